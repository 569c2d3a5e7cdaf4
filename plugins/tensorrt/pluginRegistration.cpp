// Entry points of libcriticalkv_trt_plugin.so, as NVIDIA/TensorRT plugin/vc: getCreators and setLoggerFinder are
// what `trtexec --dynamicPlugins=...` and IPluginRegistry::loadLibrary look up.
#include "criticalKVSelectPlugin.h"
#include "modelLevelPlugins.h"
#include "pluginUtils.h"

#include <iostream>
#include <mutex>

namespace criticalkv::trt
{
namespace
{

class ThreadSafeLoggerFinder
{
public:
    void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
    {
        std::lock_guard<std::mutex> lock(mMutex);
        if (mLoggerFinder == nullptr && finder != nullptr)
        {
            mLoggerFinder = finder;
        }
    }

    nvinfer1::ILogger* getLogger() noexcept
    {
        std::lock_guard<std::mutex> lock(mMutex);
        return mLoggerFinder != nullptr ? mLoggerFinder->findLogger() : nullptr;
    }

private:
    nvinfer1::ILoggerFinder* mLoggerFinder{nullptr};
    std::mutex mMutex;
};

ThreadSafeLoggerFinder gLoggerFinder;

} // namespace

nvinfer1::ILogger* pluginLogger() noexcept
{
    return gLoggerFinder.getLogger();
}

void logMessage(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept
{
    try
    {
        if (nvinfer1::ILogger* logger = pluginLogger())
        {
            logger->log(severity, message.c_str());
        }
        else if (severity <= nvinfer1::ILogger::Severity::kWARNING)
        {
            std::cerr << message << std::endl;
        }
    }
    catch (...)
    {
        // logging must never throw across the plugin boundary
    }
}

} // namespace criticalkv::trt

//! Two creators of each plugin: namespace "" (what the ONNX parser's plugin fallback looks up by default) and
//! "ai.criticalkv" (the node's ONNX domain, which newer parsers may use as the namespace). CriticalKVSelect first, then
//! the model-level selection's CriticalKVScore and CriticalKVSelectModel.
extern "C" TENSORRTAPI nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    using criticalkv::trt::kPluginDomain;
    static criticalkv::trt::CriticalKVSelectCreator sDefaultNamespace{""};
    static criticalkv::trt::CriticalKVSelectCreator sDomainNamespace{kPluginDomain};
    static criticalkv::trt::ModelLevelCreator sScoreDefault{false, ""};
    static criticalkv::trt::ModelLevelCreator sScoreDomain{false, kPluginDomain};
    static criticalkv::trt::ModelLevelCreator sModelDefault{true, ""};
    static criticalkv::trt::ModelLevelCreator sModelDomain{true, kPluginDomain};
    static nvinfer1::IPluginCreatorInterface* const kCreators[]
        = {&sDefaultNamespace, &sDomainNamespace, &sScoreDefault, &sScoreDomain, &sModelDefault, &sModelDomain};
    nbCreators = static_cast<int32_t>(sizeof(kCreators) / sizeof(kCreators[0]));
    return kCreators;
}

extern "C" TENSORRTAPI void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    criticalkv::trt::gLoggerFinder.setLoggerFinder(finder);
}
