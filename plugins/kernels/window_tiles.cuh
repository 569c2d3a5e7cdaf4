// Tensor-core tiles of the window scores and of the pooled rows (mma.sync m16n8k16, ldmatrix, cp.async; lane layouts
// in criticalkv/mma_layout.h, fragment loads shared with mma_tiles.cuh). Included by kernels/window_scores.cu (device)
// and by the CPU emulation (testing/window_scores_emulation.cpp, which supplies the warp instructions and one
// fiber per CUDA thread).
//
// The w window queries of the G query heads of one KV head against its n keys is a GEMM, Q_g [G w, d_h] x K_g^T
// [d_h, n]: one K tile feeds G w query rows (128 for Llama-3's G = 4, w = 32). Ā needs every row's global softmax
// statistics (max, sum over all n keys) before any probability can be summed over the rows, so the scores are
// computed twice, and K is read twice; nothing of size [w, n] is ever stored:
//   1. windowStatsBlock: per key block (tilesPerBlock steps of 64 keys) and query row, the online softmax partial
//      (max, sum exp over the visible keys, the same sum over the older keys, and the pooled rows' pool-edge sum);
//   2. windowCombineBlock: the partials of a row into its (max, sum) and the pooled rows' (mass, total);
//   3. windowColumnsBlock: the scores again, p = exp(s - max) / sum into a shared fp32 tile [rows][64 keys], then per
//      (head, key) Ā = sum_j p / w, sum_j p^2 (windowSquares) and the pooled rows' pooledMax = max_j rescaled
//      pooled p (row_scores.h).
// The logits are s = (q . k) x (1 / sqrt(d_h)) and p takes a product by 1 / sum: within an ulp of the reference's
// divisions, far inside the flash-attention rule these 16-bit inputs are held to (fp32 inputs run the SIMT kernels).
// Bytes: storing the fp32 scores instead of recomputing them writes and reads G w 4 = 512 bytes per key and KV head,
// twice what K itself takes (d_h 2 = 256): a second read of K (256 bytes per key) is the cheapest way to the global
// statistics. Partials are 16 bytes per row and key block (1 MiB at 32k for Llama-3-8B's layer).
// The pooled rows' mass and pooled total are linear in the row, so they come from the same pass-1 sums: mass =
// sum over older keys / sum, total = sum_i pool(row)_i = (k mass - sum_t p_t deficit(t)) / k with deficit(t) > 0 only
// within k/2 of the older range's ends (poolDeficit): the rows' rescaling is known before pass 3, which computes pooledMax
// in the same sweep as Ā (two reads of K for the pooled rows instead of four). Each pass-3 step computes keys
// [out - k/2, out + 64 - k/2) and writes 64 - 2 (k/2) outputs, so a token's pool span lies in the step's tile.
//
// CTA: 4 warps, 128 query rows (headsPerChunk whole heads; more heads go to further row chunks), 64 keys per step
// through a 3-deep cp.async ring; each warp owns 32 rows (2 m16 tiles) x 64 keys (8 n8 tiles), its Q fragments held in
// registers for the whole CTA (2 x d_h / 16 x 4 registers), fp32 accumulators (64 registers).
// * shared memory (d_h = 128): K ring 3 x 64 x 136 x 2 = 51 KiB, Q tile 128 x 136 x 2 = 34 KiB reused by the
//   probability tile 128 x 72 x 4 = 36 KiB, row statistics 2 KiB: 89 KiB, two CTAs per H100 SM;
// * per step and warp: 8 k16 steps x (4 ldmatrix.x4 of K, 16 mma): 128 B of shared memory per mma (~80 B/clock per SM
//   at 0.6 mma/clock, under the 128 B/clock it delivers);
// * pass 1's epilogue: one exp per score; a step whose keys are all older, visible and clear of the pool's edges
//   (every step but the few at the ends of a sequence) tests no key;
// * pass 3's epilogue: the thread's 64 accumulators to the probability tile (float2 stores, rows 72 floats apart: no
//   bank conflict), then w reads per (head, key) output (w k more for the pooled maximum).
#pragma once

