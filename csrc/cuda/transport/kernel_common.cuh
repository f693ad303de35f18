// What the kernels_*.cu files share: block shapes, the dtype/payload switch, slot address
// math, 16-bit vector conversions, the end of a send kernel (block arrival, flags in
// planner order, begin of the call, statistics) and the work-item loop of the receive
// kernels. Protocol and invariants: device_protocol.cuh. Included only by kernels_*.cu.
#pragma once

#include "core/exception.h"
#include "core/numeric.h"
#include "cuda/transport/kernels.cuh"
#include "cuda/transport/launch.cuh"
#include "cuda/transport/pull.cuh"

namespace pa2a::cuda {
namespace detail {

constexpr int kWarps = 8;  // warps per block of every row kernel
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerBlock = 16;    // rows of one source per receive/combine work item
constexpr int kMaxTokPerBlock = 64;  // dispatch_send: tokens per block (shared tables)
constexpr int kMaxTopk = 64;         // WireConfig::num_topk bound (checked on the host)
constexpr unsigned kFull = 0xffffffffu;

// ---- the one compile-time switch -------------------------------------------------------
// Kernels are specialised on the dtype of x (bf16/fp16) and on whether the wire payload
// is fp8, so conversions fold to straight-line code. Any other combination is refused
// here rather than aliased to a kernel that would write the wrong bytes.
#define PA2A_SWITCH_WIRE(cfg, ...)                                                             \
  do {                                                                                         \
    const bool fp8_ = (cfg).payload == Payload::kFP8;                                          \
    if ((cfg).dtype == DType::kBF16 && (fp8_ || (cfg).payload == Payload::kBF16)) {            \
      constexpr DType kDT = DType::kBF16;                                                      \
      if (fp8_) {                                                                              \
        constexpr bool kFp8 = true;                                                            \
        __VA_ARGS__;                                                                           \
      } else {                                                                                 \
        constexpr bool kFp8 = false;                                                           \
        __VA_ARGS__;                                                                           \
      }                                                                                        \
    } else if ((cfg).dtype == DType::kFP16 && (fp8_ || (cfg).payload == Payload::kFP16)) {     \
      constexpr DType kDT = DType::kFP16;                                                      \
      if (fp8_) {                                                                              \
        constexpr bool kFp8 = true;                                                            \
        __VA_ARGS__;                                                                           \
      } else {                                                                                 \
        constexpr bool kFp8 = false;                                                           \
        __VA_ARGS__;                                                                           \
      }                                                                                        \
    } else {                                                                                   \
      PA2A_THROW(kValue, "CUDA transport: unsupported dtype/payload combination (dtype ",      \
                 static_cast<int>((cfg).dtype), ", payload ", static_cast<int>((cfg).payload), \
                 "); supported: bf16 or fp16 x with the same 16-bit payload or fp8");          \
    }                                                                                          \
  } while (0)

PA2A_HD unsigned cdiv(int64_t a, int64_t b) {
  return static_cast<unsigned>((a + b - 1) / b);
}

// Every receive grid: the work items, at most max_recv_blocks blocks.
inline unsigned recv_grid(const KernelContext& k, int64_t items) {
  const int64_t cap = k.max_recv_blocks > 0 ? k.max_recv_blocks : 1;
  return static_cast<unsigned>(items < 1 ? 1 : (items < cap ? items : cap));
}

__device__ __forceinline__ uint8_t* dispatch_slot(const KernelContext& k, uint8_t* base, int parity,
                                                  int src, int j) {
  return base + k.seg.dispatch_off + slot_offset(k.cfg, parity, src, j, k.seg.dispatch_slot);
}

__device__ __forceinline__ uint8_t* combine_slot(const KernelContext& k, uint8_t* base, int parity,
                                                 int src, int j) {
  return base + k.seg.combine_off + slot_offset(k.cfg, parity, src, j, k.seg.combine_slot);
}

// Entry kk of a received dispatch slot's routing: (expert, weight), or (-1, 0) past the
// row's count or for an id outside [0, E) (the receive paths treat both as "no entry").
__device__ __forceinline__ void slot_route(const KernelContext& k, const uint8_t* slot, int kk,
                                           int E, int32_t* e, float* w) {
  *e = -1;
  *w = 0.0f;
  if (kk >= reinterpret_cast<const int32_t*>(slot)[1]) return;
  const int32_t id = reinterpret_cast<const int32_t*>(slot + k.slot.experts_off)[kk];
  if (id < 0 || id >= E) return;
  *e = id;
  *w = reinterpret_cast<const float*>(slot + k.slot.weights_off)[kk];
}

// Expert-major positions, one warp, lane l on row jb + l (rows at or past `end` hold
// nothing): each entry of expert e in these rows gets base + its rank among e's entries in
// (row, k) order (an inclusive warp scan of the rows' hit counts). Returns how many entries
// of e the 32 rows hold (the same in every lane). A row lists e at most once (the sender
// skips repeats); the scan would still give a repeat its own position.
__device__ __forceinline__ int place_expert_entries(const int32_t* row_experts, int32_t* expert_pos,
                                                    int64_t row0, int jb, int end, int K, int e,
                                                    int base, int lane) {
  const int j = jb + lane;
  int hits = 0;
  if (j < end)
    for (int kk = 0; kk < K; ++kk) hits += row_experts[(row0 + j) * K + kk] == e;
  int incl = hits;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += v;
  }
  int p = base + incl - hits;
  if (hits > 0)
    for (int kk = 0; kk < K; ++kk)
      if (row_experts[(row0 + j) * K + kk] == e) expert_pos[(row0 + j) * K + kk] = p++;
  return __shfl_sync(kFull, incl, 31);
}

// Entry kk of a token's expert list, or -1: -1 itself, an id outside [-1, E) and a repeat
// of an earlier entry of the same token are skipped (the Buffer's host check refuses
// them; the device path records kBadInput instead, through *bad).
__device__ __forceinline__ int64_t load_id(const void* ids, int ids64, int64_t i) {
  return ids64 ? static_cast<const int64_t*>(ids)[i]
               : static_cast<int64_t>(static_cast<const int32_t*>(ids)[i]);
}

__device__ __forceinline__ int32_t routed_expert(const void* ids, int ids64, int64_t row, int kk,
                                                 int32_t num_experts, bool* bad) {
  const int64_t e = load_id(ids, ids64, row + kk);
  if (e == -1) return -1;
  if (e < -1 || e >= num_experts) {
    *bad = true;
    return -1;
  }
  for (int q = 0; q < kk; ++q)
    if (load_id(ids, ids64, row + q) == e) {
      *bad = true;
      return -1;
    }
  return static_cast<int32_t>(e);
}

// Destination ranks of token t as a bit mask (kMaxWorld <= 64).
__device__ __forceinline__ uint64_t token_dest_mask(const KernelContext& k, const void* ids,
                                                    int ids64, int topk, int t, bool* bad) {
  uint64_t m = 0;
  const int64_t g = global_token_id(k.rank, k.cfg.max_tokens, t);
  for (int i = 0; i < topk; ++i) {
    const int32_t e =
        routed_expert(ids, ids64, static_cast<int64_t>(t) * topk, i, k.placement.num_experts, bad);
    if (e < 0) continue;
    int32_t d = 0, l = 0;
    select_replica(k.placement, e, g, &d, &l);
    m |= 1ull << d;
  }
  return m;
}

// Eight 16-bit values of dtype kDT <-> fp32, exactly as core/numeric.h converts them.
template <DType kDT>
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const auto lo = static_cast<uint16_t>(w[i] & 0xffffu);
    const auto hi = static_cast<uint16_t>(w[i] >> 16);
    f[2 * i] = kDT == DType::kBF16 ? bf16_to_float(lo) : fp16_to_float(lo);
    f[2 * i + 1] = kDT == DType::kBF16 ? bf16_to_float(hi) : fp16_to_float(hi);
  }
}

