// GENERATED from criticalkv.policy.KVPolicy and criticalkv.methods by python -m criticalkv.spec.generate; do not edit.
// Host only. A policy is a row of the registry table kPolicyMethods (criticalkv.methods.METHODS): its base method
// (whose traits the kernels read: methodTraits, policy_fields.h), whether CriticalKV's two stages refine it, what
// its budget floor reads, why the plugin or the kernels refuse it, and the validation of its knobs struct. Each
// knobs dataclass of a method is a struct here (SnapKVKnobs: its knobs with their defaults, of(), validate()); a
// knob several methods read has one check (checkPoolKernel), as it is one Knob in Python. The validation, the
// refusals, minRuntimeBudget and baseOf find the policy's row once (findMethod) and read it: nothing here names a
// policy. PolicyConfig stays the creator's fields by name (every knob of every method: the ONNX node's
// attributes), which the plugin and the ops parse (host/policy.h) and the host driver reads. The messages are
// KVPolicy's, generated from the same rule objects as the Python checks (criticalkv.spec.rules).
#pragma once

#include "criticalkv/policy_fields.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <initializer_list>
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

//! The exact integer value * 10^6 of a fraction with at most 6 decimals (validatePolicy checks that).
inline int64_t decimalMicros(double value)
{
    return static_cast<int64_t>(std::llround(value * static_cast<double>(kDecimalScale)));
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

//! The first error of checks made in order ("": none).
inline std::string firstError(std::initializer_list<std::string> errors)
{
    for (auto const& error : errors)
        if (!error.empty())
            return error;
    return "";
}

} // namespace detail

// ---- One check per knob (KVPolicy's rules and wording).

//! sink_tokens, read by streamingllm, expected-attention, kvzip, layer-kvzip, expected-criticalkv, kvzip-criticalkv,
//! layer-kvzip-criticalkv.
//! "" or "sink_tokens: reason": every rule when the policy's method reads it (methodReads), else those that hold for
//! every policy.
inline std::string checkSinkTokens(int32_t value, int32_t budget, int32_t /*window*/, bool methodReads)
{
    if (!(value >= 0))
        return "sink_tokens: must be >= 0, got " + std::to_string(value);
    if (methodReads && value > budget)
        return "sink_tokens: " + std::to_string(value) + " exceeds the budget " + std::to_string(budget);
    if (value > 4194304)
        return "sink_tokens: " + std::to_string(value) + " exceeds the supported maximum 4194304";
    return "";
}

//! pool_kernel, read by snapkv, pyramidkv, adakv, laprox, defensivekv, layer-defensivekv, criticalkv,
//! pyramid-criticalkv, ada-criticalkv.
//! "" or "pool_kernel: reason": every rule when the policy's method reads it (methodReads), else those that hold for
//! every policy.
inline std::string checkPoolKernel(int32_t value, int32_t /*budget*/, int32_t /*window*/, bool /*methodReads*/)
{
    if (!(value > 0 && value % 2 == 1))
        return "pool_kernel: must be a positive odd integer, got " + std::to_string(value);
    if (value > 4194304)
        return "pool_kernel: " + std::to_string(value) + " exceeds the supported maximum 4194304";
    return "";
}

//! pyramid_beta, read by pyramidkv, pyramid-criticalkv.
//! "" or "pyramid_beta: reason": its type (choices, finiteness), which KVPolicy checks first.
inline std::string checkPyramidBetaType(double value)
{
    if (!std::isfinite(value))
        return "pyramid_beta: expected a finite number, got " + detail::formatNumber(value);
    return "";
}

//! "" or "pyramid_beta: reason": every rule when the policy's method reads it (methodReads), else those that hold for
//! every policy.
inline std::string checkPyramidBeta(double value, int32_t /*budget*/, int32_t /*window*/, bool /*methodReads*/)
{
    if (!(value >= 1.0))
        return "pyramid_beta: must be >= 1, got " + detail::formatNumber(value);
    if (static_cast<double>(std::llround(value * 1000000.0)) / 1000000.0 != value)
        return "pyramid_beta: must have at most 6 decimals, got " + detail::formatNumber(value);
    return "";
}

//! ada_floor, read by adakv, laprox, defensivekv, layer-defensivekv, kvzip, layer-kvzip, ada-criticalkv,
//! kvzip-criticalkv, layer-kvzip-criticalkv.
//! "" or "ada_floor: reason": its type (choices, finiteness), which KVPolicy checks first.
inline std::string checkAdaFloorType(double value)
{
    if (!std::isfinite(value))
        return "ada_floor: expected a finite number, got " + detail::formatNumber(value);
    return "";
}

