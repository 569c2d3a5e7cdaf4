#include "layerInputs.h"

#include "criticalkv/kernels.h"
#include "pluginUtils.h"

#include <cstring>
#include <limits>

using namespace nvinfer1;

namespace criticalkv::trt
{
namespace
{

constexpr int32_t kMaxFields = 1024;

//! scores [B, H_kv, n] against keys [B, H_kv, n, d_h]; dynamic: -1 (unknown) matches anything (configurePlugin).
void checkScoresDims(Dims const& scores, Dims const& keys, bool dynamic)
{
    std::string const expected = "scores: expected shape [B, H_kv, n] = [" + std::to_string(keys.d[0]) + ", "
        + std::to_string(keys.d[1]) + ", " + std::to_string(keys.d[2]) + "] (the keys' first three dimensions)";
    check(scores.nbDims == 3, expected + ", got " + std::to_string(scores.nbDims) + " dimensions");
    // [.., 0]: the graph computed no scores (the PyTorch reference's window-attention fallback), which has no kernel
    check(scores.d[2] != 0 || keys.d[2] == 0,
        "scores: 0 entries given (no scores computed): the plugin ranks by the graph's per-entry scores "
        "[B, H_kv, n]; the window-attention fallback runs on the PyTorch path or ONNX Runtime only");
    for (int32_t i = 0; i < 3; ++i)
    {
        check(dynamic ? !knownAndDifferent(scores.d[i], keys.d[i]) : scores.d[i] == keys.d[i],
            expected + ", got [" + std::to_string(scores.d[0]) + ", " + std::to_string(scores.d[1]) + ", "
                + std::to_string(scores.d[2]) + "]");
    }
}

} // namespace

bool validLayerInputCount(int32_t nbInputs, bool externalScores)
{
    return externalScores ? nbInputs == kMaxLayerInputs : nbInputs >= kMinLayerInputs && nbInputs <= kScores;
}

std::string layerInputCountError(int32_t nbInputs, bool externalScores)
{
    if (externalScores)
    {
        return "expected 7 inputs (queries, keys, values, o_proj_weight, prompt_lengths, kv_budget, scores): the "
               "policy ranks by scores computed outside the layer, got "
            + std::to_string(nbInputs);
    }
    return "expected 4 to 6 inputs (queries, keys, values, o_proj_weight[, prompt_lengths[, kv_budget]]), got "
        + std::to_string(nbInputs);
}

bool isFloatType(DataType type)
{
    return type == DataType::kFLOAT || type == DataType::kHALF || type == DataType::kBF16;
}

DType toDType(DataType type, char const* what)
{
    switch (type)
    {
    case DataType::kFLOAT: return DType::kFloat32;
    case DataType::kHALF: return DType::kFloat16;
    case DataType::kBF16: return DType::kBFloat16;
    default: break;
    }
    throw std::invalid_argument(std::string(what) + ": unsupported data type (expected fp32, fp16 or bf16)");
}

FieldType toFieldType(PluginFieldType type)
{
    switch (type)
    {
    case PluginFieldType::kCHAR: return FieldType::kChar;
    case PluginFieldType::kINT32: return FieldType::kInt32;
    case PluginFieldType::kINT64: return FieldType::kInt64;
    case PluginFieldType::kFLOAT32: return FieldType::kFloat32;
    case PluginFieldType::kFLOAT64: return FieldType::kFloat64;
    default: break;
    }
    return FieldType::kOther;
}

int32_t toInt32(int64_t value, char const* what)
{
    check(value >= 0 && value <= std::numeric_limits<int32_t>::max(),
        std::string(what) + ": dimension " + std::to_string(value) + " is out of range");
    return static_cast<int32_t>(value);
}

bool knownAndDifferent(int64_t a, int64_t b)
{
    return a >= 0 && b >= 0 && a != b;
}

SelectShape layerShapeFromDims(Dims const* dims, int32_t nbInputs, bool externalScores)
{
    check(validLayerInputCount(nbInputs, externalScores), layerInputCountError(nbInputs, externalScores));
    Dims const& q = dims[kQueries];
    Dims const& k = dims[kKeys];
    Dims const& v = dims[kValues];
    Dims const& o = dims[kOProj];
    check(q.nbDims == 4, "queries: expected [B, H, w, d_h]");
    check(k.nbDims == 4, "keys: expected [B, H_kv, n, d_h]");
    check(v.nbDims == 4, "values: expected [B, H_kv, n, d_h]");
    check(o.nbDims == 2, "o_proj_weight: expected [hidden, H * d_h]");
    for (int32_t i = 0; i < 4; ++i)
    {
        check(v.d[i] == k.d[i], "values: shape differs from keys");
    }
    check(q.d[0] == k.d[0], "queries: batch differs from keys");
    check(q.d[3] == k.d[3], "queries: head dim differs from keys");
    check(k.d[1] > 0 && q.d[1] % k.d[1] == 0, "queries: query heads are not a multiple of the KV heads");
    check(o.d[1] == q.d[1] * q.d[3], "o_proj_weight: second dimension is not H * d_h");
    if (nbInputs > kPromptLengths)
    {
        check(dims[kPromptLengths].nbDims == 1 && dims[kPromptLengths].d[0] == k.d[0],
            "prompt_lengths: expected shape [B]");
    }
    if (nbInputs > kKvBudget)
    {
        check(dims[kKvBudget].nbDims == 1 && dims[kKvBudget].d[0] == 1, "kv_budget: expected shape [1]");
    }
    if (nbInputs > kScores)
    {
        checkScoresDims(dims[kScores], k, false);
    }
    SelectShape s{};
    s.batch = toInt32(k.d[0], "batch");
    s.heads = toInt32(q.d[1], "heads");
    s.kvHeads = toInt32(k.d[1], "kv heads");
    s.n = toInt32(k.d[2], "n");
    s.queryLen = toInt32(q.d[2], "window queries");
    s.headDim = toInt32(k.d[3], "head dim");
    s.hidden = toInt32(o.d[0], "hidden");
    check(s.headDim >= 1 && s.headDim <= kMaxHeadDim,
        "keys: head dim " + std::to_string(s.headDim) + " is outside [1, " + std::to_string(kMaxHeadDim) + "]");
    return s;
}

SelectShape layerShapeOf(PluginTensorDesc const* in, int32_t nbInputs, bool externalScores)
{
    check(validLayerInputCount(nbInputs, externalScores), layerInputCountError(nbInputs, externalScores));
    Dims dims[kMaxLayerInputs];
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        dims[i] = in[i].dims;
    }
    return layerShapeFromDims(dims, nbInputs, externalScores);
}

