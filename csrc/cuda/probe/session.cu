// The probe's host side (see session.cuh for the memory layout).
#include "cuda/probe/session.cuh"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/exception.h"
#include "cuda/probe/kernels.cuh"
#include "cuda/probe/pattern.h"
#include "cuda/probe/runtime.cuh"

namespace pa2a::probe {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    PA2A_THROW(kRuntime, "probe: ", what, " failed: ", cudaGetErrorName(e), ": ",
               cudaGetErrorString(e));
  }
}

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kStore:
      return "store";
    case Mode::kLoad:
      return "load";
    case Mode::kCe:
      return "ce";
    case Mode::kCeRead:
      return "ce_read";
    case Mode::kStaged:
      return "staged";
  }
  return "?";
}

bool kernel_mode(Mode m) {
  return m == Mode::kStore || m == Mode::kLoad;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Session::Session(std::vector<int> devices, size_t slot_bytes, std::vector<int> staging_numa) {
  PA2A_CHECK_ARG(devices.size() >= 2, "probe: devices: got ", devices.size(),
                 ", expected at least 2 CUDA devices");
  PA2A_CHECK_ARG(slot_bytes >= 16, "probe: slot_bytes: got ", slot_bytes, ", expected >= 16");
  int count = 0;
  check(rt::device_count(&count), "cudaGetDeviceCount");
  for (int d : devices) {
    PA2A_CHECK_ARG(d >= 0 && d < count, "probe: device ", d, " does not exist (", count,
                   " visible)");
  }
  slot_ = slot_bytes;
  stride_ = align_up(slot_bytes + kGuardBytes, 256);
  const int n = static_cast<int>(devices.size());
  devs_.resize(devices.size());
  peer_.assign(devices.size(), std::vector<bool>(devices.size(), false));
  try {
    check(cudaHostAlloc(&go_host_, sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable),
          "cudaHostAlloc of the start gate");
    rt::close_gate(go_host_);
    check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&go_dev_), go_host_, 0),
          "cudaHostGetDevicePointer of the start gate");
    for (int k = 0; k < n; ++k) {
      Dev& dv = devs_[static_cast<size_t>(k)];
      dv.id = devices[static_cast<size_t>(k)];
      use(k);
      check(rt::sm_count(&dv.sms, dv.id), "cudaDeviceGetAttribute(MultiProcessorCount)");
      check(cudaMalloc(&dv.send, slot_), "cudaMalloc of the send region");
      check(cudaMalloc(&dv.recv, stride_ * static_cast<size_t>(n)),
            "cudaMalloc of the receive region");
      check(cudaMalloc(&dv.ring, kRingWords * sizeof(uint32_t)), "cudaMalloc of the chase ring");
      check(cudaMalloc(&dv.flags, static_cast<size_t>(n) * sizeof(uint64_t)),
            "cudaMalloc of the flags");
      check(cudaMemset(dv.flags, 0, static_cast<size_t>(n) * sizeof(uint64_t)),
            "cudaMemset of the flags");
      check(cudaMalloc(&dv.scratch, 4 * sizeof(uint64_t)), "cudaMalloc of the scratch words");
      const size_t max_flows = static_cast<size_t>(n) * static_cast<size_t>(n);
      check(cudaMalloc(&dv.flow_table, max_flows * sizeof(FlowDesc)),
            "cudaMalloc of the flow table");
      check(cudaMalloc(&dv.times, 2 * 1024 * sizeof(uint64_t)), "cudaMalloc of the timers");
      check(cudaMalloc(&dv.error, sizeof(uint32_t)), "cudaMalloc of the error word");
      const int node =
          k < static_cast<int>(staging_numa.size()) ? staging_numa[static_cast<size_t>(k)] : -1;
      dv.host = std::make_unique<NumaBuffer>(stride_, node);
      check(cudaHostRegister(dv.host->data(), stride_, cudaHostRegisterPortable),
            "cudaHostRegister of the staging slot");
      dv.host_registered = true;
      dv.streams.resize(static_cast<size_t>(n) + 1);
      for (auto& s : dv.streams)
        check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      dv.events.resize(3 * dv.streams.size());
      for (auto& e : dv.events) check(cudaEventCreate(&e), "cudaEventCreate");
      launch_ring_init(dv.ring, kRingWords, static_cast<uint32_t>(kChaseStrideWords),
                       dv.streams[0]);
      check(cudaGetLastError(), "ring_init launch");
    }
    for (int a = 0; a < n; ++a) {
      use(a);
      for (int b = 0; b < n; ++b) {
        if (a == b) continue;
        int ok = 0;
        check(rt::can_access_peer(&ok, devs_[static_cast<size_t>(a)].id,
                                  devs_[static_cast<size_t>(b)].id),
              "cudaDeviceCanAccessPeer");
        if (ok) {
          check(rt::enable_peer(devs_[static_cast<size_t>(b)].id), "cudaDeviceEnablePeerAccess");
          peer_[static_cast<size_t>(a)][static_cast<size_t>(b)] = true;
        }
      }
    }
    sync_all();
  } catch (...) {
    close();
    throw;
  }
}

