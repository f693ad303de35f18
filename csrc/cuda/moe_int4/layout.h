// INT4 expert weight layout: the index math shared by the packer (Python,
// pcie_a2a/quant/layout.py, the tested oracle) and the kernel (moe_int4.cuh).
//
// Hardware reason: mma.sync.m16n8k16 (bf16/fp16 in, fp32 accumulate) gives lane t of a
// warp, for its B operand (weights, K x N), column t/4 of an n8 tile and rows
// 2*(t%4) + {0,1} (register b0) and 2*(t%4) + {8,9} (register b1). Packing every lane's
// nibbles of one 16 (k) x 64 (n) tile into 4 consecutive 32-bit words lets the kernel
// fetch them with one 16-byte load per tile, and makes a tile 512 contiguous bytes.
//
// Invariants (each mirrored 1:1 by the Python constant or function of the same name;
// a test checks the constants textually, and dequantises the layout
// through a lane-by-lane emulation written from the PTX fragment table):
//  * qweight word index of (k-tile kt, n-tile nt, lane, word j):
//      (kt * n_tiles + nt) * 128 + lane * 4 + j
//  * nibble p of word j of lane t holds value v = kNibbleOrder[p]:
//      k = 2*(t%4) + kKOff[v%4],  n = 16*j + 8*(v/4) + t/4     (inside the tile)
//    so (word >> 4*s) & 0x000F000F gives registers b0, b1 of n8 tile 2j (s = 0, 1) and
//    of n8 tile 2j+1 (s = 2, 3), low half first.
//  * scales (and zero points) [G][n_pad] in the activation dtype; column c of each block
//    of 64 sits at 8*(c%8) + c/8, so lane group g = t/4 loads its 8 scales (n8 tiles
//    0..7) with one 16-byte load at 8*g. Group of packed row k: k / group (per channel:
//    group == k_pad).
//  * n_pad % kPadN == 0, k_pad % kPadK == 0 (and % group); padding dequantises to 0.
//  * w13 interleave: packed column p is gate channel 32*(p/64) + p%32 if p%64 < 32, else
//    the up row of that channel; a warp's n8 tiles i and i+4 hold gate and up of the same
//    channels, so SiLU(gate)*up is computed in registers.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace pa2a::moe_int4 {

constexpr int kTileK = 16;           // mma k
constexpr int kTileN = 64;           // columns per warp tile (8 n8 tiles)
constexpr int kPadK = 64;            // k-tile per pipeline stage
constexpr int kPadN = 256;           // CTA tile in N (4 warps x 64)
constexpr int kGateUpBlock = 32;     // gate/up interleave block
constexpr int kWarpTileWords = 128;  // 32 lanes x 4 words = 512 bytes

// The tables, for reading (and for the Python mirror); device code uses the closed forms
// below, since namespace-scope arrays are host-only in CUDA. static_asserts tie them.
constexpr int kNibbleOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
constexpr int kKOff[4] = {0, 1, 8, 9};

PA2A_HD constexpr int nibble_value(int p) {
  return p < 4 ? 2 * p : 2 * (p - 4) + 1;
}
PA2A_HD constexpr int k_offset(int v) {
  return (v % 2) + 8 * ((v % 4) / 2);
}

constexpr bool tables_match() {
  for (int p = 0; p < 8; ++p)
    if (nibble_value(p) != kNibbleOrder[p]) return false;
  for (int v = 0; v < 4; ++v)
    if (k_offset(v) != kKOff[v]) return false;
  return true;
}
static_assert(tables_match(), "closed forms must equal the documented tables");

PA2A_HD int64_t qweight_word_index(int64_t kt, int64_t nt, int64_t n_tiles, int lane, int j) {
  return (kt * n_tiles + nt) * kWarpTileWords + lane * 4 + j;
}

// Position of column c (0..63 inside its block) in the permuted scale row.
PA2A_HD int scale_position(int c) {
  return 8 * (c % 8) + c / 8;
}

// (k, n) inside the 16x64 tile of nibble p of word j held by lane.
PA2A_HD void nibble_source(int lane, int j, int p, int* k, int* n) {
  const int v = nibble_value(p);
  *k = 2 * (lane % 4) + k_offset(v);
  *n = 16 * j + 8 * (v / 4) + lane / 4;
}

// h channel of accumulator column `col` (0..63, n8 tiles 0..3 = gate) of the warp tile
// starting at packed column n0 of w13.
PA2A_HD int gate_up_channel(int n0, int col) {
  return (n0 / kTileN) * kGateUpBlock + col % kGateUpBlock;
}

}  // namespace pa2a::moe_int4
