// Shared by the torch ops' registrations (ops.cpp: schemas, CPU and Meta; ops_cuda.cpp: CUDA): the policy of a call
// parsed once per (policy, layer, capacity), and the argument checks every registration runs before any work, with
// errors that name the argument (dtype and shape problems raise TypeError / ValueError in Python, like torch's own).
#pragma once

#include "policy_json.h"

#include "criticalkv/model_level.h"

#include <torch/library.h>
#include <ATen/ATen.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace criticalkv::torchops
{

//! Largest head dimension of the kernels (kernels.h: kMaxHeadDim; ops_cuda.cpp checks they agree). The CPU
//! registration keeps the same limits, so a call that runs on the CPU runs on the GPU.
constexpr int64_t kMaxHeadDim = 256;

//! A policy of one layer as the kernels and the host version take it.
struct ParsedPolicy
{
    PolicyConfig policy;
    SelectConfig config;
};

//! The policy of a call (KVPolicy.to_json() and the layer's position), parsed and validated for the kernels, cached.
inline std::shared_ptr<ParsedPolicy const> parsedPolicy(std::string const& json, int64_t layerIdx, int64_t numLayers,
    int64_t capacity)
{
    static std::mutex mutex;
    static std::unordered_map<std::string, std::shared_ptr<ParsedPolicy const>> cache;
    TORCH_CHECK_VALUE(layerIdx >= 0 && layerIdx < numLayers && numLayers <= (1 << 20),
        "layer_idx: ", layerIdx, " is outside [0, num_layers=", numLayers, ")");
    TORCH_CHECK_VALUE(capacity >= 1 && capacity <= (int64_t{1} << 30),
        "capacity: ", capacity, " (a head's output holds at least one entry)");
    std::string const key = json + '\x1f' + std::to_string(layerIdx) + '\x1f' + std::to_string(numLayers) + '\x1f'
        + std::to_string(capacity);
    {
        std::lock_guard<std::mutex> lock(mutex);
        auto const found = cache.find(key);
        if (found != cache.end())
        {
            return found->second;
        }
    }
    auto parsed = std::make_shared<ParsedPolicy>();
    std::string error;
    TORCH_CHECK_VALUE(parsePolicyJson(json, static_cast<int32_t>(layerIdx), static_cast<int32_t>(numLayers),
                          static_cast<int32_t>(capacity), PolicyUse::kKernels, parsed->policy, error),
        error);
    parsed->config = makeSelectConfig(parsed->policy, PolicyUse::kKernels);
    std::lock_guard<std::mutex> lock(mutex);
    if (cache.size() > 4096)
    {
        cache.clear();
    }
    cache.emplace(key, parsed);
    return parsed;
}

//! torch's Python name of a dtype (torch.float32, ...), without the "torch." prefix.
inline char const* dtypeName(at::ScalarType type)
{
    switch (type)
    {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kDouble: return "float64";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kBool: return "bool";
    default: return c10::toString(type);
    }
}

//! A floating input of the kernels: fp32 / fp16 / bf16 of the queries' dtype, `dims` dimensions, on `device`.
inline void checkFloat(at::Tensor const& t, char const* name, int64_t dims, at::ScalarType dtype, c10::Device device)
{
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
        name, ": the kernels take float32, float16 or bfloat16, got ", dtypeName(t.scalar_type()));
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, ": ", dtypeName(t.scalar_type()),
        ", but the other inputs are ", dtypeName(dtype), " (one dtype for every input)");
    TORCH_CHECK_VALUE(t.dim() == dims, name, ": expected ", dims, " dimensions, got shape ", t.sizes());
    TORCH_CHECK_VALUE(t.device() == device, name, ": on ", t.device(), ", but the other inputs are on ", device);
}

//! An optional int32 / int64 input: shape `shape`, on `device` (CUDA: the kernels read it on the device).
inline void checkIndex(std::optional<at::Tensor> const& t, char const* name, at::IntArrayRef shape, c10::Device device)
{
    if (!t.has_value())
    {
        return;
    }
    TORCH_CHECK_TYPE(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, name,
        ": expected int32 or int64, got ", dtypeName(t->scalar_type()));
    TORCH_CHECK_VALUE(t->sizes() == shape, name, ": expected shape ", shape, ", got ", t->sizes());
    TORCH_CHECK_VALUE(t->device() == device, name, ": on ", t->device(), ", but the inputs are on ", device);
}

