// Group scores, the selection stages, compaction and gather.
//
// Every non-pruned selection flow (per head, shared allocation, defensivekv) is select_flows.cuh's fixed sequence of
// plan kernels and batched top-k launches (launchTopK, kernels/topk.cu) over all rows of the batch; CriticalKV's
// pruned stage 2 (prunedStage2On) is kernels/pruned.cu's (launchPrunedStage2, enqueued by pipeline.cu).
#include "criticalkv/methods/defensivekv.h"
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

//! defensivekv, per older token: the group's parts (methods/defensivekv.h) into attention (worst), ranking (norm) and
//! stage1 (attention), the scratch of the next two kernels. grid (ceil(m / kScoreThreads), H_kv, B).
__global__ void __launch_bounds__(kScoreThreads) defensivePartsKernel(ScoreArgs a)
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
    DefensiveKV::Parts const parts = DefensiveKV::partsAt(a.worst + sequence, a.raw + sequence, a.norms + sequence,
        g * group, group, m, info.validStart, i);
    int64_t const out = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m + i;
    a.attention[out] = parts.worst;
    a.ranking[out] = parts.norm;
    a.stage1[out] = parts.attention;
}

//! defensivekv, per KV head: the sums over its valid older tokens and its rows' window mass (double, block-reduced).
//! grid (H_kv, B), block kScoreThreads.
__global__ void __launch_bounds__(kScoreThreads) defensiveTotalsKernel(ScoreArgs a)
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
        attention += a.stage1[row + i];
    }
    float2 const* rows = a.rowMass + (static_cast<int64_t>(b) * a.shape.heads + g * group) * w;
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
        a.totals[static_cast<int64_t>(b) * a.shape.kvHeads + g]
            = DefensiveKV::totals(worst, norm, attention, mass, m - info.validStart, group * w);
    }
}

//! defensivekv, per older token: the defensive score (into attention) and the stage-1 mass (into stage1).
//! grid (ceil(m / kScoreThreads), H_kv, B).
__global__ void __launch_bounds__(kScoreThreads) defensiveFinishKernel(ScoreArgs a)
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
    DefensiveKV::Parts const parts{a.attention[out], a.ranking[out], a.stage1[out]};
    DefensiveKV::Totals const totals = a.totals[head];
    a.attention[out] = DefensiveKV::score(parts, totals);
    a.stage1[out] = DefensiveKV::stage1Mass(parts, totals);
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

cudaError_t launchDefensiveScores(ScoreArgs const& a, cudaStream_t stream)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    if (m <= 0)
    {
        return cudaSuccess;
    }
    dim3 const scoreGrid = scoreGridOf(a, m);
    defensivePartsKernel<<<scoreGrid, kScoreThreads, 0, stream>>>(a);
    defensiveTotalsKernel<<<dim3(static_cast<uint32_t>(a.shape.kvHeads), static_cast<uint32_t>(a.shape.batch)),
        kScoreThreads, 0, stream>>>(a);
    defensiveFinishKernel<<<scoreGrid, kScoreThreads, 0, stream>>>(a);
    return cudaGetLastError();
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

cudaError_t launchDefensiveSelection(DefensiveSelectionArgs const& a, cudaStream_t stream)
{
    FlowLaunch launch{a.rows.plan.scratch, a.rows.plan.scratchBytes, stream};
    bool const accepted = runDefensiveSelection(a, launch);
    return launch.finish(accepted);
}

cudaError_t launchDefensiveRanking(DefensiveSelectionArgs const& a, cudaStream_t stream)
{
    FlowLaunch launch{a.rows.plan.scratch, a.rows.plan.scratchBytes, stream};
    bool const accepted = runDefensiveRanking(a, launch);
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
