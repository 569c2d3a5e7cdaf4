// Short runs of launchCriticalKVSelect for compute-sanitizer (memcheck, racecheck, synccheck, initcheck), one named shape
// at a time or all of them:
//   compute-sanitizer --tool racecheck build/plugins/ckv_sanitizer_driver [--list] [SHAPE ...]   (no SHAPE: every one)
// Each shape is picked for the kernels it reaches (a left-padded batch, n not a multiple of the tiles, every launch run
// with and without a kv_budget below the built budget; CriticalKV's pruned stage 2 once more on weights-only terms
// computed beforehand by launchPrunedTerms):
//   small    d_h 64, hidden 256, n 333: every policy, value_norm l1 and l2, fp32 / fp16 / bf16 (the SIMT and the
//            tensor-core paths at their smallest tiles, every selection flow);
//   d128     d_h 128, hidden 4096, n 300, fp16 / bf16: the value norms' 3-deep cp.async ring of W_O tiles (172 KiB of
//            shared memory per CTA), gramQuad at d_h 128 (MmaTiles<4, 2, 2>: the l2 norms' 3 pieces and the pruned
//            stage 2's bounds), the pruned stage 2's tensor-core bound terms, WindowTiles<8> (defensivekv's rows
//            included), the exact norms of gathered candidates split over the group's query heads;
//   longrow  n 4,700 (4,668 older tokens per head, over the 4,096 one CTA takes): the multi-CTA top-k (per-CTA
//            histograms added with atomics, __threadfence, the last CTA choosing the digit), the layer-wide rows of
//            the shared allocation, defensivekv's mass count, the pruned stage 2's rounds on multi-CTA rows, and the
//            compaction over several tiles of positions;
//   model    the model-level selection (launchLayerRanking per layer, launchModelSelect after the last; bf16, 3
//            layers, n 1,200 so that the model-wide row of 6 heads takes several CTAs): layer-defensivekv without
//            and with a head cap (the candidates' top-k, the per-head radix sort, the level kernel's bisection and
//            its shared-memory cache, the marks), layer-kvzip-criticalkv with a cap and its scores (the refinement),
//            each with and without a kv_budget; and kvzip-criticalkv per layer with its scores (the sinks).
// Exit code 0 = every case ran without a CUDA error; the sanitizer's own exit code reports what it found.
#include "criticalkv/kernels.h"
#include "policy.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace criticalkv;

namespace
{

#define CHECK_CUDA(call)                                                                                               \
    do                                                                                                                 \
    {                                                                                                                  \
        cudaError_t const status_ = (call);                                                                            \
        if (status_ != cudaSuccess)                                                                                    \
        {                                                                                                              \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(status_));          \
            return 1;                                                                                                  \
        }                                                                                                              \
    } while (0)

//! One named shape of the driver: the tensors' dimensions and which policies, norms and dtypes run on it.
struct DriverShape
{
    char const* name;
    SelectShape shape;
    std::vector<int32_t> lengths; //!< prompt_lengths (the first = n, the others left-padded)
    int32_t window;
    int32_t budget;
    std::vector<std::string> policies; //!< empty: every policy the plugin accepts
    std::vector<std::string> norms;
    std::vector<DType> dtypes;
};

std::vector<DriverShape> driverShapes()
{
    std::vector<std::string> const all{};
    return {
        {"small", SelectShape{3, 8, 2, 333, 20, 64, 256}, {333, 201, 17}, 16, 72, all, {"l1", "l2"},
            {DType::kFloat32, DType::kFloat16, DType::kBFloat16}},
        {"d128", SelectShape{2, 4, 2, 300, 32, 128, 4096}, {300, 181}, 32, 96,
            {"snapkv", "criticalkv", "ada-criticalkv", "laprox", "defensivekv"}, {"l1", "l2"},
            {DType::kFloat16, DType::kBFloat16}},
        {"longrow", SelectShape{2, 4, 2, 4700, 32, 64, 256}, {4700, 4301}, 32, 256,
            {"snapkv", "pyramidkv", "adakv", "criticalkv", "ada-criticalkv", "laprox", "defensivekv"}, {"l1"},
            {DType::kBFloat16}},
        {"model", SelectShape{2, 4, 2, 1200, 32, 64, 256}, {1200, 877}, 32, 96,
            {"layer-defensivekv", "layer-kvzip-criticalkv", "kvzip-criticalkv"}, {"l1"}, {DType::kBFloat16}},
    };
}

char const* dtypeName(DType dtype)
{
    return dtype == DType::kFloat32 ? "fp32" : (dtype == DType::kFloat16 ? "fp16" : "bf16");
}

