#include "cuda/transport/cuda_transport.cuh"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/dispatch_layout.h"
#include "core/exception.h"
#include "core/numa_memory.h"

namespace pa2a::cuda {
namespace {

#define PA2A_CUDA_CHECK(call)                                                \
  do {                                                                       \
    const cudaError_t err_ = (call);                                         \
    if (err_ != cudaSuccess) {                                               \
      (void)cudaGetLastError();                                              \
      PA2A_THROW(kRuntime, #call, " failed: ", cudaGetErrorName(err_), ": ", \
                 cudaGetErrorString(err_), " at ", __FILE__, ":", __LINE__); \
    }                                                                        \
  } while (0)

// Launch errors surface at the next CUDA call; report them at the call that made them.
void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    PA2A_THROW(kRuntime, "CUDA transport: launching ", what, " failed: ", cudaGetErrorName(err),
               ": ", cudaGetErrorString(err));
}

// Makes `device` current for the scope (the caller's thread may have another current).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) PA2A_CUDA_CHECK(cudaSetDevice(device));
    target_ = device;
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && prev_ != target_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
  int target_ = -1;
};

uint64_t timeout_ns(double s) {
  PA2A_CHECK_ARG(s > 0, "timeout_s must be positive, got ", s);
  const double ns = s * 1e9;
  return ns > 1.8e19 ? ~0ull : static_cast<uint64_t>(ns);
}

const char* error_name(DeviceError e) {
  switch (e) {
    case DeviceError::kTimeout:
      return "timeout";
    case DeviceError::kAborted:
      return "aborted";
    case DeviceError::kOpMismatch:
      return "op mismatch";
    case DeviceError::kBadCount:
      return "bad row count";
    case DeviceError::kCountMismatch:
      return "row count mismatch";
    default:
      return "unknown";
  }
}

}  // namespace

std::string CudaTransport::segment_name(const std::string& prefix, int32_t rank) {
  return "/" + prefix + ".h" + std::to_string(rank);
}

bool CudaTransport::unlink_name(const std::string& name) {
  return ::shm_unlink(name.c_str()) == 0;
}

CudaTransport::CudaTransport(std::string prefix, int32_t rank, const WireConfig& config,
                             int32_t device, int32_t num_local_experts, bool need_host_region,
                             int32_t host_numa_node)
    : prefix_(std::move(prefix)),
      rank_(rank),
      config_(config),
      device_(device),
      num_local_experts_(num_local_experts),
      host_numa_node_(host_numa_node) {
  const WireConfig& c = config_;
  PA2A_CHECK_ARG(c.world >= 1 && c.world <= kMaxWorld,
                 "the CUDA transport supports world sizes in [1, ", kMaxWorld, "], got ", c.world);
  PA2A_CHECK_ARG(rank >= 0 && rank < c.world, "rank must be in [0, ", c.world, "), got ", rank);
  PA2A_CHECK_ARG(c.hidden > 0 && c.hidden % 8 == 0,
                 "hidden must be a positive multiple of 8 (16-byte rows), got ", c.hidden);
  PA2A_CHECK_ARG(c.payload != Payload::kFP8 || c.hidden % kFp8GroupSize == 0,
                 "fp8 payload needs hidden to be a multiple of 128, got ", c.hidden);
  // Receive grids have ceil(max_tokens / 16) blocks in y (at most 65535).
  PA2A_CHECK_ARG(c.max_tokens >= 1 && c.max_tokens <= 65535 * 16,
                 "max_tokens_per_rank must be in [1, ", 65535 * 16,
                 "] for the CUDA transport, got ", c.max_tokens);
  PA2A_CHECK_ARG(c.num_topk >= 1 && c.num_topk <= 64, "num_topk must be in [1, 64], got ",
                 c.num_topk);
  PA2A_CHECK_ARG((c.dtype == DType::kBF16 && c.payload != Payload::kFP16) ||
                     (c.dtype == DType::kFP16 && c.payload != Payload::kBF16),
                 "dtype must be bf16 or fp16 with payload of the same dtype or fp8");
  PA2A_CHECK_ARG(num_local_experts >= 0 && num_local_experts <= 4096,
                 "num_local_experts must be in [0, 4096], got ", num_local_experts);
  layout_ = segment_layout(c);
  slot_ = dispatch_slot_layout(c);
  ipc_opened_.assign(c.world, nullptr);
  host_maps_.assign(c.world, nullptr);

  DeviceGuard guard(device_);
  try {
    PA2A_CUDA_CHECK(cudaMalloc(&dev_seg_, layout_.total));
    PA2A_CUDA_CHECK(cudaMemset(dev_seg_, 0, layout_.total));
    SegmentHeader h{};
    h.magic = kSegmentMagic;
    h.version = kWireVersion;
    h.rank = rank_;
    h.pid = static_cast<int32_t>(::getpid());
    h.config = c;
    PA2A_CUDA_CHECK(cudaMemcpy(dev_seg_, &h, sizeof(h), cudaMemcpyHostToDevice));
    PA2A_CUDA_CHECK(cudaMalloc(&state_, sizeof(DeviceState)));
    PA2A_CUDA_CHECK(cudaMemset(state_, 0, sizeof(DeviceState)));
    PA2A_CUDA_CHECK(cudaMalloc(&table_dev_, sizeof(PeerTable)));
    PA2A_CUDA_CHECK(
        cudaHostAlloc(&err_host_, sizeof(uint64_t), cudaHostAllocMapped | cudaHostAllocPortable));
    *err_host_ = 0;
    PA2A_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev_), err_host_, 0));
    if (c.payload == Payload::kFP8) {
      const size_t qbytes = static_cast<size_t>(c.max_tokens) * (slot_.bytes - slot_.payload_off);
      PA2A_CUDA_CHECK(cudaMalloc(&qbuf_, qbytes));
      PA2A_CUDA_CHECK(cudaMemset(qbuf_, 0, qbytes));  // scale padding is copied, never set
    }
    const size_t cnt = static_cast<size_t>(num_local_experts > 0 ? num_local_experts : 1) * c.world;
    PA2A_CUDA_CHECK(cudaMalloc(&cnt_ws_, cnt * sizeof(int32_t)));
    if (need_host_region) {
      host_seg_ = map_host_segment(rank_, true);
      host_maps_[rank_] = nullptr;  // own segment is host_seg_
    }
  } catch (...) {
    close();
    throw;
  }
}

