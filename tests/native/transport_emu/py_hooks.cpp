// The emulated runtime's side door for the Python-level emulation (tests/cuda_emu_module.py):
// the extension module is the real csrc/bindings/cuda_transport.cu compiled against the CUDA
// model, and these C functions (found with ctypes in the same shared object) give Python the
// runtime's counters, streams and graph capture, which a GPU build gets from torch.cuda.
#include <cuda_runtime.h>

#include <string>

extern "C" {

// launches (stream operations), host synchronisations, launches with PDL
void emu_counts(unsigned long long* out) {
  out[0] = emu_rt::st.counts.launches;
  out[1] = emu_rt::st.counts.syncs;
  out[2] = emu_rt::st.counts.pdl_launches;
}

void* emu_stream_create() {
  cudaStream_t s = nullptr;
  return cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess ? s : nullptr;
}

int emu_stream_destroy(void* s) {
  return cudaStreamDestroy(static_cast<cudaStream_t>(s));
}

int emu_begin_capture(void* s) {
  return cudaStreamBeginCapture(static_cast<cudaStream_t>(s), cudaStreamCaptureModeThreadLocal);
}

// Ends the capture and instantiates it; *exec receives the graph executable.
int emu_end_capture(void* s, void** exec) {
  cudaGraph_t g = nullptr;
  int e = cudaStreamEndCapture(static_cast<cudaStream_t>(s), &g);
  if (e != cudaSuccess) return e;
  cudaGraphExec_t x = nullptr;
  e = cudaGraphInstantiate(&x, g, 0);
  (void)cudaGraphDestroy(g);
  *exec = x;
  return e;
}

int emu_graph_launch(void* exec, void* s) {
  return cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), static_cast<cudaStream_t>(s));
}

int emu_graph_destroy(void* exec) {
  return cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
}

const char* emu_leak_report() {
  static std::string report;
  report = emu_rt::leak_report();
  return report.c_str();
}

}  // extern "C"
