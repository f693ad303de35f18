// W4A16 grouped GEMM over all local experts in one persistent launch (template body).
//
// Hardware reasoning, in the order it matters for decode (1-16 rows per expert, so the
// kernel is bound by weight bytes and, on the fastest memories, by issued instructions):
//  * Weights are read once, as 16-byte cp.async.cg copies of 512-byte tiles laid out in
//    mma.m16n8k16 B-fragment order (layout.h): one LDS.128 per lane per 16x64 tile, no
//    shuffles. No L2 cache-policy hints: createpolicy/L2::cache_hint is what broke the
//    original Marlin on sm_120 (research notes section 5).
//  * A kStages-deep cp.async pipeline (activations, weights, scales, zero points of one
//    64-deep k-tile per stage) keeps enough bytes in flight to approach the copy bandwidth.
//    Every copy address is a per-segment base pointer plus a fixed per-k-tile stride: no
//    64-bit index math in the loop.
//  * int4 -> bf16/fp16 as in Marlin: one lop3 per register pair gives magic + q (mask
//    0x000F000F; fp16 magic 1024, bf16 magic 128, both with an ulp of 1), then one sub of
//    (magic + zero), exact, and one mul by the group scale: single rounded. fp16 takes the
//    odd nibbles in place (mask 0x00F000F0 gives magic + 16 q; one exact fma by 1/16 minus
//    (magic / 16 + zero)); bf16 has only 7 mantissa bits, so it shifts them down first.
//    Scales (and zero points) are broadcast with one prmt per n8 tile and group, once per
//    group and k-tile, not per k16 step. Group 32 (two groups per k-tile) and zero points
//    are template parameters, so the loop has no division and no dead zero-point path.
//  * A fragments come from shared memory with one ldmatrix.x4 per 16 rows and k16 step.
//    Rows are padded to 72 elements (144 bytes), so the 8 rows of each 8x8 matrix fall in
//    8 different 16-byte bank groups: conflict free without a swizzle.
//  * Work item = (tile of <= kBlockM rows of one expert, 256-column slice); its 64-deep
//    k-tiles are the units of work. The units of all items are divided evenly over the
//    CTAs (stream-K: CTA b gets units [b U / C, (b+1) U / C)), so there is no tail at
//    any number of active experts. An item cut by a CTA boundary is "split": the down
//    GEMM of the rows layout red.adds its parts into the fp32 row accumulator (linear, so
//    any split is fine); the SiLU and expert-major epilogues need whole sums and reduce
//    the parts through a workspace slot (reduce_splits). Slot = the item's first CTA:
//    two split items never share it (if CTA b started two items the first would be whole).
//  * Finalise of the rows layout: each (row, 256 columns) block carries a ticket counting
//    the k-tiles that have been red.added into it; the CTA whose add completes it
//    (row_pairs[row] * k_tiles) converts it to the activation dtype. No spinning anywhere.
// Shared memory per CTA: kStages * (kBlockM * 144 + 8192 + 2048) bytes: 50176 (kBlockM
// 16: two CTAs per 100 KB SM of sm_86/89/120, four per sm_90 SM) and 77824 (kBlockM 64),
// inside the 99 KB per-block opt-in of sm_86/89/120; moe_int4_run checks it.
//
// The PTX lives in device_ops.cuh and the launch in gemm_launch.cuh, so this file is plain
// C++ over a few primitives: the kernel-source emulation compiles it (and
// schedule.cuh) for the host and runs it against the Python packer and reference.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "cuda/moe_int4/device_ops.cuh"
#include "cuda/moe_int4/layout.h"
#include "cuda/moe_int4/moe_int4.cuh"

