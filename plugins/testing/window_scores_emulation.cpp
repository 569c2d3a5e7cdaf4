// CPU emulation of the window-score kernels (kernels/window_tiles.cuh: the tensor-core passes; kernels/window_simt.cuh:
// the SIMT passes and defensivekv's SIMT row passes): the very headers the kernels compile from, with the warp
// instructions of testing/mma_emulation.h (fragment layouts from criticalkv/mma_layout.h, cp.async landing at the wait
// that retires it, one fiber per CUDA thread, shared memory filled with garbage before every block). Not built by
// CMake: tests/plugins/test_window_scores_emulation.py compiles it with g++ -std=c++20 and the host driver.
//   window_scores_emulation window DTYPE B H H_KV N D W POOL ROWS TILES_PER_BLOCK SEED
//     DTYPE bf16 | fp16: the tensor-core path (pass 1, combine, pass 3; TILES_PER_BLOCK 64-key steps per CTA, 0: the
//     launch's own choice); fp32: the SIMT path. Ā, sum A^2 and (ROWS 1) defensivekv's worst and row (mass, total)
//     against fp64 loops over the same (16-bit rounded) inputs and against the host driver (select_host.cpp); the first
//     sequence whole, the second left-padded, a third too short to be compressed (its outputs must stay untouched).
//     Prints "largest relative error vs fp64: kernel K, host driver H" per quantity and "N failures".
//   window_scores_emulation rows POOL B H H_KV N D W SEED
//     the SIMT row passes alone, fed the softmax statistics of the rows they are compared with: worst and the rows'
//     (mass, total) equal the host driver's whole-row form up to fp32 rounding (2e-6).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cuda_emulation.h"

#include "mma_emulation.h"

#include "select_host.h"

#include "window_simt.cuh"
#include "window_tiles.cuh"

using namespace criticalkv;
using namespace criticalkv::kernels;

namespace
{

int gFailures = 0;

void check(bool ok, char const* what, int b, int h, int i, double got, double want)
{
    if (!ok && gFailures++ < 20)
    {
        std::printf("FAIL %s at (%d, %d, %d): got %.9g want %.9g\n", what, b, h, i, got, want);
    }
}

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

template <>
std::vector<float> toType<float>(std::vector<float>& x)
{
    return x;
}

struct Problem
{
    SelectConfig config;
    SelectShape shape;
    int w;
    int m;
    std::vector<float> q; // [B, H, w, d] as rounded to the input type
    std::vector<float> k; // [B, H_kv, n, d]
    std::vector<int32_t> lengths;
};

Problem makeProblem(int B, int H, int Hkv, int n, int d, int window, int pool, bool rows, int seed)
{
    Problem p;
    p.w = std::min(window, n);
    p.m = n - p.w;
    p.shape = SelectShape{B, H, Hkv, n, p.w, d, 8};
    std::mt19937 rng(static_cast<unsigned>(seed));
    std::normal_distribution<float> normal(0.0F, 1.0F);
    p.q.resize(static_cast<size_t>(B) * H * p.w * d);
    p.k.resize(static_cast<size_t>(B) * Hkv * n * d);
    float const sharp = 8.0F / std::sqrt(static_cast<float>(d)); // logits of a few units: peaked rows, no underflow
    for (float& x : p.q)
    {
        x = sharp * normal(rng);
    }
    for (size_t r = 0; r < p.k.size() / d; ++r)
    {
        float const boost = r % 97 == 3 ? 2.5F : 1.0F; // a few attention sinks
        for (int e = 0; e < d; ++e)
        {
            p.k[r * d + e] = boost * normal(rng);
        }
    }
    SelectConfig& c = p.config;
    c.base = rows ? BaseMethod::kDefensiveKV : BaseMethod::kSnapKV;
    c.window = window;
    c.budget = p.w + 8; // a sequence of at most w + 8 tokens is not compressed
    c.minBudget = p.w;
    c.poolKernel = pool;
    c.capacity = n;
    p.lengths.resize(B);
    for (int b = 0; b < B; ++b)
    {
        p.lengths[b] = b == 0 ? n : (b == 1 ? std::max(p.w + 9, n - 37) : p.w + 5);
    }
    return p;
}

bool compressed(Problem const& p, int b)
{
    return sequenceInfo(p.config, RuntimeBudget{nullptr, nullptr}, p.shape, p.lengths.data(), b).compress;
}

//! What every implementation gives: [B, H, m] raw, squares, worst; [B, H, w] mass, total (NaN where not written).
struct Scores
{
    std::vector<double> raw, squares, worst, mass, total;

