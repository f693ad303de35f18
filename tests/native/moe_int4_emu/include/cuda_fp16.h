// Host emulation stand-in for <cuda_fp16.h>: see emu_cuda.h.
#pragma once
#include "emu_cuda.h"
