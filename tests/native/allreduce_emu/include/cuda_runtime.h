// Host emulation stand-in for <cuda_runtime.h>: the execution model (emu_cuda.h) and the
// fake runtime (emu_runtime.h), both in tests/native/emu.
#pragma once
#include "emu_cuda.h"
#include "emu_runtime.h"