    explicit Scores(Problem const& p)
    {
        size_t const older = static_cast<size_t>(p.shape.batch) * p.shape.heads * p.m;
        size_t const rows = static_cast<size_t>(p.shape.batch) * p.shape.heads * p.w;
        raw.assign(older, NAN);
        squares.assign(older, NAN);
        worst.assign(older, NAN);
        mass.assign(rows, NAN);
        total.assign(rows, NAN);
    }
};

//! The fp64 loops: the operator's definitions (docs/operator.md steps 1, defensivekv's rows) over the rounded inputs.
Scores reference(Problem const& p)
{
    Scores s(p);
    int const n = p.shape.n, d = p.shape.headDim, w = p.w, m = p.m, H = p.shape.heads;
    int const group = H / p.shape.kvHeads;
    double const scale = std::sqrt(static_cast<double>(d));
    for (int b = 0; b < p.shape.batch; ++b)
    {
        if (!compressed(p, b))
        {
            continue;
        }
        int const validStart = n - p.lengths[b];
        for (int h = 0; h < H; ++h)
        {
            float const* keys = &p.k[((static_cast<size_t>(b) * p.shape.kvHeads + h / group) * n) * d];
            std::vector<double> rows(static_cast<size_t>(w) * m, 0.0);
            for (int j = 0; j < w; ++j)
            {
                float const* q = &p.q[((static_cast<size_t>(b) * H + h) * w + j) * d];
                int const last = n - w + j;
                std::vector<double> logits(n);
                double top = -INFINITY;
                for (int i = validStart; i <= last; ++i)
                {
                    double dot = 0.0;
                    for (int e = 0; e < d; ++e)
                    {
                        dot += static_cast<double>(q[e]) * keys[static_cast<size_t>(i) * d + e];
                    }
                    logits[i] = dot / scale;
                    top = std::max(top, logits[i]);
                }
                double sum = 0.0;
                for (int i = validStart; i <= last; ++i)
                {
                    sum += std::exp(logits[i] - top);
                }
                for (int i = validStart; i < m; ++i)
                {
                    rows[static_cast<size_t>(j) * m + i] = std::exp(logits[i] - top) / sum;
                }
            }
            size_t const at = (static_cast<size_t>(b) * H + h) * m;
            std::vector<double> best(m, -INFINITY);
            for (int j = 0; j < w; ++j)
            {
                double const* row = &rows[static_cast<size_t>(j) * m];
                std::vector<double> pooled(m, 0.0);
                double mass = 0.0, total = 0.0;
                for (int i = 0; i < m; ++i)
                {
                    mass += row[i];
                    if (i >= validStart)
                    {
                        PooledRows::PoolSpan const span = PooledRows::poolSpan(p.config.poolKernel, m, i);
                        for (int t = span.lo; t <= span.hi; ++t)
                        {
                            pooled[i] += row[t];
                        }
                        pooled[i] /= p.config.poolKernel;
                    }
                    total += pooled[i];
                }
                s.mass[(static_cast<size_t>(b) * H + h) * w + j] = mass;
                s.total[(static_cast<size_t>(b) * H + h) * w + j] = total;
                for (int i = 0; i < m; ++i)
                {
                    best[i] = std::max(best[i], total > 0.0 ? pooled[i] / total * mass : pooled[i]);
                }
            }
            for (int i = 0; i < m; ++i)
            {
                double raw = 0.0, squares = 0.0;
                for (int j = 0; j < w; ++j)
                {
                    double const x = rows[static_cast<size_t>(j) * m + i];
                    raw += x;
                    squares += x * x;
                }
                s.raw[at + i] = raw / w;
                s.squares[at + i] = squares;
                s.worst[at + i] = best[i];
            }
        }
    }
    return s;
}

//! The host driver's pooledRows (select_host.cpp) from rows [w, m]: worst [m], the rows' mass and pooled total.
void hostPooledRows(int pool, float const* rows, int w, int m, int validStart, float* worst, float* mass, float* total)
{
    std::fill(worst, worst + m, -INFINITY);
    std::vector<float> pooled(static_cast<size_t>(m));
    for (int j = 0; j < w; ++j)
    {
        float const* row = rows + static_cast<size_t>(j) * m;
        double rowMass = 0.0, rowTotal = 0.0;
        for (int i = 0; i < m; ++i)
        {
            pooled[i] = PooledRows::averagePooledAt(row, pool, m, validStart, i);
            rowMass += row[i];
            rowTotal += pooled[i];
        }
        mass[j] = static_cast<float>(rowMass);
        total[j] = static_cast<float>(rowTotal);
        for (int i = 0; i < m; ++i)
        {
            worst[i] = std::max(worst[i], PooledRows::rescaledPooled(pooled[i], mass[j], total[j]));
        }
    }
}

//! The host driver (select_host.cpp: windowScores, and its pooledRows form).
Scores hostDriver(Problem const& p, bool rowsOn)
{
    Scores s(p);
    int const n = p.shape.n, w = p.w, m = p.m, H = p.shape.heads;
    host::HostInputs in{p.q.data(), p.k.data(), nullptr, nullptr, p.lengths.data(), nullptr};
    std::vector<float> raw(m), squares(m), rows(static_cast<size_t>(w) * m), worst(m), mass(w), total(w);
    for (int b = 0; b < p.shape.batch; ++b)
    {
        if (!compressed(p, b))
        {
            continue;
        }
        int const validStart = n - p.lengths[b];
        for (int h = 0; h < H; ++h)
        {
            host::windowScores(p.config, p.shape, in, b, h, validStart, raw.data(), squares.data(), rows.data());
            size_t const at = (static_cast<size_t>(b) * H + h) * m;
            std::copy(raw.begin(), raw.end(), s.raw.begin() + at);
            std::copy(squares.begin(), squares.end(), s.squares.begin() + at);
            if (rowsOn)
            {
                hostPooledRows(p.config.poolKernel, rows.data(), w, m, validStart, worst.data(), mass.data(),
                    total.data());
                std::copy(worst.begin(), worst.end(), s.worst.begin() + at);
                std::copy(mass.begin(), mass.end(), s.mass.begin() + (static_cast<size_t>(b) * H + h) * w);
                std::copy(total.begin(), total.end(), s.total.begin() + (static_cast<size_t>(b) * H + h) * w);
            }
        }
    }
    return s;
}

//! Run one emulated block after filling its shared memory with garbage (a read of what no copy wrote shows).
template <typename Body>
void runBlock(std::vector<unsigned char>& shared, unsigned x, unsigned y, unsigned z, unsigned threads, Body body)
{
    std::fill(shared.begin(), shared.end(), static_cast<unsigned char>(0x7F));
    runEmulatedBlock(x, y, z, threads, body);
}

template <typename T, typename Cfg>
void runTensorPath(WindowTileArgs a, int tilesPerBlock)
{
    planWindowTiles<Cfg>(a, tilesPerBlock);
    std::printf("tensor path: %d heads per row chunk, %d row chunks, pass 1 %d blocks of %d steps, pass 3 %d blocks of "
                "%d steps, halo %d\n",
        a.headsPerChunk, a.rowChunks, a.statsBlocks, a.statsTilesPerBlock, a.columnBlocks, a.columnTilesPerBlock,
        a.halo);
    std::vector<unsigned char> shared(Cfg::sharedBytes(a.shape.headDim));
    unsigned const kvHeads = static_cast<unsigned>(a.shape.kvHeads), batch = static_cast<unsigned>(a.shape.batch);
    for (unsigned z = 0; z < batch; ++z)
        for (unsigned y = 0; y < kvHeads; ++y)
            for (unsigned x = 0; x < static_cast<unsigned>(a.statsBlocks * a.rowChunks); ++x)
                runBlock(shared, x, y, z, Cfg::kThreads, [&] { windowStatsBlock<T, Cfg>(a, shared.data()); });
    for (unsigned y = 0; y < batch; ++y)
        for (unsigned x = 0; x < static_cast<unsigned>(a.shape.heads); ++x)
            runEmulatedBlock(x, y, 0, 128, [&] { windowCombineBlock(a, 128); });
    for (unsigned z = 0; z < batch; ++z)
        for (unsigned y = 0; y < kvHeads; ++y)
            for (unsigned x = 0; x < static_cast<unsigned>(a.columnBlocks * a.rowChunks); ++x)
                runBlock(shared, x, y, z, Cfg::kThreads, [&] { windowColumnsBlock<T, Cfg>(a, shared.data()); });
}

void runSimtPath(Problem const& p, void const* q, void const* k, float* partials, float* rowStats, float* raw,
    float* squares, float* rowMass, float* worst)
{
    WindowArgs a{};
    a.config = p.config;
    a.shape = p.shape;
    a.queries = q;
    a.keys = k;
    a.promptLengths = p.lengths.data();
    a.budget = RuntimeBudget{nullptr, nullptr};
    a.partials = reinterpret_cast<float2*>(partials);
    a.rowStats = reinterpret_cast<float2*>(rowStats);
    a.raw = raw;
    a.squares = squares;
    a.tiles = (p.shape.n + kKeyTile - 1) / kKeyTile;
    a.scale = std::sqrt(static_cast<float>(p.shape.headDim));
    std::vector<unsigned char> shared(std::max(windowSharedBytes(p.shape.headDim), pooledRowSharedBytes(p.shape.headDim)));
    float* floats = reinterpret_cast<float*>(shared.data());
    unsigned const H = static_cast<unsigned>(p.shape.heads), B = static_cast<unsigned>(p.shape.batch);
    unsigned const olderTiles = static_cast<unsigned>((p.m + kKeyTile - 1) / kKeyTile);
    for (unsigned z = 0; z < B; ++z)
        for (unsigned y = 0; y < H; ++y)
            for (unsigned x = 0; x < static_cast<unsigned>(a.tiles); ++x)
                runBlock(shared, x, y, z, kWindowThreads, [&] { windowAttentionBlock<float, false>(a, floats); });
    for (unsigned y = 0; y < B; ++y)
        for (unsigned x = 0; x < H; ++x)
            runEmulatedBlock(x, y, 0, kStatsThreads, [&] { softmaxStatsBlock(a); });
    for (unsigned z = 0; z < B; ++z)
        for (unsigned y = 0; y < H; ++y)
            for (unsigned x = 0; x < olderTiles; ++x)
                runBlock(shared, x, y, z, kWindowThreads, [&] { windowAttentionBlock<float, true>(a, floats); });
    if (worst == nullptr)
    {
        return;
    }
    PooledRowArgs r{};
    r.config = p.config;
    r.shape = p.shape;
    r.queries = q;
    r.keys = k;
    r.promptLengths = p.lengths.data();
    r.budget = RuntimeBudget{nullptr, nullptr};
    r.rowStats = reinterpret_cast<float2 const*>(rowStats);
    r.partials = reinterpret_cast<float2*>(partials);
    r.rowSums = reinterpret_cast<float2*>(rowMass);
    r.pooledMax = worst;
    r.olderTiles = static_cast<int32_t>(olderTiles);
    r.scale = a.scale;
    for (unsigned z = 0; z < B; ++z)
        for (unsigned y = 0; y < H; ++y)
            for (unsigned x = 0; x < olderTiles; ++x)
                runBlock(shared, x, y, z, kRowThreads, [&] { pooledRowsBlock<float, false>(r, floats); });
    for (unsigned y = 0; y < B; ++y)
        for (unsigned x = 0; x < H; ++x)
            runEmulatedBlock(x, y, 0, kStatsThreads, [&] { rowSumsBlock(r); });
    for (unsigned z = 0; z < B; ++z)
        for (unsigned y = 0; y < H; ++y)
            for (unsigned x = 0; x < olderTiles; ++x)
                runBlock(shared, x, y, z, kRowThreads, [&] { pooledRowsBlock<float, true>(r, floats); });
}

//! The kernels' outputs for the problem (NaN where nothing was written).
template <typename T>
Scores kernelScores(Problem& p, bool rowsOn, int tilesPerBlock)
{
    std::vector<T> const q = toType<T>(p.q); // p.q, p.k now hold the rounded values every other implementation uses
    std::vector<T> const k = toType<T>(p.k);
    size_t const older = static_cast<size_t>(p.shape.batch) * p.shape.heads * p.m;
    size_t const rows = static_cast<size_t>(p.shape.batch) * p.shape.heads * p.w;
    size_t const tiles = (static_cast<size_t>(p.shape.n) + kKeyTile - 1) / kKeyTile;
    std::vector<float> partials(rows * tiles * 4, NAN), rowStats(2 * rows, NAN), raw(older, NAN), squares(older, NAN),
        worst(older, NAN), rowMass(2 * rows, NAN);
    float* worstOut = rowsOn ? worst.data() : nullptr;
    if constexpr (sizeof(T) == 2)
    {
        WindowTileArgs a{};
        a.config = p.config;
        a.shape = p.shape;
        a.budget = RuntimeBudget{nullptr, nullptr};
        a.promptLengths = p.lengths.data();
        a.queries = q.data();
        a.keys = k.data();
        a.partials = partials.data();
        a.rowStats = rowStats.data();
        a.rowSums = rowsOn ? rowMass.data() : nullptr;
        a.raw = raw.data();
        a.squares = squares.data();
        a.pooledMax = worstOut;
        a.scale = std::sqrt(static_cast<float>(p.shape.headDim));
        if (p.shape.headDim <= 16 * WindowTiles64::kMaxSteps)
        {
            runTensorPath<T, WindowTiles64>(a, tilesPerBlock);
        }
        else
        {
            runTensorPath<T, WindowTiles128>(a, tilesPerBlock);
        }
    }
    else
    {
        runSimtPath(p, q.data(), k.data(), partials.data(), rowStats.data(), raw.data(), squares.data(),
            rowMass.data(), worstOut);
    }
    Scores s(p);
    std::copy(raw.begin(), raw.end(), s.raw.begin());
    std::copy(squares.begin(), squares.end(), s.squares.begin());
    if (rowsOn)
    {
        std::copy(worst.begin(), worst.end(), s.worst.begin());
        for (size_t r = 0; r < rows; ++r)
        {
            s.mass[r] = rowMass[2 * r];
            s.total[r] = rowMass[2 * r + 1];
        }
    }
    return s;
}

//! Largest relative error of `got` against `want` over the compressed sequences, and checks: finite there, untouched
//! (NaN) elsewhere, exact 0 on left padding for the per-token quantities; `limit` < 0: no bound (the host's column).
double compare(Problem const& p, std::vector<double> const& got, std::vector<double> const& want, int perHead,
    bool perToken, char const* what, double limit)
{
    double worstError = 0.0;
    int const H = p.shape.heads;
    for (int b = 0; b < p.shape.batch; ++b)
    {
        bool const on = compressed(p, b);
        int const validStart = p.shape.n - p.lengths[b];
        for (int h = 0; h < H; ++h)
        {
            for (int i = 0; i < perHead; ++i)
            {
                size_t const at = (static_cast<size_t>(b) * H + h) * perHead + i;
                if (!on)
                {
                    check(std::isnan(got[at]), what, b, h, i, got[at], NAN); // an uncompressed sequence is skipped
                    continue;
                }
                if (perToken && i < validStart)
                {
                    check(got[at] == 0.0, what, b, h, i, got[at], 0.0); // left padding: exactly no attention
                    continue;
                }
                double const error = std::fabs(got[at] - want[at]) / std::max(std::fabs(want[at]), 1e-300);
                worstError = std::max(worstError, std::isfinite(got[at]) ? error : INFINITY);
                if (limit >= 0.0)
                {
                    check(error <= limit, what, b, h, i, got[at], want[at]);
                }
            }
        }
    }
    return worstError;
}

template <typename T>
int runWindow(int B, int H, int Hkv, int n, int d, int window, int pool, bool rowsOn, int tilesPerBlock, int seed)
{
    Problem p = makeProblem(B, H, Hkv, n, d, window, pool, rowsOn, seed);
    Scores const got = kernelScores<T>(p, rowsOn, tilesPerBlock);
    Scores const truth = reference(p);
    Scores const host = hostDriver(p, rowsOn);
    // The host driver sums in fp32 in order (error ~ d u of a logit); the tensor cores truncate their fp32 sums
    // (mma_emulation.h), a few times more. Bounds: both within 2e-5 of fp64 relatively, each value (the exp of a logit
    // of a few units turns its absolute error into a relative one).
    double const limit = 2e-5;
    struct Quantity
    {
        char const* name;
        std::vector<double> const Scores::*field;
        bool perToken;
        bool rows;
    };
    Quantity const quantities[] = {{"raw", &Scores::raw, true, false}, {"squares", &Scores::squares, true, false},
        {"worst", &Scores::worst, true, true}, {"mass", &Scores::mass, false, true},
        {"total", &Scores::total, false, true}};
    for (Quantity const& quantity : quantities)
    {
        if (quantity.rows && !rowsOn)
        {
            continue;
        }
        int const perHead = quantity.perToken ? p.m : p.w;
        double const kernel = compare(p, got.*quantity.field, truth.*quantity.field, perHead, quantity.perToken,
            quantity.name, limit);
        double const driver = compare(p, host.*quantity.field, truth.*quantity.field, perHead, quantity.perToken,
            "host driver", limit);
        std::printf("%s: largest relative error vs fp64: kernel %.3g, host driver %.3g\n", quantity.name, kernel, driver);
    }
    std::printf("%d failures\n", gFailures);
    return gFailures == 0 ? 0 : 1;
}

//! The SIMT row passes alone, fed the softmax statistics of the rows they are compared with (fused multiply-add dots,
//! as the kernels compute them): what tests/plugins/test_plugin_kernel_emulation.py checked on the copied section.
int runRows(int pool, int B, int H, int Hkv, int n, int d, int w, int seed)
{
    int const m = n - w;
    int const tiles = (m + kKeyTile - 1) / kKeyTile;
    std::mt19937 rng(static_cast<unsigned>(seed));
    std::normal_distribution<float> normal(0.0F, 1.0F);
    std::vector<float> q(size_t(B) * H * w * d), k(size_t(B) * Hkv * n * d);
    for (auto& x : q)
        x = 2.0F * normal(rng);
    for (auto& x : k)
        x = normal(rng);
    std::vector<int32_t> lengths(B);
    for (int b = 0; b < B; ++b)
        lengths[b] = b == 0 ? n : std::max(w + 1, n - 37 * b); // the first whole, the others left-padded
    SelectConfig c{};
    c.base = BaseMethod::kDefensiveKV;
    c.window = w;
    c.budget = w; // every sequence (length > window) is compressed
    c.minBudget = w;
    c.poolKernel = pool;
    c.capacity = n;
    SelectShape const s{B, H, Hkv, n, w, d, 8};
    float const scale = std::sqrt(static_cast<float>(d));

    // Softmax statistics (launchWindowScores's) and every row over the older tokens (the host driver's).
    std::vector<float2> stats(size_t(B) * H * w);
    std::vector<float> rows(size_t(B) * H * w * m, 0.0F);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h)
        {
            int const g = h / (H / Hkv), validStart = n - lengths[b];
            for (int j = 0; j < w; ++j)
            {
                int const last = n - w + j;
                std::vector<float> logits(n);
                float rowMax = -INFINITY;
                for (int i = validStart; i <= last; ++i)
                {
                    float dot = 0.0F;
                    for (int e = 0; e < d; ++e)
                        dot = std::fma(q[((size_t(b) * H + h) * w + j) * d + e], k[((size_t(b) * Hkv + g) * n + i) * d + e], dot);
                    logits[i] = dot / scale;
                    rowMax = std::max(rowMax, logits[i]);
                }
                float sum = 0.0F;
                for (int i = validStart; i <= last; ++i)
                    sum += std::exp(logits[i] - rowMax);
                stats[(size_t(b) * H + h) * w + j] = {rowMax, sum};
                for (int i = validStart; i < m; ++i)
                    rows[((size_t(b) * H + h) * w + j) * m + i] = std::exp(logits[i] - rowMax) / sum;
            }
        }

