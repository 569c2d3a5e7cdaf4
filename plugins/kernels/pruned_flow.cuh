// CriticalKV's pruned stage 2 on the GPU (docs/operator.md step 6a, "GPU"): the per-head and per-candidate steps of
// launchPrunedStage2 (kernels/pruned.cu), included by it and by the CPU emulation (testing/pruned_pipeline_emulation.cpp).
//
//   prepare (a block per KV head): stage 1 by S; k <= 0 or k >= the eligible count ends the head; else the best
//     c = min(2k, eligible) by U become candidates, listed for the norm launch;
//   then rounds, each three launches over the whole grid, a no-op for every head already settled:
//     exact norms of every head's listed candidates (the tensor-core kernel over gathered rows, one launch);
//     their exact C (a thread per listed candidate: groupScoresAt over the norms written over their bounds);
//     the stop rule (a block per head): settled when the best bound left out, times 1 + margin, is below the k-th
//     exact C, or when every eligible token is a candidate; else the next candidates by U (c doubles; the last round
//     takes every eligible token) are listed;
//   finish (a block per head): the k best candidates by exact C (ties: lower index) are kept.
// The host enqueues a fixed number of rounds (kPrunedRounds: candidates 2k, 4k, 8k, 16k, then all), so nothing waits
// for the device and the launch is CUDA-graph capturable; k is read on the device. Every top-k of the flow goes
// through PrunedTopK (the seam where the batched top-k primitive will come in).
#pragma once

#include "criticalkv/budget.h"
#include "criticalkv/group_scores.h"
#include "criticalkv/methods.h"
#include "criticalkv/pruned_stage2.h"
#include "pruned_row.cuh"

namespace criticalkv::kernels
{

//! Doubling rounds after the first candidates; the last one takes every eligible token.
constexpr int32_t kPrunedRounds = 4;

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
};

//! The flow's top-k calls in one place: mark with `mark` the `count` best of scores among the tokens of
//! [firstValid, m) flagged `match` (ties: lower index), by the block's radix select.
struct PrunedTopK
{
    PrunedSmem& s;

    __device__ void operator()(float const* scores, uint8_t* flags, int32_t m, int32_t firstValid, uint8_t match,
        uint8_t mark, int64_t count) const
    {
        BlockMatchRadix pick{scores, flags, m, firstValid, match, mark, s};
        radixSelectTopK(pick, count);
        __syncthreads();
    }
};

__device__ __forceinline__ int32_t olderTokens(PrunedFlowArgs const& a)
{
    return a.shape.n - windowLength(a.config, a.shape.n);
}

//! Tokens of [validStart, m) flagged `match`, counted by the block (every thread gets it).
__device__ __forceinline__ int64_t countFlagged(uint8_t const* flags, int32_t validStart, int32_t m, uint8_t match,
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
    for (int32_t i = validStart + tid; i < m; i += kPrunedThreads)
    {
        mine += flags[i] == match ? 1u : 0u;
    }
    atomicAdd(&s.count, mine);
    __syncthreads();
    int64_t const total = static_cast<int64_t>(s.count);
    __syncthreads();
    return total;
}

//! The tokens flagged kPrunedFresh into list (any order: each candidate's norm and score is its own); returns the count.
__device__ __forceinline__ int32_t listFresh(uint8_t const* flags, int32_t validStart, int32_t m, int32_t* list,
    PrunedSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    __syncthreads();
    if (tid == 0)
    {
        s.count = 0u;
    }
    __syncthreads();
    for (int32_t i = validStart + tid; i < m; i += kPrunedThreads)
    {
        if (flags[i] == kPrunedFresh)
        {
            list[atomicAdd(&s.count, 1u)] = i;
        }
    }
    __syncthreads();
    int32_t const total = static_cast<int32_t>(s.count);
    __syncthreads();
    return total;
}

//! Largest (or smallest) of values over the tokens flagged `match` (-inf / +inf when none), by the block.
__device__ __forceinline__ float flaggedExtreme(float const* values, uint8_t const* flags, int32_t validStart, int32_t m,
    uint8_t match, bool largest, PrunedSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    float best = largest ? -INFINITY : INFINITY;
    for (int32_t e = validStart + tid; e < m; e += kPrunedThreads)
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
        for (int32_t t = 1; t < kPrunedThreads; ++t)
        {
            float const x = s.partial[t];
            total = (largest ? x > total : x < total) ? x : total;
        }
        s.result = total;
    }
    __syncthreads();
    float const result = s.result;
    __syncthreads();
    return result;
}

__device__ __forceinline__ void relabelFlags(uint8_t* flags, int32_t validStart, int32_t m, uint8_t from, uint8_t to)
{
    for (int32_t e = validStart + static_cast<int32_t>(threadIdx.x); e < m; e += kPrunedThreads)
    {
        if (flags[e] == from)
        {
            flags[e] = to;
        }
    }
    __syncthreads();
}

