// Launchers of the dispatch/combine kernels, one file per phase: kernels_send.cu (dispatch
// send, copy-engine helpers, begin), kernels_recv.cu (wait, unpack rows, expert-major
// receive), kernels_combine.cu (combine send, pre-reduction, combine receive) and
// kernels_control.cu (bootstrap probe, close mark, kernel loading). Torch-free: raw device
// pointers, sizes and a stream. Every launcher enqueues work only (no host
// synchronisation, no memset), so each call can be captured in a CUDA graph.
//
// A low-latency dispatch + combine is four kernels:
//   dispatch_send     begins the call (derives the CallTicket from DeviceState; its last
//                     block writes the ticket and advances the state), one warp per row
//                     (token, destination rank), fp8 quantised per warp straight into the
//                     slot, then the last block to finish fences and release-stores the
//                     (seq, count) flag of every destination in planner order.
//   unpack_rows       rows layout: pollers (one per source) acquire the flags and mirror
//     or em_recv      them locally; row items copy or dequantise rows out and count experts;
//                     expert-major: count items (per source: positions from warp-ballot
//                     scans), scatter items (rows into [E_local, world * max_tokens, H]),
//                     tail items (tokens_per_expert, src_info padding).
//   combine_send      begins the combine call; copies rows back, or pre-reduces expert-major
//                     outputs (weighted, fp32, k order) into them, and publishes flags.
//   combine_recv      pollers per source, then one warp per token: sum the partials in fp32
//                     in ascending rank order (the CPU order).
// A pulled pair (pull.cuh) changes only where the rows go: the send kernels store them into
// the sender's own pull slots (after the consumed wait), the receive kernels load them from
// the sender's segment and their last block stores the consumed flag.
// Normal mode adds wait_counts (the host reads the counts); the copy-engine path adds
// begin_call, count_destinations and, per copy, a stream memory operation (or the
// publish_one kernel) for the flag.
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
  const PeerTable* peers;    // device
  DeviceState* state;        // device
  ErrorSink err;             // the host-mapped error word and its echo (device_protocol.cuh)
  Placement placement;       // device arrays
  int32_t* ecount;           // [max(E_local, 1)] expert counts of the running unpack, 0 between
  int32_t* cnt_ws;           // [max(E_local, 1), world] expert-major counts per source
  uint32_t max_recv_blocks;  // cap of every receive grid (>= 1)
  bool pdl;                  // launch with programmatic dependent launch (sm_90+)
  uint64_t send_timeout_ns;  // deadline of a send kernel's consumed wait (pull.cuh)
};

// ---- send (kernels_send.cu) ----------------------------------------------------------------
// One-thread begin of a call whose ticket the host needs first (copy-engine path) or that
// has no send kernel (abort: also publishes kAbortCount flags to every rank).
void launch_begin_call(const KernelContext& k, CallTicket* ticket, uint32_t op, int family,
                       bool abort, cudaStream_t stream);

// x [T, H] 16-bit, topk_ids [T, topk] int32 or int64 (ids64), weights fp32 [T, topk];
// send_token [world * max_tokens], send_count [world] (outputs). begin: this kernel begins
// the call (writes *ticket); else *ticket was begun already. Ids outside [-1, E) and
// repeated ids of one token are skipped and recorded as kBadInput. Destinations in
// pack_mask (bit d) are written to pack [world * max_tokens slots] instead and get no flag:
// the copy-engine path moves them (pack may be null when pack_mask is 0).
void launch_dispatch_send(const KernelContext& k, CallTicket* ticket, bool begin, uint32_t op,
                          const void* x, int32_t num_tokens, const void* topk_ids, bool ids64,
                          const float* topk_weights, int32_t topk, int32_t* send_token,
                          int32_t* send_count, uint8_t* pack, uint64_t pack_mask,
                          cudaStream_t stream);

// Copy-engine path: rows per destination rank (counts [world], zeroed first), and the flag
// of one destination after its copy when stream memory operations are unavailable.
void launch_count_destinations(const KernelContext& k, const void* topk_ids, bool ids64,
                               int32_t num_tokens, int32_t topk, int32_t* counts,
                               cudaStream_t stream);
void launch_publish_one(const KernelContext& k, uint32_t seq, uint32_t op, int32_t dest,
                        uint32_t count, cudaStream_t stream);

