// Fused W4A16 expert MLP for expert parallelism: host API of the INT4 MoE kernels.
//
// What runs (all on one stream, no host synchronisation, so the sequence can be captured
// in a CUDA graph; on sm_90 and newer each launch is a programmatic dependent launch, so
// its CTAs are resident before the previous kernel ends and only wait at the top):
//   1. schedule   one CTA turns device-side routing (topk ids, or per-expert counts) into
//                 a list of (expert, first pair, rows) tiles, sized by an upper bound the
//                 host knows without reading the counts; rows layout: also the rows that
//                 have a local expert and how many (row, expert) pairs each has;
//  (1b. permute   act-order only: A gathered once per call into [pairs, k_pad]);
//   2. gemm13     gate/up GEMM over all tiles of all experts in one persistent launch,
//                 SiLU(gate) * up fused into the epilogue, writing h [pairs, I] once; its
//                 CTAs first zero the fp32 accumulator rows that have a local expert;
//   3. gemm2      down GEMM, the routing weight and the per-row sum over this rank's
//                 experts fused into the epilogue (fp32 red.add into a [R, H] scratch); the
//                 CTA that completes a (row, 256 columns) block converts it into the output
//                 (a ticket per row and column block), or a plain store for the
//                 expert-major layout. Rows with no local expert are not written.
// Both GEMMs divide the k-tiles of all their work items evenly over every CTA (stream-K,
// see gemm_kernel.cuh). Every scratch buffer is sized by the caller from the problem bound
// (pairs = R * topk or E * capacity, tiles = E + pairs / block_m + 1) or, for the split-K
// workspace, from the grid; never from a guess: the Marlin-MoE c_tmp out-of-bounds bugs
// (research notes section 5) came from clamped guesses. The kernel also clamps its use of
// the workspace to the slots it was given.
//
// Invariants the caller guarantees (checked in moe_int4_run, errors name the argument):
// rows are contiguous with hidden % 8 == 0 (16-byte cp.async), weights are packed as in
// layout.h, h_stride == w13_n_pad / 2 >= w2_k_pad, num_experts <= kMaxExperts. The
// persistent scratch (split_ws, split_cnt, row_cnt) is zero before the first launch and
// every launch leaves it zero.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pa2a::moe_int4 {

constexpr int kMaxExperts = 1024;  // schedule kernel keeps 4 ints per expert in smem

struct MoeInt4Args {
  int dtype = 0;  // pa2a::DType: 0 bf16, 1 fp16
  bool expert_major = false;
  uintptr_t x = 0;       // rows [num_rows, hidden] or [E, capacity, hidden]
  int64_t num_rows = 0;  // R (rows) or E * capacity (expert-major)
  int64_t capacity = 0;  // expert-major only
  int hidden = 0;
  int num_experts = 0;
  uintptr_t topk_ids = 0;      // int32 [R, num_topk] (rows)
  uintptr_t topk_weights = 0;  // fp32 [R, num_topk] (rows)
  int num_topk = 0;
  uintptr_t counts = 0;  // int32 [E] (expert-major)
  uintptr_t out = 0;     // [R, hidden] or [E, capacity, hidden], activation dtype
  uintptr_t acc = 0;     // fp32 [R, hidden] scratch (rows)
  // Packed weights (layout.h). group = group size, or k_pad for per channel.
  uintptr_t w13_qweight = 0, w13_scales = 0, w13_zeros = 0;
  int w13_n_pad = 0, w13_k_pad = 0, w13_group = 0, w13_num_groups = 0;
  uintptr_t w2_qweight = 0, w2_scales = 0, w2_zeros = 0;
  int w2_n_pad = 0, w2_k_pad = 0, w2_group = 0, w2_num_groups = 0;
  uintptr_t x_perm = 0;      // int32 [E, w13_k_pad] act-order gather of x, or 0
  uintptr_t x_perm_buf = 0;  // activation dtype [max_pairs, w13_k_pad] when x_perm is set
  uintptr_t h_perm = 0;      // int32 [E, h_stride] position of h channel (w2 act-order), or 0
  int h_stride = 0;
  // Scratch sized by the caller (see the file comment).
  uintptr_t pair_src = 0;     // int32 [max_pairs]
  uintptr_t pair_w = 0;       // fp32 [max_pairs]
  uintptr_t tiles = 0;        // int32 [max_tiles, 4]
  uintptr_t status = 0;       // int32 [4]: tiles written, invalid ids seen, active rows
  uintptr_t h = 0;            // activation dtype [max_pairs, h_stride]
  uintptr_t row_pairs = 0;    // int32 [R] (rows): local (row, expert) pairs of each row
  uintptr_t active_rows = 0;  // int32 [R] (rows): the rows with a local expert
  // Persistent scratch, zero before the first launch and left zero by every launch:
  // split-K workspace fp32 [ws_items, block_m, 256] + int32 tickets [ws_items], sized from
  // the grid (0 disables the split of the gate/up and expert-major GEMMs), and the
  // finalise tickets int32 [R, w2_n_pad / 256] (rows layout).
  uintptr_t split_ws = 0;
  uintptr_t split_cnt = 0;
  int64_t ws_items = 0;
  uintptr_t row_cnt = 0;
  uintptr_t errors = 0;  // int32 (e.g. pinned host memory): += invalid ids seen, or 0
  int split_k = 1;       // 0: every work item runs whole in one CTA (no split-K anywhere)
  int64_t max_pairs = 0;
  int64_t max_tiles = 0;
  int block_m = 16;  // 16 (any count; decode) or 64 (prefill: >= 64 rows per expert)
  int device = 0;
  uintptr_t stream = 0;
};

