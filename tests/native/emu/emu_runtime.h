// A fake CUDA runtime for host code that drives kernels of the execution model (emu_cuda.h),
// in one process or in several forked ones (one per rank), so that real host code such as
// csrc/cuda/transport/cuda_transport.cu compiles and runs unchanged.
//
// Model:
//  * Device memory is one arena mapped MAP_SHARED | MAP_ANONYMOUS by the driver *before it
//    forks* (arena_create), so every process sees every allocation at the same address:
//    that is what CUDA IPC gives a process (a peer's device memory in its address space).
//    Each process allocates from its own region of the arena (arena_enter), 256-byte
//    aligned with a gap after each allocation; new allocations hold garbage (0xCD), like
//    cudaMalloc's. cudaIpcGetMemHandle puts (offset, size, owner) into the 64-byte handle;
//    cudaIpcOpenMemHandle returns arena base + offset (refused in the owning process, as
//    CUDA refuses it).
//  * Under AddressSanitizer the whole arena is poisoned in every process and only what the
//    process may touch is unpoisoned: its live allocations and the peers' allocations it
//    has opened through IPC. A kernel or host access outside them (an overrun, a freed
//    buffer, a peer segment after cudaIpcCloseMemHandle) is reported like a heap overflow.
//  * Pinned host memory: cudaHostAlloc is posix_memalign; cudaHostRegister records the
//    range (a second registration of an overlapping range fails as in CUDA);
//    cudaHostGetDevicePointer returns the same pointer (unified addressing) for memory
//    that was allocated or registered that way and fails otherwise.
//  * Streams and events are handles that must be live when used. Work runs synchronously
//    when it is issued (copies, memsets, kernels), so streams execute in issue order,
//    which is one legal CUDA schedule: every dependency (stream order, an event waited
//    on) points to earlier-issued work. The model therefore cannot show a missing
//    cross-stream dependency; it does show work issued in the wrong order.
//  * Launch configurations are checked (block 1..1024 threads, grid.y <= 65535, dynamic
//    shared memory <= 48 KiB): an invalid one runs nothing and sets the sticky error
//    returned by cudaGetLastError, as a real launch does.
//  * cudaMemcpy* checks the direction against the pointers (device = inside the arena).
//  * leak_report() lists what a process still holds: allocations, IPC mappings, pinned
//    and registered host memory, streams, events.
//  * Counts (st.counts): stream operations (kernel launches, async copies and memsets,
//    stream memory operations) and host synchronisations (cudaStreamSynchronize,
//    cudaEventSynchronize, cudaDeviceSynchronize, the synchronous cudaMemcpy/cudaMemset):
//    the host code's cost in launches and round trips, as a GPU would see it.
//  * Stream capture (cudaStreamBeginCapture ... cudaStreamEndCapture, cudaGraphLaunch):
//    work issued to a capturing stream is recorded with its arguments by value and run at
//    each launch of the graph; a host synchronisation while a capture is active fails with
//    cudaErrorStreamCaptureUnsupported, as CUDA's "unsafe call during capture" does.
//  * Kernels must be loaded before their first launch (cudaFuncGetAttributes, see
//    require_loaded), so host code that relies on lazy loading is caught.
//  * cudaGetDriverEntryPointByVersion knows cuStreamWriteValue32/64 (a fence, then the
//    store, in stream order; EMU_NO_STREAM_MEMOPS=1: not available).
//  * Device attributes: EMU_NUM_SMS multiprocessors (default 3), compute capability 9.0,
//    EMU_NO_HOST_REGISTER=1 reports no cudaHostRegister support.
//  * Faults: EMU_IPC_BLACKHOLE=R makes cudaIpcOpenMemHandle of region R's memory return a
//    private mapping: stores through it never reach R ("P2P supported" but not working).
//  * A process that never called arena_create gets a one-region arena at its first
//    allocation (EMU_ARENA_MB, default 256): single-process users (a Python extension).
// One device (0) exists.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "emu_cuda.h"

