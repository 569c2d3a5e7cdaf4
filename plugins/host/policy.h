// Parsing of the CriticalKVSelect node's fields (host only): named fields (TensorRT PluginFields, the test
// library) into the generated PolicyConfig, validated by the generated validatePolicy (KVPolicy's rules and
// wording, criticalkv/spec), then resolved to the kernels' SelectConfig.
#pragma once

#include "criticalkv/common.h"
#include "criticalkv/methods.h"
#include "criticalkv/policy_config.h"
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
//! Longest accepted integer-array field (layer_budgets: budget - window + 1 <= kMaxTokens + 1 values).
constexpr int32_t kMaxArrayField = kMaxTokens + 1;

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

inline bool readInts(FieldView const& field, std::vector<int32_t>& out, std::string& error)
{
    if (field.type != FieldType::kInt32 && field.type != FieldType::kInt64)
    {
        error = std::string(field.name) + ": expected an integer array (kINT32), got " + fieldTypeName(field.type);
        return false;
    }
    if (field.length < 0 || field.length > kMaxArrayField)
    {
        error = std::string(field.name) + ": array length " + std::to_string(field.length) + " is outside [0, "
            + std::to_string(kMaxArrayField) + "]";
        return false;
    }
    out.resize(static_cast<size_t>(field.length));
    for (int32_t i = 0; i < field.length; ++i)
    {
        int64_t value = 0;
        if (field.type == FieldType::kInt32)
        {
            int32_t v;
            std::memcpy(&v, static_cast<char const*>(field.data) + sizeof(int32_t) * i, sizeof(v));
            value = v;
        }
        else
        {
            std::memcpy(&value, static_cast<char const*>(field.data) + sizeof(int64_t) * i, sizeof(value));
        }
        if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max())
        {
            error = std::string(field.name) + ": " + std::to_string(value) + " does not fit in int32";
            return false;
        }
        out[static_cast<size_t>(i)] = static_cast<int32_t>(value);
    }
    return true;
}

inline bool readField(FieldView const& field, std::vector<int32_t>& out, std::string& error)
{
    return readInts(field, out, error);
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

} // namespace detail

//! Who selects with a parsed policy: the per-layer TensorRT plugin (which refuses what it has no flow for:
//! pluginRefusal), or the kernels and the host version through the torch ops (kernelsRefusal: per layer, or over every
//! layer for a model-level method, with the external scores as an input).
enum class PolicyUse : int32_t
{
    kPlugin = 0,
    kKernels = 1,
};

//! The validation of `p` for `use`: "" or "field: reason".
inline std::string validateFor(PolicyConfig const& p, PolicyUse use)
{
    if (use == PolicyUse::kPlugin)
    {
        return validatePolicy(p);
    }
    std::string const refusal = kernelsRefusal(p);
    return refusal.empty() ? validateKnobs(p) : refusal;
}

//! Parse named fields into `out` (starting from KVPolicy's defaults). Unknown, duplicated, mistyped or
//! malformed fields are an error; missing fields keep their defaults (capacity has none: validatePolicy
//! rejects 0; a missing layer_budgets is b - window except for PyramidKV, which must give it). Returns false and sets `error` ("field: reason") on failure; never reads past `length`.
inline bool parsePolicyFields(FieldView const* fields, int32_t count, PolicyConfig& out, std::string& error,
    PolicyUse use = PolicyUse::kPlugin)
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
        if (field.data == nullptr && field.length != 0) // an empty array (layer_budgets of full) may have none
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
    // A node written before runtime budgets has no layer_budgets: outside PyramidKV r_l is b - window, so the
    // table is implied; a PyramidKV node must carry it (its per-layer arithmetic lives in Python only), and
    // `full` has none.
    if (!detail::oneOf("layer_budgets", seen) && detail::oneOf(out.name, policyNames())
        && baseOf(out.name) != BaseMethod::kPyramidKV && baseOf(out.name) != BaseMethod::kFull)
    {
        for (int32_t b = out.window; b <= out.budget; ++b)
        {
            out.layer_budgets.push_back(b - out.window);
        }
    }
    error = validateFor(out, use);
    return error.empty();
}

