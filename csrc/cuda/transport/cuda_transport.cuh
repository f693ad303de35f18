// CUDA transport: each rank's receive segment (core/wire_format.h layout) in device memory,
// exported with CUDA IPC, plus — when some peer reaches this rank through the host — a
// second segment of the same layout in pinned host memory on this rank's NUMA node
// (POSIX shared memory, registered with cudaHostRegister in every process that maps it).
// Per ordered pair the planner (Python) chooses P2P (sender stores into the receiver's
// device segment through IPC) or staged (sender stores into the receiver's pinned host
// segment); pairs may mix within one call. The kernels and their invariants are in
// device_protocol.cuh and kernels.cuh.
//
// Lifetime (collective; Python drives it):
//   1. every rank constructs (allocates, exports ipc_handle(), creates its host segment);
//   2. handles are exchanged through the process group; every rank calls open_peers();
//   3. after a barrier every rank calls unlink_own() (the shm name is no longer needed);
//   4. close() (also run by the destructor) synchronises the device, closes IPC mappings,
//      unregisters and unmaps host segments, frees everything. Peers must have stopped
//      writing into this rank's memory first (Python barriers before close).
//
// Normal (prefill) mode has two send paths. dispatch_send/combine_send store rows with
// warps straight into the receivers' segments (as low-latency mode does). The *_ce
// variants first learn the rows per destination on the host (one stream synchronise:
// normal mode synchronises anyway, for the counts the receiver needs), then move every
// pair with at least `min_bytes` of rows by cudaMemcpyAsync: the rows of such a pair are
// packed locally in the exact slot bytes (HBM speed; combine rows are already contiguous),
// copied with one transfer on a stream of that destination (destinations issued in the
// planner's order, so copies to different ranks overlap on the copy engines), and followed
// on that stream by a one-thread kernel that release-stores the pair's flag. Smaller pairs
// keep the warp stores. Why both: a copy engine moves a large contiguous block at link
// speed without occupying SMs (prefill overlaps communication with expert GEMMs), but
// costs several microseconds per transfer; warps win for small pairs. The receive side
// is the same for both (flags and slots are identical bytes).
//
// Errors: CUDA API failures throw pa2a::Error(kRuntime) naming the call; kernel-detected
// problems land in the host-mapped error word and check() throws them (kTimeout, kAborted,
// kPeer) naming the peer, the call number and the op.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/wire_format.h"
#include "cuda/transport/kernels.cuh"

namespace pa2a::cuda {

class CudaTransport {
 public:
  // host_numa_node: node of the host segment (-1: unbound, first touch). need_host_region:
  // some peer sends to this rank staged (the caller knows the whole plan).
  CudaTransport(std::string prefix, int32_t rank, const WireConfig& config, int32_t device,
                int32_t num_local_experts, bool need_host_region, int32_t host_numa_node);
  ~CudaTransport();
  CudaTransport(const CudaTransport&) = delete;
  CudaTransport& operator=(const CudaTransport&) = delete;

  static std::string segment_name(const std::string& prefix, int32_t rank);
  static bool unlink_name(const std::string& name);

  std::string ipc_handle() const;  // 64 bytes (cudaIpcMemHandle_t)

  // handles[r]: rank r's ipc_handle(); send_transport[d]: how this rank reaches d
  // (PairTransport); recv_transport[s]: how s reaches this rank; order: destinations in
  // the planner's send order (a permutation of 0..world-1).
  void open_peers(const std::vector<std::string>& handles,
                  const std::vector<int32_t>& send_transport,
                  const std::vector<int32_t>& recv_transport, const std::vector<int32_t>& order);
  // choice_offset/choice: this rank's row of the replica choice table, or empty (routing.h).
  void set_placement(const std::vector<int32_t>& offset, const std::vector<int32_t>& rank,
                     const std::vector<int32_t>& local,
                     const std::vector<int32_t>& choice_offset = {},
                     const std::vector<int32_t>& choice = {});
  void unlink_own();
  void close();

  // Raises the problem recorded by a kernel, if any. Aborts are cleared once reported
  // (every rank skipped that call together); other errors stay: the transport is broken.
  void check();
  uint64_t error_word() const;

  // ---- calls (all enqueue on `stream`, none synchronises) ------------------------------
  // ticket: a device CallTicket (16 bytes) owned by the caller, one per call in flight.
  void dispatch_send(CallTicket* ticket, uint32_t op, const void* x, int32_t num_tokens,
                     const int32_t* topk_ids, const float* topk_weights, int32_t topk,
                     int32_t* send_token, int32_t* send_count, cudaStream_t stream);
  void abort(CallTicket* ticket, uint32_t op, int family, cudaStream_t stream);
  // tolerate_aborts: after this rank's own abort, only arrival matters (see wait_flag).
  void wait_counts(const CallTicket* ticket, int32_t* counts, double timeout_s,
                   bool tolerate_aborts, cudaStream_t stream);
  void unpack_rows(const CallTicket* ticket, bool wait, int32_t* counts, const int64_t* row_base,
                   void* x_out, uint8_t* fp8_out, float* scales_out, int32_t* src_rank,
                   int32_t* src_token, int32_t* topk_ids, float* topk_weights,
                   int32_t* expert_count, double timeout_s, cudaStream_t stream);
  void unpack_expert_major(const CallTicket* ticket, int32_t* recv_count, void* x_out,
                           uint8_t* fp8_out, float* scales_out, int32_t* expert_count,
                           int32_t* src_info, int64_t* layout_range, int32_t* expert_pos,
                           int32_t* row_experts, float* row_weights, double timeout_s,
                           cudaStream_t stream);
  void combine_send(CallTicket* ticket, uint32_t op, const void* y, const int32_t* recv_count,
                    const int64_t* row_base, const int32_t* expert_pos, const int32_t* row_experts,
                    const float* row_weights, cudaStream_t stream);

