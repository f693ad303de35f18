// Launchers of the dispatch/combine kernels (definitions in kernels.cu). Torch-free: raw
// device pointers, sizes and a stream. Every launcher enqueues work only (no host
// synchronisation), so each call can be captured in a CUDA graph.
//
// Kernels (one call = begin, then the send half, then the receive half):
//   begin_call        1 block: advances DeviceState, writes the call's CallTicket; with
//                     `abort` also publishes kAbortCount flags to every rank.
//   dispatch_send     one warp per row (token, destination rank); 16-byte stores into the
//                     destination's slot; the last block to finish fences and release-
//                     stores the (seq, count) flag of every destination in planner order.
//   wait_counts       normal mode: acquires every source's flag, writes the counts.
//   unpack_rows       rows layout: per source, acquire its flag (or re-check it), copy rows
//                     out (dequantising fp8 unless raw fp8 is asked for), count experts.
//   em_count          expert-major step 1: per source, acquire its flag, write the row
//                     metadata and each row's position among that source's rows of each
//                     local expert (warp ballots, so positions follow the CPU's (s, j) order).
//   em_scatter        expert-major step 2: prefix over sources, copy payloads into
//                     [E_local, world * max_tokens, H], src_info, layout_range, counts.
//   combine_send      one warp per returned row: copy it (rows layout) or pre-reduce the
//                     weighted expert outputs in fp32 (expert-major), push to the source.
//   reduce_rows       the expert-major pre-reduction alone (into local rows).
//   count_destinations / publish_one
//                     normal mode's copy-engine path: rows per destination before the
//                     send (the host sizes the copies), and one flag after each copy.
//   combine_recv      one warp per token: acquire every flag, sum partials in fp32 in
//                     ascending rank order (the CPU order), write the dtype of x.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/routing.h"
#include "core/wire_format.h"
#include "cuda/transport/device_protocol.cuh"

namespace pa2a::cuda {

// Everything the kernels of one transport share; passed by value.
struct KernelContext {
  WireConfig cfg;
  SegmentLayout seg;
  SlotLayout slot;
  int32_t rank;
  int32_t num_local_experts;
  const PeerTable* peers;  // device
  DeviceState* state;      // device
  uint64_t* err;           // device pointer of the host-mapped error word
  Placement placement;     // device arrays
};

void launch_begin_call(const KernelContext& k, CallTicket* ticket, uint32_t op, int family,
                       bool abort, cudaStream_t stream);

// x [T, H] 16-bit, topk_ids/weights [T, topk]; qbuf: per-token fp8 staging (fp8 payload);
// send_token [world * max_tokens], send_count [world] (outputs). Destinations in pack_mask
// (bit d) are written to pack [world * max_tokens slots] instead and get no flag: the
// copy-engine path moves them (pack may be null when pack_mask is 0).
void launch_dispatch_send(const KernelContext& k, const CallTicket* ticket, const void* x,
                          int32_t num_tokens, const int32_t* topk_ids, const float* topk_weights,
                          int32_t topk, uint8_t* qbuf, int32_t* send_token, int32_t* send_count,
                          uint8_t* pack, uint64_t pack_mask, cudaStream_t stream);

// Copy-engine path: rows per destination rank (counts [world], zeroed first), and the flag
// of one destination after its copy (host-known call number and count).
void launch_count_destinations(const KernelContext& k, const int32_t* topk_ids, int32_t num_tokens,
                               int32_t topk, int32_t* counts, cudaStream_t stream);
void launch_publish_one(const KernelContext& k, uint32_t seq, uint32_t op, int32_t dest,
                        uint32_t count, cudaStream_t stream);

// tolerate_aborts: this rank aborts the call and only waits for every flag to arrive.
void launch_wait_counts(const KernelContext& k, const CallTicket* ticket, int32_t* counts,
                        uint64_t timeout_ns, bool tolerate_aborts, cudaStream_t stream);

// wait == true: the kernel acquires each source's flag itself and writes counts[s]
// (low-latency); row_base may be null (row (s, j) -> s * max_tokens + j), and rows past
// the count get topk_ids -1, weights 0, src -1. wait == false: counts[] come from
// launch_wait_counts and row_base is the compacted layout (normal mode).
void launch_unpack_rows(const KernelContext& k, const CallTicket* ticket, bool wait,
                        int32_t* counts, const int64_t* row_base, void* x_out, uint8_t* fp8_out,
                        float* scales_out, int32_t* src_rank, int32_t* src_token, int32_t* topk_ids,
                        float* topk_weights, int32_t* expert_count, uint64_t timeout_ns,
                        cudaStream_t stream);

// cnt_ws: [E_local, world] int32 workspace.
void launch_unpack_expert_major(const KernelContext& k, const CallTicket* ticket,
                                int32_t* recv_count, int32_t* cnt_ws, void* x_out, uint8_t* fp8_out,
                                float* scales_out, int32_t* expert_count, int32_t* src_info,
                                int64_t* layout_range, int32_t* expert_pos, int32_t* row_experts,
                                float* row_weights, uint64_t timeout_ns, cudaStream_t stream);

// Rows layout: y [*, H], row (s, j) = y[row_base[s] + j] (row_base null: s * max_tokens).
// Expert-major (expert_pos != null): y [E_local, world * max_tokens, H] unweighted.
// Sources in ce_mask are skipped (rows and flag): the copy-engine path serves them.
void launch_combine_send(const KernelContext& k, const CallTicket* ticket, const void* y,
                         const int32_t* recv_count, const int64_t* row_base,
                         const int32_t* expert_pos, const int32_t* row_experts,
                         const float* row_weights, uint64_t ce_mask, cudaStream_t stream);

void launch_reduce_rows(const KernelContext& k, const void* y, const int32_t* recv_count,
                        const int32_t* expert_pos, const int32_t* row_experts,
                        const float* row_weights, void* rows_out, cudaStream_t stream);

void launch_combine_recv(const KernelContext& k, const CallTicket* ticket,
                         const int32_t* send_token, const int32_t* send_count, int32_t num_tokens,
                         void* out, uint64_t timeout_ns, cudaStream_t stream);

}  // namespace pa2a::cuda
