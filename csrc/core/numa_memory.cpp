#include "core/numa_memory.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "core/exception.h"

namespace pa2a {
namespace {

// linux/mempolicy.h values, spelled out so the build needs neither libnuma nor numaif.h.
constexpr int kMpolBind = 2;
constexpr unsigned kMpolMfStrict = 1u << 0;  // fail if pages already sit elsewhere...
constexpr unsigned kMpolMfMove = 1u << 1;    // ...unless they can be moved
constexpr unsigned long kMpolFNode = 1ul << 0;
constexpr unsigned long kMpolFAddr = 1ul << 1;
constexpr size_t kBitsPerWord = 8 * sizeof(unsigned long);
// Verifying every page of a multi-GiB buffer costs a syscall each; the first, the last and
// evenly spaced pages in between catch a partial bind just as well.
constexpr size_t kVerifySamples = 64;

const char* errno_name(int e) {
  switch (e) {
    case EPERM:
      return "EPERM";
    case ENOSYS:
      return "ENOSYS";
    case EINVAL:
      return "EINVAL";
    case EIO:
      return "EIO";
    case EFAULT:
      return "EFAULT";
    case ENOMEM:
      return "ENOMEM";
    default:
      return "errno";
  }
}

std::string refusal_hint(int e) {
  if (e == EPERM || e == ENOSYS)
    return " (containers need CAP_SYS_NICE, e.g. docker run --cap-add SYS_NICE, for the "
           "mempolicy syscalls)";
  return "";
}

long sys_mbind(void* p, size_t n, int node) {
  std::vector<unsigned long> mask(static_cast<size_t>(node) / kBitsPerWord + 1, 0ul);
  mask[static_cast<size_t>(node) / kBitsPerWord] |= 1ul
                                                    << (static_cast<size_t>(node) % kBitsPerWord);
  // maxnode is "bits + 1" by the kernel's convention (it decrements before use).
  const unsigned long maxnode = mask.size() * kBitsPerWord + 1;
  return syscall(SYS_mbind, p, n, kMpolBind, mask.data(), maxnode, kMpolMfStrict | kMpolMfMove);
}

void touch_pages(void* p, size_t n, size_t page) {
  // An atomic OR with 0 is a write access, so each page takes a single write fault and is
  // allocated under the VMA's (or, for a shared /dev/shm mapping, the file's) policy; a plain
  // read would first map the zero page and fault twice. It never changes the data there.
  auto* bytes = static_cast<unsigned char*>(p);
  for (size_t off = 0; off < n; off += page) __atomic_fetch_or(bytes + off, 0, __ATOMIC_RELAXED);
}

// Where POSIX shared memory lives on Linux (shm_open's directory).
constexpr const char* kShmDir = "/dev/shm";

std::string mib(uint64_t bytes) {
  return std::to_string((bytes + (1u << 20) - 1) >> 20) + " MiB";
}

[[noreturn]] void throw_shm_too_small(size_t bytes, const std::string& name, int segments, int err,
                                      const ShmUser& user) {
  struct statvfs fs{};
  const bool known = ::statvfs(kShmDir, &fs) == 0;
  const uint64_t total = known ? static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize : 0;
  const uint64_t avail = known ? static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize : 0;
  const uint64_t all = static_cast<uint64_t>(bytes) * static_cast<uint64_t>(segments);
  // What to ask for: every segment of the Buffer plus what is already used, in 64 MiB steps.
  const uint64_t want = ((all + (total - avail)) + (64ull << 20) - 1) / (64ull << 20) * 64;
  PA2A_THROW(kRuntime, kShmDir, " is too small: pcie_a2a needs ", bytes, " bytes (", mib(bytes),
             ") for the shared-memory segment ", name, " (", user.what, " of this size has up to ",
             segments, " such segment", segments == 1 ? "" : "s", " on one host, ", mib(all), "); ",
             kShmDir, " has ", known ? mib(avail) : std::string("an unknown amount"), " free of ",
             known ? mib(total) : std::string("?"), " (", std::strerror(err),
             "). In a container, start it with --shm-size=", want,
             "m or more (or --ipc=host); on a host, enlarge the tmpfs (mount -o "
             "remount,size=... /dev/shm); or make ",
             user.smaller, " smaller");
}

NumaBindResult bind_reserve_touch(void* p, size_t n, int node, bool simulate_refusal, int fd,
                                  const std::string& name, int segments, const ShmUser& user);

}  // namespace

void reserve_shm_space(int fd, size_t bytes, const std::string& name, int segments,
                       const ShmUser& user) {
  const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (rc == 0) return;
  if (rc == ENOSPC || rc == EFBIG) throw_shm_too_small(bytes, name, segments, rc, user);
  // A filesystem without fallocate (EOPNOTSUPP, EINVAL): check the free space instead.
  struct statvfs fs{};
  if (::statvfs(kShmDir, &fs) == 0 &&
      static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize < static_cast<uint64_t>(bytes))
    throw_shm_too_small(bytes, name, segments, ENOSPC, user);
}

size_t page_size() {
  const long s = sysconf(_SC_PAGESIZE);
  return s > 0 ? static_cast<size_t>(s) : 4096;
}

int numa_num_nodes() {
  DIR* d = opendir("/sys/devices/system/node");
  if (d == nullptr) return 1;
  int count = 0;
  while (const dirent* e = readdir(d)) {
    const char* name = e->d_name;
    if (std::strncmp(name, "node", 4) != 0 || name[4] == '\0') continue;
    bool digits = true;
    for (const char* c = name + 4; *c != '\0'; ++c) digits = digits && (*c >= '0' && *c <= '9');
    if (digits) ++count;
  }
  closedir(d);
  return count > 0 ? count : 1;
}

bool numa_node_exists(int node) {
  if (node < 0) return false;
  struct stat st;
  if (stat("/sys/devices/system/node", &st) != 0) return node == 0;  // kernel without NUMA
  const std::string path = "/sys/devices/system/node/node" + std::to_string(node);
  return stat(path.c_str(), &st) == 0;
}

int numa_node_of_current_cpu() {
  unsigned cpu = 0, node = 0;
  if (syscall(SYS_getcpu, &cpu, &node, nullptr) != 0) return 0;
  return static_cast<int>(node);
}

int numa_node_of_address(const void* addr) {
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0ul, addr, kMpolFNode | kMpolFAddr) != 0)
    return -1;
  return node;
}

