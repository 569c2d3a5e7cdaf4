// Arguments of the selection stages' flows (select_flows.cuh): the per-row plan in the workspace and what each stage
// reads. No CUDA header, so that pipeline.cu, selection.cu and the CPU emulation share them.
#pragma once

#include "criticalkv/selection_plan.h"

namespace criticalkv::kernels
{

//! A grid size (dim3 without CUDA's headers).
struct Grid3
{
    uint32_t x, y, z;
};

constexpr int kPlanThreads = 256;

//! What every selection stage reads: the call, and where its rows go.
struct SelectionRows
{
    SelectConfig config;
    SelectShape shape;
    int32_t const* promptLengths;
    RuntimeBudget budget;
    uint8_t* flags;      //!< [B, H_kv, m]
    int32_t* headCounts; //!< [B, H_kv] each head's share after a shared allocation (or nullptr)
    SelectionPlan plan;
};

//! The per-head and shared-allocation selection (snapkv, pyramidkv, adakv, the group-scored methods and their
//! CriticalKV forms).
struct SelectionArgs
{
    SelectionRows rows;
    float const* attention; //!< [B, H_kv, m] S
    float const* critical;  //!< [B, H_kv, m] C (two-stage) or nullptr
    float const* methodScores; //!< [B, H_kv, m] a group-scored method's own score (groupScored) or nullptr
};

//! A row-scored method's selection (row_scores.h): stage 1 by mass, then the shared allocation on the ranking.
struct RowSelectionArgs
{
    SelectionRows rows;
    float const* scores;     //!< [B, H_kv, m] the method's score
    float const* massScores; //!< [B, H_kv, m] the stage-1 mass
    float* ranking;          //!< [B, H_kv, m] scratch: the shared allocation's ranking
    void const* totals;      //!< Method::Totals [B, H_kv]
};

//! A kvzip layer's external scores copied as every query head's raw attention (model_level.cuh: externalRawKernel).
struct ExternalRawArgs
{
    SelectConfig config;
    SelectShape shape;
    int32_t const* promptLengths;
    RuntimeBudget budget;
    float const* scores; //!< [B, H_kv, n]
    float* raw;          //!< [B, H, m]
};

//! layer-kvzip's ranking of one layer (model_level.cuh: sinkRankingKernel).
struct SinkRankingArgs
{
    SelectConfig config;
    SelectShape shape;
    int32_t const* promptLengths;
    RuntimeBudget budget;
    float const* attention;
    float* ranking;
};

//! What the model-level allocation reads and writes. rows: the model's rows (shape: modelRows, kvHeads = N; config:
//! the policy with keptSinks 0; flags [B, N, m]; plan: B N rows, its scratch the top-k's).
struct ModelArgs
{
    SelectionRows rows;
    float const* ranking;       //!< [B, N, m]
    float const* attention;     //!< [B, N, m] the base's score (CriticalKV's refinement), else nullptr
    float const* critical;      //!< [B, N, m] the critical score (CriticalKV's refinement), else nullptr
    int32_t* counts;            //!< [B, N] each head's count (head cap)
    uint32_t* sortKeys[2];      //!< [B, N, sortStride] ping-pong: each head's candidates' keys, best first (in [1])
    int32_t* sortPositions[2];  //!< [B, N, sortStride] their positions
    int32_t sortStride;         //!< >= every head's candidates (modelSortStride)
};

} // namespace criticalkv::kernels
