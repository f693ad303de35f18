// Numerics of the all-reduce, shared by the CPU implementation and the CUDA kernels.
//
// Tensor-parallel ranks must agree to the last bit, or their replicated activations drift
// apart layer after layer. So every element is summed in fp32 in one fixed order, rank 0
// first, rank W - 1 last, with separately rounded IEEE additions (no FMA, no reassociation:
// the host builds with -ffp-contract=off, the kernels use __fadd_rn/__fmul_rn), and
// rounded once to the dtype. One-shot and two-shot compute exactly these operations, so
// they agree with each other and with the CPU oracle bit for bit.
//
// Fused residual add: out = dtype(float(dtype(sum)) + float(residual)): the same bits as
// the unfused all_reduce(x) followed by x + residual in torch (which adds bf16/fp16 in fp32
// and rounds), so switching fusion on changes no result.
//
// Fused add + RMSNorm (vLLM's / SGLang's fused_add_rms_norm after the all-reduce), per row
// of `hidden` elements: z = float(r) + float(residual) (fp32, not rounded), residual_out =
// dtype(z), normed = dtype(float(dtype(z * inv)) * float(weight)), inv = 1 / sqrt(mean(z^2)
// + eps). The mean's order is fixed so that host and device agree exactly: kNormThreads
// threads, thread t summing z^2 over vectors t, t + kNormThreads, ... (8 elements each, in
// order); then a butterfly over the 32 lanes of each warp (xor 16, 8, 4, 2, 1) and the same
// butterfly over the warp sums (lanes 0..7, zeros above). sqrt and the division are
// IEEE-exact on both sides.
#pragma once

#include <cstdint>

#include "core/host_device.h"
#include "core/numeric.h"

#if !defined(__CUDACC__)
#include <cmath>
#endif

namespace pa2a::ar {

constexpr int kVecElems = 8;  // 16-bit elements per 16-byte vector
constexpr int kNormThreads = 256;
constexpr int kNormWarps = kNormThreads / 32;

PA2A_HD float to_f(uint16_t h, DType dt) {
  return dt == DType::kBF16 ? bf16_to_float(h) : fp16_to_float(h);
}
PA2A_HD uint16_t from_f(float v, DType dt) {
  return dt == DType::kBF16 ? float_to_bf16(v) : float_to_fp16(v);
}

PA2A_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
PA2A_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// The all-reduce result of one element from its fp32 sum, with the optional residual.
PA2A_HD uint16_t finish(float sum, bool has_residual, uint16_t residual, DType dt) {
  const uint16_t r = from_f(sum, dt);
  return has_residual ? from_f(add_rn(to_f(r, dt), to_f(residual, dt)), dt) : r;
}

// 1 / sqrt(sum_sq / hidden + eps), IEEE-exact.
PA2A_HD float rms_inv(float sum_sq, int hidden, float eps) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, static_cast<float>(hidden)), eps)));
#else
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
#endif
}

PA2A_HD uint16_t rms_normed(float z, float inv, uint16_t weight, DType dt) {
  return from_f(mul_rn(to_f(from_f(mul_rn(z, inv), dt), dt), to_f(weight, dt)), dt);
}

// Host: the butterfly of 32 lane values (the device's __shfl_xor pattern); returns lane 0.
inline float butterfly32(float* v) {
  for (int off = 16; off >= 1; off /= 2) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = v[l] + v[l ^ off];
    for (int l = 0; l < 32; ++l) v[l] = next[l];
  }
  return v[0];
}

// Host: the fixed-order sum of z^2 over one row of `hidden` fp32 values (see the top
// comment), exactly what the CUDA norm kernel computes.
inline float norm_sum_sq(const float* z, int hidden) {
  float part[kNormThreads] = {};
  const int nvec = hidden / kVecElems;
  for (int t = 0; t < kNormThreads; ++t)
    for (int v = t; v < nvec; v += kNormThreads)
      for (int e = 0; e < kVecElems; ++e) {
        const float q = z[v * kVecElems + e];
        part[t] = part[t] + q * q;
      }
  float warps[32] = {};
  for (int w = 0; w < kNormWarps; ++w) warps[w] = butterfly32(part + 32 * w);
  return butterfly32(warps);
}

}  // namespace pa2a::ar
