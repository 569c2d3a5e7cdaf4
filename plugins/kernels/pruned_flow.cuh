// CriticalKV's pruned stage 2 on the GPU (docs/operator.md step 6a, "GPU"): the kernels of launchPrunedStage2
// (kernels/pruned.cu) and runPrunedStage2, their fixed launch sequence over a launcher, included by it and by the CPU
// emulation (testing/pruned_pipeline_emulation.cpp). Every step runs over all KV heads of the batch at once:
//
//   prepare: a plan kernel computes every head's counts (stage 1's, stage 2's k, the eligible tokens) and the
//     candidates of every round: c_r = min(2^(r+1) k, eligible) for r = 0 .. 3 (the last round, 4, takes every
//     eligible token left); stage 1 by S is one launchTopK call over the [B H_kv] rows, and one more call with
//     kPrunedCandidateLevels levels ranks the eligible tokens by U once for every round: a token among the best c_r
//     but not the best c_(r-1) is labelled kPrunedRound0 + r (the sets of the best c_r are nested, so the round-r
//     label is exactly what a top-k of c_r - c_(r-1) by U after the earlier rounds would pick); a list kernel (a thread
//     per token) lists round 0's candidates for the norm launch and finds the best bound left out (`following`);
//   then rounds, a no-op for every head already settled:
//     exact norms of every head's listed candidates (the tensor-core kernel over gathered rows, one launch);
//     their exact C (a thread per listed candidate: groupScoresAt over the norms written over their bounds);
//     the stop rule: a count over the whole grid of the candidates whose exact C clears following (1 + margin)
//       (stage2SettledByCount: the k-th exact score clears it iff k candidates do) and a thread per head deciding:
//       settled, or the next round, whose labelled tokens the list kernel lists;
//   finish: the k best candidates by exact C (ties: lower index) are kept by one launchTopK over the heads' rows, the
//     candidates relabelled to its eligible flag (0) before and the other eligible tokens (labels of rounds never
//     reached included) back to 0 after.
// The host enqueues a fixed number of rounds (kPrunedRounds: candidates 2k, 4k, 8k, 16k, then all), so nothing waits
// for the device and the launch is CUDA-graph capturable; every k is read on the device. Three top-k calls in all (the
// rounds' candidates used to take one call per round: seven calls).
//
// Flags during the flow (pruned_row.cuh): 0 an eligible token not (yet) a candidate, kPrunedRound0 + r a candidate of
// round r not yet listed, kPrunedCandidate its exact score known, kPrunedLeftOut parked during the finish's top-k.
// The old per-head form of these steps (a 512-thread block per head running the radix select over its row) is
// BlockPrunedRow (pruned_row.cuh), still the executor launchPrunedRow's tests compare with the host driver.
#pragma once

#include "criticalkv/budget.h"
#include "criticalkv/group_scores.h"
#include "criticalkv/methods.h"
#include "criticalkv/pruned_stage2.h"
#include "criticalkv/radix.h"
#include "criticalkv/selection_plan.h"
#include "pruned_row.cuh"
#include "select_flow_args.h"
#include "topk_block.cuh" // CKV_BLOCK_SHARED

