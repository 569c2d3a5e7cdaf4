// The model-level selection as two TensorRT plugins (IPluginV3), for the graph's nodes of
// criticalkv/export/model_select.py (layer-defensivekv, layer-kvzip, layer-kvzip-criticalkv over several layers):
//
// CriticalKVScore, one per layer: CriticalKVSelect's inputs and fields; launchLayerRanking.
//   Inputs:  0 queries [B, H, w', d_h]  1 keys [B, H_kv, n, d_h]  2 values  3 o_proj_weight [hidden, H d_h]
//            4 prompt_lengths [B] int32  5 kv_budget [1] int32 (both optional, as CriticalKVSelect's)
//            6 scores [B, H_kv, n] fp32 (the kvzip pair: required; others: none)
//   Outputs: 0 ranking [B, H_kv, m] fp32, m = n - min(window, n) (zeros for a sequence kept whole)
//            1 critical [B, H_kv, m] fp32 (layer-kvzip-criticalkv only: CriticalKV's critical score of every entry)
//
// CriticalKVSelectModel, once after the last layer: launchModelSelect over every layer's ranking, which stay device
// tensors (the score nodes' outputs) until here.
//   Inputs:  ranking.l [B, H_kv, m] fp32 (L), [critical.l [B, H_kv, m] fp32 (L), layer-kvzip-criticalkv only],
//            keys.l [B, H_kv, n, d_h] (L), values.l (L), prompt_lengths [B] int32, kv_budget [1] int32
//   Outputs: per layer l: kept_keys.l, kept_values.l [B, H_kv, min(n, capacities[l]), d_h], kept_lengths.l [B, H_kv]
//            int32, kept_indices.l [B, H_kv, min(n, capacities[l])] int32
//   Fields:  the KVPolicy knobs, num_layers, capacities (one per layer).
// Float tensors (queries, keys, values, o_proj_weight, kept keys/values) are all fp32, all fp16 or all bf16; rankings
// and scores fp32; linear layout.
#pragma once

#include "pluginBase.h"
#include "criticalkv/model_level.h"

#include <NvInferRuntime.h>

#include <string>
#include <vector>

namespace criticalkv::trt
{

constexpr char const* kScorePluginName = "CriticalKVScore";
constexpr char const* kModelPluginName = "CriticalKVSelectModel";

//! What the two plugins share beyond PluginBase: the kernels' validation, a model-wide config, the refinement.
class ModelLevelPluginBase : public PluginBase
{
public:
    //! Throws std::invalid_argument unless the policy is a model-level one over several layers.
    ModelLevelPluginBase(std::string layerName, std::string pluginNamespace, PolicyConfig const& policy);

protected:
    bool mRefined{false}; //!< CriticalKV's two stages (layer-kvzip-criticalkv): a critical score per layer
};

class CriticalKVScorePlugin : public ModelLevelPluginBase
{
public:
    //! Throws std::invalid_argument unless the policy is a model-level one over several layers.
    CriticalKVScorePlugin(std::string layerName, std::string pluginNamespace, PolicyConfig const& policy);

    nvinfer1::IPluginV3* clone() noexcept override;
    char const* getPluginName() const noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
};

class CriticalKVSelectModelPlugin : public ModelLevelPluginBase
{
public:
    //! Throws std::invalid_argument unless the policy is a model-level one over num_layers > 1 layers with one
    //! capacity (>= 1) per layer.
    CriticalKVSelectModelPlugin(std::string layerName, std::string pluginNamespace, PolicyConfig const& policy,
        std::vector<int32_t> capacities);

    nvinfer1::IPluginV3* clone() noexcept override;
    char const* getPluginName() const noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    int32_t layers() const noexcept
    {
        return static_cast<int32_t>(mCapacities.size());
    }
    //! Index of the first keys input (after the rankings and, refined, the critical scores).
    int32_t keysInput() const noexcept
    {
        return layers() * (mRefined ? 2 : 1);
    }
    int32_t expectedInputs() const noexcept
    {
        return keysInput() + 2 * layers() + 2;
    }
    //! The model's shape from concrete input dims (throws on an inconsistent combination).
    ModelShape shapeFromDims(nvinfer1::Dims const* dims, int32_t nbInputs) const;

    std::vector<int32_t> mCapacities;
};

//! The creator of CriticalKVScore (the fields of CriticalKVSelect) or CriticalKVSelectModel (the knobs, num_layers,
//! capacities).
class ModelLevelCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    ModelLevelCreator(bool model, char const* pluginNamespace);
    ~ModelLevelCreator() override = default;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    //! nullptr (and an error through the logger) for missing, unknown, mistyped, malformed or out-of-range fields, or
    //! a policy that does not select at model level.
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;

private:
    bool mModel;
    std::string mNamespace;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFC{};
};

} // namespace criticalkv::trt
