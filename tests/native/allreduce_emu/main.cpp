// Runs the CUDA all-reduce (csrc/cuda/allreduce: the kernels *and* class CudaAllReduce) on
// the CPU: W rank processes, forked from this one, share a device arena (tests/native/emu/
// emu_runtime.h) the way ranks share device memory through CUDA IPC.
//
//   allreduce_emu DIR
//
// DIR/case.txt (whitespace-separated records, written by tests/test_allreduce_emulation.py):
//   config W MAX_BYTES BUFFERS END_BARRIER REGION_MB
//   pull S v..                 row S of the pull matrix (pull[S * W + d]: d loads S's data)
//   delay R SEQ MS             rank R sleeps MS ms right after it first sees a flag of call SEQ
//   step I KIND ALGO DTYPE NUMEL RESIDUAL INPLACE WHO TIMEOUT_MS HIDDEN EPS
// KIND: run (fresh buffers) | graph (the same static buffers every time, inputs copied in:
// what a CUDA-graph replay sees, frozen kernel arguments) | norm (all-reduce, then the fused
// add + RMSNorm) | abort (WHO aborts, the others call) | skip (WHO does not call) |
// mismatch (WHO all-reduces half the elements).
// Inputs: DIR/s<I>.r<R>.{x,res,w}; outputs: DIR/s<I>.r<R>.{out,normed,resout} and
// DIR/s<I>.r<R>.txt ("error KIND MESSAGE", "bytes B0 .. B(W-1)", "elapsed_ms N").
// Exit status: 0, or the first failing rank's (1 unexpected exception, 2 bad input files or a
// failed CUDA call of the driver, 3 emulation fault, 4 resources left after close()); when
// one fails the others are killed.
//
// No barrier separates the steps: ranks run ahead of each other as far as the protocol lets
// them, which is what the ownership scenarios (delay) rely on.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "core/exception.h"
#include "cuda/allreduce/communicator.cuh"

namespace ar = pa2a::ar;

namespace {

struct Step {
  int idx = 0;
  std::string kind;
  int algo = 1, dtype = 0, who = -1, hidden = 0;
  int64_t numel = 0;
  bool residual = false, inplace = false;
  double timeout_s = 30.0, eps = 1e-6;
};

struct Delay {
  int rank = -1;
  uint32_t seq = 0;
  unsigned ms = 0;
};

struct Case {
  ar::Config cfg;
  bool end_barrier = false;
  size_t region_bytes = 64u << 20;
  std::vector<uint8_t> pull;
  std::vector<Delay> delays;
  std::vector<Step> steps;
};

std::string g_dir;

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "allreduce_emu: %s\n", msg.c_str());
  std::fflush(stderr);
  std::_Exit(2);
}

Case read_case() {
  std::ifstream in(g_dir + "/case.txt");
  if (!in) die("missing case.txt");
  Case c;
  std::string key;
  while (in >> key) {
    if (key == "config") {
      int mb, barrier;
      in >> c.cfg.world >> c.cfg.max_bytes >> c.cfg.buffers >> barrier >> mb;
      c.end_barrier = barrier != 0;
      c.region_bytes = static_cast<size_t>(mb) << 20;
      c.pull.assign(static_cast<size_t>(c.cfg.world) * c.cfg.world, 0);
    } else if (key == "pull") {
      int s;
      in >> s;
      for (int d = 0; d < c.cfg.world; ++d) {
        int v;
        in >> v;
        c.pull.at(static_cast<size_t>(s) * c.cfg.world + d) = static_cast<uint8_t>(v);
      }
    } else if (key == "delay") {
      Delay d;
      in >> d.rank >> d.seq >> d.ms;
      c.delays.push_back(d);
    } else if (key == "step") {
      Step s;
      int res, inplace;
      double ms;
      in >> s.idx >> s.kind >> s.algo >> s.dtype >> s.numel >> res >> inplace >> s.who >> ms >>
          s.hidden >> s.eps;
      s.residual = res != 0;
      s.inplace = inplace != 0;
      s.timeout_s = ms / 1000.0;
      if (s.idx != static_cast<int>(c.steps.size())) die("steps must be numbered 0, 1, ...");
      c.steps.push_back(s);
    } else {
      die("unknown record " + key);
    }
    if (!in) die("malformed record " + key);
  }
  if (c.cfg.world < 1) die("no config record");
  return c;
}

