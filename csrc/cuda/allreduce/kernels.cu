// The all-reduce kernels and their launchers. Protocol and invariants: core/allreduce_wire.h
// and cuda/allreduce/device.cuh; numerics: core/allreduce_math.h (shared with the CPU
// implementation, which therefore produces the same bits).
#include "core/exception.h"
#include "cuda/allreduce/kernels.cuh"
#include "cuda/allreduce/one_shot.cuh"
#include "cuda/allreduce/rmsnorm.cuh"
#include "cuda/allreduce/two_shot.cuh"
#include "cuda/transport/launch.cuh"

namespace {
// Plain launches: the all-reduce kernels do not call cudaGridDependencySynchronize, so a
// programmatic dependent launch could start them before the kernel that wrote the input.
constexpr bool kNoPdl = false;
}  // namespace

namespace pa2a::ar {
namespace {

template <DType kDT>
__global__ void __launch_bounds__(kThreads) one_shot_kernel(KernelArgs k, CallPtrs c) {
  const uint32_t seq = begin_call(k);
  one_shot_block<kDT>(k, c, seq);
  end_call(k, seq);
}

template <DType kDT>
__global__ void __launch_bounds__(kThreads) two_shot_kernel(KernelArgs k, CallPtrs c) {
  const uint32_t seq = begin_call(k);
  two_shot_block<kDT>(k, c, seq);
  end_call(k, seq);
}

__global__ void __launch_bounds__(kThreads) abort_kernel(KernelArgs k) {
  const uint32_t seq = begin_call(k);
  const int W = k.cfg.world;
  const int n = kPhases * kMaxBlocks * W;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += blockDim.x) {
    const int d = i % W, b = (i / W) % kMaxBlocks, phase = i / (W * kMaxBlocks);
    if (d != k.rank)
      pa2a::cuda::st_release_sys(flag_at(k, d, phase, seq, b, k.rank), pack_flag(seq, kAbortInfo));
  }
  // The aborted call still ends only when every peer has begun it (block 0 of kScatter, which
  // every call sends): without this wait this rank's call seq + 1 could overwrite the flags
  // and data of call seq - 1 that a slow peer has not read yet (allreduce_wire.h, "Aborts").
  wait_begun(k, seq);
  end_call(k, seq);
}

template <DType kDT>
__global__ void __launch_bounds__(kNormThreads)
    rmsnorm_kernel(const uint4* r, const uint4* residual, const uint4* weight, int32_t hidden,
                   float eps, uint4* normed, uint4* residual_out) {
  rmsnorm_row<kDT>(r, residual, weight, hidden, eps, normed, residual_out);
}

}  // namespace

void launch_all_reduce(const KernelArgs& k, Algo algo, const CallPtrs& c, cudaStream_t stream) {
  PA2A_CHECK_ARG(c.numel > 0 && c.numel % kVecElems == 0 && c.numel <= kMaxElements,
                 "numel must be a positive multiple of 8 below 2^28, got ", c.numel);
  const int64_t nvec = c.numel / kVecElems;
  const bool bf16 = k.dtype == static_cast<int32_t>(DType::kBF16);
  PA2A_CHECK_ARG(bf16 || k.dtype == static_cast<int32_t>(DType::kFP16),
                 "dtype must be bfloat16 or float16");
  const dim3 block(kThreads);
  if (algo == Algo::kOneShot) {
    const dim3 grid(static_cast<unsigned>(one_shot_blocks(nvec)));
    if (bf16)
      pa2a::cuda::launch_kernel(one_shot_kernel<DType::kBF16>, grid, block, 0, stream, kNoPdl, k,
                                c);
    else
      pa2a::cuda::launch_kernel(one_shot_kernel<DType::kFP16>, grid, block, 0, stream, kNoPdl, k,
                                c);
  } else {
    PA2A_CHECK_ARG(algo == Algo::kTwoShot, "algo must be one-shot (1) or two-shot (2)");
    const dim3 grid(static_cast<unsigned>(two_shot_blocks(nvec, k.cfg.world)));
    if (bf16)
      pa2a::cuda::launch_kernel(two_shot_kernel<DType::kBF16>, grid, block, 0, stream, kNoPdl, k,
                                c);
    else
      pa2a::cuda::launch_kernel(two_shot_kernel<DType::kFP16>, grid, block, 0, stream, kNoPdl, k,
                                c);
  }
}

void launch_abort(const KernelArgs& k, cudaStream_t stream) {
  pa2a::cuda::launch_kernel(abort_kernel, dim3(1), dim3(kThreads), 0, stream, kNoPdl, k);
}

void launch_rmsnorm(DType dtype, const void* r, const void* residual, const void* weight,
                    int64_t rows, int32_t hidden, float eps, void* normed, void* residual_out,
                    cudaStream_t stream) {
  PA2A_CHECK_ARG(hidden > 0 && hidden % kVecElems == 0,
                 "hidden must be a positive multiple of 8, got ", hidden);
  PA2A_CHECK_ARG(rows >= 0 && rows <= 0x7fffffff, "rows must be in [0, 2^31), got ", rows);
  if (rows == 0) return;
  const auto* rv = static_cast<const uint4*>(r);
  const auto* res = static_cast<const uint4*>(residual);
  const auto* w = static_cast<const uint4*>(weight);
  auto* nv = static_cast<uint4*>(normed);
  auto* ro = static_cast<uint4*>(residual_out);
  const dim3 grid(static_cast<unsigned>(rows)), block(kNormThreads);
  if (dtype == DType::kBF16)
    pa2a::cuda::launch_kernel(rmsnorm_kernel<DType::kBF16>, grid, block, 0, stream, kNoPdl, rv, res,
                              w, hidden, eps, nv, ro);
  else if (dtype == DType::kFP16)
    pa2a::cuda::launch_kernel(rmsnorm_kernel<DType::kFP16>, grid, block, 0, stream, kNoPdl, rv, res,
                              w, hidden, eps, nv, ro);
  else
    PA2A_THROW(kValue, "dtype must be bfloat16 or float16");
}

}  // namespace pa2a::ar
