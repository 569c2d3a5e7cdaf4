// The selection flows of every non-pruned policy on the GPU (head_selection.h, shared_allocation.h, and the
// row-scored methods' flow, row_scores.h: templates over the method's struct) as fixed sequences of batched launches:
// small plan kernels compute every row's k on the device (from the runtime budget, the prompt lengths, the heads'
// shares, stage 1's mass count) with the flows' own __host__ __device__ functions, and launchTopK / launchMassCount
// (criticalkv/topk.h) select over all rows of the batch at once. The host driver runs the same flows row by row (host/select_host.cpp); both keep the same sets.
//
// Included by kernels/selection.cu only and, compiled with g++, by the CPU emulation (plugins/testing/
// select_flows_emulation.cpp): no CUDA or CUB header here, launches go through a launcher:
//   kernel(fn, grid, threads, args...)              fn<<<grid, threads, 0, stream>>>(args...)
//   zero(pointer, bytes)                            cudaMemsetAsync
//   topK(TopKRows) / massCount(TopKRows, limit, count)   launchTopK / launchMassCount with the plan's scratch
#pragma once

#include "select_flow_args.h"
#include "topk_block.cuh"

#include "criticalkv/head_selection.h"
#include "criticalkv/methods/registry.h" // sharedRanking
#include "criticalkv/shared_allocation.h"

