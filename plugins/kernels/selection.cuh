// Arguments and launchers of the selection stages (private to plugins/kernels; used by pipeline.cu).
#pragma once

#include "criticalkv/methods/defensivekv.h"
#include "compact.cuh" // CompactArgs
#include "select_flow_args.h"

#include <cuda_runtime_api.h>

namespace criticalkv::kernels
{

//! The score stages (group scores, defensivekv's scores).
struct ScoreArgs
{
    SelectConfig config;
    SelectShape shape;
    int32_t const* promptLengths;
    RuntimeBudget budget;
    float const* raw;     // [B, H, m]
    float const* squares; // [B, H, m] (windowSquares)
    float const* norms;   // [B, H, m] (needsNorms)
    float* attention;     // [B, H_kv, m]
    float* critical;      // [B, H_kv, m] or nullptr
    float* methodScores;  // [B, H_kv, m] (groupScored) or nullptr
    uint8_t* flags;       // [B, H_kv, m]
    int32_t* headCounts;  // [B, H_kv]
    float const* worst;       // [B, H, m] (defensivekv, launchDefensiveRows)
    float2 const* rowMass;    // [B, H, w] (defensivekv)
    float* stage1;            // [B, H_kv, m] (defensivekv)
    float* ranking;           // [B, H_kv, m] (defensivekv)
    DefensiveKV::Totals* totals;  // [B, H_kv] (defensivekv)
    // CriticalKV's pruned stage 2 (prunedStage2On): norms hold the L1 bounds, critical their group score U; the
    // per-head selection is launchPrunedStage2's (kernels/pruned.cu)
    bool pruned;
};

struct GatherArgs
{
    SelectConfig config;
    SelectShape shape;
    int32_t const* keptIndices;
    void const* keys;
    void const* values;
    void* keptKeys;
    void* keptValues;
    int64_t rowBytes; // d_h * sizeof(element)
};

//! The gather of one layer's kept rows (keys, values [B, H_kv, n, d_h] of `dtype`) by its kept indices.
inline GatherArgs gatherArgs(SelectConfig const& config, SelectShape const& shape, DType dtype,
    int32_t const* keptIndices, void const* keys, void const* values, void* keptKeys, void* keptValues)
{
    return GatherArgs{config, shape, keptIndices, keys, values, keptKeys, keptValues,
        static_cast<int64_t>(shape.headDim) * (dtype == DType::kFloat32 ? 4 : 2)};
}

//! S, C and the group-scored method's own score of every older token (group_scores.h; the kernel's instance is the
//! method's of methods/registry.h).
cudaError_t launchGroupScores(ScoreArgs const& a, cudaStream_t stream);
//! defensivekv's scores: the defensive score into attention, the stage-1 mass into stage1, the totals.
cudaError_t launchDefensiveScores(ScoreArgs const& a, cudaStream_t stream);
//! The selection of every non-pruned, non-defensive policy (select_flows.cuh: runSelection).
cudaError_t launchSelection(SelectionArgs const& a, cudaStream_t stream);
//! Only the shared allocation and the heads' shares (the pruned ada-criticalkv's launchPrunedStage2 then reselects
//! inside them).
cudaError_t launchSharedAllocation(SelectionArgs const& a, cudaStream_t stream);
//! defensivekv's selection (select_flows.cuh: runDefensiveSelection).
cudaError_t launchDefensiveSelection(DefensiveSelectionArgs const& a, cudaStream_t stream);
//! defensivekv's ranking alone (select_flows.cuh: runDefensiveRanking; layer-defensivekv's per-layer part).
cudaError_t launchDefensiveRanking(DefensiveSelectionArgs const& a, cudaStream_t stream);
//! A kvzip layer's external scores as every query head's raw attention (model_level.cuh: externalRawKernel; the
//! kernels of this and the next three launchers are model_level.cuh's).
cudaError_t launchExternalRaw(ExternalRawArgs const& a, cudaStream_t stream);
//! layer-kvzip's ranking: the group score with the sinks first (model_level.cuh: sinkRankingKernel).
cudaError_t launchSinkRanking(SinkRankingArgs const& a, cudaStream_t stream);
//! A per-layer kvzip head's kept sinks flagged before its compaction (model_level.cuh: markKeptSinksKernel).
cudaError_t launchMarkKeptSinks(SelectionRows const& a, cudaStream_t stream);
//! The model-level allocation and refinement (model_level.cuh: runModelAllocation).
cudaError_t launchModelAllocation(ModelArgs const& a, cudaStream_t stream);
cudaError_t launchCompact(CompactArgs const& a, cudaStream_t stream);
cudaError_t launchGather(GatherArgs const& a, cudaStream_t stream);

} // namespace criticalkv::kernels
