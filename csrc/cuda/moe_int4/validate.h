// Argument checks of moe_int4_run (host only, no CUDA calls): every error names the
// argument, what was given and what is allowed. Shared with the host emulation test, which
// runs them on the arguments the Python side builds.
#pragma once

#include <cstdint>
#include <ios>
#include <utility>

#include "core/exception.h"
#include "cuda/moe_int4/layout.h"
#include "cuda/moe_int4/moe_int4.cuh"

namespace pa2a::moe_int4 {

// Pointers read with 16-byte cp.async (activations, weights, scales, h) and the scratch
// need 16-byte alignment; the routing inputs are read as 4-byte scalars and need only that
// (a slice of a routing tensor is fine).
inline void check_ptr(uintptr_t p, const char* name, bool required = true, unsigned align = 16) {
  PA2A_CHECK_ARG(!required || p != 0, "moe_int4: ", name, " is null; a device pointer is required");
  PA2A_CHECK_ARG(p % align == 0, "moe_int4: ", name, "=0x", std::hex, p, std::dec, " is not ",
                 align, "-byte aligned",
                 align == 16 ? "; 16-byte cp.async copies need it" : "; it holds 4-byte scalars");
}

inline void check_weight(const char* name, uintptr_t qweight, uintptr_t scales, uintptr_t zeros,
                         int n_pad, int k_pad, int group, int num_groups) {
  check_ptr(qweight, name);
  check_ptr(scales, "scales");
  check_ptr(zeros, "zeros", false);
  PA2A_CHECK_ARG(n_pad > 0 && n_pad % kPadN == 0, "moe_int4: ", name, " n_pad=", n_pad,
                 "; allowed: a positive multiple of ", kPadN);
  PA2A_CHECK_ARG(k_pad > 0 && k_pad % kPadK == 0, "moe_int4: ", name, " k_pad=", k_pad,
                 "; allowed: a positive multiple of ", kPadK);
  const bool grouped = group == 32 || group == 64 || group == 128;
  PA2A_CHECK_ARG(grouped || group == k_pad, "moe_int4: ", name, " group=", group,
                 "; allowed: 32, 64, 128, or k_pad (", k_pad, ") for per channel");
  PA2A_CHECK_ARG(k_pad % group == 0 && num_groups == k_pad / group, "moe_int4: ", name,
                 " num_groups=", num_groups, " with k_pad=", k_pad, " group=", group,
                 "; expected k_pad / group");
}

// Checks everything that does not need the device; returns the (row, expert) pair bound.
inline int64_t check_args(const MoeInt4Args& a) {
  PA2A_CHECK_ARG(a.dtype == 0 || a.dtype == 1, "moe_int4: dtype=", a.dtype,
                 "; allowed: 0 (bf16), 1 (fp16)");
  PA2A_CHECK_ARG(a.block_m == 16 || a.block_m == 64, "moe_int4: block_m=", a.block_m,
                 "; allowed: 16, 64");
  PA2A_CHECK_ARG(a.num_experts >= 1 && a.num_experts <= kMaxExperts,
                 "moe_int4: num_experts=", a.num_experts, "; allowed: 1..", kMaxExperts);
  PA2A_CHECK_ARG(a.hidden > 0 && a.hidden % 8 == 0, "moe_int4: hidden=", a.hidden,
                 "; allowed: a positive multiple of 8 (16-byte rows)");
  PA2A_CHECK_ARG(a.num_rows >= 0, "moe_int4: num_rows=", a.num_rows, "; must be >= 0");
  check_ptr(a.x, "x");
  check_ptr(a.out, "out");
  check_weight("w13_qweight", a.w13_qweight, a.w13_scales, a.w13_zeros, a.w13_n_pad, a.w13_k_pad,
               a.w13_group, a.w13_num_groups);
  check_weight("w2_qweight", a.w2_qweight, a.w2_scales, a.w2_zeros, a.w2_n_pad, a.w2_k_pad,
               a.w2_group, a.w2_num_groups);
  PA2A_CHECK_ARG(a.w13_k_pad >= a.hidden, "moe_int4: w13 k_pad=", a.w13_k_pad,
                 " is smaller than hidden=", a.hidden);
  PA2A_CHECK_ARG(a.w2_n_pad >= a.hidden, "moe_int4: w2 n_pad=", a.w2_n_pad,
                 " is smaller than hidden=", a.hidden);
  PA2A_CHECK_ARG(a.h_stride == a.w13_n_pad / 2 && a.w2_k_pad <= a.h_stride,
                 "moe_int4: h_stride=", a.h_stride, " must equal w13 n_pad / 2 (", a.w13_n_pad / 2,
                 ") and be >= w2 k_pad (", a.w2_k_pad, ")");
  check_ptr(a.h, "h");
  check_ptr(a.pair_src, "pair_src");
  check_ptr(a.pair_w, "pair_w");
  check_ptr(a.tiles, "tiles");
  check_ptr(a.status, "status");
  PA2A_CHECK_ARG(a.block_m == 16 || (a.w13_zeros == 0 && a.w2_zeros == 0),
                 "moe_int4: block_m=", a.block_m,
                 " is not available with zero points (asymmetric GPTQ, AWQ); use block_m=16");
  PA2A_CHECK_ARG(a.split_k == 0 || a.split_k == 1, "moe_int4: split_k=", a.split_k,
                 "; allowed: 0, 1");
  check_ptr(a.errors, "errors", false, 4);
  if (a.x_perm != 0) {
    check_ptr(a.x_perm, "x_perm", true, 4);
    check_ptr(a.x_perm_buf, "x_perm_buf");
  }
  if (a.split_ws != 0) {
    check_ptr(a.split_ws, "split_ws");
    check_ptr(a.split_cnt, "split_cnt");
    PA2A_CHECK_ARG(a.ws_items >= 1, "moe_int4: ws_items=", a.ws_items,
                   "; must be >= 1 when split_ws is given");
  }
  int64_t pairs = 0;
  if (a.expert_major) {
    check_ptr(a.counts, "counts", true, 4);
    PA2A_CHECK_ARG(a.capacity >= 0 && a.num_rows == a.capacity * a.num_experts,
                   "moe_int4: expert-major num_rows=", a.num_rows, " must be capacity (",
                   a.capacity, ") * num_experts (", a.num_experts, ")");
    pairs = a.num_rows;
  } else {
    check_ptr(a.topk_ids, "topk_ids", true, 4);
    check_ptr(a.topk_weights, "topk_weights", true, 4);
    check_ptr(a.acc, "acc");
    check_ptr(a.row_pairs, "row_pairs", true, 4);
    check_ptr(a.active_rows, "active_rows", true, 4);
    check_ptr(a.row_cnt, "row_cnt", true, 4);
    PA2A_CHECK_ARG(a.num_topk >= 1, "moe_int4: num_topk=", a.num_topk, "; must be >= 1");
    pairs = a.num_rows * a.num_topk;
  }
  PA2A_CHECK_ARG(pairs < (int64_t{1} << 31), "moe_int4: ", pairs,
                 " (row, expert) pairs; allowed: < 2^31");
  PA2A_CHECK_ARG(a.max_pairs >= pairs, "moe_int4: max_pairs=", a.max_pairs,
                 " is below the number of (row, expert) pairs ", pairs);
  const int64_t need_tiles = a.num_experts + pairs / a.block_m + 1;
  PA2A_CHECK_ARG(a.max_tiles >= need_tiles, "moe_int4: max_tiles=", a.max_tiles,
                 "; need >= num_experts + pairs / block_m + 1 = ", need_tiles);
  // The GEMMs' stream-K partition is 32-bit: max_tiles * column blocks * k-tiles < 2^31
  // (2^31 k-tiles are 16 TB of weights to stream: no real problem is near).
  for (const auto& [n_pad, k_pad] : {std::pair<int, int>{a.w13_n_pad, a.w13_k_pad},
                                     std::pair<int, int>{a.w2_n_pad, a.w2_k_pad}}) {
    const int64_t per_tile = static_cast<int64_t>(n_pad / kPadN) * (k_pad / kPadK);
    PA2A_CHECK_ARG(a.max_tiles <= ((int64_t{1} << 31) - 1) / per_tile,
                   "moe_int4: max_tiles=", a.max_tiles, " with ", per_tile,
                   " k-tiles per tile; allowed: max_tiles * ", per_tile, " < 2^31");
  }
  return pairs;
}

}  // namespace pa2a::moe_int4
