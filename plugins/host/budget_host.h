// Host-only budget bound: the most entries a KV head of the layer keeps from an n-token prompt
// (criticalkv/methods/budget.py: max_kept_per_head), for the capacity checks of the tests and tools.
#pragma once

#include "criticalkv/budget.h"
#include "criticalkv/methods.h"

#include <algorithm>
#include <cstdint>

namespace criticalkv
{

//! Upper bound of the entries any KV head keeps from an n-token prompt at the effective budget `choice`.
inline int64_t maxKeptPerHead(SelectConfig const& config, BudgetChoice const& choice, int64_t n, int64_t numKvHeads)
{
    if (config.base == BaseMethod::kFull || n <= choice.budget)
    {
        return n;
    }
    if (config.base == BaseMethod::kStreamingLLM)
    {
        return choice.budget;
    }
    int64_t const w = std::min<int64_t>(config.window, n);
    int64_t const m = n - w;
    int64_t r = choice.layerBudget;
    if (sharedAllocation(config))
    {
        int64_t const rm = std::min(r, m);
        int64_t const floor = headFloor(config.adaFloorMicros, rm);
        r = numKvHeads * rm - (numKvHeads - 1) * floor;
    }
    return w + std::min(r, m);
}

} // namespace criticalkv
