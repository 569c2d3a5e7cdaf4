// Arguments and launchers of the selection stages (private to plugins/kernels; used by pipeline.cu).
#pragma once

#include "criticalkv/defensive.h"

#include <cuda_runtime_api.h>

namespace criticalkv::kernels
{

struct ScoreArgs
{
    SelectConfig config;
    SelectShape shape;
    int32_t const* promptLengths;
    RuntimeBudget budget;
    float const* raw;     // [B, H, m]
    float const* squares; // [B, H, m] (laprox)
    float const* norms;   // [B, H, m] (two-stage, laprox)
    float* attention;     // [B, H_kv, m]
    float* critical;      // [B, H_kv, m] or nullptr
    float* laprox;        // [B, H_kv, m] or nullptr
    uint8_t* flags;       // [B, H_kv, m]
    int32_t* headCounts;  // [B, H_kv]
    float const* worst;       // [B, H, m] (defensivekv, launchDefensiveRows)
    float2 const* rowMass;    // [B, H, w] (defensivekv)
    float* stage1;            // [B, H_kv, m] (defensivekv)
    float* ranking;           // [B, H_kv, m] (defensivekv)
    DefensiveTotals* totals;  // [B, H_kv] (defensivekv)
    int32_t* keptIndices; // [B, H_kv, cap]
    int32_t* keptLengths; // [B, H_kv]
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

cudaError_t launchScoresAndSelection(ScoreArgs const& a, cudaStream_t stream);
cudaError_t launchCompact(ScoreArgs const& a, cudaStream_t stream);
cudaError_t launchGather(GatherArgs const& a, cudaStream_t stream);

} // namespace criticalkv::kernels
