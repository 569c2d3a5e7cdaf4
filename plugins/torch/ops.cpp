// libcriticalkv_torch.so: the CriticalKV selection as typed torch ops, torch.ops.criticalkv.* (like flashinfer's and
// TensorRT-LLM's thop ops): the schemas, the CPU registration (the host version of plugins/host, the kernels' logic in
// fp32: what CI runs) and the Meta registration (output shapes for torch.compile and fake tensors). The CUDA
// registration (the kernels of plugins/kernels on torch's current stream) is ops_cuda.cpp, built where torch has CUDA.
// Every registration checks dtype, device, shape and contiguity first, with errors that name the argument; none runs
// the PyTorch reference (criticalkv/selection/op.py decides that, and says so).
//
// Ops (docs/torch_backend.md has their tensor shapes):
//   select_layer   one layer's kept entries (the operator of docs/operator.md); the kvzip pair with their scores
//   layer_ranking  one layer's part of a model-level selection (its ranking, kept until the last layer)
//   select_model   the model-level selection of every layer from their rankings
//   top_k          the batched top-k primitive (k per row, ties to the lower index, NaN above +inf)
//   value_norms    ||V W_O^h|| of every token and query head (l1 / l2)
//   window_scores  the window-mean attention of the older tokens
#include "ops_common.h"

#include "select_host.h"

#include <ATen/Parallel.h>

#include <stdexcept>

