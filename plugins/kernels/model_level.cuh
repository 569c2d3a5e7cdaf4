// The model-level selection on the GPU (criticalkv/model_level.h): after the last layer, every head of every layer in
// one [B, N, m] ranking (N = L * H_kv, layer-major), the allocation of the model's budget over them, CriticalKV's two
// stages inside each head's count, then the per-layer compaction (kernels/model_level.cu). Every top-k is one
// launchTopK over all rows of the batch (criticalkv/topk.h), the primitive of the per-layer flows:
//
//   no head cap:  the shared allocation with N heads (select_flows.cuh: runSharedAllocation): each head's floor by a
//                 top-k over its row, the rest by one top-k over every sequence's model-wide row of N m entries;
//   head cap:     a top-k marks each head's candidates (its own top min(available, levelCap(r)): all a level ever
//                 reads), a CTA per head sorts them by rank (an 8-bit LSD radix sort, stable, so equal scores keep
//                 their positions' order), one CTA per sequence walks the levels t = 1 .. r (the nested allocation:
//                 each level's threshold found by bisection over the ranking's keys, with each head's next
//                 kLevelCache keys in shared memory), and a CTA per head marks its top `count`;
//   refinement:   (layer-kvzip-criticalkv) the allocated sinks kept, then stage 1 and stage 2 as two top-k calls.
//
// A fixed sequence of launches with every count read on the device: no host synchronisation, CUDA-graph capturable.
// Plain CUDA C++ with no CUDA or CUB header of its own: the CPU emulation compiles this very file
// (plugins/testing/model_level_emulation.cpp) through select_flows.cuh's launcher interface.
#pragma once

#include "criticalkv/model_level.h"
#include "select_flows.cuh"

