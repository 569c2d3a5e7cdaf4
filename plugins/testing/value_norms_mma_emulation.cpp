// CPU emulation of the tensor-core tile bodies (kernels/mma_tiles.cuh) against plain fp64 loops: the same headers the
// kernels compile from, with the warp instructions of testing/mma_emulation.h (lane layouts from
// criticalkv/mma_layout.h, one fiber per CUDA thread, cp.async deferred to its wait). Not built by CMake:
// tests/plugins/test_tensor_core_emulation.py compiles it with g++ -std=c++20.
//   value_norms_mma_emulation layouts
//     the fragment functions against the PTX ISA's per-element formulas (a_i, b_i, c_i index form)
//   value_norms_mma_emulation banks
//     the shared-memory bank analysis of the tile bodies' reads (ldmatrix phases, gramQuadBlock's epilogues): every
//     warp-wide read conflict-free for d_h = 16 .. 128
//   value_norms_mma_emulation norms DTYPE KIND BATCH HEADS KV_HEADS N HEAD_DIM HIDDEN GATHER SEED
//     valueNormsMmaBlock: DTYPE bf16 | fp16, KIND l1 | l2, GATHER 0 (every token) | 1 (ragged lists per head)
//   value_norms_mma_emulation terms DTYPE HEADS HEAD_DIM HIDDEN SEED
//     the pruned stage 2's weights-only terms (bound_terms.cuh): the fp32 path bit for bit the host driver's, the
//     tensor path's G_h within its error analysis of fp64
//   value_norms_mma_emulation quad DTYPE BATCH HEADS KV_HEADS N HEAD_DIM HIDDEN GATHER SEED
//     gramPiecesBlock + gramQuadBlock: the l2 norms through the Gram pieces, and the L1 upper bounds, which must bound
//     the emulated valueNormsMmaBlock's L1 norms of the same rows (times 1 + gamma_d) for random, cancelling, sparse
//     and top-singular-direction values
//   -> exit 0 when every check holds; prints the largest relative errors
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_emulation.h"

#include "mma_emulation.h"

#include "bound_terms.cuh"
#include "mma_tiles.cuh"

using namespace criticalkv;
using namespace criticalkv::kernels;

