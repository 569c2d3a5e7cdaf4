// prunedStage2's block executor (pruned_stage2.h) for one KV head's row, with its block-wide radix executor: simple
// steps (per-element shared atomics, ties at the radix threshold marked by thread 0, block reductions through shared
// memory). launchPrunedRow (kernels/pruned.cu) runs it for the GPU tests and testing/pruned_row_emulation.cpp on the
// CPU, both against the host driver's executor; the pipeline's pruned stage 2 (pruned_flow.cuh) runs the same flow
// over every head at once on the batched top-k instead, and takes its flags (0 eligible non-candidate, kPrunedRound0 + r
// a candidate of round r not yet listed, kPrunedCandidate exact score known, kPrunedLeftOut parked) from here.
#pragma once

#include "criticalkv/pruned_stage2.h"
#include "criticalkv/radix_select.h"

#include <cmath>

namespace criticalkv::kernels
{

constexpr int kPrunedThreads = 512; //!< threads of the pruned stage 2's per-head blocks

enum PrunedFlag : uint8_t
{
    kPrunedRound0 = 249, //!< pruned_flow.cuh: a candidate of round r (not yet listed) is kPrunedRound0 + r, r < 4
    kPrunedFresh = 253,
    kPrunedCandidate = 254,
    kPrunedLeftOut = 255,
};

struct PrunedSmem
{
    uint32_t histogram[kRadixBins];
    float partial[kPrunedThreads];
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
        for (int32_t i = tid; i < kRadixBins; i += kPrunedThreads)
        {
            s.histogram[i] = 0u;
        }
        __syncthreads();
        for (int64_t e = tid; e < len; e += kPrunedThreads)
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
        for (int64_t e = threadIdx.x; e < len; e += kPrunedThreads)
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
        for (int64_t e = threadIdx.x; e < len; e += kPrunedThreads)
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
        for (int64_t e = validStart + tid; e < m; e += kPrunedThreads)
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
        __syncthreads(); // s.result may be rewritten by the next call
        return result;
    }

    __device__ void relabel(uint8_t from, uint8_t to)
    {
        for (int64_t e = validStart + threadIdx.x; e < m; e += kPrunedThreads)
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
        for (int64_t e = validStart + threadIdx.x; e < m; e += kPrunedThreads)
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

} // namespace criticalkv::kernels
