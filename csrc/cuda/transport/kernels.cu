// Dispatch/combine kernels of the CUDA transport. Protocol and invariants: the top comments
// of core/wire_format.h and cuda/transport/device_protocol.cuh. Index math (slot offsets,
// replica selection) and numerics (bf16/fp16/fp8 conversion, group quantisation) come from
// the core headers the CPU transport uses, so both write the same bytes.
#include "core/exception.h"
#include "core/numeric.h"
#include "cuda/transport/kernels.cuh"
#include "cuda/transport/launch.cuh"

namespace pa2a::cuda {
namespace {

constexpr int kWarps = 8;  // warps per block of every row kernel
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerBlock = 16;    // receive/combine kernels: rows of one source per block
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

__device__ __forceinline__ uint8_t* dispatch_slot(const KernelContext& k, uint8_t* base, int parity,
                                                  int src, int j) {
  return base + k.seg.dispatch_off + slot_offset(k.cfg, parity, src, j, k.seg.dispatch_slot);
}

__device__ __forceinline__ uint8_t* combine_slot(const KernelContext& k, uint8_t* base, int parity,
                                                 int src, int j) {
  return base + k.seg.combine_off + slot_offset(k.cfg, parity, src, j, k.seg.combine_slot);
}

// Destination ranks of token t as a bit mask (kMaxWorld <= 64). Ids outside [0, E) are
// skipped (the host validates them; the kernel must not fault on garbage).
__device__ uint64_t token_dest_mask(const KernelContext& k, const int32_t* topk_ids, int topk,
                                    int t) {
  uint64_t m = 0;
  const int64_t g = global_token_id(k.rank, k.cfg.max_tokens, t);
  for (int i = 0; i < topk; ++i) {
    const int32_t e = topk_ids[static_cast<int64_t>(t) * topk + i];
    if (e < 0 || e >= k.placement.num_experts) continue;
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

// Block-arrival publish: every block's rows are ordered (system-scope fence) before its
// arrival; the last block to arrive acquires them all and release-stores the flags in
// the planner's order. counts[d] is read with ld.cg: it was written by another block.
// Destinations outside `mask` are skipped: the copy-engine path publishes their flags
// itself, after its copy (see publish_one_kernel).
__device__ void publish_flags(const KernelContext& k, const CallTicket& t, uint32_t* arrive,
                              const int32_t* counts, bool abort, uint64_t mask) {
  __shared__ bool last;
  fence_acq_rel_sys();  // this thread's rows before the block's arrival
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();  // cumulative: covers the rows of every thread of the block
    last = atomicAdd(arrive, 1u) == gridDim.x * gridDim.y - 1;
    if (last) {
      fence_acq_rel_sys();  // acquire side: every other block's rows precede our flags
      *arrive = 0;          // all blocks have arrived: ready for the next call
    }
  }
  __syncthreads();
  if (!last) return;
  const int W = k.cfg.world;
  const int M = k.cfg.max_tokens;
  for (int i = threadIdx.x; i < W; i += blockDim.x) {
    const int d = k.peers->order[i];
    if (!((mask >> d) & 1ull)) continue;
    uint32_t n = kAbortCount;
    if (!abort) {
      const int32_t c = __ldcg(counts + d);
      n = static_cast<uint32_t>(c < 0 ? 0 : (c > M ? M : c));
    }
    FlagLine* f = flag_line_at(k.peers->send_base[d], static_cast<int>(t.seq & 1u), k.rank, k.cfg);
    st_relaxed_sys(&f->sig, t.op);
    st_release_sys(&f->word, pack_flag(t.seq, n));
  }
}

// ---- begin -----------------------------------------------------------------------------
__global__ void begin_call_kernel(KernelContext k, CallTicket* ticket, uint32_t op, int family,
                                  int abort) {
  __shared__ CallTicket tk;
  if (threadIdx.x == 0) {
    DeviceState* st = k.state;
    st->seq += 1;
    st->calls[family] += 1;
    tk.seq = st->seq;
    tk.parity = st->calls[family] & 1u;
    tk.op = op;
    tk.reserved = 0;
    *ticket = tk;
  }
  __syncthreads();
  if (abort) {
    // No rows precede an abort: plain release stores of the flags suffice.
    for (int i = threadIdx.x; i < k.cfg.world; i += blockDim.x) {
      const int d = k.peers->order[i];
      FlagLine* f =
          flag_line_at(k.peers->send_base[d], static_cast<int>(tk.seq & 1u), k.rank, k.cfg);
      st_relaxed_sys(&f->sig, op);
      st_release_sys(&f->word, pack_flag(tk.seq, kAbortCount));
    }
  }
}

// ---- dispatch send ---------------------------------------------------------------------
// Slot j of destination d is the j-th token (in token order) with an expert on d, as on
// the CPU. Each block takes a contiguous token range; it counts the rows of the tokens
// before its range per destination (redundantly, so no grid-wide scan is needed), then
// assigns its own rows in order, then one warp writes one row.
template <DType kDT, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    dispatch_send_kernel(KernelContext k, const CallTicket* ticket, const uint16_t* x,
                         int32_t num_tokens, const int32_t* topk_ids, const float* topk_weights,
                         int32_t topk, int32_t tok_per_block, uint8_t* qbuf, int32_t* send_token,
                         int32_t* send_count, uint8_t* pack, uint64_t pack_mask) {
  __shared__ uint64_t mask[kMaxTokPerBlock];
  __shared__ int32_t base[kMaxWorld];
  __shared__ uint32_t rows[kMaxTokPerBlock * kMaxWorld];
  __shared__ int32_t nrows;
  __shared__ __align__(16) int32_t wid[kWarps][kMaxTopk];
  __shared__ __align__(16) float wwt[kWarps][kMaxTopk];

  const WireConfig& c = k.cfg;
  const int W = c.world, M = c.max_tokens, K = c.num_topk, H = c.hidden;
  const CallTicket t = *ticket;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int t0 = blockIdx.x * tok_per_block;
  const int ntok = max(0, min(num_tokens, t0 + tok_per_block) - t0);
  const size_t qstride = k.slot.bytes - k.slot.payload_off;

  for (int d = tid; d < W; d += blockDim.x) base[d] = 0;
  if (tid == 0) nrows = 0;
  __syncthreads();
  for (int tt = tid; tt < t0 && tt < num_tokens; tt += blockDim.x) {
    uint64_t m = token_dest_mask(k, topk_ids, topk, tt);
    while (m) {
      atomicAdd(&base[__ffsll(static_cast<long long>(m)) - 1], 1);
      m &= m - 1;
    }
  }
  for (int i = tid; i < ntok; i += blockDim.x) mask[i] = token_dest_mask(k, topk_ids, topk, t0 + i);
  __syncthreads();
  for (int d = tid; d < W; d += blockDim.x) {
    int j = base[d];
    for (int i = 0; i < ntok; ++i) {
      if (!((mask[i] >> d) & 1ull)) continue;
      const int r = atomicAdd(&nrows, 1);
      rows[r] = (static_cast<uint32_t>(j) << 12) | (static_cast<uint32_t>(i) << 6) |
                static_cast<uint32_t>(d);
      send_token[static_cast<int64_t>(d) * M + j] = t0 + i;
      ++j;
    }
    if (blockIdx.x == gridDim.x - 1) send_count[d] = j;
  }
  if constexpr (kFp8) {
    // One thread per 128-channel group, with the host's arithmetic (quantize_fp8_group).
    const int G = H / kFp8GroupSize;
    const size_t scales_rel = k.slot.scales_off - k.slot.payload_off;
    for (int g = tid; g < ntok * G; g += blockDim.x) {
      const int tok = t0 + g / G, gg = g % G;
      uint8_t* q = qbuf + static_cast<size_t>(tok) * qstride;
      const float s = quantize_fp8_group(x + static_cast<size_t>(tok) * H + gg * kFp8GroupSize, kDT,
                                         q + gg * kFp8GroupSize);
      reinterpret_cast<float*>(q + scales_rel)[gg] = s;
    }
  }
  __syncthreads();

  const int kvec = static_cast<int>((k.slot.weights_off - k.slot.experts_off) / 16);
  const int pvec = static_cast<int>(qstride / 16);
  for (int r = warp; r < nrows; r += kWarps) {
    const uint32_t packed = rows[r];
    const int d = static_cast<int>(packed & 63u), i = static_cast<int>((packed >> 6) & 63u);
    const int j = static_cast<int>(packed >> 12);
    const int tok = t0 + i;
    const int64_t g = global_token_id(k.rank, M, tok);
    for (int q = lane; q < kvec * 4; q += 32) {
      wid[warp][q] = -1;
      wwt[warp][q] = 0.0f;
    }
    __syncwarp();
    int n = 0;
    for (int kb = 0; kb < topk; kb += 32) {
      const int kk = kb + lane;
      bool hit = false;
      int32_t l = 0;
      float w = 0.0f;
      if (kk < topk) {
        const int32_t e = topk_ids[static_cast<int64_t>(tok) * topk + kk];
        if (e >= 0 && e < k.placement.num_experts) {
          int32_t dd = 0;
          select_replica(k.placement, e, g, &dd, &l);
          hit = dd == d;
          w = topk_weights[static_cast<int64_t>(tok) * topk + kk];
        }
      }
      const unsigned bal = __ballot_sync(kFull, hit);
      if (hit) {
        const int at = n + __popc(bal & lanemask_lt());
        wid[warp][at] = l;
        wwt[warp][at] = w;
      }
      n += __popc(bal);
    }
    __syncwarp();
    // Destinations in pack_mask go to the copy engine: their rows are packed locally,
    // slot j of d at pack[d * M + j], the exact bytes the slot will hold.
    uint8_t* slot =
        ((pack_mask >> d) & 1ull)
            ? pack + (static_cast<size_t>(d) * M + j) * k.seg.dispatch_slot
            : dispatch_slot(k, k.peers->send_base[d], static_cast<int>(t.parity), k.rank, j);
    if (lane == 0) *reinterpret_cast<int4*>(slot) = make_int4(tok, n, k.rank, 0);
    for (int q = lane; q < kvec; q += 32) {
      reinterpret_cast<int4*>(slot + k.slot.experts_off)[q] =
          reinterpret_cast<const int4*>(wid[warp])[q];
      reinterpret_cast<float4*>(slot + k.slot.weights_off)[q] =
          reinterpret_cast<const float4*>(wwt[warp])[q];
    }
    const uint4* src =
        kFp8 ? reinterpret_cast<const uint4*>(qbuf + static_cast<size_t>(tok) * qstride)
             : reinterpret_cast<const uint4*>(x + static_cast<size_t>(tok) * H);
    uint4* dst = reinterpret_cast<uint4*>(slot + k.slot.payload_off);
    for (int q = lane; q < pvec; q += 32) dst[q] = src[q];
    __syncwarp();  // wid/wwt are reused by this warp's next row
  }
  (void)K;
  publish_flags(k, t, &k.state->arrive[0], send_count, false, ~pack_mask);
}

// ---- dispatch receive ------------------------------------------------------------------
__global__ void wait_counts_kernel(KernelContext k, const CallTicket* ticket, int32_t* counts,
                                   uint64_t timeout_ns, int tolerate_aborts) {
  const CallTicket t = *ticket;
  for (int s = threadIdx.x; s < k.cfg.world; s += blockDim.x) {
    const FlagLine* f = flag_line_at(k.peers->recv_base[s], static_cast<int>(t.seq & 1u), s, k.cfg);
    const int32_t n =
        wait_flag(f, t, s, k.cfg.max_tokens, -1, timeout_ns, k.err, tolerate_aborts != 0);
    counts[s] = n < 0 ? 0 : n;
  }
}

// Re-acquires the flag of source s for a kernel that did not wait itself (the waiting
// kernel ran earlier on the stream): it makes this block's reads of the rows causally
// after the sender's release on its own, whatever caches sit between.
__device__ __forceinline__ bool reacquire(const KernelContext& k, const CallTicket& t, int s) {
  const FlagLine* f = flag_line_at(k.peers->recv_base[s], static_cast<int>(t.seq & 1u), s, k.cfg);
  return flag_seq(ld_acquire_sys(&f->word)) == t.seq;
}

// Dequantises 16 e4m3 bytes (one 16-byte load) with one group scale into 16 output values,
// as two 16-byte vectors: the inner step of every fp8 receive path.
template <DType kDT>
__device__ __forceinline__ void dequant16(const uint4 b, const float scale, uint4* lo, uint4* hi) {
  const uint32_t w[4] = {b.x, b.y, b.z, b.w};
  float f[16];
#pragma unroll
  for (int i = 0; i < 16; ++i)
    f[i] = fp8_e4m3_to_float(static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)))) * scale;
  *lo = pack8<kDT>(f);
  *hi = pack8<kDT>(f + 8);
}

