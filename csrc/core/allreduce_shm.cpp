#include "core/allreduce_shm.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/allreduce_math.h"
#include "core/exception.h"
#include "core/peer_wait.h"
#include "core/shm_segment.h"

namespace pa2a::ar {
namespace {

using wait::Clock;
using wait::process_alive;

const char* phase_name(int phase) {
  return phase == kScatter ? "scatter" : phase == kGather ? "gather" : "end barrier";
}

const char* algo_name(int32_t a) {
  return a == static_cast<int32_t>(Algo::kOneShot)   ? "one-shot"
         : a == static_cast<int32_t>(Algo::kTwoShot) ? "two-shot"
                                                     : "unknown";
}

const char* dtype_name(int32_t d) {
  return d == static_cast<int32_t>(DType::kBF16)   ? "bfloat16"
         : d == static_cast<int32_t>(DType::kFP16) ? "float16"
                                                   : "unknown";
}

constexpr int kTile = 1024;  // elements summed per pass (fits L1 with W sources)

// dst[i] = src[i] as fp32 / acc[i] += src[i], with the dtype outside the loop so that
// the compiler vectorises them.
template <DType kDT>
void load_tile(float* acc, const uint16_t* src, int n) {
  for (int i = 0; i < n; ++i) acc[i] = to_f(src[i], kDT);
}
template <DType kDT>
void add_tile(float* acc, const uint16_t* src, int n) {
  for (int i = 0; i < n; ++i) acc[i] = acc[i] + to_f(src[i], kDT);
}
template <DType kDT>
void round_tile(const float* acc, uint16_t* r, int n) {
  for (int i = 0; i < n; ++i) r[i] = from_f(acc[i], kDT);
}
template <DType kDT>
void residual_tile(const uint16_t* r, const uint16_t* res, uint16_t* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = from_f(to_f(r[i], kDT) + to_f(res[i], kDT), kDT);
}

template <DType kDT>
void sum_tiles(const uint16_t* const* src, int world, int64_t n, const uint16_t* residual,
               uint16_t* const* copies, int ncopies, uint16_t* out, float* acc) {
  uint16_t r[kTile];
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int m = static_cast<int>(std::min<int64_t>(kTile, n - t0));
    load_tile<kDT>(acc, src[0] + t0, m);
    for (int s = 1; s < world; ++s) add_tile<kDT>(acc, src[s] + t0, m);
    round_tile<kDT>(acc, r, m);
    for (int c = 0; c < ncopies; ++c) std::memcpy(copies[c] + t0, r, 2 * static_cast<size_t>(m));
    if (residual != nullptr)
      residual_tile<kDT>(r, residual + t0, out + t0, m);
    else
      std::memcpy(out + t0, r, 2 * static_cast<size_t>(m));
  }
}

template <DType kDT>
void copy_with_residual(const uint16_t* r, const uint16_t* residual, uint16_t* out, int64_t n) {
  if (residual == nullptr) {
    std::memmove(out, r, 2 * static_cast<size_t>(n));
    return;
  }
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int m = static_cast<int>(std::min<int64_t>(kTile, n - t0));
    residual_tile<kDT>(r + t0, residual + t0, out + t0, m);
  }
}

}  // namespace

std::string ShmAllReduce::segment_name(const std::string& prefix, int32_t rank) {
  return "/" + prefix + ".ar" + std::to_string(rank);
}

bool ShmAllReduce::unlink_name(const std::string& name) {
  return shm::unlink(name);
}