//! The shape of one select_layer / layer_ranking call, checked: queries [B, H, q, d_h], keys / values [B, H_kv, n, d_h],
//! o_proj [hidden, H d_h], q >= min(window, n), H a multiple of H_kv; scores [B, H_kv, n] fp32 where given.
inline SelectShape layerShape(SelectConfig const& config, at::Tensor const& queries, at::Tensor const& keys,
    at::Tensor const& values, at::Tensor const& oProj, std::optional<at::Tensor> const& promptLengths,
    std::optional<at::Tensor> const& kvBudget, std::optional<at::Tensor> const& scores)
{
    c10::Device const device = queries.device();
    at::ScalarType const dtype = queries.scalar_type();
    checkFloat(queries, "queries", 4, dtype, device);
    checkFloat(keys, "keys", 4, dtype, device);
    checkFloat(values, "values", 4, dtype, device);
    checkFloat(oProj, "o_proj", 2, dtype, device);
    int64_t const batch = keys.size(0), kvHeads = keys.size(1), n = keys.size(2), headDim = keys.size(3);
    int64_t const heads = queries.size(1);
    TORCH_CHECK_VALUE(n > 0, "keys: the prompt is empty (n = 0); there is nothing to select from");
    TORCH_CHECK_VALUE(values.sizes() == keys.sizes(), "values: shape ", values.sizes(), " differs from keys ",
        keys.sizes());
    TORCH_CHECK_VALUE(queries.size(0) == batch && queries.size(3) == headDim, "queries: shape ", queries.sizes(),
        " does not match keys ", keys.sizes(), " (expected [B, H, w, d_h] with the keys' B and d_h)");
    TORCH_CHECK_VALUE(kvHeads > 0 && heads % kvHeads == 0, "queries: ", heads, " query heads are not a multiple of ",
        kvHeads, " KV heads");
    TORCH_CHECK_VALUE(oProj.size(1) == heads * headDim, "o_proj: shape ", oProj.sizes(),
        " does not match H * d_h = ", heads, " * ", headDim, " (expected [hidden, H * d_h])");
    TORCH_CHECK_VALUE(headDim <= kMaxHeadDim, "keys: head_dim ", headDim, " exceeds the kernels' ", kMaxHeadDim);
    int64_t const w = std::min<int64_t>(config.window, n);
    TORCH_CHECK_VALUE(queries.size(2) >= w, "queries: ", queries.size(2),
        " window queries given, the policy needs the last min(window, n) = ", w);
    TORCH_CHECK_VALUE(batch <= 65535 && heads <= 65535 && n <= (int64_t{1} << 30), "shape ", keys.sizes(),
        " exceeds the kernels' limits (B, H <= 65535)");
    checkIndex(promptLengths, "prompt_lengths", {batch}, device);
    if (kvBudget.has_value())
    {
        TORCH_CHECK_VALUE(kvBudget->numel() == 1, "kv_budget: expected one value, got shape ", kvBudget->sizes());
        checkIndex(kvBudget, "kv_budget", kvBudget->sizes(), device);
    }
    if (scores.has_value())
    {
        TORCH_CHECK_TYPE(scores->scalar_type() == at::kFloat, "scores: expected float32, got ",
            dtypeName(scores->scalar_type()));
        TORCH_CHECK_VALUE(scores->dim() == 3 && scores->size(0) == batch && scores->size(1) == kvHeads
                && scores->size(2) == n,
            "scores: expected shape [", batch, ", ", kvHeads, ", ", n, "] (B, H_kv, n), got ", scores->sizes());
        TORCH_CHECK_VALUE(scores->device() == device, "scores: on ", scores->device(), ", but the inputs are on ",
            device);
    }
    TORCH_CHECK_VALUE(!config.modelWide, "a model-level policy selects over every layer at once: select it with "
        "torch.ops.criticalkv.layer_ranking and select_model (num_layers > 1)");
    TORCH_CHECK_VALUE(!externalScores(config) || scores.has_value(),
        "scores: the kvzip policies rank by scores computed outside the layer ([B, H_kv, n], a context "
        "reconstruction's or the surrogate's); without them their fallback (the window's max attention) runs only in "
        "the PyTorch reference");
    return SelectShape{static_cast<int32_t>(batch), static_cast<int32_t>(heads), static_cast<int32_t>(kvHeads),
        static_cast<int32_t>(n), static_cast<int32_t>(queries.size(2)), static_cast<int32_t>(headDim),
        static_cast<int32_t>(oProj.size(0))};
}

