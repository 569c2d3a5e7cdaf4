// The per-head selection flow: snapkv / pyramidkv keep each KV head's top `count` older tokens by pooled
// window attention; with CriticalKV on top (criticalkv, pyramid-criticalkv, and ada-criticalkv inside each
// head's adakv share) stage 1 keeps the top stage1Count(count) by attention and stage 2 the top
// count - stage1Count of the rest by C (criticalkv/selection/layer.py: two_stage_mask).
#pragma once

#include "criticalkv/budget.h"
#include "criticalkv/select_flow.h"
#include "criticalkv/select_params.h"

namespace criticalkv
{

//! Choose `count` older tokens of one KV head. attention / critical: [m] scores of the head (critical unused
//! unless two-stage); flags: [m], cleared by the caller.
CKV_FLOW_TEMPLATE
template <typename TopK>
CKV_HD void selectHead(TopK& topK, SelectConfig const& config, float const* attention, float const* critical,
    uint8_t* flags, int32_t m, int32_t firstValid, int64_t count)
{
    int64_t const first = config.twoStage ? stage1Count(config.alphaMicros, count) : count;
    topK(attention, flags, m, m, firstValid, first, kChosenByAttention);
    if (config.twoStage)
    {
        topK(critical, flags, m, m, firstValid, count - first, kChosenByCritical);
    }
}

} // namespace criticalkv
