// Portability macros for code shared by host C++ and CUDA kernels.
//
// Everything under csrc/core that the kernels reuse (index math, wire format,
// quantisation) is written against these macros so that one definition serves the
// CPU transport, the CPU tests and the device code.
#pragma once

#if defined(__CUDACC__)
#define PA2A_HD __host__ __device__ __forceinline__
#define PA2A_DEVICE __device__ __forceinline__
#else
#define PA2A_HD inline
#define PA2A_DEVICE inline
#endif

#include <cstddef>
#include <cstdint>

namespace pa2a {

PA2A_HD constexpr size_t align_up(size_t n, size_t a) {
  return (n + a - 1) / a * a;
}

}  // namespace pa2a
