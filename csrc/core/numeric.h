// Scalar formats shared by the CPU transport and the kernels: bf16, fp16, fp8 e4m3fn,
// and the per-128-channel fp8 group quantisation used for the dispatch payload.
//
// Conversions are written on the bit patterns so that host and device produce the same
// bytes (round to nearest even everywhere). The fp8 encoder saturates at +-448 instead
// of producing NaN: a saturated value is a bounded error, a NaN poisons an expert's
// whole output row. For |v| <= 448 it equals torch's float8_e4m3fn cast bit for bit
// (checked on every float of a dense sweep).
#pragma once

#include <cstdint>
#include <cstring>

#include "core/host_device.h"

#if !defined(__CUDACC__)
#include <cmath>
#endif

namespace pa2a {

enum class DType : int32_t { kBF16 = 0, kFP16 = 1, kFP32 = 2, kFP8E4M3 = 3 };

// Payload of one dispatch row on the wire.
enum class Payload : int32_t { kBF16 = 0, kFP16 = 1, kFP8 = 2 };

constexpr int kFp8GroupSize = 128;  // channels per fp32 scale (DeepEP's convention)
constexpr float kFp8Max = 448.0f;

PA2A_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
PA2A_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ---- bf16 ------------------------------------------------------------------------------
PA2A_HD float bf16_to_float(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

PA2A_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// ---- fp16 ------------------------------------------------------------------------------
PA2A_HD float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // subnormal: value = mant * 2^-24
    float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

PA2A_HD uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (a < 0x38800000u) {
    // result is subnormal (or zero): units of 2^-24, round half to even
    const uint32_t exp = a >> 23;
    if (exp < 102) return sign;  // below half of the smallest subnormal
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // 14..24
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((r >> 13) - (112u << 10)));
}

// ---- fp8 e4m3fn --------------------------------------------------------------------------
PA2A_HD float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t e = (b >> 3) & 0xfu;
  const uint32_t m = b & 7u;
  const float subnormal = static_cast<float>(static_cast<int32_t>(m)) * (1.0f / 512.0f);
  const uint32_t bits = e == 0 ? float_bits(subnormal) : ((e + 120u) << 23) | (m << 20);
  const uint32_t magnitude = (e == 15 && m == 7) ? 0x7fc00000u : bits;
  return bits_float(magnitude | (static_cast<uint32_t>(b & 0x80u) << 24));
}

// Written as selects rather than early returns so that the host compiler vectorises the
// loops over a row (the CPU transport quantises every dispatched row).
PA2A_HD uint8_t float_to_fp8_e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal results (|f| >= 2^-6): round the mantissa to 3 bits, half to even, rebias.
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  uint32_t normal = (r >> 20) - (120u << 3);
  normal = normal > 0x7eu ? 0x7eu : normal;
  // Subnormal results: |f| * 2^9 is exact (a power-of-two scaling) and adding 2^23 rounds
  // it to an integer, half to even, in the default rounding mode.
  // (Adding 2^23 leaves the integer in the low mantissa bits: read it from there.)
  const float scaled = bits_float(a) * 512.0f;
  const uint32_t sub = float_bits(scaled + 8388608.0f) - 0x4b000000u;
  uint32_t q = a < 0x3c800000u ? sub : normal;
  q = a >= 0x43e00000u ? 0x7eu : q;  // >= 448: saturate
  q = a > 0x7f800000u ? 0x7fu : q;   // NaN stays NaN
  return static_cast<uint8_t>(sign | q);
}

// ---- element access by dtype -------------------------------------------------------------
PA2A_HD float load_as_float(const void* base, size_t i, DType dt) {
  switch (dt) {
    case DType::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFP16:
      return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFP32:
      return static_cast<const float*>(base)[i];
    default:
      return fp8_e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
  }
}

PA2A_HD uint16_t float_to_half_bits(float v, DType dt) {
  return dt == DType::kBF16 ? float_to_bf16(v) : float_to_fp16(v);
}

// Row helpers with the dtype switch outside the loop, so the host compiler vectorises them.
PA2A_HD void accumulate_row(float* acc, const uint16_t* row, float weight, int n, DType dt) {
  if (dt == DType::kBF16) {
    for (int i = 0; i < n; ++i) acc[i] += weight * bf16_to_float(row[i]);
  } else {
    for (int i = 0; i < n; ++i) acc[i] += weight * fp16_to_float(row[i]);
  }
}

PA2A_HD void float_row_to_half(const float* src, int n, DType dt, uint16_t* out) {
  if (dt == DType::kBF16) {
    for (int i = 0; i < n; ++i) out[i] = float_to_bf16(src[i]);
  } else {
    for (int i = 0; i < n; ++i) out[i] = float_to_fp16(src[i]);
  }
}

// Dequantise one row of fp8 payload (hidden values, one scale per 128) into 16-bit values.
PA2A_HD void dequantize_fp8_row(const uint8_t* q, const float* scales, int hidden, DType dt,
                                uint16_t* out) {
  for (int g = 0; g < hidden / kFp8GroupSize; ++g) {
    const float s = scales[g];
    const uint8_t* qg = q + g * kFp8GroupSize;
    uint16_t* og = out + g * kFp8GroupSize;
    if (dt == DType::kBF16) {
      for (int i = 0; i < kFp8GroupSize; ++i) og[i] = float_to_bf16(fp8_e4m3_to_float(qg[i]) * s);
    } else {
      for (int i = 0; i < kFp8GroupSize; ++i) og[i] = float_to_fp16(fp8_e4m3_to_float(qg[i]) * s);
    }
  }
}

// Quantise one group of kFp8GroupSize 16-bit values; returns the scale. The scale is
// amax / 448 (amax floored at 1e-10 so an all-zero group stays finite), and each value is
// encoded as e4m3(v / scale): the same arithmetic as the torch reference
// pcie_a2a.reference.quantize_fp8.
PA2A_HD float quantize_fp8_group(const uint16_t* src, DType dt, uint8_t* dst) {
  float v[kFp8GroupSize];
  if (dt == DType::kBF16) {
    for (int i = 0; i < kFp8GroupSize; ++i) v[i] = bf16_to_float(src[i]);
  } else {
    for (int i = 0; i < kFp8GroupSize; ++i) v[i] = fp16_to_float(src[i]);
  }
  // |v| compared as integers: for non-negative floats the bit patterns sort like the
  // values (a NaN sorts above infinity, so it propagates as torch's amax does), and an
  // integer max reduction vectorises where a float one may not.
  uint32_t amax_bits = 0;
  for (int i = 0; i < kFp8GroupSize; ++i) {
    const uint32_t m = float_bits(v[i]) & 0x7fffffffu;
    amax_bits = m > amax_bits ? m : amax_bits;
  }
  const float amax = bits_float(amax_bits);
  const float scale = (amax > 1e-10f ? amax : 1e-10f) / kFp8Max;
  for (int i = 0; i < kFp8GroupSize; ++i) dst[i] = float_to_fp8_e4m3(v[i] / scale);
  return scale;
}

}  // namespace pa2a