Session::~Session() {
  try {
    close();
  } catch (...) {  // a destructor never throws; close() reports through its own calls
  }
}

void Session::close() {
  if (closed_) return;
  closed_ = true;
  for (size_t k = 0; k < devs_.size(); ++k) {
    Dev& dv = devs_[k];
    if (rt::set_device(dv.id) != cudaSuccess) continue;
    for (auto s : dv.streams)
      if (s) (void)cudaStreamSynchronize(s);
    for (auto e : dv.events)
      if (e) (void)cudaEventDestroy(e);
    for (auto s : dv.streams)
      if (s) (void)cudaStreamDestroy(s);
    if (dv.host_registered) (void)cudaHostUnregister(dv.host->data());
    dv.host.reset();
    for (void* p : {static_cast<void*>(dv.send), static_cast<void*>(dv.recv),
                    static_cast<void*>(dv.ring), static_cast<void*>(dv.flags),
                    static_cast<void*>(dv.scratch), static_cast<void*>(dv.flow_table),
                    static_cast<void*>(dv.times), static_cast<void*>(dv.error)}) {
      if (p) (void)cudaFree(p);
    }
    dv = Dev{};
  }
  if (go_host_) (void)cudaFreeHost(go_host_);
  go_host_ = nullptr;
  go_dev_ = nullptr;
  (void)cudaGetLastError();
}

void Session::use(int d) const {
  check(rt::set_device(devs_[static_cast<size_t>(d)].id), "cudaSetDevice");
}

void Session::check_pair(int src, int dst, const char* what) const {
  PA2A_CHECK_ARG(!closed_, "probe: ", what, " on a closed session");
  PA2A_CHECK_ARG(src >= 0 && src < size() && dst >= 0 && dst < size() && src != dst,
                 "probe: ", what, ": pair (", src, ", ", dst,
                 "): expected two different devices in 0..", size() - 1);
}

unsigned char* Session::recv_slot(int dst, int src) const {
  return devs_[static_cast<size_t>(dst)].recv + stride_ * static_cast<size_t>(src);
}

// Every device's error word to kOk: a measurement reads the words of all devices it used,
// whichever leg ran there.
void Session::clear_errors() {
  for (int k = 0; k < size(); ++k) {
    use(k);
    check(cudaMemset(devs_[static_cast<size_t>(k)].error, 0, sizeof(uint32_t)),
          "cudaMemset of the error word");
  }
}

void Session::sync_all() {
  for (int k = 0; k < size(); ++k) {
    use(k);
    for (auto s : devs_[static_cast<size_t>(k)].streams)
      check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }
}

std::vector<Identity> Session::identities() const {
  std::vector<Identity> out;
  for (const Dev& dv : devs_) out.push_back({rt::bus_id(dv.id), rt::uuid(dv.id), rt::name(dv.id)});
  return out;
}

bool Session::can_access(int src, int dst) const {
  check_pair(src, dst, "can_access");
  // A load by dst reads src's memory: both directions of peer access are needed to run
  // every mode, so a pair counts as P2P only when both are enabled.
  return peer_[static_cast<size_t>(src)][static_cast<size_t>(dst)] &&
         peer_[static_cast<size_t>(dst)][static_cast<size_t>(src)];
}

