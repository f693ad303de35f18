// Send phase of dispatch: the begin kernel, dispatch_send (slots in token order as on the
// CPU, rows in planner order within a block, fp8 quantised per warp into the slot), and
// the copy-engine helpers. Protocol: device_protocol.cuh; index math and numerics come
// from the core headers the CPU transport uses, so both write the same bytes.
#include "cuda/transport/kernel_common.cuh"
#include "cuda/transport/staged_progress.cuh"

namespace pa2a::cuda {
namespace {

using namespace detail;  // NOLINT: the shared kernel helpers

__global__ void begin_call_kernel(KernelContext k, CallTicket* ticket, uint32_t op, int family,
                                  int abort) {
  griddep_wait();
  griddep_launch_dependents();
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

// One 128-channel fp8 group per step of the warp: lane l loads channels 4l..4l+3 (8
// coalesced bytes), the group's |max| is one integer max reduction over the warp (the
// host compares the same bit patterns, core/numeric.h quantize_fp8_group), and each lane
// stores its 4 bytes straight into the slot (the warp's 128 bytes are one contiguous
// store). Same arithmetic as the host: one fp32 division per value, saturating e4m3.
template <DType kDT>
__device__ __forceinline__ void quantize_row_to_slot(const uint16_t* xrow, int hidden, uint8_t* q,
                                                     float* scales, int lane) {
  for (int g = 0; g < hidden / kFp8GroupSize; ++g) {
    const uint2 raw = reinterpret_cast<const uint2*>(xrow + g * kFp8GroupSize)[lane];
    const uint16_t h[4] = {
        static_cast<uint16_t>(raw.x & 0xffffu), static_cast<uint16_t>(raw.x >> 16),
        static_cast<uint16_t>(raw.y & 0xffffu), static_cast<uint16_t>(raw.y >> 16)};
    float v[4];
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = kDT == DType::kBF16 ? bf16_to_float(h[i]) : fp16_to_float(h[i]);
      const uint32_t a = float_bits(v[i]) & 0x7fffffffu;
      m = a > m ? a : m;
    }
    const float amax = bits_float(__reduce_max_sync(kFull, m));
    const float scale = (amax > 1e-10f ? amax : 1e-10f) / kFp8Max;
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      packed |= static_cast<uint32_t>(float_to_fp8_e4m3(v[i] / scale)) << (8 * i);
    reinterpret_cast<uint32_t*>(q + g * kFp8GroupSize)[lane] = packed;
    if (lane == 0) scales[g] = scale;
  }
}

// Slot j of destination d is the j-th token (in token order) with an expert on d, as on
// the CPU. Each block takes a contiguous token range; it counts the rows of the tokens
// before its range per destination (redundantly, so no grid-wide scan is needed), then
// lays out its own rows destination by destination in the planner's order (so a block's
// warps start on the planner's first destination; across blocks all destinations still
// interleave: the order of rows over the whole grid is not the planner's), then one warp
// writes one row.
template <DType kDT, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    dispatch_send_kernel(KernelContext k, CallTicket* ticket, int begin, uint32_t op,
                         const uint16_t* x, int32_t num_tokens, const void* topk_ids, int ids64,
                         const float* topk_weights, int32_t topk, int32_t tok_per_block,
                         int32_t* send_token, int32_t* send_count, uint8_t* pack,
                         uint64_t pack_mask) {
  griddep_wait();
  __shared__ uint64_t mask[kMaxTokPerBlock];
  __shared__ int32_t base[kMaxWorld];
  __shared__ int32_t first_row[kMaxWorld];
  __shared__ uint32_t rows[kMaxTokPerBlock * kMaxWorld];
  __shared__ int32_t nrows;
  __shared__ int bad_sh;
  __shared__ __align__(16) int32_t wid[kWarps][kMaxTopk];
  __shared__ __align__(16) float wwt[kWarps][kMaxTopk];

  const WireConfig& c = k.cfg;
  const int W = c.world, M = c.max_tokens, H = c.hidden;
  const CallTicket t = call_ticket(k, ticket, begin != 0, 0, op);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int t0 = blockIdx.x * tok_per_block;
  const int ntok = max(0, min(num_tokens, t0 + tok_per_block) - t0);
  const int E = k.placement.num_experts;
  const uint64_t may_store = pull::await_consumed(k, t, kDispatchRegion, ~0ull);
  griddep_launch_dependents();  // after its only wait (pulled readers' consumed lines)

  for (int d = tid; d < W; d += blockDim.x) base[d] = 0;
  if (tid == 0) bad_sh = 0;
  __syncthreads();
  bool bad = false;  // earlier tokens are another block's to report
  for (int tt = tid; tt < t0 && tt < num_tokens; tt += blockDim.x) {
    uint64_t m = token_dest_mask(k, topk_ids, ids64, topk, tt, &bad);
    while (m) {
      atomicAdd(&base[__ffsll(static_cast<long long>(m)) - 1], 1);
      m &= m - 1;
    }
  }
  bad = false;
  for (int i = tid; i < ntok; i += blockDim.x)
    mask[i] = token_dest_mask(k, topk_ids, ids64, topk, t0 + i, &bad);
  if (bad) bad_sh = 1;
  __syncthreads();
  if (tid == 0) {
    if (bad_sh) record_error(k.err, DeviceError::kBadInput, t.op, k.rank, t.seq);
    int r = 0;
    for (int i = 0; i < W; ++i) {
      const int d = k.peers->order[i];
      first_row[d] = r;
      for (int q = 0; q < ntok; ++q) r += static_cast<int>((mask[q] >> d) & 1ull);
    }
    nrows = r;
  }
  __syncthreads();
  for (int d = tid; d < W; d += blockDim.x) {
    int j = base[d], r = first_row[d];
    for (int i = 0; i < ntok; ++i) {
      if (!((mask[i] >> d) & 1ull)) continue;
      rows[r++] = (static_cast<uint32_t>(j) << 12) | (static_cast<uint32_t>(i) << 6) |
                  static_cast<uint32_t>(d);
      send_token[static_cast<int64_t>(d) * M + j] = t0 + i;
      ++j;
    }
    if (blockIdx.x == gridDim.x - 1) send_count[d] = j;
  }
  __syncthreads();
  if (blockIdx.x == 0 && op == static_cast<uint32_t>(OpCode::kLowLatencyDispatch))
    publish_early_lines(k, t, topk_ids, ids64, topk, num_tokens, pack_mask);  // before any row

  const int kvec = static_cast<int>((k.slot.weights_off - k.slot.experts_off) / 16);
  const int pvec = static_cast<int>((k.slot.bytes - k.slot.payload_off) / 16);
  for (int r = warp; r < nrows; r += kWarps) {
    const uint32_t packed = rows[r];
    const int d = static_cast<int>(packed & 63u), i = static_cast<int>((packed >> 6) & 63u);
    const int j = static_cast<int>(packed >> 12);
    if (!((may_store >> d) & 1ull)) continue;  // its reader never consumed: no stores
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
      bool hit = false, ignored = false;
      int32_t l = 0;
      float w = 0.0f;
      if (kk < topk) {
        const int32_t e =
            routed_expert(topk_ids, ids64, static_cast<int64_t>(tok) * topk, kk, E, &ignored);
        if (e >= 0) {
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
    // slot j of d at pack[d * M + j], the exact bytes the slot will hold. A staged
    // destination's row carries its own arrival mark (header word 1 = {rank, seq}),
    // stored last below; every other row's header is complete at once.
    const bool ce = (pack_mask >> d) & 1ull;
    const bool drain = !ce && ((k.peers->staged_send >> d) & 1ull);
    uint8_t* slot = ce ? pack + (static_cast<size_t>(d) * M + j) * k.seg.dispatch_slot
                       : pull::send_slot(k, kDispatchRegion, static_cast<int>(t.parity), d, j);
    if (lane == 0) {
      if (drain)
        *reinterpret_cast<int2*>(slot) = make_int2(tok, n);
      else
        *reinterpret_cast<int4*>(slot) = make_int4(tok, n, k.rank, static_cast<int>(t.seq));
    }
    for (int q = lane; q < kvec; q += 32) {
      reinterpret_cast<int4*>(slot + k.slot.experts_off)[q] =
          reinterpret_cast<const int4*>(wid[warp])[q];
      reinterpret_cast<float4*>(slot + k.slot.weights_off)[q] =
          reinterpret_cast<const float4*>(wwt[warp])[q];
    }
    const uint16_t* xrow = x + static_cast<size_t>(tok) * H;
    if constexpr (kFp8) {
      quantize_row_to_slot<kDT>(xrow, H, slot + k.slot.payload_off,
                                reinterpret_cast<float*>(slot + k.slot.scales_off), lane);
    } else {
      const uint4* src = reinterpret_cast<const uint4*>(xrow);
      uint4* dst = reinterpret_cast<uint4*>(slot + k.slot.payload_off);
      for (int q = lane; q < pvec; q += 32) dst[q] = src[q];
    }
    if (drain) {
      fence_acq_rel_sys();  // this lane's part of the row before the mark (all lanes fence)
      __syncwarp();
      if (lane == 0)
        st_release_sys(reinterpret_cast<uint64_t*>(slot + 8),
                       (static_cast<uint64_t>(t.seq) << 32) | static_cast<uint32_t>(k.rank));
    }
    __syncwarp();  // wid/wwt are reused by this warp's next row
  }
  finish_send(k, t, 0, begin != 0, ticket, send_count, ~pack_mask);
}

// Rows per destination rank, before any row moves: the host reads them to size the
// copy-engine transfers. Shared-memory histogram per block, then local atomics.
__global__ void __launch_bounds__(kThreads)
    count_destinations_kernel(KernelContext k, const void* topk_ids, int ids64, int32_t num_tokens,
                              int32_t topk, int32_t* counts) {
  griddep_wait();
  griddep_launch_dependents();
  __shared__ int32_t hist[kMaxWorld];
  const int W = k.cfg.world;
  for (int d = threadIdx.x; d < W; d += blockDim.x) hist[d] = 0;
  __syncthreads();
  const int tok = blockIdx.x * blockDim.x + threadIdx.x;
  if (tok < num_tokens) {
    bool bad = false;  // reported by dispatch_send
    uint64_t m = token_dest_mask(k, topk_ids, ids64, topk, tok, &bad);
    while (m) {
      atomicAdd(&hist[__ffsll(static_cast<long long>(m)) - 1], 1);
      m &= m - 1;
    }
  }
  __syncthreads();
  for (int d = threadIdx.x; d < W; d += blockDim.x)
    if (hist[d] != 0) atomicAdd(counts + d, hist[d]);
}

// The flag of one copy-engine transfer when stream memory operations are unavailable,
// enqueued on the copy's stream right after it. Stream order puts the copy's completion
// before this kernel; the system-scope fence then orders it before the release store, as
// finish_send does for SM-stored rows. (The preferred path, cuStreamWriteValue with its
// memory barrier, is in cuda_transport.cu; why: see docs/cuda_transport.md.)
__global__ void publish_one_kernel(KernelContext k, uint32_t seq, uint32_t op, int32_t dest,
                                   uint32_t count) {
  griddep_wait();
  griddep_launch_dependents();
  fence_acq_rel_sys();
  FlagLine* f = flag_line_at(k.peers->send_base[dest], static_cast<int>(seq & 1u), k.rank, k.cfg);
  st_relaxed_sys(&f->sig, op);
  st_release_sys(&f->word, pack_flag(seq, count));
}

}  // namespace

void load_send_kernels() {
  PA2A_LOAD(begin_call_kernel);
  PA2A_LOAD((dispatch_send_kernel<DType::kBF16, false>));
  PA2A_LOAD((dispatch_send_kernel<DType::kBF16, true>));
  PA2A_LOAD((dispatch_send_kernel<DType::kFP16, false>));
  PA2A_LOAD((dispatch_send_kernel<DType::kFP16, true>));
  PA2A_LOAD(count_destinations_kernel);
  PA2A_LOAD(publish_one_kernel);
}

void launch_begin_call(const KernelContext& k, CallTicket* ticket, uint32_t op, int family,
                       bool abort, cudaStream_t stream) {
  launch_kernel(begin_call_kernel, 1, 64, 0, stream, k.pdl, k, ticket, op, family, abort ? 1 : 0);
}

void launch_dispatch_send(const KernelContext& k, CallTicket* ticket, bool begin, uint32_t op,
                          const void* x, int32_t num_tokens, const void* topk_ids, bool ids64,
                          const float* topk_weights, int32_t topk, int32_t* send_token,
                          int32_t* send_count, uint8_t* pack, uint64_t pack_mask,
                          cudaStream_t stream) {
  // Few tokens per block for decode (more SMs pushing), more for prefill (the per-block
  // count of earlier tokens is redundant work that grows with the number of blocks).
  int tpb = static_cast<int>(cdiv(num_tokens, 256));
  tpb = tpb < 4 ? 4 : (tpb > kMaxTokPerBlock ? kMaxTokPerBlock : tpb);
  const unsigned grid = num_tokens > 0 ? cdiv(num_tokens, tpb) : 1;
  PA2A_SWITCH_WIRE(
      k.cfg, launch_kernel(dispatch_send_kernel<kDT, kFp8>, grid, kThreads, 0, stream, k.pdl, k,
                           ticket, begin ? 1 : 0, op, static_cast<const uint16_t*>(x), num_tokens,
                           topk_ids, ids64 ? 1 : 0, topk_weights, topk, tpb, send_token, send_count,
                           pack, pack_mask));
}

void launch_count_destinations(const KernelContext& k, const void* topk_ids, bool ids64,
                               int32_t num_tokens, int32_t topk, int32_t* counts,
                               cudaStream_t stream) {
  cudaMemsetAsync(counts, 0, sizeof(int32_t) * static_cast<size_t>(k.cfg.world), stream);
  if (num_tokens == 0) return;
  launch_kernel(count_destinations_kernel, cdiv(num_tokens, kThreads), kThreads, 0, stream, k.pdl,
                k, topk_ids, ids64 ? 1 : 0, num_tokens, topk, counts);
}

void launch_publish_one(const KernelContext& k, uint32_t seq, uint32_t op, int32_t dest,
                        uint32_t count, cudaStream_t stream) {
  launch_kernel(publish_one_kernel, 1, 1, 0, stream, k.pdl, k, seq, op, dest, count);
}

}  // namespace pa2a::cuda
