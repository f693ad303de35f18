// Per-chunk progress of host-staged pairs: the receiver drains a staged source's rows while
// the sender is still writing them, in the expert-major receive and in the combine receive
// (the rows-layout receive uses each dispatch row's own header mark, kernels_recv.cu).
//
// Hardware reason. A staged pair (no P2P) moves rows through the receiver's pinned host
// memory: the sender's stores are posted writes across PCIe, and every poll of the receiver
// is a read across PCIe of host memory (~1 us). With one flag after the last row the
// receiver idles while the sender writes, then reads everything: "write all, then read
// all", about twice the latency of the transfer alone. So the sender also publishes small
// progress words as it goes, and the receiver reads each chunk once its mark holds the
// call; the flag after the last row still comes (counts, aborts, the reuse chain).
//
// Who writes which word (the progress region of wire_format.h, after every other part of
// the segment; only staged pairs use it, in the receiver's host segment):
//   * Early line [parity][s] of receiver r: written only by block 0 of s's dispatch_send in
//     a low-latency call, before its rows: the rows s sends r and, for each of r's local
//     experts, how many of them list it (counts first, sig, then fence.acq_rel.sys, bar.sync,
//     one thread's fence and st.release.sys of the word (seq << 32 | rows)). With it r knows
//     where s's rows begin in every expert's list before any row arrives, so the positions
//     of s's rows no longer wait for s's flag, nor the sources after s for s's rows.
//   * Row marks: header word 1 of each staged dispatch row ({src_rank, seq}), stored last by
//     the writing warp (fence.acq_rel.sys per lane, __syncwarp, release store), as before.
//   * Combine chunk mark [parity][s][c] of receiver r: written only by the combine_send
//     block of (r, chunk c) of sender s after the chunk's rows (per-thread fence, bar.sync,
//     fence + st.release.sys of (seq << 32 | rows)). Chunks without rows get no mark.
//   * Receiver side, this GPU's own memory (DeviceState::staged_counts / staged_rows):
//     written only by the expert-major count item of source s (st.release.gpu after a
//     __threadfence and bar.sync), read by the scatter items; like the mirror, each word
//     carries the call number, so nothing is reset.
//   * Warp hand-off: where one lane acquires a mark (rows layout: lane 0, a row's mark;
//     combine: lane l, the marks of sources l, l + 32, ...) and the whole warp then reads
//     the rows, the lanes exchange the answer with a shuffle or ballot and then __syncwarp:
//     a shuffle orders no memory in the PTX model; bar.warp.sync does, so the acquiring
//     lane's acquire is ordered before every lane's reads (the CPU emulation poisons a row
//     from its mark's acquire until that barrier, so a missing barrier shows there).
// A mark or a line counts only when it holds the call number of the running call (seq is
// unique per call), so a word left by an earlier call is never taken for this one. Every
// wait has the deadline and error word of device_protocol.cuh; the waits for an early line
// or a chunk mark also watch the source's flag, so a sender that writes neither (an abort,
// the copy engine, a count that disagrees) ends them at once, and a source that dies
// mid-call is a timeout naming it. In these two receives no item waits for a staged
// source's flag before its rows: the flag is checked by items after them (the expert-major
// flag items, the combine's last items), so even a receive grid capped at one block drains.
//
// Why reuse stays safe. Early lines and chunk marks live at the slot parity of their call
// and belong to the slots they describe: source s rewrites them only where it rewrites
// those slots, at call n + 2 of the family, after the reuse chain of wire_format.h
// guarantees r finished reading call n. The expert counts a receiver takes from an early
// line are checked against the rows it then counts and the row count against the flag
// (kEarlyMismatch on a difference). Receivers with more than kEarlyMaxExperts local
// experts ignore the lines and wait for the flag as before; P2P pairs are unchanged.
#pragma once

#include "cuda/transport/kernel_common.cuh"

