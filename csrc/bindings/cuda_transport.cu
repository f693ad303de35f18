// pcie_a2a._cuda_transport: the CUDA P2P / host-staged transport. Raw device pointers
// (uintptr_t from tensor.data_ptr()), sizes, dtype codes and stream handles
// (torch.cuda.Stream.cuda_stream) cross the boundary; torch stays in Python. A pointer of
// 0 means "absent" where an argument is optional. Every call releases the GIL.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings/python_errors.h"
#include "core/exception.h"
#include "cuda/transport/cuda_transport.cuh"

namespace py = pybind11;
using pa2a::cuda::CallTicket;
using pa2a::cuda::CudaTransport;
using pa2a::cuda::DeviceReport;

namespace {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

cudaStream_t stream_of(uintptr_t s) {
  return reinterpret_cast<cudaStream_t>(s);
}

}  // namespace

PYBIND11_MODULE(_cuda_transport, m) {
  m.doc() = "pcie_a2a CUDA transport (P2P over CUDA IPC and host-staged; raw pointers, no torch)";

  // The same exception classes as the CPU transport, so callers catch one set.
  pa2a::bindings::translate_errors_like_transport();

  m.attr("WIRE_VERSION") = pa2a::kWireVersion;
  m.attr("MAX_WORLD") = pa2a::cuda::kMaxWorld;
  m.attr("TICKET_BYTES") = sizeof(CallTicket);
  m.attr("P2P") = static_cast<int>(pa2a::cuda::PairTransport::kP2P);
  m.attr("STAGED") = static_cast<int>(pa2a::cuda::PairTransport::kStaged);
  m.attr("CUDART_VERSION") = CUDART_VERSION;

  m.def(
      "device_report",
      [](int32_t device) {
        DeviceReport r;
        {
          py::gil_scoped_release release;
          r = CudaTransport::device_report(device);
        }
        py::dict d;  // with the GIL
        d["compute_mode"] = r.compute_mode;
        d["host_register"] = r.host_register;
        d["multiprocessors"] = r.multiprocessors;
        d["cc"] = py::make_tuple(r.cc_major, r.cc_minor);
        d["driver_version"] = r.driver_version;
        d["runtime_version"] = r.runtime_version;
        return d;
      },
      py::arg("device"),
      "what the transport needs to know about a device before using it (no context needed "
      "beyond the runtime's)");

  py::class_<CudaTransport>(m, "CudaTransport")
      .def(py::init([](const std::string& prefix, int32_t rank, int32_t world, int32_t hidden,
                       int32_t max_tokens, int32_t num_topk, int payload, int dtype, int32_t device,
                       int32_t num_local_experts, bool need_host_region, int32_t host_numa_node,
                       int32_t max_recv_blocks, bool pdl, bool with_pull, double send_timeout_s) {
             py::gil_scoped_release release;
             return new CudaTransport(
                 prefix, rank,
                 pa2a::make_wire_config(world, hidden, max_tokens, num_topk, payload, dtype),
                 device, num_local_experts, need_host_region, host_numa_node, max_recv_blocks, pdl,
                 with_pull, send_timeout_s);
           }),
           py::arg("prefix"), py::arg("rank"), py::arg("world"), py::arg("hidden"),
           py::arg("max_tokens"), py::arg("num_topk"), py::arg("payload"), py::arg("dtype"),
           py::arg("device"), py::arg("num_local_experts"), py::arg("need_host_region"),
           py::arg("host_numa_node") = -1, py::arg("max_recv_blocks") = 0, py::arg("pdl") = true,
           py::arg("with_pull") = false, py::arg("send_timeout_s") = 30.0)
      .def_static("segment_name", &CudaTransport::segment_name)
      .def_static("unlink_name", &CudaTransport::unlink_name)
      .def("ipc_handle", [](const CudaTransport& t) { return py::bytes(t.ipc_handle()); })
      .def(
          "open_peers",
          [](CudaTransport& t, const std::vector<py::bytes>& handles,
             const std::vector<int32_t>& send_transport, const std::vector<int32_t>& recv_transport,
             const std::vector<int32_t>& order, uint64_t nonce) {
            std::vector<std::string> hs;
            for (const auto& h : handles) hs.emplace_back(h);
            py::gil_scoped_release release;
            t.open_peers(hs, send_transport, recv_transport, order, nonce);
          },
          py::arg("handles"), py::arg("send_transport"), py::arg("recv_transport"),
          py::arg("order"), py::arg("nonce"))
      .def(
          "open_local",
          [](CudaTransport& t, const std::vector<CudaTransport*>& peers,
             const std::vector<int32_t>& send_transport, const std::vector<int32_t>& recv_transport,
             const std::vector<int32_t>& order, uint64_t nonce) {
            py::gil_scoped_release release;
            t.open_local(peers, send_transport, recv_transport, order, nonce);
          },
          py::arg("peers"), py::arg("send_transport"), py::arg("recv_transport"), py::arg("order"),
          py::arg("nonce"))
      .def("probe_peers", &CudaTransport::probe_peers, py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_placement", &CudaTransport::set_placement, py::arg("offset"), py::arg("rank"),
           py::arg("local"), py::arg("choice_offset") = std::vector<int32_t>(),
           py::arg("choice") = std::vector<int32_t>(), py::call_guard<py::gil_scoped_release>())
      .def("unlink_own", &CudaTransport::unlink_own)
      .def("close", &CudaTransport::close, py::call_guard<py::gil_scoped_release>())
      .def("close_imports", &CudaTransport::close_imports, py::call_guard<py::gil_scoped_release>())
      .def("free_own", &CudaTransport::free_own, py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("own_leaked", &CudaTransport::own_leaked)
      .def("stats",
           [](CudaTransport& t) {
             pa2a::cuda::TransportStats r;
             {
               py::gil_scoped_release release;
               r = t.stats();
             }
             py::dict d;
             d["calls"] = r.calls;
             d["last_family"] = r.last_family;
             d["last_rows"] = r.last_rows;
             d["total_rows"] = py::make_tuple(r.total_rows[0], r.total_rows[1]);
             return d;
           })
      .def("check", &CudaTransport::check)
      .def("error_word", &CudaTransport::error_word)
      .def_property_readonly("segment_bytes", &CudaTransport::segment_bytes)
      .def_property_readonly("dispatch_slot_bytes",
                             [](const CudaTransport& t) { return t.layout().dispatch_slot; })
      .def_property_readonly("combine_slot_bytes",
                             [](const CudaTransport& t) { return t.layout().combine_slot; })
      .def_property_readonly("has_host_region", &CudaTransport::has_host_region)
      .def_property_readonly("numa_warning", &CudaTransport::numa_warning)
      .def_property_readonly("device", &CudaTransport::device)
      .def_property_readonly("host_seq", &CudaTransport::host_seq)
      .def_property_readonly("max_recv_blocks", &CudaTransport::max_recv_blocks)
      .def_property_readonly("with_pull", &CudaTransport::with_pull)
      .def_property_readonly("pull_send_mask", &CudaTransport::pull_send_mask)
      .def_property_readonly("pull_recv_mask", &CudaTransport::pull_recv_mask)
      .def_property_readonly("pdl", &CudaTransport::pdl)
      .def_property_readonly("ce_flag_path", &CudaTransport::ce_flag_path)
      .def(
          "dispatch_send",
          [](CudaTransport& t, uintptr_t ticket, uint32_t op, uintptr_t x, int32_t num_tokens,
             uintptr_t topk_ids, uintptr_t topk_weights, int32_t topk, uintptr_t send_token,
             uintptr_t send_count, uintptr_t stream, bool ids64) {
            t.dispatch_send(ptr<CallTicket>(ticket), op, ptr<const void>(x), num_tokens,
                            ptr<const void>(topk_ids), ids64, ptr<const float>(topk_weights), topk,
                            ptr<int32_t>(send_token), ptr<int32_t>(send_count), stream_of(stream));
          },
          py::arg("ticket"), py::arg("op"), py::arg("x"), py::arg("num_tokens"),
          py::arg("topk_ids"), py::arg("topk_weights"), py::arg("topk"), py::arg("send_token"),
          py::arg("send_count"), py::arg("stream"), py::arg("ids64") = false,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "abort",
          [](CudaTransport& t, uintptr_t ticket, uint32_t op, int family, uintptr_t stream) {
            t.abort(ptr<CallTicket>(ticket), op, family, stream_of(stream));
          },
          py::arg("ticket"), py::arg("op"), py::arg("family"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "wait_counts",
          [](CudaTransport& t, uintptr_t ticket, uintptr_t counts, double timeout_s,
             bool tolerate_aborts, uintptr_t stream) {
            t.wait_counts(ptr<const CallTicket>(ticket), ptr<int32_t>(counts), timeout_s,
                          tolerate_aborts, stream_of(stream));
          },
          py::arg("ticket"), py::arg("counts"), py::arg("timeout_s"), py::arg("tolerate_aborts"),
          py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def(
          "unpack_rows",
          [](CudaTransport& t, uintptr_t ticket, bool wait, uintptr_t counts, uintptr_t row_base,
             uintptr_t x_out, uintptr_t fp8_out, uintptr_t scales_out, uintptr_t src_rank,
             uintptr_t src_token, uintptr_t topk_ids, uintptr_t topk_weights,
             uintptr_t expert_count, double timeout_s, uintptr_t stream) {
            t.unpack_rows(ptr<const CallTicket>(ticket), wait, ptr<int32_t>(counts),
                          ptr<const int64_t>(row_base), ptr<void>(x_out), ptr<uint8_t>(fp8_out),
                          ptr<float>(scales_out), ptr<int32_t>(src_rank), ptr<int32_t>(src_token),
                          ptr<int32_t>(topk_ids), ptr<float>(topk_weights),
                          ptr<int32_t>(expert_count), timeout_s, stream_of(stream));
          },
          py::arg("ticket"), py::arg("wait"), py::arg("counts"), py::arg("row_base"),
          py::arg("x_out"), py::arg("fp8_out"), py::arg("scales_out"), py::arg("src_rank"),
          py::arg("src_token"), py::arg("topk_ids"), py::arg("topk_weights"),
          py::arg("expert_count"), py::arg("timeout_s"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "unpack_expert_major",
          [](CudaTransport& t, uintptr_t ticket, uintptr_t recv_count, uintptr_t x_out,
             uintptr_t fp8_out, uintptr_t scales_out, uintptr_t expert_count, uintptr_t src_info,
             uintptr_t layout_range, uintptr_t expert_pos, uintptr_t row_experts,
             uintptr_t row_weights, double timeout_s, uintptr_t stream) {
            t.unpack_expert_major(
                ptr<const CallTicket>(ticket), ptr<int32_t>(recv_count), ptr<void>(x_out),
                ptr<uint8_t>(fp8_out), ptr<float>(scales_out), ptr<int32_t>(expert_count),
                ptr<int32_t>(src_info), ptr<int64_t>(layout_range), ptr<int32_t>(expert_pos),
                ptr<int32_t>(row_experts), ptr<float>(row_weights), timeout_s, stream_of(stream));
          },
          py::arg("ticket"), py::arg("recv_count"), py::arg("x_out"), py::arg("fp8_out"),
          py::arg("scales_out"), py::arg("expert_count"), py::arg("src_info"),
          py::arg("layout_range"), py::arg("expert_pos"), py::arg("row_experts"),
          py::arg("row_weights"), py::arg("timeout_s"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "combine_send",
          [](CudaTransport& t, uintptr_t ticket, uint32_t op, uintptr_t y, uintptr_t recv_count,
             uintptr_t row_base, uintptr_t expert_pos, uintptr_t row_experts, uintptr_t row_weights,
             uintptr_t stream) {
            t.combine_send(ptr<CallTicket>(ticket), op, ptr<const void>(y),
                           ptr<const int32_t>(recv_count), ptr<const int64_t>(row_base),
                           ptr<const int32_t>(expert_pos), ptr<const int32_t>(row_experts),
                           ptr<const float>(row_weights), stream_of(stream));
          },
          py::arg("ticket"), py::arg("op"), py::arg("y"), py::arg("recv_count"),
          py::arg("row_base"), py::arg("expert_pos"), py::arg("row_experts"),
          py::arg("row_weights"), py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def(
          "dispatch_send_ce",
          [](CudaTransport& t, uintptr_t ticket, uint32_t op, uintptr_t x, int32_t num_tokens,
             uintptr_t topk_ids, uintptr_t topk_weights, int32_t topk, uintptr_t send_token,
             uintptr_t send_count, uint64_t min_bytes, uintptr_t stream, bool ids64) {
            t.dispatch_send_ce(ptr<CallTicket>(ticket), op, ptr<const void>(x), num_tokens,
                               ptr<const void>(topk_ids), ids64, ptr<const float>(topk_weights),
                               topk, ptr<int32_t>(send_token), ptr<int32_t>(send_count), min_bytes,
                               stream_of(stream));
          },
          py::arg("ticket"), py::arg("op"), py::arg("x"), py::arg("num_tokens"),
          py::arg("topk_ids"), py::arg("topk_weights"), py::arg("topk"), py::arg("send_token"),
          py::arg("send_count"), py::arg("min_bytes"), py::arg("stream"), py::arg("ids64") = false,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "combine_send_ce",
          [](CudaTransport& t, uintptr_t ticket, uint32_t op, uintptr_t y, uintptr_t recv_count,
             uintptr_t row_base, const std::vector<int32_t>& counts,
             const std::vector<int64_t>& row_base_host, uint64_t min_bytes, uintptr_t stream) {
            py::gil_scoped_release release;
            t.combine_send_ce(ptr<CallTicket>(ticket), op, ptr<const void>(y),
                              ptr<const int32_t>(recv_count), ptr<const int64_t>(row_base), counts,
                              row_base_host, min_bytes, stream_of(stream));
          },
          py::arg("ticket"), py::arg("op"), py::arg("y"), py::arg("recv_count"),
          py::arg("row_base"), py::arg("counts"), py::arg("row_base_host"), py::arg("min_bytes"),
          py::arg("stream"))
      .def_property_readonly("last_ce_mask", &CudaTransport::last_ce_mask)
      .def(
          "reduce_expert_major",
          [](CudaTransport& t, uintptr_t y, uintptr_t recv_count, uintptr_t expert_pos,
             uintptr_t row_experts, uintptr_t row_weights, uintptr_t rows_out, uintptr_t stream) {
            t.reduce_expert_major(ptr<const void>(y), ptr<const int32_t>(recv_count),
                                  ptr<const int32_t>(expert_pos), ptr<const int32_t>(row_experts),
                                  ptr<const float>(row_weights), ptr<void>(rows_out),
                                  stream_of(stream));
          },
          py::arg("y"), py::arg("recv_count"), py::arg("expert_pos"), py::arg("row_experts"),
          py::arg("row_weights"), py::arg("rows_out"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "combine_recv",
          [](CudaTransport& t, uintptr_t ticket, uintptr_t send_token, uintptr_t send_count,
             int32_t num_tokens, uintptr_t out, double timeout_s, uintptr_t stream) {
            t.combine_recv(ptr<const CallTicket>(ticket), ptr<const int32_t>(send_token),
                           ptr<const int32_t>(send_count), num_tokens, ptr<void>(out), timeout_s,
                           stream_of(stream));
          },
          py::arg("ticket"), py::arg("send_token"), py::arg("send_count"), py::arg("num_tokens"),
          py::arg("out"), py::arg("timeout_s"), py::arg("stream"),
          py::call_guard<py::gil_scoped_release>());
}