// AddressSanitizer's manual poisoning, when the program is linked with it. Weak symbols
// rather than __SANITIZE_ADDRESS__, so that every translation unit (instrumented or not:
// the mutation builds mix them) has the same definition of these inline functions.
extern "C" void __asan_poison_memory_region(void const volatile*, size_t) __attribute__((weak));
extern "C" void __asan_unpoison_memory_region(void const volatile*, size_t) __attribute__((weak));
#define EMU_POISON(p, n) \
  (__asan_poison_memory_region ? __asan_poison_memory_region((p), (n)) : (void)0)
#define EMU_UNPOISON(p, n) \
  (__asan_unpoison_memory_region ? __asan_unpoison_memory_region((p), (n)) : (void)0)

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorHostMemoryAlreadyRegistered = 712,
  cudaErrorHostMemoryNotRegistered = 713,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
};
#define CUDART_VERSION 13000
typedef struct CUgraph_st* cudaGraph_t;
typedef struct CUgraphExec_st* cudaGraphExec_t;
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeMode = 20,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrHostRegisterSupported = 99,
};
struct cudaFuncAttributes {
  int maxThreadsPerBlock;
  size_t sharedSizeBytes;
};
enum cudaDriverEntryPointQueryResult {
  cudaDriverEntryPointSuccess = 0,
  cudaDriverEntryPointSymbolNotFound = 1,
  cudaDriverEntryPointVersionNotSufficent = 2,
};
constexpr unsigned long long cudaEnableDefault = 0;
typedef struct CUevent_st* cudaEvent_t;
struct cudaIpcMemHandle_t {
  char reserved[64];
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};
constexpr unsigned cudaHostAllocDefault = 0, cudaHostAllocPortable = 1, cudaHostAllocMapped = 2;
constexpr unsigned cudaHostRegisterDefault = 0, cudaHostRegisterPortable = 1,
                   cudaHostRegisterMapped = 2;
constexpr unsigned cudaEventDefault = 0, cudaEventDisableTiming = 2;
constexpr unsigned cudaStreamDefault = 0, cudaStreamNonBlocking = 1;
constexpr unsigned cudaIpcMemLazyEnablePeerAccess = 1;