#include "criticalkv/row_scores.h"
#include "criticalkv/mma_layout.h"
#include "criticalkv/select_params.h"
#include "mma_tiles.cuh"

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace criticalkv::kernels
{

template <int kMaxSteps_>
struct WindowTiles
{
    static constexpr int32_t kWarps = 4;
    static constexpr int32_t kThreads = 32 * kWarps;
    static constexpr int32_t kMTiles = 2;                            //!< m16 tiles per warp: 32 query rows
    static constexpr int32_t kNTiles = 8;                            //!< n8 tiles per step: 64 keys
    static constexpr int32_t kWarpRows = kMTiles * mma::kTileM;
    static constexpr int32_t kRows = kWarps * kWarpRows;             //!< query rows per CTA
    static constexpr int32_t kKeys = kNTiles * mma::kTileN;          //!< keys per step
    static constexpr int32_t kStages = 3;
    static constexpr int32_t kMaxSteps = kMaxSteps_;                 //!< k16 steps: d_h <= 16 kMaxSteps
    static constexpr int32_t kProbStride = kKeys + 8;                //!< floats per probability row
    static constexpr int32_t kRowFloats = 4;                         //!< max, sum, mass, total per query row

    static_assert(kStages >= 2, "the ring needs a tile in flight while one is read");

    //! Dynamic shared memory of a CTA for head dimension `headDim` (16-bit Q and K).
    static size_t sharedBytes(int32_t headDim)
    {
        size_t const stride = static_cast<size_t>(mma::paddedStride(headDim));
        size_t const ring = static_cast<size_t>(kStages) * kKeys * stride * 2;
        size_t const queries = static_cast<size_t>(kRows) * stride * 2;
        size_t const probabilities = static_cast<size_t>(kRows) * kProbStride * sizeof(float);
        return ring + (queries > probabilities ? queries : probabilities)
            + static_cast<size_t>(kRows) * kRowFloats * sizeof(float);
    }
};

using WindowTiles64 = WindowTiles<4>;  //!< d_h <= 64
using WindowTiles128 = WindowTiles<8>; //!< d_h <= 128

//! Largest k / 2 of the pooled rows' pool on the tensor-core path: a step then still writes 64 - 48 = 16 outputs.
constexpr int32_t kMaxWindowHalo = 24;

//! Arguments of the three bodies.
struct WindowTileArgs
{
    SelectConfig config;
    SelectShape shape;
    RuntimeBudget budget;
    int32_t const* promptLengths;
    void const* queries;          //!< [B, H, queryLen, d_h]: the last w rows of every head are the window
    void const* keys;             //!< [B, H_kv, n, d_h]
    float* partials;              //!< [B, H, w, statsBlocks, 4]: max, sum exp over visible keys, over older keys, edges
    float* rowStats;              //!< [B, H, w, 2]: softmax (max, sum) of every window query
    float* rowSums;               //!< [B, H, w, 2]: (mass, pooled total) over the older tokens (row-scored), or nullptr
    float* raw;                   //!< [B, H, m]: Ā
    float* squares;               //!< [B, H, m]: sum_j A_j^2, or nullptr
    float* pooledMax;             //!< [B, H, m]: max_j of the rescaled pooled rows (row-scored), or nullptr
    float scale;                  //!< sqrt(d_h) in fp32: logits = (q . k) / scale, as the reference divides
    int32_t headsPerChunk;        //!< query heads per CTA: headsPerChunk w <= kRows
    int32_t rowChunks;            //!< ceil(G / headsPerChunk)
    int32_t statsBlocks;          //!< key blocks of pass 1 (the partials' row length)
    int32_t statsTilesPerBlock;   //!< 64-key steps per pass-1 CTA
    int32_t columnBlocks;         //!< key blocks of pass 3
    int32_t columnTilesPerBlock;  //!< steps per pass-3 CTA
    int32_t halo;                 //!< keys computed on either side of a pass-3 step's outputs: k / 2 with pooledMax, else 0
};

//! CTAs a pass aims for: the 64-key steps per CTA grow (up to kMaxWindowTilesPerBlock) once the grid would exceed it,
//! so that the Q tile a CTA loads serves more keys. A function of the shape only: results do not depend on the GPU.
constexpr int64_t kTargetWindowBlocks = 512;
constexpr int32_t kMaxWindowTilesPerBlock = 8;

inline int32_t windowTilesPerBlock(int64_t tiles, int64_t blocksPerTile)
{
    int64_t const per = tiles * blocksPerTile / kTargetWindowBlocks;
    return static_cast<int32_t>(per < 1 ? 1 : (per > kMaxWindowTilesPerBlock ? kMaxWindowTilesPerBlock : per));
}

//! The plan of the three launches for `a` (config, shape and pooledMax set): query heads per row chunk, row chunks, the
//! pool halo, the key blocks of passes 1 and 3 (grids (blocks * rowChunks, H_kv, B)). tilesPerBlock > 0 forces the
//! steps per CTA (the emulation's multi-step cases), else windowTilesPerBlock. Requires w <= Cfg::kRows.
template <typename Cfg>
inline void planWindowTiles(WindowTileArgs& a, int32_t tilesPerBlock)
{
    int32_t const n = a.shape.n;
    int32_t const w = windowLength(a.config, n);
    int32_t const m = n - w;
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    int32_t const fit = Cfg::kRows / w;
    a.headsPerChunk = fit < group ? fit : group;
    a.rowChunks = (group + a.headsPerChunk - 1) / a.headsPerChunk;
    a.halo = a.pooledMax != nullptr ? a.config.poolKernel / 2 : 0;
    int64_t const perTile = static_cast<int64_t>(a.rowChunks) * a.shape.kvHeads * a.shape.batch;
    int32_t const statsTiles = (n + Cfg::kKeys - 1) / Cfg::kKeys;
    a.statsTilesPerBlock = tilesPerBlock > 0 ? tilesPerBlock : windowTilesPerBlock(statsTiles, perTile);
    a.statsBlocks = (statsTiles + a.statsTilesPerBlock - 1) / a.statsTilesPerBlock;
    int32_t const width = Cfg::kKeys - 2 * a.halo;
    int32_t const columnTiles = m > 0 ? (m + width - 1) / width : 0;
    a.columnTilesPerBlock = tilesPerBlock > 0 ? tilesPerBlock : windowTilesPerBlock(columnTiles, perTile);
    a.columnBlocks = (columnTiles + a.columnTilesPerBlock - 1) / a.columnTilesPerBlock;
}

//! How many of the (2 (k/2) + 1)-wide pool spans of the older tokens in [validStart, m) that would hold older token t
//! are missing at the ends of that range: sum_{i >= validStart} pool_i = (k mass - sum_t p_t poolDeficit(t)) / k, where
//! pool_i = sum over the span of i of p / k (PooledRows::poolSpan, PooledRows::averagePool). validStart <= t < m.
CKV_HD int32_t poolDeficit(int32_t kernel, int32_t m, int32_t validStart, int32_t t)
{
    int32_t const half = kernel / 2;
    int32_t const hi = t + half < m - 1 ? t + half : m - 1;
    int32_t const lo = t - half > validStart ? t - half : validStart;
    return 2 * half + 1 - (hi - lo + 1);
}

//! Two floats to consecutive shared-memory words `at` (8-byte aligned): one 64-bit store on the device, whose half-warp
//! phases then hit 32 distinct banks for the probability tile's rows 72 floats apart.
__device__ __forceinline__ void storeFloatPair(float* at, float x, float y)
{
#if defined(__CUDACC__)
    *reinterpret_cast<float2*>(at) = make_float2(x, y);
#else
    at[0] = x;
    at[1] = y;
#endif
}

//! The factor f of a window query's row with PooledRows::rescaledPooled(PooledRows::averagePool(s, k), mass, total)
//! = s f up to a few ulp (row_scores.h: the pooled value s / k rescaled to the row's mass):
//! mass / (k max(total, tiny)), or 1 / k for a row without pooled mass. One product per (row, token) instead of two
//! divisions.
CKV_HD float pooledRowFactor(float mass, float total, int32_t kernel)
{
    float const k = static_cast<float>(kernel);
    if (!(total > 0.0F))
    {
        return 1.0F / k;
    }
    return mass / (k * (total > kTinyFloat ? total : kTinyFloat));
}

//! Merge an online-softmax partial (max, three sums relative to it) into another.
CKV_HD void mergeSoftmaxPartial(float& top, float& all, float& older, float& edges, float otherTop, float otherAll,
    float otherOlder, float otherEdges)
{
    float const merged = top > otherTop ? top : otherTop;
    if (merged == -INFINITY)
    {
        return; // both empty
    }
    float const mine = expf(top - merged);
    float const theirs = expf(otherTop - merged);
    all = all * mine + otherAll * theirs;
    older = older * mine + otherOlder * theirs;
    edges = edges * mine + otherEdges * theirs;
    top = merged;
}

//! One CTA's place: KV head g, sequence b, the row chunk (query heads [firstHead, firstHead + heads)) and key block.
struct WindowCta
{
    int32_t b;
    int32_t g;
    int32_t block;
    int32_t n;
    int32_t d;
    int32_t w;
    int32_t m;
    int32_t firstHead;
    int32_t heads;
    int32_t rows; //!< heads * w valid query rows; the tile's other rows are zero
    int32_t validStart;
    bool compress;
};

//! grid (blocks * rowChunks, H_kv, B); reversed: the last CTA of the grid takes the first place (pass 3 runs its grid
//! backwards, so that it starts on the keys pass 1 read last, which the L2 may still hold).
__device__ __forceinline__ WindowCta windowCta(WindowTileArgs const& a, int32_t blocks, bool reversed)
{
    int32_t x = static_cast<int32_t>(blockIdx.x);
    int32_t y = static_cast<int32_t>(blockIdx.y);
    int32_t z = static_cast<int32_t>(blockIdx.z);
    if (reversed)
    {
        x = blocks * a.rowChunks - 1 - x;
        y = a.shape.kvHeads - 1 - y;
        z = a.shape.batch - 1 - z;
    }
    WindowCta c{};
    c.b = z;
    c.g = y;
    c.block = x / a.rowChunks;
    int32_t const chunk = x - c.block * a.rowChunks;
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, c.b);
    c.compress = info.compress;
    c.validStart = info.validStart;
    c.n = a.shape.n;
    c.d = a.shape.headDim;
    c.w = windowLength(a.config, c.n);
    c.m = c.n - c.w;
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    c.firstHead = c.g * group + chunk * a.headsPerChunk;
    int32_t const left = group - chunk * a.headsPerChunk;
    c.heads = left < a.headsPerChunk ? left : a.headsPerChunk;
    c.rows = c.heads * c.w;
    return c;
}

