// Arguments of the selection stages' flows (select_flows.cuh): the per-row plan in the workspace and what each stage
// reads. No CUDA header, so that pipeline.cu, selection.cu and the CPU emulation share them.
#pragma once

#include "criticalkv/defensive.h"
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

//! The per-head and shared-allocation selection (snapkv, pyramidkv, adakv, laprox and their CriticalKV forms).
struct SelectionArgs
{
    SelectionRows rows;
    float const* attention; //!< [B, H_kv, m] S
    float const* critical;  //!< [B, H_kv, m] C (two-stage) or nullptr
    float const* laprox;    //!< [B, H_kv, m] LaProx importance (laprox) or nullptr
};

//! defensivekv's selection: stage 1 by mass, then the shared allocation on the ranking.
struct DefensiveSelectionArgs
{
    SelectionRows rows;
    float const* defensive;        //!< [B, H_kv, m] the defensive score
    float const* stage1;           //!< [B, H_kv, m] the stage-1 mass
    float* ranking;                //!< [B, H_kv, m] scratch: the shared allocation's ranking
    DefensiveTotals const* totals; //!< [B, H_kv]
};

} // namespace criticalkv::kernels
