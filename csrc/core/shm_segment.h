// POSIX shared-memory segments of the CPU transport and the CPU all-reduce: each rank creates
// (and later unlinks) its own segment and maps its peers'.
//
// tmpfs (/dev/shm) allocates pages lazily: ftruncate succeeds whatever the free space, and the
// first touch of a page past it kills the process with SIGBUS (Docker's default /dev/shm is 64
// MiB). So a segment is bound to its NUMA node, then its space is reserved (posix_fallocate),
// then touched: a /dev/shm too small is an Error naming it and the size needed, never a SIGBUS.
// A peer's segment must have exactly the size this rank computed from its own configuration:
// a different size means the ranks disagree, and mapping it would read past its end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/exception.h"
#include "core/numa_memory.h"

namespace pa2a::shm {

struct OwnSegment {
  void* data = nullptr;  // `bytes` mapped read-write, shared, zero-filled, touched
  NumaBindResult numa;
};

// Creates the segment `name` (O_EXCL: a leftover of the same name is an error), sizes, maps,
// binds it to `numa_node` (< 0: unbound), reserves and touches it. `segments`/`user`: what the
// /dev/shm-too-small message says (numa_memory.h). On failure the name is unlinked again,
// nothing stays mapped, and Error(kRuntime) says which step failed.
OwnSegment create(const std::string& name, size_t bytes, int numa_node, int segments,
                  const ShmUser& user);

// Maps rank `peer`'s segment `name` (of `bytes`) for rank `self`; `what` names it in errors
// ("segment", "all-reduce segment"). A segment that cannot be opened or has another size is
// Error(kPeer) naming both ranks; a failed mmap is Error(kRuntime).
void* map_peer(const std::string& name, size_t bytes, int32_t self, int32_t peer, const char* what);

// map_peer into maps[peer], then the Header the segment starts with (magic, version, rank,
// pid, config), checked: another magic, version or rank is Error(kPeer). maps[peer] keeps the
// mapping either way (the owner's close() unmaps it).
template <class Header>
Header attach_peer(std::vector<void*>& maps, const std::string& name, size_t bytes, int32_t self,
                   int32_t peer, const char* what, uint32_t magic, uint32_t version) {
  maps[peer] = map_peer(name, bytes, self, peer, what);
  Header h{};
  std::memcpy(&h, maps[peer], sizeof(h));
  if (h.magic != magic || h.version != version || h.rank != peer)
    PA2A_THROW(kPeer, "rank ", peer, "'s ", what, " ", name, " is not a pcie_a2a ", what,
               " of this version and rank");
  return h;
}

// Unmaps every mapping of `maps` (each of `bytes`) and clears the entries.
void unmap_all(std::vector<void*>& maps, size_t bytes);

// shm_unlink(name); false when there was nothing to unlink (or it failed).
bool unlink(const std::string& name);

}  // namespace pa2a::shm