namespace pa2a::moe_int4 {

constexpr int kThreads = 128;  // 4 warps, each owns 64 columns of the 256-column slice
constexpr int kWarps = kThreads / 32;
constexpr int kBlockK = kPadK;  // 64
constexpr int kBlockN = kPadN;  // 256
constexpr int kStages = 4;
constexpr int kMinPartKTiles = 4;         // stream-K parts stream at least 256 rows of K
constexpr int kARowStride = kBlockK + 8;  // elements, padded (see top)
constexpr int kBStageBytes = (kBlockK / kTileK) * kWarps * 512;  // 8192
constexpr int kSStageBytes = 2 * kBlockN * 2;                    // <= 2 groups per k-tile
constexpr int kZStageBytes = kSStageBytes;
constexpr float kFp16Max = 65504.0f;
constexpr int32_t kPrefetchTiles = 64;  // tiles the L2 prefetch of the down weights walks

template <int kBlockM>
struct SmemLayout {
  static constexpr int kAStageBytes = kBlockM * kARowStride * 2;
  static constexpr int kStageBytes = kAStageBytes + kBStageBytes + kSStageBytes + kZStageBytes;
  // Row metadata lives in registers (A rows) and is re-read from global in the epilogue,
  // not in shared memory: that keeps kBlockM 16 at 50176 bytes, so two CTAs fit in the
  // 100 KB (1 KB reserved per block) of an sm_86/89/120 SM.
  static constexpr int kBytes = kStages * kStageBytes;
};

// CTAs per SM the instantiation is compiled for (__launch_bounds__): two kBlockM 16 CTAs
// fit an sm_89/120 SM by shared memory (four on sm_90, which the 128-register cap allows);
// kBlockM 64 holds 128 accumulators per thread and runs two per SM.
template <int kBlockM>
constexpr int kMinBlocksPerSm = kBlockM == 16 ? 4 : 2;

template <typename T>
struct TypeTraits;

template <>
struct TypeTraits<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr uint32_t kMagic2 = 0x43004300u;  // (128.0, 128.0)
  static constexpr float kMagic = 128.0f;
  // Bits 4-7 of a bf16 reach into the exponent (7 mantissa bits): the high nibble needs a
  // shift first.
  static constexpr bool kHighNibbleInPlace = false;
  static __device__ __forceinline__ T2 from_float2(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
  // bf16 has fp32's range: nothing to guard.
  static __device__ __forceinline__ T2 store2(float a, float b) { return from_float2(a, b); }
};

template <>
struct TypeTraits<__half> {
  using T2 = __half2;
  static constexpr uint32_t kMagic2 = 0x64006400u;  // (1024.0, 1024.0)
  static constexpr float kMagic = 1024.0f;
  // 10 mantissa bits: magic | (q << 4) is 1024 + 16 q exactly.
  static constexpr bool kHighNibbleInPlace = true;
  static __device__ __forceinline__ T2 from_float2(float a, float b) {
    return __floats2half2_rn(a, b);
  }
  // fp16 overflows at 65504: saturate instead of writing inf (NaN stays NaN).
  static __device__ __forceinline__ float sat(float v) {
    return v > kFp16Max ? kFp16Max : (v < -kFp16Max ? -kFp16Max : v);
  }
  static __device__ __forceinline__ T2 store2(float a, float b) {
    return from_float2(sat(a), sat(b));
  }
};

template <typename T2>
__device__ __forceinline__ T2 u32_as(uint32_t u) {
  T2 v;
  memcpy(&v, &u, 4);
  return v;
}

template <typename T2>
__device__ __forceinline__ uint32_t as_u32(T2 v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

__device__ __forceinline__ float silu(float v) {
  return v / (1.0f + __expf(-v));
}

// The stream-K partition, shared with the host (grid model tests, emulation): `units`
// k-tiles in chunks of `gran` (1, or k_tiles when items must stay whole) over `ctas`.
// 32-bit throughout (check_args bounds the units below 2^31): 64-bit division is a
// subroutine of ~100 instructions, and these sit on the chain before the first weight copy.
struct Partition {
  int32_t units = 0, ctas = 1, gran = 1;
  int32_t chunks = 0, q = 0, r = 0;  // chunks = units / gran = q * ctas + r
  // First unit of CTA b (b in [0, ctas]): floor(b * chunks / ctas) chunks, without the
  // 64-bit product (b * r < ctas^2).
  __host__ __device__ int32_t begin(int32_t b) const { return (b * q + b * r / ctas) * gran; }
  // The CTA whose range holds unit v: floor(((v / gran + 1) * ctas - 1) / chunks), from a
  // float estimate (off by at most one) corrected against begin().
  __host__ __device__ int32_t owner(int32_t v) const {
    const float est = static_cast<float>(v / gran) * static_cast<float>(ctas) / chunks;
    int32_t b = static_cast<int32_t>(est);
    b = b < 0 ? 0 : (b > ctas - 1 ? ctas - 1 : b);
    while (b > 0 && begin(b) > v) --b;
    while (b + 1 < ctas && begin(b + 1) <= v) ++b;
    return b;
  }
};

__host__ __device__ inline Partition make_partition(int32_t items, int k_tiles, int32_t grid,
                                                    bool splittable) {
  Partition pt;
  pt.units = items * k_tiles;
  pt.gran = splittable ? 1 : k_tiles;
  const int32_t chunks = pt.chunks = pt.units / pt.gran;
  // Parts of at least kMinPartKTiles k-tiles: a shorter part spends more time filling the
  // pipeline than streaming.
  int32_t c = splittable ? chunks / kMinPartKTiles : chunks;
  if (c > grid) c = grid;
  pt.ctas = c < 1 ? 1 : c;
  pt.q = chunks / pt.ctas;
  pt.r = chunks - pt.q * pt.ctas;
  return pt;
}

template <typename T, int kBlockM, bool kZeros, bool kGroup32>
struct GemmCta {
  using Tr = TypeTraits<T>;
  using T2 = typename Tr::T2;
  using Smem = SmemLayout<kBlockM>;
  static constexpr int kMBlocks = kBlockM / 16;
  static constexpr int kGroups = kGroup32 ? 2 : 1;  // scale groups per k-tile

  const GemmParams& p;
  unsigned char* smem;
  // Activation chunk i of this thread: row tid / 8 + 16 i, columns 8 (tid % 8) + 8 of the
  // k-tile; nullptr for rows past the tile. Advanced by kBlockK per k-tile.
  static constexpr int kAChunks = kBlockM * 8 / kThreads;
  static_assert(kBlockM * 8 % kThreads == 0, "every thread copies whole chunks");
  const T* a_src[kAChunks];
  int a_col = 0;                   // column of this thread's chunks in the current k-tile
  const unsigned char* w_src = 0;  // this thread's chunk of k16 row 0 of the current k-tile
  int64_t w_row_bytes = 0;         // bytes between consecutive k16 rows
  const unsigned char* s_src = 0;  // scales (tid < 64) or zero points (tid >= 64), group 0
  int expert = 0, pair0 = 0, rows = 0, nb = 0;

  __device__ GemmCta(const GemmParams& params, unsigned char* s) : p(params), smem(s) {}

  // The weights of an item need only its tile's expert: their copies are issued before
  // the activation rows (a further dependent load, pair_src) are known.
  __device__ void start_weights(const int32_t* tile, int n_block, int kt) {
    const int tid = threadIdx.x;
    expert = tile[0];
    pair0 = tile[1];
    rows = tile[2];
    nb = n_block;
    // Weights: k16 row s of k-tile kt of this slice starts at word
    // ((kt * 4 + s) * n_tiles + nb * kWarps) * 128 (layout.h); this thread copies word tid * 4.
    w_row_bytes = static_cast<int64_t>(p.n_pad) * 2 * 4;
    const int64_t expert_bytes = static_cast<int64_t>(p.k_pad / kTileK) * w_row_bytes;
    w_src = reinterpret_cast<const unsigned char*>(p.qweight) + expert * expert_bytes +
            kt * (kBlockK / kTileK) * w_row_bytes + (nb * kWarps * 128 + tid * 4) * 4;
    // Scales / zero points: row (expert, group) of n_pad, this slice's 256 columns; thread
    // tid % 32 copies 8 of them, of group row (tid / 32) % 2.
    const void* sz = tid < 64 || !kZeros ? p.scales : p.zeros;  // (tid >= 64: unused if !kZeros)
    s_src = static_cast<const unsigned char*>(sz) +
            ((static_cast<int64_t>(expert) * p.num_groups + (tid / 32) % 2) * p.n_pad +
             nb * kBlockN + (tid % 32) * 8) *
                2;
  }

  __device__ void start_rows(int kt) {
    const int tid = threadIdx.x;
    const T* a = static_cast<const T*>(p.a);
    a_col = kt * kBlockK + (tid % 8) * 8;
#pragma unroll
    for (int i = 0; i < kAChunks; ++i) {
      const int r = tid / 8 + i * (kThreads / 8);
      const int32_t pair = pair0 + r;
      const int32_t row = r < rows ? (p.a_gather ? p.pair_src[pair] : pair) : -1;
      a_src[i] = row >= 0 ? a + static_cast<int64_t>(row) * p.lda + a_col : nullptr;
    }
  }

  __device__ unsigned char* stage(int st) const { return smem + st * Smem::kStageBytes; }

  // Copies of k-tile kt into stage st, then the copy pointers advance to k-tile kt + 1.
  // load_weights (weights, scales, zero points) and load_rows (activations) join the same
  // commit group unless the prologue puts several stages' weights into the first group.
  __device__ void load_weights(int st, int kt) {
    const int tid = threadIdx.x;
    unsigned char* sb = stage(st) + Smem::kAStageBytes;
#pragma unroll
    for (int s = 0; s < kBlockK / kTileK; ++s)
      cp_async16(sb + (s * kThreads + tid) * 16, w_src + s * w_row_bytes, true);
    w_src += (kBlockK / kTileK) * w_row_bytes;
    // The <= 2 groups this k-tile touches (group 32: groups 2 kt, 2 kt + 1).
    const int g0 = (kt * kBlockK) >> p.group_shift;
    const int r = (tid / 32) % 2;
    if ((kZeros || tid < 64) && r < kGroups) {
      unsigned char* dst = sb + kBStageBytes + (tid >= 64 ? kSStageBytes : 0);
      cp_async16(dst + (r * kBlockN + (tid % 32) * 8) * 2,
                 s_src + static_cast<int64_t>(g0) * p.n_pad * 2, true);
    }
  }

  __device__ void load_rows(int st) {
    const int tid = threadIdx.x;
    T* sa = reinterpret_cast<T*>(stage(st));
    const bool col_ok = a_col < p.a_cols;
#pragma unroll
    for (int i = 0; i < kAChunks; ++i) {
      const int r = tid / 8 + i * (kThreads / 8);
      const bool ok = a_src[i] != nullptr && col_ok;
      cp_async16(sa + r * kARowStride + (tid % 8) * 8, ok ? a_src[i] : p.a, ok);
      if (a_src[i] != nullptr) a_src[i] += kBlockK;
    }
    a_col += kBlockK;
  }

  // One commit group per call.
  __device__ void load_stage(int st, int kt) {
    load_weights(st, kt);
    load_rows(st);
    cp_async_commit();
  }

  // Dequantise word j of a lane's 16x64 warp tile into the B registers of n8 tiles 2j and
  // 2j + 1 with the broadcast scales and offsets of their group (layout.h: mask 0x000F000F
  // gives register b0, the odd nibbles register b1, and the same on word >> 8 the next
  // tile).
  __device__ __forceinline__ void dequant_word(uint32_t word, int j, const T2 (&sc)[8],
                                               const T2 (&zlo)[8], const T2 (&zhi)[8],
                                               uint32_t (&b)[2][2]) const {
    const T2 sixteenth = Tr::from_float2(1.0f / 16.0f, 1.0f / 16.0f);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = 2 * j + h;
      const uint32_t w = h ? word >> 8 : word;
      const T2 lo = u32_as<T2>(lop3_and_or(w, 0x000F000Fu, Tr::kMagic2));
      b[h][0] = as_u32(__hmul2(__hsub2(lo, zlo[t]), sc[t]));
      if constexpr (Tr::kHighNibbleInPlace) {
        const T2 hi = u32_as<T2>(lop3_and_or(w, 0x00F000F0u, Tr::kMagic2));
        b[h][1] = as_u32(__hmul2(fma2(hi, sixteenth, zhi[t]), sc[t]));
      } else {
        const T2 hi = u32_as<T2>(lop3_and_or(w >> 4, 0x000F000Fu, Tr::kMagic2));
        b[h][1] = as_u32(__hmul2(__hsub2(hi, zlo[t]), sc[t]));
      }
    }
  }

  // Broadcast scales and offsets of group row gi of stage memory ss for this lane's tiles.
  __device__ __forceinline__ void group_consts(const unsigned char* ss, int gi, T2 (&sc)[8],
                                               T2 (&zlo)[8], T2 (&zhi)[8]) const {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int soff = (gi * kBlockN + warp * kTileN + 8 * (lane / 4)) * 2;
    const uint4 sv = *reinterpret_cast<const uint4*>(ss + soff);
    const uint32_t svals[4] = {sv.x, sv.y, sv.z, sv.w};  // scales of n8 tiles 2i, 2i+1
#pragma unroll
    for (int t = 0; t < 8; ++t) sc[t] = u32_as<T2>(prmt(svals[t / 2], (t % 2) ? 0x3232u : 0x1010u));
    if constexpr (kZeros) {
      const uint4 zv = *reinterpret_cast<const uint4*>(ss + kSStageBytes + soff);
      const uint32_t zvals[4] = {zv.x, zv.y, zv.z, zv.w};
      const T2 magic = u32_as<T2>(Tr::kMagic2);
      const T2 neg_magic16 = Tr::from_float2(-Tr::kMagic / 16.0f, -Tr::kMagic / 16.0f);
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        const T2 z = u32_as<T2>(prmt(zvals[t / 2], (t % 2) ? 0x3232u : 0x1010u));
        zlo[t] = __hadd2(magic, z);
        zhi[t] = __hsub2(neg_magic16, z);  // -(magic / 16 + z)
      }
    } else {
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        zlo[t] = Tr::from_float2(Tr::kMagic + 8.0f, Tr::kMagic + 8.0f);
        zhi[t] = Tr::from_float2(-(Tr::kMagic / 16.0f + 8.0f), -(Tr::kMagic / 16.0f + 8.0f));
      }
    }
  }

  // Four k16 steps of one k-tile from stage st into acc.
  __device__ void compute_stage(int st, float (&acc)[kMBlocks][8][4]) const {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned char* base = stage(st);
    const T* sa = reinterpret_cast<const T*>(base);
    const unsigned char* sb = base + Smem::kAStageBytes;
    const unsigned char* ss = sb + kBStageBytes;
    // ldmatrix.x4 row of this lane: matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15),
    // (8-15, 8-15) = mma registers a0..a3.
    const T* a_lane = sa + (lane % 16) * kARowStride + (lane / 16) * 8;
    T2 sc[8], zlo[8], zhi[8];
#pragma unroll
    for (int s = 0; s < kBlockK / kTileK; ++s) {
      if (s == 0 || (kGroup32 && s == 2))
        group_consts(ss, s / 2 * (kGroup32 ? 1 : 0), sc, zlo, zhi);
      const uint4 bw = *reinterpret_cast<const uint4*>(sb + ((s * kWarps + warp) * 32 + lane) * 16);
      const uint32_t words[4] = {bw.x, bw.y, bw.z, bw.w};
      const T* a_s = a_lane + s * kTileK;
      if constexpr (kMBlocks == 1) {
        // One A fragment: dequantise the whole warp tile, then 8 mma.
        uint32_t af[4];
        ldmatrix_x4(af, a_s);
        uint32_t b[4][2][2];
#pragma unroll
        for (int j = 0; j < 4; ++j) dequant_word(words[j], j, sc, zlo, zhi, b[j]);
#pragma unroll
        for (int t = 0; t < 8; ++t)
          mma_16816<T>(acc[0][t], af, b[t / 2][t % 2][0], b[t / 2][t % 2][1]);
      } else {
        // 128 accumulators leave little room: dequantise one word (two n8 tiles) at a time
        // and reload the A fragments from shared memory for each.
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t b[2][2];
          dequant_word(words[j], j, sc, zlo, zhi, b);
#pragma unroll
          for (int mb = 0; mb < kMBlocks; ++mb) {
            uint32_t af[4];
            ldmatrix_x4(af, a_s + mb * 16 * kARowStride);
#pragma unroll
            for (int h = 0; h < 2; ++h) mma_16816<T>(acc[mb][2 * j + h], af, b[h][0], b[h][1]);
          }
        }
      }
    }
  }

  // SiLU and expert-major epilogues of a split item: every part red.adds its partial tile
  // into the item's workspace slot; the last part to arrive (a ticket counter, no
  // spinning) reads the sums back, re-zeroes the slot and the counter for the next launch,
  // and returns true.
  __device__ bool reduce_splits(float (&acc)[kMBlocks][8][4], int64_t slot, int64_t parts) const {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, c = lane % 4;
    float* ws = p.split_ws + slot * (kBlockM * kBlockN);
#pragma unroll
    for (int mb = 0; mb < kMBlocks; ++mb)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mb * 16 + g + 8 * half;
        if (r >= rows) continue;
#pragma unroll
        for (int t = 0; t < 8; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            atomicAdd(ws + r * kBlockN + warp * kTileN + 8 * t + 2 * c + e,
                      acc[mb][t][2 * half + e]);
      }
    // The barrier orders every thread's partials before thread 0's ticket, whose release
    // carries them (cumulativity); its acquire of the earlier parts' releases, then the
    // barrier, orders their partials before every thread's reads below.
    __syncthreads();
    int last = 0;
    if (threadIdx.x == 0) last = atomic_add_acq_rel(p.split_cnt + slot, 1) == parts - 1;
    if (!__syncthreads_or(last)) return false;
#pragma unroll
    for (int mb = 0; mb < kMBlocks; ++mb)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mb * 16 + g + 8 * half;
        if (r >= rows) continue;
#pragma unroll
        for (int t = 0; t < 8; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float* w = ws + r * kBlockN + warp * kTileN + 8 * t + 2 * c + e;
            acc[mb][t][2 * half + e] = __ldcg(w);
            __stcg(w, 0.0f);
          }
      }
    if (threadIdx.x == 0) p.split_cnt[slot] = 0;
    return true;
  }

  __device__ void epilogue(const float (&acc)[kMBlocks][8][4]) const {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, c = lane % 4;
    const int n0 = nb * kBlockN + warp * kTileN;  // packed column of this warp's tile
#pragma unroll
    for (int mb = 0; mb < kMBlocks; ++mb) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mb * 16 + g + 8 * half;
        if (r >= rows) continue;
        if (p.epilogue == Epilogue::kSiluMulStore) {
          T* h = static_cast<T*>(p.out) + static_cast<int64_t>(pair0 + r) * p.ldo;
          const int32_t* perm =
              p.out_perm ? p.out_perm + static_cast<int64_t>(expert) * p.ldo : nullptr;
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const int ch = gate_up_channel(n0, 8 * t + 2 * c);
            const float v0 = silu(acc[mb][t][2 * half]) * acc[mb][t + 4][2 * half];
            const float v1 = silu(acc[mb][t][2 * half + 1]) * acc[mb][t + 4][2 * half + 1];
            const T2 v = Tr::store2(v0, v1);
            if (perm == nullptr) {
              *reinterpret_cast<T2*>(h + ch) = v;
            } else {
              h[perm[ch]] = v.x;
              h[perm[ch + 1]] = v.y;
            }
          }
        } else {
          const int64_t orow = p.pair_src[pair0 + r];  // (L1/L2 hit; once per row)
#pragma unroll
          for (int t = 0; t < 8; ++t) {
            const int n = n0 + 8 * t + 2 * c;
            if (n >= p.n_valid) continue;  // n_valid is even: n + 1 is valid too
            const float v0 = acc[mb][t][2 * half], v1 = acc[mb][t][2 * half + 1];
            if (p.epilogue == Epilogue::kWeightedAtomic) {
              float* o = static_cast<float*>(p.out) + orow * p.ldo + n;
              const float w = p.pair_w[pair0 + r];
              atomicAdd(o, w * v0);
              atomicAdd(o + 1, w * v1);
            } else {
              T* o = static_cast<T*>(p.out) + orow * p.ldo + n;
              *reinterpret_cast<T2*>(o) = Tr::store2(v0, v1);
            }
          }
        }
      }
    }
  }

  // Rows layout, after the weighted red.adds of a segment of kts k-tiles: count them into
  // the (row, column block) tickets; the CTA that completes a block converts its 256
  // columns of the fp32 accumulator into the output and re-zeroes the ticket.
  __device__ void finalise_rows(int kts) const {
    int32_t* done = reinterpret_cast<int32_t*>(smem);  // stages are idle after the barrier
    __syncthreads();  // every thread's red.adds before the tickets' releases
    const int tid = threadIdx.x;
    const int n_blocks = p.n_pad / kBlockN;
    if (tid < kBlockM) {
      int32_t row = -1;
      if (tid < rows) {
        const int32_t orow = p.pair_src[pair0 + tid];
        int32_t* cnt = p.row_cnt + static_cast<int64_t>(orow) * n_blocks + nb;
        const int32_t need = p.row_pairs[orow] * (p.k_pad / kBlockK);
        if (atomic_add_acq_rel(cnt, kts) + kts == need) {
          row = orow;
          *cnt = 0;  // every contribution has arrived: nothing else touches it this launch
        }
      }
      done[tid] = row;
    }
    __syncthreads();  // after the completing tickets' acquires: every thread reads the rows
    for (int r = 0; r < rows; ++r) {
      const int32_t orow = done[r];
      if (orow < 0) continue;
      const int n = nb * kBlockN + 2 * tid;
      if (n >= p.n_valid) continue;
      const float* src = static_cast<const float*>(p.out) + static_cast<int64_t>(orow) * p.ldo + n;
      T* dst = static_cast<T*>(p.final_out) + static_cast<int64_t>(orow) * p.ldo + n;
      *reinterpret_cast<T2*>(dst) = Tr::store2(__ldcg(src), __ldcg(src + 1));
    }
  }

  // Rows layout, gate/up GEMM, after its work: zero the fp32 accumulator rows that have a
  // local expert before the down GEMM red.adds into them (CTA-stride over the rows; no
  // division, and nothing before the first weight copy).
  __device__ void zero_active_rows() const {
    const int32_t n = *p.num_active;
    const int per_row = p.zero_cols / 4;
    for (int32_t r = blockIdx.x; r < n; r += gridDim.x) {
      float4* row = reinterpret_cast<float4*>(p.zero_acc +
                                              static_cast<int64_t>(p.active_rows[r]) * p.zero_cols);
      for (int c = threadIdx.x; c < per_row; c += kThreads)
        row[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }

  // Gate/up GEMM, after its work: the down projection's weights of the experts with tiles
  // into L2 (tiles are grouped by expert; the first tile of each names it), 128-byte lines
  // spread over every thread of the grid, until prefetch_max_bytes are asked for.
  __device__ void prefetch_down_weights(int32_t tiles) const {
    const auto* base = static_cast<const unsigned char*>(p.prefetch);
    const int64_t lines = p.prefetch_expert_bytes / 128;
    int64_t budget = p.prefetch_max_bytes / 128;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
    // At most kPrefetchTiles tiles are looked at: a hint must not cost a long serial walk
    // at the end of every CTA (many small experts at prefill).
    const int32_t walk = tiles < kPrefetchTiles ? tiles : kPrefetchTiles;
    for (int32_t t = 0; t < walk && budget > 0; ++t) {
      const int32_t e = p.tiles[t * 4];
      if (t > 0 && p.tiles[(t - 1) * 4] == e) continue;
      const int64_t n = lines < budget ? lines : budget;
      budget -= n;
      const unsigned char* w = base + e * p.prefetch_expert_bytes;
      for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
           i += stride)
        prefetch_l2(w + i * 128);
    }
  }
};