//! cp.async the CTA's window queries (row r = head r / w, query r % w; rows past c.rows zero) into tile [kRows][stride].
template <typename T, typename Cfg>
__device__ __forceinline__ void loadWindowQueries(WindowTileArgs const& a, WindowCta const& c, T* tile)
{
    int32_t const stride = mma::paddedStride(c.d);
    int32_t const chunks = c.d / 8;
    T const* queries = static_cast<T const*>(a.queries);
    int32_t const queryLen = a.shape.queryLen;
    for (int32_t e = static_cast<int32_t>(threadIdx.x); e < Cfg::kRows * chunks; e += Cfg::kThreads)
    {
        int32_t const row = e / chunks;
        int32_t const chunk = e - row * chunks;
        bool const valid = row < c.rows;
        int64_t at = 0;
        if (valid)
        {
            int32_t const local = row / c.w;
            int32_t const j = row - local * c.w;
            int64_t const head = static_cast<int64_t>(c.b) * a.shape.heads + c.firstHead + local;
            at = (head * queryLen + queryLen - c.w + j) * c.d;
        }
        cpAsync16(tile + row * stride + chunk * 8, queries + at + chunk * 8, valid);
    }
}

//! cp.async keys [key0, key0 + kKeys) of the CTA's KV head into a ring slot (keys outside [0, n) zero).
template <typename T, typename Cfg>
__device__ __forceinline__ void loadWindowKeys(WindowTileArgs const& a, WindowCta const& c, int32_t key0, T* slot)
{
    int32_t const stride = mma::paddedStride(c.d);
    int32_t const chunks = c.d / 8;
    T const* keys = static_cast<T const*>(a.keys) + (static_cast<int64_t>(c.b) * a.shape.kvHeads + c.g) * c.n * c.d;
    for (int32_t e = static_cast<int32_t>(threadIdx.x); e < Cfg::kKeys * chunks; e += Cfg::kThreads)
    {
        int32_t const row = e / chunks;
        int32_t const chunk = e - row * chunks;
        int32_t const key = key0 + row;
        bool const valid = key >= 0 && key < c.n;
        cpAsync16(slot + row * stride + chunk * 8, keys + static_cast<int64_t>(valid ? key : 0) * c.d + chunk * 8, valid);
    }
}