//! "" or "ada_floor: reason": every rule when the policy's method reads it (methodReads), else those that hold for
//! every policy.
inline std::string checkAdaFloor(double value, int32_t /*budget*/, int32_t /*window*/, bool /*methodReads*/)
{
    if (!(value >= 0.0 && value <= 1.0))
        return "ada_floor: must lie in [0, 1], got " + detail::formatNumber(value);
    if (static_cast<double>(std::llround(value * 1000000.0)) / 1000000.0 != value)
        return "ada_floor: must have at most 6 decimals, got " + detail::formatNumber(value);
    return "";
}

//! value_norm, read by defensivekv, layer-defensivekv, criticalkv, pyramid-criticalkv, ada-criticalkv,
//! expected-criticalkv, kvzip-criticalkv, layer-kvzip-criticalkv.
//! "" or "value_norm: reason": its type (choices, finiteness), which KVPolicy checks first.
inline std::string checkValueNormType(std::string const& value)
{
    if (!detail::oneOf(value, {CKV_CHOICES_value_norm}))
        return "value_norm: '" + value + "' is not one of " + detail::joinChoices({CKV_CHOICES_value_norm});
    return "";
}

//! stage1_mass, read by defensivekv, layer-defensivekv.
//! "" or "stage1_mass: reason": its type (choices, finiteness), which KVPolicy checks first.
inline std::string checkStage1MassType(double value)
{
    if (!std::isfinite(value))
        return "stage1_mass: expected a finite number, got " + detail::formatNumber(value);
    return "";
}

//! "" or "stage1_mass: reason": every rule when the policy's method reads it (methodReads), else those that hold for
//! every policy.
inline std::string checkStage1Mass(double value, int32_t /*budget*/, int32_t /*window*/, bool /*methodReads*/)
{
    if (!(value >= 0.0 && value <= 1.0))
        return "stage1_mass: must lie in [0, 1], got " + detail::formatNumber(value);
    return "";
}

//! head_cap_ratio, read by layer-defensivekv, layer-kvzip, layer-kvzip-criticalkv.
//! "" or "head_cap_ratio: reason": its type (choices, finiteness), which KVPolicy checks first.
inline std::string checkHeadCapRatioType(double value)
{
    if (!std::isfinite(value))
        return "head_cap_ratio: expected a finite number, got " + detail::formatNumber(value);
    return "";
}

//! "" or "head_cap_ratio: reason": every rule when the policy's method reads it (methodReads), else those that hold for
//! every policy.
inline std::string checkHeadCapRatio(double value, int32_t /*budget*/, int32_t /*window*/, bool /*methodReads*/)
{
    if (!(value == 0 || value >= 1.0))
        return "head_cap_ratio: must be 0 (off) or >= 1, got " + detail::formatNumber(value);
    if (static_cast<double>(std::llround(value * 1000000.0)) / 1000000.0 != value)
        return "head_cap_ratio: must have at most 6 decimals, got " + detail::formatNumber(value);
    return "";
}

//! future_positions, read by expected-attention, expected-criticalkv.
//! "" or "future_positions: reason": every rule when the policy's method reads it (methodReads), else those that hold
//! for every policy.
inline std::string checkFuturePositions(int32_t value, int32_t /*budget*/, int32_t /*window*/, bool /*methodReads*/)
{
    if (!(value > 0))
        return "future_positions: must be a positive number of tokens, got " + std::to_string(value);
    if (value > 4194304)
        return "future_positions: " + std::to_string(value) + " exceeds the supported maximum 4194304";
    return "";
}

//! kvzip_chunk, read by kvzip, layer-kvzip, kvzip-criticalkv, layer-kvzip-criticalkv.
//! "" or "kvzip_chunk: reason": every rule when the policy's method reads it (methodReads), else those that hold for
//! every policy.
inline std::string checkKvzipChunk(int32_t value, int32_t /*budget*/, int32_t /*window*/, bool /*methodReads*/)
{
    if (!(value > 0))
        return "kvzip_chunk: must be a positive number of tokens, got " + std::to_string(value);
    if (value > 4194304)
        return "kvzip_chunk: " + std::to_string(value) + " exceeds the supported maximum 4194304";
    return "";
}