// ---- cross-process barrier and handle exchange in the arena's scratch -------------------
struct Scratch {
  uint32_t arrived;
  uint32_t generation;
  char handles[ar::kMaxWorld][64];
};

void barrier(int world) {
  auto* s = static_cast<Scratch*>(emu_rt::scratch());
  const uint32_t gen = __atomic_load_n(&s->generation, __ATOMIC_ACQUIRE);
  if (__atomic_add_fetch(&s->arrived, 1u, __ATOMIC_ACQ_REL) == static_cast<uint32_t>(world)) {
    __atomic_store_n(&s->arrived, 0u, __ATOMIC_RELAXED);
    __atomic_store_n(&s->generation, gen + 1, __ATOMIC_RELEASE);
    return;
  }
  while (__atomic_load_n(&s->generation, __ATOMIC_ACQUIRE) == gen) usleep(200);
}

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorName(e));
}

struct Dev {
  void* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t bytes) : n(bytes) {
    cuda_ok(cudaMalloc(&p, bytes ? bytes : 16), "cudaMalloc");
  }
  ~Dev() { cuda_ok(cudaFree(p), "cudaFree"); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
};

std::string path(const Step& s, int r, const std::string& name) {
  return g_dir + "/s" + std::to_string(s.idx) + ".r" + std::to_string(r) + "." + name;
}

void upload(const Step& s, int r, const std::string& name, void* dev, size_t bytes) {
  std::ifstream in(path(s, r, name), std::ios::binary | std::ios::ate);
  if (!in) die("missing input " + path(s, r, name));
  if (static_cast<size_t>(in.tellg()) != bytes)
    die(path(s, r, name) + " has the wrong size, expected " + std::to_string(bytes));
  std::string host(bytes, '\0');
  in.seekg(0);
  in.read(host.data(), static_cast<std::streamsize>(bytes));
  cuda_ok(cudaMemcpy(dev, host.data(), bytes, cudaMemcpyHostToDevice), "upload");
}

void dump(const Step& s, int r, const std::string& name, const void* dev, size_t bytes) {
  std::string host(bytes, '\0');
  cuda_ok(cudaMemcpy(host.data(), dev, bytes, cudaMemcpyDeviceToHost), "download");
  std::ofstream out(path(s, r, name), std::ios::binary);
  out.write(host.data(), static_cast<std::streamsize>(bytes));
}

class Rank {
 public:
  Rank(const Case& c, int r, ar::CudaAllReduce& tx, cudaStream_t stream)
      : c_(c),
        r_(r),
        tx_(tx),
        stream_(stream),
        sx_(c.cfg.max_bytes),
        sres_(c.cfg.max_bytes),
        sout_(c.cfg.max_bytes) {}

  // False once the communicator is broken (the scenario ends there).
  bool run(const Step& s) {
    log_.open(path(s, r_, "txt"));
    const auto t0 = std::chrono::steady_clock::now();
    bool go_on = true;
    try {
      go_on = step(s);
    } catch (const pa2a::Error& e) {
      log_ << "error " << static_cast<int>(e.kind()) << " " << e.what() << "\n";
      go_on = e.kind() == pa2a::Error::Kind::kAborted;
    }
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    log_ << "elapsed_ms " << ms << "\n";
    log_ << "bytes";
    for (uint64_t b : tx_.last_bytes()) log_ << " " << b;
    log_ << "\n";
    log_.close();
    return go_on;
  }

 private:
  void call(const Step& s, const void* x, int64_t numel, const void* res, void* out) {
    tx_.run(static_cast<ar::Algo>(s.algo), static_cast<pa2a::DType>(s.dtype), x, numel, res, out,
            s.timeout_s, stream_);
    cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    tx_.check();
  }

