// INT4 MoE: the launch sequence. The schedule and finalize kernels live in schedule.cuh,
// the argument checks in validate.h, the GEMM template in gemm_kernel.cuh (its launch in
// gemm_launch.cuh, instantiated in gen/ by scripts/generate_moe_int4_kernels.py from a
// pruned list).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/exception.h"
#include "cuda/moe_int4/gemm_kernel.cuh"
#include "cuda/moe_int4/moe_int4.cuh"
#include "cuda/moe_int4/schedule.cuh"
#include "cuda/moe_int4/validate.h"

namespace pa2a::moe_int4 {

#include "cuda/moe_int4/gen/instantiations.inc"

namespace {

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    PA2A_THROW(kRuntime, "moe_int4 ", what, " launch failed: ", cudaGetErrorName(err), ": ",
               cudaGetErrorString(err));
}

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    PA2A_THROW(kRuntime, "moe_int4: ", what, ": ", cudaGetErrorName(err), ": ",
               cudaGetErrorString(err));
}

template <typename T>
void run_typed(const MoeInt4Args& a, int num_sms, cudaStream_t stream) {
  const GemmParams g1 = gate_up_params(a);
  const GemmParams g2 = down_params(a);

  auto gemm = [&](const GemmParams& p) {
    if (a.block_m == 16) {
      launch_gemm<T, 16>(p, num_sms, stream);
    } else {
      launch_gemm<T, 64>(p, num_sms, stream);
    }
  };
  gemm(g1);
  if (!a.expert_major) {
    check_cuda(cudaMemsetAsync(reinterpret_cast<void*>(a.acc), 0,
                               static_cast<size_t>(a.num_rows) * a.hidden * sizeof(float), stream),
               "zeroing the fp32 row accumulator");
  }
  gemm(g2);
  if (!a.expert_major) {
    const int64_t n = a.num_rows * a.hidden;
    const int64_t blocks = (n + 255) / 256 < 4L * num_sms ? (n + 255) / 256 : 4L * num_sms;
    finalize_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        reinterpret_cast<const float*>(a.acc), reinterpret_cast<T*>(a.out), n);
    check_launch("finalize");
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
    ~DeviceGuard() { (void)cudaSetDevice(prev); }
  } guard{prev_device};
  check_cuda(cudaSetDevice(a.device), "cudaSetDevice");
  int num_sms = 0, smem_optin = 0;
  check_cuda(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, a.device),
             "querying the SM count");
  check_cuda(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, a.device),
             "querying the shared memory per block");
  const int smem = gemm_smem_bytes(a.block_m);
  PA2A_CHECK_ARG(smem <= smem_optin, "moe_int4: block_m=", a.block_m, " needs ", smem,
                 " bytes of shared memory per block; this device allows ", smem_optin,
                 "; use block_m=16");
  const auto stream = reinterpret_cast<cudaStream_t>(a.stream);
  if (pairs == 0) return;  // nothing routed here; expert-major output stays as given

  if (a.expert_major) {
    schedule_expert_major_kernel<<<1, kScheduleThreads, 0, stream>>>(
        reinterpret_cast<const int32_t*>(a.counts), a.capacity, a.num_experts, a.block_m,
        reinterpret_cast<int32_t*>(a.pair_src), reinterpret_cast<float*>(a.pair_w),
        reinterpret_cast<int32_t*>(a.tiles), reinterpret_cast<int32_t*>(a.status), a.max_tiles);
  } else {
    schedule_rows_kernel<<<1, kScheduleThreads, 0, stream>>>(
        reinterpret_cast<const int32_t*>(a.topk_ids),
        reinterpret_cast<const float*>(a.topk_weights), a.num_rows, a.num_topk, a.num_experts,
        a.block_m, reinterpret_cast<int32_t*>(a.pair_src), reinterpret_cast<float*>(a.pair_w),
        reinterpret_cast<int32_t*>(a.tiles), reinterpret_cast<int32_t*>(a.status), a.max_tiles);
  }
  check_launch("schedule");
  if (a.dtype == 0) {
    run_typed<__nv_bfloat16>(a, num_sms, stream);
  } else {
    run_typed<__half>(a, num_sms, stream);
  }
}

}  // namespace pa2a::moe_int4
