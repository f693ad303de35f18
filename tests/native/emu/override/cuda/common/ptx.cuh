// Host model of csrc/cuda/common/ptx.cuh (same functions, same signatures), the one
// stand-in for it in every emulation build (transport, all-reduce, probe, the Python-level
// module): each puts tests/native/emu/override on -iquote, so "cuda/common/ptx.cuh" is found
// here before csrc. One model because the kernels share one header: a primitive modelled
// twice could be modelled two ways.
//
// The PTX orderings map to GCC's __atomic builtins with the same orderings: ld.acquire.sys
// -> acquire load, ld.relaxed.sys / st.relaxed.sys -> relaxed, st.release.sys -> release
// store, fence.acq_rel.sys -> acq_rel fence (the .gpu scope alike). Every rank is a process
// and all segments are shared mappings, so these are the C++ memory model's guarantees
// between processes on one CPU; on x86 they are plain loads and stores, i.e. stronger than
// PCIe gives (the model cannot show a missing fence). The accesses must be naturally
// aligned, as in PTX. %globaltimer is CLOCK_MONOTONIC; %lanemask_lt comes from threadIdx.x.
//
// One addition for the ownership tests: a rank can be made slow *between* seeing a flag and
// reading the data it covers (emu_acquire_delay: after the first acquire load that returns
// a flag whose upper 32 bits are call `seq`, sleep `ms`; off unless a driver sets it). That
// is the window in which a faster peer's next call would overwrite the data if neither
// parity nor the end barrier protected it.
//
// Programmatic dependent launch: launches run one after another here, so griddep_wait has
// nothing to wait for. What is checked instead is where a kernel triggers its dependents
// (device_protocol.cuh: after its last wait): an acquire load of a flag (every wait polls
// with one) in a block that already called griddep_launch_dependents is reported.
//
// Hooks: a build that defines EMU_PTX_HOOKS as a header name (the transport's:
// -DEMU_PTX_HOOKS="emu_staged_gate.h", its staged gate in transport_emu/include) gets that
// header included first; it provides emu_hook_acquire_load(p, v),
// emu_hook_release_store(p, v, before) and emu_hook_relaxed_store(p, v) in pa2a::cuda.
// Without it they do nothing.
#pragma once

#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "emu_cuda.h"
#ifdef EMU_PTX_HOOKS
#include EMU_PTX_HOOKS  // declared before the model that calls them
#endif

namespace pa2a::cuda {

struct EmuAcquireDelay {
  uint32_t seq = 0;  // 0: off (no call has number 0)
  unsigned ms = 0;
};
inline EmuAcquireDelay emu_acquire_delay;

#ifndef EMU_PTX_HOOKS
inline void emu_hook_acquire_load(const void*, uint64_t) {}
inline void emu_hook_release_store(const void*, uint64_t, bool) {}
inline void emu_hook_relaxed_store(const void*, uint32_t) {}
#endif

inline void emu_check_aligned(const void* p, uintptr_t n, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % n != 0) emu::fail(std::string(what) + " misaligned");
}

inline uint64_t emu_pdl_triggered = 0;  // block_serial of the block that last triggered

inline void emu_check_not_triggered(const char* what) {
  if (emu::rt.smem != nullptr && emu_pdl_triggered == emu::rt.block_serial)  // in that block
    emu::fail(std::string(what) +
              " (a flag wait) after griddep_launch_dependents in this block: the dependent "
              "kernel could be resident while this block still waits");
}

inline uint64_t ld_acquire_sys(const uint64_t* p) {
  emu_check_aligned(p, 8, "ld.acquire.sys.u64");
  emu_check_not_triggered("ld.acquire.sys.u64");
  const uint64_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
  if (emu_acquire_delay.seq != 0 && (v >> 32) == emu_acquire_delay.seq) {
    emu_acquire_delay.seq = 0;  // once
    usleep(emu_acquire_delay.ms * 1000u);
  }
  emu_hook_acquire_load(p, v);
  return v;
}

inline uint32_t ld_relaxed_sys(const uint32_t* p) {
  emu_check_aligned(p, 4, "ld.relaxed.sys.u32");
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}

inline void st_release_sys(uint64_t* p, uint64_t v) {
  emu_check_aligned(p, 8, "st.release.sys.u64");
  emu_hook_release_store(p, v, true);
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
  emu_hook_release_store(p, v, false);
}

inline void st_relaxed_sys(uint32_t* p, uint32_t v) {
  emu_check_aligned(p, 4, "st.relaxed.sys.u32");
  emu_hook_relaxed_store(p, v);
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
}

inline void st_relaxed_sys(uint64_t* p, uint64_t v) {
  emu_check_aligned(p, 8, "st.relaxed.sys.u64");
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
}

inline uint64_t ld_acquire_gpu(const uint64_t* p) {
  emu_check_aligned(p, 8, "ld.acquire.gpu.u64");
  emu_check_not_triggered("ld.acquire.gpu.u64");
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

inline void st_release_gpu(uint64_t* p, uint64_t v) {
  emu_check_aligned(p, 8, "st.release.gpu.u64");
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

// Launches run one after another here, so the previous grid is always complete.
inline void griddep_wait() {}
inline void griddep_launch_dependents() {
  emu_pdl_triggered = emu::rt.block_serial;  // >= 1 inside a kernel
}

inline void fence_acq_rel_sys() {
  __atomic_thread_fence(__ATOMIC_ACQ_REL);
}

inline uint64_t globaltimer_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

inline unsigned lanemask_lt() {
  return (1u << (threadIdx.x % 32u)) - 1u;
}

template <typename T>
inline T* dynamic_smem() {
  return reinterpret_cast<T*>(emu::rt.smem);
}

}  // namespace pa2a::cuda