namespace emu_rt {

constexpr size_t kAlign = 256;         // cudaMalloc's alignment
constexpr size_t kGap = 256;           // poisoned bytes after every allocation
constexpr size_t kScratch = 1u << 20;  // start of the arena: the driver's shared scratch
constexpr uint64_t kHandleMagic = 0x454d55495043ull;  // "EMUIPC"
constexpr size_t kMaxDynamicSmem = 48 * 1024;         // without cudaFuncSetAttribute

struct Handle {  // what cudaIpcMemHandle_t carries
  uint64_t magic;
  uint64_t offset;  // from the arena base
  uint64_t bytes;
  int64_t owner;  // pid of the allocating process
};
static_assert(sizeof(Handle) <= sizeof(cudaIpcMemHandle_t), "handle fits");

struct Counts {
  uint64_t launches = 0;      // stream operations: kernels, async copies/memsets, memops
  uint64_t pdl_launches = 0;  // kernels launched with programmatic dependent launch
  uint64_t syncs = 0;         // host synchronisations
};

struct Graph {  // a captured stream's work, in issue order
  std::vector<std::function<void()>> nodes;
};

struct State {
  unsigned char* base = nullptr;  // the arena (same address in every process)
  size_t bytes = 0;
  size_t region_bytes = 1;
  unsigned char *next = nullptr, *end = nullptr;                  // this process's region
  std::map<const unsigned char*, size_t> live;                    // device allocations
  std::map<const unsigned char*, std::pair<int, size_t>> opened;  // IPC: (opens, bytes)
  std::map<const unsigned char*, size_t> pinned, registered;
  std::set<uintptr_t> streams, events;
  uintptr_t next_handle = 0x1000;
  int device = 0;
  cudaError_t last = cudaSuccess;  // sticky launch error
  Counts counts;
  uintptr_t capturing = 0;                      // the stream being captured (0: none)
  std::unique_ptr<Graph> capture;               // its work so far
  std::set<const Graph*> graphs;                // instantiated graphs (cudaGraphExec_t)
  std::set<const void*> loaded;                 // kernels loaded (cudaFuncGetAttributes)
  std::map<unsigned char*, size_t> blackholes;  // EMU_IPC_BLACKHOLE mappings
};
inline State st;

inline size_t align_up(size_t n, size_t a) {
  return (n + a - 1) / a * a;
}

// Maps the arena: kScratch bytes for the driver, then `regions` regions of `region_bytes`.
// Call before fork.
inline void arena_create(int regions, size_t region_bytes) {
  st.bytes = kScratch + static_cast<size_t>(regions) * region_bytes;
  st.region_bytes = region_bytes;
  void* p = mmap(nullptr, st.bytes, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) emu::fail("mmap of the device arena failed");
  st.base = static_cast<unsigned char*>(p);
  st.next = st.end = nullptr;
}

inline void* scratch() {
  return st.base;
}

inline void arena_enter(int region, size_t region_bytes);

// A single-process user's arena, made at the first allocation (see the top comment).
inline void ensure_arena() {
  if (st.base != nullptr) return;
  const char* mb = std::getenv("EMU_ARENA_MB");
  const size_t bytes = static_cast<size_t>(mb != nullptr ? std::atoi(mb) : 256) << 20;
  arena_create(1, bytes);
  arena_enter(0, bytes);
}

inline int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

// In the process that allocates from region `region` (after fork).
inline void arena_enter(int region, size_t region_bytes) {
  st.next = st.base + kScratch + static_cast<size_t>(region) * region_bytes;
  st.end = st.next + region_bytes;
  EMU_POISON(st.base + kScratch, st.bytes - kScratch);
}

inline bool is_device(const void* p) {
  const auto* c = static_cast<const unsigned char*>(p);
  return st.base != nullptr && c >= st.base + kScratch && c < st.base + st.bytes;
}

inline bool valid_stream(cudaStream_t s) {
  return s == nullptr || st.streams.count(reinterpret_cast<uintptr_t>(s)) != 0;
}

template <typename Map>
inline bool inside(const Map& m, const void* p) {
  const auto* c = static_cast<const unsigned char*>(p);
  auto it = m.upper_bound(c);
  if (it == m.begin()) return false;
  --it;
  return c < it->first + it->second;
}

inline std::string leak_report() {
  std::string r;
  for (const auto& [p, n] : st.live) r += "device allocation of " + std::to_string(n) + " bytes; ";
  for (const auto& [p, n] : st.opened) r += "IPC mapping opened " + std::to_string(n.first) + "x; ";
  for (const auto& [p, n] : st.pinned)
    r += "pinned allocation of " + std::to_string(n) + " bytes; ";
  for (const auto& [p, n] : st.registered)
    r += "registered host range of " + std::to_string(n) + " bytes; ";
  for (const auto& [p, n] : st.blackholes)
    r += "IPC mapping (blackhole) of " + std::to_string(n) + " bytes; ";
  if (!st.graphs.empty()) r += std::to_string(st.graphs.size()) + " graph executables; ";
  if (!st.streams.empty()) r += std::to_string(st.streams.size()) + " streams; ";
  if (!st.events.empty()) r += std::to_string(st.events.size()) + " events; ";
  return r;
}

// Work issued to `stream`: recorded when the stream is being captured, else run now.
// Returns false (and runs nothing) for an invalid stream.
inline bool issue(cudaStream_t stream, std::function<void()> work) {
  if (!valid_stream(stream)) return false;
  ++st.counts.launches;
  if (st.capturing != 0 && reinterpret_cast<uintptr_t>(stream) == st.capturing) {
    st.capture->nodes.push_back(std::move(work));
    return true;
  }
  work();
  return true;
}

// A host synchronisation: counted, and refused while a capture is active.
inline cudaError_t host_sync() {
  ++st.counts.syncs;
  return st.capturing != 0 ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

inline void require_loaded(const void* kernel) {
  if (st.loaded.count(kernel) == 0)
    emu::fail(
        "a kernel was launched that was not loaded first (cudaFuncGetAttributes): lazy "
        "module loading in the middle of a call");
}

inline bool config_ok(dim3 grid, dim3 block, size_t smem) {
  return block.x >= 1 && block.x <= 1024 && block.y == 1 && block.z == 1 && grid.x >= 1 &&
         grid.x <= 0x7fffffffu && grid.y >= 1 && grid.y <= 65535 && grid.z == 1 &&
         smem <= kMaxDynamicSmem;
}

// A kernel launch: checks, then runs the grid here and now (or records it in a capture).
// body must hold the kernel's arguments by value when the stream may be capturing.
inline void launch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   std::function<void()> body, bool pdl = false) {
  if (!valid_stream(stream)) {
    st.last = cudaErrorInvalidResourceHandle;
    return;
  }
  if (!config_ok(grid, block, smem)) {
    st.last = cudaErrorInvalidConfiguration;
    return;
  }
  if (pdl) ++st.counts.pdl_launches;
  issue(stream,
        [grid, block, smem, body = std::move(body)] { emu::launch(grid, block, smem, body); });
}

}  // namespace emu_rt

