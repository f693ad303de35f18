#include "cuda/allreduce/communicator.cuh"

#include <unistd.h>

#include "core/exception.h"
#include "cuda/common/cuda_check.cuh"
#include "cuda/common/ipc.cuh"

namespace pa2a::ar {

using cuda::capturing;
using cuda::check_launch;
using cuda::DeviceGuard;
using cuda::open_ipc_handle;

namespace {

const char* phase_name(int phase) {
  return phase == kScatter ? "scatter" : phase == kGather ? "gather" : "end barrier";
}

}  // namespace

CudaAllReduce::CudaAllReduce(int32_t rank, const Config& config, int32_t device, bool end_barrier)
    : rank_(rank), config_(config), device_(device), end_barrier_(end_barrier) {
  const Config& c = config_;
  PA2A_CHECK_ARG(c.world >= 1 && c.world <= kMaxWorld, "world size must be in [1, ", kMaxWorld,
                 "], got ", c.world);
  PA2A_CHECK_ARG(rank >= 0 && rank < c.world, "rank must be in [0, ", c.world, "), got ", rank);
  PA2A_CHECK_ARG(c.buffers == 1 || c.buffers == 2, "buffers must be 1 or 2, got ", c.buffers);
  PA2A_CHECK_ARG(c.buffers == 2 || end_barrier,
                 "one buffer is safe only with the end barrier (core/allreduce_wire.h)");
  PA2A_CHECK_ARG(
      c.max_bytes >= kVecBytes && c.max_bytes % kVecBytes == 0 && c.max_bytes / 2 <= kMaxElements,
      "max_bytes must be a positive multiple of 16 of at most ", 2 * kMaxElements, ", got ",
      c.max_bytes);
  layout_ = segment_layout(c);
  ipc_opened_.assign(c.world, nullptr);
  pull_.assign(static_cast<size_t>(c.world) * c.world, 0);
  last_bytes_.assign(c.world, 0);
  DeviceGuard guard(device_);
  try {
    PA2A_CUDA_CHECK(cudaMalloc(&seg_, layout_.total));
    // Flags start at call 0 (no call has that number); data needs no initial value.
    PA2A_CUDA_CHECK(cudaMemset(seg_, 0, layout_.data_off));
    SegmentHeader h{};
    h.magic = kMagic;
    h.version = kVersion;
    h.rank = rank_;
    h.pid = static_cast<int32_t>(::getpid());
    h.config = c;
    PA2A_CUDA_CHECK(cudaMemcpy(seg_, &h, sizeof(h), cudaMemcpyHostToDevice));
    PA2A_CUDA_CHECK(cudaMalloc(&state_, sizeof(DeviceState)));
    PA2A_CUDA_CHECK(cudaMemset(state_, 0, sizeof(DeviceState)));
    PA2A_CUDA_CHECK(
        cudaHostAlloc(&err_host_, sizeof(uint64_t), cudaHostAllocMapped | cudaHostAllocPortable));
    *err_host_ = 0;
    PA2A_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev_), err_host_, 0));
    PA2A_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  } catch (...) {
    close();
    throw;
  }
  base_[rank_] = seg_;
}

CudaAllReduce::~CudaAllReduce() {
  try {
    close();
  } catch (...) {  // a destructor never throws
  }
}

