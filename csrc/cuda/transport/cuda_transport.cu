#include "cuda/transport/cuda_transport.cuh"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <thread>

#include "core/dispatch_layout.h"
#include "core/exception.h"
#include "core/numa_memory.h"
#include "cuda/common/cuda_check.cuh"
#include "cuda/common/ipc.cuh"

namespace pa2a::cuda {
namespace {

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
    case DeviceError::kBadInput:
      return "bad topk_ids";
    case DeviceError::kEarlyMismatch:
      return "early count line mismatch";
    case DeviceError::kNotConsumed:
      return "rows not consumed";
    default:
      return "unknown";
  }
}

int attribute(cudaDeviceAttr a, int device) {
  int v = 0;
  PA2A_CUDA_CHECK(cudaDeviceGetAttribute(&v, a, device));
  return v;
}

// The close mark a rank writes into its peers' headers (any value the bootstrap's ranks
// agree on and a fresh segment does not hold).
uint64_t close_mark(uint64_t nonce) {
  return (nonce ^ 0xc105ec105ec105ecull) | 1u;
}

}  // namespace

std::string CudaTransport::segment_name(const std::string& prefix, int32_t rank) {
  return "/" + prefix + ".h" + std::to_string(rank);
}

bool CudaTransport::unlink_name(const std::string& name) {
  return ::shm_unlink(name.c_str()) == 0;
}

DeviceReport CudaTransport::device_report(int32_t device) {
  DeviceReport r;
  r.runtime_version = CUDART_VERSION;
  (void)cudaDriverGetVersion(&r.driver_version);
  r.compute_mode = attribute(cudaDevAttrComputeMode, device);
  r.host_register = attribute(cudaDevAttrHostRegisterSupported, device);
  r.multiprocessors = attribute(cudaDevAttrMultiProcessorCount, device);
  r.cc_major = attribute(cudaDevAttrComputeCapabilityMajor, device);
  r.cc_minor = attribute(cudaDevAttrComputeCapabilityMinor, device);
  return r;
}

