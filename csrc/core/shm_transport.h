// CPU transport: ranks are processes on one host, each owning one POSIX shared-memory
// segment laid out as core/wire_format.h describes. It runs the exact protocol of the
// CUDA transports (rows pushed or pulled per ordered pair, one release-stored flag per
// (source, receiver) pair, a consumed flag back for pulled pairs, epoch parity) and is the
// oracle the kernels are tested against.
//
// Lifetime. A rank creates its segment (mode 0600, O_EXCL, a name unique to the group),
// every rank maps every peer's segment, and once all have mapped (a barrier in Python)
// each rank unlinks its own name. From then on nothing is left in /dev/shm whatever
// happens to the processes: the kernel frees the memory with the last mapping. Names
// that could still exist (a rank that died during bootstrap) are unlinked by the
// survivors' error path, by close(), by the garbage collector and at interpreter exit.
//
// Waiting. Ranks often outnumber cores (8 ranks on 2 cores in CI), so a wait spins only
// for a few microseconds, then yields, then sleeps with exponential backoff; it checks
// every ~50 ms that the peers it waits for are alive and raises at the deadline, naming
// the peer and the call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/numa_memory.h"
#include "core/routing.h"
#include "core/wire_format.h"

namespace pa2a {

struct CallCounts {
  std::vector<int32_t> counts;  // rows received from each source rank
};

// Seeded slips of the pull protocol, for the tests that must catch them (never set in use).
enum class PullMutation : int32_t {
  kNone = 0,
  kReuseBeforeConsumed = 1,  // the sender does not wait for the consumed flag
  kWrongConsumedEpoch = 2,   // the reader stores seq - 1 as consumed
};

class ShmTransport {
 public:
  // Creates and maps this rank's segment `<prefix>.<rank>`. `pull[s * world + r]` != 0:
  // rows of the ordered pair s -> r are pulled by r (dispatch: s the token's rank; combine:
  // s the expert's rank); empty: every pair pushes. The diagonal must be 0 (push).
  // `timeout_s` bounds a sender's wait for a consumed flag.
  ShmTransport(std::string prefix, int32_t rank, const WireConfig& config,
               std::vector<uint8_t> pull = {}, double timeout_s = 30.0);
  ~ShmTransport();
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  static std::string segment_name(const std::string& prefix, int32_t rank);
  // shm_unlink that ignores "no such segment"; returns true if a name was removed.
  static bool unlink_name(const std::string& name);

  void attach_peers();  // map every peer's segment (after all have created theirs)
  void unlink_own();    // after every rank has attached
  void close();         // unmap everything and unlink our name if still linked

  int32_t rank() const { return rank_; }
  const WireConfig& config() const { return config_; }
  const SegmentLayout& layout() const { return layout_; }
  size_t segment_bytes() const { return layout_.total; }
  int32_t peer_pid(int32_t r) const;
  // Where this rank's region was placed (bound=false plus a warning where mbind is refused).
  const NumaBindResult& numa() const { return numa_; }

  // ---- dispatch ----------------------------------------------------------------------
  // Writes one row per (token, destination rank) into the destinations' dispatch slots
  // of parity `parity`, then the flags of call `seq`. send_token[d * max_tokens + j] is
  // the token sent in slot j to rank d; send_count[d] the number of rows sent to d.
  void dispatch_send(uint32_t seq, uint32_t op, int parity, const void* x, int32_t num_tokens,
                     const int32_t* topk_ids, const float* topk_weights, int32_t topk,
                     const Placement& placement, int32_t* send_token, int32_t* send_count);

  // Waits for the flags of call `seq` from every rank; returns the row counts.
  std::vector<int32_t> wait(uint32_t seq, uint32_t op, double timeout_s);

  // Tells every peer that this rank will not take part in call `seq` (it raised), then
  // waits for their flags of that call so that the reuse invariant still holds.
  void abort(uint32_t seq, uint32_t op, double timeout_s);

  // Copies received dispatch rows out of the region. Row (s, j) goes to output row
  // row_base[s] + j. x_out is in the buffer dtype (fp8 dequantised), or, when
  // fp8_out/scales_out are given, raw fp8 bytes and scales. expert_count[E_local] is
  // incremented for every valid local expert id of every row.
  void unpack_rows(int parity, const int32_t* counts, const int64_t* row_base, void* x_out,
                   uint8_t* fp8_out, float* scales_out, int32_t* src_rank_out,
                   int32_t* src_token_out, int32_t* topk_ids_out, float* topk_weights_out,
                   int32_t num_local_experts, int32_t* expert_count);

