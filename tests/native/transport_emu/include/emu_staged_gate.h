// The transport emulation's staged gate: hooks that the shared model of the PTX primitives
// (tests/native/emu/override/cuda/common/ptx.cuh, EMU_PTX_HOOKS) calls around its loads and
// stores, to make a host-staged sender slow and partial on purpose. Off unless
// transport_emu/main.cpp sets it up (EMU_STAGED_GATE).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <string>

#include "emu_cuda.h"
#include "emu_lane_view.h"
#include "emu_runtime.h"

namespace pa2a::cuda {

// EMU_STAGED_GATE=R (world 2; set up by transport_emu/main.cpp): a sender that is slow and
// partial on purpose, to show that receivers drain host-staged rows while the sender
// writes. Rank R's low-latency flags (sig 3 or 4) into the peer's host segment are held
// until the peer has consumed (acquire-loaded) a row mark or combine chunk mark holding
// that call; a receiver that waits for the flag instead never does, and the held store
// fails the run after 3 s. Rank R also waits before each early-line store until the peer
// polls that line (at most 2 s), and after each row or chunk mark until the peer has read
// that mark (at most 20 ms) and 10 ms more, so a receiver that takes a line, row or chunk
// before it is complete reads stale bytes (a mark stored before the data it covers, a
// stale mark or line taken for the call).
struct StagedGate {
  int held = -1;  // the rank whose flags are held (-1: off)
  int rank = -1;  // this process's rank
  size_t flags_lo = 0, flags_hi = 0, rows_lo = 0, rows_hi = 0, early_lo = 0, early_hi = 0,
         chunks_lo = 0, chunks_hi = 0;  // byte ranges in a segment
  uint32_t* consumed = nullptr;  // [2][64], shared: [rank][seq % 64] = seq of a mark it consumed
  uint64_t* polled = nullptr;    // [2], shared: offset of the last early line each rank read
  uint64_t* last = nullptr;  // [2], shared: (offset << 32 | seq) of the last mark each rank read
  uint32_t last_sig = 0;     // the last flag sig this process stored
};
inline StagedGate staged_gate;

inline bool emu_in(size_t off, size_t lo, size_t hi) {
  return off >= lo && off < hi;
}

inline void emu_gate_load(const void* p, uint64_t v) {
  StagedGate& g = staged_gate;
  if (g.held < 0) return;
  const size_t off = emu_host_offset(p);
  if (off != SIZE_MAX && emu_in(off, g.early_lo, g.early_hi))
    __atomic_store_n(&g.polled[g.rank], static_cast<uint64_t>(off), __ATOMIC_RELEASE);
  if (off == SIZE_MAX ||
      !(emu_in(off, g.rows_lo, g.rows_hi) || emu_in(off, g.chunks_lo, g.chunks_hi)))
    return;
  const auto seq = static_cast<uint32_t>(v >> 32);
  __atomic_store_n(&g.consumed[g.rank * 64 + seq % 64], seq, __ATOMIC_RELEASE);
  __atomic_store_n(&g.last[g.rank], (static_cast<uint64_t>(off) << 32) | seq, __ATOMIC_RELEASE);
}

// Before (true) or after (false) a release store of v at p.
inline void emu_gate_store(const void* p, uint64_t v, bool before) {
  StagedGate& g = staged_gate;
  if (g.held < 0 || g.rank != g.held) return;
  const size_t off = emu_host_offset(p);
  if (off == SIZE_MAX) return;
  if (before && emu_in(off, g.early_lo, g.early_hi)) {
    // until the peer polls this line (at most 2 s), so that it reads the old one first
    __atomic_store_n(&g.polled[1 - g.rank], uint64_t{0}, __ATOMIC_RELEASE);
    for (int i = 0; i < 2000 && __atomic_load_n(&g.polled[1 - g.rank], __ATOMIC_ACQUIRE) != off;
         ++i)
      usleep(1000);
  }
  if (!before && (emu_in(off, g.rows_lo, g.rows_hi) || emu_in(off, g.chunks_lo, g.chunks_hi))) {
    // until the peer has read this mark (at most 20 ms: it may be waiting for another), then
    // 10 ms more: whatever the peer reads right after the mark comes before our next stores
    const uint64_t want = (static_cast<uint64_t>(off) << 32) | static_cast<uint32_t>(v >> 32);
    for (int i = 0; i < 20 && __atomic_load_n(&g.last[1 - g.rank], __ATOMIC_ACQUIRE) != want; ++i)
      usleep(1000);
    usleep(10000);
  }
  if (!before || !emu_in(off, g.flags_lo, g.flags_hi) || (off - g.flags_lo) % 64 != 0 ||
      (g.last_sig != 3 && g.last_sig != 4))
    return;
  const auto seq = static_cast<uint32_t>(v >> 32);
  const uint32_t* seen = &g.consumed[(1 - g.rank) * 64 + seq % 64];
  for (int i = 0; __atomic_load_n(seen, __ATOMIC_ACQUIRE) != seq; ++i) {
    if (i == 3000)
      emu::fail("EMU_STAGED_GATE: rank " + std::to_string(g.rank) + "'s flag of call " +
                std::to_string(seq) + " held 3 s, and rank " + std::to_string(1 - g.rank) +
                " consumed no row or chunk of the call: it waits for the flag");
    usleep(1000);
  }
}

// st.relaxed.sys.u32 into a flag line: the sig of the flag the next release store publishes.
inline void emu_gate_relaxed_store(const void* p, uint32_t v) {
  StagedGate& g = staged_gate;
  if (g.held < 0) return;
  const size_t off = emu_host_offset(p);
  if (off != SIZE_MAX && emu_in(off, g.flags_lo, g.flags_hi)) g.last_sig = v;
}

// The hooks the PTX model calls (EMU_PTX_HOOKS); the acquire also feeds the lane views.
inline void emu_hook_acquire_load(const void* p, uint64_t v) {
  emu_gate_load(p, v);
  emu_lane_view_acquire(p, v);
}
inline void emu_hook_release_store(const void* p, uint64_t v, bool before) {
  emu_gate_store(p, v, before);
}
inline void emu_hook_relaxed_store(const void* p, uint32_t v) {
  emu_gate_relaxed_store(p, v);
}

}  // namespace pa2a::cuda
