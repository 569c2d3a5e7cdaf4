// What the library's IPluginV3 plugins (CriticalKVSelect, CriticalKVScore, CriticalKVSelectModel) share: the
// capability plumbing, namespace, version, metadata, the parsed policy and its serialization.
#pragma once

#include "layerInputs.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace criticalkv::trt
{

constexpr char const* kPluginVersion = "1";
//! The serialized field (int64, not a policy field) of the workspace TensorRT allocated for a node: what
//! getWorkspaceSize gave at the profile's largest shapes when the engine was built. enqueue is not told the size of
//! the workspace it is given, so the plugin carries it and checks every launch against it.
constexpr char const* kWorkspaceField = "workspace_bytes";

//! Removes kWorkspaceField from `views` and returns its value (nullopt when absent; throws on a malformed one).
std::optional<int64_t> takeWorkspaceField(std::vector<FieldView>& views, std::string const& where);

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
    //! Every policy field and kWorkspaceField (a plugin serializing more overrides it, calling serializePolicy and
    //! serializeWorkspace).
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

    //! The workspace TensorRT allocated for the node (a deserialised plugin's kWorkspaceField).
    void setWorkspaceBytes(int64_t bytes) noexcept
    {
        mWorkspaceBytes = bytes;
    }

    PolicyConfig const& policy() const noexcept
    {
        return mPolicy;
    }

protected:
    //! The policy's generated fields into mDataToSerialize, but those `skip` names (nullptr: none); the collection.
    nvinfer1::PluginFieldCollection const* serializePolicy(bool (*skip)(char const*));
    //! Appends kWorkspaceField to mDataToSerialize; the collection.
    nvinfer1::PluginFieldCollection const* serializeWorkspace();
    //! The workspace bytes enqueue may use: the size TensorRT allocated, after checking that it holds the `need` bytes
    //! of these shapes and that `workspace` is there (throws otherwise: nothing is launched).
    size_t checkWorkspace(void const* workspace, size_t need) const;

    std::string mLayerName;
    std::string mNamespace;
    PolicyConfig mPolicy;
    SelectConfig mConfig;
    std::string mMetadata;
    bool mExternalScores{false}; //!< the policy ranks by a scores input (the kvzip pair)
    int32_t mNbInputs{-1};       //!< from configurePlugin / onShapeChange (enqueue is not given it)
    //! The workspace TensorRT allocates for the node: getWorkspaceSize's value at the profile's largest shapes, recorded
    //! by configurePlugin and getWorkspaceSize at build, then serialized with the engine (kWorkspaceField); 0 when
    //! getWorkspaceSize failed (TensorRT allocates nothing then); -1 not known (nothing is launched).
    mutable int64_t mWorkspaceBytes{-1};
    std::vector<nvinfer1::PluginField> mDataToSerialize;
    nvinfer1::PluginFieldCollection mFCToSerialize{};
};

} // namespace criticalkv::trt
