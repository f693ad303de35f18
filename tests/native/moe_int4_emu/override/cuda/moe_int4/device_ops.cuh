// Host stand-in for csrc/cuda/moe_int4/device_ops.cuh (same functions, same signatures),
// found first through -iquote by the emulation build. The execution model (fibers,
// barriers, warps) is tests/native/emu/emu_cuda.h; this adds what only the INT4 kernel uses:
//  * cp.async: the destination is poisoned (0xFF bytes: NaN in bf16/fp16, code 15 in the
//    weights) when the copy is issued and filled only when a cp.async.wait_group of the
//    issuing thread requires its group, i.e. as late as the hardware may deliver it.
//    Reading a stage too early, or overwriting one still in use, gives wrong numbers.
//    Source and destination must be 16-byte aligned; sources must lie in a registered
//    global buffer and destinations in the dynamic shared memory. A thread that exits
//    with copies in flight still has them land (the hardware finishes them).
//  * ldmatrix.x4: warp-collective; each lane publishes its row address (16-byte aligned,
//    inside the dynamic shared memory), the first lane through reads the four 8x8 matrices
//    at once (as the hardware does) and every lane takes its registers from that copy.
//  * prmt, fma2 (computed exactly in double, rounded once to the 16-bit type) and
//    griddepcontrol.wait / launch_dependents (no-ops: launches run one after the other).
//  * atom.acq_rel (an atomicAdd: the model is sequentially consistent) and prefetch.L2 (no
//    effect; the line must lie in a registered global buffer, so a wrong address fails).
//  * mma.sync.m16n8k16: warp-collective; each lane publishes its fragment registers and
//    reads the others', placed by the PTX ISA fragment tables (written here from the ISA,
//    not from the kernel or the packer). fp32 accumulation.
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <vector>

#include "emu_cuda.h"

namespace emu_int4 {

struct Copy {
  void* dst;
  const void* src;
  bool pred;
};

struct ThreadState {
  std::vector<Copy> open;                  // cp.async issued since the last commit
  std::deque<std::vector<Copy>> inflight;  // committed groups, oldest first
  int mma_parity = 0;
  int ldm_parity = 0;
};

struct LdmResult {
  uint64_t epoch = ~uint64_t{0};
  uint32_t regs[32][4];
};
inline const void* ldm_addr[32][2][32];  // [warp][parity][lane]
inline LdmResult ldm_res[32][2];

struct MmaSlot {
  uint32_t a[4];
  uint32_t b[2];
};

struct MmaOperands {
  uint64_t epoch = ~uint64_t{0};  // warp barrier generation these were decoded in
  float a[16][16];
  float b[16][8];
};

inline std::vector<ThreadState>& threads() {
  static std::vector<ThreadState> t(1024);
  return t;
}
inline ThreadState& me() {
  return threads()[threadIdx.x];
}
inline MmaSlot mma[32][2][32];  // [warp][parity][lane]
inline MmaOperands mma_ops[32][2];

inline void complete(std::vector<Copy>& group) {
  for (const Copy& c : group) {
    if (c.pred) {
      std::memcpy(c.dst, c.src, 16);
    } else {
      std::memset(c.dst, 0, 16);
    }
  }
  group.clear();
}

inline void block_begin() {
  for (unsigned i = 0; i < emu::rt.nthreads; ++i) threads()[i] = ThreadState{};
}

inline void thread_exit() {
  ThreadState& s = me();
  while (!s.inflight.empty()) {
    complete(s.inflight.front());
    s.inflight.pop_front();
  }
  complete(s.open);
}

inline const bool hooks_installed = [] {
  emu::hooks.block_begin = block_begin;
  emu::hooks.thread_exit = thread_exit;
  return true;
}();

}  // namespace emu_int4

namespace pa2a::moe_int4 {

inline unsigned char* dynamic_smem() {
  return emu::rt.smem;
}

inline uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  return (a & b) | c;
}

inline uint32_t prmt(uint32_t a, uint32_t sel) {
  const uint64_t bytes = a;  // {b = 0, a}: bytes 0..3 from a, 4..7 zero
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned pick = (sel >> (4 * i)) & 7u;  // sign-replicate mode (bit 3) unused here
    d |= static_cast<uint32_t>((bytes >> (8 * pick)) & 0xFFu) << (8 * i);
  }
  return d;
}

inline __nv_bfloat162 fma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  auto f = [](__nv_bfloat16 x, __nv_bfloat16 y, __nv_bfloat16 z) {
    return __nv_bfloat16(static_cast<float>(static_cast<double>(float(x)) * float(y) + float(z)));
  };
  return {f(a.x, b.x, c.x), f(a.y, b.y, c.y)};
}
inline __half2 fma2(__half2 a, __half2 b, __half2 c) {
  auto f = [](__half x, __half y, __half z) {
    return __half(static_cast<float>(static_cast<double>(float(x)) * float(y) + float(z)));
  };
  return {f(a.x, b.x, c.x), f(a.y, b.y, c.y)};
}