namespace
{

int gFailures = 0;

void check(bool ok, char const* what, double got, double want)
{
    if (!ok && gFailures++ < 20)
    {
        std::printf("FAIL %s: got %.9g want %.9g\n", what, got, want);
    }
}

int layouts()
{
    // PTX ISA 9.7.14.5.8 (m16n8k16, .f16/.bf16): element a_i (i = 0..7, two per register, low half first)
    //   row = groupID for 0 <= i < 2 || 4 <= i < 6, else groupID + 8
    //   col = threadID_in_group * 2 + (i & 1) for i < 4, else + 8
    // b_i (i = 0..3): row = threadID_in_group * 2 + (i & 1) for i < 2, else + 8; col = groupID
    // c_i (i = 0..3): row = groupID for i < 2, else groupID + 8; col = threadID_in_group * 2 + (i & 1)
    for (int lane = 0; lane < 32; ++lane)
    {
        int const group = lane >> 2;
        int const thread = lane % 4;
        for (int i = 0; i < 8; ++i)
        {
            int const row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
            int const col = thread * 2 + (i & 1) + (i < 4 ? 0 : 8);
            mma::RowCol const rc = mma::aFragment(lane, i / 2);
            check(rc.row == row && rc.col + (i & 1) == col, "a fragment", lane * 100 + i, row * 100 + col);
        }
        for (int i = 0; i < 4; ++i)
        {
            int const row = thread * 2 + (i & 1) + (i < 2 ? 0 : 8);
            mma::RowCol const rc = mma::bFragment(lane, i / 2);
            check(rc.row + (i & 1) == row && rc.col == group, "b fragment", lane * 100 + i, row * 100 + group);
        }
        for (int i = 0; i < 4; ++i)
        {
            mma::RowCol const rc = mma::cFragment(lane, i);
            check(rc.row == (i < 2 ? group : group + 8) && rc.col == thread * 2 + (i & 1), "c fragment", lane, i);
        }
        // ldmatrix.x4 of A: the matrix a lane's address belongs to must be the register it fills (q = lane >> 3)
        mma::RowCol const ar = mma::ldmatrixARow(lane);
        int const q = lane >> 3;
        mma::RowCol const first = mma::aFragment(0, q); // register q holds rows 8 (q & 1).., cols 8 (q >> 1)..
        check(ar.row - (lane & 7) == first.row && ar.col == first.col, "ldmatrix A row", lane, q);
        mma::RowCol const br = mma::ldmatrixBRow(lane);
        check(br.row == (lane & 7) + 8 * (q >> 1) && br.col == 8 * (q & 1), "ldmatrix B row", lane, q);
    }
    std::printf("layouts: %d failures\n", gFailures);
    return gFailures == 0 ? 0 : 1;
}

//! Shared-memory bank conflicts of one warp-wide access: `words` holds the 32-bit word every lane touches (-1: none).
//! The degree is the most distinct words that fall in one of the 32 banks (1: conflict-free; lanes reading one word
//! share it).
int conflictDegree(std::vector<int64_t> const& words)
{
    std::vector<std::vector<int64_t>> banks(32);
    for (int64_t word : words)
    {
        if (word < 0)
        {
            continue;
        }
        auto& bank = banks[static_cast<size_t>(word % 32)];
        if (std::find(bank.begin(), bank.end(), word) == bank.end())
        {
            bank.push_back(word);
        }
    }
    int degree = 0;
    for (auto const& bank : banks)
    {
        degree = std::max(degree, static_cast<int>(bank.size()));
    }
    return degree;
}

//! The shared-memory reads of the tile bodies, index by index (the header's own offset functions), for every d_h
//! % 16 == 0 up to 128 and each configuration: the ldmatrix.x4 phases of A (value rows) and B (W_O or Gram tiles),
//! gramQuadBlock's epilogue reads of v in the accumulators' layout, and its bound epilogue's per-row loop
//! (boundRowWord). Every one must be conflict-free; the bound loop in the plain word order is reported beside it (it
//! had 4-way conflicts) so that the analysis is seen to find conflicts.
template <typename Cfg>
int bankAnalysis(char const* name)
{
    int worstFragments = 0;
    int worstEpilogue = 0;
    int worstBound = 0;
    int plainBound = 0;
    for (int32_t d = 16; d <= 128; d += 16)
    {
        int32_t const stride = mma::paddedStride(d);
        // ldmatrix.x4: 4 phases (one per 8x8 matrix), the 8 lanes of a phase each read one 16-byte row
        for (int32_t k0 = 0; k0 < d; k0 += mma::kTileK)
        {
            for (int32_t row0 = 0; row0 < Cfg::kRows; row0 += 16)
            {
                for (int32_t phase = 0; phase < 4; ++phase)
                {
                    std::vector<int64_t> a, b;
                    for (int32_t lane = phase * 8; lane < phase * 8 + 8; ++lane)
                    {
                        for (int32_t word = 0; word < 4; ++word)
                        {
                            a.push_back(mma::fragmentAOffset(stride, row0, k0, lane) / 2 + word);
                            if (row0 < Cfg::kCols)
                            {
                                b.push_back(mma::fragmentBOffset(stride, row0, k0, lane) / 2 + word);
                            }
                        }
                    }
                    worstFragments = std::max({worstFragments, conflictDegree(a), conflictDegree(b)});
                }
            }
        }
        // gramQuadBlock's epilogue: v[row, col] at every accumulator element (cFragment), col < d
        for (int32_t warpM = 0; warpM < Cfg::kWarpsM; ++warpM)
        {
            for (int32_t warpN = 0; warpN < Cfg::kWarpsN; ++warpN)
            {
                for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
                {
                    for (int32_t ni = 0; ni < Cfg::kNTiles; ++ni)
                    {
                        for (int32_t e = 0; e < 4; ++e)
                        {
                            std::vector<int64_t> words;
                            for (int32_t lane = 0; lane < 32; ++lane)
                            {
                                mma::RowCol const rc = mma::cFragment(lane, e);
                                int32_t const row = warpM * Cfg::kWarpRows + mi * 16 + rc.row;
                                int32_t const col = warpN * Cfg::kWarpCols + ni * 8 + rc.col;
                                words.push_back(col < d ? (int64_t(row) * stride + col) / 2 : -1);
                            }
                            worstEpilogue = std::max(worstEpilogue, conflictDegree(words));
                        }
                    }
                }
            }
        }
        // the bound epilogue: thread t of the block takes rows t, t + kThreads, ...; a warp's 32 rows are consecutive
        for (int32_t row0 = 0; row0 < Cfg::kRows; row0 += 32)
        {
            for (int32_t w = 0; w < d / 2; ++w)
            {
                std::vector<int64_t> swizzled, plain;
                for (int32_t lane = 0; lane < 32; ++lane)
                {
                    int32_t const row = row0 + lane;
                    int32_t const word = boundRowWord(row, w);
                    if (word < 0 || word >= d / 2)
                    {
                        std::printf("FAIL boundRowWord(%d, %d) = %d leaves the row of %d words\n", row, w, word, d / 2);
                        ++gFailures;
                    }
                    swizzled.push_back(int64_t(row) * stride / 2 + word);
                    plain.push_back(int64_t(row) * stride / 2 + w);
                }
                worstBound = std::max(worstBound, conflictDegree(swizzled));
                plainBound = std::max(plainBound, conflictDegree(plain));
            }
            // every row reads each of its words exactly once
            for (int32_t lane = 0; lane < 32; ++lane)
            {
                std::vector<int32_t> seen;
                for (int32_t w = 0; w < d / 2; ++w)
                {
                    seen.push_back(boundRowWord(row0 + lane, w));
                }
                std::sort(seen.begin(), seen.end());
                for (int32_t w = 0; w < d / 2; ++w)
                {
                    if (seen[static_cast<size_t>(w)] != w)
                    {
                        std::printf("FAIL row %d does not read word %d exactly once\n", row0 + lane, w);
                        ++gFailures;
                        break;
                    }
                }
            }
        }
    }
    std::printf("%s: ldmatrix phases %d-way, quad epilogue %d-way, bound rows %d-way (plain order: %d-way)\n", name,
        worstFragments, worstEpilogue, worstBound, plainBound);
    return (worstFragments == 1 && worstEpilogue == 1 && worstBound == 1 && plainBound > 1) ? 0 : 1;
}

int banks()
{
    int failures = bankAnalysis<GramTiles64>("GramTiles64") + bankAnalysis<GramTiles128>("GramTiles128")
        + bankAnalysis<NormTiles>("NormTiles") + bankAnalysis<NormTilesSmall>("NormTilesSmall");
    failures += gFailures;
    std::printf("banks: %d failures\n", failures);
    return failures == 0 ? 0 : 1;
}

struct Layer
{
    SelectShape shape;
    std::vector<float> v; // [B, H_kv, n, d] as rounded to the 16-bit type
    std::vector<float> o; // [hidden, H d]
    std::vector<int32_t> tokens; // [B, H_kv, n] lists (gathered)
    std::vector<int32_t> counts; // [B, H_kv]
};

template <typename T>
std::vector<T> toType(std::vector<float>& x)
{
    std::vector<T> out(x.size());
    for (size_t i = 0; i < x.size(); ++i)
    {
        out[i] = fromFloat<T>(x[i]);
        x[i] = toFloat(out[i]);
    }
    return out;
}

Layer makeLayer(int B, int H, int Hkv, int n, int d, int hidden, bool gather, std::mt19937& rng, std::string const& values)
{
    Layer l;
    l.shape = SelectShape{B, H, Hkv, n, 0, d, hidden};
    std::normal_distribution<float> normal(0.0F, 1.0F);
    l.v.resize(static_cast<size_t>(B) * Hkv * n * d);
    for (size_t i = 0; i < l.v.size(); ++i)
    {
        size_t const row = i / d;
        float x = normal(rng) * (0.5F + static_cast<float>(row % 7));
        if (values == "sparse" && (i % d) % 5 != 0)
        {
            x = 0.0F;
        }
        else if (values == "tiny")
        {
            x *= 1e-6F;
        }
        l.v[i] = x;
    }
    l.o.resize(static_cast<size_t>(hidden) * H * d);
    for (float& x : l.o)
    {
        x = normal(rng) / std::sqrt(static_cast<float>(H * d));
    }
    if (values == "cancel")
    {
        // every value row orthogonal-ish to W_O's first head: v = w_a - w_b for two rows' worth of columns
        for (size_t r = 0; r < l.v.size() / d; ++r)
        {
            for (int k = 0; k < d; ++k)
            {
                l.v[r * d + k] = l.o[(r % hidden) * H * d + k] - l.o[((r + 1) % hidden) * H * d + k];
            }
        }
    }
    if (gather)
    {
        l.tokens.assign(static_cast<size_t>(B) * Hkv * n, -1);
        l.counts.resize(static_cast<size_t>(B) * Hkv);
        for (int head = 0; head < B * Hkv; ++head)
        {
            std::vector<int32_t> all(n);
            for (int i = 0; i < n; ++i)
            {
                all[i] = i;
            }
            std::shuffle(all.begin(), all.end(), rng);
            int const count = head == 0 ? n : static_cast<int>(rng() % static_cast<unsigned>(n)); // ragged, some 0
            l.counts[head] = head == 1 ? 0 : count;
            std::copy(all.begin(), all.begin() + l.counts[head], l.tokens.begin() + static_cast<int64_t>(head) * n);
        }
    }
    return l;
}

//! fp64 ||v W_O^h|| (l1 or l2) and the exact sum_k |v_k W_kc| terms.
double referenceNorm(Layer const& l, int b, int h, int i, bool l2)
{
    int const d = l.shape.headDim;
    int const g = h / (l.shape.heads / l.shape.kvHeads);
    float const* v = &l.v[((static_cast<size_t>(b) * l.shape.kvHeads + g) * l.shape.n + i) * d];
    double total = 0.0;
    for (int c = 0; c < l.shape.hidden; ++c)
    {
        double dot = 0.0;
        for (int k = 0; k < d; ++k)
        {
            dot += static_cast<double>(v[k]) * l.o[static_cast<size_t>(c) * l.shape.heads * d + h * d + k];
        }
        total += l2 ? dot * dot : std::fabs(dot);
    }
    return l2 ? std::sqrt(total) : total;
}

NormTileArgs argsOf(Layer const& l, void const* v, void const* o, float* out, bool gather)
{
    NormTileArgs a{};
    a.shape = l.shape;
    a.values = v;
    a.oProj = o;
    a.numTokens = l.shape.n;
    a.out = out;
    a.rowTokens = gather ? l.tokens.data() : nullptr;
    a.rowCounts = gather ? l.counts.data() : nullptr;
    a.rowStride = l.shape.n;
    return a;
}

template <typename Cfg, typename Body>
void runGrid(NormTileArgs const& a, int32_t headDim, Body body)
{
    std::vector<unsigned char> shared(Cfg::sharedBytes(headDim) + 64);
    // shared memory starts as garbage: reading what no copy wrote shows
    std::fill(shared.begin(), shared.end(), static_cast<unsigned char>(0x7F));
    unsigned const tiles = static_cast<unsigned>((a.shape.n + Cfg::kRows - 1) / Cfg::kRows);
    for (unsigned z = 0; z < static_cast<unsigned>(a.shape.batch); ++z)
    {
        for (unsigned y = 0; y < static_cast<unsigned>(a.shape.kvHeads * headSplitOf(a)); ++y)
        {
            for (unsigned x = 0; x < tiles; ++x)
            {
                runEmulatedBlock(x, y, z, Cfg::kThreads, [&] { body(a, shared.data()); });
            }
        }
    }
}

//! Emulated valueNormsMmaBlock over the layer: out [B, H, n] (NaN where no row was listed); headSplit CTAs per KV head.
template <typename T>
std::vector<float> emulatedNorms(Layer const& l, std::vector<T> const& v, std::vector<T> const& o, bool l2, bool gather,
    int32_t headSplit = 1)
{
    std::vector<float> out(static_cast<size_t>(l.shape.batch) * l.shape.heads * l.shape.n, NAN);
    NormTileArgs a = argsOf(l, v.data(), o.data(), out.data(), gather);
    a.headSplit = headSplit;
    auto body = [l2](NormTileArgs const& args, unsigned char* shared) {
        if (l2)
        {
            valueNormsMmaBlock<T, NormTiles, true>(args, shared);
        }
        else
        {
            valueNormsMmaBlock<T, NormTiles, false>(args, shared);
        }
    };
    runGrid<NormTiles>(a, l.shape.headDim, body);
    return out;
}

bool listed(Layer const& l, bool gather, int b, int g, int i)
{
    if (!gather)
    {
        return true;
    }
    int64_t const head = static_cast<int64_t>(b) * l.shape.kvHeads + g;
    for (int p = 0; p < l.counts[head]; ++p)
    {
        if (l.tokens[head * l.shape.n + p] == i)
        {
            return true;
        }
    }
    return false;
}

template <typename T>
int runNorms(int B, int H, int Hkv, int n, int d, int hidden, bool l2, bool gather, int seed)
{
    std::mt19937 rng(seed);
    Layer l = makeLayer(B, H, Hkv, n, d, hidden, gather, rng, "random");
    std::vector<T> const v = toType<T>(l.v);
    std::vector<T> const o = toType<T>(l.o);
    std::vector<float> const out = emulatedNorms<T>(l, v, o, l2, gather);
    double worst = 0.0;
    int computed = 0;
    for (int b = 0; b < B; ++b)
    {
        for (int h = 0; h < H; ++h)
        {
            int const g = h / (H / Hkv);
            for (int i = 0; i < n; ++i)
            {
                float const got = out[(static_cast<size_t>(b) * H + h) * n + i];
                if (!listed(l, gather, b, g, i))
                {
                    check(std::isnan(got), "unlisted row untouched", got, NAN);
                    continue;
                }
                double const want = referenceNorm(l, b, h, i, l2);
                double const error = std::fabs(got - want) / (want + 1e-30);
                worst = std::max(worst, error);
                check(error < 2e-5, "norm", got, want);
                ++computed;
            }
        }
    }
    // the query heads of a group spread over several CTAs (chooseHeadSplit's choice where the grid is short of the
    // device's waves): every norm bit for bit the one-CTA launch's
    int32_t const group = H / Hkv;
    int splitRows = 0;
    for (int32_t split = 2; split <= group; ++split)
    {
        if (group % split != 0)
        {
            continue;
        }
        std::vector<float> const spread = emulatedNorms<T>(l, v, o, l2, gather, split);
        for (size_t e = 0; e < out.size(); ++e)
        {
            bool const same = std::memcmp(&spread[e], &out[e], sizeof(float)) == 0;
            check(same, "norm with the group split over CTAs", spread[e], out[e]);
            splitRows += std::isnan(out[e]) ? 0 : 1;
        }
    }
    // chooseHeadSplit: the pruned stage 2's first candidates at 32k on an H100 (12 row tiles x 8 KV heads, group 4,
    // 132 SMs): 4; a full layer's 1,024 CTAs: 1; more waves only where the last one fills better
    check(chooseHeadSplit(96, 4, 132) == 4, "chooseHeadSplit(96, 4, 132)", chooseHeadSplit(96, 4, 132), 4);
    check(chooseHeadSplit(1024, 4, 132) == 1, "chooseHeadSplit(1024, 4, 132)", chooseHeadSplit(1024, 4, 132), 1);
    check(chooseHeadSplit(132, 4, 132) == 1, "chooseHeadSplit(132, 4, 132)", chooseHeadSplit(132, 4, 132), 1);
    check(chooseHeadSplit(66, 4, 132) == 2, "chooseHeadSplit(66, 4, 132)", chooseHeadSplit(66, 4, 132), 2);
    check(chooseHeadSplit(96, 1, 132) == 1, "chooseHeadSplit(96, 1, 132)", chooseHeadSplit(96, 1, 132), 1);
    check(chooseHeadSplit(20, 3, 108) == 3, "chooseHeadSplit(20, 3, 108)", chooseHeadSplit(20, 3, 108), 3);
    std::printf("norms: %d rows, largest relative error %.3g, %d rows split over CTAs, %d failures\n", computed, worst,
        splitRows, gFailures);
    return gFailures == 0 ? 0 : 1;
}

//! The pruned stage 2's weights-only terms (bound_terms.cuh) of random weights [hidden, H d_h] of type T:
//! boundTermsSimtBlock bit for bit the host driver's functions (gramEntry, rowL1Entry, columnL1; T widened to float);
//! for 16-bit T with d_h % 16 == 0 and d_h <= 128, boundTermsTensorBlock's G_h within (34 + hidden / 16 + 2) u of
//! sum_c |W_kc W_lc| of the fp64 Gram matrix (a fresh mma accumulator per k16 step, fp32 sums of the steps: inside the
//! gamma_{hidden + 3 d_h + 64} the bound grants), s_h and c_h within gamma_hidden of fp64.
template <typename T>
int runTerms(int H, int d, int hidden, int seed)
{
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0F, 1.0F);
    std::vector<float> wf(static_cast<size_t>(hidden) * H * d);
    for (size_t i = 0; i < wf.size(); ++i)
    {
        wf[i] = normal(rng) * (i % 17 == 0 ? 8.0F : 0.05F); // a few large entries: sums far from uniform
    }
    std::vector<T> const w = toType<T>(wf);
    SelectShape const shape{1, H, H, 1, 0, d, hidden};
    size_t const entries = static_cast<size_t>(d) * d;
    auto weightOf = [&](int h) {
        return [&wf, h, H, d](int32_t c, int32_t k) { return wf[static_cast<size_t>(c) * H * d + h * d + k]; };
    };
    unsigned const rowBlocks = static_cast<unsigned>((d + kTermRows - 1) / kTermRows);
    auto argsFor = [&](std::vector<float>& gram, std::vector<float>& rowL1, std::vector<float>& colL1) {
        BoundArgs a{};
        a.shape = shape;
        a.oProj = w.data();
        a.gram = gram.data();
        a.rowL1 = rowL1.data();
        a.colL1 = colL1.data();
        return a;
    };
    // the fp32 path: bit for bit
    std::vector<float> gram(H * entries, NAN), rowL1(static_cast<size_t>(H) * d, NAN), colL1(H, NAN);
    BoundArgs const simt = argsFor(gram, rowL1, colL1);
    std::vector<float> shared(boundTermsSimtSharedBytes(d) / sizeof(float));
    for (unsigned h = 0; h < static_cast<unsigned>(H); ++h)
    {
        for (unsigned x = 0; x < rowBlocks; ++x)
        {
            std::fill(shared.begin(), shared.end(), 1.5e30F); // garbage first
            runEmulatedBlock(x, h, 0, kTermThreads, [&] { boundTermsSimtBlock<T>(simt, shared.data()); });
        }
    }
    int mismatches = 0;
    for (int h = 0; h < H; ++h)
    {
        auto const weight = weightOf(h);
        float best = 0.0F;
        for (int c = 0; c < hidden; ++c)
        {
            best = std::max(best, columnL1(weight, c, d));
        }
        mismatches += std::memcmp(&best, &colL1[h], sizeof(float)) != 0 ? 1 : 0;
        for (int k = 0; k < d; ++k)
        {
            float const row = rowL1Entry(weight, k, hidden);
            mismatches += std::memcmp(&row, &rowL1[static_cast<size_t>(h) * d + k], sizeof(float)) != 0 ? 1 : 0;
            for (int l = 0; l < d; ++l)
            {
                float const g = gramEntry(weight, k, l, hidden);
                mismatches += std::memcmp(&g, &gram[h * entries + static_cast<size_t>(k) * d + l], sizeof(float)) != 0;
            }
        }
    }
    check(mismatches == 0, "fp32-path terms bit for bit the host driver's (mismatching entries)", mismatches, 0);
    double worstGram = 0.0; // |G - G64| / (u sum |p|), tensor path
    if constexpr (!std::is_same<T, float>::value)
    {
        if (d % 16 == 0 && d <= 128)
        {
            std::vector<float> tg(H * entries, NAN), tr(static_cast<size_t>(H) * d, NAN), tc(H, NAN);
            BoundArgs const tensor = argsFor(tg, tr, tc);
            for (unsigned h = 0; h < static_cast<unsigned>(H); ++h)
            {
                for (unsigned x = 0; x < rowBlocks; ++x)
                {
                    static TermTileSmem smem;
                    std::memset(&smem, 0x7F, sizeof(smem));
                    runEmulatedBlock(x, h, 0, kTermThreads, [&] { boundTermsTensorBlock<T>(tensor, smem); });
                }
            }
            double const u = std::ldexp(1.0, -24);
            double const allowed = 34.0 + hidden / 16.0 + 2.0;
            for (int h = 0; h < H; ++h)
            {
                double columnBest = 0.0;
                for (int c = 0; c < hidden; ++c)
                {
                    double sum = 0.0;
                    for (int k = 0; k < d; ++k)
                    {
                        sum += std::fabs(static_cast<double>(wf[static_cast<size_t>(c) * H * d + h * d + k]));
                    }
                    columnBest = std::max(columnBest, sum);
                }
                double const gammaD = hidden * u / (1.0 - hidden * u);
                check(std::fabs(tc[h] - columnBest) <= gammaD * columnBest, "tensor-path c_h", tc[h], columnBest);
                for (int k = 0; k < d; ++k)
                {
                    double row = 0.0;
                    for (int c = 0; c < hidden; ++c)
                    {
                        row += std::fabs(static_cast<double>(wf[static_cast<size_t>(c) * H * d + h * d + k]));
                    }
                    float const gotRow = tr[static_cast<size_t>(h) * d + k];
                    check(std::fabs(gotRow - row) <= gammaD * row, "tensor-path s_h", gotRow, row);
                    for (int l = 0; l < d; ++l)
                    {
                        double exact = 0.0;
                        double magnitude = 0.0;
                        for (int c = 0; c < hidden; ++c)
                        {
                            double const x = static_cast<double>(wf[static_cast<size_t>(c) * H * d + h * d + k])
                                * wf[static_cast<size_t>(c) * H * d + h * d + l];
                            exact += x;
                            magnitude += std::fabs(x);
                        }
                        float const got = tg[h * entries + static_cast<size_t>(k) * d + l];
                        double const ratio = std::fabs(got - exact) / (u * magnitude + 1e-300);
                        worstGram = std::max(worstGram, ratio);
                        check(ratio <= allowed, "tensor-path G_h error / (u sum |p|)", ratio, allowed);
                    }
                }
            }
        }
    }
    std::printf("terms: %d heads, fp32 path %d entries apart from the host driver, tensor-path G error %.2f u sum |p|, "
                "%d failures\n",
        H, mismatches, worstGram, gFailures);
    return gFailures == 0 ? 0 : 1;
}