  // Expert-major layout [E_local, world * max_tokens, H] built from the received rows.
  // expert_pos[(s * max_tokens + j) * topk + k] = position of row (s, j) in the list of
  // its k-th local expert (for combine). src_info[e * cap + p] = source token index,
  // layout_range[e * world + s] = (begin << 32) | count of rows from source s.
  void unpack_expert_major(int parity, const int32_t* counts, int32_t num_local_experts,
                           void* x_out, uint8_t* fp8_out, float* scales_out, int32_t* expert_count,
                           int32_t* src_info, int64_t* layout_range, int32_t* expert_pos,
                           int32_t* row_experts, float* row_weights);

  // ---- combine -----------------------------------------------------------------------
  // Pushes row (s, j) = y[row_base[s] + j] back to source s's combine slot j.
  void combine_send(uint32_t seq, uint32_t op, int parity, const void* y, const int32_t* counts,
                    const int64_t* row_base);

  // Weighted pre-reduction of expert-major outputs into rows (fp32, then the dtype):
  // rows_out[s * max_tokens + j] = sum_k w * y[e_k, pos_k].
  void reduce_expert_major(const void* y, const int32_t* counts, const int32_t* expert_pos,
                           const int32_t* row_experts, const float* row_weights,
                           int32_t num_local_experts, void* rows_out);

  // Waits for call `seq` and sums the returned partials of each token in fp32, in
  // ascending rank order, into out[num_tokens, H] (buffer dtype). Tokens sent nowhere are 0.
  // out_fp32: out is float[num_tokens, H] and keeps the fp32 sums (the inter-node path sends a
  // node's partial sum across the hop without rounding it to the dtype first).
  void combine_recv(uint32_t seq, uint32_t op, int parity, double timeout_s,
                    const int32_t* send_token, const int32_t* send_count, int32_t num_tokens,
                    void* out, bool out_fp32 = false);

  // Bytes this rank moved to each rank during the last call (own rank: local): rows it
  // pushed into that rank's segment or staged there for it to pull, and flags it stored.
  const std::vector<uint64_t>& last_bytes() const { return last_bytes_; }

  bool pulls(int32_t src, int32_t dst) const {
    return !pull_.empty() && pull_[static_cast<size_t>(src) * config_.world + dst] != 0;
  }
  void set_pull_mutation(PullMutation m) { mutation_ = m; }

 private:
  uint8_t* peer_base(int32_t r) const { return static_cast<uint8_t*>(maps_[r]); }
  FlagLine* flag_line(uint8_t* base, int parity, int src) const;
  std::vector<int32_t> wait_impl(uint32_t seq, uint32_t op, double timeout_s, bool tolerate_aborts);
  void publish(uint32_t seq, uint32_t op, const std::vector<uint32_t>& counts);
  void dequant_row(const uint8_t* slot, const SlotLayout& sl, void* dst) const;
  std::string describe_peer(int32_t r) const;
  // Slot of row j of the pair (src -> dst) in `region`, wherever that pair keeps it.
  uint8_t* slot_ptr(int region, int parity, int32_t src, int32_t dst, int32_t j) const;
  // Before staging into pull slots of `parity`: waits for every pulling reader to have
  // consumed the call that last used them.
  void await_consumed(int region, int parity, uint32_t seq, uint32_t op);
  void note_staged(int region, int parity, uint32_t seq);
  // After the last read of call seq: tells every pulled source.
  void mark_consumed(int region, uint32_t seq);

  std::string prefix_;
  int32_t rank_;
  WireConfig config_;
  SegmentLayout layout_;
  SlotLayout slot_;
  std::vector<void*> maps_;
  std::vector<int32_t> pids_;
  bool own_linked_ = false;
  NumaBindResult numa_;
  std::vector<uint64_t> last_bytes_;
  std::vector<float> acc_;     // combine accumulator scratch
  std::vector<uint8_t> qrow_;  // fp8 row scratch
  std::vector<uint8_t> pull_;  // [world * world], empty: all push
  double timeout_s_;
  // Call that last staged into pull slots [region][parity] (0: none yet).
  uint32_t staged_seq_[2][2] = {{0, 0}, {0, 0}};
  uint32_t received_seq_ = 0;  // dispatch call whose flags wait() last returned
  PullMutation mutation_ = PullMutation::kNone;
};

}  // namespace pa2a
