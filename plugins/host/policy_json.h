// A policy as KVPolicy.to_json() writes it (a flat JSON object of its knobs), plus a layer's position and capacity,
// into the parser's named fields (policy.h): the torch ops (plugins/torch) take the policy in that form, so the op's
// string argument is the one every Python caller already has. The layer's layer_budgets table (the ONNX node's
// attribute, criticalkv/methods/budget.py: layer_budget_table) is computed here: r for every base but PyramidKV, whose
// per-layer budgets are budget.py's exact integer pyramid (_pyramid_layer_budgets, ported line for line).
#pragma once

#include "policy.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

namespace criticalkv
{

//! PyramidKV's r_l of every layer (budget.py: _pyramid_layer_budgets): linear from r_max down to r_min = max(r / beta,
//! 1) as exact rationals over beta_micros (L - 1), floors, then the missing units to the largest remainders (ties to
//! the lower layer), so the layers sum to L r exactly.
inline std::vector<int64_t> pyramidLayerBudgets(int64_t r, int64_t layers, int64_t betaMicros)
{
    std::vector<int64_t> out(static_cast<size_t>(layers), r);
    if (layers == 1 || r <= 0)
    {
        return out;
    }
    using Wide = __int128;
    Wide const q = betaMicros;
    Wide const steps = layers - 1;
    Wide const a = std::max<Wide>(static_cast<Wide>(r) * kDecimalScale, q);
    Wide const denominator = q * steps;
    std::vector<Wide> remainders(static_cast<size_t>(layers));
    Wide sum = 0;
    for (int64_t l = 0; l < layers; ++l)
    {
        Wide const numerator = (2 * static_cast<Wide>(r) * q - a) * steps - (2 * static_cast<Wide>(r) * q - 2 * a) * l;
        out[static_cast<size_t>(l)] = static_cast<int64_t>(numerator / denominator); // numerators are >= 0
        remainders[static_cast<size_t>(l)] = numerator % denominator;
        sum += out[static_cast<size_t>(l)];
    }
    std::vector<int64_t> order(static_cast<size_t>(layers));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
        [&](int64_t x, int64_t y) { return remainders[static_cast<size_t>(x)] > remainders[static_cast<size_t>(y)]; });
    Wide const missing = static_cast<Wide>(layers) * r - sum;
    for (Wide i = 0; i < missing && i < layers; ++i)
    {
        out[static_cast<size_t>(order[static_cast<size_t>(i)])] += 1;
    }
    return out;
}

//! layer_budget_table (budget.py): r_l of layer `layer` at every budget b = window .. budget (index b - window); empty
//! for a policy that does not evict.
inline std::vector<int32_t> layerBudgetTable(
    std::string const& name, int32_t budget, int32_t window, double pyramidBeta, int32_t layer, int32_t layers)
{
    std::vector<int32_t> table;
    if (!detail::oneOf(name, policyNames()) || baseOf(name) == BaseMethod::kFull || budget < window || layers <= 0
        || layer < 0 || layer >= layers)
    {
        return table;
    }
    bool const pyramid = baseOf(name) == BaseMethod::kPyramidKV;
    int64_t const beta = decimalMicros(pyramidBeta);
    for (int32_t r = 0; r <= budget - window; ++r)
    {
        table.push_back(pyramid ? static_cast<int32_t>(pyramidLayerBudgets(r, layers, beta)[static_cast<size_t>(layer)]) : r);
    }
    return table;
}