// ---- the runtime API used by the host code ------------------------------------------------
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer:
      return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection:
      return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorHostMemoryAlreadyRegistered:
      return "cudaErrorHostMemoryAlreadyRegistered";
    case cudaErrorHostMemoryNotRegistered:
      return "cudaErrorHostMemoryNotRegistered";
  }
  return "cudaErrorUnknown";
}
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "emulated CUDA runtime error";
}
inline cudaError_t cudaGetLastError() {
  const cudaError_t e = emu_rt::st.last;
  emu_rt::st.last = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() {
  return emu_rt::st.last;
}
inline cudaError_t cudaSetDevice(int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  emu_rt::st.device = device;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = emu_rt::st.device;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() {
  return emu_rt::host_sync();
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  switch (a) {
    case cudaDevAttrMultiProcessorCount:
      *v = emu_rt::env_int("EMU_NUM_SMS", 3);
      return cudaSuccess;
    case cudaDevAttrComputeMode:
      *v = 0;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *v = 9;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *v = 0;
      return cudaSuccess;
    case cudaDevAttrHostRegisterSupported:
      *v = emu_rt::env_int("EMU_NO_HOST_REGISTER", 0) ? 0 : 1;
      return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}
inline cudaError_t cudaDriverGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
template <typename T>
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, T* kernel) {
  emu_rt::st.loaded.insert(reinterpret_cast<const void*>(kernel));
  a->maxThreadsPerBlock = 1024;
  a->sharedSizeBytes = 0;
  return cudaSuccess;
}

inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  using namespace emu_rt;
  ensure_arena();
  const size_t need = align_up(bytes ? bytes : 1, kAlign) + kGap;
  if (st.next == nullptr || st.next + need > st.end) return cudaErrorMemoryAllocation;
  unsigned char* a = st.next;
  st.next += need;
  st.live[a] = bytes;
  EMU_UNPOISON(a, bytes);
  std::memset(a, 0xCD, bytes);  // cudaMalloc returns garbage, not zeros
  *p = a;
  return cudaSuccess;
}
template <typename T>
inline cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
inline cudaError_t cudaFree(void* p) {
  using namespace emu_rt;
  if (p == nullptr) return cudaSuccess;
  auto it = st.live.find(static_cast<unsigned char*>(p));
  if (it == st.live.end()) return cudaErrorInvalidDevicePointer;
  EMU_POISON(p, it->second);
  st.live.erase(it);
  return cudaSuccess;
}

inline cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned flags) {
  (void)flags;
  if (posix_memalign(p, 4096, bytes ? bytes : 1) != 0) return cudaErrorMemoryAllocation;
  std::memset(*p, 0xCD, bytes);
  emu_rt::st.pinned[static_cast<unsigned char*>(*p)] = bytes;
  return cudaSuccess;
}
template <typename T>
inline cudaError_t cudaHostAlloc(T** p, size_t bytes, unsigned flags) {
  return cudaHostAlloc(reinterpret_cast<void**>(p), bytes, flags);
}
inline cudaError_t cudaFreeHost(void* p) {
  auto& m = emu_rt::st.pinned;
  auto it = m.find(static_cast<unsigned char*>(p));
  if (it == m.end()) return cudaErrorInvalidValue;
  m.erase(it);
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned flags) {
  (void)flags;
  auto& m = emu_rt::st.registered;
  const auto* c = static_cast<const unsigned char*>(p);
  if (emu_rt::inside(m, c) || emu_rt::inside(m, c + bytes - 1)) {
    return cudaErrorHostMemoryAlreadyRegistered;
  }
  auto it = m.lower_bound(c);
  if (it != m.end() && it->first < c + bytes) return cudaErrorHostMemoryAlreadyRegistered;
  m[c] = bytes;
  return cudaSuccess;
}
inline cudaError_t cudaHostUnregister(void* p) {
  auto& m = emu_rt::st.registered;
  auto it = m.find(static_cast<unsigned char*>(p));
  if (it == m.end()) return cudaErrorHostMemoryNotRegistered;
  m.erase(it);
  return cudaSuccess;
}
inline cudaError_t cudaHostGetDevicePointer(void** d, void* p, unsigned flags) {
  if (flags != 0) return cudaErrorInvalidValue;
  if (!emu_rt::inside(emu_rt::st.pinned, p) && !emu_rt::inside(emu_rt::st.registered, p))
    return cudaErrorInvalidValue;
  *d = p;
  return cudaSuccess;
}

