// The CriticalKVSelect TensorRT plugin (IPluginV3: IPluginV3OneCore / OneBuild / OneRuntime) and its creator.
//
// Inputs (see docs/kernels.md, "The node and the plugin", and docs/operator.md):
//   0 queries [B, H, w', d_h]  1 keys [B, H_kv, n, d_h]  2 values [B, H_kv, n, d_h]  3 o_proj_weight [d, H*d_h]
//   4 prompt_lengths [B] int32 (optional: without it every sequence has n tokens)
//   5 kv_budget [1] int32 (optional, needs input 4: the request's budget, clamped to [window, budget]; read on the
//     device, so enqueue never waits for it)
//   6 scores [B, H_kv, n] fp32 (the kvzip pair, which then takes all seven inputs; no other policy takes it): the
//     per-entry scores the graph computed (the KVzip surrogate's, or a context reconstruction's)
// Outputs, cap = min(n, capacity):
//   0 kept_keys [B, H_kv, cap, d_h]  1 kept_values [B, H_kv, cap, d_h]  2 kept_lengths [B, H_kv] int32
//   3 kept_indices [B, H_kv, cap] int32
// Float tensors are all fp32, all fp16 or all bf16 (scores: always fp32), linear layout.
#pragma once

#include "pluginBase.h"

#include <NvInferRuntime.h>

#include <string>
#include <vector>

namespace criticalkv::trt
{

constexpr char const* kPluginName = "CriticalKVSelect";

class CriticalKVSelectPlugin : public PluginBase
{
public:
    //! Throws std::invalid_argument when the policy does not validate.
    CriticalKVSelectPlugin(std::string layerName, std::string pluginNamespace, PolicyConfig const& policy);

    // IPluginV3
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;

    // IPluginV3OneBuild
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

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
};

class CriticalKVSelectCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    explicit CriticalKVSelectCreator(char const* pluginNamespace);
    ~CriticalKVSelectCreator() override = default;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    //! nullptr (and an error through the logger) for missing, unknown, mistyped, malformed or out-of-range fields.
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;

private:
    std::string mNamespace;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFC{};
};

} // namespace criticalkv::trt
