// Runs the CUDA transport (csrc/cuda/transport: the kernels *and* class CudaTransport) on the
// CPU: W rank processes, forked from this one, share a device arena (tests/native/emu/
// emu_runtime.h) the way ranks on one GPU share device memory through CUDA IPC, and map
// each other's host staging segments through real POSIX shared memory. With `inprocess 1`
// the W transports live in this one process instead (open_local: the tables take each
// other's pointers, no IPC), each with its own stream, and the calls of all ranks are
// issued phase by phase (every send, then every receive), as the in-process GPU harness
// (tests/test_cuda_inprocess.py) issues them.
//
//   transport_emu DIR
//
// DIR/case.txt (whitespace-separated records, written by tests/test_cuda_transport_
// emulation.py):
//   config W H M K PAYLOAD DTYPE REGION_MB      WireConfig codes, arena MiB per rank
//   offset N v..  /  replica_rank N v..  /  replica_local N v..   placement CSR
//   choice_offset R N v..  /  choice R N v..    rank R's replica choice row (optional)
//   local_experts v.. (W)                       num_local_experts per rank
//   send R v.. (W)                              rank R's pair plan: 0 P2P, 1 staged, 2 P2P
//                                               pulled by the receiver (pull.cuh)
//   order R v.. (W)                             rank R's send order
//   options INPROCESS MAX_RECV_BLOCKS PROBE_MS CLOSE_MS
//   step I KIND WHO CE_DISPATCH CE_COMBINE RAW TIMEOUT_MS
//   shape I R T TOPK                            rank R's tokens in step I
// KIND: ll_rows | ll_em | graph_rows | graph_em | normal | abort | abort_combine |
// abort_silent | skip | only0 | mismatch | count_mismatch | bad_ids | exit | two_in_flight.
// two_in_flight: two low-latency dispatches of the step's inputs sent back to back, then both
// received (a deferred receive, as with DeepEP's receive hook); no combine. EMU_SLOW_RANK=R
// makes rank R sleep EMU_SLOW_MS (default 300) before its sends and before its receives of
// such a step: a slow reader and a slow sender for its peers.
// CE_*: copy-engine min_bytes of the normal mode's dispatch / combine (-1: warp stores
// only). RAW: unpack fp8 rows as raw bytes and scales. WHO: the rank that aborts, skips,
// calls another op, passes bad ids (its transport reports them at the end of the step, as
// the Buffer's next call does) or exits without closing (abort_silent: the last rank never
// calls).
// graph_*: the first such step of a run captures the low-latency dispatch (send + receive)
// and combine (send + receive) of its shapes in two CUDA graphs; every graph_* step copies
// its inputs into the captured buffers and launches the graphs.
// Inputs: DIR/s<I>.r<R>.{x,ids,w,y} (raw bytes; y: the combine input, from the reference;
// ids64: int64 ids instead of x's int32 ids file when present).
// Outputs: DIR/s<I>.r<R>.<buffer> and DIR/s<I>.r<R>.txt ("error KIND MESSAGE", "ce_dispatch
// MASK", "ce_combine MASK", "ce_flag PATH", "elapsed_ms N", "slots DISPATCH COMBINE",
// "counts HALF LAUNCHES SYNCS PDL", "stats CALLS FAMILY ROWS.."), DIR/r<R>.txt ("probe
// STATUS..", "close OK|LEAKED"). Exit status: 0, or the first failing rank's (1 unexpected
// exception, 2 bad input files or a failed CUDA call of the driver, 3 emulation fault, 4
// resources left after close() beyond a leaked segment it reported), when one fails the
// others are killed; 5 when a host segment was still linked after every rank closed.
//
// Each step issues exactly the CudaTransport calls that pcie_a2a.transport.cuda makes for it
// (tickets are 16-byte device buffers, one stream per rank); no barrier separates steps
// or precedes close() (its two phases synchronise the ranks), so ranks run ahead of each
// other as far as the protocol lets them.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/exception.h"
#include "cuda/transport/cuda_transport.cuh"

namespace pc = pa2a::cuda;