template <typename T>
std::vector<T> randomTensor(size_t count, std::mt19937& rng, float scale)
{
    std::normal_distribution<float> normal(0.0F, scale);
    std::vector<T> out(count);
    for (auto& x : out)
    {
        x = static_cast<T>(normal(rng));
    }
    return out;
}

template <typename T>
int runCase(PolicyConfig const& policy, DriverShape const& shape, DType dtype, std::mt19937& rng)
{
    SelectShape const s = shape.shape;
    SelectConfig const config = makeSelectConfig(policy, PolicyUse::kKernels);
    int32_t const cap = outputCapacity(config, s.n);
    size_t const qCount = size_t(s.batch) * s.heads * s.queryLen * s.headDim;
    size_t const kvCount = size_t(s.batch) * s.kvHeads * s.n * s.headDim;
    size_t const oCount = size_t(s.hidden) * s.heads * s.headDim;
    size_t const keptCount = size_t(s.batch) * s.kvHeads * cap * s.headDim;
    std::vector<T> hq = randomTensor<T>(qCount, rng, 2.0F);
    std::vector<T> hk = randomTensor<T>(kvCount, rng, 1.0F);
    std::vector<T> hv = randomTensor<T>(kvCount, rng, 1.0F);
    std::vector<T> ho = randomTensor<T>(oCount, rng, 0.05F);
    std::vector<int32_t> const& lengths = shape.lengths;
    int32_t const runtimeBudget = policy.budget - 20; // a request below the built budget: kv_budget on the device
    void *q, *k, *v, *o, *kk, *kv, *workspace = nullptr;
    int32_t *len, *kvBudget, *keptLengths, *keptIndices;
    CHECK_CUDA(cudaMalloc(&q, qCount * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&k, kvCount * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&v, kvCount * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&o, oCount * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&kk, keptCount * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&kv, keptCount * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&len, lengths.size() * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&kvBudget, sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&keptLengths, size_t(s.batch) * s.kvHeads * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&keptIndices, size_t(s.batch) * s.kvHeads * cap * sizeof(int32_t)));
    size_t const bytes = workspaceLayout(config, s).total;
    if (bytes > 0)
    {
        CHECK_CUDA(cudaMalloc(&workspace, bytes));
    }
    CHECK_CUDA(cudaMemcpy(q, hq.data(), qCount * sizeof(T), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(k, hk.data(), kvCount * sizeof(T), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(v, hv.data(), kvCount * sizeof(T), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(o, ho.data(), oCount * sizeof(T), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(len, lengths.data(), lengths.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(kvBudget, &runtimeBudget, sizeof(int32_t), cudaMemcpyHostToDevice));
    // a kvzip policy's external scores [B, H_kv, n]
    float* scores = nullptr;
    if (externalScores(config))
    {
        std::vector<float> const hs = randomTensor<float>(size_t(s.batch) * s.kvHeads * s.n, rng, 1.0F);
        CHECK_CUDA(cudaMalloc(&scores, hs.size() * sizeof(float)));
        CHECK_CUDA(cudaMemcpy(scores, hs.data(), hs.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    // CriticalKV's pruned stage 2 also runs on weights-only terms computed beforehand (launchPrunedTerms)
    void* terms = nullptr;
    if (prunedStage2On(config))
    {
        size_t const termBytes = prunedTermsBytes(s);
        CHECK_CUDA(cudaMalloc(&terms, termBytes));
        CHECK_CUDA(launchPrunedTerms(s, dtype, o, terms, termBytes, nullptr));
    }
    for (void const* given : {static_cast<void const*>(nullptr), static_cast<void const*>(terms)})
    {
        for (int32_t const* budget : {static_cast<int32_t const*>(nullptr), static_cast<int32_t const*>(kvBudget)})
        {
            if (given != nullptr && budget != nullptr)
            {
                continue; // one run with the given terms
            }
            SelectTensors const t{dtype, q, k, v, o, len, budget, kk, kv, keptLengths, keptIndices, given, scores};
            CHECK_CUDA(launchCriticalKVSelect(config, budgetTable(policy), s, t, workspace, bytes, nullptr));
            CHECK_CUDA(cudaDeviceSynchronize());
        }
        if (terms == nullptr)
        {
            break;
        }
    }
    for (void* p : {q, k, v, o, kk, kv, static_cast<void*>(len), static_cast<void*>(kvBudget), static_cast<void*>(keptLengths),
             static_cast<void*>(keptIndices), workspace, terms, static_cast<void*>(scores)})
    {
        if (p != nullptr)
        {
            CHECK_CUDA(cudaFree(p));
        }
    }
    return 0;
}

//! The model-level selection of `layers` layers of `shape` (every layer's ranking, then launchModelSelect), with and
//! without a kv_budget.
template <typename T>
int runModel(PolicyConfig const& policy, DriverShape const& shape, DType dtype, std::mt19937& rng)
{
    SelectShape const s = shape.shape;
    int32_t const layers = policy.num_layers;
    SelectConfig const config = makeSelectConfig(policy, PolicyUse::kKernels);
    int32_t const m = s.n - windowLength(config, s.n);
    ModelShape const model{s, layers};
    size_t const qCount = size_t(s.batch) * s.heads * s.queryLen * s.headDim;
    size_t const kvCount = size_t(s.batch) * s.kvHeads * s.n * s.headDim;
    size_t const oCount = size_t(s.hidden) * s.heads * s.headDim;
    size_t const layerRows = size_t(s.batch) * s.kvHeads * m;
    int32_t const cap = outputCapacity(config, s.n);
    std::vector<void*> owned;
    auto alloc = [&](size_t bytes) -> void* {
        void* p = nullptr;
        if (cudaMalloc(&p, bytes) != cudaSuccess)
        {
            return nullptr;
        }
        owned.push_back(p);
        return p;
    };
    auto upload = [&](std::vector<T> const& host) -> void* {
        void* p = alloc(host.size() * sizeof(T));
        return p != nullptr && cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess
            ? p
            : nullptr;
    };
    auto* len = static_cast<int32_t*>(alloc(shape.lengths.size() * sizeof(int32_t)));
    auto* kvBudget = static_cast<int32_t*>(alloc(sizeof(int32_t)));
    int32_t const runtimeBudget = policy.budget - 20;
    CHECK_CUDA(cudaMemcpy(len, shape.lengths.data(), shape.lengths.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(kvBudget, &runtimeBudget, sizeof(int32_t), cudaMemcpyHostToDevice));
    size_t const modelRowsBytes = layerRows * layers * sizeof(float);
    auto* ranking = static_cast<float*>(alloc(modelRowsBytes));
    auto* attention = static_cast<float*>(alloc(modelRowsBytes));
    auto* critical = static_cast<float*>(alloc(modelRowsBytes));
    auto* layerRanking = static_cast<float*>(alloc(layerRows * sizeof(float)));
    auto* layerAttention = static_cast<float*>(alloc(layerRows * sizeof(float)));
    auto* layerCritical = static_cast<float*>(alloc(layerRows * sizeof(float)));
    size_t const layerBytes = workspaceLayout(config, s).total;
    void* layerWorkspace = alloc(layerBytes > 0 ? layerBytes : 1);
    ModelWorkspaceLayout const layout = modelWorkspaceLayout(config, model);
    void* workspace = alloc(layout.total > 0 ? layout.total : 1);
    std::vector<ModelLayerTensors> outputs;
    for (int32_t l = 0; l < layers; ++l)
    {
        void* q = upload(randomTensor<T>(qCount, rng, 2.0F));
        void* k = upload(randomTensor<T>(kvCount, rng, 1.0F));
        void* v = upload(randomTensor<T>(kvCount, rng, 1.0F));
        void* o = upload(randomTensor<T>(oCount, rng, 0.05F));
        float* scores = nullptr;
        if (externalScores(config))
        {
            std::vector<float> const hs = randomTensor<float>(size_t(s.batch) * s.kvHeads * s.n, rng, 1.0F);
            scores = static_cast<float*>(alloc(hs.size() * sizeof(float)));
            CHECK_CUDA(cudaMemcpy(scores, hs.data(), hs.size() * sizeof(float), cudaMemcpyHostToDevice));
        }
        if (q == nullptr || k == nullptr || v == nullptr || o == nullptr || layerWorkspace == nullptr)
        {
            std::fprintf(stderr, "model: allocation failed\n");
            return 1;
        }
        LayerRankingTensors const t{dtype, q, k, v, o, len, nullptr, scores, layerRanking, layerAttention,
            config.twoStage ? layerCritical : nullptr};
        CHECK_CUDA(launchLayerRanking(config, budgetTable(policy), s, t, layerWorkspace, layerBytes, nullptr));
        // layer l's rows of the model-wide [B, L H_kv, m] buffers
        size_t const width = size_t(s.kvHeads) * m * sizeof(float);
        for (auto [to, from] : {std::pair{ranking, layerRanking}, std::pair{attention, layerAttention},
                 std::pair{critical, layerCritical}})
        {
            if (to != ranking && !config.twoStage)
            {
                continue; // read only by the refinement (and not written otherwise)
            }
            CHECK_CUDA(cudaMemcpy2D(reinterpret_cast<char*>(to) + l * width, width * layers, from, width, width,
                size_t(s.batch), cudaMemcpyDeviceToDevice));
        }
        size_t const kept = size_t(s.batch) * s.kvHeads * cap;
        outputs.push_back(ModelLayerTensors{k, v, alloc(kept * s.headDim * sizeof(T)), alloc(kept * s.headDim * sizeof(T)),
            static_cast<int32_t*>(alloc(size_t(s.batch) * s.kvHeads * sizeof(int32_t))),
            static_cast<int32_t*>(alloc(kept * sizeof(int32_t))), cap});
    }
    for (int32_t const* budget : {static_cast<int32_t const*>(nullptr), static_cast<int32_t const*>(kvBudget)})
    {
        ModelSelectTensors const t{dtype, len, budget, ranking, config.twoStage ? attention : nullptr,
            config.twoStage ? critical : nullptr, outputs.data()};
        CHECK_CUDA(launchModelSelect(config, model, t, workspace, layout.total, nullptr));
        CHECK_CUDA(cudaDeviceSynchronize());
    }
    for (void* p : owned)
    {
        CHECK_CUDA(cudaFree(p));
    }
    return 0;
}

int runShape(DriverShape const& shape, std::mt19937& rng)
{
    int failures = 0;
    std::vector<std::string> const names = shape.policies.empty() ? policyNames() : shape.policies;
    for (std::string const& name : names)
    {
        for (std::string const& norm : shape.norms)
        {
            PolicyConfig policy;
            policy.name = name;
            policy.budget = shape.budget;
            policy.window = shape.window;
            policy.value_norm = norm;
            policy.layer_idx = 1;
            policy.num_layers = 3;
            policy.capacity = 4096;
            // layer_budgets[b - window]: b - window, halved for PyramidKV so the device lookup runs (none for full)
            bool const pyramid = baseOf(name) == BaseMethod::kPyramidKV;
            for (int32_t b = policy.window; b <= policy.budget && baseOf(name) != BaseMethod::kFull; ++b)
            {
                policy.layer_budgets.push_back(pyramid ? (b - policy.window) / 2 : b - policy.window);
            }
            if (!validateFor(policy, PolicyUse::kKernels).empty())
            {
                continue; // a method with no kernel flow (the Expected Attention pair)
            }
            if (modelLevel(makeSelectConfig(policy, PolicyUse::kKernels)))
            {
                if (std::string(shape.name) != "model")
                {
                    continue; // the model-level selection runs on its own shape
                }
                for (double const cap : {0.0, 2.0})
                {
                    policy.head_cap_ratio = cap;
                    policy.layer_idx = 0;
                    std::printf("%s: %s head_cap_ratio=%g model-level\n", shape.name, name.c_str(), cap);
                    std::fflush(stdout);
                    failures += runModel<__nv_bfloat16>(policy, shape, DType::kBFloat16, rng);
                }
                continue;
            }
            for (DType dtype : shape.dtypes)
            {
                std::printf("%s: %s value_norm=%s %s\n", shape.name, name.c_str(), norm.c_str(), dtypeName(dtype));
                std::fflush(stdout);
                int const failed = dtype == DType::kFloat32 ? runCase<float>(policy, shape, dtype, rng)
                    : dtype == DType::kFloat16              ? runCase<__half>(policy, shape, dtype, rng)
                                                            : runCase<__nv_bfloat16>(policy, shape, dtype, rng);
                failures += failed;
            }
        }
    }
    return failures;
}

} // namespace

int main(int argc, char** argv)
{
    std::vector<DriverShape> const shapes = driverShapes();
    std::vector<DriverShape> chosen;
    for (int i = 1; i < argc; ++i)
    {
        std::string const arg = argv[i];
        if (arg == "--list" || arg == "-h" || arg == "--help")
        {
            std::printf("usage: %s [--list] [SHAPE ...] (no SHAPE: all)\nshapes:", argv[0]);
            for (DriverShape const& s : shapes)
            {
                std::printf(" %s", s.name);
            }
            std::printf("\n");
            return 0;
        }
        bool found = false;
        for (DriverShape const& s : shapes)
        {
            if (arg == s.name)
            {
                chosen.push_back(s);
                found = true;
            }
        }
        if (!found)
        {
            std::fprintf(stderr, "ckv_sanitizer_driver: unknown shape '%s' (see --list)\n", arg.c_str());
            return 2;
        }
    }
    if (chosen.empty())
    {
        chosen = shapes;
    }
    std::mt19937 rng(7);
    int failures = 0;
    for (DriverShape const& shape : chosen)
    {
        failures += runShape(shape, rng);
    }
    std::printf("ckv_sanitizer_driver: %d failing case(s)\n", failures);
    return failures == 0 ? 0 : 1;
}
