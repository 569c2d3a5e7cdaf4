// Host-only budget arithmetic (per layer, independent of the batch): PyramidKV layer budgets, the selectable
// budget of a layer and the capacity bound. Mirrors criticalkv/selection/budget.py line by line.
#pragma once

#include "criticalkv/budget.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace criticalkv
{

//! Selectable budget of every layer for PyramidKV; sums to numLayers * r (budget.pyramid_layer_budgets).
inline std::vector<int64_t> pyramidLayerBudgets(int64_t r, int32_t numLayers, double beta)
{
    if (numLayers <= 0)
    {
        throw std::invalid_argument("num_layers: must be positive, got " + std::to_string(numLayers));
    }
    if (numLayers == 1 || r <= 0)
    {
        return std::vector<int64_t>(static_cast<size_t>(numLayers), r);
    }
    double const rMin = std::max(static_cast<double>(r) / beta, 1.0);
    double const rMax = static_cast<double>(2 * r) - rMin;
    std::vector<double> exact(static_cast<size_t>(numLayers));
    std::vector<int64_t> floors(static_cast<size_t>(numLayers));
    for (int32_t layer = 0; layer < numLayers; ++layer)
    {
        // Same evaluation order as Python: r_max - (r_max - r_min) * layer / (num_layers - 1)
        double const step = ((rMax - rMin) * static_cast<double>(layer)) / static_cast<double>(numLayers - 1);
        exact[layer] = rMax - step;
        floors[layer] = floorRound9(exact[layer]);
    }
    int64_t const total = std::accumulate(floors.begin(), floors.end(), int64_t{0});
    int64_t const missing = static_cast<int64_t>(numLayers) * r - total;
    std::vector<int32_t> byRemainder(static_cast<size_t>(numLayers));
    std::iota(byRemainder.begin(), byRemainder.end(), 0);
    // sorted(range(L), key=lambda i: (-(exact[i] - floors[i]), i)): larger remainder first, then lower layer
    std::stable_sort(byRemainder.begin(), byRemainder.end(), [&](int32_t a, int32_t b) {
        return (exact[a] - static_cast<double>(floors[a])) > (exact[b] - static_cast<double>(floors[b]));
    });
    // Python slice semantics of by_remainder[:missing]
    int64_t const count
        = missing >= 0 ? std::min<int64_t>(missing, numLayers) : std::max<int64_t>(0, numLayers + missing);
    for (int64_t i = 0; i < count; ++i)
    {
        floors[byRemainder[i]] += 1;
    }
    return floors;
}

//! Older tokens per KV head (average over the layer's heads) that layerIdx may keep (budget.layer_selectable_budget).
inline int64_t layerSelectableBudget(
    BaseMethod base, int64_t budget, int64_t window, double pyramidBeta, int32_t layerIdx, int32_t numLayers)
{
    if (layerIdx < 0 || layerIdx >= numLayers)
    {
        throw std::invalid_argument("layer_idx: " + std::to_string(layerIdx) + " is outside [0, "
            + std::to_string(numLayers) + ")");
    }
    int64_t const r = budget - window;
    if (base == BaseMethod::kPyramidKV)
    {
        return pyramidLayerBudgets(r, numLayers, pyramidBeta)[static_cast<size_t>(layerIdx)];
    }
    return r;
}

//! Upper bound of the entries any KV head of layerIdx keeps from an n-token prompt (budget.max_kept_per_head).
inline int64_t maxKeptPerHead(BaseMethod base, int64_t budget, int64_t window, double adaFloor, double pyramidBeta,
    int64_t n, int64_t numKvHeads, int32_t layerIdx, int32_t numLayers)
{
    if (base == BaseMethod::kFull || n <= budget)
    {
        return n;
    }
    if (base == BaseMethod::kStreamingLLM)
    {
        return budget;
    }
    int64_t const w = std::min(window, n);
    int64_t const m = n - w;
    int64_t r = layerSelectableBudget(base, budget, window, pyramidBeta, layerIdx, numLayers);
    if (base == BaseMethod::kAdaKV || base == BaseMethod::kLaProx)
    {
        int64_t const rm = std::min(r, m);
        int64_t const floor = headFloor(adaFloor, rm);
        r = numKvHeads * rm - (numKvHeads - 1) * floor;
    }
    return w + std::min(r, m);
}

} // namespace criticalkv
