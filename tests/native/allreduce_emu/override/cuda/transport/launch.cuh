// Host stand-in for csrc/cuda/transport/launch.cuh (same function, same signature), found
// first through -iquote by the all-reduce emulation build: the launch is checked and the
// grid runs now, in this process, on the execution model's fibers (tests/native/emu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace pa2a::cuda {

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, bool pdl, Args&&... args) {
  (void)pdl;  // the model runs one grid at a time: there is no overlap to allow or forbid
  emu_rt::launch(grid, block, smem, stream, [&] { kernel(args...); });
}

}  // namespace pa2a::cuda
