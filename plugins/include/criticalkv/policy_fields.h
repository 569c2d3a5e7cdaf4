// GENERATED from criticalkv.policy.KVPolicy and criticalkv.methods by python -m criticalkv.spec.generate; do not edit.
// Device-safe: X-macros, enums and constants only.
#pragma once

#include <cstdint>

//! Every field of the CriticalKVSelect plugin creator, in order: the KVPolicy knobs, then the layer
//! fields. CKV_FIELD(kind, name, default), kind STRING (kCHAR), INT (kINT32), FLOAT (kFLOAT32) or INTS
//! (kINT32 array, variable length).
#define CKV_FOR_EACH_PLUGIN_FIELD(CKV_FIELD) \
    CKV_FIELD(STRING, name, "criticalkv") \
    CKV_FIELD(INT, budget, 256) \
    CKV_FIELD(INT, window, 32) \
    CKV_FIELD(INT, sink_tokens, 4) \
    CKV_FIELD(INT, pool_kernel, 7) \
    CKV_FIELD(FLOAT, pyramid_beta, 20.0) \
    CKV_FIELD(FLOAT, ada_floor, 0.2) \
    CKV_FIELD(STRING, value_norm, "l1") \
    CKV_FIELD(FLOAT, stage1_mass, 0.9) \
    CKV_FIELD(FLOAT, head_cap_ratio, 0.0) \
    CKV_FIELD(INT, future_positions, 512) \
    CKV_FIELD(INT, kvzip_chunk, 2048) \
    CKV_FIELD(STRING, kvzip_reread, "context") \
    CKV_FIELD(STRING, kvzip_score, "reread") \
    CKV_FIELD(FLOAT, alpha, 0.25) \
    CKV_FIELD(FLOAT, epsilon, 0.0001) \
    CKV_FIELD(STRING, gqa_reduce, "mean") \
    CKV_FIELD(STRING, stage2_scores, "pooled") \
    CKV_FIELD(INT, layer_idx, 0) \
    CKV_FIELD(INT, num_layers, 1) \
    CKV_FIELD(INT, capacity, 0) \
    CKV_FIELD(INTS, layer_budgets, {})

//! CKV_POLICY(name, base method, two-stage) for every policy name.
#define CKV_FOR_EACH_POLICY(CKV_POLICY) \
    CKV_POLICY("full", kFull, 0) \
    CKV_POLICY("streamingllm", kStreamingLLM, 0) \
    CKV_POLICY("snapkv", kSnapKV, 0) \
    CKV_POLICY("pyramidkv", kPyramidKV, 0) \
    CKV_POLICY("adakv", kAdaKV, 0) \
    CKV_POLICY("laprox", kLaProx, 0) \
    CKV_POLICY("defensivekv", kDefensiveKV, 0) \
    CKV_POLICY("layer-defensivekv", kLayerDefensiveKV, 0) \
    CKV_POLICY("expected-attention", kExpectedAttention, 0) \
    CKV_POLICY("kvzip", kKVzip, 0) \
    CKV_POLICY("layer-kvzip", kLayerKVzip, 0) \
    CKV_POLICY("criticalkv", kSnapKV, 1) \
    CKV_POLICY("pyramid-criticalkv", kPyramidKV, 1) \
    CKV_POLICY("ada-criticalkv", kAdaKV, 1) \
    CKV_POLICY("expected-criticalkv", kExpectedAttention, 1) \
    CKV_POLICY("kvzip-criticalkv", kKVzip, 1) \
    CKV_POLICY("layer-kvzip-criticalkv", kLayerKVzip, 1)

//! CKV_BASE(enumerator, name, scored, shared_allocation, own_l2_norms, row_scores, pools, external_scores, sinks,
//! model_level) for every base method, enum order. scored: ranks older tokens by window attention;
//! shared_allocation: the layer's H_kv * r slots are shared across its heads with a per-head floor; own_l2_norms:
//! its own score needs the l2 projected-value norms; row_scores: its score reads every window query's attention
//! row (defensive aggregation); pools: its attention is max-pooled over positions; external_scores: it ranks by
//! a score computed outside the layer (the scores input); sinks: it keeps the first sink_tokens valid tokens
//! before ranking; model_level: its budget is shared across every layer of the model.
#define CKV_FOR_EACH_BASE(CKV_BASE) \
    CKV_BASE(kFull, "full", 0, 0, 0, 0, 1, 0, 0, 0) \
    CKV_BASE(kStreamingLLM, "streamingllm", 0, 0, 0, 0, 1, 0, 0, 0) \
    CKV_BASE(kSnapKV, "snapkv", 1, 0, 0, 0, 1, 0, 0, 0) \
    CKV_BASE(kPyramidKV, "pyramidkv", 1, 0, 0, 0, 1, 0, 0, 0) \
    CKV_BASE(kAdaKV, "adakv", 1, 1, 0, 0, 1, 0, 0, 0) \
    CKV_BASE(kLaProx, "laprox", 1, 1, 1, 0, 1, 0, 0, 0) \
    CKV_BASE(kDefensiveKV, "defensivekv", 1, 1, 0, 1, 1, 0, 0, 0) \
    CKV_BASE(kLayerDefensiveKV, "layer-defensivekv", 1, 1, 0, 1, 1, 0, 0, 1) \
    CKV_BASE(kExpectedAttention, "expected-attention", 1, 0, 0, 0, 0, 0, 1, 0) \
    CKV_BASE(kKVzip, "kvzip", 1, 1, 0, 0, 0, 1, 1, 0) \
    CKV_BASE(kLayerKVzip, "layer-kvzip", 1, 1, 0, 0, 0, 1, 1, 1)

#define CKV_CHOICES_value_norm "l1", "l2"
#define CKV_CHOICES_kvzip_reread "context", "chunk"
#define CKV_CHOICES_kvzip_score "reread", "surrogate"
#define CKV_CHOICES_gqa_reduce "mean", "kvpress"
#define CKV_CHOICES_stage2_scores "pooled", "raw"

namespace criticalkv
{

//! Budget-allocation base method of a policy (criticalkv.methods.BASE_METHODS).
enum class BaseMethod : int32_t
{
    kFull = 0,
    kStreamingLLM = 1,
    kSnapKV = 2,
    kPyramidKV = 3,
    kAdaKV = 4,
    kLaProx = 5,
    kDefensiveKV = 6,
    kLayerDefensiveKV = 7,
    kExpectedAttention = 8,
    kKVzip = 9,
    kLayerKVzip = 10,
};

//! KVPolicy.value_norm.
enum class ValueNorm : int32_t
{
    kL1 = 0,
    kL2 = 1,
};

//! KVPolicy.kvzip_reread.
enum class KvzipReread : int32_t
{
    kContext = 0,
    kChunk = 1,
};

//! KVPolicy.kvzip_score.
enum class KvzipScore : int32_t
{
    kReread = 0,
    kSurrogate = 1,
};

//! KVPolicy.gqa_reduce.
enum class GqaReduce : int32_t
{
    kMean = 0,
    kKvpress = 1,
};

//! KVPolicy.stage2_scores.
enum class Stage2Scores : int32_t
{
    kPooled = 0,
    kRaw = 1,
};

//! Fractions (alpha, ada_floor, pyramid_beta) are exact decimals with at most 6 decimals: value = micros / kDecimalScale.
constexpr int64_t kDecimalScale = 1000000;
//! Largest token count a knob may take (budget, window, pool_kernel, sink_tokens).
constexpr int32_t kMaxTokens = 4194304;

} // namespace criticalkv