//! The warp's Q fragments (its 2 m16 tiles, every k16 step) from the query tile into registers.
template <typename T, typename Cfg>
__device__ __forceinline__ void loadQueryFragments(T const* tile, int32_t stride, int32_t steps,
    uint32_t (&qf)[Cfg::kMTiles][Cfg::kMaxSteps][4])
{
    int32_t const warp = static_cast<int32_t>(threadIdx.x) / 32;
#pragma unroll
    for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
    {
#pragma unroll
        for (int32_t s = 0; s < Cfg::kMaxSteps; ++s)
        {
            if (s < steps)
            {
                loadFragmentA(tile, stride, warp * Cfg::kWarpRows + mi * mma::kTileM, s * mma::kTileK, qf[mi][s]);
            }
        }
    }
}

//! acc = the warp's 32 rows x 64 keys of Q K^T (fp32 accumulators) from the key tile [kKeys][stride].
template <typename T, typename Cfg>
__device__ __forceinline__ void windowScoreTile(T const* keyTile, int32_t stride, int32_t steps,
    uint32_t const (&qf)[Cfg::kMTiles][Cfg::kMaxSteps][4], float (&acc)[Cfg::kMTiles][Cfg::kNTiles][4])
{
#pragma unroll
    for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
    {
#pragma unroll
        for (int32_t ni = 0; ni < Cfg::kNTiles; ++ni)
        {
#pragma unroll
            for (int32_t e = 0; e < 4; ++e)
            {
                acc[mi][ni][e] = 0.0F;
            }
        }
    }
#pragma unroll
    for (int32_t s = 0; s < Cfg::kMaxSteps; ++s)
    {
        if (s < steps)
        {
            uint32_t bf[Cfg::kNTiles][2];
            loadFragmentsB<Cfg>(keyTile, stride, 0, s * mma::kTileK, bf);
#pragma unroll
            for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
            {
#pragma unroll
                for (int32_t ni = 0; ni < Cfg::kNTiles; ++ni)
                {
                    mmaSync<T>(acc[mi][ni], qf[mi][s], bf[ni]);
                }
            }
        }
    }
}