namespace criticalkv::torchops
{
namespace
{

using at::Tensor;
using Optional = std::optional<Tensor>;

//! Run the host driver, its std::invalid_argument as a ValueError.
template <typename Fn>
void hostCall(Fn&& fn)
{
    try
    {
        fn();
    }
    catch (std::invalid_argument const& e)
    {
        TORCH_CHECK_VALUE(false, e.what());
    }
}

Tensor f32(Tensor const& t)
{
    return t.to(at::kFloat).contiguous();
}

void checkLengths(Optional const& promptLengths, int64_t n)
{
    if (promptLengths.has_value() && promptLengths->numel() > 0)
    {
        int64_t const low = promptLengths->min().item<int64_t>();
        int64_t const high = promptLengths->max().item<int64_t>();
        TORCH_CHECK_VALUE(low >= 1 && high <= n, "prompt_lengths: every length must lie in [1, ", n, "], got ",
            promptLengths->to(at::kLong));
    }
}

// ---------------------------------------------------------------------------------------------------- select_layer

std::tuple<Tensor, Tensor, Tensor, Tensor> selectLayerCpu(Tensor const& queries, Tensor const& keys,
    Tensor const& values, Tensor const& oProj, Optional const& promptLengths, Optional const& kvBudget,
    Optional const& /*rotation*/, std::string const& policy, int64_t layerIdx, int64_t numLayers, int64_t capacity,
    Optional const& scores)
{
    auto const parsed = parsedPolicy(policy, layerIdx, numLayers, capacity);
    SelectShape const shape = layerShape(parsed->config, queries, keys, values, oProj, promptLengths, kvBudget, scores);
    checkLengths(promptLengths, shape.n);
    int64_t const cap = outputSize(shape.n, capacity);
    Tensor const q = f32(queries), k = f32(keys), v = f32(values), o = f32(oProj);
    Optional const lengths = asInt32(promptLengths), budget = asInt32(kvBudget);
    Optional const given = scores.has_value() ? Optional(scores->contiguous()) : std::nullopt;
    Tensor indices = at::empty({shape.batch, shape.kvHeads, cap}, keys.options().dtype(at::kInt));
    Tensor kept = at::empty({shape.batch, shape.kvHeads}, keys.options().dtype(at::kInt));
    hostCall([&] {
        host::HostInputs in{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>(),
            int32Data(lengths), int32Data(budget), given.has_value() ? given->data_ptr<float>() : nullptr};
        host::selectLayer(parsed->config, budgetTable(parsed->policy), shape, in,
            host::HostOutputs{indices.data_ptr<int32_t>(), kept.data_ptr<int32_t>(), nullptr, nullptr});
    });
    auto const [keptKeys, keptValues] = gatherKept(keys, values, indices);
    return {keptKeys, keptValues, kept, indices};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> selectLayerMeta(Tensor const& queries, Tensor const& keys,
    Tensor const& values, Tensor const& oProj, Optional const& promptLengths, Optional const& kvBudget,
    Optional const& /*rotation*/, std::string const& policy, int64_t layerIdx, int64_t numLayers, int64_t capacity,
    Optional const& scores)
{
    auto const parsed = parsedPolicy(policy, layerIdx, numLayers, capacity);
    SelectShape const shape = layerShape(parsed->config, queries, keys, values, oProj, promptLengths, kvBudget, scores);
    int64_t const cap = outputSize(shape.n, capacity);
    return {keys.new_empty({shape.batch, shape.kvHeads, cap, shape.headDim}),
        values.new_empty({shape.batch, shape.kvHeads, cap, shape.headDim}),
        keys.new_empty({shape.batch, shape.kvHeads}, keys.options().dtype(at::kInt)),
        keys.new_empty({shape.batch, shape.kvHeads, cap}, keys.options().dtype(at::kInt))};
}

// ---------------------------------------------------------------------------------------------------- model level

//! layer_ranking's outputs: ranking and attention [B, H_kv, m], critical the same when the policy refines, else [0].
std::tuple<Tensor, Tensor, Tensor> rankingOutputs(SelectConfig const& config, SelectShape const& shape,
    at::TensorOptions const& options)
{
    int64_t const m = olderCount(config, shape.n);
    auto const f = options.dtype(at::kFloat);
    return {at::empty({shape.batch, shape.kvHeads, m}, f), at::empty({shape.batch, shape.kvHeads, m}, f),
        config.twoStage ? at::empty({shape.batch, shape.kvHeads, m}, f) : at::empty({0}, f)};
}

std::shared_ptr<ParsedPolicy const> rankingPolicy(std::string const& policy, int64_t layerIdx, int64_t numLayers)
{
    auto parsed = parsedPolicy(policy, layerIdx, numLayers, 1);
    TORCH_CHECK_VALUE(modelLevel(parsed->config) && needsScores(parsed->config), "policy: ", parsed->policy.name,
        " is not a model-level method (select it layer by layer with select_layer)");
    return parsed;
}

SelectShape rankingShape(SelectConfig config, Tensor const& queries, Tensor const& keys, Tensor const& values,
    Tensor const& oProj, Optional const& promptLengths, Optional const& kvBudget, Optional const& scores)
{
    config.modelWide = 0; // layerShape refuses a model-wide policy for select_layer; here it is the point
    return layerShape(config, queries, keys, values, oProj, promptLengths, kvBudget, scores);
}

std::tuple<Tensor, Tensor, Tensor> layerRankingCpu(Tensor const& queries, Tensor const& keys, Tensor const& values,
    Tensor const& oProj, Optional const& promptLengths, Optional const& kvBudget, std::string const& policy,
    int64_t layerIdx, int64_t numLayers, Optional const& scores)
{
    auto const parsed = rankingPolicy(policy, layerIdx, numLayers);
    SelectShape const shape
        = rankingShape(parsed->config, queries, keys, values, oProj, promptLengths, kvBudget, scores);
    checkLengths(promptLengths, shape.n);
    auto outputs = rankingOutputs(parsed->config, shape, keys.options());
    Tensor const q = f32(queries), k = f32(keys), v = f32(values), o = f32(oProj);
    Optional const lengths = asInt32(promptLengths), budget = asInt32(kvBudget);
    Optional const given = scores.has_value() ? Optional(scores->contiguous()) : std::nullopt;
    hostCall([&] {
        host::HostInputs in{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), o.data_ptr<float>(),
            int32Data(lengths), int32Data(budget), given.has_value() ? given->data_ptr<float>() : nullptr};
        host::layerRanking(parsed->config, budgetTable(parsed->policy), shape, in, std::get<0>(outputs).data_ptr<float>(),
            std::get<1>(outputs).data_ptr<float>(),
            parsed->config.twoStage ? std::get<2>(outputs).data_ptr<float>() : nullptr);
    });
    return outputs;
}

std::tuple<Tensor, Tensor, Tensor> layerRankingMeta(Tensor const& queries, Tensor const& keys, Tensor const& values,
    Tensor const& oProj, Optional const& promptLengths, Optional const& kvBudget, std::string const& policy,
    int64_t layerIdx, int64_t numLayers, Optional const& scores)
{
    auto const parsed = rankingPolicy(policy, layerIdx, numLayers);
    SelectShape const shape
        = rankingShape(parsed->config, queries, keys, values, oProj, promptLengths, kvBudget, scores);
    return rankingOutputs(parsed->config, shape, keys.options());
}

using ModelOutputs = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>>;

ModelOutputs selectModelCpu(Tensor const& ranking, Optional const& attention, Optional const& critical,
    at::TensorList keys, at::TensorList values, Optional const& promptLengths, Optional const& kvBudget,
    std::string const& policy, at::IntArrayRef capacities)
{
    ModelCall const call
        = modelCall(policy, ranking, attention, critical, keys, values, promptLengths, kvBudget, capacities);
    SelectConfig const& config = call.parsed->config;
    SelectShape layer = call.shape.layer;
    layer.queryLen = layer.n;
    checkLengths(promptLengths, layer.n);
    int64_t const m = olderCount(config, layer.n);
    Optional const lengths = asInt32(promptLengths), budget = asInt32(kvBudget);
    Tensor const rank = ranking.contiguous();
    Optional const att = config.twoStage ? Optional(attention->contiguous()) : std::nullopt;
    Optional const crit = config.twoStage ? Optional(critical->contiguous()) : std::nullopt;
    std::vector<uint8_t> flags(static_cast<size_t>(layer.batch) * call.shape.layers * layer.kvHeads * m, 0);
    ModelOutputs out;
    hostCall([&] {
        host::allocateModel(config, call.shape, int32Data(lengths), int32Data(budget), rank.data_ptr<float>(),
            att.has_value() ? att->data_ptr<float>() : nullptr, crit.has_value() ? crit->data_ptr<float>() : nullptr,
            flags.data());
        for (int32_t l = 0; l < call.shape.layers; ++l)
        {
            SelectConfig layerConfig = config;
            layerConfig.capacity = static_cast<int32_t>(capacities[l]);
            int64_t const cap = outputSize(layer.n, capacities[l]);
            Tensor indices = at::empty({layer.batch, layer.kvHeads, cap}, keys[l].options().dtype(at::kInt));
            Tensor kept = at::empty({layer.batch, layer.kvHeads}, keys[l].options().dtype(at::kInt));
            host::HostInputs const in{nullptr, nullptr, nullptr, nullptr, int32Data(lengths), int32Data(budget)};
            host::compactModelLayer(layerConfig, layer, l, call.shape.layers, in, flags.data(),
                host::HostOutputs{indices.data_ptr<int32_t>(), kept.data_ptr<int32_t>(), nullptr, nullptr});
            auto const [keptKeys, keptValues] = gatherKept(keys[l], values[l], indices);
            std::get<0>(out).push_back(keptKeys);
            std::get<1>(out).push_back(keptValues);
            std::get<2>(out).push_back(kept);
            std::get<3>(out).push_back(indices);
        }
    });
    return out;
}

ModelOutputs selectModelMeta(Tensor const& ranking, Optional const& attention, Optional const& critical,
    at::TensorList keys, at::TensorList values, Optional const& promptLengths, Optional const& kvBudget,
    std::string const& policy, at::IntArrayRef capacities)
{
    ModelCall const call
        = modelCall(policy, ranking, attention, critical, keys, values, promptLengths, kvBudget, capacities);
    SelectShape const& layer = call.shape.layer;
    ModelOutputs out;
    for (size_t l = 0; l < keys.size(); ++l)
    {
        int64_t const cap = outputSize(layer.n, capacities[l]);
        std::get<0>(out).push_back(keys[l].new_empty({layer.batch, layer.kvHeads, cap, layer.headDim}));
        std::get<1>(out).push_back(values[l].new_empty({layer.batch, layer.kvHeads, cap, layer.headDim}));
        std::get<2>(out).push_back(keys[l].new_empty({layer.batch, layer.kvHeads}, keys[l].options().dtype(at::kInt)));
        std::get<3>(out).push_back(
            keys[l].new_empty({layer.batch, layer.kvHeads, cap}, keys[l].options().dtype(at::kInt)));
    }
    return out;
}

// ---------------------------------------------------------------------------------------------------- primitives

Tensor topKCpu(Tensor const& scores, Tensor const& k, Optional const& eligible)
{
    TopKCall const call = topKCall(scores, k, eligible);
    Tensor const s = scores.contiguous();
    Tensor const counts = k.to(at::kLong).expand(scores.sizes().slice(0, scores.dim() - 1)).contiguous().reshape({-1});
    Tensor flags = eligible.has_value() ? eligible->logical_not().to(at::kByte).mul(2).contiguous()
                                        : at::zeros(scores.sizes(), scores.options().dtype(at::kByte));
    float const* data = s.data_ptr<float>();
    uint8_t* marks = flags.data_ptr<uint8_t>();
    int64_t const* kk = counts.data_ptr<int64_t>();
    at::parallel_for(0, call.rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
        {
            host::selectTopK(data + r * call.length, marks + r * call.length, call.length, call.length, 0, kk[r], 1);
        }
    });
    return flags.eq(1);
}

Tensor topKMeta(Tensor const& scores, Tensor const& k, Optional const& eligible)
{
    topKCall(scores, k, eligible);
    return at::empty_like(scores, scores.options().dtype(at::kBool));
}

Tensor valueNormsCpu(Tensor const& values, Tensor const& oProj, int64_t numHeads, std::string const& kind)
{
    SelectShape const s = normsShape(values, oProj, numHeads, kind);
    Tensor const v = f32(values), o = f32(oProj);
    Tensor out = at::empty({s.batch, s.heads, s.n}, values.options().dtype(at::kFloat));
    ValueNorm const norm = kind == "l2" ? ValueNorm::kL2 : ValueNorm::kL1;
    at::parallel_for(0, static_cast<int64_t>(s.batch) * s.heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row)
        {
            host::valueProjectionNorms(s, v.data_ptr<float>(), o.data_ptr<float>(), static_cast<int32_t>(row / s.heads),
                static_cast<int32_t>(row % s.heads), s.n, norm, out.data_ptr<float>() + row * s.n);
        }
    });
    return out;
}

