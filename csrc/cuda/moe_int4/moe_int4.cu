// INT4 MoE: the launch sequence. The schedule and permute kernels live in schedule.cuh,
// the argument checks in validate.h, the GEMM template in gemm_kernel.cuh (its launch in
// gemm_launch.cuh, instantiated in gen/ by scripts/generate_moe_int4_kernels.py).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <mutex>

#include "core/exception.h"
#include "cuda/moe_int4/gemm_kernel.cuh"
#include "cuda/moe_int4/gemm_launch.cuh"
#include "cuda/moe_int4/moe_int4.cuh"
#include "cuda/moe_int4/schedule.cuh"
#include "cuda/moe_int4/validate.h"

namespace pa2a::moe_int4 {

#include "cuda/moe_int4/gen/instantiations.inc"

namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    PA2A_THROW(kRuntime, "moe_int4: ", what, ": ", cudaGetErrorName(err), ": ",
               cudaGetErrorString(err));
}

struct DeviceInfo {
  int num_sms = 0, smem_optin = 0, major = 0, l2_bytes = 0;
};

// Device attributes, queried once per device (they cannot change while the process runs).
DeviceInfo device_info(int device) {
  static std::mutex mu;
  static std::array<DeviceInfo, kMaxDevices> cache{};
  PA2A_CHECK_ARG(device >= 0 && device < kMaxDevices, "moe_int4: device=", device, "; allowed: 0..",
                 kMaxDevices - 1);
  std::lock_guard<std::mutex> lock(mu);
  DeviceInfo& d = cache[device];
  if (d.num_sms == 0) {
    check_cuda(
        cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "querying the shared memory per block");
    check_cuda(cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device),
               "querying the compute capability");
    check_cuda(cudaDeviceGetAttribute(&d.num_sms, cudaDevAttrMultiProcessorCount, device),
               "querying the SM count");
    check_cuda(cudaDeviceGetAttribute(&d.l2_bytes, cudaDevAttrL2CacheSize, device),
               "querying the L2 size");
  }
  return d;
}

// One GEMM launch: the instantiation for the operand's variant (gemm_variant).
template <typename T, int kBlockM>
void gemm_m(const GemmParams& p, const LaunchContext& ctx) {
  const GemmVariant v = gemm_variant(p, kBlockM);
  if constexpr (kBlockM != 16) {  // no zero-point instantiation (check_args refuses it)
    if (v.group32) {
      launch_gemm<T, kBlockM, false, true>(p, ctx);
    } else {
      launch_gemm<T, kBlockM, false, false>(p, ctx);
    }
  } else if (v.zeros) {
    if (v.group32) {
      launch_gemm<T, kBlockM, true, true>(p, ctx);
    } else {
      launch_gemm<T, kBlockM, true, false>(p, ctx);
    }
  } else if (v.group32) {
    launch_gemm<T, kBlockM, false, true>(p, ctx);
  } else {
    launch_gemm<T, kBlockM, false, false>(p, ctx);
  }
}

template <typename T>
void run_typed(const MoeInt4Args& a, const LaunchContext& ctx) {
  if (a.x_perm != 0) {
    const int64_t grid = a.max_tiles < 4L * ctx.num_sms ? a.max_tiles : 4L * ctx.num_sms;
    launch_kernel("permute", permute_rows_kernel<T>, grid, 256, 0, ctx,
                  reinterpret_cast<const T*>(a.x), static_cast<int64_t>(a.hidden),
                  reinterpret_cast<const int32_t*>(a.x_perm), a.w13_k_pad,
                  reinterpret_cast<const int32_t*>(a.tiles),
                  reinterpret_cast<const int32_t*>(a.status), a.max_tiles,
                  reinterpret_cast<const int32_t*>(a.pair_src), reinterpret_cast<T*>(a.x_perm_buf));
  }
  GemmParams g1 = gate_up_params(a);
  g1.prefetch_max_bytes = ctx.l2_bytes / 2;  // room for the down weights and what else runs
  for (const GemmParams& p : {g1, down_params(a)}) {
    if (a.block_m == 16) {
      gemm_m<T, 16>(p, ctx);
    } else {
      gemm_m<T, 64>(p, ctx);
    }
  }
}

}  // namespace

int gemm_smem_bytes(int block_m) {
  return block_m == 16 ? SmemLayout<16>::kBytes : SmemLayout<64>::kBytes;
}

void moe_int4_run(const MoeInt4Args& a) {
  const int64_t pairs = check_args(a);

  // Switch to the tensors' device for the launches and restore the caller's device after
  // (torch reads the current device from the runtime; changing it would leak into it).
  int prev_device = 0;
  check_cuda(cudaGetDevice(&prev_device), "cudaGetDevice");
  struct DeviceGuard {
    int prev;
    bool restore;
    ~DeviceGuard() {
      if (restore) (void)cudaSetDevice(prev);
    }
  } guard{prev_device, prev_device != a.device};
  if (guard.restore) check_cuda(cudaSetDevice(a.device), "cudaSetDevice");
  const DeviceInfo dev = device_info(a.device);
  const int smem = gemm_smem_bytes(a.block_m);
  PA2A_CHECK_ARG(smem <= dev.smem_optin, "moe_int4: block_m=", a.block_m, " needs ", smem,
                 " bytes of shared memory per block; this device allows ", dev.smem_optin,
                 "; use block_m=16");
  if (pairs == 0) return;  // nothing routed here; the output stays as given
  LaunchContext ctx;
  ctx.device = a.device;
  ctx.num_sms = dev.num_sms;
  ctx.pdl = dev.major >= 9;
  ctx.l2_bytes = dev.l2_bytes;
  ctx.stream = reinterpret_cast<cudaStream_t>(a.stream);

  auto* status = reinterpret_cast<int32_t*>(a.status);
  auto* errors = reinterpret_cast<int32_t*>(a.errors);
  if (a.expert_major) {
    launch_kernel("schedule", schedule_expert_major_kernel, 1, kScheduleThreads, 0, ctx,
                  reinterpret_cast<const int32_t*>(a.counts), a.capacity, a.num_experts, a.block_m,
                  reinterpret_cast<int32_t*>(a.pair_src), reinterpret_cast<float*>(a.pair_w),
                  reinterpret_cast<int32_t*>(a.tiles), status, a.max_tiles, errors);
  } else {
    launch_kernel("schedule", schedule_rows_kernel, 1, kScheduleThreads, 0, ctx,
                  reinterpret_cast<const int32_t*>(a.topk_ids),
                  reinterpret_cast<const float*>(a.topk_weights), a.num_rows, a.num_topk,
                  a.num_experts, a.block_m, reinterpret_cast<int32_t*>(a.pair_src),
                  reinterpret_cast<float*>(a.pair_w), reinterpret_cast<int32_t*>(a.tiles), status,
                  a.max_tiles, reinterpret_cast<int32_t*>(a.row_pairs),
                  reinterpret_cast<int32_t*>(a.active_rows), errors);
  }
  if (a.dtype == 0) {
    run_typed<__nv_bfloat16>(a, ctx);
  } else {
    run_typed<__half>(a, ctx);
  }
}

}  // namespace pa2a::moe_int4
