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
//   1. every rank constructs (allocates, loads every kernel, exports ipc_handle(), creates
//      its host segment; the space in /dev/shm is reserved first, so a small /dev/shm is
//      an error naming it, not a SIGBUS);
//   2. handles are exchanged through the process group; every rank calls open_peers()
//      (or, for W transports in one process, open_local() with the peers' own pointers);
//   3. probe_peers(): every pair writes a pattern into the receiver's header with the
//      protocol's own fence and release; "P2P supported" is not "P2P works";
//   4. after a barrier every rank calls unlink_own() (the shm name is no longer needed);
//   5. close, in two phases. close_imports(): wait for this rank's own work (its own
//      streams, never cudaDeviceSynchronize, which would also wait for NCCL's), write the
//      close mark into every peer's header, close the IPC mappings and unmap the peers'
//      host segments. free_own(timeout): wait until every peer's close mark is in this
//      rank's memory, then free it all. Freeing memory a peer still has mapped through IPC
//      is undefined behaviour (CUDA documentation), so when the marks do not all arrive
//      (a peer died, or the interpreter is exiting without a collective close) the device
//      segment is left allocated (own_leaked()): the process exit returns it.
//
// Normal (prefill) mode has two send paths. dispatch_send/combine_send store rows with
// warps straight into the receivers' segments (as low-latency mode does). The *_ce
// variants first learn the rows per destination on the host (one stream synchronise:
// normal mode synchronises anyway, for the counts the receiver needs), then move every
// pair with at least `min_bytes` of rows by cudaMemcpyAsync: the rows of such a pair are
// packed locally in the exact slot bytes (HBM speed; combine rows are already contiguous),
// copied with one transfer on a stream of that destination (destinations issued in the
// planner's order, so copies to different ranks overlap on the copy engines), and followed
// on that stream by the pair's flag: a stream memory operation (cuStreamWriteValue, whose
// default carries a system-wide memory barrier) or, where the driver has none, a one-thread
// kernel that fences and release-stores it. Why not a kernel always: the CUDA memory model
// promises nothing about when a copy engine's writes become visible to a third agent
// relative to a later kernel's store; the stream memory operation's barrier is specified
// to order the stream's earlier work before the write. Smaller pairs keep the warp stores.
// The receive side is the same for both (flags and slots are identical bytes).
//
// Errors: CUDA API failures throw pa2a::Error(kRuntime) naming the call; kernel-detected
// problems land in the host-mapped error word and check() throws them (kTimeout, kAborted,
// kPeer, kValue for this rank's bad ids) naming the peer, the call number and the op.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/wire_format.h"
#include "cuda/transport/kernels.cuh"

namespace pa2a::cuda {

// What the host learns about a device before it uses it (Python turns it into clear
// errors: compute mode, host registration, the driver floor).
struct DeviceReport {
  int compute_mode = 0;     // cudaComputeMode: 0 default, 2 prohibited, 3 exclusive process
  int host_register = 0;    // cudaDevAttrHostRegisterSupported
  int multiprocessors = 0;  // SMs
  int cc_major = 0, cc_minor = 0;
  int driver_version = 0;   // cudaDriverGetVersion (the CUDA version the driver supports)
  int runtime_version = 0;  // CUDART_VERSION of this build (static cudart)
};

// What the send kernels counted (DeviceState statistics), for Buffer.stats().
struct TransportStats {
  uint64_t calls = 0;
  uint32_t last_family = 0;
  std::vector<uint32_t> last_rows;
  std::vector<uint64_t> total_rows[2];
};

class CudaTransport {
 public:
  // host_numa_node: node of the host segment (-1: unbound, first touch). need_host_region:
  // some peer sends to this rank staged (the caller knows the whole plan).
  // max_recv_blocks: cap of every receive grid (0: the device's number of SMs), so that two
  // Buffers on two streams cannot starve each other's send kernels. pdl: programmatic
  // dependent launch where the device has it (sm_90+). with_pull: some pair of the group
  // pulls (the same on every rank: the segment then has the pull slots and consumed lines
  // of core/wire_format.h); send_timeout_s: deadline of a send kernel's consumed wait.
  CudaTransport(std::string prefix, int32_t rank, const WireConfig& config, int32_t device,
                int32_t num_local_experts, bool need_host_region, int32_t host_numa_node,
                int32_t max_recv_blocks = 0, bool pdl = true, bool with_pull = false,
                double send_timeout_s = 30.0);
  ~CudaTransport();
  CudaTransport(const CudaTransport&) = delete;
  CudaTransport& operator=(const CudaTransport&) = delete;