// Copies (or dequantises) the payload of one received slot into a 16-bit row.
template <DType kDT, bool kFp8>
__device__ __forceinline__ void copy_payload(const KernelContext& k, const uint8_t* slot,
                                             uint8_t* dst, int lane) {
  const int H = k.cfg.hidden;
  if constexpr (kFp8) {
    const uint4* q = reinterpret_cast<const uint4*>(slot + k.slot.payload_off);
    const float* sc = reinterpret_cast<const float*>(slot + k.slot.scales_off);
    for (int v = lane; v < H / 16; v += 32) {
      uint4* o = reinterpret_cast<uint4*>(dst) + 2 * v;
      dequant16<kDT>(q[v], sc[(v * 16) / kFp8GroupSize], o, o + 1);
    }
  } else {
    const uint4* p = reinterpret_cast<const uint4*>(slot + k.slot.payload_off);
    for (int v = lane; v < H / 8; v += 32) reinterpret_cast<uint4*>(dst)[v] = p[v];
  }
}

template <DType kDT, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    unpack_rows_kernel(KernelContext k, const CallTicket* ticket, int wait, int32_t* counts,
                       const int64_t* row_base, uint8_t* x_out, uint8_t* fp8_out, float* scales_out,
                       int32_t* src_rank, int32_t* src_token, int32_t* ids_out, float* ws_out,
                       int32_t* expert_count, uint64_t timeout_ns) {
  __shared__ int32_t n_sh;
  const WireConfig& c = k.cfg;
  const int M = c.max_tokens, K = c.num_topk, H = c.hidden, G = H / kFp8GroupSize;
  const int s = blockIdx.x;
  const CallTicket t = *ticket;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    int32_t n;
    if (wait) {
      const FlagLine* f = flag_line_at(k.peers->recv_base[s], static_cast<int>(t.seq & 1u), s, c);
      n = wait_flag(f, t, s, M, -1, timeout_ns, k.err);
      n = n < 0 ? 0 : n;
      if (blockIdx.y == 0) counts[s] = n;
    } else {
      n = reacquire(k, t, s) ? counts[s] : 0;
    }
    n_sh = n;
  }
  __syncthreads();
  const int n = n_sh;
  const int j0 = blockIdx.y * kRowsPerBlock;
  const int j1 = min(j0 + kRowsPerBlock, wait ? M : n);
  for (int j = j0 + warp; j < j1; j += kWarps) {
    const int64_t i = row_base != nullptr ? row_base[s] + j : static_cast<int64_t>(s) * M + j;
    if (j >= n) {  // low-latency static shape: mark the unused row
      for (int q = lane; q < K; q += 32) {
        ids_out[i * K + q] = -1;
        ws_out[i * K + q] = 0.0f;
      }
      if (lane == 0) src_rank[i] = src_token[i] = -1;
      continue;
    }
    const uint8_t* slot = dispatch_slot(k, k.peers->recv_base[s], static_cast<int>(t.parity), s, j);
    const int4 h = *reinterpret_cast<const int4*>(slot);
    if (lane == 0) {
      src_rank[i] = s;
      src_token[i] = h.x;
    }
    const int32_t* ids = reinterpret_cast<const int32_t*>(slot + k.slot.experts_off);
    const float* ws = reinterpret_cast<const float*>(slot + k.slot.weights_off);
    for (int q = lane; q < K; q += 32) {
      const int32_t e = ids[q];
      ids_out[i * K + q] = e;
      ws_out[i * K + q] = ws[q];
      if (q < h.y && e >= 0 && e < k.num_local_experts) atomicAdd(expert_count + e, 1);
    }
    if (kFp8 && fp8_out != nullptr) {
      const uint4* q = reinterpret_cast<const uint4*>(slot + k.slot.payload_off);
      for (int v = lane; v < H / 16; v += 32) reinterpret_cast<uint4*>(fp8_out + i * H)[v] = q[v];
      const float* sc = reinterpret_cast<const float*>(slot + k.slot.scales_off);
      for (int v = lane; v < G; v += 32) scales_out[i * G + v] = sc[v];
    } else {
      copy_payload<kDT, kFp8>(k, slot, x_out + i * H * 2, lane);
    }
  }
}