namespace criticalkv::kernels
{

__device__ __forceinline__ int32_t olderTokens(SelectionRows const& a)
{
    return a.shape.n - windowLength(a.config, a.shape.n);
}

//! The KV head row (b, g) of thread t of a plan kernel; false past the last one.
__device__ __forceinline__ bool planRow(SelectionRows const& a, int32_t& b, int32_t& g)
{
    int32_t const row = static_cast<int32_t>(blockIdx.x) * kPlanThreads + static_cast<int32_t>(threadIdx.x);
    b = row / a.shape.kvHeads;
    g = row % a.shape.kvHeads;
    return row < a.shape.batch * a.shape.kvHeads;
}

//! Per-head selection: stage 1's and stage 2's k of every head (its share of a shared allocation, else r). Sequences
//! kept whole get 0. grid (ceil(B H_kv / kPlanThreads)).
__global__ void __launch_bounds__(kPlanThreads) headPlanKernel(SelectionRows a)
{
    int32_t b = 0;
    int32_t g = 0;
    if (!planRow(a, b, g))
    {
        return;
    }
    int64_t const row = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    int64_t const count = sharedAllocation(a.config) ? a.headCounts[row] : info.r;
    HeadStageCounts const counts = headStageCounts(a.config, count);
    a.plan.headFirst[row] = info.compress ? counts.first : 0;
    a.plan.headSecond[row] = info.compress ? counts.second : 0;
    a.plan.headFirstValid[row] = info.candidateStart;
}

//! Shared allocation: every head's floor and every sequence's layer-wide rest. grid (ceil(B H_kv / kPlanThreads)).
__global__ void __launch_bounds__(kPlanThreads) sharedPlanKernel(SelectionRows a)
{
    int32_t b = 0;
    int32_t g = 0;
    if (!planRow(a, b, g))
    {
        return;
    }
    int64_t const row = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    SharedCounts const counts = sharedCounts(a.config, a.shape.kvHeads, info.r);
    a.plan.headFirst[row] = info.compress ? counts.floor : 0;
    a.plan.headFirstValid[row] = info.candidateStart;
    if (g == 0)
    {
        a.plan.layerRest[b] = info.compress ? counts.rest : 0;
        a.plan.layerFirstValid[b] = info.candidateStart;
    }
}

//! Each head's share after the shared allocation: its marked older tokens. grid (B H_kv), block kTopKThreads.
__global__ void __launch_bounds__(kTopKThreads) headCountsKernel(SelectionRows a)
{
    CKV_BLOCK_SHARED TopKSmem s;
    int32_t const m = olderTokens(a);
    int64_t const row = blockIdx.x;
    uint8_t const* flags = a.flags + row * m;
    unsigned long long mine = 0;
    for (int32_t i = static_cast<int32_t>(threadIdx.x); i < m; i += kTopKThreads)
    {
        mine += flags[i] != 0 ? 1ull : 0ull;
    }
    unsigned long long const total = blockSum(mine, s);
    if (threadIdx.x == 0)
    {
        a.headCounts[row] = static_cast<int32_t>(total);
    }
}

//! A row-scored Method: every head's stage-1 limit (the sequence's, Method::stage1Limit over its heads' totals). grid
//! as the plans.
template <typename Method>
__global__ void __launch_bounds__(kPlanThreads) stage1PlanKernel(SelectionRows a, void const* headTotals)
{
    auto const* totals = static_cast<typename Method::Totals const*>(headTotals);
    int32_t b = 0;
    int32_t g = 0;
    if (!planRow(a, b, g))
    {
        return;
    }
    int64_t const row = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    a.plan.limits[row] = info.compress
        ? Method::stage1Limit(a.config, totals + static_cast<int64_t>(b) * a.shape.kvHeads, a.shape.kvHeads)
        : 0.0F;
    a.plan.headFirstValid[row] = info.candidateStart;
}

//! A row-scored Method: stage 1 keeps the mass count, at most r. grid as the plans.
template <typename Method>
__global__ void __launch_bounds__(kPlanThreads) stage1KeepKernel(SelectionRows a)
{
    int32_t b = 0;
    int32_t g = 0;
    if (!planRow(a, b, g))
    {
        return;
    }
    int64_t const row = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    a.plan.headFirst[row] = info.compress ? Method::stage1Keep(a.plan.massCounts[row], info.r) : 0;
}

//! A row-scored Method: the shared allocation's ranking (stage-1 tokens first) and the flags cleared for it.
//! grid (ceil(H_kv m / kPlanThreads), B).
template <typename Method>
__global__ void __launch_bounds__(kPlanThreads) rankStage1Kernel(RowSelectionArgs a)
{
    int32_t const m = olderTokens(a.rows);
    int64_t const length = static_cast<int64_t>(a.rows.shape.kvHeads) * m;
    int64_t const e = static_cast<int64_t>(blockIdx.x) * kPlanThreads + threadIdx.x;
    if (e >= length)
    {
        return;
    }
    int64_t const at = static_cast<int64_t>(blockIdx.y) * length + e;
    a.ranking[at] = Method::stage1Ranking(a.scores[at], a.rows.flags[at] != 0);
    a.rows.flags[at] = 0;
}

inline Grid3 planGrid(SelectionRows const& a)
{
    int32_t const rows = a.shape.batch * a.shape.kvHeads;
    return Grid3{static_cast<uint32_t>((rows + kPlanThreads - 1) / kPlanThreads), 1, 1};
}

//! The rows of one top-k call over every KV head of the batch ([B H_kv] rows of m).
inline TopKRows headRows(SelectionRows const& a, float const* scores, int64_t const* k, uint8_t mark)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    return TopKRows{scores, a.flags, k, a.plan.headFirstValid, a.shape.batch * a.shape.kvHeads, m, m, m, mark, 1};
}

//! ... over every sequence's layer-wide row ([B] rows of H_kv m, the left padding in every head's m).
inline TopKRows layerRows(SelectionRows const& a, float const* scores, int64_t const* k, uint8_t mark)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int32_t const length = a.shape.kvHeads * m;
    return TopKRows{scores, a.flags, k, a.plan.layerFirstValid, a.shape.batch, length, length, m, mark, 1};
}

//! The shared allocation over `ranking` (flags cleared by the caller): each head's floor, then the layer-wide rest.
template <typename Launcher>
__host__ bool runSharedAllocation(SelectionRows const& a, float const* ranking, Launcher& launch)
{
    launch.kernel(sharedPlanKernel, planGrid(a), kPlanThreads, a);
    return launch.topK(headRows(a, ranking, a.plan.headFirst, kChosenByAttention))
        && launch.topK(layerRows(a, ranking, a.plan.layerRest, kChosenByAttention));
}

