// Host stand-in for csrc/cuda/probe/runtime.cuh: N fake devices in one process over the fake
// runtime's single device. Every device's memory comes from the one arena, so a "peer"
// pointer is an ordinary pointer, as it is with peer access under unified addressing.
// Differences from a GPU, on purpose: the start gate is always open (launches run when
// they are issued, so a kernel waiting for a gate the host opens later would never see it
// open), and event timing is a constant (the model has no time).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace pa2a::probe::rt {

inline int emu_devices = 4;
inline unsigned long long emu_no_peer = 0;  // bit (from * 8 + to): CUDA refuses peer access
inline int emu_current = 0;

inline cudaError_t device_count(int* n) {
  *n = emu_devices;
  return cudaSuccess;
}
inline cudaError_t set_device(int d) {
  if (d < 0 || d >= emu_devices) return cudaErrorInvalidDevice;
  emu_current = d;
  return cudaSuccess;
}
inline cudaError_t can_access_peer(int* ok, int from, int to) {
  *ok = (emu_no_peer >> (from * 8 + to) & 1) ? 0 : 1;
  return cudaSuccess;
}
inline cudaError_t enable_peer(int peer) {
  int ok = 0;
  (void)can_access_peer(&ok, emu_current, peer);
  return ok ? cudaSuccess : cudaErrorInvalidDevice;
}
inline cudaError_t copy_peer(void* dst, int dst_dev, const void* src, int src_dev, size_t n,
                             cudaStream_t s) {
  (void)dst_dev;
  (void)src_dev;
  return cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s);
}
inline cudaError_t sm_count(int* n, int d) {
  (void)d;
  *n = 3;
  return cudaSuccess;
}
inline std::string bus_id(int d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0000:%02x:00.0", 0x11 + d);
  return buf;
}
inline std::string uuid(int d) {
  return "GPU-emu-" + std::to_string(d);
}
inline std::string name(int d) {
  return "emulated device " + std::to_string(d);
}
inline int driver_version() {
  return 13000;
}
inline cudaError_t elapsed_ms(float* ms, cudaEvent_t a, cudaEvent_t b) {
  (void)a;
  (void)b;
  *ms = 1.0f;
  return cudaSuccess;
}
inline void close_gate(volatile uint32_t* go) {
  *go = 1;
}
inline void open_gate(volatile uint32_t* go) {
  *go = 1;
}

}  // namespace pa2a::probe::rt