namespace criticalkv::kernels
{

//! Doubling rounds after the first candidates; the last one takes every eligible token.
constexpr int32_t kPrunedRounds = 4;
static_assert(kPrunedCandidateLevels == kPrunedRounds && kPrunedRound0 + kPrunedRounds <= kPrunedFresh,
    "one top-k level and one flag per round before the last");

//! Threads of the flow's grid-wide kernels; the scans take kPrunedScanPerThread tokens per thread.
constexpr int kPrunedGridThreads = 256;
constexpr int32_t kPrunedScanPerThread = 8;
constexpr int32_t kPrunedChunk = kPrunedGridThreads * kPrunedScanPerThread;
static_assert(kPrunedScanPerThread <= 32, "a thread's picks fit a 32-bit mask");

//! Kernel-side arguments (a copy of PrunedStage2Params's device pointers).
struct PrunedFlowArgs
{
    SelectConfig config;
    SelectShape shape;
    RuntimeBudget budget;
    int32_t const* promptLengths;
    float const* raw;
    float const* squares;
    float const* norms;
    float const* attention;
    float const* critical;
    int32_t const* headCounts;
    float* exact;
    uint8_t* flags;
    int32_t* candidates;
    int32_t* candidateCounts;
    PrunedHeadState* states;
    float margin;
    PrunedPlan plan;
};

__device__ __forceinline__ int32_t olderTokens(PrunedFlowArgs const& a)
{
    return a.shape.n - windowLength(a.config, a.shape.n);
}

//! The KV head row (b H_kv + g) of a grid (x, H_kv, B).
__device__ __forceinline__ int64_t headOfBlock(PrunedFlowArgs const& a)
{
    return static_cast<int64_t>(blockIdx.z) * a.shape.kvHeads + static_cast<int64_t>(blockIdx.y);
}

//! Block-shared state of the scans.
struct PrunedScanSmem
{
    float best[kPrunedGridThreads];
    uint32_t counts[kPrunedGridThreads];
    uint32_t picked;
    int32_t base;
};

//! Prepare, a thread per KV head: the head's counts, its state, and the plan of the first two top-k calls.
//! grid (ceil(B H_kv / kPlanThreads)).
__global__ void __launch_bounds__(kPlanThreads) prunedPlanKernel(PrunedFlowArgs a)
{
    int32_t const row = static_cast<int32_t>(blockIdx.x) * kPlanThreads + static_cast<int32_t>(threadIdx.x);
    if (row >= a.shape.batch * a.shape.kvHeads)
    {
        return;
    }
    int32_t const b = row / a.shape.kvHeads;
    int32_t const m = olderTokens(a);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    PrunedHeadState state{0, 0, 0, 0, 1};
    int64_t first = 0;
    int64_t rounds[kPrunedCandidateLevels] = {};
    if (info.compress)
    {
        int64_t const count = a.headCounts != nullptr ? a.headCounts[row] : info.r;
        first = stage1Count(a.config.alphaMicros, count);
        int64_t const k = count - first;
        // stage 1 marks min(first, valid) of the valid tokens (every flag is 0 before it): the rest are eligible
        int64_t const valid = m > info.candidateStart ? m - info.candidateStart : 0;
        int64_t const eligible = valid - (first <= 0 ? 0 : (first < valid ? first : valid));
        if (k > 0 && k >= eligible)
        {
            rounds[0] = eligible; // stage 2 keeps every eligible token: the list kernel marks them kChosenByCritical
        }
        else if (k > 0)
        {
            int64_t c = kCandidateFactor * k < eligible ? kCandidateFactor * k : eligible;
            state = PrunedHeadState{k, eligible, c, 1, 0};
            for (int32_t r = 0; r < kPrunedCandidateLevels; ++r)
            {
                rounds[r] = c; // prunedDecideKernel's doubling: 2k, 4k, 8k, 16k (at most every eligible token)
                c = 2 * c < eligible ? 2 * c : eligible;
            }
        }
    }
    int32_t const heads = a.shape.batch * a.shape.kvHeads;
    a.states[row] = state;
    a.candidateCounts[row] = 0;
    a.plan.first[row] = first;
    for (int32_t r = 0; r < kPrunedCandidateLevels; ++r)
    {
        a.plan.rounds[static_cast<int64_t>(r) * heads + row] = rounds[r];
    }
    a.plan.next[row] = rounds[0];
    a.plan.keep[row] = state.active ? state.k : 0;
    a.plan.firstValid[row] = info.candidateStart;
    a.plan.following[row] = orderedKey(-INFINITY);
    a.plan.clearing[row] = 0u;
}

//! Round `round`'s candidates (labelled kPrunedRound0 + round by the top-k by U; the last round: every eligible token
//! left) are listed for the norm launch (any order: each candidate's norm and score is its own), and the best bound
//! among the eligible tokens left out (not yet candidates, later rounds' labels included) goes to plan.following (float
//! comparisons: a NaN bound is never the best, as in BlockPrunedRow::nextBound). A head whose stage 2 keeps every
//! eligible token gets them kChosenByCritical instead. grid (ceil(m / kPrunedChunk), H_kv, B).
__global__ void __launch_bounds__(kPrunedGridThreads) prunedListKernel(PrunedFlowArgs a, int32_t round)
{
    CKV_BLOCK_SHARED PrunedScanSmem s;
    int64_t const head = headOfBlock(a);
    if (a.plan.next[head] <= 0)
    {
        return; // nothing was picked for this head
    }
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const m = olderTokens(a);
    bool const active = a.states[head].active != 0;
    int32_t const validStart = a.plan.firstValid[head];
    int32_t const begin = static_cast<int32_t>(blockIdx.x) * kPrunedChunk;
    uint8_t* flags = a.flags + head * m;
    float const* bound = a.critical + head * m;
    uint32_t picked = 0u; // bit j: token begin + j kPrunedGridThreads + tid
    uint32_t mine = 0u;
    float best = -INFINITY;
    for (int32_t j = 0; j < kPrunedScanPerThread; ++j)
    {
        int32_t const e = begin + j * kPrunedGridThreads + tid;
        if (e < validStart || e >= m)
        {
            continue;
        }
        uint8_t const flag = flags[e];
        bool const labelled = flag >= kPrunedRound0 && flag < kPrunedRound0 + kPrunedRounds;
        bool const here = round < kPrunedRounds ? flag == kPrunedRound0 + round : (flag == 0 || labelled);
        if (here && active)
        {
            picked |= 1u << j;
            ++mine;
        }
        else if (here)
        {
            flags[e] = kChosenByCritical;
        }
        else if (flag == 0 || (labelled && flag > kPrunedRound0 + round))
        {
            float const x = bound[e];
            best = x > best ? x : best;
        }
    }
    if (!active)
    {
        return; // the same for every thread of the block
    }
    if (tid == 0)
    {
        s.picked = 0u;
    }
    __syncthreads();
    uint32_t const offset = mine > 0u ? atomicAdd(&s.picked, mine) : 0u;
    s.best[tid] = best;
    __syncthreads();
    for (int32_t stride = kPrunedGridThreads / 2; stride > 0; stride /= 2)
    {
        if (tid < stride && s.best[tid + stride] > s.best[tid])
        {
            s.best[tid] = s.best[tid + stride];
        }
        __syncthreads();
    }
    if (tid == 0)
    {
        s.base = s.picked > 0u ? atomicAdd(&a.candidateCounts[head], static_cast<int32_t>(s.picked)) : 0;
        if (s.best[0] > -INFINITY)
        {
            atomicMax(&a.plan.following[head], orderedKey(s.best[0]));
        }
    }
    __syncthreads();
    int32_t* list = a.candidates + head * m;
    int32_t slot = s.base + static_cast<int32_t>(offset);
    for (int32_t j = 0; j < kPrunedScanPerThread; ++j)
    {
        if ((picked >> j) & 1u)
        {
            list[slot++] = begin + j * kPrunedGridThreads + tid;
        }
    }
}

//! A round's exact scores, a thread per listed candidate (blockIdx.y = g, blockIdx.z = b): its exact C from the exact
//! norms the norm launch wrote over its bounds; the candidate's flag becomes kPrunedCandidate.
//! grid (ceil(listed / kPrunedGridThreads), H_kv, B).
__global__ void __launch_bounds__(kPrunedGridThreads) prunedScoreKernel(PrunedFlowArgs a)
{
    int32_t const position
        = static_cast<int32_t>(blockIdx.x) * kPrunedGridThreads + static_cast<int32_t>(threadIdx.x);
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    int32_t const m = olderTokens(a);
    int64_t const head = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    if (position >= a.candidateCounts[head])
    {
        return;
    }
    int32_t const i = a.candidates[head * m + position];
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    int64_t const sequence = static_cast<int64_t>(b) * a.shape.heads * m;
    a.exact[head * m + i] = groupScoresAt(a.config, a.raw + sequence,
        a.squares != nullptr ? a.squares + sequence : nullptr, a.norms + sequence, g * group, group, m, i)
                                .critical;
    a.flags[head * m + i] = kPrunedCandidate;
}

//! The stop rule's count (stage2SettledByCount) of the heads still ranking: plan.clearing += the candidates whose
//! exact C is not <= stopThreshold(following). grid (ceil(m / kPrunedChunk), H_kv, B).
__global__ void __launch_bounds__(kPrunedGridThreads) prunedCountKernel(PrunedFlowArgs a)
{
    CKV_BLOCK_SHARED PrunedScanSmem s;
    int64_t const head = headOfBlock(a);
    PrunedHeadState const state = a.states[head];
    float const following = orderedValue(a.plan.following[head]);
    if (!state.active || state.settled || following == -INFINITY)
    {
        return; // no count needed: settled either way
    }
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const m = olderTokens(a);
    int32_t const validStart = a.plan.firstValid[head];
    int32_t const begin = static_cast<int32_t>(blockIdx.x) * kPrunedChunk;
    uint8_t const* flags = a.flags + head * m;
    float const* exact = a.exact + head * m;
    float const threshold = stopThreshold(following, a.margin);
    uint32_t mine = 0u;
    for (int32_t j = 0; j < kPrunedScanPerThread; ++j)
    {
        int32_t const e = begin + j * kPrunedGridThreads + tid;
        if (e >= validStart && e < m && flags[e] == kPrunedCandidate && !(exact[e] <= threshold))
        {
            ++mine;
        }
    }
    s.counts[tid] = mine;
    __syncthreads();
    for (int32_t stride = kPrunedGridThreads / 2; stride > 0; stride /= 2)
    {
        if (tid < stride)
        {
            s.counts[tid] += s.counts[tid + stride];
        }
        __syncthreads();
    }
    if (tid == 0 && s.counts[0] > 0u)
    {
        atomicAdd(&a.plan.clearing[head], s.counts[0]);
    }
}

//! The stop rule of a round, a thread per KV head: settled, or the next round's count (plan.next; lastRound: every
//! eligible token), whose candidates the top-k by U labelled already. Resets the count, the best bound left out and the
//! list for the next step.
//! grid (ceil(B H_kv / kPlanThreads)).
__global__ void __launch_bounds__(kPlanThreads) prunedDecideKernel(PrunedFlowArgs a, int32_t lastRound)
{
    int32_t const row = static_cast<int32_t>(blockIdx.x) * kPlanThreads + static_cast<int32_t>(threadIdx.x);
    if (row >= a.shape.batch * a.shape.kvHeads)
    {
        return;
    }
    PrunedHeadState state = a.states[row];
    int64_t next = 0;
    if (state.active && !state.settled)
    {
        float const following = orderedValue(a.plan.following[row]);
        if (state.done >= state.eligible
            || stage2SettledByCount(following, static_cast<int64_t>(a.plan.clearing[row]), state.k, a.margin))
        {
            state.settled = 1;
        }
        else
        {
            int64_t const doubled = 2 * state.done < state.eligible ? 2 * state.done : state.eligible;
            int64_t const c = lastRound != 0 ? state.eligible : doubled;
            next = c - state.done;
            state.done = c;
        }
        a.states[row] = state;
    }
    a.plan.next[row] = next;
    a.plan.following[row] = orderedKey(-INFINITY);
    a.plan.clearing[row] = 0u;
    a.candidateCounts[row] = 0;
}

//! Around the finish's top-k by exact C, a thread per token of the heads with candidates (plan.keep > 0): before
//! (toRank), the candidates become its eligible tokens (0) and the other eligible tokens (0, or a label of a round the
//! head never reached) are parked (kPrunedLeftOut); after, the parked ones are eligible again (0).
//! grid (ceil(m / kPrunedGridThreads), H_kv, B).
__global__ void __launch_bounds__(kPrunedGridThreads) prunedRelabelKernel(PrunedFlowArgs a, int32_t toRank)
{
    int64_t const head = headOfBlock(a);
    int32_t const m = olderTokens(a);
    int32_t const e = static_cast<int32_t>(blockIdx.x) * kPrunedGridThreads + static_cast<int32_t>(threadIdx.x);
    if (a.plan.keep[head] <= 0 || e < a.plan.firstValid[head] || e >= m)
    {
        return;
    }
    uint8_t* flag = a.flags + head * m + e;
    if (toRank != 0)
    {
        bool const left = *flag == 0 || (*flag >= kPrunedRound0 && *flag < kPrunedRound0 + kPrunedRounds);
        *flag = left ? kPrunedLeftOut : (*flag == kPrunedCandidate ? 0 : *flag);
    }
    else if (*flag == kPrunedLeftOut)
    {
        *flag = 0;
    }
}

//! Upper bound of the candidates listed per head for norm launch `round` (known on the host): the first 2k, then the
//! new ones of each doubling (as many as were there), the last every remaining eligible token (at most m).
inline int32_t prunedListBound(int32_t round, int32_t maxK, int32_t m)
{
    if (round >= kPrunedRounds)
    {
        return m;
    }
    int64_t bound = static_cast<int64_t>(kCandidateFactor) * maxK;
    for (int32_t r = 2; r <= round; ++r)
    {
        bound *= 2;
    }
    return bound < m ? static_cast<int32_t>(bound) : m;
}

//! One top-k over every KV head's row of `scores` ([B H_kv] rows of m, the flow's flags and first valid positions);
//! levels > 1: k [levels, B H_kv], the level l set marked mark + l.
inline TopKRows prunedRows(PrunedFlowArgs const& a, float const* scores, int64_t const* k, uint8_t mark,
    int32_t levels = 1)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    return TopKRows{scores, a.flags, k, a.plan.firstValid, a.shape.batch * a.shape.kvHeads, m, m, m, mark, levels};
}

