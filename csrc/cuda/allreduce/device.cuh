// Device side of the all-reduce: what every kernel of csrc/cuda/allreduce shares. The wire
// (segment layout, flags, chunking, the ownership proof) is core/allreduce_wire.h and the
// numerics core/allreduce_math.h, both shared with the CPU implementation; nothing here
// redefines them.
//
// Hardware reason. A GPU store into a peer's memory (CUDA IPC) is a posted PCIe write; a
// load from it is a non-posted round trip (~1 us); peer atomics are not atomic. So every
// byte is stored (push) or loaded (pull) with 16-byte vectors, every flag is one 8-byte
// st.release.sys into the consumer's own memory after a fence.acq_rel.sys that follows the
// data, consumers poll only their own memory with ld.acquire.sys, and the only atomics are
// on this rank's own DeviceState.
//
// Who writes what, on the device:
//   * data / gather / flags of any segment: as core/allreduce_wire.h says (one writer each);
//   * DeviceState (this rank's device memory, outside the segment): only this rank's
//     kernels, in stream order: every block reads `seq` at its start, the last block of a
//     call to finish (an arrival counter) stores seq + 1. The next call's kernel starts
//     after this one ends (stream order), so all of its blocks read the new value. The call
//     number therefore lives on the device: a CUDA graph replays the kernels with frozen
//     arguments and still advances the epoch and the parity exactly as eager calls do
//     (a parity in the kernel arguments would freeze to one buffer under replay, the
//     corruption field_2026.md section 3 reports).
//   * the error word (host-mapped, this rank's): this rank's kernels when a wait expires,
//     a peer aborted or disagrees; read and cleared by this rank's host. Its echo
//     DeviceState::timed_out: the same record_error, when the word it stores is a timeout.
//
// Never hang. Every wait reads %globaltimer and gives up at its deadline, records the
// error (code, phase, peer, seq) and skips the rest of the call; a wait also gives up once
// another wait of this rank timed out, which it reads (every 64 polls) from
// DeviceState::timed_out in this GPU's memory, not from the host-mapped word: only this
// rank's kernels write a timeout and the host never clears one, so the echo is exact, and
// the waiters' polls stay off PCIe. The host turns the word into an exception.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/allreduce_math.h"
#include "core/allreduce_wire.h"
#include "cuda/common/ptx.cuh"

