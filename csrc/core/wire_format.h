// Wire format of dispatch/combine: receive regions, slots and flags, push and pull.
//
// Hardware reason. Across PCIe a posted write is cheap and a read is a non-posted round
// trip, and peer atomics are a read followed by a write, so consumers poll only their own
// memory and no location has two writers. Payload defaults to *push* (the producer stores
// into the consumer's memory), but on some boxes concurrent writes from one switch to
// several root complexes collapse while reads do not (research/field_2026.md section 4), so
// each ordered pair (s -> r) moves its rows by push or by *pull*, as the plan decides
// (python/pcie_a2a/topology: RankTransfers.pair_direction). Flags are never pulled: a flag is
// always an 8-byte posted write by its producer into the memory of the one rank that polls it.
//
// Regions. Each rank owns one segment (host shared memory for the CPU transport, device
// or pinned host memory for the CUDA transports) laid out as
//   [SegmentHeader 4 KiB][flags: 2 parities x world x FlagLine]
//   [dispatch slots: 2 parities x world sources x max_tokens slots x dispatch_slot_bytes]
//   [combine slots:  2 parities x world sources x max_tokens slots x combine_slot_bytes]
// and, only when some pair of the group pulls (the same on every rank):
//   [consumed flags: 2 regions (dispatch, combine) x world readers x FlagLine]
//   [pull dispatch send slots: 2 parities x world destinations x max_tokens x dispatch slot]
//   [pull combine send slots:  2 parities x world destinations x max_tokens x combine slot]
// Source s writes only the [*, s, *] part of a receiver's slots, the flag line [*, s], and
// its own pull send slots; reader r writes only the consumed line [*, r] of a sender.
// Slots are fixed size and 16-byte aligned so a warp can store them with 16-byte vectors.
// The pull send slots are separate from the receive slots because a pair may be mixed:
// with s -> r pulled and r -> s pushed, r pushes into s's receive slots [*, r, *]; had s
// staged its rows for r in that same area, it would have two writers.
//
// Calls and flags. Every rank makes the same sequence of calls; call number `seq`
// (1, 2, ..., shared by dispatch and combine) is a complete exchange: every rank sends a
// flag to every rank (itself included), even with zero rows. The flag of (source s ->
// receiver r) for call seq lives in r's memory at [seq % 2][s] and holds the 64-bit word
// (seq << 32 | row count), stored *last* by s with release semantics after its rows (and
// the op code in `sig`); r acquires it by polling for the exact value seq. Flags carry
// the call number, so they are never reset. A count of kAbortCount tells the receiver
// that the sender raised before sending (bad input): it raises too instead of waiting.
// For a pulled pair this same flag is the *ready* flag: s has stored its rows into its own
// pull send slots [parity][r][*] (local stores) before it release-stores (seq, count) into
// r's memory; r acquires the flag and only then loads the rows from s's segment (SM loads
// or a copy-engine read). Reading before the flag reads the previous call's rows.
// After its last load of call seq, r release-stores `seq` into the consumed line
// [region][r] of s's memory (8 bytes, posted). Consumed values only grow: a rank reads
// its calls in order, so consumed >= n means every row s staged for r up to call n has
// been read. A receiver that reads nothing of a call (it or a peer aborted, or the call
// was refused) still stores consumed for it, so that the sender's record stays exact.
// Combine pulls partials the same way, with the direction of (expert rank -> source rank):
// the expert rank stages partials in its pull combine slots and the source loads them.
//
// Reuse invariant. Each rank finishes *receiving* call n (reads every row it needs, in its
// own region and, for pulled pairs, in its peers' pull send slots) before it *sends* call
// n + 1; dispatch and combine each count their own calls for slot parity.
//   Push slots (in the receiver's memory, written by the sender): a sender at call n + 2
//   of a region has received call n + 1 from every receiver, each of which had finished
//   call n before sending it, so slots of parity n % 2 are free when they are overwritten.
//   Pull slots (in the sender's own memory, read by the receiver): the same chain holds (s
//   received r's flag of n + 1, which r release-stored after its loads of n), and on top
//   of it s waits, before its first store into pull slots of parity p, until r's consumed
//   line shows the call that last used parity p (acquire). The consumed flag makes the
//   guard local to the pair: it does not depend on every call being a complete exchange or
//   on the reader's loads having ended before its next send (a copy-engine read on another
//   stream, a deferred receive hook), and a reader that falls behind becomes a timeout that
//   names it instead of rows overwritten under it. In the normal flow it is already there
//   when the sender looks (it was stored before r's flag of n + 1), so it costs no wait.
//   Mixed pairs: the two directions of a pair use disjoint memory (r's receive slots
//   [*, s, *] vs s's pull send slots [*, r, *]) and each is guarded by its own rule above,
//   so any mix of push and pull pairs in one call, and across dispatch and combine, is
//   safe with two parities. A rank may run at most one call ahead of the slowest peer.
//   Flags use parity seq % 2: the flag of call n + 2 overwrites the line of call n only
//   after its reader saw it (the sender has received n + 1 from that reader, which sent it
//   after receiving n; for a pulled pair also because the sender stores the flag of n + 2
//   only after the consumed wait, which follows the reader's acquire of the flag of n).
// Both transports run these rules: the CPU transport on the host (shm_transport.cpp), the
// CUDA transport on the device (cuda/transport/pull.cuh: every send block waits on the
// consumed lines in its own memory with a deadline, the call that last used each parity is
// kept in DeviceState so graph replays keep it, the last receive block stores consumed).
// Host-staged CUDA pairs always push.
// Why each part is needed, as the tests that remove it show: push with a single parity and
// a sender two calls ahead, the receiver reads the wrong rows; pull with the consumed wait
// switched off, a sender two calls ahead of a slow reader overwrites the rows being read
// (with it, the sender times out naming the reader), and a reader storing the wrong consumed
// epoch makes the sender time out; in the CUDA kernels, on the emulated scenario
// w2_pull_two_in_flight_slow (two dispatches in flight, a slow peer): the consumed
// wait removed, the consumed flag checked for the wrong call, or the ready flag not
// acquired, and the rows or flags a slow reader has not read yet are overwritten.
#pragma once

