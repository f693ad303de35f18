// Receive phase of dispatch: wait_counts (normal mode), unpack_rows (rows layout) and the
// expert-major receive, as work items (device_protocol.cuh: pollers first, then the items
// that wait on their mirrors; the grid is capped at max_recv_blocks).
#include "cuda/transport/kernel_common.cuh"
#include "cuda/transport/staged_progress.cuh"

namespace pa2a::cuda {
namespace {

using namespace detail;  // NOLINT: the shared kernel helpers

__global__ void wait_counts_kernel(KernelContext k, const CallTicket* ticket, int32_t* counts,
                                   uint64_t timeout_ns, int tolerate_aborts) {
  griddep_wait();
  const CallTicket t = *ticket;
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < k.cfg.world; s += blockDim.x) {
    const FlagLine* f = flag_line_at(k.peers->recv_base[s], static_cast<int>(t.seq & 1u), s, k.cfg);
    const int32_t n =
        wait_flag(f, t, s, k.cfg.max_tokens, -1, timeout_ns, k.err, tolerate_aborts != 0);
    counts[s] = n < 0 ? 0 : n;
    if (n < 0) failed = 1;
  }
  __syncthreads();              // this rank reads nothing of the call: its pulled sources may reuse
  griddep_launch_dependents();  // after the waits (device_protocol.cuh, "Dependent launch")
  if (tolerate_aborts != 0 || failed != 0) pull::publish_consumed(k, t, pull::region_of(t.op));
}

// Poller of source s (one thread). wait: acquires the flag (deadline) and writes counts[s].
// Otherwise (normal mode: wait_counts saw every flag) it re-acquires the flag, which makes
// the rows causally after the sender's release for this kernel's readers. Then the mirror.
__device__ __forceinline__ void poll_source(const KernelContext& k, const CallTicket& t, int s,
                                            bool wait, int32_t* counts, uint64_t timeout_ns) {
  const FlagLine* f = flag_line_at(k.peers->recv_base[s], static_cast<int>(t.seq & 1u), s, k.cfg);
  int32_t n;
  if (wait) {
    n = wait_flag(f, t, s, k.cfg.max_tokens, -1, timeout_ns, k.err);
    counts[s] = n < 0 ? 0 : n;
  } else {
    n = flag_seq(ld_acquire_sys(&f->word)) == t.seq ? counts[s] : -1;
  }
  publish_mirror(k.state, s, t.seq, n);
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

// Whether row j of staged source s is there (one warp, the same answer in every lane):
// its header mark (stored last by the sender, release) holds this call, or the source's
// count is known (mirror) and j is past it. Rows are drained as they arrive instead of
// after the source's flag. false also when the wait gave up (recorded). Lane 0 acquires the
// mark; the shuffle hands its answer to the other lanes but orders no memory (PTX memory
// model), so the __syncwarp after it is what makes the row causally after the sender's
// release for every lane that then reads it.
__device__ __forceinline__ bool staged_row_arrived(const KernelContext& k, const CallTicket& t,
                                                   const uint8_t* slot, int s, int j,
                                                   uint64_t timeout_ns, int lane) {
  int state = 0;  // 0 waiting, 1 row present, 2 no row
  if (lane == 0) {
    Poll poll(timeout_ns);
    for (;;) {
      if ((ld_acquire_sys(reinterpret_cast<const uint64_t*>(slot + 8)) >> 32) == t.seq) {
        state = 1;
        break;
      }
      const uint64_t m = ld_acquire_gpu(&k.state->mirror[s]);
      if (flag_seq(m) == t.seq && (flag_count(m) == kMirrorFailed || j >= int(flag_count(m)))) {
        state = 2;
        break;
      }
      if (!poll.again(k.err)) {
        if (poll.expired()) record_error(k.err, DeviceError::kTimeout, t.op, s, t.seq);
        state = 2;
        break;
      }
    }
  }
  const bool arrived = __shfl_sync(kFull, state, 0) == 1;
  __syncwarp();  // lane 0's acquire -> every lane's reads of the row
  return arrived;
}

// Items: [0, W) pollers (source s), then (chunk c, source s) = W + c * W + s: rows
// [16c, 16c + 16) of s. Output row (s, j) = row_base[s] + j (row_base null: s * M + j).
template <DType kDT, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    unpack_rows_kernel(KernelContext k, const CallTicket* ticket, int wait, int32_t* counts,
                       const int64_t* row_base, uint8_t* x_out, uint8_t* fp8_out, float* scales_out,
                       int32_t* src_rank, int32_t* src_token, int32_t* ids_out, float* ws_out,
                       int32_t* expert_count, uint64_t timeout_ns) {
  griddep_wait();
  __shared__ int32_t n_sh;
  const WireConfig& c = k.cfg;
  const int W = c.world, M = c.max_tokens, K = c.num_topk, H = c.hidden, G = H / kFp8GroupSize;
  const CallTicket t = *ticket;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t total = static_cast<uint32_t>(W) * (1u + cdiv(M, kRowsPerBlock));
  for (uint32_t item = next_item(k); item < total; item = next_item(k)) {
    if (item < static_cast<uint32_t>(W)) {
      if (threadIdx.x == 0)
        poll_source(k, t, static_cast<int>(item), wait != 0, counts, timeout_ns);
      continue;
    }
    const int s = static_cast<int>((item - W) % W),
              j0 = static_cast<int>((item - W) / W) * kRowsPerBlock;
    const bool drain = wait && ((k.peers->staged_recv >> s) & 1ull);
    if (!drain) {
      if (threadIdx.x == 0) {
        const int32_t n = wait_mirror(k.state, s, t, timeout_ns, k.err);
        n_sh = n < 0 ? 0 : n;
      }
      __syncthreads();
    }
    const int n = drain ? M : n_sh;
    const int j1 = min(j0 + kRowsPerBlock, wait ? M : n);
    for (int j = j0 + warp; j < j1; j += kWarps) {
      const int64_t i = row_base != nullptr ? row_base[s] + j : static_cast<int64_t>(s) * M + j;
      const uint8_t* slot = pull::recv_slot(k, kDispatchRegion, static_cast<int>(t.parity), s, j);
      const bool have = drain ? staged_row_arrived(k, t, slot, s, j, timeout_ns, lane) : j < n;
      if (!have) {  // low-latency static shape: mark the unused row
        for (int q = lane; q < K; q += 32) {
          ids_out[i * K + q] = -1;
          ws_out[i * K + q] = 0.0f;
        }
        if (lane == 0) src_rank[i] = src_token[i] = -1;
        continue;
      }
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
        if (q < h.y && e >= 0 && e < k.num_local_experts) atomicAdd(k.ecount + e, 1);
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
  griddep_launch_dependents();  // after the last wait (device_protocol.cuh)
  finish_recv(k, expert_count, t, kDispatchRegion);
}

// ---- expert-major: one kernel ------------------------------------------------------------
// Items: [0, W) count items (source s: the poller of s; the row metadata and each row's
// position among s's rows of each local expert, by warp ballots in (row, k) order as on
// the CPU; cnt_ws[e * W + s]; then the mirror, which tells the other items that s is
// counted); then scatter items (chunk c, source s) = W + c * W + s, which wait for the
// mirrors of sources 0..s (the begin of s in each expert's list is the sum over earlier
// sources) and copy rows to every local expert; then tail items (8 experts each), which
// wait for every mirror and write tokens_per_expert and src_info's padding.
// Dynamic shared memory: E_local int32 begins.
template <DType kDT, bool kFp8>
__global__ void __launch_bounds__(kThreads)
    em_recv_kernel(KernelContext k, const CallTicket* ticket, int32_t* recv_count, uint8_t* x_out,
                   uint8_t* fp8_out, float* scales_out, int32_t* expert_count, int32_t* src_info,
                   int64_t* layout_range, int32_t* expert_pos, int32_t* row_experts,
                   float* row_weights, uint64_t timeout_ns) {
  griddep_wait();
  int32_t* const begin_sh = dynamic_smem<int32_t>();  // [E_local]
  __shared__ int32_t n_sh;
  __shared__ int fail_sh;
  __shared__ int64_t dst_sh[kWarps][kMaxTopk];
  const WireConfig& c = k.cfg;
  const int W = c.world, M = c.max_tokens, K = c.num_topk, H = c.hidden, G = H / kFp8GroupSize;
  const int E = k.num_local_experts;
  const int64_t cap = static_cast<int64_t>(W) * M;
  int32_t* const cnt_ws = k.cnt_ws;
  const CallTicket t = *ticket;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t chunks = cdiv(M, kRowsPerBlock);
  const uint32_t scatter_end = static_cast<uint32_t>(W) * (1u + chunks);
  const uint32_t flags_end = scatter_end + static_cast<uint32_t>(W);  // staged sources' flags
  const uint32_t total = flags_end + cdiv(E, kWarps);
  for (uint32_t item = next_item(k); item < total; item = next_item(k)) {
    if (item < static_cast<uint32_t>(W)) {  // ---- count items
      const int s = static_cast<int>(item);
      if (em_drains(k, s)) {  // staged: from its early line and row marks, not its flag
        em_count_staged(k, t, s, recv_count, expert_pos, row_experts, row_weights, begin_sh,
                        timeout_ns);
        continue;
      }
      if (threadIdx.x == 0) {
        const FlagLine* f = flag_line_at(k.peers->recv_base[s], static_cast<int>(t.seq & 1u), s, c);
        const int32_t n = wait_flag(f, t, s, M, -1, timeout_ns, k.err);
        n_sh = n;
        recv_count[s] = n < 0 ? 0 : n;
      }
      __syncthreads();
      const int n = n_sh < 0 ? 0 : n_sh;
      const int64_t row0 = static_cast<int64_t>(s) * M;
      for (int idx = threadIdx.x; idx < M * K; idx += blockDim.x) {
        const int j = idx / K, kk = idx % K;
        int32_t e = -1;
        float w = 0.0f;
        if (j < n)
          slot_route(k, pull::recv_slot(k, kDispatchRegion, static_cast<int>(t.parity), s, j), kk,
                     E, &e, &w);
        row_experts[(row0 + j) * K + kk] = e;
        row_weights[(row0 + j) * K + kk] = w;
        expert_pos[(row0 + j) * K + kk] = -1;
      }
      __syncthreads();
      // Position of each (row j, slot k) of expert e among source s's entries of e, in (j, k)
      // order, 32 rows per step.
      for (int e = warp; e < E; e += kWarps) {
        int running = 0;
        for (int jb = 0; jb < n; jb += 32)
          running +=
              place_expert_entries(row_experts, expert_pos, row0, jb, n, K, e, running, lane);
        if (lane == 0) cnt_ws[e * W + s] = running;
      }
      __threadfence();  // this thread's metadata before the mirror (all threads fence)
      __syncthreads();
      if (threadIdx.x == 0) publish_mirror(k.state, s, t.seq, n_sh);
      continue;
    }
    if (item < scatter_end) {  // ---- scatter items
      const int s = static_cast<int>((item - W) % W);
      const int j0 = static_cast<int>((item - W) / W) * kRowsPerBlock;
      if (threadIdx.x == 0) {
        fail_sh = 0;
        n_sh = 0;
      }
      __syncthreads();
      for (int r = threadIdx.x; r <= s; r += blockDim.x) {
        const int32_t n = em_wait_source(k, t, r, r == s ? j0 : -1, timeout_ns);
        if (n < 0 && timed_out_elsewhere(k.err)) fail_sh = 1;
        if (r == s) n_sh = n < 0 ? 0 : n;
      }
      __syncthreads();
      if (fail_sh) continue;
      for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int32_t b = 0;
        for (int r = 0; r < s; ++r) b += __ldcg(cnt_ws + e * W + r);
        begin_sh[e] = b;
        if (j0 == 0)
          layout_range[static_cast<int64_t>(e) * W + s] =
              (static_cast<int64_t>(b) << 32) | static_cast<uint32_t>(__ldcg(cnt_ws + e * W + s));
      }
      __syncthreads();
      const int j1 = min(j0 + kRowsPerBlock, n_sh);
      for (int j = j0 + warp; j < j1; j += kWarps) {
        const int64_t row = static_cast<int64_t>(s) * M + j;
        const uint8_t* slot = pull::recv_slot(k, kDispatchRegion, static_cast<int>(t.parity), s, j);
        const int32_t src_tok = reinterpret_cast<const int32_t*>(slot)[0];
        for (int kk = lane; kk < K; kk += 32) {
          const int32_t e = __ldcg(row_experts + row * K + kk);
          int64_t dst = -1;
          if (e >= 0) {
            const int32_t p = __ldcg(expert_pos + row * K + kk) + begin_sh[e];
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
      continue;
    }
    if (item < flags_end) {  // ---- flag items (draining sources only)
      if (threadIdx.x == 0)
        em_finish_staged(k, t, static_cast<int>(item - scatter_end), recv_count, timeout_ns);
      continue;
    }
    // ---- tail items: experts [8g, 8g + 8), one warp each
    if (threadIdx.x == 0) fail_sh = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < W; r += blockDim.x)
      if (wait_mirror(k.state, r, t, timeout_ns, k.err) < 0 && timed_out_elsewhere(k.err))
        fail_sh = 1;
    __syncthreads();
    if (fail_sh) continue;
    const int e = static_cast<int>(item - flags_end) * kWarps + warp;
    if (e < E) {
      int32_t sum = 0;
      for (int r = 0; r < W; ++r) sum += __ldcg(cnt_ws + e * W + r);
      if (lane == 0) expert_count[e] = sum;
      for (int64_t p = sum + lane; p < cap; p += 32)
        src_info[static_cast<int64_t>(e) * cap + p] = -1;
    }
  }
  griddep_launch_dependents();  // after the last wait (device_protocol.cuh)
  finish_recv(k, nullptr, t, kDispatchRegion);
}

}  // namespace

void load_recv_kernels() {
  PA2A_LOAD(wait_counts_kernel);
  PA2A_LOAD((unpack_rows_kernel<DType::kBF16, false>));
  PA2A_LOAD((unpack_rows_kernel<DType::kBF16, true>));
  PA2A_LOAD((unpack_rows_kernel<DType::kFP16, false>));
  PA2A_LOAD((unpack_rows_kernel<DType::kFP16, true>));
  PA2A_LOAD((em_recv_kernel<DType::kBF16, false>));
  PA2A_LOAD((em_recv_kernel<DType::kBF16, true>));
  PA2A_LOAD((em_recv_kernel<DType::kFP16, false>));
  PA2A_LOAD((em_recv_kernel<DType::kFP16, true>));
}

void launch_wait_counts(const KernelContext& k, const CallTicket* ticket, int32_t* counts,
                        uint64_t timeout_ns, bool tolerate_aborts, cudaStream_t stream) {
  launch_kernel(wait_counts_kernel, 1, kMaxWorld, 0, stream, k.pdl, k, ticket, counts, timeout_ns,
                tolerate_aborts ? 1 : 0);
}

void launch_unpack_rows(const KernelContext& k, const CallTicket* ticket, bool wait,
                        int32_t* counts, const int64_t* row_base, void* x_out, uint8_t* fp8_out,
                        float* scales_out, int32_t* src_rank, int32_t* src_token, int32_t* topk_ids,
                        float* topk_weights, int32_t* expert_count, uint64_t timeout_ns,
                        cudaStream_t stream) {
  const int64_t items =
      static_cast<int64_t>(k.cfg.world) * (1 + cdiv(k.cfg.max_tokens, kRowsPerBlock));
  PA2A_SWITCH_WIRE(
      k.cfg, launch_kernel(unpack_rows_kernel<kDT, kFp8>, recv_grid(k, items), kThreads, 0, stream,
                           k.pdl, k, ticket, wait ? 1 : 0, counts, row_base,
                           static_cast<uint8_t*>(x_out), fp8_out, scales_out, src_rank, src_token,
                           topk_ids, topk_weights, expert_count, timeout_ns));
}

void launch_unpack_expert_major(const KernelContext& k, const CallTicket* ticket,
                                int32_t* recv_count, void* x_out, uint8_t* fp8_out,
                                float* scales_out, int32_t* expert_count, int32_t* src_info,
                                int64_t* layout_range, int32_t* expert_pos, int32_t* row_experts,
                                float* row_weights, uint64_t timeout_ns, cudaStream_t stream) {
  const int64_t items =
      static_cast<int64_t>(k.cfg.world) * (2 + cdiv(k.cfg.max_tokens, kRowsPerBlock)) +
      cdiv(k.num_local_experts, kWarps);
  const size_t smem = sizeof(int32_t) * static_cast<size_t>(k.num_local_experts);
  PA2A_SWITCH_WIRE(
      k.cfg, launch_kernel(em_recv_kernel<kDT, kFp8>, recv_grid(k, items), kThreads, smem, stream,
                           k.pdl, k, ticket, recv_count, static_cast<uint8_t*>(x_out), fp8_out,
                           scales_out, expert_count, src_info, layout_range, expert_pos,
                           row_experts, row_weights, timeout_ns));
}

}  // namespace pa2a::cuda
