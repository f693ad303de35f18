// W4A16 grouped GEMM over all local experts in one persistent launch (template body).
//
// Hardware reasoning, in the order it matters for decode (1-16 rows per expert, so the
// kernel is bound by weight bytes):
//  * Weights are read once, as 16-byte cp.async.cg copies of 512-byte tiles laid out in
//    mma.m16n8k16 B-fragment order (layout.h): one LDS.128 per lane per 16x64 tile, no
//    shuffles. No L2 cache-policy hints: createpolicy/L2::cache_hint is what broke the
//    original Marlin on sm_120 (research notes section 5).
//  * A kStages-deep cp.async pipeline (activations, weights, scales, zero points of one
//    64-deep k-tile per stage) keeps enough bytes in flight to approach the copy bandwidth.
//  * int4 -> bf16/fp16 with one lop3 per register pair: (w >> 4s) & 0x000F000F | magic
//    gives magic + q in both halves exactly (fp16 magic 1024, bf16 magic 128, both with an
//    ulp of 1), then one sub of (magic + zero) and one mul by the group scale in the
//    activation dtype. Group scales change at most every 16 rows of K, since every
//    supported group (32, 64, 128, per channel) is a multiple of the mma k.
//  * Work item = (tile of <= kBlockM rows of one expert, 256-column slice[, K part]).
//    CTAs stride over items read from the device-side tile count, so one launch covers
//    every expert with no host sync; consecutive items share the same rows (A stays in
//    L2). With fewer items than CTAs, K is split so every SM streams weights.
//  * Activations sit in shared memory with rows padded to 72 elements (144 bytes): the 8
//    row groups of an mma A fragment then hit 8 different 4-bank groups, so the 32-bit
//    fragment loads are conflict free without ldmatrix or a swizzle.
// Shared memory per CTA: kStages * (kBlockM * 144 + 8192 + 2048) bytes: 50176 (kBlockM
// 16: two CTAs per 100 KB SM of sm_86/89/120) and 77824 (kBlockM 64), inside the 99 KB
// per-block opt-in of sm_86/89/120 and far inside sm_80/90/100; moe_int4_run checks it
// against the device.
//
// The PTX lives in device_ops.cuh and the launch in gemm_launch.cuh, so this file is plain
// C++ over a few primitives: tests/test_quant_kernel_source_emulation.py compiles it (and
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
constexpr int kMinSplitKTiles = 4;        // a split-K part streams at least 256 rows of K
constexpr int kARowStride = kBlockK + 8;  // elements, padded (see top)
constexpr int kBStageBytes = (kBlockK / kTileK) * kWarps * 512;  // 8192
constexpr int kSStageBytes = 2 * kBlockN * 2;                    // <= 2 groups per k-tile
constexpr int kZStageBytes = kSStageBytes;

template <int kBlockM>
struct SmemLayout {
  static constexpr int kAStageBytes = kBlockM * kARowStride * 2;
  static constexpr int kStageBytes = kAStageBytes + kBStageBytes + kSStageBytes + kZStageBytes;
  // Row metadata lives in registers (A rows) and is re-read from global in the epilogue,
  // not in shared memory: that keeps kBlockM 16 at 50176 bytes, so two CTAs fit in the
  // 100 KB (1 KB reserved per block) of an sm_86/89/120 SM.
  static constexpr int kBytes = kStages * kStageBytes;
};

template <typename T>
struct TypeTraits;

template <>
struct TypeTraits<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr uint32_t kMagic2 = 0x43004300u;  // (128.0, 128.0)
  static __device__ __forceinline__ T2 from_float2(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
  static __device__ __forceinline__ T2 magic_plus(T2 z) {
    return __hadd2(z, __floats2bfloat162_rn(128.0f, 128.0f));
  }
};

