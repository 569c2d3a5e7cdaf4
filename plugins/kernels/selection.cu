// Group scores, radix top-k selection, compaction and gather.
//
// Selection runs one thread block per row (a KV head, or for adakv/laprox the layer-wide row of all heads of a
// sequence): 4 radix passes of 8 bits over order-preserving keys of the fp32 scores (histograms in shared
// memory) find the key T of the k-th best candidate; candidates above T are kept, and among those equal to T
// the lowest indices win (a block-wide prefix count in index order): exactly the reference's tie rule.
// Each pass reads the row once (coalesced), so a row costs ~5 reads of m fp32 scores.
#include "criticalkv/defensive.h"
#include "criticalkv/group_scores.h"
#include "criticalkv/head_selection.h"
#include "criticalkv/kept_positions.h"
#include "criticalkv/kernels.h"
#include "criticalkv/radix_select.h"
#include "criticalkv/shared_allocation.h"
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
    unsigned long long sums[kRadixBins]; // radixMassCount's per-digit fixedMass sums (defensivekv)
    typename cub::BlockScan<int32_t, kSelectThreads>::TempStorage scan;
};

//! The radix select's data-parallel steps for one thread block (radix_select.h). Every thread of the block calls
//! them with the same arguments; the histogram is block-wide in shared memory and every thread reads it.
struct BlockRadixRow
{
    float const* scores;
    uint8_t* flags;
    int64_t len;
    int64_t period;
    int64_t firstValid;
    uint8_t mark;
    SelectSmem& s;

    __device__ bool candidate(int64_t e) const
    {
        return radixCandidate(flags, e, period, firstValid);
    }

    __device__ uint32_t const* histogram(int pass, uint32_t prefix, uint32_t prefixMask)
    {
        int32_t const tid = static_cast<int32_t>(threadIdx.x);
        __syncthreads(); // every thread is done reading the previous pass's histogram
        for (int32_t i = tid; i < kRadixBins; i += kSelectThreads)
        {
            s.histogram[i] = 0u;
        }
        __syncthreads();
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
        return s.histogram;
    }

    __device__ void markAll()
    {
        for (int64_t e = threadIdx.x; e < len; e += kSelectThreads)
        {
            if (candidate(e))
            {
                flags[e] = mark;
            }
        }
        __syncthreads();
    }

    __device__ void markBest(uint32_t threshold, int64_t remaining, int64_t atThreshold)
    {
        int32_t const tid = static_cast<int32_t>(threadIdx.x);
        if (remaining == atThreshold)
        {
            for (int64_t e = tid; e < len; e += kSelectThreads)
            {
                if (candidate(e) && orderedKey(scores[e]) >= threshold)
                {
                    flags[e] = mark;
                }
            }
            __syncthreads();
            return;
        }
        // Ties at the threshold: the first `remaining` of them in index order (a block-wide prefix count).
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
};

//! Mark with `mark` the k best candidates of scores[0, len): flags[e] == 0 and (e % period) >= firstValid.
//! Called by every thread of a kSelectThreads block with block-uniform arguments.
__device__ void blockSelectTopK(float const* scores, uint8_t* flags, int64_t len, int64_t period, int64_t firstValid,
    int64_t k, uint8_t mark, SelectSmem& s)
{
    BlockRadixRow row{scores, flags, len, period, firstValid, mark, s};
    radixSelectTopK(row, k);
}

// BEGIN block mass row (tests/plugins/test_plugin_kernel_emulation.py runs this section on the CPU)
//! radixMassCount's data-parallel step for one thread block (defensive.h): counts and fixedMass sums per digit (integer
//! atomics: the sums do not depend on the threads' order).
struct BlockMassRow
{
    float const* scores;
    uint8_t const* flags;
    int64_t len;
    int64_t period;
    int64_t firstValid;
    SelectSmem& s;

    __device__ MassHistogram massHistogram(int pass, uint32_t prefix, uint32_t prefixMask)
    {
        int32_t const tid = static_cast<int32_t>(threadIdx.x);
        __syncthreads(); // every thread is done reading the previous histogram
        for (int32_t i = tid; i < kRadixBins; i += kSelectThreads)
        {
            s.histogram[i] = 0u;
            s.sums[i] = 0ull;
        }
        __syncthreads();
        for (int64_t e = tid; e < len; e += kSelectThreads)
        {
            if (!radixCandidate(flags, e, period, firstValid))
            {
                continue;
            }
            uint32_t const key = orderedKey(scores[e]);
            if ((key & prefixMask) == prefix)
            {
                uint32_t const digit = radixDigit(key, pass);
                atomicAdd(&s.histogram[digit], 1u);
                atomicAdd(&s.sums[digit], static_cast<unsigned long long>(fixedMass(scores[e])));
            }
        }
        __syncthreads();
        return MassHistogram{s.histogram, s.sums};
    }
};
// END block mass row


//! The block-wide radix select as the flows' top-k primitive (select_flow.h), with defensivekv's steps.
struct BlockTopK
{
    SelectSmem& smem;
    __device__ void operator()(float const* scores, uint8_t* flags, int64_t len, int64_t period, int64_t firstValid,
        int64_t k, uint8_t mark) const
    {
        blockSelectTopK(scores, flags, len, period, firstValid, k, mark, smem);
    }

