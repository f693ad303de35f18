// Pull mode of the CUDA transport: a P2P pair (s -> r) whose rows the receiver reads from
// the sender's memory instead of the sender storing them into the receiver's. The wire
// (the pull send slots and consumed lines, the reuse rule) is core/wire_format.h, the
// same bytes the CPU transport reads and writes; this header is the device side of it.
//
// Hardware reason. On AMD hosts behind Broadcom (PEX890xx) or Microchip switches,
// concurrent posted writes from the GPUs of one switch to GPUs behind two or more root
// complexes collapse (36.8 -> 2.7 GB/s for two flows on the ESC8000A-E13P) while reads of
// the same pattern run at full speed (51.1 GB/s): research/field_2026.md section 4. For
// such pairs the planner chooses pull (topology RankTransfers.pair_direction): the bulk bytes
// cross PCIe as the receiver's SM loads (non-posted reads, the fast direction there) and
// only two 8-byte flags per call are written across.
//
// Who writes which flag (every flag an 8-byte release store by its one producer into the
// memory of the one rank that polls it; the sender's pull slots are local stores):
//   * Pull send slots [parity][r][*] of sender s (s's own device segment, from
//     seg.pull_dispatch_off / pull_combine_off): written only by s's send kernels, with
//     the same slot format as a receive slot, so the receive code only changes the base it
//     reads from (recv_slot below).
//   * Ready flag: the ordinary flag line [seq % 2][s] in r's memory, (seq << 32 | count),
//     release-stored by s's last send block after a system-scope fence that follows every
//     block's slot stores (finish_send). r acquires it (its poller) before any load of the
//     rows, exactly as for a pushed pair.
//   * Consumed line [region][r] in s's memory: written only by r, `seq` of the call whose
//     rows r has finished loading, release-stored by the last block of r's receive kernel
//     (after every block's loads, fence first), or by wait_counts when r reads nothing of
//     the call (its own abort, a peer's failure): the sender's record stays exact.
//   * DeviceState::staged_seq[region][parity] (s's own): the call that last staged into
//     that parity, written by the last block of the send kernel; pull_blocked[region][d]:
//     a send block whose consumed wait for d failed, so the last block withholds d's flag.
//
// Why reuse is safe, mixed push/pull pairs included. Before any store into its pull slots
// of parity p, every send block waits (deadline, then a timeout naming the reader in the
// error word, and no store and no flag for that reader: never rows overwritten under a
// reader, never a hang) until the reader's consumed line holds at least staged_seq[p], the
// call that last used p. Consumed values only grow (a rank receives its calls in order),
// so that is exact. Pushed pairs keep the stream-order argument of device_protocol.cuh;
// the two directions of a pair use disjoint memory (r's receive slots [*, s, *] vs s's
// pull slots [*, r, *]). The flag line of a pulled pair is reused at call n + 2 only after
// the same consumed wait, so a pulled pair stays safe even when the reader's receive of
// call n is deferred past its next send (two dispatches in flight, a receive hook): the
// emulation runs that case (w2_pull_two_in_flight_slow).
// Host-staged pairs always push: pull would be a GPU reading another host's pinned memory.
#pragma once

#include "core/wire_format.h"
#include "cuda/transport/kernels.cuh"

