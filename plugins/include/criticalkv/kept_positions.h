// Which prompt positions a KV head keeps, once its older tokens are chosen: the compaction rule of every method
// (criticalkv/selection/layer.py: select_layer), shared by the compaction kernel and the host driver.
//   * a sequence that is not compressed (full, or length <= b): every valid position;
//   * streamingllm: the sink_tokens first valid positions and the most recent b - sink_tokens (b: the
//     effective budget of the call);
//   * scored methods: the chosen older tokens (flags) and the whole window.
#pragma once

#include "criticalkv/methods.h"

namespace criticalkv
{

//! Kept entries of a head whose kept set does not depend on scores (-1 when it does: count the flags).
CKV_HD int32_t fixedKeptCount(SelectConfig const& config, SequenceInfo const& info)
{
    if (!info.compress)
    {
        return info.length;
    }
    return config.base == BaseMethod::kStreamingLLM ? info.budget : -1;
}

//! Position of the slot-th kept entry for heads with a fixed kept set (slot < fixedKeptCount).
CKV_HD int32_t fixedKeptPosition(SelectConfig const& config, SequenceInfo const& info, int32_t n, int32_t slot)
{
    if (!info.compress)
    {
        return info.validStart + slot;
    }
    int32_t const sinks = config.sinkTokens;
    return slot < sinks ? info.validStart + slot : n - (info.budget - sinks) + (slot - sinks);
}

//! Whether position p of a compressed, scored head is kept. flags: [m] chosen older tokens of the head.
CKV_HD bool scoredPositionKept(SequenceInfo const& info, int32_t m, uint8_t const* flags, int32_t p)
{
    return p >= m || (p >= info.validStart && flags[p] != 0);
}

} // namespace criticalkv
