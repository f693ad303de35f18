// The transport emulation's lane views: the part of the PTX memory model that the warp
// hand-off of a staged receive depends on (staged_progress.cuh, "Warp hand-off").
//
// On the GPU, one lane's ld.acquire.sys of a mark makes the row the mark covers visible to
// that lane; a shuffle or a ballot passes the answer to the other lanes but orders no
// memory, so their reads of the row may still see what was there before. Only a barrier
// that orders memory (bar.warp.sync, bar.sync) hands the acquire on. Here memory is
// sequentially consistent, so without help a missing __syncwarp would be invisible. So
// when a receive kernel acquires a staged row mark (a dispatch row's header word 1) or a
// combine chunk mark that holds the running call, the row's bytes (every byte but the mark
// itself; for a chunk, each of its rows) are saved and overwritten with garbage (0xA5)
// until a barrier that orders memory completes for the acquiring warp (__syncwarp of that
// warp, __syncthreads, the block's end: Hooks::memory_sync), which restores them. A lane
// that reads the row after only a shuffle or ballot reads garbage, and the bit-exact check
// fails. Later acquires of a range restored in the same block do not poison it again (a
// warp that synchronised may still be reading it), and every warp that acquires a range
// still poisoned joins it (its barrier restores it too), so correct code never reads
// garbage: what one warp synchronised on stays restored for the block.
//
// Which marks count: only those of the running call (the row is complete and the sender
// does not touch it again before this rank's receive ends: the reuse invariant). A mark
// left by an earlier call of the same parity (the sender may be rewriting that row right
// now) holds a call at least two below this rank's DeviceState::seq (the last call begun,
// at most one ahead of the call being received), so it is left alone.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/wire_format.h"
#include "emu_cuda.h"
#include "emu_runtime.h"

namespace pa2a::cuda {

struct LaneView {
  // The running transport kernel's layout and call counter (set by launch.cuh; null
  // outside a transport kernel).
  const SegmentLayout* seg = nullptr;
  const WireConfig* cfg = nullptr;
  const uint32_t* seq = nullptr;
  struct Part {
    unsigned char* at;
    std::vector<unsigned char> bytes;
  };
  struct Held {
    std::vector<Part> parts;
    uint32_t warps = 0;  // the warps whose barrier restores it
  };
  std::map<unsigned char*, Held> held;  // by the row's first byte
  std::set<unsigned char*> settled;     // restored in this block: not poisoned again
};
inline LaneView lane_view;

// Offset of p in a registered host segment (a staged region), or SIZE_MAX.
inline size_t emu_host_offset(const void* p) {
  const auto& m = emu_rt::st.registered;
  const auto* c = static_cast<const unsigned char*>(p);
  auto it = m.upper_bound(c);
  if (it == m.begin()) return SIZE_MAX;
  --it;
  return c < it->first + it->second ? static_cast<size_t>(c - it->first) : SIZE_MAX;
}

inline void emu_lane_view_hold(unsigned char* key,
                               std::initializer_list<std::pair<unsigned char*, size_t>> parts) {
  LaneView& v = lane_view;
  const unsigned warp = emu::self().tid / 32;
  if (v.settled.count(key) != 0) return;
  auto it = v.held.find(key);
  if (it != v.held.end()) {
    it->second.warps |= 1u << warp;
    return;
  }
  LaneView::Held h;
  h.warps = 1u << warp;
  for (const auto& [at, n] : parts) {
    h.parts.push_back({at, std::vector<unsigned char>(at, at + n)});
    std::memset(at, 0xA5, n);
  }
  v.held.emplace(key, std::move(h));
}

// Hooks::memory_sync: restores what the synchronising warp (or every warp) holds.
inline void emu_lane_view_sync(int warp) {
  LaneView& v = lane_view;
  for (auto it = v.held.begin(); it != v.held.end();) {
    if (warp < 0 || ((it->second.warps >> warp) & 1u) != 0) {
      for (const LaneView::Part& p : it->second.parts)
        std::memcpy(p.at, p.bytes.data(), p.bytes.size());
      v.settled.insert(it->first);
      it = v.held.erase(it);
    } else {
      ++it;
    }
  }
  if (warp == emu::kBlockEnd) v.settled.clear();
}

// An acquire load of v at p by the running kernel (the PTX model's hook).
inline void emu_lane_view_acquire(const void* p, uint64_t v) {
  LaneView& lv = lane_view;
  if (lv.seg == nullptr || emu::rt.smem == nullptr) return;
  const size_t off = emu_host_offset(p);
  if (off == SIZE_MAX) return;
  const auto call = static_cast<uint32_t>(v >> 32);
  const uint32_t begun = __atomic_load_n(lv.seq, __ATOMIC_RELAXED);
  if (call == 0 || call > begun || call + 1 < begun) return;  // not the running call's
  const SegmentLayout& l = *lv.seg;
  const WireConfig& c = *lv.cfg;
  unsigned char* const base = static_cast<unsigned char*>(const_cast<void*>(p)) - off;
  if (off >= l.dispatch_off && off < l.combine_off &&
      (off - l.dispatch_off) % l.dispatch_slot == 8) {
    unsigned char* row = base + off - 8;  // a row mark: header word 1 of its slot
    emu_lane_view_hold(row, {{row, 8}, {row + 16, l.dispatch_slot - 16}});
    return;
  }
  const size_t marks = l.progress_off + chunk_mark_offset(c, 0, 0, 0);
  if (l.progress_off == 0 || off < marks || off >= l.total) return;
  const size_t idx = (off - marks) / 8, n = progress_chunks(c);
  const int chunk = static_cast<int>(idx % n), src = static_cast<int>((idx / n) % c.world),
            parity = static_cast<int>(idx / n / c.world);
  const int rows = static_cast<int>(v & 0xffffffffu);
  for (int i = 0; i < rows && chunk * kProgressChunkRows + i < c.max_tokens; ++i) {
    unsigned char* row =
        base + l.combine_off +
        slot_offset(c, parity, src, chunk * kProgressChunkRows + i, l.combine_slot);
    emu_lane_view_hold(row, {{row, l.combine_slot}});
  }
}

// launch.cuh, in every thread of a transport kernel (its first parameter is the
// KernelContext, alive until the grid ends): the layout and counter of the running kernel.
template <typename K>
inline void emu_lane_view_enter(const K& k) {
  lane_view.seg = &k.seg;
  lane_view.cfg = &k.cfg;
  lane_view.seq = &k.state->seq;
  emu::hooks.memory_sync = emu_lane_view_sync;
}

template <typename T, typename = void>
struct EmuIsContext : std::false_type {};
template <typename T>
struct EmuIsContext<T, std::void_t<decltype(std::declval<const T&>().seg.dispatch_off),
                                   decltype(std::declval<const T&>().state->seq)>>
    : std::true_type {};

}  // namespace pa2a::cuda
