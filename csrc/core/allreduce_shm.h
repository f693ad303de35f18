// CPU all-reduce: ranks are processes on one host, each owning one POSIX shared-memory
// segment laid out as core/allreduce_wire.h describes, running the exact protocol of the
// CUDA kernels (chunks, per-block flags with call numbers, parity or end barrier, push or
// pull per pair, one-shot and two-shot) with the numerics of core/allreduce_math.h. It is
// the oracle the kernels are compared with, and a CPU tensor-parallel all-reduce.
//
// A call runs as two halves so that a test can interleave ranks in one process:
// send() pushes (or stages) this rank's data and publishes its kScatter flags; finish()
// waits, sums, does the two-shot gather and the end barrier. run() is send + finish.
//
// Lifetime and waiting as in core/shm_transport.h: private segment (0600, O_EXCL), every
// rank maps every peer's, then each unlinks its own name; waits spin briefly, yield, then
// sleep with backoff, check every ~50 ms that the awaited peers are alive, and raise at the
// deadline naming the peer, the phase and the call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/allreduce_wire.h"
#include "core/numa_memory.h"
#include "core/numeric.h"

namespace pa2a::ar {

struct CallArgs {
  uint32_t seq = 0;
  Algo algo = Algo::kOneShot;
  DType dtype = DType::kBF16;
  const void* x = nullptr;
  int64_t numel = 0;
  const void* residual = nullptr;  // optional: out = dtype(dtype(sum) + residual)
  void* out = nullptr;             // may alias x or residual
  double timeout_s = 30.0;
};

class ShmAllReduce {
 public:
  // end_barrier: publish and await kDone flags at the end of every call. buffers == 1 is
  // safe only with the barrier (allreduce_wire.h); the combination without it exists to
  // show the invariant break in tests, and Python never makes it.
  ShmAllReduce(std::string prefix, int32_t rank, const Config& config, bool end_barrier);
  ~ShmAllReduce();
  ShmAllReduce(const ShmAllReduce&) = delete;
  ShmAllReduce& operator=(const ShmAllReduce&) = delete;

  static std::string segment_name(const std::string& prefix, int32_t rank);
  static bool unlink_name(const std::string& name);

  void attach_peers();
  void unlink_own();
  void close();
  // pull[s * world + d] = 1: d reads s's data from s's segment instead of s pushing it.
  void set_directions(const std::vector<uint8_t>& pull);

  void run(const CallArgs& a);
  void send(const CallArgs& a);
  void finish(const CallArgs& a);
  // This rank raised before call `seq`: tell every peer (they skip the call). Reads nothing.
  // Publishes kAbortInfo for call `seq` (this rank raised before it), then waits until every
  // peer has begun that call (allreduce_wire.h, "Aborts"); a peer that never does is a
  // timeout naming it.
  void abort(uint32_t seq, double timeout_s);

  int32_t rank() const { return rank_; }
  const Config& config() const { return config_; }
  size_t segment_bytes() const { return layout_.total; }
  int32_t peer_pid(int32_t r) const { return pids_.at(r); }
  const NumaBindResult& numa() const { return numa_; }
  // Bytes this rank stored into each rank's segment in the last call (own: staging).
  const std::vector<uint64_t>& last_bytes() const { return last_bytes_; }

 private:
  uint8_t* base(int32_t r) const { return static_cast<uint8_t*>(maps_[r]); }
  uint64_t* flag(int32_t owner, int phase, uint32_t seq, int block, int32_t src) const;
  bool pulls(int32_t src, int32_t dst) const { return pull_[src * config_.world + dst] != 0; }
  void check_call(const CallArgs& a) const;
  void publish(int phase, uint32_t seq, int block, uint32_t info);
  // Waits for flag (phase, seq, block) from every peer; returns false if one aborted
  // (after all have arrived, so that the call is skipped on every rank together).
  bool wait_phase(int phase, uint32_t seq, int block, uint32_t tag, double timeout_s,
                  bool any_info = false);
  const uint8_t* source_vectors(int32_t s, int buf, const CallArgs& a) const;
  std::string describe_peer(int32_t r) const;

  std::string prefix_;
  int32_t rank_;
  Config config_;
  Layout layout_;
  bool end_barrier_;
  bool own_linked_ = false;
  bool skip_ = false;  // the call being finished was aborted by a peer
  int32_t last_aborter_ = -1;
  std::vector<void*> maps_;
  std::vector<int32_t> pids_;
  std::vector<uint8_t> pull_;
  NumaBindResult numa_;
  std::vector<uint64_t> last_bytes_;
  std::vector<float> acc_;
};

// Fused add + RMSNorm over `rows` rows of `hidden` elements (allreduce_math.h): r is the
// all-reduce result, residual optional; writes normed (may alias r) and residual_out (may
// alias residual).
void rmsnorm_rows(const void* r, const void* residual, const void* weight, int64_t rows,
                  int32_t hidden, float eps, DType dtype, void* normed, void* residual_out);

}  // namespace pa2a::ar
