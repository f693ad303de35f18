// Opening a peer's exported device segment, for the transport and the all-reduce host code.
//
// A handle that does not open is the peer pair's problem (no P2P between the GPUs, an IOMMU
// or ACS setting), not this process's: it is a pa2a::Error of kind kPeer (PeerError in
// Python) naming both ranks, what the segment is, and what the caller can do about it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "core/exception.h"

namespace pa2a::cuda {

// Maps the segment behind `handle` (bytes of a cudaIpcMemHandle_t from rank `peer`) into
// this process. `what` names the segment ("device segment"), `hint` ends the error message.
inline void* open_ipc_handle(const std::string& handle, int32_t self, int32_t peer,
                             const char* what, const char* hint) {
  PA2A_CHECK_ARG(handle.size() == sizeof(cudaIpcMemHandle_t), "rank ", peer, "'s IPC handle has ",
                 handle.size(), " bytes, expected ", sizeof(cudaIpcMemHandle_t));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    PA2A_THROW(kPeer, "rank ", self, " cannot open rank ", peer, "'s ", what,
               " through CUDA IPC: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err), " (",
               hint, ")");
  }
  return p;
}

}  // namespace pa2a::cuda
