// Block-wide steps of the batched top-k (criticalkv/topk.h) over a chunk of a row: the digit histogram, the digit
// choice, the marks with ties in index order (topk_device.cuh builds the kernels from them; select_flows.cuh uses
// the block sum). Plain CUDA C++ with no CUDA or CUB header of its own, so that the emulation tests
// (plugins/testing/*_emulation.cpp) compile this very file with g++ and run it on the CPU (testing/cuda_emulation.h).
#pragma once

#include "criticalkv/topk.h"

// A block's shared variables: __shared__ on the GPU; under the CPU emulation (its blocks run one after another) one
// static copy that every thread of the running block sees.
#if defined(__CUDACC__)
#define CKV_BLOCK_SHARED __shared__
#else
#define CKV_BLOCK_SHARED static
#endif

namespace criticalkv::kernels
{

static_assert(kTopKThreads == kRadixBins, "the digit choice gives one thread per bin");
static_assert(kTopKThreads % 32 == 0 && kTopKChunk % kTopKThreads == 0, "chunks of whole tiles of whole warps");
constexpr int kTopKWarps = kTopKThreads / 32;
constexpr unsigned kFullWarp = 0xffffffffu;

//! One row of a TopKRows as the kernels see it (int32 positions: launchTopK checks len).
struct TopKRow
{
    float const* scores;
    uint8_t* flags;
    int32_t len;
    int32_t period;
    int32_t firstValid;
};

__device__ __forceinline__ TopKRow topKRow(TopKRows const& p, int32_t row)
{
    int64_t const offset = static_cast<int64_t>(row) * p.stride;
    int32_t const firstValid = p.firstValid != nullptr ? p.firstValid[row] : 0;
    return TopKRow{p.scores + offset, p.flags + offset, p.len, p.period, firstValid};
}

//! radix_select.h's radixCandidate in 32 bits (no division when the row has no left padding).
__device__ __forceinline__ bool topKCandidate(TopKRow const& r, int32_t e)
{
    return r.flags[e] == 0 && (r.firstValid <= 0 || e % r.period >= r.firstValid);
}

struct TopKSmem
{
    uint32_t histogram[kRadixBins];
    unsigned long long sums[kRadixBins]; // the mass count's per-digit fixedMass sums
    unsigned long long warpTotals[kTopKWarps];
    DigitChoice choice;
    MassDigit massChoice;
    int64_t total;
    int32_t last;
};

//! Inclusive suffix sums over the digit bins: thread t (< kRadixBins) gives bin t's value and gets bins t..255's sum.
//! Every thread of the block calls it.
__device__ __forceinline__ unsigned long long blockSuffixSum(unsigned long long value, TopKSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const lane = tid % 32;
    int32_t const warp = tid / 32;
    unsigned long long x = value;
    for (int offset = 1; offset < 32; offset *= 2)
    {
        unsigned long long const y = __shfl_down_sync(kFullWarp, x, offset);
        x += lane + offset < 32 ? y : 0ull;
    }
    __syncthreads(); // warpTotals is free
    if (lane == 0)
    {
        s.warpTotals[warp] = x;
    }
    __syncthreads();
    for (int32_t w = warp + 1; w < kTopKWarps; ++w)
    {
        x += s.warpTotals[w];
    }
    return x;
}

//! The sum over the block of one value per thread; every thread gets it.
__device__ __forceinline__ unsigned long long blockSum(unsigned long long value, TopKSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    for (int offset = 16; offset > 0; offset /= 2)
    {
        value += __shfl_xor_sync(kFullWarp, value, offset);
    }
    __syncthreads(); // warpTotals is free
    if (tid % 32 == 0)
    {
        s.warpTotals[tid / 32] = value;
    }
    __syncthreads();
    unsigned long long total = 0;
    for (int32_t w = 0; w < kTopKWarps; ++w)
    {
        total += s.warpTotals[w];
    }
    return total;
}

//! chooseDigit (radix.h) of the histogram in s.histogram, and its total, for every thread: the digit d holding the
//! `remaining`-th best is the one whose suffix count reaches `remaining` while the next one's does not.
__device__ __forceinline__ void blockChooseDigit(int64_t remaining, TopKSmem& s, DigitChoice& choice, int64_t& total)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    uint32_t const count = s.histogram[tid];
    int64_t const suffix = static_cast<int64_t>(blockSuffixSum(count, s));
    if (tid == 0)
    {
        s.total = suffix;
        s.choice = DigitChoice{0u, suffix, 0}; // remaining above every candidate: pass 0 takes them all
    }
    __syncthreads();
    int64_t const above = suffix - count;
    if (suffix >= remaining && above < remaining)
    {
        s.choice = DigitChoice{static_cast<uint32_t>(tid), above, count};
    }
    __syncthreads();
    choice = s.choice;
    total = s.total;
    __syncthreads(); // s.choice and s.total may be rewritten by the next call
}

