// One-shot all-reduce, one block per chunk (core/allreduce_wire.h split()): the block stores
// its chunk of x into every pushing peer's slot (and once into its own slot when some peer
// pulls), publishes its kScatter flag, waits for the same chunk from every peer, and sums
// the W chunks in rank order into out (plus the residual). Block b touches only chunk b and
// waits only for block b of its peers, so the blocks need not be co-resident, and out may
// alias x (the block read its chunk of x before writing it) or the residual.
#pragma once

#include "cuda/allreduce/device.cuh"

namespace pa2a::ar {

template <DType kDT>
__device__ __forceinline__ void one_shot_block(const KernelArgs& k, const CallPtrs& c,
                                               uint32_t seq) {
  const int W = k.cfg.world, me = k.rank;
  const int64_t nvec = c.numel / kVecElems;
  const int B = one_shot_blocks(nvec);
  const int b = static_cast<int>(blockIdx.x);
  const Range r = split(nvec, B, b);
  const int buf = data_buffer(k.cfg, seq);
  const uint32_t tag = call_tag(Algo::kOneShot, k.dtype, c.numel);
  auto* own_slot = reinterpret_cast<uint4*>(k.base[me] + data_offset(k.cfg, k.lay, buf, me));
  for (int64_t v = r.begin + threadIdx.x; v < r.end; v += blockDim.x) {
    const uint4 val = c.x[v];
    if (k.pull_to != 0) own_slot[v] = val;
    for (int i = 1; i < W; ++i) {
      const int d = (me + i) % W;  // from our rank on: ranks do not all hit rank 0 at once
      if ((k.pull_to >> d) & 1u) continue;
      reinterpret_cast<uint4*>(k.base[d] + data_offset(k.cfg, k.lay, buf, me))[v] = val;
    }
  }
  publish(k, kScatter, seq, b, tag);
  if (wait_peers(k, kScatter, seq, b, tag)) {
    for (int64_t v = r.begin + threadIdx.x; v < r.end; v += blockDim.x) {
      const uint4 sum = sum_vector<kDT>(k, c, buf, v);
      c.out[v] = c.residual != nullptr ? add_residual8<kDT>(sum, c.residual[v]) : sum;
    }
  }
  if (k.end_barrier) {  // "done reading chunk b", also after skipping the call
    publish(k, kDone, seq, b, tag);
    wait_peers(k, kDone, seq, b, tag);
  }
}

}  // namespace pa2a::ar
