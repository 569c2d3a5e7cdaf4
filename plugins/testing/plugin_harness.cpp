// Host harness for the CriticalKV plugin library (libcriticalkv_plugin_harness.so, ctypes tests).
//
// It dlopens libcriticalkv_trt_plugin.so the way TensorRT's IPluginRegistry::loadLibrary does (getCreators,
// setLoggerFinder) and drives the creator and plugin through the public IPluginV3 interfaces: field names,
// createPlugin (build and runtime phases), getFieldsToSerialize round trips, clone / attachToContext,
// output types and shapes (through a small constant-folding IExprBuilder), supported formats and workspace
// sizes. Nothing here needs libnvinfer or a GPU. Results come back as JSON text or plain integers.
#include <NvInferRuntime.h>

#include <dlfcn.h>

#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace
{

// ------------------------------------------------------------------------------------------------ logging

class RecordingLogger : public ILogger
{
public:
    void log(Severity severity, AsciiChar const* msg) noexcept override
    {
        std::lock_guard<std::mutex> lock(mMutex);
        mMessages.emplace_back(static_cast<int32_t>(severity), msg != nullptr ? msg : "");
    }

    std::vector<std::pair<int32_t, std::string>> take()
    {
        std::lock_guard<std::mutex> lock(mMutex);
        return std::move(mMessages);
    }

private:
    std::mutex mMutex;
    std::vector<std::pair<int32_t, std::string>> mMessages;
};

class Finder : public ILoggerFinder
{
public:
    explicit Finder(ILogger* logger)
        : mLogger(logger)
    {
    }
    ILogger* findLogger() override
    {
        return mLogger;
    }
    ~Finder() override = default;

private:
    ILogger* mLogger;
};

RecordingLogger gLogger;
Finder gFinder{&gLogger};

// ------------------------------------------------------------------------------------------------ shape exprs

//! A dimension expression that is a constant or a symbol ("B", "n", ...) with folded min/max/sum/...
class FakeExpr : public IDimensionExpr
{
public:
    FakeExpr(bool constant, int64_t value, std::string symbol)
        : mImplObject(constant, value)
        , mSymbol(std::move(symbol))
    {
        mImpl = &mImplObject;
    }
    ~FakeExpr() override = default;

    std::string text() const
    {
        return mImplObject.constant ? std::to_string(mImplObject.value) : mSymbol;
    }

private:
    struct Impl : public apiv::VDimensionExpr
    {
        Impl(bool c, int64_t v)
            : constant(c)
            , value(v)
        {
        }
        bool isConstant() const override
        {
            return constant;
        }
        int64_t getConstantValue() const override
        {
            return constant ? value : std::numeric_limits<int64_t>::min();
        }
        bool isSizeTensor() const override
        {
            return false;
        }
        bool constant;
        int64_t value;
    };
    Impl mImplObject;
    std::string mSymbol;
};

class FakeBuilder : public IExprBuilder
{
public:
    FakeBuilder()
    {
        mImpl = &mImplObject;
        mImplObject.owner = this;
    }
    ~FakeBuilder() override = default;

    FakeExpr const* make(bool constant, int64_t value, std::string symbol)
    {
        mExprs.push_back(std::make_unique<FakeExpr>(constant, value, std::move(symbol)));
        return mExprs.back().get();
    }

private:
    struct Impl : public apiv::VExprBuilder
    {
        IDimensionExpr const* constant(int64_t value) override
        {
            return owner->make(true, value, "");
        }
        IDimensionExpr const* operation(
            DimensionOperation op, IDimensionExpr const& first, IDimensionExpr const& second) override
        {
            auto const* a = dynamic_cast<FakeExpr const*>(&first);
            auto const* b = dynamic_cast<FakeExpr const*>(&second);
            if (a == nullptr || b == nullptr)
            {
                return nullptr;
            }
            static char const* names[] = {"sum", "prod", "max", "min", "sub", "eq", "less", "floordiv", "ceildiv"};
            int32_t const index = static_cast<int32_t>(op);
            if (index < 0 || index > 8)
            {
                return nullptr;
            }
            if (first.isConstant() && second.isConstant())
            {
                int64_t const x = first.getConstantValue();
                int64_t const y = second.getConstantValue();
                int64_t r = 0;
                switch (op)
                {
                case DimensionOperation::kSUM: r = x + y; break;
                case DimensionOperation::kPROD: r = x * y; break;
                case DimensionOperation::kMAX: r = x > y ? x : y; break;
                case DimensionOperation::kMIN: r = x < y ? x : y; break;
                case DimensionOperation::kSUB: r = x - y; break;
                case DimensionOperation::kEQUAL: r = x == y; break;
                case DimensionOperation::kLESS: r = x < y; break;
                case DimensionOperation::kFLOOR_DIV: r = y ? x / y : 0; break;
                case DimensionOperation::kCEIL_DIV: r = y ? (x + y - 1) / y : 0; break;
                }
                return owner->make(true, r, "");
            }
            return owner->make(false, 0, std::string(names[index]) + "(" + a->text() + "," + b->text() + ")");
        }
        IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override
        {
            return nullptr;
        }
        FakeBuilder* owner{nullptr};
    };
    Impl mImplObject;
    std::deque<std::unique_ptr<FakeExpr>> mExprs;
};

// ------------------------------------------------------------------------------------------------ state

using GetCreatorsFn = IPluginCreatorInterface* const* (*) (int32_t&);
using SetLoggerFinderFn = void (*)(ILoggerFinder*);

struct HarnessState
{
    void* library{nullptr};
    std::vector<IPluginCreatorV3One*> creators;
    std::vector<std::unique_ptr<IPluginV3>> plugins;
};

HarnessState gState;

void writeText(std::string const& text, char* out, int32_t outLen)
{
    if (out != nullptr && outLen > 0)
    {
        std::strncpy(out, text.c_str(), static_cast<size_t>(outLen - 1));
        out[outLen - 1] = '\0';
    }
}

std::string quote(std::string const& text)
{
    std::ostringstream out;
    out << '"';
    for (char c : text)
    {
        switch (c)
        {
        case '"': out << "\\\""; break;
        case '\\': out << "\\\\"; break;
        case '\n': out << "\\n"; break;
        default:
            if (static_cast<unsigned char>(c) < 0x20)
            {
                out << "\\u00" << "0123456789abcdef"[(c >> 4) & 0xf] << "0123456789abcdef"[c & 0xf];
            }
            else
            {
                out << c;
            }
        }
    }
    out << '"';
    return out.str();
}

std::string fieldsJson(PluginFieldCollection const* fc, bool withValues)
{
    std::ostringstream out;
    out.precision(17);
    out << "[";
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
    {
        PluginField const& f = fc->fields[i];
        out << (i ? "," : "") << "{\"name\":" << quote(f.name ? f.name : "") << ",\"type\":" << static_cast<int32_t>(f.type)
            << ",\"length\":" << f.length;
        if (withValues && f.data != nullptr)
        {
            out << ",\"value\":";
            switch (f.type)
            {
            case PluginFieldType::kCHAR:
                out << quote(std::string(static_cast<char const*>(f.data), strnlen(static_cast<char const*>(f.data), f.length)));
                break;
            case PluginFieldType::kINT32:
                if (f.length == 1)
                {
                    out << *static_cast<int32_t const*>(f.data);
                    break;
                }
                out << "[";
                for (int32_t v = 0; v < f.length; ++v)
                {
                    out << (v ? "," : "") << static_cast<int32_t const*>(f.data)[v];
                }
                out << "]";
                break;
            case PluginFieldType::kINT64: out << *static_cast<int64_t const*>(f.data); break;
            case PluginFieldType::kFLOAT32: out << *static_cast<float const*>(f.data); break;
            case PluginFieldType::kFLOAT64: out << *static_cast<double const*>(f.data); break;
            default: out << "null"; break;
            }
        }
        out << "}";
    }
    out << "]";
    return out.str();
}

IPluginV3* pluginAt(int32_t handle)
{
    if (handle < 0 || handle >= static_cast<int32_t>(gState.plugins.size()))
    {
        return nullptr;
    }
    return gState.plugins[static_cast<size_t>(handle)].get();
}

int32_t keep(IPluginV3* plugin)
{
    if (plugin == nullptr)
    {
        return -1;
    }
    gState.plugins.emplace_back(plugin);
    return static_cast<int32_t>(gState.plugins.size() - 1);
}

template <typename T>
T* capability(int32_t handle, PluginCapabilityType type)
{
    IPluginV3* plugin = pluginAt(handle);
    return plugin != nullptr ? static_cast<T*>(plugin->getCapabilityInterface(type)) : nullptr;
}

Dims toDims(int64_t const* packed)
{
    // packed: nbDims, d0 .. d7
    Dims dims{};
    dims.nbDims = static_cast<int32_t>(packed[0]);
    for (int32_t i = 0; i < Dims::MAX_DIMS; ++i)
    {
        dims.d[i] = i < dims.nbDims ? packed[1 + i] : 0;
    }
    return dims;
}

} // namespace