//! chooseMassDigit (defensive.h) of s.histogram / s.sums for every thread: the highest non-empty digit d with
//! above + (sums of d..255) >= bound; it is the one whose next digit's suffix stays below the bound, or the highest
//! non-empty digit when `above` reaches the bound already.
__device__ __forceinline__ MassDigit blockChooseMassDigit(int64_t above, int64_t bound, TopKSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    uint32_t const count = s.histogram[tid];
    unsigned long long const sum = s.sums[tid];
    int64_t const sumSuffix = static_cast<int64_t>(blockSuffixSum(sum, s));
    int64_t const countSuffix = static_cast<int64_t>(blockSuffixSum(count, s));
    if (tid == 0)
    {
        s.massChoice = MassDigit{-1, sumSuffix, countSuffix}; // no digit reaches the bound
    }
    __syncthreads();
    int64_t const sumAbove = sumSuffix - static_cast<int64_t>(sum);
    int64_t const countAbove = countSuffix - count;
    if (count > 0 && above + sumSuffix >= bound && (above + sumAbove < bound || countAbove == 0))
    {
        s.massChoice = MassDigit{tid, sumAbove, countAbove};
    }
    __syncthreads();
    MassDigit const choice = s.massChoice;
    __syncthreads();
    return choice;
}

//! Digit histogram of the candidates of [begin, end) matching the search's prefix into s.histogram (zeroed here).
//! Warp-aggregated increments: ties (one digit for many lanes) cost one shared atomic per warp, not 32.
__device__ __forceinline__ void blockHistogram(
    TopKRow const& r, int32_t begin, int32_t end, RadixSearch const& search, TopKSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    __syncthreads(); // every thread is done reading the previous histogram
    s.histogram[tid] = 0u;
    __syncthreads();
    for (int32_t base = begin; base < end; base += kTopKThreads) // whole warps iterate together
    {
        int32_t const e = base + tid;
        int32_t bin = -1;
        if (e < end && topKCandidate(r, e))
        {
            uint32_t const key = orderedKey(r.scores[e]);
            if ((key & search.prefixMask) == search.prefix)
            {
                bin = static_cast<int32_t>(radixDigit(key, search.pass));
            }
        }
        unsigned const peers = __match_any_sync(kFullWarp, bin);
        if (bin >= 0 && __ffs(static_cast<int>(peers)) - 1 == tid % 32)
        {
            atomicAdd(&s.histogram[bin], static_cast<uint32_t>(__popc(peers)));
        }
    }
    __syncthreads();
}

//! Counts and fixedMass sums per digit of the candidates of [begin, end) matching the prefix (integer atomics: the
//! sums do not depend on the threads' order).
__device__ __forceinline__ void blockMassHistogram(
    TopKRow const& r, int32_t begin, int32_t end, MassSearch const& search, TopKSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    __syncthreads();
    s.histogram[tid] = 0u;
    s.sums[tid] = 0ull;
    __syncthreads();
    for (int32_t e = begin + tid; e < end; e += kTopKThreads)
    {
        if (!topKCandidate(r, e))
        {
            continue;
        }
        float const score = r.scores[e];
        uint32_t const key = orderedKey(score);
        if ((key & search.prefixMask) == search.prefix)
        {
            uint32_t const digit = radixDigit(key, search.pass);
            atomicAdd(&s.histogram[digit], 1u);
            atomicAdd(&s.sums[digit], static_cast<unsigned long long>(fixedMass(score)));
        }
    }
    __syncthreads();
}

//! Mark the kept candidates of [begin, end) once the search is over; tiesBefore: the candidates with key == T in
//! the row before `begin` (multi-CTA rows). Ties at the threshold are ranked in index order by a block scan per tile.
__device__ __forceinline__ void blockMark(TopKRow const& r, int32_t begin, int32_t end, RadixSearch const& search,
    uint8_t mark, int64_t tiesBefore, TopKSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    if (search.outcome == kRadixAll || (search.outcome == kRadixThreshold && search.remaining == search.atThreshold))
    {
        bool const all = search.outcome == kRadixAll;
        for (int32_t e = begin + tid; e < end; e += kTopKThreads)
        {
            if (topKCandidate(r, e) && (all || orderedKey(r.scores[e]) >= search.prefix))
            {
                r.flags[e] = mark;
            }
        }
        return;
    }
    if (search.outcome != kRadixThreshold)
    {
        return;
    }
    int32_t const lane = tid % 32;
    int32_t const warp = tid / 32;
    uint32_t const threshold = search.prefix;
    int64_t running = tiesBefore;
    for (int32_t base = begin; base < end; base += kTopKThreads)
    {
        int32_t const e = base + tid;
        bool const isCandidate = e < end && topKCandidate(r, e);
        uint32_t const key = isCandidate ? orderedKey(r.scores[e]) : 0u;
        bool const tie = isCandidate && key == threshold;
        unsigned const ballot = __ballot_sync(kFullWarp, tie ? 1 : 0);
        __syncthreads(); // warpTotals is free
        if (lane == 0)
        {
            s.warpTotals[warp] = static_cast<unsigned long long>(__popc(ballot));
        }
        __syncthreads();
        int64_t before = __popc(ballot & ((1u << lane) - 1u));
        int64_t tileTies = 0;
        for (int32_t w = 0; w < kTopKWarps; ++w)
        {
            before += w < warp ? static_cast<int64_t>(s.warpTotals[w]) : 0;
            tileTies += static_cast<int64_t>(s.warpTotals[w]);
        }
        if (isCandidate && (key > threshold || (tie && running + before < search.remaining)))
        {
            r.flags[e] = mark;
        }
        running += tileTies;
    }
}

} // namespace criticalkv::kernels
