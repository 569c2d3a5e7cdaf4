#include "modelLevelPlugins.h"

#include "criticalkv/kernels.h"
#include "pluginUtils.h"

#include <cstring>
#include <memory>
#include <utility>

using namespace nvinfer1;

namespace criticalkv::trt
{
namespace
{

//! The layer fields CriticalKVSelectModel does not take (it has capacities, one per layer, instead).
bool layerOnlyField(char const* name)
{
    return std::strcmp(name, "layer_idx") == 0 || std::strcmp(name, "capacity") == 0
        || std::strcmp(name, "layer_budgets") == 0;
}

constexpr char const* kCapacities = "capacities";

//! m = n - min(window, n) older tokens of a layer.
IDimensionExpr const* olderExpr(IDimensionExpr const& n, int32_t window, IExprBuilder& exprBuilder)
{
    IDimensionExpr const* w = exprBuilder.constant(window);
    IDimensionExpr const* zero = exprBuilder.constant(0);
    check(w != nullptr && zero != nullptr, "getOutputShapes: constant failed");
    IDimensionExpr const* older = exprBuilder.operation(DimensionOperation::kSUB, n, *w);
    check(older != nullptr, "getOutputShapes: n - window failed");
    IDimensionExpr const* m = exprBuilder.operation(DimensionOperation::kMAX, *older, *zero);
    check(m != nullptr, "getOutputShapes: max(n - window, 0) failed");
    return m;
}

bool sameDims(Dims const& a, Dims const& b)
{
    if (a.nbDims != b.nbDims)
    {
        return false;
    }
    for (int32_t i = 0; i < a.nbDims; ++i)
    {
        if (a.d[i] != b.d[i])
        {
            return false;
        }
    }
    return true;
}

std::string dimsText(Dims const& d)
{
    std::string text = "[";
    for (int32_t i = 0; i < d.nbDims; ++i)
    {
        text += (i ? ", " : "") + std::to_string(d.d[i]);
    }
    return text + "]";
}

//! The model node's scratch: every layer's ranking (and critical score) concatenated layer-major [B, L H_kv, m] fp32,
//! then launchModelSelect's workspace.
struct ModelBuffers
{
    size_t ranking;
    size_t critical;
    size_t select;
    size_t selectBytes;
    size_t total;
};

ModelBuffers modelBuffers(SelectConfig const& config, ModelShape const& shape, bool refined)
{
    size_t const m = static_cast<size_t>(shape.layer.n - windowLength(config, shape.layer.n));
    size_t const rows = static_cast<size_t>(shape.layer.batch) * static_cast<size_t>(modelHeads(shape)) * m;
    ModelBuffers b{};
    b.ranking = 0;
    b.critical = alignWorkspace(rows * sizeof(float));
    b.select = b.critical + (refined ? alignWorkspace(rows * sizeof(float)) : 0);
    b.selectBytes = modelWorkspaceLayout(config, shape).total;
    b.total = b.select + b.selectBytes;
    return b;
}

} // namespace

// ------------------------------------------------------------------------------------------------ shared plumbing

ModelLevelPluginBase::ModelLevelPluginBase(std::string layerName, std::string pluginNamespace, PolicyConfig const& policy)
    : PluginBase(std::move(layerName), std::move(pluginNamespace), policy, PolicyUse::kKernels)
    , mRefined(mConfig.twoStage != 0)
{
    check(mConfig.modelWide != 0,
        "name: " + policy.name + " (num_layers " + std::to_string(policy.num_layers)
            + ") does not select at model level: its graph holds CriticalKVSelect nodes (a model-level method over "
              "more than one layer has CriticalKVScore / CriticalKVSelectModel)");
}

// ------------------------------------------------------------------------------------------------ CriticalKVScore

CriticalKVScorePlugin::CriticalKVScorePlugin(std::string layerName, std::string pluginNamespace, PolicyConfig const& policy)
    : ModelLevelPluginBase(std::move(layerName), std::move(pluginNamespace), policy)
{
}

IPluginV3* CriticalKVScorePlugin::clone() noexcept
{
    try
    {
        return std::make_unique<CriticalKVScorePlugin>(*this).release();
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return nullptr;
}

char const* CriticalKVScorePlugin::getPluginName() const noexcept
{
    return kScorePluginName;
}

int32_t CriticalKVScorePlugin::getNbOutputs() const noexcept
{
    return mRefined ? 2 : 1;
}

int32_t CriticalKVScorePlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        check(in != nullptr && out != nullptr, "configurePlugin: null descriptors");
        check(nbOutputs == getNbOutputs(), "expected " + std::to_string(getNbOutputs()) + " outputs, got "
                + std::to_string(nbOutputs));
        checkLayerStructure(in, nbInputs, mExternalScores);
        mNbInputs = nbInputs;
        if (maxDimsKnown(in, nbInputs)) // the workspace TensorRT will allocate (CriticalKVSelectPlugin::configurePlugin)
        {
            mWorkspaceBytes = static_cast<int64_t>(layerWorkspaceBytes(mConfig, in, nbInputs, mExternalScores));
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return -1;
}

int32_t CriticalKVScorePlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    try
    {
        check(outputTypes != nullptr && inputTypes != nullptr, "getOutputDataTypes: null arrays");
        check(nbOutputs == getNbOutputs(), "expected " + std::to_string(getNbOutputs()) + " outputs");
        check(validLayerInputCount(nbInputs, mExternalScores), layerInputCountError(nbInputs, mExternalScores));
        check(isFloatType(inputTypes[kQueries]), "queries: expected fp32, fp16 or bf16");
        check(nbInputs <= kScores || inputTypes[kScores] == DataType::kFLOAT, "scores: expected fp32");
        for (int32_t i = 0; i < nbOutputs; ++i)
        {
            outputTypes[i] = DataType::kFLOAT; // the ranking (and critical score) in fp32 whatever the layer's type
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return -1;
}

int32_t CriticalKVScorePlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
    int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept
{
    try
    {
        check(inputs != nullptr && outputs != nullptr, "getOutputShapes: null arrays");
        check(validLayerInputCount(nbInputs, mExternalScores), layerInputCountError(nbInputs, mExternalScores));
        check(nbOutputs == getNbOutputs(), "expected " + std::to_string(getNbOutputs()) + " outputs");
        DimsExprs const& keys = inputs[kKeys];
        check(keys.nbDims == 4, "keys: expected [B, H_kv, n, d_h]");
        IDimensionExpr const* m = olderExpr(*keys.d[2], mPolicy.window, exprBuilder);
        for (int32_t i = 0; i < nbOutputs; ++i)
        {
            outputs[i].nbDims = 3;
            outputs[i].d[0] = keys.d[0];
            outputs[i].d[1] = keys.d[1];
            outputs[i].d[2] = m;
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return -1;
}

bool CriticalKVScorePlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    try
    {
        check(inOut != nullptr, "supportsFormatCombination: null descriptors");
        check(validLayerInputCount(nbInputs, mExternalScores) && nbOutputs == getNbOutputs(),
            layerInputCountError(nbInputs, mExternalScores) + " and " + std::to_string(getNbOutputs()) + " outputs");
        check(pos >= 0 && pos < nbInputs + nbOutputs, "supportsFormatCombination: position out of range");
        PluginTensorDesc const& desc = inOut[pos].desc;
        if (pos < nbInputs)
        {
            return layerInputSupported(pos, desc, inOut[kQueries].desc.type);
        }
        return desc.format == TensorFormat::kLINEAR && desc.type == DataType::kFLOAT;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return false;
}

size_t CriticalKVScorePlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    try
    {
        size_t const bytes = layerWorkspaceBytes(mConfig, inputs, nbInputs, mExternalScores);
        mWorkspaceBytes = static_cast<int64_t>(bytes);
        return bytes;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    mWorkspaceBytes = 0; // TensorRT allocates nothing: every enqueue that needs a workspace refuses
    return 0;
}

int32_t CriticalKVScorePlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        check(in != nullptr && out != nullptr, "onShapeChange: null descriptors");
        check(nbOutputs == getNbOutputs(), "expected " + std::to_string(getNbOutputs()) + " outputs");
        SelectShape const s = layerShapeOf(in, nbInputs, mExternalScores);
        checkWindowQueries(mConfig, s);
        Dims want{};
        want.nbDims = 3;
        want.d[0] = s.batch;
        want.d[1] = s.kvHeads;
        want.d[2] = s.n - windowLength(mConfig, s.n);
        for (int32_t i = 0; i < nbOutputs; ++i)
        {
            check(sameDims(out[i].dims, want), std::string(i == 0 ? "ranking" : "critical") + ": expected shape "
                    + dimsText(want) + " [B, H_kv, n - min(window, n)], got " + dimsText(out[i].dims));
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

int32_t CriticalKVScorePlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept
{
    // queries        [B, H, w', d_h]     fp32/fp16/bf16
    // keys, values   [B, H_kv, n, d_h]   same type
    // o_proj_weight  [hidden, H * d_h]   same type
    // prompt_lengths [B]                 int32 (optional input 4)
    // kv_budget      [1]                 int32 (optional input 5)
    // scores         [B, H_kv, n]        fp32 (input 6, the kvzip pair only)
    // ranking [B, H_kv, m] fp32, critical [B, H_kv, m] fp32 (layer-kvzip-criticalkv), m = n - min(window, n)
    try
    {
        check(inputDesc != nullptr && inputs != nullptr && outputs != nullptr, "enqueue: null arguments");
        check(validLayerInputCount(mNbInputs, mExternalScores), "enqueue: onShapeChange was not called");
        SelectShape const s = layerShapeOf(inputDesc, mNbInputs, mExternalScores);
        LayerRankingTensors t{};
        fillLayerInputs(t, inputDesc, inputs, mNbInputs);
        t.ranking = static_cast<float*>(outputs[0]);
        t.attention = nullptr; // the model node refines by the ranking (equal to the base score beyond the sinks)
        t.critical = mRefined ? static_cast<float*>(outputs[1]) : nullptr;
        size_t const bytes = checkWorkspace(workspace, workspaceLayout(mConfig, s).total);
        cudaError_t const status = launchLayerRanking(mConfig, budgetTable(mPolicy), s, t, workspace, bytes, stream);
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

// ------------------------------------------------------------------------------------------------ CriticalKVSelectModel

CriticalKVSelectModelPlugin::CriticalKVSelectModelPlugin(std::string layerName, std::string pluginNamespace,
    PolicyConfig const& policy, std::vector<int32_t> capacities)
    : ModelLevelPluginBase(std::move(layerName), std::move(pluginNamespace), policy)
    , mCapacities(std::move(capacities))
{
    check(static_cast<int32_t>(mCapacities.size()) == policy.num_layers,
        "capacities: " + std::to_string(mCapacities.size()) + " values for num_layers " + std::to_string(policy.num_layers)
            + " (one per layer)");
    for (size_t l = 0; l < mCapacities.size(); ++l)
    {
        check(mCapacities[l] >= 1, "capacities[" + std::to_string(l) + "]: " + std::to_string(mCapacities[l])
                + " (a head's output holds at least one entry)");
    }
    mMetadata += ", capacities=[";
    for (size_t l = 0; l < mCapacities.size(); ++l)
    {
        mMetadata += (l ? "," : "") + std::to_string(mCapacities[l]);
    }
    mMetadata += "]";
}

IPluginV3* CriticalKVSelectModelPlugin::clone() noexcept
{
    try
    {
        return std::make_unique<CriticalKVSelectModelPlugin>(*this).release();
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return nullptr;
}

char const* CriticalKVSelectModelPlugin::getPluginName() const noexcept
{
    return kModelPluginName;
}

int32_t CriticalKVSelectModelPlugin::getNbOutputs() const noexcept
{
    return 4 * layers();
}

ModelShape CriticalKVSelectModelPlugin::shapeFromDims(Dims const* dims, int32_t nbInputs) const
{
    int32_t const L = layers();
    check(nbInputs == expectedInputs(),
        "expected " + std::to_string(expectedInputs()) + " inputs (ranking.0.." + std::to_string(L - 1)
            + (mRefined ? ", critical.*" : "") + ", keys.*, values.*, prompt_lengths, kv_budget), got "
            + std::to_string(nbInputs));
    Dims const& keys = dims[keysInput()];
    check(keys.nbDims == 4, "keys.0: expected [B, H_kv, n, d_h]");
    for (int32_t l = 0; l < L; ++l)
    {
        check(sameDims(dims[keysInput() + l], keys), "keys." + std::to_string(l) + ": shape "
                + dimsText(dims[keysInput() + l]) + " differs from keys.0's " + dimsText(keys));
        check(sameDims(dims[keysInput() + L + l], keys), "values." + std::to_string(l) + ": shape "
                + dimsText(dims[keysInput() + L + l]) + " differs from keys.0's " + dimsText(keys));
    }
    ModelShape shape{};
    SelectShape& s = shape.layer;
    s.batch = toInt32(keys.d[0], "batch");
    s.kvHeads = toInt32(keys.d[1], "kv heads");
    s.heads = s.kvHeads;
    s.n = toInt32(keys.d[2], "n");
    s.headDim = toInt32(keys.d[3], "head dim");
    s.queryLen = windowLength(mConfig, s.n);
    check(s.n > 0, "keys: the prompt is empty (n = 0); there is nothing to select from");
    check(s.kvHeads > 0, "keys: no KV heads");
    check(s.headDim >= 1 && s.headDim <= kMaxHeadDim,
        "keys: head dim " + std::to_string(s.headDim) + " is outside [1, " + std::to_string(kMaxHeadDim) + "]");
    shape.layers = L;
    Dims older{};
    older.nbDims = 3;
    older.d[0] = s.batch;
    older.d[1] = s.kvHeads;
    older.d[2] = s.n - windowLength(mConfig, s.n);
    for (int32_t i = 0; i < keysInput(); ++i)
    {
        std::string const name = (i < L ? "ranking." : "critical.") + std::to_string(i % L);
        check(sameDims(dims[i], older), name + ": expected shape " + dimsText(older)
                + " [B, H_kv, n - min(window, n)], got " + dimsText(dims[i]));
    }
    int32_t const lengths = keysInput() + 2 * L;
    check(dims[lengths].nbDims == 1 && dims[lengths].d[0] == s.batch, "prompt_lengths: expected shape [B]");
    check(dims[lengths + 1].nbDims == 1 && dims[lengths + 1].d[0] == 1, "kv_budget: expected shape [1]");
    return shape;
}

int32_t CriticalKVSelectModelPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        check(in != nullptr && out != nullptr, "configurePlugin: null descriptors");
        check(nbInputs == expectedInputs(), "expected " + std::to_string(expectedInputs()) + " inputs, got "
                + std::to_string(nbInputs));
        check(nbOutputs == getNbOutputs(), "expected " + std::to_string(getNbOutputs()) + " outputs, got "
                + std::to_string(nbOutputs));
        // Structure only: dims may hold -1 (dynamic) here; enqueue checks the concrete shapes.
        Dims const& keys = in[keysInput()].desc.dims;
        check(keys.nbDims == 4, "keys.0: expected [B, H_kv, n, d_h]");
        for (int32_t i = 0; i < keysInput() + 2 * layers(); ++i)
        {
            Dims const& d = in[i].desc.dims;
            bool const ranked = i < keysInput();
            check(d.nbDims == (ranked ? 3 : 4), (ranked ? "rankings must be 3-D" : "keys and values must be 4-D"));
            for (int32_t a = 0; a < (ranked ? 2 : 4); ++a)
            {
                check(!knownAndDifferent(d.d[a], keys.d[a]), "input " + std::to_string(i) + ": shape "
                        + dimsText(d) + " does not match keys.0's " + dimsText(keys));
            }
        }
        mNbInputs = nbInputs;
        if (maxDimsKnown(in, nbInputs)) // the workspace TensorRT will allocate (CriticalKVSelectPlugin::configurePlugin)
        {
            std::vector<Dims> maxDims(static_cast<size_t>(nbInputs));
            for (int32_t i = 0; i < nbInputs; ++i)
            {
                maxDims[static_cast<size_t>(i)] = in[i].max;
            }
            mWorkspaceBytes = static_cast<int64_t>(modelBuffers(mConfig, shapeFromDims(maxDims.data(), nbInputs),
                mRefined).total);
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return -1;
}

int32_t CriticalKVSelectModelPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    try
    {
        check(outputTypes != nullptr && inputTypes != nullptr, "getOutputDataTypes: null arrays");
        check(nbOutputs == getNbOutputs(), "expected " + std::to_string(getNbOutputs()) + " outputs");
        check(nbInputs == expectedInputs(), "expected " + std::to_string(expectedInputs()) + " inputs, got "
                + std::to_string(nbInputs));
        DataType const t = inputTypes[keysInput()];
        check(isFloatType(t), "keys.0: expected fp32, fp16 or bf16");
        for (int32_t i = 0; i < keysInput(); ++i)
        {
            check(inputTypes[i] == DataType::kFLOAT, "rankings: expected fp32");
        }
        for (int32_t l = 0; l < layers(); ++l)
        {
            outputTypes[4 * l + 0] = t;
            outputTypes[4 * l + 1] = t;
            outputTypes[4 * l + 2] = DataType::kINT32;
            outputTypes[4 * l + 3] = DataType::kINT32;
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return -1;
}

int32_t CriticalKVSelectModelPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
    IExprBuilder& exprBuilder) noexcept
{
    try
    {
        check(inputs != nullptr && outputs != nullptr, "getOutputShapes: null arrays");
        check(nbInputs == expectedInputs(), "expected " + std::to_string(expectedInputs()) + " inputs, got "
                + std::to_string(nbInputs));
        check(nbOutputs == getNbOutputs(), "expected " + std::to_string(getNbOutputs()) + " outputs");
        DimsExprs const& keys = inputs[keysInput()];
        check(keys.nbDims == 4, "keys.0: expected [B, H_kv, n, d_h]");
        for (int32_t l = 0; l < layers(); ++l)
        {
            IDimensionExpr const* capacity = exprBuilder.constant(mCapacities[static_cast<size_t>(l)]);
            check(capacity != nullptr, "getOutputShapes: constant failed");
            IDimensionExpr const* cap = exprBuilder.operation(DimensionOperation::kMIN, *keys.d[2], *capacity);
            check(cap != nullptr, "getOutputShapes: min(n, capacity) failed");
            for (int32_t i : {0, 1})
            {
                DimsExprs& o = outputs[4 * l + i];
                o.nbDims = 4;
                o.d[0] = keys.d[0];
                o.d[1] = keys.d[1];
                o.d[2] = cap;
                o.d[3] = keys.d[3];
            }
            outputs[4 * l + 2].nbDims = 2;
            outputs[4 * l + 2].d[0] = keys.d[0];
            outputs[4 * l + 2].d[1] = keys.d[1];
            outputs[4 * l + 3].nbDims = 3;
            outputs[4 * l + 3].d[0] = keys.d[0];
            outputs[4 * l + 3].d[1] = keys.d[1];
            outputs[4 * l + 3].d[2] = cap;
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return -1;
}

bool CriticalKVSelectModelPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    try
    {
        check(inOut != nullptr, "supportsFormatCombination: null descriptors");
        check(nbInputs == expectedInputs() && nbOutputs == getNbOutputs(),
            "expected " + std::to_string(expectedInputs()) + " inputs and " + std::to_string(getNbOutputs())
                + " outputs");
        check(pos >= 0 && pos < nbInputs + nbOutputs, "supportsFormatCombination: position out of range");
        PluginTensorDesc const& desc = inOut[pos].desc;
        if (desc.format != TensorFormat::kLINEAR)
        {
            return false;
        }
        int32_t const keys = keysInput();
        if (pos < keys)
        {
            return desc.type == DataType::kFLOAT; // rankings, critical scores
        }
        if (pos == keys)
        {
            return isFloatType(desc.type);
        }
        DataType const t = inOut[keys].desc.type;
        if (pos < nbInputs)
        {
            return pos < keys + 2 * layers() ? desc.type == t : desc.type == DataType::kINT32;
        }
        int32_t const out = (pos - nbInputs) % 4;
        return out < 2 ? desc.type == t : desc.type == DataType::kINT32;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return false;
}

size_t CriticalKVSelectModelPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    try
    {
        check(inputs != nullptr, "getWorkspaceSize: null descriptors");
        check(nbInputs == expectedInputs(), "expected " + std::to_string(expectedInputs()) + " inputs, got "
                + std::to_string(nbInputs));
        std::vector<Dims> maxDims(static_cast<size_t>(nbInputs));
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            maxDims[static_cast<size_t>(i)] = inputs[i].max;
        }
        size_t const bytes = modelBuffers(mConfig, shapeFromDims(maxDims.data(), nbInputs), mRefined).total;
        mWorkspaceBytes = static_cast<int64_t>(bytes);
        return bytes;
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    mWorkspaceBytes = 0; // TensorRT allocates nothing: every enqueue that needs a workspace refuses
    return 0;
}

int32_t CriticalKVSelectModelPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        check(in != nullptr && out != nullptr, "onShapeChange: null descriptors");
        check(nbOutputs == getNbOutputs(), "expected " + std::to_string(getNbOutputs()) + " outputs");
        std::vector<Dims> dims(static_cast<size_t>(nbInputs > 0 ? nbInputs : 0));
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            dims[static_cast<size_t>(i)] = in[i].dims;
        }
        ModelShape const shape = shapeFromDims(dims.data(), nbInputs);
        for (int32_t l = 0; l < layers(); ++l)
        {
            Dims const& indices = out[4 * l + 3].dims;
            int32_t const capacity = mCapacities[static_cast<size_t>(l)];
            int32_t const cap = shape.layer.n < capacity ? shape.layer.n : capacity;
            check(indices.nbDims == 3 && indices.d[2] == cap,
                "kept_indices." + std::to_string(l) + ": unexpected shape " + dimsText(indices));
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

int32_t CriticalKVSelectModelPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept
{
    // ranking.l, critical.l (refined)  [B, H_kv, m]       fp32, m = n - min(window, n)
    // keys.l, values.l                 [B, H_kv, n, d_h]  fp32/fp16/bf16
    // prompt_lengths [B] int32, kv_budget [1] int32
    // per layer l: kept_keys.l, kept_values.l [B, H_kv, cap_l, d_h], kept_lengths.l [B, H_kv] int32,
    //              kept_indices.l [B, H_kv, cap_l] int32, cap_l = min(n, capacities[l])
    try
    {
        check(inputDesc != nullptr && inputs != nullptr && outputs != nullptr, "enqueue: null arguments");
        check(mNbInputs == expectedInputs(), "enqueue: onShapeChange was not called");
        int32_t const L = layers();
        std::vector<Dims> dims(static_cast<size_t>(mNbInputs));
        for (int32_t i = 0; i < mNbInputs; ++i)
        {
            dims[static_cast<size_t>(i)] = inputDesc[i].dims;
        }
        ModelShape const shape = shapeFromDims(dims.data(), mNbInputs);
        SelectShape const& s = shape.layer;
        ModelBuffers const buffers = modelBuffers(mConfig, shape, mRefined);
        size_t const bytes = checkWorkspace(workspace, buffers.total);
        auto* base = static_cast<unsigned char*>(workspace);
        float* ranking = reinterpret_cast<float*>(base + buffers.ranking);
        float* critical = mRefined ? reinterpret_cast<float*>(base + buffers.critical) : nullptr;
        // every layer's [B, H_kv, m] rows into the model's [B, L H_kv, m], layer-major inside each sequence
        size_t const rowBytes = static_cast<size_t>(s.kvHeads) * static_cast<size_t>(s.n - windowLength(mConfig, s.n))
            * sizeof(float);
        for (int32_t l = 0; l < L && rowBytes > 0; ++l)
        {
            for (int32_t part = 0; part < (mRefined ? 2 : 1); ++part)
            {
                float* target = part == 0 ? ranking : critical;
                cudaError_t const copied = cudaMemcpy2DAsync(reinterpret_cast<unsigned char*>(target) + l * rowBytes,
                    L * rowBytes, inputs[part * L + l], rowBytes, rowBytes, static_cast<size_t>(s.batch),
                    cudaMemcpyDeviceToDevice, stream);
                check(copied == cudaSuccess, std::string("enqueue (") + mLayerName + "): " + cudaGetErrorName(copied));
            }
        }
        std::vector<ModelLayerTensors> layerTensors(static_cast<size_t>(L));
        for (int32_t l = 0; l < L; ++l)
        {
            ModelLayerTensors& t = layerTensors[static_cast<size_t>(l)];
            t.keys = inputs[keysInput() + l];
            t.values = inputs[keysInput() + L + l];
            t.keptKeys = outputs[4 * l + 0];
            t.keptValues = outputs[4 * l + 1];
            t.keptLengths = static_cast<int32_t*>(outputs[4 * l + 2]);
            t.keptIndices = static_cast<int32_t*>(outputs[4 * l + 3]);
            t.capacity = mCapacities[static_cast<size_t>(l)];
        }
        ModelSelectTensors t{};
        t.dtype = toDType(inputDesc[keysInput()].type, "keys.0");
        t.promptLengths = static_cast<int32_t const*>(inputs[keysInput() + 2 * L]);
        t.kvBudget = static_cast<int32_t const*>(inputs[keysInput() + 2 * L + 1]);
        t.ranking = ranking;
        // CriticalKV's stage 1 ranks each head's entries beyond its allocated sinks by the base's score: the ranking
        // there (sinkRanking adds 0 beyond the sinks, and every sink is allocated: head_cap_ratio is 0 or >= 1)
        t.attention = mRefined ? ranking : nullptr;
        t.critical = critical;
        t.layers = layerTensors.data();
        cudaError_t const status = launchModelSelect(
            mConfig, shape, t, base + buffers.select, bytes - buffers.select, stream);
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

PluginFieldCollection const* CriticalKVSelectModelPlugin::getFieldsToSerialize() noexcept
{
    try
    {
        serializePolicy(layerOnlyField);
        addSerializedField(mDataToSerialize, kCapacities, mCapacities);
        return serializeWorkspace();
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return nullptr;
}

// ------------------------------------------------------------------------------------------------ creator

ModelLevelCreator::ModelLevelCreator(bool model, char const* pluginNamespace)
    : mModel(model)
    , mNamespace(pluginNamespace != nullptr ? pluginNamespace : "")
{
    // CriticalKVScore: CriticalKVSelect's fields; CriticalKVSelectModel: the knobs, num_layers and capacities
#define CKV_ADVERTISE_FIELD(kind, fieldName, defaultValue)                                                             \
    if (!mModel || !layerOnlyField(#fieldName))                                                                        \
    {                                                                                                                  \
        mFields.emplace_back(#fieldName, nullptr, CKV_PLUGIN_FIELD_TYPE_##kind, 1);                                    \
    }
    CKV_FOR_EACH_PLUGIN_FIELD(CKV_ADVERTISE_FIELD)
#undef CKV_ADVERTISE_FIELD
    if (mModel)
    {
        mFields.emplace_back(kCapacities, nullptr, PluginFieldType::kINT32, 1);
    }
    mFC.nbFields = static_cast<int32_t>(mFields.size());
    mFC.fields = mFields.data();
}

char const* ModelLevelCreator::getPluginName() const noexcept
{
    return mModel ? kModelPluginName : kScorePluginName;
}

char const* ModelLevelCreator::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* ModelLevelCreator::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

PluginFieldCollection const* ModelLevelCreator::getFieldNames() noexcept
{
    return &mFC;
}

IPluginV3* ModelLevelCreator::createPlugin(char const* name, PluginFieldCollection const* fc, TensorRTPhase phase) noexcept
{
    try
    {
        std::string const layerName = name != nullptr ? std::string(name, strnlen(name, 1024)) : std::string();
        std::string const where = std::string(getPluginName()) + " (" + layerName + "): ";
        std::vector<FieldView> views = fieldViews(fc, where);
        std::optional<int64_t> const workspace = takeWorkspaceField(views, where);
        if (phase == TensorRTPhase::kRUNTIME)
        {
            // A deserialised plugin must carry every field it serialised: the advertised ones and the workspace's size.
            check(fc->nbFields == mFC.nbFields + 1 && workspace.has_value(),
                where + "serialized plugin has " + std::to_string(fc->nbFields) + " fields, expected "
                    + std::to_string(mFC.nbFields + 1) + " (the advertised ones and " + kWorkspaceField
                    + "; an engine built by an older plugin library must be rebuilt)");
        }
        std::vector<int32_t> capacities;
        int32_t const one = 1; // the model node's capacities are per layer: the policy's own capacity is unused
        if (mModel)
        {
            std::vector<FieldView> knobs;
            bool found = false;
            for (FieldView const& view : views)
            {
                std::string const field = view.name != nullptr ? std::string(view.name, strnlen(view.name, 256)) : "";
                if (field == kCapacities)
                {
                    std::string error;
                    check(!found, where + "capacities: given twice");
                    check(detail::readField(view, capacities, error), where + error);
                    found = true;
                    continue;
                }
                check(!layerOnlyField(field.c_str()), where + "unknown field '" + field + "'; " + kModelPluginName
                        + " takes the KVPolicy knobs, num_layers and capacities (one per layer)");
                knobs.push_back(view);
            }
            check(found, where + "capacities: missing (one output capacity per layer)");
            knobs.push_back(FieldView{"capacity", &one, FieldType::kInt32, 1});
            views = std::move(knobs);
        }
        PolicyConfig policy;
        std::string error;
        if (!parsePolicyFields(views.data(), static_cast<int32_t>(views.size()), policy, error, PolicyUse::kKernels))
        {
            logError(where + error);
            return nullptr;
        }
        std::unique_ptr<PluginBase> plugin;
        if (mModel)
        {
            plugin = std::make_unique<CriticalKVSelectModelPlugin>(layerName, mNamespace, policy, capacities);
        }
        else
        {
            plugin = std::make_unique<CriticalKVScorePlugin>(layerName, mNamespace, policy);
        }
        if (workspace.has_value())
        {
            plugin->setWorkspaceBytes(*workspace);
        }
        return plugin.release();
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return nullptr;
}

} // namespace criticalkv::trt