  static std::string segment_name(const std::string& prefix, int32_t rank);
  static bool unlink_name(const std::string& name);
  static DeviceReport device_report(int32_t device);

  std::string ipc_handle() const;  // 64 bytes (cudaIpcMemHandle_t)

  // handles[r]: rank r's ipc_handle(); send_transport[d]: how this rank reaches d
  // (PairTransport: kPull means d reads this rank's rows from its segment);
  // recv_transport[s]: how s reaches this rank (kPull: this rank reads s's segment, which it
  // opens through IPC whatever its own direction to s); order: destinations in
  // the planner's send order (a permutation of 0..world-1); nonce: the same on every rank
  // of this bootstrap (the probe pattern and the close mark).
  void open_peers(const std::vector<std::string>& handles,
                  const std::vector<int32_t>& send_transport,
                  const std::vector<int32_t>& recv_transport, const std::vector<int32_t>& order,
                  uint64_t nonce);
  // The same for W transports of one process (peers[r]: rank r's transport, on this
  // device): the tables take the peers' own pointers, no IPC.
  void open_local(const std::vector<CudaTransport*>& peers,
                  const std::vector<int32_t>& send_transport,
                  const std::vector<int32_t>& recv_transport, const std::vector<int32_t>& order,
                  uint64_t nonce);
  // Every rank at once: status[s] for each source (0 ok, 1 nothing arrived within
  // timeout_s, 2 wrong bytes). Synchronises this transport's own stream.
  std::vector<int32_t> probe_peers(double timeout_s);
  // choice_offset/choice: this rank's row of the replica choice table, or empty (routing.h).
  void set_placement(const std::vector<int32_t>& offset, const std::vector<int32_t>& rank,
                     const std::vector<int32_t>& local,
                     const std::vector<int32_t>& choice_offset = {},
                     const std::vector<int32_t>& choice = {});
  void unlink_own();
  void close_imports();
  // true: every peer's close mark arrived within timeout_s (0: look once) and all memory
  // is free; false: the device segment is left allocated (own_leaked()).
  bool free_own(double timeout_s);
  void close();  // close_imports() + free_own(0): the destructor's non-collective close
  bool own_leaked() const { return own_leaked_; }

  // Raises the problem recorded by a kernel, if any. Aborts and bad ids are cleared once
  // reported (the Buffer stays usable); other errors stay: the transport is broken.
  void check();
  uint64_t error_word() const;
  TransportStats stats();  // waits for this transport's last call

  // ---- calls (all enqueue on `stream`, none synchronises) ------------------------------
  // ticket: a device CallTicket (16 bytes) owned by the caller, one per call in flight;
  // the send kernel writes it. topk_ids int32 or int64 (ids64).
  void dispatch_send(CallTicket* ticket, uint32_t op, const void* x, int32_t num_tokens,
                     const void* topk_ids, bool ids64, const float* topk_weights, int32_t topk,
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
                        const void* topk_ids, bool ids64, const float* topk_weights, int32_t topk,
                        int32_t* send_token, int32_t* send_count, uint64_t min_bytes,
                        cudaStream_t stream);
  void combine_send_ce(CallTicket* ticket, uint32_t op, const void* y, const int32_t* recv_count,
                       const int64_t* row_base, const std::vector<int32_t>& counts,
                       const std::vector<int64_t>& row_base_host, uint64_t min_bytes,
                       cudaStream_t stream);
  // Ranks (bit r) the last *_ce call served with the copy engine (tests, stats).
  uint64_t last_ce_mask() const { return last_ce_mask_; }
  // How the copy-engine path publishes flags: "stream_memop" (cuStreamWriteValue) or
  // "kernel" (publish_one), "" before the first copy-engine call.
  const char* ce_flag_path() const;
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
  int32_t max_recv_blocks() const { return max_recv_blocks_; }
  bool pdl() const { return pdl_; }
  bool with_pull() const { return with_pull_; }
  // Bit d: d pulls this rank's rows (send); bit s: this rank pulls from s (receive).
  uint64_t pull_send_mask() const { return table_.pull_send; }
  uint64_t pull_recv_mask() const { return table_.pull_recv; }

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
  using WriteValue32 = int (*)(cudaStream_t, unsigned long long, unsigned, unsigned);
  using WriteValue64 = int (*)(cudaStream_t, unsigned long long, unsigned long long, unsigned);