CudaTransport::~CudaTransport() {
  try {
    close();
  } catch (...) {  // a destructor never throws
  }
}

// Creates (own) or maps (peer) the host segment of rank r and registers it with CUDA.
// Returns the host mapping; the device pointer is stored by the caller.
void* CudaTransport::map_host_segment(int32_t r, bool create) {
  const std::string name = segment_name(prefix_, r);
  const int fd = create ? ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                        : ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0)
    PA2A_THROW(kPeer, "rank ", rank_, " cannot ", create ? "create" : "open",
               " the host staging segment ", name, ": ", std::strerror(errno));
  if (create) {
    host_linked_ = true;
    if (::ftruncate(fd, static_cast<off_t>(layout_.total)) != 0) {
      const int err = errno;
      ::close(fd);
      PA2A_THROW(kRuntime, "ftruncate(", name, ", ", layout_.total,
                 " bytes) failed: ", std::strerror(err), " (is /dev/shm large enough?)");
    }
  } else {
    struct stat st{};
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != layout_.total) {
      ::close(fd);
      PA2A_THROW(kPeer, "rank ", r, "'s host segment ", name, " has ", st.st_size,
                 " bytes, expected ", layout_.total, ": the ranks disagree on the configuration");
    }
  }
  void* p = ::mmap(nullptr, layout_.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED)
    PA2A_THROW(kRuntime, "mmap of ", name, " (", layout_.total,
               " bytes) failed: ", std::strerror(err));
  if (create) {
    // The receiver's node: the far leg of a staged transfer is then the sender's posted
    // write, and the receiving GPU's reads (flags, rows) stay on its own socket.
    const NumaBindResult nb = numa_bind_and_touch(p, layout_.total, host_numa_node_);
    numa_warning_ = nb.warning;
  }
  const cudaError_t reg =
      cudaHostRegister(p, layout_.total, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (reg != cudaSuccess) {
    (void)cudaGetLastError();
    ::munmap(p, layout_.total);
    PA2A_THROW(kRuntime, "cudaHostRegister of ", name, " (", layout_.total,
               " bytes) failed: ", cudaGetErrorName(reg), ": ", cudaGetErrorString(reg));
  }
  if (create) {
    void* d = nullptr;
    const cudaError_t dev = cudaHostGetDevicePointer(&d, p, 0);
    if (dev != cudaSuccess) {
      (void)cudaGetLastError();
      (void)cudaHostUnregister(p);
      ::munmap(p, layout_.total);
      PA2A_THROW(kRuntime, "cudaHostGetDevicePointer of ", name, " failed: ", cudaGetErrorName(dev),
                 ": ", cudaGetErrorString(dev));
    }
    host_seg_dev_ = static_cast<uint8_t*>(d);
  }
  return p;
}

