#include "core/dispatch_layout.h"

#include <algorithm>

#include "core/exception.h"

namespace pa2a {

void check_placement(const int32_t* offset, size_t num_offsets, const int32_t* rank,
                     const int32_t* local, size_t num_replicas, int32_t world) {
  PA2A_CHECK_ARG(num_offsets >= 2 && offset[0] == 0 &&
                     static_cast<size_t>(offset[num_offsets - 1]) == num_replicas,
                 "placement CSR arrays are inconsistent");
  for (size_t e = 0; e + 1 < num_offsets; ++e)
    PA2A_CHECK_ARG(offset[e + 1] > offset[e], "expert ", e, " has no replica");
  for (size_t i = 0; i < num_replicas; ++i)
    PA2A_CHECK_ARG(rank[i] >= 0 && rank[i] < world && local[i] >= 0, "placement replica ", i,
                   " is out of range");
}

void check_replica_choice(const int32_t* choice_offset, size_t num_choice_offsets,
                          const int32_t* choice, size_t num_choices, const int32_t* offset,
                          size_t num_offsets) {
  PA2A_CHECK_ARG(num_choice_offsets == num_offsets, "replica choice offsets: got ",
                 num_choice_offsets, " entries, the placement has ", num_offsets,
                 " (num_experts + 1)");
  PA2A_CHECK_ARG(choice_offset[0] == 0 &&
                     static_cast<size_t>(choice_offset[num_choice_offsets - 1]) == num_choices,
                 "replica choice CSR arrays are inconsistent");
  for (size_t e = 0; e + 1 < num_offsets; ++e)  // all bounds first: the loop below reads
    PA2A_CHECK_ARG(choice_offset[e + 1] > choice_offset[e], "replica choice: expert ", e,
                   " has no candidate");
  for (size_t e = 0; e + 1 < num_offsets; ++e) {
    for (int32_t j = choice_offset[e]; j < choice_offset[e + 1]; ++j)
      PA2A_CHECK_ARG(choice[j] >= offset[e] && choice[j] < offset[e + 1], "replica choice: expert ",
                     e, " names replica ", choice[j], ", not one of its replicas [", offset[e],
                     ", ", offset[e + 1], ")");
  }
}

void dispatch_layout(const int32_t* topk_ids, int32_t num_tokens, int32_t topk,
                     const Placement& placement, int32_t world, int32_t rank, int32_t max_tokens,
                     int32_t* tokens_per_rank, int32_t* tokens_per_expert,
                     uint8_t* is_token_in_rank) {
  std::fill(tokens_per_rank, tokens_per_rank + world, 0);
  std::fill(tokens_per_expert, tokens_per_expert + placement.num_experts, 0);
  std::fill(is_token_in_rank, is_token_in_rank + static_cast<size_t>(num_tokens) * world, 0);
  for (int32_t t = 0; t < num_tokens; ++t) {
    uint8_t* in_rank = is_token_in_rank + static_cast<size_t>(t) * world;
    for (int32_t k = 0; k < topk; ++k) {
      const int32_t e = topk_ids[static_cast<size_t>(t) * topk + k];
      if (e < 0) continue;
      PA2A_CHECK_ARG(e < placement.num_experts, "topk_ids[", t, ", ", k, "] = ", e,
                     " is not an expert id in [0, ", placement.num_experts, ")");
      ++tokens_per_expert[e];
      int32_t d = 0, l = 0;
      select_replica(placement, e, global_token_id(rank, max_tokens, t), &d, &l);
      in_rank[d] = 1;
    }
    for (int32_t d = 0; d < world; ++d) tokens_per_rank[d] += in_rank[d];
  }
}

}  // namespace pa2a