//! The named fields of a JSON policy (their data lives here).
class JsonPolicyFields
{
public:
    //! Parse `json` (KVPolicy.to_json(): string, integer and float values; "schema_version" is skipped) and add the
    //! layer fields. False with the reason in `error`.
    bool parse(std::string const& json, int32_t layerIdx, int32_t numLayers, int32_t capacity, std::string& error)
    {
        mText = json;
        size_t at = 0;
        auto skip = [&] {
            while (at < mText.size() && std::isspace(static_cast<unsigned char>(mText[at])))
            {
                ++at;
            }
        };
        auto fail = [&](std::string const& why) {
            error = "policy: not a KVPolicy JSON object (" + why + " at character " + std::to_string(at) + ")";
            return false;
        };
        auto readString = [&](std::string& out) {
            if (at >= mText.size() || mText[at] != '"')
            {
                return false;
            }
            size_t const end = mText.find('"', at + 1);
            if (end == std::string::npos || mText.find('\\', at + 1) < end)
            {
                return false; // knob values and names never need escapes
            }
            out = mText.substr(at + 1, end - at - 1);
            at = end + 1;
            return true;
        };
        skip();
        if (at >= mText.size() || mText[at] != '{')
        {
            return fail("expected '{'");
        }
        ++at;
        skip();
        while (at < mText.size() && mText[at] != '}')
        {
            std::string key;
            if (!readString(key))
            {
                return fail("expected a quoted knob name");
            }
            skip();
            if (at >= mText.size() || mText[at] != ':')
            {
                return fail("expected ':'");
            }
            ++at;
            skip();
            Value value;
            value.name = key;
            if (at < mText.size() && mText[at] == '"')
            {
                if (!readString(value.text))
                {
                    return fail("unterminated string");
                }
                value.type = FieldType::kChar;
            }
            else
            {
                size_t const start = at;
                while (at < mText.size() && (std::isdigit(static_cast<unsigned char>(mText[at])) || std::strchr("+-.eE", mText[at])))
                {
                    ++at;
                }
                std::string const number = mText.substr(start, at - start);
                if (number.empty())
                {
                    return fail("expected a string or a number for '" + key + "'");
                }
                char* end = nullptr;
                if (number.find_first_of(".eE") == std::string::npos)
                {
                    value.integer = std::strtoll(number.c_str(), &end, 10);
                    value.type = FieldType::kInt64;
                }
                else
                {
                    value.real = std::strtod(number.c_str(), &end);
                    value.type = FieldType::kFloat64;
                }
                if (end != number.c_str() + number.size())
                {
                    return fail("malformed number '" + number + "'");
                }
            }
            if (key != "schema_version")
            {
                mValues.push_back(value);
            }
            skip();
            if (at < mText.size() && mText[at] == ',')
            {
                ++at;
                skip();
            }
            else if (at >= mText.size() || mText[at] != '}')
            {
                return fail("expected ',' or '}'");
            }
        }
        if (at >= mText.size())
        {
            return fail("expected '}'");
        }
        PolicyConfig defaults;
        for (char const* layerField : {"layer_idx", "num_layers", "capacity", "layer_budgets"})
        {
            for (Value const& v : mValues)
            {
                if (v.name == layerField)
                {
                    error = std::string("policy: '") + layerField + "' is an argument of the op, not a knob";
                    return false;
                }
            }
        }
        std::string name = defaults.name;
        int64_t budget = defaults.budget;
        int64_t window = defaults.window;
        double beta = defaults.pyramid_beta;
        for (Value const& v : mValues)
        {
            name = v.name == "name" && v.type == FieldType::kChar ? v.text : name;
            budget = v.name == "budget" && v.type == FieldType::kInt64 ? v.integer : budget;
            window = v.name == "window" && v.type == FieldType::kInt64 ? v.integer : window;
            beta = v.name == "pyramid_beta" ? (v.type == FieldType::kFloat64 ? v.real : static_cast<double>(v.integer))
                                            : beta;
        }
        mValues.push_back(Value{"layer_idx", FieldType::kInt64, layerIdx, 0.0, ""});
        mValues.push_back(Value{"num_layers", FieldType::kInt64, numLayers, 0.0, ""});
        mValues.push_back(Value{"capacity", FieldType::kInt64, capacity, 0.0, ""});
        if (budget >= 0 && budget <= kMaxTokens && window >= 0 && window <= kMaxTokens)
        {
            mTable = layerBudgetTable(name, static_cast<int32_t>(budget), static_cast<int32_t>(window), beta, layerIdx,
                numLayers);
        }
        mViews.clear();
        for (Value const& v : mValues)
        {
            switch (v.type)
            {
            case FieldType::kChar: mViews.push_back(FieldView{v.name.c_str(), v.text.c_str(), v.type,
                                       static_cast<int32_t>(v.text.size() + 1)}); break;
            case FieldType::kInt64: mViews.push_back(FieldView{v.name.c_str(), &v.integer, v.type, 1}); break;
            default: mViews.push_back(FieldView{v.name.c_str(), &v.real, v.type, 1}); break;
            }
        }
        mViews.push_back(FieldView{"layer_budgets", mTable.data(), FieldType::kInt32, static_cast<int32_t>(mTable.size())});
        return true;
    }

    FieldView const* views() const
    {
        return mViews.data();
    }

    int32_t count() const
    {
        return static_cast<int32_t>(mViews.size());
    }

private:
    struct Value
    {
        std::string name;
        FieldType type;
        int64_t integer;
        double real;
        std::string text;
    };

    std::string mText;
    std::vector<Value> mValues;
    std::vector<int32_t> mTable;
    std::vector<FieldView> mViews;
};

//! A KVPolicy JSON policy of one layer, parsed and validated for `use`: the config, or false with the reason.
inline bool parsePolicyJson(std::string const& json, int32_t layerIdx, int32_t numLayers, int32_t capacity,
    PolicyUse use, PolicyConfig& out, std::string& error)
{
    JsonPolicyFields fields;
    return fields.parse(json, layerIdx, numLayers, capacity, error)
        && parsePolicyFields(fields.views(), fields.count(), out, error, use);
}

} // namespace criticalkv