//! kvzip_reread, read by kvzip, layer-kvzip, kvzip-criticalkv, layer-kvzip-criticalkv.
//! "" or "kvzip_reread: reason": its type (choices, finiteness), which KVPolicy checks first.
inline std::string checkKvzipRereadType(std::string const& value)
{
    if (!detail::oneOf(value, {CKV_CHOICES_kvzip_reread}))
        return "kvzip_reread: '" + value + "' is not one of " + detail::joinChoices({CKV_CHOICES_kvzip_reread});
    return "";
}

//! kvzip_score, read by kvzip, layer-kvzip, kvzip-criticalkv, layer-kvzip-criticalkv.
//! "" or "kvzip_score: reason": its type (choices, finiteness), which KVPolicy checks first.
inline std::string checkKvzipScoreType(std::string const& value)
{
    if (!detail::oneOf(value, {CKV_CHOICES_kvzip_score}))
        return "kvzip_score: '" + value + "' is not one of " + detail::joinChoices({CKV_CHOICES_kvzip_score});
    return "";
}

//! alpha, read by criticalkv, pyramid-criticalkv, ada-criticalkv, expected-criticalkv, kvzip-criticalkv,
//! layer-kvzip-criticalkv.
//! "" or "alpha: reason": its type (choices, finiteness), which KVPolicy checks first.
inline std::string checkAlphaType(double value)
{
    if (!std::isfinite(value))
        return "alpha: expected a finite number, got " + detail::formatNumber(value);
    return "";
}

//! "" or "alpha: reason": every rule when the policy's method reads it (methodReads), else those that hold for every
//! policy.
inline std::string checkAlpha(double value, int32_t /*budget*/, int32_t /*window*/, bool /*methodReads*/)
{
    if (!(value >= 0.0 && value <= 1.0))
        return "alpha: must lie in [0, 1], got " + detail::formatNumber(value);
    if (static_cast<double>(std::llround(value * 1000000.0)) / 1000000.0 != value)
        return "alpha: must have at most 6 decimals, got " + detail::formatNumber(value);
    return "";
}

//! epsilon, read by criticalkv, pyramid-criticalkv, ada-criticalkv, expected-criticalkv, kvzip-criticalkv,
//! layer-kvzip-criticalkv.
//! "" or "epsilon: reason": its type (choices, finiteness), which KVPolicy checks first.
inline std::string checkEpsilonType(double value)
{
    if (!std::isfinite(value))
        return "epsilon: expected a finite number, got " + detail::formatNumber(value);
    return "";
}

//! "" or "epsilon: reason": every rule when the policy's method reads it (methodReads), else those that hold for every
//! policy.
inline std::string checkEpsilon(double value, int32_t /*budget*/, int32_t /*window*/, bool /*methodReads*/)
{
    if (!(value >= 0.0))
        return "epsilon: must be >= 0, got " + detail::formatNumber(value);
    return "";
}

//! gqa_reduce, read by criticalkv, pyramid-criticalkv, ada-criticalkv, expected-criticalkv, kvzip-criticalkv,
//! layer-kvzip-criticalkv.
//! "" or "gqa_reduce: reason": its type (choices, finiteness), which KVPolicy checks first.
inline std::string checkGqaReduceType(std::string const& value)
{
    if (!detail::oneOf(value, {CKV_CHOICES_gqa_reduce}))
        return "gqa_reduce: '" + value + "' is not one of " + detail::joinChoices({CKV_CHOICES_gqa_reduce});
    return "";
}

//! stage2_scores, read by criticalkv, pyramid-criticalkv, ada-criticalkv, expected-criticalkv, kvzip-criticalkv,
//! layer-kvzip-criticalkv.
//! "" or "stage2_scores: reason": its type (choices, finiteness), which KVPolicy checks first.
inline std::string checkStage2ScoresType(std::string const& value)
{
    if (!detail::oneOf(value, {CKV_CHOICES_stage2_scores}))
        return "stage2_scores: '" + value + "' is not one of " + detail::joinChoices({CKV_CHOICES_stage2_scores});
    return "";
}

// ---- One struct per knobs dataclass of a method (criticalkv.methods.knobs): its knobs with their defaults;
// of(p): their values among a creator's fields; validateTypes(): "" or "knob: reason", its knobs' types;
// validate(budget, window): every rule of its knobs (budget and window: the policy's, which some rules compare
// with). Both in declaration order, KVPolicy's.

//! criticalkv.methods.knobs.Knobs, read by full, keydiff: no knobs.
struct Knobs
{
    static Knobs of(PolicyConfig const&)
    {
        return {};
    }

    std::string validateTypes() const
    {
        return "";
    }

    std::string validate(int32_t, int32_t) const
    {
        return "";
    }
};

