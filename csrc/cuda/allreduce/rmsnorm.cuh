// Fused add + RMSNorm after the all-reduce (core/allreduce_math.h), one block of
// kNormThreads per row: pass 1 sums z^2 (z = r + residual in fp32) in the fixed order of
// the header (thread-strided vectors, then lane and warp butterflies), pass 2 recomputes z
// and writes normed and residual_out. A thread reads element i of r and of the residual
// before it writes element i of normed and residual_out, and pass 2 starts after every
// thread finished pass 1, so normed may alias r and residual_out the residual.
#pragma once

#include "cuda/allreduce/device.cuh"

namespace pa2a::ar {

__device__ __forceinline__ float butterfly(float v) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v = add_rn(v, __shfl_sync(kFullMask, v, lane ^ off));
  return v;
}

template <DType kDT>
__device__ __forceinline__ void load_z(const uint4* r, const uint4* res, int64_t i, float* z) {
  unpack8<kDT>(r[i], z);
  if (res != nullptr) {
    float q[8];
    unpack8<kDT>(res[i], q);
#pragma unroll
    for (int e = 0; e < 8; ++e) z[e] = add_rn(z[e], q[e]);
  }
}

template <DType kDT>
__device__ __forceinline__ void rmsnorm_row(const uint4* r, const uint4* res, const uint4* weight,
                                            int hidden, float eps, uint4* normed, uint4* res_out) {
  __shared__ float warp_sum[kNormWarps];
  __shared__ float inv_shared;
  const int nvec = hidden / kVecElems;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * nvec;
  float part = 0.0f, z[8];
  for (int v = static_cast<int>(threadIdx.x); v < nvec; v += kNormThreads) {
    load_z<kDT>(r, res, row + v, z);
#pragma unroll
    for (int e = 0; e < 8; ++e) part = add_rn(part, mul_rn(z[e], z[e]));
  }
  part = butterfly(part);
  const int lane = static_cast<int>(threadIdx.x & 31u), warp = static_cast<int>(threadIdx.x >> 5);
  if (lane == 0) warp_sum[warp] = part;
  __syncthreads();
  if (warp == 0) {
    const float total = butterfly(lane < kNormWarps ? warp_sum[lane] : 0.0f);
    if (lane == 0) inv_shared = rms_inv(total, hidden, eps);
  }
  __syncthreads();
  const float inv = inv_shared;
  for (int v = static_cast<int>(threadIdx.x); v < nvec; v += kNormThreads) {
    load_z<kDT>(r, res, row + v, z);
    const uint4 wv = weight[v];
    const uint32_t w[4] = {wv.x, wv.y, wv.z, wv.w};
    uint32_t q[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint16_t lo = rms_normed(z[2 * i], inv, static_cast<uint16_t>(w[i] & 0xffffu), kDT);
      const uint16_t hi = rms_normed(z[2 * i + 1], inv, static_cast<uint16_t>(w[i] >> 16), kDT);
      q[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    if (res_out != nullptr) res_out[row + v] = pack8<kDT>(z);
    normed[row + v] = make_uint4(q[0], q[1], q[2], q[3]);
  }
}

}  // namespace pa2a::ar
