// pcie_a2a._cuda: device queries and the CUDA ops. Built only when nvcc is found.
// Raw pointers and stream handles cross the boundary; torch stays in Python.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <string>
#include <tuple>

#include "bindings/python_errors.h"
#include "core/exception.h"
#include "cuda/quantize_fp8.cuh"

namespace py = pybind11;

namespace {

std::tuple<int, std::string> device_count() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky error so later calls start clean
    return {0, std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err)};
  }
  return {n, ""};
}

void check_launch() {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    PA2A_THROW(kRuntime, "CUDA launch failed: ", cudaGetErrorName(err), ": ",
               cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "pcie_a2a CUDA kernels (raw pointers, sizes and streams; no torch ABI)";
  pa2a::bindings::translate_errors_like_transport();
  m.def("device_count", &device_count, "(count, error string) from cudaGetDeviceCount");
  m.attr("cuda_runtime_version") = CUDART_VERSION;
  m.def(
      "driver_version",
      [] {
        int v = 0;  // 0: no driver
        if (cudaDriverGetVersion(&v) != cudaSuccess) (void)cudaGetLastError();
        return v;
      },
      "the CUDA version the installed driver supports (1000 * major + 10 * minor), 0 if none");
  m.def(
      "quantize_fp8",
      [](uintptr_t x, int dtype, int64_t rows, int32_t hidden, uintptr_t q, uintptr_t scales,
         uintptr_t stream) {
        PA2A_CHECK_ARG(hidden % pa2a::kFp8GroupSize == 0, "hidden must be a multiple of 128, got ",
                       hidden);
        pa2a::cuda::launch_quantize_fp8(
            reinterpret_cast<const uint16_t*>(x), static_cast<pa2a::DType>(dtype), rows, hidden,
            reinterpret_cast<uint8_t*>(q), reinterpret_cast<float*>(scales),
            reinterpret_cast<cudaStream_t>(stream));
        check_launch();
      },
      py::arg("x"), py::arg("dtype"), py::arg("rows"), py::arg("hidden"), py::arg("q"),
      py::arg("scales"), py::arg("stream"));
  m.def(
      "dequantize_fp8",
      [](uintptr_t q, uintptr_t scales, int64_t rows, int32_t hidden, int out_dtype, uintptr_t out,
         uintptr_t stream) {
        pa2a::cuda::launch_dequantize_fp8(
            reinterpret_cast<const uint8_t*>(q), reinterpret_cast<const float*>(scales), rows,
            hidden, static_cast<pa2a::DType>(out_dtype), reinterpret_cast<uint16_t*>(out),
            reinterpret_cast<cudaStream_t>(stream));
        check_launch();
      },
      py::arg("q"), py::arg("scales"), py::arg("rows"), py::arg("hidden"), py::arg("out_dtype"),
      py::arg("out"), py::arg("stream"));
}
