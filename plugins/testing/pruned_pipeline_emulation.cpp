// CPU emulation of the CUDA pipeline's pruned stage 2 (CriticalKV with value_norm=l1, 16-bit inputs: the tensor-core
// path) on whole layers, from the headers the kernels compile: kernels/bound_terms.cuh (the bound's weights-only terms),
// kernels/mma_tiles.cuh (the Gram pieces, the tensor-core bounds and the exact L1 norms over gathered candidate rows),
// kernels/pruned_flow.cuh (runPrunedStage2: its plan, list, score, count and relabel kernels, its top-k calls through
// the batched top-k's kernels, kernels/topk_device.cuh) with the warp instructions of testing/mma_emulation.h and
// testing/cuda_emulation.h, one fiber per CUDA thread. The steps the emulation does not cover run as the host driver runs them: window
// attention (host::windowScores), the group score (groupScoresAt, the kernel's function), the shared allocation
// (shared_allocation.h over the host radix select) and the compaction rule (kept_positions.h). Checks:
//   * the kept indices equal the unpruned selection on the same computed values (stage 2 by the exact C of every
//     eligible token from the same emulated norm kernel): the stop rule's certification, exactly;
//   * they differ from the fp32 host driver's (host::selectLayer on the same 16-bit inputs) in at most `allowed`
//     entries per head (rounding differences at near-ties: 0 for random values);
//   * every candidate's bound covers its computed norm.
// Not built by CMake: tests/plugins/test_tensor_core_emulation.py compiles it with g++ -std=c++20.
//   pruned_pipeline_emulation BASE BATCH HEADS KV_HEADS N HEAD_DIM HIDDEN WINDOW BUDGET KV_BUDGET KIND SEED ALLOWED
//     BASE snapkv | pyramidkv | adakv (two-stage on top), KV_BUDGET 0 = none, KIND random | ties | near | flat | mixed
//   -> exit 0 when the checks hold; prints "exact scores: X of Y eligible tokens", how many rows stopped before
//      computing every exact score and how many needed a doubling round
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda_emulation.h"

#include "mma_emulation.h"

#include "select_host.h"

#include "criticalkv/group_scores.h"
#include "criticalkv/head_selection.h"
#include "criticalkv/kept_positions.h"
#include "criticalkv/radix_select.h"
#include "criticalkv/shared_allocation.h"

#include "bound_terms.cuh"
#include "mma_tiles.cuh"
#include "pruned_flow.cuh"
#include "topk_emulated_launch.h"

using namespace criticalkv;
using T = __nv_bfloat16;

namespace
{

//! runPrunedStage2's launcher: kernels and top-k calls as select_flows.cuh's (testing/topk_emulated_launch.h), the
//! exact norms of the listed candidates through `norms`.
struct PrunedEmulatedLaunch
{
    EmulatedFlowLaunch flow;
    std::function<void(int32_t)> exactNorms;

    template <typename... Params, typename... Args>
    void kernel(void (*fn)(Params...), kernels::Grid3 grid, int threads, Args const&... args)
    {
        flow.kernel(fn, grid, threads, args...);
    }

    void zero(void* pointer, size_t bytes)
    {
        flow.zero(pointer, bytes);
    }

    bool topK(TopKRows const& rows)
    {
        return flow.topK(rows);
    }

