// pcie_a2a._allreduce_cuda: the CUDA all-reduce (csrc/cuda/allreduce). Raw device pointers
// (tensor.data_ptr()), sizes, dtype codes and stream handles (torch.cuda.Stream.cuda_stream)
// cross the boundary; torch stays in Python. A pointer of 0 means "absent" where an
// argument is optional. Every call releases the GIL.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings/python_errors.h"
#include "core/exception.h"
#include "cuda/allreduce/communicator.cuh"
#include "cuda/allreduce/kernels.cuh"

namespace py = pybind11;
using pa2a::ar::CudaAllReduce;

namespace {

cudaStream_t stream_of(uintptr_t s) {
  return reinterpret_cast<cudaStream_t>(s);
}

const void* cptr(uintptr_t p) {
  return reinterpret_cast<const void*>(p);
}

void* mptr(uintptr_t p) {
  return reinterpret_cast<void*>(p);
}

}  // namespace

PYBIND11_MODULE(_allreduce_cuda, m) {
  m.doc() = "pcie_a2a CUDA all-reduce over CUDA IPC (raw pointers, no torch)";
  pa2a::bindings::translate_errors_like_transport();
  m.attr("MAX_WORLD") = pa2a::ar::kMaxWorld;
  m.attr("VERSION") = pa2a::ar::kVersion;

  m.def(
      "device_count",
      []() -> py::tuple {
        int n = 0;
        const cudaError_t e = cudaGetDeviceCount(&n);
        if (e != cudaSuccess) {
          (void)cudaGetLastError();
          return py::make_tuple(0, std::string(cudaGetErrorString(e)));
        }
        return py::make_tuple(n, std::string());
      },
      "(number of CUDA devices, error text or '')");

  m.def(
      "rmsnorm",
      [](int dtype, uintptr_t r, uintptr_t residual, uintptr_t weight, int64_t rows, int32_t hidden,
         float eps, uintptr_t normed, uintptr_t residual_out, uintptr_t stream) {
        pa2a::ar::launch_rmsnorm(static_cast<pa2a::DType>(dtype), cptr(r), cptr(residual),
                                 cptr(weight), rows, hidden, eps, mptr(normed), mptr(residual_out),
                                 stream_of(stream));
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
          PA2A_THROW(kRuntime, "CUDA all-reduce: launching rmsnorm failed: ", cudaGetErrorName(e));
      },
      py::call_guard<py::gil_scoped_release>());

  py::class_<CudaAllReduce>(m, "CudaAllReduce")
      .def(py::init([](int32_t rank, int32_t world, int64_t max_bytes, int32_t buffers,
                       int32_t device, bool end_barrier) {
             pa2a::ar::Config c;
             c.world = world;
             c.max_bytes = max_bytes;
             c.buffers = buffers;
             return new CudaAllReduce(rank, c, device, end_barrier);
           }),
           py::arg("rank"), py::arg("world"), py::arg("max_bytes"), py::arg("buffers"),
           py::arg("device"), py::arg("end_barrier"))
      .def("ipc_handle", [](const CudaAllReduce& t) { return py::bytes(t.ipc_handle()); })
      .def_property_readonly("segment_ptr", &CudaAllReduce::segment_ptr)
      .def_property_readonly("segment_bytes", &CudaAllReduce::segment_bytes)
      .def(
          "open_peers",
          [](CudaAllReduce& t, const std::vector<py::bytes>& handles,
             const std::vector<uintptr_t>& local, const std::vector<uint8_t>& pull) {
            std::vector<std::string> hs;
            for (const auto& h : handles) hs.emplace_back(h);
            py::gil_scoped_release release;
            t.open_peers(hs, local, pull);
          },
          py::arg("handles"), py::arg("local"), py::arg("pull"))
      .def("close", &CudaAllReduce::close, py::call_guard<py::gil_scoped_release>())
      .def("check", &CudaAllReduce::check)
      .def("error_word", &CudaAllReduce::error_word)
      .def("last_bytes", [](const CudaAllReduce& t) { return t.last_bytes(); })
      .def(
          "run",
          [](CudaAllReduce& t, int algo, int dtype, uintptr_t x, int64_t numel, uintptr_t residual,
             uintptr_t out, double timeout_s, uintptr_t stream) {
            t.run(static_cast<pa2a::ar::Algo>(algo), static_cast<pa2a::DType>(dtype), cptr(x),
                  numel, cptr(residual), mptr(out), timeout_s, stream_of(stream));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "abort",
          [](CudaAllReduce& t, double timeout_s, uintptr_t stream) {
            t.abort(timeout_s, stream_of(stream));
          },
          py::call_guard<py::gil_scoped_release>());
}
