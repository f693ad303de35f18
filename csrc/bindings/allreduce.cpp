// pcie_a2a._allreduce: the CPU all-reduce (core/allreduce_shm.h) and the host reference of
// the fused RMSNorm. Raw pointers (tensor.data_ptr()) and sizes cross the boundary; every
// call releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

#include "bindings/python_errors.h"
#include "core/allreduce_math.h"
#include "core/allreduce_shm.h"
#include "core/allreduce_wire.h"

namespace py = pybind11;
using pa2a::ar::ShmAllReduce;

namespace {

pa2a::ar::CallArgs call(uint32_t seq, int algo, int dtype, uintptr_t x, int64_t numel,
                        uintptr_t residual, uintptr_t out, double timeout_s) {
  pa2a::ar::CallArgs a;
  a.seq = seq;
  a.algo = static_cast<pa2a::ar::Algo>(algo);
  a.dtype = static_cast<pa2a::DType>(dtype);
  a.x = reinterpret_cast<const void*>(x);
  a.numel = numel;
  a.residual = reinterpret_cast<const void*>(residual);
  a.out = reinterpret_cast<void*>(out);
  a.timeout_s = timeout_s;
  return a;
}

}  // namespace

PYBIND11_MODULE(_allreduce, m) {
  m.doc() = "pcie_a2a CPU all-reduce over shared memory (raw pointers; no torch ABI)";
  pa2a::bindings::translate_errors_like_transport();
  m.attr("MAX_WORLD") = pa2a::ar::kMaxWorld;
  m.attr("MAX_BLOCKS") = pa2a::ar::kMaxBlocks;
  m.attr("MAX_ELEMENTS") = pa2a::ar::kMaxElements;
  m.attr("VERSION") = pa2a::ar::kVersion;
  m.attr("NORM_THREADS") = pa2a::ar::kNormThreads;

  m.def(
      "segment_bytes",
      [](int32_t world, int64_t max_bytes, int32_t buffers) {
        pa2a::ar::Config c;
        c.world = world;
        c.max_bytes = max_bytes;
        c.buffers = buffers;
        return pa2a::ar::segment_layout(c).total;
      },
      py::arg("world"), py::arg("max_bytes"), py::arg("buffers"));
  m.def(
      "chunks",
      [](int algo, int64_t nvec, int32_t world) {
        // (blocks, [(begin, end) of every block; two-shot: of every (shard, block)]) in vectors
        std::vector<std::pair<int64_t, int64_t>> out;
        if (algo == static_cast<int>(pa2a::ar::Algo::kOneShot)) {
          const int b = pa2a::ar::one_shot_blocks(nvec);
          for (int i = 0; i < b; ++i) {
            const auto r = pa2a::ar::split(nvec, b, i);
            out.emplace_back(r.begin, r.end);
          }
          return py::make_tuple(b, out);
        }
        const int b = pa2a::ar::two_shot_blocks(nvec, world);
        for (int d = 0; d < world; ++d)
          for (int i = 0; i < b; ++i) {
            const auto r = pa2a::ar::shard_piece(nvec, world, d, b, i);
            out.emplace_back(r.begin, r.end);
          }
        return py::make_tuple(b, out);
      },
      py::arg("algo"), py::arg("nvec"), py::arg("world"));
  m.def(
      "rmsnorm_rows",
      [](uintptr_t r, uintptr_t residual, uintptr_t weight, int64_t rows, int32_t hidden, float eps,
         int dtype, uintptr_t normed, uintptr_t residual_out) {
        pa2a::ar::rmsnorm_rows(reinterpret_cast<const void*>(r),
                               reinterpret_cast<const void*>(residual),
                               reinterpret_cast<const void*>(weight), rows, hidden, eps,
                               static_cast<pa2a::DType>(dtype), reinterpret_cast<void*>(normed),
                               reinterpret_cast<void*>(residual_out));
      },
      py::call_guard<py::gil_scoped_release>());

  py::class_<ShmAllReduce>(m, "ShmAllReduce")
      .def(py::init([](const std::string& prefix, int32_t rank, int32_t world, int64_t max_bytes,
                       int32_t buffers, bool end_barrier) {
             pa2a::ar::Config c;
             c.world = world;
             c.max_bytes = max_bytes;
             c.buffers = buffers;
             return new ShmAllReduce(prefix, rank, c, end_barrier);
           }),
           py::arg("prefix"), py::arg("rank"), py::arg("world"), py::arg("max_bytes"),
           py::arg("buffers"), py::arg("end_barrier"))
      .def_static("segment_name", &ShmAllReduce::segment_name)
      .def_static("unlink_name", &ShmAllReduce::unlink_name)
      .def("attach_peers", &ShmAllReduce::attach_peers)
      .def("unlink_own", &ShmAllReduce::unlink_own)
      .def("close", &ShmAllReduce::close)
      .def("set_directions", &ShmAllReduce::set_directions)
      .def("peer_pid", &ShmAllReduce::peer_pid)
      .def_property_readonly("segment_bytes", &ShmAllReduce::segment_bytes)
      .def_property_readonly("numa_node", [](const ShmAllReduce& t) { return t.numa().node; })
      .def_property_readonly("numa_warning", [](const ShmAllReduce& t) { return t.numa().warning; })
      .def("last_bytes", [](const ShmAllReduce& t) { return t.last_bytes(); })
      .def(
          "run",
          [](ShmAllReduce& t, uint32_t seq, int algo, int dtype, uintptr_t x, int64_t numel,
             uintptr_t residual, uintptr_t out, double timeout_s) {
            t.run(call(seq, algo, dtype, x, numel, residual, out, timeout_s));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "send",
          [](ShmAllReduce& t, uint32_t seq, int algo, int dtype, uintptr_t x, int64_t numel,
             uintptr_t residual, uintptr_t out, double timeout_s) {
            t.send(call(seq, algo, dtype, x, numel, residual, out, timeout_s));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "finish",
          [](ShmAllReduce& t, uint32_t seq, int algo, int dtype, uintptr_t x, int64_t numel,
             uintptr_t residual, uintptr_t out, double timeout_s) {
            t.finish(call(seq, algo, dtype, x, numel, residual, out, timeout_s));
          },
          py::call_guard<py::gil_scoped_release>())
      .def("abort", &ShmAllReduce::abort, py::arg("seq"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>());
}
