// Checks of CUDA runtime calls in the host code of the transport and the all-reduce.
//
// The library never aborts (core/exception.h): a failed runtime call or kernel launch becomes
// pa2a::Error (kRuntime, RuntimeError in Python) naming the call and CUDA's error. Torch-free;
// the CPU execution model of CUDA provides the runtime these use.
#pragma once

#include <cuda_runtime.h>

#include "core/exception.h"

// The failed call, CUDA's error name and text, and the place. The sticky last error is
// cleared, so the next check does not report this failure again.
#define PA2A_CUDA_CHECK(call)                                                \
  do {                                                                       \
    const cudaError_t err_ = (call);                                         \
    if (err_ != cudaSuccess) {                                               \
      (void)cudaGetLastError();                                              \
      PA2A_THROW(kRuntime, #call, " failed: ", cudaGetErrorName(err_), ": ", \
                 cudaGetErrorString(err_), " at ", __FILE__, ":", __LINE__); \
    }                                                                        \
  } while (0)

namespace pa2a::cuda {

// Launch errors surface at the next CUDA call; report them at the call that made them.
// `what` names the kernel (and the component where the name alone does not say it).
inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    PA2A_THROW(kRuntime, "CUDA kernel launch (", what, ") failed: ", cudaGetErrorName(err), ": ",
               cudaGetErrorString(err));
}

// Whether `stream` is being captured into a CUDA graph (its work then runs at the replays).
inline bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
         status != cudaStreamCaptureStatusNone;
}

// Makes `device` current for the scope (the caller's thread may have another current).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : target_(device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) PA2A_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && prev_ != target_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
  int target_;
};

}  // namespace pa2a::cuda