//! launchPrunedStage2's sequence (the top of this file) over a launcher (kernels/pruned.cu on a stream; the emulation
//! test on the CPU): maxCount bounds every head's k on the host.
//!   kernel(fn, grid, threads, args...)   fn<<<grid, threads, 0, stream>>>(args...)
//!   zero(pointer, bytes)                 cudaMemsetAsync
//!   topK(TopKRows) -> bool               launchTopK with the flow's scratch
//!   norms(listed)                        the exact L1 norms of every head's listed candidates (at most `listed`
//!                                        per head) written over their bounds
//! Returns false when a top-k call refuses its rows.
template <typename Launcher>
__host__ bool runPrunedStage2(PrunedFlowArgs const& a, int32_t maxCount, Launcher& launch)
{
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    if (m <= 0)
    {
        return true;
    }
    uint32_t const heads = static_cast<uint32_t>(a.shape.batch * a.shape.kvHeads);
    uint32_t const kvHeads = static_cast<uint32_t>(a.shape.kvHeads);
    uint32_t const batch = static_cast<uint32_t>(a.shape.batch);
    Grid3 const perHead{(heads + kPlanThreads - 1) / kPlanThreads, 1, 1};
    Grid3 const scan{static_cast<uint32_t>((m + kPrunedChunk - 1) / kPrunedChunk), kvHeads, batch};
    Grid3 const perToken{static_cast<uint32_t>((m + kPrunedGridThreads - 1) / kPrunedGridThreads), kvHeads, batch};

    launch.zero(a.flags, static_cast<size_t>(heads) * static_cast<size_t>(m));
    launch.kernel(prunedPlanKernel, perHead, kPlanThreads, a);
    if (!launch.topK(prunedRows(a, a.attention, a.plan.first, kChosenByAttention))
        || !launch.topK(prunedRows(a, a.critical, a.plan.rounds, kPrunedRound0, kPrunedCandidateLevels)))
    {
        return false;
    }
    launch.kernel(prunedListKernel, scan, kPrunedGridThreads, a, 0);
    int32_t const maxK = maxCount < m ? maxCount : m;
    for (int32_t round = 0; round <= kPrunedRounds; ++round)
    {
        int32_t const listed = prunedListBound(round, maxK, m);
        if (listed > 0)
        {
            launch.norms(listed);
            Grid3 const scores{static_cast<uint32_t>((listed + kPrunedGridThreads - 1) / kPrunedGridThreads), kvHeads,
                batch};
            launch.kernel(prunedScoreKernel, scores, kPrunedGridThreads, a);
        }
        if (round < kPrunedRounds)
        {
            launch.kernel(prunedCountKernel, scan, kPrunedGridThreads, a);
            launch.kernel(prunedDecideKernel, perHead, kPlanThreads, a, round == kPrunedRounds - 1 ? 1 : 0);
            launch.kernel(prunedListKernel, scan, kPrunedGridThreads, a, round + 1);
        }
    }
    launch.kernel(prunedRelabelKernel, perToken, kPrunedGridThreads, a, 1);
    if (!launch.topK(prunedRows(a, a.exact, a.plan.keep, kChosenByCritical)))
    {
        return false;
    }
    launch.kernel(prunedRelabelKernel, perToken, kPrunedGridThreads, a, 0);
    return true;
}

} // namespace criticalkv::kernels