//! Pass 1: the online softmax partial of every query row of the CTA over its key block. grid (statsBlocks *
//! rowChunks, H_kv, B), Cfg::kThreads, Cfg::sharedBytes(d_h).
template <typename T, typename Cfg>
__device__ void windowStatsBlock(WindowTileArgs const& a, unsigned char* shared)
{
    WindowCta const c = windowCta(a, a.statsBlocks, false);
    if (!c.compress)
    {
        return;
    }
    int32_t const tiles = (c.n + Cfg::kKeys - 1) / Cfg::kKeys;
    int32_t const first = c.block * a.statsTilesPerBlock;
    int32_t const left = tiles - first;
    int32_t const count = left < a.statsTilesPerBlock ? left : a.statsTilesPerBlock;
    int32_t const stride = mma::paddedStride(c.d);
    int32_t const steps = c.d / mma::kTileK;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const lane = tid & 31;
    int32_t const warp = tid / 32;
    bool const warpRows = warp * Cfg::kWarpRows < c.rows; // warp-uniform: a warp of padding rows computes nothing
    bool const edges = a.rowSums != nullptr;
    int32_t const kernel = a.config.poolKernel;

    T* ring = reinterpret_cast<T*>(shared);
    T* queryTile = ring + Cfg::kStages * Cfg::kKeys * stride;

    // a step whose keys are all left padding loads and computes nothing (uniform over the CTA)
    auto seen = [&](int32_t t) { return (first + t) * Cfg::kKeys + Cfg::kKeys > c.validStart; };
    auto load = [&](int32_t t) {
        if (t < count && seen(t))
        {
            loadWindowKeys<T, Cfg>(a, c, (first + t) * Cfg::kKeys, ring + (t % Cfg::kStages) * Cfg::kKeys * stride);
        }
        cpAsyncCommit(); // one group per step, empty or not: the wait count stays uniform
    };

    loadWindowQueries<T, Cfg>(a, c, queryTile);
    cpAsyncCommit();
    for (int32_t s = 0; s < Cfg::kStages - 1; ++s)
    {
        load(s);
    }
    cpAsyncWait<Cfg::kStages - 1>(); // the queries' group
    __syncthreads();
    uint32_t qf[Cfg::kMTiles][Cfg::kMaxSteps][4] = {};
    loadQueryFragments<T, Cfg>(queryTile, stride, steps, qf);

    // this thread's rows: warp * 32 + mi * 16 + half * 8 + lane / 4 (mma_layout.h: cFragment). Sums relative to
    // runMax: over the visible older keys, over the visible window keys, and the pooled rows' pool-edge sum.
    float runMax[Cfg::kMTiles][2];
    float runOlder[Cfg::kMTiles][2] = {};
    float runWindow[Cfg::kMTiles][2] = {};
    float runEdges[Cfg::kMTiles][2] = {};
#pragma unroll
    for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
    {
        runMax[mi][0] = -INFINITY;
        runMax[mi][1] = -INFINITY;
    }
    float const inverseScale = 1.0F / a.scale; // a product instead of the reference's division: <= 1 ulp apart
    int32_t const edgeReach = edges ? kernel / 2 : 0; // poolDeficit is 0 farther than k/2 from the older range's ends

    for (int32_t t = 0; t < count; ++t)
    {
        cpAsyncWait<Cfg::kStages - 2>(); // step t's group (committed groups: 1 + kStages - 1 + t)
        __syncthreads();                 // its keys visible to every warp; every warp done with the slot refilled next
        load(t + Cfg::kStages - 1);
        if (!seen(t) || !warpRows)
        {
            continue;
        }
        float acc[Cfg::kMTiles][Cfg::kNTiles][4];
        windowScoreTile<T, Cfg>(ring + (t % Cfg::kStages) * Cfg::kKeys * stride, stride, steps, qf, acc);
        int32_t const key0 = (first + t) * Cfg::kKeys;
        // every key of the step older, visible to every row, and clear of the pool's edges: no per-key test
        bool const interior = key0 >= c.validStart + edgeReach && key0 + Cfg::kKeys <= c.m - edgeReach;
#pragma unroll
        for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
        {
#pragma unroll
            for (int32_t half = 0; half < 2; ++half)
            {
                int32_t const row = warp * Cfg::kWarpRows + mi * mma::kTileM + half * 8 + (lane >> 2);
                if (row >= c.rows)
                {
                    continue;
                }
                int32_t const last = c.n - c.w + row % c.w; // window query j sees keys <= n - w + j
                float top = -INFINITY;
#pragma unroll
                for (int32_t ni = 0; ni < Cfg::kNTiles; ++ni)
                {
#pragma unroll
                    for (int32_t e = 0; e < 2; ++e)
                    {
                        int32_t const key = key0 + ni * mma::kTileN + 2 * (lane & 3) + e;
                        float& x = acc[mi][ni][2 * half + e];
                        x *= inverseScale;
                        if ((interior || (key >= c.validStart && key <= last)) && x > top)
                        {
                            top = x;
                        }
                    }
                }
                if (top == -INFINITY)
                {
                    continue; // no visible key in this step
                }
                if (top > runMax[mi][half])
                {
                    float const rescale = expf(runMax[mi][half] - top);
                    runOlder[mi][half] *= rescale;
                    runWindow[mi][half] *= rescale;
                    runEdges[mi][half] *= rescale;
                    runMax[mi][half] = top;
                }
                float const rowMax = runMax[mi][half];
                if (interior)
                {
                    float sum = 0.0F;
#pragma unroll
                    for (int32_t ni = 0; ni < Cfg::kNTiles; ++ni)
                    {
#pragma unroll
                        for (int32_t e = 0; e < 2; ++e)
                        {
                            sum += expf(acc[mi][ni][2 * half + e] - rowMax);
                        }
                    }
                    runOlder[mi][half] += sum;
                    continue;
                }
#pragma unroll
                for (int32_t ni = 0; ni < Cfg::kNTiles; ++ni)
                {
#pragma unroll
                    for (int32_t e = 0; e < 2; ++e)
                    {
                        int32_t const key = key0 + ni * mma::kTileN + 2 * (lane & 3) + e;
                        if (key < c.validStart || key > last)
                        {
                            continue;
                        }
                        float const p = expf(acc[mi][ni][2 * half + e] - rowMax);
                        if (key >= c.m)
                        {
                            runWindow[mi][half] += p;
                            continue;
                        }
                        runOlder[mi][half] += p;
                        if (edges)
                        {
                            int32_t const deficit = poolDeficit(kernel, c.m, c.validStart, key);
                            if (deficit > 0)
                            {
                                runEdges[mi][half] += p * static_cast<float>(deficit);
                            }
                        }
                    }
                }
            }
        }
    }
    cpAsyncWait<0>(); // the trailing groups are empty; nothing is left in flight at exit

    // the 4 lanes of a quad hold the same rows: merge their partials, then one lane writes the row's
#pragma unroll
    for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
    {
#pragma unroll
        for (int32_t half = 0; half < 2; ++half)
        {
            float top = runMax[mi][half];
            float all = runOlder[mi][half] + runWindow[mi][half];
            float older = runOlder[mi][half];
            float edgeSum = runEdges[mi][half];
            for (int32_t mask = 1; mask <= 2; mask <<= 1)
            {
                float const otherTop = shflXor(top, mask);
                float const otherAll = shflXor(all, mask);
                float const otherOlder = shflXor(older, mask);
                float const otherEdges = shflXor(edgeSum, mask);
                mergeSoftmaxPartial(top, all, older, edgeSum, otherTop, otherAll, otherOlder, otherEdges);
            }
            int32_t const row = warp * Cfg::kWarpRows + mi * mma::kTileM + half * 8 + (lane >> 2);
            if ((lane & 3) == 0 && row < c.rows)
            {
                int32_t const local = row / c.w;
                int32_t const j = row - local * c.w;
                int64_t const at
                    = (((static_cast<int64_t>(c.b) * a.shape.heads + c.firstHead + local) * c.w + j) * a.statsBlocks
                          + c.block)
                    * 4;
                a.partials[at] = top;
                a.partials[at + 1] = all;
                a.partials[at + 2] = older;
                a.partials[at + 3] = edgeSum;
            }
        }
    }
}