namespace pa2a::ar {

constexpr int kThreads = 256;  // threads per block of the all-reduce kernels
constexpr unsigned kFullMask = 0xffffffffu;

enum class DevError : uint32_t { kNone = 0, kTimeout = 1, kAborted = 2, kMismatch = 3 };

// One 64-bit word so a single store describes the problem completely, whichever block wins:
// [63:56] code, [55:48] phase, [47:32] peer, [31:0] seq.
PA2A_HD uint64_t pack_error(DevError code, int phase, int32_t peer, uint32_t seq) {
  return (static_cast<uint64_t>(code) << 56) | (static_cast<uint64_t>(phase & 0xff) << 48) |
         (static_cast<uint64_t>(static_cast<uint32_t>(peer) & 0xffffu) << 32) | seq;
}
PA2A_HD DevError error_code(uint64_t w) {
  return static_cast<DevError>(w >> 56);
}
PA2A_HD int error_phase(uint64_t w) {
  return static_cast<int>((w >> 48) & 0xffu);
}
PA2A_HD int32_t error_peer(uint64_t w) {
  return static_cast<int32_t>((w >> 32) & 0xffffu);
}
PA2A_HD uint32_t error_seq(uint64_t w) {
  return static_cast<uint32_t>(w);
}

struct DeviceState {
  uint32_t seq;        // last call number finished
  uint32_t arrive;     // blocks of the running call that have finished
  uint32_t timed_out;  // 1 once a wait of this rank recorded a timeout (never cleared)
  uint32_t reserved;
};

// Everything the kernels of one call read; passed by value (no device table to keep alive).
struct KernelArgs {
  Config cfg;
  Layout lay;
  int32_t rank;
  int32_t dtype;             // DType code (for the tag)
  uint32_t pull_from;        // bit s: this rank loads s's data from s's segment
  uint32_t pull_to;          // bit d: rank d loads this rank's data: stage it in our segment
  int32_t end_barrier;       // 1: kDone barrier at the end of every call
  uint8_t* base[kMaxWorld];  // rank r's segment as this rank reaches it (own: [rank])
  DeviceState* state;
  uint64_t* err;  // device pointer of the host-mapped error word
  uint64_t timeout_ns;
};

struct CallPtrs {
  const uint4* x;
  const uint4* residual;  // null: none
  uint4* out;
  int64_t numel;
};

__device__ __forceinline__ void record_error(const KernelArgs& k, DevError code, int phase,
                                             int32_t peer, uint32_t seq) {
  const uint64_t old = *reinterpret_cast<volatile uint64_t*>(k.err);
  // An abort is the mildest problem (the host clears it): anything else replaces it.
  if (old == 0 || (error_code(old) == DevError::kAborted && code != DevError::kAborted)) {
    pa2a::cuda::st_relaxed_sys(k.err, pack_error(code, phase, peer, seq));
    if (code == DevError::kTimeout)  // the waiters' echo, in this GPU's memory
      *reinterpret_cast<volatile uint32_t*>(&k.state->timed_out) = 1u;
  }
}

// Another wait of this rank timed out: read from DeviceState, never from the host-mapped
// word (a PCIe read per poll of every waiter otherwise).
__device__ __forceinline__ bool timed_out_elsewhere(const KernelArgs& k) {
  return *reinterpret_cast<const volatile uint32_t*>(&k.state->timed_out) != 0u;
}

__device__ __forceinline__ uint64_t* flag_at(const KernelArgs& k, int owner, int phase,
                                             uint32_t seq, int block, int src) {
  return reinterpret_cast<uint64_t*>(k.base[owner] +
                                     flag_offset(k.cfg, phase, flag_parity(seq), block, src));
}

// The call number of the running call, read by every block at its start.
__device__ __forceinline__ uint32_t begin_call(const KernelArgs& k) {
  __shared__ uint32_t seq;
  if (threadIdx.x == 0) seq = *reinterpret_cast<volatile uint32_t*>(&k.state->seq) + 1u;
  __syncthreads();
  return seq;
}

// The last block of the call to finish advances the call number (see the top comment).
__device__ __forceinline__ void end_call(const KernelArgs& k, uint32_t seq) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (atomicAdd(&k.state->arrive, 1u) == gridDim.x - 1) {
      k.state->arrive = 0;
      *reinterpret_cast<volatile uint32_t*>(&k.state->seq) = seq;
    }
  }
}

// After every thread of the block stored its part of a chunk: the flag (phase, seq, block)
// with `info` to every peer. Each thread fences its own stores (system scope) before the
// barrier; the release store of the flag thread then follows all of them.
__device__ __forceinline__ void publish(const KernelArgs& k, int phase, uint32_t seq, int block,
                                        uint32_t info) {
  pa2a::cuda::fence_acq_rel_sys();
  __syncthreads();
  const int d = static_cast<int>(threadIdx.x);
  if (d < k.cfg.world && d != k.rank)
    pa2a::cuda::st_release_sys(flag_at(k, d, phase, seq, block, k.rank), pack_flag(seq, info));
}

// Waits for flag (phase, seq, block) from every peer, one thread per peer; true when all
// arrived with `tag`. Otherwise the error is recorded and the block must skip the call.
__device__ __forceinline__ bool wait_peers(const KernelArgs& k, int phase, uint32_t seq, int block,
                                           uint32_t tag) {
  bool bad = false;
  const int s = static_cast<int>(threadIdx.x);
  if (s < k.cfg.world && s != k.rank) {
    const uint64_t* f = flag_at(k, k.rank, phase, seq, block, s);
    const uint64_t start = pa2a::cuda::globaltimer_ns();
    uint32_t spins = 0;
    uint64_t w = pa2a::cuda::ld_acquire_sys(f);
    while (flag_seq(w) != seq) {
      if ((++spins & 63u) == 0) {  // %globaltimer is a slow special register
        if (pa2a::cuda::globaltimer_ns() - start > k.timeout_ns) {
          record_error(k, DevError::kTimeout, phase, s, seq);
          bad = true;
          break;
        }
        if (timed_out_elsewhere(k)) {
          bad = true;
          break;
        }
      }
      __nanosleep(32);
      w = pa2a::cuda::ld_acquire_sys(f);
    }
    if (!bad) {
      const uint32_t info = flag_info(w);
      if (info == kAbortInfo) {
        record_error(k, DevError::kAborted, phase, s, seq);
        bad = true;
      } else if (info != tag) {
        record_error(k, DevError::kMismatch, phase, s, seq);
        bad = true;
      }
    }
  }
  return __syncthreads_or(bad) == 0;
}

