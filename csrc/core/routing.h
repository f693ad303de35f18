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
};

PA2A_HD void select_replica(const Placement& p, int32_t expert, int64_t global_token, int32_t* rank,
                            int32_t* local) {
  const int32_t begin = p.replica_offset[expert];
  const int32_t n = p.replica_offset[expert + 1] - begin;
  const int32_t i = begin + static_cast<int32_t>(global_token % n);
  *rank = p.replica_rank[i];
  *local = p.replica_local[i];
}

PA2A_HD int64_t global_token_id(int32_t src_rank, int32_t max_tokens_per_rank, int32_t token) {
  return static_cast<int64_t>(src_rank) * max_tokens_per_rank + token;
}

}  // namespace pa2a