Tensor valueNormsMeta(Tensor const& values, Tensor const& oProj, int64_t numHeads, std::string const& kind)
{
    SelectShape const s = normsShape(values, oProj, numHeads, kind);
    return values.new_empty({s.batch, s.heads, s.n}, values.options().dtype(at::kFloat));
}

Tensor windowScoresCpu(Tensor const& queries, Tensor const& keys, Optional const& promptLengths, int64_t window)
{
    SelectShape const s = windowShape(queries, keys, promptLengths, window);
    checkLengths(promptLengths, s.n);
    SelectConfig const config = windowConfig(window, s.n);
    int64_t const m = olderCount(config, s.n);
    Tensor const q = f32(queries), k = f32(keys);
    Optional const lengths = asInt32(promptLengths);
    Tensor out = at::zeros({s.batch, s.heads, m}, queries.options().dtype(at::kFloat));
    host::HostInputs const in{q.data_ptr<float>(), k.data_ptr<float>(), nullptr, nullptr, int32Data(lengths), nullptr};
    at::parallel_for(0, static_cast<int64_t>(s.batch) * s.heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> squares(static_cast<size_t>(m > 0 ? m : 1));
        for (int64_t row = begin; row < end; ++row)
        {
            int32_t const b = static_cast<int32_t>(row / s.heads);
            int32_t const validStart = lengths.has_value() ? s.n - std::clamp(int32Data(lengths)[b], 1, s.n) : 0;
            host::windowScores(config, s, in, b, static_cast<int32_t>(row % s.heads), validStart,
                out.data_ptr<float>() + row * m, squares.data(), nullptr);
        }
    });
    return out;
}

