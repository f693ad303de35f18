// Host stand-in for csrc/cuda/transport/ptx.cuh, found first through -iquote by the
// emulation build: the execution model's PTX primitives (tests/native/emu).
#pragma once

#include "emu_ptx.h"
