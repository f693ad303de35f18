// How the launchers of the kernels_*.cu files start a kernel: one function instead of the
// chevrons at every call site so that the CPU emulation of the kernels
// can run the real launchers with its own version of this
// header (same name, same signature), which runs the grid on fibers in the calling process.
//
// pdl: programmatic dependent launch (cudaLaunchAttributeProgrammaticStreamSerialization,
// sm_90 and newer; the caller decides from the device). The kernel may then be scheduled
// while the previous kernel of the stream is still running; every transport kernel calls
// griddep_wait() (common/ptx.cuh) before it touches memory, so only the launch latency overlaps.
// pdl false: exactly `kernel<<<grid, block, smem, stream>>>(args...)`.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace pa2a::cuda {

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, bool pdl, Args&&... args) {
  if (!pdl) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  // A failed launch is also the thread's last error: the caller's check_launch reports it.
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace pa2a::cuda