//! min(n, capacity): the per-head output size.
inline int64_t outputSize(int64_t n, int64_t capacity)
{
    return std::min(n, capacity);
}

//! The older tokens m = n - min(window, n).
inline int64_t olderCount(SelectConfig const& config, int64_t n)
{
    return n - std::min<int64_t>(config.window, n);
}

//! The device's optional int32 view of prompt_lengths / kv_budget (contiguous), for the kernels and the host driver.
inline std::optional<at::Tensor> asInt32(std::optional<at::Tensor> const& t)
{
    if (!t.has_value())
    {
        return std::nullopt;
    }
    return t->to(at::kInt).contiguous().reshape({-1});
}

inline int32_t const* int32Data(std::optional<at::Tensor> const& t)
{
    return t.has_value() ? t->data_ptr<int32_t>() : nullptr;
}

//! kept_keys / kept_values from the inputs' own rows (exact in their dtype): zero where the index is -1.
inline std::pair<at::Tensor, at::Tensor> gatherKept(at::Tensor const& keys, at::Tensor const& values,
    at::Tensor const& indices)
{
    at::Tensor const index = indices.to(at::kLong).clamp_min(0).unsqueeze(-1).expand({-1, -1, -1, keys.size(3)});
    at::Tensor const pad = (indices < 0).unsqueeze(-1);
    return {at::gather(keys, 2, index).masked_fill(pad, 0), at::gather(values, 2, index).masked_fill(pad, 0)};
}

//! The model-level call's checked shape: ranking [B, L H_kv, m] fp32, keys[l] / values[l] [B, H_kv, n, d_h].
struct ModelCall
{
    ModelShape shape;
    std::shared_ptr<ParsedPolicy const> parsed;
};

