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

//! How many of a head's `count` older tokens each stage keeps: stage 1 by attention (all of them without stage 2),
//! stage 2 by C the rest. The kernels compute these per head on the device between their top-k launches.
struct HeadStageCounts
{
    int64_t first;
    int64_t second;
};

CKV_HD HeadStageCounts headStageCounts(SelectConfig const& config, int64_t count)
{
    int64_t const first = config.twoStage ? stage1Count(config.alphaMicros, count) : count;
    return HeadStageCounts{first, config.twoStage ? count - first : 0};
}

//! Choose `count` older tokens of one KV head. attention / critical: [m] scores of the head (critical unused
//! unless two-stage); flags: [m], cleared by the caller.
CKV_FLOW_TEMPLATE
template <typename TopK>
CKV_HD void selectHead(TopK& topK, SelectConfig const& config, float const* attention, float const* critical,
    uint8_t* flags, int32_t m, int32_t firstValid, int64_t count)
{
    HeadStageCounts const counts = headStageCounts(config, count);
    topK(attention, flags, m, m, firstValid, counts.first, kChosenByAttention);
    if (config.twoStage)
    {
        topK(critical, flags, m, m, firstValid, counts.second, kChosenByCritical);
    }
}

} // namespace criticalkv
