// Host stand-in for csrc/cuda/probe/ptx.cuh (same functions, same signatures): GCC atomics
// with the PTX orderings (acquire, relaxed, release); %globaltimer is CLOCK_MONOTONIC.
#pragma once

#include <time.h>

#include <cstdint>

#include "emu_cuda.h"

namespace pa2a::probe {

inline uint64_t ld_acquire_sys(const uint64_t* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

inline uint32_t ld_relaxed_sys(const uint32_t* p) {
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}

inline void st_release_sys(uint64_t* p, uint64_t v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

inline uint64_t globaltimer_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace pa2a::probe