//! criticalkv.methods.streamingllm.StreamingLLMKnobs, read by streamingllm: its knobs with their defaults.
struct StreamingLLMKnobs
{
    int32_t sink_tokens = 4;

    static StreamingLLMKnobs of(PolicyConfig const& p)
    {
        return {p.sink_tokens};
    }

    std::string validateTypes() const
    {
        return "";
    }

    std::string validate(int32_t budget, int32_t window) const
    {
        return detail::firstError({
            checkSinkTokens(sink_tokens, budget, window, true),
        });
    }
};

//! criticalkv.methods.snapkv.SnapKVKnobs, read by snapkv, criticalkv: its knobs with their defaults.
struct SnapKVKnobs
{
    int32_t pool_kernel = 7;

    static SnapKVKnobs of(PolicyConfig const& p)
    {
        return {p.pool_kernel};
    }

    std::string validateTypes() const
    {
        return "";
    }

    std::string validate(int32_t budget, int32_t window) const
    {
        return detail::firstError({
            checkPoolKernel(pool_kernel, budget, window, true),
        });
    }
};

//! criticalkv.methods.pyramidkv.PyramidKVKnobs, read by pyramidkv, pyramid-criticalkv: its knobs with their defaults.
struct PyramidKVKnobs
{
    int32_t pool_kernel = 7;
    double pyramid_beta = 20.0;

    static PyramidKVKnobs of(PolicyConfig const& p)
    {
        return {p.pool_kernel, p.pyramid_beta};
    }

    std::string validateTypes() const
    {
        return detail::firstError({
            checkPyramidBetaType(pyramid_beta),
        });
    }

    std::string validate(int32_t budget, int32_t window) const
    {
        return detail::firstError({
            checkPoolKernel(pool_kernel, budget, window, true),
            checkPyramidBeta(pyramid_beta, budget, window, true),
        });
    }
};

//! criticalkv.methods.adakv.AdaKVKnobs, read by adakv, laprox, ada-criticalkv: its knobs with their defaults.
struct AdaKVKnobs
{
    int32_t pool_kernel = 7;
    double ada_floor = 0.2;

    static AdaKVKnobs of(PolicyConfig const& p)
    {
        return {p.pool_kernel, p.ada_floor};
    }

    std::string validateTypes() const
    {
        return detail::firstError({
            checkAdaFloorType(ada_floor),
        });
    }

    std::string validate(int32_t budget, int32_t window) const
    {
        return detail::firstError({
            checkPoolKernel(pool_kernel, budget, window, true),
            checkAdaFloor(ada_floor, budget, window, true),
        });
    }
};

//! criticalkv.methods.defensivekv.DefensiveKVKnobs, read by defensivekv: its knobs with their defaults.
struct DefensiveKVKnobs
{
    int32_t pool_kernel = 7;
    double ada_floor = 0.2;
    std::string value_norm = "l1";
    double stage1_mass = 0.9;

    static DefensiveKVKnobs of(PolicyConfig const& p)
    {
        return {p.pool_kernel, p.ada_floor, p.value_norm, p.stage1_mass};
    }

    std::string validateTypes() const
    {
        return detail::firstError({
            checkAdaFloorType(ada_floor),
            checkValueNormType(value_norm),
            checkStage1MassType(stage1_mass),
        });
    }

    std::string validate(int32_t budget, int32_t window) const
    {
        return detail::firstError({
            checkPoolKernel(pool_kernel, budget, window, true),
            checkAdaFloor(ada_floor, budget, window, true),
            checkStage1Mass(stage1_mass, budget, window, true),
        });
    }
};

//! criticalkv.methods.defensivekv.LayerDefensiveKVKnobs, read by layer-defensivekv: its knobs with their defaults.
struct LayerDefensiveKVKnobs
{
    int32_t pool_kernel = 7;
    double ada_floor = 0.2;
    std::string value_norm = "l1";
    double stage1_mass = 0.9;
    double head_cap_ratio = 0.0;

    static LayerDefensiveKVKnobs of(PolicyConfig const& p)
    {
        return {p.pool_kernel, p.ada_floor, p.value_norm, p.stage1_mass, p.head_cap_ratio};
    }

    std::string validateTypes() const
    {
        return detail::firstError({
            checkAdaFloorType(ada_floor),
            checkValueNormType(value_norm),
            checkStage1MassType(stage1_mass),
            checkHeadCapRatioType(head_cap_ratio),
        });
    }