    PooledRowArgs a{};
    a.config = c;
    a.shape = s;
    a.queries = q.data();
    a.keys = k.data();
    a.promptLengths = lengths.data();
    a.budget = RuntimeBudget{nullptr, nullptr};
    a.rowStats = stats.data();
    std::vector<float2> partials(size_t(B) * H * w * tiles), rowMass(size_t(B) * H * w);
    std::vector<float> worst(size_t(B) * H * m, NAN);
    a.partials = partials.data();
    a.rowSums = rowMass.data();
    a.pooledMax = worst.data();
    a.olderTiles = tiles;
    a.scale = scale;
    std::vector<unsigned char> shared(pooledRowSharedBytes(d));
    float* floats = reinterpret_cast<float*>(shared.data());
    for (unsigned z = 0; z < unsigned(B); ++z)
        for (unsigned y = 0; y < unsigned(H); ++y)
            for (unsigned x = 0; x < unsigned(tiles); ++x)
                runBlock(shared, x, y, z, kRowThreads, [&] { pooledRowsBlock<float, false>(a, floats); });
    for (unsigned y = 0; y < unsigned(B); ++y)
        for (unsigned x = 0; x < unsigned(H); ++x)
            runEmulatedBlock(x, y, 0, kStatsThreads, [&] { rowSumsBlock(a); });
    for (unsigned z = 0; z < unsigned(B); ++z)
        for (unsigned y = 0; y < unsigned(H); ++y)
            for (unsigned x = 0; x < unsigned(tiles); ++x)
                runBlock(shared, x, y, z, kRowThreads, [&] { pooledRowsBlock<float, true>(a, floats); });

