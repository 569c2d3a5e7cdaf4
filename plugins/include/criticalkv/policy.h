// The policy of one CriticalKVSelect node (host only): the KVPolicy knobs plus the layer fields, parsed from
// named fields (TensorRT PluginFields, the host test library) and validated with KVPolicy's rules.
#pragma once

#include "criticalkv/budget_host.h"
#include "criticalkv/common.h"
#include "criticalkv/policy_fields.h"
#include "criticalkv/select_params.h"

#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace criticalkv
{

#define CKV_CPP_TYPE_STRING std::string
#define CKV_CPP_TYPE_INT int32_t
#define CKV_CPP_TYPE_FLOAT double

//! Every creator field, with KVPolicy's names and defaults (generated: policy_fields.h).
struct PolicyConfig
{
#define CKV_DECLARE_FIELD(kind, fieldName, defaultValue) CKV_CPP_TYPE_##kind fieldName = defaultValue;
    CKV_FOR_EACH_PLUGIN_FIELD(CKV_DECLARE_FIELD)
#undef CKV_DECLARE_FIELD
};

//! Type of a named field value (a framework-free mirror of the TensorRT PluginFieldType values we accept).
enum class FieldType : int32_t
{
    kChar = 0,
    kInt32 = 1,
    kInt64 = 2,
    kFloat32 = 3,
    kFloat64 = 4,
    kOther = 5,
};

//! One named field: `length` counts elements (characters for kChar, including any terminating NUL).
struct FieldView
{
    char const* name;
    void const* data;
    FieldType type;
    int32_t length;
};

//! Longest accepted string field, in bytes.
constexpr int32_t kMaxStringField = 256;
//! Largest budget / capacity / window accepted (the round-9 budget helpers are exact below 2^22).
constexpr int32_t kMaxTokens = 1 << 22;

//! A float32 field (ONNX FLOAT attributes are float32) widened to the double of its shortest decimal form,
//! so that alpha = 0.3f means 0.3 exactly as in the Python policy, not 0.30000001192092896.
inline double widenFloat32(float value)
{
    if (!std::isfinite(value))
    {
        return static_cast<double>(value);
    }
    char buffer[64];
    auto const printed = std::to_chars(buffer, buffer + sizeof(buffer), value);
    if (printed.ec != std::errc())
    {
        return static_cast<double>(value);
    }
    double wide = 0.0;
    auto const parsed = std::from_chars(buffer, printed.ptr, wide);
    return parsed.ec == std::errc() ? wide : static_cast<double>(value);
}

namespace detail
{

inline char const* fieldTypeName(FieldType type)
{
    switch (type)
    {
    case FieldType::kChar: return "kCHAR";
    case FieldType::kInt32: return "kINT32";
    case FieldType::kInt64: return "kINT64";
    case FieldType::kFloat32: return "kFLOAT32";
    case FieldType::kFloat64: return "kFLOAT64";
    case FieldType::kOther: break;
    }
    return "an unsupported type";
}

inline bool readString(FieldView const& field, std::string& out, std::string& error)
{
    if (field.type != FieldType::kChar)
    {
        error = std::string(field.name) + ": expected a kCHAR string, got " + fieldTypeName(field.type);
        return false;
    }
    if (field.length < 1 || field.length > kMaxStringField)
    {
        error = std::string(field.name) + ": string length " + std::to_string(field.length) + " is outside [1, "
            + std::to_string(kMaxStringField) + "]";
        return false;
    }
    auto const* chars = static_cast<char const*>(field.data);
    size_t const size = strnlen(chars, static_cast<size_t>(field.length));
    for (size_t i = 0; i < size; ++i)
    {
        auto const c = static_cast<unsigned char>(chars[i]);
        if (c < 0x20 || c > 0x7e)
        {
            error = std::string(field.name) + ": contains a non-printable character";
            return false;
        }
    }
    out.assign(chars, size);
    return true;
}

inline bool readInt(FieldView const& field, int32_t& out, std::string& error)
{
    if (field.type != FieldType::kInt32 && field.type != FieldType::kInt64)
    {
        error = std::string(field.name) + ": expected an integer (kINT32), got " + fieldTypeName(field.type);
        return false;
    }
    if (field.length != 1)
    {
        error = std::string(field.name) + ": expected 1 value, got " + std::to_string(field.length);
        return false;
    }
    int64_t value = 0;
    if (field.type == FieldType::kInt32)
    {
        int32_t v;
        std::memcpy(&v, field.data, sizeof(v));
        value = v;
    }
    else
    {
        std::memcpy(&value, field.data, sizeof(value));
    }
    if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max())
    {
        error = std::string(field.name) + ": " + std::to_string(value) + " does not fit in int32";
        return false;
    }
    out = static_cast<int32_t>(value);
    return true;
}

inline bool readFloat(FieldView const& field, double& out, std::string& error)
{
    if (field.type == FieldType::kChar || field.type == FieldType::kOther)
    {
        error = std::string(field.name) + ": expected a number (kFLOAT32), got " + fieldTypeName(field.type);
        return false;
    }
    if (field.length != 1)
    {
        error = std::string(field.name) + ": expected 1 value, got " + std::to_string(field.length);
        return false;
    }
    switch (field.type)
    {
    case FieldType::kFloat32:
    {
        float v;
        std::memcpy(&v, field.data, sizeof(v));
        out = widenFloat32(v);
        break;
    }
    case FieldType::kFloat64: std::memcpy(&out, field.data, sizeof(out)); break;
    case FieldType::kInt32:
    case FieldType::kInt64:
    {
        int32_t v = 0;
        if (!readInt(field, v, error))
        {
            return false;
        }
        out = static_cast<double>(v);
        break;
    }
    case FieldType::kChar:
    case FieldType::kOther:
        error = std::string(field.name) + ": expected a number (kFLOAT32), got " + fieldTypeName(field.type);
        return false;
    }
    if (!std::isfinite(out))
    {
        error = std::string(field.name) + ": expected a finite number";
        return false;
    }
    return true;
}

inline bool readField(FieldView const& field, std::string& out, std::string& error)
{
    return readString(field, out, error);
}
inline bool readField(FieldView const& field, int32_t& out, std::string& error)
{
    return readInt(field, out, error);
}
inline bool readField(FieldView const& field, double& out, std::string& error)
{
    return readFloat(field, out, error);
}

inline std::string joinChoices(std::vector<std::string> const& choices)
{
    std::string joined;
    for (size_t i = 0; i < choices.size(); ++i)
    {
        joined += (i ? ", " : "") + choices[i];
    }
    return joined;
}

inline bool oneOf(std::string const& value, std::vector<std::string> const& choices)
{
    for (auto const& c : choices)
    {
        if (c == value)
        {
            return true;
        }
    }
    return false;
}

} // namespace detail

