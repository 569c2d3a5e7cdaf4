#include "criticalKVSelectPlugin.h"

#include "criticalkv/kernels.h"
#include "pluginUtils.h"

#include <limits>
#include <memory>
#include <utility>

using namespace nvinfer1;

namespace criticalkv::trt
{
namespace
{

constexpr int32_t kNbOutputs = 4;
constexpr int32_t kMaxFields = 1024;

enum InputIndex : int32_t
{
    kQueries = 0,
    kKeys = 1,
    kValues = 2,
    kOProj = 3,
    kPromptLengths = 4,
    kKvBudget = 5,
    kScores = 6,
};

constexpr int32_t kMinInputs = 4;
constexpr int32_t kMaxInputs = 7;

//! A policy that ranks by external scores (the kvzip pair) takes all seven inputs, the scores last; any other 4 to 6.
bool validInputCount(int32_t nbInputs, bool externalScores)
{
    return externalScores ? nbInputs == kMaxInputs : nbInputs >= kMinInputs && nbInputs <= kScores;
}

std::string inputCountError(int32_t nbInputs, bool externalScores)
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

enum OutputIndex : int32_t
{
    kKeptKeys = 0,
    kKeptValues = 1,
    kKeptLengths = 2,
    kKeptIndices = 3,
};

bool isFloatType(DataType type)
{
    return type == DataType::kFLOAT || type == DataType::kHALF || type == DataType::kBF16;
}

DType toDType(DataType type)
{
    switch (type)
    {
    case DataType::kFLOAT: return DType::kFloat32;
    case DataType::kHALF: return DType::kFloat16;
    case DataType::kBF16: return DType::kBFloat16;
    default: break;
    }
    throw std::invalid_argument("queries: unsupported data type (expected fp32, fp16 or bf16)");
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

} // namespace

// ------------------------------------------------------------------------------------------------ plugin

CriticalKVSelectPlugin::CriticalKVSelectPlugin(std::string layerName, std::string pluginNamespace, PolicyConfig const& policy)
    : mLayerName(std::move(layerName))
    , mNamespace(std::move(pluginNamespace))
    , mPolicy(policy)
    , mConfig(makeSelectConfig(policy)) // validates
    , mMetadata(describePolicy(policy))
    , mExternalScores(externalScores(mConfig))
{
    check(!mConfig.modelWide,
        "name: " + policy.name + " shares the budget across all layers: its graph holds a CriticalKVScore node per "
            "layer and one CriticalKVSelectModel node, not CriticalKVSelect");
}

CriticalKVSelectPlugin::CriticalKVSelectPlugin(CriticalKVSelectPlugin const& other)
    : IPluginV3(other)
    , IPluginV3OneCore(other)
    , IPluginV3OneBuild(other)
    , IPluginV3OneRuntime(other)
    , mLayerName(other.mLayerName)
    , mNamespace(other.mNamespace)
    , mPolicy(other.mPolicy)
    , mConfig(other.mConfig)
    , mMetadata(other.mMetadata)
    , mExternalScores(other.mExternalScores)
    , mNbInputs(other.mNbInputs)
{
    // mDataToSerialize points into its owner: rebuilt by getFieldsToSerialize, never copied.
}

IPluginCapability* CriticalKVSelectPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    try
    {
        switch (type)
        {
        case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
        case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
        }
        check(false, "unknown plugin capability type");
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return nullptr;
}

IPluginV3* CriticalKVSelectPlugin::clone() noexcept
{
    try
    {
        return std::make_unique<CriticalKVSelectPlugin>(*this).release();
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return nullptr;
}

char const* CriticalKVSelectPlugin::getPluginName() const noexcept
{
    return kPluginName;
}

char const* CriticalKVSelectPlugin::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* CriticalKVSelectPlugin::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

SelectShape CriticalKVSelectPlugin::shapeFromDims(Dims const* dims, int32_t nbInputs) const
{
    check(validInputCount(nbInputs, mExternalScores), inputCountError(nbInputs, mExternalScores));
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

int32_t CriticalKVSelectPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        check(in != nullptr && out != nullptr, "configurePlugin: null descriptors");
        check(validInputCount(nbInputs, mExternalScores), inputCountError(nbInputs, mExternalScores));
        check(nbOutputs == kNbOutputs, "expected 4 outputs, got " + std::to_string(nbOutputs));
        // Structure only: dims may hold -1 (dynamic) here; enqueue checks the concrete shapes.
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
        mNbInputs = nbInputs;
        return 0;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return -1;
}

int32_t CriticalKVSelectPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    try
    {
        check(outputTypes != nullptr && inputTypes != nullptr, "getOutputDataTypes: null arrays");
        check(nbOutputs == kNbOutputs, "expected 4 outputs");
        check(validInputCount(nbInputs, mExternalScores), inputCountError(nbInputs, mExternalScores));
        check(isFloatType(inputTypes[kQueries]), "queries: expected fp32, fp16 or bf16");
        check(nbInputs <= kScores || inputTypes[kScores] == DataType::kFLOAT, "scores: expected fp32");
        outputTypes[kKeptKeys] = inputTypes[kQueries];
        outputTypes[kKeptValues] = inputTypes[kQueries];
        outputTypes[kKeptLengths] = DataType::kINT32;
        outputTypes[kKeptIndices] = DataType::kINT32;
        return 0;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return -1;
}

int32_t CriticalKVSelectPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
    IExprBuilder& exprBuilder) noexcept
{
    try
    {
        check(inputs != nullptr && outputs != nullptr, "getOutputShapes: null arrays");
        check(validInputCount(nbInputs, mExternalScores), inputCountError(nbInputs, mExternalScores));
        check(nbOutputs == kNbOutputs, "expected 4 outputs");
        DimsExprs const& keys = inputs[kKeys];
        check(keys.nbDims == 4, "keys: expected [B, H_kv, n, d_h]");
        IDimensionExpr const* capacity = exprBuilder.constant(mPolicy.capacity);
        check(capacity != nullptr, "getOutputShapes: constant failed");
        IDimensionExpr const* cap = exprBuilder.operation(DimensionOperation::kMIN, *keys.d[2], *capacity);
        check(cap != nullptr, "getOutputShapes: min(n, capacity) failed");
        for (int32_t i : {kKeptKeys, kKeptValues})
        {
            outputs[i].nbDims = 4;
            outputs[i].d[0] = keys.d[0];
            outputs[i].d[1] = keys.d[1];
            outputs[i].d[2] = cap;
            outputs[i].d[3] = keys.d[3];
        }
        outputs[kKeptLengths].nbDims = 2;
        outputs[kKeptLengths].d[0] = keys.d[0];
        outputs[kKeptLengths].d[1] = keys.d[1];
        outputs[kKeptIndices].nbDims = 3;
        outputs[kKeptIndices].d[0] = keys.d[0];
        outputs[kKeptIndices].d[1] = keys.d[1];
        outputs[kKeptIndices].d[2] = cap;
        return 0;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return -1;
}

bool CriticalKVSelectPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    try
    {
        check(inOut != nullptr, "supportsFormatCombination: null descriptors");
        check(validInputCount(nbInputs, mExternalScores) && nbOutputs == kNbOutputs,
            inputCountError(nbInputs, mExternalScores) + " and 4 outputs");
        check(pos >= 0 && pos < nbInputs + nbOutputs, "supportsFormatCombination: position out of range");
        PluginTensorDesc const& desc = inOut[pos].desc;
        if (desc.format != TensorFormat::kLINEAR)
        {
            return false;
        }
        if (pos == kQueries)
        {
            return isFloatType(desc.type);
        }
        if (pos == kScores && pos < nbInputs)
        {
            return desc.type == DataType::kFLOAT; // fp32 whatever the layer's type: the kernels read float
        }
        bool const isIntTensor = (pos >= kPromptLengths && pos < nbInputs) || pos == nbInputs + kKeptLengths
            || pos == nbInputs + kKeptIndices;
        if (isIntTensor)
        {
            return desc.type == DataType::kINT32;
        }
        return desc.type == inOut[kQueries].desc.type; // keys, values, o_proj_weight, kept_keys, kept_values
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return false;
}

int32_t CriticalKVSelectPlugin::getNbOutputs() const noexcept
{
    return kNbOutputs;
}

size_t CriticalKVSelectPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    try
    {
        check(inputs != nullptr, "getWorkspaceSize: null descriptors");
        check(validInputCount(nbInputs, mExternalScores), inputCountError(nbInputs, mExternalScores));
        Dims maxDims[kMaxInputs];
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            maxDims[i] = inputs[i].max;
        }
        return workspaceLayout(mConfig, shapeFromDims(maxDims, nbInputs)).total;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return 0;
}

char const* CriticalKVSelectPlugin::getTimingCacheID() noexcept
{
    return mMetadata.c_str();
}

char const* CriticalKVSelectPlugin::getMetadataString() noexcept
{
    return mMetadata.c_str();
}

int32_t CriticalKVSelectPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        check(in != nullptr && out != nullptr, "onShapeChange: null descriptors");
        check(nbOutputs == kNbOutputs, "expected 4 outputs");
        check(validInputCount(nbInputs, mExternalScores), inputCountError(nbInputs, mExternalScores));
        Dims dims[kMaxInputs];
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            dims[i] = in[i].dims;
        }
        SelectShape const s = shapeFromDims(dims, nbInputs);
        check(s.queryLen >= windowLength(mConfig, s.n),
            "queries: " + std::to_string(s.queryLen) + " window queries given, the policy needs min(window, n) = "
                + std::to_string(windowLength(mConfig, s.n)));
        check(out[kKeptIndices].dims.nbDims == 3 && out[kKeptIndices].dims.d[2] == outputCapacity(mConfig, s.n),
            "kept_indices: unexpected shape");
        mNbInputs = nbInputs;
        return 0;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return -1;
}

