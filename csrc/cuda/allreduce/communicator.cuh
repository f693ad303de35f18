// Host side of the CUDA all-reduce of one rank: its segment (core/allreduce_wire.h layout)
// in device memory, exported with CUDA IPC; the peers' segments opened through IPC (or, for
// ranks in the same process, their device pointers); the call state and the host-mapped
// error word; the launches. Every pair must be P2P: a group with a host-staged pair is
// handed to NCCL by the Python layer before this class is made.
//
// Lifetime (collective, Python drives it): construct on every rank; exchange
// ipc_handle(); open_peers() on every rank; calls; close() (also from the destructor)
// waits for this rank's own last call (an event recorded after every call issued outside a
// graph capture; all calls of a communicator are in one stream order, which the call number
// on the device needs anyway), closes the IPC mappings and frees everything. Never
// cudaDeviceSynchronize: that also waits for NCCL's and every other stream's work, and for
// kernels that wait on peers. Peers must have stopped touching this rank's segment first
// (Python: a barrier before close); there is no close handshake yet.
//
// Errors: CUDA API failures throw pa2a::Error(kRuntime) naming the call; problems a kernel
// saw (a peer that timed out, aborted or disagrees) land in the error word and check()
// throws them naming the peer, the phase and the call (kTimeout, kAborted, kPeer). An abort
// is cleared once reported (every rank skipped that call); the others stay.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/allreduce_wire.h"
#include "cuda/allreduce/kernels.cuh"

namespace pa2a::ar {

class CudaAllReduce {
 public:
  CudaAllReduce(int32_t rank, const Config& config, int32_t device, bool end_barrier);
  ~CudaAllReduce();
  CudaAllReduce(const CudaAllReduce&) = delete;
  CudaAllReduce& operator=(const CudaAllReduce&) = delete;

  std::string ipc_handle() const;  // 64 bytes (cudaIpcMemHandle_t)
  uintptr_t segment_ptr() const { return reinterpret_cast<uintptr_t>(seg_); }

  // handles[r]: rank r's ipc_handle(); local[r] != 0: rank r lives in this process and that
  // is its segment_ptr() (CUDA refuses to open a process's own IPC handle); pull[s * W + d]:
  // d loads s's data from s's segment.
  void open_peers(const std::vector<std::string>& handles, const std::vector<uintptr_t>& local,
                  const std::vector<uint8_t>& pull);
  void close();

  // One all-reduce on `stream` (enqueue only). Raises a pending kernel error first.
  void run(Algo algo, DType dtype, const void* x, int64_t numel, const void* residual, void* out,
           double timeout_s, cudaStream_t stream);
  // This rank raised before its next call: peers skip that call (enqueue only).
  void abort(double timeout_s, cudaStream_t stream);
  void check();
  uint64_t error_word() const;
  const std::vector<uint64_t>& last_bytes() const { return last_bytes_; }
  int32_t rank() const { return rank_; }
  int32_t device() const { return device_; }
  size_t segment_bytes() const { return layout_.total; }
  uint32_t host_calls() const { return host_calls_; }

 private:
  KernelArgs args(double timeout_s) const;
  void require_open(const char* what) const;
  void count_bytes(Algo algo, int64_t numel);
  void mark_done(cudaStream_t stream);  // records done_ after a call (not while capturing)

  int32_t rank_;
  Config config_;
  Layout layout_;
  int32_t device_;
  bool end_barrier_;
  bool opened_ = false;
  bool closed_ = false;
  uint32_t host_calls_ = 0;  // calls issued from this host (messages only)
  uint8_t* seg_ = nullptr;
  DeviceState* state_ = nullptr;
  uint64_t* err_host_ = nullptr;
  uint64_t* err_dev_ = nullptr;
  cudaEvent_t done_ = nullptr;  // recorded after every call issued outside a capture
  bool done_recorded_ = false;
  uint8_t* base_[kMaxWorld] = {};
  std::vector<void*> ipc_opened_;
  std::vector<uint8_t> pull_;
  uint32_t pull_from_ = 0, pull_to_ = 0;
  std::vector<uint64_t> last_bytes_;
};

}  // namespace pa2a::ar