std::string CudaAllReduce::ipc_handle() const {
  require_open("ipc_handle");
  DeviceGuard guard(device_);
  cudaIpcMemHandle_t h;
  PA2A_CUDA_CHECK(cudaIpcGetMemHandle(&h, seg_));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void CudaAllReduce::open_peers(const std::vector<std::string>& handles,
                               const std::vector<uintptr_t>& local,
                               const std::vector<uint8_t>& pull) {
  require_open("open_peers");
  const int32_t W = config_.world;
  PA2A_CHECK_ARG(!opened_, "open_peers was already called");
  PA2A_CHECK_ARG(
      static_cast<int32_t>(handles.size()) == W && static_cast<int32_t>(local.size()) == W &&
          static_cast<int32_t>(pull.size()) == W * W,
      "open_peers: handles and local need world = ", W, " entries and pull world^2 = ", W * W);
  for (int32_t s = 0; s < W; ++s)
    PA2A_CHECK_ARG(pull[s * W + s] == 0, "rank ", s, " cannot pull from itself");
  pull_ = pull;
  pull_from_ = pull_to_ = 0;
  for (int32_t s = 0; s < W; ++s) {
    if (pull[s * W + rank_]) pull_from_ |= 1u << s;
    if (pull[rank_ * W + s]) pull_to_ |= 1u << s;
  }
  DeviceGuard guard(device_);
  for (int32_t r = 0; r < W; ++r) {
    if (r == rank_) continue;
    if (local[r] != 0) {
      base_[r] = reinterpret_cast<uint8_t*>(local[r]);
      continue;
    }
    ipc_opened_[r] = open_ipc_handle(handles[r], rank_, r, "all-reduce segment",
                                     "no P2P between these GPUs? the group then needs NCCL");
    base_[r] = static_cast<uint8_t*>(ipc_opened_[r]);
  }
  opened_ = true;
}

void CudaAllReduce::close() {
  if (closed_) return;
  closed_ = true;
  int prev = -1;
  (void)cudaGetDevice(&prev);
  (void)cudaSetDevice(device_);
  // Our own last call (kernels never wait without a deadline, so this returns): the segment
  // stays alive until it is done. Errors are swallowed: close releases what it can.
  if (done_recorded_) (void)cudaEventSynchronize(done_);
  done_recorded_ = false;
  for (auto& p : ipc_opened_) {
    if (p != nullptr) (void)cudaIpcCloseMemHandle(p);
    p = nullptr;
  }
  (void)cudaFree(seg_);
  (void)cudaFree(state_);
  if (err_host_ != nullptr) (void)cudaFreeHost(err_host_);
  if (done_ != nullptr) (void)cudaEventDestroy(done_);
  done_ = nullptr;
  seg_ = nullptr;
  state_ = nullptr;
  err_host_ = err_dev_ = nullptr;
  for (auto& b : base_) b = nullptr;
  (void)cudaGetLastError();
  if (prev >= 0 && prev != device_) (void)cudaSetDevice(prev);
}

void CudaAllReduce::require_open(const char* what) const {
  if (closed_) PA2A_THROW(kRuntime, "CUDA all-reduce: ", what, " after close()");
}

uint64_t CudaAllReduce::error_word() const {
  return err_host_ == nullptr ? 0 : *reinterpret_cast<volatile uint64_t*>(err_host_);
}

void CudaAllReduce::check() {
  const uint64_t w = error_word();
  if (w == 0) return;
  const int32_t peer = error_peer(w);
  const uint32_t seq = error_seq(w);
  const char* phase = phase_name(error_phase(w));
  switch (error_code(w)) {
    case DevError::kTimeout:
      PA2A_THROW(kTimeout, "rank ", rank_, " timed out on the GPU in all-reduce call ", seq, " (",
                 phase, ") waiting for rank ", peer,
                 ": it did not send (stuck, slower than the timeout, skipped a call, or exited)");
    case DevError::kAborted:
      *reinterpret_cast<volatile uint64_t*>(err_host_) = 0;
      PA2A_THROW(kAborted, "rank ", peer, " aborted all-reduce call ", seq,
                 " because it raised an error; see that rank's traceback");
    case DevError::kMismatch:
      PA2A_THROW(kPeer, "rank ", peer, " all-reduces another shape, dtype or algorithm than rank ",
                 rank_, " in call ", seq, " (", phase,
                 "): every rank must all-reduce the same shape and dtype in the same order");
    default:
      PA2A_THROW(kRuntime, "CUDA all-reduce: unknown error word 0x", std::hex, w);
  }
}

KernelArgs CudaAllReduce::args(double timeout_s) const {
  PA2A_CHECK_ARG(timeout_s > 0, "timeout_s must be positive, got ", timeout_s);
  KernelArgs k{};
  k.cfg = config_;
  k.lay = layout_;
  k.rank = rank_;
  k.pull_from = pull_from_;
  k.pull_to = pull_to_;
  k.end_barrier = end_barrier_ ? 1 : 0;
  for (int r = 0; r < kMaxWorld; ++r) k.base[r] = base_[r];
  k.state = state_;
  k.err = err_dev_;
  const double ns = timeout_s * 1e9;
  k.timeout_ns = ns > 1.8e19 ? ~0ull : static_cast<uint64_t>(ns);
  return k;
}

namespace {
void check_aligned(const void* p, const char* name) {
  PA2A_CHECK_ARG(reinterpret_cast<uintptr_t>(p) % kVecBytes == 0, name,
                 " must be 16-byte aligned for vector loads and stores, got address ", p);
}
}  // namespace

void CudaAllReduce::run(Algo algo, DType dtype, const void* x, int64_t numel, const void* residual,
                        void* out, double timeout_s, cudaStream_t stream) {
  require_open("run");
  PA2A_CHECK_ARG(opened_, "run before open_peers");
  PA2A_CHECK_ARG(numel > 0 && numel % kVecElems == 0 && 2 * numel <= config_.max_bytes,
                 "numel must be a positive multiple of 8 with 2 * numel <= max_bytes = ",
                 config_.max_bytes, ", got ", numel);
  check_aligned(x, "x");
  check_aligned(out, "out");
  if (residual != nullptr) check_aligned(residual, "residual");
  check();
  DeviceGuard guard(device_);
  KernelArgs k = args(timeout_s);
  k.dtype = static_cast<int32_t>(dtype);
  CallPtrs c{static_cast<const uint4*>(x), static_cast<const uint4*>(residual),
             static_cast<uint4*>(out), numel};
  ++host_calls_;
  launch_all_reduce(k, algo, c, stream);
  check_launch(algo == Algo::kOneShot ? "all-reduce one_shot" : "all-reduce two_shot");
  mark_done(stream);
  count_bytes(algo, numel);
}

void CudaAllReduce::abort(double timeout_s, cudaStream_t stream) {
  require_open("abort");
  PA2A_CHECK_ARG(opened_, "abort before open_peers");
  DeviceGuard guard(device_);
  ++host_calls_;
  launch_abort(args(timeout_s), stream);
  check_launch("all-reduce abort");
  mark_done(stream);
  std::fill(last_bytes_.begin(), last_bytes_.end(), 0);
}

// A captured call's work runs at its graph's replays, which the caller completes before
// close (the barrier of the lifetime above); eager calls are covered by the event.
void CudaAllReduce::mark_done(cudaStream_t stream) {
  if (capturing(stream)) return;
  if (cudaEventRecord(done_, stream) == cudaSuccess) done_recorded_ = true;
  (void)cudaGetLastError();
}

// What this rank stores into each segment per call (flags included), as the CPU
// implementation counts it: the kernels' traffic is a function of the call's shape.
void CudaAllReduce::count_bytes(Algo algo, int64_t numel) {
  const int32_t W = config_.world;
  const int64_t nvec = numel / kVecElems;
  std::fill(last_bytes_.begin(), last_bytes_.end(), 0);
  const bool stage = pull_to_ != 0;
  const int phases = (algo == Algo::kTwoShot ? 2 : 1) + (end_barrier_ ? 1 : 0);
  const int B = algo == Algo::kOneShot ? one_shot_blocks(nvec) : two_shot_blocks(nvec, W);
  for (int32_t d = 0; d < W; ++d) {
    if (d == rank_) continue;
    const bool pulls = (pull_to_ >> d) & 1u;
    uint64_t data = 0;
    if (algo == Algo::kOneShot) {
      data = static_cast<uint64_t>(nvec) * kVecBytes;
    } else {
      const Range sd = shard(nvec, W, d), me = shard(nvec, W, rank_);
      data = static_cast<uint64_t>((sd.end - sd.begin) + (me.end - me.begin)) * kVecBytes;
    }
    if (!pulls) last_bytes_[d] += data;
    last_bytes_[d] += static_cast<uint64_t>(B) * phases * 8;
  }
  if (stage) {
    if (algo == Algo::kOneShot) {
      last_bytes_[rank_] = static_cast<uint64_t>(nvec) * kVecBytes;
    } else {
      for (int32_t d = 0; d < W; ++d)
        if ((pull_to_ >> d) & 1u) {
          const Range sd = shard(nvec, W, d);
          last_bytes_[rank_] += static_cast<uint64_t>(sd.end - sd.begin) * kVecBytes;
        }
      const Range me = shard(nvec, W, rank_);
      last_bytes_[rank_] += static_cast<uint64_t>(me.end - me.begin) * kVecBytes;
    }
  }
}

}  // namespace pa2a::ar
