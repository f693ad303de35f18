// Host launch of the INT4 MoE kernels: cached per-device attributes (the occupancy query
// and cudaFuncSetAttribute run once per kernel and device, not per call) and programmatic
// dependent launch on sm_90 and newer. Included by the generated gen/*.cu files (one GEMM
// instantiation each) and by moe_int4.cu.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <utility>

#include "core/exception.h"
#include "cuda/moe_int4/gemm_kernel.cuh"

namespace pa2a::moe_int4 {

constexpr int kMaxDevices = 64;

// Launch with the programmatic stream serialization attribute where the device has it: the
// kernel's CTAs may start while the previous kernel of the stream finishes and wait in
// grid_dependency_wait() (every kernel here calls it before reading anything).
template <typename... Params, typename... Args>
void launch_kernel(const char* what, void (*kernel)(Params...), int64_t grid, int threads, int smem,
                   const LaunchContext& ctx, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = ctx.stream;
  cudaLaunchAttribute attr[1];
  if (ctx.pdl) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess)
    PA2A_THROW(kRuntime, "moe_int4 ", what, " launch failed: ", cudaGetErrorName(err), ": ",
               cudaGetErrorString(err));
}

// CTAs per SM of one kernel on one device, set up once (max dynamic shared memory, the
// shared-memory carveout, the occupancy query).
class KernelSlots {
 public:
  template <typename Kernel>
  int get(Kernel kernel, int device, int threads, int smem) {
    PA2A_CHECK_ARG(device >= 0 && device < kMaxDevices, "moe_int4: device=", device,
                   "; allowed: 0..", kMaxDevices - 1);
    std::lock_guard<std::mutex> lock(mu_);
    if (per_sm_[device] > 0) return per_sm_[device];
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess)
      PA2A_THROW(kRuntime, "moe_int4: cannot set ", smem,
                 " bytes of shared memory: ", cudaGetErrorString(err));
    // Ask for the largest carveout: the GEMM's occupancy is bounded by shared memory.
    (void)cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
    int n = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem);
    per_sm_[device] = (err == cudaSuccess && n >= 1) ? n : 1;
    (void)cudaGetLastError();  // a failed optional query must not poison the next check
    return per_sm_[device];
  }

 private:
  std::mutex mu_;
  std::array<int, kMaxDevices> per_sm_{};
};

template <typename T, int kBlockM, bool kZeros, bool kGroup32>
void launch_gemm(const GemmParams& p, const LaunchContext& ctx) {
  constexpr int smem = SmemLayout<kBlockM>::kBytes;
  auto kernel = moe_int4_gemm_kernel<T, kBlockM, kZeros, kGroup32>;
  static KernelSlots slots;
  const int per_sm = slots.get(kernel, ctx.device, kThreads, smem);
  launch_kernel("GEMM", kernel, gemm_grid(p, ctx.num_sms, per_sm), kThreads, smem, ctx, p);
}

}  // namespace pa2a::moe_int4
