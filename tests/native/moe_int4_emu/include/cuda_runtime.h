// Host emulation stand-in for <cuda_runtime.h>: see emu_cuda.h.
#pragma once
#include "emu_cuda.h"
