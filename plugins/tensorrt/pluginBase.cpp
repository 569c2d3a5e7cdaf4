#include "pluginBase.h"

#include "pluginUtils.h"

#include <cstring>
#include <utility>

using namespace nvinfer1;

namespace criticalkv::trt
{

PluginBase::PluginBase(std::string layerName, std::string pluginNamespace, PolicyConfig const& policy, PolicyUse use)
    : mLayerName(std::move(layerName))
    , mNamespace(std::move(pluginNamespace))
    , mPolicy(policy)
    , mConfig(makeSelectConfig(policy, use)) // validates
    , mMetadata(describePolicy(policy))
    , mExternalScores(externalScores(mConfig))
{
}

PluginBase::PluginBase(PluginBase const& other)
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
    , mWorkspaceBytes(other.mWorkspaceBytes)
{
    // mDataToSerialize points into its owner: rebuilt by getFieldsToSerialize, never copied.
}

IPluginCapability* PluginBase::getCapabilityInterface(PluginCapabilityType type) noexcept
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

char const* PluginBase::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* PluginBase::getPluginNamespace() const noexcept
{
    return mNamespace.c_str();
}

char const* PluginBase::getTimingCacheID() noexcept
{
    return mMetadata.c_str();
}

char const* PluginBase::getMetadataString() noexcept
{
    return mMetadata.c_str();
}

IPluginV3* PluginBase::attachToContext(IPluginResourceContext* /*context*/) noexcept
{
    return clone();
}

PluginFieldCollection const* PluginBase::getFieldsToSerialize() noexcept
{
    try
    {
        serializePolicy(nullptr);
        return serializeWorkspace();
    }
    catch (std::exception const& e)
    {
        caughtError(e);
    }
    return nullptr;
}

PluginFieldCollection const* PluginBase::serializePolicy(bool (*skip)(char const*))
{
    mDataToSerialize.clear();
#define CKV_SERIALIZE_FIELD(kind, fieldName, defaultValue)                                                             \
    if (skip == nullptr || !skip(#fieldName))                                                                          \
    {                                                                                                                  \
        addSerializedField(mDataToSerialize, #fieldName, mPolicy.fieldName);                                           \
    }
    CKV_FOR_EACH_PLUGIN_FIELD(CKV_SERIALIZE_FIELD)
#undef CKV_SERIALIZE_FIELD
    mFCToSerialize.nbFields = static_cast<int32_t>(mDataToSerialize.size());
    mFCToSerialize.fields = mDataToSerialize.data();
    return &mFCToSerialize;
}

PluginFieldCollection const* PluginBase::serializeWorkspace()
{
    mDataToSerialize.emplace_back(kWorkspaceField, &mWorkspaceBytes, PluginFieldType::kINT64, 1);
    mFCToSerialize.nbFields = static_cast<int32_t>(mDataToSerialize.size());
    mFCToSerialize.fields = mDataToSerialize.data();
    return &mFCToSerialize;
}

size_t PluginBase::checkWorkspace(void const* workspace, size_t need) const
{
    check(mWorkspaceBytes >= 0,
        "enqueue (" + mLayerName + "): the size of the workspace TensorRT allocated is not known (the plugin was "
            "neither configured for a build nor deserialised with " + kWorkspaceField + "): rebuild the engine");
    auto const given = static_cast<size_t>(mWorkspaceBytes);
    check(given >= need,
        "enqueue (" + mLayerName + "): these shapes need " + std::to_string(need) + " bytes of workspace, TensorRT "
            "allocated " + std::to_string(given) + " (getWorkspaceSize at the profile's largest shapes"
            + (given == 0 ? ", which failed when the engine was built" : "") + "): nothing is launched");
    check(workspace != nullptr || need == 0, "enqueue (" + mLayerName + "): null workspace");
    return given;
}

std::optional<int64_t> takeWorkspaceField(std::vector<FieldView>& views, std::string const& where)
{
    std::optional<int64_t> value;
    std::vector<FieldView> kept;
    for (FieldView const& view : views)
    {
        if (view.name == nullptr || strncmp(view.name, kWorkspaceField, 64) != 0)
        {
            kept.push_back(view);
            continue;
        }
        check(!value.has_value(), where + kWorkspaceField + ": given twice");
        check(view.type == FieldType::kInt64 && view.length == 1 && view.data != nullptr,
            where + kWorkspaceField + ": expected one int64");
        int64_t bytes = 0;
        std::memcpy(&bytes, view.data, sizeof(bytes));
        check(bytes >= -1, where + kWorkspaceField + ": " + std::to_string(bytes) + " is not a size");
        value = bytes;
    }
    views = std::move(kept);
    return value;
}

} // namespace criticalkv::trt
