// CPU emulation of the model-level selection's kernels (kernels/model_level.cuh: the shared allocation with N heads,
// or the head cap's candidates top-k, sort, levels and marks; CriticalKV's refinement; the external scores' raw copy
// and layer-kvzip's sink ranking), included as is and run with every CTA's threads as fibers (cuda_emulation.h), beside
// the host driver's allocation (host/model_host.cpp, written as the PyTorch reference states it). Not built by CMake:
// tests/plugins/test_model_level_emulation.py compiles it and compares both with criticalkv.selection.layer's
// model_level_mask / model_level_refine.
//   model_level_emulation IN OUT
// IN: int32 header [B, L, H_kv, n, window, budget, kv_budget (0: none), two_stage, base (0 layer-defensivekv,
//     1 layer-kvzip), sink_tokens, group], int64 [head_cap_micros, ada_floor_micros, alpha_micros], int32 lengths [B],
//     float32 ranking, attention, critical [B, L H_kv, m], float32 scores [B, H_kv, n] (one layer's external scores).
// OUT: uint8 kernels' flags, host flags [B, L H_kv, m]; float32 kernels' raw [B, H_kv G, m] and sink ranking
//     [B, H_kv, m] of the scores; int64 [kernel launches, memsets, top-k calls].
#include "cuda_emulation.h"

#include "model_level.cuh"
#include "select_host.h"
#include "topk_emulated_launch.h"

#include <cstdio>
#include <fstream>
#include <vector>

using namespace criticalkv;

namespace
{

template <typename T>
std::vector<T> readArray(std::ifstream& in, size_t count)
{
    std::vector<T> out(count);
    in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(count * sizeof(T)));
    return out;
}

