// A small, self-contained run of launchCriticalKVSelect for compute-sanitizer (memcheck, racecheck, synccheck):
//   compute-sanitizer --tool memcheck build/plugins/ckv_sanitizer_driver
// Every policy, fp32 / fp16 / bf16, a left-padded batch, n not a multiple of the tiles. Exit code 0 = clean run.
#include "criticalkv/kernels.h"
#include "policy.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdio>
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
int runCase(PolicyConfig const& policy, DType dtype, std::mt19937& rng)
{
    SelectShape const s{3, 8, 2, 333, 20, 64, 256};
    SelectConfig const config = makeSelectConfig(policy);
    int32_t const cap = outputCapacity(config, s.n);
    size_t const qCount = size_t(s.batch) * s.heads * s.queryLen * s.headDim;
    size_t const kvCount = size_t(s.batch) * s.kvHeads * s.n * s.headDim;
    size_t const oCount = size_t(s.hidden) * s.heads * s.headDim;
    size_t const keptCount = size_t(s.batch) * s.kvHeads * cap * s.headDim;
    std::vector<T> hq = randomTensor<T>(qCount, rng, 2.0F);
    std::vector<T> hk = randomTensor<T>(kvCount, rng, 1.0F);
    std::vector<T> hv = randomTensor<T>(kvCount, rng, 1.0F);
    std::vector<T> ho = randomTensor<T>(oCount, rng, 0.05F);
    std::vector<int32_t> const lengths = {s.n, 201, 17};
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
    for (int32_t const* budget : {static_cast<int32_t const*>(nullptr), static_cast<int32_t const*>(kvBudget)})
    {
        SelectTensors const t{dtype, q, k, v, o, len, budget, kk, kv, keptLengths, keptIndices};
        CHECK_CUDA(launchCriticalKVSelect(config, budgetTable(policy), s, t, workspace, bytes, nullptr));
        CHECK_CUDA(cudaDeviceSynchronize());
    }
    for (void* p : {q, k, v, o, kk, kv, static_cast<void*>(len), static_cast<void*>(kvBudget), static_cast<void*>(keptLengths),
             static_cast<void*>(keptIndices), workspace})
    {
        if (p != nullptr)
        {
            CHECK_CUDA(cudaFree(p));
        }
    }
    return 0;
}

} // namespace

int main()
{
    std::mt19937 rng(7);
    int failures = 0;
    for (std::string const& name : policyNames())
    {
        for (std::string const& norm : {std::string("l1"), std::string("l2")})
        {
            PolicyConfig policy;
            policy.name = name;
            policy.budget = 72;
            policy.window = 16;
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
            if (!validatePolicy(policy).empty())
            {
                continue; // a method the plugin refuses (layer-defensivekv: a model-level selection)
            }
            failures += runCase<float>(policy, DType::kFloat32, rng);
            failures += runCase<__half>(policy, DType::kFloat16, rng);
            failures += runCase<__nv_bfloat16>(policy, DType::kBFloat16, rng);
        }
    }
    std::printf("ckv_sanitizer_driver: %d failing case(s)\n", failures);
    return failures == 0 ? 0 : 1;
}
