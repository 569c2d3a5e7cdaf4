// Group scores, the selection stages, compaction and gather.
//
// Every non-pruned selection flow (per head, shared allocation, the row-scored methods') is select_flows.cuh's fixed
// sequence of plan kernels and batched top-k launches (launchTopK, kernels/topk.cu) over all rows of the batch;
// CriticalKV's pruned stage 2 (prunedStage2On) is kernels/pruned.cu's (launchPrunedStage2, enqueued by pipeline.cu).
#include "criticalkv/group_scores.h"
#include "criticalkv/head_selection.h"
#include "criticalkv/kept_positions.h"
#include "criticalkv/kernels.h"
#include "device_utils.cuh"
#include "flow_launch.cuh"
#include "model_level.cuh"
#include "select_flows.cuh"
#include "selection.cuh"

#include <cub/block/block_reduce.cuh>

namespace criticalkv
{
namespace kernels
{

constexpr int kScoreThreads = 256;
constexpr int kGatherWarps = 8;

//! S, C and Method's own score (group_scores.h; NoGroupScore: none) of every older token.
//! grid (ceil(m / kScoreThreads), H_kv, B).
template <typename Method>
__global__ void __launch_bounds__(kScoreThreads) groupScoresKernel(ScoreArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    if (!sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress)
    {
        return;
    }
    int32_t const n = a.shape.n;
    int32_t const m = n - windowLength(a.config, n);
    int32_t const i = static_cast<int32_t>(blockIdx.x) * kScoreThreads + static_cast<int32_t>(threadIdx.x);
    if (i >= m)
    {
        return;
    }
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    int64_t const sequence = static_cast<int64_t>(b) * a.shape.heads * m;
    GroupScores const scores = groupScoresAt<Method>(a.config, a.raw + sequence,
        a.squares != nullptr ? a.squares + sequence : nullptr, a.norms != nullptr ? a.norms + sequence : nullptr,
        g * group, group, m, i);
    int64_t const out = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m + i;
    a.attention[out] = scores.attention;
    if (a.critical != nullptr)
    {
        a.critical[out] = scores.critical;
    }
    if (a.methodScores != nullptr)
    {
        a.methodScores[out] = scores.method;
    }
}

//! A row-scored Method (row_scores.h), per older token: the group's parts into attention (worst), ranking (norm) and
//! massScores (attention), the scratch of the next two kernels. grid (ceil(m / kScoreThreads), H_kv, B).
template <typename Method>
__global__ void __launch_bounds__(kScoreThreads) rowPartsKernel(ScoreArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int32_t const i = static_cast<int32_t>(blockIdx.x) * kScoreThreads + static_cast<int32_t>(threadIdx.x);
    if (!info.compress || i >= m)
    {
        return;
    }
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    int64_t const sequence = static_cast<int64_t>(b) * a.shape.heads * m;
    typename Method::Parts const parts = Method::partsAt(a.pooledMax + sequence, a.raw + sequence,
        a.norms + sequence, g * group, group, m, info.validStart, i);
    int64_t const out = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m + i;
    a.attention[out] = parts.worst;
    a.ranking[out] = parts.norm;
    a.massScores[out] = parts.attention;
}

//! A row-scored Method, per KV head: the sums over its valid older tokens and its rows' window mass (double,
//! block-reduced) into its totals. grid (H_kv, B), block kScoreThreads.
template <typename Method>
__global__ void __launch_bounds__(kScoreThreads) rowTotalsKernel(ScoreArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    if (!info.compress)
    {
        return;
    }
    using Reduce = cub::BlockReduce<double, kScoreThreads>;
    __shared__ typename Reduce::TempStorage storage;
    int32_t const w = windowLength(a.config, a.shape.n);
    int32_t const m = a.shape.n - w;
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    int64_t const row = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m;
    double worst = 0.0;
    double norm = 0.0;
    double attention = 0.0;
    double mass = 0.0;
    for (int32_t i = static_cast<int32_t>(threadIdx.x); i < m; i += kScoreThreads)
    {
        worst += i >= info.validStart ? a.attention[row + i] : 0.0F;
        norm += a.ranking[row + i];
        attention += a.massScores[row + i];
    }
    float2 const* rows = a.rowSums + (static_cast<int64_t>(b) * a.shape.heads + g * group) * w;
    for (int32_t r = static_cast<int32_t>(threadIdx.x); r < group * w; r += kScoreThreads)
    {
        mass += rows[r].x;
    }
    worst = Reduce(storage).Sum(worst);
    __syncthreads();
    norm = Reduce(storage).Sum(norm);
    __syncthreads();
    attention = Reduce(storage).Sum(attention);
    __syncthreads();
    mass = Reduce(storage).Sum(mass);
    if (threadIdx.x == 0)
    {
        static_cast<typename Method::Totals*>(a.totals)[static_cast<int64_t>(b) * a.shape.kvHeads + g]
            = Method::totals(worst, norm, attention, mass, m - info.validStart, group * w);
    }
}

//! A row-scored Method, per older token: its score (into attention) and its stage-1 mass (into massScores).
//! grid (ceil(m / kScoreThreads), H_kv, B).
template <typename Method>
__global__ void __launch_bounds__(kScoreThreads) rowFinishKernel(ScoreArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int32_t const i = static_cast<int32_t>(blockIdx.x) * kScoreThreads + static_cast<int32_t>(threadIdx.x);
    if (!sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress || i >= m)
    {
        return;
    }
    int64_t const head = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    int64_t const out = head * m + i;
    typename Method::Parts const parts{a.attention[out], a.ranking[out], a.massScores[out]};
    typename Method::Totals const totals = static_cast<typename Method::Totals const*>(a.totals)[head];
    a.attention[out] = Method::score(parts, totals);
    a.massScores[out] = Method::stage1Mass(parts, totals);
}

//! Ascending kept positions of every head (-1 padded) and their count (compact.cuh). grid compactGrid(shape), block
//! kCompactThreads.
__global__ void __launch_bounds__(kCompactThreads) compactKernel(CompactArgs a)
{
    __shared__ CompactSmem smem;
    compactBlock(a, smem);
}

//! kept_keys / kept_values rows from kept_indices (zero where -1). grid (ceil(cap / kGatherWarps), H_kv, B);
//! one warp per slot, 16-byte vectors when the row allows them.
template <typename Vec>
__global__ void __launch_bounds__(kGatherWarps * 32) gatherKernel(GatherArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    int32_t const cap = outputCapacity(a.config, a.shape.n);
    int32_t const slot = static_cast<int32_t>(blockIdx.x) * kGatherWarps + static_cast<int32_t>(threadIdx.x) / 32;
    if (slot >= cap)
    {
        return;
    }
    int32_t const lane = static_cast<int32_t>(threadIdx.x) % 32;
    int64_t const head = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    int32_t const index = a.keptIndices[head * cap + slot];
    int64_t const rowVectors = a.rowBytes / static_cast<int64_t>(sizeof(Vec));
    Vec const* keys = static_cast<Vec const*>(a.keys) + (head * a.shape.n + (index < 0 ? 0 : index)) * rowVectors;
    Vec const* values = static_cast<Vec const*>(a.values) + (head * a.shape.n + (index < 0 ? 0 : index)) * rowVectors;
    Vec* keptKeys = static_cast<Vec*>(a.keptKeys) + (head * cap + slot) * rowVectors;
    Vec* keptValues = static_cast<Vec*>(a.keptValues) + (head * cap + slot) * rowVectors;
    for (int64_t v = lane; v < rowVectors; v += 32)
    {
        Vec zero{};
        keptKeys[v] = index >= 0 ? keys[v] : zero;
        keptValues[v] = index >= 0 ? values[v] : zero;
    }
}

namespace
{

dim3 scoreGridOf(ScoreArgs const& a, int32_t m)
{
    return dim3(static_cast<uint32_t>((m + kScoreThreads - 1) / kScoreThreads), static_cast<uint32_t>(a.shape.kvHeads),
        static_cast<uint32_t>(a.shape.batch));
}

} // namespace

cudaError_t launchGroupScores(ScoreArgs const& a, cudaStream_t stream)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    if (m <= 0)
    {
        return cudaSuccess;
    }
    forGroupScore(a.config.base, [&a, m, stream](auto method) {
        groupScoresKernel<decltype(method)><<<scoreGridOf(a, m), kScoreThreads, 0, stream>>>(a);
    });
    return cudaGetLastError();
}

cudaError_t launchRowScores(ScoreArgs const& a, cudaStream_t stream)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    if (m <= 0)
    {
        return cudaSuccess;
    }
    dim3 const scoreGrid = scoreGridOf(a, m);
    bool const listed = forRowScoredMethod(a.config.base, [&a, &scoreGrid, stream](auto method) {
        using Method = decltype(method);
        rowPartsKernel<Method><<<scoreGrid, kScoreThreads, 0, stream>>>(a);
        rowTotalsKernel<Method><<<dim3(static_cast<uint32_t>(a.shape.kvHeads), static_cast<uint32_t>(a.shape.batch)),
            kScoreThreads, 0, stream>>>(a);
        rowFinishKernel<Method><<<scoreGrid, kScoreThreads, 0, stream>>>(a);
    });
    return listed ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launchSelection(SelectionArgs const& a, cudaStream_t stream)
{
    FlowLaunch launch{a.rows.plan.scratch, a.rows.plan.scratchBytes, stream};
    bool const accepted = runSelection(a, launch);
    return launch.finish(accepted);
}

cudaError_t launchSharedAllocation(SelectionArgs const& a, cudaStream_t stream)
{
    FlowLaunch launch{a.rows.plan.scratch, a.rows.plan.scratchBytes, stream};
    bool const accepted = runSharedStage(a, launch);
    return launch.finish(accepted);
}

cudaError_t launchRowSelection(RowSelectionArgs const& a, cudaStream_t stream)
{
    FlowLaunch launch{a.rows.plan.scratch, a.rows.plan.scratchBytes, stream};
    bool accepted = false;
    forRowScoredMethod(a.rows.config.base,
        [&](auto method) { accepted = runRowSelection<decltype(method)>(a, launch); });
    return launch.finish(accepted);
}

cudaError_t launchRowRanking(RowSelectionArgs const& a, cudaStream_t stream)
{
    FlowLaunch launch{a.rows.plan.scratch, a.rows.plan.scratchBytes, stream};
    bool accepted = false;
    forRowScoredMethod(a.rows.config.base,
        [&](auto method) { accepted = runRowRanking<decltype(method)>(a, launch); });
    return launch.finish(accepted);
}

cudaError_t launchExternalRaw(ExternalRawArgs const& a, cudaStream_t stream)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    if (m <= 0)
    {
        return cudaSuccess;
    }
    dim3 const grid(static_cast<uint32_t>((m + kPlanThreads - 1) / kPlanThreads), static_cast<uint32_t>(a.shape.heads),
        static_cast<uint32_t>(a.shape.batch));
    externalRawKernel<<<grid, kPlanThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launchSinkRanking(SinkRankingArgs const& a, cudaStream_t stream)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    if (m <= 0)
    {
        return cudaSuccess;
    }
    dim3 const grid(static_cast<uint32_t>((m + kPlanThreads - 1) / kPlanThreads),
        static_cast<uint32_t>(a.shape.kvHeads), static_cast<uint32_t>(a.shape.batch));
    sinkRankingKernel<<<grid, kPlanThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launchMarkKeptSinks(SelectionRows const& a, cudaStream_t stream)
{
    dim3 const grid(static_cast<uint32_t>(a.shape.kvHeads), static_cast<uint32_t>(a.shape.batch));
    markKeptSinksKernel<<<grid, kPlanThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launchModelAllocation(ModelArgs const& a, cudaStream_t stream)
{
    FlowLaunch launch{a.rows.plan.scratch, a.rows.plan.scratchBytes, stream};
    bool const accepted = runModelAllocation(a, launch);
    return launch.finish(accepted);
}

cudaError_t launchCompact(CompactArgs const& a, cudaStream_t stream)
{
    Grid3 const grid = compactGrid(a.shape);
    compactKernel<<<dim3(grid.x, grid.y, grid.z), kCompactThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launchGather(GatherArgs const& a, cudaStream_t stream)
{
    int32_t const cap = outputCapacity(a.config, a.shape.n);
    if (cap <= 0)
    {
        return cudaSuccess;
    }
    dim3 const grid(static_cast<uint32_t>((cap + kGatherWarps - 1) / kGatherWarps), static_cast<uint32_t>(a.shape.kvHeads),
        static_cast<uint32_t>(a.shape.batch));
    bool const vectorised = a.rowBytes % 16 == 0
        && (reinterpret_cast<uintptr_t>(a.keys) | reinterpret_cast<uintptr_t>(a.values)
               | reinterpret_cast<uintptr_t>(a.keptKeys) | reinterpret_cast<uintptr_t>(a.keptValues))
                % 16
            == 0;
    if (vectorised)
    {
        gatherKernel<uint4><<<grid, kGatherWarps * 32, 0, stream>>>(a);
    }
    else if (a.rowBytes % 4 == 0)
    {
        gatherKernel<uint32_t><<<grid, kGatherWarps * 32, 0, stream>>>(a);
    }
    else
    {
        gatherKernel<uint16_t><<<grid, kGatherWarps * 32, 0, stream>>>(a);
    }
    return cudaGetLastError();
}

} // namespace kernels

} // namespace criticalkv
