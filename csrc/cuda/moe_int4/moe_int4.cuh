// Fused W4A16 expert MLP for expert parallelism: host API of the INT4 MoE kernels.
//
// What runs (all on one stream, no host synchronisation, so the sequence can be captured
// in a CUDA graph):
//   1. schedule   one CTA turns device-side routing (topk ids, or per-expert counts) into
//                 a list of (expert, first pair, rows) tiles, sized by an upper bound the
//                 host knows without reading the counts;
//   2. gemm13     gate/up GEMM over all tiles of all experts in one persistent launch,
//                 SiLU(gate) * up fused into the epilogue, writing h [pairs, I] once;
//   3. gemm2      down GEMM, the routing weight and the per-row sum over this rank's
//                 experts fused into the epilogue (fp32 red.add into a [R, H] scratch), or a
//                 plain store for the expert-major layout;
//   4. finalize   fp32 scratch -> the activation dtype (rows layout only).
// Both GEMMs split K on the device when there are fewer items than CTAs (decode with few
// active experts); see gemm_kernel.cuh.
// Every scratch buffer is sized by the caller from the problem bound (pairs = R * topk or
// E * capacity, tiles = E + pairs / block_m + 1) or, for the split-K workspace, from the
// grid; never from a guess: the Marlin-MoE c_tmp out-of-bounds bugs (research notes
// section 5) came from clamped guesses. The kernel also checks the workspace's capacity.
//
// Invariants the caller guarantees (checked in moe_int4_run, errors name the argument):
// rows are contiguous with hidden % 8 == 0 (16-byte cp.async), weights are packed as in
// layout.h, h_stride == w13_n_pad / 2 >= w2_k_pad, num_experts <= kMaxExperts.
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
  uintptr_t x_perm = 0;  // int32 [E, w13_k_pad] act-order gather of x, or 0
  uintptr_t h_perm = 0;  // int32 [E, h_stride] position of h channel (w2 act-order), or 0
  int h_stride = 0;
  // Scratch sized by the caller (see the file comment).
  uintptr_t pair_src = 0;  // int32 [max_pairs]
  uintptr_t pair_w = 0;    // fp32 [max_pairs]
  uintptr_t tiles = 0;     // int32 [max_tiles, 4]
  uintptr_t status = 0;    // int32 [4]: tiles written, invalid ids seen
  uintptr_t h = 0;         // activation dtype [max_pairs, h_stride]
  // Split-K workspace of the gate/up GEMM, sized from the grid, not from the tokens:
  // fp32 [ws_items, block_m, 256] + int32 [ws_items], zeroed once; 0 disables its split.
  uintptr_t split_ws = 0;
  uintptr_t split_cnt = 0;
  int64_t ws_items = 0;
  int max_splits = 16;  // 1 disables split-K for both GEMMs
  int64_t max_pairs = 0;
  int64_t max_tiles = 0;
  int block_m = 64;  // 16 (decode) or 64
  int device = 0;
  uintptr_t stream = 0;
};

// Launch the whole sequence on args.stream. Throws pa2a::Error on invalid arguments or a
// failed launch; never synchronises.
void moe_int4_run(const MoeInt4Args& args);

// Dynamic shared memory one GEMM CTA uses (for docs/tests/benchmarks).
int gemm_smem_bytes(int block_m);

// ---- internal: one GEMM launch, instantiated per (dtype, block_m) in gen/*.cu ------------

enum class Epilogue : int { kSiluMulStore = 0, kWeightedAtomic = 1, kStore = 2 };

struct GemmParams {
  const void* a = nullptr;          // activation dtype
  int64_t lda = 0;                  // elements per A row
  int a_cols = 0;                   // valid columns of A (zero beyond), multiple of 8
  const int32_t* a_perm = nullptr;  // [E, k_pad] or null
  bool a_gather = false;            // A row = pair_src[pair] (else A row = pair)
  const int32_t* qweight = nullptr;
  const void* scales = nullptr;
  const void* zeros = nullptr;
  int n_pad = 0, k_pad = 0, group = 0, num_groups = 0;
  int n_valid = 0;  // output columns to write (epilogues 1, 2)
  const int32_t* pair_src = nullptr;
  const float* pair_w = nullptr;
  const int32_t* tiles = nullptr;
  const int32_t* num_tiles = nullptr;  // device scalar written by the schedule kernel
  int64_t max_tiles = 0;
  Epilogue epilogue = Epilogue::kStore;
  void* out = nullptr;
  int64_t ldo = 0;
  const int32_t* out_perm = nullptr;  // epilogue 0: [E, ldo] or null
  // Split-K (see the kernel). max_splits <= 1 disables it. The gate/up GEMM splits only
  // with a workspace: ws_items slots of kBlockM x 256 fp32 and one int32 ticket each, all
  // zero before the first launch (the kernel leaves them zero again).
  int max_splits = 1;
  float* split_ws = nullptr;
  int32_t* split_cnt = nullptr;
  int64_t ws_items = 0;
};

template <typename T, int kBlockM>
void launch_gemm(const GemmParams& p, int num_sms, cudaStream_t stream);

// The parameters of the two GEMM launches of moe_int4_run (pure; the host emulation test
// builds them with the same functions).
inline GemmParams gate_up_params(const MoeInt4Args& a) {
  GemmParams g1;
  g1.a = reinterpret_cast<const void*>(a.x);
  g1.lda = a.hidden;
  g1.a_cols = a.hidden;
  g1.a_perm = reinterpret_cast<const int32_t*>(a.x_perm);
  g1.a_gather = true;
  g1.qweight = reinterpret_cast<const int32_t*>(a.w13_qweight);
  g1.scales = reinterpret_cast<const void*>(a.w13_scales);
  g1.zeros = reinterpret_cast<const void*>(a.w13_zeros);
  g1.n_pad = a.w13_n_pad;
  g1.k_pad = a.w13_k_pad;
  g1.group = a.w13_group;
  g1.num_groups = a.w13_num_groups;
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
  g1.max_splits = a.max_splits;
  g1.split_ws = reinterpret_cast<float*>(a.split_ws);
  g1.split_cnt = reinterpret_cast<int32_t*>(a.split_cnt);
  g1.ws_items = a.split_ws != 0 ? a.ws_items : 0;
  return g1;
}

inline GemmParams down_params(const MoeInt4Args& a) {
  GemmParams g2 = gate_up_params(a);
  g2.a = reinterpret_cast<const void*>(a.h);
  g2.lda = a.h_stride;
  g2.a_cols = a.w2_k_pad;
  g2.a_perm = nullptr;
  g2.a_gather = false;
  g2.qweight = reinterpret_cast<const int32_t*>(a.w2_qweight);
  g2.scales = reinterpret_cast<const void*>(a.w2_scales);
  g2.zeros = reinterpret_cast<const void*>(a.w2_zeros);
  g2.n_pad = a.w2_n_pad;
  g2.k_pad = a.w2_k_pad;
  g2.group = a.w2_group;
  g2.num_groups = a.w2_num_groups;
  g2.n_valid = a.hidden;
  g2.ldo = a.hidden;
  g2.out_perm = nullptr;
  g2.split_ws = nullptr;  // the down GEMM's parts red.add into the fp32 row accumulator
  g2.split_cnt = nullptr;
  g2.ws_items = 0;
  if (a.expert_major) {
    g2.epilogue = Epilogue::kStore;
    g2.out = reinterpret_cast<void*>(a.out);
  } else {
    g2.epilogue = Epilogue::kWeightedAtomic;
    g2.out = reinterpret_cast<void*>(a.acc);
  }
  return g2;
}

}  // namespace pa2a::moe_int4
