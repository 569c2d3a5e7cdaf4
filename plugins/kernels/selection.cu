// Group scores, the selection stages, compaction and gather.
//
// Every non-pruned selection flow (per head, shared allocation, defensivekv) is select_flows.cuh's fixed sequence of
// plan kernels and batched top-k launches (launchTopK, kernels/topk.cu) over all rows of the batch; the pruned
// stage 2 of CriticalKV (prunedStage2On) has its own block executor below ("pruned row", "pruned pipeline").
#include "criticalkv/defensive.h"
#include "criticalkv/group_scores.h"
#include "criticalkv/head_selection.h"
#include "criticalkv/kept_positions.h"
#include "criticalkv/kernels.h"
#include "criticalkv/pruned_stage2.h"
#include "criticalkv/radix_select.h"
#include "device_utils.cuh"
#include "select_flows.cuh"
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

// BEGIN pruned row (tests/plugins/test_plugin_kernel_emulation.py runs this section on the CPU)
// prunedStage2's block executor (pruned_stage2.h) for one KV head's row: simple steps (per-element shared atomics,
// ties at the radix threshold marked by thread 0, block reductions through shared memory). Flags during the flow:
// 0 eligible non-candidate, kPrunedFresh just picked, kPrunedCandidate exact score known, kPrunedLeftOut parked.
// The pipeline runs it with exact norms computed by the block ("pruned pipeline" below); the emulation checks it
// against the host driver's executor (host/pruned_row_host.h).
enum PrunedFlag : uint8_t
{
    kPrunedFresh = 253,
    kPrunedCandidate = 254,
    kPrunedLeftOut = 255,
};

struct PrunedSmem
{
    uint32_t histogram[kRadixBins];
    float partial[kSelectThreads];
    float result;
    uint32_t count;
};

//! radix_select.h's executor over the tokens e >= firstValid with flags[e] == match; marks with `mark`.
struct BlockMatchRadix
{
    float const* scores;
    uint8_t* flags;
    int64_t len;
    int64_t firstValid;
    uint8_t match;
    uint8_t mark;
    PrunedSmem& s;

