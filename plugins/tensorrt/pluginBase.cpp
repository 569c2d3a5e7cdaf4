#include "pluginBase.h"

#include "pluginUtils.h"

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
        return serializePolicy(nullptr);
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

} // namespace criticalkv::trt