  KernelContext context() const;
  void require_open(const char* what) const;
  void* map_host_segment(int32_t r, bool create);
  void* open_ipc(int32_t r, const std::string& handle);
  void check_dispatch_args(const void* x, int32_t num_tokens, int32_t topk) const;
  void set_table(const std::vector<int32_t>& send_transport,
                 const std::vector<int32_t>& recv_transport, const std::vector<int32_t>& order,
                 uint64_t nonce);
  void ensure_copy_engine(bool need_pack);
  void read_back(const CallTicket* ticket, bool counts, cudaStream_t stream);
  void push_copies(const std::vector<CeCopy>& copies, uint64_t mask, const CallTicket& t,
                   cudaStream_t stream);
  void publish_ce_flag(int32_t dest, const CallTicket& t, uint32_t count, cudaStream_t s);
  void mark_done(cudaStream_t stream);  // records done_ after a call (not while capturing)
  void wait_own_work();
  bool close_marks_arrived(std::vector<int32_t>* missing);
  void free_everything_but_segment();

  std::string prefix_;
  int32_t rank_;
  WireConfig config_;
  int32_t device_;
  int32_t num_local_experts_;
  int32_t host_numa_node_;
  int32_t max_recv_blocks_ = 1;
  bool pdl_ = false;
  bool with_pull_ = false;
  uint64_t send_timeout_ns_ = 0;
  SegmentLayout layout_;
  SlotLayout slot_;
  bool opened_ = false;
  bool imports_closed_ = false;
  bool closed_ = false;
  bool own_leaked_ = false;
  mutable bool exported_ = false;  // the IPC handle (or, in one process, the pointer) is out
  uint64_t nonce_ = 0;
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
  int32_t* cnt_ws_ = nullptr;     // expert-major [E_local, world] counts
  int32_t* ecount_ws_ = nullptr;  // [E_local] expert counts of the running unpack
  int32_t* probe_status_ = nullptr;
  cudaStream_t aux_ = nullptr;  // this transport's own stream (probe, close, stats)
  cudaEvent_t done_ = nullptr;  // recorded after every call issued outside a capture
  bool done_recorded_ = false;

  // Copy-engine path, allocated on first use.
  uint8_t* pack_ = nullptr;               // [world * max_tokens] dispatch slots
  int32_t* ce_counts_dev_ = nullptr;      // [world] rows per destination
  CeHost* ce_host_ = nullptr;             // pinned
  std::vector<cudaStream_t> ce_streams_;  // one per destination rank
  std::vector<cudaEvent_t> ce_join_;      // recorded after each destination's flag
  cudaEvent_t ce_fork_ = nullptr;         // recorded on the caller's stream before the copies
  bool ce_ready_ = false;                 // every resource above (but pack_) exists
  uint64_t last_ce_mask_ = 0;
  WriteValue32 write32_ = nullptr;  // cuStreamWriteValue32/64 (driver entry points)
  WriteValue64 write64_ = nullptr;
  int ce_flag_path_ = 0;  // 0 unknown, 1 stream memop, 2 kernel
};

}  // namespace pa2a::cuda
