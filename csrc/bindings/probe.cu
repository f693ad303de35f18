// pcie_a2a._probe: the calibration probe (csrc/cuda/probe) for pcie_a2a.topology.probe_run.
// Raw device indices, sizes and mode numbers cross the boundary; torch is not involved.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/python_errors.h"
#include "core/exception.h"
#include "cuda/probe/runtime.cuh"
#include "cuda/probe/session.cuh"

namespace py = pybind11;
using pa2a::probe::Mode;
using pa2a::probe::Session;

namespace {

Mode mode_of(int m) {
  PA2A_CHECK_ARG(m >= 0 && m <= 4, "probe: mode ", m,
                 ": expected 0 store, 1 load, 2 ce, 3 ce_read, 4 staged");
  return static_cast<Mode>(m);
}

}  // namespace

PYBIND11_MODULE(_probe, m) {
  m.doc() = "pcie_a2a calibration probe (kernels, copy engine and host staging between GPUs)";
  pa2a::bindings::translate_errors_like_transport();
  m.def(
      "device_count",
      []() {
        int n = 0;
        const cudaError_t e = pa2a::probe::rt::device_count(&n);
        if (e != cudaSuccess) {
          (void)cudaGetLastError();
          return std::make_tuple(0,
                                 std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e));
        }
        return std::make_tuple(n, std::string());
      },
      "(count, error string) of CUDA devices");
  m.def(
      "identities",
      []() {
        int n = 0;
        if (pa2a::probe::rt::device_count(&n) != cudaSuccess) {
          (void)cudaGetLastError();
          n = 0;
        }
        std::vector<std::tuple<std::string, std::string, std::string>> out;
        for (int d = 0; d < n; ++d)
          out.emplace_back(pa2a::probe::rt::bus_id(d), pa2a::probe::rt::uuid(d),
                           pa2a::probe::rt::name(d));
        return out;
      },
      "(bus id, UUID, name) of every CUDA device, in CUDA's order");
  m.def("cuda_driver_version", &pa2a::probe::rt::driver_version);
  py::class_<Session>(m, "Session")
      .def(py::init<std::vector<int>, size_t, std::vector<int>>(), py::arg("devices"),
           py::arg("slot_bytes"), py::arg("staging_numa"))
      .def("identities",
           [](const Session& s) {
             std::vector<std::tuple<std::string, std::string, std::string>> out;
             for (const auto& i : s.identities()) out.emplace_back(i.bus_id, i.uuid, i.name);
             return out;
           })
      .def("can_access", &Session::can_access)
      .def(
          "known_answer",
          [](Session& s, int src, int dst, int mode, size_t nbytes, uint32_t seed) {
            py::gil_scoped_release unlocked;
            const auto r = s.known_answer(src, dst, mode_of(mode), nbytes, seed);
            return std::make_tuple(r.offset, r.got, r.expected);
          },
          "(offset, got, expected) of the first wrong byte, offset -1 when all are right")
      .def(
          "known_answer_flows",
          [](Session& s, const std::vector<std::pair<int, int>>& flows, int mode, size_t nbytes,
             uint32_t seed) {
            py::gil_scoped_release unlocked;
            std::vector<std::tuple<int64_t, int, int>> out;
            for (const auto& r : s.known_answer_flows(flows, mode_of(mode), nbytes, seed))
              out.emplace_back(r.offset, r.got, r.expected);
            return out;
          },
          "known_answer for flows run together; source s sends the pattern of seed + s")
      .def(
          "run_flows",
          [](Session& s, const std::vector<std::pair<int, int>>& flows, int mode, size_t nbytes) {
            py::gil_scoped_release unlocked;
            return s.run_flows(flows, mode_of(mode), nbytes);
          },
          "seconds per flow, every flow started together")
      .def("latency_us",
           [](Session& s, int src, int dst, int mode, int iters) {
             py::gil_scoped_release unlocked;
             return s.latency_us(src, dst, mode_of(mode), iters);
           })
      .def("close", &Session::close);
}