namespace pa2a::cuda {
namespace detail {

static_assert(kProgressChunkRows == kRowsPerBlock, "a combine chunk mark covers one send block");
static_assert(kProgressChunkRows <= 32, "one warp lane per row of a chunk");

__device__ __forceinline__ EarlyLine* early_line_at(const KernelContext& k, uint8_t* base,
                                                    int parity, int src) {
  return reinterpret_cast<EarlyLine*>(base + k.seg.progress_off +
                                      early_line_offset(k.cfg, parity, src));
}

__device__ __forceinline__ uint64_t* chunk_mark_at(const KernelContext& k, uint8_t* base,
                                                   int parity, int src, int chunk) {
  return reinterpret_cast<uint64_t*>(base + k.seg.progress_off +
                                     chunk_mark_offset(k.cfg, parity, src, chunk));
}

// Source s reaches this rank through host memory.
__device__ __forceinline__ bool staged_from(const KernelContext& k, int s) {
  return s != k.rank && ((k.peers->staged_recv >> s) & 1ull);
}

// The expert-major receive drains source s as it arrives (s's early line can hold our
// counts); otherwise it waits for s's flag.
__device__ __forceinline__ bool em_drains(const KernelContext& k, int s) {
  return staged_from(k, s) && k.num_local_experts <= kEarlyMaxExperts;
}

// ---- sender ---------------------------------------------------------------------------------
// Block 0 of a low-latency dispatch_send, every thread, before its rows: the early line of
// every staged destination not in skip_mask (the copy engine's), in the planner's order.
// Counts the same rows and entries the send kernel writes (routed_expert, select_replica).
__device__ __forceinline__ void publish_early_lines(const KernelContext& k, const CallTicket& t,
                                                    const void* ids, int ids64, int topk,
                                                    int num_tokens, uint64_t skip_mask) {
  __shared__ __align__(16) int32_t hist[kEarlyMaxExperts];
  __shared__ int32_t rows_sh;
  for (int i = 0; i < k.cfg.world; ++i) {
    const int d = k.peers->order[i];
    if (d == k.rank || !((k.peers->staged_send >> d) & 1ull) || ((skip_mask >> d) & 1ull)) continue;
    for (int e = threadIdx.x; e < kEarlyMaxExperts; e += blockDim.x) hist[e] = 0;
    if (threadIdx.x == 0) rows_sh = 0;
    __syncthreads();
    int rows = 0;
    for (int tok = threadIdx.x; tok < num_tokens; tok += blockDim.x) {
      const int64_t g = global_token_id(k.rank, k.cfg.max_tokens, tok);
      bool hit = false, ignored = false;  // bad ids are reported by the rows' pass
      for (int kk = 0; kk < topk; ++kk) {
        const int32_t e = routed_expert(ids, ids64, static_cast<int64_t>(tok) * topk, kk,
                                        k.placement.num_experts, &ignored);
        if (e < 0) continue;
        int32_t dd = 0, l = 0;
        select_replica(k.placement, e, g, &dd, &l);
        if (dd != d) continue;
        hit = true;
        if (l >= 0 && l < kEarlyMaxExperts) atomicAdd(&hist[l], 1);
      }
      rows += hit ? 1 : 0;
    }
    if (rows != 0) atomicAdd(&rows_sh, rows);
    __syncthreads();
    EarlyLine* line = early_line_at(k, k.peers->send_base[d], static_cast<int>(t.parity), k.rank);
    for (int q = threadIdx.x; q < kEarlyMaxExperts / 4; q += blockDim.x)
      reinterpret_cast<int4*>(line->counts)[q] = reinterpret_cast<const int4*>(hist)[q];
    if (threadIdx.x == 0) st_relaxed_sys(&line->sig, t.op);
    fence_acq_rel_sys();  // this thread's counts before the word (every thread fences)
    __syncthreads();
    if (threadIdx.x == 0) {
      fence_acq_rel_sys();
      st_release_sys(&line->word, pack_flag(t.seq, static_cast<uint32_t>(rows_sh)));
    }
    __syncthreads();  // hist and rows_sh are reused for the next destination
  }
}

// A combine_send block, every thread, after its rows of chunk `chunk` to `dest`: the
// chunk's mark, for a staged destination (the block's rows are ordered before it).
__device__ __forceinline__ void publish_chunk_mark(const KernelContext& k, const CallTicket& t,
                                                   int dest, int chunk, int rows) {
  if (rows <= 0 || dest == k.rank || !((k.peers->staged_send >> dest) & 1ull)) return;
  fence_acq_rel_sys();  // this thread's rows before the mark
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();  // cumulative: every thread's rows of the chunk
    st_release_sys(
        chunk_mark_at(k, k.peers->send_base[dest], static_cast<int>(t.parity), k.rank, chunk),
        pack_flag(t.seq, static_cast<uint32_t>(rows)));
  }
}

// ---- receiver: waits ------------------------------------------------------------------------
// Waits (one thread) for a local progress word of source `src` that holds call t.seq and a
// count >= need. Returns the count, or -1 when it says failed or the deadline passed.
__device__ __forceinline__ int32_t wait_progress(const uint64_t* p, const CallTicket& t, int src,
                                                 uint32_t need, uint64_t timeout_ns,
                                                 ErrorSink err) {
  Poll poll(timeout_ns);
  for (;;) {
    const uint64_t w = ld_acquire_gpu(p);
    if (flag_seq(w) == t.seq) {
      if (flag_count(w) == kMirrorFailed) return -1;
      if (flag_count(w) >= need) return static_cast<int32_t>(flag_count(w));
    }
    if (!poll.again(err)) {
      if (poll.expired()) record_error(err, DeviceError::kTimeout, t.op, src, t.seq);
      return -1;
    }
  }
}

// What a scatter item of the expert-major receive needs of source r (one thread): its
// expert counts (the begin of a later source's rows in each list) and, when j0 >= 0 (r is
// the item's own source), its rows up to the end of the item's chunk counted. Returns r's
// row count, or -1. Sources that do not drain: the mirror, as before.
__device__ __forceinline__ int32_t em_wait_source(const KernelContext& k, const CallTicket& t,
                                                  int r, int j0, uint64_t timeout_ns) {
  if (!em_drains(k, r)) return wait_mirror(k.state, r, t, timeout_ns, k.err);
  const int32_t n = wait_progress(&k.state->staged_counts[r], t, r, 0, timeout_ns, k.err);
  if (n < 0 || j0 < 0 || j0 >= n) return n;
  const uint32_t need = static_cast<uint32_t>(min(j0 + kProgressChunkRows, n));
  return wait_progress(&k.state->staged_rows[r], t, r, need, timeout_ns, k.err) < 0 ? -1 : n;
}

// Whether the combine partials this warp's token needs from staged sources are there (a
// warp collective; the same answer in every lane): for each staged source d with a slot
// (slot_of[d] >= 0), its chunk's mark holds the call, or d's flag (read every few polls)
// holds the call with the expected count and op (its rows all came before the flag: a
// sender without marks). false when the flag says otherwise (the source's last item
// records why) or the deadline passed (recorded). No mirror: staged sources have no poller
// item, so a block capped grid drains them too. Each lane acquires its sources' marks and
// every lane then reads every source's rows: the ballot orders no memory, the __syncwarp
// after it does (PTX memory model).
__device__ __forceinline__ bool combine_chunks_arrived(const KernelContext& k, const CallTicket& t,
                                                       const int32_t* slot_of,
                                                       const int32_t* send_count,
                                                       uint64_t timeout_ns, int lane) {
  bool ok = true;
  for (int d = lane; d < k.cfg.world && ok; d += 32) {
    const int j = slot_of[d];
    if (j < 0 || !staged_from(k, d)) continue;
    const uint64_t* mark = chunk_mark_at(k, k.peers->recv_base[d], static_cast<int>(t.parity), d,
                                         j / kProgressChunkRows);
    const FlagLine* f = flag_line_at(k.peers->recv_base[d], static_cast<int>(t.seq & 1u), d, k.cfg);
    Poll poll(timeout_ns);
    for (uint32_t i = 0;; ++i) {
      if (flag_seq(ld_acquire_sys(mark)) == t.seq) break;
      if (i % kClockEvery == 0) {
        const uint64_t w = ld_acquire_sys(&f->word);
        if (flag_seq(w) == t.seq) {
          ok = flag_count(w) == static_cast<uint32_t>(send_count[d]) &&
               ld_relaxed_sys(&f->sig) == t.op;
          break;
        }
      }
      if (!poll.again(k.err)) {
        if (poll.expired()) record_error(k.err, DeviceError::kTimeout, t.op, d, t.seq);
        ok = false;
        break;
      }
    }
  }
  const bool all = __ballot_sync(kFull, !ok) == 0;
  __syncwarp();  // each lane's acquires -> every lane's reads of the partials
  return all;
}

// The last items of combine_recv, one per source (one thread): a staged source's flag,
// with the checks its poller would make (count = what this rank sent it, op, aborts).
// Nothing waits for these items, so they may wait for the token items before them.
__device__ __forceinline__ void finish_staged_combine(const KernelContext& k, const CallTicket& t,
                                                      int d, const int32_t* send_count,
                                                      uint64_t timeout_ns) {
  if (!staged_from(k, d)) return;
  const FlagLine* f = flag_line_at(k.peers->recv_base[d], static_cast<int>(t.seq & 1u), d, k.cfg);
  wait_flag(f, t, d, k.cfg.max_tokens, send_count[d], timeout_ns, k.err);
}

// ---- receiver: the expert-major count item of a draining source -----------------------------
// Every thread of the block. The rows of source s and their counts per local expert come
// from s's early line (or, when the flag comes first, from the flag: an abort, a sender
// without lines); then chunk by chunk, as each row's mark holds the call, the row's
// experts, weights and positions (warp scans in (row, k) order, carried across chunks in
// `running`, dynamic shared memory of E_local ints: the CPU's order), each chunk published
// in staged_rows[s]; the counted totals must match the line. Writes what the flag path
// writes (recv_count, row_* and expert_pos, cnt_ws) but never waits for the flag: s's flag
// item (em_finish_staged) does, after the scatter items, and publishes the mirror.
__device__ __forceinline__ void em_count_staged(const KernelContext& k, const CallTicket& t, int s,
                                                int32_t* recv_count, int32_t* expert_pos,
                                                int32_t* row_experts, float* row_weights,
                                                int32_t* running, uint64_t timeout_ns) {
  __shared__ int32_t cn_sh;
  __shared__ int early_sh, bad_sh;
  const WireConfig& c = k.cfg;
  const int W = c.world, M = c.max_tokens, K = c.num_topk, E = k.num_local_experts;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int parity = static_cast<int>(t.parity);
  uint8_t* const base = k.peers->recv_base[s];
  const EarlyLine* line = early_line_at(k, base, parity, s);
  const FlagLine* flag = flag_line_at(base, static_cast<int>(t.seq & 1u), s, c);
  if (threadIdx.x == 0) {
    int32_t n = -1;
    int early = 0;
    Poll poll(timeout_ns);
    for (;;) {
      const uint64_t w = ld_acquire_sys(&line->word);
      if (flag_seq(w) == t.seq) {
        early = 1;
        n = static_cast<int32_t>(flag_count(w));
        if (ld_relaxed_sys(&line->sig) != t.op) {
          record_error(k.err, DeviceError::kOpMismatch, t.op, s, t.seq);
          n = -1;
        } else if (flag_count(w) > static_cast<uint32_t>(M)) {
          record_error(k.err, DeviceError::kBadCount, t.op, s, t.seq);
          n = -1;
        }
        break;
      }
      if (flag_seq(ld_acquire_sys(&flag->word)) == t.seq) {  // no line came: the flag path
        n = wait_flag(flag, t, s, M, -1, timeout_ns, k.err);
        break;
      }
      if (!poll.again(k.err)) {
        if (poll.expired()) record_error(k.err, DeviceError::kTimeout, t.op, s, t.seq);
        break;
      }
    }
    cn_sh = n;
    early_sh = early && n >= 0;
    bad_sh = n < 0;
  }
  __syncthreads();
  const int n = cn_sh < 0 ? 0 : cn_sh;
  const bool early = early_sh != 0;
  int32_t* const cnt_ws = k.cnt_ws;
  const int64_t row0 = static_cast<int64_t>(s) * M;
  for (int64_t idx = threadIdx.x; idx < static_cast<int64_t>(M - n) * K; idx += blockDim.x) {
    const int64_t at = (row0 + n) * K + idx;  // rows past the count list no expert
    row_experts[at] = -1;
    row_weights[at] = 0.0f;
    expert_pos[at] = -1;
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    running[e] = 0;
    if (early) cnt_ws[e * W + s] = line->counts[e];
  }
  __threadfence();  // the counts before staged_counts (every thread fences)
  __syncthreads();
  if (early && threadIdx.x == 0) st_release_gpu(&k.state->staged_counts[s], pack_flag(t.seq, n));
  for (int j0 = 0; j0 < n; j0 += kProgressChunkRows) {
    const int j1 = min(j0 + kProgressChunkRows, n);
    if (early && threadIdx.x == 0) {
      for (int j = j0; j < j1 && !bad_sh; ++j) {
        const uint64_t* mark =
            reinterpret_cast<const uint64_t*>(dispatch_slot(k, base, parity, s, j) + 8);
        Poll poll(timeout_ns);
        while ((ld_acquire_sys(mark) >> 32) != t.seq) {
          if (!poll.again(k.err)) {
            if (poll.expired()) record_error(k.err, DeviceError::kTimeout, t.op, s, t.seq);
            bad_sh = 1;
            break;
          }
        }
      }
    }
    __syncthreads();
    if (bad_sh) break;
    for (int idx = threadIdx.x; idx < (j1 - j0) * K; idx += blockDim.x) {
      const int j = j0 + idx / K, kk = idx % K;
      int32_t e;
      float w;
      slot_route(k, dispatch_slot(k, base, parity, s, j), kk, E, &e, &w);
      row_experts[(row0 + j) * K + kk] = e;
      row_weights[(row0 + j) * K + kk] = w;
      expert_pos[(row0 + j) * K + kk] = -1;
    }
    __syncthreads();
    for (int e = warp; e < E; e += kWarps) {  // lane l: row j0 + l
      const int total =
          place_expert_entries(row_experts, expert_pos, row0, j0, j1, K, e, running[e], lane);
      if (lane == 0) running[e] += total;
    }
    __threadfence();  // the chunk's metadata before its progress word
    __syncthreads();
    if (threadIdx.x == 0) st_release_gpu(&k.state->staged_rows[s], pack_flag(t.seq, j1));
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    if (!early)
      cnt_ws[e * W + s] = running[e];
    else if (!bad_sh && running[e] != line->counts[e])
      bad_sh = 2;  // the line's count of expert e is not what the rows list
  }
  __syncthreads();
  if (threadIdx.x == 0 && bad_sh == 2)
    record_error(k.err, DeviceError::kEarlyMismatch, t.op, s, t.seq);
  const bool failed = bad_sh != 0;
  if (threadIdx.x == 0) recv_count[s] = failed ? 0 : n;
  __threadfence();  // the metadata and counts before the progress words
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t done = pack_flag(t.seq, failed ? kMirrorFailed : static_cast<uint32_t>(n));
    if (!early || failed) st_release_gpu(&k.state->staged_counts[s], done);
    st_release_gpu(&k.state->staged_rows[s], done);
  }
}

