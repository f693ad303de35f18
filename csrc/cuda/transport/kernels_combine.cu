// Combine phase: combine_send (rows back to their sources, or the fused expert-major
// pre-reduction), the pre-reduction alone, and combine_recv (pollers, then one warp per
// token summing the partials in the CPU's order).
#include "cuda/transport/kernel_common.cuh"
#include "cuda/transport/staged_progress.cuh"

namespace pa2a::cuda {
namespace {

using namespace detail;  // NOLINT: the shared kernel helpers

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
    combine_send_kernel(KernelContext k, CallTicket* ticket, int begin, uint32_t op,
                        const uint8_t* y, const int32_t* recv_count, const int64_t* row_base,
                        const int32_t* expert_pos, const int32_t* row_experts,
                        const float* row_weights, uint64_t ce_mask) {
  griddep_wait();
  const WireConfig& c = k.cfg;
  const int M = c.max_tokens, H = c.hidden;
  const int s = blockIdx.x;
  const CallTicket t = call_ticket(k, ticket, begin != 0, 1, op);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Sources in ce_mask get their rows from the copy engine (rows layout only); a pulling
  // source that never consumed this parity's last call gets none (pull.cuh).
  const bool store = (pull::await_consumed(k, t, kCombineRegion, 1ull << s) >> s) & 1ull;
  griddep_launch_dependents();  // after its only wait (pulled readers' consumed lines)
  const int n = ((ce_mask >> s) & 1ull) || !store ? 0 : min(max(recv_count[s], 0), M);
  const int j1 = min((static_cast<int>(blockIdx.y) + 1) * kRowsPerBlock, n);
  for (int j = blockIdx.y * kRowsPerBlock + warp; j < j1; j += kWarps) {
    uint4* dst = reinterpret_cast<uint4*>(
        pull::send_slot(k, kCombineRegion, static_cast<int>(t.parity), s, j));
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
  publish_chunk_mark(k, t, s, static_cast<int>(blockIdx.y),
                     j1 - static_cast<int>(blockIdx.y) * kRowsPerBlock);
  finish_send(k, t, 1, begin != 0, ticket, recv_count, ~ce_mask);
}

template <DType kDT>
__global__ void __launch_bounds__(kThreads)
    reduce_rows_kernel(KernelContext k, const uint8_t* y, const int32_t* recv_count,
                       const int32_t* expert_pos, const int32_t* row_experts,
                       const float* row_weights, uint8_t* rows_out) {
  griddep_wait();
  griddep_launch_dependents();
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

// Items: [0, W) pollers (source d: acquire its flag, check its count against send_count,
// mirror it), then blocks of kWarps tokens, one warp per token. Slots to one destination
// were assigned in token order, so send_token[d * M + 0 .. count) is increasing: a binary
// search finds the slot.
template <DType kDT>
__global__ void __launch_bounds__(kThreads)
    combine_recv_kernel(KernelContext k, const CallTicket* ticket, const int32_t* send_token,
                        const int32_t* send_count, int32_t num_tokens, uint8_t* out,
                        uint64_t timeout_ns) {
  griddep_wait();
  __shared__ int fail;
  __shared__ int32_t slot_of[kWarps][kMaxWorld];
  const WireConfig& c = k.cfg;
  const int W = c.world, M = c.max_tokens, H = c.hidden;
  const CallTicket t = *ticket;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t total = static_cast<uint32_t>(2 * W) + cdiv(num_tokens, kWarps);
  for (uint32_t item = next_item(k); item < total; item = next_item(k)) {
    if (item < static_cast<uint32_t>(W)) {
      if (threadIdx.x == 0 && !staged_from(k, static_cast<int>(item))) {  // staged: at the end
        const int d = static_cast<int>(item);
        const FlagLine* f = flag_line_at(k.peers->recv_base[d], static_cast<int>(t.seq & 1u), d, c);
        publish_mirror(k.state, d, t.seq, wait_flag(f, t, d, M, send_count[d], timeout_ns, k.err));
      }
      continue;
    }
    if (item >= total - W) {  // staged sources' flags, after their rows were reduced
      if (threadIdx.x == 0)
        finish_staged_combine(k, t, static_cast<int>(item - (total - W)), send_count, timeout_ns);
      continue;
    }
    if (threadIdx.x == 0) fail = 0;
    __syncthreads();
    for (int d = threadIdx.x; d < W; d += blockDim.x)
      if (!staged_from(k, d) && wait_mirror(k.state, d, t, timeout_ns, k.err) < 0) fail = 1;
    __syncthreads();
    if (fail) continue;
    const int tok = static_cast<int>(item - W) * kWarps + warp;
    if (tok >= num_tokens) continue;
    for (int d = lane; d < W; d += 32) {
      const int32_t* st = send_token + static_cast<int64_t>(d) * M;
      const int cnt = min(max(send_count[d], 0), M);
      int lo = 0, hi = cnt;  // search [lo, hi)
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (st[mid] < tok)
          lo = mid + 1;
        else
          hi = mid;
      }
      slot_of[warp][d] = (lo < cnt && st[lo] == tok) ? lo : -1;
    }
    __syncwarp();
    if (!combine_chunks_arrived(k, t, slot_of[warp], send_count, timeout_ns, lane)) continue;
    for (int v = lane; v < H / 8; v += 32) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int d = 0; d < W; ++d) {
        const int j = slot_of[warp][d];
        if (j < 0) continue;
        const uint8_t* row = pull::recv_slot(k, kCombineRegion, static_cast<int>(t.parity), d, j);
        float f[8];
        unpack8<kDT>(reinterpret_cast<const uint4*>(row)[v], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], f[i]);
      }
      reinterpret_cast<uint4*>(out + static_cast<int64_t>(tok) * H * 2)[v] = pack8<kDT>(acc);
    }
    __syncwarp();  // slot_of is rewritten by this warp's next token
  }
  griddep_launch_dependents();  // after the last wait (device_protocol.cuh)
  finish_recv(k, nullptr, t, kCombineRegion);
}

}  // namespace