  bool step(const Step& s) {
    const size_t bytes = static_cast<size_t>(s.numel) * 2;
    if (s.kind == "skip" && r_ == s.who) return false;
    if (s.kind == "abort" && r_ == s.who) {
      tx_.abort(s.timeout_s, stream_);
      cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      return true;
    }
    if (s.kind == "graph") {
      upload(s, r_, "x", sx_.p, bytes);
      if (s.residual) upload(s, r_, "res", sres_.p, bytes);
      void* out = s.inplace ? sx_.p : sout_.p;
      call(s, sx_.p, s.numel, s.residual ? sres_.p : nullptr, out);
      dump(s, r_, "out", out, bytes);
      return true;
    }
    Dev x(bytes), res(bytes), out(bytes);
    upload(s, r_, "x", x.p, bytes);
    if (s.residual) upload(s, r_, "res", res.p, bytes);
    void* o = s.inplace ? x.p : out.p;
    const int64_t numel = s.kind == "mismatch" && r_ == s.who ? s.numel / 2 : s.numel;
    if (s.kind == "norm") {
      Dev w(static_cast<size_t>(s.hidden) * 2), resout(bytes);
      upload(s, r_, "w", w.p, static_cast<size_t>(s.hidden) * 2);
      call(s, x.p, numel, nullptr, o);  // as pcie_a2a.AllReduce.all_reduce_rmsnorm does
      ar::launch_rmsnorm(static_cast<pa2a::DType>(s.dtype), o, s.residual ? res.p : nullptr, w.p,
                         s.numel / s.hidden, s.hidden, static_cast<float>(s.eps), o, resout.p,
                         stream_);
      cuda_ok(cudaGetLastError(), "launch_rmsnorm");
      cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      dump(s, r_, "normed", o, bytes);
      dump(s, r_, "resout", resout.p, bytes);
      return true;
    }
    call(s, x.p, numel, s.residual ? res.p : nullptr, o);
    dump(s, r_, "out", o, bytes);
    return true;
  }

  const Case& c_;
  int r_;
  ar::CudaAllReduce& tx_;
  cudaStream_t stream_;
  Dev sx_, sres_, sout_;  // the static buffers of the graph steps
  std::ofstream log_;
};

int run_rank(const Case& c, int r) {
  const int W = c.cfg.world;
  auto* scratch = static_cast<Scratch*>(emu_rt::scratch());
  for (const Delay& d : c.delays)
    if (d.rank == r) pa2a::cuda::emu_acquire_delay = {d.seq, d.ms};
  {
    ar::CudaAllReduce tx(r, c.cfg, 0, c.end_barrier);
    const std::string h = tx.ipc_handle();
    std::memcpy(scratch->handles[r], h.data(), 64);
    barrier(W);
    std::vector<std::string> handles(W);
    for (int s = 0; s < W; ++s) handles[s].assign(scratch->handles[s], 64);
    tx.open_peers(handles, std::vector<uintptr_t>(W, 0), c.pull);
    barrier(W);
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    {
      Rank rank(c, r, tx, stream);
      for (const Step& s : c.steps)
        if (!rank.run(s)) break;
    }
    barrier(W);  // peers stop touching this rank's memory before it closes
    tx.close();
    cuda_ok(cudaStreamDestroy(stream), "cudaStreamDestroy");
  }
  const std::string leaks = emu_rt::leak_report();
  if (!leaks.empty()) {
    std::fprintf(stderr, "rank %d: resources left after close(): %s\n", r, leaks.c_str());
    return 4;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  g_dir = argv[1];
  const Case c = read_case();
  const int W = c.cfg.world;
  emu_rt::arena_create(W, c.region_bytes);
  std::vector<pid_t> pids(W, -1);
  for (int r = 0; r < W; ++r) {
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) die("fork failed");
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      emu_rt::arena_enter(r, c.region_bytes);
      int status = 1;
      try {
        status = run_rank(c, r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: unexpected exception: %s\n", r, e.what());
      }
      std::fflush(nullptr);
      std::_Exit(status);
    }
    pids[r] = pid;
  }
  int result = 0, left = W;
  while (left > 0) {
    int st = 0;
    const pid_t pid = wait(&st);
    if (pid < 0) break;
    --left;
    int r = 0;
    while (r < W && pids[r] != pid) ++r;
    if (r == W) continue;
    pids[r] = -1;
    const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (code != 0 && result == 0) {
      result = code;
      std::fprintf(stderr, "allreduce_emu: rank %d failed with status %d; stopping the others\n", r,
                   code);
      for (const pid_t p : pids)
        if (p > 0) kill(p, SIGKILL);
    }
  }
  return result;
}
