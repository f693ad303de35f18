// Device side of the dispatch/combine protocol: memory-ordering primitives, deadlines, the
// error word, and the per-rank tables the kernels use. The wire itself (segment layout,
// slots, flags, epoch parity, the reuse invariant) is core/wire_format.h, shared with the
// CPU transport; nothing here redefines it.
//
// Hardware reason. On a PCIe-only box a GPU store to a peer's memory (or to pinned host
// memory mapped into our address space) is a posted write: it leaves the SM and the
// sender moves on. A load from a peer is a non-posted round trip of ~1 us, and peer
// atomics are a read followed by a write (not atomic at all across PCIe). So:
//   * senders push every byte with vector stores straight into the receiver's segment
//     (peer device memory through CUDA IPC, or the receiver's pinned host memory for
//     pairs the planner marks "staged");
//   * receivers poll only flags that live in their own segment (device memory, or their
//     own pinned host memory for staged pairs: the read there stays on the receiver's
//     NUMA node, which is why the staging memory belongs to the receiver);
//   * one poller per source: the first work items of a receive kernel each poll one
//     source's flag (with exponential back-off) and mirror it into this GPU's own memory
//     (DeviceState::mirror); every other block waits on the mirror, a local read. For a
//     staged pair each poll is a read across PCIe, so this keeps it to one reader;
//   * no kernel issues an atomic on memory it does not own. The only atomics are on the
//     local DeviceState (block arrivals, work tickets) and local counters.
//
// Who writes what.
//   * Flag line [seq % 2][s] of receiver r: written only by sender s (the last block of
//     s's send kernel to arrive), sig first (relaxed), then the 64-bit word
//     (seq << 32 | count) with st.release.sys after a fence.acq_rel.sys that follows every
//     block's row stores. Receivers read it with ld.acquire.sys and never write it.
//   * Slots [parity][s][*] of receiver r: written only by sender s. Word 1 of a dispatch
//     row's header ({src_rank, seq}) is stored last with st.release.sys when the pair is
//     staged: the row is its own arrival mark, so the receiver drains rows while the
//     sender is still writing (per-chunk progress instead of one flag at the end). The
//     early lines and combine chunk marks of staged pairs: staged_progress.cuh.
//   * Header lines of receiver r (kProbeLineOff, kCloseLineOff): written only by sender s
//     at bootstrap (the P2P probe) and at close (the close mark).
//   * Pulled pairs (cuda/transport/pull.cuh): the rows in the sender's own pull slots
//     (local stores), the ready flag as above, and the consumed line [region][r] in the
//     sender's segment, written only by reader r's last receive block.
//   * DeviceState: written only by this rank's own kernels, in stream order.
//   * The error word (host-mapped, this rank's own): written by this rank's kernels when a
//     wait expires or a flag is inconsistent; read and cleared by this rank's host. Its
//     device-memory echo DeviceState::timed_out is written by the same record_error when
//     the word it stores is a timeout, and polled by the waiters (see "Never hang").
//
// Why reuse is safe. The reuse invariant of core/wire_format.h (a rank finishes receiving
// call n before it sends call n + 1) holds on the device because the receive kernels of
// call n precede the send kernel of call n + 1 on the caller's stream: a send kernel
// cannot start before the receive kernel that read the same parity has finished (with
// programmatic dependent launch the next kernel may be *scheduled* early, but every kernel
// calls griddep_wait() before it touches memory, which waits for the previous grid to
// complete and flush). Callers that overlap two micro-batches with the send/recv halves
// must keep that order per Buffer; two Buffers do not share regions. Pulled pairs add the
// consumed guard of pull.cuh, which holds even when a receive is deferred past a send.
//
// Call numbers live on the device. A CUDA graph replays kernels with frozen arguments,
// so `seq` and the parity cannot be kernel arguments. The send kernel of a call reads
// DeviceState (every block, at its start: no kernel of this transport runs beside it),
// derives the call's CallTicket itself, and its last block to finish writes the ticket
// and advances DeviceState; every later kernel of the call reads the ticket. Replays
// therefore advance the epoch exactly as eager calls do. (The copy-engine path and aborts
// advance it with the separate one-thread begin kernel: they need the ticket on the host
// or have no send kernel.)
//
// Work items. Receive kernels take work items from a ticket counter in DeviceState
// (atomicAdd), not from blockIdx: items are handed out in increasing order to blocks that
// are running, so an item may wait for an item with a smaller ticket (the pollers come
// first) without any assumption about block scheduling, and the grid can be capped
// (max_recv_blocks) below the number of items. The last block to finish resets the
// counter for the next receive kernel, so no memset precedes any kernel.
//
// Never hang. Every wait reads %globaltimer and gives up at a deadline; it then writes
// the error word (code, op, peer, seq) and the kernel returns. A wait also gives up once
// another wait of this rank timed out, which it learns from DeviceState::timed_out (this
// GPU's memory) every few polls, never from the host-mapped word: with hundreds of waiters
// that word would be read across PCIe 10^7-10^8 times a second, competing with the rows.
// Only this rank's kernels write timeouts and the host never clears them, so the echo is
// exact; the host word is read only on the error path (record_error). The host turns the
// word into an exception (CudaTransport::check). A send kernel waits on nothing but, for
// pulled pairs, the consumed lines in its own memory (pull.cuh), with the same deadline.
//
// Dependent launch. Every kernel calls griddep_wait() before it touches memory, and a
// kernel that waits on other agents (the receive kernels; the send kernels' consumed waits
// of pulled pairs) calls griddep_launch_dependents() only after its last wait: the next
// kernel of the stream (a persistent GEMM with a large shared-memory footprint, say) must
// not become resident beside blocks that still spin on a peer, where it could starve
// another stream's send kernel that the peer's progress depends on (a cross-GPU cycle).
// The CPU emulation fails a flag wait that follows the trigger in its block.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/wire_format.h"
#include "cuda/common/ptx.cuh"

