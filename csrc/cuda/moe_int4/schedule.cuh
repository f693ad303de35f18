// Device-side schedule (expert counts -> pair lists and tiles, no host sync; rows layout:
// also which rows have a local expert) and the act-order gather of the INT4 MoE. Device
// code only; moe_int4.cu launches it. Plain C++ over CUDA built-ins, so the host emulation of the
// kernel source compiles and runs this same source.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/moe_int4/device_ops.cuh"
#include "cuda/moe_int4/moe_int4.cuh"

namespace pa2a::moe_int4 {
namespace {

constexpr int kScheduleThreads = 1024;

// Per-expert prefix sums by one thread: E <= kMaxExperts, a few microseconds at most,
// and it keeps the schedule deterministic in its tile order.
__device__ void prefix_and_tiles(int num_experts, int block_m, const int32_t* cnt, int32_t* off,
                                 int32_t* tile_off, int32_t* status, int64_t max_tiles) {
  if (threadIdx.x == 0) {
    int32_t pairs = 0, tiles = 0;
    for (int e = 0; e < num_experts; ++e) {
      off[e] = pairs;
      tile_off[e] = tiles;
      pairs += cnt[e];
      tiles += (cnt[e] + block_m - 1) / block_m;
    }
    status[0] = tiles <= max_tiles ? tiles : static_cast<int32_t>(max_tiles);
  }
  __syncthreads();
}

__device__ void write_tiles(int num_experts, int block_m, const int32_t* cnt, const int32_t* off,
                            const int32_t* tile_off, int32_t* tiles, int64_t max_tiles) {
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    const int n = (cnt[e] + block_m - 1) / block_m;
    for (int t = 0; t < n; ++t) {
      const int64_t idx = tile_off[e] + t;
      if (idx >= max_tiles) break;  // cannot happen with the documented bound
      const int32_t start = t * block_m;
      tiles[idx * 4 + 0] = e;
      tiles[idx * 4 + 1] = off[e] + start;
      tiles[idx * 4 + 2] = min(block_m, cnt[e] - start);
      tiles[idx * 4 + 3] = 0;
    }
  }
}

// Invalid ids are skipped by the GEMMs and reported: status[1] (this launch) and, when the
// caller gives one, a sticky host-visible flag it reads without synchronising.
__device__ void report_invalid(int32_t bad, int32_t* status, int32_t* errors) {
  if (threadIdx.x == 0) {
    status[1] = bad;
    if (errors != nullptr && bad != 0) *static_cast<volatile int32_t*>(errors) = bad;
  }
}

// Rows layout: group the (row, k) pairs by local expert; count each row's pairs and list
// the rows that have any (the GEMMs zero and finalise only those).
__global__ void __launch_bounds__(kScheduleThreads)
    schedule_rows_kernel(const int32_t* ids, const float* wts, int64_t num_rows, int num_topk,
                         int num_experts, int block_m, int32_t* pair_src, float* pair_w,
                         int32_t* tiles, int32_t* status, int64_t max_tiles, int32_t* row_pairs,
                         int32_t* active_rows, int32_t* errors) {
  grid_dependency_wait();
  grid_dependency_launch();
  __shared__ int32_t cnt[kMaxExperts], off[kMaxExperts], tile_off[kMaxExperts], cursor[kMaxExperts];
  __shared__ int32_t bad, active;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) cnt[e] = cursor[e] = 0;
  if (threadIdx.x == 0) bad = active = 0;
  __syncthreads();
  for (int64_t r = threadIdx.x; r < num_rows; r += blockDim.x) {
    int32_t n = 0;
    for (int k = 0; k < num_topk; ++k) {
      const int32_t e = ids[r * num_topk + k];
      n += e >= 0 && e < num_experts;
    }
    row_pairs[r] = n;
    if (n > 0) active_rows[atomicAdd(&active, 1)] = static_cast<int32_t>(r);
  }
  const int64_t n = num_rows * num_topk;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t e = ids[i];
    if (e >= 0 && e < num_experts) {
      atomicAdd(&cnt[e], 1);
    } else if (e != -1) {
      atomicAdd(&bad, 1);
    }
  }
  __syncthreads();
  prefix_and_tiles(num_experts, block_m, cnt, off, tile_off, status, max_tiles);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t e = ids[i];
    if (e < 0 || e >= num_experts) continue;
    const int32_t pos = off[e] + atomicAdd(&cursor[e], 1);
    pair_src[pos] = static_cast<int32_t>(i / num_topk);
    pair_w[pos] = wts[i];
  }
  write_tiles(num_experts, block_m, cnt, off, tile_off, tiles, max_tiles);
  __syncthreads();  // `active` is complete
  if (threadIdx.x == 0) status[2] = active;
  report_invalid(bad, status, errors);
}

// Expert-major layout: rows e * capacity + i for i < counts[e].
__global__ void __launch_bounds__(kScheduleThreads)
    schedule_expert_major_kernel(const int32_t* counts, int64_t capacity, int num_experts,
                                 int block_m, int32_t* pair_src, float* pair_w, int32_t* tiles,
                                 int32_t* status, int64_t max_tiles, int32_t* errors) {
  grid_dependency_wait();
  grid_dependency_launch();
  __shared__ int32_t cnt[kMaxExperts], off[kMaxExperts], tile_off[kMaxExperts];
  __shared__ int32_t bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int64_t c = counts[e];
    if (c < 0 || c > capacity) {
      atomicAdd(&bad, 1);
      c = c < 0 ? 0 : capacity;
    }
    cnt[e] = static_cast<int32_t>(c);
  }
  __syncthreads();
  prefix_and_tiles(num_experts, block_m, cnt, off, tile_off, status, max_tiles);
  const int64_t n = capacity * num_experts;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int e = static_cast<int>(i / capacity);
    const int32_t r = static_cast<int32_t>(i % capacity);
    if (r >= cnt[e]) continue;
    pair_src[off[e] + r] = static_cast<int32_t>(i);
    pair_w[off[e] + r] = 1.0f;
  }
  write_tiles(num_experts, block_m, cnt, off, tile_off, tiles, max_tiles);
  report_invalid(bad, status, errors);
}

// Act-order: A of each pair gathered through its expert's permutation once per call
// ([pairs, k_pad], -1 = padding column), so the GEMM's pipeline copies rows as usual.
template <typename T>
__global__ void permute_rows_kernel(const T* x, int64_t lda, const int32_t* perm, int k_pad,
                                    const int32_t* tiles, const int32_t* num_tiles,
                                    int64_t max_tiles, const int32_t* pair_src, T* out) {
  grid_dependency_wait();
  grid_dependency_launch();
  const int64_t n = min(static_cast<int64_t>(*num_tiles), max_tiles);
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int32_t e = tiles[t * 4], pair0 = tiles[t * 4 + 1], rows = tiles[t * 4 + 2];
    const int32_t* pe = perm + static_cast<int64_t>(e) * k_pad;
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(rows) * k_pad; i += blockDim.x) {
      const int64_t pair = pair0 + i / k_pad;
      const int32_t c = pe[i % k_pad];
      out[pair * k_pad + i % k_pad] =
          c >= 0 ? x[static_cast<int64_t>(pair_src[pair]) * lda + c] : static_cast<T>(0.0f);
    }
  }
}

}  // namespace
}  // namespace pa2a::moe_int4
