// pcie_a2a._transport: the CPU shared-memory transport and the host index math.
// Raw pointers (uintptr_t from tensor.data_ptr()) and sizes cross the boundary; torch stays
// in Python. Every call releases the GIL: none touches Python objects.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

#include "bindings/python_errors.h"
#include "core/dispatch_layout.h"
#include "core/exception.h"
#include "core/numeric.h"
#include "core/shm_transport.h"

namespace py = pybind11;
using pa2a::ShmTransport;

namespace {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// Owns a copy of the placement map so callers need not keep arrays alive.
// choice_offset/choice: this rank's row of the replica choice table, or empty (routing.h).
struct PlacementTable {
  std::vector<int32_t> offset, rank, local, choice_offset, choice;
  pa2a::Placement view() const {
    pa2a::Placement p;
    p.replica_offset = offset.data();
    p.replica_rank = rank.data();
    p.replica_local = local.data();
    p.num_experts = static_cast<int32_t>(offset.size()) - 1;
    if (!choice_offset.empty()) {
      p.choice_offset = choice_offset.data();
      p.choice = choice.data();
    }
    return p;
  }
};

PlacementTable make_placement(std::vector<int32_t> offset, std::vector<int32_t> rank,
                              std::vector<int32_t> local, int32_t world,
                              std::vector<int32_t> choice_offset, std::vector<int32_t> choice) {
  PA2A_CHECK_ARG(rank.size() == local.size(), "placement rank/local arrays differ in length");
  pa2a::check_placement(offset.data(), offset.size(), rank.data(), local.data(), rank.size(),
                        world);
  if (!choice_offset.empty())
    pa2a::check_replica_choice(choice_offset.data(), choice_offset.size(), choice.data(),
                               choice.size(), offset.data(), offset.size());
  else
    PA2A_CHECK_ARG(choice.empty(), "replica choice given without its offsets");
  return PlacementTable{std::move(offset), std::move(rank), std::move(local),
                        std::move(choice_offset), std::move(choice)};
}

}  // namespace

