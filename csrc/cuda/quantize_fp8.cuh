// fp8 dispatch payload on the device: one warp quantises one row, group by group.
//
// The arithmetic is core/numeric.h's quantize_fp8_group, shared with the CPU transport,
// so the bytes a GPU sender writes equal the bytes the CPU oracle writes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/numeric.h"

namespace pa2a::cuda {

// x: [rows, hidden] bf16/fp16 bits; q: [rows, hidden] e4m3; scales: [rows, hidden / 128].
void launch_quantize_fp8(const uint16_t* x, DType dtype, int64_t rows, int32_t hidden, uint8_t* q,
                         float* scales, cudaStream_t stream);

void launch_dequantize_fp8(const uint8_t* q, const float* scales, int64_t rows, int32_t hidden,
                           DType out_dtype, uint16_t* out, cudaStream_t stream);

}  // namespace pa2a::cuda