//! Launch 1, a block per KV head (blockIdx.x = g, blockIdx.y = b): stage 1 and the first candidates.
__device__ void prunedPrepareHead(PrunedFlowArgs const& a, PrunedSmem& s)
{
    int32_t const g = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const m = olderTokens(a);
    int64_t const head = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    PrunedHeadState state{0, 0, 0, 0, 1};
    int32_t listed = 0;
    if (info.compress)
    {
        int64_t const count = a.headCounts != nullptr ? a.headCounts[head] : info.r;
        uint8_t* flags = a.flags + head * m;
        for (int32_t i = tid; i < m; i += kPrunedThreads)
        {
            flags[i] = 0;
        }
        __syncthreads();
        PrunedTopK const topK{s};
        int64_t const first = stage1Count(a.config.alphaMicros, count);
        topK(a.attention + head * m, flags, m, info.validStart, 0, kChosenByAttention, first);
        int64_t const k = count - first;
        int64_t const eligible = k > 0 ? countFlagged(flags, info.validStart, m, 0, s) : 0;
        if (k > 0 && k >= eligible)
        {
            relabelFlags(flags, info.validStart, m, 0, kChosenByCritical); // stage 2 keeps every eligible token
        }
        else if (k > 0)
        {
            int64_t const c = kCandidateFactor * k < eligible ? kCandidateFactor * k : eligible;
            topK(a.critical + head * m, flags, m, info.validStart, 0, kPrunedFresh, c);
            listed = listFresh(flags, info.validStart, m, a.candidates + head * m, s);
            state = PrunedHeadState{k, eligible, c, 1, 0};
        }
    }
    if (tid == 0)
    {
        a.states[head] = state;
        a.candidateCounts[head] = listed;
    }
}

//! Launch 2 of a round, a thread per listed candidate (blockIdx.y = g, blockIdx.z = b): its exact C from the exact
//! norms the norm launch wrote over its bounds; the candidate's flag becomes kPrunedCandidate.
__device__ void prunedScoreAt(PrunedFlowArgs const& a, int32_t position)
{
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

//! Launch 3 of a round, a block per KV head: the stop rule, then the next candidates (lastRound: every eligible token).
__device__ void prunedRoundHead(PrunedFlowArgs const& a, bool lastRound, PrunedSmem& s)
{
    int32_t const g = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    int32_t const m = olderTokens(a);
    int64_t const head = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    PrunedHeadState state = a.states[head];
    if (!state.active || state.settled)
    {
        if (threadIdx.x == 0)
        {
            a.candidateCounts[head] = 0;
        }
        return;
    }
    int32_t const validStart = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).validStart;
    uint8_t* flags = a.flags + head * m;
    float const* bound = a.critical + head * m;
    float const* exact = a.exact + head * m;
    PrunedTopK const topK{s};
    float const following = flaggedExtreme(bound, flags, validStart, m, 0, true, s);
    topK(exact, flags, m, validStart, kPrunedCandidate, kPrunedFresh, state.k); // the k best candidates
    float const kth = flaggedExtreme(exact, flags, validStart, m, kPrunedFresh, false, s);
    relabelFlags(flags, validStart, m, kPrunedFresh, kPrunedCandidate);
    int32_t listed = 0;
    if (state.done >= state.eligible || stage2Settled(following, kth, a.margin))
    {
        state.settled = 1;
    }
    else
    {
        int64_t const doubled = 2 * state.done < state.eligible ? 2 * state.done : state.eligible;
        int64_t const c = lastRound ? state.eligible : doubled;
        topK(bound, flags, m, validStart, 0, kPrunedFresh, c - state.done);
        listed = listFresh(flags, validStart, m, a.candidates + head * m, s);
        state.done = c;
    }
    if (threadIdx.x == 0)
    {
        a.states[head] = state;
        a.candidateCounts[head] = listed;
    }
}

//! Last launch, a block per KV head: the k best candidates by exact C are kept (kChosenByCritical).
__device__ void prunedFinishHead(PrunedFlowArgs const& a, PrunedSmem& s)
{
    int32_t const g = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    int32_t const m = olderTokens(a);
    int64_t const head = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    PrunedHeadState const state = a.states[head];
    if (!state.active)
    {
        return;
    }
    int32_t const validStart = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).validStart;
    uint8_t* flags = a.flags + head * m;
    relabelFlags(flags, validStart, m, 0, kPrunedLeftOut);
    relabelFlags(flags, validStart, m, kPrunedCandidate, 0);
    PrunedTopK const topK{s};
    topK(a.exact + head * m, flags, m, validStart, 0, kChosenByCritical, state.k);
    relabelFlags(flags, validStart, m, kPrunedLeftOut, 0);
}

} // namespace criticalkv::kernels