std::string CudaTransport::ipc_handle() const {
  require_open("ipc_handle");
  DeviceGuard guard(device_);
  cudaIpcMemHandle_t h;
  PA2A_CUDA_CHECK(cudaIpcGetMemHandle(&h, dev_seg_));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void CudaTransport::open_peers(const std::vector<std::string>& handles,
                               const std::vector<int32_t>& send_transport,
                               const std::vector<int32_t>& recv_transport,
                               const std::vector<int32_t>& order) {
  require_open("open_peers");
  const int32_t W = config_.world;
  PA2A_CHECK_ARG(!opened_, "open_peers was already called");
  PA2A_CHECK_ARG(static_cast<int32_t>(handles.size()) == W &&
                     static_cast<int32_t>(send_transport.size()) == W &&
                     static_cast<int32_t>(recv_transport.size()) == W &&
                     static_cast<int32_t>(order.size()) == W,
                 "open_peers: every list must have world = ", W, " entries");
  std::vector<bool> seen(W, false);
  for (int32_t i = 0; i < W; ++i) {
    PA2A_CHECK_ARG(order[i] >= 0 && order[i] < W && !seen[order[i]],
                   "send order must be a permutation of 0..", W - 1);
    seen[order[i]] = true;
    table_.order[i] = order[i];
  }
  DeviceGuard guard(device_);
  for (int32_t r = 0; r < W; ++r) {
    const auto st = static_cast<PairTransport>(send_transport[r]);
    const auto rt = static_cast<PairTransport>(recv_transport[r]);
    PA2A_CHECK_ARG(st == PairTransport::kP2P || st == PairTransport::kStaged, "send_transport[", r,
                   "] must be 0 (p2p) or 1 (staged)");
    PA2A_CHECK_ARG(rt == PairTransport::kP2P || rt == PairTransport::kStaged, "recv_transport[", r,
                   "] must be 0 (p2p) or 1 (staged)");
    if (r == rank_) {  // our own rows never leave the device
      table_.send_base[r] = dev_seg_;
      table_.recv_base[r] = dev_seg_;
      continue;
    }
    if (rt == PairTransport::kStaged) {
      PA2A_CHECK_ARG(host_seg_dev_ != nullptr, "rank ", r, " sends to rank ", rank_,
                     " through host memory but this rank was built without a host region");
      table_.recv_base[r] = host_seg_dev_;
    } else {
      table_.recv_base[r] = dev_seg_;
    }
    if (st == PairTransport::kP2P) {
      PA2A_CHECK_ARG(handles[r].size() == sizeof(cudaIpcMemHandle_t), "rank ", r,
                     "'s IPC handle has ", handles[r].size(), " bytes, expected ",
                     sizeof(cudaIpcMemHandle_t));
      cudaIpcMemHandle_t h;
      std::memcpy(&h, handles[r].data(), sizeof(h));
      void* p = nullptr;
      const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        PA2A_THROW(kPeer, "rank ", rank_, " cannot open rank ", r,
                   "'s device segment through CUDA IPC: ", cudaGetErrorName(err), ": ",
                   cudaGetErrorString(err),
                   " (peer access unsupported? force host staging with PCIE_A2A_P2P=0)");
      }
      ipc_opened_[r] = p;
      table_.send_base[r] = static_cast<uint8_t*>(p);
    } else {
      host_maps_[r] = map_host_segment(r, false);
      void* d = nullptr;
      PA2A_CUDA_CHECK(cudaHostGetDevicePointer(&d, host_maps_[r], 0));
      table_.send_base[r] = static_cast<uint8_t*>(d);
    }
  }
  PA2A_CUDA_CHECK(cudaMemcpy(table_dev_, &table_, sizeof(table_), cudaMemcpyHostToDevice));
  opened_ = true;
}

