// Device side of the dispatch/combine protocol: memory-ordering primitives, deadlines, the
// error word, and the per-rank tables the kernels use. The wire itself (segment layout,
// slots, flags, epoch parity, the reuse invariant) is core/wire_format.h, shared with the
// CPU transport; nothing here redefines it.
//
// Hardware reason. On a PCIe-only box a GPU store to a peer's memory (or to pinned host
// memory mapped into our address space) is a posted write: it leaves the SM and the
// sender moves on. A load from a peer is a non-posted round trip of ~1 us, and peer
// atomics are a read followed by a write (not atomic at all across PCIe). So:
//   * senders push every byte with 16-byte vector stores straight into the receiver's
//     segment (peer device memory through CUDA IPC, or the receiver's pinned host memory
//     for pairs the planner marks "staged");
//   * receivers poll only flags that live in their own segment (device memory, or their
//     own pinned host memory for staged pairs: the read there stays on the receiver's
//     NUMA node, which is why the staging memory belongs to the receiver);
//   * no kernel issues an atomic on memory it does not own. The only atomics are on the
//     local DeviceState (block-arrival counters) and the local expert counts.
//
// Who writes what.
//   * Flag line [seq % 2][s] of receiver r: written only by sender s (the last block of
//     s's send kernel to arrive), sig first (relaxed), then the 64-bit word
//     (seq << 32 | count) with st.release.sys after a fence.acq_rel.sys that follows every
//     block's row stores. Receivers read it with ld.acquire.sys and never write it.
//   * Slots [parity][s][*] of receiver r: written only by sender s.
//   * DeviceState: written only by this rank's own kernels, in stream order.
//   * The error word (host-mapped, this rank's own): written by this rank's kernels when a
//     wait expires or a flag is inconsistent; read and cleared by this rank's host.
//
// Why reuse is safe. The reuse invariant of core/wire_format.h (a rank finishes receiving
// call n before it sends call n + 1) holds on the device because the receive kernels of
// call n precede the send kernel of call n + 1 on the caller's stream: a send kernel
// cannot start before the receive kernel that read the same parity has finished. Callers
// that overlap two micro-batches with the send/recv halves must keep that order per
// Buffer (recv of call n before send of call n + 1); two Buffers do not share regions.
//
// Call numbers live on the device. A CUDA graph replays kernels with frozen arguments,
// so `seq` and the parity cannot be kernel arguments. A one-thread `begin` kernel
// advances DeviceState (seq, per-family call count) and writes the call's CallTicket;
// every later kernel of that call reads its ticket. Replays therefore advance the epoch
// exactly as eager calls do, and the send/recv halves of one call agree on it.
//
// Never hang. Every wait reads %globaltimer and gives up at a deadline; it then writes
// the error word (code, op, peer, seq) and the kernel returns. The host turns the word
// into an exception (CudaTransport::check). A send kernel never waits on anything.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/wire_format.h"
#include "cuda/transport/ptx.cuh"

namespace pa2a::cuda {

// Pairs of the CUDA transport: how a sender reaches a receiver's segment.
enum class PairTransport : int32_t { kP2P = 0, kStaged = 1 };

// The largest world the device tables and the 64-bit destination masks support. PCIe
// servers have at most 8-10 GPUs per box; the CPU transport allows more.
constexpr int kMaxWorld = 64;

// Error codes written into the error word (append-only; mirrored in the host message).
enum class DeviceError : uint32_t {
  kNone = 0,
  kTimeout = 1,        // a flag did not arrive before the deadline
  kAborted = 2,        // the peer raised before sending (count == kAbortCount)
  kOpMismatch = 3,     // the peer is in another call (sig != op)
  kBadCount = 4,       // the peer announced more rows than max_tokens
  kCountMismatch = 5,  // combine: rows returned != rows dispatched
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

// This rank's call counters, in its own device memory.
struct DeviceState {
  uint32_t seq;        // last call number begun (dispatch and combine share it)
  uint32_t calls[2];   // calls begun per family (0 dispatch, 1 combine): slot parity
  uint32_t arrive[2];  // blocks of the running send kernel that finished (per family)
  uint32_t reserved[3];
};

// What the kernels of one call agree on. Written by the begin kernel, read by the rest.
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
};

// ---- memory-ordering primitives ---------------------------------------------------------
// System scope everywhere: the other side is another GPU or the CPU-side memory a GPU
// polls, never only this GPU. The primitives (ld_acquire_sys, ld_relaxed_sys,
// st_release_sys, st_relaxed_sys, fence_acq_rel_sys, globaltimer_ns) are the inline PTX
// of cuda/transport/ptx.cuh.

// Records the first problem of a call. Plain (relaxed, system-scope) store: the host reads
// the word without synchronising, and any writer's word is a complete description. An
// abort is the mildest problem (the host clears it and the Buffer stays usable), so any
// other problem replaces it: a peer that aborted must not hide a peer that never came.
__device__ __forceinline__ void record_error(uint64_t* err, DeviceError code, uint32_t op,
                                             int32_t peer, uint32_t seq) {
  const uint64_t old = *reinterpret_cast<volatile uint64_t*>(err);
  if (old == 0 || (error_code(old) == DeviceError::kAborted && code != DeviceError::kAborted))
    st_relaxed_sys(err, pack_error(code, op, peer, seq));
}

__device__ __forceinline__ bool timed_out_elsewhere(const uint64_t* err) {
  return error_code(*reinterpret_cast<const volatile uint64_t*>(err)) == DeviceError::kTimeout;
}

__device__ __forceinline__ FlagLine* flag_line_at(uint8_t* base, int parity, int src,
                                                  const WireConfig& c) {
  return reinterpret_cast<FlagLine*>(base + kSegmentHeaderBytes + flag_offset(c, parity, src));
}

// Polls the flag of (src -> this rank) for call t.seq in our own memory until it holds
// t.seq or the deadline passes. Returns the row count, or -1 after recording an error.
// `max_count` bounds a sane count (max_tokens); `expect` >= 0 demands an exact count.
// `tolerate` (this rank is aborting the call): only arrival matters, whatever the flag
// says, as in the CPU transport's wait after an abort. A wait gives up early once another
// wait of this rank timed out (the transport is broken then; blocks that run in waves
// would otherwise each wait out a full timeout).
__device__ __forceinline__ int32_t wait_flag(const FlagLine* f, const CallTicket& t, int32_t src,
                                             int32_t max_count, int32_t expect, uint64_t timeout_ns,
                                             uint64_t* err, bool tolerate = false) {
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  uint64_t w = ld_acquire_sys(&f->word);
  while (flag_seq(w) != t.seq) {
    // Check the clock every 64 polls: %globaltimer is a slow special register.
    if ((++spins & 63u) == 0) {
      if (globaltimer_ns() - start > timeout_ns) {
        record_error(err, DeviceError::kTimeout, t.op, src, t.seq);
        return -1;
      }
      if (timed_out_elsewhere(err)) return -1;
    }
    __nanosleep(64);  // back off: the poll competes with the rows arriving over PCIe
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

}  // namespace pa2a::cuda