ShmAllReduce::ShmAllReduce(std::string prefix, int32_t rank, const Config& config, bool end_barrier)
    : prefix_(std::move(prefix)), rank_(rank), config_(config), end_barrier_(end_barrier) {
  const Config& c = config_;
  PA2A_CHECK_ARG(c.world >= 1 && c.world <= kMaxWorld, "world size must be in [1, ", kMaxWorld,
                 "], got ", c.world);
  PA2A_CHECK_ARG(rank >= 0 && rank < c.world, "rank must be in [0, ", c.world, "), got ", rank);
  PA2A_CHECK_ARG(c.buffers == 1 || c.buffers == 2, "buffers must be 1 or 2, got ", c.buffers);
  PA2A_CHECK_ARG(
      c.max_bytes >= kVecBytes && c.max_bytes % kVecBytes == 0 && c.max_bytes / 2 <= kMaxElements,
      "max_bytes must be a positive multiple of 16 of at most ", 2 * kMaxElements, ", got ",
      c.max_bytes);
  layout_ = segment_layout(c);
  maps_.assign(c.world, nullptr);
  pids_.assign(c.world, 0);
  pull_.assign(static_cast<size_t>(c.world) * c.world, 0);
  last_bytes_.assign(c.world, 0);
  acc_.resize(kTile);

  // Receivers poll and sum from their own segment: keep it on this rank's NUMA node. Its
  // space in /dev/shm is reserved first (every rank of the host has a segment).
  shm::OwnSegment own =
      shm::create(segment_name(prefix_, rank_), layout_.total, numa_node_of_current_cpu(), c.world,
                  ShmUser{"an all-reduce", "max_bytes"});
  own_linked_ = true;
  maps_[rank_] = own.data;
  numa_ = std::move(own.numa);
  pids_[rank_] = static_cast<int32_t>(::getpid());
  SegmentHeader h{};
  h.magic = kMagic;
  h.version = kVersion;
  h.rank = rank_;
  h.pid = pids_[rank_];
  h.config = c;
  std::memcpy(own.data, &h, sizeof(h));
}

ShmAllReduce::~ShmAllReduce() {
  close();
}

void ShmAllReduce::attach_peers() {
  for (int32_t r = 0; r < config_.world; ++r) {
    if (maps_[r] != nullptr) continue;
    const auto h =
        shm::attach_peer<SegmentHeader>(maps_, segment_name(prefix_, r), layout_.total, rank_, r,
                                        "all-reduce segment", kMagic, kVersion);
    pids_[r] = h.pid;
  }
}

void ShmAllReduce::unlink_own() {
  if (own_linked_) {
    unlink_name(segment_name(prefix_, rank_));
    own_linked_ = false;
  }
}

void ShmAllReduce::close() {
  unlink_own();
  shm::unmap_all(maps_, layout_.total);
}

void ShmAllReduce::set_directions(const std::vector<uint8_t>& pull) {
  const int32_t W = config_.world;
  PA2A_CHECK_ARG(static_cast<int32_t>(pull.size()) == W * W, "directions need world^2 = ", W * W,
                 " entries (pull[src * world + dst]), got ", pull.size());
  for (int32_t s = 0; s < W; ++s)
    PA2A_CHECK_ARG(pull[s * W + s] == 0, "rank ", s, " cannot pull from itself");
  pull_ = pull;
}

uint64_t* ShmAllReduce::flag(int32_t owner, int phase, uint32_t seq, int block, int32_t src) const {
  return reinterpret_cast<uint64_t*>(base(owner) +
                                     flag_offset(config_, phase, flag_parity(seq), block, src));
}

std::string ShmAllReduce::describe_peer(int32_t r) const {
  return "rank " + std::to_string(r) + " (pid " + std::to_string(pids_[r]) + ")";
}

void ShmAllReduce::check_call(const CallArgs& a) const {
  PA2A_CHECK_ARG(maps_[rank_] != nullptr, "all-reduce used after close()");
  PA2A_CHECK_ARG(a.algo == Algo::kOneShot || a.algo == Algo::kTwoShot,
                 "algo must be 1 (one-shot) or 2 (two-shot), got ", static_cast<int>(a.algo));
  PA2A_CHECK_ARG(a.dtype == DType::kBF16 || a.dtype == DType::kFP16,
                 "dtype must be bfloat16 or float16");
  PA2A_CHECK_ARG(a.numel >= 0 && a.numel % kVecElems == 0 && 2 * a.numel <= config_.max_bytes,
                 "numel must be a multiple of 8 with 2 * numel <= max_bytes = ", config_.max_bytes,
                 ", got ", a.numel);
  PA2A_CHECK_ARG(a.timeout_s > 0, "timeout_s must be positive, got ", a.timeout_s);
  PA2A_CHECK_ARG(a.numel == 0 || (a.x != nullptr && a.out != nullptr), "x and out are required");
}

