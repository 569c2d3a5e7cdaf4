// Parameters of one CriticalKVSelect invocation (one attention layer), shared by the kernels, the host driver
// and the TensorRT plugin. Plain structs: they are passed by value to CUDA kernels.
#pragma once

#include "criticalkv/common.h"

#include <cstddef>

namespace criticalkv
{

//! The policy of one layer, resolved to numbers (host/policy.h: makeSelectConfig).
struct SelectConfig
{
    BaseMethod base;
    int32_t twoStage;         //!< CriticalKV stage 2 on (criticalkv, pyramid-criticalkv, ada-criticalkv)
    int32_t budget;           //!< built (largest) budget: tokens per KV head, window included
    int32_t minBudget;        //!< smallest runtime budget (window; sink_tokens for streamingllm if larger)
    int32_t window;           //!< observation window (always kept)
    int32_t poolKernel;       //!< odd max-pool kernel
    int32_t sinkTokens;       //!< streamingllm sinks
    int64_t alphaMicros;      //!< stage-1 fraction in millionths
    float epsilon;            //!< stage-2 score (P + epsilon) * N, added in fp32 like the reference
    int64_t adaFloorMicros;   //!< adakv / laprox per-head floor fraction in millionths
    ValueNorm valueNorm;      //!< l1 / l2 (laprox always uses l2)
    GqaReduce gqaReduce;      //!< mean of products / kvpress product of means
    Stage2Scores stage2Scores;
    float stage1Mass;         //!< defensivekv stage-1 mass threshold, float32 like the reference's comparison
    int32_t layerBudget;      //!< r_l at the built budget: layer_budgets[budget - window]
    int32_t budgetTable;      //!< 1: r_l at a runtime budget b is layer_budgets[b - window] (PyramidKV); 0: b - window
    int32_t capacity;         //!< static per-head output size; outputs hold min(n, capacity) entries
    int32_t modelWide;        //!< 1: a model-level method over several layers (selected after the last layer by
                              //!< model_level.h; the per-layer operator refuses it)
    int64_t headCapMicros;    //!< model-level selection: head_cap_ratio in millionths (0: no cap; model_level.h)
    int32_t keptSinks;        //!< the first keptSinks valid tokens are kept before the others are ranked (kvzip's
                              //!< sink_tokens, per layer: SequenceInfo::candidateStart); 0 for every other method
};

//! Dimensions of one invocation. queries [B, H, queryLen, d_h]; keys, values [B, H_kv, n, d_h]; o_proj [hidden, H*d_h].
struct SelectShape
{
    int32_t batch;
    int32_t heads;
    int32_t kvHeads;
    int32_t n;
    int32_t queryLen;
    int32_t headDim;
    int32_t hidden;
};

//! The request's budget as the kernels see it: pointers into device memory on the GPU (host memory on the
//! host), read by every kernel, so the launch never waits for the host to learn the budget.
struct RuntimeBudget
{
    int32_t const* kvBudget;    //!< [1] the node's kv_budget input, or nullptr (= the built budget)
    int32_t const* layerBudget; //!< [1] r_l resolved from layer_budgets (only read when config.budgetTable)
};

//! PyramidKV's per-layer budgets: values[b - window] = r_l at budget b, b = window .. budget (host memory, read
//! at launch: the entries reach the device as kernel parameters).
struct BudgetTable
{
    int32_t const* values;
    int32_t count;
};

//! The effective budget b and the layer's selectable budget r_l of this call.
struct BudgetChoice
{
    int32_t budget;
    int32_t layerBudget;
};

//! b = clamp(kv_budget, minBudget, budget), or the built budget without a kv_budget input.
CKV_HD int32_t effectiveBudget(SelectConfig const& config, int32_t const* kvBudget)
{
    if (kvBudget == nullptr)
    {
        return config.budget;
    }
    int32_t const b = *kvBudget;
    return b < config.minBudget ? config.minBudget : (b > config.budget ? config.budget : b);
}

//! b and r_l: from the table (PyramidKV, resolved on the device into runtime.layerBudget) or b - window. r_l is
//! only read by the scoring stages, which run after the resolution.
CKV_HD BudgetChoice resolveBudget(SelectConfig const& config, RuntimeBudget const& runtime)
{
    if (runtime.kvBudget == nullptr)
    {
        return BudgetChoice{config.budget, config.layerBudget};
    }
    int32_t const b = effectiveBudget(config, runtime.kvBudget);
    int32_t const r = config.budgetTable && runtime.layerBudget != nullptr ? *runtime.layerBudget : b - config.window;
    return BudgetChoice{b, r > 0 ? r : 0};
}

//! Keys per tile of the window-attention kernels (the workspace holds one softmax partial per tile).
constexpr int32_t kKeyTile = 64;

CKV_HD int32_t windowLength(SelectConfig const& config, int32_t n)
{
    return config.window < n ? config.window : n;
}

CKV_HD int32_t outputCapacity(SelectConfig const& config, int32_t n)
{
    return config.capacity < n ? config.capacity : n;
}

//! What one (left-padded) sequence of the batch needs.
struct SequenceInfo
{
    int32_t length;     //!< valid tokens, clamped to [1, n]
    int32_t validStart; //!< n - length: first valid position
    int32_t budget;     //!< the effective budget b of this call
    bool compress;      //!< length > b under a policy that evicts
    int32_t olderValid; //!< valid tokens among the m = n - w older positions
    int32_t candidateStart; //!< first older position the selection ranks: validStart, or after the kept sinks
                            //!< (SelectConfig::keptSinks, at most the valid older tokens)
    int32_t r;          //!< older tokens per head the selection ranks: min(olderValid, r_l), less the kept sinks
};

CKV_HD SequenceInfo sequenceInfo(SelectConfig const& config, BudgetChoice const& choice, SelectShape const& shape,
    int32_t const* promptLengths, int32_t b)
{
    int32_t const n = shape.n;
    int32_t length = promptLengths != nullptr ? promptLengths[b] : n;
    length = length < 1 ? 1 : (length > n ? n : length);
    SequenceInfo info{};
    info.length = length;
    info.validStart = n - length;
    info.budget = choice.budget;
    info.compress = config.base != BaseMethod::kFull && length > choice.budget;
    int32_t const m = n - windowLength(config, n);
    int32_t const older = m - info.validStart;
    info.olderValid = older > 0 ? older : 0;
    int32_t const rLayer = choice.layerBudget > 0 ? choice.layerBudget : 0;
    info.r = info.olderValid < rLayer ? info.olderValid : rLayer;
    // kept sinks (criticalkv/selection/layer.py: choose_older_tokens): out of the ranked range and out of r
    int32_t const sinks = config.keptSinks < info.olderValid ? (config.keptSinks > 0 ? config.keptSinks : 0)
                                                             : info.olderValid;
    info.candidateStart = info.validStart + sinks;
    info.r = info.r > sinks ? info.r - sinks : 0;
    return info;
}

//! sequenceInfo with the budget resolved from the runtime input.
CKV_HD SequenceInfo sequenceInfo(SelectConfig const& config, RuntimeBudget const& runtime, SelectShape const& shape,
    int32_t const* promptLengths, int32_t b)
{
    return sequenceInfo(config, resolveBudget(config, runtime), shape, promptLengths, b);
}

} // namespace criticalkv