NumaBindResult numa_bind_and_touch(void* p, size_t n, int node, bool simulate_refusal) {
  return bind_reserve_touch(p, n, node, simulate_refusal, -1, "", 1, ShmUser{});
}

NumaBindResult numa_bind_reserve_and_touch(void* p, size_t n, int node, int fd,
                                           const std::string& name, int segments,
                                           const ShmUser& user) {
  return bind_reserve_touch(p, n, node, false, fd, name, segments, user);
}

namespace {

NumaBindResult bind_reserve_touch(void* p, size_t n, int node, bool simulate_refusal, int fd,
                                  const std::string& name, int segments, const ShmUser& user) {
  const size_t page = page_size();
  PA2A_CHECK_ARG(p != nullptr && n > 0, "numa_bind_and_touch: empty range (p=", p, ", n=", n, ")");
  PA2A_CHECK_ARG(reinterpret_cast<uintptr_t>(p) % page == 0, "numa_bind_and_touch: address ", p,
                 " is not aligned to the page size ", page);
  PA2A_CHECK_ARG(node < 0 || numa_node_exists(node), "numa_bind_and_touch: node=", node,
                 " does not exist; this machine has ", numa_num_nodes(),
                 " NUMA node(s) (see /sys/devices/system/node), or pass -1 for unbound");

  NumaBindResult r;
  bool mbind_ok = false;
  if (node >= 0) {
    int err = EPERM;
    if (!simulate_refusal) {
      mbind_ok = sys_mbind(p, n, node) == 0;
      err = errno;
    }
    if (!mbind_ok)
      r.warning = detail::concat("pcie_a2a: mbind(MPOL_BIND, node ", node, ") of ", n,
                                 " bytes was refused: ", std::strerror(err), " (", errno_name(err),
                                 ")", refusal_hint(err),
                                 "; the staging memory is left unbound (first-touch placement "
                                 "on the allocating thread's node ",
                                 numa_node_of_current_cpu(), ")");
  }

  // After mbind: the reserved pages are allocated under the policy.
  if (fd >= 0) reserve_shm_space(fd, n, name, segments, user);
  touch_pages(p, n, page);

  auto* base = static_cast<char*>(p);
  const size_t pages = (n + page - 1) / page;
  r.node = numa_node_of_address(base);
  if (!mbind_ok) return r;
  if (r.node < 0) {
    r.bound = true;  // the kernel accepted the bind; it only refuses to report placement
    r.warning = "pcie_a2a: get_mempolicy refused, NUMA placement of staging memory unverified";
    return r;
  }
  const size_t samples = pages < kVerifySamples ? pages : kVerifySamples;
  size_t wrong = 0;
  int wrong_node = -1;
  for (size_t s = 0; s < samples; ++s) {
    const size_t pg = samples == 1 ? 0 : s * (pages - 1) / (samples - 1);
    const int got = numa_node_of_address(base + pg * page);
    if (got != node) {
      ++wrong;
      wrong_node = got;
    }
  }
  r.bound = wrong == 0;
  if (!r.bound)
    r.warning = detail::concat("pcie_a2a: mbind to node ", node, " succeeded but ", wrong, " of ",
                               samples, " sampled pages are on node ", wrong_node);
  return r;
}

}  // namespace

NumaBuffer::NumaBuffer(size_t bytes, int node, bool simulate_refusal)
    : size_(bytes), requested_node_(node) {
  PA2A_CHECK_ARG(bytes > 0, "NumaBuffer: bytes must be > 0, got ", bytes);
  const size_t page = page_size();
  mapped_ = (bytes + page - 1) / page * page;
  void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    PA2A_THROW(kRuntime, "NumaBuffer: mmap of ", mapped_, " bytes failed: ", std::strerror(errno));
  data_ = p;
  try {
    result_ = numa_bind_and_touch(data_, mapped_, node, simulate_refusal);
  } catch (...) {
    release();
    throw;
  }
}

NumaBuffer::~NumaBuffer() {
  release();
}

NumaBuffer::NumaBuffer(NumaBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      requested_node_(other.requested_node_),
      result_(std::move(other.result_)) {}

NumaBuffer& NumaBuffer::operator=(NumaBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    requested_node_ = other.requested_node_;
    result_ = std::move(other.result_);
  }
  return *this;
}

void NumaBuffer::release() noexcept {
  if (data_ != nullptr) munmap(data_, mapped_);
  data_ = nullptr;
}

}  // namespace pa2a
