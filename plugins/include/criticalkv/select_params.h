// Parameters of one CriticalKVSelect invocation (one attention layer), shared by the kernels, the host C++
// version and the TensorRT plugin. Plain structs: they are passed by value to CUDA kernels.
#pragma once

#include "criticalkv/common.h"

#include <cstddef>

namespace criticalkv
{

//! The policy of one layer, resolved to numbers (see policy.h: makeSelectConfig).
struct SelectConfig
{
    BaseMethod base;
    int32_t twoStage;     //!< CriticalKV stage 2 on (criticalkv, pyramid-criticalkv, ada-criticalkv)
    int32_t budget;       //!< tokens per KV head, window included; a sequence of <= budget tokens is kept whole
    int32_t window;       //!< observation window (always kept)
    int32_t poolKernel;   //!< odd max-pool kernel
    int32_t sinkTokens;   //!< streamingllm sinks
    double alpha;         //!< stage-1 fraction
    float epsilon;        //!< stage-2 score (P + epsilon) * N, added in fp32 like the reference
    double adaFloor;      //!< adakv / laprox per-head floor fraction
    ValueNorm valueNorm;  //!< l1 / l2 (laprox always uses l2)
    GqaReduce gqaReduce;  //!< mean of products / kvpress product of means
    Stage2Scores stage2Scores;
    int32_t layerBudget;  //!< r_l: selectable (older) tokens per head of this layer, PyramidKV applied
    int32_t capacity;     //!< static per-head output size; outputs hold min(n, capacity) entries
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

CKV_HD bool needsScores(SelectConfig const& config)
{
    return config.base != BaseMethod::kFull && config.base != BaseMethod::kStreamingLLM;
}

CKV_HD bool needsNorms(SelectConfig const& config)
{
    return config.base == BaseMethod::kLaProx || (needsScores(config) && config.twoStage != 0);
}

CKV_HD bool sharedAllocation(SelectConfig const& config)
{
    return config.base == BaseMethod::kAdaKV || config.base == BaseMethod::kLaProx;
}

//! Norm the stage-2 / LaProx score uses.
CKV_HD ValueNorm normKind(SelectConfig const& config)
{
    return config.base == BaseMethod::kLaProx ? ValueNorm::kL2 : config.valueNorm;
}

//! What one (left-padded) sequence of the batch needs.
struct SequenceInfo
{
    int32_t length;     //!< valid tokens, clamped to [1, n]
    int32_t validStart; //!< n - length: first valid position
    bool compress;      //!< length > budget under a policy that evicts
    int32_t olderValid; //!< valid tokens among the m = n - w older positions
    int32_t r;          //!< older tokens per head: min(olderValid, layerBudget)
};

CKV_HD SequenceInfo sequenceInfo(SelectConfig const& config, SelectShape const& shape, int32_t const* promptLengths, int32_t b)
{
    int32_t const n = shape.n;
    int32_t length = promptLengths != nullptr ? promptLengths[b] : n;
    length = length < 1 ? 1 : (length > n ? n : length);
    SequenceInfo info{};
    info.length = length;
    info.validStart = n - length;
    info.compress = config.base != BaseMethod::kFull && length > config.budget;
    int32_t const m = n - windowLength(config, n);
    int32_t const older = m - info.validStart;
    info.olderValid = older > 0 ? older : 0;
    int32_t const rLayer = config.layerBudget > 0 ? config.layerBudget : 0;
    info.r = info.olderValid < rLayer ? info.olderValid : rLayer;
    return info;
}

} // namespace criticalkv
