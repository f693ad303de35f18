// The transport's inline PTX and other device intrinsics that have no C++ spelling, in one
// place. Everything the kernels need from the hardware beyond plain CUDA C++ is here:
// system-scope acquire/release loads and stores, the fence that makes many threads' row
// stores cumulative before a flag, %globaltimer, %lanemask_lt and the dynamic shared
// memory base. Why each ordering is what it is: device_protocol.cuh.
//
// The CPU emulation of the kernels replaces this header with
// one of the same functions and signatures on C++ atomics with the same orderings, so
// the kernel sources run unchanged there; nothing else in csrc/cuda/transport may use asm.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pa2a::cuda {

// Acquire load of a flag word. .sys because the writer is another device (or a process
// on this device through IPC); acquire so the rows the flag covers are visible after it.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Relaxed system-scope load: reads `sig` after the acquire of the word (which orders it).
__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Release store of a flag word: every write this thread has observed (fence-cumulative:
// including the rows of other blocks ordered before it) becomes visible first.
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// GPU-scope acquire/release: what only this GPU's blocks share (the pollers' mirrors of the
// flags, in this rank's own device memory). Cheaper than .sys: no wait for the system.
__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Programmatic dependent launch (sm_90 and newer; no-ops before). The launch attribute
// (launch.cuh) lets the next kernel of the stream be scheduled before this one ends; every
// kernel of the transport calls griddep_wait() before it touches memory, which waits until
// the previous grid has completed and its writes are visible, so PDL hides only the launch
// latency and never reorders memory. griddep_launch_dependents() allows that scheduling.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Orders this thread's earlier stores (rows pushed across PCIe) before its later ones
// (the arrival count, then the flag) at system scope. A release store alone orders only
// the issuing thread; rows are written by many threads, so each fences before the block
// barrier (see publish_flags in kernels.cu).
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// Nanoseconds from the GPU's global timer. Unlike clock64() it does not depend on the SM
// clock (which changes with boost and power state), so a deadline in seconds stays one.
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Bits of the lanes below this one in its warp (for a rank within a ballot).
__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// The block's dynamic shared memory (the launch's third parameter), 16-byte aligned.
template <typename T>
__device__ __forceinline__ T* dynamic_smem() {
  extern __shared__ __align__(16) unsigned char pa2a_transport_smem[];
  return reinterpret_cast<T*>(pa2a_transport_smem);
}

}  // namespace pa2a::cuda