// Launch the whole sequence on args.stream. Throws pa2a::Error on invalid arguments or a
// failed launch; never synchronises.
void moe_int4_run(const MoeInt4Args& args);

// Dynamic shared memory one GEMM CTA uses (also exported to Python, to check it fits a GPU).
int gemm_smem_bytes(int block_m);

// ---- internal: one GEMM launch, instantiated in gen/*.cu ------------------------------------

enum class Epilogue : int { kSiluMulStore = 0, kWeightedAtomic = 1, kStore = 2 };

struct GemmParams {
  const void* a = nullptr;  // activation dtype
  int64_t lda = 0;          // elements per A row
  int a_cols = 0;           // valid columns of A (zero beyond), multiple of 8
  bool a_gather = false;    // A row = pair_src[pair] (else A row = pair)
  const int32_t* qweight = nullptr;
  const void* scales = nullptr;
  const void* zeros = nullptr;
  int n_pad = 0, k_pad = 0, group = 0, num_groups = 0;
  int group_shift = 0;  // group = 1 << group_shift; 31 for per channel (one group)
  int n_valid = 0;      // output columns to write (epilogues 1, 2)
  const int32_t* pair_src = nullptr;
  const float* pair_w = nullptr;
  const int32_t* tiles = nullptr;
  const int32_t* num_tiles = nullptr;  // device scalar written by the schedule kernel
  int64_t max_tiles = 0;
  Epilogue epilogue = Epilogue::kStore;
  void* out = nullptr;
  int64_t ldo = 0;
  const int32_t* out_perm = nullptr;  // epilogue 0: [E, ldo] or null
  // Split-K (see the kernel). split_k false: whole items only. Epilogues 0 and 2 reduce
  // split items through the workspace: ws_items slots of kBlockM x 256 fp32 and one int32
  // ticket each, all zero before the first launch (the kernel leaves them zero again).
  bool split_k = false;
  float* split_ws = nullptr;
  int32_t* split_cnt = nullptr;
  int64_t ws_items = 0;
  // Epilogue 1 (rows layout): finalise. A (row, column block) is complete when its ticket
  // row_cnt[row * (n_pad / 256) + block] reaches row_pairs[row] * k_tiles; its last CTA
  // converts out (fp32) into final_out (activation dtype, row stride ldo).
  void* final_out = nullptr;
  int32_t* row_cnt = nullptr;
  const int32_t* row_pairs = nullptr;
  // Zeroing before the work (the gate/up GEMM of the rows layout): rows active_rows[0 ..
  // *num_active) of zero_acc (fp32, zero_cols per row).
  float* zero_acc = nullptr;
  const int32_t* active_rows = nullptr;
  const int32_t* num_active = nullptr;
  int zero_cols = 0;
  // After its work (the gate/up GEMM): prefetch into L2 the down projection's weights of
  // the experts that have tiles, prefetch_expert_bytes from prefetch + e * that each, at
  // most prefetch_max_bytes in all (0: none; the host gives half the L2).
  const void* prefetch = nullptr;
  int64_t prefetch_expert_bytes = 0;
  int64_t prefetch_max_bytes = 0;
};

// Template parameters of one GEMM instantiation (gen/*.cu): what changes the hot loop.
struct GemmVariant {
  int block_m = 16;
  bool zeros = false;    // asymmetric: zero points per group
  bool group32 = false;  // two scale groups per 64-deep k-tile (group 32)
};

inline GemmVariant gemm_variant(const GemmParams& p, int block_m) {
  return GemmVariant{block_m, p.zeros != nullptr, p.group == 32};
}

// Launch context the host caches per device (moe_int4.cu).
struct LaunchContext {
  int device = 0;
  int num_sms = 0;
  bool pdl = false;      // programmatic dependent launch (compute capability >= 9.0)
  int64_t l2_bytes = 0;  // the device's L2 (the gate/up GEMM prefetches into half of it)
  cudaStream_t stream = nullptr;
};

template <typename T, int kBlockM, bool kZeros, bool kGroup32>
void launch_gemm(const GemmParams& p, const LaunchContext& ctx);

