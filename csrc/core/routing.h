// Routing index math: expert placement and the (token, destination rank) rows.
//
// Bytes are the currency on PCIe: a token travels once per destination *rank*, carrying
// the local expert ids and routing weights it has there, never once per expert. With
// uniform top-8 routing over 8 ranks that is ~5.25 copies per token instead of 8.
//
// Placement maps a global expert to one or more replicas (rank, local index). With
// redundant copies of hot experts the replica of a token is chosen by its global token id
// (source_rank * max_tokens_per_rank + token) modulo the number of replicas: deterministic,
// identical on every rank and on host and device, and it spreads a hot expert's tokens
// evenly over its copies.
//
// A replica choice table replaces that rule where the balancer (pcie_a2a.balance) has
// decided where each source's tokens should go: on a PCIe box the copy behind the same
// switch or on the same socket is cheaper than one across the socket link, which every
// token-count balancer ignores. The table is per (source rank, expert); each rank holds
// only its own row, since select_replica runs on the source only. Expert e's candidates are
// choice[choice_offset[e] .. choice_offset[e + 1]) (replica indices into replica_rank /
// replica_local, repeats allowed as weights) and a token takes candidate global_token % n:
// the same arithmetic on host and device, so the CPU transport and the kernels agree row
// for row.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace pa2a {

// CSR view of the placement map: expert e has replicas replica_offset[e] ..
// replica_offset[e + 1] - 1, each a (replica_rank[i], replica_local[i]) pair.
struct Placement {
  const int32_t* replica_offset = nullptr;  // [num_experts + 1]
  const int32_t* replica_rank = nullptr;    // [num_replicas]
  const int32_t* replica_local = nullptr;   // [num_replicas]
  int32_t num_experts = 0;
  // Optional: this source rank's replica choice (null: global_token % num_replicas).
  const int32_t* choice_offset = nullptr;  // [num_experts + 1]
  const int32_t* choice = nullptr;         // [choice_offset[num_experts]] replica indices
};

PA2A_HD void select_replica(const Placement& p, int32_t expert, int64_t global_token, int32_t* rank,
                            int32_t* local) {
  int32_t i;
  if (p.choice_offset != nullptr) {
    const int32_t begin = p.choice_offset[expert];
    const int32_t n = p.choice_offset[expert + 1] - begin;
    i = p.choice[begin + static_cast<int32_t>(global_token % n)];
  } else {
    const int32_t begin = p.replica_offset[expert];
    const int32_t n = p.replica_offset[expert + 1] - begin;
    i = begin + static_cast<int32_t>(global_token % n);
  }
  *rank = p.replica_rank[i];
  *local = p.replica_local[i];
}

PA2A_HD int64_t global_token_id(int32_t src_rank, int32_t max_tokens_per_rank, int32_t token) {
  return static_cast<int64_t>(src_rank) * max_tokens_per_rank + token;
}

}  // namespace pa2a