//! The numbers the kernels need; throws std::invalid_argument if the config does not validate for `use`.
inline SelectConfig makeSelectConfig(PolicyConfig const& p, PolicyUse use = PolicyUse::kPlugin)
{
    std::string const error = validateFor(p, use);
    if (!error.empty())
    {
        throw std::invalid_argument(error);
    }
    SelectConfig c{};
    c.base = baseOf(p.name);
    c.twoStage = twoStageOf(p.name) ? 1 : 0;
    c.budget = p.budget;
    int32_t const minBudget = minRuntimeBudget(p);
    c.minBudget = minBudget < p.budget ? minBudget : p.budget;
    c.window = p.window;
    c.poolKernel = p.pool_kernel;
    c.sinkTokens = p.sink_tokens;
    c.alphaMicros = decimalMicros(p.alpha);
    c.epsilon = static_cast<float>(p.epsilon);
    c.adaFloorMicros = decimalMicros(p.ada_floor);
    c.valueNorm = p.value_norm == "l2" ? ValueNorm::kL2 : ValueNorm::kL1;
    c.gqaReduce = p.gqa_reduce == "kvpress" ? GqaReduce::kKvpress : GqaReduce::kMean;
    c.stage2Scores = p.stage2_scores == "raw" ? Stage2Scores::kRaw : Stage2Scores::kPooled;
    // A float32 threshold, not integer millionths: it is only compared with fp32 cumulative masses, and float32(x)
    // survives the ONNX float32 attribute and its shortest-decimal widening unchanged.
    c.stage1Mass = static_cast<float>(p.stage1_mass);
    c.layerBudget = 0;
    c.budgetTable = 0;
    if (p.budget >= p.window && !p.layer_budgets.empty())
    {
        // layer_budgets[b - window] = r_l at budget b; a table that is b - window everywhere needs no lookup, and
        // only the scoring stages read r_l.
        c.layerBudget = p.layer_budgets[static_cast<size_t>(p.budget - p.window)];
        for (size_t i = 0; i < p.layer_budgets.size() && needsScores(c); ++i)
        {
            c.budgetTable = c.budgetTable || p.layer_budgets[i] != static_cast<int32_t>(i);
        }
    }
    c.capacity = p.capacity;
    // kvzip's score is not pooled (poolsAttention); it keeps its sinks before ranking (per layer: sequenceInfo's
    // candidateStart; the model-level selection ranks them first instead: model_level.h)
    c.poolKernel = poolsAttention(c) ? p.pool_kernel : 1;
    c.headCapMicros = decimalMicros(p.head_cap_ratio);
    c.modelWide = modelLevel(c) && p.num_layers > 1 ? 1 : 0;
    c.keptSinks = keepsSinks(c) && !c.modelWide ? p.sink_tokens : 0;
    return c;
}

//! The layer_budgets table of a validated config, as the launch takes it.
inline BudgetTable budgetTable(PolicyConfig const& p)
{
    return BudgetTable{p.layer_budgets.data(), static_cast<int32_t>(p.layer_budgets.size())};
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

//! An integer array as "<count>:<FNV-1a 64 of the values, hex>": the metadata / timing-cache id stays short for
//! a table of thousands of entries and still tells tables apart.
inline std::string formatValue(std::vector<int32_t> const& values)
{
    uint64_t hash = 0xcbf29ce484222325ULL;
    for (int32_t value : values)
    {
        auto const bits = static_cast<uint32_t>(value);
        for (int shift = 0; shift < 32; shift += 8)
        {
            hash = (hash ^ ((bits >> shift) & 0xffu)) * 0x100000001b3ULL;
        }
    }
    char hex[17];
    for (int i = 15; i >= 0; --i, hash >>= 4)
    {
        hex[i] = "0123456789abcdef"[hash & 0xfu];
    }
    hex[16] = '\0';
    return std::to_string(values.size()) + ":" + hex;
}

inline std::string formatValue(double value)
{
    char buffer[64];
    auto const printed = std::to_chars(buffer, buffer + sizeof(buffer), value); // shortest round-trip form
    return printed.ec == std::errc() ? std::string(buffer, printed.ptr) : std::to_string(value);
}

} // namespace detail

//! One line "name=criticalkv budget=256 ... layer_budgets=225:<hash>" (plugin metadata / timing-cache id, error
//! messages).
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