//! Names of every policy, in registry order.
inline std::vector<std::string> const& policyNames()
{
    static std::vector<std::string> const names = {
#define CKV_POLICY_NAME(policyName, base, twoStage) policyName,
        CKV_FOR_EACH_POLICY(CKV_POLICY_NAME)
#undef CKV_POLICY_NAME
    };
    return names;
}

//! Names of every creator field, in order.
inline std::vector<std::string> const& pluginFieldNames()
{
    static std::vector<std::string> const names = {
#define CKV_FIELD_NAME(kind, fieldName, defaultValue) #fieldName,
        CKV_FOR_EACH_PLUGIN_FIELD(CKV_FIELD_NAME)
#undef CKV_FIELD_NAME
    };
    return names;
}

//! "" when the config is valid, else "field: reason" (the same rules and wording as KVPolicy.__post_init__).
inline std::string validatePolicy(PolicyConfig const& p)
{
    std::ostringstream out;
    if (!detail::oneOf(p.name, policyNames()))
    {
        out << "name: unknown KV policy '" << p.name << "'; choose one of " << detail::joinChoices(policyNames());
        return out.str();
    }
    std::vector<std::string> const valueNorms = {CKV_CHOICES_value_norm};
    std::vector<std::string> const gqaReduces = {CKV_CHOICES_gqa_reduce};
    std::vector<std::string> const stage2Scores = {CKV_CHOICES_stage2_scores};
    if (!detail::oneOf(p.value_norm, valueNorms))
    {
        return "value_norm: '" + p.value_norm + "' is not one of " + detail::joinChoices(valueNorms);
    }
    if (!detail::oneOf(p.gqa_reduce, gqaReduces))
    {
        return "gqa_reduce: '" + p.gqa_reduce + "' is not one of " + detail::joinChoices(gqaReduces);
    }
    if (!detail::oneOf(p.stage2_scores, stage2Scores))
    {
        return "stage2_scores: '" + p.stage2_scores + "' is not one of " + detail::joinChoices(stage2Scores);
    }
    for (auto const& [fieldName, value] : {std::pair<char const*, double>{"alpha", p.alpha}, {"epsilon", p.epsilon},
             {"ada_floor", p.ada_floor}, {"pyramid_beta", p.pyramid_beta}})
    {
        if (!std::isfinite(value))
        {
            out << fieldName << ": expected a finite number, got " << value;
            return out.str();
        }
    }
    if (p.window <= 0)
    {
        return "window: must be a positive number of tokens, got " + std::to_string(p.window);
    }
    if (p.budget <= 0)
    {
        return "budget: must be a positive number of tokens, got " + std::to_string(p.budget);
    }
    if (p.name != "full" && p.budget < p.window)
    {
        return "budget: " + std::to_string(p.budget) + " is smaller than the window (" + std::to_string(p.window)
            + "); the window is always kept, so the budget must be at least the window";
    }
    if (p.pool_kernel <= 0 || p.pool_kernel % 2 == 0)
    {
        return "pool_kernel: must be a positive odd integer, got " + std::to_string(p.pool_kernel);
    }
    if (!(p.alpha >= 0.0 && p.alpha <= 1.0))
    {
        out << "alpha: must lie in [0, 1], got " << p.alpha;
        return out.str();
    }
    if (p.epsilon < 0.0)
    {
        out << "epsilon: must be >= 0, got " << p.epsilon;
        return out.str();
    }
    if (!(p.ada_floor >= 0.0 && p.ada_floor <= 1.0))
    {
        out << "ada_floor: must lie in [0, 1], got " << p.ada_floor;
        return out.str();
    }
    if (p.pyramid_beta < 1.0)
    {
        out << "pyramid_beta: must be >= 1, got " << p.pyramid_beta;
        return out.str();
    }
    if (p.sink_tokens < 0)
    {
        return "sink_tokens: must be >= 0, got " + std::to_string(p.sink_tokens);
    }
    if (p.name == "streamingllm" && p.sink_tokens > p.budget)
    {
        return "sink_tokens: " + std::to_string(p.sink_tokens) + " exceeds the budget " + std::to_string(p.budget);
    }
    // Layer fields and the implementation's limits.
    if (p.num_layers <= 0)
    {
        return "num_layers: must be positive, got " + std::to_string(p.num_layers);
    }
    if (p.layer_idx < 0 || p.layer_idx >= p.num_layers)
    {
        return "layer_idx: " + std::to_string(p.layer_idx) + " is outside [0, num_layers="
            + std::to_string(p.num_layers) + ")";
    }
    if (p.capacity <= 0)
    {
        return "capacity: must be a positive number of entries per head (node_capacity), got "
            + std::to_string(p.capacity);
    }
    for (auto const& [fieldName, value] :
        {std::pair<char const*, int32_t>{"budget", p.budget}, {"window", p.window}, {"pool_kernel", p.pool_kernel},
            {"sink_tokens", p.sink_tokens}})
    {
        if (value > kMaxTokens)
        {
            return std::string(fieldName) + ": " + std::to_string(value) + " exceeds the supported maximum "
                + std::to_string(kMaxTokens);
        }
    }
    return "";
}

