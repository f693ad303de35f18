// NUMA placement of host staging memory, without libnuma.
//
// Host-staged transfers write across PCIe (and maybe the socket link) into host memory and
// the receiving GPU reads it back. Reads are non-posted round trips, so the memory must sit
// on the receiver's NUMA node: the far leg is then a posted write and the read stays local
// (NCCL does the same: NCCL_SHM_LOCALITY=2, receiver side). cudaHostAlloc takes no node, so
// we mmap, mbind(MPOL_BIND) and first-touch ourselves, then verify with get_mempolicy.
//
// Docker's default seccomp profile refuses the mempolicy syscalls without CAP_SYS_NICE.
// That is not an error: the memory stays unbound (first-touch placement) and the result
// carries a warning the caller shows to the user.
#pragma once

#include <cstddef>
#include <string>

namespace pa2a {

struct NumaBindResult {
  bool bound = false;   // mbind succeeded and every sampled page is on the requested node
  int node = -1;        // node of the first page as reported by the kernel, -1 if unknown
  std::string warning;  // empty when nothing needs the user's attention
};

// [p, p+n) is page-aligned, mmapped (possibly MAP_SHARED over /dev/shm), not yet touched.
// Binds it to `node` with mbind(MPOL_BIND, MPOL_MF_STRICT|MPOL_MF_MOVE) via syscall(2),
// first-touches it (one write per page), verifies with get_mempolicy(MPOL_F_NODE|
// MPOL_F_ADDR). Refused syscalls never throw: bound=false plus a warning. node < 0 means
// leave it unbound and just touch. Throws ValueError for a misaligned range or a node id
// that does not exist. `simulate_refusal` behaves as if mbind returned EPERM (tests).
NumaBindResult numa_bind_and_touch(void* p, size_t n, int node, bool simulate_refusal = false);

// Who a shared-memory segment is for, in the message of a /dev/shm too small for it: "<what>
// of this size has up to N such segments ..."; "or make <smaller> smaller".
struct ShmUser {
  const char* what = "a Buffer";
  const char* smaller = "max_tokens_per_rank / hidden";
};

// The same for a MAP_SHARED mapping of the POSIX shared-memory file `fd` (named `name`;
// the host holds about `segments` such segments for one Buffer): between the bind and the
// touch, the file's blocks are reserved with posix_fallocate. tmpfs (/dev/shm) allocates
// pages lazily: ftruncate succeeds whatever the free space, and touching a page past it
// kills the process with SIGBUS (Docker's default /dev/shm is 64 MiB). Reserved after
// mbind, the pages are allocated under the bound policy; a /dev/shm too small is then an
// Error(kRuntime) naming /dev/shm, the bytes needed and free, and the container flags.
NumaBindResult numa_bind_reserve_and_touch(void* p, size_t n, int node, int fd,
                                           const std::string& name, int segments,
                                           const ShmUser& user = ShmUser{});

// Reserves `bytes` of the shared-memory file `fd` (see above); throws when they do not fit.
void reserve_shm_space(int fd, size_t bytes, const std::string& name, int segments,
                       const ShmUser& user = ShmUser{});

// Number of NUMA nodes in /sys/devices/system/node (>= 1; 1 when sysfs has no node dir).
int numa_num_nodes();

// True when /sys/devices/system/node/node<node> exists (node ids may be sparse).
bool numa_node_exists(int node);

// Node of the CPU this thread runs on (getcpu syscall), 0 if unknown.
int numa_node_of_current_cpu();

// Node holding the (already faulted-in) page at `addr`, -1 if the kernel refuses to say.
int numa_node_of_address(const void* addr);

size_t page_size();

// Owning anonymous mapping bound to a node: mmap + numa_bind_and_touch, munmap on
// destruction. Move-only.
class NumaBuffer {
 public:
  NumaBuffer(size_t bytes, int node, bool simulate_refusal = false);
  ~NumaBuffer();
  NumaBuffer(const NumaBuffer&) = delete;
  NumaBuffer& operator=(const NumaBuffer&) = delete;
  NumaBuffer(NumaBuffer&& other) noexcept;
  NumaBuffer& operator=(NumaBuffer&& other) noexcept;

  void* data() const { return data_; }
  size_t size() const { return size_; }           // bytes requested
  size_t mapped_size() const { return mapped_; }  // rounded up to whole pages
  int requested_node() const { return requested_node_; }
  const NumaBindResult& bind_result() const { return result_; }

 private:
  void release() noexcept;
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;
  int requested_node_ = -1;
  NumaBindResult result_;
};

}  // namespace pa2a