void CudaTransport::set_placement(const std::vector<int32_t>& offset,
                                  const std::vector<int32_t>& rank,
                                  const std::vector<int32_t>& local,
                                  const std::vector<int32_t>& choice_offset,
                                  const std::vector<int32_t>& choice) {
  require_open("set_placement");
  PA2A_CHECK_ARG(rank.size() == local.size(), "placement rank/local arrays differ in length");
  check_placement(offset.data(), offset.size(), rank.data(), local.data(), rank.size(),
                  config_.world);
  if (!choice_offset.empty())
    check_replica_choice(choice_offset.data(), choice_offset.size(), choice.data(), choice.size(),
                         offset.data(), offset.size());
  PA2A_CHECK_ARG(!choice_offset.empty() || choice.empty(),
                 "replica choice given without its offsets");
  DeviceGuard guard(device_);
  if (placement_dev_ != nullptr) {
    PA2A_CUDA_CHECK(cudaDeviceSynchronize());  // a running kernel may read the old map
    PA2A_CUDA_CHECK(cudaFree(placement_dev_));
    placement_dev_ = nullptr;
  }
  std::vector<int32_t> all(offset);
  all.insert(all.end(), rank.begin(), rank.end());
  all.insert(all.end(), local.begin(), local.end());
  all.insert(all.end(), choice_offset.begin(), choice_offset.end());
  all.insert(all.end(), choice.begin(), choice.end());
  PA2A_CUDA_CHECK(cudaMalloc(&placement_dev_, all.size() * sizeof(int32_t)));
  PA2A_CUDA_CHECK(
      cudaMemcpy(placement_dev_, all.data(), all.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  placement_.replica_offset = placement_dev_;
  placement_.replica_rank = placement_dev_ + offset.size();
  placement_.replica_local = placement_dev_ + offset.size() + rank.size();
  placement_.num_experts = static_cast<int32_t>(offset.size()) - 1;
  const size_t choice_at = offset.size() + rank.size() + local.size();
  placement_.choice_offset = choice_offset.empty() ? nullptr : placement_dev_ + choice_at;
  placement_.choice =
      choice_offset.empty() ? nullptr : placement_dev_ + choice_at + choice_offset.size();
}

void CudaTransport::unlink_own() {
  if (host_linked_) {
    unlink_name(segment_name(prefix_, rank_));
    host_linked_ = false;
  }
}

void CudaTransport::close() {
  if (closed_) return;
  closed_ = true;
  unlink_own();
  int prev = -1;
  (void)cudaGetDevice(&prev);
  (void)cudaSetDevice(device_);
  // Kernels never wait without a deadline, so this returns; it keeps memory alive until
  // our own in-flight work is done. Errors are swallowed: close must release what it can.
  (void)cudaDeviceSynchronize();
  for (auto& p : ipc_opened_) {
    if (p != nullptr) (void)cudaIpcCloseMemHandle(p);
    p = nullptr;
  }
  for (auto& p : host_maps_) {
    if (p != nullptr) {
      (void)cudaHostUnregister(p);
      ::munmap(p, layout_.total);
    }
    p = nullptr;
  }
  if (host_seg_ != nullptr) {
    (void)cudaHostUnregister(host_seg_);
    ::munmap(host_seg_, layout_.total);
    host_seg_ = nullptr;
    host_seg_dev_ = nullptr;
  }
  (void)cudaFree(dev_seg_);
  (void)cudaFree(state_);
  (void)cudaFree(table_dev_);
  (void)cudaFree(placement_dev_);
  (void)cudaFree(qbuf_);
  (void)cudaFree(cnt_ws_);
  (void)cudaFree(pack_);
  (void)cudaFree(ce_counts_dev_);
  if (ce_host_ != nullptr) (void)cudaFreeHost(ce_host_);
  for (auto& e : ce_join_)
    if (e != nullptr) (void)cudaEventDestroy(e);
  for (auto& st : ce_streams_)
    if (st != nullptr) (void)cudaStreamDestroy(st);
  if (ce_fork_ != nullptr) (void)cudaEventDestroy(ce_fork_);
  ce_join_.clear();
  ce_streams_.clear();
  pack_ = nullptr;
  ce_counts_dev_ = nullptr;
  ce_host_ = nullptr;
  ce_fork_ = nullptr;
  ce_ready_ = false;
  if (err_host_ != nullptr) (void)cudaFreeHost(err_host_);
  dev_seg_ = nullptr;
  state_ = nullptr;
  table_dev_ = nullptr;
  placement_dev_ = nullptr;
  qbuf_ = nullptr;
  cnt_ws_ = nullptr;
  err_host_ = err_dev_ = nullptr;
  (void)cudaGetLastError();
  if (prev >= 0 && prev != device_) (void)cudaSetDevice(prev);
}

void CudaTransport::require_open(const char* what) const {
  if (closed_) PA2A_THROW(kRuntime, "CUDA transport: ", what, " after close()");
}

uint64_t CudaTransport::error_word() const {
  return err_host_ == nullptr ? 0 : *reinterpret_cast<volatile uint64_t*>(err_host_);
}

void CudaTransport::check() {
  const uint64_t w = error_word();
  if (w == 0) return;
  const DeviceError code = error_code(w);
  const int32_t peer = error_peer(w);
  const uint32_t seq = error_seq(w), op = error_op(w);
  switch (code) {
    case DeviceError::kTimeout:
      PA2A_THROW(kTimeout, "rank ", rank_, " timed out on the GPU in ", op_name(op), " (call ", seq,
                 ") waiting for rank ", peer,
                 ": it did not send (stuck, slower than the timeout, skipped a call, or exited)");
    case DeviceError::kAborted:
      *reinterpret_cast<volatile uint64_t*>(err_host_) = 0;
      PA2A_THROW(kAborted, "rank ", peer, " aborted ", op_name(op), " (call ", seq,
                 ") because it raised an error; see that rank's traceback");
    case DeviceError::kOpMismatch:
      PA2A_THROW(kPeer, "rank ", peer, " is in another call than rank ", rank_, "'s ", op_name(op),
                 " (call ", seq,
                 "): every rank must make the same sequence of dispatch/combine calls");
    case DeviceError::kBadCount:
      PA2A_THROW(kPeer, "rank ", peer,
                 " announced more rows than max_tokens_per_rank = ", config_.max_tokens, " in ",
                 op_name(op), " (call ", seq, ")");
    case DeviceError::kCountMismatch:
      PA2A_THROW(kPeer, "rank ", peer, " returned a different number of rows in ", op_name(op),
                 " (call ", seq, ") than rank ", rank_,
                 " dispatched to it: every rank must combine the handles of the same dispatch");
    default:
      PA2A_THROW(kRuntime, "CUDA transport: unknown error word 0x", std::hex, w, " (",
                 error_name(code), ")");
  }
}

KernelContext CudaTransport::context() const {
  KernelContext k{};
  k.cfg = config_;
  k.seg = layout_;
  k.slot = slot_;
  k.rank = rank_;
  k.num_local_experts = num_local_experts_;
  k.peers = table_dev_;
  k.state = state_;
  k.err = err_dev_;
  k.placement = placement_;
  return k;
}

namespace {
void check_aligned(const void* p, const char* name) {
  PA2A_CHECK_ARG(reinterpret_cast<uintptr_t>(p) % 16 == 0, name,
                 " must be 16-byte aligned for vector stores, got address ", p);
}
}  // namespace

void CudaTransport::dispatch_send(CallTicket* ticket, uint32_t op, const void* x,
                                  int32_t num_tokens, const int32_t* topk_ids,
                                  const float* topk_weights, int32_t topk, int32_t* send_token,
                                  int32_t* send_count, cudaStream_t stream) {
  check_dispatch_args(x, num_tokens, topk);
  DeviceGuard guard(device_);
  const KernelContext k = context();
  ++host_seq_;
  last_ce_mask_ = 0;
  launch_begin_call(k, ticket, op, 0, false, stream);
  launch_dispatch_send(k, ticket, x, num_tokens, topk_ids, topk_weights, topk, qbuf_, send_token,
                       send_count, nullptr, 0, stream);
  check_launch("dispatch_send");
}

void CudaTransport::check_dispatch_args(const void* x, int32_t num_tokens, int32_t topk) const {
  require_open("dispatch_send");
  PA2A_CHECK_ARG(opened_, "dispatch_send before open_peers");
  PA2A_CHECK_ARG(placement_.num_experts > 0, "dispatch_send before set_placement");
  PA2A_CHECK_ARG(num_tokens >= 0 && num_tokens <= config_.max_tokens, "num_tokens must be in [0, ",
                 config_.max_tokens, "], got ", num_tokens);
  PA2A_CHECK_ARG(topk >= 0 && topk <= config_.num_topk, "topk must be in [0, ", config_.num_topk,
                 "], got ", topk);
  check_aligned(x, "x");
}

// ---- copy-engine path (normal mode) -------------------------------------------------------
void CudaTransport::ensure_copy_engine(bool need_pack) {
  const int32_t W = config_.world;
  // ce_ready_ is set last: a failure half way (out of memory) leaves what was made for
  // close() to free and makes the next call try again, never run with null streams.
  if (!ce_ready_) {
    if (ce_host_ == nullptr)
      PA2A_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&ce_host_), sizeof(CeHost),
                                    cudaHostAllocPortable));
    if (ce_counts_dev_ == nullptr)
      PA2A_CUDA_CHECK(cudaMalloc(&ce_counts_dev_, sizeof(int32_t) * W));
    if (ce_fork_ == nullptr)
      PA2A_CUDA_CHECK(cudaEventCreateWithFlags(&ce_fork_, cudaEventDisableTiming));
    ce_streams_.resize(W, nullptr);
    ce_join_.resize(W, nullptr);
    for (int32_t r = 0; r < W; ++r) {
      if (ce_streams_[r] == nullptr)
        PA2A_CUDA_CHECK(cudaStreamCreateWithFlags(&ce_streams_[r], cudaStreamNonBlocking));
      if (ce_join_[r] == nullptr)
        PA2A_CUDA_CHECK(cudaEventCreateWithFlags(&ce_join_[r], cudaEventDisableTiming));
    }
    ce_ready_ = true;
  }
  // Allocated on the first copy-engine dispatch, not at construction: prefill-sized
  // Buffers that never reach the threshold do not pay for it (world * max_tokens slots).
  if (need_pack && pack_ == nullptr)
    PA2A_CUDA_CHECK(
        cudaMalloc(&pack_, static_cast<size_t>(W) * config_.max_tokens * layout_.dispatch_slot));
}

