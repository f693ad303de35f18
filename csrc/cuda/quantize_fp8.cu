#include "cuda/quantize_fp8.cuh"

namespace pa2a::cuda {
namespace {

// One thread per 128-channel group: the group is quantised exactly as on the host.
__global__ void quantize_fp8_kernel(const uint16_t* __restrict__ x, DType dtype, int64_t groups,
                                    uint8_t* __restrict__ q, float* __restrict__ scales) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  scales[g] = quantize_fp8_group(x + g * kFp8GroupSize, dtype, q + g * kFp8GroupSize);
}

__global__ void dequantize_fp8_kernel(const uint8_t* __restrict__ q,
                                      const float* __restrict__ scales, int64_t n, DType out_dtype,
                                      uint16_t* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = fp8_e4m3_to_float(q[i]) * scales[i / kFp8GroupSize];
  out[i] = float_to_half_bits(v, out_dtype);
}

}  // namespace

void launch_quantize_fp8(const uint16_t* x, DType dtype, int64_t rows, int32_t hidden, uint8_t* q,
                         float* scales, cudaStream_t stream) {
  const int64_t groups = rows * (hidden / kFp8GroupSize);
  if (groups == 0) return;
  const int threads = 128;
  const auto blocks = static_cast<unsigned>((groups + threads - 1) / threads);
  quantize_fp8_kernel<<<blocks, threads, 0, stream>>>(x, dtype, groups, q, scales);
}

void launch_dequantize_fp8(const uint8_t* q, const float* scales, int64_t rows, int32_t hidden,
                           DType out_dtype, uint16_t* out, cudaStream_t stream) {
  const int64_t n = rows * hidden;
  if (n == 0) return;
  const int threads = 256;
  const auto blocks = static_cast<unsigned>((n + threads - 1) / threads);
  dequantize_fp8_kernel<<<blocks, threads, 0, stream>>>(q, scales, n, out_dtype, out);
}

}  // namespace pa2a::cuda
