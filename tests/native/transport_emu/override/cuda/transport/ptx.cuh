// Host stand-in for csrc/cuda/transport/ptx.cuh, found first through -iquote by the
// emulation build: the execution model's PTX primitives (tests/native/emu), with the
// transport's staged gate hooked into them.
#pragma once

#define EMU_PTX_HOOKS 1
#include "emu_staged_gate.h"  // the hooks, declared before the model that calls them

#include "emu_ptx.h"