namespace pa2a::cuda::pull {

__device__ __forceinline__ bool pulls_from(const KernelContext& k, int s) {
  return (k.peers->pull_recv >> s) & 1ull;
}

__device__ __forceinline__ size_t slot_bytes(const KernelContext& k, int region) {
  return region == kDispatchRegion ? k.seg.dispatch_slot : k.seg.combine_slot;
}

// Where this rank stores row j of call parity p for destination d: its own pull slots
// (d pulls) or d's receive slots (push; d's device or pinned host segment).
__device__ __forceinline__ uint8_t* send_slot(const KernelContext& k, int region, int parity, int d,
                                              int j) {
  const size_t b = slot_bytes(k, region);
  if ((k.peers->pull_send >> d) & 1ull) {
    const size_t off = region == kDispatchRegion ? k.seg.pull_dispatch_off : k.seg.pull_combine_off;
    return k.peers->send_base[k.rank] + off + slot_offset(k.cfg, parity, d, j, b);
  }
  const size_t off = region == kDispatchRegion ? k.seg.dispatch_off : k.seg.combine_off;
  return k.peers->send_base[d] + off + slot_offset(k.cfg, parity, k.rank, j, b);
}

// Where this rank reads row j of source s: s's pull slots (through IPC) or its own slots.
__device__ __forceinline__ const uint8_t* recv_slot(const KernelContext& k, int region, int parity,
                                                    int s, int j) {
  const size_t b = slot_bytes(k, region);
  if (pulls_from(k, s)) {
    const size_t off = region == kDispatchRegion ? k.seg.pull_dispatch_off : k.seg.pull_combine_off;
    return k.peers->pull_base[s] + off + slot_offset(k.cfg, parity, k.rank, j, b);
  }
  const size_t off = region == kDispatchRegion ? k.seg.dispatch_off : k.seg.combine_off;
  return k.peers->recv_base[s] + off + slot_offset(k.cfg, parity, s, j, b);
}

__device__ __forceinline__ FlagLine* consumed_line(const KernelContext& k, uint8_t* base,
                                                   int region, int reader) {
  return reinterpret_cast<FlagLine*>(base + k.seg.consumed_off +
                                     consumed_offset(k.cfg, region, reader));
}

// Every thread of a send block: waits until each destination in `dests` that pulls from
// this rank has consumed the call that last staged into this call's parity. Returns the
// destinations this block may store into (all, but those whose wait failed: recorded as
// kNotConsumed naming the reader, and in state->pull_blocked for the last block).
__device__ __forceinline__ uint64_t await_consumed(const KernelContext& k, const CallTicket& t,
                                                   int region, uint64_t dests) {
  __shared__ unsigned long long blocked;
  const uint64_t pulled = k.peers->pull_send & dests;
  if (pulled == 0) return ~0ull;  // the same in every thread
  if (threadIdx.x == 0) blocked = 0;
  __syncthreads();
  const uint32_t need = k.state->staged_seq[region][t.parity];
  for (int d = threadIdx.x; d < k.cfg.world && need != 0; d += blockDim.x) {
    if (!((pulled >> d) & 1ull)) continue;
    const FlagLine* line = consumed_line(k, k.peers->send_base[k.rank], region, d);
    Poll poll(k.send_timeout_ns);
    while (ld_acquire_sys(&line->word) < need) {
      if (!poll.again(k.err)) {
        if (poll.expired()) record_error(k.err, DeviceError::kNotConsumed, t.op, d, t.seq);
        atomicAdd(&blocked, 1ull << d);  // one thread per d: an OR
        k.state->pull_blocked[region][d] = 1;
        break;
      }
    }
  }
  __syncthreads();
  return ~static_cast<uint64_t>(blocked);
}

// Last send block, one thread (the block shares the result): the destinations some block
// could not store into (their flags are withheld: the reader then times out instead of
// reading stale rows), zeroed for the next call.
__device__ __forceinline__ uint64_t take_blocked(const KernelContext& k, int region) {
  uint64_t m = 0;
  if (k.peers->pull_send == 0) return 0;
  for (int d = 0; d < k.cfg.world; ++d)
    if (k.state->pull_blocked[region][d] != 0) {
      m |= 1ull << d;
      k.state->pull_blocked[region][d] = 0;
    }
  return m;
}

// Last send block, one thread: this call staged into its parity (the next use waits on it).
__device__ __forceinline__ void note_staged(const KernelContext& k, int region,
                                            const CallTicket& t) {
  if (k.peers->pull_send != 0) k.state->staged_seq[region][t.parity] = t.seq;
}

// Last receive block (every thread), after every block's loads: tell each source this
// rank pulls from that call t.seq is consumed.
__device__ __forceinline__ void publish_consumed(const KernelContext& k, const CallTicket& t,
                                                 int region) {
  if (k.peers->pull_recv == 0) return;
  fence_acq_rel_sys();  // the loads of every block (ordered before our arrival) first
  for (int s = threadIdx.x; s < k.cfg.world; s += blockDim.x)
    if (pulls_from(k, s))
      st_release_sys(&consumed_line(k, k.peers->pull_base[s], region, k.rank)->word,
                     static_cast<uint64_t>(t.seq));
}

__device__ __forceinline__ int region_of(uint32_t op) {
  return op == static_cast<uint32_t>(OpCode::kCombine) ||
                 op == static_cast<uint32_t>(OpCode::kLowLatencyCombine)
             ? kCombineRegion
             : kDispatchRegion;
}

}  // namespace pa2a::cuda::pull
