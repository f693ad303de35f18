// Runs the CUDA transport (csrc/cuda/transport: the kernels *and* class CudaTransport) on the
// CPU: W rank processes, forked from this one, share a device arena (tests/native/emu/
// emu_runtime.h) the way ranks on one GPU share device memory through CUDA IPC, and map
// each other's host staging segments through real POSIX shared memory.
//
//   transport_emu DIR
//
// DIR/case.txt (whitespace-separated records, written by tests/test_cuda_transport_
// emulation.py):
//   config W H M K PAYLOAD DTYPE REGION_MB      WireConfig codes, arena MiB per rank
//   offset N v..  /  replica_rank N v..  /  replica_local N v..   placement CSR
//   choice_offset R N v..  /  choice R N v..    rank R's replica choice row (optional)
//   local_experts v.. (W)                       num_local_experts per rank
//   send R v.. (W)                              rank R's pair plan: 0 P2P, 1 staged
//   order R v.. (W)                             rank R's send order
//   step I KIND WHO CE_DISPATCH CE_COMBINE RAW TIMEOUT_MS
//   shape I R T TOPK                            rank R's tokens in step I
// KIND: ll_rows | ll_em | normal | abort | abort_combine | abort_silent | skip | mismatch |
// count_mismatch.
// CE_*: copy-engine min_bytes of the normal mode's dispatch / combine (-1: warp stores
// only). RAW: unpack fp8 rows as raw bytes and scales. WHO: the rank that aborts, skips
// or calls another op (abort_silent: the last rank never calls).
// Inputs: DIR/s<I>.r<R>.{x,ids,w,y} (raw bytes; y: the combine input, from the reference).
// Outputs: DIR/s<I>.r<R>.<buffer> and DIR/s<I>.r<R>.txt ("error KIND MESSAGE", "ce_dispatch
// MASK", "ce_combine MASK", "elapsed_ms N", "slots DISPATCH COMBINE"). Exit status: 0, or
// the first failing rank's (1 unexpected exception, 2 bad input files or a failed CUDA call
// of the driver, 3 emulation fault, 4 resources left after close()), when one fails the
// others are killed; 5 when a host segment was still linked after every rank closed.
//
// Each step issues exactly the CudaTransport calls that pcie_a2a.cuda_backend makes for it
// (tickets are 16-byte device buffers, one stream per rank); no barrier separates steps,
// so ranks run ahead of each other as far as the protocol lets them.
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
#include "cuda/transport/cuda_transport.cuh"

namespace pc = pa2a::cuda;

namespace {

struct Step {
  int idx = 0;
  std::string kind;
  int who = -1;
  int64_t ce_dispatch = -1, ce_combine = -1;
  bool raw = false;
  double timeout_s = 30.0;
  std::vector<int> tokens, topk;  // per rank
};

struct Case {
  pa2a::WireConfig cfg;
  size_t region_bytes = 64u << 20;
  std::vector<int32_t> offset, replica_rank, replica_local, local;
  std::vector<std::vector<int32_t>> send, order, choice_offset, choice;
  std::vector<Step> steps;
};

std::string g_dir;

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "transport_emu: %s\n", msg.c_str());
  std::fflush(stderr);
  std::_Exit(2);
}

std::vector<int32_t> read_ints(std::istream& in, size_t n) {
  std::vector<int32_t> v(n);
  for (auto& x : v) in >> x;
  return v;
}