template <>
struct TypeTraits<__half> {
  using T2 = __half2;
  static constexpr uint32_t kMagic2 = 0x64006400u;  // (1024.0, 1024.0)
  static __device__ __forceinline__ T2 from_float2(float a, float b) {
    return __floats2half2_rn(a, b);
  }
  static __device__ __forceinline__ T2 magic_plus(T2 z) {
    return __hadd2(z, __floats2half2_rn(1024.0f, 1024.0f));
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

template <typename T, int kBlockM>
struct GemmCta {
  using Tr = TypeTraits<T>;
  using T2 = typename Tr::T2;
  using Smem = SmemLayout<kBlockM>;
  static constexpr int kMBlocks = kBlockM / 16;

  const GemmParams& p;
  unsigned char* smem;
  // A row of each activation chunk this thread copies (chunk tid + i * kThreads is row
  // tid / 8 + 16 i); -1 for rows past the tile. Indices are compile-time: registers.
  static constexpr int kAChunks = kBlockM * 8 / kThreads;
  int32_t arow[kAChunks];
  int expert = 0, pair0 = 0, rows = 0, nb = 0;

  __device__ GemmCta(const GemmParams& params, unsigned char* s) : p(params), smem(s) {}

  __device__ void start_item(const int32_t* tile, int n_block) {
    expert = tile[0];
    pair0 = tile[1];
    rows = tile[2];
    nb = n_block;
#pragma unroll
    for (int i = 0; i < kAChunks; ++i) {
      const int r = static_cast<int>(threadIdx.x) / 8 + i * (kThreads / 8);
      const int32_t pair = pair0 + r;
      arow[i] = r < rows ? (p.a_gather ? p.pair_src[pair] : pair) : -1;
    }
  }

  __device__ unsigned char* stage(int st) const { return smem + st * Smem::kStageBytes; }

  // Issue the copies of k-tile kt into stage st (one commit group per call, even if empty).
  __device__ void load_stage(int st, int kt) const {
    const int tid = threadIdx.x;
    unsigned char* base = stage(st);
    T* sa = reinterpret_cast<T*>(base);
    const T* a = static_cast<const T*>(p.a);
    const int k0 = kt * kBlockK;
    // Activations: kBlockM rows x 8 chunks of 8 elements.
    static_assert(kBlockM * 8 % kThreads == 0, "every thread copies whole chunks");
#pragma unroll
    for (int i = 0; i < kAChunks; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / 8, kc = c % 8;
      const int col = k0 + kc * 8;
      T* dst = sa + r * kARowStride + kc * 8;
      const int32_t row = arow[i];
      if (p.a_perm == nullptr) {
        const bool ok = row >= 0 && col < p.a_cols;
        const T* src = ok ? a + static_cast<int64_t>(row) * p.lda + col : a;
        cp_async16(dst, src, ok);
      } else {
        // Act-order: gather through the permutation (synchronous, 8 scalar loads).
        const int32_t* perm = p.a_perm + static_cast<int64_t>(expert) * p.k_pad + col;
        T v[8];
        for (int q = 0; q < 8; ++q) {
          const int32_t src_col = row >= 0 ? perm[q] : -1;
          v[q] =
              src_col >= 0 ? a[static_cast<int64_t>(row) * p.lda + src_col] : static_cast<T>(0.0f);
        }
        memcpy(dst, v, 16);
      }
    }
    // Weights: 4 k16 rows x 2048 contiguous bytes (this slice's 4 warp tiles).
    const int n_tiles = p.n_pad / kTileN;
    const int32_t* qw = p.qweight + static_cast<int64_t>(expert) * (p.k_pad / kTileK) *
                                        (static_cast<int64_t>(p.n_pad) * 2);
    unsigned char* sb = base + Smem::kAStageBytes;
    for (int c = tid; c < kBStageBytes / 16; c += kThreads) {
      const int s = c / 128, w = c % 128;  // 128 chunks of 16 B per k16 row
      const int64_t word =
          qweight_word_index(kt * (kBlockK / kTileK) + s, nb * kWarps, n_tiles, 0, 0) + w * 4;
      cp_async16(sb + c * 16, qw + word, true);
    }
    // Scales (and zero points): the <= 2 groups this k-tile touches, 256 columns each.
    const int g0 = k0 / p.group;
    const int ng = p.group < kBlockK ? kBlockK / p.group : 1;
    const int64_t sbase = static_cast<int64_t>(expert) * p.num_groups * p.n_pad + nb * kBlockN;
    unsigned char* ss = sb + kBStageBytes;
    if (tid < 64) {
      const int r = tid / 32, c = tid % 32;
      if (r < ng) {
        const T* src = static_cast<const T*>(p.scales) + sbase +
                       static_cast<int64_t>(g0 + r) * p.n_pad + c * 8;
        cp_async16(ss + (r * kBlockN + c * 8) * 2, src, true);
      }
    } else if (p.zeros != nullptr) {
      const int r = (tid - 64) / 32, c = tid % 32;
      if (r < ng) {
        const T* src =
            static_cast<const T*>(p.zeros) + sbase + static_cast<int64_t>(g0 + r) * p.n_pad + c * 8;
        cp_async16(ss + kSStageBytes + (r * kBlockN + c * 8) * 2, src, true);
      }
    }
    cp_async_commit();
  }

  // Four k16 steps of one k-tile from stage st into acc.
  __device__ void compute_stage(int st, int kt, float (&acc)[kMBlocks][8][4]) const {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, c = lane % 4;
    const unsigned char* base = stage(st);
    const T* sa = reinterpret_cast<const T*>(base);
    const unsigned char* sb = base + Smem::kAStageBytes;
    const unsigned char* ss = sb + kBStageBytes;
    const int g0 = (kt * kBlockK) / p.group;
    const T2 sym_zero = Tr::magic_plus(Tr::from_float2(8.0f, 8.0f));  // magic + 8
#pragma unroll
    for (int s = 0; s < kBlockK / kTileK; ++s) {
      const uint4 bw = *reinterpret_cast<const uint4*>(sb + ((s * kWarps + warp) * 32 + lane) * 16);
      const int gi = (kt * kBlockK + s * kTileK) / p.group - g0;
      const int soff = (gi * kBlockN + warp * kTileN + 8 * g) * 2;
      const uint4 sv = *reinterpret_cast<const uint4*>(ss + soff);
      uint4 zv = make_uint4(0, 0, 0, 0);
      if (p.zeros != nullptr) zv = *reinterpret_cast<const uint4*>(ss + kSStageBytes + soff);
      // Dequantise: register pairs of n8 tiles 0..7 (layout.h).
      uint32_t b[8][2];
      const uint32_t words[4] = {bw.x, bw.y, bw.z, bw.w};
      const uint32_t svals[4] = {sv.x, sv.y, sv.z, sv.w};  // scales of n8 tiles 2i, 2i+1
      const uint32_t zvals[4] = {zv.x, zv.y, zv.z, zv.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int tile = 2 * j + q / 2;
          const uint32_t raw = lop3_and_or(words[j] >> (4 * q), 0x000F000Fu, Tr::kMagic2);
          // Broadcast element (tile % 2) of the packed pair to both halves.
          const uint32_t sp = svals[tile / 2];
          const uint32_t s16 = (tile % 2) ? (sp >> 16) : (sp & 0xFFFFu);
          const T2 scale = u32_as<T2>(s16 | (s16 << 16));
          T2 zero = sym_zero;
          if (p.zeros != nullptr) {
            const uint32_t zp = zvals[tile / 2];
            const uint32_t z16 = (tile % 2) ? (zp >> 16) : (zp & 0xFFFFu);
            zero = Tr::magic_plus(u32_as<T2>(z16 | (z16 << 16)));
          }
          b[tile][q % 2] = as_u32(__hmul2(__hsub2(u32_as<T2>(raw), zero), scale));
        }
      }
#pragma unroll
      for (int mb = 0; mb < kMBlocks; ++mb) {
        const T* r0 = sa + (mb * 16 + g) * kARowStride + s * kTileK + 2 * c;
        const T* r1 = r0 + 8 * kARowStride;
        uint32_t af[4];
        af[0] = *reinterpret_cast<const uint32_t*>(r0);
        af[1] = *reinterpret_cast<const uint32_t*>(r1);
        af[2] = *reinterpret_cast<const uint32_t*>(r0 + 8);
        af[3] = *reinterpret_cast<const uint32_t*>(r1 + 8);
#pragma unroll
        for (int t = 0; t < 8; ++t) mma_16816<T>(acc[mb][t], af, b[t][0], b[t][1]);
      }
    }
  }

  // Split-K for the gate/up GEMM: SiLU needs complete sums, so every part red.adds its
  // partial tile into a workspace slot of the base item (slots sized from the grid by the
  // caller); the last part to arrive (a ticket counter, no spinning) reads the sums back,
  // re-zeroes the slot and the counter for the next launch, and returns true.
  __device__ bool reduce_splits(float (&acc)[kMBlocks][8][4], int64_t base, int splits) const {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, c = lane % 4;
    float* ws = p.split_ws + base * (kBlockM * kBlockN);
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
    __threadfence();  // release: this thread's partials before the ticket
    __syncthreads();
    int last = 0;
    if (threadIdx.x == 0) {
      __threadfence();  // with the ticket RMW: release of this CTA's partials
      last = atomicAdd(p.split_cnt + base, 1) == splits - 1;
      // The PTX memory model's acquire pattern is a strong read followed by a fence *in the
      // same thread*: only then does the barrier below order the other parts' partials
      // before this CTA's reads (a fence in the other threads after the barrier alone is
      // not that pattern).
      __threadfence();
    }
    if (!__syncthreads_or(last)) return false;
    __threadfence();  // every thread: its reads below come after the acquire
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
    if (threadIdx.x == 0) p.split_cnt[base] = 0;
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
            if (perm == nullptr) {
              *reinterpret_cast<T2*>(h + ch) = Tr::from_float2(v0, v1);
            } else {
              const T2 v = Tr::from_float2(v0, v1);
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
              *reinterpret_cast<T2*>(o) = Tr::from_float2(v0, v1);
            }
          }
        }
      }
    }
  }
};