    std::string validate(int32_t budget, int32_t window) const
    {
        return detail::firstError({
            checkPoolKernel(pool_kernel, budget, window, true),
            checkAdaFloor(ada_floor, budget, window, true),
            checkStage1Mass(stage1_mass, budget, window, true),
            checkHeadCapRatio(head_cap_ratio, budget, window, true),
        });
    }
};

//! criticalkv.methods.expected_attention.ExpectedAttentionKnobs, read by expected-attention, expected-criticalkv: its
//! knobs with their defaults.
struct ExpectedAttentionKnobs
{
    int32_t sink_tokens = 4;
    int32_t future_positions = 512;

    static ExpectedAttentionKnobs of(PolicyConfig const& p)
    {
        return {p.sink_tokens, p.future_positions};
    }

    std::string validateTypes() const
    {
        return "";
    }

    std::string validate(int32_t budget, int32_t window) const
    {
        return detail::firstError({
            checkSinkTokens(sink_tokens, budget, window, true),
            checkFuturePositions(future_positions, budget, window, true),
        });
    }
};

//! criticalkv.methods.kvzip.KVzipKnobs, read by kvzip, kvzip-criticalkv: its knobs with their defaults.
struct KVzipKnobs
{
    double ada_floor = 0.2;
    int32_t sink_tokens = 4;
    int32_t kvzip_chunk = 2048;
    std::string kvzip_reread = "context";
    std::string kvzip_score = "reread";

    static KVzipKnobs of(PolicyConfig const& p)
    {
        return {p.ada_floor, p.sink_tokens, p.kvzip_chunk, p.kvzip_reread, p.kvzip_score};
    }

    std::string validateTypes() const
    {
        return detail::firstError({
            checkAdaFloorType(ada_floor),
            checkKvzipRereadType(kvzip_reread),
            checkKvzipScoreType(kvzip_score),
        });
    }

    std::string validate(int32_t budget, int32_t window) const
    {
        return detail::firstError({
            checkAdaFloor(ada_floor, budget, window, true),
            checkSinkTokens(sink_tokens, budget, window, true),
            checkKvzipChunk(kvzip_chunk, budget, window, true),
        });
    }
};

//! criticalkv.methods.kvzip.LayerKVzipKnobs, read by layer-kvzip, layer-kvzip-criticalkv: its knobs with their
//! defaults.
struct LayerKVzipKnobs
{
    double ada_floor = 0.2;
    int32_t sink_tokens = 4;
    int32_t kvzip_chunk = 2048;
    std::string kvzip_reread = "context";
    std::string kvzip_score = "reread";
    double head_cap_ratio = 0.0;

    static LayerKVzipKnobs of(PolicyConfig const& p)
    {
        return {p.ada_floor, p.sink_tokens, p.kvzip_chunk, p.kvzip_reread, p.kvzip_score, p.head_cap_ratio};
    }

    std::string validateTypes() const
    {
        return detail::firstError({
            checkAdaFloorType(ada_floor),
            checkKvzipRereadType(kvzip_reread),
            checkKvzipScoreType(kvzip_score),
            checkHeadCapRatioType(head_cap_ratio),
        });
    }

    std::string validate(int32_t budget, int32_t window) const
    {
        return detail::firstError({
            checkAdaFloor(ada_floor, budget, window, true),
            checkSinkTokens(sink_tokens, budget, window, true),
            checkKvzipChunk(kvzip_chunk, budget, window, true),
            checkHeadCapRatio(head_cap_ratio, budget, window, true),
        });
    }
};

//! criticalkv.methods.two_stage.TwoStageKnobs, read by criticalkv, pyramid-criticalkv, ada-criticalkv,
//! expected-criticalkv, kvzip-criticalkv, layer-kvzip-criticalkv: its knobs with their defaults.
struct TwoStageKnobs
{
    double alpha = 0.25;
    double epsilon = 0.0001;
    std::string value_norm = "l1";
    std::string gqa_reduce = "mean";
    std::string stage2_scores = "pooled";

    static TwoStageKnobs of(PolicyConfig const& p)
    {
        return {p.alpha, p.epsilon, p.value_norm, p.gqa_reduce, p.stage2_scores};
    }

    std::string validateTypes() const
    {
        return detail::firstError({
            checkAlphaType(alpha),
            checkEpsilonType(epsilon),
            checkValueNormType(value_norm),
            checkGqaReduceType(gqa_reduce),
            checkStage2ScoresType(stage2_scores),
        });
    }

    std::string validate(int32_t budget, int32_t window) const
    {
        return detail::firstError({
            checkAlpha(alpha, budget, window, true),
            checkEpsilon(epsilon, budget, window, true),
        });
    }
};

