// A small CUDA execution model on the CPU, for running kernel *source* without a GPU. Shared
// by the INT4 MoE GEMM emulation (tests/native/moe_int4_emu, which adds cp.async and
// mma.sync in its device_ops.cuh) and the dispatch/combine transport emulation
// (tests/native/transport_emu, which adds a fake CUDA runtime in emu_runtime.h).
//
// What is modelled, and how it can expose kernel bugs:
//  * Every CUDA thread of a block is a fiber (ucontext); blocks of a grid run one after the
//    other in the calling process (in index order, or shuffled with EMU_SCHEDULE=<seed>).
//    __syncthreads / __syncthreads_or are real barriers over the block, so the kernel's
//    own ordering is what makes data visible; a barrier that not every thread reaches
//    (one exited, or waits at another barrier) is reported as a deadlock.
//  * Threads switch only at barriers and warp collectives. Between two switch points a
//    thread runs alone, so atomics on shared memory are atomic; global-memory atomics
//    are real __atomic RMWs as well, because other processes (ranks) share that memory.
//    With EMU_SCHEDULE the threads resume in a different random order after every
//    switch point, so code that relies on an order the hardware does not promise (which
//    thread of a block arrives last, which block finishes first) sees other orders.
//  * Warp collectives (__syncwarp, __ballot_sync, __shfl_sync, __shfl_up_sync) are
//    switch points: each lane publishes its value, waits for the 32 lanes of its warp,
//    then reads the others'. Of these only __syncwarp orders memory among the lanes (as
//    bar.warp.sync does in PTX); a model extension can act at the barriers that do
//    (Hooks::memory_sync: the transport's lane views poison what one lane acquired until
//    such a barrier, so a shuffle taken for a synchronisation reads garbage). Only the full mask of
//    a full warp is modelled; a lane that skipped the collective (exited, or diverged into another
//    collective) is reported (deadlock, or "lanes of one warp in different collectives").
//  * Shared memory starts as garbage (0xA5 bytes) in every block: the dynamic part is a
//    fresh allocation per launch (exact size, so AddressSanitizer sees overruns), and the
//    static __shared__ variables (function statics here) are refilled at every block start
//    when the build collects them into one section (transport_emu/emu_shared.ld); reading
//    shared memory before writing it gives garbage, not a previous block's value.
//  * bf16/fp16 are bit-exact 16-bit types with round-to-nearest-even conversions; the
//    two-element intrinsics compute in fp32 and round once. __fadd_rn/__fmul_rn are fp32
//    operations (builds use -ffp-contract=off, so nothing fuses them).
//  * int4/uint4/float4 are 16-byte aligned as in CUDA: a misaligned vector access (a fault
//    on the GPU) is reported by UndefinedBehaviorSanitizer's alignment check.
//  * __nanosleep (the back-off of a polling wait) really sleeps ~20 us instead of yielding:
//    the ranks being waited for are other processes, and the test machines have fewer
//    cores than ranks, so a spinning waiter must free its core. A polling thread does not
//    switch to the other threads of its block: a kernel that spins on a thread or block
//    of its own grid would not progress here (the transport's waits are on other ranks).
// Not modelled: timing, bank conflicts, true concurrency of warps within a block (threads
// of one block interleave only at switch points), and the memory model beyond sequential
// consistency inside a process.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// ---- CUDA keywords and built-in types ---------------------------------------------------
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // one block runs at a time: function statics are its shared memory
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1)  // NOLINT: like CUDA's
      : x(vx), y(vy), z(vz) {}
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) int2 {
  int x, y;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
inline int2 make_int2(int x, int y) {
  return int2{x, y};
}
inline uint2 make_uint2(unsigned x, unsigned y) {
  return uint2{x, y};
}
inline int4 make_int4(int x, int y, int z, int w) {
  return int4{x, y, z, w};
}
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  return uint4{x, y, z, w};
}
inline float4 make_float4(float x, float y, float z, float w) {
  return float4{x, y, z, w};
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

// Static __shared__ variables, collected into one section by the linker script of builds
// that want them refilled with garbage at every block start (weak: absent otherwise).
extern "C" __attribute__((weak)) unsigned char emu_static_smem_begin[];
extern "C" __attribute__((weak)) unsigned char emu_static_smem_end[];

namespace emu {

[[noreturn]] inline void fail(const std::string& msg) {
  std::fprintf(stderr, "EMU ERROR: %s (block %u,%u thread %u)\n", msg.c_str(), blockIdx.x,
               blockIdx.y, threadIdx.x);
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
inline float __fadd_rn(float a, float b) {
  return a + b;
}
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline int __popc(unsigned x) {
  return __builtin_popcount(x);
}
inline int __popcll(unsigned long long x) {
  return __builtin_popcountll(x);
}
inline int __ffs(int x) {
  return __builtin_ffs(x);
}
inline int __ffsll(long long x) {
  return __builtin_ffsll(x);
}

namespace emu {

// ---- global memory registry (bounds checks of the accesses routed through the model) ---
// A driver that registers its buffers gets __ldcg/__stcg/atomicAdd(float) checked against
// them; with no buffer registered those checks are off (the transport driver relies on
// AddressSanitizer poisoning of its device arena instead, which sees every access).
struct Buffer {
  const unsigned char* begin;
  size_t bytes;
  std::string name;
};
inline std::vector<Buffer> buffers;

inline void check_global(const void* p, size_t n, const char* what) {
  if (buffers.empty()) return;
  const auto* c = static_cast<const unsigned char*>(p);
  for (const Buffer& b : buffers)
    if (c >= b.begin && c + n <= b.begin + b.bytes) return;
  char msg[160];
  std::snprintf(msg, sizeof msg, "%s of %zu bytes at %p is outside every buffer", what, n, p);
  fail(msg);
}

// ---- fibers -------------------------------------------------------------------------------
struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;  // uninitialised: pages are touched only as used
  unsigned tid = 0;
  bool done = false;
  const char* waiting = nullptr;  // the barrier a blocked thread waits at
  unsigned warp_parity = 0;       // slot set of this lane's next warp collective
};

// One warp's collective state. Two slot sets alternate: a lane can overwrite set p (at
// collective n + 2) only after the barrier of collective n + 1, which every lane reaches
// only after reading its result of collective n from set p.
struct Warp {
  int count = 0;
  uint64_t gen = 0;
  uint64_t slot[2][32] = {};
  const char* what[2][32] = {};
};

// Per-kernel extensions (the INT4 model's cp.async queues): called at every block start
// and when a thread returns from the kernel. memory_sync (the transport's lane views,
// transport_emu/include/emu_lane_view.h): called when a barrier that orders memory
// completes, before any of its threads goes on: __syncwarp of warp w (w), __syncthreads
// and __syncthreads_or (kBlockSync), and at the end of every block (kBlockEnd). Shuffles,
// ballots and reductions order no memory (PTX memory model) and call nothing.
struct Hooks {
  void (*block_begin)() = nullptr;
  void (*thread_exit)() = nullptr;
  void (*memory_sync)(int warp) = nullptr;
};
constexpr int kNoSync = -3, kBlockEnd = -2, kBlockSync = -1;
inline Hooks hooks;

struct Runtime {
  std::vector<Fiber> fibers;
  ucontext_t main_ctx;
  unsigned current = 0, nthreads = 0;
  int bar_count = 0, or_acc = 0, or_result = 0;
  uint64_t bar_gen = 0, progress = 0;
  Warp warps[32];
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  std::function<void()> body;
  uint64_t rng = 0;  // EMU_SCHEDULE state; 0: program order
  bool rng_read = false;
  uint64_t block_serial = 0;  // blocks begun by this process (a block's identity)
};
inline Runtime rt;

inline Fiber& self() {
  return rt.fibers[rt.current];
}

inline void yield() {
  Fiber& f = self();
  if (swapcontext(&f.ctx, &rt.main_ctx) != 0) fail("swapcontext");
}

inline void trampoline() {
  rt.body();
  if (hooks.thread_exit != nullptr) hooks.thread_exit();
  self().done = true;
  ++rt.progress;
}  // returns to rt.main_ctx through uc_link

constexpr size_t kStackBytes = 256 * 1024;

inline uint64_t next_random() {  // xorshift64*
  rt.rng ^= rt.rng >> 12;
  rt.rng ^= rt.rng << 25;
  rt.rng ^= rt.rng >> 27;
  return rt.rng * 0x2545F4914F6CDD1Dull;
}

// 0..n-1, shuffled when EMU_SCHEDULE is set.
inline void schedule_order(std::vector<unsigned>& order, size_t n) {
  if (!rt.rng_read) {
    rt.rng_read = true;
    const char* s = std::getenv("EMU_SCHEDULE");
    rt.rng = s != nullptr ? std::strtoull(s, nullptr, 0) : 0;
    if (rt.rng != 0) rt.rng = rt.rng * 0x9E3779B97F4A7C15ull | 1u;
  }
  order.resize(n);
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<unsigned>(i);
  if (rt.rng == 0) return;
  for (size_t i = n; i > 1; --i) std::swap(order[i - 1], order[next_random() % i]);
}

// Refills the static __shared__ variables with garbage. Byte by byte through a volatile
// pointer, not instrumented: the section also holds AddressSanitizer's redzones between
// the variables (writing those is harmless; memset would be reported).
__attribute__((no_sanitize_address)) inline void fill_static_smem() {
  if (emu_static_smem_begin == nullptr || emu_static_smem_end <= emu_static_smem_begin) return;
  volatile unsigned char* p = emu_static_smem_begin;
  for (; p < emu_static_smem_end; ++p) *p = 0xA5;
}

// Runs body on block.x fibers for each block of grid (x and y), blocks one after another.
inline void launch(dim3 grid, dim3 block, size_t smem_bytes, std::function<void()> body) {
  const unsigned threads = block.x;
  if (threads == 0 || threads > 1024 || block.y != 1 || block.z != 1)
    fail("block must be 1-D with 1..1024 threads");
  if (grid.x == 0 || grid.y == 0 || grid.z != 1) fail("grid must be non-empty with z = 1");
  gridDim = grid;
  blockDim = block;
  threadIdx = dim3(0, 0, 0);
  rt.body = std::move(body);
  rt.nthreads = threads;
  rt.smem_bytes = smem_bytes;
  void* smem = nullptr;
  if (posix_memalign(&smem, 128, smem_bytes ? smem_bytes : 1) != 0) fail("posix_memalign");
  rt.smem = static_cast<unsigned char*>(smem);
  rt.fibers.resize(threads);
  std::vector<unsigned> blocks, round;
  schedule_order(blocks, static_cast<size_t>(grid.x) * grid.y);
  for (const unsigned b : blocks) {
    blockIdx = dim3(b % grid.x, b / grid.x, 0);
    std::memset(rt.smem, 0xA5, smem_bytes);  // shared memory starts as garbage
    fill_static_smem();
    rt.bar_count = rt.or_acc = 0;
    ++rt.block_serial;
    for (Warp& w : rt.warps) w.count = 0;
    if (hooks.block_begin != nullptr) hooks.block_begin();
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = rt.fibers[t];
      if (!f.stack) f.stack.reset(new char[kStackBytes]);
      f.tid = t;
      f.done = false;
      f.waiting = nullptr;
      f.warp_parity = 0;
      if (getcontext(&f.ctx) != 0) fail("getcontext");
      f.ctx.uc_stack.ss_sp = f.stack.get();
      f.ctx.uc_stack.ss_size = kStackBytes;
      f.ctx.uc_link = &rt.main_ctx;
      makecontext(&f.ctx, trampoline, 0);
    }
    for (;;) {
      const uint64_t before = rt.progress;
      bool live = false, all_blocked = true;
      schedule_order(round, threads);
      for (const unsigned t : round) {
        Fiber& f = rt.fibers[t];
        if (f.done) continue;
        rt.current = t;
        threadIdx.x = t;
        if (swapcontext(&rt.main_ctx, &f.ctx) != 0) fail("swapcontext");
        if (!f.done) live = true;
        if (!f.done && f.waiting == nullptr) all_blocked = false;
      }
      if (!live) break;
      if (all_blocked && rt.progress == before) {
        std::string msg = "deadlock: every live thread waits at a barrier that cannot complete:";
        unsigned shown = 0, exited = 0;
        for (const Fiber& f : rt.fibers) {
          exited += f.done;
          if (!f.done && shown++ < 4)
            msg += " thread " + std::to_string(f.tid) + " at " + f.waiting + ";";
        }
        fail(msg + " " + std::to_string(exited) + " threads of the block have exited");
      }
    }
    if (hooks.memory_sync != nullptr) hooks.memory_sync(kBlockEnd);
  }
  std::free(rt.smem);
  rt.smem = nullptr;
}

// Barrier over `n` participants with the given counter/generation; `sync` (a warp,
// kBlockSync or kNoSync): what Hooks::memory_sync is told when it completes.
inline void barrier(int& count, uint64_t& gen, int n, const char* what, int sync = kNoSync) {
  const uint64_t g = gen;
  if (++count == n) {
    if (sync != kNoSync && hooks.memory_sync != nullptr) hooks.memory_sync(sync);
    count = 0;
    ++gen;
    ++rt.progress;
    return;
  }
  Fiber& f = self();
  f.waiting = what;
  while (gen == g) yield();
  f.waiting = nullptr;
}

inline void check_smem(const void* p, size_t n, const char* what) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < rt.smem || c + n > rt.smem + rt.smem_bytes) fail(std::string(what) + " outside smem");
}

