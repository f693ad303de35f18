// pcie_a2a._numa: NUMA-bound host staging memory (mmap + mbind + first touch).
// Addresses cross the boundary as integers; a NumaBuffer also exposes the buffer protocol so
// numpy (and torch via numpy) can view it without a copy.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "bindings/python_errors.h"
#include "core/exception.h"
#include "core/numa_memory.h"

namespace py = pybind11;
using pa2a::NumaBindResult;
using pa2a::NumaBuffer;

namespace {

void warn_if_needed(const NumaBindResult& r) {
  if (r.warning.empty()) return;
  py::module_::import("warnings")
      .attr("warn")(r.warning, py::module_::import("builtins").attr("RuntimeWarning"), 2);
}

}  // namespace

PYBIND11_MODULE(_numa, m) {
  m.doc() = "NUMA-bound host staging memory (mmap + mbind + first touch, no libnuma)";

  pa2a::bindings::translate_errors_like_transport();

  py::class_<NumaBindResult>(m, "NumaBindResult")
      .def_readonly("bound", &NumaBindResult::bound)
      .def_readonly("node", &NumaBindResult::node)
      .def_readonly("warning", &NumaBindResult::warning)
      .def("__repr__", [](const NumaBindResult& r) {
        return "NumaBindResult(bound=" + std::string(r.bound ? "True" : "False") +
               ", node=" + std::to_string(r.node) +
               ", warning=" + py::repr(py::str(r.warning)).cast<std::string>() + ")";
      });

  m.def("num_nodes", &pa2a::numa_num_nodes, "NUMA nodes in /sys/devices/system/node (>= 1)");
  m.def("node_exists", &pa2a::numa_node_exists, py::arg("node"));
  m.def("node_of_current_cpu", &pa2a::numa_node_of_current_cpu,
        "node of the CPU this thread runs on (getcpu), 0 if unknown");
  m.def(
      "node_of_address",
      [](uintptr_t addr) {
        return pa2a::numa_node_of_address(reinterpret_cast<const void*>(addr));
      },
      py::arg("address"), "node of the faulted-in page at address, -1 if the kernel refuses");
  m.def("page_size", &pa2a::page_size);
  m.def(
      "bind_and_touch",
      [](uintptr_t addr, size_t nbytes, int node, bool simulate_refusal) {
        NumaBindResult r;
        {
          py::gil_scoped_release nogil;
          r = pa2a::numa_bind_and_touch(reinterpret_cast<void*>(addr), nbytes, node,
                                        simulate_refusal);
        }
        warn_if_needed(r);
        return r;
      },
      py::arg("address"), py::arg("nbytes"), py::arg("node"), py::arg("simulate_refusal") = false,
      "bind a page-aligned, untouched mapping to node, touch it, verify; warns when refused");

  py::class_<NumaBuffer>(m, "NumaBuffer", py::buffer_protocol())
      .def(py::init([](size_t nbytes, int node, bool simulate_refusal) {
             NumaBuffer* b;
             {
               py::gil_scoped_release nogil;
               b = new NumaBuffer(nbytes, node, simulate_refusal);
             }
             warn_if_needed(b->bind_result());
             return b;
           }),
           py::arg("nbytes"), py::arg("node"), py::arg("simulate_refusal") = false)
      .def_property_readonly(
          "address", [](const NumaBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &NumaBuffer::size)
      .def_property_readonly("mapped_nbytes", &NumaBuffer::mapped_size)
      .def_property_readonly("requested_node", &NumaBuffer::requested_node)
      .def_property_readonly("bound", [](const NumaBuffer& b) { return b.bind_result().bound; })
      .def_property_readonly("node", [](const NumaBuffer& b) { return b.bind_result().node; })
      .def_property_readonly("warning", [](const NumaBuffer& b) { return b.bind_result().warning; })
      .def(
          "node_of",
          [](const NumaBuffer& b, size_t offset) {
            PA2A_CHECK_ARG(offset < b.size(), "node_of: offset=", offset,
                           " is outside the buffer of ", b.size(), " bytes");
            return pa2a::numa_node_of_address(static_cast<const char*>(b.data()) + offset);
          },
          py::arg("offset"), "node of the page holding byte `offset`")
      .def_buffer([](NumaBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      });
}