inline void grid_dependency_wait() {}
inline void grid_dependency_launch() {}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  if (reinterpret_cast<uintptr_t>(smem_row) % 16)
    emu::fail("ldmatrix row address that is not 16-byte aligned");
  emu::check_smem(smem_row, 16, "ldmatrix row");
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  emu_int4::ThreadState& f = emu_int4::me();
  const int parity = f.ldm_parity;
  f.ldm_parity ^= 1;
  emu_int4::ldm_addr[warp][parity][lane] = smem_row;
  emu::Warp& w = emu::rt.warps[warp];
  emu::barrier(w.count, w.gen, 32, "ldmatrix");
  emu_int4::LdmResult& res = emu_int4::ldm_res[warp][parity];
  if (res.epoch != w.gen) {  // first lane through: all four matrices, before anyone writes
    res.epoch = w.gen;
    for (int t = 0; t < 32; ++t)
      for (int j = 0; j < 4; ++j) {
        const auto* row =
            static_cast<const unsigned char*>(emu_int4::ldm_addr[warp][parity][8 * j + t / 4]);
        std::memcpy(&res.regs[t][j], row + 4 * (t % 4), 4);
      }
  }
  std::memcpy(r, res.regs[lane], sizeof r);
}

inline void cp_async16(void* smem, const void* gmem, bool pred) {
  if (reinterpret_cast<uintptr_t>(smem) % 16 || reinterpret_cast<uintptr_t>(gmem) % 16)
    emu::fail("cp.async with a source or destination that is not 16-byte aligned");
  emu::check_smem(smem, 16, "cp.async destination");
  if (pred) emu::check_global(gmem, 16, "cp.async source");
  std::memset(smem, 0xFF, 16);  // what a reader sees before the copy lands
  emu_int4::me().open.push_back(emu_int4::Copy{smem, gmem, pred});
}

inline void cp_async_commit() {
  emu_int4::ThreadState& f = emu_int4::me();
  f.inflight.push_back(std::move(f.open));
  f.open.clear();
}

template <int kPending>
inline void cp_async_wait() {
  emu_int4::ThreadState& f = emu_int4::me();
  while (f.inflight.size() > static_cast<size_t>(kPending)) {
    emu_int4::complete(f.inflight.front());
    f.inflight.pop_front();
  }
}

inline int32_t atomic_add_acq_rel(int32_t* p, int32_t v) {
  return atomicAdd(p, v);
}

inline void prefetch_l2(const void* p) {
  emu::check_global(p, 1, "prefetch.global.L2");
}

namespace emu_detail {

inline float element(const __nv_bfloat16*, uint32_t bits16) {
  return emu::bf16_to_float(static_cast<uint16_t>(bits16));
}
inline float element(const __half*, uint32_t bits16) {
  return emu::half_to_float(static_cast<uint16_t>(bits16));
}

}  // namespace emu_detail

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32, from the PTX ISA
// fragment tables ("Matrix Fragments for mma.m16n8k16 with floating point type"):
//   A a0..a7 (regs a[0..3], element i in register i/2, low half first):
//     row = groupID for i in {0,1,4,5}, groupID + 8 otherwise;
//     col = threadID_in_group * 2 + (i & 1) (+ 8 for i >= 4)
//   B b0..b3 (regs b0, b1): row(k) = threadID_in_group * 2 + (i & 1) (+ 8 for i >= 2),
//     col(n) = groupID
//   C/D c0..c3: row = groupID (+ 8 for i >= 2), col = threadID_in_group * 2 + (i & 1)
// groupID = lane / 4, threadID_in_group = lane % 4.
template <typename T>
inline void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  emu_int4::ThreadState& f = emu_int4::me();
  emu_int4::MmaSlot& mine = emu_int4::mma[warp][f.mma_parity][lane];
  std::memcpy(mine.a, a, sizeof mine.a);
  mine.b[0] = b0;
  mine.b[1] = b1;
  // Two slot sets alternate: a lane can overwrite this set only after the next mma's
  // barrier, which every lane reaches only after reading this one.
  emu::Warp& w = emu::rt.warps[warp];
  emu::barrier(w.count, w.gen, 32, "mma.sync");
  const int parity = f.mma_parity;
  f.mma_parity ^= 1;
  // The first lane through decodes the warp's operands for everyone (same barrier epoch).
  emu_int4::MmaOperands& op = emu_int4::mma_ops[warp][parity];
  if (op.epoch != w.gen) {
    op.epoch = w.gen;
    const emu_int4::MmaSlot* s = emu_int4::mma[warp][parity];
    for (int l = 0; l < 32; ++l) {
      const int gid = l / 4, tig = l % 4;
      for (int i = 0; i < 8; ++i) {
        const uint32_t reg = s[l].a[i / 2];
        const int row = gid + (((i / 2) % 2) ? 8 : 0);
        const int col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
        op.a[row][col] = emu_detail::element(static_cast<const T*>(nullptr),
                                             (i & 1) ? reg >> 16 : reg & 0xFFFFu);
      }
      for (int i = 0; i < 4; ++i) {
        const uint32_t reg = s[l].b[i / 2];
        const int row = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
        op.b[row][gid] = emu_detail::element(static_cast<const T*>(nullptr),
                                             (i & 1) ? reg >> 16 : reg & 0xFFFFu);
      }
    }
  }
  const auto& am = op.a;
  const auto& bm = op.b;
  const int gid = static_cast<int>(lane) / 4, tig = static_cast<int>(lane) % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = gid + (i >= 2 ? 8 : 0), col = tig * 2 + (i & 1);
    double acc = c[i];
    for (int k = 0; k < 16; ++k) acc += static_cast<double>(am[row][k]) * bm[k][col];
    c[i] = static_cast<float>(acc);
  }
}

}  // namespace pa2a::moe_int4