template <DType kDT>
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = static_cast<uint32_t>(float_to_half_bits(f[2 * i], kDT)) |
           (static_cast<uint32_t>(float_to_half_bits(f[2 * i + 1], kDT)) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The call a send kernel works for. begin: derived from DeviceState (every block reads it
// at its start; only the last block to finish advances it, after every block arrived).
__device__ __forceinline__ CallTicket call_ticket(const KernelContext& k, const CallTicket* ticket,
                                                  bool begin, int family, uint32_t op) {
  if (!begin) return *ticket;
  CallTicket t;
  t.seq = k.state->seq + 1;
  t.parity = (k.state->calls[family] + 1) & 1u;
  t.op = op;
  t.reserved = 0;
  return t;
}

// End of a send kernel. Every block's rows are ordered (system-scope fence) before its
// arrival; the last block to arrive acquires them all, release-stores the flags in the
// planner's order, records the statistics and (begin) writes the ticket and advances the
// call counters. counts[d] is read with ld.cg: another block wrote it. Destinations outside
// `mask` get no flag: the copy-engine path publishes theirs after its copy; nor do pulled
// destinations whose consumed wait failed (pull.cuh).
__device__ __forceinline__ void finish_send(const KernelContext& k, const CallTicket& t, int family,
                                            bool begin, CallTicket* ticket, const int32_t* counts,
                                            uint64_t mask) {
  __shared__ bool last;
  fence_acq_rel_sys();  // this thread's rows before the block's arrival
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();  // cumulative: covers the rows of every thread of the block
    last = atomicAdd(&k.state->arrive[family], 1u) == gridDim.x * gridDim.y - 1;
    if (last) {
      fence_acq_rel_sys();          // acquire side: every other block's rows precede our flags
      k.state->arrive[family] = 0;  // all blocks have arrived: ready for the next call
    }
  }
  __syncthreads();
  if (!last) return;
  const int W = k.cfg.world;
  const int M = k.cfg.max_tokens;
  DeviceState* st = k.state;
  __shared__ uint64_t blocked;
  if (threadIdx.x == 0) blocked = pull::take_blocked(k, family);
  __syncthreads();
  mask &= ~blocked;
  for (int i = threadIdx.x; i < W; i += blockDim.x) {
    const int d = k.peers->order[i];
    const int32_t c = __ldcg(counts + d);
    const uint32_t n = static_cast<uint32_t>(c < 0 ? 0 : (c > M ? M : c));
    st->stat_last_rows[d] = n;
    st->stat_total_rows[family][d] += n;
    if (!((mask >> d) & 1ull)) continue;
    FlagLine* f = flag_line_at(k.peers->send_base[d], static_cast<int>(t.seq & 1u), k.rank, k.cfg);
    st_relaxed_sys(&f->sig, t.op);
    st_release_sys(&f->word, pack_flag(t.seq, n));
  }
  if (threadIdx.x == 0) {
    st->stat_calls += 1;
    st->stat_last_family = static_cast<uint32_t>(family);
    pull::note_staged(k, family, t);
    if (begin) {
      *ticket = t;
      st->seq = t.seq;
      st->calls[family] += 1;
    }
  }
}

// ---- work items of the receive kernels -----------------------------------------------------
// The next item of this block (all threads get the same value). Tickets come in increasing
// order from a counter only running blocks touch: an item may wait for a smaller one.
__device__ __forceinline__ uint32_t next_item(const KernelContext& k) {
  __shared__ uint32_t item;
  __syncthreads();  // every thread has read the previous item
  if (threadIdx.x == 0) item = atomicAdd(&k.state->recv_ticket, 1u);
  __syncthreads();
  return item;
}

// After a block's last item. The last block to finish zeroes the counters for the next
// receive kernel ("zero counters in the previous receive": no memset is ever enqueued)
// and moves the expert counts accumulated in k.ecount to expert_count (if given); then it
// tells the sources this rank pulls from that call t is consumed (`region`, pull.cuh).
__device__ __forceinline__ void finish_recv(const KernelContext& k, int32_t* expert_count,
                                            const CallTicket& t, int region) {
  __shared__ bool last;
  __threadfence();  // this thread's counter updates before the block's arrival
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(&k.state->recv_done, 1u) == gridDim.x - 1;
    if (last) __threadfence();
  }
  __syncthreads();
  if (!last) return;
  if (expert_count != nullptr)
    for (int e = threadIdx.x; e < k.num_local_experts; e += blockDim.x)
      expert_count[e] = atomicExch(k.ecount + e, 0);
  if (threadIdx.x == 0) {
    k.state->recv_ticket = 0;
    k.state->recv_done = 0;
  }
  pull::publish_consumed(k, t, region);
}

}  // namespace detail
}  // namespace pa2a::cuda

// Loads one kernel now (load_*_kernels): cudaFuncGetAttributes forces lazy loading.
#define PA2A_LOAD(kernel)                                                              \
  do {                                                                                 \
    cudaFuncAttributes a_;                                                             \
    const cudaError_t e_ = cudaFuncGetAttributes(&a_, kernel);                         \
    if (e_ != cudaSuccess) {                                                           \
      (void)cudaGetLastError();                                                        \
      PA2A_THROW(kRuntime, "CUDA transport: loading kernel ", #kernel,                 \
                 " failed: ", cudaGetErrorName(e_), ": ", cudaGetErrorString(e_),      \
                 " (is this build's architecture list missing this GPU? see README)"); \
    }                                                                                  \
  } while (0)
