// What the CriticalKV TensorRT plugins share: the layer inputs of CriticalKVSelect and CriticalKVScore (indices, count,
// shape and format rules), type and field conversions, and the serialization of the generated policy fields.
#pragma once

#include "policy.h"
#include "criticalkv/select_params.h"

#include <NvInferRuntime.h>

#include <string>
#include <vector>

namespace criticalkv::trt
{

constexpr char const* kPluginDomain = "ai.criticalkv";

//! The inputs of one layer's node (criticalkv.node.INPUTS, then SCORES_INPUT for the kvzip pair).
enum LayerInput : int32_t
{
    kQueries = 0,
    kKeys = 1,
    kValues = 2,
    kOProj = 3,
    kPromptLengths = 4,
    kKvBudget = 5,
    kScores = 6,
};

constexpr int32_t kMinLayerInputs = 4;
constexpr int32_t kMaxLayerInputs = 7;

//! A policy that ranks by external scores (the kvzip pair) takes all seven inputs, the scores last; any other 4 to 6.
bool validLayerInputCount(int32_t nbInputs, bool externalScores);
std::string layerInputCountError(int32_t nbInputs, bool externalScores);

bool isFloatType(nvinfer1::DataType type);
//! The kernels' dtype of a float tensor; throws naming `what` for another type.
DType toDType(nvinfer1::DataType type, char const* what);
FieldType toFieldType(nvinfer1::PluginFieldType type);
int32_t toInt32(int64_t value, char const* what);
bool knownAndDifferent(int64_t a, int64_t b);

//! The kernels' shape from a layer node's concrete input dims (throws on an inconsistent or unsupported combination).
SelectShape layerShapeFromDims(nvinfer1::Dims const* dims, int32_t nbInputs, bool externalScores);

//! The kernels' shape from a layer node's concrete input descriptors (onShapeChange, enqueue).
SelectShape layerShapeOf(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, bool externalScores);

//! The queries hold at least min(window, n) window queries (throws otherwise).
void checkWindowQueries(SelectConfig const& config, SelectShape const& shape);

//! getWorkspaceSize of a layer node: launchCriticalKVSelect's workspace (launchLayerRanking's too) for the profile's
//! max shapes.
size_t layerWorkspaceBytes(SelectConfig const& config, nvinfer1::DynamicPluginTensorDesc const* inputs,
    int32_t nbInputs, bool externalScores);

//! Whether every input's largest dims are concrete (TensorRT's configurePlugin gives the profile's maxima; a harness may
//! give -1).
bool maxDimsKnown(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs);

//! A layer node's input pointers into a launch's tensors (SelectTensors, LayerRankingTensors); `count` inputs given.
template <typename Tensors>
void fillLayerInputs(Tensors& t, nvinfer1::PluginTensorDesc const* desc, void const* const* inputs, int32_t count)
{
    t.dtype = toDType(desc[kQueries].type, "queries");
    t.queries = inputs[kQueries];
    t.keys = inputs[kKeys];
    t.values = inputs[kValues];
    t.oProj = inputs[kOProj];
    t.promptLengths = count > kPromptLengths ? static_cast<int32_t const*>(inputs[kPromptLengths]) : nullptr;
    t.kvBudget = count > kKvBudget ? static_cast<int32_t const*>(inputs[kKvBudget]) : nullptr;
    t.scores = count > kScores ? static_cast<float const*>(inputs[kScores]) : nullptr;
}

//! configurePlugin's structure checks of a layer node's inputs (dims may hold -1 there).
void checkLayerStructure(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs, bool externalScores);

//! Whether layer input `pos` (< nbInputs) may have `desc`'s type, the float type being queries' (linear layout only).
bool layerInputSupported(int32_t pos, nvinfer1::PluginTensorDesc const& desc, nvinfer1::DataType floatType);

//! Every field of a creator's collection as the parser's views, after the collection's own sanity checks.
std::vector<FieldView> fieldViews(nvinfer1::PluginFieldCollection const* fc, std::string const& where);

//! The layer fields' count a deserialised node carries (every generated plugin field).
int32_t serializedLayerFieldCount();

void addSerializedField(std::vector<nvinfer1::PluginField>& fields, char const* name, std::string const& value);
void addSerializedField(std::vector<nvinfer1::PluginField>& fields, char const* name, int32_t const& value);
void addSerializedField(std::vector<nvinfer1::PluginField>& fields, char const* name, std::vector<int32_t> const& values);
void addSerializedField(std::vector<nvinfer1::PluginField>& fields, char const* name, double const& value);

//! The TensorRT field type of a generated field kind (STRING, INT, FLOAT, INTS).
#define CKV_PLUGIN_FIELD_TYPE_STRING nvinfer1::PluginFieldType::kCHAR
#define CKV_PLUGIN_FIELD_TYPE_INT nvinfer1::PluginFieldType::kINT32
#define CKV_PLUGIN_FIELD_TYPE_FLOAT nvinfer1::PluginFieldType::kFLOAT32
#define CKV_PLUGIN_FIELD_TYPE_INTS nvinfer1::PluginFieldType::kINT32

} // namespace criticalkv::trt
