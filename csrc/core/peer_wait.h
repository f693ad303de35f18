// What the CPU implementations (the dispatch/combine transport and the all-reduce) share
// while they wait for a peer's flag in shared memory: whether the peer process is still
// there, and how to wait without burning a core that another rank may need.
//
// Ranks may outnumber cores (tests run 8 ranks on 2), so a wait spins only for a few
// microseconds, then yields, then sleeps with exponential backoff capped at 200 us; every
// caller checks its deadline and the peers' liveness between pauses.
#pragma once

#include <sched.h>
#include <signal.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <string>
#include <thread>

namespace pa2a::wait {

using Clock = std::chrono::steady_clock;

// A peer that exited is gone or a zombie waiting to be reaped by its parent.
inline bool process_alive(int32_t pid) {
  if (pid <= 0) return true;  // unknown: rely on the deadline
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return true;
  const char state = line[close + 2];
  return state != 'Z' && state != 'X';
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline Clock::time_point deadline_after(Clock::time_point start, double timeout_s) {
  return start +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
}

// Spin for a few microseconds, then yield the core, then sleep with exponential backoff
// capped at 200 us.
class Backoff {
 public:
  Backoff() : start_(Clock::now()) {}
  Clock::time_point start() const { return start_; }
  void pause(Clock::time_point now) {
    const auto waited = now - start_;
    if (waited < std::chrono::microseconds(20)) {
      for (int i = 0; i < 64; ++i) cpu_relax();
    } else if (waited < std::chrono::milliseconds(2)) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
      sleep_us_ = sleep_us_ < 200 ? sleep_us_ * 2 : 200;
    }
  }

 private:
  Clock::time_point start_;
  int64_t sleep_us_ = 1;
};

}  // namespace pa2a::wait