// Copies the call's ticket (and the per-destination counts) to the host and waits for
// them. Refused inside a graph capture with a message instead of a capture error.
void CudaTransport::read_back(const CallTicket* ticket, bool counts, cudaStream_t stream) {
  PA2A_CUDA_CHECK(cudaMemcpyAsync(&ce_host_->ticket, ticket, sizeof(CallTicket),
                                  cudaMemcpyDeviceToHost, stream));
  if (counts)
    PA2A_CUDA_CHECK(cudaMemcpyAsync(ce_host_->counts, ce_counts_dev_,
                                    sizeof(int32_t) * config_.world, cudaMemcpyDeviceToHost,
                                    stream));
  PA2A_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void CudaTransport::push_copies(const std::vector<CeCopy>& copies, uint64_t mask,
                                const CallTicket& t, cudaStream_t stream) {
  last_ce_mask_ = mask;
  if (mask == 0) return;
  const KernelContext k = context();
  PA2A_CUDA_CHECK(cudaEventRecord(ce_fork_, stream));
  for (int32_t i = 0; i < config_.world; ++i) {
    const int32_t r = table_.order[i];
    if (!((mask >> r) & 1ull)) continue;
    const CeCopy& c = copies[r];
    cudaStream_t s = ce_streams_[r];
    PA2A_CUDA_CHECK(cudaStreamWaitEvent(s, ce_fork_, 0));
    // cudaMemcpyDefault: the target is a peer's device memory (IPC) or pinned host memory
    // mapped here; unified addressing tells the copy engine which.
    PA2A_CUDA_CHECK(
        cudaMemcpyAsync(table_.send_base[r] + c.dst_off, c.src, c.bytes, cudaMemcpyDefault, s));
    launch_publish_one(k, t.seq, t.op, r, c.count, s);
    check_launch("publish_one");
    PA2A_CUDA_CHECK(cudaEventRecord(ce_join_[r], s));
    PA2A_CUDA_CHECK(cudaStreamWaitEvent(stream, ce_join_[r], 0));
  }
}

namespace {
void refuse_capture(cudaStream_t stream, const char* what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
      status != cudaStreamCaptureStatusNone)
    PA2A_THROW(kValue, what,
               " through the copy engine synchronises the host and cannot be captured in a "
               "CUDA graph; capture low_latency_dispatch/low_latency_combine instead");
}
}  // namespace