// The work of one GEMM CTA (its stream-K range).
template <typename T, int kBlockM, bool kZeros, bool kGroup32>
__device__ __forceinline__ void gemm_cta_work(const GemmParams& p,
                                              GemmCta<T, kBlockM, kZeros, kGroup32>& cta,
                                              int32_t tiles) {
  constexpr int kM = GemmCta<T, kBlockM, kZeros, kGroup32>::kMBlocks;
  const int n_blocks = p.n_pad / kBlockN;
  const int k_tiles = p.k_pad / kBlockK;
  const int32_t items = tiles * n_blocks;  // < 2^31 (check_args)
  if (items == 0) return;
  // Split items reduce through the workspace except in the red.add epilogue; without a
  // workspace (or split_k off) items stay whole. With a workspace, at most ws_items CTAs
  // take part, so every slot index (a CTA index) is inside it.
  const bool needs_ws = p.epilogue != Epilogue::kWeightedAtomic;
  const bool splittable = p.split_k && (!needs_ws || (p.split_ws != nullptr && p.ws_items > 0));
  int32_t grid = static_cast<int32_t>(gridDim.x);
  if (splittable && needs_ws && grid > p.ws_items) grid = static_cast<int32_t>(p.ws_items);
  const Partition pt = make_partition(items, k_tiles, grid, splittable);
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  if (b >= pt.ctas) return;
  const int32_t u_end = pt.begin(b + 1);
  for (int32_t u = pt.begin(b); u < u_end;) {
    const int32_t item = u / k_tiles;
    const int kb = u - item * k_tiles;
    const int ke = min(k_tiles, kb + (u_end - u));
    u += ke - kb;
    const int32_t tile = item / n_blocks;
    cta.start_weights(p.tiles + tile * 4, item - tile * n_blocks, kb);

    // Stage (kt - kb) % kStages holds k-tile kt. The prologue's weights go first, into the
    // first commit group (the weights of stages 1 and 2 land no later than needed); the
    // activation rows follow once pair_src has been read.
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st)
      if (kb + st < ke) cta.load_weights(st, kb + st);
    cta.start_rows(kb);
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (kb + st < ke) cta.load_rows(st);
      cp_async_commit();
    }

    float acc[kM][8][4];
