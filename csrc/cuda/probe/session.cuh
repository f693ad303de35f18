// The calibration probe's host side: every GPU of the machine in one process (as
// p2pBandwidthLatencyTest runs), peer access enabled where CUDA allows it, and the ways a
// row can move between two GPUs: kernel stores (push), kernel loads (pull), the copy engine
// driven from either side, and host staging through pinned memory on the receiver's NUMA
// node. pcie_a2a/topology/probe_run.py drives it through the _probe binding.
//
// Memory per device: a send region (the source of every flow leaving the device), a
// receive region with one slot per source device plus a guard (so concurrent flows never
// share bytes and an overrun shows), one host staging slot on its NUMA node (staged flows
// in one measurement have distinct receivers), a pointer-chase ring, one ping-pong flag per
// peer (written only by that peer), and the flow table and timers of its kernel. All of it
// is allocated at construction and freed by close(); nothing is allocated per measurement.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/numa_memory.h"
#include "cuda/probe/kernels.cuh"

namespace pa2a::probe {

enum class Mode : int { kStore = 0, kLoad = 1, kCe = 2, kCeRead = 3, kStaged = 4 };

struct Identity {
  std::string bus_id, uuid, name;
};

struct Mismatch {
  int64_t offset = -1;  // -1: every byte right
  int got = 0, expected = 0;
};

constexpr size_t kGuardBytes = 256;
constexpr uint32_t kRingWords = 1u << 18;  // 1 MiB of chase ring
constexpr uint64_t kTimeoutNs = 10'000'000'000ull;

class Session {
 public:
  // `devices`: CUDA device indices; `slot_bytes`: the largest transfer; `staging_numa`: the
  // NUMA node of each device's host staging slot (-1 or missing: first touch).
  Session(std::vector<int> devices, size_t slot_bytes, std::vector<int> staging_numa);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int size() const { return static_cast<int>(devs_.size()); }
  std::vector<Identity> identities() const;
  bool can_access(int src, int dst) const;

  // Moves the pattern of `seed` (nbytes) from src to dst by `mode` and compares every byte,
  // and the guard after it, on the host.
  Mismatch known_answer(int src, int dst, Mode mode, size_t nbytes, uint32_t seed);

  // The same for flows run together; source s sends the pattern of seed + s. One result
  // per flow, in order.
  std::vector<Mismatch> known_answer_flows(const std::vector<std::pair<int, int>>& flows, Mode mode,
                                           size_t nbytes, uint32_t seed);

  // Starts every flow together (nbytes each) and returns each flow's seconds.
  std::vector<double> run_flows(const std::vector<std::pair<int, int>>& flows, Mode mode,
                                size_t nbytes);

  // One-way latency: kStore flag ping-pong / 2, kLoad one dependent load, kCe / kStaged an
  // 8-byte copy from the host's clock.
  double latency_us(int src, int dst, Mode mode, int iters);

  void close();

 private:
  struct Dev {
    int id = 0;
    int sms = 1;
    unsigned char* send = nullptr;
    unsigned char* recv = nullptr;  // size() slots of stride_ bytes
    std::unique_ptr<NumaBuffer> host;
    bool host_registered = false;
    uint32_t* ring = nullptr;
    uint64_t* flags = nullptr;  // [peer]: written by that peer
    uint64_t* scratch = nullptr;
    FlowDesc* flow_table = nullptr;
    uint64_t* times = nullptr;
    uint32_t* error = nullptr;
    std::vector<cudaStream_t> streams;
    std::vector<cudaEvent_t> events;  // 3 per stream
  };

  void check_pair(int src, int dst, const char* what) const;
  std::vector<Mismatch> check_flows(const std::vector<std::pair<int, int>>& flows, Mode mode,
                                    size_t nbytes, const std::vector<uint32_t>& seeds);
  void use(int d) const;
  unsigned char* recv_slot(int dst, int src) const;
  void sync_all();
  void clear_errors();
  std::vector<double> kernel_flows(const std::vector<std::pair<int, int>>& flows, Mode mode,
                                   size_t nbytes);
  std::vector<double> copy_flows(const std::vector<std::pair<int, int>>& flows, Mode mode,
                                 size_t nbytes);

  std::vector<Dev> devs_;
  std::vector<std::vector<bool>> peer_;  // [from][to]: peer access enabled
  size_t slot_ = 0, stride_ = 0;
  uint32_t* go_host_ = nullptr;  // the start gate, mapped pinned memory
  uint32_t* go_dev_ = nullptr;
  uint64_t pingpong_base_ = 0;
  bool closed_ = false;
};

}  // namespace pa2a::probe
