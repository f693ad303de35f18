// Two-shot all-reduce, one block per piece of every shard (core/allreduce_wire.h
// shard_piece()): reduce-scatter, then all-gather, both by block b of every rank only.
//   1. store piece b of shard d of x into rank d's slot (or our own slot if d pulls);
//      kScatter flag;
//   2. wait for piece b of our shard from every peer, sum in rank order, store the summed
//      piece into every pushing peer's gather buffer (and ours if some peer pulls); write
//      out (plus residual); kGather flag;
//   3. wait for piece b of every other shard and copy it into out (plus residual).
// The residual is added by each rank to its own copy, never sent: out is exactly what the
// one-shot computes. Block b reads its pieces of x before it writes them in out, so out may
// alias x or the residual.
#pragma once

#include "cuda/allreduce/device.cuh"

namespace pa2a::ar {

template <DType kDT>
__device__ __forceinline__ void two_shot_block(const KernelArgs& k, const CallPtrs& c,
                                               uint32_t seq) {
  const int W = k.cfg.world, me = k.rank;
  const int64_t nvec = c.numel / kVecElems;
  const int B = two_shot_blocks(nvec, W);
  const int b = static_cast<int>(blockIdx.x);
  const int buf = data_buffer(k.cfg, seq);
  const uint32_t tag = call_tag(Algo::kTwoShot, k.dtype, c.numel);
  const size_t slot_off = data_offset(k.cfg, k.lay, buf, me);
  const size_t gather_off = gather_offset(k.cfg, k.lay, buf);
  for (int i = 1; i < W; ++i) {
    const int d = (me + i) % W;
    const Range p = shard_piece(nvec, W, d, B, b);
    const int owner = ((k.pull_to >> d) & 1u) ? me : d;
    auto* dst = reinterpret_cast<uint4*>(k.base[owner] + slot_off);
    for (int64_t v = p.begin + threadIdx.x; v < p.end; v += blockDim.x) dst[v] = c.x[v];
  }
  publish(k, kScatter, seq, b, tag);
  if (wait_peers(k, kScatter, seq, b, tag)) {
    const Range mine = shard_piece(nvec, W, me, B, b);
    auto* own_gather = reinterpret_cast<uint4*>(k.base[me] + gather_off);
    for (int64_t v = mine.begin + threadIdx.x; v < mine.end; v += blockDim.x) {
      const uint4 sum = sum_vector<kDT>(k, c, buf, v);
      if (k.pull_to != 0) own_gather[v] = sum;
      for (int i = 1; i < W; ++i) {
        const int d = (me + i) % W;
        if (!((k.pull_to >> d) & 1u)) reinterpret_cast<uint4*>(k.base[d] + gather_off)[v] = sum;
      }
      c.out[v] = c.residual != nullptr ? add_residual8<kDT>(sum, c.residual[v]) : sum;
    }
    publish(k, kGather, seq, b, tag);
    if (wait_peers(k, kGather, seq, b, tag)) {
      for (int i = 1; i < W; ++i) {
        const int s = (me + i) % W;
        const Range p = shard_piece(nvec, W, s, B, b);
        const int owner = ((k.pull_from >> s) & 1u) ? s : me;
        const auto* g = reinterpret_cast<const uint4*>(k.base[owner] + gather_off);
        for (int64_t v = p.begin + threadIdx.x; v < p.end; v += blockDim.x) {
          const uint4 val = g[v];
          c.out[v] = c.residual != nullptr ? add_residual8<kDT>(val, c.residual[v]) : val;
        }
      }
    }
  }
  if (k.end_barrier) {
    publish(k, kDone, seq, b, tag);
    wait_peers(k, kDone, seq, b, tag);
  }
}

}  // namespace pa2a::ar
