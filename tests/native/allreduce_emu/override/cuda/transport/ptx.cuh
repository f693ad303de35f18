// Host stand-in for csrc/cuda/transport/ptx.cuh, found first through -iquote by the
// all-reduce emulation build: the execution model's PTX primitives (tests/native/emu), with
// the acquire delay the ownership scenarios set (main.cpp).
#pragma once

#include "emu_ptx.h"