void ShmAllReduce::publish(int phase, uint32_t seq, int block, uint32_t info) {
  const int32_t W = config_.world;
  for (int32_t i = 1; i < W; ++i) {  // starting after our rank: ranks do not all hit rank 0
    const int32_t d = (rank_ + i) % W;
    __atomic_store_n(flag(d, phase, seq, block, rank_), pack_flag(seq, info), __ATOMIC_RELEASE);
    last_bytes_[d] += 8;
  }
}

void ShmAllReduce::abort(uint32_t seq, double timeout_s) {
  PA2A_CHECK_ARG(maps_[rank_] != nullptr, "all-reduce used after close()");
  PA2A_CHECK_ARG(timeout_s > 0, "timeout_s must be positive, got ", timeout_s);
  std::fill(last_bytes_.begin(), last_bytes_.end(), 0);
  for (int phase = 0; phase < kPhases; ++phase)
    for (int b = 0; b < kMaxBlocks; ++b) publish(phase, seq, b, kAbortInfo);
  // Every peer sends block 0 of kScatter in every call it begins, so this returns once each
  // has begun call seq: it finished reading call seq - 1, whose parity our call seq + 1 reuses.
  wait_phase(kScatter, seq, 0, 0, timeout_s, /*any_info=*/true);
}

bool ShmAllReduce::wait_phase(int phase, uint32_t seq, int block, uint32_t tag, double timeout_s,
                              bool any_info) {
  const int32_t W = config_.world;
  std::vector<bool> got(W, false);
  got[rank_] = true;
  int32_t remaining = W - 1, aborter = -1;
  std::string problem;
  wait::Backoff backoff;
  const auto start = backoff.start();
  const auto deadline = wait::deadline_after(start, timeout_s);
  auto next_liveness = start + std::chrono::milliseconds(50);
  for (;;) {
    for (int32_t s = 0; s < W; ++s) {
      if (got[s]) continue;
      const uint64_t w = __atomic_load_n(flag(rank_, phase, seq, block, s), __ATOMIC_ACQUIRE);
      if (flag_seq(w) != seq) continue;
      got[s] = true;
      --remaining;
      const uint32_t info = flag_info(w);
      if (any_info) continue;
      if (info == kAbortInfo) {
        if (aborter < 0) aborter = s;
      } else if (info != tag && problem.empty()) {
        problem = detail::concat(
            "rank ", s, " all-reduces ", tag_numel(info), " ", dtype_name(tag_dtype(info)), " (",
            algo_name(tag_algo(info)), ") in call ", seq, " while rank ", rank_, " all-reduces ",
            tag_numel(tag), " ", dtype_name(tag_dtype(tag)), " (", algo_name(tag_algo(tag)),
            "): every rank must all-reduce the same shape and dtype in the same order");
      }
    }
    if (remaining == 0) {
      if (!problem.empty()) PA2A_THROW(kPeer, problem);
      if (aborter >= 0) {
        skip_ = true;
        last_aborter_ = aborter;
      }
      return aborter < 0;
    }
    const auto now = Clock::now();
    if (now >= deadline || now >= next_liveness) {
      std::string missing;
      for (int32_t s = 0; s < W; ++s) {
        if (got[s]) continue;
        if (!process_alive(pids_[s]))
          PA2A_THROW(kPeer, describe_peer(s), " exited before the all-reduce ", phase_name(phase),
                     " of call ", seq, " reached rank ", rank_);
        missing += (missing.empty() ? "" : ", ") + std::to_string(s);
      }
      if (now >= deadline)
        PA2A_THROW(kTimeout, "rank ", rank_, " timed out after ", timeout_s,
                   " s in all-reduce call ", seq, " (", phase_name(phase), ") waiting for rank(s) ",
                   missing,
                   "; they are alive but did not send: a rank is stuck, slower than the timeout, "
                   "or skipped a call");
      next_liveness = now + std::chrono::milliseconds(50);
    }
    backoff.pause(now);
  }
}