// The flag item of a draining source s (one thread), after the scatter items: the flag
// still ends s's call; its count must be the early line's. Publishes the mirror the tail
// items wait for. Nothing before it waits for it, so the count item never holds a block
// waiting for the flag.
__device__ __forceinline__ void em_finish_staged(const KernelContext& k, const CallTicket& t, int s,
                                                 int32_t* recv_count, uint64_t timeout_ns) {
  if (!em_drains(k, s)) return;
  int32_t n = wait_progress(&k.state->staged_counts[s], t, s, 0, timeout_ns, k.err);
  if (n >= 0 && wait_progress(&k.state->staged_rows[s], t, s, static_cast<uint32_t>(n), timeout_ns,
                              k.err) < 0)
    n = -1;  // the count item failed (recorded)
  if (n >= 0) {
    const FlagLine* f = flag_line_at(k.peers->recv_base[s], static_cast<int>(t.seq & 1u), s, k.cfg);
    const int32_t m = wait_flag(f, t, s, k.cfg.max_tokens, -1, timeout_ns, k.err);
    if (m != n) {
      if (m >= 0) record_error(k.err, DeviceError::kEarlyMismatch, t.op, s, t.seq);
      recv_count[s] = 0;
      n = -1;
    }
  }
  publish_mirror(k.state, s, t.seq, n);
}

}  // namespace detail
}  // namespace pa2a::cuda
