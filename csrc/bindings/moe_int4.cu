// pcie_a2a._moe_int4: the fused INT4 expert MLP. Built only when nvcc is found.
// Raw device pointers (uintptr_t), sizes, dtype codes and a cudaStream_t handle cross the
// boundary; torch stays in Python (pcie_a2a/quant/moe.py fills Args from tensors).
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <exception>

#include "bindings/python_errors.h"
#include "core/exception.h"
#include "cuda/moe_int4/gemm_kernel.cuh"
#include "cuda/moe_int4/layout.h"
#include "cuda/moe_int4/moe_int4.cuh"

namespace py = pybind11;
namespace mi = pa2a::moe_int4;

PYBIND11_MODULE(_moe_int4, m) {
  m.doc() = "pcie_a2a fused W4A16 expert MLP (raw pointers, sizes and streams; no torch ABI)";
  pa2a::bindings::translate_errors_like_transport();

  py::class_<mi::MoeInt4Args> args(m, "Args", "Arguments of run(); see moe_int4.cuh");
  args.def(py::init<>());
#define PA2A_FIELD(name) args.def_readwrite(#name, &mi::MoeInt4Args::name)
  PA2A_FIELD(dtype);
  PA2A_FIELD(expert_major);
  PA2A_FIELD(x);
  PA2A_FIELD(num_rows);
  PA2A_FIELD(capacity);
  PA2A_FIELD(hidden);
  PA2A_FIELD(num_experts);
  PA2A_FIELD(topk_ids);
  PA2A_FIELD(topk_weights);
  PA2A_FIELD(num_topk);
  PA2A_FIELD(counts);
  PA2A_FIELD(out);
  PA2A_FIELD(acc);
  PA2A_FIELD(w13_qweight);
  PA2A_FIELD(w13_scales);
  PA2A_FIELD(w13_zeros);
  PA2A_FIELD(w13_n_pad);
  PA2A_FIELD(w13_k_pad);
  PA2A_FIELD(w13_group);
  PA2A_FIELD(w13_num_groups);
  PA2A_FIELD(w2_qweight);
  PA2A_FIELD(w2_scales);
  PA2A_FIELD(w2_zeros);
  PA2A_FIELD(w2_n_pad);
  PA2A_FIELD(w2_k_pad);
  PA2A_FIELD(w2_group);
  PA2A_FIELD(w2_num_groups);
  PA2A_FIELD(x_perm);
  PA2A_FIELD(x_perm_buf);
  PA2A_FIELD(h_perm);
  PA2A_FIELD(h_stride);
  PA2A_FIELD(pair_src);
  PA2A_FIELD(pair_w);
  PA2A_FIELD(tiles);
  PA2A_FIELD(status);
  PA2A_FIELD(h);
  PA2A_FIELD(row_pairs);
  PA2A_FIELD(active_rows);
  PA2A_FIELD(split_ws);
  PA2A_FIELD(split_cnt);
  PA2A_FIELD(ws_items);
  PA2A_FIELD(row_cnt);
  PA2A_FIELD(errors);
  PA2A_FIELD(split_k);
  PA2A_FIELD(max_pairs);
  PA2A_FIELD(max_tiles);
  PA2A_FIELD(block_m);
  PA2A_FIELD(device);
  PA2A_FIELD(stream);
#undef PA2A_FIELD

  m.def("run", &mi::moe_int4_run, py::arg("args"),
        "Launch schedule, gate/up GEMM (+SiLU*up), down GEMM (+weight, row sum, cast) on "
        "args.stream; never synchronises");
  m.def("gemm_smem_bytes", &mi::gemm_smem_bytes, py::arg("block_m"),
        "Dynamic shared memory of one GEMM CTA");
  m.attr("TILE_K") = mi::kTileK;
  m.attr("TILE_N") = mi::kTileN;
  m.attr("PAD_K") = mi::kPadK;
  m.attr("PAD_N") = mi::kPadN;
  m.attr("GATE_UP_BLOCK") = mi::kGateUpBlock;
  m.attr("MAX_EXPERTS") = mi::kMaxExperts;
  m.attr("MIN_PART_K_TILES") = mi::kMinPartKTiles;
  m.attr("STAGES") = mi::kStages;
  m.attr("THREADS") = mi::kThreads;
  m.def(
      "nibble_source",
      [](int lane, int j, int p) {
        int k = 0, n = 0;
        mi::nibble_source(lane, j, p, &k, &n);
        return py::make_tuple(k, n);
      },
      py::arg("lane"), py::arg("word"), py::arg("nibble"),
      "(k, n) inside the 16x64 tile of nibble p of word j of lane (layout.h)");
  m.def("scale_position", &mi::scale_position, py::arg("col"));
  m.def(
      "partition",
      [](int64_t items, int k_tiles, int64_t grid, bool splittable) {
        const mi::Partition pt = mi::make_partition(items, k_tiles, grid, splittable);
        py::list begins, owners;
        for (int64_t b = 0; b <= pt.ctas; ++b) begins.append(pt.begin(b));
        for (int64_t v = 0; v < pt.units; ++v) owners.append(pt.owner(v));
        return py::make_tuple(pt.ctas, begins, owners);
      },
      py::arg("items"), py::arg("k_tiles"), py::arg("grid"), py::arg("splittable"),
      "The GEMM's stream-K partition: (CTAs, first unit of each CTA and the end, owner of "
      "each unit)");
  m.def("gate_up_channel", &mi::gate_up_channel, py::arg("n0"), py::arg("col"));
}