CudaTransport::CudaTransport(std::string prefix, int32_t rank, const WireConfig& config,
                             int32_t device, int32_t num_local_experts, bool need_host_region,
                             int32_t host_numa_node, int32_t max_recv_blocks, bool pdl,
                             bool with_pull, double send_timeout_s)
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
  // Send grids have ceil(max_tokens / 16) blocks in y (at most 65535).
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
  PA2A_CHECK_ARG(max_recv_blocks >= 0, "max_recv_blocks must be >= 0 (0: one per SM), got ",
                 max_recv_blocks);
  with_pull_ = with_pull;
  send_timeout_ns_ = timeout_ns(send_timeout_s);
  layout_ = segment_layout(c, with_pull);
  add_staged_progress(&layout_, c);  // host-staged pairs' per-chunk progress (both segments)
  slot_ = dispatch_slot_layout(c);
  ipc_opened_.assign(c.world, nullptr);
  host_maps_.assign(c.world, nullptr);

  DeviceGuard guard(device_);
  try {
    const DeviceReport dev = device_report(device_);
    max_recv_blocks_ = max_recv_blocks > 0 ? max_recv_blocks : dev.multiprocessors;
    if (max_recv_blocks_ < 1) max_recv_blocks_ = 1;
    pdl_ = pdl && dev.cc_major >= 9;
    // Every kernel now: lazy loading in the middle of a call, next to peers' kernels that
    // spin on this GPU, can stall until their deadlines.
    load_transport_kernels();
    PA2A_CUDA_CHECK(cudaStreamCreateWithFlags(&aux_, cudaStreamNonBlocking));
    PA2A_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
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
    const size_t e = static_cast<size_t>(num_local_experts > 0 ? num_local_experts : 1);
    PA2A_CUDA_CHECK(cudaMalloc(&cnt_ws_, e * c.world * sizeof(int32_t)));
    PA2A_CUDA_CHECK(cudaMalloc(&ecount_ws_, e * sizeof(int32_t)));
    PA2A_CUDA_CHECK(cudaMemset(ecount_ws_, 0, e * sizeof(int32_t)));
    PA2A_CUDA_CHECK(cudaMalloc(&probe_status_, sizeof(int32_t) * c.world));
    if (need_host_region) {
      if (!dev.host_register)
        PA2A_THROW(kRuntime, "rank ", rank_, ": GPU ", device_,
                   " cannot register host memory (cudaDevAttrHostRegisterSupported = 0), which "
                   "the host-staged pairs of this plan need; use a plan with P2P for those "
                   "pairs or a GPU/driver that supports cudaHostRegister");
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
  if (!create && attribute(cudaDevAttrHostRegisterSupported, device_) == 0)
    PA2A_THROW(kRuntime, "rank ", rank_, ": GPU ", device_,
               " cannot register host memory (cudaDevAttrHostRegisterSupported = 0), which "
               "sending to rank ",
               r, " through host staging needs");
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
  if (p == MAP_FAILED) {
    ::close(fd);
    PA2A_THROW(kRuntime, "mmap of ", name, " (", layout_.total,
               " bytes) failed: ", std::strerror(err));
  }
  if (create) {
    // The receiver's node: the far leg of a staged transfer is then the sender's posted
    // write, and the receiving GPU's reads (flags, rows) stay on its own socket. The space
    // in /dev/shm is reserved after the bind, before the touch: a /dev/shm too small is an
    // error naming it (and --shm-size), never a SIGBUS at the touch.
    try {
      const NumaBindResult nb =
          numa_bind_reserve_and_touch(p, layout_.total, host_numa_node_, fd, name, config_.world);
      numa_warning_ = nb.warning;
    } catch (...) {
      ::close(fd);
      ::munmap(p, layout_.total);
      throw;
    }
  }
  ::close(fd);
  const cudaError_t reg =
      cudaHostRegister(p, layout_.total, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (reg != cudaSuccess) {
    (void)cudaGetLastError();
    ::munmap(p, layout_.total);
    PA2A_THROW(kRuntime, "cudaHostRegister of ", name, " (", layout_.total,
               " bytes) failed: ", cudaGetErrorName(reg), ": ", cudaGetErrorString(reg),
               " (ulimit -l too low for pinned memory?)");
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
  exported_ = true;  // a peer may map the segment from now on (see free_own)
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

// Checks the plan and the order; fills what open_peers and open_local share.
void CudaTransport::set_table(const std::vector<int32_t>& send_transport,
                              const std::vector<int32_t>& recv_transport,
                              const std::vector<int32_t>& order, uint64_t nonce) {
  require_open("open_peers");
  const int32_t W = config_.world;
  PA2A_CHECK_ARG(!opened_, "open_peers was already called");
  PA2A_CHECK_ARG(static_cast<int32_t>(send_transport.size()) == W &&
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
  table_.staged_send = table_.staged_recv = table_.pull_send = table_.pull_recv = 0;
  for (int32_t r = 0; r < W; ++r) {
    const auto st = static_cast<PairTransport>(send_transport[r]);
    const auto rt = static_cast<PairTransport>(recv_transport[r]);
    PA2A_CHECK_ARG(send_transport[r] >= 0 && send_transport[r] <= 2, "send_transport[", r,
                   "] must be 0 (p2p push), 1 (staged) or 2 (p2p pull), got ", send_transport[r]);
    PA2A_CHECK_ARG(recv_transport[r] >= 0 && recv_transport[r] <= 2, "recv_transport[", r,
                   "] must be 0 (p2p push), 1 (staged) or 2 (p2p pull), got ", recv_transport[r]);
    const bool pull = st == PairTransport::kPull || rt == PairTransport::kPull;
    PA2A_CHECK_ARG(!pull || r != rank_, "rank ", rank_,
                   " cannot pull from itself (the diagonal "
                   "pair is push)");
    PA2A_CHECK_ARG(!pull || with_pull_, "pair (", rank_, ", ", r,
                   ") pulls but this transport "
                   "was built with with_pull = false (no pull slots in its segment)");
    if (r == rank_) continue;  // our own rows never leave the device
    if (st == PairTransport::kPull) table_.pull_send |= 1ull << r;
    if (rt == PairTransport::kPull) table_.pull_recv |= 1ull << r;
    if (st == PairTransport::kStaged) table_.staged_send |= 1ull << r;
    if (rt == PairTransport::kStaged) {
      PA2A_CHECK_ARG(host_seg_dev_ != nullptr, "rank ", r, " sends to rank ", rank_,
                     " through host memory but this rank was built without a host region");
      table_.staged_recv |= 1ull << r;
    }
  }
  for (int32_t r = 0; r < W; ++r) {
    const bool staged_in = (table_.staged_recv >> r) & 1ull;
    table_.recv_base[r] = r != rank_ && staged_in ? host_seg_dev_ : dev_seg_;
    if (r == rank_) table_.send_base[r] = table_.pull_base[r] = dev_seg_;
  }
  nonce_ = nonce;
}

void CudaTransport::open_peers(const std::vector<std::string>& handles,
                               const std::vector<int32_t>& send_transport,
                               const std::vector<int32_t>& recv_transport,
                               const std::vector<int32_t>& order, uint64_t nonce) {
  set_table(send_transport, recv_transport, order, nonce);
  const int32_t W = config_.world;
  PA2A_CHECK_ARG(static_cast<int32_t>(handles.size()) == W,
                 "open_peers: every list must have world = ", W, " entries");
  DeviceGuard guard(device_);
  for (int32_t r = 0; r < W; ++r) {
    if (r == rank_) continue;
    if (!((table_.staged_send >> r) & 1ull)) {
      table_.send_base[r] = static_cast<uint8_t*>(open_ipc(r, handles[r]));
    } else {
      host_maps_[r] = map_host_segment(r, false);
      void* d = nullptr;
      PA2A_CUDA_CHECK(cudaHostGetDevicePointer(&d, host_maps_[r], 0));
      table_.send_base[r] = static_cast<uint8_t*>(d);
    }
    if ((table_.pull_recv >> r) & 1ull)  // r's device segment, to read its pull slots
      table_.pull_base[r] = static_cast<uint8_t*>(open_ipc(r, handles[r]));
  }
  PA2A_CUDA_CHECK(cudaMemcpy(table_dev_, &table_, sizeof(table_), cudaMemcpyHostToDevice));
  opened_ = true;
}

// Rank r's device segment mapped here (once; closed by close_imports).
void* CudaTransport::open_ipc(int32_t r, const std::string& handle) {
  if (ipc_opened_[r] == nullptr)
    ipc_opened_[r] =
        open_ipc_handle(handle, rank_, r, "device segment",
                        "peer access unsupported? force host staging with PCIE_A2A_P2P=0");
  return ipc_opened_[r];
}

void CudaTransport::open_local(const std::vector<CudaTransport*>& peers,
                               const std::vector<int32_t>& send_transport,
                               const std::vector<int32_t>& recv_transport,
                               const std::vector<int32_t>& order, uint64_t nonce) {
  set_table(send_transport, recv_transport, order, nonce);
  const int32_t W = config_.world;
  PA2A_CHECK_ARG(static_cast<int32_t>(peers.size()) == W, "open_local: peers must have world = ", W,
                 " entries");
  for (int32_t r = 0; r < W; ++r) {
    const CudaTransport* p = peers[r];
    PA2A_CHECK_ARG(
        p != nullptr && p->rank_ == r && p->device_ == device_ && p->layout_.total == layout_.total,
        "open_local: peers[", r, "] must be rank ", r,
        "'s transport on the same device with the same configuration");
    if (r == rank_) continue;
    peers[r]->exported_ = true;  // this rank writes into it from now on
    table_.pull_base[r] = p->dev_seg_;
    if ((table_.staged_send >> r) & 1ull) {
      PA2A_CHECK_ARG(p->host_seg_dev_ != nullptr, "open_local: rank ", r,
                     " has no host region but rank ", rank_, " sends to it staged");
      table_.send_base[r] = p->host_seg_dev_;
    } else {
      table_.send_base[r] = p->dev_seg_;
    }
  }
  DeviceGuard guard(device_);
  PA2A_CUDA_CHECK(cudaMemcpy(table_dev_, &table_, sizeof(table_), cudaMemcpyHostToDevice));
  opened_ = true;
}

std::vector<int32_t> CudaTransport::probe_peers(double timeout_s) {
  require_open("probe_peers");
  PA2A_CHECK_ARG(opened_, "probe_peers before open_peers");
  DeviceGuard guard(device_);
  const KernelContext k = context();
  launch_probe_send(k, nonce_, aux_);
  launch_probe_recv(k, nonce_, timeout_ns(timeout_s), probe_status_, aux_);
  check_launch("probe");
  std::vector<int32_t> status(config_.world, 0);
  PA2A_CUDA_CHECK(cudaMemcpyAsync(status.data(), probe_status_, sizeof(int32_t) * config_.world,
                                  cudaMemcpyDeviceToHost, aux_));
  PA2A_CUDA_CHECK(cudaStreamSynchronize(aux_));
  return status;
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
    wait_own_work();  // a running kernel may read the old map
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

// ---- close ---------------------------------------------------------------------------------
void CudaTransport::mark_done(cudaStream_t stream) {
  if (capturing(stream)) return;  // a captured call's work is its graph's (see close_imports)
  if (cudaEventRecord(done_, stream) == cudaSuccess) done_recorded_ = true;
  (void)cudaGetLastError();
}

// This transport's own work: the last call (all of a Buffer's calls are in one stream
// order, so its event covers the earlier ones), the copy-engine streams and the aux stream.
// Not cudaDeviceSynchronize: that also waits for unrelated streams (NCCL's, another
// Buffer's), and for kernels of other processes' peers that never finish without us.
void CudaTransport::wait_own_work() {
  if (done_recorded_) (void)cudaEventSynchronize(done_);
  for (cudaStream_t s : ce_streams_)
    if (s != nullptr) (void)cudaStreamSynchronize(s);
  if (aux_ != nullptr) (void)cudaStreamSynchronize(aux_);
  (void)cudaGetLastError();
}

void CudaTransport::close_imports() {
  if (imports_closed_) return;
  imports_closed_ = true;
  unlink_own();
  int prev = -1;
  (void)cudaGetDevice(&prev);
  (void)cudaSetDevice(device_);
  wait_own_work();
  if (opened_ && config_.world > 1) {  // after our last write: tell every peer we are done
    launch_close_mark(context(), close_mark(nonce_), aux_);
    (void)cudaStreamSynchronize(aux_);
  }
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
  (void)cudaGetLastError();
  if (prev >= 0 && prev != device_) (void)cudaSetDevice(prev);
}

// Whether every peer that writes into this rank's memory has written its close mark.
bool CudaTransport::close_marks_arrived(std::vector<int32_t>* missing) {
  const int32_t W = config_.world;
  missing->clear();
  if (W == 1 || dev_seg_ == nullptr || !exported_) return true;  // no peer can write here
  if (!opened_) {  // unknown who mapped us: assume every peer did
    for (int32_t s = 0; s < W; ++s)
      if (s != rank_) missing->push_back(s);
    return false;
  }
  std::vector<uint64_t> dev_lines(W, 0);
  // On this transport's own non-blocking stream: a plain cudaMemcpy would also wait for the
  // legacy default stream and every blocking stream (other work of this process).
  if (cudaMemcpyAsync(dev_lines.data(), dev_seg_ + kCloseLineOff, W * kCloseLineBytes,
                      cudaMemcpyDeviceToHost, aux_) != cudaSuccess ||
      cudaStreamSynchronize(aux_) != cudaSuccess) {
    (void)cudaGetLastError();
    for (int32_t s = 0; s < W; ++s)
      if (s != rank_) missing->push_back(s);
    return false;
  }
  const uint64_t mark = close_mark(nonce_);
  for (int32_t s = 0; s < W; ++s) {
    if (s == rank_) continue;
    uint64_t v = dev_lines[s];
    if ((table_.staged_recv >> s) & 1ull)
      v = __atomic_load_n(reinterpret_cast<const uint64_t*>(static_cast<uint8_t*>(host_seg_) +
                                                            kCloseLineOff + s * kCloseLineBytes),
                          __ATOMIC_ACQUIRE);
    if (v != mark) missing->push_back(s);
  }
  return missing->empty();
}

void CudaTransport::free_everything_but_segment() {
  if (host_seg_ != nullptr) {  // peers' mappings keep the pages: unmapping ours is safe
    (void)cudaHostUnregister(host_seg_);
    ::munmap(host_seg_, layout_.total);
    host_seg_ = nullptr;
    host_seg_dev_ = nullptr;
  }
  (void)cudaFree(state_);
  (void)cudaFree(table_dev_);
  (void)cudaFree(placement_dev_);
  (void)cudaFree(cnt_ws_);
  (void)cudaFree(ecount_ws_);
  (void)cudaFree(probe_status_);
  (void)cudaFree(pack_);
  (void)cudaFree(ce_counts_dev_);
  if (ce_host_ != nullptr) (void)cudaFreeHost(ce_host_);
  for (auto& e : ce_join_)
    if (e != nullptr) (void)cudaEventDestroy(e);
  for (auto& st : ce_streams_)
    if (st != nullptr) (void)cudaStreamDestroy(st);
  if (ce_fork_ != nullptr) (void)cudaEventDestroy(ce_fork_);
  if (done_ != nullptr) (void)cudaEventDestroy(done_);
  if (aux_ != nullptr) (void)cudaStreamDestroy(aux_);
  ce_join_.clear();
  ce_streams_.clear();
  pack_ = nullptr;
  ce_counts_dev_ = nullptr;
  ce_host_ = nullptr;
  ce_fork_ = nullptr;
  ce_ready_ = false;
  done_ = nullptr;
  aux_ = nullptr;
  if (err_host_ != nullptr) (void)cudaFreeHost(err_host_);
  state_ = nullptr;
  table_dev_ = nullptr;
  placement_dev_ = nullptr;
  cnt_ws_ = nullptr;
  ecount_ws_ = nullptr;
  probe_status_ = nullptr;
  err_host_ = err_dev_ = nullptr;
}

bool CudaTransport::free_own(double timeout_s) {
  if (closed_) return !own_leaked_;
  close_imports();
  closed_ = true;
  int prev = -1;
  (void)cudaGetDevice(&prev);
  (void)cudaSetDevice(device_);
  std::vector<int32_t> missing;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(timeout_s > 0 ? timeout_s : 0);
  bool all = close_marks_arrived(&missing);
  while (!all && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    all = close_marks_arrived(&missing);
  }
  free_everything_but_segment();
  if (all) {
    (void)cudaFree(dev_seg_);
  } else {
    own_leaked_ = true;  // a peer may still write into it: freeing it would be UB
  }
  dev_seg_ = nullptr;
  (void)cudaGetLastError();
  if (prev >= 0 && prev != device_) (void)cudaSetDevice(prev);
  return all;
}

void CudaTransport::close() {
  close_imports();
  free_own(0.0);
}

void CudaTransport::require_open(const char* what) const {
  if (imports_closed_) PA2A_THROW(kRuntime, "CUDA transport: ", what, " after close()");
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
    case DeviceError::kBadInput:
      *reinterpret_cast<volatile uint64_t*>(err_host_) = 0;
      PA2A_THROW(kValue, "topk_ids of ", op_name(op), " (call ", seq, ") on rank ", rank_,
                 " held an expert id outside [-1, ", placement_.num_experts,
                 ") or an expert listed twice for one token; allowed: -1 (no expert) or an id "
                 "in range, each at most once per token. The GPU checks ids without a host "
                 "synchronisation, so this is raised at the next call: those entries were "
                 "skipped (not sent)");
    case DeviceError::kNotConsumed:
      PA2A_THROW(kTimeout, "rank ", rank_, " timed out on the GPU in ", op_name(op), " (call ", seq,
                 ") waiting for rank ", peer,
                 " to consume (pull) the rows of the call that last used this slot parity: that "
                 "rank is behind by more than one call, stuck, or exited");
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
    case DeviceError::kEarlyMismatch:
      PA2A_THROW(kPeer, "rank ", peer, "'s early count line of ", op_name(op), " (call ", seq,
                 ") disagrees with the rows or the flag it sent to rank ", rank_,
                 " (host-staged pair)");
    default:
      PA2A_THROW(kRuntime, "CUDA transport: unknown error word 0x", std::hex, w, " (",
                 error_name(code), ")");
  }
}

TransportStats CudaTransport::stats() {
  require_open("stats");
  DeviceGuard guard(device_);
  wait_own_work();
  DeviceState st{};
  PA2A_CUDA_CHECK(cudaMemcpyAsync(&st, state_, sizeof(st), cudaMemcpyDeviceToHost, aux_));
  PA2A_CUDA_CHECK(cudaStreamSynchronize(aux_));
  TransportStats r;
  r.calls = st.stat_calls;
  r.last_family = st.stat_last_family;
  const int32_t W = config_.world;
  r.last_rows.assign(st.stat_last_rows, st.stat_last_rows + W);
  for (int f = 0; f < 2; ++f)
    r.total_rows[f].assign(st.stat_total_rows[f], st.stat_total_rows[f] + W);
  return r;
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
  k.err = ErrorSink{err_dev_, state_ == nullptr ? nullptr : &state_->timed_out};
  k.placement = placement_;
  k.ecount = ecount_ws_;
  k.cnt_ws = cnt_ws_;
  k.max_recv_blocks = static_cast<uint32_t>(max_recv_blocks_);
  k.pdl = pdl_;
  k.send_timeout_ns = send_timeout_ns_;
  return k;
}

namespace {
void check_aligned(const void* p, size_t align, const char* name) {
  PA2A_CHECK_ARG(reinterpret_cast<uintptr_t>(p) % align == 0, name, " must be ", align,
                 "-byte aligned, got address ", p);
}
}  // namespace

void CudaTransport::dispatch_send(CallTicket* ticket, uint32_t op, const void* x,
                                  int32_t num_tokens, const void* topk_ids, bool ids64,
                                  const float* topk_weights, int32_t topk, int32_t* send_token,
                                  int32_t* send_count, cudaStream_t stream) {
  check_dispatch_args(x, num_tokens, topk);
  check_aligned(topk_ids, ids64 ? 8 : 4, "topk_ids");
  DeviceGuard guard(device_);
  const KernelContext k = context();
  ++host_seq_;
  last_ce_mask_ = 0;
  launch_dispatch_send(k, ticket, true, op, x, num_tokens, topk_ids, ids64, topk_weights, topk,
                       send_token, send_count, nullptr, 0, stream);
  check_launch("dispatch_send");
  mark_done(stream);
}

void CudaTransport::check_dispatch_args(const void* x, int32_t num_tokens, int32_t topk) const {
  require_open("dispatch_send");
  PA2A_CHECK_ARG(opened_, "dispatch_send before open_peers");
  PA2A_CHECK_ARG(placement_.num_experts > 0, "dispatch_send before set_placement");
  PA2A_CHECK_ARG(num_tokens >= 0 && num_tokens <= config_.max_tokens, "num_tokens must be in [0, ",
                 config_.max_tokens, "], got ", num_tokens);
  PA2A_CHECK_ARG(topk >= 0 && topk <= config_.num_topk, "topk must be in [0, ", config_.num_topk,
                 "], got ", topk);
  check_aligned(x, 16, "x (vector loads)");
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
    // The flag after a copy: a stream memory operation where the driver has it (through
    // its entry point, so the module needs no -lcuda link).
    if (ce_flag_path_ == 0) {
      void* f32 = nullptr;
      void* f64 = nullptr;
      cudaDriverEntryPointQueryResult q32{}, q64{};
      const bool ok = cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &f32, 12000,
                                                       cudaEnableDefault, &q32) == cudaSuccess &&
                      cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &f64, 12000,
                                                       cudaEnableDefault, &q64) == cudaSuccess &&
                      q32 == cudaDriverEntryPointSuccess && q64 == cudaDriverEntryPointSuccess &&
                      f32 && f64;
      (void)cudaGetLastError();
      write32_ = ok ? reinterpret_cast<WriteValue32>(f32) : nullptr;
      write64_ = ok ? reinterpret_cast<WriteValue64>(f64) : nullptr;
      ce_flag_path_ = ok ? 1 : 2;
    }
    ce_ready_ = true;
  }
  // Allocated on the first copy-engine dispatch, not at construction: prefill-sized
  // Buffers that never reach the threshold do not pay for it (world * max_tokens slots).
  if (need_pack && pack_ == nullptr)
    PA2A_CUDA_CHECK(
        cudaMalloc(&pack_, static_cast<size_t>(W) * config_.max_tokens * layout_.dispatch_slot));
}

const char* CudaTransport::ce_flag_path() const {
  return ce_flag_path_ == 1 ? "stream_memop" : (ce_flag_path_ == 2 ? "kernel" : "");
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

// After the copy on stream s: sig, then the word, each a stream memory operation whose
// default (no CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER) orders the stream's earlier work
// (the copy) before the write, system-wide. The kernel path is the fallback.
void CudaTransport::publish_ce_flag(int32_t dest, const CallTicket& t, uint32_t count,
                                    cudaStream_t s) {
  uint8_t* line = table_.send_base[dest] + kSegmentHeaderBytes +
                  flag_offset(config_, static_cast<int>(t.seq & 1u), rank_);
  const auto addr = reinterpret_cast<uintptr_t>(line);
  if (write64_ != nullptr && write32_(s, addr + offsetof(FlagLine, sig), t.op, 0) == 0 &&
      write64_(s, addr + offsetof(FlagLine, word), pack_flag(t.seq, count), 0) == 0)
    return;
  write32_ = nullptr;  // unsupported here (an old driver or device): the kernel from now on
  write64_ = nullptr;
  ce_flag_path_ = 2;
  launch_publish_one(context(), t.seq, t.op, dest, count, s);
  check_launch("publish_one");
}

void CudaTransport::push_copies(const std::vector<CeCopy>& copies, uint64_t mask,
                                const CallTicket& t, cudaStream_t stream) {
  last_ce_mask_ = mask;
  if (mask == 0) return;
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
    publish_ce_flag(r, t, c.count, s);
    PA2A_CUDA_CHECK(cudaEventRecord(ce_join_[r], s));
    PA2A_CUDA_CHECK(cudaStreamWaitEvent(stream, ce_join_[r], 0));
  }
}

namespace {
void refuse_capture(cudaStream_t stream, const char* what) {
  if (capturing(stream))
    PA2A_THROW(kValue, what,
               " through the copy engine synchronises the host and cannot be captured in a "
               "CUDA graph; capture low_latency_dispatch/low_latency_combine instead");
}
}  // namespace

void CudaTransport::dispatch_send_ce(CallTicket* ticket, uint32_t op, const void* x,
                                     int32_t num_tokens, const void* topk_ids, bool ids64,
                                     const float* topk_weights, int32_t topk, int32_t* send_token,
                                     int32_t* send_count, uint64_t min_bytes, cudaStream_t stream) {
  check_dispatch_args(x, num_tokens, topk);
  check_aligned(topk_ids, ids64 ? 8 : 4, "topk_ids");
  DeviceGuard guard(device_);
  refuse_capture(stream, "dispatch");
  ensure_copy_engine(true);
  const KernelContext k = context();
  ++host_seq_;
  launch_begin_call(k, ticket, op, 0, false, stream);
  launch_count_destinations(k, topk_ids, ids64, num_tokens, topk, ce_counts_dev_, stream);
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
    if ((table_.pull_send >> d) & 1ull) continue;  // d pulls: the rows stay here
    mask |= 1ull << d;
    copies[d].src = pack_ + static_cast<size_t>(d) * M * slot;
    copies[d].dst_off =
        layout_.dispatch_off + slot_offset(config_, static_cast<int>(t.parity), rank_, 0, slot);
    copies[d].bytes = static_cast<size_t>(n) * slot;
    copies[d].count = static_cast<uint32_t>(n);
  }
  launch_dispatch_send(k, ticket, false, op, x, num_tokens, topk_ids, ids64, topk_weights, topk,
                       send_token, send_count, pack_, mask, stream);
  check_launch("dispatch_send");
  push_copies(copies, mask, t, stream);
  mark_done(stream);
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
  check_aligned(y, 16, "y (vector loads)");
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
    if ((table_.pull_send >> s) & 1ull) continue;  // s pulls: the rows stay here
    mask |= 1ull << s;
    copies[s].src = static_cast<const uint8_t*>(y) + static_cast<size_t>(row_base_host[s]) * slot;
    copies[s].dst_off =
        layout_.combine_off + slot_offset(config_, static_cast<int>(t.parity), rank_, 0, slot);
    copies[s].bytes = static_cast<size_t>(n) * slot;
    copies[s].count = static_cast<uint32_t>(n);
  }
  launch_combine_send(k, ticket, false, op, y, recv_count, row_base, nullptr, nullptr, nullptr,
                      mask, stream);
  check_launch("combine_send");
  push_copies(copies, mask, t, stream);
  mark_done(stream);
}

