// Driver of the probe emulation (tests/test_probe_emulation.py): the real Session
// (csrc/cuda/probe/session.cu) and kernels (kernels.cu) on N fake devices in one process.
//
// Usage: probe_emu DEVICES NBYTES [NO_PEER_MASK]
// Prints one line per check, then "done" and the leak report:
//   pattern SEED N HEX                       the known-answer bytes, for the Python mirror
//   gate S D MODE ok | WRONG OFFSET GOT WANT the known-answer exchange of one pair and mode
//   flows MODE ok | WRONG S D OFFSET          all pairs at once (store, load, ce, ce_read)
//   can S D 0|1                               can_access after NO_PEER_MASK
//   latency MODE S D US                       chase (load), copy engine, staged
//   error TEXT                                a pa2a::Error (argument checks, refusals)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "core/exception.h"
#include "cuda/probe/pattern.h"
#include "cuda/probe/runtime.cuh"
#include "cuda/probe/session.cuh"

using pa2a::probe::Mode;

namespace {

const char* kModes[] = {"store", "load", "ce", "ce_read", "staged"};

// pcie_a2a.topology.probe_run.gate_seed
uint32_t gate_seed(int src, int dst, int mode) {
  return static_cast<uint32_t>(0x9E3779B1ull * static_cast<uint64_t>(1 + 64 * src + dst) +
                               0x85EBCA77ull * static_cast<uint64_t>(1 + mode));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: probe_emu DEVICES NBYTES [NO_PEER_MASK]\n");
    return 2;
  }
  const int n = std::atoi(argv[1]);
  const size_t nbytes = std::strtoull(argv[2], nullptr, 10);
  pa2a::probe::rt::emu_devices = n;
  if (argc > 3) pa2a::probe::rt::emu_no_peer = std::strtoull(argv[3], nullptr, 0);
  emu_rt::arena_create(1, 256u << 20);
  emu_rt::arena_enter(0, 256u << 20);

  std::printf("pattern 12345 37 ");
  for (uint64_t i = 0; i < 37; ++i) std::printf("%02x", pa2a::probe::pattern_byte(12345, i));
  std::printf("\n");
  try {
    std::vector<int> devices;
    for (int d = 0; d < n; ++d) devices.push_back(d);
    pa2a::probe::Session s(devices, nbytes, std::vector<int>(static_cast<size_t>(n), -1));
    std::vector<std::pair<int, int>> all;
    for (int a = 0; a < n; ++a) {
      for (int b = 0; b < n; ++b) {
        if (a == b) continue;
        std::printf("can %d %d %d\n", a, b, s.can_access(a, b) ? 1 : 0);
        if (s.can_access(a, b)) all.emplace_back(a, b);
        for (int m = 0; m < 5; ++m) {
          if (m != 4 && !s.can_access(a, b)) continue;
          const auto r = s.known_answer(a, b, static_cast<Mode>(m), nbytes, gate_seed(a, b, m));
          if (r.offset < 0) {
            std::printf("gate %d %d %s ok\n", a, b, kModes[m]);
          } else {
            std::printf("gate %d %d %s WRONG %lld %d %d\n", a, b, kModes[m],
                        static_cast<long long>(r.offset), r.got, r.expected);
          }
        }
      }
    }
    for (int m = 0; m < 4; ++m) {
      const auto rs = s.known_answer_flows(all, static_cast<Mode>(m), nbytes, 777u);
      bool ok = true;
      for (size_t k = 0; k < rs.size(); ++k) {
        if (rs[k].offset >= 0) {
          std::printf("flows %s WRONG %d %d %lld\n", kModes[m], all[k].first, all[k].second,
                      static_cast<long long>(rs[k].offset));
          ok = false;
        }
      }
      if (ok) std::printf("flows %s ok\n", kModes[m]);
      const auto t = s.run_flows(all, static_cast<Mode>(m), nbytes);
      for (double x : t) {
        if (!(x > 0)) std::printf("flows %s WRONG time %g\n", kModes[m], x);
      }
    }
    for (int m : {1, 2, 4}) {
      if (all.empty() && m != 4) continue;
      const auto [a, b] = all.empty() ? std::make_pair(0, 1) : all[0];
      std::printf("latency %s %d %d %.3f\n", kModes[m], a, b,
                  s.latency_us(a, b, static_cast<Mode>(m), 64));
    }
    // Refusals become errors, never a wrong measurement.
    try {
      (void)s.run_flows({{0, 0}}, Mode::kStore, nbytes);
    } catch (const pa2a::Error& e) {
      std::printf("error %s\n", e.what());
    }
    try {
      (void)s.known_answer(0, 1, Mode::kStore, nbytes + 1, 1);
    } catch (const pa2a::Error& e) {
      std::printf("error %s\n", e.what());
    }
    s.close();
  } catch (const pa2a::Error& e) {
    std::printf("error %s\n", e.what());
  }
  std::printf("done\nleaks: %s\n", emu_rt::leak_report().c_str());
  return 0;
}