inline cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* h, void* p) {
  using namespace emu_rt;
  auto it = st.live.find(static_cast<unsigned char*>(p));
  if (it == st.live.end()) return cudaErrorInvalidValue;
  Handle x{kHandleMagic, static_cast<uint64_t>(it->first - st.base), it->second,
           static_cast<int64_t>(getpid())};
  std::memset(h, 0, sizeof *h);
  std::memcpy(h, &x, sizeof x);
  return cudaSuccess;
}
inline cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t h, unsigned flags) {
  using namespace emu_rt;
  Handle x;
  std::memcpy(&x, &h, sizeof x);
  if (x.magic != kHandleMagic || x.offset < kScratch || x.offset + x.bytes > st.bytes ||
      flags != cudaIpcMemLazyEnablePeerAccess)
    return cudaErrorInvalidValue;
  if (x.owner == static_cast<int64_t>(getpid())) return cudaErrorInvalidResourceHandle;
  const int hole = env_int("EMU_IPC_BLACKHOLE", -1);
  if (hole >= 0 && static_cast<int>((x.offset - kScratch) / st.region_bytes) == hole) {
    void* m = mmap(nullptr, x.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return cudaErrorMemoryAllocation;
    st.blackholes[static_cast<unsigned char*>(m)] = x.bytes;
    *p = m;
    return cudaSuccess;
  }
  unsigned char* a = st.base + x.offset;
  EMU_UNPOISON(a, x.bytes);
  auto& o = st.opened[a];
  ++o.first;
  o.second = x.bytes;
  *p = a;
  return cudaSuccess;
}
inline cudaError_t cudaIpcCloseMemHandle(void* p) {
  using namespace emu_rt;
  auto hole = st.blackholes.find(static_cast<unsigned char*>(p));
  if (hole != st.blackholes.end()) {
    munmap(hole->first, hole->second);
    st.blackholes.erase(hole);
    return cudaSuccess;
  }
  auto it = st.opened.find(static_cast<unsigned char*>(p));
  if (it == st.opened.end()) return cudaErrorInvalidValue;
  if (--it->second.first == 0) {
    EMU_POISON(p, it->second.second);
    st.opened.erase(it);
  }
  return cudaSuccess;
}

inline cudaError_t emu_copy_check(void* dst, const void* src, cudaMemcpyKind kind) {
  using emu_rt::is_device;
  const bool d = is_device(dst), s = is_device(src);
  switch (kind) {
    case cudaMemcpyHostToDevice:
      return d && !s ? cudaSuccess : cudaErrorInvalidMemcpyDirection;
    case cudaMemcpyDeviceToHost:
      return s && !d ? cudaSuccess : cudaErrorInvalidMemcpyDirection;
    case cudaMemcpyDeviceToDevice:
      return s && d ? cudaSuccess : cudaErrorInvalidMemcpyDirection;
    case cudaMemcpyHostToHost:
      return !s && !d ? cudaSuccess : cudaErrorInvalidMemcpyDirection;
    case cudaMemcpyDefault:
      return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind,
                                   cudaStream_t stream = nullptr) {
  if (!emu_rt::valid_stream(stream)) return cudaErrorInvalidResourceHandle;
  if (n == 0) return cudaSuccess;
  const cudaError_t e = emu_copy_check(dst, src, kind);
  if (e == cudaSuccess) emu_rt::issue(stream, [dst, src, n] { std::memcpy(dst, src, n); });
  return e;
}
// The synchronous copy and memset: host synchronisations (counted as such, not also as
// stream operations), refused while a capture is active.
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  const cudaError_t s = emu_rt::host_sync();
  if (s != cudaSuccess) return s;
  if (n == 0) return cudaSuccess;
  const cudaError_t e = emu_copy_check(dst, src, kind);
  if (e == cudaSuccess) std::memcpy(dst, src, n);
  return e;
}
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t stream = nullptr) {
  if (!emu_rt::valid_stream(stream)) return cudaErrorInvalidResourceHandle;
  if (n == 0) return cudaSuccess;
  if (!emu_rt::is_device(p)) return cudaErrorInvalidValue;
  emu_rt::issue(stream, [p, v, n] { std::memset(p, v, n); });
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* p, int v, size_t n) {
  const cudaError_t s = emu_rt::host_sync();
  if (s != cudaSuccess) return s;
  if (n == 0) return cudaSuccess;
  if (!emu_rt::is_device(p)) return cudaErrorInvalidValue;
  std::memset(p, v, n);
  return cudaSuccess;
}

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  (void)flags;
  const uintptr_t h = emu_rt::st.next_handle++;
  emu_rt::st.streams.insert(h);
  *s = reinterpret_cast<cudaStream_t>(h);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* s) {
  return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  return emu_rt::st.streams.erase(reinterpret_cast<uintptr_t>(s)) ? cudaSuccess
                                                                  : cudaErrorInvalidResourceHandle;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (!emu_rt::valid_stream(s)) return cudaErrorInvalidResourceHandle;
  return emu_rt::host_sync();
}
inline cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  if (!emu_rt::valid_stream(s)) return cudaErrorInvalidResourceHandle;
  *status = emu_rt::st.capturing != 0 && reinterpret_cast<uintptr_t>(s) == emu_rt::st.capturing
                ? cudaStreamCaptureStatusActive
                : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