    __device__ int64_t massCount(float const* scores, uint8_t const* flags, int64_t len, int64_t period,
        int64_t firstValid, float limit) const
    {
        BlockMassRow row{scores, flags, len, period, firstValid, smem};
        return radixMassCount(row, limit);
    }

    __device__ void rankStage1(float const* defensive, uint8_t* flags, float* ranking, int64_t len) const
    {
        __syncthreads(); // the stage-1 marks are complete
        for (int64_t e = threadIdx.x; e < len; e += kSelectThreads)
        {
            ranking[e] = stage1Ranking(defensive[e], flags[e] != 0);
            flags[e] = 0;
        }
        __syncthreads();
    }
};

//! S, C and the LaProx importance of every older token. grid (ceil(m / kScoreThreads), H_kv, B).
__global__ void __launch_bounds__(kScoreThreads) groupScoresKernel(ScoreArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    if (!sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress)
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
    int64_t const sequence = static_cast<int64_t>(b) * a.shape.heads * m;
    GroupScores const scores = groupScoresAt(a.config, a.raw + sequence,
        a.squares != nullptr ? a.squares + sequence : nullptr, a.norms != nullptr ? a.norms + sequence : nullptr,
        g * group, group, m, i);
    int64_t const out = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m + i;
    a.attention[out] = scores.attention;
    if (a.critical != nullptr)
    {
        a.critical[out] = scores.critical;
    }
    if (a.laprox != nullptr)
    {
        a.laprox[out] = scores.laprox;
    }
}

//! defensivekv, per older token: the group's parts (defensive.h) into attention (worst), ranking (norm) and stage1
//! (attention), the scratch of the next two kernels. grid (ceil(m / kScoreThreads), H_kv, B).
__global__ void __launch_bounds__(kScoreThreads) defensivePartsKernel(ScoreArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int32_t const i = static_cast<int32_t>(blockIdx.x) * kScoreThreads + static_cast<int32_t>(threadIdx.x);
    if (!info.compress || i >= m)
    {
        return;
    }
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    int64_t const sequence = static_cast<int64_t>(b) * a.shape.heads * m;
    DefensiveParts const parts = defensivePartsAt(a.worst + sequence, a.raw + sequence, a.norms + sequence,
        g * group, group, m, info.validStart, i);
    int64_t const out = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m + i;
    a.attention[out] = parts.worst;
    a.ranking[out] = parts.norm;
    a.stage1[out] = parts.attention;
}

//! defensivekv, per KV head: the sums over its valid older tokens and its rows' window mass (double, block-reduced).
//! grid (H_kv, B), block kScoreThreads.
__global__ void __launch_bounds__(kScoreThreads) defensiveTotalsKernel(ScoreArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    if (!info.compress)
    {
        return;
    }
    using Reduce = cub::BlockReduce<double, kScoreThreads>;
    __shared__ typename Reduce::TempStorage storage;
    int32_t const w = windowLength(a.config, a.shape.n);
    int32_t const m = a.shape.n - w;
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    int64_t const row = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m;
    double worst = 0.0;
    double norm = 0.0;
    double attention = 0.0;
    double mass = 0.0;
    for (int32_t i = static_cast<int32_t>(threadIdx.x); i < m; i += kScoreThreads)
    {
        worst += i >= info.validStart ? a.attention[row + i] : 0.0F;
        norm += a.ranking[row + i];
        attention += a.stage1[row + i];
    }
    float2 const* rows = a.rowMass + (static_cast<int64_t>(b) * a.shape.heads + g * group) * w;
    for (int32_t r = static_cast<int32_t>(threadIdx.x); r < group * w; r += kScoreThreads)
    {
        mass += rows[r].x;
    }
    worst = Reduce(storage).Sum(worst);
    __syncthreads();
    norm = Reduce(storage).Sum(norm);
    __syncthreads();
    attention = Reduce(storage).Sum(attention);
    __syncthreads();
    mass = Reduce(storage).Sum(mass);
    if (threadIdx.x == 0)
    {
        a.totals[static_cast<int64_t>(b) * a.shape.kvHeads + g]
            = defensiveTotals(worst, norm, attention, mass, m - info.validStart, group * w);
    }
}

//! defensivekv, per older token: the defensive score (into attention) and the stage-1 mass (into stage1).
//! grid (ceil(m / kScoreThreads), H_kv, B).
__global__ void __launch_bounds__(kScoreThreads) defensiveFinishKernel(ScoreArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int32_t const i = static_cast<int32_t>(blockIdx.x) * kScoreThreads + static_cast<int32_t>(threadIdx.x);
    if (!sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress || i >= m)
    {
        return;
    }
    int64_t const head = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    int64_t const out = head * m + i;
    DefensiveParts const parts{a.attention[out], a.ranking[out], a.stage1[out]};
    DefensiveTotals const totals = a.totals[head];
    a.attention[out] = defensiveScore(parts, totals);
    a.stage1[out] = stage1MassOf(parts, totals);
}

//! defensivekv's selection of one sequence (defensive.h: stage 1 by mass, then the shared allocation).
//! grid (B), block kSelectThreads.
__global__ void __launch_bounds__(kSelectThreads) selectDefensiveKernel(ScoreArgs a)
{
    int32_t const b = static_cast<int32_t>(blockIdx.x);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    if (!info.compress)
    {
        return;
    }
    __shared__ SelectSmem smem;
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int32_t const heads = a.shape.kvHeads;
    int64_t const base = static_cast<int64_t>(b) * heads * m;
    for (int64_t e = threadIdx.x; e < static_cast<int64_t>(heads) * m; e += kSelectThreads)
    {
        a.flags[base + e] = 0;
    }
    __syncthreads();
    float const limit = stage1Limit(a.config, a.totals + static_cast<int64_t>(b) * heads, heads);
    BlockTopK topK{smem};
    selectDefensive(topK, a.config, a.attention + base, a.stage1 + base, a.ranking + base, a.flags + base, heads, m,
        info.validStart, info.r, limit);
}

//! Per-head selection (snapkv / pyramidkv, and the two stages of ada-criticalkv inside each head's share).
//! grid (H_kv, B), block kSelectThreads.
__global__ void __launch_bounds__(kSelectThreads) selectPerHeadKernel(ScoreArgs a)
{
    int32_t const g = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
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
    BlockTopK topK{smem};
    selectHead(topK, a.config, a.attention + row, a.critical != nullptr ? a.critical + row : nullptr, flags, m,
        info.validStart, count);
}

//! AdaKV / LaProx allocation of a layer's H_kv * r slots: every head's own top floor, then the best of the rest
//! over all heads (ties: lower head, then lower position). grid (B), block kSelectThreads.
__global__ void __launch_bounds__(kSelectThreads) selectSharedKernel(ScoreArgs a)
{
    int32_t const b = static_cast<int32_t>(blockIdx.x);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
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
    float const* ranking = sharedRanking(a.config, a.attention, a.laprox) + base;
    uint8_t* flags = a.flags + base;
    for (int64_t e = threadIdx.x; e < rowLength; e += kSelectThreads)
    {
        flags[e] = 0;
    }
    __syncthreads();
    BlockTopK topK{smem};
    selectShared(topK, a.config, ranking, flags, heads, m, info.validStart, info.r);
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
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    int32_t const n = a.shape.n;
    int32_t const m = n - windowLength(a.config, n);
    int32_t const cap = outputCapacity(a.config, n);
    int64_t const head = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    int32_t* indices = a.keptIndices + head * cap;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t count = fixedKeptCount(a.config, info);
    if (count >= 0)
    {
        for (int32_t slot = tid; slot < cap; slot += kSelectThreads)
        {
            indices[slot] = slot < count ? fixedKeptPosition(a.config, info, n, slot) : -1;
        }
    }
    else
    {
        count = 0;
        uint8_t const* flags = a.flags + head * m;
        for (int32_t base = 0; base < n; base += kSelectThreads)
        {
            int32_t const p = base + tid;
            int32_t const keep = p < n && scoredPositionKept(info, m, flags, p) ? 1 : 0;
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
    if (rowScores(a.config))
    {
        defensivePartsKernel<<<scoreGrid, kScoreThreads, 0, stream>>>(a);
        defensiveTotalsKernel<<<dim3(static_cast<uint32_t>(a.shape.kvHeads), static_cast<uint32_t>(a.shape.batch)),
            kScoreThreads, 0, stream>>>(a);
        defensiveFinishKernel<<<scoreGrid, kScoreThreads, 0, stream>>>(a);
        selectDefensiveKernel<<<static_cast<uint32_t>(a.shape.batch), kSelectThreads, 0, stream>>>(a);
        return cudaGetLastError();
    }
    groupScoresKernel<<<scoreGrid, kScoreThreads, 0, stream>>>(a);
    dim3 const headGrid(static_cast<uint32_t>(a.shape.kvHeads), static_cast<uint32_t>(a.shape.batch));
    if (sharedAllocation(a.config))
    {
        selectSharedKernel<<<static_cast<uint32_t>(a.shape.batch), kSelectThreads, 0, stream>>>(a);
        if (!a.config.twoStage)
        {
            return cudaGetLastError();
        }
    }
    if (a.pruned)
    {
        return cudaGetLastError(); // the per-head selection is launchPrunedStage2's (kernels/pruned.cu)
    }
    selectPerHeadKernel<<<headGrid, kSelectThreads, 0, stream>>>(a);
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
