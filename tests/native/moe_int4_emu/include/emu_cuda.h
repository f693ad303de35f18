// A small CUDA execution model on the CPU, for running the INT4 MoE kernel *source*
// (csrc/cuda/moe_int4/{gemm_kernel.cuh, schedule.cuh}) without a GPU.
//
// What is modelled, and how it can expose kernel bugs:
//  * Every CUDA thread of a block is a fiber (ucontext); blocks of a grid run one after the
//    other. __syncthreads / __syncthreads_or are real barriers over the block, so the
//    kernel's own ordering is what makes data visible; a barrier that not every thread
//    reaches is reported as a deadlock.
//  * cp.async: the destination is poisoned (0xFF bytes: NaN in bf16/fp16, code 15 in the
//    weights) when the copy is issued and filled only when a cp.async.wait_group of the
//    issuing thread requires its group, i.e. as late as the hardware may deliver it.
//    Reading a stage too early, or overwriting one still in use, gives wrong numbers.
//    Source and destination must be 16-byte aligned; sources must lie in a registered
//    global buffer and destinations in the dynamic shared memory.
//  * mma.sync.m16n8k16: warp-collective; each lane publishes its fragment registers and
//    reads the others', placed by the PTX ISA fragment tables (written here from the ISA,
//    not from the kernel or the packer). fp32 accumulation.
//  * bf16/fp16 are bit-exact 16-bit types with round-to-nearest-even conversions; the
//    two-element intrinsics compute in fp32 and round once.
//  * Atomics are plain read-modify-writes (fibers switch only at barriers, so they are
//    atomic); fences are no-ops (the model is sequentially consistent).
// Not modelled: timing, bank conflicts, real asynchrony between warps beyond barriers.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

// ---- CUDA keywords and built-in types ---------------------------------------------------
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // one block runs at a time: function statics are its shared memory
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  return uint4{x, y, z, w};
}
typedef struct CUstream_st* cudaStream_t;

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

template <typename T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
inline T max(T a, T b) {
  return a < b ? b : a;
}

namespace emu {

[[noreturn]] inline void fail(const std::string& msg) {
  std::fprintf(stderr, "EMU ERROR: %s (block %u thread %u)\n", msg.c_str(), blockIdx.x,
               threadIdx.x);
  std::fflush(stderr);
  std::_Exit(3);
}

// ---- 16-bit floats ----------------------------------------------------------------------
inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline uint16_t float_to_bf16_rn(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t h) {
  return bits_to_float(static_cast<uint32_t>(h) << 16);
}
inline uint16_t float_to_half_rn(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);   // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to inf
  if (a < 0x38800000u) {  // half subnormal (or zero): value / 2^-24, rounded to even
    const float v = bits_to_float(a) * 16777216.0f;  // exact scaling by 2^24
    const float r = std::nearbyint(v);               // default rounding mode: to even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));
  }
  uint32_t m = a + 0xFFFu + ((a >> 13) & 1u);  // round mantissa to 10 bits, to even
  m -= 0x38000000u;                            // rebias exponent 127 -> 15
  return static_cast<uint16_t>(sign | (m >> 13));
}
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) {
    const float v = static_cast<float>(m) / 16777216.0f;
    return sign ? -v : v;
  }
  if (e == 31) return bits_to_float(sign | 0x7F800000u | (m << 13));
  return bits_to_float(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace emu

struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : bits(emu::float_to_bf16_rn(f)) {}  // NOLINT: like CUDA's
  operator float() const { return emu::bf16_to_float(bits); }
};
struct __half {
  uint16_t bits;
  __half() = default;
  __half(float f) : bits(emu::float_to_half_rn(f)) {}  // NOLINT: like CUDA's
  operator float() const { return emu::half_to_float(bits); }
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;  // x in the low 16 bits, as in CUDA
};
struct __half2 {
  __half x, y;
};
static_assert(sizeof(__nv_bfloat162) == 4 && sizeof(__half2) == 4, "packed pairs");

inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__nv_bfloat16(a), __nv_bfloat16(b)};
}
inline __half2 __floats2half2_rn(float a, float b) {
  return {__half(a), __half(b)};
}
#define PA2A_EMU_PAIR_OP(T2, name, op)                           \
  inline T2 name(T2 a, T2 b) {                                   \
    return {static_cast<float>(a.x) op static_cast<float>(b.x),  \
            static_cast<float>(a.y) op static_cast<float>(b.y)}; \
  }
PA2A_EMU_PAIR_OP(__nv_bfloat162, __hadd2, +)
PA2A_EMU_PAIR_OP(__nv_bfloat162, __hsub2, -)
PA2A_EMU_PAIR_OP(__nv_bfloat162, __hmul2, *)
PA2A_EMU_PAIR_OP(__half2, __hadd2, +)
PA2A_EMU_PAIR_OP(__half2, __hsub2, -)
PA2A_EMU_PAIR_OP(__half2, __hmul2, *)
#undef PA2A_EMU_PAIR_OP

inline float __expf(float x) {
  return std::exp(x);
}

namespace emu {

// ---- global memory registry (bounds checks of the accesses routed through the model) ---
struct Buffer {
  const unsigned char* begin;
  size_t bytes;
  std::string name;
};
inline std::vector<Buffer> buffers;

inline void check_global(const void* p, size_t n, const char* what) {
  const auto* c = static_cast<const unsigned char*>(p);
  for (const Buffer& b : buffers)
    if (c >= b.begin && c + n <= b.begin + b.bytes) return;
  char msg[160];
  std::snprintf(msg, sizeof msg, "%s of %zu bytes at %p is outside every buffer", what, n, p);
  fail(msg);
}

// ---- fibers -------------------------------------------------------------------------------
struct Copy {
  void* dst;
  const void* src;
  bool pred;
};

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;  // uninitialised: pages are touched only as used
  unsigned tid = 0;
  bool done = false;
  bool blocked = false;
  std::vector<Copy> open;                  // cp.async issued since the last commit
  std::deque<std::vector<Copy>> inflight;  // committed groups, oldest first
  int mma_parity = 0;
};

struct MmaSlot {
  uint32_t a[4];
  uint32_t b[2];
};

struct MmaOperands {
  uint64_t epoch = ~uint64_t{0};  // warp barrier generation these were decoded in
  float a[16][16];
  float b[16][8];
};

struct Runtime {
  std::vector<Fiber> fibers;
  ucontext_t main_ctx;
  unsigned current = 0, nthreads = 0;
  int bar_count = 0, or_acc = 0, or_result = 0;
  uint64_t bar_gen = 0, progress = 0;
  int warp_count[32] = {};
  uint64_t warp_gen[32] = {};
  MmaSlot mma[32][2][32];  // [warp][parity][lane]
  MmaOperands mma_ops[32][2];
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  std::function<void()> body;
};
inline Runtime rt;

inline Fiber& self() {
  return rt.fibers[rt.current];
}

inline void yield() {
  Fiber& f = self();
  if (swapcontext(&f.ctx, &rt.main_ctx) != 0) fail("swapcontext");
}

inline void complete(std::vector<Copy>& group) {
  for (const Copy& c : group) {
    if (c.pred) {
      std::memcpy(c.dst, c.src, 16);
    } else {
      std::memset(c.dst, 0, 16);
    }
  }
  group.clear();
}

inline void trampoline() {
  rt.body();
  Fiber& f = self();
  // A thread that exits with copies in flight: they still land (the hardware finishes them).
  while (!f.inflight.empty()) {
    complete(f.inflight.front());
    f.inflight.pop_front();
  }
  complete(f.open);
  f.done = true;
  ++rt.progress;
}  // returns to rt.main_ctx through uc_link

constexpr size_t kStackBytes = 256 * 1024;

