// The probe kernels' inline PTX, in one place (the probe's CPU emulation
// replaces this header with C++ atomics of the same orderings, as the transport's does).
// System scope because the other side of every access is another GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pa2a::probe {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// A load that is neither cached nor merged with its neighbours: one PCIe read each.
__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Nanoseconds of the GPU's global timer (independent of the SM clock).
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace pa2a::probe
