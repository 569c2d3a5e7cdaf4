// Logging and error handling of the CriticalKV TensorRT plugin library (NVIDIA plugin conventions: every
// noexcept entry point catches std::exception and reports it through the logger TensorRT gives us).
#pragma once

#include <NvInferRuntime.h>

#include <exception>
#include <stdexcept>
#include <string>

namespace criticalkv::trt
{

//! The logger of the engine / builder calling into the plugin (set through setLoggerFinder), or nullptr.
nvinfer1::ILogger* pluginLogger() noexcept;

//! Log `message` with `severity` to the TensorRT logger, or to stderr when none was set.
void logMessage(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept;

inline void logError(std::string const& message) noexcept
{
    logMessage(nvinfer1::ILogger::Severity::kERROR, message);
}

//! Report an exception caught at an API boundary.
inline void caughtError(std::exception const& e) noexcept
{
    logError(std::string("criticalkv plugin: ") + e.what());
}

//! Throw std::invalid_argument(message) unless condition holds (caught at the API boundary).
inline void check(bool condition, std::string const& message)
{
    if (!condition)
    {
        throw std::invalid_argument(message);
    }
}

} // namespace criticalkv::trt