//! A refined policy's knobs: its base method's, then its refinement's (criticalkv.methods.knobs.combined; a knob
//! both read is held, and checked, in each).
template <class Base, class Refine>
struct PolicyKnobs
{
    Base base;
    Refine refine;

    static PolicyKnobs of(PolicyConfig const& p)
    {
        return PolicyKnobs{Base::of(p), Refine::of(p)};
    }

    std::string validateTypes() const
    {
        std::string const error = base.validateTypes();
        return error.empty() ? refine.validateTypes() : error;
    }

    std::string validate(int32_t budget, int32_t window) const
    {
        std::string const error = base.validate(budget, window);
        return error.empty() ? refine.validate(budget, window) : error;
    }
};

using CriticalkvKnobs = PolicyKnobs<SnapKVKnobs, TwoStageKnobs>; //!< criticalkv
using PyramidCriticalkvKnobs = PolicyKnobs<PyramidKVKnobs, TwoStageKnobs>; //!< pyramid-criticalkv
using AdaCriticalkvKnobs = PolicyKnobs<AdaKVKnobs, TwoStageKnobs>; //!< ada-criticalkv
using ExpectedCriticalkvKnobs = PolicyKnobs<ExpectedAttentionKnobs, TwoStageKnobs>; //!< expected-criticalkv
using KvzipCriticalkvKnobs = PolicyKnobs<KVzipKnobs, TwoStageKnobs>; //!< kvzip-criticalkv
using LayerKvzipCriticalkvKnobs = PolicyKnobs<LayerKVzipKnobs, TwoStageKnobs>; //!< layer-kvzip-criticalkv

//! What of a policy's knobs is checked: their types (choices, finiteness: KVPolicy checks them before any rule) or
//! their rules.
enum class KnobCheck : int32_t
{
    kTypes = 0,
    kRules = 1,
};

//! The validation of a policy's knobs among a creator's fields (a registry row's checkKnobs).
template <class MethodKnobs>
inline std::string checkKnobsOf(PolicyConfig const& p, KnobCheck what)
{
    MethodKnobs const knobs = MethodKnobs::of(p);
    return what == KnobCheck::kTypes ? knobs.validateTypes() : knobs.validate(p.budget, p.window);
}

// ---- The registry.

//! A policy's method: one row of the registry (criticalkv.methods.METHODS).
struct PolicyMethod
{
    char const* name;           //!< the policy's name
    BaseMethod base;            //!< its base method (what it asks of the pipeline: methodTraits(base))
    bool twoStage;              //!< CriticalKV's two-stage refinement is on
    bool evicts;                //!< false for full (every entry kept: no budget table)
    bool readsSinkTokens;       //!< its budget is at least sink_tokens (KVPolicy.min_budget)
    bool sinksBesideWindow;     //!< it keeps its first sink_tokens beside the window (BaseMethod.sinks)
    char const* pluginRefusal;  //!< why the per-layer CriticalKVSelect plugin refuses it; "": it selects it
    char const* kernelsRefusal; //!< why the kernels and the host version refuse it; "": they select it
    std::string (*checkKnobs)(PolicyConfig const&, KnobCheck); //!< checkKnobsOf its knobs struct
};