    // The host driver's form: whole rows, sums in double (select_host.cpp: pooledRows).
    double worstError = 0.0, massError = 0.0;
    int equal = 0;
    std::vector<float> want(m), mass(w), total(w);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h)
        {
            int const validStart = n - lengths[b];
            hostPooledRows(pool, &rows[(size_t(b) * H + h) * w * m], w, m, validStart, want.data(), mass.data(),
                total.data());
            for (int j = 0; j < w; ++j)
            {
                float2 const got = rowMass[(size_t(b) * H + h) * w + j];
                massError = std::max({massError, std::fabs(got.x - double(mass[j])) / mass[j],
                    std::fabs(got.y - double(total[j])) / total[j]});
            }
            for (int i = 0; i < m; ++i)
            {
                float const got = worst[(size_t(b) * H + h) * m + i];
                equal += got == want[i];
                double const scaleOf = std::max(double(want[i]), 1e-30);
                worstError = std::max(worstError, std::isnan(got) ? INFINITY : std::fabs(got - want[i]) / scaleOf);
            }
        }
    std::printf("pool %d: worst bitwise equal %d / %d, max relative error worst %.3g, row mass/total %.3g\n", pool,
        equal, B * H * m, worstError, massError);
    // The kernels sum the rows' mass and pooled total per 64-token tile: fp32 rounding apart, nothing else differs.
    return worstError < 2e-6 && massError < 2e-6 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv)
{
    std::string const mode = argc > 1 ? argv[1] : "";
    if (mode == "window" && argc == 13)
    {
        std::string const dtype = argv[2];
        int v[10];
        for (int i = 0; i < 10; ++i)
        {
            v[i] = std::atoi(argv[3 + i]);
        }
        auto run = [&](auto tag) {
            return runWindow<decltype(tag)>(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7] != 0, v[8], v[9]);
        };
        if (dtype == "bf16")
        {
            return run(__nv_bfloat16{});
        }
        if (dtype == "fp16")
        {
            return run(__half{});
        }
        if (dtype == "fp32")
        {
            return run(float{});
        }
    }
    if (mode == "rows" && argc == 10)
    {
        int v[8];
        for (int i = 0; i < 8; ++i)
        {
            v[i] = std::atoi(argv[2 + i]);
        }
        return runRows(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
    }
    std::fprintf(stderr,
        "usage: %s window DTYPE B H H_KV N D W POOL ROWS TILES_PER_BLOCK SEED | rows POOL B H H_KV N D W SEED\n",
        argv[0]);
    return 2;
}
