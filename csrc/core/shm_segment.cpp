#include "core/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace pa2a::shm {

OwnSegment create(const std::string& name, size_t bytes, int numa_node, int segments,
                  const ShmUser& user) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) PA2A_THROW(kRuntime, "shm_open(", name, ") failed: ", std::strerror(errno));
  void* p = MAP_FAILED;
  try {
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int err = errno;
      PA2A_THROW(kRuntime, "ftruncate(", name, ", ", bytes, " bytes) failed: ", std::strerror(err),
                 " (is /dev/shm large enough?)");
    }
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      PA2A_THROW(kRuntime, "mmap of ", name, " (", bytes, " bytes) failed: ", std::strerror(err));
    }
    // The reservation needs the file (fd) and comes between the bind and the touch.
    OwnSegment seg;
    seg.numa = numa_bind_reserve_and_touch(p, bytes, numa_node, fd, name, segments, user);
    seg.data = p;
    ::close(fd);
    return seg;
  } catch (...) {
    if (p != MAP_FAILED) ::munmap(p, bytes);
    ::close(fd);
    unlink(name);
    throw;
  }
}

void* map_peer(const std::string& name, size_t bytes, int32_t self, int32_t peer,
               const char* what) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0)
    PA2A_THROW(kPeer, "rank ", self, " cannot open rank ", peer, "'s ", what, " ", name, ": ",
               std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    ::close(fd);
    PA2A_THROW(kPeer, "rank ", peer, "'s ", what, " ", name, " has ", st.st_size,
               " bytes, expected ", bytes, ": the ranks disagree on the configuration");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED)
    PA2A_THROW(kRuntime, "mmap of rank ", peer, "'s ", what, " ", name, " (", bytes,
               " bytes) failed: ", std::strerror(err));
  return p;
}

void unmap_all(std::vector<void*>& maps, size_t bytes) {
  for (void*& p : maps) {
    if (p != nullptr) ::munmap(p, bytes);
    p = nullptr;
  }
}

bool unlink(const std::string& name) {
  return ::shm_unlink(name.c_str()) == 0;
}

}  // namespace pa2a::shm