//! Every policy, in registry order. Columns: name, base, twoStage, evicts, readsSinkTokens, sinksBesideWindow,
//! pluginRefusal, kernelsRefusal, checkKnobs.
inline PolicyMethod const kPolicyMethods[] = {
    {"full", BaseMethod::kFull, false, false, false, false, "", "", &checkKnobsOf<Knobs>},
    {"streamingllm", BaseMethod::kStreamingLLM, false, true, true, false, "", "", &checkKnobsOf<StreamingLLMKnobs>},
    {"snapkv", BaseMethod::kSnapKV, false, true, false, false, "", "", &checkKnobsOf<SnapKVKnobs>},
    {"pyramidkv", BaseMethod::kPyramidKV, false, true, false, false, "", "", &checkKnobsOf<PyramidKVKnobs>},
    {"adakv", BaseMethod::kAdaKV, false, true, false, false, "", "", &checkKnobsOf<AdaKVKnobs>},
    {"laprox", BaseMethod::kLaProx, false, true, false, false, "", "", &checkKnobsOf<AdaKVKnobs>},
    {"defensivekv", BaseMethod::kDefensiveKV, false, true, false, false, "", "", &checkKnobsOf<DefensiveKVKnobs>},
    {"layer-defensivekv", BaseMethod::kLayerDefensiveKV, false, true, false, false,
        "shares the budget across all layers, and the CriticalKVSelect plugin selects one layer per node: its graph selects with a CriticalKVScore node per layer and one CriticalKVSelectModel node (plugins/README.md)",
        "", &checkKnobsOf<LayerDefensiveKVKnobs>},
    {"expected-attention", BaseMethod::kExpectedAttention, false, true, true, true,
        "reads RoPE's rotation averaged over the next future_positions positions, an input the CriticalKVSelect plugin does not take; select it on the PyTorch path or ONNX Runtime",
        "reads RoPE's rotation averaged over the next future_positions positions, an input the kernels do not take; select it on the PyTorch path or ONNX Runtime", &checkKnobsOf<ExpectedAttentionKnobs>},
    {"kvzip", BaseMethod::kKVzip, false, true, true, true, "", "", &checkKnobsOf<KVzipKnobs>},
    {"layer-kvzip", BaseMethod::kLayerKVzip, false, true, true, true,
        "shares the budget across all layers, and the CriticalKVSelect plugin selects one layer per node: its graph selects with a CriticalKVScore node per layer and one CriticalKVSelectModel node (plugins/README.md)",
        "", &checkKnobsOf<LayerKVzipKnobs>},
    {"keydiff", BaseMethod::kKeyDiff, false, true, false, false, "", "", &checkKnobsOf<Knobs>},
    {"criticalkv", BaseMethod::kSnapKV, true, true, false, false, "", "", &checkKnobsOf<CriticalkvKnobs>},
    {"pyramid-criticalkv", BaseMethod::kPyramidKV, true, true, false, false, "", "", &checkKnobsOf<PyramidCriticalkvKnobs>},
    {"ada-criticalkv", BaseMethod::kAdaKV, true, true, false, false, "", "", &checkKnobsOf<AdaCriticalkvKnobs>},
    {"expected-criticalkv", BaseMethod::kExpectedAttention, true, true, true, true,
        "reads RoPE's rotation averaged over the next future_positions positions, an input the CriticalKVSelect plugin does not take; select it on the PyTorch path or ONNX Runtime",
        "reads RoPE's rotation averaged over the next future_positions positions, an input the kernels do not take; select it on the PyTorch path or ONNX Runtime", &checkKnobsOf<ExpectedCriticalkvKnobs>},
    {"kvzip-criticalkv", BaseMethod::kKVzip, true, true, true, true, "", "", &checkKnobsOf<KvzipCriticalkvKnobs>},
    {"layer-kvzip-criticalkv", BaseMethod::kLayerKVzip, true, true, true, true,
        "shares the budget across all layers, and the CriticalKVSelect plugin selects one layer per node: its graph selects with a CriticalKVScore node per layer and one CriticalKVSelectModel node (plugins/README.md)",
        "", &checkKnobsOf<LayerKvzipCriticalkvKnobs>},
};

//! The registry row of a policy name; nullptr for an unknown name.
inline PolicyMethod const* findMethod(std::string const& policyName)
{
    for (auto const& method : kPolicyMethods)
        if (policyName == method.name)
            return &method;
    return nullptr;
}

//! Names of every policy, in registry order.
inline std::vector<std::string> const& policyNames()
{
    static std::vector<std::string> const names = [] {
        std::vector<std::string> out;
        for (auto const& method : kPolicyMethods)
            out.emplace_back(method.name);
        return out;
    }();
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
    PolicyMethod const* method = findMethod(policyName);
    return method != nullptr ? method->base : BaseMethod::kFull;
}

//! Whether CriticalKV's two-stage refinement is on for a policy name.
inline bool twoStageOf(std::string const& policyName)
{
    PolicyMethod const* method = findMethod(policyName);
    return method != nullptr && method->twoStage;
}

//! Smallest per-request budget (input kv_budget) the node accepts (KVPolicy.min_budget): the window, and the sinks
//! when read (beside the window for a scored method that keeps them, kvzip's).
inline int32_t minRuntimeBudget(PolicyConfig const& p)
{
    PolicyMethod const* method = findMethod(p.name);
    if (method != nullptr && method->sinksBesideWindow)
        return p.window + p.sink_tokens;
    return method != nullptr && method->readsSinkTokens && p.sink_tokens > p.window ? p.sink_tokens : p.window;
}

