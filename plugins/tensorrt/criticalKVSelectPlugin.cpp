#include "criticalKVSelectPlugin.h"

#include "criticalkv/kernels.h"
#include "pluginUtils.h"

#include <memory>
#include <utility>

using namespace nvinfer1;

namespace criticalkv::trt
{
namespace
{

constexpr int32_t kNbOutputs = 4;

enum OutputIndex : int32_t
{
    kKeptKeys = 0,
    kKeptValues = 1,
    kKeptLengths = 2,
    kKeptIndices = 3,
};

} // namespace

// ------------------------------------------------------------------------------------------------ plugin

CriticalKVSelectPlugin::CriticalKVSelectPlugin(std::string layerName, std::string pluginNamespace, PolicyConfig const& policy)
    : PluginBase(std::move(layerName), std::move(pluginNamespace), policy, PolicyUse::kPlugin)
{
    check(!mConfig.modelWide,
        "name: " + policy.name + " shares the budget across all layers: its graph holds a CriticalKVScore node per "
            "layer and one CriticalKVSelectModel node, not CriticalKVSelect");
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

int32_t CriticalKVSelectPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        check(in != nullptr && out != nullptr, "configurePlugin: null descriptors");
        check(validLayerInputCount(nbInputs, mExternalScores), layerInputCountError(nbInputs, mExternalScores));
        check(nbOutputs == kNbOutputs, "expected 4 outputs, got " + std::to_string(nbOutputs));
        // Structure only: dims may hold -1 (dynamic) here; enqueue checks the concrete shapes.
        checkLayerStructure(in, nbInputs, mExternalScores);
        mNbInputs = nbInputs;
        // the workspace TensorRT will allocate (getWorkspaceSize at the profile's largest shapes, concrete here): a
        // profile the kernels cannot take fails the build now, and every enqueue is checked against it
        if (maxDimsKnown(in, nbInputs))
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

int32_t CriticalKVSelectPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    try
    {
        check(outputTypes != nullptr && inputTypes != nullptr, "getOutputDataTypes: null arrays");
        check(nbOutputs == kNbOutputs, "expected 4 outputs");
        check(validLayerInputCount(nbInputs, mExternalScores), layerInputCountError(nbInputs, mExternalScores));
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
        check(validLayerInputCount(nbInputs, mExternalScores), layerInputCountError(nbInputs, mExternalScores));
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
        check(validLayerInputCount(nbInputs, mExternalScores) && nbOutputs == kNbOutputs,
            layerInputCountError(nbInputs, mExternalScores) + " and 4 outputs");
        check(pos >= 0 && pos < nbInputs + nbOutputs, "supportsFormatCombination: position out of range");
        PluginTensorDesc const& desc = inOut[pos].desc;
        if (pos < nbInputs)
        {
            return layerInputSupported(pos, desc, inOut[kQueries].desc.type);
        }
        if (desc.format != TensorFormat::kLINEAR)
        {
            return false;
        }
        int32_t const out = pos - nbInputs;
        return out == kKeptLengths || out == kKeptIndices ? desc.type == DataType::kINT32
                                                          : desc.type == inOut[kQueries].desc.type;
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

int32_t CriticalKVSelectPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        check(in != nullptr && out != nullptr, "onShapeChange: null descriptors");
        check(nbOutputs == kNbOutputs, "expected 4 outputs");
        SelectShape const s = layerShapeOf(in, nbInputs, mExternalScores);
        checkWindowQueries(mConfig, s);
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
    // workspace      the bytes TensorRT allocated (mWorkspaceBytes), checked against what these shapes need
    try
    {
        check(inputDesc != nullptr && outputDesc != nullptr && inputs != nullptr && outputs != nullptr,
            "enqueue: null arguments");
        // TensorRT does not pass the input count to enqueue: onShapeChange (always called with the concrete
        // shapes before the first enqueue, as NVIDIA's ROIAlign plugin relies on) recorded it.
        check(validLayerInputCount(mNbInputs, mExternalScores), "enqueue: onShapeChange was not called");
        SelectShape const s = layerShapeOf(inputDesc, mNbInputs, mExternalScores);
        SelectTensors t{};
        fillLayerInputs(t, inputDesc, inputs, mNbInputs);
        t.keptKeys = outputs[kKeptKeys];
        t.keptValues = outputs[kKeptValues];
        t.keptLengths = static_cast<int32_t*>(outputs[kKeptLengths]);
        t.keptIndices = static_cast<int32_t*>(outputs[kKeptIndices]);
        // t.prunedTerms stays null: the pruned stage 2's weights-only terms are recomputed at every enqueue (on the
        // tensor cores, one pass over o_proj), since a plugin cannot tell that its o_proj input keeps its content from
        // one enqueue to the next (a refitted engine, or o_proj not a constant of the graph) and a key by address alone
        // would then keep stale terms. The torch op's callers can reuse them (launchPrunedTerms, ckv_ops_pruned_terms).
        size_t const bytes = checkWorkspace(workspace, workspaceLayout(mConfig, s).total);
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

// ------------------------------------------------------------------------------------------------ creator

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
        std::vector<FieldView> views = fieldViews(fc, where);
        std::optional<int64_t> const workspace = takeWorkspaceField(views, where);
        PolicyConfig policy;
        std::string error;
        if (!parsePolicyFields(views.data(), static_cast<int32_t>(views.size()), policy, error))
        {
            logError(where + error);
            return nullptr;
        }
        if (phase == TensorRTPhase::kRUNTIME)
        {
            // A deserialised plugin must carry every field it serialised: the policy's and the workspace's size.
            check(fc->nbFields == serializedLayerFieldCount() + 1 && workspace.has_value(),
                where + "serialized plugin has " + std::to_string(fc->nbFields) + " fields, expected "
                    + std::to_string(serializedLayerFieldCount() + 1) + " (the policy's and " + kWorkspaceField
                    + "; an engine built by an older plugin library must be rebuilt)");
        }
        auto plugin = std::make_unique<CriticalKVSelectPlugin>(layerName, mNamespace, policy);
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