namespace pa2a::cuda {

// Pairs of the CUDA transport: how a sender reaches a receiver's segment.
// kPull: P2P, but the receiver reads the rows from the sender's segment (pull.cuh).
enum class PairTransport : int32_t { kP2P = 0, kStaged = 1, kPull = 2 };

// The largest world the device tables and the 64-bit destination masks support. PCIe
// servers have at most 8-10 GPUs per box; the CPU transport allows more.
constexpr int kMaxWorld = 64;

// Lines in the 4 KiB segment header (after the SegmentHeader itself), one per source:
// the close mark (8 bytes) and the bootstrap P2P probe (16 bytes of pattern, then the
// 8-byte release-stored word).
constexpr size_t kCloseLineOff = 1024;
constexpr size_t kCloseLineBytes = 8;
constexpr size_t kProbeLineOff = 2048;
constexpr size_t kProbeLineBytes = 32;
static_assert(sizeof(SegmentHeader) <= kCloseLineOff, "header lines after the SegmentHeader");
static_assert(kCloseLineOff + kMaxWorld * kCloseLineBytes <= kProbeLineOff, "close lines fit");
static_assert(kProbeLineOff + kMaxWorld * kProbeLineBytes <= kSegmentHeaderBytes,
              "probe lines fit in the segment header");

// Error codes written into the error word (append-only; mirrored in the host message).
enum class DeviceError : uint32_t {
  kNone = 0,
  kTimeout = 1,        // a flag did not arrive before the deadline
  kAborted = 2,        // the peer raised before sending (count == kAbortCount)
  kOpMismatch = 3,     // the peer is in another call (sig != op)
  kBadCount = 4,       // the peer announced more rows than max_tokens
  kCountMismatch = 5,  // combine: rows returned != rows dispatched
  kBadInput = 6,       // this rank's topk_ids held an id outside [-1, E) or a duplicate
  kEarlyMismatch = 7,  // a staged peer's early count line disagrees with its rows or flag
  kNotConsumed = 8,    // pull: the reader did not consume the rows of the call that last
                       // used this slot parity before the deadline (cuda/transport/pull.cuh)
};

// One 64-bit word so a single store is self-consistent whichever block wins:
// [63:56] code, [55:48] op, [47:32] peer, [31:0] seq.
PA2A_HD uint64_t pack_error(DeviceError code, uint32_t op, int32_t peer, uint32_t seq) {
  return (static_cast<uint64_t>(code) << 56) | (static_cast<uint64_t>(op & 0xffu) << 48) |
         (static_cast<uint64_t>(static_cast<uint32_t>(peer) & 0xffffu) << 32) | seq;
}
PA2A_HD DeviceError error_code(uint64_t w) {
  return static_cast<DeviceError>(w >> 56);
}
PA2A_HD uint32_t error_op(uint64_t w) {
  return static_cast<uint32_t>((w >> 48) & 0xffu);
}
PA2A_HD int32_t error_peer(uint64_t w) {
  return static_cast<int32_t>((w >> 32) & 0xffffu);
}
PA2A_HD uint32_t error_seq(uint64_t w) {
  return static_cast<uint32_t>(w);
}
// Problems after which the Buffer stays usable: the host clears them once reported.
PA2A_HD bool error_is_mild(DeviceError e) {
  return e == DeviceError::kAborted || e == DeviceError::kBadInput;
}

// The count field of a mirrored flag whose wait failed (an error was recorded): the
// waiters of that source treat it as no rows. Valid counts are <= max_tokens < 2^20.
constexpr uint32_t kMirrorFailed = 0xffffffffu;

// This rank's call counters and receive bookkeeping, in its own device memory.
struct DeviceState {
  uint32_t seq;          // last call number begun (dispatch and combine share it)
  uint32_t calls[2];     // calls begun per family (0 dispatch, 1 combine): slot parity
  uint32_t arrive[2];    // blocks of the running send kernel that finished (per family)
  uint32_t recv_ticket;  // next work item of the running receive kernel
  uint32_t recv_done;    // blocks of the running receive kernel that finished
  // 1 once a wait of this rank timed out (kTimeout / kNotConsumed recorded in the error
  // word): what the waiters poll instead of the host-mapped word. Never cleared, like those
  // errors (the host clears only mild ones).
  uint32_t timed_out;
  // mirror[s]: pack_flag(seq, count) of source s for call seq, written by the poller of
  // s (count kMirrorFailed when its wait failed); read by the other work items.
  uint64_t mirror[kMaxWorld];
  // Statistics, kept by the send kernels (read by the host only when asked for).
  uint64_t stat_calls;                     // send kernels completed (dispatch + combine)
  uint32_t stat_last_family;               // family of the last one
  uint32_t stat_reserved;                  //
  uint32_t stat_last_rows[kMaxWorld];      // rows it sent to each rank
  uint64_t stat_total_rows[2][kMaxWorld];  // rows sent per family and rank, in total
  // Expert-major receive of staged sources (staged_progress.cuh), written by the count item
  // of source s: pack_flag(seq, rows) once s's expert counts are known / once rows [0, n)
  // of s are counted (count kMirrorFailed when its wait failed).
  uint64_t staged_counts[kMaxWorld];
  uint64_t staged_rows[kMaxWorld];
  // Pull (pull.cuh): the call that last staged into own pull slots [region][parity] (0:
  // none), and the destinations a block of the running send kernel could not store into.
  uint32_t staged_seq[2][2];
  uint32_t pull_blocked[2][kMaxWorld];
};

// What the kernels of one call agree on. Written by the send kernel (or the begin
// kernel), read by the rest.
struct CallTicket {
  uint32_t seq;
  uint32_t parity;  // slot parity of the call's family
  uint32_t op;      // OpCode
  uint32_t reserved;
};

// Device-visible pointers to every rank's segment, as this rank reaches them.
struct PeerTable {
  uint8_t* send_base[kMaxWorld];  // segment of receiver d that this rank writes (d's device
                                  // memory over IPC, or d's pinned host memory)
  uint8_t* recv_base[kMaxWorld];  // own segment in which source s writes to us (own device
                                  // memory, or own pinned host memory for staged pairs)
  int32_t order[kMaxWorld];       // destinations in the planner's send order
  uint64_t staged_send;           // bit d: this rank reaches d through host memory
  uint64_t staged_recv;           // bit s: s reaches this rank through host memory
  uint8_t* pull_base[kMaxWorld];  // segment of source s that this rank reads (s's device
                                  // memory over IPC) where this rank pulls from s
  uint64_t pull_send;             // bit d: d pulls this rank's rows (own pull slots)
  uint64_t pull_recv;             // bit s: this rank pulls s's rows (pull.cuh)
};

// ---- memory-ordering primitives ---------------------------------------------------------
// System scope for everything another agent writes or reads (another GPU, or the
// CPU-side memory a GPU polls); GPU scope for what only this GPU's blocks share (the
// mirrors). The primitives are the inline PTX of cuda/common/ptx.cuh.

// Where the kernels record problems: the host-mapped error word (its device pointer) and
// its echo in this GPU's memory, DeviceState::timed_out (passed by value, like the context).
struct ErrorSink {
  uint64_t* word;
  uint32_t* timed_out;
};

__device__ __forceinline__ bool is_timeout(DeviceError e) {
  return e == DeviceError::kTimeout || e == DeviceError::kNotConsumed;
}

// Records the first problem of a call. Plain (relaxed, system-scope) store: the host reads
// the word without synchronising, and any writer's word is a complete description. Aborts
// and bad input are the mildest problems (the host clears them and the Buffer stays
// usable), so any other problem replaces them: a peer that aborted must not hide a peer
// that never came. A timeout stored is echoed into timed_out for the waiters (a plain
// volatile store: they only need to see it eventually, and give up then).
__device__ __forceinline__ void record_error(ErrorSink err, DeviceError code, uint32_t op,
                                             int32_t peer, uint32_t seq) {
  const uint64_t old = *reinterpret_cast<volatile uint64_t*>(err.word);
  if (old == 0 || (error_is_mild(error_code(old)) && !error_is_mild(code))) {
    st_relaxed_sys(err.word, pack_error(code, op, peer, seq));
    if (is_timeout(code)) *reinterpret_cast<volatile uint32_t*>(err.timed_out) = 1u;
  }
}

// Another wait of this rank timed out: from this GPU's memory, not the host-mapped word.
__device__ __forceinline__ bool timed_out_elsewhere(ErrorSink err) {
  return *reinterpret_cast<const volatile uint32_t*>(err.timed_out) != 0u;
}

__device__ __forceinline__ FlagLine* flag_line_at(uint8_t* base, int parity, int src,
                                                  const WireConfig& c) {
  return reinterpret_cast<FlagLine*>(base + kSegmentHeaderBytes + flag_offset(c, parity, src));
}

// Exponential back-off of a polling loop: starts at kBackoffMinNs and doubles to
// kBackoffMaxNs. A poll of a staged flag is a PCIe read; a poll of a P2P flag competes
// with the rows arriving in the same memory. The cap bounds the added latency once the
// data arrives. The clock and DeviceState::timed_out are read every kClockEvery polls.
constexpr unsigned kBackoffMinNs = 32;
constexpr unsigned kBackoffMaxNs = 512;
constexpr unsigned kClockEvery = 8;

struct Poll {
  uint64_t start, timeout_ns;
  uint32_t spins = 0;
  unsigned sleep_ns = kBackoffMinNs;
  __device__ __forceinline__ Poll(uint64_t timeout)
      : start(globaltimer_ns()), timeout_ns(timeout) {}
  // Sleeps; returns false once the deadline passed or another wait of this rank timed
  // out (then the caller gives up; `expired()` tells which).
  __device__ __forceinline__ bool again(ErrorSink err) {
    if ((++spins % kClockEvery) == 0) {
      if (globaltimer_ns() - start > timeout_ns) {
        expired_ = true;
        return false;
      }
      if (timed_out_elsewhere(err)) return false;
    }
    __nanosleep(sleep_ns);
    sleep_ns = sleep_ns * 2 > kBackoffMaxNs ? kBackoffMaxNs : sleep_ns * 2;
    return true;
  }
  __device__ __forceinline__ bool expired() const { return expired_; }

