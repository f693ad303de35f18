// Control kernels of the transport's lifetime: the bootstrap P2P probe, the close mark,
// and loading every kernel at construction.
#include "cuda/transport/kernel_common.cuh"

namespace pa2a::cuda {
namespace {

using namespace detail;  // NOLINT: the shared kernel helpers

// The 16 bytes source `src` writes into receiver `dst`'s probe line: different for every
// ordered pair and bootstrap, so a write that lands in the wrong line or a stale one fails.
__device__ __forceinline__ uint4 probe_pattern(int src, int dst, uint64_t nonce) {
  return make_uint4(
      0x50324f42u ^ static_cast<uint32_t>(src), 0xa5a5a5a5u ^ static_cast<uint32_t>(dst),
      static_cast<uint32_t>(nonce),
      static_cast<uint32_t>(nonce >> 32) ^ (static_cast<uint32_t>(src) * 0x9e3779b9u));
}

__device__ __forceinline__ uint8_t* probe_line(uint8_t* base, int src) {
  return base + kProbeLineOff + static_cast<size_t>(src) * kProbeLineBytes;
}

// The same stores as a row and its flag: a 16-byte vector, the system-scope fence, then the
// release store of the word the receiver polls.
__global__ void probe_send_kernel(KernelContext k, uint64_t nonce) {
  griddep_wait();
  for (int d = threadIdx.x; d < k.cfg.world; d += blockDim.x) {
    if (d == k.rank) continue;
    uint8_t* line = probe_line(k.peers->send_base[d], k.rank);
    *reinterpret_cast<uint4*>(line) = probe_pattern(k.rank, d, nonce);
    fence_acq_rel_sys();
    st_release_sys(reinterpret_cast<uint64_t*>(line + 16), nonce);
  }
}

__global__ void probe_recv_kernel(KernelContext k, uint64_t nonce, uint64_t timeout_ns,
                                  int32_t* status) {
  griddep_wait();
  for (int s = threadIdx.x; s < k.cfg.world; s += blockDim.x) {
    if (s == k.rank) {
      status[s] = 0;
      continue;
    }
    const uint8_t* line = probe_line(k.peers->recv_base[s], s);
    Poll poll(timeout_ns);
    bool arrived = true;
    while (ld_acquire_sys(reinterpret_cast<const uint64_t*>(line + 16)) != nonce) {
      if (!poll.again(k.err)) {
        arrived = false;
        break;
      }
    }
    int32_t st = arrived ? 0 : 1;
    if (arrived) {
      const uint4 got = *reinterpret_cast<const uint4*>(line);
      const uint4 want = probe_pattern(s, k.rank, nonce);
      if (got.x != want.x || got.y != want.y || got.z != want.z || got.w != want.w) st = 2;
    }
    status[s] = st;
  }
}

__global__ void close_mark_kernel(KernelContext k, uint64_t mark) {
  griddep_wait();
  fence_acq_rel_sys();  // every earlier write of this rank (stream order) before the mark
  for (int d = threadIdx.x; d < k.cfg.world; d += blockDim.x) {
    if (d == k.rank) continue;
    uint8_t* line =
        k.peers->send_base[d] + kCloseLineOff + static_cast<size_t>(k.rank) * kCloseLineBytes;
    st_release_sys(reinterpret_cast<uint64_t*>(line), mark);
  }
}

}  // namespace

void launch_probe_send(const KernelContext& k, uint64_t nonce, cudaStream_t stream) {
  launch_kernel(probe_send_kernel, 1, kMaxWorld, 0, stream, false, k, nonce);
}

void launch_probe_recv(const KernelContext& k, uint64_t nonce, uint64_t timeout_ns, int32_t* status,
                       cudaStream_t stream) {
  launch_kernel(probe_recv_kernel, 1, kMaxWorld, 0, stream, false, k, nonce, timeout_ns, status);
}

void launch_close_mark(const KernelContext& k, uint64_t mark, cudaStream_t stream) {
  launch_kernel(close_mark_kernel, 1, kMaxWorld, 0, stream, false, k, mark);
}

void load_transport_kernels() {
  PA2A_LOAD(probe_send_kernel);
  PA2A_LOAD(probe_recv_kernel);
  PA2A_LOAD(close_mark_kernel);
  load_send_kernels();
  load_recv_kernels();
  load_combine_kernels();
}

}  // namespace pa2a::cuda