  // Normal mode through the copy engine for pairs of >= min_bytes (see the top comment).
  // Both synchronise `stream` once (never inside a CUDA graph capture: refused). The
  // combine takes the rows per source on the host too (counts, row_base_host), equal to
  // the device arrays the rows layout uses.
  void dispatch_send_ce(CallTicket* ticket, uint32_t op, const void* x, int32_t num_tokens,
                        const int32_t* topk_ids, const float* topk_weights, int32_t topk,
                        int32_t* send_token, int32_t* send_count, uint64_t min_bytes,
                        cudaStream_t stream);
  void combine_send_ce(CallTicket* ticket, uint32_t op, const void* y, const int32_t* recv_count,
                       const int64_t* row_base, const std::vector<int32_t>& counts,
                       const std::vector<int64_t>& row_base_host, uint64_t min_bytes,
                       cudaStream_t stream);
  // Ranks (bit r) the last *_ce call served with the copy engine (tests, stats).
  uint64_t last_ce_mask() const { return last_ce_mask_; }
  void reduce_expert_major(const void* y, const int32_t* recv_count, const int32_t* expert_pos,
                           const int32_t* row_experts, const float* row_weights, void* rows_out,
                           cudaStream_t stream);
  void combine_recv(const CallTicket* ticket, const int32_t* send_token, const int32_t* send_count,
                    int32_t num_tokens, void* out, double timeout_s, cudaStream_t stream);

  int32_t rank() const { return rank_; }
  int32_t device() const { return device_; }
  const WireConfig& config() const { return config_; }
  const SegmentLayout& layout() const { return layout_; }
  size_t segment_bytes() const { return layout_.total; }
  bool has_host_region() const { return host_seg_ != nullptr; }
  const std::string& numa_warning() const { return numa_warning_; }
  uint32_t host_seq() const { return host_seq_; }

 private:
  // One copy-engine transfer of the current call: src -> send_base[r] + dst_off.
  struct CeCopy {
    const void* src = nullptr;
    size_t dst_off = 0;
    size_t bytes = 0;
    uint32_t count = 0;
  };
  struct CeHost {  // pinned: what the host reads back before sizing the copies
    CallTicket ticket;
    int32_t counts[kMaxWorld];
  };

  KernelContext context() const;
  void require_open(const char* what) const;
  void* map_host_segment(int32_t r, bool create);
  void check_dispatch_args(const void* x, int32_t num_tokens, int32_t topk) const;
  void ensure_copy_engine(bool need_pack);
  void read_back(const CallTicket* ticket, bool counts, cudaStream_t stream);
  void push_copies(const std::vector<CeCopy>& copies, uint64_t mask, const CallTicket& t,
                   cudaStream_t stream);

  std::string prefix_;
  int32_t rank_;
  WireConfig config_;
  int32_t device_;
  int32_t num_local_experts_;
  int32_t host_numa_node_;
  SegmentLayout layout_;
  SlotLayout slot_;
  bool opened_ = false;
  bool closed_ = false;
  uint32_t host_seq_ = 0;  // calls begun from this host (messages only)
  std::string numa_warning_;

  uint8_t* dev_seg_ = nullptr;  // own device segment
  void* host_seg_ = nullptr;    // own host segment (mmap), if any
  uint8_t* host_seg_dev_ = nullptr;
  bool host_linked_ = false;
  std::vector<void*> ipc_opened_;  // peers' device segments opened through IPC
  std::vector<void*> host_maps_;   // peers' host segments mapped (and registered) here
  PeerTable table_{};
  PeerTable* table_dev_ = nullptr;
  DeviceState* state_ = nullptr;
  uint64_t* err_host_ = nullptr;
  uint64_t* err_dev_ = nullptr;
  int32_t* placement_dev_ = nullptr;  // offset | rank | local
  Placement placement_{};
  uint8_t* qbuf_ = nullptr;    // fp8 staging of the tokens being sent
  int32_t* cnt_ws_ = nullptr;  // expert-major [E_local, world] counts

  // Copy-engine path, allocated on first use.
  uint8_t* pack_ = nullptr;               // [world * max_tokens] dispatch slots
  int32_t* ce_counts_dev_ = nullptr;      // [world] rows per destination
  CeHost* ce_host_ = nullptr;             // pinned
  std::vector<cudaStream_t> ce_streams_;  // one per destination rank
  std::vector<cudaEvent_t> ce_join_;      // recorded after each destination's flag
  cudaEvent_t ce_fork_ = nullptr;         // recorded on the caller's stream before the copies
  bool ce_ready_ = false;                 // every resource above (but pack_) exists
  uint64_t last_ce_mask_ = 0;
};

}  // namespace pa2a::cuda
