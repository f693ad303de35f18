// Scalar formats shared by the CPU transport and the kernels: bf16, fp16, fp8 e4m3fn,
// and the per-128-channel fp8 group quantisation used for the dispatch payload.
//
// Conversions are written on the bit patterns so that host and device produce the same
// bytes (round to nearest even everywhere). The fp8 encoder saturates at +-448 instead
// of producing NaN: a saturated value is a bounded error, a NaN poisons an expert's
// whole output row. For |v| <= 448 it equals torch's float8_e4m3fn cast bit for bit
// (tests/test_numeric.py checks every float of a dense sweep).
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
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
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
  float v;
  if (e == 0) {
    v = static_cast<float>(m) * (1.0f / 512.0f);
  } else if (e == 15 && m == 7) {
    v = bits_float(0x7fc00000u);
  } else {
    v = bits_float(((e + 120u) << 23) | (m << 20));
  }
  return (b & 0x80u) ? -v : v;
}

PA2A_HD uint8_t float_to_fp8_e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);   // NaN stays NaN
  if (a >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // >= 448: saturate
  if (a < 0x3c800000u) {
    // below the smallest normal 2^-6: subnormal grid of 2^-9, round half to even
    const uint32_t exp = a >> 23;
    if (exp < 117) return sign;  // below a quarter of the grid step: rounds to zero
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 141u - exp;  // value * 2^9 = mant * 2^(exp - 150 + 9)
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint8_t>(sign | q);
  }
  uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  uint32_t q = (r >> 20) - (120u << 3);
  if (q > 0x7eu) q = 0x7eu;
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

// Quantise one group of kFp8GroupSize 16-bit values; returns the scale. The scale is
// amax / 448 (amax floored at 1e-10 so an all-zero group stays finite), and each value is
// encoded as e4m3(v / scale): the same arithmetic as the torch reference
// pcie_a2a.reference.quantize_fp8.
PA2A_HD float quantize_fp8_group(const uint16_t* src, DType dt, uint8_t* dst) {
  float amax = 0.0f;
  for (int i = 0; i < kFp8GroupSize; ++i) {
    float v = dt == DType::kBF16 ? bf16_to_float(src[i]) : fp16_to_float(src[i]);
    v = v < 0 ? -v : v;
    amax = v > amax ? v : amax;
  }
  const float scale = (amax > 1e-10f ? amax : 1e-10f) / kFp8Max;
  for (int i = 0; i < kFp8GroupSize; ++i) {
    const float v = dt == DType::kBF16 ? bf16_to_float(src[i]) : fp16_to_float(src[i]);
    dst[i] = float_to_fp8_e4m3(v / scale);
  }
  return scale;
}

}  // namespace pa2a