// Where source s's vectors of the current call are, as this rank reads them.
const uint8_t* ShmAllReduce::source_vectors(int32_t s, int buf, const CallArgs& a) const {
  if (s == rank_) return static_cast<const uint8_t*>(a.x);
  const int32_t owner = pulls(s, rank_) ? s : rank_;
  return base(owner) + data_offset(config_, layout_, buf, s);
}

void ShmAllReduce::run(const CallArgs& a) {
  send(a);
  finish(a);
}

void ShmAllReduce::send(const CallArgs& a) {
  check_call(a);
  const int32_t W = config_.world;
  std::fill(last_bytes_.begin(), last_bytes_.end(), 0);
  const int64_t nvec = a.numel / kVecElems;
  const uint32_t tag = call_tag(a.algo, static_cast<int32_t>(a.dtype), a.numel);
  const int buf = data_buffer(config_, a.seq);
  const auto* x = static_cast<const uint8_t*>(a.x);
  auto put = [&](int32_t d, Range r) {  // vectors r of x towards rank d
    if (r.end <= r.begin) return;
    const int32_t owner = pulls(rank_, d) ? rank_ : d;
    const size_t off = static_cast<size_t>(r.begin) * kVecBytes;
    const size_t len = static_cast<size_t>(r.end - r.begin) * kVecBytes;
    std::memcpy(base(owner) + data_offset(config_, layout_, buf, rank_) + off, x + off, len);
    last_bytes_[owner] += len;
  };
  if (a.algo == Algo::kOneShot) {
    const int B = one_shot_blocks(nvec);
    for (int b = 0; b < B; ++b) {
      const Range r = split(nvec, B, b);
      bool staged = false;
      for (int32_t i = 1; i < W; ++i) {
        const int32_t d = (rank_ + i) % W;
        if (pulls(rank_, d)) {
          if (!staged) put(d, r);  // one copy in our own segment serves every puller
          staged = true;
        } else {
          put(d, r);
        }
      }
      publish(kScatter, a.seq, b, tag);
    }
  } else {
    const int B = two_shot_blocks(nvec, W);
    for (int b = 0; b < B; ++b) {
      for (int32_t i = 1; i < W; ++i) {
        const int32_t d = (rank_ + i) % W;
        put(d, shard_piece(nvec, W, d, B, b));
      }
      publish(kScatter, a.seq, b, tag);
    }
  }
}