//! Pass 2: every window query's softmax (max, sum) and the pooled rows' (mass, total) from the pass-1 partials, merged in
//! key-block order. grid (H, B), `threads` threads: one per row.
__device__ __forceinline__ void windowCombineBlock(WindowTileArgs const& a, int32_t threads)
{
    int32_t const h = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    if (!sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress)
    {
        return;
    }
    int32_t const w = windowLength(a.config, a.shape.n);
    int32_t const kernel = a.config.poolKernel;
    for (int32_t j = static_cast<int32_t>(threadIdx.x); j < w; j += threads)
    {
        int64_t const row = (static_cast<int64_t>(b) * a.shape.heads + h) * w + j;
        float const* partial = a.partials + row * a.statsBlocks * 4;
        float top = -INFINITY;
        float all = 0.0F;
        float older = 0.0F;
        float edgeSum = 0.0F;
        for (int32_t t = 0; t < a.statsBlocks; ++t)
        {
            mergeSoftmaxPartial(top, all, older, edgeSum, partial[4 * t], partial[4 * t + 1], partial[4 * t + 2],
                partial[4 * t + 3]);
        }
        a.rowStats[2 * row] = top;
        a.rowStats[2 * row + 1] = all;
        if (a.rowSums != nullptr)
        {
            bool const some = all > 0.0F;
            float const mass = some ? older / all : 0.0F;
            float const span = static_cast<float>(2 * (kernel / 2) + 1);
            a.rowSums[2 * row] = mass;
            a.rowSums[2 * row + 1] = some ? (span * older - edgeSum) / (static_cast<float>(kernel) * all) : 0.0F;
        }
    }
}