// Expert-major step 1 (one block per source s).
__global__ void __launch_bounds__(kThreads)
    em_count_kernel(KernelContext k, const CallTicket* ticket, int32_t* recv_count, int32_t* cnt_ws,
                    int32_t* expert_pos, int32_t* row_experts, float* row_weights,
                    uint64_t timeout_ns) {
  __shared__ int32_t n_sh;
  const WireConfig& c = k.cfg;
  const int W = c.world, M = c.max_tokens, K = c.num_topk, E = k.num_local_experts;
  const int s = blockIdx.x;
  const CallTicket t = *ticket;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    const FlagLine* f = flag_line_at(k.peers->recv_base[s], static_cast<int>(t.seq & 1u), s, c);
    const int32_t n = wait_flag(f, t, s, M, -1, timeout_ns, k.err);
    n_sh = n < 0 ? 0 : n;
    recv_count[s] = n_sh;
  }
  __syncthreads();
  const int n = n_sh;
  const int64_t row0 = static_cast<int64_t>(s) * M;
  for (int idx = threadIdx.x; idx < M * K; idx += blockDim.x) {
    const int j = idx / K, kk = idx % K;
    int32_t e = -1;
    float w = 0.0f;
    if (j < n) {
      const uint8_t* slot =
          dispatch_slot(k, k.peers->recv_base[s], static_cast<int>(t.parity), s, j);
      const int32_t ne = reinterpret_cast<const int32_t*>(slot)[1];
      if (kk < ne) {
        e = reinterpret_cast<const int32_t*>(slot + k.slot.experts_off)[kk];
        if (e < 0 || e >= E) e = -1;
        if (e >= 0) w = reinterpret_cast<const float*>(slot + k.slot.weights_off)[kk];
      }
    }
    row_experts[(row0 + j) * K + kk] = e;
    row_weights[(row0 + j) * K + kk] = w;
    expert_pos[(row0 + j) * K + kk] = -1;
  }
  __syncthreads();
  // Position of each (row j, slot k) of expert e among source s's entries of e, in (j, k)
  // order: a warp scan over rows of the entries per row. A row normally lists e at most
  // once; the graph path does not check for duplicates, so a duplicate gets its own
  // position (as on the CPU) instead of an index of -1.
  for (int e = warp; e < E; e += kWarps) {
    int running = 0;
    for (int jb = 0; jb < n; jb += 32) {
      const int j = jb + lane;
      int hits = 0;
      if (j < n)
        for (int kk = 0; kk < K; ++kk) hits += row_experts[(row0 + j) * K + kk] == e;
      int incl = hits;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(kFull, incl, o);
        if (lane >= o) incl += v;
      }
      int p = running + incl - hits;
      if (hits > 0)
        for (int kk = 0; kk < K; ++kk)
          if (row_experts[(row0 + j) * K + kk] == e) expert_pos[(row0 + j) * K + kk] = p++;
      running += __shfl_sync(kFull, incl, 31);
    }
    if (lane == 0) cnt_ws[e * W + s] = running;
  }
}