 private:
  bool expired_ = false;
};

// Polls the flag of (src -> this rank) for call t.seq in our own memory until it holds
// t.seq or the deadline passes. Returns the row count, or -1 after recording an error.
// `max_count` bounds a sane count (max_tokens); `expect` >= 0 demands an exact count.
// `tolerate` (this rank is aborting the call): only arrival matters, whatever the flag
// says, as in the CPU transport's wait after an abort. A wait gives up early once another
// wait of this rank timed out (the transport is broken then; blocks that run in waves
// would otherwise each wait out a full timeout).
__device__ __forceinline__ int32_t wait_flag(const FlagLine* f, const CallTicket& t, int32_t src,
                                             int32_t max_count, int32_t expect, uint64_t timeout_ns,
                                             ErrorSink err, bool tolerate = false) {
  Poll poll(timeout_ns);
  uint64_t w = ld_acquire_sys(&f->word);
  while (flag_seq(w) != t.seq) {
    if (!poll.again(err)) {
      if (poll.expired()) record_error(err, DeviceError::kTimeout, t.op, src, t.seq);
      return -1;
    }
    w = ld_acquire_sys(&f->word);
  }
  if (tolerate) return 0;
  const uint32_t n = flag_count(w);
  if (n == kAbortCount) {
    record_error(err, DeviceError::kAborted, t.op, src, t.seq);
    return -1;
  }
  if (ld_relaxed_sys(&f->sig) != t.op) {
    record_error(err, DeviceError::kOpMismatch, t.op, src, t.seq);
    return -1;
  }
  if (n > static_cast<uint32_t>(max_count)) {
    record_error(err, DeviceError::kBadCount, t.op, src, t.seq);
    return -1;
  }
  if (expect >= 0 && n != static_cast<uint32_t>(expect)) {
    record_error(err, DeviceError::kCountMismatch, t.op, src, t.seq);
    return -1;
  }
  return static_cast<int32_t>(n);
}

// The poller's result for the other work items: release at GPU scope (the readers are
// blocks of this GPU), after whatever the poller wrote that they need.
__device__ __forceinline__ void publish_mirror(DeviceState* st, int s, uint32_t seq, int32_t n) {
  st_release_gpu(&st->mirror[s], pack_flag(seq, n < 0 ? kMirrorFailed : static_cast<uint32_t>(n)));
}

// Waits (one thread) for the mirror of source s for call seq; returns its count, or -1
// when the poller failed or (after a deadline, recorded) never published. The acquire
// pairs with publish_mirror, and through the poller's own acquire of the flag with the
// sender's release: the rows the flag covers are visible after it.
__device__ __forceinline__ int32_t wait_mirror(const DeviceState* st, int s, const CallTicket& t,
                                               uint64_t timeout_ns, ErrorSink err) {
  Poll poll(timeout_ns);
  uint64_t w = ld_acquire_gpu(&st->mirror[s]);
  while (flag_seq(w) != t.seq) {
    if (!poll.again(err)) {
      if (poll.expired()) record_error(err, DeviceError::kTimeout, t.op, s, t.seq);
      return -1;
    }
    w = ld_acquire_gpu(&st->mirror[s]);
  }
  return flag_count(w) == kMirrorFailed ? -1 : static_cast<int32_t>(flag_count(w));
}

}  // namespace pa2a::cuda