Tensor windowScoresMeta(Tensor const& queries, Tensor const& keys, Optional const& promptLengths, int64_t window)
{
    SelectShape const s = windowShape(queries, keys, promptLengths, window);
    return queries.new_empty({s.batch, s.heads, s.n - std::min<int64_t>(window, s.n)},
        queries.options().dtype(at::kFloat));
}

} // namespace
} // namespace criticalkv::torchops

TORCH_LIBRARY(criticalkv, m)
{
    m.def("select_layer(Tensor queries, Tensor keys, Tensor values, Tensor o_proj, Tensor? prompt_lengths, "
          "Tensor? kv_budget, Tensor? rotation, str policy, int layer_idx, int num_layers, int capacity, "
          "Tensor? scores=None) -> (Tensor, Tensor, Tensor, Tensor)");
    m.def("layer_ranking(Tensor queries, Tensor keys, Tensor values, Tensor o_proj, Tensor? prompt_lengths, "
          "Tensor? kv_budget, str policy, int layer_idx, int num_layers, Tensor? scores=None) -> (Tensor, Tensor, Tensor)");
    m.def("select_model(Tensor ranking, Tensor? attention, Tensor? critical, Tensor[] keys, Tensor[] values, "
          "Tensor? prompt_lengths, Tensor? kv_budget, str policy, int[] capacities) -> "
          "(Tensor[], Tensor[], Tensor[], Tensor[])");
    m.def("top_k(Tensor scores, Tensor k, Tensor? eligible=None) -> Tensor");
    m.def("value_norms(Tensor values, Tensor o_proj, int num_heads, str kind=\"l1\") -> Tensor");
    m.def("window_scores(Tensor queries, Tensor keys, Tensor? prompt_lengths, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(criticalkv, CPU, m)
{
    using namespace criticalkv::torchops;
    m.impl("select_layer", &selectLayerCpu);
    m.impl("layer_ranking", &layerRankingCpu);
    m.impl("select_model", &selectModelCpu);
    m.impl("top_k", &topKCpu);
    m.impl("value_norms", &valueNormsCpu);
    m.impl("window_scores", &windowScoresCpu);
}

TORCH_LIBRARY_IMPL(criticalkv, Meta, m)
{
    using namespace criticalkv::torchops;
    m.impl("select_layer", &selectLayerMeta);
    m.impl("layer_ranking", &layerRankingMeta);
    m.impl("select_model", &selectModelMeta);
    m.impl("top_k", &topKMeta);
    m.impl("value_norms", &valueNormsMeta);
    m.impl("window_scores", &windowScoresMeta);
}