// Expert-major step 2 (blocks (s, c)); dynamic shared memory: E_local int32 begins.
template <DType kDT, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    em_scatter_kernel(KernelContext k, const CallTicket* ticket, const int32_t* recv_count,
                      const int32_t* cnt_ws, uint8_t* x_out, uint8_t* fp8_out, float* scales_out,
                      int32_t* expert_count, int32_t* src_info, int64_t* layout_range,
                      int32_t* expert_pos, const int32_t* row_experts) {
  int32_t* const begin_sh = dynamic_smem<int32_t>();  // [E_local]
  __shared__ int32_t n_sh;
  __shared__ int64_t dst_sh[kWarps][kMaxTopk];
  const WireConfig& c = k.cfg;
  const int W = c.world, M = c.max_tokens, K = c.num_topk, H = c.hidden, G = H / kFp8GroupSize;
  const int E = k.num_local_experts;
  const int64_t cap = static_cast<int64_t>(W) * M;
  const int s = blockIdx.x;
  const CallTicket t = *ticket;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) n_sh = reacquire(k, t, s) ? recv_count[s] : 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t b = 0, total = 0;
    for (int r = 0; r < W; ++r) {
      const int32_t v = cnt_ws[e * W + r];
      if (r < s) b += v;
      total += v;
    }
    begin_sh[e] = b;
    if (blockIdx.y == 0) {
      layout_range[static_cast<int64_t>(e) * W + s] =
          (static_cast<int64_t>(b) << 32) | static_cast<uint32_t>(cnt_ws[e * W + s]);
      if (s == 0) expert_count[e] = total;
    }
  }
  __syncthreads();
  const int n = n_sh;
  const int j1 = min((static_cast<int>(blockIdx.y) + 1) * kRowsPerBlock, n);
  for (int j = blockIdx.y * kRowsPerBlock + warp; j < j1; j += kWarps) {
    const int64_t row = static_cast<int64_t>(s) * M + j;
    const uint8_t* slot = dispatch_slot(k, k.peers->recv_base[s], static_cast<int>(t.parity), s, j);
    const int32_t src_tok = reinterpret_cast<const int32_t*>(slot)[0];
    for (int kk = lane; kk < K; kk += 32) {
      const int32_t e = row_experts[row * K + kk];
      int64_t dst = -1;
      if (e >= 0) {
        const int32_t p = expert_pos[row * K + kk] + begin_sh[e];
        expert_pos[row * K + kk] = p;
        dst = static_cast<int64_t>(e) * cap + p;
        src_info[dst] = src_tok;
      }
      dst_sh[warp][kk] = dst;
    }
    __syncwarp();
    // Read each 16-byte chunk of the payload once (it may sit in host memory across
    // PCIe), store it to every local expert of the row.
    if (kFp8 && fp8_out != nullptr) {
      const uint4* q = reinterpret_cast<const uint4*>(slot + k.slot.payload_off);
      for (int v = lane; v < H / 16; v += 32) {
        const uint4 b = q[v];
        for (int kk = 0; kk < K; ++kk)
          if (dst_sh[warp][kk] >= 0)
            reinterpret_cast<uint4*>(fp8_out + dst_sh[warp][kk] * H)[v] = b;
      }
      const float* sc = reinterpret_cast<const float*>(slot + k.slot.scales_off);
      for (int v = lane; v < G; v += 32) {
        const float b = sc[v];
        for (int kk = 0; kk < K; ++kk)
          if (dst_sh[warp][kk] >= 0) scales_out[dst_sh[warp][kk] * G + v] = b;
      }
    } else if constexpr (kFp8) {
      const uint4* q = reinterpret_cast<const uint4*>(slot + k.slot.payload_off);
      const float* sc = reinterpret_cast<const float*>(slot + k.slot.scales_off);
      for (int v = lane; v < H / 16; v += 32) {
        uint4 lo, hi;
        dequant16<kDT>(q[v], sc[(v * 16) / kFp8GroupSize], &lo, &hi);
        for (int kk = 0; kk < K; ++kk) {
          if (dst_sh[warp][kk] < 0) continue;
          uint4* o = reinterpret_cast<uint4*>(x_out + dst_sh[warp][kk] * H * 2);
          o[2 * v] = lo;
          o[2 * v + 1] = hi;
        }
      }
    } else {
      const uint4* p = reinterpret_cast<const uint4*>(slot + k.slot.payload_off);
      for (int v = lane; v < H / 8; v += 32) {
        const uint4 b = p[v];
        for (int kk = 0; kk < K; ++kk)
          if (dst_sh[warp][kk] >= 0)
            reinterpret_cast<uint4*>(x_out + dst_sh[warp][kk] * H * 2)[v] = b;
      }
    }
    __syncwarp();
  }
}