void CudaTransport::dispatch_send_ce(CallTicket* ticket, uint32_t op, const void* x,
                                     int32_t num_tokens, const int32_t* topk_ids,
                                     const float* topk_weights, int32_t topk, int32_t* send_token,
                                     int32_t* send_count, uint64_t min_bytes, cudaStream_t stream) {
  check_dispatch_args(x, num_tokens, topk);
  DeviceGuard guard(device_);
  refuse_capture(stream, "dispatch");
  ensure_copy_engine(true);
  const KernelContext k = context();
  ++host_seq_;
  launch_begin_call(k, ticket, op, 0, false, stream);
  launch_count_destinations(k, topk_ids, num_tokens, topk, ce_counts_dev_, stream);
  check_launch("count_destinations");
  read_back(ticket, true, stream);
  const CallTicket t = ce_host_->ticket;
  const size_t slot = layout_.dispatch_slot;
  const int32_t W = config_.world, M = config_.max_tokens;
  std::vector<CeCopy> copies(W);
  uint64_t mask = 0;
  for (int32_t d = 0; d < W; ++d) {
    const int32_t n = ce_host_->counts[d];
    if (n <= 0 || static_cast<uint64_t>(n) * slot < min_bytes) continue;
    mask |= 1ull << d;
    copies[d].src = pack_ + static_cast<size_t>(d) * M * slot;
    copies[d].dst_off =
        layout_.dispatch_off + slot_offset(config_, static_cast<int>(t.parity), rank_, 0, slot);
    copies[d].bytes = static_cast<size_t>(n) * slot;
    copies[d].count = static_cast<uint32_t>(n);
  }
  launch_dispatch_send(k, ticket, x, num_tokens, topk_ids, topk_weights, topk, qbuf_, send_token,
                       send_count, pack_, mask, stream);
  check_launch("dispatch_send");
  push_copies(copies, mask, t, stream);
}