Mismatch Session::known_answer(int src, int dst, Mode mode, size_t nbytes, uint32_t seed) {
  check_pair(src, dst, "known_answer");
  std::vector<uint32_t> seeds(static_cast<size_t>(size()), 0);
  seeds[static_cast<size_t>(src)] = seed;
  return check_flows({{src, dst}}, mode, nbytes, seeds)[0];
}

std::vector<Mismatch> Session::known_answer_flows(const std::vector<std::pair<int, int>>& flows,
                                                  Mode mode, size_t nbytes, uint32_t seed) {
  std::vector<uint32_t> seeds;
  for (int k = 0; k < size(); ++k) seeds.push_back(seed + static_cast<uint32_t>(k));
  return check_flows(flows, mode, nbytes, seeds);
}

std::vector<Mismatch> Session::check_flows(const std::vector<std::pair<int, int>>& flows, Mode mode,
                                           size_t nbytes, const std::vector<uint32_t>& seeds) {
  PA2A_CHECK_ARG(!flows.empty(), "probe: known_answer: no flows");
  PA2A_CHECK_ARG(nbytes >= 1 && nbytes <= slot_, "probe: known_answer: nbytes ", nbytes,
                 " outside 1..", slot_);
  for (const auto& [s, d] : flows) check_pair(s, d, "known_answer");
  const size_t span = nbytes + kGuardBytes;
  std::vector<bool> filled(static_cast<size_t>(size()), false);
  for (const auto& [s, d] : flows) {
    if (!filled[static_cast<size_t>(s)]) {
      use(s);
      launch_fill(devs_[static_cast<size_t>(s)].send, nbytes, seeds[static_cast<size_t>(s)], false,
                  devs_[static_cast<size_t>(s)].streams[0]);
      check(cudaGetLastError(), "fill launch");
      filled[static_cast<size_t>(s)] = true;
    }
    // The destination starts as the complement of what must arrive, guard included: a
    // byte that is not written, or written past the end, compares wrong.
    use(d);
    launch_fill(recv_slot(d, s), span, seeds[static_cast<size_t>(s)], true,
                devs_[static_cast<size_t>(d)].streams[0]);
    check(cudaGetLastError(), "fill launch");
  }
  sync_all();
  (void)run_flows(flows, mode, nbytes);
  std::vector<Mismatch> out;
  std::vector<unsigned char> got(span);
  for (const auto& [s, d] : flows) {
    use(d);
    check(cudaMemcpy(got.data(), recv_slot(d, s), span, cudaMemcpyDeviceToHost),
          "cudaMemcpy of the received bytes");
    Mismatch m;
    for (size_t i = 0; i < span; ++i) {
      const uint8_t flip = i < nbytes ? 0x00 : 0xFF;
      const uint8_t want =
          static_cast<uint8_t>(pattern_byte(seeds[static_cast<size_t>(s)], i) ^ flip);
      if (got[i] != want) {
        m = Mismatch{static_cast<int64_t>(i), got[i], want};
        break;
      }
    }
    out.push_back(m);
  }
  return out;
}

std::vector<double> Session::run_flows(const std::vector<std::pair<int, int>>& flows, Mode mode,
                                       size_t nbytes) {
  PA2A_CHECK_ARG(!flows.empty(), "probe: run_flows: no flows");
  PA2A_CHECK_ARG(nbytes >= 1 && nbytes <= slot_, "probe: run_flows: nbytes ", nbytes,
                 " outside 1..", slot_);
  for (const auto& [s, d] : flows) {
    check_pair(s, d, "run_flows");
    PA2A_CHECK_ARG(mode == Mode::kStaged || can_access(s, d), "probe: run_flows: ", mode_name(mode),
                   " ", s, "->", d, " needs peer access, which CUDA refused");
  }
  return kernel_mode(mode) ? kernel_flows(flows, mode, nbytes) : copy_flows(flows, mode, nbytes);
}