// Waits until every peer has begun call seq (its flag of block 0 of kScatter, whatever it
// says: data or an abort of its own); a peer that never does is a timeout naming it.
__device__ __forceinline__ void wait_begun(const KernelArgs& k, uint32_t seq) {
  const int s = static_cast<int>(threadIdx.x);
  if (s < k.cfg.world && s != k.rank) {
    const uint64_t* f = flag_at(k, k.rank, kScatter, seq, 0, s);
    const uint64_t start = pa2a::cuda::globaltimer_ns();
    uint32_t spins = 0;
    while (flag_seq(pa2a::cuda::ld_acquire_sys(f)) != seq) {
      if ((++spins & 63u) == 0) {
        if (pa2a::cuda::globaltimer_ns() - start > k.timeout_ns) {
          record_error(k, DevError::kTimeout, kScatter, s, seq);
          break;
        }
        if (timed_out_elsewhere(k)) break;
      }
      __nanosleep(32);
    }
  }
  __syncthreads();
}

// ---- vectors ----------------------------------------------------------------------------
template <DType kDT>
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = to_f(static_cast<uint16_t>(w[i] & 0xffffu), kDT);
    f[2 * i + 1] = to_f(static_cast<uint16_t>(w[i] >> 16), kDT);
  }
}

template <DType kDT>
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = static_cast<uint32_t>(from_f(f[2 * i], kDT)) |
           (static_cast<uint32_t>(from_f(f[2 * i + 1], kDT)) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// dtype(float(r) + float(residual)) per element (allreduce_math.h finish()).
template <DType kDT>
__device__ __forceinline__ uint4 add_residual8(const uint4& r, const uint4& res) {
  float a[8], b[8];
  unpack8<kDT>(r, a);
  unpack8<kDT>(res, b);
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = add_rn(a[i], b[i]);
  return pack8<kDT>(a);
}

// Where source s's vectors of this call are, as this rank reads them: its own input, a
// pushing peer's slot in our segment, or a pulled peer's own slot in its segment.
__device__ __forceinline__ const uint4* source_vectors(const KernelArgs& k, const CallPtrs& c,
                                                       int s, int buf) {
  if (s == k.rank) return c.x;
  const int owner = ((k.pull_from >> s) & 1u) ? s : k.rank;
  return reinterpret_cast<const uint4*>(k.base[owner] + data_offset(k.cfg, k.lay, buf, s));
}

// The fp32 sum of vector v over every rank, rank 0 first, rounded once: the 16-byte result.
// The loops are unrolled over kMaxWorld with constant indices so that the W inputs stay in
// registers (a runtime-indexed pointer table would live in local memory).
template <DType kDT>
__device__ __forceinline__ uint4 sum_vector(const KernelArgs& k, const CallPtrs& c, int buf,
                                            int64_t v) {
  const int world = k.cfg.world;
  uint4 in[kMaxWorld];
#pragma unroll
  for (int s = 0; s < kMaxWorld; ++s)  // every load issued before the first add
    if (s < world) in[s] = source_vectors(k, c, s, buf)[v];
  float acc[8], f[8];
  unpack8<kDT>(in[0], acc);
#pragma unroll
  for (int s = 1; s < kMaxWorld; ++s) {
    if (s < world) {
      unpack8<kDT>(in[s], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = add_rn(acc[i], f[i]);
    }
  }
  return pack8<kDT>(acc);
}

}  // namespace pa2a::ar