void CudaTransport::combine_send_ce(CallTicket* ticket, uint32_t op, const void* y,
                                    const int32_t* recv_count, const int64_t* row_base,
                                    const std::vector<int32_t>& counts,
                                    const std::vector<int64_t>& row_base_host, uint64_t min_bytes,
                                    cudaStream_t stream) {
  require_open("combine_send");
  PA2A_CHECK_ARG(opened_, "combine_send before open_peers");
  const int32_t W = config_.world;
  PA2A_CHECK_ARG(
      static_cast<int32_t>(counts.size()) == W && static_cast<int32_t>(row_base_host.size()) == W,
      "combine_send_ce: counts and row_base need world = ", W, " entries, got ", counts.size(),
      " and ", row_base_host.size());
  for (int32_t s = 0; s < W; ++s)
    PA2A_CHECK_ARG(counts[s] >= 0 && counts[s] <= config_.max_tokens && row_base_host[s] >= 0,
                   "combine_send_ce: counts[", s, "] = ", counts[s], " must be in [0, ",
                   config_.max_tokens, "] and row_base[", s, "] = ", row_base_host[s],
                   " non-negative");
  check_aligned(y, "y");
  const size_t slot = layout_.combine_slot;
  // A combine slot is exactly one row of y (hidden % 8 == 0), so rows copy as one block.
  PA2A_CHECK_ARG(slot == 2 * static_cast<size_t>(config_.hidden),
                 "combine slots must be one 16-bit row");
  DeviceGuard guard(device_);
  refuse_capture(stream, "combine");
  ensure_copy_engine(false);
  const KernelContext k = context();
  ++host_seq_;
  launch_begin_call(k, ticket, op, 1, false, stream);
  check_launch("begin_call");
  read_back(ticket, false, stream);
  const CallTicket t = ce_host_->ticket;
  std::vector<CeCopy> copies(W);
  uint64_t mask = 0;
  for (int32_t s = 0; s < W; ++s) {
    const int32_t n = counts[s];
    if (n <= 0 || static_cast<uint64_t>(n) * slot < min_bytes) continue;
    mask |= 1ull << s;
    copies[s].src = static_cast<const uint8_t*>(y) + static_cast<size_t>(row_base_host[s]) * slot;
    copies[s].dst_off =
        layout_.combine_off + slot_offset(config_, static_cast<int>(t.parity), rank_, 0, slot);
    copies[s].bytes = static_cast<size_t>(n) * slot;
    copies[s].count = static_cast<uint32_t>(n);
  }
  launch_combine_send(k, ticket, y, recv_count, row_base, nullptr, nullptr, nullptr, mask, stream);
  check_launch("combine_send");
  push_copies(copies, mask, t, stream);
}

void CudaTransport::abort(CallTicket* ticket, uint32_t op, int family, cudaStream_t stream) {
  require_open("abort");
  PA2A_CHECK_ARG(family == 0 || family == 1, "family must be 0 (dispatch) or 1 (combine)");
  DeviceGuard guard(device_);
  ++host_seq_;
  launch_begin_call(context(), ticket, op, family, true, stream);
  check_launch("abort");
}

void CudaTransport::wait_counts(const CallTicket* ticket, int32_t* counts, double timeout_s,
                                bool tolerate_aborts, cudaStream_t stream) {
  require_open("wait_counts");
  DeviceGuard guard(device_);
  launch_wait_counts(context(), ticket, counts, timeout_ns(timeout_s), tolerate_aborts, stream);
  check_launch("wait_counts");
}