inline ModelCall modelCall(std::string const& policy, at::Tensor const& ranking,
    std::optional<at::Tensor> const& attention, std::optional<at::Tensor> const& critical, at::TensorList keys,
    at::TensorList values, std::optional<at::Tensor> const& promptLengths, std::optional<at::Tensor> const& kvBudget,
    at::IntArrayRef capacities)
{
    int64_t const layers = static_cast<int64_t>(keys.size());
    TORCH_CHECK_VALUE(layers >= 1 && values.size() == keys.size() && capacities.size() == keys.size(),
        "keys, values, capacities: one per layer, got ", keys.size(), ", ", values.size(), ", ", capacities.size());
    ModelCall call;
    call.parsed = parsedPolicy(policy, 0, layers, 1);
    SelectConfig const& config = call.parsed->config;
    TORCH_CHECK_VALUE(modelLevel(config) && needsScores(config), "policy: ", call.parsed->policy.name,
        " is not a model-level method (select it layer by layer with select_layer)");
    c10::Device const device = keys[0].device();
    at::ScalarType const dtype = keys[0].scalar_type();
    for (int64_t l = 0; l < layers; ++l)
    {
        checkFloat(keys[l], "keys", 4, dtype, device);
        checkFloat(values[l], "values", 4, dtype, device);
        TORCH_CHECK_VALUE(keys[l].sizes() == keys[0].sizes() && values[l].sizes() == keys[0].sizes(), "layers[", l,
            "]: keys / values of shape ", keys[l].sizes(), " / ", values[l].sizes(), " differ from layer 0's ",
            keys[0].sizes());
        TORCH_CHECK_VALUE(capacities[l] >= 1, "capacities[", l, "]: ", capacities[l],
            " (a head's output holds at least one entry)");
    }
    int64_t const batch = keys[0].size(0), kvHeads = keys[0].size(1), n = keys[0].size(2);
    TORCH_CHECK_VALUE(n > 0, "keys: the prompt is empty (n = 0); there is nothing to select from");
    TORCH_CHECK_VALUE(keys[0].size(3) <= kMaxHeadDim, "keys: head_dim ", keys[0].size(3), " exceeds the kernels' ",
        kMaxHeadDim);
    int64_t const m = olderCount(config, n);
    auto checkScores = [&](at::Tensor const& t, char const* name) {
        TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, ": expected float32, got ", dtypeName(t.scalar_type()));
        TORCH_CHECK_VALUE(t.dim() == 3 && t.size(0) == batch && t.size(1) == layers * kvHeads && t.size(2) == m, name,
            ": expected shape [", batch, ", ", layers * kvHeads, ", ", m, "] (B, L * H_kv, m), got ", t.sizes());
        TORCH_CHECK_VALUE(t.device() == device, name, ": on ", t.device(), ", but the keys are on ", device);
    };
    checkScores(ranking, "ranking");
    if (config.twoStage)
    {
        TORCH_CHECK_VALUE(attention.has_value() && critical.has_value(), "attention, critical: ",
            call.parsed->policy.name, " refines with CriticalKV's two stages and needs both (layer_ranking's)");
        checkScores(*attention, "attention");
        checkScores(*critical, "critical");
    }
    checkIndex(promptLengths, "prompt_lengths", {batch}, device);
    if (kvBudget.has_value())
    {
        TORCH_CHECK_VALUE(kvBudget->numel() == 1, "kv_budget: expected one value, got shape ", kvBudget->sizes());
        checkIndex(kvBudget, "kv_budget", kvBudget->sizes(), device);
    }
    call.shape = ModelShape{SelectShape{static_cast<int32_t>(batch), static_cast<int32_t>(kvHeads),
                                static_cast<int32_t>(kvHeads), static_cast<int32_t>(n), 1,
                                static_cast<int32_t>(keys[0].size(3)), 1},
        static_cast<int32_t>(layers)};
    return call;
}

// ---------------------------------------------------------------------------------------------------- primitives

//! top_k's rows: scores [..., L] fp32, k [...] (or one value) int64, eligible [..., L] bool.
struct TopKCall
{
    int64_t rows;
    int64_t length;
};

inline TopKCall topKCall(at::Tensor const& scores, at::Tensor const& k, std::optional<at::Tensor> const& eligible)
{
    TORCH_CHECK_TYPE(scores.scalar_type() == at::kFloat, "scores: expected float32, got ",
        dtypeName(scores.scalar_type()));
    TORCH_CHECK_VALUE(scores.dim() >= 1 && scores.size(-1) >= 1, "scores: expected [..., L] with L >= 1, got shape ",
        scores.sizes());
    TORCH_CHECK_VALUE(scores.size(-1) <= (int64_t{1} << 30), "scores: rows of ", scores.size(-1),
        " entries exceed the top-k's 2^30");
    TORCH_CHECK_TYPE(k.scalar_type() == at::kLong || k.scalar_type() == at::kInt, "k: expected int64 or int32, got ",
        dtypeName(k.scalar_type()));
    int64_t const length = scores.size(-1);
    int64_t const rows = scores.numel() / length;
    TORCH_CHECK_VALUE(k.numel() == 1 || k.sizes() == scores.sizes().slice(0, scores.dim() - 1), "k: expected one value "
        "or shape ", scores.sizes().slice(0, scores.dim() - 1), " (one per row), got ", k.sizes());
    TORCH_CHECK_VALUE(k.device() == scores.device(), "k: on ", k.device(), ", but scores are on ", scores.device());
    if (eligible.has_value())
    {
        TORCH_CHECK_TYPE(eligible->scalar_type() == at::kBool, "eligible: expected bool, got ",
            dtypeName(eligible->scalar_type()));
        TORCH_CHECK_VALUE(eligible->sizes() == scores.sizes(), "eligible: expected shape ", scores.sizes(), ", got ",
            eligible->sizes());
        TORCH_CHECK_VALUE(eligible->device() == scores.device(), "eligible: on ", eligible->device(),
            ", but scores are on ", scores.device());
    }
    return TopKCall{rows, length};
}