// A warp collective: publishes this lane's value, waits for the 32 lanes of the warp and
// returns the 32 published values (valid until this lane's next collective).
inline const uint64_t* warp_exchange(unsigned mask, uint64_t value, const char* what,
                                     bool orders_memory = false) {
  Fiber& f = self();
  const unsigned w = f.tid / 32, lane = f.tid % 32;
  if (mask != 0xffffffffu) fail(std::string(what) + ": only the full mask is modelled");
  if (rt.nthreads < 32 * (w + 1)) fail(std::string(what) + " in a partial warp");
  Warp& warp = rt.warps[w];
  const unsigned p = f.warp_parity;
  f.warp_parity ^= 1u;
  warp.slot[p][lane] = value;
  warp.what[p][lane] = what;
  barrier(warp.count, warp.gen, 32, what, orders_memory ? static_cast<int>(w) : kNoSync);
  for (unsigned l = 0; l < 32; ++l)
    if (warp.what[p][l] != what)
      fail(std::string("lanes of one warp in different collectives: ") + what + " and " +
           warp.what[p][l]);
  return warp.slot[p];
}

template <typename T>
inline uint64_t to_slot(T v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffled type");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <typename T>
inline T from_slot(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

}  // namespace emu

// ---- CUDA device built-ins ----------------------------------------------------------------
inline void __syncthreads() {
  emu::barrier(emu::rt.bar_count, emu::rt.bar_gen, static_cast<int>(emu::rt.nthreads),
               "__syncthreads", emu::kBlockSync);
}
inline int __syncthreads_or(int pred) {
  emu::rt.or_acc |= pred != 0;
  const uint64_t g = emu::rt.bar_gen;
  if (emu::rt.bar_count + 1 == static_cast<int>(emu::rt.nthreads)) {
    emu::rt.or_result = emu::rt.or_acc;
    emu::rt.or_acc = 0;
  }
  emu::barrier(emu::rt.bar_count, emu::rt.bar_gen, static_cast<int>(emu::rt.nthreads),
               "__syncthreads_or", emu::kBlockSync);
  if (emu::rt.bar_gen == g) emu::fail("__syncthreads_or: barrier bookkeeping");
  return emu::rt.or_result;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::warp_exchange(mask, 0, "__syncwarp", true);
}
// sm_80's warp reduction: every lane gets the maximum of the 32 lanes' values.
inline unsigned __reduce_max_sync(unsigned mask, unsigned value) {
  const uint64_t* v = emu::warp_exchange(mask, value, "__reduce_max_sync");
  unsigned m = 0;
  for (unsigned l = 0; l < 32; ++l)
    m = static_cast<unsigned>(v[l]) > m ? static_cast<unsigned>(v[l]) : m;
  return m;
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  const uint64_t* v = emu::warp_exchange(mask, pred != 0, "__ballot_sync");
  unsigned bits = 0;
  for (unsigned l = 0; l < 32; ++l) bits |= static_cast<unsigned>(v[l] != 0) << l;
  return bits;
}
template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  if (width != 32) emu::fail("__shfl_sync: only width 32 is modelled");
  const uint64_t* v = emu::warp_exchange(mask, emu::to_slot(var), "__shfl_sync");
  return emu::from_slot<T>(v[static_cast<unsigned>(src_lane) % 32u]);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  if (width != 32) emu::fail("__shfl_up_sync: only width 32 is modelled");
  const uint64_t* v = emu::warp_exchange(mask, emu::to_slot(var), "__shfl_up_sync");
  const unsigned lane = threadIdx.x % 32;
  return lane >= delta ? emu::from_slot<T>(v[lane - delta]) : var;
}
inline void __threadfence() {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
// Real atomic read-modify-writes: global memory may be shared with other processes.
template <typename T>
inline T emu_atomic_add(T* p, T v, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % sizeof(T) != 0)
    emu::fail(std::string(what) + " on a misaligned address");
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline int atomicAdd(int* p, int v) {
  return emu_atomic_add(p, v, "atomicAdd(int)");
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return emu_atomic_add(p, v, "atomicAdd(unsigned)");
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return emu_atomic_add(p, v, "atomicAdd(unsigned long long)");
}
inline int atomicExch(int* p, int v) {
  if (reinterpret_cast<uintptr_t>(p) % sizeof(int) != 0)
    emu::fail("atomicExch on a misaligned address");
  return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
inline float atomicAdd(float* p, float v) {  // one process at a time uses these (INT4)
  emu::check_global(p, 4, "atomicAdd(float)");
  const float old = *p;
  *p = old + v;
  return old;
}
inline int __ldcg(const int* p) {
  return *p;
}
inline unsigned __ldcg(const unsigned* p) {
  return *p;
}
inline float __ldcg(const float* p) {
  emu::check_global(p, 4, "__ldcg");
  return *p;
}
inline void __stcg(float* p, float v) {
  emu::check_global(p, 4, "__stcg");
  *p = v;
}
// The poll back-off of the transport's waits: a short real sleep, so that the processes
// being waited for get the CPU (the test machines have fewer cores than ranks).
inline void __nanosleep(unsigned ns) {
  (void)ns;
  const timespec ts{0, 20000};
  nanosleep(&ts, nullptr);
}