PYBIND11_MODULE(_transport, m) {
  m.doc() = "pcie_a2a CPU shared-memory transport (raw pointers; no torch ABI)";

  py::object peer_error = py::reinterpret_steal<py::object>(
      PyErr_NewException("pcie_a2a._transport.PeerError", PyExc_RuntimeError, nullptr));
  py::object peer_timeout = py::reinterpret_steal<py::object>(PyErr_NewException(
      "pcie_a2a._transport.PeerTimeoutError",
      py::make_tuple(peer_error, py::handle(PyExc_TimeoutError)).ptr(), nullptr));
  py::object peer_aborted = py::reinterpret_steal<py::object>(
      PyErr_NewException("pcie_a2a._transport.PeerAbortedError", peer_error.ptr(), nullptr));
  m.attr("PeerError") = peer_error;
  m.attr("PeerTimeoutError") = peer_timeout;
  m.attr("PeerAbortedError") = peer_aborted;
  pa2a::bindings::translate_errors(peer_error, peer_timeout, peer_aborted);

  m.attr("WIRE_VERSION") = pa2a::kWireVersion;
  m.attr("ABORT_COUNT") = pa2a::kAbortCount;

  py::class_<PlacementTable>(m, "Placement")
      .def(py::init(&make_placement), py::arg("offset"), py::arg("rank"), py::arg("local"),
           py::arg("world"), py::arg("choice_offset") = std::vector<int32_t>(),
           py::arg("choice") = std::vector<int32_t>())
      .def_property_readonly("num_experts",
                             [](const PlacementTable& p) { return p.view().num_experts; });

  m.def(
      "slot_bytes",
      [](int32_t world, int32_t hidden, int32_t max_tokens, int32_t num_topk, int payload,
         int dtype) {
        const auto c = pa2a::make_wire_config(world, hidden, max_tokens, num_topk, payload, dtype);
        const auto l = pa2a::segment_layout(c);
        return py::make_tuple(l.dispatch_slot, l.combine_slot, l.total);
      },
      "(dispatch slot bytes, combine slot bytes, segment bytes)");

  m.def(
      "dispatch_layout",
      [](uintptr_t topk_ids, int32_t num_tokens, int32_t topk, const PlacementTable& placement,
         int32_t world, int32_t rank, int32_t max_tokens, uintptr_t tokens_per_rank,
         uintptr_t tokens_per_expert, uintptr_t is_token_in_rank) {
        pa2a::dispatch_layout(ptr<const int32_t>(topk_ids), num_tokens, topk, placement.view(),
                              world, rank, max_tokens, ptr<int32_t>(tokens_per_rank),
                              ptr<int32_t>(tokens_per_expert), ptr<uint8_t>(is_token_in_rank));
      },
      py::call_guard<py::gil_scoped_release>());

  // Bulk scalar conversions: the tests compare them with torch's casts.
  m.def(
      "float_to_fp8",
      [](uintptr_t src, int64_t n, uintptr_t dst) {
        for (int64_t i = 0; i < n; ++i)
          ptr<uint8_t>(dst)[i] = pa2a::float_to_fp8_e4m3(ptr<const float>(src)[i]);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "float_to_half",
      [](uintptr_t src, int64_t n, int dtype, uintptr_t dst) {
        for (int64_t i = 0; i < n; ++i)
          ptr<uint16_t>(dst)[i] =
              pa2a::float_to_half_bits(ptr<const float>(src)[i], static_cast<pa2a::DType>(dtype));
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "quantize_fp8_rows",
      [](uintptr_t x, int dtype, int64_t rows, int32_t hidden, uintptr_t q, uintptr_t scales) {
        PA2A_CHECK_ARG(hidden % pa2a::kFp8GroupSize == 0, "hidden must be a multiple of 128");
        const int64_t groups = rows * (hidden / pa2a::kFp8GroupSize);
        for (int64_t g = 0; g < groups; ++g)
          ptr<float>(scales)[g] = pa2a::quantize_fp8_group(
              ptr<const uint16_t>(x) + g * pa2a::kFp8GroupSize, static_cast<pa2a::DType>(dtype),
              ptr<uint8_t>(q) + g * pa2a::kFp8GroupSize);
      },
      py::call_guard<py::gil_scoped_release>());

  py::class_<ShmTransport>(m, "ShmTransport")
      .def(py::init([](const std::string& prefix, int32_t rank, int32_t world, int32_t hidden,
                       int32_t max_tokens, int32_t num_topk, int payload, int dtype,
                       std::vector<uint8_t> pull, double timeout_s) {
             return new ShmTransport(
                 prefix, rank,
                 pa2a::make_wire_config(world, hidden, max_tokens, num_topk, payload, dtype),
                 std::move(pull), timeout_s);
           }),
           py::arg("prefix"), py::arg("rank"), py::arg("world"), py::arg("hidden"),
           py::arg("max_tokens"), py::arg("num_topk"), py::arg("payload"), py::arg("dtype"),
           py::arg("pull") = std::vector<uint8_t>{}, py::arg("timeout_s") = 30.0,
           "pull: [world * world] 0/1, entry s * world + r = 1 when r pulls the rows of the "
           "ordered pair s -> r (empty: all push); timeout_s bounds a consumed-flag wait")
      .def("pulls", &ShmTransport::pulls)
      .def(
          "_set_pull_mutation",
          [](ShmTransport& t, int mutation) {
            PA2A_CHECK_ARG(mutation >= 0 && mutation <= 2, "pull mutation must be 0, 1 or 2, got ",
                           mutation);
            t.set_pull_mutation(static_cast<pa2a::PullMutation>(mutation));
          },
          "tests only: seed a slip of the pull protocol (1: reuse before consumed, 2: wrong "
          "consumed epoch)")
      .def_static("segment_name", &ShmTransport::segment_name)
      .def_static("unlink_name", &ShmTransport::unlink_name)
      .def("attach_peers", &ShmTransport::attach_peers)
      .def("unlink_own", &ShmTransport::unlink_own)
      .def("close", &ShmTransport::close)
      .def("peer_pid", &ShmTransport::peer_pid)
      .def_property_readonly("numa_node", [](const ShmTransport& t) { return t.numa().node; })
      .def_property_readonly("numa_bound", [](const ShmTransport& t) { return t.numa().bound; })
      .def_property_readonly("numa_warning", [](const ShmTransport& t) { return t.numa().warning; })
      .def_property_readonly("segment_bytes", &ShmTransport::segment_bytes)
      .def_property_readonly("dispatch_slot_bytes",
                             [](const ShmTransport& t) { return t.layout().dispatch_slot; })
      .def_property_readonly("combine_slot_bytes",
                             [](const ShmTransport& t) { return t.layout().combine_slot; })
      .def("last_bytes", [](const ShmTransport& t) { return t.last_bytes(); })
      .def(
          "dispatch_send",
          [](ShmTransport& t, uint32_t seq, uint32_t op, int parity, uintptr_t x,
             int32_t num_tokens, uintptr_t topk_ids, uintptr_t topk_weights, int32_t topk,
             const PlacementTable& placement, uintptr_t send_token, uintptr_t send_count) {
            t.dispatch_send(seq, op, parity, ptr<const void>(x), num_tokens,
                            ptr<const int32_t>(topk_ids), ptr<const float>(topk_weights), topk,
                            placement.view(), ptr<int32_t>(send_token), ptr<int32_t>(send_count));
          },
          py::call_guard<py::gil_scoped_release>())
      .def("wait", &ShmTransport::wait, py::call_guard<py::gil_scoped_release>())
      .def("abort", &ShmTransport::abort, py::call_guard<py::gil_scoped_release>())
      .def(
          "unpack_rows",
          [](ShmTransport& t, int parity, uintptr_t counts, uintptr_t row_base, uintptr_t x_out,
             uintptr_t fp8_out, uintptr_t scales_out, uintptr_t src_rank, uintptr_t src_token,
             uintptr_t topk_ids, uintptr_t topk_weights, int32_t num_local_experts,
             uintptr_t expert_count) {
            t.unpack_rows(parity, ptr<const int32_t>(counts), ptr<const int64_t>(row_base),
                          ptr<void>(x_out), ptr<uint8_t>(fp8_out), ptr<float>(scales_out),
                          ptr<int32_t>(src_rank), ptr<int32_t>(src_token), ptr<int32_t>(topk_ids),
                          ptr<float>(topk_weights), num_local_experts, ptr<int32_t>(expert_count));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "unpack_expert_major",
          [](ShmTransport& t, int parity, uintptr_t counts, int32_t num_local_experts,
             uintptr_t x_out, uintptr_t fp8_out, uintptr_t scales_out, uintptr_t expert_count,
             uintptr_t src_info, uintptr_t layout_range, uintptr_t expert_pos,
             uintptr_t row_experts, uintptr_t row_weights) {
            t.unpack_expert_major(parity, ptr<const int32_t>(counts), num_local_experts,
                                  ptr<void>(x_out), ptr<uint8_t>(fp8_out), ptr<float>(scales_out),
                                  ptr<int32_t>(expert_count), ptr<int32_t>(src_info),
                                  ptr<int64_t>(layout_range), ptr<int32_t>(expert_pos),
                                  ptr<int32_t>(row_experts), ptr<float>(row_weights));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "combine_send",
          [](ShmTransport& t, uint32_t seq, uint32_t op, int parity, uintptr_t y, uintptr_t counts,
             uintptr_t row_base) {
            t.combine_send(seq, op, parity, ptr<const void>(y), ptr<const int32_t>(counts),
                           ptr<const int64_t>(row_base));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "reduce_expert_major",
          [](ShmTransport& t, uintptr_t y, uintptr_t counts, uintptr_t expert_pos,
             uintptr_t row_experts, uintptr_t row_weights, int32_t num_local_experts,
             uintptr_t rows_out) {
            t.reduce_expert_major(ptr<const void>(y), ptr<const int32_t>(counts),
                                  ptr<const int32_t>(expert_pos), ptr<const int32_t>(row_experts),
                                  ptr<const float>(row_weights), num_local_experts,
                                  ptr<void>(rows_out));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "combine_recv",
          [](ShmTransport& t, uint32_t seq, uint32_t op, int parity, double timeout_s,
             uintptr_t send_token, uintptr_t send_count, int32_t num_tokens, uintptr_t out) {
            t.combine_recv(seq, op, parity, timeout_s, ptr<const int32_t>(send_token),
                           ptr<const int32_t>(send_count), num_tokens, ptr<void>(out));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "combine_recv_fp32",
          [](ShmTransport& t, uint32_t seq, uint32_t op, int parity, double timeout_s,
             uintptr_t send_token, uintptr_t send_count, int32_t num_tokens, uintptr_t out) {
            t.combine_recv(seq, op, parity, timeout_s, ptr<const int32_t>(send_token),
                           ptr<const int32_t>(send_count), num_tokens, ptr<void>(out),
                           /*out_fp32=*/true);
          },
          py::call_guard<py::gil_scoped_release>());
}
