// CPU emulation of the compaction kernel (kernels/compact.cuh: compactBlock, one CTA per tile of 4,096 positions of a
// KV head) against the host driver's rule (kept_positions.h, as host/select_host.cpp applies it): random layers of
// scored, streamingllm and full heads, left-padded sequences, runtime budgets, one to four tiles of positions, a
// capacity below the kept count (truncation), flags set inside the left padding (ignored by the rule), flag rows at
// every byte alignment, outputs filled with garbage first. Not built by CMake: tests/plugins/test_plugin_kernel_emulation.py
// compiles it with g++ -std=c++20.
//   compact_emulation SEED TRIALS   -> exit 0 when every trial agrees; prints the tiles and positions covered
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_emulation.h"

#include "compact.cuh"

using namespace criticalkv;

int main(int argc, char** argv)
{
    if (argc != 3)
    {
        std::fprintf(stderr, "usage: %s SEED TRIALS\n", argv[0]);
        return 2;
    }
    std::mt19937 rng(static_cast<unsigned>(std::atoi(argv[1])));
    int const trials = std::atoi(argv[2]);
    int failures = 0;
    int64_t positions = 0;
    int maxTiles = 0;
    int truncated = 0;
    for (int trial = 0; trial < trials; ++trial)
    {
        SelectConfig c{};
        int const kind = static_cast<int>(rng() % 4); // 0, 1 scored; 2 streamingllm; 3 full
        c.base = kind < 2 ? BaseMethod::kSnapKV : (kind == 2 ? BaseMethod::kStreamingLLM : BaseMethod::kFull);
        int32_t const n = 1 + static_cast<int32_t>(rng() % (trial % 3 == 0 ? 13000u : 700u));
        c.window = 1 + static_cast<int32_t>(rng() % 40u);
        c.sinkTokens = static_cast<int32_t>(rng() % 5u);
        c.minBudget = std::max(c.window, c.base == BaseMethod::kStreamingLLM ? c.sinkTokens : 0);
        c.budget = c.minBudget + static_cast<int32_t>(rng() % static_cast<unsigned>(n + 1));
        c.layerBudget = c.budget - c.window;
        c.capacity = rng() % 4 == 0 ? 1 + static_cast<int32_t>(rng() % static_cast<unsigned>(c.budget + 1))
                                    : std::max(1, c.budget + static_cast<int32_t>(rng() % 9u));
        int32_t const batch = 1 + static_cast<int32_t>(rng() % 3u);
        int32_t const kvHeads = 1 + static_cast<int32_t>(rng() % 2u);
        SelectShape const s{batch, kvHeads, kvHeads, n, c.window, 16, 16};
        std::vector<int32_t> lengths(static_cast<size_t>(batch));
        for (int32_t& l : lengths)
        {
            l = rng() % 3 == 0 ? n : 1 + static_cast<int32_t>(rng() % static_cast<unsigned>(n));
        }
        int32_t kvBudget = c.minBudget + static_cast<int32_t>(rng() % static_cast<unsigned>(c.budget - c.minBudget + 1));
        RuntimeBudget const runtime{rng() % 2 == 0 ? &kvBudget : nullptr, nullptr};
        int32_t const m = n - windowLength(c, n);
        int32_t const cap = outputCapacity(c, n);
        // flags at an arbitrary byte offset; any non-zero value marks a kept token, also inside the padding
        size_t const shift = rng() % 4;
        std::vector<uint8_t> storage(shift + static_cast<size_t>(batch) * kvHeads * m + 8, 0);
        uint8_t* flags = storage.data() + shift;
        for (int64_t e = 0; e < int64_t(batch) * kvHeads * m; ++e)
        {
            flags[e] = rng() % 3 == 0 ? static_cast<uint8_t>(1 + rng() % 254) : 0;
        }
        std::vector<int32_t> indices(static_cast<size_t>(batch) * kvHeads * cap, 0x7f7f7f7f);
        std::vector<int32_t> keptLengths(static_cast<size_t>(batch) * kvHeads, 0x7f7f7f7f);
        kernels::CompactArgs const a{c, s, lengths.data(), runtime, flags, indices.data(), keptLengths.data()};
        kernels::Grid3 const grid = kernels::compactGrid(s);
        emulateLaunch({grid.x, grid.y, grid.z}, kernels::kCompactThreads, [&] {
            CKV_BLOCK_SHARED kernels::CompactSmem smem;
            kernels::compactBlock(a, smem);
        });
        maxTiles = std::max(maxTiles, static_cast<int>(grid.x));
        positions += int64_t(batch) * kvHeads * n;
        bool ok = true;
        for (int32_t b = 0; b < batch; ++b)
        {
            SequenceInfo const info = sequenceInfo(c, runtime, s, lengths.data(), b);
            for (int32_t g = 0; g < kvHeads; ++g)
            {
                int64_t const head = int64_t(b) * kvHeads + g;
                std::vector<int32_t> kept; // host/select_host.cpp's rule
                int32_t const fixed = fixedKeptCount(c, info);
                for (int32_t slot = 0; slot < fixed; ++slot)
                {
                    kept.push_back(fixedKeptPosition(c, info, n, slot));
                }
                if (fixed < 0)
                {
                    for (int32_t p = 0; p < n; ++p)
                    {
                        if (scoredPositionKept(info, m, flags + head * m, p))
                        {
                            kept.push_back(p);
                        }
                    }
                }
                int32_t const count = std::min(static_cast<int32_t>(kept.size()), cap);
                truncated += static_cast<int32_t>(kept.size()) > cap ? 1 : 0;
                ok = ok && keptLengths[head] == count;
                for (int32_t slot = 0; slot < cap; ++slot)
                {
                    ok = ok && indices[head * cap + slot] == (slot < count ? kept[slot] : -1);
                }
            }
        }
        if (!ok && failures++ < 10)
        {
            std::printf("trial %d: base %d, n %d, window %d, budget %d, capacity %d, batch %d, H_kv %d: kept indices "
                        "differ from the host rule\n",
                trial, static_cast<int>(c.base), n, c.window, c.budget, c.capacity, batch, kvHeads);
        }
    }
    std::printf("compaction: %d of %d trials differ; %lld positions, up to %d tiles per head, %d heads truncated\n",
        failures, trials, static_cast<long long>(positions), maxTiles, truncated);
    return failures == 0 ? 0 : 1;
}