template <typename T>
int runQuad(int B, int H, int Hkv, int n, int d, int hidden, bool gather, int seed, std::string const& values)
{
    std::mt19937 rng(seed);
    Layer l = makeLayer(B, H, Hkv, n, d, hidden, gather, rng, values);
    std::vector<T> const v = toType<T>(l.v);
    std::vector<T> const o = toType<T>(l.o);
    size_t const entries = static_cast<size_t>(d) * d;
    // the weights-only terms as the bound's kernels compute them (fp32 from the 16-bit weights)
    std::vector<float> gram(H * entries), rowL1(static_cast<size_t>(H) * d), colL1(H, 0.0F);
    for (int h = 0; h < H; ++h)
    {
        for (int k = 0; k < d; ++k)
        {
            double s = 0.0;
            for (int c = 0; c < hidden; ++c)
            {
                s += std::fabs(l.o[static_cast<size_t>(c) * H * d + h * d + k]);
            }
            rowL1[static_cast<size_t>(h) * d + k] = static_cast<float>(s);
            for (int j = 0; j < d; ++j)
            {
                double acc = 0.0;
                for (int c = 0; c < hidden; ++c)
                {
                    acc += static_cast<double>(l.o[static_cast<size_t>(c) * H * d + h * d + k])
                        * l.o[static_cast<size_t>(c) * H * d + h * d + j];
                }
                gram[h * entries + static_cast<size_t>(k) * d + j] = static_cast<float>(acc);
            }
        }
        for (int c = 0; c < hidden; ++c)
        {
            double s = 0.0;
            for (int k = 0; k < d; ++k)
            {
                s += std::fabs(l.o[static_cast<size_t>(c) * H * d + h * d + k]);
            }
            colL1[h] = std::max(colL1[h], static_cast<float>(s));
        }
    }
    auto quadOf = [&](int pieces, bool bound) {
        std::vector<T> gramPieces(static_cast<size_t>(H) * pieces * entries);
        std::vector<float> inverseScale(H);
        std::vector<float> partial(kGramPieceThreads);
        for (unsigned h = 0; h < static_cast<unsigned>(H); ++h)
        {
            runEmulatedBlock(h, 0, 0, kGramPieceThreads, [&] {
                if (pieces == kGramPiecesL2)
                {
                    gramPiecesBlock<T, kGramPiecesL2, kGramPieceThreads>(gram.data(), d, gramPieces.data(),
                        inverseScale.data(), partial.data());
                }
                else
                {
                    gramPiecesBlock<T, kGramPiecesBound, kGramPieceThreads>(gram.data(), d, gramPieces.data(),
                        inverseScale.data(), partial.data());
                }
            });
        }
        std::vector<float> out(static_cast<size_t>(B) * H * n, NAN);
        NormTileArgs a = argsOf(l, v.data(), nullptr, out.data(), gather);
        a.gramPieces = gramPieces.data();
        a.gramScale = inverseScale.data();
        a.rowL1 = rowL1.data();
        a.colL1 = colL1.data();
        auto run = [&](auto cfg) {
            using Cfg = decltype(cfg);
            runGrid<Cfg>(a, d, [&](NormTileArgs const& args, unsigned char* shared) {
                if (bound)
                {
                    gramQuadBlock<T, Cfg, kGramPiecesBound, true>(args, shared);
                }
                else
                {
                    gramQuadBlock<T, Cfg, kGramPiecesL2, false>(args, shared);
                }
            });
        };
        if (d <= 64)
        {
            run(GramTiles64{});
        }
        else
        {
            run(GramTiles128{});
        }
        return out;
    };
    std::vector<float> const l2 = quadOf(kGramPiecesL2, false);
    std::vector<float> const bounds = quadOf(kGramPiecesBound, true);
    std::vector<float> const l1 = emulatedNorms<T>(l, v, o, false, gather);
    double worst = 0.0;
    double slack = 1e30;
    int computed = 0;
    float const grow = 1.0F + roundingGamma(static_cast<float>(hidden));
    for (int b = 0; b < B; ++b)
    {
        for (int h = 0; h < H; ++h)
        {
            int const g = h / (H / Hkv);
            for (int i = 0; i < n; ++i)
            {
                size_t const at = (static_cast<size_t>(b) * H + h) * n + i;
                if (!listed(l, gather, b, g, i))
                {
                    check(std::isnan(l2[at]) && std::isnan(bounds[at]), "unlisted row untouched", l2[at], NAN);
                    continue;
                }
                double const want = referenceNorm(l, b, h, i, true);
                double const error = std::fabs(l2[at] - want) / (want + 1e-30);
                worst = std::max(worst, error);
                check(error < 4e-6 || std::fabs(l2[at] - want) < 1e-30, "l2 through the Gram pieces", l2[at], want);
                // soundness: the computed L1 norm never exceeds (1 + gamma_d) B
                check(l1[at] <= grow * bounds[at], "bound >= computed L1 norm", bounds[at], l1[at]);
                check(bounds[at] >= referenceNorm(l, b, h, i, false), "bound >= exact L1 norm", bounds[at],
                    referenceNorm(l, b, h, i, false));
                slack = std::min(slack, static_cast<double>(bounds[at]) / l1[at]);
                ++computed;
            }
        }
    }
    std::printf("quad: %d rows, l2 largest relative error %.3g, tightest bound / L1 %.6f, %d failures\n", computed,
        worst, slack, gFailures);
    return gFailures == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv)
{
    std::string const mode = argc > 1 ? argv[1] : "";
    if (mode == "layouts")
    {
        return layouts();
    }
    if (mode == "banks")
    {
        return banks();
    }
    if (mode == "norms" && argc == 12)
    {
        std::string const dtype = argv[2];
        bool const l2 = std::string(argv[3]) == "l2";
        int const a[] = {std::atoi(argv[4]), std::atoi(argv[5]), std::atoi(argv[6]), std::atoi(argv[7]),
            std::atoi(argv[8]), std::atoi(argv[9]), std::atoi(argv[10]), std::atoi(argv[11])};
        return dtype == "fp16" ? runNorms<__half>(a[0], a[1], a[2], a[3], a[4], a[5], l2, a[6] != 0, a[7])
                               : runNorms<__nv_bfloat16>(a[0], a[1], a[2], a[3], a[4], a[5], l2, a[6] != 0, a[7]);
    }
    if (mode == "terms" && argc == 7)
    {
        std::string const dtype = argv[2];
        int const a[] = {std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), std::atoi(argv[6])};
        return dtype == "fp16" ? runTerms<__half>(a[0], a[1], a[2], a[3])
            : dtype == "fp32"  ? runTerms<float>(a[0], a[1], a[2], a[3])
                               : runTerms<__nv_bfloat16>(a[0], a[1], a[2], a[3]);
    }
    if (mode == "quad" && argc == 12)
    {
        std::string const dtype = argv[2];
        int const a[] = {std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), std::atoi(argv[6]),
            std::atoi(argv[7]), std::atoi(argv[8]), std::atoi(argv[9]), std::atoi(argv[10])};
        std::string const values = argv[11];
        return dtype == "fp16" ? runQuad<__half>(a[0], a[1], a[2], a[3], a[4], a[5], a[6] != 0, a[7], values)
                               : runQuad<__nv_bfloat16>(a[0], a[1], a[2], a[3], a[4], a[5], a[6] != 0, a[7], values);
    }
    std::fprintf(stderr,
        "usage: %s layouts | banks | terms DTYPE H D HIDDEN SEED | norms DTYPE KIND B H H_KV N D HIDDEN GATHER SEED | quad DTYPE B H H_KV N D HIDDEN GATHER "
        "SEED VALUES\n",
        argv[0]);
    return 2;
}
