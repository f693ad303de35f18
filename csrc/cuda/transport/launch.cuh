// How the launchers of kernels.cu start a kernel: exactly
// `kernel<<<grid, block, smem, stream>>>(args...)`. One function instead of the chevrons
// at every call site so that the CPU emulation of the kernels (tests/native/transport_emu)
// can run the real launchers with its own version of this header (same name, same
// signature), which runs the grid on fibers in the calling process.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace pa2a::cuda {

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args&&... args) {
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
}

}  // namespace pa2a::cuda