// ---- combine ---------------------------------------------------------------------------
// Weighted pre-reduction of eight channels of row `row` (chunk v): fp32, experts in k
// order, separate multiply and add rounding (no FMA contraction) like the CPU loop
// `acc += w * y` in ShmTransport::reduce_expert_major.
template <DType kDT>
__device__ __forceinline__ uint4 reduce_chunk(const KernelContext& k, const uint8_t* y, int64_t row,
                                              int v, const int32_t* expert_pos,
                                              const int32_t* row_experts,
                                              const float* row_weights) {
  const int K = k.cfg.num_topk, H = k.cfg.hidden;
  const int64_t cap = static_cast<int64_t>(k.cfg.world) * k.cfg.max_tokens;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int kk = 0; kk < K; ++kk) {
    const int32_t e = row_experts[row * K + kk];
    if (e < 0) continue;
    const float w = row_weights[row * K + kk];
    const int64_t src = static_cast<int64_t>(e) * cap + expert_pos[row * K + kk];
    float f[8];
    unpack8<kDT>(reinterpret_cast<const uint4*>(y + src * H * 2)[v], f);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, f[i]));
  }
  return pack8<kDT>(acc);
}

template <DType kDT, bool kExpertMajor>
__global__ void __launch_bounds__(kThreads)
    combine_send_kernel(KernelContext k, const CallTicket* ticket, const uint8_t* y,
                        const int32_t* recv_count, const int64_t* row_base,
                        const int32_t* expert_pos, const int32_t* row_experts,
                        const float* row_weights, uint64_t ce_mask) {
  const WireConfig& c = k.cfg;
  const int M = c.max_tokens, H = c.hidden;
  const int s = blockIdx.x;
  const CallTicket t = *ticket;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Sources in ce_mask get their rows from the copy engine (rows layout only).
  const int n = ((ce_mask >> s) & 1ull) ? 0 : min(max(recv_count[s], 0), M);
  const int j1 = min((static_cast<int>(blockIdx.y) + 1) * kRowsPerBlock, n);
  for (int j = blockIdx.y * kRowsPerBlock + warp; j < j1; j += kWarps) {
    uint4* dst = reinterpret_cast<uint4*>(
        combine_slot(k, k.peers->send_base[s], static_cast<int>(t.parity), k.rank, j));
    if constexpr (kExpertMajor) {
      const int64_t row = static_cast<int64_t>(s) * M + j;
      for (int v = lane; v < H / 8; v += 32)
        dst[v] = reduce_chunk<kDT>(k, y, row, v, expert_pos, row_experts, row_weights);
    } else {
      const int64_t i = row_base != nullptr ? row_base[s] + j : static_cast<int64_t>(s) * M + j;
      const uint4* src = reinterpret_cast<const uint4*>(y + i * H * 2);
      for (int v = lane; v < H / 8; v += 32) dst[v] = src[v];
    }
  }
  publish_flags(k, t, &k.state->arrive[1], recv_count, false, ~ce_mask);
}