//! Parse named fields into `out` (starting from KVPolicy's defaults). Unknown, duplicated, mistyped or
//! malformed fields are an error; missing fields keep their defaults (capacity has none: validatePolicy
//! rejects 0). Returns false and sets `error` ("field: reason") on failure; never reads past `length`.
inline bool parsePolicyFields(FieldView const* fields, int32_t count, PolicyConfig& out, std::string& error)
{
    out = PolicyConfig{};
    if (count < 0 || (count > 0 && fields == nullptr))
    {
        error = "fields: invalid field collection";
        return false;
    }
    std::vector<std::string> seen;
    for (int32_t i = 0; i < count; ++i)
    {
        FieldView const& field = fields[i];
        if (field.name == nullptr)
        {
            error = "field #" + std::to_string(i) + ": has no name";
            return false;
        }
        std::string const name(field.name, strnlen(field.name, kMaxStringField));
        if (detail::oneOf(name, seen))
        {
            error = name + ": given twice";
            return false;
        }
        seen.push_back(name);
        if (field.data == nullptr)
        {
            error = name + ": has no data";
            return false;
        }
        bool known = false;
        bool ok = true;
#define CKV_PARSE_FIELD(kind, fieldName, defaultValue)                                                                 \
    if (!known && name == #fieldName)                                                                                  \
    {                                                                                                                  \
        known = true;                                                                                                  \
        ok = detail::readField(field, out.fieldName, error);                                                           \
    }
        CKV_FOR_EACH_PLUGIN_FIELD(CKV_PARSE_FIELD)
#undef CKV_PARSE_FIELD
        if (!known)
        {
            error = "unknown field '" + name + "'; expected one of " + detail::joinChoices(pluginFieldNames());
            return false;
        }
        if (!ok)
        {
            return false;
        }
    }
    error = validatePolicy(out);
    return error.empty();
}

//! The numbers the kernels need; throws std::invalid_argument if the config does not validate.
inline SelectConfig makeSelectConfig(PolicyConfig const& p)
{
    std::string const error = validatePolicy(p);
    if (!error.empty())
    {
        throw std::invalid_argument(error);
    }
    SelectConfig c{};
#define CKV_POLICY_MATCH(policyName, baseMethod, twoStageOn)                                                           \
    if (p.name == policyName)                                                                                          \
    {                                                                                                                  \
        c.base = BaseMethod::baseMethod;                                                                               \
        c.twoStage = twoStageOn;                                                                                       \
    }
    CKV_FOR_EACH_POLICY(CKV_POLICY_MATCH)
#undef CKV_POLICY_MATCH
    c.budget = p.budget;
    c.window = p.window;
    c.poolKernel = p.pool_kernel;
    c.sinkTokens = p.sink_tokens;
    c.alpha = p.alpha;
    c.epsilon = static_cast<float>(p.epsilon);
    c.adaFloor = p.ada_floor;
    c.valueNorm = p.value_norm == "l2" ? ValueNorm::kL2 : ValueNorm::kL1;
    c.gqaReduce = p.gqa_reduce == "kvpress" ? GqaReduce::kKvpress : GqaReduce::kMean;
    c.stage2Scores = p.stage2_scores == "raw" ? Stage2Scores::kRaw : Stage2Scores::kPooled;
    int64_t const r = c.base == BaseMethod::kFull
        ? 0
        : layerSelectableBudget(c.base, p.budget, p.window, p.pyramid_beta, p.layer_idx, p.num_layers);
    c.layerBudget = static_cast<int32_t>(r);
    c.capacity = p.capacity;
    return c;
}

namespace detail
{

inline std::string formatValue(std::string const& value)
{
    return value;
}

inline std::string formatValue(int32_t value)
{
    return std::to_string(value);
}

inline std::string formatValue(double value)
{
    char buffer[64];
    auto const printed = std::to_chars(buffer, buffer + sizeof(buffer), value); // shortest round-trip form
    return printed.ec == std::errc() ? std::string(buffer, printed.ptr) : std::to_string(value);
}

} // namespace detail

//! One line "name=criticalkv budget=256 ..." (plugin metadata / timing-cache id, error messages).
inline std::string describePolicy(PolicyConfig const& p)
{
    std::string out;
#define CKV_DESCRIBE_FIELD(kind, fieldName, defaultValue)                                                              \
    out += (out.empty() ? "" : " ") + std::string(#fieldName) + "=" + detail::formatValue(p.fieldName);
    CKV_FOR_EACH_PLUGIN_FIELD(CKV_DESCRIBE_FIELD)
#undef CKV_DESCRIBE_FIELD
    return out;
}

} // namespace criticalkv