int32_t CriticalKVSelectPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept
{
    // queries        [B, H, w', d_h]     fp32/fp16/bf16
    // keys, values   [B, H_kv, n, d_h]   same type
    // o_proj_weight  [hidden, H * d_h]   same type
    // prompt_lengths [B]                 int32 (optional input 4)
    // kv_budget      [1]                 int32 (optional input 5): the request's budget, read on the device
    // scores         [B, H_kv, n]        fp32 (input 6, the kvzip pair only): the graph's per-entry scores
    // kept_keys, kept_values [B, H_kv, cap, d_h], kept_lengths [B, H_kv] int32, kept_indices [B, H_kv, cap] int32
    try
    {
        check(inputDesc != nullptr && outputDesc != nullptr && inputs != nullptr && outputs != nullptr,
            "enqueue: null arguments");
        // TensorRT does not pass the input count to enqueue: onShapeChange (always called with the concrete
        // shapes before the first enqueue, as NVIDIA's ROIAlign plugin relies on) recorded it.
        check(validInputCount(mNbInputs, mExternalScores), "enqueue: onShapeChange was not called");
        int32_t const count = mNbInputs;
        Dims dims[kMaxInputs];
        for (int32_t i = 0; i < count; ++i)
        {
            dims[i] = inputDesc[i].dims;
        }
        SelectShape const s = shapeFromDims(dims, count);
        SelectTensors t{};
        t.dtype = toDType(inputDesc[kQueries].type);
        t.queries = inputs[kQueries];
        t.keys = inputs[kKeys];
        t.values = inputs[kValues];
        t.oProj = inputs[kOProj];
        t.promptLengths = count > kPromptLengths ? static_cast<int32_t const*>(inputs[kPromptLengths]) : nullptr;
        t.kvBudget = count > kKvBudget ? static_cast<int32_t const*>(inputs[kKvBudget]) : nullptr;
        t.scores = count > kScores ? static_cast<float const*>(inputs[kScores]) : nullptr;
        t.keptKeys = outputs[kKeptKeys];
        t.keptValues = outputs[kKeptValues];
        t.keptLengths = static_cast<int32_t*>(outputs[kKeptLengths]);
        t.keptIndices = static_cast<int32_t*>(outputs[kKeptIndices]);
        // t.prunedTerms stays null: the pruned stage 2's weights-only terms are recomputed at every enqueue (on the
        // tensor cores, one pass over o_proj), since a plugin cannot tell that its o_proj input keeps its content from
        // one enqueue to the next (a refitted engine, or o_proj not a constant of the graph) and a key by address alone
        // would then keep stale terms. The torch op's callers can reuse them (launchPrunedTerms, ckv_ops_pruned_terms).
        size_t const bytes = workspaceLayout(mConfig, s).total;
        cudaError_t const status = launchCriticalKVSelect(mConfig, budgetTable(mPolicy), s, t, workspace, bytes, stream);
        check(status == cudaSuccess,
            std::string("enqueue (") + mLayerName + "): " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
        return 0;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return -1;
}

IPluginV3* CriticalKVSelectPlugin::attachToContext(IPluginResourceContext* /*context*/) noexcept
{
    return clone();
}

PluginFieldCollection const* CriticalKVSelectPlugin::getFieldsToSerialize() noexcept
{
    try
    {
        mDataToSerialize.clear();
#define CKV_SERIALIZE_FIELD(kind, fieldName, defaultValue) addSerializedField(mDataToSerialize, #fieldName, mPolicy.fieldName);
        CKV_FOR_EACH_PLUGIN_FIELD(CKV_SERIALIZE_FIELD)
#undef CKV_SERIALIZE_FIELD
        mFCToSerialize.nbFields = static_cast<int32_t>(mDataToSerialize.size());
        mFCToSerialize.fields = mDataToSerialize.data();
        return &mFCToSerialize;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return nullptr;
}

// ------------------------------------------------------------------------------------------------ creator

#define CKV_PLUGIN_FIELD_TYPE_STRING PluginFieldType::kCHAR
#define CKV_PLUGIN_FIELD_TYPE_INT PluginFieldType::kINT32
#define CKV_PLUGIN_FIELD_TYPE_FLOAT PluginFieldType::kFLOAT32
#define CKV_PLUGIN_FIELD_TYPE_INTS PluginFieldType::kINT32

CriticalKVSelectCreator::CriticalKVSelectCreator(char const* pluginNamespace)
    : mNamespace(pluginNamespace != nullptr ? pluginNamespace : "")
{
    // The fields the ONNX parser reads from the node's attributes: generated from KVPolicy (policy_fields.h).
#define CKV_ADVERTISE_FIELD(kind, fieldName, defaultValue)                                                             \
    mFields.emplace_back(#fieldName, nullptr, CKV_PLUGIN_FIELD_TYPE_##kind, 1);
    CKV_FOR_EACH_PLUGIN_FIELD(CKV_ADVERTISE_FIELD)
#undef CKV_ADVERTISE_FIELD
    mFC.nbFields = static_cast<int32_t>(mFields.size());
    mFC.fields = mFields.data();
}

char const* CriticalKVSelectCreator::getPluginName() const noexcept
{
    return kPluginName;
}

char const* CriticalKVSelectCreator::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* CriticalKVSelectCreator::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

PluginFieldCollection const* CriticalKVSelectCreator::getFieldNames() noexcept
{
    return &mFC;
}

IPluginV3* CriticalKVSelectCreator::createPlugin(
    char const* name, PluginFieldCollection const* fc, TensorRTPhase phase) noexcept
{
    try
    {
        std::string const layerName = name != nullptr ? std::string(name, strnlen(name, 1024)) : std::string();
        std::string const where = std::string(kPluginName) + " (" + layerName + "): ";
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
        PolicyConfig policy;
        std::string error;
        if (!parsePolicyFields(views.data(), fc->nbFields, policy, error))
        {
            logError(where + error);
            return nullptr;
        }
        if (phase == TensorRTPhase::kRUNTIME)
        {
            // A deserialised plugin must carry every field it serialised.
            check(fc->nbFields == static_cast<int32_t>(pluginFieldNames().size()),
                where + "serialized plugin has " + std::to_string(fc->nbFields) + " fields, expected "
                    + std::to_string(pluginFieldNames().size()));
        }
        return std::make_unique<CriticalKVSelectPlugin>(layerName, mNamespace, policy).release();
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return nullptr;
}

} // namespace criticalkv::trt