    void norms(int32_t listed)
    {
        flow.counter.kernels += 1; // launchValueNorms: one kernel
        exactNorms(listed);
    }
};

struct HostTopKFn
{
    void operator()(float const* scores, uint8_t* flags, int64_t len, int64_t period, int64_t firstValid, int64_t k,
        uint8_t mark) const
    {
        host::selectTopK(scores, flags, len, period, firstValid, k, mark);
    }
};

//! Every CTA of a (x, y, z) grid of `threads`-thread blocks, one after the other.
template <typename Fn>
void runGrid(unsigned gx, unsigned gy, unsigned gz, unsigned threads, Fn fn)
{
    for (unsigned z = 0; z < gz; ++z)
    {
        for (unsigned y = 0; y < gy; ++y)
        {
            for (unsigned x = 0; x < gx; ++x)
            {
                runEmulatedBlock(x, y, z, threads, fn);
            }
        }
    }
}

//! The kept positions of every head from the flags (compactKernel's rule): [B * H_kv] lists.
std::vector<std::vector<int32_t>> keptPositions(SelectConfig const& c, RuntimeBudget const& runtime, SelectShape const& s,
    int32_t const* lengths, std::vector<uint8_t> const& flags)
{
    int32_t const n = s.n;
    int32_t const m = n - windowLength(c, n);
    std::vector<std::vector<int32_t>> out;
    for (int b = 0; b < s.batch; ++b)
    {
        SequenceInfo const info = sequenceInfo(c, runtime, s, lengths, b);
        for (int g = 0; g < s.kvHeads; ++g)
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
                    if (scoredPositionKept(info, m, &flags[(int64_t(b) * s.kvHeads + g) * m], p))
                    {
                        kept.push_back(p);
                    }
                }
            }
            out.push_back(kept);
        }
    }
    return out;
}