inline cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  (void)mode;
  if (s == nullptr || !emu_rt::valid_stream(s))
    return cudaErrorInvalidValue;  // not the null stream
  if (emu_rt::st.capturing != 0) return cudaErrorStreamCaptureUnsupported;
  emu_rt::st.capturing = reinterpret_cast<uintptr_t>(s);
  emu_rt::st.capture = std::make_unique<emu_rt::Graph>();
  return cudaSuccess;
}
inline cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  if (emu_rt::st.capturing != reinterpret_cast<uintptr_t>(s)) return cudaErrorInvalidValue;
  emu_rt::st.capturing = 0;
  *graph = reinterpret_cast<cudaGraph_t>(emu_rt::st.capture.release());
  return cudaSuccess;
}
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                        unsigned long long flags = 0) {
  (void)flags;
  auto* g = new emu_rt::Graph(*reinterpret_cast<emu_rt::Graph*>(graph));
  emu_rt::st.graphs.insert(g);
  *exec = reinterpret_cast<cudaGraphExec_t>(g);
  return cudaSuccess;
}
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  auto* g = reinterpret_cast<emu_rt::Graph*>(exec);
  if (emu_rt::st.graphs.count(g) == 0 || !emu_rt::valid_stream(s))
    return cudaErrorInvalidResourceHandle;
  ++emu_rt::st.counts.launches;  // one graph launch
  for (auto& node : g->nodes) node();
  return cudaSuccess;
}
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  auto* g = reinterpret_cast<emu_rt::Graph*>(exec);
  if (emu_rt::st.graphs.erase(g) == 0) return cudaErrorInvalidResourceHandle;
  delete g;
  return cudaSuccess;
}
inline cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete reinterpret_cast<emu_rt::Graph*>(graph);
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  (void)flags;
  const uintptr_t h = emu_rt::st.next_handle++;
  emu_rt::st.events.insert(h);
  *e = reinterpret_cast<cudaEvent_t>(h);
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) {
  return cudaEventCreateWithFlags(e, cudaEventDefault);
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  return emu_rt::st.events.erase(reinterpret_cast<uintptr_t>(e)) ? cudaSuccess
                                                                 : cudaErrorInvalidResourceHandle;
}
inline bool emu_valid_event(cudaEvent_t e) {
  return emu_rt::st.events.count(reinterpret_cast<uintptr_t>(e)) != 0;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr) {
  return emu_valid_event(e) && emu_rt::valid_stream(s) ? cudaSuccess
                                                       : cudaErrorInvalidResourceHandle;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (!emu_valid_event(e)) return cudaErrorInvalidResourceHandle;
  return emu_rt::host_sync();
}

