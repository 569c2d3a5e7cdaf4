// Group scores, radix top-k selection, compaction and gather.
//
// Selection runs one thread block per row (a KV head, or for adakv/laprox the layer-wide row of all heads of a
// sequence): 4 radix passes of 8 bits over order-preserving keys of the fp32 scores (histograms in shared
// memory) find the key T of the k-th best candidate; candidates above T are kept, and among those equal to T
// the lowest indices win (a block-wide prefix count in index order): exactly the reference's tie rule.
// Each pass reads the row once (coalesced), so a row costs ~5 reads of m fp32 scores.
#include "criticalkv/budget.h"
#include "criticalkv/kernels.h"
#include "criticalkv/radix.h"
#include "device_utils.cuh"
#include "selection.cuh"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace criticalkv
{
namespace kernels
{

constexpr int kSelectThreads = 512;
constexpr int kScoreThreads = 256;
constexpr int kGatherWarps = 8;

struct SelectSmem
{
    uint32_t histogram[kRadixBins];
    typename cub::BlockScan<int32_t, kSelectThreads>::TempStorage scan;
    uint32_t prefix;
    int64_t remaining;
    int64_t atThreshold;
    int32_t all;
};

//! Mark with `mark` the k best candidates of scores[0, len): flags[e] == 0 and (e % period) >= firstValid.
//! Called by every thread of a kSelectThreads block with block-uniform arguments.
__device__ void blockSelectTopK(float const* scores, uint8_t* flags, int64_t len, int64_t period, int64_t firstValid,
    int64_t k, uint8_t mark, SelectSmem& s)
{
    if (k <= 0)
    {
        return;
    }
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    auto candidate = [&](int64_t e) { return flags[e] == 0 && (e % period) >= firstValid; };
    if (tid == 0)
    {
        s.prefix = 0u;
        s.remaining = k;
        s.all = 0;
    }
    uint32_t prefixMask = 0u;
    for (int pass = 0; pass < kRadixPasses; ++pass)
    {
        for (int32_t i = tid; i < kRadixBins; i += kSelectThreads)
        {
            s.histogram[i] = 0u;
        }
        __syncthreads();
        uint32_t const prefix = s.prefix;
        for (int64_t base = 0; base < len; base += kSelectThreads) // whole warps iterate together
        {
            int64_t const e = base + tid;
            int32_t bin = -1;
            if (e < len && candidate(e))
            {
                uint32_t const key = orderedKey(scores[e]);
                if ((key & prefixMask) == prefix)
                {
                    bin = static_cast<int32_t>(radixDigit(key, pass));
                }
            }
            // Warp-aggregated increments: ties (one digit for many lanes) cost one atomic per warp, not 32.
            uint32_t const peers = __match_any_sync(0xffffffffu, bin);
            if (bin >= 0 && static_cast<int32_t>(__ffs(peers)) - 1 == (tid & 31))
            {
                atomicAdd(&s.histogram[bin], static_cast<uint32_t>(__popc(peers)));
            }
        }
        __syncthreads();
        if (tid == 0)
        {
            if (pass == 0)
            {
                int64_t total = 0;
                for (int i = 0; i < kRadixBins; ++i)
                {
                    total += s.histogram[i];
                }
                s.all = k >= total ? 1 : 0;
            }
            if (!s.all)
            {
                DigitChoice const choice = chooseDigit(s.histogram, s.remaining);
                s.prefix = prefix | (choice.digit << (32 - kRadixBits * (pass + 1)));
                s.remaining -= choice.above;
                s.atThreshold = choice.atDigit;
            }
        }
        __syncthreads();
        if (s.all)
        {
            break;
        }
        prefixMask = radixPrefixMask(pass);
    }
    if (s.all)
    {
        for (int64_t e = tid; e < len; e += kSelectThreads)
        {
            if (candidate(e))
            {
                flags[e] = mark;
            }
        }
        __syncthreads();
        return;
    }
    uint32_t const threshold = s.prefix;
    int64_t const remaining = s.remaining;
    if (remaining == s.atThreshold)
    {
        for (int64_t e = tid; e < len; e += kSelectThreads)
        {
            if (candidate(e) && orderedKey(scores[e]) >= threshold)
            {
                flags[e] = mark;
            }
        }
    }
    else
    {
        // Ties at the threshold: the first `remaining` of them in index order.
        int64_t running = 0;
        for (int64_t base = 0; base < len; base += kSelectThreads)
        {
            int64_t const e = base + tid;
            bool const isCandidate = e < len && candidate(e);
            uint32_t const key = isCandidate ? orderedKey(scores[e]) : 0u;
            int32_t const tie = isCandidate && key == threshold ? 1 : 0;
            int32_t position = 0;
            int32_t ties = 0;
            cub::BlockScan<int32_t, kSelectThreads>(s.scan).ExclusiveSum(tie, position, ties);
            if (isCandidate && (key > threshold || (tie && running + position < remaining)))
            {
                flags[e] = mark;
            }
            running += ties;
            __syncthreads(); // scan storage reuse
        }
    }
    __syncthreads();
}

//! S, C and the LaProx importance of every older token. grid (ceil(m / kScoreThreads), H_kv, B).
__global__ void __launch_bounds__(kScoreThreads) groupScoresKernel(ScoreArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    if (!sequenceInfo(a.config, a.shape, a.promptLengths, b).compress)
    {
        return;
    }
    int32_t const n = a.shape.n;
    int32_t const m = n - windowLength(a.config, n);
    int32_t const i = static_cast<int32_t>(blockIdx.x) * kScoreThreads + static_cast<int32_t>(threadIdx.x);
    if (i >= m)
    {
        return;
    }
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    int32_t const half = a.config.poolKernel / 2;
    int32_t const lo = i - half > 0 ? i - half : 0;
    int32_t const hi = i + half < m - 1 ? i + half : m - 1;
    bool const norms = needsNorms(a.config);
    float sumPooled = 0.0F;
    float sumCritical = 0.0F;
    float sumP = 0.0F;
    float sumN = 0.0F;
    float sumL = 0.0F;
    for (int32_t h = g * group; h < (g + 1) * group; ++h)
    {
        int64_t const row = (static_cast<int64_t>(b) * a.shape.heads + h) * m;
        float const raw = a.raw[row + i];
        float pooled = raw;
        for (int32_t t = lo; t <= hi; ++t)
        {
            pooled = fmaxf(pooled, a.raw[row + t]);
        }
        float const norm = norms ? a.norms[row + i] : 0.0F;
        float const p = a.config.stage2Scores == Stage2Scores::kPooled ? pooled : raw;
        sumPooled += pooled;
        sumCritical += (p + a.config.epsilon) * norm;
        sumP += p;
        sumN += norm;
        if (a.laprox != nullptr)
        {
            sumL += sqrtf(a.squares[row + i]) * norm;
        }
    }
    float const groupSize = static_cast<float>(group);
    int64_t const out = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m + i;
    a.attention[out] = sumPooled / groupSize;
    if (a.critical != nullptr)
    {
        a.critical[out] = a.config.gqaReduce == GqaReduce::kMean ? sumCritical / groupSize
                                                                 : (sumP / groupSize + a.config.epsilon) * (sumN / groupSize);
    }
    if (a.laprox != nullptr)
    {
        a.laprox[out] = sumL;
    }
}

//! Per-head selection (snapkv / pyramidkv, and the two stages of ada-criticalkv inside each head's share).
//! grid (H_kv, B), block kSelectThreads.
__global__ void __launch_bounds__(kSelectThreads) selectPerHeadKernel(ScoreArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    SequenceInfo const info = sequenceInfo(a.config, a.shape, a.promptLengths, b);
    if (!info.compress)
    {
        return;
    }
    __shared__ SelectSmem smem;
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int64_t const row = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m;
    uint8_t* flags = a.flags + row;
    for (int32_t i = static_cast<int32_t>(threadIdx.x); i < m; i += kSelectThreads)
    {
        flags[i] = 0;
    }
    __syncthreads();
    int64_t const count = sharedAllocation(a.config) ? a.headCounts[static_cast<int64_t>(b) * a.shape.kvHeads + g] : info.r;
    int64_t const first = a.config.twoStage ? stage1Count(a.config.alpha, count) : count;
    blockSelectTopK(a.attention + row, flags, m, m, info.validStart, first, 1, smem);
    if (a.config.twoStage)
    {
        blockSelectTopK(a.critical + row, flags, m, m, info.validStart, count - first, 2, smem);
    }
}

//! AdaKV / LaProx allocation of a layer's H_kv * r slots: every head's own top floor, then the best of the rest
//! over all heads (ties: lower head, then lower position). grid (B), block kSelectThreads.
__global__ void __launch_bounds__(kSelectThreads) selectSharedKernel(ScoreArgs a)
{
    int32_t const b = static_cast<int32_t>(blockIdx.x);
    SequenceInfo const info = sequenceInfo(a.config, a.shape, a.promptLengths, b);
    if (!info.compress)
    {
        return;
    }
    __shared__ SelectSmem smem;
    __shared__ typename cub::BlockReduce<int32_t, kSelectThreads>::TempStorage reduceStorage;
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int32_t const heads = a.shape.kvHeads;
    int64_t const base = static_cast<int64_t>(b) * heads * m;
    int64_t const rowLength = static_cast<int64_t>(heads) * m;
    float const* ranking = (a.config.base == BaseMethod::kLaProx ? a.laprox : a.attention) + base;
    uint8_t* flags = a.flags + base;
    for (int64_t e = threadIdx.x; e < rowLength; e += kSelectThreads)
    {
        flags[e] = 0;
    }
    __syncthreads();
    int64_t const floor = headFloor(a.config.adaFloor, info.r);
    for (int32_t g = 0; g < heads; ++g)
    {
        blockSelectTopK(ranking + static_cast<int64_t>(g) * m, flags + static_cast<int64_t>(g) * m, m, m,
            info.validStart, floor, 1, smem);
    }
    blockSelectTopK(ranking, flags, rowLength, m, info.validStart, heads * (info.r - floor), 1, smem);
    for (int32_t g = 0; g < heads; ++g)
    {
        int32_t kept = 0;
        for (int32_t i = static_cast<int32_t>(threadIdx.x); i < m; i += kSelectThreads)
        {
            kept += flags[static_cast<int64_t>(g) * m + i] != 0 ? 1 : 0;
        }
        int32_t const total = cub::BlockReduce<int32_t, kSelectThreads>(reduceStorage).Sum(kept);
        if (threadIdx.x == 0)
        {
            a.headCounts[static_cast<int64_t>(b) * heads + g] = total;
        }
        __syncthreads();
    }
}

//! Ascending kept positions of every head (-1 padded) and their count. grid (H_kv, B), block kSelectThreads.
__global__ void __launch_bounds__(kSelectThreads) compactKernel(ScoreArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    __shared__ typename cub::BlockScan<int32_t, kSelectThreads>::TempStorage scan;
    SequenceInfo const info = sequenceInfo(a.config, a.shape, a.promptLengths, b);
    int32_t const n = a.shape.n;
    int32_t const m = n - windowLength(a.config, n);
    int32_t const cap = outputCapacity(a.config, n);
    int64_t const head = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    int32_t* indices = a.keptIndices + head * cap;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t count = 0;
    if (!info.compress)
    {
        count = info.length;
        for (int32_t slot = tid; slot < cap; slot += kSelectThreads)
        {
            indices[slot] = slot < count ? info.validStart + slot : -1;
        }
    }
    else if (a.config.base == BaseMethod::kStreamingLLM)
    {
        count = a.config.budget;
        int32_t const sinks = a.config.sinkTokens;
        int32_t const recentStart = n - (a.config.budget - sinks);
        for (int32_t slot = tid; slot < cap; slot += kSelectThreads)
        {
            indices[slot] = slot >= count ? -1 : (slot < sinks ? info.validStart + slot : recentStart + (slot - sinks));
        }
    }
    else
    {
        uint8_t const* flags = a.flags + head * m;
        for (int32_t base = 0; base < n; base += kSelectThreads)
        {
            int32_t const p = base + tid;
            int32_t const keep = p < n && (p >= m || (p >= info.validStart && flags[p] != 0)) ? 1 : 0;
            int32_t position = 0;
            int32_t total = 0;
            cub::BlockScan<int32_t, kSelectThreads>(scan).ExclusiveSum(keep, position, total);
            if (keep && count + position < cap)
            {
                indices[count + position] = p;
            }
            count += total;
            __syncthreads();
        }
        for (int32_t slot = count + tid; slot < cap; slot += kSelectThreads)
        {
            indices[slot] = -1;
        }
    }
    if (tid == 0)
    {
        a.keptLengths[head] = count < cap ? count : cap;
    }
}

//! kept_keys / kept_values rows from kept_indices (zero where -1). grid (ceil(cap / kGatherWarps), H_kv, B);
//! one warp per slot, 16-byte vectors when the row allows them.
template <typename Vec>
__global__ void __launch_bounds__(kGatherWarps * 32) gatherKernel(GatherArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    int32_t const cap = outputCapacity(a.config, a.shape.n);
    int32_t const slot = static_cast<int32_t>(blockIdx.x) * kGatherWarps + static_cast<int32_t>(threadIdx.x) / 32;
    if (slot >= cap)
    {
        return;
    }
    int32_t const lane = static_cast<int32_t>(threadIdx.x) % 32;
    int64_t const head = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    int32_t const index = a.keptIndices[head * cap + slot];
    int64_t const rowVectors = a.rowBytes / static_cast<int64_t>(sizeof(Vec));
    Vec const* keys = static_cast<Vec const*>(a.keys) + (head * a.shape.n + (index < 0 ? 0 : index)) * rowVectors;
    Vec const* values = static_cast<Vec const*>(a.values) + (head * a.shape.n + (index < 0 ? 0 : index)) * rowVectors;
    Vec* keptKeys = static_cast<Vec*>(a.keptKeys) + (head * cap + slot) * rowVectors;
    Vec* keptValues = static_cast<Vec*>(a.keptValues) + (head * cap + slot) * rowVectors;
    for (int64_t v = lane; v < rowVectors; v += 32)
    {
        Vec zero{};
        keptKeys[v] = index >= 0 ? keys[v] : zero;
        keptValues[v] = index >= 0 ? values[v] : zero;
    }
}

//! Top-k of independent rows (tests). grid (rows), block kSelectThreads.
__global__ void __launch_bounds__(kSelectThreads) topKRowsKernel(
    float const* scores, int64_t const* k, uint8_t* flags, int64_t len)
{
    __shared__ SelectSmem smem;
    int64_t const row = blockIdx.x;
    for (int64_t e = threadIdx.x; e < len; e += kSelectThreads)
    {
        flags[row * len + e] = 0;
    }
    __syncthreads();
    blockSelectTopK(scores + row * len, flags + row * len, len, len, 0, k[row], 1, smem);
}

cudaError_t launchScoresAndSelection(ScoreArgs const& a, cudaStream_t stream)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    if (m <= 0)
    {
        return cudaSuccess;
    }
    dim3 const scoreGrid(static_cast<uint32_t>((m + kScoreThreads - 1) / kScoreThreads),
        static_cast<uint32_t>(a.shape.kvHeads), static_cast<uint32_t>(a.shape.batch));
    groupScoresKernel<<<scoreGrid, kScoreThreads, 0, stream>>>(a);
    dim3 const headGrid(static_cast<uint32_t>(a.shape.kvHeads), static_cast<uint32_t>(a.shape.batch));
    if (sharedAllocation(a.config))
    {
        selectSharedKernel<<<static_cast<uint32_t>(a.shape.batch), kSelectThreads, 0, stream>>>(a);
        if (a.config.twoStage)
        {
            selectPerHeadKernel<<<headGrid, kSelectThreads, 0, stream>>>(a);
        }
    }
    else
    {
        selectPerHeadKernel<<<headGrid, kSelectThreads, 0, stream>>>(a);
    }
    return cudaGetLastError();
}

cudaError_t launchCompact(ScoreArgs const& a, cudaStream_t stream)
{
    dim3 const headGrid(static_cast<uint32_t>(a.shape.kvHeads), static_cast<uint32_t>(a.shape.batch));
    compactKernel<<<headGrid, kSelectThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launchGather(GatherArgs const& a, cudaStream_t stream)
{
    int32_t const cap = outputCapacity(a.config, a.shape.n);
    if (cap <= 0)
    {
        return cudaSuccess;
    }
    dim3 const grid(static_cast<uint32_t>((cap + kGatherWarps - 1) / kGatherWarps), static_cast<uint32_t>(a.shape.kvHeads),
        static_cast<uint32_t>(a.shape.batch));
    bool const vectorised = a.rowBytes % 16 == 0
        && (reinterpret_cast<uintptr_t>(a.keys) | reinterpret_cast<uintptr_t>(a.values)
               | reinterpret_cast<uintptr_t>(a.keptKeys) | reinterpret_cast<uintptr_t>(a.keptValues))
                % 16
            == 0;
    if (vectorised)
    {
        gatherKernel<uint4><<<grid, kGatherWarps * 32, 0, stream>>>(a);
    }
    else if (a.rowBytes % 4 == 0)
    {
        gatherKernel<uint32_t><<<grid, kGatherWarps * 32, 0, stream>>>(a);
    }
    else
    {
        gatherKernel<uint16_t><<<grid, kGatherWarps * 32, 0, stream>>>(a);
    }
    return cudaGetLastError();
}

} // namespace kernels

cudaError_t launchTopKRows(float const* scores, int64_t const* k, uint8_t* flags, int32_t rows, int64_t len,
    cudaStream_t stream)
{
    if (rows < 0 || len < 0)
    {
        return cudaErrorInvalidValue;
    }
    if (rows == 0 || len == 0)
    {
        return cudaSuccess;
    }
    kernels::topKRowsKernel<<<static_cast<uint32_t>(rows), kernels::kSelectThreads, 0, stream>>>(scores, k, flags, len);
    return cudaGetLastError();
}

} // namespace criticalkv