template <DType kDT>
__global__ void __launch_bounds__(kThreads)
    reduce_rows_kernel(KernelContext k, const uint8_t* y, const int32_t* recv_count,
                       const int32_t* expert_pos, const int32_t* row_experts,
                       const float* row_weights, uint8_t* rows_out) {
  const int M = k.cfg.max_tokens, H = k.cfg.hidden;
  const int s = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = min(max(recv_count[s], 0), M);
  const int j1 = min((static_cast<int>(blockIdx.y) + 1) * kRowsPerBlock, n);
  for (int j = blockIdx.y * kRowsPerBlock + warp; j < j1; j += kWarps) {
    const int64_t row = static_cast<int64_t>(s) * M + j;
    uint4* dst = reinterpret_cast<uint4*>(rows_out + row * H * 2);
    for (int v = lane; v < H / 8; v += 32)
      dst[v] = reduce_chunk<kDT>(k, y, row, v, expert_pos, row_experts, row_weights);
  }
}

// One warp per token. Slots to one destination were assigned in token order, so
// send_token[d * M + 0 .. count) is increasing: a binary search finds the slot.
template <DType kDT>
__global__ void __launch_bounds__(kThreads)
    combine_recv_kernel(KernelContext k, const CallTicket* ticket, const int32_t* send_token,
                        const int32_t* send_count, int32_t num_tokens, uint8_t* out,
                        uint64_t timeout_ns) {
  __shared__ int fail;
  __shared__ int32_t slot_of[kWarps][kMaxWorld];
  const WireConfig& c = k.cfg;
  const int W = c.world, M = c.max_tokens, H = c.hidden;
  const CallTicket t = *ticket;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) fail = 0;
  __syncthreads();
  for (int d = threadIdx.x; d < W; d += blockDim.x) {
    const FlagLine* f = flag_line_at(k.peers->recv_base[d], static_cast<int>(t.seq & 1u), d, c);
    if (wait_flag(f, t, d, M, send_count[d], timeout_ns, k.err) < 0) fail = 1;
  }
  __syncthreads();
  if (fail) return;
  const int tok = blockIdx.x * kWarps + warp;
  if (tok >= num_tokens) return;
  for (int d = lane; d < W; d += 32) {
    const int32_t* st = send_token + static_cast<int64_t>(d) * M;
    int lo = 0, hi = min(max(send_count[d], 0), M);  // search [lo, hi)
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (st[mid] < tok)
        lo = mid + 1;
      else
        hi = mid;
    }
    slot_of[warp][d] = (lo < min(max(send_count[d], 0), M) && st[lo] == tok) ? lo : -1;
  }
  __syncwarp();
  for (int v = lane; v < H / 8; v += 32) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int d = 0; d < W; ++d) {
      const int j = slot_of[warp][d];
      if (j < 0) continue;
      const uint8_t* row = combine_slot(k, k.peers->recv_base[d], static_cast<int>(t.parity), d, j);
      float f[8];
      unpack8<kDT>(reinterpret_cast<const uint4*>(row)[v], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], f[i]);
    }
    reinterpret_cast<uint4*>(out + static_cast<int64_t>(tok) * H * 2)[v] = pack8<kDT>(acc);
  }
}