void checkWindowQueries(SelectConfig const& config, SelectShape const& shape)
{
    check(shape.queryLen >= windowLength(config, shape.n),
        "queries: " + std::to_string(shape.queryLen) + " window queries given, the policy needs min(window, n) = "
            + std::to_string(windowLength(config, shape.n)));
}

size_t layerWorkspaceBytes(
    SelectConfig const& config, DynamicPluginTensorDesc const* inputs, int32_t nbInputs, bool externalScores)
{
    check(inputs != nullptr, "getWorkspaceSize: null descriptors");
    check(validLayerInputCount(nbInputs, externalScores), layerInputCountError(nbInputs, externalScores));
    Dims maxDims[kMaxLayerInputs];
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        maxDims[i] = inputs[i].max;
    }
    return workspaceLayout(config, layerShapeFromDims(maxDims, nbInputs, externalScores)).total;
}

bool maxDimsKnown(DynamicPluginTensorDesc const* in, int32_t nbInputs)
{
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        Dims const& dims = in[i].max;
        if (dims.nbDims < 0)
        {
            return false;
        }
        for (int32_t axis = 0; axis < dims.nbDims; ++axis)
        {
            if (dims.d[axis] < 0)
            {
                return false;
            }
        }
    }
    return true;
}

void checkLayerStructure(DynamicPluginTensorDesc const* in, int32_t nbInputs, bool externalScores)
{
    check(validLayerInputCount(nbInputs, externalScores), layerInputCountError(nbInputs, externalScores));
    Dims const& q = in[kQueries].desc.dims;
    Dims const& k = in[kKeys].desc.dims;
    Dims const& v = in[kValues].desc.dims;
    check(q.nbDims == 4 && k.nbDims == 4 && v.nbDims == 4 && in[kOProj].desc.dims.nbDims == 2,
        "queries/keys/values must be 4-D and o_proj_weight 2-D");
    for (int32_t i = 0; i < 4; ++i)
    {
        check(!knownAndDifferent(k.d[i], v.d[i]), "values: shape differs from keys");
    }
    check(!knownAndDifferent(q.d[0], k.d[0]), "queries: batch differs from keys");
    check(!knownAndDifferent(q.d[3], k.d[3]), "queries: head dim differs from keys");
    if (nbInputs > kScores)
    {
        checkScoresDims(in[kScores].desc.dims, k, true);
    }
}

bool layerInputSupported(int32_t pos, PluginTensorDesc const& desc, DataType floatType)
{
    if (desc.format != TensorFormat::kLINEAR)
    {
        return false;
    }
    switch (pos)
    {
    case kQueries: return isFloatType(desc.type);
    case kPromptLengths:
    case kKvBudget: return desc.type == DataType::kINT32;
    case kScores: return desc.type == DataType::kFLOAT; // fp32 whatever the layer's type: the kernels read float
    default: return desc.type == floatType;             // keys, values, o_proj_weight
    }
}

std::vector<FieldView> fieldViews(PluginFieldCollection const* fc, std::string const& where)
{
    check(fc != nullptr, where + "no field collection");
    check(fc->nbFields >= 0 && fc->nbFields <= kMaxFields, where + "invalid field count " + std::to_string(fc->nbFields));
    check(fc->nbFields == 0 || fc->fields != nullptr, where + "null field array");
    std::vector<FieldView> views;
    views.reserve(static_cast<size_t>(fc->nbFields));
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        PluginField const& f = fc->fields[i];
        views.push_back(FieldView{f.name, f.data, toFieldType(f.type), f.length});
    }
    return views;
}

int32_t serializedLayerFieldCount()
{
    return static_cast<int32_t>(pluginFieldNames().size());
}

void addSerializedField(std::vector<PluginField>& fields, char const* name, std::string const& value)
{
    fields.emplace_back(name, value.c_str(), PluginFieldType::kCHAR, static_cast<int32_t>(value.size() + 1));
}

void addSerializedField(std::vector<PluginField>& fields, char const* name, int32_t const& value)
{
    fields.emplace_back(name, &value, PluginFieldType::kINT32, 1);
}

void addSerializedField(std::vector<PluginField>& fields, char const* name, std::vector<int32_t> const& values)
{
    static int32_t const kNoValue = 0; // an empty array still points somewhere
    fields.emplace_back(
        name, values.empty() ? &kNoValue : values.data(), PluginFieldType::kINT32, static_cast<int32_t>(values.size()));
}

void addSerializedField(std::vector<PluginField>& fields, char const* name, double const& value)
{
    fields.emplace_back(name, &value, PluginFieldType::kFLOAT64, 1); // exact round trip of the double knobs
}

} // namespace criticalkv::trt