template <typename T>
void writeArray(std::ofstream& out, std::vector<T> const& values)
{
    out.write(reinterpret_cast<char const*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(T)));
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 3)
    {
        std::fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
        return 2;
    }
    std::ifstream in(argv[1], std::ios::binary);
    std::vector<int32_t> const header = readArray<int32_t>(in, 11);
    std::vector<int64_t> const micros = readArray<int64_t>(in, 3);
    int32_t const B = header[0], L = header[1], Hkv = header[2], n = header[3];
    SelectConfig config{};
    config.base = header[8] == 0 ? BaseMethod::kLayerDefensiveKV : BaseMethod::kLayerKVzip;
    config.twoStage = header[7];
    config.window = header[4];
    config.budget = header[5];
    config.minBudget = config.window;
    config.poolKernel = 1;
    config.sinkTokens = header[9];
    config.alphaMicros = micros[2];
    config.epsilon = 1e-4F;
    config.adaFloorMicros = micros[1];
    config.stage1Mass = 0.9F;
    config.layerBudget = config.budget - config.window;
    config.budgetTable = 0;
    config.capacity = n;
    config.modelWide = 1;
    config.headCapMicros = micros[0];
    config.keptSinks = 0;
    int32_t const group = header[10];
    int32_t const kvBudgetValue = header[6];
    RuntimeBudget const budget{kvBudgetValue > 0 ? &kvBudgetValue : nullptr, nullptr};
    ModelShape const model{SelectShape{B, Hkv * group, Hkv, n, config.window, 8, 16}, L};
    SelectShape const rowsShape = modelRows(model);
    int32_t const N = rowsShape.kvHeads;
    int32_t const m = n - windowLength(config, n);
    size_t const cells = static_cast<size_t>(B) * N * m;
    std::vector<int32_t> const lengths = readArray<int32_t>(in, static_cast<size_t>(B));
    std::vector<float> const ranking = readArray<float>(in, cells);
    std::vector<float> const attention = readArray<float>(in, cells);
    std::vector<float> const critical = readArray<float>(in, cells);
    std::vector<float> const scores = readArray<float>(in, static_cast<size_t>(B) * Hkv * n);
    if (!in)
    {
        std::fprintf(stderr, "%s: short input\n", argv[1]);
        return 2;
    }

    // The host driver.
    std::vector<uint8_t> hostFlags(cells, 0);
    host::allocateModel(config, model, lengths.data(), budget.kvBudget, ranking.data(), attention.data(),
        critical.data(), hostFlags.data());

    // The kernels, on garbage-filled buffers.
    std::vector<uint8_t> flags(cells, 0x77);
    std::vector<int64_t> planStore(selectionPlanBytes(B, N) / sizeof(int64_t) + 1, -7);
    size_t const scratchBytes = selectionScratchBytes(B, N, m, true, false);
    std::vector<unsigned char> scratch(scratchBytes + 1, 0xa5);
    int32_t const stride = modelSortStride(config, m);
    size_t const sorted = static_cast<size_t>(B) * N * (stride > 0 ? stride : 1);
    std::vector<uint32_t> keys0(sorted, 0xdeadbeefu), keys1(sorted, 0xdeadbeefu);
    std::vector<int32_t> positions0(sorted, -5), positions1(sorted, -5), counts(static_cast<size_t>(B) * N, -3);
    kernels::SelectionRows const rows{config, rowsShape, lengths.data(), budget, flags.data(), nullptr,
        selectionPlan(planStore.data(), B, N, scratch.data(), scratchBytes)};
    kernels::ModelArgs const args{rows, ranking.data(), config.twoStage ? attention.data() : nullptr,
        config.twoStage ? critical.data() : nullptr, counts.data(), {keys0.data(), keys1.data()},
        {positions0.data(), positions1.data()}, stride};
    EmulatedFlowLaunch launch{scratch.data(), scratchBytes};
    if (!kernels::runModelAllocation(args, launch))
    {
        std::printf("the flow refused its arguments\n");
        return 1;
    }

    // One layer's external scores: the raw copy of every query head, and layer-kvzip's sink ranking of their group
    // score (groupScoresAt: the group's mean, as groupScoresKernel computes it).
    SelectShape const layer = model.layer;
    std::vector<float> raw(static_cast<size_t>(B) * layer.heads * m, -1.0F);
    kernels::ExternalRawArgs const copy{config, layer, lengths.data(), budget, scores.data(), raw.data()};
    uint32_t const tiles = static_cast<uint32_t>((m + kernels::kPlanThreads - 1) / kernels::kPlanThreads);
    launch.kernel(kernels::externalRawKernel, kernels::Grid3{tiles, static_cast<uint32_t>(layer.heads),
        static_cast<uint32_t>(B)}, kernels::kPlanThreads, copy);
    std::vector<float> groupAttention(static_cast<size_t>(B) * Hkv * m, 0.0F);
    std::vector<float> sinkRanks(groupAttention.size(), -1.0F);
    for (int32_t b = 0; b < B; ++b)
    {
        if (!sequenceInfo(config, budget, layer, lengths.data(), b).compress)
        {
            continue;
        }
        for (int32_t g = 0; g < Hkv; ++g)
        {
            for (int32_t i = 0; i < m; ++i)
            {
                groupAttention[(static_cast<size_t>(b) * Hkv + g) * m + i] = groupScoresAt(config,
                    &raw[static_cast<size_t>(b) * layer.heads * m], nullptr, nullptr, g * group, group, m, i)
                                                                                 .attention;
            }
        }
    }
    kernels::SinkRankingArgs const rank{config, layer, lengths.data(), budget, groupAttention.data(), sinkRanks.data()};
    launch.kernel(kernels::sinkRankingKernel, kernels::Grid3{tiles, static_cast<uint32_t>(Hkv), static_cast<uint32_t>(B)},
        kernels::kPlanThreads, rank);

    std::ofstream out(argv[2], std::ios::binary);
    writeArray(out, flags);
    writeArray(out, hostFlags);
    writeArray(out, raw);
    writeArray(out, sinkRanks);
    writeArray(out, std::vector<int64_t>{launch.counter.kernels, launch.counter.memsets, launch.counter.topKCalls});
    std::printf("%d heads, %d levels at most, sort stride %d\n", N, config.budget - config.window, stride);
    return 0;
}
