// The per-row plan of the selection's batched top-k calls (kernels/select_flows.cuh, kernels/pruned_flow.cuh), part of
// the workspace (kernels.h: WorkspaceLayout::plan, ::prunedPlan, ::topK): every row's k and first valid position,
// computed on the device between the launches, and the top-k scratch.
#pragma once

#include "criticalkv/budget.h"
#include "criticalkv/methods.h"
#include "criticalkv/topk.h"

namespace criticalkv
{

//! Per-row arguments of the selection's top-k calls, computed on the device (workspace: selectionPlanBytes).
struct SelectionPlan
{
    int64_t* headFirst;       //!< [B, H_kv] stage 1 (or the only stage), the shared allocation's floor, or
                              //!< a row-scored method's stage 1
    int64_t* headSecond;      //!< [B, H_kv] stage 2
    int64_t* layerRest;       //!< [B] the shared allocation's layer-wide rest
    int64_t* massCounts;      //!< [B, H_kv] a row-scored method's stage-1 mass counts
    int32_t* headFirstValid;  //!< [B, H_kv] the sequence's first valid position
    int32_t* layerFirstValid; //!< [B]
    float* limits;            //!< [B, H_kv] a row-scored method's stage-1 limit of the sequence
    void* scratch;            //!< launchTopK / launchMassCount's
    size_t scratchBytes;
};

inline size_t selectionPlanBytes(int32_t batch, int32_t kvHeads)
{
    size_t const heads = static_cast<size_t>(batch) * static_cast<size_t>(kvHeads);
    size_t const b = static_cast<size_t>(batch);
    return heads * (3 * sizeof(int64_t) + sizeof(int32_t) + sizeof(float)) + b * (sizeof(int64_t) + sizeof(int32_t));
}

//! The plan's arrays laid out from `at` (8-byte aligned, selectionPlanBytes long).
inline SelectionPlan selectionPlan(void* at, int32_t batch, int32_t kvHeads, void* scratch, size_t scratchBytes)
{
    size_t const heads = static_cast<size_t>(batch) * static_cast<size_t>(kvHeads);
    auto* wide = static_cast<int64_t*>(at);
    SelectionPlan plan{};
    plan.headFirst = wide;
    plan.headSecond = wide + heads;
    plan.massCounts = wide + 2 * heads;
    plan.layerRest = wide + 3 * heads;
    auto* narrow = reinterpret_cast<int32_t*>(wide + 3 * heads + batch);
    plan.headFirstValid = narrow;
    plan.layerFirstValid = narrow + heads;
    plan.limits = reinterpret_cast<float*>(narrow + heads + batch);
    plan.scratch = scratch;
    plan.scratchBytes = scratchBytes;
    return plan;
}

//! Candidate rounds of CriticalKV's pruned stage 2 that one multi-level top-k by U ranks at once (kernels/pruned_flow.cuh:
//! the first min(2k, eligible) candidates, then 4k, 8k, 16k; the last round takes every eligible token left).
constexpr int32_t kPrunedCandidateLevels = 4;

//! Per-head arguments of CriticalKV's pruned stage 2 (kernels/pruned_flow.cuh), computed on the device between its
//! launches (workspace: prunedPlanBytes).
struct PrunedPlan
{
    int64_t* first;      //!< [B, H_kv] stage 1's count: the top-k by S
    int64_t* rounds;     //!< [kPrunedCandidateLevels, B, H_kv] the candidates of rounds 0 .. l together: the levels of
                         //!< the one top-k by U (0: none)
    int64_t* next;       //!< [B, H_kv] the candidates the current round adds (0: the head lists none)
    int64_t* keep;       //!< [B, H_kv] stage 2's count k of a head with candidates, else 0: the top-k by exact C
    int32_t* firstValid; //!< [B, H_kv] the sequence's first valid position
    uint32_t* following; //!< [B, H_kv] orderedKey of the best bound among the eligible tokens left out
    uint32_t* clearing;  //!< [B, H_kv] candidates whose exact C is not <= stopThreshold (stage2SettledByCount)
};

//! A host-side upper bound of every head's stage-2 count k in CriticalKV's pruned stage 2 (the norm launches' grids
//! cover 2^(round+1) of it): a head's count is at most r_l at the largest runtime budget (the table's largest entry for
//! PyramidKV), H_kv times that under shared allocation, and m; k = count - stage1Count(count) grows with the count
//! (stage 1 takes at most one more token per token), so the largest count bounds it. The first candidates' launch then
//! covers the 2k rows that can be listed (Llama-3-8B at 32k, budget 2048: 3,024 rows, 12 tiles), not 2 r_l.
inline int32_t prunedMaxK(SelectConfig const& config, BudgetTable const& table, SelectShape const& shape, int32_t m)
{
    int64_t r = config.layerBudget > config.budget - config.window ? config.layerBudget : config.budget - config.window;
    if (config.budgetTable && table.values != nullptr)
    {
        for (int32_t i = 0; i < table.count; ++i)
        {
            r = table.values[i] > r ? table.values[i] : r;
        }
    }
    if (sharedAllocation(config))
    {
        r *= shape.kvHeads;
    }
    int64_t const count = r < m ? r : m;
    int64_t const k = count - stage1Count(config.alphaMicros, count);
    return k > 0 ? static_cast<int32_t>(k) : 0;
}

inline size_t prunedPlanBytes(int32_t batch, int32_t kvHeads)
{
    size_t const heads = static_cast<size_t>(batch) * static_cast<size_t>(kvHeads);
    return heads * ((3 + kPrunedCandidateLevels) * sizeof(int64_t) + sizeof(int32_t) + 2 * sizeof(uint32_t));
}

//! The pruned plan's arrays laid out from `at` (8-byte aligned, prunedPlanBytes long).
inline PrunedPlan prunedPlan(void* at, int32_t batch, int32_t kvHeads)
{
    size_t const heads = static_cast<size_t>(batch) * static_cast<size_t>(kvHeads);
    auto* wide = static_cast<int64_t*>(at);
    int64_t* rounds = wide + heads;
    int64_t* after = rounds + kPrunedCandidateLevels * heads;
    auto* narrow = reinterpret_cast<int32_t*>(after + 2 * heads);
    auto* keys = reinterpret_cast<uint32_t*>(narrow + heads);
    return PrunedPlan{wide, rounds, after, after + heads, narrow, keys, keys + heads};
}

//! Scratch of the selection's top-k calls for a shape: the largest of the per-head rows, the layer-wide rows (shared
//! allocation) and the mass count (a row-scored method's stage 1). Non-decreasing in every dimension.
inline size_t selectionScratchBytes(int32_t batch, int32_t kvHeads, int32_t m, bool shared, bool massCount)
{
    size_t bytes = topKScratchBytes(batch * kvHeads, m);
    size_t const layer = shared ? topKScratchBytes(batch, kvHeads * m) : 0;
    size_t const mass = massCount ? massCountScratchBytes(batch * kvHeads, m) : 0;
    bytes = layer > bytes ? layer : bytes;
    return mass > bytes ? mass : bytes;
}

} // namespace criticalkv