// Runs body on `threads` fibers for each block of `grid`, blocks in order.
inline void launch(unsigned grid, unsigned threads, size_t smem_bytes, std::function<void()> body) {
  if (threads > 1024 || threads % 32 != 0) fail("block size must be a multiple of 32, <= 1024");
  gridDim.x = grid;
  blockDim.x = threads;
  rt.body = std::move(body);
  rt.nthreads = threads;
  std::free(rt.smem);
  rt.smem_bytes = smem_bytes;
  rt.smem = static_cast<unsigned char*>(std::aligned_alloc(128, smem_bytes + 128));
  rt.fibers.resize(threads);
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    std::memset(rt.smem, 0xA5, smem_bytes + 128);  // shared memory starts as garbage
    rt.bar_count = rt.or_acc = 0;
    for (int w = 0; w < 32; ++w) rt.warp_count[w] = 0;
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = rt.fibers[t];
      if (!f.stack) f.stack.reset(new char[kStackBytes]);
      f.tid = t;
      f.done = f.blocked = false;
      f.open.clear();
      f.inflight.clear();
      f.mma_parity = 0;
      if (getcontext(&f.ctx) != 0) fail("getcontext");
      f.ctx.uc_stack.ss_sp = f.stack.get();
      f.ctx.uc_stack.ss_size = kStackBytes;
      f.ctx.uc_link = &rt.main_ctx;
      makecontext(&f.ctx, trampoline, 0);
    }
    for (;;) {
      const uint64_t before = rt.progress;
      bool live = false, all_blocked = true;
      for (unsigned t = 0; t < threads; ++t) {
        Fiber& f = rt.fibers[t];
        if (f.done) continue;
        rt.current = t;
        threadIdx.x = t;
        if (swapcontext(&rt.main_ctx, &f.ctx) != 0) fail("swapcontext");
        if (!f.done) live = true;
        if (!f.done && !f.blocked) all_blocked = false;
      }
      if (!live) break;
      if (all_blocked && rt.progress == before)
        fail("deadlock: every live thread waits at a barrier that cannot complete");
    }
  }
  std::free(rt.smem);
  rt.smem = nullptr;
}

// Barrier over `n` participants with the given counter/generation.
inline void barrier(int& count, uint64_t& gen, int n) {
  const uint64_t g = gen;
  if (++count == n) {
    count = 0;
    ++gen;
    ++rt.progress;
    return;
  }
  Fiber& f = self();
  f.blocked = true;
  while (gen == g) yield();
  f.blocked = false;
}

inline void check_smem(const void* p, size_t n, const char* what) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < rt.smem || c + n > rt.smem + rt.smem_bytes) fail(std::string(what) + " outside smem");
}

}  // namespace emu

// ---- CUDA device built-ins ----------------------------------------------------------------
inline void __syncthreads() {
  emu::barrier(emu::rt.bar_count, emu::rt.bar_gen, static_cast<int>(emu::rt.nthreads));
}
inline int __syncthreads_or(int pred) {
  emu::rt.or_acc |= pred != 0;
  const uint64_t g = emu::rt.bar_gen;
  if (emu::rt.bar_count + 1 == static_cast<int>(emu::rt.nthreads)) {
    emu::rt.or_result = emu::rt.or_acc;
    emu::rt.or_acc = 0;
  }
  emu::barrier(emu::rt.bar_count, emu::rt.bar_gen, static_cast<int>(emu::rt.nthreads));
  if (emu::rt.bar_gen == g) emu::fail("__syncthreads_or: barrier bookkeeping");
  return emu::rt.or_result;
}
inline void __threadfence() {}
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}
inline float atomicAdd(float* p, float v) {
  emu::check_global(p, 4, "atomicAdd(float)");
  const float old = *p;
  *p = old + v;
  return old;
}
inline float __ldcg(const float* p) {
  emu::check_global(p, 4, "__ldcg");
  return *p;
}
inline void __stcg(float* p, float v) {
  emu::check_global(p, 4, "__stcg");
  *p = v;
}