Case read_case() {
  std::ifstream in(g_dir + "/case.txt");
  if (!in) die("missing case.txt");
  Case c;
  std::string key;
  int w = 0;
  while (in >> key) {
    if (key == "config") {
      int32_t h, m, k, p, d, mb;
      in >> w >> h >> m >> k >> p >> d >> mb;
      c.cfg = pa2a::make_wire_config(w, h, m, k, p, d);
      c.region_bytes = static_cast<size_t>(mb) << 20;
      c.send.assign(w, {});
      c.order.assign(w, {});
      c.choice_offset.assign(w, {});
      c.choice.assign(w, {});
    } else if (key == "offset" || key == "replica_rank" || key == "replica_local") {
      size_t n;
      in >> n;
      (key == "offset"         ? c.offset
       : key == "replica_rank" ? c.replica_rank
                               : c.replica_local) = read_ints(in, n);
    } else if (key == "choice_offset" || key == "choice") {
      int r;
      size_t n;
      in >> r >> n;
      (key == "choice" ? c.choice : c.choice_offset).at(r) = read_ints(in, n);
    } else if (key == "local_experts") {
      c.local = read_ints(in, w);
    } else if (key == "send" || key == "order") {
      int r;
      in >> r;
      (key == "send" ? c.send : c.order).at(r) = read_ints(in, w);
    } else if (key == "step") {
      Step s;
      int raw;
      double ms;
      in >> s.idx >> s.kind >> s.who >> s.ce_dispatch >> s.ce_combine >> raw >> ms;
      s.raw = raw != 0;
      s.timeout_s = ms / 1000.0;
      s.tokens.assign(w, 0);
      s.topk.assign(w, 0);
      if (s.idx != static_cast<int>(c.steps.size())) die("steps must be numbered 0, 1, ...");
      c.steps.push_back(s);
    } else if (key == "shape") {
      int i, r;
      in >> i >> r;
      in >> c.steps.at(i).tokens.at(r) >> c.steps.at(i).topk.at(r);
    } else {
      die("unknown record " + key);
    }
    if (!in) die("malformed record " + key);
  }
  if (w < 1) die("no config record");
  return c;
}

// ---- cross-process barrier in the arena's scratch -------------------------------------
struct Scratch {
  uint32_t arrived;
  uint32_t generation;
  char handles[pc::kMaxWorld][64];
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

// ---- device buffers ---------------------------------------------------------------------
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorName(e));
}