// ---- receive (kernels_recv.cu) -------------------------------------------------------------
// tolerate_aborts: this rank aborts the call and only waits for every flag to arrive.
void launch_wait_counts(const KernelContext& k, const CallTicket* ticket, int32_t* counts,
                        uint64_t timeout_ns, bool tolerate_aborts, cudaStream_t stream);

// wait == true: the pollers acquire each source's flag and write counts[s] (low latency);
// row_base may be null (row (s, j) -> s * max_tokens + j), and rows past the count get
// topk_ids -1, weights 0, src -1; rows of staged sources are drained as they arrive.
// wait == false: counts[] come from launch_wait_counts and row_base is the compacted
// layout (normal mode). expert_count[E_local] is written (no zeroing needed).
void launch_unpack_rows(const KernelContext& k, const CallTicket* ticket, bool wait,
                        int32_t* counts, const int64_t* row_base, void* x_out, uint8_t* fp8_out,
                        float* scales_out, int32_t* src_rank, int32_t* src_token, int32_t* topk_ids,
                        float* topk_weights, int32_t* expert_count, uint64_t timeout_ns,
                        cudaStream_t stream);

// Expert-major [E_local, world * max_tokens, H], one kernel; every output is written
// whole (src_info is -1 past each expert's count).
void launch_unpack_expert_major(const KernelContext& k, const CallTicket* ticket,
                                int32_t* recv_count, void* x_out, uint8_t* fp8_out,
                                float* scales_out, int32_t* expert_count, int32_t* src_info,
                                int64_t* layout_range, int32_t* expert_pos, int32_t* row_experts,
                                float* row_weights, uint64_t timeout_ns, cudaStream_t stream);

// ---- combine (kernels_combine.cu) ----------------------------------------------------------
// Rows layout: y [*, H], row (s, j) = y[row_base[s] + j] (row_base null: s * max_tokens).
// Expert-major (expert_pos != null): y [E_local, world * max_tokens, H] unweighted.
// begin: as in launch_dispatch_send. Sources in ce_mask are skipped (rows and flag): the
// copy-engine path serves them.
void launch_combine_send(const KernelContext& k, CallTicket* ticket, bool begin, uint32_t op,
                         const void* y, const int32_t* recv_count, const int64_t* row_base,
                         const int32_t* expert_pos, const int32_t* row_experts,
                         const float* row_weights, uint64_t ce_mask, cudaStream_t stream);

void launch_reduce_rows(const KernelContext& k, const void* y, const int32_t* recv_count,
                        const int32_t* expert_pos, const int32_t* row_experts,
                        const float* row_weights, void* rows_out, cudaStream_t stream);

void launch_combine_recv(const KernelContext& k, const CallTicket* ticket,
                         const int32_t* send_token, const int32_t* send_count, int32_t num_tokens,
                         void* out, uint64_t timeout_ns, cudaStream_t stream);

// ---- control (kernels_control.cu) ----------------------------------------------------------
// The bootstrap check that P2P *works* (not only that CUDA reports it): every rank writes
// a pattern into the probe line of each peer's segment header, through the same pointer
// and with the same fence + release as rows and flags; every rank then polls its own
// probe lines until `nonce` arrives (deadline timeout_ns) and compares the pattern.
// status[s]: 0 ok, 1 nothing arrived, 2 the bytes differ (status[rank] = 0).
void launch_probe_send(const KernelContext& k, uint64_t nonce, cudaStream_t stream);
void launch_probe_recv(const KernelContext& k, uint64_t nonce, uint64_t timeout_ns, int32_t* status,
                       cudaStream_t stream);

// Close, phase 1: after this rank's last write, release-stores `mark` into the close line
// of every peer's segment header (the peer may free its memory once every mark is there).
void launch_close_mark(const KernelContext& k, uint64_t mark, cudaStream_t stream);

// Loads every kernel of the transport now (cudaFuncGetAttributes on each), so that lazy
// module loading (CUDA_MODULE_LOADING=LAZY, the default) never happens in the middle of a
// call while peers' kernels spin on this GPU. Throws naming the kernel that failed.
void load_transport_kernels();
void load_send_kernels();
void load_recv_kernels();
void load_combine_kernels();

}  // namespace pa2a::cuda
