// CPU emulation of the GPU selection flows (kernels/select_flows.cuh: plan kernels and batched top-k launches over
// every row of the batch, kernels/topk_device.cuh underneath), included as is and run with every CTA's threads as
// fibers (cuda_emulation.h), against the host driver's flows (head_selection.h, shared_allocation.h,
// methods/defensivekv.h: the row-scored flow, run sequence by sequence with host::selectTopK / host::massCount, as host/select_host.cpp
// does) on the same group scores of a small layer. Not built by CMake: tests/plugins/test_plugin_topk_emulation.py
// compiles it.
//   select_flows_emulation BASE TWO_STAGE BATCH KV_HEADS N WINDOW BUDGET KV_BUDGET KIND SEED
// BASE: snapkv | pyramidkv | adakv | laprox | defensivekv; KV_BUDGET 0: none; KIND: random | ties.
// Prints "D of H heads differ; shares S" and exits 0 when the flags of every KV head (and the shares of a shared
// allocation) are the host driver's.
#include "cuda_emulation.h"

#include "criticalkv/methods/defensivekv.h"
#include "select_host.h"
#include "topk_emulated_launch.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

using namespace criticalkv;
using criticalkv::methods::DefensiveKV;

namespace
{

//! The host driver's top-k primitive of the flows (select_host.cpp: HostTopK).
struct HostExec
{
    void operator()(float const* scores, uint8_t* flags, int64_t len, int64_t period, int64_t firstValid, int64_t k,
        uint8_t mark) const
    {
        host::selectTopK(scores, flags, len, period, firstValid, k, mark);
    }

    int64_t massCount(float const* scores, uint8_t const* flags, int64_t len, int64_t period, int64_t firstValid,
        float limit) const
    {
        return host::massCount(scores, flags, len, period, firstValid, limit);
    }
};

BaseMethod baseOf(char const* name)
{
    if (std::strcmp(name, "pyramidkv") == 0)
        return BaseMethod::kPyramidKV;
    if (std::strcmp(name, "adakv") == 0)
        return BaseMethod::kAdaKV;
    if (std::strcmp(name, "laprox") == 0)
        return BaseMethod::kLaProx;
    if (std::strcmp(name, "defensivekv") == 0)
        return BaseMethod::kDefensiveKV;
    return BaseMethod::kSnapKV;
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 11)
    {
        std::fprintf(stderr, "usage: %s BASE TWO_STAGE BATCH KV_HEADS N WINDOW BUDGET KV_BUDGET KIND SEED\n", argv[0]);
        return 2;
    }
    SelectConfig config{};
    config.base = baseOf(argv[1]);
    config.twoStage = std::atoi(argv[2]);
    int32_t const B = std::atoi(argv[3]), Hkv = std::atoi(argv[4]), n = std::atoi(argv[5]);
    config.window = std::atoi(argv[6]);
    config.budget = std::atoi(argv[7]);
    int32_t const kvBudget = std::atoi(argv[8]);
    bool const ties = std::strcmp(argv[9], "ties") == 0;
    std::mt19937 rng(static_cast<unsigned>(std::atoi(argv[10])));
    config.minBudget = config.window;
    config.poolKernel = 7;
    config.alphaMicros = config.twoStage ? 250000 : 1000000;
    config.epsilon = 1e-4F;
    config.adaFloorMicros = 200000;
    config.stage1Mass = 0.9F;
    config.layerBudget = config.budget - config.window;
    config.budgetTable = 0;
    config.capacity = n;
    SelectShape const shape{B, 2 * Hkv, Hkv, n, config.window, 8, 16};
    int32_t const m = n - windowLength(config, n);
    std::vector<int32_t> lengths(static_cast<size_t>(B));
    for (int32_t b = 0; b < B; ++b) // a full sequence, left-padded ones, and the last one kept whole when b >= 3
    {
        lengths[b] = b == 0 ? n : (b == 2 ? config.budget - 3 : n - static_cast<int32_t>(rng() % (n / 2)));
    }
    int32_t const kvBudgetValue = kvBudget;
    RuntimeBudget const budget{kvBudget > 0 ? &kvBudgetValue : nullptr, nullptr};

    size_t const cells = static_cast<size_t>(B) * Hkv * m;
    std::vector<float> attention(cells), critical(cells), methodScores(cells), stage1(cells), ranking(cells, 0.0F);
    std::uniform_real_distribution<float> unit(0.0F, 1.0F);
    for (size_t e = 0; e < cells; ++e)
    {
        attention[e] = ties ? static_cast<float>(rng() % 4) / 4.0F : unit(rng);
        critical[e] = ties ? static_cast<float>(rng() % 3) : unit(rng);
        methodScores[e] = ties ? static_cast<float>(rng() % 5) : unit(rng);
    }
    // defensivekv: scores in [0, 1], stage-1 masses summing to ~1 per head over its valid tokens, window masses
    std::vector<DefensiveKV::Totals> totals(static_cast<size_t>(B) * Hkv);
    for (int32_t b = 0; b < B; ++b)
    {
        int32_t const validStart = n - lengths[b];
        for (int32_t g = 0; g < Hkv; ++g)
        {
            size_t const row = (static_cast<size_t>(b) * Hkv + g) * m;
            double sum = 0.0;
            for (int32_t i = 0; i < m; ++i)
            {
                float const x = i < validStart ? 0.0F : (ties ? static_cast<float>(rng() % 3) : unit(rng) * unit(rng));
                stage1[row + i] = x;
                sum += x;
            }
            for (int32_t i = 0; i < m && sum > 0.0; ++i)
            {
                stage1[row + i] = static_cast<float>(stage1[row + i] / sum);
            }
            totals[static_cast<size_t>(b) * Hkv + g].windowMass = 0.2F * unit(rng);
        }
    }
    bool const defensive = rowScores(config);