struct Dev {
  void* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t bytes, int fill = -1) : n(bytes) {
    cuda_ok(cudaMalloc(&p, bytes), "cudaMalloc");
    if (fill >= 0) cuda_ok(cudaMemset(p, fill, bytes), "cudaMemset");
  }
  ~Dev() { cuda_ok(cudaFree(p), "cudaFree"); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

std::string path(const Step& s, int r, const std::string& name) {
  return g_dir + "/s" + std::to_string(s.idx) + ".r" + std::to_string(r) + "." + name;
}

// A device buffer holding the input file (which must have `bytes` bytes).
std::unique_ptr<Dev> upload(const Step& s, int r, const std::string& name, size_t bytes) {
  std::ifstream in(path(s, r, name), std::ios::binary | std::ios::ate);
  if (!in) die("missing input " + path(s, r, name));
  const size_t n = static_cast<size_t>(in.tellg());
  if (n != bytes)
    die(path(s, r, name) + " has " + std::to_string(n) + " bytes, expected " +
        std::to_string(bytes));
  std::string host(n, '\0');
  in.seekg(0);
  in.read(host.data(), static_cast<std::streamsize>(n));
  auto d = std::make_unique<Dev>(bytes);
  cuda_ok(cudaMemcpy(d->p, host.data(), n, cudaMemcpyHostToDevice), "upload");
  return d;
}

void dump(const Step& s, int r, const std::string& name, const void* dev, size_t bytes) {
  std::string host(bytes, '\0');
  cuda_ok(cudaMemcpy(host.data(), dev, bytes, cudaMemcpyDeviceToHost), "download");
  std::ofstream out(path(s, r, name), std::ios::binary);
  out.write(host.data(), static_cast<std::streamsize>(bytes));
}

void dump(const Step& s, int r, const std::string& name, const Dev& d) {
  dump(s, r, name, d.p, d.n);
}

std::vector<int32_t> to_host(const Dev& d, size_t n) {
  std::vector<int32_t> v(n);
  cuda_ok(cudaMemcpy(v.data(), d.p, n * 4, cudaMemcpyDeviceToHost), "to_host");
  return v;
}

// ---- one rank ----------------------------------------------------------------------------
class Rank {
 public:
  Rank(const Case& c, int r, pc::CudaTransport& tx, cudaStream_t stream)
      : c_(c), r_(r), tx_(tx), stream_(stream) {}

  // Runs step s; returns false once the transport is broken (no further steps).
  bool run(const Step& s) {
    log_.open(path(s, r_, "txt"));
    log_ << "slots " << tx_.layout().dispatch_slot << " " << tx_.layout().combine_slot << "\n";
    const auto t0 = std::chrono::steady_clock::now();
    bool go_on = true;
    try {
      go_on = dispatch_kind(s);
    } catch (const pa2a::Error& e) {
      log_ << "error " << static_cast<int>(e.kind()) << " " << e.what() << "\n";
      go_on = e.kind() == pa2a::Error::Kind::kAborted;
    }
    const auto dt = std::chrono::steady_clock::now() - t0;
    log_ << "elapsed_ms " << std::chrono::duration_cast<std::chrono::milliseconds>(dt).count()
         << "\n";
    log_.close();
    return go_on;
  }

 private:
  int W() const { return c_.cfg.world; }
  int M() const { return c_.cfg.max_tokens; }
  int H() const { return c_.cfg.hidden; }
  int K() const { return c_.cfg.num_topk; }
  int E() const { return c_.local[r_]; }

  bool dispatch_kind(const Step& s) {
    if (s.kind == "ll_rows") return ll_rows(s);
    if (s.kind == "ll_em") return ll_em(s);
    if (s.kind == "normal") return normal(s);
    if (s.kind == "abort") return abort(s);
    if (s.kind == "abort_combine") return abort_combine(s);
    if (s.kind == "skip") return skip(s);
    if (s.kind == "mismatch") return mismatch(s);
    if (s.kind == "abort_silent") return abort_silent(s);
    if (s.kind == "count_mismatch") return count_mismatch(s);
    die("unknown step kind " + s.kind);
  }

  void sync_check() {
    cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    tx_.check();
  }

  struct Send {
    std::unique_ptr<Dev> x, ids, w, send_token, send_count, ticket;
    int T = 0, k = 0;
  };

  Send inputs(const Step& s) {
    Send in;
    in.T = s.tokens[r_];
    in.k = s.topk[r_];
    const size_t T = static_cast<size_t>(in.T), k = static_cast<size_t>(in.k);
    in.x = upload(s, r_, "x", T * H() * 2);
    in.ids = upload(s, r_, "ids", T * k * 4);
    in.w = upload(s, r_, "w", T * k * 4);
    in.send_token = std::make_unique<Dev>(static_cast<size_t>(W()) * M() * 4);
    in.send_count = std::make_unique<Dev>(static_cast<size_t>(W()) * 4);
    in.ticket = std::make_unique<Dev>(sizeof(pc::CallTicket), 0);  // torch.zeros(4, int32)
    return in;
  }

  void send(Send& in, uint32_t op) {
    tx_.dispatch_send(in.ticket->as<pc::CallTicket>(), op, in.x->p, in.T, in.ids->as<int32_t>(),
                      in.w->as<float>(), in.k, in.send_token->as<int32_t>(),
                      in.send_count->as<int32_t>(), stream_);
  }

  // Rows-layout outputs for `rows` rows.
  struct Rows {
    std::unique_ptr<Dev> x, fp8, scales, src_rank, src_token, ids, ws, per_expert;
  };
  Rows rows(size_t n, bool raw) {
    Rows o;
    const size_t H = static_cast<size_t>(this->H()), K = static_cast<size_t>(this->K());
    if (raw) {
      o.fp8 = std::make_unique<Dev>(n * H);
      o.scales = std::make_unique<Dev>(n * (H / 128) * 4);
    } else {
      o.x = std::make_unique<Dev>(n * H * 2);
    }
    o.src_rank = std::make_unique<Dev>(n * 4);
    o.src_token = std::make_unique<Dev>(n * 4);
    o.ids = std::make_unique<Dev>(n * K * 4);
    o.ws = std::make_unique<Dev>(n * K * 4);
    o.per_expert = std::make_unique<Dev>(static_cast<size_t>(E()) * 4);
    return o;
  }
  void unpack(const Step& s, Send& in, bool wait, const Dev& counts, const Dev* row_base, Rows& o) {
    tx_.unpack_rows(in.ticket->as<pc::CallTicket>(), wait, counts.as<int32_t>(),
                    row_base ? row_base->as<int64_t>() : nullptr, o.x ? o.x->p : nullptr,
                    o.fp8 ? o.fp8->as<uint8_t>() : nullptr,
                    o.scales ? o.scales->as<float>() : nullptr, o.src_rank->as<int32_t>(),
                    o.src_token->as<int32_t>(), o.ids->as<int32_t>(), o.ws->as<float>(),
                    o.per_expert->as<int32_t>(), s.timeout_s, stream_);
  }
  void dump_rows(const Step& s, const Rows& o) {
    if (o.x) dump(s, r_, "xo", *o.x);
    if (o.fp8) dump(s, r_, "fp8", *o.fp8);
    if (o.scales) dump(s, r_, "scales", *o.scales);
    dump(s, r_, "src_rank", *o.src_rank);
    dump(s, r_, "src_token", *o.src_token);
    dump(s, r_, "ids_o", *o.ids);
    dump(s, r_, "ws_o", *o.ws);
    dump(s, r_, "per_expert", *o.per_expert);
  }

  // combine_recv into a fresh output; dumps it with the send-side tables.
  void combine_recv(const Step& s, Send& in, const Dev& ticket) {
    Dev out(static_cast<size_t>(in.T) * H() * 2);
    tx_.combine_recv(ticket.as<pc::CallTicket>(), in.send_token->as<int32_t>(),
                     in.send_count->as<int32_t>(), in.T, out.p, s.timeout_s, stream_);
    sync_check();
    dump(s, r_, "out", out);
    dump(s, r_, "send_count", *in.send_count);
    dump(s, r_, "send_token", *in.send_token);
  }

  // Low-latency rows: dispatch_send_async, recv_rows_async (the kernel waits), then
  // combine_send_async / combine_recv_async of y [world * max_tokens, H].
  bool ll_rows(const Step& s) {
    Send in = inputs(s);
    const size_t cap = static_cast<size_t>(W()) * M();
    Dev counts(static_cast<size_t>(W()) * 4);
    Rows o = rows(cap, s.raw);
    send(in, 3);
    unpack(s, in, true, counts, nullptr, o);
    sync_check();
    dump(s, r_, "counts", counts);
    dump_rows(s, o);
    auto y = upload(s, r_, "y", cap * H() * 2);
    Dev tc(sizeof(pc::CallTicket), 0);
    tx_.combine_send(tc.as<pc::CallTicket>(), 4, y->p, counts.as<int32_t>(), nullptr, nullptr,
                     nullptr, nullptr, stream_);
    combine_recv(s, in, tc);
    return true;
  }

  // Low-latency expert-major: recv_expert_major_async, the pre-reduction alone
  // (reduce_expert_major) and fused into combine_send_async.
  bool ll_em(const Step& s) {
    Send in = inputs(s);
    const size_t cap = static_cast<size_t>(W()) * M(), E = static_cast<size_t>(this->E());
    const size_t H = static_cast<size_t>(this->H()), K = static_cast<size_t>(this->K());
    Dev counts(static_cast<size_t>(W()) * 4);
    std::unique_ptr<Dev> xo, fp8, scales;
    if (s.raw) {
      fp8 = std::make_unique<Dev>(E * cap * H);
      scales = std::make_unique<Dev>(E * cap * (H / 128) * 4);
    } else {
      xo = std::make_unique<Dev>(E * cap * H * 2);
    }
    Dev per_expert(E * 4), src_info(E * cap * 4), layout_range(E * W() * 8);
    Dev expert_pos(cap * K * 4), row_experts(cap * K * 4), row_weights(cap * K * 4);
    send(in, 3);
    tx_.unpack_expert_major(in.ticket->as<pc::CallTicket>(), counts.as<int32_t>(),
                            xo ? xo->p : nullptr, fp8 ? fp8->as<uint8_t>() : nullptr,
                            scales ? scales->as<float>() : nullptr, per_expert.as<int32_t>(),
                            src_info.as<int32_t>(), layout_range.as<int64_t>(),
                            expert_pos.as<int32_t>(), row_experts.as<int32_t>(),
                            row_weights.as<float>(), s.timeout_s, stream_);
    sync_check();
    dump(s, r_, "counts", counts);
    if (xo) dump(s, r_, "xo", *xo);
    if (fp8) dump(s, r_, "fp8", *fp8);
    if (scales) dump(s, r_, "scales", *scales);
    dump(s, r_, "per_expert", per_expert);
    dump(s, r_, "src_info", src_info);
    dump(s, r_, "layout_range", layout_range);
    dump(s, r_, "expert_pos", expert_pos);
    dump(s, r_, "row_experts", row_experts);
    dump(s, r_, "row_weights", row_weights);
    auto y = upload(s, r_, "y", E * cap * H * 2);
    Dev reduced(cap * H * 2);
    tx_.reduce_expert_major(y->p, counts.as<int32_t>(), expert_pos.as<int32_t>(),
                            row_experts.as<int32_t>(), row_weights.as<float>(), reduced.p, stream_);
    sync_check();
    dump(s, r_, "reduced", reduced);
    Dev tc(sizeof(pc::CallTicket), 0);
    tx_.combine_send(tc.as<pc::CallTicket>(), 4, y->p, counts.as<int32_t>(), nullptr,
                     expert_pos.as<int32_t>(), row_experts.as<int32_t>(), row_weights.as<float>(),
                     stream_);
    combine_recv(s, in, tc);
    return true;
  }

  // Normal mode as cuda_backend's dispatch_send / wait / unpack_rows / combine_send /
  // combine_recv: host counts, compacted rows, optionally the copy-engine path.
  bool normal(const Step& s) {
    Send in = inputs(s);
    if (s.ce_dispatch >= 0) {
      tx_.dispatch_send_ce(in.ticket->as<pc::CallTicket>(), 1, in.x->p, in.T, in.ids->as<int32_t>(),
                           in.w->as<float>(), in.k, in.send_token->as<int32_t>(),
                           in.send_count->as<int32_t>(), static_cast<uint64_t>(s.ce_dispatch),
                           stream_);
      log_ << "ce_dispatch " << tx_.last_ce_mask() << "\n";
    } else {
      send(in, 1);
    }
    Dev counts(static_cast<size_t>(W()) * 4);
    tx_.wait_counts(in.ticket->as<pc::CallTicket>(), counts.as<int32_t>(), s.timeout_s, false,
                    stream_);
    sync_check();
    const std::vector<int32_t> host = to_host(counts, W());
    std::vector<int64_t> base(W(), 0);
    for (int i = 1; i < W(); ++i) base[i] = base[i - 1] + host[i - 1];
    const size_t total = static_cast<size_t>(base[W() - 1] + host[W() - 1]);
    Dev row_base(static_cast<size_t>(W()) * 8);
    cuda_ok(cudaMemcpy(row_base.p, base.data(), base.size() * 8, cudaMemcpyHostToDevice),
            "row_base");
    Rows o = rows(total, s.raw);
    unpack(s, in, false, counts, &row_base, o);
    sync_check();
    dump(s, r_, "counts", counts);
    dump_rows(s, o);
    auto y = upload(s, r_, "y", total * H() * 2);
    Dev tc(sizeof(pc::CallTicket), 0);
    if (s.ce_combine >= 0) {
      tx_.combine_send_ce(tc.as<pc::CallTicket>(), 2, y->p, counts.as<int32_t>(),
                          row_base.as<int64_t>(), host, base, static_cast<uint64_t>(s.ce_combine),
                          stream_);
      log_ << "ce_combine " << tx_.last_ce_mask() << "\n";
    } else {
      tx_.combine_send(tc.as<pc::CallTicket>(), 2, y->p, counts.as<int32_t>(),
                       row_base.as<int64_t>(), nullptr, nullptr, nullptr, stream_);
    }
    combine_recv(s, in, tc);
    return true;
  }

  // cuda_backend.abort: publish abort flags, then still receive the call (tolerant wait).
  void abort_call(const Step& s, uint32_t op, int family) {
    Dev ticket(sizeof(pc::CallTicket), 0), counts(static_cast<size_t>(W()) * 4);
    tx_.abort(ticket.as<pc::CallTicket>(), op, family, stream_);
    tx_.wait_counts(ticket.as<pc::CallTicket>(), counts.as<int32_t>(), s.timeout_s, true, stream_);
    sync_check();
  }

  // `who` aborts a normal dispatch; the others send and wait (and raise PeerAbortedError).
  bool abort(const Step& s) {
    if (r_ == s.who) {
      abort_call(s, 1, 0);
      return true;
    }
    send_and_wait(s);
    return true;
  }

  // A normal dispatch and the host-synchronising wait for every source's flag.
  void send_and_wait(const Step& s) {
    Send in = inputs(s);
    send(in, 1);
    Dev counts(static_cast<size_t>(W()) * 4);
    tx_.wait_counts(in.ticket->as<pc::CallTicket>(), counts.as<int32_t>(), s.timeout_s, false,
                    stream_);
    sync_check();
  }

  // `who` aborts a combine; the others return no rows (counts 0) and wait for theirs.
  bool abort_combine(const Step& s) {
    if (r_ == s.who) {
      abort_call(s, 2, 1);
      return true;
    }
    Dev y(16), zeros(static_cast<size_t>(W()) * 4, 0), send_token(static_cast<size_t>(W()) * 4);
    Dev ticket(sizeof(pc::CallTicket), 0), out(16);
    tx_.combine_send(ticket.as<pc::CallTicket>(), 2, y.p, zeros.as<int32_t>(), nullptr, nullptr,
                     nullptr, nullptr, stream_);
    tx_.combine_recv(ticket.as<pc::CallTicket>(), send_token.as<int32_t>(), zeros.as<int32_t>(), 0,
                     out.p, s.timeout_s, stream_);
    sync_check();
    return true;
  }

  // `who` never makes this call: the others' low-latency receive must time out naming it.
  bool skip(const Step& s) {
    if (r_ == s.who) return false;
    Send in = inputs(s);
    Dev counts(static_cast<size_t>(W()) * 4);
    Rows o = rows(static_cast<size_t>(W()) * M(), false);
    send(in, 3);
    unpack(s, in, true, counts, nullptr, o);
    sync_check();
    return false;
  }

  // `who` aborts a dispatch while the last rank never makes it: every waiting rank must
  // time out naming the silent rank (an abort must not hide a peer that never came).
  bool abort_silent(const Step& s) {
    if (r_ == W() - 1) return false;
    if (r_ == s.who) {
      abort_call(s, 1, 0);
      return false;
    }
    send_and_wait(s);
    return false;
  }

  // A normal dispatch, then `who` returns one row fewer than it received from the first
  // other rank that sent it any: that rank's combine_recv must report the mismatch.
  bool count_mismatch(const Step& s) {
    Send in = inputs(s);
    send(in, 1);
    Dev counts(static_cast<size_t>(W()) * 4), row_base(static_cast<size_t>(W()) * 8);
    tx_.wait_counts(in.ticket->as<pc::CallTicket>(), counts.as<int32_t>(), s.timeout_s, false,
                    stream_);
    sync_check();
    std::vector<int32_t> host = to_host(counts, W());
    std::vector<int64_t> base(W(), 0);
    for (int i = 1; i < W(); ++i) base[i] = base[i - 1] + host[i - 1];
    const size_t total = static_cast<size_t>(base[W() - 1] + host[W() - 1]);
    cuda_ok(cudaMemcpy(row_base.p, base.data(), base.size() * 8, cudaMemcpyHostToDevice),
            "row_base");
    Rows o = rows(total, false);
    unpack(s, in, false, counts, &row_base, o);
    sync_check();
    for (int d = 0; d < W() && r_ == s.who; ++d)
      if (d != r_ && host[d] > 0) {
        --host[d];
        cuda_ok(cudaMemcpy(counts.p, host.data(), host.size() * 4, cudaMemcpyHostToDevice),
                "counts");
        break;
      }
    Dev y(total * H() * 2, 0), tc(sizeof(pc::CallTicket), 0), out(in.T * H() * 2ul);
    tx_.combine_send(tc.as<pc::CallTicket>(), 2, y.p, counts.as<int32_t>(), row_base.as<int64_t>(),
                     nullptr, nullptr, nullptr, stream_);
    tx_.combine_recv(tc.as<pc::CallTicket>(), in.send_token->as<int32_t>(),
                     in.send_count->as<int32_t>(), in.T, out.p, s.timeout_s, stream_);
    sync_check();
    return false;
  }

  // `who` makes a low-latency dispatch while the others make a normal one.
  bool mismatch(const Step& s) {
    Send in = inputs(s);
    send(in, r_ == s.who ? 3 : 1);
    Dev counts(static_cast<size_t>(W()) * 4);
    tx_.wait_counts(in.ticket->as<pc::CallTicket>(), counts.as<int32_t>(), s.timeout_s, false,
                    stream_);
    sync_check();
    return false;
  }

  const Case& c_;
  int r_;
  pc::CudaTransport& tx_;
  cudaStream_t stream_;
  std::ofstream log_;
};

int run_rank(const Case& c, int r, const std::string& prefix) {
  const int W = c.cfg.world;
  bool need_host = false;
  for (int s = 0; s < W; ++s) need_host |= s != r && c.send[s][r] == 1;
  auto* scratch = static_cast<Scratch*>(emu_rt::scratch());
  int status = 0;
  {
    pc::CudaTransport tx(prefix, r, c.cfg, 0, c.local[r], need_host, -1);
    const std::string h = tx.ipc_handle();
    std::memcpy(scratch->handles[r], h.data(), 64);
    barrier(W);
    std::vector<std::string> handles(W);
    for (int s = 0; s < W; ++s) handles[s].assign(scratch->handles[s], 64);
    std::vector<int32_t> recv(W);
    for (int s = 0; s < W; ++s) recv[s] = c.send[s][r];
    tx.open_peers(handles, c.send[r], recv, c.order[r]);
    tx.set_placement(c.offset, c.replica_rank, c.replica_local, c.choice_offset[r], c.choice[r]);
    barrier(W);
    tx.unlink_own();
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    Rank rank(c, r, tx, stream);
    for (const Step& s : c.steps)
      if (!rank.run(s)) break;
    barrier(W);  // peers stop writing into this rank's memory before it closes
    tx.close();
    cuda_ok(cudaStreamDestroy(stream), "cudaStreamDestroy");
  }
  const std::string leaks = emu_rt::leak_report();
  if (!leaks.empty()) {
    std::fprintf(stderr, "rank %d: resources left after close(): %s\n", r, leaks.c_str());
    status = 4;
  }
  return status;
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
  // Segment names carry this process's pid, as pcie_a2a's do (tests/conftest.py checks
  // that no segment outlives its creator).
  const std::string prefix = "pcie_a2a." + std::to_string(getpid()) + "_emu";
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
        status = run_rank(c, r, prefix);
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
      std::fprintf(stderr, "transport_emu: rank %d failed with status %d; stopping the others\n", r,
                   code);
      for (const pid_t p : pids)
        if (p > 0) kill(p, SIGKILL);
    }
  }
  for (int r = 0; r < W; ++r)  // a rank that failed leaves its host segment linked
    if (pc::CudaTransport::unlink_name(pc::CudaTransport::segment_name(prefix, r)) && result == 0) {
      std::fprintf(stderr, "transport_emu: rank %d's host segment outlived close()\n", r);
      result = 5;
    }
  return result;
}