std::vector<double> Session::kernel_flows(const std::vector<std::pair<int, int>>& flows, Mode mode,
                                          size_t nbytes) {
  const int n = size();
  std::vector<std::vector<int>> by_issuer(static_cast<size_t>(n));  // flow indices
  for (size_t f = 0; f < flows.size(); ++f) {
    const int issuer = mode == Mode::kStore ? flows[f].first : flows[f].second;
    by_issuer[static_cast<size_t>(issuer)].push_back(static_cast<int>(f));
  }
  rt::close_gate(go_host_);
  clear_errors();
  std::vector<int> bpf(static_cast<size_t>(n), 1);
  for (int k = 0; k < n; ++k) {
    const auto& mine = by_issuer[static_cast<size_t>(k)];
    if (mine.empty()) continue;
    Dev& dv = devs_[static_cast<size_t>(k)];
    use(k);
    std::vector<FlowDesc> table;
    for (int f : mine) {
      const auto [s, d] = flows[static_cast<size_t>(f)];
      table.push_back({devs_[static_cast<size_t>(s)].send, recv_slot(d, s), nbytes});
    }
    const int blocks = std::clamp(dv.sms / static_cast<int>(mine.size()), 1, 32);
    bpf[static_cast<size_t>(k)] = std::min(blocks, 1024 / static_cast<int>(mine.size()));
    check(cudaMemcpy(dv.flow_table, table.data(), table.size() * sizeof(FlowDesc),
                     cudaMemcpyHostToDevice),
          "cudaMemcpy of the flow table");
    launch_flows(dv.flow_table, static_cast<int>(mine.size()), bpf[static_cast<size_t>(k)], go_dev_,
                 kTimeoutNs, dv.times, dv.error, dv.streams[0]);
    check(cudaGetLastError(), "flows launch");
  }
  rt::open_gate(go_host_);
  sync_all();
  std::vector<double> out(flows.size(), 0.0);
  for (int k = 0; k < n; ++k) {
    const auto& mine = by_issuer[static_cast<size_t>(k)];
    if (mine.empty()) continue;
    Dev& dv = devs_[static_cast<size_t>(k)];
    use(k);
    uint32_t err = 0;
    check(cudaMemcpy(&err, dv.error, sizeof err, cudaMemcpyDeviceToHost),
          "cudaMemcpy of the error word");
    if (err != kOk)
      PA2A_THROW(kTimeout, "probe: the start gate of device ", k, " did not open within ",
                 kTimeoutNs / 1'000'000'000ull, " s (", mode_name(mode), ")");
    const int b = bpf[static_cast<size_t>(k)];
    std::vector<uint64_t> t(2 * mine.size() * static_cast<size_t>(b));
    check(cudaMemcpy(t.data(), dv.times, t.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost),
          "cudaMemcpy of the timers");
    for (size_t j = 0; j < mine.size(); ++j) {
      uint64_t lo = UINT64_MAX, hi = 0;
      for (int p = 0; p < b; ++p) {
        const size_t blk = j * static_cast<size_t>(b) + static_cast<size_t>(p);
        lo = std::min(lo, t[2 * blk]);
        hi = std::max(hi, t[2 * blk + 1]);
      }
      out[static_cast<size_t>(mine[j])] = static_cast<double>(hi > lo ? hi - lo : 1) * 1e-9;
    }
  }
  return out;
}

std::vector<double> Session::copy_flows(const std::vector<std::pair<int, int>>& flows, Mode mode,
                                        size_t nbytes) {
  const int n = size();
  if (mode == Mode::kStaged) {
    std::vector<bool> seen(static_cast<size_t>(n), false);
    for (const auto& [s, d] : flows) {
      PA2A_CHECK_ARG(!seen[static_cast<size_t>(d)],
                     "probe: run_flows: two staged flows into device ", d,
                     " (one host staging slot per receiver)");
      seen[static_cast<size_t>(d)] = true;
    }
  }
  rt::close_gate(go_host_);
  clear_errors();
  std::vector<int> used(static_cast<size_t>(n), 0);  // streams taken per device
  struct Timing {
    int dev_a, ev_a0, ev_a1;  // the first leg (the whole copy when not staged)
    int dev_b, ev_b0, ev_b1;  // the second leg of a staged copy, dev_b = -1 otherwise
  };
  std::vector<Timing> timing;
  for (const auto& [s, d] : flows) {
    Dev& ds = devs_[static_cast<size_t>(s)];
    Dev& dd = devs_[static_cast<size_t>(d)];
    const int issuer = mode == Mode::kCeRead ? d : s;
    Dev& di = devs_[static_cast<size_t>(issuer)];
    const int k = used[static_cast<size_t>(issuer)]++;
    PA2A_HOST_ASSERT(k < static_cast<int>(di.streams.size()));
    cudaStream_t st = di.streams[static_cast<size_t>(k)];
    use(issuer);
    launch_gate_wait(go_dev_, kTimeoutNs, di.error, st);
    check(cudaGetLastError(), "gate launch");
    check(cudaEventRecord(di.events[3 * static_cast<size_t>(k)], st), "cudaEventRecord");
    Timing t{issuer, 3 * k, 3 * k + 1, -1, 0, 0};
    if (mode != Mode::kStaged) {
      check(rt::copy_peer(recv_slot(d, s), dd.id, ds.send, ds.id, nbytes, st),
            "cudaMemcpyPeerAsync");
      check(cudaEventRecord(di.events[3 * static_cast<size_t>(k) + 1], st), "cudaEventRecord");
    } else {
      check(cudaMemcpyAsync(dd.host->data(), ds.send, nbytes, cudaMemcpyDeviceToHost, st),
            "cudaMemcpyAsync to the staging slot");
      check(cudaEventRecord(di.events[3 * static_cast<size_t>(k) + 1], st), "cudaEventRecord");
      const int kb = used[static_cast<size_t>(d)]++;
      PA2A_HOST_ASSERT(kb < static_cast<int>(dd.streams.size()));
      cudaStream_t sb = dd.streams[static_cast<size_t>(kb)];
      use(d);
      check(cudaStreamWaitEvent(sb, di.events[3 * static_cast<size_t>(k) + 1], 0),
            "cudaStreamWaitEvent");
      check(cudaEventRecord(dd.events[3 * static_cast<size_t>(kb)], sb), "cudaEventRecord");
      check(cudaMemcpyAsync(recv_slot(d, s), dd.host->data(), nbytes, cudaMemcpyHostToDevice, sb),
            "cudaMemcpyAsync from the staging slot");
      check(cudaEventRecord(dd.events[3 * static_cast<size_t>(kb) + 1], sb), "cudaEventRecord");
      t.dev_b = d;
      t.ev_b0 = 3 * kb;
      t.ev_b1 = 3 * kb + 1;
    }
    timing.push_back(t);
  }
  rt::open_gate(go_host_);
  sync_all();
  std::vector<double> out;
  for (const Timing& t : timing) {
    float ms = 0, ms_b = 0;
    use(t.dev_a);
    const Dev& da = devs_[static_cast<size_t>(t.dev_a)];
    check(rt::elapsed_ms(&ms, da.events[static_cast<size_t>(t.ev_a0)],
                         da.events[static_cast<size_t>(t.ev_a1)]),
          "cudaEventElapsedTime");
    if (t.dev_b >= 0) {
      use(t.dev_b);
      const Dev& db = devs_[static_cast<size_t>(t.dev_b)];
      check(rt::elapsed_ms(&ms_b, db.events[static_cast<size_t>(t.ev_b0)],
                           db.events[static_cast<size_t>(t.ev_b1)]),
            "cudaEventElapsedTime");
    }
    out.push_back(std::max(1e-9, (static_cast<double>(ms) + static_cast<double>(ms_b)) * 1e-3));
  }
  for (int k = 0; k < n; ++k) {
    if (!used[static_cast<size_t>(k)]) continue;
    use(k);
    uint32_t err = 0;
    check(cudaMemcpy(&err, devs_[static_cast<size_t>(k)].error, sizeof err, cudaMemcpyDeviceToHost),
          "cudaMemcpy of the error word");
    if (err != kOk)
      PA2A_THROW(kTimeout, "probe: the start gate of device ", k, " did not open (",
                 mode_name(mode), ")");
  }
  return out;
}

double Session::latency_us(int src, int dst, Mode mode, int iters) {
  check_pair(src, dst, "latency_us");
  PA2A_CHECK_ARG(iters >= 1, "probe: latency_us: iters ", iters, ", expected >= 1");
  Dev& ds = devs_[static_cast<size_t>(src)];
  Dev& dd = devs_[static_cast<size_t>(dst)];
  if (mode == Mode::kStore || mode == Mode::kLoad) {
    PA2A_CHECK_ARG(can_access(src, dst), "probe: latency_us: ", mode_name(mode), " ", src, "->",
                   dst, " needs peer access");
  }
  if (mode == Mode::kStore) {
    // dst answers src; each side polls its own flag slot written by the other.
    pingpong_base_ += 1ull << 32;
    use(dst);
    check(cudaMemset(dd.error, 0, sizeof(uint32_t)), "cudaMemset of the error word");
    launch_pingpong(dd.flags + src, ds.flags + dst, pingpong_base_, iters, false, kTimeoutNs,
                    dd.scratch, dd.error, dd.streams[0]);
    check(cudaGetLastError(), "ping-pong launch");
    use(src);
    check(cudaMemset(ds.error, 0, sizeof(uint32_t)), "cudaMemset of the error word");
    launch_pingpong(ds.flags + dst, dd.flags + src, pingpong_base_, iters, true, kTimeoutNs,
                    ds.scratch, ds.error, ds.streams[0]);
    check(cudaGetLastError(), "ping-pong launch");
    sync_all();
    uint32_t e1 = 0, e2 = 0;
    uint64_t ns = 0;
    check(cudaMemcpy(&e1, ds.error, sizeof e1, cudaMemcpyDeviceToHost), "cudaMemcpy");
    check(cudaMemcpy(&ns, ds.scratch, sizeof ns, cudaMemcpyDeviceToHost), "cudaMemcpy");
    use(dst);
    check(cudaMemcpy(&e2, dd.error, sizeof e2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    if (e1 != kOk || e2 != kOk)
      PA2A_THROW(kTimeout, "probe: flag ping-pong ", src, "<->", dst,
                 " timed out: a flag written "
                 "across PCIe never arrived");
    return static_cast<double>(ns) / iters / 2.0 / 1000.0;
  }
  if (mode == Mode::kLoad) {
    use(dst);
    launch_chase(ds.ring, iters, dd.scratch, dd.streams[0]);
    check(cudaGetLastError(), "chase launch");
    check(cudaStreamSynchronize(dd.streams[0]), "cudaStreamSynchronize");
    uint64_t ns = 0;
    check(cudaMemcpy(&ns, dd.scratch, sizeof ns, cudaMemcpyDeviceToHost), "cudaMemcpy");
    return static_cast<double>(ns) / iters / 1000.0;
  }
  const bool staged = mode == Mode::kStaged;
  const int issuer = mode == Mode::kCeRead ? dst : src;
  cudaStream_t st = devs_[static_cast<size_t>(issuer)].streams[0];
  sync_all();
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < iters; ++k) {
    use(issuer);
    if (!staged) {
      check(rt::copy_peer(recv_slot(dst, src), dd.id, ds.send, ds.id, 8, st),
            "cudaMemcpyPeerAsync");
      check(cudaStreamSynchronize(st), "cudaStreamSynchronize");
      continue;
    }
    check(cudaMemcpyAsync(dd.host->data(), ds.send, 8, cudaMemcpyDeviceToHost, st),
          "cudaMemcpyAsync");
    check(cudaStreamSynchronize(st), "cudaStreamSynchronize");
    use(dst);
    check(cudaMemcpyAsync(recv_slot(dst, src), dd.host->data(), 8, cudaMemcpyHostToDevice,
                          dd.streams[0]),
          "cudaMemcpyAsync");
    check(cudaStreamSynchronize(dd.streams[0]), "cudaStreamSynchronize");
  }
  return seconds_since(t0) / iters * 1e6;
}

}  // namespace pa2a::probe