// ---- copy-engine path (normal mode) ------------------------------------------------------
// Rows per destination rank, before any row moves: the host reads them to size the
// copy-engine transfers. Shared-memory histogram per block, then local atomics.
__global__ void __launch_bounds__(kThreads)
    count_destinations_kernel(KernelContext k, const int32_t* topk_ids, int32_t num_tokens,
                              int32_t topk, int32_t* counts) {
  __shared__ int32_t hist[kMaxWorld];
  const int W = k.cfg.world;
  for (int d = threadIdx.x; d < W; d += blockDim.x) hist[d] = 0;
  __syncthreads();
  const int tok = blockIdx.x * blockDim.x + threadIdx.x;
  if (tok < num_tokens) {
    uint64_t m = token_dest_mask(k, topk_ids, topk, tok);
    while (m) {
      atomicAdd(&hist[__ffsll(static_cast<long long>(m)) - 1], 1);
      m &= m - 1;
    }
  }
  __syncthreads();
  for (int d = threadIdx.x; d < W; d += blockDim.x)
    if (hist[d] != 0) atomicAdd(counts + d, hist[d]);
}

// The flag of one copy-engine transfer, enqueued on the copy's stream right after it.
// Stream order puts the copy's completion before this kernel; the system-scope fence
// then orders it before the release store, as publish_flags does for SM-stored rows.
__global__ void publish_one_kernel(KernelContext k, uint32_t seq, uint32_t op, int32_t dest,
                                   uint32_t count) {
  fence_acq_rel_sys();
  FlagLine* f = flag_line_at(k.peers->send_base[dest], static_cast<int>(seq & 1u), k.rank, k.cfg);
  st_relaxed_sys(&f->sig, op);
  st_release_sys(&f->word, pack_flag(seq, count));
}

unsigned cdiv(int64_t a, int64_t b) {
  return static_cast<unsigned>((a + b - 1) / b);
}

}  // namespace

// ---- launchers ---------------------------------------------------------------------------
void launch_begin_call(const KernelContext& k, CallTicket* ticket, uint32_t op, int family,
                       bool abort, cudaStream_t stream) {
  launch_kernel(begin_call_kernel, 1, 64, 0, stream, k, ticket, op, family, abort ? 1 : 0);
}

void launch_dispatch_send(const KernelContext& k, const CallTicket* ticket, const void* x,
                          int32_t num_tokens, const int32_t* topk_ids, const float* topk_weights,
                          int32_t topk, uint8_t* qbuf, int32_t* send_token, int32_t* send_count,
                          uint8_t* pack, uint64_t pack_mask, cudaStream_t stream) {
  // Few tokens per block for decode (more SMs pushing), more for prefill (the per-block
  // count of earlier tokens is redundant work that grows with the number of blocks).
  int tpb = static_cast<int>(cdiv(num_tokens, 256));
  tpb = tpb < 4 ? 4 : (tpb > kMaxTokPerBlock ? kMaxTokPerBlock : tpb);
  const unsigned grid = num_tokens > 0 ? cdiv(num_tokens, tpb) : 1;
  PA2A_SWITCH_WIRE(
      k.cfg, launch_kernel(dispatch_send_kernel<kDT, kFp8>, grid, kThreads, 0, stream, k, ticket,
                           static_cast<const uint16_t*>(x), num_tokens, topk_ids, topk_weights,
                           topk, tpb, qbuf, send_token, send_count, pack, pack_mask));
}

void launch_wait_counts(const KernelContext& k, const CallTicket* ticket, int32_t* counts,
                        uint64_t timeout_ns, bool tolerate_aborts, cudaStream_t stream) {
  launch_kernel(wait_counts_kernel, 1, kMaxWorld, 0, stream, k, ticket, counts, timeout_ns,
                tolerate_aborts ? 1 : 0);
}

void launch_unpack_rows(const KernelContext& k, const CallTicket* ticket, bool wait,
                        int32_t* counts, const int64_t* row_base, void* x_out, uint8_t* fp8_out,
                        float* scales_out, int32_t* src_rank, int32_t* src_token, int32_t* topk_ids,
                        float* topk_weights, int32_t* expert_count, uint64_t timeout_ns,
                        cudaStream_t stream) {
  if (k.num_local_experts > 0)
    cudaMemsetAsync(expert_count, 0, sizeof(int32_t) * k.num_local_experts, stream);
  const dim3 grid(static_cast<unsigned>(k.cfg.world), cdiv(k.cfg.max_tokens, kRowsPerBlock));
  PA2A_SWITCH_WIRE(
      k.cfg, launch_kernel(unpack_rows_kernel<kDT, kFp8>, grid, kThreads, 0, stream, k, ticket,
                           wait ? 1 : 0, counts, row_base, static_cast<uint8_t*>(x_out), fp8_out,
                           scales_out, src_rank, src_token, topk_ids, topk_weights, expert_count,
                           timeout_ns));
}

