// Launchers of the all-reduce kernels (definitions in kernels.cu). Torch-free: raw device
// pointers, sizes and a stream; every launcher only enqueues (no host synchronisation), so
// every call can be captured in a CUDA graph.
//
//   one_shot   grid one_shot_blocks(nvec) x kThreads   (one_shot.cuh)
//   two_shot   grid two_shot_blocks(nvec, W) x kThreads (two_shot.cuh)
//   abort      1 block: kAbortInfo flags of the next call into every peer, for every phase
//              and block; advances the call number like any call
//   rmsnorm    one block of kNormThreads per row        (rmsnorm.cuh)
#pragma once

#include <cuda_runtime.h>

#include "cuda/allreduce/device.cuh"

namespace pa2a::ar {

// x, residual (may be null), out: 16-byte aligned, numel a positive multiple of 8.
void launch_all_reduce(const KernelArgs& k, Algo algo, const CallPtrs& c, cudaStream_t stream);
void launch_abort(const KernelArgs& k, cudaStream_t stream);
// r, residual (may be null), weight [hidden], normed, residual_out (may be null): rows x
// hidden elements of `dtype`, 16-byte aligned.
void launch_rmsnorm(DType dtype, const void* r, const void* residual, const void* weight,
                    int64_t rows, int32_t hidden, float eps, void* normed, void* residual_out,
                    cudaStream_t stream);

}  // namespace pa2a::ar