#pragma unroll
    for (int mb = 0; mb < kM; ++mb)
#pragma unroll
      for (int t = 0; t < 8; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mb][t][e] = 0.0f;

    int st_load = kStages - 1, st_use = 0;
    for (int kt = kb; kt < ke; ++kt) {
      cp_async_wait<kStages - 2>();  // stage st_use has landed (for this thread)
      __syncthreads();               // ... for every thread; stage st_load is free again
      if (kt + kStages - 1 < ke) {
        cta.load_stage(st_load, kt + kStages - 1);
      } else {
        cp_async_commit();
      }
      cta.compute_stage(st_use, acc);
      st_load = st_load == kStages - 1 ? 0 : st_load + 1;
      st_use = st_use == kStages - 1 ? 0 : st_use + 1;
    }
    cp_async_wait<0>();
    const int32_t first = pt.owner(item * k_tiles);
    const int32_t parts = pt.owner((item + 1) * k_tiles - 1) - first + 1;
    if (!needs_ws) {
      cta.epilogue(acc);
      if (p.row_cnt != nullptr) cta.finalise_rows(ke - kb);
    } else if (parts == 1 || cta.reduce_splits(acc, first, parts)) {
      cta.epilogue(acc);
    }
    __syncthreads();  // the stages are reused by the next segment
  }
}