    // The host driver's flows, sequence by sequence (select_host.cpp: selectLayer's selection part).
    std::vector<uint8_t> hostFlags(cells, 0);
    std::vector<int64_t> hostCounts(static_cast<size_t>(B) * Hkv, 0);
    std::vector<float> hostRanking(cells, 0.0F);
    HostExec exec;
    for (int32_t b = 0; b < B; ++b)
    {
        SequenceInfo const info = sequenceInfo(config, budget, shape, lengths.data(), b);
        if (!info.compress)
        {
            continue;
        }
        size_t const base = static_cast<size_t>(b) * Hkv * m;
        if (defensive)
        {
            float const limit = DefensiveKV::stage1Limit(config, &totals[static_cast<size_t>(b) * Hkv], Hkv);
            DefensiveKV::select(exec, config, &attention[base], &stage1[base], &hostRanking[base], &hostFlags[base],
                Hkv, m, info.validStart, info.r, limit);
            continue;
        }
        if (sharedAllocation(config))
        {
            selectShared(exec, config, sharedRanking(config, &attention[base], &methodScores[base]), &hostFlags[base],
                Hkv, m, info.validStart, info.r);
            for (int32_t g = 0; g < Hkv; ++g)
            {
                uint8_t const* row = &hostFlags[base + static_cast<size_t>(g) * m];
                hostCounts[static_cast<size_t>(b) * Hkv + g] = std::count_if(row, row + m, [](uint8_t f) { return f; });
            }
            if (!config.twoStage)
            {
                continue;
            }
        }
        for (int32_t g = 0; g < Hkv; ++g)
        {
            size_t const row = base + static_cast<size_t>(g) * m;
            std::fill(&hostFlags[row], &hostFlags[row] + m, 0);
            int64_t const count = sharedAllocation(config) ? hostCounts[static_cast<size_t>(b) * Hkv + g] : info.r;
            selectHead(exec, config, &attention[row], &critical[row], &hostFlags[row], m, info.validStart, count);
        }
    }

    // The kernels' flows over the whole batch, on garbage-filled buffers.
    std::vector<uint8_t> flags(cells, 0x77);
    std::vector<int32_t> headCounts(static_cast<size_t>(B) * Hkv, -1);
    std::vector<int64_t> planStore(selectionPlanBytes(B, Hkv) / sizeof(int64_t) + 1, -7);
    size_t const scratchBytes = selectionScratchBytes(B, Hkv, m, true, defensive);
    std::vector<unsigned char> scratch(scratchBytes + 1, 0xa5);
    kernels::SelectionRows const rows{config, shape, lengths.data(), budget, flags.data(), headCounts.data(),
        selectionPlan(planStore.data(), B, Hkv, scratch.data(), scratchBytes)};
    EmulatedFlowLaunch launch{scratch.data(), scratchBytes};
    bool accepted = false;
    if (defensive)
    {
        kernels::RowSelectionArgs const d{rows, attention.data(), stage1.data(), ranking.data(), totals.data()};
        accepted = kernels::runRowSelection<DefensiveKV>(d, launch);
    }
    else
    {
        kernels::SelectionArgs const a{rows, attention.data(), config.twoStage ? critical.data() : nullptr,
            methodScores.data()};
        accepted = kernels::runSelection(a, launch);
    }
    if (!accepted)
    {
        std::printf("the flow refused its arguments\n");
        return 1;
    }
    int differ = 0;
    int shares = 0;
    for (int32_t b = 0; b < B; ++b)
    {
        SequenceInfo const info = sequenceInfo(config, budget, shape, lengths.data(), b);
        for (int32_t g = 0; g < Hkv && info.compress; ++g)
        {
            size_t const row = (static_cast<size_t>(b) * Hkv + g) * m;
            bool const same = std::equal(&flags[row], &flags[row] + m, &hostFlags[row]);
            differ += same ? 0 : 1;
            if (!same)
            {
                for (int32_t i = 0; i < m; ++i)
                {
                    if (flags[row + i] != hostFlags[row + i])
                    {
                        std::printf("sequence %d head %d: first difference at %d (kernels %d, host %d)\n", b, g, i,
                            flags[row + i], hostFlags[row + i]);
                        break;
                    }
                }
            }
            size_t const head = static_cast<size_t>(b) * Hkv + g;
            if (sharedAllocation(config) && !defensive)
            {
                shares += headCounts[head] == hostCounts[head] ? 0 : 1;
            }
        }
    }
    std::printf("%d of %d heads differ; shares %d\n", differ, B * Hkv, shares);
    return differ == 0 && shares == 0 ? 0 : 1;
}