//! Pass 3: the probabilities of the older keys, summed per (query head, key) into Ā and sum A^2, and the pooled
//! rows' pooledMax = max over the head's window queries of PooledRows::rescaledPooled (row_scores.h).
//! grid (columnBlocks * rowChunks, H_kv, B) run backwards, Cfg::kThreads, Cfg::sharedBytes(d_h).
template <typename T, typename Cfg>
__device__ void windowColumnsBlock(WindowTileArgs const& a, unsigned char* shared)
{
    WindowCta const c = windowCta(a, a.columnBlocks, true);
    if (!c.compress || c.m <= 0)
    {
        return;
    }
    int32_t const width = Cfg::kKeys - 2 * a.halo; // outputs per step
    int32_t const tiles = (c.m + width - 1) / width;
    int32_t const first = c.block * a.columnTilesPerBlock;
    int32_t const left = tiles - first;
    int32_t const count = left < a.columnTilesPerBlock ? left : a.columnTilesPerBlock;
    int32_t const stride = mma::paddedStride(c.d);
    int32_t const steps = c.d / mma::kTileK;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const lane = tid & 31;
    int32_t const warp = tid / 32;
    bool const warpRows = warp * Cfg::kWarpRows < c.rows;
    int32_t const kernel = a.config.poolKernel;

    T* ring = reinterpret_cast<T*>(shared);
    T* queryTile = ring + Cfg::kStages * Cfg::kKeys * stride;
    float* prob = reinterpret_cast<float*>(queryTile); // [kRows][kProbStride], once the Q fragments are in registers
    size_t const queryBytes = static_cast<size_t>(Cfg::kRows) * stride * 2;
    size_t const probBytes = static_cast<size_t>(Cfg::kRows) * Cfg::kProbStride * sizeof(float);
    float* rowInfo = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(queryTile)
        + (queryBytes > probBytes ? queryBytes : probBytes)); // [kRows][4]: max, 1 / sum, pooledRowFactor, unused
    float const inverseScale = 1.0F / a.scale;

    auto keyBegin = [&](int32_t t) { return (first + t) * width - a.halo; };
    auto seen = [&](int32_t t) { return keyBegin(t) + Cfg::kKeys > c.validStart; };
    auto load = [&](int32_t t) {
        if (t < count && seen(t))
        {
            loadWindowKeys<T, Cfg>(a, c, keyBegin(t), ring + (t % Cfg::kStages) * Cfg::kKeys * stride);
        }
        cpAsyncCommit();
    };

    loadWindowQueries<T, Cfg>(a, c, queryTile);
    cpAsyncCommit();
    for (int32_t s = 0; s < Cfg::kStages - 1; ++s)
    {
        load(s);
    }
    for (int32_t r = tid; r < Cfg::kRows; r += Cfg::kThreads)
    {
        float info[Cfg::kRowFloats] = {-INFINITY, 0.0F, 0.0F, 0.0F};
        if (r < c.rows)
        {
            int32_t const local = r / c.w;
            int64_t const row = (static_cast<int64_t>(c.b) * a.shape.heads + c.firstHead + local) * c.w + r - local * c.w;
            info[0] = a.rowStats[2 * row];
            info[1] = 1.0F / a.rowStats[2 * row + 1]; // p = exp(s - max) * (1 / sum): <= 1 ulp from the division
            if (a.pooledMax != nullptr)
            {
                info[2] = pooledRowFactor(a.rowSums[2 * row], a.rowSums[2 * row + 1], kernel);
            }
        }
        for (int32_t e = 0; e < Cfg::kRowFloats; ++e)
        {
            rowInfo[r * Cfg::kRowFloats + e] = info[e];
        }
    }
    cpAsyncWait<Cfg::kStages - 1>();
    __syncthreads();
    uint32_t qf[Cfg::kMTiles][Cfg::kMaxSteps][4] = {};
    loadQueryFragments<T, Cfg>(queryTile, stride, steps, qf);
    __syncthreads(); // every warp holds its fragments: the probability tile may overwrite the queries

    for (int32_t t = 0; t < count; ++t)
    {
        cpAsyncWait<Cfg::kStages - 2>();
        __syncthreads(); // also: the previous step's probabilities are consumed
        load(t + Cfg::kStages - 1);
        int32_t const key0 = keyBegin(t);
        bool const live = seen(t);
        float acc[Cfg::kMTiles][Cfg::kNTiles][4] = {};
        if (live && warpRows)
        {
            windowScoreTile<T, Cfg>(ring + (t % Cfg::kStages) * Cfg::kKeys * stride, stride, steps, qf, acc);
        }
#pragma unroll
        for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
        {
#pragma unroll
            for (int32_t half = 0; half < 2; ++half)
            {
                int32_t const row = warp * Cfg::kWarpRows + mi * mma::kTileM + half * 8 + (lane >> 2);
                float const top = rowInfo[row * Cfg::kRowFloats];
                float const inverseSum = rowInfo[row * Cfg::kRowFloats + 1];
                bool const scored = live && row < c.rows;
#pragma unroll
                for (int32_t ni = 0; ni < Cfg::kNTiles; ++ni)
                {
                    int32_t const col = ni * mma::kTileN + 2 * (lane & 3);
                    float p[2] = {0.0F, 0.0F};
#pragma unroll
                    for (int32_t e = 0; e < 2; ++e)
                    {
                        int32_t const key = key0 + col + e;
                        if (scored && key >= c.validStart && key < c.m) // the older keys only: zero beyond (pool padding)
                        {
                            p[e] = expf(acc[mi][ni][2 * half + e] * inverseScale - top) * inverseSum;
                        }
                    }
                    storeFloatPair(prob + row * Cfg::kProbStride + col, p[0], p[1]);
                }
            }
        }
        __syncthreads();
        int32_t const outBegin = (first + t) * width;
        for (int32_t task = tid; task < c.heads * width; task += Cfg::kThreads)
        {
            int32_t const local = task / width;
            int32_t const o = task - local * width;
            int32_t const i = outBegin + o;
            if (i >= c.m)
            {
                continue;
            }
            int32_t const col = a.halo + o;
            float const* rows = prob + local * c.w * Cfg::kProbStride;
            float sum = 0.0F;
            float squares = 0.0F;
            for (int32_t j = 0; j < c.w; ++j)
            {
                float const p = rows[j * Cfg::kProbStride + col];
                sum += p;
                squares += p * p;
            }
            int64_t const at = (static_cast<int64_t>(c.b) * a.shape.heads + c.firstHead + local) * c.m + i;
            a.raw[at] = sum / static_cast<float>(c.w);
            if (a.squares != nullptr)
            {
                a.squares[at] = squares;
            }
            if (a.pooledMax != nullptr)
            {
                // the host driver's pooledRows: the span summed in ascending position order, 0 on padding
                float best = 0.0F;
                if (i >= c.validStart)
                {
                    PooledRows::PoolSpan const span = PooledRows::poolSpan(kernel, c.m, i);
                    best = -INFINITY;
                    for (int32_t j = 0; j < c.w; ++j)
                    {
                        float const* row = rows + j * Cfg::kProbStride;
                        float spanSum = 0.0F;
                        for (int32_t k = span.lo; k <= span.hi; ++k)
                        {
                            spanSum += row[k - key0];
                        }
                        float const value = spanSum * rowInfo[(local * c.w + j) * Cfg::kRowFloats + 2];
                        best = value > best ? value : best;
                    }
                }
                a.pooledMax[at] = best;
            }
        }
    }
    cpAsyncWait<0>();
}

} // namespace criticalkv::kernels