void launch_unpack_expert_major(const KernelContext& k, const CallTicket* ticket,
                                int32_t* recv_count, int32_t* cnt_ws, void* x_out, uint8_t* fp8_out,
                                float* scales_out, int32_t* expert_count, int32_t* src_info,
                                int64_t* layout_range, int32_t* expert_pos, int32_t* row_experts,
                                float* row_weights, uint64_t timeout_ns, cudaStream_t stream) {
  const int64_t cap = static_cast<int64_t>(k.cfg.world) * k.cfg.max_tokens;
  if (k.num_local_experts > 0)
    cudaMemsetAsync(src_info, 0xff, sizeof(int32_t) * cap * k.num_local_experts, stream);
  launch_kernel(em_count_kernel, static_cast<unsigned>(k.cfg.world), kThreads, 0, stream, k, ticket,
                recv_count, cnt_ws, expert_pos, row_experts, row_weights, timeout_ns);
  const dim3 grid(static_cast<unsigned>(k.cfg.world), cdiv(k.cfg.max_tokens, kRowsPerBlock));
  const size_t smem = sizeof(int32_t) * static_cast<size_t>(k.num_local_experts);
  PA2A_SWITCH_WIRE(
      k.cfg, launch_kernel(em_scatter_kernel<kDT, kFp8>, grid, kThreads, smem, stream, k, ticket,
                           recv_count, cnt_ws, static_cast<uint8_t*>(x_out), fp8_out, scales_out,
                           expert_count, src_info, layout_range, expert_pos, row_experts));
}

void launch_combine_send(const KernelContext& k, const CallTicket* ticket, const void* y,
                         const int32_t* recv_count, const int64_t* row_base,
                         const int32_t* expert_pos, const int32_t* row_experts,
                         const float* row_weights, uint64_t ce_mask, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(k.cfg.world), cdiv(k.cfg.max_tokens, kRowsPerBlock));
  const auto* yb = static_cast<const uint8_t*>(y);
  PA2A_SWITCH_WIRE(k.cfg, {
    (void)kFp8;
    if (expert_pos != nullptr)
      launch_kernel(combine_send_kernel<kDT, true>, grid, kThreads, 0, stream, k, ticket, yb,
                    recv_count, row_base, expert_pos, row_experts, row_weights, ce_mask);
    else
      launch_kernel(combine_send_kernel<kDT, false>, grid, kThreads, 0, stream, k, ticket, yb,
                    recv_count, row_base, expert_pos, row_experts, row_weights, ce_mask);
  });
}

void launch_count_destinations(const KernelContext& k, const int32_t* topk_ids, int32_t num_tokens,
                               int32_t topk, int32_t* counts, cudaStream_t stream) {
  cudaMemsetAsync(counts, 0, sizeof(int32_t) * static_cast<size_t>(k.cfg.world), stream);
  if (num_tokens == 0) return;
  launch_kernel(count_destinations_kernel, cdiv(num_tokens, kThreads), kThreads, 0, stream, k,
                topk_ids, num_tokens, topk, counts);
}

void launch_publish_one(const KernelContext& k, uint32_t seq, uint32_t op, int32_t dest,
                        uint32_t count, cudaStream_t stream) {
  launch_kernel(publish_one_kernel, 1, 1, 0, stream, k, seq, op, dest, count);
}

void launch_reduce_rows(const KernelContext& k, const void* y, const int32_t* recv_count,
                        const int32_t* expert_pos, const int32_t* row_experts,
                        const float* row_weights, void* rows_out, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(k.cfg.world), cdiv(k.cfg.max_tokens, kRowsPerBlock));
  PA2A_SWITCH_WIRE(k.cfg, {
    (void)kFp8;
    launch_kernel(reduce_rows_kernel<kDT>, grid, kThreads, 0, stream, k,
                  static_cast<const uint8_t*>(y), recv_count, expert_pos, row_experts, row_weights,
                  static_cast<uint8_t*>(rows_out));
  });
}

void launch_combine_recv(const KernelContext& k, const CallTicket* ticket,
                         const int32_t* send_token, const int32_t* send_count, int32_t num_tokens,
                         void* out, uint64_t timeout_ns, cudaStream_t stream) {
  const unsigned grid = num_tokens > 0 ? cdiv(num_tokens, kWarps) : 1;
  PA2A_SWITCH_WIRE(k.cfg, {
    (void)kFp8;
    launch_kernel(combine_recv_kernel<kDT>, grid, kThreads, 0, stream, k, ticket, send_token,
                  send_count, num_tokens, static_cast<uint8_t*>(out), timeout_ns);
  });
}

}  // namespace pa2a::cuda
