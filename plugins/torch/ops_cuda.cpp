// The CUDA registration of torch.ops.criticalkv.* (ops.cpp has the schemas): the kernels of plugins/kernels through
// their launch functions, on torch's current stream, the workspace from torch's caching allocator. No host
// synchronisation (CUDA-graph capturable: a runtime kv_budget stays in device memory), no PyTorch reference. Built
// only where torch has CUDA (scripts/build_plugin.sh).
#include "ops_common.h"

#include "criticalkv/kernels.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime_api.h>

namespace criticalkv::torchops
{
namespace
{

static_assert(kMaxHeadDim == criticalkv::kMaxHeadDim, "the torch ops check the kernels' head-dimension limit");

using at::Tensor;
using Optional = std::optional<Tensor>;

DType dtypeOf(at::ScalarType type)
{
    return type == at::kFloat ? DType::kFloat32 : (type == at::kHalf ? DType::kFloat16 : DType::kBFloat16);
}

void checkLaunch(cudaError_t status, char const* op)
{
    TORCH_CHECK(status == cudaSuccess, "criticalkv::", op, ": ", cudaGetErrorName(status), ": ",
        cudaGetErrorString(status));
}

Tensor workspaceOf(size_t bytes, c10::Device device)
{
    return at::empty({static_cast<int64_t>(bytes > 0 ? bytes : 1)}, at::TensorOptions().dtype(at::kByte).device(device));
}

cudaStream_t currentStream(c10::Device device)
{
    return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

std::tuple<Tensor, Tensor, Tensor, Tensor> selectLayerCuda(Tensor const& queries, Tensor const& keys,
    Tensor const& values, Tensor const& oProj, Optional const& promptLengths, Optional const& kvBudget,
    Optional const& /*rotation*/, std::string const& policy, int64_t layerIdx, int64_t numLayers, int64_t capacity,
    Optional const& scores)
{
    auto const parsed = parsedPolicy(policy, layerIdx, numLayers, capacity);
    SelectShape const shape = layerShape(parsed->config, queries, keys, values, oProj, promptLengths, kvBudget, scores);
    c10::cuda::CUDAGuard const guard(keys.device());
    int64_t const cap = outputSize(shape.n, capacity);
    Tensor const q = queries.contiguous(), k = keys.contiguous(), v = values.contiguous(), o = oProj.contiguous();
    Optional const lengths = asInt32(promptLengths), budget = asInt32(kvBudget);
    Optional const given = scores.has_value() ? Optional(scores->contiguous()) : std::nullopt;
    Tensor keptKeys = k.new_empty({shape.batch, shape.kvHeads, cap, shape.headDim});
    Tensor keptValues = v.new_empty({shape.batch, shape.kvHeads, cap, shape.headDim});
    Tensor keptLengths = at::empty({shape.batch, shape.kvHeads}, k.options().dtype(at::kInt));
    Tensor keptIndices = at::empty({shape.batch, shape.kvHeads, cap}, k.options().dtype(at::kInt));
    size_t const bytes = workspaceLayout(parsed->config, shape).total;
    Tensor workspace = workspaceOf(bytes, keys.device());
    SelectTensors const t{dtypeOf(keys.scalar_type()), q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
        int32Data(lengths), int32Data(budget), keptKeys.data_ptr(), keptValues.data_ptr(),
        keptLengths.data_ptr<int32_t>(), keptIndices.data_ptr<int32_t>(), nullptr,
        given.has_value() ? given->data_ptr<float>() : nullptr};
    checkLaunch(launchCriticalKVSelect(parsed->config, budgetTable(parsed->policy), shape, t, workspace.data_ptr(), bytes,
                    currentStream(keys.device())),
        "select_layer");
    return {keptKeys, keptValues, keptLengths, keptIndices};
}

std::tuple<Tensor, Tensor, Tensor> layerRankingCuda(Tensor const& queries, Tensor const& keys, Tensor const& values,
    Tensor const& oProj, Optional const& promptLengths, Optional const& kvBudget, std::string const& policy,
    int64_t layerIdx, int64_t numLayers, Optional const& scores)
{
    auto const parsed = parsedPolicy(policy, layerIdx, numLayers, 1);
    TORCH_CHECK_VALUE(modelLevel(parsed->config) && needsScores(parsed->config), "policy: ", parsed->policy.name,
        " is not a model-level method (select it layer by layer with select_layer)");
    SelectConfig perLayer = parsed->config;
    perLayer.modelWide = 0;
    SelectShape const shape = layerShape(perLayer, queries, keys, values, oProj, promptLengths, kvBudget, scores);
    c10::cuda::CUDAGuard const guard(keys.device());
    int64_t const m = olderCount(parsed->config, shape.n);
    auto const f = keys.options().dtype(at::kFloat);
    Tensor ranking = at::empty({shape.batch, shape.kvHeads, m}, f);
    Tensor attention = at::empty({shape.batch, shape.kvHeads, m}, f);
    Tensor critical = parsed->config.twoStage ? at::empty({shape.batch, shape.kvHeads, m}, f) : at::empty({0}, f);
    Tensor const q = queries.contiguous(), k = keys.contiguous(), v = values.contiguous(), o = oProj.contiguous();
    Optional const lengths = asInt32(promptLengths), budget = asInt32(kvBudget);
    Optional const given = scores.has_value() ? Optional(scores->contiguous()) : std::nullopt;
    size_t const bytes = workspaceLayout(parsed->config, shape).total;
    Tensor workspace = workspaceOf(bytes, keys.device());
    LayerRankingTensors const t{dtypeOf(keys.scalar_type()), q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
        int32Data(lengths), int32Data(budget), given.has_value() ? given->data_ptr<float>() : nullptr,
        ranking.data_ptr<float>(), attention.data_ptr<float>(),
        parsed->config.twoStage ? critical.data_ptr<float>() : nullptr};
    checkLaunch(launchLayerRanking(parsed->config, budgetTable(parsed->policy), shape, t, workspace.data_ptr(), bytes,
                    currentStream(keys.device())),
        "layer_ranking");
    return {ranking, attention, critical};
}

std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>> selectModelCuda(
    Tensor const& ranking, Optional const& attention, Optional const& critical, at::TensorList keys,
    at::TensorList values, Optional const& promptLengths, Optional const& kvBudget, std::string const& policy,
    at::IntArrayRef capacities)
{
    ModelCall const call
        = modelCall(policy, ranking, attention, critical, keys, values, promptLengths, kvBudget, capacities);
    SelectConfig const& config = call.parsed->config;
    SelectShape const& layer = call.shape.layer;
    c10::cuda::CUDAGuard const guard(keys[0].device());
    Optional const lengths = asInt32(promptLengths), budget = asInt32(kvBudget);
    Tensor const rank = ranking.contiguous();
    Optional const att = config.twoStage ? Optional(attention->contiguous()) : std::nullopt;
    Optional const crit = config.twoStage ? Optional(critical->contiguous()) : std::nullopt;
    std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>> out;
    std::vector<Tensor> keysIn, valuesIn;
    std::vector<ModelLayerTensors> layers;
    for (int32_t l = 0; l < call.shape.layers; ++l)
    {
        keysIn.push_back(keys[l].contiguous());
        valuesIn.push_back(values[l].contiguous());
        int64_t const cap = outputSize(layer.n, capacities[l]);
        std::get<0>(out).push_back(keysIn.back().new_empty({layer.batch, layer.kvHeads, cap, layer.headDim}));
        std::get<1>(out).push_back(valuesIn.back().new_empty({layer.batch, layer.kvHeads, cap, layer.headDim}));
        std::get<2>(out).push_back(at::empty({layer.batch, layer.kvHeads}, keysIn.back().options().dtype(at::kInt)));
        std::get<3>(out).push_back(
            at::empty({layer.batch, layer.kvHeads, cap}, keysIn.back().options().dtype(at::kInt)));
        layers.push_back(ModelLayerTensors{keysIn.back().data_ptr(), valuesIn.back().data_ptr(),
            std::get<0>(out).back().data_ptr(), std::get<1>(out).back().data_ptr(),
            std::get<2>(out).back().data_ptr<int32_t>(), std::get<3>(out).back().data_ptr<int32_t>(),
            static_cast<int32_t>(capacities[l])});
    }
    ModelWorkspaceLayout const layout = modelWorkspaceLayout(config, call.shape);
    Tensor workspace = workspaceOf(layout.total, keys[0].device());
    ModelSelectTensors const t{dtypeOf(keys[0].scalar_type()), int32Data(lengths), int32Data(budget),
        rank.data_ptr<float>(), att.has_value() ? att->data_ptr<float>() : nullptr,
        crit.has_value() ? crit->data_ptr<float>() : nullptr, layers.data()};
    checkLaunch(launchModelSelect(config, call.shape, t, workspace.data_ptr(), layout.total,
                    currentStream(keys[0].device())),
        "select_model");
    return out;
}

Tensor topKCuda(Tensor const& scores, Tensor const& k, Optional const& eligible)
{
    TopKCall const call = topKCall(scores, k, eligible);
    TORCH_CHECK_VALUE(call.rows <= (int64_t{1} << 31) - 1, "scores: too many rows");
    c10::cuda::CUDAGuard const guard(scores.device());
    int64_t const length = call.length;
    int64_t const rows = call.rows;
    Tensor const s = scores.contiguous();
    Tensor const counts = k.to(at::kLong).expand(scores.sizes().slice(0, scores.dim() - 1)).contiguous();
    Tensor flags = eligible.has_value() ? eligible->logical_not().to(at::kByte).mul(2).contiguous()
                                        : at::zeros(scores.sizes(), scores.options().dtype(at::kByte));
    TopKRows const r{s.data_ptr<float>(), flags.data_ptr<uint8_t>(), counts.data_ptr<int64_t>(), nullptr,
        static_cast<int32_t>(rows), static_cast<int32_t>(length), length, static_cast<int32_t>(length), 1, 1};
    size_t const bytes = topKScratchBytes(r.rows, r.len);
    Tensor scratch = workspaceOf(bytes, scores.device());
    checkLaunch(launchTopK(r, scratch.data_ptr(), bytes, currentStream(scores.device())), "top_k");
    return flags.eq(1);
}

Tensor valueNormsCuda(Tensor const& values, Tensor const& oProj, int64_t numHeads, std::string const& kind)
{
    SelectShape const s = normsShape(values, oProj, numHeads, kind);
    int64_t const headDim = s.headDim;
    c10::cuda::CUDAGuard const guard(values.device());
    Tensor const v = values.contiguous(), o = oProj.contiguous();
    Tensor out = at::empty({s.batch, s.heads, s.n}, values.options().dtype(at::kFloat));
    size_t const h = static_cast<size_t>(s.heads), d = static_cast<size_t>(headDim);
    bool const l2 = kind == "l2";
    size_t const gramBytes = alignWorkspace(h * d * d * 4), piecesBytes = alignWorkspace(h * kGramPiecesMax * d * d * 2);
    Tensor scratch = workspaceOf(l2 ? gramBytes + piecesBytes + alignWorkspace(h * 4) : 0, values.device());
    auto* base = static_cast<unsigned char*>(scratch.data_ptr());
    ValueNormParams p{};
    p.shape = s;
    p.dtype = dtypeOf(values.scalar_type());
    p.values = v.data_ptr();
    p.oProj = o.data_ptr();
    p.numTokens = s.n;
    p.kind = l2 ? ValueNorm::kL2 : ValueNorm::kL1;
    p.out = out.data_ptr<float>();
    p.gram = l2 ? GramScratch{reinterpret_cast<float*>(base), base + gramBytes,
                      reinterpret_cast<float*>(base + gramBytes + piecesBytes)}
                : GramScratch{};
    checkLaunch(launchValueNorms(p, currentStream(values.device())), "value_norms");
    return out;
}

Tensor windowScoresCuda(Tensor const& queries, Tensor const& keys, Optional const& promptLengths, int64_t window)
{
    SelectShape const s = windowShape(queries, keys, promptLengths, window);
    c10::cuda::CUDAGuard const guard(queries.device());
    SelectConfig const config = windowConfig(window, s.n);
    int64_t const batch = s.batch, n = s.n;
    int64_t const w = std::min<int64_t>(window, n), m = n - w;
    size_t const tiles = (static_cast<size_t>(n) + kKeyTile - 1) / kKeyTile;
    size_t const rows = static_cast<size_t>(batch) * s.heads * static_cast<size_t>(w);
    size_t const partials = alignWorkspace(rows * tiles * 4 * sizeof(float));
    Tensor scratch = workspaceOf(partials + alignWorkspace(rows * 2 * sizeof(float)), queries.device());
    Tensor out = at::zeros({batch, s.heads, m}, queries.options().dtype(at::kFloat)); // sequences of <= w: zeros
    Tensor const q = queries.contiguous(), k = keys.contiguous();
    Optional const lengths = asInt32(promptLengths);
    WindowScoreParams p{};
    p.config = config;
    p.shape = s;
    p.dtype = dtypeOf(queries.scalar_type());
    p.queries = q.data_ptr();
    p.keys = k.data_ptr();
    p.promptLengths = int32Data(lengths);
    p.partials = static_cast<float*>(scratch.data_ptr());
    p.rowStats = reinterpret_cast<float*>(static_cast<unsigned char*>(scratch.data_ptr()) + partials);
    p.raw = out.data_ptr<float>();
    if (m > 0)
    {
        checkLaunch(launchWindowScores(p, currentStream(queries.device())), "window_scores");
    }
    return out;
}

} // namespace
} // namespace criticalkv::torchops

TORCH_LIBRARY_IMPL(criticalkv, CUDA, m)
{
    using namespace criticalkv::torchops;
    m.impl("select_layer", &selectLayerCuda);
    m.impl("layer_ranking", &layerRankingCuda);
    m.impl("select_model", &selectModelCuda);
    m.impl("top_k", &topKCuda);
    m.impl("value_norms", &valueNormsCuda);
    m.impl("window_scores", &windowScoresCuda);
}