//! "" when the config's knobs are valid, else "field: reason": KVPolicy's rules and wording, in its order (the
//! name, the types of the knobs the method reads, the rules of budget, window and those knobs, then every other
//! knob's type and the rules that hold for every policy), then the layer fields (num_layers, layer_idx, capacity,
//! layer_budgets). Says nothing of who selects it.
inline std::string validateKnobs(PolicyConfig const& p)
{
    PolicyMethod const* method = findMethod(p.name);
    if (method == nullptr)
        return "name: unknown KV policy '" + p.name + "'; choose one of " + detail::joinChoices(policyNames());
    // KVPolicy's order: the types of the knobs the policy's method reads (its knobs struct, through its row),
    // budget's and window's rules, the method's knobs' rules, then every other knob.
    std::string error = method->checkKnobs(p, KnobCheck::kTypes);
    if (!error.empty())
        return error;
    if (!(p.budget > 0))
        return "budget: must be a positive number of tokens, got " + std::to_string(p.budget);
    if (method->evicts && p.budget < p.window)
        return "budget: " + std::to_string(p.budget) + " is smaller than the window (" + std::to_string(p.window) + "); the window is always kept, so the budget must be at least the window";
    if (p.budget > 4194304)
        return "budget: " + std::to_string(p.budget) + " exceeds the supported maximum 4194304";
    if (!(p.window > 0))
        return "window: must be a positive number of tokens, got " + std::to_string(p.window);
    if (p.window > 4194304)
        return "window: " + std::to_string(p.window) + " exceeds the supported maximum 4194304";
    error = method->checkKnobs(p, KnobCheck::kRules);
    if (!error.empty())
        return error;
    // Every knob, read or not: one the method does not read holds its type and the rules that hold for every
    // policy (KVPolicy checks another method's knob given to it against those, then drops it); those the method
    // reads passed them above.
    error = detail::firstError({
        checkSinkTokens(p.sink_tokens, p.budget, p.window, false),
        checkPoolKernel(p.pool_kernel, p.budget, p.window, false),
        checkPyramidBetaType(p.pyramid_beta),
        checkPyramidBeta(p.pyramid_beta, p.budget, p.window, false),
        checkAdaFloorType(p.ada_floor),
        checkAdaFloor(p.ada_floor, p.budget, p.window, false),
        checkValueNormType(p.value_norm),
        checkStage1MassType(p.stage1_mass),
        checkStage1Mass(p.stage1_mass, p.budget, p.window, false),
        checkHeadCapRatioType(p.head_cap_ratio),
        checkHeadCapRatio(p.head_cap_ratio, p.budget, p.window, false),
        checkFuturePositions(p.future_positions, p.budget, p.window, false),
        checkKvzipChunk(p.kvzip_chunk, p.budget, p.window, false),
        checkKvzipRereadType(p.kvzip_reread),
        checkKvzipScoreType(p.kvzip_score),
        checkAlphaType(p.alpha),
        checkAlpha(p.alpha, p.budget, p.window, false),
        checkEpsilonType(p.epsilon),
        checkEpsilon(p.epsilon, p.budget, p.window, false),
        checkGqaReduceType(p.gqa_reduce),
        checkStage2ScoresType(p.stage2_scores),
    });
    if (!error.empty())
        return error;
    // Layer fields.
    if (p.num_layers <= 0)
        return "num_layers: must be positive, got " + std::to_string(p.num_layers);
    if (p.layer_idx < 0 || p.layer_idx >= p.num_layers)
        return "layer_idx: " + std::to_string(p.layer_idx) + " is outside [0, num_layers=" + std::to_string(p.num_layers) + ")";
    if (p.capacity <= 0)
        return "capacity: must be a positive number of entries per head (node_capacity), got " + std::to_string(p.capacity);
    size_t const tableSize = method->evicts ? static_cast<size_t>(p.budget - p.window + 1) : 0;
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
    PolicyMethod const* method = findMethod(p.name);
    return method != nullptr && *method->pluginRefusal ? "name: " + p.name + " " + method->pluginRefusal : "";
}

//! "" when the CUDA kernels and the host version select the policy through the torch ops (per layer, or over every
//! layer for a model-level method; BaseMethod.kernels), else why not.
inline std::string kernelsRefusal(PolicyConfig const& p)
{
    PolicyMethod const* method = findMethod(p.name);
    return method != nullptr && *method->kernelsRefusal ? "name: " + p.name + " " + method->kernelsRefusal : "";
}

//! The plugin's validation: its refusal first, then the knobs.
inline std::string validatePolicy(PolicyConfig const& p)
{
    std::string const refusal = pluginRefusal(p);
    return refusal.empty() ? validateKnobs(p) : refusal;
}

} // namespace criticalkv
