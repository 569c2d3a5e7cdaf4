// What the library's IPluginV3 plugins (CriticalKVSelect, CriticalKVScore, CriticalKVSelectModel) share: the
// capability plumbing, namespace, version, metadata, the parsed policy and its serialization.
#pragma once

#include "layerInputs.h"

#include <NvInferRuntime.h>

#include <string>
#include <vector>

namespace criticalkv::trt
{

constexpr char const* kPluginVersion = "1";

class PluginBase : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
                   public nvinfer1::IPluginV3OneBuild,
                   public nvinfer1::IPluginV3OneRuntime
{
public:
    //! Throws std::invalid_argument when the policy does not validate for `use`.
    PluginBase(std::string layerName, std::string pluginNamespace, PolicyConfig const& policy, PolicyUse use);
    PluginBase(PluginBase const& other);
    PluginBase& operator=(PluginBase const&) = delete;
    ~PluginBase() override = default;

    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    char const* getTimingCacheID() noexcept override;
    char const* getMetadataString() noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    //! Every policy field (a plugin serializing more overrides it, calling serializePolicy).
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

    PolicyConfig const& policy() const noexcept
    {
        return mPolicy;
    }

protected:
    //! The policy's generated fields into mDataToSerialize, but those `skip` names (nullptr: none); the collection.
    nvinfer1::PluginFieldCollection const* serializePolicy(bool (*skip)(char const*));

    std::string mLayerName;
    std::string mNamespace;
    PolicyConfig mPolicy;
    SelectConfig mConfig;
    std::string mMetadata;
    bool mExternalScores{false}; //!< the policy ranks by a scores input (the kvzip pair)
    int32_t mNbInputs{-1};       //!< from configurePlugin / onShapeChange (enqueue is not given it)
    std::vector<nvinfer1::PluginField> mDataToSerialize;
    nvinfer1::PluginFieldCollection mFCToSerialize{};
};

} // namespace criticalkv::trt
