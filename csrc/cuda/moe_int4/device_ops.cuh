// The device primitives the INT4 GEMM is written against: inline PTX (cp.async, lop3,
// prmt, ldmatrix, mma.sync, griddepcontrol), the paired fma and the dynamic shared memory.
// Everything else in gemm_kernel.cuh and schedule.cuh is plain C++ over these functions, so
// the CPU emulation can substitute a host implementation of exactly this header (one fiber
// per CUDA thread, cp.async groups that land only at wait_group, the warp-collective mma built from
// the PTX fragment tables) and run the kernel source on the CPU. Keep every PTX statement of the
// GEMM here, with the same signatures as the emulation's copy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pa2a::moe_int4 {

__device__ __forceinline__ unsigned char* dynamic_smem() {
  extern __shared__ __align__(16) unsigned char moe_int4_smem[];
  return moe_int4_smem;
}

// (a & b) | c in one LOP3 (nvcc does not always fuse it): immLut 0xEA = (F0 & CC) | AA.
__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Byte permute (one PRMT): selector nibbles pick bytes of {b, a}; 0x1010 broadcasts the low
// 16-bit half of a to both halves, 0x3232 the high half.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(d) : "r"(a), "r"(sel));
  return d;
}

// d = a * b + c on a pair, rounded once (HFMA2).
__device__ __forceinline__ __nv_bfloat162 fma2(__nv_bfloat162 a, __nv_bfloat162 b,
                                               __nv_bfloat162 c) {
  return __hfma2(a, b, c);
}
__device__ __forceinline__ __half2 fma2(__half2 a, __half2 b, __half2 c) {
  return __hfma2(a, b, c);
}

// Four 8x8 16-bit matrices from shared memory, one per register (ldmatrix.x4): lane l gives
// the 16-byte row address of row l % 8 of matrix l / 8; register j of lane t receives
// elements 2 (t % 4), +1 of row t / 4 of matrix j. Rows must be 16-byte aligned.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// Programmatic dependent launch: wait until the preceding kernel of the stream has
// completed and its memory is visible. Kernels launched with the programmatic
// serialization attribute (sm_90 and newer) start early and block here; without the
// attribute (and before sm_90) it returns at once.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Let the next kernel of the stream launch now: its CTAs become resident as this grid's
// CTAs exit and wait in grid_dependency_wait() for this grid to complete, so only the
// launch latency overlaps; correctness never depends on where this is called.
__device__ __forceinline__ void grid_dependency_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// 16 bytes global -> shared, asynchronous; pred false: fill with zeros, read nothing.
// Both addresses must be 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

// Wait until at most kPending of this thread's committed groups are still in flight.
// The "memory" clobber keeps the compiler from moving shared-memory accesses across it.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Ticket of the split-K and finalise tails: one RMW that releases what this CTA wrote
// before its barrier (cumulativity: the other threads' red.adds were ordered before it by
// __syncthreads) and acquires what the earlier parts released; the CTA's other threads
// read after the next barrier. Replaces a seq-cst fence before and after the RMW in every
// thread (MEMBAR.SC: a full drain of the memory pipeline each).
__device__ __forceinline__ int32_t atomic_add_acq_rel(int32_t* p, int32_t v) {
  int32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}

// Hint: fetch the 128-byte line holding p into L2 (no register result, no fault, no
// ordering). The gate/up GEMM's CTAs issue it for the down projection's weights when they
// run out of work, so the down GEMM's first k-tiles hit L2 across the launch gap.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// D = A * B + D, m16n8k16, A row-major bf16/fp16 (4 regs), B col-major (2 regs), fp32 D.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace pa2a::moe_int4