void CudaTransport::unpack_rows(const CallTicket* ticket, bool wait, int32_t* counts,
                                const int64_t* row_base, void* x_out, uint8_t* fp8_out,
                                float* scales_out, int32_t* src_rank, int32_t* src_token,
                                int32_t* topk_ids, float* topk_weights, int32_t* expert_count,
                                double timeout_s, cudaStream_t stream) {
  require_open("unpack_rows");
  PA2A_CHECK_ARG(wait || row_base != nullptr, "unpack_rows without wait needs row_base");
  PA2A_CHECK_ARG(fp8_out == nullptr || config_.payload == Payload::kFP8,
                 "raw fp8 output needs payload='fp8'");
  PA2A_CHECK_ARG(fp8_out != nullptr || x_out != nullptr, "unpack_rows needs an output");
  check_aligned(fp8_out != nullptr ? static_cast<const void*>(fp8_out) : x_out, "x_out");
  DeviceGuard guard(device_);
  launch_unpack_rows(context(), ticket, wait, counts, row_base, x_out, fp8_out, scales_out,
                     src_rank, src_token, topk_ids, topk_weights, expert_count,
                     timeout_ns(timeout_s), stream);
  check_launch("unpack_rows");
}

void CudaTransport::unpack_expert_major(const CallTicket* ticket, int32_t* recv_count, void* x_out,
                                        uint8_t* fp8_out, float* scales_out, int32_t* expert_count,
                                        int32_t* src_info, int64_t* layout_range,
                                        int32_t* expert_pos, int32_t* row_experts,
                                        float* row_weights, double timeout_s, cudaStream_t stream) {
  require_open("unpack_expert_major");
  PA2A_CHECK_ARG(fp8_out == nullptr || config_.payload == Payload::kFP8,
                 "raw fp8 output needs payload='fp8'");
  PA2A_CHECK_ARG(fp8_out != nullptr || x_out != nullptr, "unpack_expert_major needs an output");
  check_aligned(fp8_out != nullptr ? static_cast<const void*>(fp8_out) : x_out, "x_out");
  DeviceGuard guard(device_);
  launch_unpack_expert_major(context(), ticket, recv_count, cnt_ws_, x_out, fp8_out, scales_out,
                             expert_count, src_info, layout_range, expert_pos, row_experts,
                             row_weights, timeout_ns(timeout_s), stream);
  check_launch("unpack_expert_major");
}

void CudaTransport::combine_send(CallTicket* ticket, uint32_t op, const void* y,
                                 const int32_t* recv_count, const int64_t* row_base,
                                 const int32_t* expert_pos, const int32_t* row_experts,
                                 const float* row_weights, cudaStream_t stream) {
  require_open("combine_send");
  PA2A_CHECK_ARG(opened_, "combine_send before open_peers");
  PA2A_CHECK_ARG(expert_pos == nullptr || (row_experts != nullptr && row_weights != nullptr),
                 "expert-major combine needs expert_pos, row_experts and row_weights");
  check_aligned(y, "y");
  DeviceGuard guard(device_);
  const KernelContext k = context();
  ++host_seq_;
  last_ce_mask_ = 0;
  launch_begin_call(k, ticket, op, 1, false, stream);
  launch_combine_send(k, ticket, y, recv_count, row_base, expert_pos, row_experts, row_weights, 0,
                      stream);
  check_launch("combine_send");
}

void CudaTransport::reduce_expert_major(const void* y, const int32_t* recv_count,
                                        const int32_t* expert_pos, const int32_t* row_experts,
                                        const float* row_weights, void* rows_out,
                                        cudaStream_t stream) {
  require_open("reduce_expert_major");
  check_aligned(y, "y");
  check_aligned(rows_out, "rows_out");
  DeviceGuard guard(device_);
  launch_reduce_rows(context(), y, recv_count, expert_pos, row_experts, row_weights, rows_out,
                     stream);
  check_launch("reduce_expert_major");
}

void CudaTransport::combine_recv(const CallTicket* ticket, const int32_t* send_token,
                                 const int32_t* send_count, int32_t num_tokens, void* out,
                                 double timeout_s, cudaStream_t stream) {
  require_open("combine_recv");
  PA2A_CHECK_ARG(num_tokens >= 0 && num_tokens <= config_.max_tokens, "num_tokens must be in [0, ",
                 config_.max_tokens, "], got ", num_tokens);
  check_aligned(out, "out");
  DeviceGuard guard(device_);
  launch_combine_recv(context(), ticket, send_token, send_count, num_tokens, out,
                      timeout_ns(timeout_s), stream);
  check_launch("combine_recv");
}

}  // namespace pa2a::cuda