//! Shared allocation of adakv / the group-scored methods (and ada-criticalkv's shares): flags cleared, the
//! allocation, each head's share into headCounts.
template <typename Launcher>
__host__ bool runSharedStage(SelectionArgs const& a, Launcher& launch)
{
    SelectionRows const& r = a.rows;
    int32_t const m = r.shape.n - windowLength(r.config, r.shape.n);
    launch.zero(r.flags, static_cast<size_t>(r.shape.batch) * r.shape.kvHeads * m);
    if (!runSharedAllocation(r, sharedRanking(r.config, a.attention, a.methodScores), launch))
    {
        return false;
    }
    launch.kernel(headCountsKernel, Grid3{static_cast<uint32_t>(r.shape.batch * r.shape.kvHeads), 1, 1}, kTopKThreads,
        r);
    return true;
}

//! The per-head flow (selectHead) over every KV head: flags cleared, stage 1 by S, stage 2 by C.
template <typename Launcher>
__host__ bool runHeadStage(SelectionArgs const& a, Launcher& launch)
{
    SelectionRows const& r = a.rows;
    int32_t const m = r.shape.n - windowLength(r.config, r.shape.n);
    launch.zero(r.flags, static_cast<size_t>(r.shape.batch) * r.shape.kvHeads * m);
    launch.kernel(headPlanKernel, planGrid(r), kPlanThreads, r);
    if (!launch.topK(headRows(r, a.attention, r.plan.headFirst, kChosenByAttention)))
    {
        return false;
    }
    return !r.config.twoStage || launch.topK(headRows(r, a.critical, r.plan.headSecond, kChosenByCritical));
}

//! Every non-pruned policy but the row-scored ones: the shared allocation first where the base shares the layer's slots,
//! then the per-head flow unless the shares are the result (adakv, the group-scored methods).
template <typename Launcher>
__host__ bool runSelection(SelectionArgs const& a, Launcher& launch)
{
    if (sharedAllocation(a.rows.config))
    {
        if (!runSharedStage(a, launch))
        {
            return false;
        }
        if (!a.rows.config.twoStage)
        {
            return true;
        }
    }
    return runHeadStage(a, launch);
}

//! A row-scored Method's ranking (Method::rank): stage 1 by mass per head, then the method's score with the stage-1
//! tokens first into a.ranking, the flags cleared (a model-level method's part of the model-wide ranking: this alone).
template <typename Method, typename Launcher>
__host__ bool runRowRanking(RowSelectionArgs const& a, Launcher& launch)
{
    SelectionRows const& r = a.rows;
    int32_t const m = r.shape.n - windowLength(r.config, r.shape.n);
    launch.zero(r.flags, static_cast<size_t>(r.shape.batch) * r.shape.kvHeads * m);
    launch.kernel(stage1PlanKernel<Method>, planGrid(r), kPlanThreads, r, a.totals);
    if (!launch.massCount(headRows(r, a.massScores, nullptr, kChosenByAttention), r.plan.limits, r.plan.massCounts))
    {
        return false;
    }
    launch.kernel(stage1KeepKernel<Method>, planGrid(r), kPlanThreads, r);
    if (!launch.topK(headRows(r, a.massScores, r.plan.headFirst, kChosenByAttention)))
    {
        return false;
    }
    int32_t const length = r.shape.kvHeads * m;
    launch.kernel(rankStage1Kernel<Method>,
        Grid3{static_cast<uint32_t>((length + kPlanThreads - 1) / kPlanThreads), static_cast<uint32_t>(r.shape.batch),
            1},
        kPlanThreads, a);
    return true;
}

//! A row-scored Method (Method::select): its ranking (runRowRanking), then the shared allocation on it.
template <typename Method, typename Launcher>
__host__ bool runRowSelection(RowSelectionArgs const& a, Launcher& launch)
{
    return runRowRanking<Method>(a, launch) && runSharedAllocation(a.rows, a.ranking, launch);
}

} // namespace criticalkv::kernels