inline int group_shift(int group, int k_pad) {
  if (group == k_pad && (group & (group - 1)) != 0) return 31;  // per channel, one group
  int s = 0;
  while ((1 << s) < group) ++s;
  return s;
}

// The parameters of the two GEMM launches of moe_int4_run (pure; the host emulation test
// builds them with the same functions).
inline GemmParams gate_up_params(const MoeInt4Args& a) {
  GemmParams g1;
  g1.a = reinterpret_cast<const void*>(a.x);
  g1.lda = a.hidden;
  g1.a_cols = a.hidden;
  g1.a_gather = true;
  if (a.x_perm != 0) {  // act-order: A was gathered into [pairs, k_pad] by the permute kernel
    g1.a = reinterpret_cast<const void*>(a.x_perm_buf);
    g1.lda = a.w13_k_pad;
    g1.a_cols = a.w13_k_pad;
    g1.a_gather = false;
  }
  g1.qweight = reinterpret_cast<const int32_t*>(a.w13_qweight);
  g1.scales = reinterpret_cast<const void*>(a.w13_scales);
  g1.zeros = reinterpret_cast<const void*>(a.w13_zeros);
  g1.n_pad = a.w13_n_pad;
  g1.k_pad = a.w13_k_pad;
  g1.group = a.w13_group;
  g1.num_groups = a.w13_num_groups;
  g1.group_shift = group_shift(a.w13_group, a.w13_k_pad);
  g1.n_valid = a.w13_n_pad;
  g1.pair_src = reinterpret_cast<const int32_t*>(a.pair_src);
  g1.pair_w = reinterpret_cast<const float*>(a.pair_w);
  g1.tiles = reinterpret_cast<const int32_t*>(a.tiles);
  g1.num_tiles = reinterpret_cast<const int32_t*>(a.status);
  g1.max_tiles = a.max_tiles;
  g1.epilogue = Epilogue::kSiluMulStore;
  g1.out = reinterpret_cast<void*>(a.h);
  g1.ldo = a.h_stride;
  g1.out_perm = reinterpret_cast<const int32_t*>(a.h_perm);
  g1.split_k = a.split_k != 0;
  g1.split_ws = reinterpret_cast<float*>(a.split_ws);
  g1.split_cnt = reinterpret_cast<int32_t*>(a.split_cnt);
  g1.ws_items = a.split_ws != 0 ? a.ws_items : 0;
  if (!a.expert_major) {
    g1.zero_acc = reinterpret_cast<float*>(a.acc);
    g1.active_rows = reinterpret_cast<const int32_t*>(a.active_rows);
    g1.num_active = reinterpret_cast<const int32_t*>(a.status) + 2;
    g1.zero_cols = a.hidden;
  }
  g1.prefetch = reinterpret_cast<const void*>(a.w2_qweight);
  g1.prefetch_expert_bytes = static_cast<int64_t>(a.w2_k_pad / 16) * a.w2_n_pad * 8;  // layout.h
  return g1;
}

inline GemmParams down_params(const MoeInt4Args& a) {
  GemmParams g2 = gate_up_params(a);
  g2.a = reinterpret_cast<const void*>(a.h);
  g2.lda = a.h_stride;
  g2.a_cols = a.w2_k_pad;
  g2.a_gather = false;
  g2.qweight = reinterpret_cast<const int32_t*>(a.w2_qweight);
  g2.scales = reinterpret_cast<const void*>(a.w2_scales);
  g2.zeros = reinterpret_cast<const void*>(a.w2_zeros);
  g2.n_pad = a.w2_n_pad;
  g2.k_pad = a.w2_k_pad;
  g2.group = a.w2_group;
  g2.num_groups = a.w2_num_groups;
  g2.group_shift = group_shift(a.w2_group, a.w2_k_pad);
  g2.n_valid = a.hidden;
  g2.ldo = a.hidden;
  g2.out_perm = nullptr;
  g2.zero_acc = nullptr;
  g2.active_rows = nullptr;
  g2.num_active = nullptr;
  g2.prefetch = nullptr;
  g2.prefetch_expert_bytes = 0;
  if (a.expert_major) {
    g2.epilogue = Epilogue::kStore;  // split items reduce through the workspace
    g2.out = reinterpret_cast<void*>(a.out);
  } else {
    // Parts red.add into the fp32 row accumulator; no workspace needed.
    g2.epilogue = Epilogue::kWeightedAtomic;
    g2.out = reinterpret_cast<void*>(a.acc);
    g2.split_ws = nullptr;
    g2.split_cnt = nullptr;
    g2.ws_items = 0;
    g2.final_out = reinterpret_cast<void*>(a.out);
    g2.row_cnt = reinterpret_cast<int32_t*>(a.row_cnt);
    g2.row_pairs = reinterpret_cast<const int32_t*>(a.row_pairs);
  }
  return g2;
}

}  // namespace pa2a::moe_int4
