// CPU emulation of defensivekv's row kernels (kernels/window_scores.cu, the section between "BEGIN defensive rows"
// and "END defensive rows", which the test copies to defensive_rows_section.inc): one std::thread per CUDA thread,
// __syncthreads() a std::barrier, blocks one after the other. Compares the kernels' output with the host driver's
// whole-row form of the same defensive.h functions. Not built by CMake: tests/plugins/test_plugin_kernel_emulation.py
// compiles it with g++ -std=c++20.
//   defensive_rows_emulation POOL_KERNEL BATCH HEADS KV_HEADS N HEAD_DIM WINDOW SEED   -> exit 0 when they agree
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

struct float2
{
    float x, y;
};
inline float2 make_float2(float a, float b)
{
    return {a, b};
}
#include "cuda_emulation.h"

#include "criticalkv/defensive.h"

namespace criticalkv::kernels
{
constexpr int kQueryChunk = 16; // window_scores.cu's
constexpr int kStatsThreads = 256;
template <typename T>
float toFloat(T value)
{
    return static_cast<float>(value);
}
float sharedStore[1 << 20]; // the block's dynamic shared memory (blocks run one at a time)
#define shared sharedStore
#include "defensive_rows_section.inc"
#undef shared

template <typename Fn>
void launch(unsigned gx, unsigned gy, unsigned gz, unsigned threads, Fn fn)
{
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x)
            {
                std::barrier<> barrier(threads);
                gBarrier = &barrier;
                std::vector<std::thread> pool;
                for (unsigned t = 0; t < threads; ++t)
                {
                    pool.emplace_back([&, t] {
                        threadIdx = {t, 0, 0};
                        blockIdx = {x, y, z};
                        fn();
                    });
                }
                for (auto& thread : pool)
                    thread.join();
            }
}
} // namespace criticalkv::kernels

using namespace criticalkv;

int main(int argc, char** argv)
{
    if (argc != 9)
    {
        std::fprintf(stderr, "usage: %s POOL_KERNEL BATCH HEADS KV_HEADS N HEAD_DIM WINDOW SEED\n", argv[0]);
        return 2;
    }
    int const pool = std::atoi(argv[1]), B = std::atoi(argv[2]), H = std::atoi(argv[3]), Hkv = std::atoi(argv[4]);
    int const n = std::atoi(argv[5]), d = std::atoi(argv[6]), w = std::atoi(argv[7]), seed = std::atoi(argv[8]);
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

    kernels::DefensiveRowArgs a{};
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
    a.rowMass = rowMass.data();
    a.worst = worst.data();
    a.olderTiles = tiles;
    a.scale = scale;
    kernels::launch(tiles, H, B, kernels::kRowThreads, [&] { kernels::defensiveRowsKernel<float, false>(a); });
    kernels::launch(H, B, 1, kernels::kStatsThreads, [&] { kernels::defensiveRowMassKernel(a); });
    kernels::launch(tiles, H, B, kernels::kRowThreads, [&] { kernels::defensiveRowsKernel<float, true>(a); });

    // The host driver's form: whole rows, sums in double (select_host.cpp: defensiveRows).
    double worstError = 0.0, massError = 0.0;
    int equal = 0;
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h)
        {
            int const validStart = n - lengths[b];
            std::vector<float> want(m, -INFINITY), pooled(m);
            for (int j = 0; j < w; ++j)
            {
                float const* row = &rows[((size_t(b) * H + h) * w + j) * m];
                double mass = 0.0, total = 0.0;
                for (int i = 0; i < m; ++i)
                {
                    pooled[i] = averagePooledAt(row, pool, m, validStart, i);
                    mass += row[i];
                    total += pooled[i];
                }
                float2 const got = rowMass[(size_t(b) * H + h) * w + j];
                massError = std::max({massError, std::fabs(got.x - mass) / mass, std::fabs(got.y - total) / total});
                for (int i = 0; i < m; ++i)
                    want[i] = std::max(want[i], rescaledPooled(pooled[i], float(mass), float(total)));
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
