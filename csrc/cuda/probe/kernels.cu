// Kernels of the calibration probe; the invariants are in kernels.cuh.
#include "cuda/probe/kernels.cuh"

#include "cuda/common/ptx.cuh"
#include "cuda/probe/launch.cuh"
#include "cuda/probe/pattern.h"

namespace pa2a::probe {
namespace {

// System scope throughout: the other side of every access is another GPU.
using cuda::globaltimer_ns;
using cuda::ld_acquire_sys;
using cuda::ld_relaxed_sys;
using cuda::st_release_sys;

// Returns false (and records kGateTimeout) when the gate did not open in time.
__device__ bool wait_gate(const uint32_t* go, uint64_t timeout_ns, uint32_t* error) {
  if (go == nullptr) return true;
  const uint64_t start = globaltimer_ns();
  while (ld_relaxed_sys(go) == 0) {
    if (globaltimer_ns() - start > timeout_ns) {
      *reinterpret_cast<volatile uint32_t*>(error) = kGateTimeout;
      return false;
    }
    __nanosleep(200);
  }
  return true;
}

__global__ void flows_kernel(const FlowDesc* flows, int nflows, int blocks_per_flow,
                             const uint32_t* go, uint64_t timeout_ns, uint64_t* times,
                             uint32_t* error) {
  __shared__ int gate_open;
  __shared__ uint64_t start;
  if (threadIdx.x == 0) {
    gate_open = wait_gate(go, timeout_ns, error) ? 1 : 0;
    start = globaltimer_ns();
  }
  __syncthreads();
  const int flow = static_cast<int>(blockIdx.x) / blocks_per_flow;
  const int part = static_cast<int>(blockIdx.x) % blocks_per_flow;
  if (gate_open && flow < nflows) {
    const FlowDesc f = flows[flow];
    const uint64_t vectors = f.bytes / 16;
    const uint4* src = reinterpret_cast<const uint4*>(f.src);
    uint4* dst = reinterpret_cast<uint4*>(f.dst);
    const uint64_t stride = static_cast<uint64_t>(blocks_per_flow) * blockDim.x;
    for (uint64_t i = static_cast<uint64_t>(part) * blockDim.x + threadIdx.x; i < vectors;
         i += stride) {
      dst[i] = src[i];
    }
    if (part == 0) {
      for (uint64_t i = vectors * 16 + threadIdx.x; i < f.bytes; i += blockDim.x) {
        f.dst[i] = f.src[i];
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    times[2 * blockIdx.x] = start;
    times[2 * blockIdx.x + 1] = globaltimer_ns();
  }
}

__global__ void gate_wait_kernel(const uint32_t* go, uint64_t timeout_ns, uint32_t* error) {
  if (threadIdx.x == 0) (void)wait_gate(go, timeout_ns, error);
}

__global__ void fill_kernel(unsigned char* buf, uint64_t bytes, uint32_t seed, int complement) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint8_t flip = complement ? 0xFF : 0x00;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes;
       i += stride) {
    buf[i] = static_cast<unsigned char>(pattern_byte(seed, i) ^ flip);
  }
}

__global__ void ring_init_kernel(uint32_t* ring, uint32_t words, uint32_t stride) {
  const uint32_t step = gridDim.x * blockDim.x;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += step) {
    ring[i] = static_cast<uint32_t>((static_cast<uint64_t>(i) + stride) % words);
  }
}

__global__ void chase_kernel(const uint32_t* ring, int iters, uint64_t* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  uint32_t idx = 0;
  const uint64_t t0 = globaltimer_ns();
  for (int k = 0; k < iters; ++k) idx = ld_relaxed_sys(ring + idx);
  out[0] = globaltimer_ns() - t0;
  out[1] = idx;
}

__global__ void pingpong_kernel(uint64_t* local_flag, uint64_t* remote_flag, uint64_t base,
                                int iters, int initiator, uint64_t timeout_ns, uint64_t* out_ns,
                                uint32_t* error) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const uint64_t t0 = globaltimer_ns();
  for (int k = 1; k <= iters; ++k) {
    const uint64_t want = base + static_cast<uint64_t>(k);
    if (initiator) st_release_sys(remote_flag, want);
    while (ld_acquire_sys(local_flag) != want) {
      if (globaltimer_ns() - t0 > timeout_ns) {
        *reinterpret_cast<volatile uint32_t*>(error) = kPeerTimeout;
        return;
      }
    }
    if (!initiator) st_release_sys(remote_flag, want);
  }
  if (initiator) out_ns[0] = globaltimer_ns() - t0;
}

}  // namespace

void launch_flows(const FlowDesc* flows, int nflows, int blocks_per_flow, const uint32_t* go,
                  uint64_t timeout_ns, uint64_t* times, uint32_t* error, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(nflows * blocks_per_flow));
  launch_kernel(flows_kernel, grid, dim3(kFlowThreads), 0, stream, flows, nflows, blocks_per_flow,
                go, timeout_ns, times, error);
}

void launch_gate_wait(const uint32_t* go, uint64_t timeout_ns, uint32_t* error,
                      cudaStream_t stream) {
  launch_kernel(gate_wait_kernel, dim3(1), dim3(32), 0, stream, go, timeout_ns, error);
}

void launch_fill(unsigned char* buf, uint64_t bytes, uint32_t seed, bool complement,
                 cudaStream_t stream) {
  const uint64_t blocks = (bytes + 4095) / 4096;  // about 16 bytes per thread, at most 256 blocks
  launch_kernel(fill_kernel, dim3(static_cast<unsigned>(blocks < 256 ? blocks : 256)), dim3(256), 0,
                stream, buf, bytes, seed, complement ? 1 : 0);
}

void launch_ring_init(uint32_t* ring, uint32_t words, uint32_t stride, cudaStream_t stream) {
  launch_kernel(ring_init_kernel, dim3(64), dim3(1024), 0, stream, ring, words, stride);
}

void launch_chase(const uint32_t* ring, int iters, uint64_t* out, cudaStream_t stream) {
  launch_kernel(chase_kernel, dim3(1), dim3(32), 0, stream, ring, iters, out);
}

void launch_pingpong(uint64_t* local_flag, uint64_t* remote_flag, uint64_t base, int iters,
                     bool initiator, uint64_t timeout_ns, uint64_t* out_ns, uint32_t* error,
                     cudaStream_t stream) {
  launch_kernel(pingpong_kernel, dim3(1), dim3(32), 0, stream, local_flag, remote_flag, base, iters,
                initiator ? 1 : 0, timeout_ns, out_ns, error);
}

}  // namespace pa2a::probe
