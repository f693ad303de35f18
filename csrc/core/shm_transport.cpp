#include "core/shm_transport.h"

#include <unistd.h>

#include <chrono>
#include <cstring>

#include "core/exception.h"
#include "core/numa_memory.h"
#include "core/peer_wait.h"
#include "core/shm_segment.h"

namespace pa2a {
namespace {

using wait::Backoff;
using wait::Clock;
using wait::deadline_after;
using wait::process_alive;

}  // namespace

std::string ShmTransport::segment_name(const std::string& prefix, int32_t rank) {
  return "/" + prefix + ".r" + std::to_string(rank);
}

bool ShmTransport::unlink_name(const std::string& name) {
  return shm::unlink(name);
}

ShmTransport::ShmTransport(std::string prefix, int32_t rank, const WireConfig& config,
                           std::vector<uint8_t> pull, double timeout_s)
    : prefix_(std::move(prefix)), rank_(rank), config_(config), timeout_s_(timeout_s) {
  const WireConfig& c = config_;
  PA2A_CHECK_ARG(c.world >= 1 && c.world <= 1024, "world size must be in [1, 1024], got ", c.world);
  PA2A_CHECK_ARG(rank >= 0 && rank < c.world, "rank must be in [0, ", c.world, "), got ", rank);
  PA2A_CHECK_ARG(c.hidden > 0 && c.hidden % 8 == 0,
                 "hidden must be a positive multiple of 8 (16-byte rows), got ", c.hidden);
  PA2A_CHECK_ARG(c.payload != Payload::kFP8 || c.hidden % kFp8GroupSize == 0,
                 "fp8 payload needs hidden to be a multiple of 128, got ", c.hidden);
  PA2A_CHECK_ARG(c.max_tokens >= 1, "max_tokens_per_rank must be >= 1, got ", c.max_tokens);
  PA2A_CHECK_ARG(c.num_topk >= 1 && c.num_topk <= 64, "num_topk must be in [1, 64], got ",
                 c.num_topk);
  PA2A_CHECK_ARG(c.dtype == DType::kBF16 || c.dtype == DType::kFP16, "dtype must be bf16 or fp16");
  PA2A_CHECK_ARG(timeout_s > 0, "timeout_s must be positive, got ", timeout_s);
  const size_t pairs = static_cast<size_t>(c.world) * c.world;
  PA2A_CHECK_ARG(pull.empty() || pull.size() == pairs,
                 "pair_direction must have world x world = ", pairs, " entries, got ", pull.size());
  bool any_pull = false;
  for (size_t i = 0; i < pull.size(); ++i) {
    PA2A_CHECK_ARG(pull[i] <= 1, "pair_direction[", i / c.world, "][", i % c.world,
                   "] must be 0 (push) or 1 (pull), got ", static_cast<int>(pull[i]));
    PA2A_CHECK_ARG(pull[i] == 0 || i / c.world != i % c.world, "pair_direction[", i / c.world, "][",
                   i % c.world, "]: a rank cannot pull from itself (the diagonal is push)");
    any_pull = any_pull || pull[i] != 0;
  }
  if (any_pull) pull_ = std::move(pull);
  layout_ = segment_layout(c, any_pull);
  slot_ = dispatch_slot_layout(c);
  maps_.assign(c.world, nullptr);
  pids_.assign(c.world, 0);
  last_bytes_.assign(c.world, 0);

  // Receivers poll and read their own region: place it on this rank's NUMA node (the
  // staging rule of DESIGN.md section 4), first-touching it now rather than in the first call;
  // its space in /dev/shm is reserved first (every rank of the host has a segment).
  shm::OwnSegment own = shm::create(segment_name(prefix_, rank_), layout_.total,
                                    numa_node_of_current_cpu(), c.world, ShmUser{});
  own_linked_ = true;
  maps_[rank_] = own.data;
  numa_ = std::move(own.numa);
  pids_[rank_] = static_cast<int32_t>(::getpid());
  SegmentHeader h{};
  h.magic = kSegmentMagic;
  h.version = kWireVersion;
  h.rank = rank_;
  h.pid = pids_[rank_];
  h.config = c;
  std::memcpy(own.data, &h, sizeof(h));
}

ShmTransport::~ShmTransport() {
  close();
}

void ShmTransport::attach_peers() {
  for (int32_t r = 0; r < config_.world; ++r) {
    if (maps_[r] != nullptr) continue;
    const auto h =
        shm::attach_peer<SegmentHeader>(maps_, segment_name(prefix_, r), layout_.total, rank_, r,
                                        "segment", kSegmentMagic, kWireVersion);
    pids_[r] = h.pid;
  }
}

void ShmTransport::unlink_own() {
  if (own_linked_) {
    unlink_name(segment_name(prefix_, rank_));
    own_linked_ = false;
  }
}

void ShmTransport::close() {
  unlink_own();
  shm::unmap_all(maps_, layout_.total);
}

int32_t ShmTransport::peer_pid(int32_t r) const {
  PA2A_CHECK_ARG(r >= 0 && r < config_.world, "rank out of range: ", r);
  return pids_[r];
}

FlagLine* ShmTransport::flag_line(uint8_t* base, int parity, int src) const {
  return reinterpret_cast<FlagLine*>(base + layout_.flags_off + flag_offset(config_, parity, src));
}

std::string ShmTransport::describe_peer(int32_t r) const {
  return "rank " + std::to_string(r) + " (pid " + std::to_string(pids_[r]) + ")";
}

// ---- dispatch --------------------------------------------------------------------------

void ShmTransport::dispatch_send(uint32_t seq, uint32_t op, int parity, const void* x,
                                 int32_t num_tokens, const int32_t* topk_ids,
                                 const float* topk_weights, int32_t topk,
                                 const Placement& placement, int32_t* send_token,
                                 int32_t* send_count) {
  const WireConfig& c = config_;
  const int32_t W = c.world, M = c.max_tokens, K = c.num_topk, H = c.hidden;
  PA2A_CHECK_ARG(num_tokens >= 0 && num_tokens <= M, "num_tokens must be in [0, ", M, "], got ",
                 num_tokens);
  PA2A_CHECK_ARG(topk >= 0 && topk <= K, "topk must be in [0, ", K, "], got ", topk);
  PA2A_CHECK_ARG(parity == 0 || parity == 1, "parity must be 0 or 1");
  std::fill(last_bytes_.begin(), last_bytes_.end(), 0);
  std::fill(send_count, send_count + W, 0);
  await_consumed(kDispatchRegion, parity, seq, op);

  std::vector<int32_t> n_dest(W), local(static_cast<size_t>(W) * K);
  std::vector<float> weight(static_cast<size_t>(W) * K);
  const bool fp8 = c.payload == Payload::kFP8;
  if (fp8) qrow_.resize(static_cast<size_t>(H) + 4 * static_cast<size_t>(H / kFp8GroupSize));
  const auto* xs = static_cast<const uint16_t*>(x);
  const size_t row_bytes_in = 2 * static_cast<size_t>(H);

  for (int32_t t = 0; t < num_tokens; ++t) {
    std::fill(n_dest.begin(), n_dest.end(), 0);
    const int64_t gtok = global_token_id(rank_, M, t);
    for (int32_t k = 0; k < topk; ++k) {
      const int32_t e = topk_ids[static_cast<size_t>(t) * topk + k];
      if (e < 0) continue;
      PA2A_CHECK_ARG(e < placement.num_experts, "topk_ids[", t, ", ", k, "] = ", e,
                     " is not an expert id in [0, ", placement.num_experts, ")");
      int32_t d = 0, l = 0;
      select_replica(placement, e, gtok, &d, &l);
      PA2A_CHECK_ARG(d >= 0 && d < W, "placement sends expert ", e, " to rank ", d,
                     ", not a rank of this ", W, "-rank group");
      const size_t at = static_cast<size_t>(d) * K + n_dest[d]++;
      local[at] = l;
      weight[at] = topk_weights[static_cast<size_t>(t) * topk + k];
    }
    const uint16_t* src_row = xs + static_cast<size_t>(t) * H;
    const void* payload = src_row;
    if (fp8) {
      uint8_t* q = qrow_.data();
      auto* scales = reinterpret_cast<float*>(q + H);
      for (int32_t g = 0; g < H / kFp8GroupSize; ++g)
        scales[g] = quantize_fp8_group(src_row + g * kFp8GroupSize, c.dtype,
                                       q + static_cast<size_t>(g) * kFp8GroupSize);
    }
    for (int32_t d = 0; d < W; ++d) {
      const int32_t n = n_dest[d];
      if (n == 0) continue;
      const int32_t j = send_count[d]++;
      uint8_t* slot = slot_ptr(kDispatchRegion, parity, rank_, d, j);
      const RowHeader h{t, n, rank_, 0};
      std::memcpy(slot, &h, sizeof(h));
      auto* ids = reinterpret_cast<int32_t*>(slot + slot_.experts_off);
      auto* ws = reinterpret_cast<float*>(slot + slot_.weights_off);
      for (int32_t i = 0; i < K; ++i) {
        ids[i] = i < n ? local[static_cast<size_t>(d) * K + i] : -1;
        ws[i] = i < n ? weight[static_cast<size_t>(d) * K + i] : 0.0f;
      }
      if (fp8) {
        std::memcpy(slot + slot_.payload_off, qrow_.data(), static_cast<size_t>(H));
        std::memcpy(slot + slot_.scales_off, qrow_.data() + H,
                    4 * static_cast<size_t>(H / kFp8GroupSize));
      } else {
        std::memcpy(slot + slot_.payload_off, payload, row_bytes_in);
      }
      send_token[static_cast<size_t>(d) * M + j] = t;
      last_bytes_[d] += layout_.dispatch_slot;
    }
  }
  std::vector<uint32_t> counts(send_count, send_count + W);
  note_staged(kDispatchRegion, parity, seq);
  publish(seq, op, counts);
}

uint8_t* ShmTransport::slot_ptr(int region, int parity, int32_t src, int32_t dst, int32_t j) const {
  const bool dispatch = region == kDispatchRegion;
  const size_t bytes = dispatch ? layout_.dispatch_slot : layout_.combine_slot;
  if (pulls(src, dst)) {  // staged in the sender's own segment, indexed by destination
    const size_t off = dispatch ? layout_.pull_dispatch_off : layout_.pull_combine_off;
    return peer_base(src) + off + slot_offset(config_, parity, dst, j, bytes);
  }
  const size_t off = dispatch ? layout_.dispatch_off : layout_.combine_off;
  return peer_base(dst) + off + slot_offset(config_, parity, src, j, bytes);
}

void ShmTransport::note_staged(int region, int parity, uint32_t seq) {
  if (!pull_.empty()) staged_seq_[region][parity] = seq;
}

// The sender's half of the pull reuse rule (wire_format.h): the consumed line of reader d
// lives in our own memory; consumed values only grow, so ">=" the call that last staged
// into these slots means d has finished reading them.
void ShmTransport::await_consumed(int region, int parity, uint32_t seq, uint32_t op) {
  const uint32_t need = staged_seq_[region][parity];
  if (pull_.empty() || need == 0 || mutation_ == PullMutation::kReuseBeforeConsumed) return;
  Backoff backoff;
  const auto deadline = deadline_after(backoff.start(), timeout_s_);
  auto next_liveness = backoff.start() + std::chrono::milliseconds(50);
  uint8_t* own = peer_base(rank_) + layout_.consumed_off;
  for (int32_t d = 0; d < config_.world; ++d) {
    if (!pulls(rank_, d)) continue;
    auto* line = reinterpret_cast<FlagLine*>(own + consumed_offset(config_, region, d));
    while (__atomic_load_n(&line->word, __ATOMIC_ACQUIRE) < need) {
      const auto now = Clock::now();
      if (now >= next_liveness) {
        if (!process_alive(pids_[d]))
          PA2A_THROW(kPeer, describe_peer(d), " exited before reading the rows rank ", rank_,
                     " staged for it in call ", need, "; rank ", rank_, " cannot send ",
                     op_name(op), " (call ", seq, ")");
        next_liveness = now + std::chrono::milliseconds(50);
      }
      if (now >= deadline)
        PA2A_THROW(kTimeout, "rank ", rank_, " timed out after ", timeout_s_, " s in ", op_name(op),
                   " (call ", seq, ") waiting for rank ", d, " to consume (pull) the rows of call ",
                   need, " it staged for it: that rank is behind by more than one call or stuck");
      backoff.pause(now);
    }
  }
}

void ShmTransport::mark_consumed(int region, uint32_t seq) {
  if (pull_.empty()) return;
  const uint32_t value = mutation_ == PullMutation::kWrongConsumedEpoch ? seq - 1 : seq;
  for (int32_t s = 0; s < config_.world; ++s) {
    if (!pulls(s, rank_)) continue;
    auto* line = reinterpret_cast<FlagLine*>(peer_base(s) + layout_.consumed_off +
                                             consumed_offset(config_, region, rank_));
    __atomic_store_n(&line->word, static_cast<uint64_t>(value), __ATOMIC_RELEASE);
    last_bytes_[s] += 8;
  }
}

void ShmTransport::publish(uint32_t seq, uint32_t op, const std::vector<uint32_t>& counts) {
  // Peers first, starting after our own rank so that ranks do not all hit rank 0 at once;
  // our own flag last.
  const int32_t W = config_.world;
  for (int32_t i = 1; i <= W; ++i) {
    const int32_t d = (rank_ + i) % W;
    FlagLine* f = flag_line(peer_base(d), static_cast<int>(seq & 1u), rank_);
    __atomic_store_n(&f->sig, op, __ATOMIC_RELAXED);
    __atomic_store_n(&f->word, pack_flag(seq, counts[d]), __ATOMIC_RELEASE);
    last_bytes_[d] += 16;
  }
}

void ShmTransport::abort(uint32_t seq, uint32_t op, double timeout_s) {
  std::fill(last_bytes_.begin(), last_bytes_.end(), 0);
  // Staged nothing: the slots of this call's parity keep their last call's guard (and
  // every reader reads nothing of this call, so the record stays exact).
  publish(seq, op, std::vector<uint32_t>(config_.world, kAbortCount));
  wait_impl(seq, op, timeout_s, /*tolerate_aborts=*/true);  // see wait_impl
}

std::vector<int32_t> ShmTransport::wait(uint32_t seq, uint32_t op, double timeout_s) {
  return wait_impl(seq, op, timeout_s, /*tolerate_aborts=*/false);
}

// Waits until every rank's flag of call `seq` has arrived, even after one of them turned out
// to be an abort or a different call: returning earlier would let this rank start call
// seq + 1 before it has received call seq, which breaks the reuse invariant of
// wire_format.h. The first problem seen is raised once all flags are in.
std::vector<int32_t> ShmTransport::wait_impl(uint32_t seq, uint32_t op, double timeout_s,
                                             bool tolerate_aborts) {
  const int32_t W = config_.world;
  std::vector<int32_t> counts(W, -1);
  int32_t remaining = W;
  uint8_t* own = peer_base(rank_);
  std::string problem;
  Error::Kind problem_kind = Error::Kind::kPeer;
  Backoff backoff;
  const auto start = backoff.start();
  const auto deadline = deadline_after(start, timeout_s);
  auto next_liveness = start + std::chrono::milliseconds(50);
  for (;;) {
    for (int32_t r = 0; r < W; ++r) {
      if (counts[r] >= 0) continue;
      FlagLine* f = flag_line(own, static_cast<int>(seq & 1u), r);
      const uint64_t w = __atomic_load_n(&f->word, __ATOMIC_ACQUIRE);
      if (flag_seq(w) != seq) continue;
      const uint32_t sig = __atomic_load_n(&f->sig, __ATOMIC_RELAXED);
      const uint32_t n = flag_count(w);
      --remaining;
      counts[r] = 0;
      if (tolerate_aborts || !problem.empty()) continue;
      if (n == kAbortCount) {
        problem = detail::concat("rank ", r, " aborted ", op_name(op), " (call ", seq,
                                 ") because it raised an error; see that rank's traceback");
        problem_kind = Error::Kind::kAborted;
      } else if (sig != op) {
        problem = detail::concat("rank ", r, " is in ", op_name(sig), " while rank ", rank_,
                                 " is in ", op_name(op), " (call ", seq,
                                 "): every rank must make the same sequence of dispatch/combine "
                                 "calls");
      } else if (n > static_cast<uint32_t>(config_.max_tokens)) {
        problem = detail::concat("rank ", r, " announced ", n, " rows for call ", seq,
                                 ", more than max_tokens_per_rank = ", config_.max_tokens);
      } else {
        counts[r] = static_cast<int32_t>(n);
      }
    }
    if (remaining == 0) {
      const int region = (op == static_cast<uint32_t>(OpCode::kDispatch) ||
                          op == static_cast<uint32_t>(OpCode::kLowLatencyDispatch))
                             ? kDispatchRegion
                             : kCombineRegion;
      if (tolerate_aborts || !problem.empty()) {
        mark_consumed(region, seq);  // this rank reads nothing of call seq
        if (!problem.empty()) throw Error(problem_kind, problem);
        return counts;
      }
      if (region == kDispatchRegion) received_seq_ = seq;  // unpack_* marks it consumed
      return counts;
    }

    const auto now = Clock::now();
    if (now >= deadline || now >= next_liveness) {
      std::string missing;
      for (int32_t r = 0; r < W; ++r) {
        if (counts[r] >= 0) continue;
        if (!process_alive(pids_[r]))
          PA2A_THROW(kPeer, describe_peer(r), " exited before sending ", op_name(op), " (call ",
                     seq, ") to rank ", rank_);
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      if (now >= deadline)
        PA2A_THROW(kTimeout, "rank ", rank_, " timed out after ", timeout_s, " s in ", op_name(op),
                   " (call ", seq, ") waiting for rank(s) ", missing,
                   "; they are alive but did not send: a rank is stuck, slower than the timeout, "
                   "or skipped a call");
      next_liveness = now + std::chrono::milliseconds(50);
    }
    backoff.pause(now);
  }
}

void ShmTransport::dequant_row(const uint8_t* slot, const SlotLayout& sl, void* dst) const {
  const int32_t H = config_.hidden;
  auto* out = static_cast<uint16_t*>(dst);
  if (config_.payload != Payload::kFP8) {
    std::memcpy(out, slot + sl.payload_off, 2 * static_cast<size_t>(H));
    return;
  }
  dequantize_fp8_row(slot + sl.payload_off, reinterpret_cast<const float*>(slot + sl.scales_off), H,
                     config_.dtype, out);
}

void ShmTransport::unpack_rows(int parity, const int32_t* counts, const int64_t* row_base,
                               void* x_out, uint8_t* fp8_out, float* scales_out,
                               int32_t* src_rank_out, int32_t* src_token_out, int32_t* topk_ids_out,
                               float* topk_weights_out, int32_t num_local_experts,
                               int32_t* expert_count) {
  const WireConfig& c = config_;
  const int32_t K = c.num_topk, H = c.hidden, G = H / kFp8GroupSize;
  for (int32_t s = 0; s < c.world; ++s) {
    for (int32_t j = 0; j < counts[s]; ++j) {
      const uint8_t* slot = slot_ptr(kDispatchRegion, parity, s, rank_, j);
      const size_t i = static_cast<size_t>(row_base[s] + j);
      RowHeader h{};
      std::memcpy(&h, slot, sizeof(h));
      PA2A_HOST_ASSERT(h.src_rank == s);
      src_rank_out[i] = s;
      src_token_out[i] = h.src_token;
      std::memcpy(topk_ids_out + i * K, slot + slot_.experts_off, 4 * static_cast<size_t>(K));
      std::memcpy(topk_weights_out + i * K, slot + slot_.weights_off, 4 * static_cast<size_t>(K));
      for (int32_t k = 0; k < h.num_experts; ++k) {
        const int32_t e = topk_ids_out[i * K + k];
        PA2A_HOST_ASSERT(e >= 0 && e < num_local_experts);
        ++expert_count[e];
      }
      if (fp8_out != nullptr) {
        std::memcpy(fp8_out + i * H, slot + slot_.payload_off, static_cast<size_t>(H));
        std::memcpy(scales_out + i * G, slot + slot_.scales_off, 4 * static_cast<size_t>(G));
      } else {
        dequant_row(slot, slot_, static_cast<uint16_t*>(x_out) + i * H);
      }
    }
  }
  mark_consumed(kDispatchRegion, received_seq_);
}

void ShmTransport::unpack_expert_major(int parity, const int32_t* counts, int32_t num_local_experts,
                                       void* x_out, uint8_t* fp8_out, float* scales_out,
                                       int32_t* expert_count, int32_t* src_info,
                                       int64_t* layout_range, int32_t* expert_pos,
                                       int32_t* row_experts, float* row_weights) {
  const WireConfig& c = config_;
  const int32_t W = c.world, M = c.max_tokens, K = c.num_topk, H = c.hidden;
  const int32_t G = H / kFp8GroupSize;
  const size_t cap = static_cast<size_t>(W) * M;
  std::fill(expert_count, expert_count + num_local_experts, 0);
  std::vector<int32_t> begin(num_local_experts);
  for (int32_t s = 0; s < W; ++s) {
    std::copy(expert_count, expert_count + num_local_experts, begin.begin());
    for (int32_t j = 0; j < counts[s]; ++j) {
      const uint8_t* slot = slot_ptr(kDispatchRegion, parity, s, rank_, j);
      const size_t row = static_cast<size_t>(s) * M + j;
      RowHeader h{};
      std::memcpy(&h, slot, sizeof(h));
      const auto* ids = reinterpret_cast<const int32_t*>(slot + slot_.experts_off);
      const auto* ws = reinterpret_cast<const float*>(slot + slot_.weights_off);
      for (int32_t k = 0; k < K; ++k) {
        const int32_t e = k < h.num_experts ? ids[k] : -1;
        row_experts[row * K + k] = e;
        row_weights[row * K + k] = e >= 0 ? ws[k] : 0.0f;
        expert_pos[row * K + k] = -1;
        if (e < 0) continue;
        PA2A_HOST_ASSERT(e < num_local_experts);
        const int32_t pos = expert_count[e]++;
        expert_pos[row * K + k] = pos;
        const size_t dst = static_cast<size_t>(e) * cap + pos;
        src_info[dst] = h.src_token;
        if (fp8_out != nullptr) {
          std::memcpy(fp8_out + dst * H, slot + slot_.payload_off, static_cast<size_t>(H));
          std::memcpy(scales_out + dst * G, slot + slot_.scales_off, 4 * static_cast<size_t>(G));
        } else {
          dequant_row(slot, slot_, static_cast<uint16_t*>(x_out) + dst * H);
        }
      }
    }
    for (int32_t e = 0; e < num_local_experts; ++e)
      layout_range[static_cast<size_t>(e) * W + s] =
          (static_cast<int64_t>(begin[e]) << 32) | (expert_count[e] - begin[e]);
  }
  mark_consumed(kDispatchRegion, received_seq_);
}

// ---- combine ---------------------------------------------------------------------------

void ShmTransport::combine_send(uint32_t seq, uint32_t op, int parity, const void* y,
                                const int32_t* counts, const int64_t* row_base) {
  const WireConfig& c = config_;
  const size_t row_bytes = 2 * static_cast<size_t>(c.hidden);
  std::fill(last_bytes_.begin(), last_bytes_.end(), 0);
  std::vector<uint32_t> sent(c.world);
  for (int32_t s = 0; s < c.world; ++s)  // before any store: a bad count stages nothing
    PA2A_CHECK_ARG(counts[s] >= 0 && counts[s] <= c.max_tokens, "row count for rank ", s,
                   " out of range: ", counts[s]);
  await_consumed(kCombineRegion, parity, seq, op);
  for (int32_t i = 1; i <= c.world; ++i) {
    const int32_t s = (rank_ + i) % c.world;
    for (int32_t j = 0; j < counts[s]; ++j) {
      const auto* src = static_cast<const uint8_t*>(y) + (row_base[s] + j) * row_bytes;
      std::memcpy(slot_ptr(kCombineRegion, parity, rank_, s, j), src, row_bytes);
    }
    sent[s] = static_cast<uint32_t>(counts[s]);
    last_bytes_[s] += static_cast<uint64_t>(counts[s]) * layout_.combine_slot;
  }
  note_staged(kCombineRegion, parity, seq);
  publish(seq, op, sent);
}

void ShmTransport::reduce_expert_major(const void* y, const int32_t* counts,
                                       const int32_t* expert_pos, const int32_t* row_experts,
                                       const float* row_weights, int32_t num_local_experts,
                                       void* rows_out) {
  const WireConfig& c = config_;
  const int32_t M = c.max_tokens, K = c.num_topk, H = c.hidden;
  const size_t cap = static_cast<size_t>(c.world) * M;
  std::vector<float> acc(H);
  for (int32_t s = 0; s < c.world; ++s) {
    for (int32_t j = 0; j < counts[s]; ++j) {
      const size_t row = static_cast<size_t>(s) * M + j;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int32_t k = 0; k < K; ++k) {
        const int32_t e = row_experts[row * K + k];
        if (e < 0) continue;
        PA2A_HOST_ASSERT(e < num_local_experts);
        // expert_pos comes from the handle; a bad one would make `src` a wild pointer.
        const int32_t pos = expert_pos[row * K + k];
        PA2A_HOST_ASSERT(pos >= 0 && static_cast<size_t>(pos) < cap);
        const size_t src = (static_cast<size_t>(e) * cap + pos) * H;
        accumulate_row(acc.data(), static_cast<const uint16_t*>(y) + src, row_weights[row * K + k],
                       H, c.dtype);
      }
      float_row_to_half(acc.data(), H, c.dtype, static_cast<uint16_t*>(rows_out) + row * H);
    }
  }
}

void ShmTransport::combine_recv(uint32_t seq, uint32_t op, int parity, double timeout_s,
                                const int32_t* send_token, const int32_t* send_count,
                                int32_t num_tokens, void* out, bool out_fp32) {
  const WireConfig& c = config_;
  const int32_t W = c.world, M = c.max_tokens, H = c.hidden;
  const std::vector<int32_t> counts = wait(seq, op, timeout_s);
  for (int32_t d = 0; d < W; ++d)
    if (counts[d] != send_count[d]) {
      mark_consumed(kCombineRegion, seq);  // reads nothing of this call
      PA2A_THROW(kPeer, "rank ", d, " returned ", counts[d], " rows in ", op_name(op), " (call ",
                 seq, ") but rank ", rank_, " dispatched ", send_count[d],
                 " rows to it: every rank must combine the handles of the same dispatch");
    }
  acc_.assign(static_cast<size_t>(num_tokens) * H, 0.0f);
  for (int32_t d = 0; d < W; ++d) {
    for (int32_t j = 0; j < send_count[d]; ++j) {
      const int32_t t = send_token[static_cast<size_t>(d) * M + j];
      PA2A_HOST_ASSERT(t >= 0 && t < num_tokens);
      const auto* row =
          reinterpret_cast<const uint16_t*>(slot_ptr(kCombineRegion, parity, d, rank_, j));
      accumulate_row(acc_.data() + static_cast<size_t>(t) * H, row, 1.0f, H, c.dtype);
    }
  }
  mark_consumed(kCombineRegion, seq);
  if (out_fp32) {
    std::memcpy(out, acc_.data(), acc_.size() * sizeof(float));
    return;
  }
  float_row_to_half(acc_.data(), static_cast<int>(acc_.size()), c.dtype,
                    static_cast<uint16_t*>(out));
}

}  // namespace pa2a