//! value_norms' shape: values [B, H_kv, n, d_h], o_proj [hidden, H d_h], H = num_heads.
inline SelectShape normsShape(at::Tensor const& values, at::Tensor const& oProj, int64_t numHeads,
    std::string const& kind)
{
    checkFloat(values, "values", 4, values.scalar_type(), values.device());
    checkFloat(oProj, "o_proj", 2, values.scalar_type(), values.device());
    TORCH_CHECK_VALUE(kind == "l1" || kind == "l2", "kind: '", kind, "' is not one of l1, l2");
    int64_t const kvHeads = values.size(1), headDim = values.size(3);
    TORCH_CHECK_VALUE(numHeads > 0 && kvHeads > 0 && numHeads % kvHeads == 0, "num_heads: ", numHeads,
        " query heads are not a multiple of ", kvHeads, " KV heads");
    TORCH_CHECK_VALUE(oProj.size(1) == numHeads * headDim, "o_proj: shape ", oProj.sizes(),
        " does not match H * d_h = ", numHeads, " * ", headDim, " (expected [hidden, H * d_h])");
    TORCH_CHECK_VALUE(headDim <= kMaxHeadDim && values.size(0) <= 65535 && numHeads <= 65535, "values: shape ",
        values.sizes(), " exceeds the kernels' limits (d_h <= ", kMaxHeadDim, ", B, H <= 65535)");
    return SelectShape{static_cast<int32_t>(values.size(0)), static_cast<int32_t>(numHeads),
        static_cast<int32_t>(kvHeads), static_cast<int32_t>(values.size(2)), 1, static_cast<int32_t>(headDim),
        static_cast<int32_t>(oProj.size(0))};
}

//! window_scores' shape: queries [B, H, q, d_h], keys [B, H_kv, n, d_h], q >= min(window, n).
inline SelectShape windowShape(at::Tensor const& queries, at::Tensor const& keys,
    std::optional<at::Tensor> const& promptLengths, int64_t window)
{
    checkFloat(queries, "queries", 4, queries.scalar_type(), queries.device());
    checkFloat(keys, "keys", 4, queries.scalar_type(), queries.device());
    TORCH_CHECK_VALUE(window >= 1 && window <= kMaxTokens, "window: must be a positive number of tokens, got ", window);
    int64_t const batch = keys.size(0), kvHeads = keys.size(1), n = keys.size(2), headDim = keys.size(3);
    TORCH_CHECK_VALUE(n > 0, "keys: the prompt is empty (n = 0)");
    TORCH_CHECK_VALUE(queries.size(0) == batch && queries.size(3) == headDim && kvHeads > 0
            && queries.size(1) % kvHeads == 0,
        "queries: shape ", queries.sizes(), " does not match keys ", keys.sizes(),
        " (expected [B, H, w, d_h], H a multiple of H_kv)");
    TORCH_CHECK_VALUE(queries.size(2) >= std::min(window, n), "queries: ", queries.size(2),
        " window queries given, the window needs min(window, n) = ", std::min(window, n));
    TORCH_CHECK_VALUE(headDim <= kMaxHeadDim && batch <= 65535 && queries.size(1) <= 65535, "keys: shape ",
        keys.sizes(), " exceeds the kernels' limits");
    checkIndex(promptLengths, "prompt_lengths", {batch}, queries.device());
    return SelectShape{static_cast<int32_t>(batch), static_cast<int32_t>(queries.size(1)),
        static_cast<int32_t>(kvHeads), static_cast<int32_t>(n), static_cast<int32_t>(queries.size(2)),
        static_cast<int32_t>(headDim), 1};
}

//! The config of a window_scores call: a scored base whose budget is the window, so that every sequence longer than
//! the window is scored (the shorter ones have no older token).
inline SelectConfig windowConfig(int64_t window, int32_t n)
{
    SelectConfig config{};
    config.base = BaseMethod::kSnapKV;
    config.window = static_cast<int32_t>(window);
    config.budget = config.window;
    config.minBudget = config.window;
    config.poolKernel = 1;
    config.capacity = n;
    return config;
}

} // namespace criticalkv::torchops
