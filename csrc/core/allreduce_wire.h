// Wire format of the PCIe all-reduce: segments, flags, chunking, and why reuse is safe.
//
// Hardware reason. The attention all-reduce of a tensor-parallel layer is small (14 KB per
// token of Kimi K2) and runs 61 times per token, so it is latency bound. On PCIe a posted
// write costs ~1 us one way, a read is a round trip, and peer atomics are a read then a
// write; stores of more than 8 bytes may arrive in pieces (NCCL's LL128 inline flags are
// unsafe here). So data and flags are separate: a producer stores its data, fences, then
// release-stores one 8-byte flag into the consumer's memory; consumers poll only their own
// memory; every location has exactly one writer; flags carry the call number (epoch) and
// are never reset.
//
// Algorithms (DESIGN.md section 8, field_2026.md section 3).
//   one-shot: every rank moves its whole vector to every peer and every rank sums all W
//     vectors itself: one flag hop, (W - 1) x S bytes out per rank. Small messages.
//   two-shot: reduce-scatter (rank d sums shard d of every vector), then all-gather (d
//     sends its summed shard to every peer): two flag hops, 2 (W - 1) / W x S bytes.
//   Above the crossover the communicator hands the call to NCCL (gloo on the CPU).
// Per ordered pair (s -> r) the data moves by push (s stores into r's segment) or pull
// (s stores into its *own* segment, once for all pulling peers, and r loads from there);
// the flag always goes s -> r. Direction comes from the probe (python/pcie_a2a/allreduce).
//
// Segment of rank r (device memory for the CUDA path, POSIX shared memory for the CPU one):
//   [SegmentHeader 4 KiB]
//   [flags: 3 phases x 2 parities x kMaxBlocks blocks x world sources x 8 bytes]
//   [data: buffers x world sources x max_bytes]       one-shot vectors, two-shot shards
//   [gather: buffers x max_bytes]                     two-shot summed shards
// buffers = 2 (parity double-buffering, the default) or 1 (end-barrier mode).
// Flag (phase, parity, b, s) of r holds (seq << 32 | info) for call seq, block b, source s.
// Phases: kScatter (data of one-shot, shards of two-shot), kGather (two-shot summed
// shards), kDone (the end barrier). info = kAbortInfo (the source raised before the call)
// or the call's tag: algorithm, dtype and element count, so that ranks that disagree on
// the call get an error naming the peer instead of summing mismatched bytes.
//
// Who writes what (one writer per location):
//   * data [buf][s][*] of any segment: only rank s (push: into r's segment; pull: into its
//     own segment, slot s, which no one else writes);
//   * gather [buf][shard d] of any segment: only rank d, the owner of shard d;
//   * flag (*, *, *, s) of r: only rank s; read only by r.
// Chunking (block_range / shard_piece below) is a pure function of the element count, the
// world and the algorithm, so every rank agrees on it; block b of a call reads and writes
// only its own chunk and waits only for block b of its peers (no dependency inside a grid).
//
// Ownership across calls (eager calls and CUDA-graph replays alike).
//   (1) Every call is a complete exchange: every rank sends at least one flag (block 0) of
//       phase kScatter to every other rank. (Calls above the crossover take no part: every
//       rank decides that from the same element count.)
//   (2) A rank starts call n + 1 only after it has finished reading everything of call n,
//       in its own segment and in its peers' (pull): its calls run in stream order (CUDA) or
//       one after another (CPU), and a call's reads end before it returns.
//   From (1) and (2): if rank s has received any flag of call n + 1 from rank r, then r has
//   finished reading call n. Parity mode: call n uses buffer n % 2. Rank s writes buffer
//   n % 2 again in call n + 2, which starts after s finished call n + 1, in which it waited
//   for flags of call n + 1 from every peer (every peer sends them, (1)); so every reader of
//   call n is done. A faster rank runs at most one call ahead and then waits.
//   End-barrier mode: one buffer. After its last read of call n a rank release-stores a
//   kDone flag to every peer and does not finish call n before it has every peer's kDone of
//   call n. So when any rank starts call n + 1 every rank has finished reading call n.
//   Flags use parity seq % 2 in both modes (they carry seq, so a flag of call n + 2 can
//   never be taken for call n; parity keeps a flag of n + 1 from overwriting one of n
//   before its reader saw it).
//   Remove both fences and a fast rank's one-shot call n + 1 overwrites data a slow peer is
//   still summing for call n. (The two-shot would survive it: a peer finishes call n only
//   after our kGather flag, sent after our scatter reads, and writes our gather buffer in
//   call n + 1 only after our kScatter flag of n + 1, sent after all our reads of n. It uses
//   the same buffers and rules anyway, so that every call of any size follows one proof.) The
//   CUDA-graph trap (field_2026.md section 3: a barrier-free fused all-reduce corrupted hidden
//   states under replay) is a parity or call number frozen into the captured kernel arguments: here
//   both come from device memory the kernels advance (see cuda/allreduce/device.cuh).
//   Tests break the invariant on the CPU (single buffer, no barrier)
//   and in the emulation of the CUDA kernels (parity removed; barrier removed),
//   both by delaying one rank's reads.
//
// Aborts. A rank that raises before call n publishes kAbortInfo in every phase and block
// of that call and reads nothing; peers skip the call and raise PeerAbortedError. The
// aborted call still ends only when every peer has begun it (its block-0 kScatter flag of
// call n, data or abort): that wait is what makes (1) hold for an aborted call. Without it
// the aborting rank, having finished call n - 1 (which needs only that its peers *sent*
// call n - 1), runs call n + 1 at once and overwrites the flags and data of parity
// (n - 1) % 2 before a slow peer has read them: two calls ahead, a wrong sum or a timeout
// (the w2_abort_skew emulation scenario shows it). The wait costs a
// bad call the time until its peers arrive (at most the timeout).
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace pa2a::ar {

constexpr uint32_t kMagic = 0x52414150u;  // "PAAR"
constexpr uint32_t kVersion = 1;
constexpr int kMaxWorld = 16;       // PCIe boxes have up to ~10 GPUs per node
constexpr int kMaxBlocks = 64;      // chunks (CUDA blocks) of one call
constexpr int kVecBytes = 16;       // every chunk is whole 16-byte vectors
constexpr int kMinBlockVecs = 256;  // 4 KiB: a block is not worth less
constexpr size_t kHeaderBytes = 4096;
constexpr uint32_t kAbortInfo = 0xffffffffu;
constexpr int kPhases = 3;
constexpr int kScatter = 0, kGather = 1, kDone = 2;

enum class Algo : int32_t { kOneShot = 1, kTwoShot = 2 };

// The tag of a call in the low 32 bits of its flags: [31:30] algorithm, [29:28] dtype code
// (core/numeric.h DType), [27:0] element count (so max_bytes < 2^28 elements).
constexpr int64_t kMaxElements = (int64_t{1} << 28) - 1;
PA2A_HD uint32_t call_tag(Algo algo, int32_t dtype, int64_t numel) {
  return (static_cast<uint32_t>(algo) << 30) | ((static_cast<uint32_t>(dtype) & 3u) << 28) |
         static_cast<uint32_t>(numel & kMaxElements);
}
PA2A_HD uint64_t pack_flag(uint32_t seq, uint32_t info) {
  return (static_cast<uint64_t>(seq) << 32) | info;
}
PA2A_HD uint32_t flag_seq(uint64_t w) {
  return static_cast<uint32_t>(w >> 32);
}
PA2A_HD uint32_t flag_info(uint64_t w) {
  return static_cast<uint32_t>(w & 0xffffffffu);
}
PA2A_HD int32_t tag_algo(uint32_t info) {
  return static_cast<int32_t>(info >> 30);
}
PA2A_HD int32_t tag_dtype(uint32_t info) {
  return static_cast<int32_t>((info >> 28) & 3u);
}
PA2A_HD int64_t tag_numel(uint32_t info) {
  return static_cast<int64_t>(info & static_cast<uint32_t>(kMaxElements));
}

// Fixed at construction, identical on every rank (checked at bootstrap).
struct Config {
  int32_t world = 0;
  int32_t buffers = 2;    // 2: parity double-buffering; 1: end-barrier mode only
  int64_t max_bytes = 0;  // largest call, a multiple of kVecBytes
};

struct Layout {
  size_t flags_off, data_off, gather_off, total;
};

PA2A_HD Layout segment_layout(const Config& c) {
  const size_t w = static_cast<size_t>(c.world), m = static_cast<size_t>(c.max_bytes);
  const size_t nb = static_cast<size_t>(c.buffers);
  Layout l{};
  l.flags_off = kHeaderBytes;
  l.data_off = align_up(l.flags_off + kPhases * 2 * kMaxBlocks * w * 8, 4096);
  l.gather_off = align_up(l.data_off + nb * w * m, 4096);
  l.total = align_up(l.gather_off + nb * m, 4096);
  return l;
}

// The data buffer of a call (flags always use parity seq % 2, see the top comment).
PA2A_HD int data_buffer(const Config& c, uint32_t seq) {
  return c.buffers == 1 ? 0 : static_cast<int>(seq & 1u);
}
PA2A_HD int flag_parity(uint32_t seq) {
  return static_cast<int>(seq & 1u);
}

PA2A_HD size_t flag_offset(const Config& c, int phase, int parity, int block, int src) {
  return kHeaderBytes +
         (((static_cast<size_t>(phase) * 2 + parity) * kMaxBlocks + block) * c.world + src) * 8;
}
// Byte offset of source s's slot of buffer `buf` (vector v of the call is at + 16 v).
PA2A_HD size_t data_offset(const Config& c, const Layout& l, int buf, int src) {
  return l.data_off + (static_cast<size_t>(buf) * c.world + src) * static_cast<size_t>(c.max_bytes);
}
PA2A_HD size_t gather_offset(const Config& c, const Layout& l, int buf) {
  return l.gather_off + static_cast<size_t>(buf) * static_cast<size_t>(c.max_bytes);
}

// ---- chunking ---------------------------------------------------------------------------
struct Range {
  int64_t begin, end;  // vectors [begin, end)
};

PA2A_HD int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

PA2A_HD int blocks_for(int64_t vecs) {
  const int64_t b = ceil_div(vecs, kMinBlockVecs);
  return static_cast<int>(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

// Part b of `blocks` equal parts of [0, n).
PA2A_HD Range split(int64_t n, int blocks, int b) {
  const int64_t per = ceil_div(n, blocks);
  int64_t lo = per * b;
  lo = lo < n ? lo : n;
  const int64_t hi = lo + per < n ? lo + per : n;
  return Range{lo, hi};
}

// One-shot: the call's vectors in blocks_for(nvec) chunks.
PA2A_HD int one_shot_blocks(int64_t nvec) {
  return blocks_for(nvec);
}
// Two-shot: shard d of the vectors (owned by rank d), each shard in the same number of pieces.
PA2A_HD Range shard(int64_t nvec, int world, int d) {
  return split(nvec, world, d);
}
PA2A_HD int two_shot_blocks(int64_t nvec, int world) {
  return blocks_for(ceil_div(nvec, world));
}
PA2A_HD Range shard_piece(int64_t nvec, int world, int d, int blocks, int b) {
  const Range s = shard(nvec, world, d);
  const Range p = split(s.end - s.begin, blocks, b);
  return Range{s.begin + p.begin, s.begin + p.end};
}

struct SegmentHeader {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  int32_t pid;
  Config config;
};

}  // namespace pa2a::ar
