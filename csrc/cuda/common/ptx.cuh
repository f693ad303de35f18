// The inline PTX and other device intrinsics without a C++ spelling, for every kernel of
// the library (transport, all-reduce, calibration probe): system- and GPU-scope acquire,
// release and relaxed loads and stores, the cumulative fence, programmatic dependent
// launch, %globaltimer, %lanemask_lt and the dynamic shared memory base.
//
// Design. One header, used as is by every part, for two reasons. The orderings are the
// correctness argument of every flag protocol (transport: device_protocol.cuh; all-reduce:
// allreduce/device.cuh), so each is spelled and explained once; two copies drift. And the
// CPU execution model of the kernels replaces exactly this header with one of the same
// functions and signatures on C++ atomics of the same orderings (one host model serves every
// emulation build), so the kernel sources run unchanged there; that only holds while no other
// file under csrc/cuda/{transport,allreduce,probe} uses asm. Nothing here knows a protocol:
// the parts decide which scope and which ordering each of their words needs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pa2a::cuda {

// Acquire load of a flag word. .sys because the writer is another device (or a process
// on this device through IPC); acquire so the data the flag covers is visible after it.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Relaxed system-scope load: neither cached nor merged with its neighbours, so across PCIe
// each is one read (what the probe's latency chase times). Ordered only by an acquire of
// the word before it (the transport's `sig` after its flag).
__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Release store of a flag word: every write this thread has observed (fence-cumulative:
// including the data of other threads ordered before it) becomes visible first.
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// GPU-scope acquire/release: for words only this GPU's blocks share (in this GPU's own
// memory). Cheaper than .sys: no wait for the rest of the system.
__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Programmatic dependent launch (sm_90 and newer; no-ops before). With the launch attribute
// the next kernel of the stream may be scheduled before this one ends. griddep_wait() waits
// until the previous grid has completed and its writes are visible, so a kernel that calls
// it before it touches memory overlaps only its launch latency and never reorders memory;
// griddep_launch_dependents() allows the next kernel to be scheduled.
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

// Orders this thread's earlier stores (data pushed across PCIe) before its later ones (a
// count, then the flag) at system scope. A release store alone orders only the issuing
// thread; data is written by many threads, so each fences before the block barrier that
// precedes the flag.
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
  extern __shared__ __align__(16) unsigned char pa2a_dynamic_smem[];
  return reinterpret_cast<T*>(pa2a_dynamic_smem);
}

}  // namespace pa2a::cuda
