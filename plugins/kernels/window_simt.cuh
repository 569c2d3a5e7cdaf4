// The SIMT window-score and pooled-row kernels' bodies (fp32, and every input the tensor-core tiles of
// window_tiles.cuh do not take: d_h % 16 != 0 or > 128, w > 128, a pool wider than 49, unaligned tensors, sm < 80).
// Included by kernels/window_scores.cu (the __global__ wrappers give each body its dynamic shared memory) and by the
// CPU emulation (testing/window_scores_emulation.cpp).
//
// Window attention in two passes over the keys so that no [w, n] probability matrix is stored: pass 1 writes a (max,
// sum of exponentials) partial per 64-key tile and window query, a combine step reduces them to the softmax statistics
// of every query, pass 2 recomputes the logits of the m older keys and accumulates the normalised probabilities per
// key. Keys and a 16-query chunk sit in shared memory; logits accumulate in fp32.
//
// A row-scored method's pooled rows (row_scores.h): two more passes recompute the probabilities of the older keys (the
// rows' pooled sums, then the maximum of the rescaled pooled rows per head).
#pragma once

#include "criticalkv/row_scores.h"
#include "criticalkv/select_params.h"

#if defined(__CUDACC__)
#include "device_utils.cuh"
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace criticalkv::kernels
{

constexpr int kQueryChunk = 16;
constexpr int kWindowThreads = 256;
constexpr int kStatsThreads = 256;

struct WindowArgs
{
    SelectConfig config;
    SelectShape shape;
    void const* queries;
    void const* keys;
    int32_t const* promptLengths;
    RuntimeBudget budget;
    float2* partials; // [B, H, w, tiles]
    float2* rowStats; // [B, H, w]
    float* raw;       // [B, H, m]
    float* squares;   // [B, H, m] or nullptr
    int32_t tiles;
    float scale; // sqrt(d_h) in fp32, as the reference divides by it
};

inline size_t windowSharedBytes(int32_t headDim)
{
    return (static_cast<size_t>(kKeyTile + kQueryChunk) * (headDim + 1) + kQueryChunk * kKeyTile) * sizeof(float);
}

//! Pass 1 (kColumns = false): softmax partials per key tile. Pass 2 (kColumns = true): Ā and sum A^2 per key.
//! grid (key tiles, H, B), block kWindowThreads, dynamic shared memory windowSharedBytes(d_h).
template <typename T, bool kColumns>
__device__ void windowAttentionBlock(WindowArgs const& a, float* shared)
{
    int32_t const tile = static_cast<int32_t>(blockIdx.x);
    int32_t const h = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    if (!info.compress)
    {
        return;
    }
    int32_t const n = a.shape.n;
    int32_t const d = a.shape.headDim;
    int32_t const w = windowLength(a.config, n);
    int32_t const m = n - w;
    int32_t const g = h / (a.shape.heads / a.shape.kvHeads);
    int32_t const keyBegin = tile * kKeyTile;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int64_t const headRow = static_cast<int64_t>(b) * a.shape.heads + h;

    if (keyBegin + kKeyTile <= info.validStart)
    {
        // The whole tile is left padding: no probability mass (the reference's masked softmax gives exact 0).
        if (!kColumns)
        {
            for (int32_t j = tid; j < w; j += kWindowThreads)
            {
                a.partials[(headRow * w + j) * a.tiles + tile] = make_float2(-INFINITY, 0.0F);
            }
        }
        else if (tid < kKeyTile && keyBegin + tid < m)
        {
            a.raw[headRow * m + keyBegin + tid] = 0.0F;
            if (a.squares != nullptr)
            {
                a.squares[headRow * m + keyBegin + tid] = 0.0F;
            }
        }
        return;
    }

    int32_t const stride = d + 1; // +1: conflict-free column reads across keys
    float* keyTile = shared;                          // [kKeyTile][d + 1]
    float* queryTile = keyTile + kKeyTile * stride;   // [kQueryChunk][d + 1]
    float* logitTile = queryTile + kQueryChunk * stride; // [kQueryChunk][kKeyTile]

    T const* keys = static_cast<T const*>(a.keys) + (static_cast<int64_t>(b) * a.shape.kvHeads + g) * n * d;
    for (int32_t e = tid; e < kKeyTile * d; e += kWindowThreads)
    {
        int32_t const r = e / d;
        int32_t const c = e - r * d;
        int32_t const key = keyBegin + r;
        keyTile[r * stride + c] = key < n ? toFloat(keys[static_cast<int64_t>(key) * d + c]) : 0.0F;
    }

    T const* queries = static_cast<T const*>(a.queries) + headRow * a.shape.queryLen * d;
    int32_t const firstQuery = a.shape.queryLen - w; // the operator uses the last w queries
    int32_t const warp = tid / 32;
    int32_t const lane = tid % 32;
    float columnSum = 0.0F;
    float columnSquares = 0.0F;

    for (int32_t j0 = 0; j0 < w; j0 += kQueryChunk)
    {
        __syncthreads(); // keys loaded / previous chunk consumed
        for (int32_t e = tid; e < kQueryChunk * d; e += kWindowThreads)
        {
            int32_t const r = e / d;
            int32_t const c = e - r * d;
            int32_t const j = j0 + r;
            queryTile[r * stride + c]
                = j < w ? toFloat(queries[static_cast<int64_t>(firstQuery + j) * d + c]) : 0.0F;
        }
        __syncthreads();
        for (int32_t e = tid; e < kQueryChunk * kKeyTile; e += kWindowThreads)
        {
            int32_t const r = e / kKeyTile;
            int32_t const i = e - r * kKeyTile;
            int32_t const j = j0 + r;
            int32_t const key = keyBegin + i;
            bool const visible = j < w && key < n && key >= info.validStart && key <= n - w + j;
            float dot = 0.0F;
            float const* q = queryTile + r * stride;
            float const* k = keyTile + i * stride;
            for (int32_t c = 0; c < d; ++c)
            {
                dot = fmaf(q[c], k[c], dot);
            }
            logitTile[r * kKeyTile + i] = visible ? dot / a.scale : -INFINITY;
        }
        __syncthreads();
        if (!kColumns)
        {
            static_assert(kKeyTile == 64, "one warp reduces a 64-key row with two values per lane");
            for (int32_t r = warp; r < kQueryChunk; r += kWindowThreads / 32)
            {
                int32_t const j = j0 + r;
                if (j >= w)
                {
                    continue;
                }
                float const v0 = logitTile[r * kKeyTile + lane];
                float const v1 = logitTile[r * kKeyTile + lane + 32];
                float const rowMax = warpMax(fmaxf(v0, v1));
                float sum = rowMax == -INFINITY ? 0.0F : expf(v0 - rowMax) + expf(v1 - rowMax);
                sum = warpSum(sum);
                if (lane == 0)
                {
                    a.partials[(headRow * w + j) * a.tiles + tile] = make_float2(rowMax, sum);
                }
            }
        }
        else if (tid < kKeyTile)
        {
            for (int32_t r = 0; r < kQueryChunk && j0 + r < w; ++r)
            {
                float const logit = logitTile[r * kKeyTile + tid];
                if (logit == -INFINITY)
                {
                    continue;
                }
                float2 const stats = a.rowStats[headRow * w + j0 + r];
                float const p = expf(logit - stats.x) / stats.y;
                columnSum += p;
                columnSquares += p * p;
            }
        }
    }
    if (kColumns && tid < kKeyTile && keyBegin + tid < m)
    {
        a.raw[headRow * m + keyBegin + tid] = columnSum / static_cast<float>(w);
        if (a.squares != nullptr)
        {
            a.squares[headRow * m + keyBegin + tid] = columnSquares;
        }
    }
}

//! Combine the per-tile partials into the softmax (max, sum) of every window query. grid (H, B), kStatsThreads.
__device__ __forceinline__ void softmaxStatsBlock(WindowArgs const& a)
{
    int32_t const h = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    if (!sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress)
    {
        return;
    }
    int32_t const w = windowLength(a.config, a.shape.n);
    int64_t const headRow = static_cast<int64_t>(b) * a.shape.heads + h;
    int32_t const warp = static_cast<int32_t>(threadIdx.x) / 32;
    int32_t const lane = static_cast<int32_t>(threadIdx.x) % 32;
    for (int32_t j = warp; j < w; j += kStatsThreads / 32)
    {
        float2 const* partial = a.partials + (headRow * w + j) * a.tiles;
        float rowMax = -INFINITY;
        for (int32_t t = lane; t < a.tiles; t += 32)
        {
            rowMax = fmaxf(rowMax, partial[t].x);
        }
        rowMax = warpMax(rowMax);
        float sum = 0.0F;
        for (int32_t t = lane; t < a.tiles; t += 32)
        {
            float2 const p = partial[t];
            if (p.x != -INFINITY)
            {
                sum += p.y * expf(p.x - rowMax);
            }
        }
        sum = warpSum(sum);
        if (lane == 0)
        {
            a.rowStats[headRow * w + j] = make_float2(rowMax, sum);
        }
    }
}

//! The pooled rows of a row-scored method (row_scores.h): every window query's attention row over the older tokens,
//! average-pooled and rescaled to the row's mass, maximum over the rows of each query head.
struct PooledRowArgs
{
    SelectConfig config;
    SelectShape shape;
    void const* queries;
    void const* keys;
    int32_t const* promptLengths;
    RuntimeBudget budget;
    float2 const* rowStats; // [B, H, w] softmax (max, sum)
    float2* partials;       // [B, H, w, olderTiles] per token tile (sum A, sum P)
    float2* rowSums;        // [B, H, w] (mass, total)
    float* pooledMax;       // [B, H, m]
    int32_t olderTiles;
    float scale;
};

constexpr int kRowThreads = 256;              // kKeyTile tokens x kRowLanes lanes of window queries
constexpr int kRowLanes = kRowThreads / kKeyTile;
constexpr int kRowQueriesPerLane = kQueryChunk / kRowLanes;

inline size_t pooledRowSharedBytes(int32_t headDim)
{
    // keys, queries, probabilities, two reduction tiles, the lanes' maxima
    return (static_cast<size_t>(kKeyTile + kQueryChunk) * (headDim + 1) + 3 * kQueryChunk * kKeyTile
               + kRowLanes * kKeyTile)
        * sizeof(float);
}

//! Pass kRescale = false: per token tile and window query, the sums of A and of P over the tile's tokens (partials).
//! Pass kRescale = true: pooledMax[b, h, i] = max over j of PooledRows::rescaledPooled(P[j, i], rowSums[j]). P[j, i]
//! sums the probabilities of the span of token i in ascending position order, as avg_pool1d does; the span crosses the
//! tile, so the probabilities of keys [tile - k/2, tile + 64 + k/2) are computed in chunks of 64 keys.
//! grid (older tiles, H, B), block kRowThreads, dynamic shared memory pooledRowSharedBytes(d_h).
template <typename T, bool kRescale>
__device__ void pooledRowsBlock(PooledRowArgs const& a, float* shared)
{
    int32_t const tile = static_cast<int32_t>(blockIdx.x);
    int32_t const h = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    if (!info.compress)
    {
        return;
    }
    int32_t const n = a.shape.n;
    int32_t const d = a.shape.headDim;
    int32_t const w = windowLength(a.config, n);
    int32_t const m = n - w;
    int32_t const g = h / (a.shape.heads / a.shape.kvHeads);
    int32_t const tileBegin = tile * kKeyTile;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const token = tid % kKeyTile;
    int32_t const lane = tid / kKeyTile;
    int32_t const i = tileBegin + token;
    int64_t const headRow = static_cast<int64_t>(b) * a.shape.heads + h;
    int32_t const half = a.config.poolKernel / 2;
    PooledRows::PoolSpan const span
        = i < m ? PooledRows::poolSpan(a.config.poolKernel, m, i) : PooledRows::PoolSpan{1, 0};
    int32_t const lo = tileBegin - half > 0 ? tileBegin - half : 0;
    int32_t const hi = tileBegin + kKeyTile + half < m ? tileBegin + kKeyTile + half : m; // exclusive

    int32_t const stride = d + 1;
    float* keyTile = shared;                                 // [kKeyTile][d + 1]
    float* queryTile = keyTile + kKeyTile * stride;          // [kQueryChunk][d + 1]
    float* probTile = queryTile + kQueryChunk * stride;      // [kQueryChunk][kKeyTile]
    float* pooledTile = probTile + kQueryChunk * kKeyTile;   // [kQueryChunk][kKeyTile]
    float* massTile = pooledTile + kQueryChunk * kKeyTile;   // [kQueryChunk][kKeyTile]
    float* laneBest = massTile + kQueryChunk * kKeyTile;     // [kRowLanes][kKeyTile]

    T const* keys = static_cast<T const*>(a.keys) + (static_cast<int64_t>(b) * a.shape.kvHeads + g) * n * d;
    T const* queries = static_cast<T const*>(a.queries) + headRow * a.shape.queryLen * d;
    int32_t const firstQuery = a.shape.queryLen - w;
    float best = -INFINITY;

    for (int32_t j0 = 0; j0 < w; j0 += kQueryChunk)
    {
        __syncthreads(); // the previous chunk's tiles are consumed
        for (int32_t e = tid; e < kQueryChunk * d; e += kRowThreads)
        {
            int32_t const r = e / d;
            int32_t const c = e - r * d;
            int32_t const j = j0 + r;
            queryTile[r * stride + c] = j < w ? toFloat(queries[static_cast<int64_t>(firstQuery + j) * d + c]) : 0.0F;
        }
        float sums[kRowQueriesPerLane] = {};
        float own[kRowQueriesPerLane] = {};
        for (int32_t c0 = lo; c0 < hi; c0 += kKeyTile)
        {
            __syncthreads(); // queries loaded, previous probabilities consumed
            for (int32_t e = tid; e < kKeyTile * d; e += kRowThreads)
            {
                int32_t const r = e / d;
                int32_t const c = e - r * d;
                int32_t const key = c0 + r;
                keyTile[r * stride + c] = key < hi ? toFloat(keys[static_cast<int64_t>(key) * d + c]) : 0.0F;
            }
            __syncthreads();
            for (int32_t e = tid; e < kQueryChunk * kKeyTile; e += kRowThreads)
            {
                int32_t const r = e / kKeyTile;
                int32_t const col = e - r * kKeyTile;
                int32_t const j = j0 + r;
                int32_t const key = c0 + col;
                bool const visible = j < w && key < hi && key >= info.validStart && key <= n - w + j;
                float dot = 0.0F;
                float const* q = queryTile + r * stride;
                float const* k = keyTile + col * stride;
                for (int32_t c = 0; c < d; ++c)
                {
                    dot = fmaf(q[c], k[c], dot);
                }
                float p = 0.0F;
                if (visible)
                {
                    float2 const stats = a.rowStats[headRow * w + j];
                    p = expf(dot / a.scale - stats.x) / stats.y;
                }
                probTile[r * kKeyTile + col] = p;
            }
            __syncthreads();
            int32_t const first = span.lo > c0 ? span.lo : c0;
            int32_t const last = span.hi < c0 + kKeyTile - 1 ? span.hi : c0 + kKeyTile - 1;
            for (int32_t q = 0; q < kRowQueriesPerLane; ++q)
            {
                float const* row = probTile + (lane + kRowLanes * q) * kKeyTile;
                for (int32_t t = first; t <= last; ++t)
                {
                    sums[q] += row[t - c0];
                }
                if (i >= c0 && i < c0 + kKeyTile && i < m)
                {
                    own[q] = row[i - c0];
                }
            }
        }
        for (int32_t q = 0; q < kRowQueriesPerLane; ++q)
        {
            int32_t const r = lane + kRowLanes * q;
            int32_t const j = j0 + r;
            bool const scored = j < w && i < m;
            float const pooled
                = scored && i >= info.validStart ? PooledRows::averagePool(sums[q], a.config.poolKernel) : 0.0F;
            if (kRescale)
            {
                if (scored)
                {
                    float2 const mass = a.rowSums[headRow * w + j];
                    float const value = PooledRows::rescaledPooled(pooled, mass.x, mass.y);
                    best = value > best ? value : best;
                }
            }
            else
            {
                pooledTile[r * kKeyTile + token] = pooled;
                massTile[r * kKeyTile + token] = scored ? own[q] : 0.0F;
            }
        }
        if (!kRescale)
        {
            __syncthreads();
            if (tid < kQueryChunk && j0 + tid < w)
            {
                float sumA = 0.0F;
                float sumP = 0.0F;
                for (int32_t t = 0; t < kKeyTile; ++t)
                {
                    sumA += massTile[tid * kKeyTile + t];
                    sumP += pooledTile[tid * kKeyTile + t];
                }
                a.partials[(headRow * w + j0 + tid) * a.olderTiles + tile] = make_float2(sumA, sumP);
            }
        }
    }
    if (kRescale)
    {
        laneBest[lane * kKeyTile + token] = best;
        __syncthreads();
        if (lane == 0 && i < m)
        {
            for (int32_t l = 1; l < kRowLanes; ++l)
            {
                float const other = laneBest[l * kKeyTile + token];
                best = other > best ? other : best;
            }
            a.pooledMax[headRow * m + i] = best;
        }
    }
}

//! rowSums[b, h, j] = (mass, total) of every window query's row from the tile partials. grid (H, B), kStatsThreads.
__device__ __forceinline__ void rowSumsBlock(PooledRowArgs const& a)
{
    int32_t const h = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    if (!sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress)
    {
        return;
    }
    int32_t const w = windowLength(a.config, a.shape.n);
    int64_t const headRow = static_cast<int64_t>(b) * a.shape.heads + h;
    for (int32_t j = static_cast<int32_t>(threadIdx.x); j < w; j += kStatsThreads)
    {
        double mass = 0.0;
        double total = 0.0;
        for (int32_t t = 0; t < a.olderTiles; ++t)
        {
            float2 const p = a.partials[(headRow * w + j) * a.olderTiles + t];
            mass += p.x;
            total += p.y;
        }
        a.rowSums[headRow * w + j] = make_float2(static_cast<float>(mass), static_cast<float>(total));
    }
}

} // namespace criticalkv::kernels