namespace {

constexpr uint64_t kNonce = 0x5eed1234abcd0001ull;

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
  bool inprocess = false;
  int32_t max_recv_blocks = 0;
  double probe_s = 5.0, close_s = 30.0;
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
    } else if (key == "options") {
      int inproc;
      double probe_ms, close_ms;
      in >> inproc >> c.max_recv_blocks >> probe_ms >> close_ms;
      c.inprocess = inproc != 0;
      c.probe_s = probe_ms / 1000.0;
      c.close_s = close_ms / 1000.0;
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
using DevP = std::unique_ptr<Dev>;

std::string path(const Step& s, int r, const std::string& name) {
  return g_dir + "/s" + std::to_string(s.idx) + ".r" + std::to_string(r) + "." + name;
}

std::string read_file(const std::string& p, size_t bytes) {
  std::ifstream in(p, std::ios::binary | std::ios::ate);
  if (!in) die("missing input " + p);
  const size_t n = static_cast<size_t>(in.tellg());
  if (n != bytes)
    die(p + " has " + std::to_string(n) + " bytes, expected " + std::to_string(bytes));
  std::string host(n, '\0');
  in.seekg(0);
  in.read(host.data(), static_cast<std::streamsize>(n));
  return host;
}

// Copies the input file (which must have d.n bytes) into a device buffer.
void upload_into(const Step& s, int r, const std::string& name, const Dev& d) {
  const std::string host = read_file(path(s, r, name), d.n);
  cuda_ok(cudaMemcpy(d.p, host.data(), d.n, cudaMemcpyHostToDevice), "upload");
}

DevP upload(const Step& s, int r, const std::string& name, size_t bytes) {
  auto d = std::make_unique<Dev>(bytes);
  upload_into(s, r, name, *d);
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

bool file_exists(const std::string& p) {
  std::ifstream in(p);
  return static_cast<bool>(in);
}

// What the device counted between two points (launches, host synchronisations, PDL).
struct Counter {
  emu_rt::Counts start = emu_rt::st.counts;
  std::string line(const char* half) const {
    const emu_rt::Counts& now = emu_rt::st.counts;
    return std::string("counts ") + half + " " + std::to_string(now.launches - start.launches) +
           " " + std::to_string(now.syncs - start.syncs) + " " +
           std::to_string(now.pdl_launches - start.pdl_launches) + "\n";
  }
};

// ---- one rank ----------------------------------------------------------------------------
class Rank {
 public:
  Rank(const Case& c, int r, pc::CudaTransport& tx, cudaStream_t stream)
      : c_(c), r_(r), tx_(tx), stream_(stream) {}

  // The phases of step s (the caller runs them in order; the in-process driver runs phase
  // p of every rank before phase p + 1 of any). A phase returns false once the transport
  // is broken (no further phases or steps).
  std::vector<std::function<void()>> phases(const Step& s) {
    const std::string& k = s.kind;
    if (k == "ll_rows" || k == "ll_em") return ll_phases(s, k == "ll_em");
    if (k == "bad_ids") {  // ll_rows, and the error word is read after the step
      auto p = ll_phases(s, false);
      defer_check_ = r_ == s.who;
      p.push_back([this] {
        defer_check_ = false;
        tx_.check();
      });
      return p;
    }
    if (k == "exit")
      return {[this, &s] {
        if (r_ == s.who) std::_Exit(0);  // gone without close(): no close mark
      }};
    if (k == "graph_rows" || k == "graph_em") return graph_phases(s, k == "graph_em");
    if (k == "normal") return {[this, &s] { normal(s); }};
    if (k == "abort") return {[this, &s] { abort(s); }};
    if (k == "abort_combine") return {[this, &s] { abort_combine(s); }};
    if (k == "skip") return {[this, &s] { skip(s, r_ == s.who); }};
    if (k == "only0") return {[this, &s] { skip(s, r_ != 0); }};  // every other rank is silent
    if (k == "mismatch") return {[this, &s] { mismatch(s); }};
    if (k == "abort_silent") return {[this, &s] { abort_silent(s); }};
    if (k == "count_mismatch") return {[this, &s] { count_mismatch(s); }};
    if (k == "two_in_flight") return {[this, &s] { two_in_flight(s); }};
    die("unknown step kind " + k);
  }

  void begin(const Step& s) {
    log_.open(path(s, r_, "txt"));
    log_ << "slots " << tx_.layout().dispatch_slot << " " << tx_.layout().combine_slot << "\n";
    t0_ = std::chrono::steady_clock::now();
    stop_ = false;
  }
  // Runs one phase; exceptions of the transport are the step's result.
  void run(const std::function<void()>& phase) {
    if (stop_) return;
    try {
      phase();
    } catch (const pa2a::Error& e) {
      log_ << "error " << static_cast<int>(e.kind()) << " " << e.what() << "\n";
      stop_ = true;
      broken_ = e.kind() != pa2a::Error::Kind::kAborted && e.kind() != pa2a::Error::Kind::kValue;
    }
  }
  // false once the transport is broken.
  bool end() {
    const auto dt = std::chrono::steady_clock::now() - t0_;
    log_ << "elapsed_ms " << std::chrono::duration_cast<std::chrono::milliseconds>(dt).count()
         << "\n";
    log_.close();
    return !broken_;
  }
  void quit() { broken_ = true; }  // the step says this rank stops here

 private:
  int W() const { return c_.cfg.world; }
  int M() const { return c_.cfg.max_tokens; }
  int H() const { return c_.cfg.hidden; }
  int K() const { return c_.cfg.num_topk; }
  int E() const { return c_.local[r_]; }
  size_t cap() const { return static_cast<size_t>(W()) * M(); }

  void sync_check() {
    cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    if (!defer_check_) tx_.check();
  }

  struct Send {
    DevP x, ids, w, send_token, send_count, ticket;
    bool ids64 = false;
    int T = 0, k = 0;
  };

  Send inputs(const Step& s) {
    Send in;
    in.T = s.tokens[r_];
    in.k = s.topk[r_];
    const size_t T = static_cast<size_t>(in.T), k = static_cast<size_t>(in.k);
    in.x = upload(s, r_, "x", T * H() * 2);
    in.ids64 = file_exists(path(s, r_, "ids64"));
    in.ids = in.ids64 ? upload(s, r_, "ids64", T * k * 8) : upload(s, r_, "ids", T * k * 4);
    in.w = upload(s, r_, "w", T * k * 4);
    in.send_token = std::make_unique<Dev>(cap() * 4);
    in.send_count = std::make_unique<Dev>(static_cast<size_t>(W()) * 4);
    in.ticket = std::make_unique<Dev>(sizeof(pc::CallTicket));  // torch.empty: the kernel writes it
    return in;
  }

  void send(Send& in, uint32_t op) {
    tx_.dispatch_send(in.ticket->as<pc::CallTicket>(), op, in.x->p, in.T, in.ids->p, in.ids64,
                      in.w->as<float>(), in.k, in.send_token->as<int32_t>(),
                      in.send_count->as<int32_t>(), stream_);
  }

  // Rows-layout outputs for `rows` rows.
  struct Rows {
    DevP x, fp8, scales, src_rank, src_token, ids, ws, per_expert;
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
  void dump_send_side(const Step& s, Send& in) {
    dump(s, r_, "send_count", *in.send_count);
    dump(s, r_, "send_token", *in.send_token);
  }
  void log_stats() {
    const pc::TransportStats st = tx_.stats();
    log_ << "stats " << st.calls << " " << st.last_family;
    for (const uint32_t n : st.last_rows) log_ << " " << n;
    log_ << "\n";
  }

  // Expert-major outputs.
  struct Em {
    DevP xo, fp8, scales, per_expert, src_info, layout_range, expert_pos, row_experts, row_weights;
  };
  Em em_outputs(bool raw) {
    Em o;
    const size_t E = static_cast<size_t>(this->E()), H = static_cast<size_t>(this->H());
    const size_t K = static_cast<size_t>(this->K());
    if (raw) {
      o.fp8 = std::make_unique<Dev>(E * cap() * H);
      o.scales = std::make_unique<Dev>(E * cap() * (H / 128) * 4);
    } else {
      o.xo = std::make_unique<Dev>(E * cap() * H * 2);
    }
    o.per_expert = std::make_unique<Dev>(E * 4);
    o.src_info = std::make_unique<Dev>(E * cap() * 4);
    o.layout_range = std::make_unique<Dev>(E * W() * 8);
    o.expert_pos = std::make_unique<Dev>(cap() * K * 4);
    o.row_experts = std::make_unique<Dev>(cap() * K * 4);
    o.row_weights = std::make_unique<Dev>(cap() * K * 4);
    return o;
  }
  void em_unpack(const Step& s, Send& in, const Dev& counts, Em& o) {
    tx_.unpack_expert_major(in.ticket->as<pc::CallTicket>(), counts.as<int32_t>(),
                            o.xo ? o.xo->p : nullptr, o.fp8 ? o.fp8->as<uint8_t>() : nullptr,
                            o.scales ? o.scales->as<float>() : nullptr, o.per_expert->as<int32_t>(),
                            o.src_info->as<int32_t>(), o.layout_range->as<int64_t>(),
                            o.expert_pos->as<int32_t>(), o.row_experts->as<int32_t>(),
                            o.row_weights->as<float>(), s.timeout_s, stream_);
  }
  void dump_em(const Step& s, const Em& o) {
    if (o.xo) dump(s, r_, "xo", *o.xo);
    if (o.fp8) dump(s, r_, "fp8", *o.fp8);
    if (o.scales) dump(s, r_, "scales", *o.scales);
    dump(s, r_, "per_expert", *o.per_expert);
    dump(s, r_, "src_info", *o.src_info);
    dump(s, r_, "layout_range", *o.layout_range);
    dump(s, r_, "expert_pos", *o.expert_pos);
    dump(s, r_, "row_experts", *o.row_experts);
    dump(s, r_, "row_weights", *o.row_weights);
  }
  void em_combine_send(const Dev& ticket, const Dev& y, const Dev& counts, const Em& o) {
    tx_.combine_send(ticket.as<pc::CallTicket>(), 4, y.p, counts.as<int32_t>(), nullptr,
                     o.expert_pos->as<int32_t>(), o.row_experts->as<int32_t>(),
                     o.row_weights->as<float>(), stream_);
  }

  // ---- low latency: exactly Buffer.low_latency_dispatch / low_latency_combine on the CUDA
  // backend (rows: dispatch_send + unpack_rows(wait); expert-major: dispatch_send +
  // unpack_expert_major; combine: combine_send (+ the fused pre-reduction) + combine_recv),
  // counted; the expert-major step also runs the pre-reduction alone (reduce_expert_major)
  // and checks it, outside the counts.
  struct Ll {
    Send in;
    DevP counts, y, tc, out, reduced;
    Rows o;
    Em em;
    Counter count;
  };
  std::vector<std::function<void()>> ll_phases(const Step& s, bool em) {
    auto st = std::make_shared<Ll>();
    return {
        [this, &s, st, em] {  // send
          st->in = inputs(s);
          st->counts = std::make_unique<Dev>(static_cast<size_t>(W()) * 4);
          if (em)
            st->em = em_outputs(s.raw);
          else
            st->o = rows(cap(), s.raw);
          st->count = Counter();
          send(st->in, 3);
        },
        [this, &s, st, em] {  // receive
          if (em)
            em_unpack(s, st->in, *st->counts, st->em);
          else
            unpack(s, st->in, true, *st->counts, nullptr, st->o);
          log_ << st->count.line("dispatch");
          sync_check();
          dump(s, r_, "counts", *st->counts);
          if (em)
            dump_em(s, st->em);
          else
            dump_rows(s, st->o);
          const size_t y_rows = em ? static_cast<size_t>(E()) * cap() : cap();
          st->y = upload(s, r_, "y", y_rows * H() * 2);
          if (em) {
            st->reduced = std::make_unique<Dev>(cap() * H() * 2);
            tx_.reduce_expert_major(st->y->p, st->counts->as<int32_t>(),
                                    st->em.expert_pos->as<int32_t>(),
                                    st->em.row_experts->as<int32_t>(),
                                    st->em.row_weights->as<float>(), st->reduced->p, stream_);
            sync_check();
            dump(s, r_, "reduced", *st->reduced);
          }
        },
        [this, st, em] {  // combine send
          st->tc = std::make_unique<Dev>(sizeof(pc::CallTicket));
          st->out = std::make_unique<Dev>(static_cast<size_t>(st->in.T) * H() * 2 + 16);
          st->count = Counter();
          if (em)
            em_combine_send(*st->tc, *st->y, *st->counts, st->em);
          else
            tx_.combine_send(st->tc->as<pc::CallTicket>(), 4, st->y->p, st->counts->as<int32_t>(),
                             nullptr, nullptr, nullptr, nullptr, stream_);
        },
        [this, &s, st] {  // combine receive
          tx_.combine_recv(st->tc->as<pc::CallTicket>(), st->in.send_token->as<int32_t>(),
                           st->in.send_count->as<int32_t>(), st->in.T, st->out->p, s.timeout_s,
                           stream_);
          log_ << st->count.line("combine");
          sync_check();
          dump(s, r_, "out", st->out->p, static_cast<size_t>(st->in.T) * H() * 2);
          dump_send_side(s, st->in);
          log_stats();
        },
    };
  }

  // Two dispatches in flight (see the top comment). The second one's rows are dumped with
  // the prefix "b_" (the same inputs: the same rows).
  void two_in_flight(const Step& s) {
    const char* slow = std::getenv("EMU_SLOW_RANK");
    const char* ms = std::getenv("EMU_SLOW_MS");
    const auto nap = [&] {
      if (slow != nullptr && std::atoi(slow) == r_)
        std::this_thread::sleep_for(std::chrono::milliseconds(ms != nullptr ? std::atoi(ms) : 300));
    };
    nap();
    Send a = inputs(s), b = inputs(s);
    Dev ca(static_cast<size_t>(W()) * 4), cb(static_cast<size_t>(W()) * 4);
    Rows oa = rows(cap(), s.raw), ob = rows(cap(), s.raw);
    send(a, 3);
    send(b, 3);
    nap();
    unpack(s, a, true, ca, nullptr, oa);
    unpack(s, b, true, cb, nullptr, ob);
    sync_check();
    dump(s, r_, "counts", ca);
    dump_rows(s, oa);
    dump_send_side(s, a);
    dump(s, r_, "b_counts", cb);
    dump(s, r_, "b_src_token", *ob.src_token);
    dump(s, r_, "b_ids_o", *ob.ids);
    if (ob.x) dump(s, r_, "b_xo", *ob.x);
    if (ob.fp8) dump(s, r_, "b_fp8", *ob.fp8);
  }

  // ---- the same, captured once in two graphs (dispatch, combine) and replayed per step
  struct Graphs {
    Ll ll;
    cudaGraphExec_t dispatch = nullptr, combine = nullptr;
    ~Graphs() {
      if (dispatch != nullptr) cuda_ok(cudaGraphExecDestroy(dispatch), "cudaGraphExecDestroy");
      if (combine != nullptr) cuda_ok(cudaGraphExecDestroy(combine), "cudaGraphExecDestroy");
    }
  };
  template <typename F>
  cudaGraphExec_t capture(F&& issue) {
    cudaGraph_t g;
    cuda_ok(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin capture");
    issue();
    cuda_ok(cudaStreamEndCapture(stream_, &g), "end capture");
    cudaGraphExec_t exec;
    cuda_ok(cudaGraphInstantiate(&exec, g, 0), "instantiate");
    cuda_ok(cudaGraphDestroy(g), "graph destroy");
    return exec;
  }
  std::vector<std::function<void()>> graph_phases(const Step& s, bool em) {
    return {
        [this, &s, em] {
          if (!graphs_) {  // capture with this step's shapes; inputs are copied in below
            graphs_ = std::make_unique<Graphs>();
            Ll& ll = graphs_->ll;
            ll.in = inputs(s);
            ll.counts = std::make_unique<Dev>(static_cast<size_t>(W()) * 4);
            if (em)
              ll.em = em_outputs(s.raw);
            else
              ll.o = rows(cap(), s.raw);
            const size_t y_rows = em ? static_cast<size_t>(E()) * cap() : cap();
            ll.y = std::make_unique<Dev>(y_rows * H() * 2);
            ll.tc = std::make_unique<Dev>(sizeof(pc::CallTicket));
            ll.out = std::make_unique<Dev>(static_cast<size_t>(ll.in.T) * H() * 2 + 16);
            graphs_->dispatch = capture([&] {
              send(ll.in, 3);
              if (em)
                em_unpack(s, ll.in, *ll.counts, ll.em);
              else
                unpack(s, ll.in, true, *ll.counts, nullptr, ll.o);
            });
            graphs_->combine = capture([&] {
              if (em)
                em_combine_send(*ll.tc, *ll.y, *ll.counts, ll.em);
              else
                tx_.combine_send(ll.tc->as<pc::CallTicket>(), 4, ll.y->p, ll.counts->as<int32_t>(),
                                 nullptr, nullptr, nullptr, nullptr, stream_);
              tx_.combine_recv(ll.tc->as<pc::CallTicket>(), ll.in.send_token->as<int32_t>(),
                               ll.in.send_count->as<int32_t>(), ll.in.T, ll.out->p, s.timeout_s,
                               stream_);
            });
          }
          Ll& ll = graphs_->ll;
          upload_into(s, r_, "x", *ll.in.x);
          upload_into(s, r_, ll.in.ids64 ? "ids64" : "ids", *ll.in.ids);
          upload_into(s, r_, "w", *ll.in.w);
          const Counter count;
          cuda_ok(cudaGraphLaunch(graphs_->dispatch, stream_), "graph launch");
          log_ << count.line("dispatch");
          sync_check();
          dump(s, r_, "counts", *ll.counts);
          if (em)
            dump_em(s, ll.em);
          else
            dump_rows(s, ll.o);
          upload_into(s, r_, "y", *ll.y);
          const Counter count2;
          cuda_ok(cudaGraphLaunch(graphs_->combine, stream_), "graph launch");
          log_ << count2.line("combine");
          sync_check();
          dump(s, r_, "out", ll.out->p, static_cast<size_t>(ll.in.T) * H() * 2);
          dump_send_side(s, ll.in);
        },
    };
  }

  // Normal mode as transport.cuda's dispatch_send / wait / unpack_rows / combine_send /
  // combine_recv: host counts, compacted rows, optionally the copy-engine path.
  void normal(const Step& s) {
    Send in = inputs(s);
    if (s.ce_dispatch >= 0) {
      tx_.dispatch_send_ce(in.ticket->as<pc::CallTicket>(), 1, in.x->p, in.T, in.ids->p, in.ids64,
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
    Dev tc(sizeof(pc::CallTicket));
    if (s.ce_combine >= 0) {
      tx_.combine_send_ce(tc.as<pc::CallTicket>(), 2, y->p, counts.as<int32_t>(),
                          row_base.as<int64_t>(), host, base, static_cast<uint64_t>(s.ce_combine),
                          stream_);
      log_ << "ce_combine " << tx_.last_ce_mask() << "\n";
    } else {
      tx_.combine_send(tc.as<pc::CallTicket>(), 2, y->p, counts.as<int32_t>(),
                       row_base.as<int64_t>(), nullptr, nullptr, nullptr, stream_);
    }
    if (s.ce_dispatch >= 0 || s.ce_combine >= 0) log_ << "ce_flag " << tx_.ce_flag_path() << "\n";
    Dev out(static_cast<size_t>(in.T) * H() * 2 + 16);
    tx_.combine_recv(tc.as<pc::CallTicket>(), in.send_token->as<int32_t>(),
                     in.send_count->as<int32_t>(), in.T, out.p, s.timeout_s, stream_);
    sync_check();
    dump(s, r_, "out", out.p, static_cast<size_t>(in.T) * H() * 2);
    dump_send_side(s, in);
  }

  // transport.cuda abort: publish abort flags, then still receive the call (tolerant wait).
  void abort_call(const Step& s, uint32_t op, int family) {
    Dev ticket(sizeof(pc::CallTicket)), counts(static_cast<size_t>(W()) * 4);
    tx_.abort(ticket.as<pc::CallTicket>(), op, family, stream_);
    tx_.wait_counts(ticket.as<pc::CallTicket>(), counts.as<int32_t>(), s.timeout_s, true, stream_);
    sync_check();
  }

  // `who` aborts a normal dispatch; the others send and wait (and raise PeerAbortedError).
  void abort(const Step& s) {
    if (r_ == s.who) {
      abort_call(s, 1, 0);
      return;
    }
    send_and_wait(s);
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
  void abort_combine(const Step& s) {
    if (r_ == s.who) {
      abort_call(s, 2, 1);
      return;
    }
    Dev y(16), zeros(static_cast<size_t>(W()) * 4, 0), send_token(static_cast<size_t>(W()) * 4);
    Dev ticket(sizeof(pc::CallTicket)), out(16);
    tx_.combine_send(ticket.as<pc::CallTicket>(), 2, y.p, zeros.as<int32_t>(), nullptr, nullptr,
                     nullptr, nullptr, stream_);
    tx_.combine_recv(ticket.as<pc::CallTicket>(), send_token.as<int32_t>(), zeros.as<int32_t>(), 0,
                     out.p, s.timeout_s, stream_);
    sync_check();
  }

  // `silent` ranks never make this call: the others' low-latency receive must time out
  // naming the first of them.
  void skip(const Step& s, bool silent) {
    quit();
    if (silent) return;
    Send in = inputs(s);
    Dev counts(static_cast<size_t>(W()) * 4);
    Rows o = rows(cap(), false);
    send(in, 3);
    unpack(s, in, true, counts, nullptr, o);
    sync_check();
  }

  // `who` aborts a dispatch while the last rank never makes it: every waiting rank must
  // time out naming the silent rank (an abort must not hide a peer that never came).
  void abort_silent(const Step& s) {
    quit();
    if (r_ == W() - 1) return;
    if (r_ == s.who) {
      abort_call(s, 1, 0);
      return;
    }
    send_and_wait(s);
  }

  // A normal dispatch, then `who` returns one row fewer than it received from the first
  // other rank that sent it any: that rank's combine_recv must report the mismatch.
  void count_mismatch(const Step& s) {
    quit();
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
    Dev y(total * H() * 2 + 16, 0), tc(sizeof(pc::CallTicket)), out(in.T * H() * 2ul + 16);
    tx_.combine_send(tc.as<pc::CallTicket>(), 2, y.p, counts.as<int32_t>(), row_base.as<int64_t>(),
                     nullptr, nullptr, nullptr, stream_);
    tx_.combine_recv(tc.as<pc::CallTicket>(), in.send_token->as<int32_t>(),
                     in.send_count->as<int32_t>(), in.T, out.p, s.timeout_s, stream_);
    sync_check();
  }

  // `who` makes a low-latency dispatch while the others make a normal one.
  void mismatch(const Step& s) {
    quit();
    Send in = inputs(s);
    send(in, r_ == s.who ? 3 : 1);
    Dev counts(static_cast<size_t>(W()) * 4);
    tx_.wait_counts(in.ticket->as<pc::CallTicket>(), counts.as<int32_t>(), s.timeout_s, false,
                    stream_);
    sync_check();
  }

  const Case& c_;
  int r_;
  pc::CudaTransport& tx_;
  cudaStream_t stream_;
  std::ofstream log_;
  std::chrono::steady_clock::time_point t0_;
  bool stop_ = false, broken_ = false, defer_check_ = false;
  std::unique_ptr<Graphs> graphs_;
};

std::vector<int32_t> recv_plan(const Case& c, int r) {
  std::vector<int32_t> recv(c.cfg.world);
  for (int s = 0; s < c.cfg.world; ++s) recv[s] = c.send[s][r];
  return recv;
}

bool with_pull(const Case& c) {
  for (const auto& row : c.send)
    for (const int32_t v : row)
      if (v == 2) return true;
  return false;
}

// The send kernels' consumed wait: the longest step timeout.
double send_timeout(const Case& c) {
  double t = 0;
  for (const Step& s : c.steps) t = s.timeout_s > t ? s.timeout_s : t;
  return t > 0 ? t : 30.0;
}

bool needs_host(const Case& c, int r) {
  bool need = false;
  for (int s = 0; s < c.cfg.world; ++s) need |= s != r && c.send[s][r] == 1;
  return need;
}

void log_probe(int r, const std::vector<int32_t>& status) {
  std::ofstream out(g_dir + "/r" + std::to_string(r) + ".txt", std::ios::app);
  out << "probe";
  for (const int32_t v : status) out << " " << v;
  out << "\n";
}

void log_close(int r, bool ok) {
  std::ofstream out(g_dir + "/r" + std::to_string(r) + ".txt", std::ios::app);
  out << "close " << (ok ? "OK" : "LEAKED") << "\n";
}

// What a rank may still hold after close(): nothing, or (when it reported that a peer's
// close mark never came) exactly its device segment. Returns an exit status.
int check_leaks(int r, bool leaked, size_t segment_bytes) {
  const std::string leaks = emu_rt::leak_report();
  const std::string segment = "device allocation of " + std::to_string(segment_bytes) + " bytes; ";
  if (leaks.empty() || (leaked && leaks == segment)) return 0;
  std::fprintf(stderr, "rank %d: resources left after close(): %s\n", r, leaks.c_str());
  return 4;
}

int run_rank(const Case& c, int r, const std::string& prefix) {
  const int W = c.cfg.world;
  auto* scratch = static_cast<Scratch*>(emu_rt::scratch());
  bool leaked = false;
  size_t segment_bytes = 0;
  {
    pc::CudaTransport tx(prefix, r, c.cfg, 0, c.local[r], needs_host(c, r), -1, c.max_recv_blocks,
                         true, with_pull(c), send_timeout(c));
    segment_bytes = tx.segment_bytes();
    const std::string h = tx.ipc_handle();
    std::memcpy(scratch->handles[r], h.data(), 64);
    barrier(W);
    std::vector<std::string> handles(W);
    for (int s = 0; s < W; ++s) handles[s].assign(scratch->handles[s], 64);
    tx.open_peers(handles, c.send[r], recv_plan(c, r), c.order[r], kNonce);
    tx.set_placement(c.offset, c.replica_rank, c.replica_local, c.choice_offset[r], c.choice[r]);
    const std::vector<int32_t> probe = tx.probe_peers(c.probe_s);
    log_probe(r, probe);
    bool ok = true;
    for (const int32_t v : probe) ok = ok && v == 0;
    barrier(W);
    tx.unlink_own();
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    {
      Rank rank(c, r, tx, stream);
      for (const Step& s : c.steps) {
        if (!ok) break;
        rank.begin(s);
        for (const auto& phase : rank.phases(s)) rank.run(phase);
        ok = rank.end();
      }
    }
    tx.close_imports();
    leaked = !tx.free_own(c.close_s);
    log_close(r, !leaked);
    cuda_ok(cudaStreamDestroy(stream), "cudaStreamDestroy");
  }
  return check_leaks(r, leaked, segment_bytes);
}

// W transports in this process, phase by phase over the ranks.
int run_inprocess(const Case& c, const std::string& prefix) {
  const int W = c.cfg.world;
  int status = 0;
  {
    std::vector<std::unique_ptr<pc::CudaTransport>> txs;
    std::vector<pc::CudaTransport*> peers;
    for (int r = 0; r < W; ++r) {
      txs.push_back(std::make_unique<pc::CudaTransport>(prefix, r, c.cfg, 0, c.local[r],
                                                        needs_host(c, r), -1, c.max_recv_blocks,
                                                        true, with_pull(c), send_timeout(c)));
      peers.push_back(txs.back().get());
    }
    for (int r = 0; r < W; ++r) {
      txs[r]->open_local(peers, c.send[r], recv_plan(c, r), c.order[r], kNonce);
      txs[r]->set_placement(c.offset, c.replica_rank, c.replica_local, c.choice_offset[r],
                            c.choice[r]);
      txs[r]->unlink_own();
    }
    std::vector<cudaStream_t> streams(W);
    for (auto& s : streams)
      cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    {
      std::vector<std::unique_ptr<Rank>> ranks;
      for (int r = 0; r < W; ++r)
        ranks.push_back(std::make_unique<Rank>(c, r, *txs[r], streams[r]));
      bool ok = true;
      for (const Step& s : c.steps) {
        if (!ok) break;
        std::vector<std::vector<std::function<void()>>> phases;
        for (int r = 0; r < W; ++r) {
          ranks[r]->begin(s);
          phases.push_back(ranks[r]->phases(s));
        }
        for (size_t p = 0; p < phases[0].size(); ++p)
          for (int r = 0; r < W; ++r) ranks[r]->run(phases[r][p]);
        for (int r = 0; r < W; ++r) ok = ranks[r]->end() && ok;
      }
    }
    for (auto& t : txs) t->close_imports();
    for (int r = 0; r < W; ++r) {
      const bool ok = txs[r]->free_own(c.close_s);
      log_close(r, ok);
      if (!ok) status = 4;  // every mark is written in this process: nothing may be left
    }
    for (auto& s : streams) cuda_ok(cudaStreamDestroy(s), "cudaStreamDestroy");
  }
  const std::string leaks = emu_rt::leak_report();
  if (!leaks.empty()) {
    std::fprintf(stderr, "in-process: resources left after close(): %s\n", leaks.c_str());
    status = 4;
  }
  return status;
}

// EMU_STAGED_GATE=R (the emulation's PTX model): the regions of a segment it watches, from
// the layout the transport uses, and its shared counters in the arena's scratch.
void setup_staged_gate(const Case& c) {
  const char* v = std::getenv("EMU_STAGED_GATE");
  if (v == nullptr || *v == '\0') return;
  if (c.cfg.world != 2 || c.inprocess) die("EMU_STAGED_GATE needs world 2, one process per rank");
  pa2a::SegmentLayout l = pa2a::segment_layout(c.cfg);
  pa2a::add_staged_progress(&l, c.cfg);
  pc::StagedGate& g = pc::staged_gate;
  g.held = std::atoi(v);
  g.flags_lo = l.flags_off;
  g.flags_hi = l.flags_off + 2 * 2 * pa2a::kFlagLineBytes;
  g.rows_lo = l.dispatch_off;
  g.rows_hi = l.combine_off;
  g.early_lo = l.progress_off;
  g.early_hi = l.progress_off + pa2a::chunk_mark_offset(c.cfg, 0, 0, 0);
  g.chunks_lo = g.early_hi;
  g.chunks_hi = l.total;
  g.consumed = reinterpret_cast<uint32_t*>(static_cast<char*>(emu_rt::scratch()) + (512u << 10));
  std::memset(g.consumed, 0, 2 * 64 * sizeof(uint32_t));
  g.last = reinterpret_cast<uint64_t*>(g.consumed + 2 * 64);
  g.last[0] = g.last[1] = 0;
  g.polled = g.last + 2;
  g.polled[0] = g.polled[1] = 0;
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
  int result = 0;
  if (c.inprocess) {
    emu_rt::arena_create(1, c.region_bytes * static_cast<size_t>(W));
    emu_rt::arena_enter(0, c.region_bytes * static_cast<size_t>(W));
    try {
      result = run_inprocess(c, prefix);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "in-process: unexpected exception: %s\n", e.what());
      result = 1;
    }
  } else {
    emu_rt::arena_create(W, c.region_bytes);
    setup_staged_gate(c);
    std::vector<pid_t> pids(W, -1);
    for (int r = 0; r < W; ++r) {
      std::fflush(nullptr);
      const pid_t pid = fork();
      if (pid < 0) die("fork failed");
      if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        emu_rt::arena_enter(r, c.region_bytes);
        pc::staged_gate.rank = r;
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
    int left = W;
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
        std::fprintf(stderr, "transport_emu: rank %d failed with status %d; stopping the others\n",
                     r, code);
        for (const pid_t p : pids)
          if (p > 0) kill(p, SIGKILL);
      }
    }
  }
  for (int r = 0; r < W; ++r)  // a rank that failed leaves its host segment linked
    if (pc::CudaTransport::unlink_name(pc::CudaTransport::segment_name(prefix, r)) && result == 0) {
      std::fprintf(stderr, "transport_emu: rank %d's host segment outlived close()\n", r);
      result = 5;
    }
  return result;
}