void CudaTransport::abort(CallTicket* ticket, uint32_t op, int family, cudaStream_t stream) {
  require_open("abort");
  PA2A_CHECK_ARG(family == 0 || family == 1, "family must be 0 (dispatch) or 1 (combine)");
  DeviceGuard guard(device_);
  ++host_seq_;
  launch_begin_call(context(), ticket, op, family, true, stream);
  check_launch("abort");
  mark_done(stream);
}

void CudaTransport::wait_counts(const CallTicket* ticket, int32_t* counts, double timeout_s,
                                bool tolerate_aborts, cudaStream_t stream) {
  require_open("wait_counts");
  DeviceGuard guard(device_);
  launch_wait_counts(context(), ticket, counts, timeout_ns(timeout_s), tolerate_aborts, stream);
  check_launch("wait_counts");
  mark_done(stream);
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
  check_aligned(fp8_out != nullptr ? static_cast<const void*>(fp8_out) : x_out, 16,
                "x_out (vector stores)");
  DeviceGuard guard(device_);
  launch_unpack_rows(context(), ticket, wait, counts, row_base, x_out, fp8_out, scales_out,
                     src_rank, src_token, topk_ids, topk_weights, expert_count,
                     timeout_ns(timeout_s), stream);
  check_launch("unpack_rows");
  mark_done(stream);
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
  check_aligned(fp8_out != nullptr ? static_cast<const void*>(fp8_out) : x_out, 16,
                "x_out (vector stores)");
  DeviceGuard guard(device_);
  launch_unpack_expert_major(context(), ticket, recv_count, x_out, fp8_out, scales_out,
                             expert_count, src_info, layout_range, expert_pos, row_experts,
                             row_weights, timeout_ns(timeout_s), stream);
  check_launch("unpack_expert_major");
  mark_done(stream);
}

