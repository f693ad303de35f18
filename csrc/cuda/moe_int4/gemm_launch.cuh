// Host launch of one GEMM instantiation (included by the generated gen/*.cu files).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/exception.h"
#include "cuda/moe_int4/gemm_kernel.cuh"

namespace pa2a::moe_int4 {

template <typename T, int kBlockM>
void launch_gemm(const GemmParams& p, int num_sms, cudaStream_t stream) {
  constexpr int smem = SmemLayout<kBlockM>::kBytes;
  auto kernel = moe_int4_gemm_kernel<T, kBlockM>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess)
    PA2A_THROW(kRuntime, "moe_int4: cannot set ", smem,
               " bytes of shared memory: ", cudaGetErrorString(err));
  int per_sm = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
  if (err != cudaSuccess || per_sm < 1) per_sm = 1;
  const int64_t grid = gemm_grid(p, num_sms, per_sm);
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess)
    PA2A_THROW(kRuntime, "moe_int4 GEMM launch failed: ", cudaGetErrorName(err), ": ",
               cudaGetErrorString(err));
}

}  // namespace pa2a::moe_int4