#include <cstdint>

#include "core/host_device.h"
#include "core/numeric.h"

namespace pa2a {

constexpr uint32_t kSegmentMagic = 0x50413241u;  // "PA2A"
constexpr uint32_t kWireVersion = 1;
constexpr uint32_t kAbortCount = 0xffffffffu;
constexpr size_t kSegmentHeaderBytes = 4096;
constexpr size_t kFlagLineBytes = 64;  // one writer per cache line: no false sharing
constexpr size_t kSlotAlign = 16;

// What a call is; a receiver checks that its peers are in the same call.
enum class OpCode : uint32_t {
  kNone = 0,
  kDispatch = 1,
  kCombine = 2,
  kLowLatencyDispatch = 3,
  kLowLatencyCombine = 4,
};

inline const char* op_name(uint32_t op) {
  switch (op) {
    case 1:
      return "dispatch";
    case 2:
      return "combine";
    case 3:
      return "low_latency_dispatch";
    case 4:
      return "low_latency_combine";
    default:
      return "unknown call";
  }
}

struct FlagLine {
  uint64_t word;  // (seq << 32) | count, release-stored last
  uint32_t sig;   // OpCode of the sender's call, written before `word`
  uint32_t reserved;
  uint8_t pad[kFlagLineBytes - 16];
};
static_assert(sizeof(FlagLine) == kFlagLineBytes, "flag line is one cache line");

PA2A_HD uint64_t pack_flag(uint32_t seq, uint32_t count) {
  return (static_cast<uint64_t>(seq) << 32) | count;
}
PA2A_HD uint32_t flag_seq(uint64_t w) {
  return static_cast<uint32_t>(w >> 32);
}
PA2A_HD uint32_t flag_count(uint64_t w) {
  return static_cast<uint32_t>(w & 0xffffffffu);
}

// Fixed at Buffer construction and identical on every rank (checked at bootstrap).
struct WireConfig {
  int32_t world = 0;
  int32_t hidden = 0;
  int32_t max_tokens = 0;  // per source rank
  int32_t num_topk = 0;    // expert slots per row
  Payload payload = Payload::kBF16;
  DType dtype = DType::kBF16;  // of x and of combine rows
};

// From the integer codes that cross the Python boundary.
PA2A_HD WireConfig make_wire_config(int32_t world, int32_t hidden, int32_t max_tokens,
                                    int32_t num_topk, int32_t payload, int32_t dtype) {
  WireConfig c;
  c.world = world;
  c.hidden = hidden;
  c.max_tokens = max_tokens;
  c.num_topk = num_topk;
  c.payload = static_cast<Payload>(payload);
  c.dtype = static_cast<DType>(dtype);
  return c;
}

// Header of a dispatch row. Followed by int32 local_expert[num_topk] (-1 padded),
// float weight[num_topk], then the payload: hidden 16-bit values, or hidden fp8 bytes
// followed by hidden / 128 fp32 scales. Each part starts 16-byte aligned.
struct RowHeader {
  int32_t src_token;
  int32_t num_experts;  // valid entries of local_expert
  int32_t src_rank;
  // The CUDA transport writes the call number here: for a staged pair {src_rank, seq} is
  // stored last with release semantics, so the row is its own arrival mark (the receiver
  // drains rows while the sender writes). The CPU transport writes 0; no other reader.
  int32_t reserved;
};
static_assert(sizeof(RowHeader) == 16, "row header is one 16-byte vector");

struct SlotLayout {
  size_t experts_off, weights_off, payload_off, scales_off, payload_bytes, bytes;
};

PA2A_HD SlotLayout dispatch_slot_layout(const WireConfig& c) {
  SlotLayout s{};
  s.experts_off = sizeof(RowHeader);
  s.weights_off = align_up(s.experts_off + 4 * static_cast<size_t>(c.num_topk), kSlotAlign);
  s.payload_off = align_up(s.weights_off + 4 * static_cast<size_t>(c.num_topk), kSlotAlign);
  const size_t h = static_cast<size_t>(c.hidden);
  if (c.payload == Payload::kFP8) {
    s.scales_off = align_up(s.payload_off + h, kSlotAlign);
    s.payload_bytes = h + 4 * (h / kFp8GroupSize);
    s.bytes = align_up(s.scales_off + 4 * (h / kFp8GroupSize), kSlotAlign);
  } else {
    s.scales_off = 0;
    s.payload_bytes = 2 * h;
    s.bytes = align_up(s.payload_off + 2 * h, kSlotAlign);
  }
  return s;
}

// A combine row is the hidden vector in the dtype of x, nothing else: the source knows
// which token each of its slots was (it wrote them).
PA2A_HD size_t combine_slot_bytes(const WireConfig& c) {
  return align_up(2 * static_cast<size_t>(c.hidden), kSlotAlign);
}

// Regions of the consumed lines (pull only).
constexpr int kDispatchRegion = 0;
constexpr int kCombineRegion = 1;

struct SegmentLayout {
  size_t flags_off, dispatch_off, combine_off, total;
  size_t dispatch_slot, combine_slot;
  // Present only with `with_pull` (0 otherwise): consumed lines, pull send slots.
  size_t consumed_off, pull_dispatch_off, pull_combine_off;
  // Present only after add_staged_progress (CUDA transport; 0 otherwise).
  size_t progress_off;
};

// `with_pull`: some pair of the group pulls (every rank passes the same value). Without it
// the layout is the push-only layout of wire version 1, byte for byte.
PA2A_HD SegmentLayout segment_layout(const WireConfig& c, bool with_pull = false) {
  SegmentLayout l{};
  const size_t w = static_cast<size_t>(c.world), m = static_cast<size_t>(c.max_tokens);
  l.dispatch_slot = dispatch_slot_layout(c).bytes;
  l.combine_slot = combine_slot_bytes(c);
  l.flags_off = kSegmentHeaderBytes;
  l.dispatch_off = align_up(l.flags_off + 2 * w * kFlagLineBytes, 4096);
  l.combine_off = align_up(l.dispatch_off + 2 * w * m * l.dispatch_slot, 4096);
  l.total = align_up(l.combine_off + 2 * w * m * l.combine_slot, 4096);
  if (with_pull) {
    l.consumed_off = l.total;
    l.pull_dispatch_off = align_up(l.consumed_off + 2 * w * kFlagLineBytes, 4096);
    l.pull_combine_off = align_up(l.pull_dispatch_off + 2 * w * m * l.dispatch_slot, 4096);
    l.total = align_up(l.pull_combine_off + 2 * w * m * l.combine_slot, 4096);
  }
  return l;
}

// Byte offset of slot `slot` written by `src` in parity `parity` of a region.
PA2A_HD size_t slot_offset(const WireConfig& c, int parity, int src, int slot, size_t slot_bytes) {
  return ((static_cast<size_t>(parity) * c.world + src) * c.max_tokens + slot) * slot_bytes;
}

PA2A_HD size_t flag_offset(const WireConfig& c, int parity, int src) {
  return (static_cast<size_t>(parity) * c.world + src) * kFlagLineBytes;
}

// Consumed line of reader `reader` for `region` (kDispatchRegion / kCombineRegion), in the
// sender's segment, from layout.consumed_off. Its `word` holds the last call consumed.
PA2A_HD size_t consumed_offset(const WireConfig& c, int region, int reader) {
  return (static_cast<size_t>(region) * c.world + reader) * kFlagLineBytes;
}

// A pull send slot is addressed like a receive slot with the destination in place of the
// source: slot_offset(c, parity, dest, slot, slot_bytes) from pull_*_off.

// ---- staged progress (CUDA transport only) -----------------------------------------------
// The CUDA transport's segments end with a progress region that host-staged pairs use to
// publish per-chunk progress (cuda/transport/staged_progress.cuh has the protocol). It is
// appended after everything above, so the bytes and offsets of the layout before it, and
// the CPU transport's segments (which never call add_staged_progress), are unchanged:
//   [early lines: 2 parities x world sources x EarlyLine]     dispatch, per (source, parity)
//   [combine chunk marks: 2 parities x world sources x ceil(max_tokens / 16) x 8 bytes]
// Source s writes only the [*, s] parts, as with slots and flags.
constexpr int kEarlyMaxExperts = 256;     // local experts an early line counts (more: no line)
constexpr int kProgressChunkRows = 16;    // rows per combine chunk mark
constexpr size_t kEarlyLineBytes = 1088;  // 16 + 4 * kEarlyMaxExperts, in whole cache lines

struct EarlyLine {
  uint64_t word;  // (seq << 32) | rows for this receiver, release-stored last
  uint32_t sig;   // OpCode, written before `word`
  uint32_t reserved;
  int32_t counts[kEarlyMaxExperts];  // rows listing each of the receiver's local experts
  uint8_t pad[kEarlyLineBytes - 16 - 4 * kEarlyMaxExperts];
};
static_assert(sizeof(EarlyLine) == kEarlyLineBytes, "early line is whole cache lines");

PA2A_HD size_t progress_chunks(const WireConfig& c) {
  return (static_cast<size_t>(c.max_tokens) + kProgressChunkRows - 1) / kProgressChunkRows;
}

// Appends the progress region to a layout from segment_layout (with or without pull).
PA2A_HD void add_staged_progress(SegmentLayout* l, const WireConfig& c) {
  const size_t w = static_cast<size_t>(c.world);
  l->progress_off = l->total;
  l->total =
      align_up(l->progress_off + 2 * w * kEarlyLineBytes + 2 * w * progress_chunks(c) * 8, 4096);
}

// From layout.progress_off: the early line of (parity, src), and the combine chunk mark of
// (parity, src, chunk).
PA2A_HD size_t early_line_offset(const WireConfig& c, int parity, int src) {
  return (static_cast<size_t>(parity) * c.world + src) * kEarlyLineBytes;
}
PA2A_HD size_t chunk_mark_offset(const WireConfig& c, int parity, int src, int chunk) {
  const size_t w = static_cast<size_t>(c.world), n = progress_chunks(c);
  return 2 * w * kEarlyLineBytes + ((static_cast<size_t>(parity) * w + src) * n + chunk) * 8;
}

struct SegmentHeader {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  int32_t pid;
  WireConfig config;
};

}  // namespace pa2a
