// CPU emulation of the CUDA pipeline's pruned stage 2 (CriticalKV with value_norm=l1) against the host driver. The test
// copies three marked sections of the kernels next to this file: kernels/value_norms.cu "l1 bounds" (the bound-terms
// and bound kernels' per-thread bodies), kernels/selection.cu "pruned row" (the block executor) and "pruned pipeline"
// (a KV head's two stages in three launches: stage 1 and the first candidates by one block, their exact scores by
// one thread per token, the stop rule and the doubling rounds by one block). One std::thread per CUDA thread,
// __syncthreads() a std::barrier, shared-memory atomics std::atomic_ref, blocks one after the other. The steps the
// emulation does not cover run as the host driver runs them: window attention (host::windowScores), the group score
// (groupScoresAt, the kernel's function), the shared allocation (shared_allocation.h over the host radix select) and
// the compaction rule (kept_positions.h). The kept indices and lengths must equal host::selectLayer's, which prunes
// with its own executor (host/pruned_row_host.h). Not built by CMake: tests/plugins/test_plugin_kernel_emulation.py
// compiles it with g++ -std=c++20.
//   pruned_pipeline_emulation BASE BATCH HEADS KV_HEADS N HEAD_DIM HIDDEN WINDOW BUDGET KV_BUDGET KIND SEED
//     BASE snapkv | pyramidkv | adakv (two-stage on top), KV_BUDGET 0 = none, KIND random | ties | near | flat | mixed
//   -> exit 0 when every kept index agrees; prints "exact scores: X of Y eligible tokens", how many rows stopped
//      before computing every exact score and how many needed a doubling round
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda_emulation.h"

#include "select_host.h"

#include "criticalkv/group_scores.h"
#include "criticalkv/kept_positions.h"
#include "criticalkv/pruned_stage2.h"
#include "criticalkv/radix_select.h"
#include "criticalkv/shared_allocation.h"

namespace criticalkv::kernels
{
constexpr int kSelectThreads = 512; // selection.cu's
template <typename T>
float toFloat(T value)
{
    return static_cast<float>(value);
}
#include "l1_bounds_section.inc"
#include "pruned_row_section.inc"
#include "pruned_pipeline_section.inc"

//! One block of `threads` emulated threads running fn().
template <typename Fn>
void runBlock(unsigned x, unsigned y, unsigned threads, Fn fn)
{
    std::barrier<> barrier(threads);
    gBarrier = &barrier;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t)
    {
        pool.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            blockIdx = {x, y, 0};
            fn();
        });
    }
    for (auto& thread : pool)
    {
        thread.join();
    }
}
} // namespace criticalkv::kernels

using namespace criticalkv;

namespace
{

struct HostTopKFn
{
    void operator()(float const* scores, uint8_t* flags, int64_t len, int64_t period, int64_t firstValid, int64_t k,
        uint8_t mark) const
    {
        host::selectTopK(scores, flags, len, period, firstValid, k, mark);
    }
};

} // namespace

