// GENERATED from criticalkv.policy.KVPolicy and criticalkv.methods by python -m criticalkv.spec.generate; do not edit.
// Device-safe: the creator's fields (X-macro), the enums, the constants and the base methods' traits.
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
    kKeyDiff = 11,
};

//! What a base method asks of the pipeline (criticalkv.methods.base.BaseMethod's flags): the kernels, the host
//! driver and the workspace layout ask these (methods.h) instead of comparing method names.
struct MethodTraits
{
    bool scored; //!< ranks older tokens by window attention (every base but full and streamingllm)
    bool sharedAllocation; //!< the layer's H_kv * r slots are shared across its heads with a per-head floor
    bool ownL2Norms; //!< its own score needs the l2 projected-value norms (laprox)
    bool rowScores; //!< its score reads every window query's attention row, not only their mean (defensivekv)
    bool pools; //!< its attention is max-pooled over positions (pool_kernel) before it ranks
    bool externalScores; //!< it ranks by a per-entry score computed outside the layer (the scores input)
    bool keepsSinks; //!< it keeps the first sink_tokens valid tokens before ranking
    bool modelLevel; //!< its budget is shared across every layer of the model
};

#if defined(__CUDACC__)
#define CKV_TRAITS_HD __host__ __device__ __forceinline__
#else
#define CKV_TRAITS_HD inline
#endif

//! The traits of a base method: one row per base method, enum order; columns scored, sharedAllocation, ownL2Norms,
//! rowScores, pools, externalScores, keepsSinks, modelLevel.
CKV_TRAITS_HD MethodTraits methodTraits(BaseMethod base)
{
    switch (base)
    {
    case BaseMethod::kFull: return MethodTraits{false, false, false, false, true, false, false, false};
    case BaseMethod::kStreamingLLM: return MethodTraits{false, false, false, false, true, false, false, false};
    case BaseMethod::kSnapKV: return MethodTraits{true, false, false, false, true, false, false, false};
    case BaseMethod::kPyramidKV: return MethodTraits{true, false, false, false, true, false, false, false};
    case BaseMethod::kAdaKV: return MethodTraits{true, true, false, false, true, false, false, false};
    case BaseMethod::kLaProx: return MethodTraits{true, true, true, false, true, false, false, false};
    case BaseMethod::kDefensiveKV: return MethodTraits{true, true, false, true, true, false, false, false};
    case BaseMethod::kLayerDefensiveKV: return MethodTraits{true, true, false, true, true, false, false, true};
    case BaseMethod::kExpectedAttention: return MethodTraits{true, false, false, false, false, false, true, false};
    case BaseMethod::kKVzip: return MethodTraits{true, true, false, false, false, true, true, false};
    case BaseMethod::kLayerKVzip: return MethodTraits{true, true, false, false, false, true, true, true};
    case BaseMethod::kKeyDiff: return MethodTraits{true, false, false, false, false, false, false, false};
    }
    return MethodTraits{};
}

#undef CKV_TRAITS_HD

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