void ShmAllReduce::finish(const CallArgs& a) {
  check_call(a);
  const int32_t W = config_.world;
  skip_ = false;
  const int64_t nvec = a.numel / kVecElems;
  const uint32_t tag = call_tag(a.algo, static_cast<int32_t>(a.dtype), a.numel);
  const int buf = data_buffer(config_, a.seq);
  const auto* res = static_cast<const uint16_t*>(a.residual);
  auto* out = static_cast<uint16_t*>(a.out);
  std::vector<const uint16_t*> src(W);
  auto sum = [&](Range r, uint16_t* const* copies, int ncopies) {
    if (r.end <= r.begin) return;
    const int64_t e0 = r.begin * kVecElems, n = (r.end - r.begin) * kVecElems;
    for (int32_t s = 0; s < W; ++s)
      src[s] = reinterpret_cast<const uint16_t*>(source_vectors(s, buf, a)) + e0;
    const uint16_t* rr = res != nullptr ? res + e0 : nullptr;
    if (a.dtype == DType::kBF16)
      sum_tiles<DType::kBF16>(src.data(), W, n, rr, copies, ncopies, out + e0, acc_.data());
    else
      sum_tiles<DType::kFP16>(src.data(), W, n, rr, copies, ncopies, out + e0, acc_.data());
  };
  const int B = a.algo == Algo::kOneShot ? one_shot_blocks(nvec) : two_shot_blocks(nvec, W);
  if (a.algo == Algo::kOneShot) {
    for (int b = 0; b < B; ++b) wait_phase(kScatter, a.seq, b, tag, a.timeout_s);
    if (!skip_)
      for (int b = 0; b < B; ++b) sum(split(nvec, B, b), nullptr, 0);
  } else {
    // The summed shard goes into every pushing peer's gather buffer, and once into our own
    // when some peer pulls it from us.
    const size_t goff = gather_offset(config_, layout_, buf);
    for (int b = 0; b < B; ++b) {
      wait_phase(kScatter, a.seq, b, tag, a.timeout_s);
      if (skip_) continue;
      const Range r = shard_piece(nvec, W, rank_, B, b);
      const size_t off = static_cast<size_t>(r.begin) * kVecBytes;
      std::vector<uint16_t*> copies;
      bool staged = false;
      for (int32_t i = 1; i < W; ++i) {
        const int32_t d = (rank_ + i) % W;
        const int32_t owner = pulls(rank_, d) ? rank_ : d;
        if (owner == rank_ && staged) continue;
        staged = staged || owner == rank_;
        copies.push_back(reinterpret_cast<uint16_t*>(base(owner) + goff + off));
        last_bytes_[owner] += static_cast<size_t>(r.end - r.begin) * kVecBytes;
      }
      sum(r, copies.data(), static_cast<int>(copies.size()));
      publish(kGather, a.seq, b, tag);
    }
    if (!skip_) {
      for (int b = 0; b < B; ++b) wait_phase(kGather, a.seq, b, tag, a.timeout_s);
      for (int b = 0; b < B; ++b) {
        for (int32_t s = 0; s < W; ++s) {
          if (s == rank_) continue;
          const Range r = shard_piece(nvec, W, s, B, b);
          if (r.end <= r.begin) continue;
          const int64_t e0 = r.begin * kVecElems, n = (r.end - r.begin) * kVecElems;
          const int32_t owner = pulls(s, rank_) ? s : rank_;
          const auto* g = reinterpret_cast<const uint16_t*>(base(owner) + goff) + e0;
          const uint16_t* rr = res != nullptr ? res + e0 : nullptr;
          if (a.dtype == DType::kBF16)
            copy_with_residual<DType::kBF16>(g, rr, out + e0, n);
          else
            copy_with_residual<DType::kFP16>(g, rr, out + e0, n);
        }
      }
    }
  }
  // Done means "finished reading this call", also after skipping it: a peer that waits for
  // our kDone must get it (the kernels' pushing blocks wait for it whatever happened).
  if (end_barrier_) {
    for (int b = 0; b < B; ++b) publish(kDone, a.seq, b, tag);
    for (int b = 0; b < B; ++b) wait_phase(kDone, a.seq, b, tag, a.timeout_s);
  }
  if (skip_)
    PA2A_THROW(kAborted, "rank ", last_aborter_, " aborted all-reduce call ", a.seq,
               " because it raised an error; see that rank's traceback");
}

void rmsnorm_rows(const void* r, const void* residual, const void* weight, int64_t rows,
                  int32_t hidden, float eps, DType dtype, void* normed, void* residual_out) {
  PA2A_CHECK_ARG(hidden > 0 && hidden % kVecElems == 0,
                 "hidden must be a positive multiple of 8, got ", hidden);
  PA2A_CHECK_ARG(rows >= 0, "rows must be >= 0, got ", rows);
  PA2A_CHECK_ARG(dtype == DType::kBF16 || dtype == DType::kFP16,
                 "dtype must be bfloat16 or float16");
  const auto* rv = static_cast<const uint16_t*>(r);
  const auto* res = static_cast<const uint16_t*>(residual);
  const auto* w = static_cast<const uint16_t*>(weight);
  auto* nv = static_cast<uint16_t*>(normed);
  auto* ro = static_cast<uint16_t*>(residual_out);
  std::vector<float> z(hidden);
  for (int64_t row = 0; row < rows; ++row) {
    const size_t o = static_cast<size_t>(row) * hidden;
    for (int32_t i = 0; i < hidden; ++i)
      z[i] = res != nullptr ? to_f(rv[o + i], dtype) + to_f(res[o + i], dtype)
                            : to_f(rv[o + i], dtype);
    const float inv = rms_inv(norm_sum_sq(z.data(), hidden), hidden, eps);
    for (int32_t i = 0; i < hidden; ++i) {
      if (ro != nullptr) ro[o + i] = from_f(z[i], dtype);
      nv[o + i] = rms_normed(z[i], inv, w[i], dtype);
    }
  }
}

}  // namespace pa2a::ar