int32_t differing(std::vector<int32_t> const& a, std::vector<int32_t> const& b)
{
    int32_t missed = 0;
    for (int32_t x : b)
    {
        missed += std::find(a.begin(), a.end(), x) == a.end() ? 1 : 0;
    }
    return missed + std::max<int32_t>(0, static_cast<int32_t>(a.size()) - static_cast<int32_t>(b.size()));
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 14)
    {
        std::fprintf(stderr,
            "usage: %s BASE BATCH HEADS KV_HEADS N HEAD_DIM HIDDEN WINDOW BUDGET KV_BUDGET KIND SEED ALLOWED\n", argv[0]);
        return 2;
    }
    std::string const base = argv[1];
    int const B = std::atoi(argv[2]), H = std::atoi(argv[3]), Hkv = std::atoi(argv[4]), n = std::atoi(argv[5]);
    int const d = std::atoi(argv[6]), hidden = std::atoi(argv[7]), w = std::atoi(argv[8]), budget = std::atoi(argv[9]);
    int32_t kvBudget = std::atoi(argv[10]);
    std::string const kind = argv[11];
    int const seed = std::atoi(argv[12]);
    int const allowed = std::atoi(argv[13]);
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
    // 16-bit inputs: the pipeline reads T, the host driver the same values widened to fp32.
    std::vector<T> v16(v.size()), o16(o.size());
    for (size_t i = 0; i < v.size(); ++i)
    {
        v16[i] = kernels::fromFloat<T>(v[i]);
        v[i] = kernels::toFloat(v16[i]);
    }
    for (size_t i = 0; i < o.size(); ++i)
    {
        o16[i] = kernels::fromFloat<T>(o[i]);
        o[i] = kernels::toFloat(o16[i]);
    }
    std::vector<int32_t> lengths(B);
    for (int b = 0; b < B; ++b)
    {
        lengths[b] = b == 0 ? n : std::max(w + 1, n - 53 * b); // the first whole, the others left-padded
    }
    int32_t const* kvBudgetPtr = kvBudget > 0 ? &kvBudget : nullptr;
    host::HostInputs const in{q.data(), k.data(), v.data(), o.data(), lengths.data(), kvBudgetPtr};

    // The host driver (fp32, bitwise the ONNX / PyTorch fp32 paths).
    int const cap = n;
    std::vector<int32_t> wantIndices(size_t(B) * Hkv * cap), wantLengths(size_t(B) * Hkv);
    host::selectLayer(c, budgets, s, in, host::HostOutputs{wantIndices.data(), wantLengths.data(), nullptr, nullptr});

    int32_t resolved = 0;
    RuntimeBudget runtime{kvBudgetPtr, nullptr};
    if (kvBudgetPtr != nullptr && c.budgetTable)
    {
        resolved = host::resolveLayerBudget(c, budgets, kvBudgetPtr);
        runtime.layerBudget = &resolved;
    }
    size_t const perHead = size_t(B) * H * m, perKvHead = size_t(B) * Hkv * m;
    std::vector<float> raw(perHead, 0.0F), squares(perHead, 0.0F), norms(perHead, NAN), exactNorms(perHead, NAN);
    std::vector<float> gram(size_t(H) * d * d), rowL1(size_t(H) * d), colL1(H), scale(H);
    std::vector<T> pieces(size_t(H) * kernels::kGramPiecesBound * d * d);
    std::vector<float> attention(perKvHead, 0.0F), critical(perKvHead, 0.0F), exact(perKvHead, 0.0F);
    std::vector<uint8_t> flags(perKvHead, 0);
    std::vector<int32_t> headCounts(size_t(B) * Hkv, 0), candidates(perKvHead, 0), candidateCounts(size_t(B) * Hkv, 0);
    std::vector<PrunedHeadState> states(size_t(B) * Hkv);

    // launchPrunedBounds: G_h on the tensor cores with s_h and c_h (bound_terms.cuh), the pieces, the tensor-core bounds
    kernels::BoundArgs terms{c, true, runtime, lengths.data(), s, v16.data(), o16.data(), m, gram.data(), rowL1.data(),
        colL1.data(), norms.data()};
    runGrid((d + kernels::kTermRows - 1) / kernels::kTermRows, H, 1, kernels::kTermThreads, [&] {
        static kernels::TermTileSmem smem;
        kernels::boundTermsTensorBlock<T>(terms, smem);
    });
    std::vector<float> partial(kernels::kGramPieceThreads);
    runGrid(H, 1, 1, kernels::kGramPieceThreads, [&] {
        kernels::gramPiecesBlock<T, kernels::kGramPiecesBound, kernels::kGramPieceThreads>(gram.data(), d,
            pieces.data(), scale.data(), partial.data());
    });
    kernels::NormTileArgs tiles{};
    tiles.shape = s;
    tiles.values = v16.data();
    tiles.oProj = o16.data();
    tiles.numTokens = m;
    tiles.rowStride = m;
    tiles.skipUncompressed = true;
    tiles.config = c;
    tiles.budget = runtime;
    tiles.promptLengths = lengths.data();
    kernels::NormTileArgs boundTiles = tiles;
    boundTiles.out = norms.data();
    boundTiles.gramPieces = pieces.data();
    boundTiles.gramScale = scale.data();
    boundTiles.rowL1 = rowL1.data();
    boundTiles.colL1 = colL1.data();
    auto runBoundTiles = [&](auto cfg) {
        using Cfg = decltype(cfg);
        std::vector<unsigned char> shared(Cfg::sharedBytes(d), 0x7F);
        runGrid((m + Cfg::kRows - 1) / Cfg::kRows, Hkv, B, Cfg::kThreads, [&] {
            kernels::gramQuadBlock<T, Cfg, kernels::kGramPiecesBound, true>(boundTiles, shared.data());
        });
    };
    if (d <= kernels::GramTiles64::kCols)
    {
        runBoundTiles(kernels::GramTiles64{});
    }
    else
    {
        runBoundTiles(kernels::GramTiles128{});
    }
    std::vector<float> const bounds = norms;

    // Window scores, group scores (S, U), the shared allocation: as the host driver.
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
        }
        int64_t const base = int64_t(b) * Hkv * m;
        for (int g = 0; g < Hkv; ++g)
        {
            for (int i = 0; i < m; ++i)
            {
                GroupScores const scores
                    = groupScoresAt(c, &raw[sequence], &squares[sequence], &norms[sequence], g * group, group, m, i);
                attention[base + int64_t(g) * m + i] = scores.attention;
                critical[base + int64_t(g) * m + i] = scores.critical;
            }
        }
        if (sharedAllocation(c))
        {
            HostTopKFn topK;
            selectShared(topK, c, &attention[base], &flags[base], Hkv, m, info.validStart, info.r);
            for (int g = 0; g < Hkv; ++g)
            {
                for (int i = 0; i < m; ++i)
                {
                    headCounts[b * Hkv + g] += flags[base + int64_t(g) * m + i] != 0 ? 1 : 0;
                }
            }
        }
    }

    // launchPrunedStage2: runPrunedStage2's launches, the top-k calls through the batched top-k's kernels
    std::vector<int64_t> planWords((prunedPlanBytes(B, Hkv) + sizeof(int64_t) - 1) / sizeof(int64_t), -1);
    PrunedPlan const plan = prunedPlan(planWords.data(), B, Hkv);
    kernels::PrunedFlowArgs const a{c, s, runtime, lengths.data(), raw.data(), squares.data(), norms.data(),
        attention.data(), critical.data(), sharedAllocation(c) ? headCounts.data() : nullptr, exact.data(),
        flags.data(), candidates.data(), candidateCounts.data(), states.data(), stopMargin(hidden, group), plan};
    kernels::NormTileArgs listed = tiles;
    listed.skipUncompressed = false;
    listed.out = norms.data();
    listed.rowTokens = candidates.data();
    listed.rowCounts = candidateCounts.data();
    std::vector<unsigned char> shared(kernels::NormTiles::sharedBytes(d), 0x7F);
    std::vector<unsigned char> topKScratch(std::max<size_t>(topKScratchBytes(B * Hkv, m, kPrunedCandidateLevels), 1));
    int64_t rounds = 0;
    int64_t splitLaunches = 0;
    std::vector<int64_t> roundsOfHead(size_t(B) * Hkv, 0);
    PrunedEmulatedLaunch launch{EmulatedFlowLaunch{topKScratch.data(), topKScratch.size()}, [&](int32_t bound) {
        // the norm launch covers `bound` rows per head; the blocks past the longest list return at once, so the
        // emulation runs only those up to it
        int32_t longest = 0;
        for (int32_t x : candidateCounts)
        {
            if (x > bound)
            {
                std::printf("a list of %d candidates exceeds the norm launch's %d rows\n", x, bound);
                std::exit(1);
            }
            longest = std::max(longest, x);
        }
        for (size_t head = 0; head < candidateCounts.size(); ++head)
        {
            roundsOfHead[head] += candidateCounts[head] > 0 ? 1 : 0;
        }
        rounds += longest > 0 ? 1 : 0;
        // the group's query heads spread over CTAs as value_norms.cu's launch spreads them on an H100 (132 SMs, one
        // CTA each): the same norms bit for bit, so the kept set must not change
        unsigned const tiles = static_cast<unsigned>((longest + kernels::NormTiles::kRows - 1) / kernels::NormTiles::kRows);
        int64_t const gridTiles = (bound + kernels::NormTiles::kRows - 1) / kernels::NormTiles::kRows; // the launch's
        listed.headSplit = kernels::chooseHeadSplit(gridTiles * Hkv * B, group, 132);
        splitLaunches += listed.headSplit > 1 && tiles > 0 ? 1 : 0;
        runGrid(tiles, static_cast<unsigned>(Hkv * listed.headSplit), B, kernels::NormTiles::kThreads,
            [&] { kernels::valueNormsMmaBlock<T, kernels::NormTiles, false>(listed, shared.data()); });
    }};
    int32_t const maxCount = prunedMaxK(c, budgets, s, m); // pipeline.cu's: every head's k at most
    if (!kernels::runPrunedStage2(a, maxCount, launch))
    {
        std::printf("runPrunedStage2 refused its top-k rows\n");
        return 1;
    }
    std::vector<std::vector<int32_t>> const got = keptPositions(c, runtime, s, lengths.data(), flags);

    // The unpruned selection on the same computed values: every older token's exact norm from the same kernel.
    kernels::NormTileArgs every = tiles;
    every.out = exactNorms.data();
    runGrid((m + kernels::NormTiles::kRows - 1) / kernels::NormTiles::kRows, Hkv, B, kernels::NormTiles::kThreads,
        [&] { kernels::valueNormsMmaBlock<T, kernels::NormTiles, false>(every, shared.data()); });
    std::vector<uint8_t> unprunedFlags(perKvHead, 0);
    int64_t computed = 0, eligibleTotal = 0, prunedRows = 0, doubledRows = 0;
    int boundFailures = 0;
    for (int b = 0; b < B; ++b)
    {
        SequenceInfo const info = sequenceInfo(c, runtime, s, lengths.data(), b);
        if (!info.compress)
        {
            continue;
        }
        int64_t const sequence = int64_t(b) * H * m;
        for (int g = 0; g < Hkv; ++g)
        {
            int64_t const row = (int64_t(b) * Hkv + g) * m;
            std::vector<float> exactC(m);
            for (int i = 0; i < m; ++i)
            {
                exactC[i] = groupScoresAt(c, &raw[sequence], &squares[sequence], &exactNorms[sequence], g * group,
                    group, m, i).critical;
                for (int h = g * group; h < (g + 1) * group; ++h)
                {
                    float const computedNorm = exactNorms[sequence + int64_t(h) * m + i];
                    float const bound = bounds[sequence + int64_t(h) * m + i];
                    if (i >= info.validStart && computedNorm > (1.0F + roundingGamma(float(hidden))) * bound)
                    {
                        ++boundFailures;
                    }
                    float const got = norms[sequence + int64_t(h) * m + i];
                    if (got != bound && got != computedNorm) // a candidate's norm is the full kernel's, bit for bit
                    {
                        ++boundFailures;
                    }
                }
            }
            int64_t const count = sharedAllocation(c) ? headCounts[b * Hkv + g] : info.r;
            HostTopKFn topK;
            selectHead(topK, c, &attention[row], exactC.data(), &unprunedFlags[row], m, info.validStart, count);
            PrunedHeadState const state = states[b * Hkv + g];
            if (state.active)
            {
                computed += state.done;
                eligibleTotal += state.eligible;
                prunedRows += state.done < state.eligible ? 1 : 0;
                doubledRows += roundsOfHead[b * Hkv + g] > 1 ? 1 : 0;
            }
        }
    }
    std::vector<std::vector<int32_t>> const unpruned = keptPositions(c, runtime, s, lengths.data(), unprunedFlags);
    int mismatches = 0;
    int hostHeads = 0;
    int32_t hostEntries = 0;
    for (int head = 0; head < B * Hkv; ++head)
    {
        if (got[head] != unpruned[head])
        {
            std::printf("sequence %d, KV head %d: %zu kept, the unpruned selection keeps %zu, or other indices\n",
                head / Hkv, head % Hkv, got[head].size(), unpruned[head].size());
            ++mismatches;
        }
        std::vector<int32_t> host(wantIndices.begin() + int64_t(head) * cap,
            wantIndices.begin() + int64_t(head) * cap + wantLengths[head]);
        int32_t const apart = differing(got[head], host);
        hostHeads += apart > 0 ? 1 : 0;
        hostEntries += apart;
        if (apart > allowed)
        {
            std::printf("sequence %d, KV head %d: %d kept entries differ from the host driver's\n", head / Hkv,
                head % Hkv, apart);
            ++mismatches;
        }
    }
    if (boundFailures > 0)
    {
        std::printf("%d norms exceed (1 + gamma_d) times their bound or are not the full kernel's\n", boundFailures);
        ++mismatches;
    }
    std::printf("%d of %d heads differ; host driver: %d heads, %d entries apart; exact scores: %lld of %lld eligible "
                "tokens; pruned rows: %lld; rows past the first round: %lld; rounds with candidates: %lld; norm launches "
                "with the group split over CTAs: %lld; launchPrunedStage2's stream operations: %lld, of which %lld in "
                "%lld top-k calls\n",
        mismatches, B * Hkv, hostHeads, hostEntries, static_cast<long long>(computed),
        static_cast<long long>(eligibleTotal), static_cast<long long>(prunedRows), static_cast<long long>(doubledRows),
        static_cast<long long>(rounds), static_cast<long long>(splitLaunches),
        static_cast<long long>(launch.flow.counter.operations()), static_cast<long long>(launch.flow.counter.topKOperations),
        static_cast<long long>(launch.flow.counter.topKCalls));
    return mismatches == 0 ? 0 : 1;
}