int main(int argc, char** argv)
{
    if (argc != 13)
    {
        std::fprintf(stderr,
            "usage: %s BASE BATCH HEADS KV_HEADS N HEAD_DIM HIDDEN WINDOW BUDGET KV_BUDGET KIND SEED\n", argv[0]);
        return 2;
    }
    std::string const base = argv[1];
    int const B = std::atoi(argv[2]), H = std::atoi(argv[3]), Hkv = std::atoi(argv[4]), n = std::atoi(argv[5]);
    int const d = std::atoi(argv[6]), hidden = std::atoi(argv[7]), w = std::atoi(argv[8]), budget = std::atoi(argv[9]);
    int32_t kvBudget = std::atoi(argv[10]);
    std::string const kind = argv[11];
    int const seed = std::atoi(argv[12]);
    int const m = n - w;
    int const group = H / Hkv;

    SelectConfig c{};
    c.base = base == "pyramidkv" ? BaseMethod::kPyramidKV : (base == "adakv" ? BaseMethod::kAdaKV : BaseMethod::kSnapKV);
    c.twoStage = 1;
    c.budget = budget;
    c.minBudget = w;
    c.window = w;
    c.poolKernel = 7;
    c.alphaMicros = seed % 2 == 0 ? 250000 : 500000;
    c.epsilon = 1e-4F;
    c.adaFloorMicros = 200000;
    c.valueNorm = ValueNorm::kL1;
    c.gqaReduce = seed % 3 == 2 ? GqaReduce::kKvpress : GqaReduce::kMean;
    c.stage2Scores = seed % 4 == 3 ? Stage2Scores::kRaw : Stage2Scores::kPooled;
    c.capacity = n;
    std::vector<int32_t> table(static_cast<size_t>(budget - w + 1));
    for (int32_t i = 0; i < static_cast<int32_t>(table.size()); ++i)
    {
        table[i] = i + i / 2; // a lower pyramid layer: r_l = 1.5 (b - window)
    }
    c.budgetTable = c.base == BaseMethod::kPyramidKV ? 1 : 0;
    c.layerBudget = c.budgetTable ? table.back() : budget - w;
    BudgetTable const budgets{table.data(), static_cast<int32_t>(table.size())};
    SelectShape const s{B, H, Hkv, n, w, d, hidden};

    // Inputs
    std::mt19937 rng(static_cast<unsigned>(seed));
    std::normal_distribution<float> normal(0.0F, 1.0F);
    std::vector<float> q(size_t(B) * H * w * d), k(size_t(B) * Hkv * n * d), v(size_t(B) * Hkv * n * d);
    std::vector<float> o(size_t(hidden) * H * d);
    for (auto* x : {&q, &k, &v, &o})
    {
        for (float& e : *x)
        {
            e = normal(rng);
        }
    }
    if (kind == "ties" || kind == "near")
    {
        // keys 0: every older token gets the same attention, so C orders by the values alone; three distinct value
        // rows ("ties": exact ties everywhere) or one row scaled by 1 + j 2^-22 ("near": exact scores within the
        // stop margin of each other)
        std::fill(k.begin(), k.end(), 0.0F);
        for (int64_t row = 0; row < int64_t(B) * Hkv * n; ++row)
        {
            int64_t const g = row / n;
            int64_t const pick = kind == "ties" ? static_cast<int64_t>(rng() % 3) : 0;
            float const scale = kind == "ties" ? 1.0F : 1.0F + std::ldexp(static_cast<float>(rng() % 5), -22);
            for (int e = 0; e < d; ++e)
            {
                v[row * d + e] = v[(g * n + pick) * d + e] * scale;
            }
        }
    }
    else if (kind == "flat")
    {
        // every output of v W_O^h has the same magnitude, so ||x||_1 = sqrt(hidden) ||x||_2: the bound is tight and
        // the first round (2k candidates) settles the head
        for (float& e : o)
        {
            e = rng() % 2 == 0 ? 0.1F : -0.1F;
        }
        std::uniform_real_distribution<float> uniform(0.0F, 1.0F);
        for (int64_t row = 0; row < int64_t(B) * Hkv * n; ++row)
        {
            std::fill(&v[row * d], &v[row * d] + d, 0.0F);
            v[row * d] = uniform(rng);
        }
    }
    else if (kind == "mixed")
    {
        // half the tokens project flat (L1 = sqrt(hidden) L2), half onto one output with 3x the L2: the best bounds
        // are the wrong tokens, so the stop rule needs several doubling rounds
        std::fill(o.begin(), o.end(), 0.0F);
        for (int c0 = 0; c0 < hidden; ++c0)
        {
            for (int h = 0; h < H; ++h)
            {
                o[size_t(c0) * H * d + size_t(h) * d] = rng() % 2 == 0 ? 1.0F : -1.0F;
                if (c0 == 0 && d > 1)
                {
                    o[size_t(h) * d + 1] = 1.0F;
                }
            }
        }
        std::uniform_real_distribution<float> uniform(1.0F, 2.0F);
        for (int64_t row = 0; row < int64_t(B) * Hkv * n; ++row)
        {
            float const size = uniform(rng);
            bool const flat = rng() % 2 == 0;
            std::fill(&v[row * d], &v[row * d] + d, 0.0F);
            v[row * d] = flat ? size : 0.0F;
            if (d > 1)
            {
                v[row * d + 1] = flat ? 0.0F : 3.0F * size * std::sqrt(static_cast<float>(hidden));
            }
        }
    }
    std::vector<int32_t> lengths(B);
    for (int b = 0; b < B; ++b)
    {
        lengths[b] = b == 0 ? n : std::max(w + 1, n - 53 * b); // the first whole, the others left-padded
    }
    int32_t const* kvBudgetPtr = kvBudget > 0 ? &kvBudget : nullptr;
    host::HostInputs const in{q.data(), k.data(), v.data(), o.data(), lengths.data(), kvBudgetPtr};

    // The host driver.
    int const cap = n;
    std::vector<int32_t> wantIndices(size_t(B) * Hkv * cap), wantLengths(size_t(B) * Hkv);
    host::selectLayer(c, budgets, s, in, host::HostOutputs{wantIndices.data(), wantLengths.data(), nullptr, nullptr});

    // The pipeline with the pruned stage 2: resolve, bound terms and bounds, window scores, group scores (U), shared
    // allocation, per-head selection, compaction.
    int32_t resolved = 0;
    RuntimeBudget runtime{kvBudgetPtr, nullptr};
    if (kvBudgetPtr != nullptr && c.budgetTable)
    {
        resolved = host::resolveLayerBudget(c, budgets, kvBudgetPtr);
        runtime.layerBudget = &resolved;
    }
    size_t const perHead = size_t(B) * H * m, perKvHead = size_t(B) * Hkv * m;
    std::vector<float> raw(perHead, 0.0F), squares(perHead, 0.0F), norms(perHead, 0.0F);
    std::vector<float> gram(size_t(H) * d * d), rowL1(size_t(H) * d), colL1(H);
    std::vector<float> attention(perKvHead, 0.0F), critical(perKvHead, 0.0F), exact(perKvHead, 0.0F);
    std::vector<uint8_t> flags(perKvHead, 0);
    kernels::BoundArgs bounds{c, true, runtime, lengths.data(), s, v.data(), o.data(), m, gram.data(), rowL1.data(),
        colL1.data(), norms.data()};
    for (int h = 0; h < H; ++h) // boundTermsKernel: one thread per entry
    {
        for (int64_t e = 0; e < int64_t(d) * d + d; ++e)
        {
            kernels::boundTermAt<float>(bounds, h, e);
        }
    }
    constexpr unsigned kColumnThreads = 256; // columnL1Kernel's block
    for (int h = 0; h < H; ++h)
    {
        std::vector<float> partial(kColumnThreads);
        kernels::runBlock(static_cast<unsigned>(h), 0, kColumnThreads,
            [&] { kernels::columnL1Block<float>(bounds, h, kColumnThreads, partial.data()); });
    }
    int64_t computed = 0, eligibleTotal = 0, prunedRows = 0, doubledRows = 0;
    for (int b = 0; b < B; ++b)
    {
        SequenceInfo const info = sequenceInfo(c, runtime, s, lengths.data(), b);
        if (!info.compress)
        {
            continue;
        }
        int64_t const sequence = int64_t(b) * H * m;
        for (int h = 0; h < H; ++h)
        {
            host::windowScores(c, s, in, b, h, info.validStart, &raw[sequence + int64_t(h) * m],
                &squares[sequence + int64_t(h) * m], nullptr);
            for (int i = 0; i < m; ++i) // l1BoundsKernel: one thread per token
            {
                kernels::l1BoundAt<float>(bounds, b, h, i);
            }
        }
        int64_t const base = int64_t(b) * Hkv * m;
        for (int g = 0; g < Hkv; ++g) // groupScoresKernel
        {
            for (int i = 0; i < m; ++i)
            {
                GroupScores const scores
                    = groupScoresAt(c, &raw[sequence], &squares[sequence], &norms[sequence], g * group, group, m, i);
                attention[base + int64_t(g) * m + i] = scores.attention;
                critical[base + int64_t(g) * m + i] = scores.critical;
            }
        }
        std::vector<int64_t> counts(Hkv, info.r);
        if (sharedAllocation(c)) // selectSharedKernel
        {
            HostTopKFn topK;
            selectShared(topK, c, &attention[base], &flags[base], Hkv, m, info.validStart, info.r);
            for (int g = 0; g < Hkv; ++g)
            {
                counts[g] = 0;
                for (int i = 0; i < m; ++i)
                {
                    counts[g] += flags[base + int64_t(g) * m + i] != 0 ? 1 : 0;
                }
            }
        }
        kernels::PrunedPipelineArgs const args{c, s, raw.data(), squares.data(), norms.data(), attention.data(),
            critical.data(), exact.data(), flags.data(), v.data(), o.data(), stopMargin(hidden, group)};
        for (int g = 0; g < Hkv; ++g) // the three launches of the pruned per-head selection
        {
            std::vector<int64_t> done(kernels::kSelectThreads, -1);
            kernels::PrunedSmem smem{};
            kernels::runBlock(static_cast<unsigned>(g), static_cast<unsigned>(b), kernels::kSelectThreads,
                [&] { kernels::prunedPrepare(args, b, g, info.validStart, counts[g], smem); });
            for (int i = 0; i < m; ++i) // prunedExactKernel: one thread per token
            {
                kernels::prunedExactAt<float>(args, b, g, i);
            }
            kernels::runBlock(static_cast<unsigned>(g), static_cast<unsigned>(b), kernels::kSelectThreads, [&] {
                done[threadIdx.x] = kernels::prunedFinish<float>(args, b, g, info.validStart, counts[g], smem);
            });
            for (int64_t x : done)
            {
                if (x != done[0])
                {
                    std::printf("row (%d, %d): the threads disagree on the exact-score count\n", b, g);
                    return 1;
                }
            }
            int64_t const first = stage1Count(c.alphaMicros, counts[g]);
            int64_t eligible = 0;
            for (int i = info.validStart; i < m; ++i)
            {
                eligible += flags[base + int64_t(g) * m + i] != kChosenByAttention ? 1 : 0;
            }
            if (counts[g] - first > 0 && counts[g] - first < eligible)
            {
                computed += done[0];
                eligibleTotal += eligible;
                prunedRows += done[0] < eligible ? 1 : 0;
                int64_t const k = counts[g] - first;
                doubledRows += done[0] > std::min(kCandidateFactor * k, eligible) ? 1 : 0;
            }
        }
    }
    int mismatches = 0;
    for (int b = 0; b < B; ++b)
    {
        SequenceInfo const info = sequenceInfo(c, runtime, s, lengths.data(), b);
        for (int g = 0; g < Hkv; ++g) // compactKernel
        {
            std::vector<int32_t> kept;
            int32_t const fixed = fixedKeptCount(c, info);
            for (int32_t slot = 0; slot < fixed; ++slot)
            {
                kept.push_back(fixedKeptPosition(c, info, n, slot));
            }
            if (fixed < 0)
            {
                for (int32_t p = 0; p < n; ++p)
                {
                    if (scoredPositionKept(info, m, &flags[(int64_t(b) * Hkv + g) * m], p))
                    {
                        kept.push_back(p);
                    }
                }
            }
            int64_t const head = int64_t(b) * Hkv + g;
            bool same = static_cast<int32_t>(kept.size()) == wantLengths[head];
            for (int32_t slot = 0; slot < cap; ++slot)
            {
                int32_t const got = slot < static_cast<int32_t>(kept.size()) ? kept[slot] : -1;
                same = same && got == wantIndices[head * cap + slot];
            }
            if (!same)
            {
                std::printf("sequence %d, KV head %d: %zu kept, the host driver keeps %d, or different indices\n", b, g,
                    kept.size(), wantLengths[head]);
                ++mismatches;
            }
        }
    }
    std::printf("%d of %d heads differ; exact scores: %lld of %lld eligible tokens; pruned rows: %lld; rows past the "
                "first round: %lld\n",
        mismatches, B * Hkv, static_cast<long long>(computed), static_cast<long long>(eligibleTotal),
        static_cast<long long>(prunedRows), static_cast<long long>(doubledRows));
    return mismatches == 0 ? 0 : 1;
}
