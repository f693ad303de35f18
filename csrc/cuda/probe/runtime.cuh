// The multi-device CUDA runtime calls of the probe's host code, as thin wrappers, so that the
// probe's CPU emulation can stand in N fake devices for them (its fake
// runtime has one device). Everything else the probe calls is the plain runtime API.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

namespace pa2a::probe::rt {

inline cudaError_t device_count(int* n) {
  return cudaGetDeviceCount(n);
}
inline cudaError_t set_device(int d) {
  return cudaSetDevice(d);
}
inline cudaError_t can_access_peer(int* ok, int from, int to) {
  return cudaDeviceCanAccessPeer(ok, from, to);
}

// Peer access from the current device to `peer`; already enabled is success.
inline cudaError_t enable_peer(int peer) {
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
    return cudaSuccess;
  }
  return e;
}

inline cudaError_t copy_peer(void* dst, int dst_dev, const void* src, int src_dev, size_t n,
                             cudaStream_t s) {
  return cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, n, s);
}

inline cudaError_t sm_count(int* n, int d) {
  return cudaDeviceGetAttribute(n, cudaDevAttrMultiProcessorCount, d);
}

inline std::string bus_id(int d) {
  char buf[32] = {0};
  if (cudaDeviceGetPCIBusId(buf, sizeof buf, d) != cudaSuccess) {
    (void)cudaGetLastError();
    return "";
  }
  return buf;
}

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" as nvidia-smi prints it, "" when unknown.
inline std::string uuid(int d) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
    (void)cudaGetLastError();
    return "";
  }
  const auto* b = reinterpret_cast<const unsigned char*>(p.uuid.bytes);
  char out[48];
  std::snprintf(out, sizeof out,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return out;
}

inline std::string name(int d) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
    (void)cudaGetLastError();
    return "";
  }
  return p.name;
}

inline int driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) (void)cudaGetLastError();
  return v;
}

inline cudaError_t elapsed_ms(float* ms, cudaEvent_t a, cudaEvent_t b) {
  return cudaEventElapsedTime(ms, a, b);
}

// The start gate: closed before a measurement's launches are queued, opened after.
inline void close_gate(volatile uint32_t* go) {
  *go = 0;
}
inline void open_gate(volatile uint32_t* go) {
  *go = 1;
}

}  // namespace pa2a::probe::rt