namespace criticalkv::kernels
{

constexpr int kModelThreads = 256;
constexpr int kModelWarps = kModelThreads / 32;
//! Heads per thread of the level kernel (contiguous), so the model may have up to kModelMaxHeads heads.
constexpr int32_t kModelHeadsPerThread = 4;
constexpr int32_t kModelMaxHeads = kModelThreads * kModelHeadsPerThread;
//! Each head's next keys the level kernel keeps in shared memory (a level takes about one entry per head).
#ifndef CKV_LEVEL_CACHE
#define CKV_LEVEL_CACHE 8
#endif
constexpr int32_t kLevelCache = CKV_LEVEL_CACHE;
//! The mark of a head's candidates (its top min(available, levelCap(r))) before the sort.
constexpr uint8_t kModelCandidate = 1;

static_assert(kModelThreads == kRadixBins, "the sort's digit steps give one thread per digit");




//! The block reductions' scratch.
struct ModelReduceSmem
{
    long long warpTotals[kModelWarps][2];
};

//! The sort's digit histogram, each digit's next slot, and each warp's count of every digit in a tile.
struct ModelSortSmem
{
    uint32_t histogram[kRadixBins];
    uint32_t binStart[kRadixBins];
    uint32_t warpCounts[kModelWarps][kRadixBins];
    ModelReduceSmem reduce;
};

//! The level kernel's copy of each head's next kLevelCache keys (32 KiB for kModelMaxHeads heads).
struct ModelLevelSmem
{
    uint32_t cache[kModelMaxHeads * kLevelCache];
    ModelReduceSmem reduce;
};

//! Sums of two values over the block, for every thread. Every thread calls it.
__device__ __forceinline__ void modelBlockSum2(long long& x, long long& y, ModelReduceSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    for (int offset = 16; offset > 0; offset /= 2)
    {
        x += __shfl_xor_sync(kFullWarp, x, offset);
        y += __shfl_xor_sync(kFullWarp, y, offset);
    }
    __syncthreads(); // warpTotals is free
    if (tid % 32 == 0)
    {
        s.warpTotals[tid / 32][0] = x;
        s.warpTotals[tid / 32][1] = y;
    }
    __syncthreads();
    x = 0;
    y = 0;
    for (int32_t w = 0; w < kModelWarps; ++w)
    {
        x += s.warpTotals[w][0];
        y += s.warpTotals[w][1];
    }
}

__device__ __forceinline__ long long modelBlockSum(long long x, ModelReduceSmem& s)
{
    long long y = 0;
    modelBlockSum2(x, y, s);
    return x;
}

//! Exclusive prefix sum over the block in thread order. Every thread calls it.
__device__ __forceinline__ long long modelExclusiveScan(long long value, ModelReduceSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const lane = tid % 32;
    int32_t const warp = tid / 32;
    long long inclusive = value;
    for (int offset = 1; offset < 32; offset *= 2)
    {
        long long const y = __shfl_up_sync(kFullWarp, inclusive, static_cast<unsigned>(offset));
        inclusive += lane >= offset ? y : 0;
    }
    __syncthreads(); // warpTotals is free
    if (lane == 31)
    {
        s.warpTotals[warp][0] = inclusive;
    }
    __syncthreads();
    long long before = 0;
    for (int32_t w = 0; w < warp; ++w)
    {
        before += s.warpTotals[w][0];
    }
    return before + inclusive - value;
}

//! Head cap: every head's candidates (the plan's headFirst) and first valid position. grid planGrid (B N rows).
__global__ void __launch_bounds__(kPlanThreads) modelPlanKernel(ModelArgs a)
{
    int32_t b = 0;
    int32_t h = 0;
    if (!planRow(a.rows, b, h))
    {
        return;
    }
    int64_t const row = static_cast<int64_t>(b) * a.rows.shape.kvHeads + h;
    SequenceInfo const info = sequenceInfo(a.rows.config, a.rows.budget, a.rows.shape, a.rows.promptLengths, b);
    a.rows.plan.headFirst[row] = info.compress ? modelCandidates(a.rows.config, info.olderValid, info.r) : 0;
    a.rows.plan.headFirstValid[row] = info.validStart;
}

//! The sort key of a ranking key: ascending order of ~key is the ranking's order (best first).
__device__ __forceinline__ uint32_t sortDigit(uint32_t key, int32_t pass)
{
    return ((~key) >> (kRadixBits * pass)) & static_cast<uint32_t>(kRadixBins - 1);
}

//! Head cap: one head's candidates (flags == kModelCandidate) sorted best first, equal keys by position: four stable
//! 8-bit passes (least significant first) from the row into sortKeys/sortPositions[0], then [1], [0], [1]. Each pass:
//! a digit histogram, its exclusive scan, then the entries in order, a tile of kModelThreads at a time, each to its
//! digit's next slot (its rank among its warp's equal digits by __match_any_sync, the warps before it by their counts).
//! grid (B N), block kModelThreads.
__global__ void __launch_bounds__(kModelThreads) modelSortKernel(ModelArgs a)
{
    CKV_BLOCK_SHARED ModelSortSmem s;
    int64_t const row = blockIdx.x;
    int32_t const heads = a.rows.shape.kvHeads;
    int32_t const b = static_cast<int32_t>(row / heads);
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const lane = tid % 32;
    int32_t const warp = tid / 32;
    int64_t const candidates = a.rows.plan.headFirst[row];
    if (!sequenceInfo(a.rows.config, a.rows.budget, a.rows.shape, a.rows.promptLengths, b).compress || candidates <= 0)
    {
        return;
    }
    int32_t const m = olderTokens(a.rows);
    float const* scores = a.ranking + row * m;
    uint8_t const* flags = a.rows.flags + row * m;
    int64_t const slot = row * a.sortStride;
    for (int32_t pass = 0; pass < kRadixPasses; ++pass)
    {
        int32_t const length = pass == 0 ? m : static_cast<int32_t>(candidates);
        uint32_t const* fromKeys = a.sortKeys[(pass + 1) % 2] + slot;
        int32_t const* fromPositions = a.sortPositions[(pass + 1) % 2] + slot;
        uint32_t* toKeys = a.sortKeys[pass % 2] + slot;
        int32_t* toPositions = a.sortPositions[pass % 2] + slot;
        auto item = [&](int32_t e, uint32_t& key, int32_t& position) {
            if (pass == 0)
            {
                key = orderedKey(scores[e]);
                position = e;
                return flags[e] == kModelCandidate;
            }
            key = fromKeys[e];
            position = fromPositions[e];
            return true;
        };
        s.histogram[tid] = 0u;
        for (int32_t w = 0; w < kModelWarps; ++w)
        {
            s.warpCounts[w][tid] = 0u;
        }
        __syncthreads();
        for (int32_t e = tid; e < length; e += kModelThreads)
        {
            uint32_t key = 0;
            int32_t position = 0;
            if (item(e, key, position))
            {
                atomicAdd(&s.histogram[sortDigit(key, pass)], 1u);
            }
        }
        __syncthreads();
        s.binStart[tid] = static_cast<uint32_t>(modelExclusiveScan(s.histogram[tid], s.reduce));
        __syncthreads();
        for (int32_t base = 0; base < length; base += kModelThreads)
        {
            int32_t const e = base + tid;
            uint32_t key = 0;
            int32_t position = 0;
            bool const valid = e < length && item(e, key, position);
            uint32_t const digit = valid ? sortDigit(key, pass) : static_cast<uint32_t>(kRadixBins);
            unsigned const peers = __match_any_sync(kFullWarp, digit);
            unsigned const before = peers & ((1u << lane) - 1u);
            if (valid && before == 0u)
            {
                s.warpCounts[warp][digit] = static_cast<uint32_t>(__popc(peers));
            }
            __syncthreads();
            uint32_t running = 0; // thread tid: digit tid's offsets of the warps, in warp order
            for (int32_t w = 0; w < kModelWarps; ++w)
            {
                uint32_t const count = s.warpCounts[w][tid];
                s.warpCounts[w][tid] = running;
                running += count;
            }
            __syncthreads();
            if (valid)
            {
                uint32_t const at = s.binStart[digit] + s.warpCounts[warp][digit] + static_cast<uint32_t>(__popc(before));
                toKeys[at] = key;
                toPositions[at] = position;
            }
            __syncthreads();
            s.binStart[tid] += running;
            for (int32_t w = 0; w < kModelWarps; ++w)
            {
                s.warpCounts[w][tid] = 0u;
            }
            __syncthreads();
        }
    }
}

//! How many of a head's next `window` sorted keys (from `low`) are >= threshold: a binary search in its cached keys,
//! then in global memory when every cached one is and the window goes further.
__device__ __forceinline__ int64_t keysAtLeast(uint32_t const* cached, uint32_t const* keys, int64_t low, int64_t window,
    uint32_t threshold)
{
    int64_t const inCache = window < kLevelCache ? window : kLevelCache;
    int64_t lo = 0;
    int64_t hi = inCache;
    while (lo < hi)
    {
        int64_t const mid = (lo + hi) / 2;
        if (cached[mid] >= threshold)
        {
            lo = mid + 1;
        }
        else
        {
            hi = mid;
        }
    }
    if (lo < inCache || inCache == window)
    {
        return lo;
    }
    hi = window;
    while (lo < hi)
    {
        int64_t const mid = (lo + hi) / 2;
        if (keys[low + mid] >= threshold)
        {
            lo = mid + 1;
        }
        else
        {
            hi = mid;
        }
    }
    return lo;
}

//! Head cap: the nested allocation of one sequence (model_level.h), every head's count into counts. Thread t holds
//! heads [t kModelHeadsPerThread, (t + 1) kModelHeadsPerThread). At each level: the heads' spans, the best `need` of
//! their windows by a bisection over the 32-bit keys (the largest key T with at least `need` window keys >= T), the
//! keys above T taken, and the `need` - (those) keys equal to T in head order. grid (B), block kModelThreads.
__global__ void __launch_bounds__(kModelThreads) modelLevelKernel(ModelArgs a)
{
    CKV_BLOCK_SHARED ModelLevelSmem s;
    int32_t const b = static_cast<int32_t>(blockIdx.x);
    int32_t const heads = a.rows.shape.kvHeads;
    SequenceInfo const info = sequenceInfo(a.rows.config, a.rows.budget, a.rows.shape, a.rows.promptLengths, b);
    if (!info.compress)
    {
        return;
    }
    int32_t const first = static_cast<int32_t>(threadIdx.x) * kModelHeadsPerThread;
    uint32_t const* keys = a.sortKeys[1] + static_cast<int64_t>(b) * heads * a.sortStride;
    int64_t held[kModelHeadsPerThread] = {};
    int64_t low[kModelHeadsPerThread] = {};
    int64_t window[kModelHeadsPerThread] = {};
    for (int64_t t = 1; t <= info.r; ++t)
    {
        long long lows = 0;
        long long windows = 0;
        for (int32_t k = 0; k < kModelHeadsPerThread; ++k)
        {
            LevelSpan const span = first + k < heads
                ? levelSpan(a.rows.config, held[k], info.olderValid, t, heads)
                : LevelSpan{0, 0};
            low[k] = span.low;
            window[k] = span.window;
            lows += span.low;
            windows += span.window;
        }
        modelBlockSum2(lows, windows, s.reduce);
        long long const need = heads * t - lows > 0 ? heads * t - lows : 0;
        if (need == 0 || windows <= need)
        {
            for (int32_t k = 0; k < kModelHeadsPerThread; ++k)
            {
                held[k] = low[k] + (need == 0 ? 0 : window[k]);
            }
            continue;
        }
        // each head's next keys into its own cache slots (read by this thread only)
        for (int32_t k = 0; k < kModelHeadsPerThread; ++k)
        {
            int64_t const h = first + k;
            for (int64_t j = 0; j < window[k] && j < kLevelCache; ++j)
            {
                s.cache[h * kLevelCache + j] = keys[h * a.sortStride + low[k] + j];
            }
        }
        auto atLeast = [&](int32_t k, uint32_t threshold) -> int64_t {
            int64_t const h = first + k;
            return window[k] > 0
                ? keysAtLeast(&s.cache[h * kLevelCache], keys + h * a.sortStride, low[k], window[k], threshold)
                : 0;
        };
        uint32_t threshold = 0u;
        for (int32_t bit = 31; bit >= 0; --bit)
        {
            uint32_t const probe = threshold | (1u << bit);
            long long count = 0;
            for (int32_t k = 0; k < kModelHeadsPerThread; ++k)
            {
                count += atLeast(k, probe);
            }
            if (modelBlockSum(count, s.reduce) >= need)
            {
                threshold = probe;
            }
        }
        int64_t above[kModelHeadsPerThread];
        int64_t equal[kModelHeadsPerThread];
        long long aboveSum = 0;
        long long equalSum = 0;
        for (int32_t k = 0; k < kModelHeadsPerThread; ++k)
        {
            int64_t const atOrAbove = atLeast(k, threshold);
            above[k] = threshold == 0xffffffffu ? 0 : atLeast(k, threshold + 1u);
            equal[k] = atOrAbove - above[k];
            aboveSum += above[k];
            equalSum += equal[k];
        }
        aboveSum = modelBlockSum(aboveSum, s.reduce);
        long long before = modelExclusiveScan(equalSum, s.reduce);
        long long const ties = need - aboveSum; // taken among the keys equal to the threshold, lower heads first
        for (int32_t k = 0; k < kModelHeadsPerThread; ++k)
        {
            long long take = ties - before;
            take = take < 0 ? 0 : (take > equal[k] ? equal[k] : take);
            held[k] = low[k] + above[k] + take;
            before += equal[k];
        }
    }
    for (int32_t k = 0; k < kModelHeadsPerThread && first + k < heads; ++k)
    {
        a.counts[static_cast<int64_t>(b) * heads + first + k] = static_cast<int32_t>(held[k]);
    }
}

//! Head cap: each head's flags := its top `count` (the first of its sorted candidates). grid (B N), block
//! kModelThreads.
__global__ void __launch_bounds__(kModelThreads) modelMarkKernel(ModelArgs a)
{
    int64_t const row = blockIdx.x;
    int32_t const heads = a.rows.shape.kvHeads;
    int32_t const b = static_cast<int32_t>(row / heads);
    int32_t const m = olderTokens(a.rows);
    uint8_t* flags = a.rows.flags + row * m;
    for (int32_t i = static_cast<int32_t>(threadIdx.x); i < m; i += kModelThreads)
    {
        flags[i] = 0;
    }
    __syncthreads();
    if (!sequenceInfo(a.rows.config, a.rows.budget, a.rows.shape, a.rows.promptLengths, b).compress)
    {
        return;
    }
    int32_t const count = a.counts[row];
    int32_t const* positions = a.sortPositions[1] + row * a.sortStride;
    for (int32_t j = static_cast<int32_t>(threadIdx.x); j < count; j += kModelThreads)
    {
        flags[positions[j]] = kChosenByAttention;
    }
}

//! CriticalKV's refinement (model_level_refine): each head keeps its allocated sinks (kKeptSink) and chooses the rest
//! of its count by the two stages (the plan's headFirst / headSecond); the other flags are cleared. grid (B N), block
//! kModelThreads.
__global__ void __launch_bounds__(kModelThreads) modelRefinePlanKernel(ModelArgs a)
{
    CKV_BLOCK_SHARED ModelReduceSmem s;
    int64_t const row = blockIdx.x;
    int32_t const heads = a.rows.shape.kvHeads;
    int32_t const b = static_cast<int32_t>(row / heads);
    int32_t const m = olderTokens(a.rows);
    SequenceInfo const info = sequenceInfo(a.rows.config, a.rows.budget, a.rows.shape, a.rows.promptLengths, b);
    uint8_t* flags = a.rows.flags + row * m;
    int32_t const sinks = keepsSinks(a.rows.config) ? a.rows.config.sinkTokens : 0;
    int32_t const sinkEnd = info.validStart + sinks < m ? info.validStart + sinks : m;
    long long allocated = 0;
    long long keptSinks = 0;
    for (int32_t i = static_cast<int32_t>(threadIdx.x); i < m; i += kModelThreads)
    {
        bool const set = flags[i] != 0;
        allocated += set ? 1 : 0;
        keptSinks += set && i >= info.validStart && i < sinkEnd ? 1 : 0;
    }
    modelBlockSum2(allocated, keptSinks, s); // every flag is read before any is rewritten
    for (int32_t i = static_cast<int32_t>(threadIdx.x); i < m; i += kModelThreads)
    {
        flags[i] = flags[i] != 0 && i >= info.validStart && i < sinkEnd ? kKeptSink : 0;
    }
    if (threadIdx.x == 0)
    {
        int64_t const count = info.compress ? allocated - keptSinks : 0;
        HeadStageCounts const stages = headStageCounts(a.rows.config, count);
        a.rows.plan.headFirst[row] = stages.first;
        a.rows.plan.headSecond[row] = stages.second;
        a.rows.plan.headFirstValid[row] = info.validStart;
    }
}

//! The model-wide allocation and refinement into rows.flags (non-zero: kept), as a fixed sequence of launches.
template <typename Launcher>
__host__ bool runModelAllocation(ModelArgs const& a, Launcher& launch)
{
    SelectionRows const& r = a.rows;
    int32_t const m = r.shape.n - windowLength(r.config, r.shape.n);
    uint32_t const rows = static_cast<uint32_t>(r.shape.batch * r.shape.kvHeads);
    if (m <= 0)
    {
        return true;
    }
    if (r.config.keptSinks != 0 || (modelCapped(r.config) && r.shape.kvHeads > kModelMaxHeads))
    {
        return false;
    }
    launch.zero(r.flags, static_cast<size_t>(rows) * m);
    if (!modelCapped(r.config))
    {
        if (!runSharedAllocation(r, a.ranking, launch))
        {
            return false;
        }
    }
    else
    {
        launch.kernel(modelPlanKernel, planGrid(r), kPlanThreads, a);
        if (!launch.topK(headRows(r, a.ranking, r.plan.headFirst, kModelCandidate)))
        {
            return false;
        }
        launch.kernel(modelSortKernel, Grid3{rows, 1, 1}, kModelThreads, a);
        launch.kernel(modelLevelKernel, Grid3{static_cast<uint32_t>(r.shape.batch), 1, 1}, kModelThreads, a);
        launch.kernel(modelMarkKernel, Grid3{rows, 1, 1}, kModelThreads, a);
    }
    if (!r.config.twoStage)
    {
        return true;
    }
    launch.kernel(modelRefinePlanKernel, Grid3{rows, 1, 1}, kModelThreads, a);
    return launch.topK(headRows(r, a.attention, r.plan.headFirst, kChosenByAttention))
        && launch.topK(headRows(r, a.critical, r.plan.headSecond, kChosenByCritical));
}

// ---------------------------------------------------------------------------------------------- external scores

//! One layer's external scores (kvzip: [B, H_kv, n]) as every query head's raw attention [B, H, m], unpooled: the
//! group scores then average the group's copies as the reference does. Uncompressed sequences are skipped.
//! grid (ceil(m / kPlanThreads), H, B).


__global__ void __launch_bounds__(kPlanThreads) externalRawKernel(ExternalRawArgs a)
{
    int32_t const h = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int32_t const i = static_cast<int32_t>(blockIdx.x) * kPlanThreads + static_cast<int32_t>(threadIdx.x);
    if (i >= m || !sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress)
    {
        return;
    }
    int32_t const g = h / (a.shape.heads / a.shape.kvHeads);
    a.raw[(static_cast<int64_t>(b) * a.shape.heads + h) * m + i]
        = a.scores[(static_cast<int64_t>(b) * a.shape.kvHeads + g) * a.shape.n + i];
}

//! layer-kvzip's ranking of one layer: the group score with the sinks first (sinkRanking). attention, ranking:
//! [B, H_kv, m]. grid (ceil(m / kPlanThreads), H_kv, B).


__global__ void __launch_bounds__(kPlanThreads) sinkRankingKernel(SinkRankingArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int32_t const i = static_cast<int32_t>(blockIdx.x) * kPlanThreads + static_cast<int32_t>(threadIdx.x);
    if (i >= m)
    {
        return;
    }
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    int64_t const at = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m + i;
    int32_t const sinks = keepsSinks(a.config) ? a.config.sinkTokens : 0;
    a.ranking[at] = info.compress ? sinkRanking(a.attention[at], i >= info.validStart && i < info.validStart + sinks)
                                  : 0.0F;
}

//! A per-layer kvzip head's kept sinks ([validStart, candidateStart)) flagged kKeptSink after its selection, before
//! the compaction. grid (H_kv, B), block kPlanThreads.
__global__ void __launch_bounds__(kPlanThreads) markKeptSinksKernel(SelectionRows a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    if (!info.compress)
    {
        return;
    }
    uint8_t* flags = a.flags + (static_cast<int64_t>(b) * a.shape.kvHeads + g) * olderTokens(a);
    for (int32_t i = info.validStart + static_cast<int32_t>(threadIdx.x); i < info.candidateStart; i += kPlanThreads)
    {
        flags[i] = kKeptSink;
    }
}

} // namespace criticalkv::kernels