template <typename T, int kBlockM>
__global__ void __launch_bounds__(kThreads) moe_int4_gemm_kernel(const GemmParams p) {
  GemmCta<T, kBlockM> cta(p, dynamic_smem());
  constexpr int kM = GemmCta<T, kBlockM>::kMBlocks;
  const int64_t tiles = min(static_cast<int64_t>(*p.num_tiles), p.max_tiles);
  const int n_blocks = p.n_pad / kBlockN;
  const int k_tiles = p.k_pad / kBlockK;
  const int64_t base_items = tiles * n_blocks;
  // Split K when there are fewer items than CTAs (few active experts, decode). The count
  // is computed from device-side data identically by every CTA. Parts of the down GEMM
  // simply red.add into the fp32 row accumulator; gate/up parts reduce through the
  // workspace (reduce_splits); the expert-major store epilogue is never split.
  int splits = 1;
  if (p.max_splits > 1 && base_items > 0 && p.epilogue != Epilogue::kStore &&
      (p.epilogue != Epilogue::kSiluMulStore ||
       (p.split_ws != nullptr && base_items <= p.ws_items))) {
    int64_t s = static_cast<int64_t>(gridDim.x) / base_items;
    s = min(s, static_cast<int64_t>(p.max_splits));
    s = min(s, static_cast<int64_t>(k_tiles / kMinSplitKTiles));
    splits = s > 1 ? static_cast<int>(s) : 1;
  }
  for (int64_t item = blockIdx.x; item < base_items * splits; item += gridDim.x) {
    const int64_t base = item / splits;
    const int part = static_cast<int>(item % splits);
    const int kt_begin = part * k_tiles / splits, kt_end = (part + 1) * k_tiles / splits;
    cta.start_item(p.tiles + (base / n_blocks) * 4, static_cast<int>(base % n_blocks));

    float acc[kM][8][4];
#pragma unroll
    for (int mb = 0; mb < kM; ++mb)
#pragma unroll
      for (int t = 0; t < 8; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mb][t][e] = 0.0f;

    // Stage i % kStages holds k-tile kt_begin + i.
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (kt_begin + st < kt_end) {
        cta.load_stage(st, kt_begin + st);
      } else {
        cp_async_commit();
      }
    }
    for (int kt = kt_begin; kt < kt_end; ++kt) {
      const int i = kt - kt_begin;
      cp_async_wait<kStages - 2>();  // stage i has landed (for this thread)
      __syncthreads();               // ... for every thread; stage i-1 is free again
      if (kt + kStages - 1 < kt_end) {
        cta.load_stage((i + kStages - 1) % kStages, kt + kStages - 1);
      } else {
        cp_async_commit();
      }
      cta.compute_stage(i % kStages, kt, acc);
    }
    cp_async_wait<0>();
    if (splits == 1 || p.epilogue != Epilogue::kSiluMulStore ||
        cta.reduce_splits(acc, base, splits))
      cta.epilogue(acc);
    __syncthreads();  // the stages are reused by the next item
  }
}

// Persistent grid of one launch: every CTA slot of the device (per_sm from the occupancy
// API), unless even with split-K there is less work than that (the item bound is known on
// the host; the actual count is not). Shared with the host emulation test.
inline int64_t gemm_grid(const GemmParams& p, int num_sms, int per_sm) {
  const int64_t items = p.max_tiles * (p.n_pad / kBlockN) * (p.max_splits > 1 ? p.max_splits : 1);
  int64_t grid = static_cast<int64_t>(num_sms) * (per_sm < 1 ? 1 : per_sm);
  if (items < grid) grid = items;
  return grid < 1 ? 1 : grid;
}

}  // namespace pa2a::moe_int4