extern "C"
{

    //! A plugin field as ctypes passes it; `type` is a nvinfer1::PluginFieldType value.
    struct HarnessField
    {
        char const* name;
        void const* data;
        int32_t type;
        int32_t length;
    };

    //! dlopen the plugin library, register our logger, fetch its creators. 0 on success.
    int32_t ckv_harness_open(char const* path, char* err, int32_t errLen)
    {
        if (gState.library != nullptr)
        {
            return 0;
        }
        void* library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (library == nullptr)
        {
            writeText(std::string("dlopen failed: ") + dlerror(), err, errLen);
            return 1;
        }
        auto getCreators = reinterpret_cast<GetCreatorsFn>(dlsym(library, "getCreators"));
        auto setLoggerFinder = reinterpret_cast<SetLoggerFinderFn>(dlsym(library, "setLoggerFinder"));
        if (getCreators == nullptr || setLoggerFinder == nullptr)
        {
            writeText("the library does not export getCreators and setLoggerFinder", err, errLen);
            return 2;
        }
        setLoggerFinder(&gFinder);
        int32_t count = 0;
        IPluginCreatorInterface* const* creators = getCreators(count);
        for (int32_t i = 0; i < count; ++i)
        {
            if (std::strcmp(creators[i]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") != 0)
            {
                writeText(std::string("creator ") + std::to_string(i) + " is not an IPluginCreatorV3One", err, errLen);
                return 3;
            }
            gState.creators.push_back(static_cast<IPluginCreatorV3One*>(creators[i]));
        }
        gState.library = library;
        return 0;
    }

    //! JSON list of the creators: name, version, namespace, interface kind/version, advertised fields.
    int32_t ckv_harness_creators(char* out, int32_t outLen)
    {
        std::ostringstream json;
        json << "[";
        for (size_t i = 0; i < gState.creators.size(); ++i)
        {
            IPluginCreatorV3One* c = gState.creators[i];
            InterfaceInfo const info = c->getInterfaceInfo();
            json << (i ? "," : "") << "{\"name\":" << quote(c->getPluginName())
                 << ",\"version\":" << quote(c->getPluginVersion()) << ",\"namespace\":" << quote(c->getPluginNamespace())
                 << ",\"kind\":" << quote(info.kind) << ",\"major\":" << info.major << ",\"minor\":" << info.minor
                 << ",\"fields\":" << fieldsJson(c->getFieldNames(), false) << "}";
        }
        json << "]";
        writeText(json.str(), out, outLen);
        return static_cast<int32_t>(gState.creators.size());
    }

    //! createPlugin through creator `creatorIndex`; returns a handle >= 0, or -1 (see ckv_harness_logs).
    int32_t ckv_harness_create(int32_t creatorIndex, char const* layerName, HarnessField const* fields, int32_t count,
        int32_t claimedCount, int32_t phase, int32_t nullCollection)
    {
        if (creatorIndex < 0 || creatorIndex >= static_cast<int32_t>(gState.creators.size()))
        {
            return -1;
        }
        std::vector<PluginField> pluginFields;
        for (int32_t i = 0; i < count && fields != nullptr; ++i)
        {
            pluginFields.emplace_back(
                fields[i].name, fields[i].data, static_cast<PluginFieldType>(fields[i].type), fields[i].length);
        }
        // claimedCount lets a test corrupt nbFields (negative, huge) without the harness itself reading out of bounds.
        PluginFieldCollection fc{};
        fc.nbFields = claimedCount;
        fc.fields = fields == nullptr ? nullptr : pluginFields.data();
        IPluginV3* plugin = gState.creators[static_cast<size_t>(creatorIndex)]->createPlugin(
            layerName, nullCollection ? nullptr : &fc, static_cast<TensorRTPhase>(phase));
        return keep(plugin);
    }

    //! Name, version, namespace, outputs, metadata and serialized fields (with values) of a plugin, as JSON.
    int32_t ckv_harness_describe(int32_t handle, char* out, int32_t outLen)
    {
        auto* core = capability<IPluginV3OneCore>(handle, PluginCapabilityType::kCORE);
        auto* build = capability<IPluginV3OneBuild>(handle, PluginCapabilityType::kBUILD);
        auto* runtime = capability<IPluginV3OneRuntime>(handle, PluginCapabilityType::kRUNTIME);
        if (core == nullptr || build == nullptr || runtime == nullptr)
        {
            return 1;
        }
        InterfaceInfo const coreInfo = core->getInterfaceInfo();
        std::ostringstream json;
        char const* metadata = build->getMetadataString();
        char const* timing = build->getTimingCacheID();
        json << "{\"name\":" << quote(core->getPluginName()) << ",\"version\":" << quote(core->getPluginVersion())
             << ",\"namespace\":" << quote(core->getPluginNamespace()) << ",\"core_kind\":" << quote(coreInfo.kind)
             << ",\"build_kind\":" << quote(build->getInterfaceInfo().kind)
             << ",\"runtime_kind\":" << quote(runtime->getInterfaceInfo().kind)
             << ",\"outputs\":" << build->getNbOutputs() << ",\"metadata\":" << quote(metadata ? metadata : "")
             << ",\"timing_cache_id\":" << quote(timing ? timing : "")
             << ",\"fields\":" << fieldsJson(runtime->getFieldsToSerialize(), true) << "}";
        writeText(json.str(), out, outLen);
        return 0;
    }

    //! Serialize (getFieldsToSerialize) and deserialize through `creatorIndex` in the runtime phase: new handle.
    int32_t ckv_harness_round_trip(int32_t handle, int32_t creatorIndex)
    {
        auto* runtime = capability<IPluginV3OneRuntime>(handle, PluginCapabilityType::kRUNTIME);
        if (runtime == nullptr || creatorIndex < 0 || creatorIndex >= static_cast<int32_t>(gState.creators.size()))
        {
            return -1;
        }
        PluginFieldCollection const* fc = runtime->getFieldsToSerialize();
        // Copy the bytes like an engine file would, so nothing points back into the original plugin.
        std::vector<std::vector<unsigned char>> storage;
        std::vector<std::string> names;
        std::vector<PluginField> copies;
        for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
        {
            PluginField const& f = fc->fields[i];
            size_t const element = f.type == PluginFieldType::kCHAR ? 1
                : (f.type == PluginFieldType::kINT64 || f.type == PluginFieldType::kFLOAT64) ? 8 : 4;
            auto const* bytes = static_cast<unsigned char const*>(f.data);
            storage.emplace_back(bytes, bytes + element * static_cast<size_t>(f.length));
            names.emplace_back(f.name);
        }
        for (size_t i = 0; i < storage.size(); ++i)
        {
            copies.emplace_back(names[i].c_str(), storage[i].data(), fc->fields[i].type, fc->fields[i].length);
        }
        PluginFieldCollection copy{static_cast<int32_t>(copies.size()), copies.data()};
        return keep(gState.creators[static_cast<size_t>(creatorIndex)]->createPlugin("round_trip", &copy, TensorRTPhase::kRUNTIME));
    }

    //! IPluginV3::clone (attach = 0) or IPluginV3OneRuntime::attachToContext(nullptr) (attach = 1): new handle.
    int32_t ckv_harness_clone(int32_t handle, int32_t attach)
    {
        IPluginV3* plugin = pluginAt(handle);
        if (plugin == nullptr)
        {
            return -1;
        }
        if (attach)
        {
            auto* runtime = capability<IPluginV3OneRuntime>(handle, PluginCapabilityType::kRUNTIME);
            return keep(runtime->attachToContext(nullptr));
        }
        return keep(plugin->clone());
    }

    //! getOutputDataTypes: status, output types into outTypes[nbOutputs].
    int32_t ckv_harness_output_types(
        int32_t handle, int32_t const* inputTypes, int32_t nbInputs, int32_t* outTypes, int32_t nbOutputs)
    {
        auto* build = capability<IPluginV3OneBuild>(handle, PluginCapabilityType::kBUILD);
        if (build == nullptr)
        {
            return -2;
        }
        std::vector<DataType> in(static_cast<size_t>(nbInputs));
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            in[i] = static_cast<DataType>(inputTypes[i]);
        }
        std::vector<DataType> outputs(static_cast<size_t>(nbOutputs));
        int32_t const status = build->getOutputDataTypes(outputs.data(), nbOutputs, in.data(), nbInputs);
        for (int32_t i = 0; i < nbOutputs; ++i)
        {
            outTypes[i] = static_cast<int32_t>(outputs[i]);
        }
        return status;
    }

    //! getOutputShapes with inputs given as packed dims (nbDims, d0..d7; -1 = symbolic: the layer inputs' axis names,
    //! "in<i>.<axis>" beyond input 4). JSON [[dims...], ...].
    int32_t ckv_harness_output_shapes(
        int32_t handle, int64_t const* packedInputs, int32_t nbInputs, int32_t nbOutputs, char* out, int32_t outLen)
    {
        auto* build = capability<IPluginV3OneBuild>(handle, PluginCapabilityType::kBUILD);
        if (build == nullptr)
        {
            return -2;
        }
        static char const* const axisNames[5][4] = {
            {"B", "H", "Wq", "D"}, {"B", "Hkv", "n", "D"}, {"B", "Hkv", "n", "D"}, {"hidden", "HD", "", ""}, {"B", "", "", ""}};
        FakeBuilder builder;
        std::vector<DimsExprs> inputs(static_cast<size_t>(nbInputs));
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            Dims const dims = toDims(packedInputs + i * 9);
            inputs[i].nbDims = dims.nbDims;
            for (int32_t a = 0; a < dims.nbDims; ++a)
            {
                bool const known = dims.d[a] >= 0;
                std::string const symbol
                    = i < 5 && a < 4 ? axisNames[i][a] : "in" + std::to_string(i) + "." + std::to_string(a);
                inputs[i].d[a] = builder.make(known, known ? dims.d[a] : 0, symbol);
            }
        }
        std::vector<DimsExprs> outputs(static_cast<size_t>(nbOutputs));
        int32_t const status
            = build->getOutputShapes(inputs.data(), nbInputs, nullptr, 0, outputs.data(), nbOutputs, builder);
        std::ostringstream json;
        json << "{\"status\":" << status << ",\"shapes\":[";
        for (int32_t o = 0; o < nbOutputs && status == 0; ++o)
        {
            json << (o ? "," : "") << "[";
            for (int32_t a = 0; a < outputs[o].nbDims; ++a)
            {
                auto const* e = dynamic_cast<FakeExpr const*>(outputs[o].d[a]);
                json << (a ? "," : "") << quote(e != nullptr ? e->text() : "?");
            }
            json << "]";
        }
        json << "]}";
        writeText(json.str(), out, outLen);
        return status;
    }

    //! supportsFormatCombination(pos) for tensors of the given types / formats (inputs then outputs).
    int32_t ckv_harness_supports(int32_t handle, int32_t pos, int32_t const* types, int32_t const* formats,
        int32_t nbInputs, int32_t nbOutputs)
    {
        auto* build = capability<IPluginV3OneBuild>(handle, PluginCapabilityType::kBUILD);
        if (build == nullptr)
        {
            return -2;
        }
        std::vector<DynamicPluginTensorDesc> descs(static_cast<size_t>(nbInputs + nbOutputs));
        for (int32_t i = 0; i < nbInputs + nbOutputs; ++i)
        {
            descs[i].desc.type = static_cast<DataType>(types[i]);
            descs[i].desc.format = static_cast<TensorFormat>(formats[i]);
            descs[i].desc.dims.nbDims = 0;
        }
        return build->supportsFormatCombination(pos, descs.data(), nbInputs, nbOutputs) ? 1 : 0;
    }

    //! getWorkspaceSize with the given packed max dims of the inputs (min / opt set equal).
    int64_t ckv_harness_workspace(int32_t handle, int64_t const* packedMaxInputs, int32_t nbInputs, int32_t nbOutputs)
    {
        auto* build = capability<IPluginV3OneBuild>(handle, PluginCapabilityType::kBUILD);
        if (build == nullptr)
        {
            return -2;
        }
        std::vector<DynamicPluginTensorDesc> in(static_cast<size_t>(nbInputs));
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            Dims const dims = toDims(packedMaxInputs + i * 9);
            in[i].desc.dims = dims;
            in[i].min = dims;
            in[i].opt = dims;
            in[i].max = dims;
        }
        std::vector<DynamicPluginTensorDesc> out(static_cast<size_t>(nbOutputs));
        return static_cast<int64_t>(build->getWorkspaceSize(in.data(), nbInputs, out.data(), nbOutputs));
    }

    //! configurePlugin (which = 0, dims as desc.dims with -1 allowed) or onShapeChange (which = 1, concrete dims).
    //! Output dims are derived by the caller and passed packed after the inputs.
    int32_t ckv_harness_configure(int32_t handle, int32_t which, int64_t const* packed, int32_t nbInputs, int32_t nbOutputs)
    {
        auto* build = capability<IPluginV3OneBuild>(handle, PluginCapabilityType::kBUILD);
        auto* runtime = capability<IPluginV3OneRuntime>(handle, PluginCapabilityType::kRUNTIME);
        if (build == nullptr || runtime == nullptr)
        {
            return -2;
        }
        std::vector<DynamicPluginTensorDesc> dyn(static_cast<size_t>(nbInputs + nbOutputs));
        std::vector<PluginTensorDesc> desc(static_cast<size_t>(nbInputs + nbOutputs));
        for (int32_t i = 0; i < nbInputs + nbOutputs; ++i)
        {
            Dims const dims = toDims(packed + i * 9);
            desc[i].dims = dims;
            desc[i].type = DataType::kFLOAT;
            desc[i].format = TensorFormat::kLINEAR;
            dyn[i].desc = desc[i];
            dyn[i].min = dims;
            dyn[i].opt = dims;
            dyn[i].max = dims;
        }
        if (which == 0)
        {
            return build->configurePlugin(dyn.data(), nbInputs, dyn.data() + nbInputs, nbOutputs);
        }
        return runtime->onShapeChange(desc.data(), nbInputs, desc.data() + nbInputs, nbOutputs);
    }

    //! onShapeChange with concrete dims, then enqueue with every tensor pointer, the workspace and the stream null:
    //! what enqueue refuses before it launches anything (the workspace check, then the null workspace). Returns
    //! onShapeChange's status if it failed, else enqueue's (never 0: a plugin that launched would read null pointers).
    int32_t ckv_harness_enqueue(int32_t handle, int64_t const* packed, int32_t nbInputs, int32_t nbOutputs)
    {
        auto* runtime = capability<IPluginV3OneRuntime>(handle, PluginCapabilityType::kRUNTIME);
        if (runtime == nullptr)
        {
            return -2;
        }
        std::vector<PluginTensorDesc> desc(static_cast<size_t>(nbInputs + nbOutputs));
        for (int32_t i = 0; i < nbInputs + nbOutputs; ++i)
        {
            desc[i].dims = toDims(packed + i * 9);
            desc[i].type = DataType::kFLOAT;
            desc[i].format = TensorFormat::kLINEAR;
        }
        int32_t const changed = runtime->onShapeChange(desc.data(), nbInputs, desc.data() + nbInputs, nbOutputs);
        if (changed != 0)
        {
            return changed;
        }
        std::vector<void const*> inputs(static_cast<size_t>(nbInputs), nullptr);
        std::vector<void*> outputs(static_cast<size_t>(nbOutputs), nullptr);
        return runtime->enqueue(desc.data(), desc.data() + nbInputs, inputs.data(), outputs.data(), nullptr, nullptr);
    }

    //! JSON list of [severity, message] logged by the plugin since the last call.
    int32_t ckv_harness_logs(char* out, int32_t outLen)
    {
        auto const messages = gLogger.take();
        std::ostringstream json;
        json << "[";
        for (size_t i = 0; i < messages.size(); ++i)
        {
            json << (i ? "," : "") << "[" << messages[i].first << "," << quote(messages[i].second) << "]";
        }
        json << "]";
        writeText(json.str(), out, outLen);
        return static_cast<int32_t>(messages.size());
    }

    //! Delete a plugin (TensorRT owns and deletes plugins it creates; so do we).
    void ckv_harness_destroy(int32_t handle)
    {
        if (pluginAt(handle) != nullptr)
        {
            gState.plugins[static_cast<size_t>(handle)].reset();
        }
    }

} // extern "C"
