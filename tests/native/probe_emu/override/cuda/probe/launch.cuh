// Host stand-in for csrc/cuda/probe/launch.cuh (same function, same signature), found first
// through -iquote: the launch is checked and the grid runs now, on the model's fibers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace pa2a::probe {

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args&&... args) {
  emu_rt::launch(grid, block, smem, stream, [&] { kernel(args...); });
}

}  // namespace pa2a::probe
