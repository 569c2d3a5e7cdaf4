// GENERATED from criticalkv.policy.KVPolicy and criticalkv.methods by python -m criticalkv.spec.generate; do not edit.
// Host only: the creator's fields as a struct, registry lookups and the validation (KVPolicy's rules and
// messages, generated from the same rule objects as the Python checks).
#pragma once

#include "criticalkv/policy_fields.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace criticalkv
{

//! Every creator field with KVPolicy's defaults (STRING std::string, INT int32_t, FLOAT double, INTS vector).
struct PolicyConfig
{
    std::string name = "criticalkv";
    int32_t budget = 256;
    int32_t window = 32;
    int32_t sink_tokens = 4;
    int32_t pool_kernel = 7;
    double pyramid_beta = 20.0;
    double ada_floor = 0.2;
    std::string value_norm = "l1";
    double stage1_mass = 0.9;
    double head_cap_ratio = 0.0;
    int32_t future_positions = 512;
    int32_t kvzip_chunk = 2048;
    std::string kvzip_reread = "context";
    std::string kvzip_score = "reread";
    double alpha = 0.25;
    double epsilon = 0.0001;
    std::string gqa_reduce = "mean";
    std::string stage2_scores = "pooled";
    int32_t layer_idx = 0;
    int32_t num_layers = 1;
    int32_t capacity = 0;
    std::vector<int32_t> layer_budgets;
};

//! Names of every policy, in registry order.
inline std::vector<std::string> const& policyNames()
{
    static std::vector<std::string> const names = {"full", "streamingllm", "snapkv", "pyramidkv", "adakv", "laprox", "defensivekv", "layer-defensivekv", "expected-attention", "kvzip", "layer-kvzip", "criticalkv", "pyramid-criticalkv", "ada-criticalkv", "expected-criticalkv", "kvzip-criticalkv", "layer-kvzip-criticalkv"};
    return names;
}

//! Names of every creator field, in order.
inline std::vector<std::string> const& pluginFieldNames()
{
    static std::vector<std::string> const names = {"name", "budget", "window", "sink_tokens", "pool_kernel", "pyramid_beta", "ada_floor", "value_norm", "stage1_mass", "head_cap_ratio", "future_positions", "kvzip_chunk", "kvzip_reread", "kvzip_score", "alpha", "epsilon", "gqa_reduce", "stage2_scores", "layer_idx", "num_layers", "capacity", "layer_budgets"};
    return names;
}

//! Base method of a policy name (precondition: one of policyNames()).
inline BaseMethod baseOf(std::string const& policyName)
{
    if (policyName == "full")
        return BaseMethod::kFull;
    if (policyName == "streamingllm")
        return BaseMethod::kStreamingLLM;
    if (policyName == "snapkv")
        return BaseMethod::kSnapKV;
    if (policyName == "pyramidkv")
        return BaseMethod::kPyramidKV;
    if (policyName == "adakv")
        return BaseMethod::kAdaKV;
    if (policyName == "laprox")
        return BaseMethod::kLaProx;
    if (policyName == "defensivekv")
        return BaseMethod::kDefensiveKV;
    if (policyName == "layer-defensivekv")
        return BaseMethod::kLayerDefensiveKV;
    if (policyName == "expected-attention")
        return BaseMethod::kExpectedAttention;
    if (policyName == "kvzip")
        return BaseMethod::kKVzip;
    if (policyName == "layer-kvzip")
        return BaseMethod::kLayerKVzip;
    if (policyName == "criticalkv")
        return BaseMethod::kSnapKV;
    if (policyName == "pyramid-criticalkv")
        return BaseMethod::kPyramidKV;
    if (policyName == "ada-criticalkv")
        return BaseMethod::kAdaKV;
    if (policyName == "expected-criticalkv")
        return BaseMethod::kExpectedAttention;
    if (policyName == "kvzip-criticalkv")
        return BaseMethod::kKVzip;
    if (policyName == "layer-kvzip-criticalkv")
        return BaseMethod::kLayerKVzip;
    return BaseMethod::kFull;
}

//! Whether CriticalKV's two-stage refinement is on for a policy name.
inline bool twoStageOf(std::string const& policyName)
{
    return policyName == "criticalkv" || policyName == "pyramid-criticalkv" || policyName == "ada-criticalkv" || policyName == "expected-criticalkv" || policyName == "kvzip-criticalkv" || policyName == "layer-kvzip-criticalkv";
}

//! The exact integer value * 10^6 of a fraction with at most 6 decimals (validatePolicy checks that).
inline int64_t decimalMicros(double value)
{
    return static_cast<int64_t>(std::llround(value * static_cast<double>(kDecimalScale)));
}

//! Smallest per-request budget (input kv_budget) the node accepts (KVPolicy.min_budget): the window, and the sinks
//! when read (beside the window for a scored method that keeps them, kvzip's).
inline int32_t minRuntimeBudget(PolicyConfig const& p)
{
    if (p.name == "expected-attention" || p.name == "kvzip" || p.name == "layer-kvzip" || p.name == "expected-criticalkv" || p.name == "kvzip-criticalkv" || p.name == "layer-kvzip-criticalkv")
        return p.window + p.sink_tokens;
    return (p.name == "streamingllm" || p.name == "expected-attention" || p.name == "kvzip" || p.name == "layer-kvzip" || p.name == "expected-criticalkv" || p.name == "kvzip-criticalkv" || p.name == "layer-kvzip-criticalkv") && p.sink_tokens > p.window ? p.sink_tokens : p.window;
}

namespace detail
{

inline bool oneOf(std::string const& value, std::vector<std::string> const& choices)
{
    for (auto const& c : choices)
        if (c == value)
            return true;
    return false;
}

inline std::string joinChoices(std::vector<std::string> const& choices)
{
    std::string joined;
    for (size_t i = 0; i < choices.size(); ++i)
        joined += (i ? ", " : "") + choices[i];
    return joined;
}

//! Python's repr of a float (shortest round-trip digits, ".0" on integral values).
inline std::string formatNumber(double value)
{
    if (std::isnan(value))
        return "nan";
    if (std::isinf(value))
        return value > 0 ? "inf" : "-inf";
    char buffer[64];
    auto const printed = std::to_chars(buffer, buffer + sizeof(buffer), value);
    std::string text(buffer, printed.ptr);
    if (text.find_first_of(".e") == std::string::npos)
        text += ".0";
    return text;
}

inline std::string formatNumber(int32_t value)
{
    return std::to_string(value);
}

} // namespace detail

//! "" when the config's knobs are valid, else "field: reason" (KVPolicy.__post_init__'s rules and wording,
//! then the layer fields: num_layers, layer_idx, capacity, layer_budgets). Says nothing of who selects it.
inline std::string validateKnobs(PolicyConfig const& p)
{
    if (!detail::oneOf(p.name, policyNames()))
        return "name: unknown KV policy '" + p.name + "'; choose one of " + detail::joinChoices(policyNames());
    if (!(p.budget > 0))
        return "budget: must be a positive number of tokens, got " + std::to_string(p.budget);
    if ((p.name == "streamingllm" || p.name == "snapkv" || p.name == "pyramidkv" || p.name == "adakv" || p.name == "laprox" || p.name == "defensivekv" || p.name == "layer-defensivekv" || p.name == "expected-attention" || p.name == "kvzip" || p.name == "layer-kvzip" || p.name == "criticalkv" || p.name == "pyramid-criticalkv" || p.name == "ada-criticalkv" || p.name == "expected-criticalkv" || p.name == "kvzip-criticalkv" || p.name == "layer-kvzip-criticalkv") && p.budget < p.window)
        return "budget: " + std::to_string(p.budget) + " is smaller than the window (" + std::to_string(p.window) + "); the window is always kept, so the budget must be at least the window";
    if (p.budget > 4194304)
        return "budget: " + std::to_string(p.budget) + " exceeds the supported maximum 4194304";
    if (!(p.window > 0))
        return "window: must be a positive number of tokens, got " + std::to_string(p.window);
    if (p.window > 4194304)
        return "window: " + std::to_string(p.window) + " exceeds the supported maximum 4194304";
    if (!(p.sink_tokens >= 0))
        return "sink_tokens: must be >= 0, got " + std::to_string(p.sink_tokens);
    if ((p.name == "streamingllm" || p.name == "expected-attention" || p.name == "kvzip" || p.name == "layer-kvzip" || p.name == "expected-criticalkv" || p.name == "kvzip-criticalkv" || p.name == "layer-kvzip-criticalkv") && p.sink_tokens > p.budget)
        return "sink_tokens: " + std::to_string(p.sink_tokens) + " exceeds the budget " + std::to_string(p.budget);
    if (p.sink_tokens > 4194304)
        return "sink_tokens: " + std::to_string(p.sink_tokens) + " exceeds the supported maximum 4194304";
    if (!(p.pool_kernel > 0 && p.pool_kernel % 2 == 1))
        return "pool_kernel: must be a positive odd integer, got " + std::to_string(p.pool_kernel);
    if (p.pool_kernel > 4194304)
        return "pool_kernel: " + std::to_string(p.pool_kernel) + " exceeds the supported maximum 4194304";
    if (!std::isfinite(p.pyramid_beta))
        return "pyramid_beta: expected a finite number, got " + detail::formatNumber(p.pyramid_beta);
    if (!(p.pyramid_beta >= 1.0))
        return "pyramid_beta: must be >= 1, got " + detail::formatNumber(p.pyramid_beta);
    if (static_cast<double>(std::llround(p.pyramid_beta * 1000000.0)) / 1000000.0 != p.pyramid_beta)
        return "pyramid_beta: must have at most 6 decimals, got " + detail::formatNumber(p.pyramid_beta);
    if (!std::isfinite(p.ada_floor))
        return "ada_floor: expected a finite number, got " + detail::formatNumber(p.ada_floor);
    if (!(p.ada_floor >= 0.0 && p.ada_floor <= 1.0))
        return "ada_floor: must lie in [0, 1], got " + detail::formatNumber(p.ada_floor);
    if (static_cast<double>(std::llround(p.ada_floor * 1000000.0)) / 1000000.0 != p.ada_floor)
        return "ada_floor: must have at most 6 decimals, got " + detail::formatNumber(p.ada_floor);
    if (!detail::oneOf(p.value_norm, {CKV_CHOICES_value_norm}))
        return "value_norm: '" + p.value_norm + "' is not one of " + detail::joinChoices({CKV_CHOICES_value_norm});
    if (!std::isfinite(p.stage1_mass))
        return "stage1_mass: expected a finite number, got " + detail::formatNumber(p.stage1_mass);
    if (!(p.stage1_mass >= 0.0 && p.stage1_mass <= 1.0))
        return "stage1_mass: must lie in [0, 1], got " + detail::formatNumber(p.stage1_mass);
    if (!std::isfinite(p.head_cap_ratio))
        return "head_cap_ratio: expected a finite number, got " + detail::formatNumber(p.head_cap_ratio);
    if (!(p.head_cap_ratio == 0 || p.head_cap_ratio >= 1.0))
        return "head_cap_ratio: must be 0 (off) or >= 1, got " + detail::formatNumber(p.head_cap_ratio);
    if (static_cast<double>(std::llround(p.head_cap_ratio * 1000000.0)) / 1000000.0 != p.head_cap_ratio)
        return "head_cap_ratio: must have at most 6 decimals, got " + detail::formatNumber(p.head_cap_ratio);
    if (!(p.future_positions > 0))
        return "future_positions: must be a positive number of tokens, got " + std::to_string(p.future_positions);
    if (p.future_positions > 4194304)
        return "future_positions: " + std::to_string(p.future_positions) + " exceeds the supported maximum 4194304";
    if (!(p.kvzip_chunk > 0))
        return "kvzip_chunk: must be a positive number of tokens, got " + std::to_string(p.kvzip_chunk);
    if (p.kvzip_chunk > 4194304)
        return "kvzip_chunk: " + std::to_string(p.kvzip_chunk) + " exceeds the supported maximum 4194304";
    if (!detail::oneOf(p.kvzip_reread, {CKV_CHOICES_kvzip_reread}))
        return "kvzip_reread: '" + p.kvzip_reread + "' is not one of " + detail::joinChoices({CKV_CHOICES_kvzip_reread});
    if (!detail::oneOf(p.kvzip_score, {CKV_CHOICES_kvzip_score}))
        return "kvzip_score: '" + p.kvzip_score + "' is not one of " + detail::joinChoices({CKV_CHOICES_kvzip_score});
    if (!std::isfinite(p.alpha))
        return "alpha: expected a finite number, got " + detail::formatNumber(p.alpha);
    if (!(p.alpha >= 0.0 && p.alpha <= 1.0))
        return "alpha: must lie in [0, 1], got " + detail::formatNumber(p.alpha);
    if (static_cast<double>(std::llround(p.alpha * 1000000.0)) / 1000000.0 != p.alpha)
        return "alpha: must have at most 6 decimals, got " + detail::formatNumber(p.alpha);
    if (!std::isfinite(p.epsilon))
        return "epsilon: expected a finite number, got " + detail::formatNumber(p.epsilon);
    if (!(p.epsilon >= 0.0))
        return "epsilon: must be >= 0, got " + detail::formatNumber(p.epsilon);
    if (!detail::oneOf(p.gqa_reduce, {CKV_CHOICES_gqa_reduce}))
        return "gqa_reduce: '" + p.gqa_reduce + "' is not one of " + detail::joinChoices({CKV_CHOICES_gqa_reduce});
    if (!detail::oneOf(p.stage2_scores, {CKV_CHOICES_stage2_scores}))
        return "stage2_scores: '" + p.stage2_scores + "' is not one of " + detail::joinChoices({CKV_CHOICES_stage2_scores});
    // Layer fields.
    if (p.num_layers <= 0)
        return "num_layers: must be positive, got " + std::to_string(p.num_layers);
    if (p.layer_idx < 0 || p.layer_idx >= p.num_layers)
        return "layer_idx: " + std::to_string(p.layer_idx) + " is outside [0, num_layers=" + std::to_string(p.num_layers) + ")";
    if (p.capacity <= 0)
        return "capacity: must be a positive number of entries per head (node_capacity), got " + std::to_string(p.capacity);
    size_t const tableSize = (p.name == "streamingllm" || p.name == "snapkv" || p.name == "pyramidkv" || p.name == "adakv" || p.name == "laprox" || p.name == "defensivekv" || p.name == "layer-defensivekv" || p.name == "expected-attention" || p.name == "kvzip" || p.name == "layer-kvzip" || p.name == "criticalkv" || p.name == "pyramid-criticalkv" || p.name == "ada-criticalkv" || p.name == "expected-criticalkv" || p.name == "kvzip-criticalkv" || p.name == "layer-kvzip-criticalkv") ? static_cast<size_t>(p.budget - p.window + 1) : 0;
    if (p.layer_budgets.size() != tableSize)
        return "layer_budgets: expected " + std::to_string(tableSize) + " values (budget - window + 1), got " + std::to_string(p.layer_budgets.size());
    for (size_t i = 0; i < p.layer_budgets.size(); ++i)
        if (p.layer_budgets[i] < 0 || p.layer_budgets[i] > 2 * static_cast<int64_t>(i))
            return "layer_budgets: entry " + std::to_string(i) + " (budget window + " + std::to_string(i) + ") is "
                + std::to_string(p.layer_budgets[i]) + ", outside [0, 2 * " + std::to_string(i) + "]";
    return "";
}

//! "" when the per-layer CriticalKVSelect plugin selects the policy, else why not (BaseMethod.native, cpp_refusal).
inline std::string pluginRefusal(PolicyConfig const& p)
{
    if (p.name == "layer-defensivekv")
        return "name: layer-defensivekv shares the budget across all layers, and the CriticalKVSelect plugin selects one layer per node: its graph selects with a CriticalKVScore node per layer and one CriticalKVSelectModel node (plugins/README.md)";
    if (p.name == "expected-attention")
        return "name: expected-attention reads RoPE's rotation averaged over the next future_positions positions, an input the CriticalKVSelect plugin does not take; select it on the PyTorch path or ONNX Runtime";
    if (p.name == "layer-kvzip")
        return "name: layer-kvzip shares the budget across all layers, and the CriticalKVSelect plugin selects one layer per node: its graph selects with a CriticalKVScore node per layer and one CriticalKVSelectModel node (plugins/README.md)";
    if (p.name == "expected-criticalkv")
        return "name: expected-criticalkv reads RoPE's rotation averaged over the next future_positions positions, an input the CriticalKVSelect plugin does not take; select it on the PyTorch path or ONNX Runtime";
    if (p.name == "layer-kvzip-criticalkv")
        return "name: layer-kvzip-criticalkv shares the budget across all layers, and the CriticalKVSelect plugin selects one layer per node: its graph selects with a CriticalKVScore node per layer and one CriticalKVSelectModel node (plugins/README.md)";
    return "";
}

//! "" when the CUDA kernels and the host version select the policy through the torch ops (per layer, or over every
//! layer for a model-level method; BaseMethod.kernels), else why not.
inline std::string kernelsRefusal(PolicyConfig const& p)
{
    if (p.name == "expected-attention")
        return "name: expected-attention reads RoPE's rotation averaged over the next future_positions positions, an input the kernels do not take; select it on the PyTorch path or ONNX Runtime";
    if (p.name == "expected-criticalkv")
        return "name: expected-criticalkv reads RoPE's rotation averaged over the next future_positions positions, an input the kernels do not take; select it on the PyTorch path or ONNX Runtime";
    return "";
}

//! The plugin's validation: its refusal first, then the knobs.
inline std::string validatePolicy(PolicyConfig const& p)
{
    std::string const refusal = pluginRefusal(p);
    return refusal.empty() ? validateKnobs(p) : refusal;
}

} // namespace criticalkv
