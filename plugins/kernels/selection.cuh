// Arguments and launchers of the selection stages (private to plugins/kernels; used by pipeline.cu).
#pragma once

#include "compact.cuh" // CompactArgs
#include "select_flow_args.h"

#include <cuda_runtime_api.h>

namespace criticalkv::kernels
{

//! The score stages (group scores, a row-scored method's scores).
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
    // a row-scored method's (row_scores.h; the window pass's rows, then its scratch and totals), else nullptr
    float const* pooledMax;   // [B, H, m]
    float2 const* rowSums;    // [B, H, w] (mass, pooled total)
    float* massScores;        // [B, H_kv, m]
    float* ranking;           // [B, H_kv, m]
    void* totals;             // Method::Totals [B, H_kv]
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
//! A row-scored method's scores (the kernels' instance is the base's of methods/registry.h: RowScoredMethods): its
//! score into attention, its stage-1 mass into massScores, its totals.
cudaError_t launchRowScores(ScoreArgs const& a, cudaStream_t stream);
//! The selection of every non-pruned policy but the row-scored ones (select_flows.cuh: runSelection).
cudaError_t launchSelection(SelectionArgs const& a, cudaStream_t stream);
//! Only the shared allocation and the heads' shares (the pruned ada-criticalkv's launchPrunedStage2 then reselects
//! inside them).
cudaError_t launchSharedAllocation(SelectionArgs const& a, cudaStream_t stream);
//! A row-scored method's selection (select_flows.cuh: runRowSelection).
cudaError_t launchRowSelection(RowSelectionArgs const& a, cudaStream_t stream);
//! A row-scored method's ranking alone (select_flows.cuh: runRowRanking; a model-level one's per-layer part).
cudaError_t launchRowRanking(RowSelectionArgs const& a, cudaStream_t stream);
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
