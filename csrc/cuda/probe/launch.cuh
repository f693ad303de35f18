// How the probe's launchers start a kernel: `kernel<<<grid, block, smem, stream>>>(args...)`,
// in one function so that the probe's CPU emulation can replace this header
// with its own version (same name and signature) that runs the grid on fibers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace pa2a::probe {

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args&&... args) {
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
}

}  // namespace pa2a::probe