    __device__ bool candidate(int64_t e) const
    {
        return e >= firstValid && flags[e] == match;
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
        for (int64_t e = tid; e < len; e += kSelectThreads)
        {
            if (candidate(e))
            {
                uint32_t const key = orderedKey(scores[e]);
                if ((key & prefixMask) == prefix)
                {
                    atomicAdd(&s.histogram[radixDigit(key, pass)], 1u);
                }
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
        (void) atThreshold;
        for (int64_t e = threadIdx.x; e < len; e += kSelectThreads)
        {
            if (candidate(e) && orderedKey(scores[e]) > threshold)
            {
                flags[e] = mark;
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) // the first `remaining` ties in index order
        {
            for (int64_t e = 0; e < len && remaining > 0; ++e)
            {
                if (candidate(e) && orderedKey(scores[e]) == threshold)
                {
                    flags[e] = mark;
                    --remaining;
                }
            }
        }
        __syncthreads();
    }
};

//! exactScore(i): __device__ float, token i's exact group score C, called by the one thread that owns token i.
//! exact: [m] scratch, valid at the candidates.
template <typename ExactScore>
struct BlockPrunedRow
{
    ExactScore& exactScore;
    float const* bound;
    float* exact;
    uint8_t* flags;
    int32_t m;
    int32_t validStart;
    PrunedSmem& s;

    //! Largest (or smallest) of values[e] over the tokens flagged `match`; +-inf when there is none.
    __device__ float extreme(float const* values, uint8_t match, bool largest)
    {
        int32_t const tid = static_cast<int32_t>(threadIdx.x);
        float best = largest ? -INFINITY : INFINITY;
        for (int64_t e = validStart + tid; e < m; e += kSelectThreads)
        {
            if (flags[e] == match)
            {
                float const x = values[e];
                best = (largest ? x > best : x < best) ? x : best;
            }
        }
        s.partial[tid] = best;
        __syncthreads();
        if (tid == 0)
        {
            float total = s.partial[0];
            for (int32_t t = 1; t < kSelectThreads; ++t)
            {
                float const x = s.partial[t];
                total = (largest ? x > total : x < total) ? x : total;
            }
            s.result = total;
        }
        __syncthreads();
        float const result = s.result;
        __syncthreads(); // s.result may be rewritten by the next call
        return result;
    }

    __device__ void relabel(uint8_t from, uint8_t to)
    {
        for (int64_t e = validStart + threadIdx.x; e < m; e += kSelectThreads)
        {
            if (flags[e] == from)
            {
                flags[e] = to;
            }
        }
        __syncthreads();
    }

    __device__ void addCandidates(int64_t count)
    {
        BlockMatchRadix pick{bound, flags, m, validStart, 0, kPrunedFresh, s};
        radixSelectTopK(pick, count);
        __syncthreads();
        for (int64_t e = validStart + threadIdx.x; e < m; e += kSelectThreads)
        {
            if (flags[e] == kPrunedFresh)
            {
                exact[e] = exactScore(static_cast<int32_t>(e));
                flags[e] = kPrunedCandidate;
            }
        }
        __syncthreads();
    }

    __device__ float nextBound()
    {
        return extreme(bound, 0, true);
    }

    __device__ float kthExact(int64_t k)
    {
        BlockMatchRadix pick{exact, flags, m, validStart, kPrunedCandidate, kPrunedFresh, s};
        radixSelectTopK(pick, k);
        __syncthreads();
        float const kth = extreme(exact, kPrunedFresh, false);
        relabel(kPrunedFresh, kPrunedCandidate);
        return kth;
    }

    __device__ void keepBest(int64_t k)
    {
        relabel(0, kPrunedLeftOut);
        relabel(kPrunedCandidate, 0);
        BlockMatchRadix pick{exact, flags, m, validStart, 0, kChosenByCritical, s};
        radixSelectTopK(pick, k);
        __syncthreads();
        relabel(kPrunedLeftOut, 0);
    }
};
// END pruned row

// BEGIN pruned pipeline (tests/plugins/test_plugin_kernel_emulation.py runs this section on the CPU)
// Both stages of one KV head with the pruned stage 2, as the host driver's selectHeadPruned, in three launches:
//   1. prunedPrepare (one block per head): stage 1 by S (the radix select over the row); k <= 0 or k >= the eligible
//      count ends the head here; else the first c = min(2k, eligible) candidates by U are flagged kPrunedFresh;
//   2. prunedExactAt (one thread per flagged token, over the whole grid: most heads stop after this first round, and
//      its exact norms, the bulk of the work, then use every SM): the token's exact score;
//   3. prunedFinish (one block per head): prunedStage2 with BlockPrunedRow, its first round already done; a
//      doubling round computes the new candidates' exact scores in the block.
// A token's exact score is the group's exact L1 norms (projectedL1Norm: the host driver's loops and floats) written
// over their bounds in `norms`, then C (groupScoresAt) in the host's order: the same float whichever thread computes
// it, so the kept set is the host driver's, bit for bit.
struct PrunedPipelineArgs
{
    SelectConfig config;
    SelectShape shape;
    float const* raw;       // [B, H, m]
    float const* squares;   // [B, H, m] or nullptr
    float* norms;           // [B, H, m]: the bounds; the exact norms of the candidates are written over them
    float const* attention; // [B, H_kv, m] S
    float const* critical;  // [B, H_kv, m] U: the group score of the bounds
    float* exact;           // [B, H_kv, m] scratch: the candidates' exact C
    uint8_t* flags;         // [B, H_kv, m]
    void const* values;     // [B, H_kv, n, d_h]
    void const* oProj;      // [hidden, H * d_h]
    float margin;           // stopMargin(hidden, group)
};

//! The exact C of older token i of KV head g of sequence b, by one thread (its group's norms written into norms).
template <typename T>
__device__ float prunedExactScore(PrunedPipelineArgs const& a, int32_t b, int32_t g, int32_t i)
{
    int32_t const n = a.shape.n;
    int32_t const d = a.shape.headDim;
    int32_t const m = n - windowLength(a.config, n);
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    int64_t const sequence = static_cast<int64_t>(b) * a.shape.heads * m;
    int64_t const ld = static_cast<int64_t>(a.shape.heads) * d;
    T const* v = static_cast<T const*>(a.values) + ((static_cast<int64_t>(b) * a.shape.kvHeads + g) * n + i) * d;
    auto value = [v](int32_t k) { return toFloat(v[k]); };
    for (int32_t h = g * group; h < (g + 1) * group; ++h)
    {
        T const* w = static_cast<T const*>(a.oProj) + static_cast<int64_t>(h) * d;
        auto weight = [w, ld](int32_t c, int32_t k) { return toFloat(w[c * ld + k]); };
        a.norms[sequence + static_cast<int64_t>(h) * m + i] = projectedL1Norm(value, weight, d, a.shape.hidden);
    }
    return groupScoresAt(a.config, a.raw + sequence, a.squares != nullptr ? a.squares + sequence : nullptr,
        a.norms + sequence, g * group, group, m, i)
        .critical;
}

//! The tokens of [validStart, m) whose flag is `match` or `also`, counted by the block (every thread gets it).
__device__ int64_t blockCountFlags(uint8_t const* flags, int32_t validStart, int32_t m, uint8_t match, uint8_t also,
    PrunedSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    __syncthreads(); // s.count is free
    if (tid == 0)
    {
        s.count = 0u;
    }
    __syncthreads();
    uint32_t mine = 0u;
    for (int32_t i = validStart + tid; i < m; i += kSelectThreads)
    {
        mine += flags[i] == match || flags[i] == also ? 1u : 0u;
    }
    atomicAdd(&s.count, mine);
    __syncthreads();
    return static_cast<int64_t>(s.count);
}

//! Launch 1 for KV head g of sequence b keeping `count` older tokens (flags cleared here). Every thread of a
//! kSelectThreads block calls it with the same arguments.
__device__ void prunedPrepare(PrunedPipelineArgs const& a, int32_t b, int32_t g, int32_t validStart, int64_t count,
    PrunedSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int64_t const row = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m;
    uint8_t* flags = a.flags + row;
    for (int32_t i = tid; i < m; i += kSelectThreads)
    {
        flags[i] = 0;
    }
    __syncthreads();
    int64_t const first = stage1Count(a.config.alphaMicros, count);
    BlockMatchRadix stage1{a.attention + row, flags, m, validStart, 0, kChosenByAttention, s};
    radixSelectTopK(stage1, first);
    __syncthreads();
    int64_t const k = count - first;
    if (k <= 0)
    {
        return;
    }
    int64_t const eligible = blockCountFlags(flags, validStart, m, 0, 0, s);
    if (k >= eligible)
    {
        for (int32_t i = validStart + tid; i < m; i += kSelectThreads)
        {
            if (flags[i] == 0)
            {
                flags[i] = kChosenByCritical;
            }
        }
        __syncthreads();
        return;
    }
    // prunedStage2's first round: the best min(2k, eligible) by U (ties: lower index)
    int64_t const candidates = kCandidateFactor * k < eligible ? kCandidateFactor * k : eligible;
    BlockMatchRadix pick{a.critical + row, flags, m, validStart, 0, kPrunedFresh, s};
    radixSelectTopK(pick, candidates);
    __syncthreads();
}

//! Launch 2, one thread per older token i of KV head g of sequence b: a first-round candidate gets its exact score.
template <typename T>
__device__ void prunedExactAt(PrunedPipelineArgs const& a, int32_t b, int32_t g, int32_t i)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int64_t const at = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m + i;
    if (a.flags[at] == kPrunedFresh)
    {
        a.exact[at] = prunedExactScore<T>(a, b, g, i);
        a.flags[at] = kPrunedCandidate;
    }
}

//! prunedStage2's executor whose first addCandidates (launches 1 and 2) is already done.
template <typename Exec>
struct FirstRoundDone
{
    Exec& exec;
    bool pending;

    __device__ void addCandidates(int64_t count)
    {
        if (pending)
        {
            pending = false;
            return;
        }
        exec.addCandidates(count);
    }

    __device__ float nextBound()
    {
        return exec.nextBound();
    }

    __device__ float kthExact(int64_t k)
    {
        return exec.kthExact(k);
    }

    __device__ void keepBest(int64_t k)
    {
        exec.keepBest(k);
    }
};

//! Launch 3 for KV head g of sequence b (the arguments of launch 1). Returns how many tokens got their exact score.
template <typename T>
__device__ int64_t prunedFinish(PrunedPipelineArgs const& a, int32_t b, int32_t g, int32_t validStart, int64_t count,
    PrunedSmem& s)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int64_t const row = (static_cast<int64_t>(b) * a.shape.kvHeads + g) * m;
    uint8_t* flags = a.flags + row;
    int64_t const k = count - stage1Count(a.config.alphaMicros, count);
    if (k <= 0)
    {
        return 0;
    }
    // the eligible tokens: neither chosen by stage 1 nor, when launch 1 kept them all, by stage 2 (then 0 here)
    int64_t const eligible = blockCountFlags(flags, validStart, m, 0, kPrunedCandidate, s);
    if (k >= eligible)
    {
        return 0;
    }
    auto exactScore = [&](int32_t i) { return prunedExactScore<T>(a, b, g, i); };
    BlockPrunedRow<decltype(exactScore)> pruned{exactScore, a.critical + row, a.exact + row, flags, m, validStart, s};
    FirstRoundDone<decltype(pruned)> resumed{pruned, true};
    return prunedStage2(resumed, k, eligible, a.margin);
}
// END pruned pipeline

//! prunedStage2 run by one block on precomputed exact scores `scores` (exact: [m] scratch; done: how many got their
//! exact score). For the GPU tests (launchPrunedRow); the pipeline runs the same executor in prunedFinishKernel.
__global__ void __launch_bounds__(kSelectThreads) prunedRowKernel(float const* bound, float const* scores,
    float* exact, uint8_t* flags, int32_t m, int32_t validStart, int64_t k, int64_t eligible, float margin,
    int64_t* done)
{
    __shared__ PrunedSmem smem;
    auto score = [scores](int32_t i) { return scores[i]; };
    BlockPrunedRow<decltype(score)> row{score, bound, exact, flags, m, validStart, smem};
    int64_t const count = prunedStage2(row, k, eligible, margin);
    if (threadIdx.x == 0)
    {
        *done = count;
    }
}

PrunedPipelineArgs prunedArgs(ScoreArgs const& a)
{
    return PrunedPipelineArgs{a.config, a.shape, a.raw, a.squares, a.exactNorms, a.attention, a.critical, a.exact,
        a.flags, a.values, a.oProj, a.margin};
}

__device__ int64_t headCount(ScoreArgs const& a, SequenceInfo const& info, int32_t b, int32_t g)
{
    return sharedAllocation(a.config) ? a.headCounts[static_cast<int64_t>(b) * a.shape.kvHeads + g] : info.r;
}

//! The pruned two-stage policies (prunedStage2On: criticalkv, pyramid-criticalkv, and ada-criticalkv inside each
//! head's share), launch 1: stage 1 and the first candidates. grid (H_kv, B), block kSelectThreads.
__global__ void __launch_bounds__(kSelectThreads) prunedPrepareKernel(ScoreArgs a, PrunedPipelineArgs p)
{
    int32_t const g = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    if (!info.compress)
    {
        return;
    }
    __shared__ PrunedSmem smem;
    prunedPrepare(p, b, g, info.validStart, headCount(a, info, b, g), smem);
}

//! Launch 2: the first candidates' exact scores. grid (ceil(m / kScoreThreads), H_kv, B).
template <typename T>
__global__ void __launch_bounds__(kScoreThreads) prunedExactKernel(ScoreArgs a, PrunedPipelineArgs p)
{
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    int32_t const i = static_cast<int32_t>(blockIdx.x) * kScoreThreads + static_cast<int32_t>(threadIdx.x);
    if (i >= m || !sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress)
    {
        return;
    }
    prunedExactAt<T>(p, b, g, i);
}

//! Launch 3: the stop rule, doubling rounds, the k kept. grid (H_kv, B), block kSelectThreads.
template <typename T>
__global__ void __launch_bounds__(kSelectThreads) prunedFinishKernel(ScoreArgs a, PrunedPipelineArgs p)
{
    int32_t const g = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    if (!info.compress)
    {
        return;
    }
    __shared__ PrunedSmem smem;
    prunedFinish<T>(p, b, g, info.validStart, headCount(a, info, b, g), smem);
}

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

//! Ascending kept positions of every head (-1 padded) and their count. grid (H_kv, B), block kSelectThreads.
__global__ void __launch_bounds__(kSelectThreads) compactKernel(CompactArgs a)
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

namespace
{

//! select_flows.cuh's launcher on a stream.
struct FlowLaunch
{
    void* scratch;
    size_t scratchBytes;
    cudaStream_t stream;
    cudaError_t status = cudaSuccess;