void load_combine_kernels() {
  PA2A_LOAD((combine_send_kernel<DType::kBF16, false>));
  PA2A_LOAD((combine_send_kernel<DType::kBF16, true>));
  PA2A_LOAD((combine_send_kernel<DType::kFP16, false>));
  PA2A_LOAD((combine_send_kernel<DType::kFP16, true>));
  PA2A_LOAD(reduce_rows_kernel<DType::kBF16>);
  PA2A_LOAD(reduce_rows_kernel<DType::kFP16>);
  PA2A_LOAD(combine_recv_kernel<DType::kBF16>);
  PA2A_LOAD(combine_recv_kernel<DType::kFP16>);
}

void launch_combine_send(const KernelContext& k, CallTicket* ticket, bool begin, uint32_t op,
                         const void* y, const int32_t* recv_count, const int64_t* row_base,
                         const int32_t* expert_pos, const int32_t* row_experts,
                         const float* row_weights, uint64_t ce_mask, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(k.cfg.world), cdiv(k.cfg.max_tokens, kRowsPerBlock));
  const auto* yb = static_cast<const uint8_t*>(y);
  PA2A_SWITCH_WIRE(k.cfg, {
    (void)kFp8;
    if (expert_pos != nullptr)
      launch_kernel(combine_send_kernel<kDT, true>, grid, kThreads, 0, stream, k.pdl, k, ticket,
                    begin ? 1 : 0, op, yb, recv_count, row_base, expert_pos, row_experts,
                    row_weights, ce_mask);
    else
      launch_kernel(combine_send_kernel<kDT, false>, grid, kThreads, 0, stream, k.pdl, k, ticket,
                    begin ? 1 : 0, op, yb, recv_count, row_base, expert_pos, row_experts,
                    row_weights, ce_mask);
  });
}

void launch_reduce_rows(const KernelContext& k, const void* y, const int32_t* recv_count,
                        const int32_t* expert_pos, const int32_t* row_experts,
                        const float* row_weights, void* rows_out, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(k.cfg.world), cdiv(k.cfg.max_tokens, kRowsPerBlock));
  PA2A_SWITCH_WIRE(k.cfg, {
    (void)kFp8;
    launch_kernel(reduce_rows_kernel<kDT>, grid, kThreads, 0, stream, k.pdl, k,
                  static_cast<const uint8_t*>(y), recv_count, expert_pos, row_experts, row_weights,
                  static_cast<uint8_t*>(rows_out));
  });
}

void launch_combine_recv(const KernelContext& k, const CallTicket* ticket,
                         const int32_t* send_token, const int32_t* send_count, int32_t num_tokens,
                         void* out, uint64_t timeout_ns, cudaStream_t stream) {
  const int64_t items = 2 * k.cfg.world + cdiv(num_tokens, kWarps);
  PA2A_SWITCH_WIRE(k.cfg, {
    (void)kFp8;
    launch_kernel(combine_recv_kernel<kDT>, recv_grid(k, items), kThreads, 0, stream, k.pdl, k,
                  ticket, send_token, send_count, num_tokens, static_cast<uint8_t*>(out),
                  timeout_ns);
  });
}

}  // namespace pa2a::cuda