void CudaTransport::combine_send(CallTicket* ticket, uint32_t op, const void* y,
                                 const int32_t* recv_count, const int64_t* row_base,
                                 const int32_t* expert_pos, const int32_t* row_experts,
                                 const float* row_weights, cudaStream_t stream) {
  require_open("combine_send");
  PA2A_CHECK_ARG(opened_, "combine_send before open_peers");
  PA2A_CHECK_ARG(expert_pos == nullptr || (row_experts != nullptr && row_weights != nullptr),
                 "expert-major combine needs expert_pos, row_experts and row_weights");
  check_aligned(y, 16, "y (vector loads)");
  DeviceGuard guard(device_);
  const KernelContext k = context();
  ++host_seq_;
  last_ce_mask_ = 0;
  launch_combine_send(k, ticket, true, op, y, recv_count, row_base, expert_pos, row_experts,
                      row_weights, 0, stream);
  check_launch("combine_send");
  mark_done(stream);
}

void CudaTransport::reduce_expert_major(const void* y, const int32_t* recv_count,
                                        const int32_t* expert_pos, const int32_t* row_experts,
                                        const float* row_weights, void* rows_out,
                                        cudaStream_t stream) {
  require_open("reduce_expert_major");
  check_aligned(y, 16, "y (vector loads)");
  check_aligned(rows_out, 16, "rows_out (vector stores)");
  DeviceGuard guard(device_);
  launch_reduce_rows(context(), y, recv_count, expert_pos, row_experts, row_weights, rows_out,
                     stream);
  check_launch("reduce_expert_major");
  mark_done(stream);
}

void CudaTransport::combine_recv(const CallTicket* ticket, const int32_t* send_token,
                                 const int32_t* send_count, int32_t num_tokens, void* out,
                                 double timeout_s, cudaStream_t stream) {
  require_open("combine_recv");
  PA2A_CHECK_ARG(num_tokens >= 0 && num_tokens <= config_.max_tokens, "num_tokens must be in [0, ",
                 config_.max_tokens, "], got ", num_tokens);
  check_aligned(out, 16, "out (vector stores)");
  DeviceGuard guard(device_);
  launch_combine_recv(context(), ticket, send_token, send_count, num_tokens, out,
                      timeout_ns(timeout_s), stream);
  check_launch("combine_recv");
  mark_done(stream);
}

}  // namespace pa2a::cuda