template <typename T, int kBlockM, bool kZeros, bool kGroup32>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<kBlockM>)
    moe_int4_gemm_kernel(const GemmParams p) {
  grid_dependency_wait();  // routing, h and the accumulator come from earlier kernels
  grid_dependency_launch();
  GemmCta<T, kBlockM, kZeros, kGroup32> cta(p, dynamic_smem());
  const int64_t n_tiles = *p.num_tiles;
  const int32_t tiles = static_cast<int32_t>(n_tiles < p.max_tiles ? n_tiles : p.max_tiles);
  gemm_cta_work(p, cta, tiles);
  // What the next kernel needs, after this CTA's weights have streamed: the down
  // projection's weights in L2, its fp32 accumulator rows zeroed.
  if (p.prefetch_max_bytes > 0 && p.prefetch != nullptr) cta.prefetch_down_weights(tiles);
  if (p.zero_acc != nullptr) cta.zero_active_rows();
}

// Persistent grid of one launch: every CTA slot of the device (per_sm from the occupancy
// API), unless even split into kMinPartKTiles parts the largest possible problem (the
// item bound is known on the host; the actual count is not) has less work than that.
// Shared with the host emulation test.
inline int64_t gemm_grid(const GemmParams& p, int num_sms, int per_sm) {
  const int64_t items = p.max_tiles * (p.n_pad / kBlockN);
  const int k_tiles = p.k_pad / kBlockK;
  const int64_t work = p.split_k ? items * k_tiles / kMinPartKTiles : items;
  int64_t grid = static_cast<int64_t>(num_sms) * (per_sm < 1 ? 1 : per_sm);
  if (work < grid) grid = work;
  return grid < 1 ? 1 : grid;
}

}  // namespace pa2a::moe_int4