// cuStreamWriteValue32/64 (default flags: a memory barrier, then the store), for
// cudaGetDriverEntryPointByVersion.
inline int emu_write_value32(cudaStream_t s, unsigned long long addr, unsigned v, unsigned flags) {
  if (flags != 0) return 1;
  return emu_rt::issue(s,
                       [addr, v] {
                         __atomic_thread_fence(__ATOMIC_SEQ_CST);
                         __atomic_store_n(reinterpret_cast<uint32_t*>(addr), v, __ATOMIC_RELEASE);
                       })
             ? 0
             : 400;
}
inline int emu_write_value64(cudaStream_t s, unsigned long long addr, unsigned long long v,
                             unsigned flags) {
  if (flags != 0) return 1;
  return emu_rt::issue(s,
                       [addr, v] {
                         __atomic_thread_fence(__ATOMIC_SEQ_CST);
                         __atomic_store_n(reinterpret_cast<uint64_t*>(addr), v, __ATOMIC_RELEASE);
                       })
             ? 0
             : 400;
}
inline cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned version,
                                                    unsigned long long flags,
                                                    cudaDriverEntryPointQueryResult* status) {
  (void)version;
  (void)flags;
  *fn = nullptr;
  *status = cudaDriverEntryPointSymbolNotFound;
  if (emu_rt::env_int("EMU_NO_STREAM_MEMOPS", 0)) return cudaSuccess;
  if (std::strcmp(symbol, "cuStreamWriteValue32") == 0)
    *fn = reinterpret_cast<void*>(&emu_write_value32);
  else if (std::strcmp(symbol, "cuStreamWriteValue64") == 0)
    *fn = reinterpret_cast<void*>(&emu_write_value64);
  if (*fn != nullptr) *status = cudaDriverEntryPointSuccess;
  return cudaSuccess;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0) {
  return emu_valid_event(e) && emu_rt::valid_stream(s) && flags == 0
             ? cudaSuccess
             : cudaErrorInvalidResourceHandle;
}
