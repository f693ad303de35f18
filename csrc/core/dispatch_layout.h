// DeepEP's get_dispatch_layout on the host: which ranks and experts each token goes to.
#pragma once

#include <cstdint>

#include "core/routing.h"

namespace pa2a {

// Validates a placement map in CSR form (see routing.h) for `world` ranks; throws ValueError.
void check_placement(const int32_t* offset, size_t num_offsets, const int32_t* rank,
                     const int32_t* local, size_t num_replicas, int32_t world);
// Validates one source rank's replica choice row (see routing.h) against the placement's
// replica offsets (num_offsets = num_experts + 1); throws ValueError.
void check_replica_choice(const int32_t* choice_offset, size_t num_choice_offsets,
                          const int32_t* choice, size_t num_choices, const int32_t* offset,
                          size_t num_offsets);

// tokens_per_rank[world], tokens_per_expert[num_experts] (global ids, replicas merged),
// is_token_in_rank[num_tokens * world] (0/1 bytes). Outputs are overwritten.
void dispatch_layout(const int32_t* topk_ids, int32_t num_tokens, int32_t topk,
                     const Placement& placement, int32_t world, int32_t rank, int32_t max_tokens,
                     int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                     uint8_t* is_token_in_rank);

}  // namespace pa2a