    template <typename... Params, typename... Args>
    void kernel(void (*fn)(Params...), Grid3 grid, int threads, Args const&... args)
    {
        if (status == cudaSuccess)
        {
            fn<<<dim3(grid.x, grid.y, grid.z), threads, 0, stream>>>(args...);
            status = cudaGetLastError();
        }
    }

    void zero(void* pointer, size_t bytes)
    {
        if (status == cudaSuccess && bytes > 0)
        {
            status = cudaMemsetAsync(pointer, 0, bytes, stream);
        }
    }

    bool topK(TopKRows const& rows)
    {
        if (status == cudaSuccess)
        {
            status = launchTopK(rows, scratch, scratchBytes, stream);
        }
        return status == cudaSuccess;
    }

    bool massCount(TopKRows const& rows, float const* limit, int64_t* count)
    {
        if (status == cudaSuccess)
        {
            status = launchMassCount(rows, limit, count, scratch, scratchBytes, stream);
        }
        return status == cudaSuccess;
    }

    cudaError_t finish(bool accepted) const
    {
        return status != cudaSuccess ? status : (accepted ? cudaSuccess : cudaErrorInvalidValue);
    }
};

dim3 scoreGridOf(ScoreArgs const& a, int32_t m)
{
    return dim3(static_cast<uint32_t>((m + kScoreThreads - 1) / kScoreThreads), static_cast<uint32_t>(a.shape.kvHeads),
        static_cast<uint32_t>(a.shape.batch));
}

} // namespace

cudaError_t launchGroupScores(ScoreArgs const& a, cudaStream_t stream)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    if (m <= 0)
    {
        return cudaSuccess;
    }
    groupScoresKernel<<<scoreGridOf(a, m), kScoreThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launchDefensiveScores(ScoreArgs const& a, cudaStream_t stream)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    if (m <= 0)
    {
        return cudaSuccess;
    }
    dim3 const scoreGrid = scoreGridOf(a, m);
    defensivePartsKernel<<<scoreGrid, kScoreThreads, 0, stream>>>(a);
    defensiveTotalsKernel<<<dim3(static_cast<uint32_t>(a.shape.kvHeads), static_cast<uint32_t>(a.shape.batch)),
        kScoreThreads, 0, stream>>>(a);
    defensiveFinishKernel<<<scoreGrid, kScoreThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launchSelection(SelectionArgs const& a, cudaStream_t stream)
{
    FlowLaunch launch{a.rows.plan.scratch, a.rows.plan.scratchBytes, stream};
    bool const accepted = runSelection(a, launch);
    return launch.finish(accepted);
}

cudaError_t launchSharedAllocation(SelectionArgs const& a, cudaStream_t stream)
{
    FlowLaunch launch{a.rows.plan.scratch, a.rows.plan.scratchBytes, stream};
    bool const accepted = runSharedStage(a, launch);
    return launch.finish(accepted);
}

cudaError_t launchDefensiveSelection(DefensiveSelectionArgs const& a, cudaStream_t stream)
{
    FlowLaunch launch{a.rows.plan.scratch, a.rows.plan.scratchBytes, stream};
    bool const accepted = runDefensiveSelection(a, launch);
    return launch.finish(accepted);
}

cudaError_t launchPrunedSelection(ScoreArgs const& a, cudaStream_t stream)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    if (m <= 0)
    {
        return cudaSuccess;
    }
    dim3 const scoreGrid = scoreGridOf(a, m);
    dim3 const headGrid(static_cast<uint32_t>(a.shape.kvHeads), static_cast<uint32_t>(a.shape.batch));
    PrunedPipelineArgs const p = prunedArgs(a);
    prunedPrepareKernel<<<headGrid, kSelectThreads, 0, stream>>>(a, p);
    cudaError_t const status = dispatchDType(a.dtype, [&](auto tag) {
        using T = decltype(tag);
        prunedExactKernel<T><<<scoreGrid, kScoreThreads, 0, stream>>>(a, p);
        prunedFinishKernel<T><<<headGrid, kSelectThreads, 0, stream>>>(a, p);
        return cudaSuccess;
    });
    if (status != cudaSuccess)
    {
        return status;
    }
    return cudaGetLastError();
}

cudaError_t launchCompact(CompactArgs const& a, cudaStream_t stream)
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

cudaError_t launchPrunedRow(float const* bound, float const* scores, float* exact, uint8_t* flags, int32_t m,
    int32_t validStart, int64_t k, int64_t eligible, float margin, int64_t* done, cudaStream_t stream)
{
    if (m <= 0 || validStart < 0 || k <= 0 || k >= eligible || eligible > m)
    {
        return cudaErrorInvalidValue;
    }
    kernels::prunedRowKernel<<<1, kernels::kSelectThreads, 0, stream>>>(
        bound, scores, exact, flags, m, validStart, k, eligible, margin, done);
    return cudaGetLastError();
}

} // namespace criticalkv
