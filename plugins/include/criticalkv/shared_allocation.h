// The shared-allocation flow of adakv and the group-scored methods (laprox; criticalkv/selection/layer.py:
// shared_allocation_mask): the layer's H_kv * r slots of one sequence are shared across its KV heads. Every head first
// keeps its own top headFloor(r) entries, the remaining H_kv * (r - floor) go to the best scores over all heads (ties:
// lower head, then lower position). ada-criticalkv then reselects inside each head's share (head_selection.h).
#pragma once

#include "criticalkv/budget.h"
#include "criticalkv/methods.h"
#include "criticalkv/select_flow.h"

namespace criticalkv
{

//! How many older tokens each head keeps by its own ranking (the floor), and how many the layer-wide row then takes.
struct SharedCounts
{
    int64_t floor;
    int64_t rest;
};

CKV_HD SharedCounts sharedCounts(SelectConfig const& config, int32_t heads, int64_t r)
{
    int64_t const floor = headFloor(config.adaFloorMicros, r);
    return SharedCounts{floor, heads * (r - floor)};
}

//! Mark the chosen older tokens of one sequence. ranking, flags: [heads, m] (flags cleared by the caller);
//! r: older tokens per head of this sequence (SequenceInfo::r).
CKV_FLOW_TEMPLATE
template <typename TopK>
CKV_HD void selectShared(TopK& topK, SelectConfig const& config, float const* ranking, uint8_t* flags, int32_t heads,
    int32_t m, int32_t firstValid, int64_t r)
{
    SharedCounts const counts = sharedCounts(config, heads, r);
    for (int32_t g = 0; g < heads; ++g)
    {
        int64_t const offset = static_cast<int64_t>(g) * m;
        topK(ranking + offset, flags + offset, m, m, firstValid, counts.floor, kChosenByAttention);
    }
    topK(ranking, flags, static_cast<int64_t>(heads) * m, m, firstValid, counts.rest, kChosenByAttention);
}

} // namespace criticalkv
