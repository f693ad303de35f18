// The probe's known-answer pattern, one definition for the kernels that write it and the
// host code that checks it (the synthetic probe's Python gate pattern mirrors it).
//
// Word k of a buffer is a 32-bit mix of (seed, k), stored little endian. Every transfer of
// the gate gets its own seed (source, destination, mode), so bytes that land in the wrong
// place, a stale buffer, or a copy of another pair's data all compare wrong.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace pa2a::probe {

PA2A_HD uint32_t pattern_word(uint32_t seed, uint64_t k) {
  uint32_t x = seed ^ static_cast<uint32_t>(k * 0x9E3779B9ull);
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// Byte `i` of the pattern (little endian within each word).
PA2A_HD uint8_t pattern_byte(uint32_t seed, uint64_t i) {
  return static_cast<uint8_t>(pattern_word(seed, i / 4) >> (8 * (i % 4)));
}

}  // namespace pa2a::probe
