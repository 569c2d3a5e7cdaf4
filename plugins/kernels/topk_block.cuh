// Block-wide steps of the batched top-k (criticalkv/topk.h) over a chunk of a row: the digit histogram, the digit
// choice, the marks with ties in index order (topk_device.cuh builds the kernels from them; select_flows.cuh uses
// the block sum). Plain CUDA C++ with no CUDA or CUB header of its own, so that the emulation tests
// (plugins/testing/*_emulation.cpp) compile this very file with g++ and run it on the CPU (testing/cuda_emulation.h).
#pragma once

#include "criticalkv/common.h" // CKV_BLOCK_SHARED
#include "criticalkv/topk.h"

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
    uint32_t histogram[kTopKMaxLevels * kRadixBins]; // level l's digit histogram at l * kRadixBins (the mass count: 0)
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

//! chooseDigit (radix.h) of level `level`'s histogram in s.histogram, and its total, for every thread: the digit d
//! holding the `remaining`-th best is the one whose suffix count reaches `remaining` while the next one's does not.
__device__ __forceinline__ void blockChooseDigit(int64_t remaining, TopKSmem& s, DigitChoice& choice, int64_t& total,
    int32_t level = 0)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    uint32_t const count = s.histogram[level * kRadixBins + tid];
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

//! chooseMassDigit (methods/defensivekv.h) of s.histogram / s.sums for every thread: the highest non-empty digit d with
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

//! Digit histograms of the candidates of [begin, end) matching each active level's prefix (bit l of `active`: level l
//! searches this pass) into s.histogram's level slots (zeroed here); one read of the chunk for every level.
//! Warp-aggregated increments: ties (one digit for many lanes) cost one shared atomic per warp, not 32.
template <int kLevels>
__device__ __forceinline__ void blockHistogramLevels(
    TopKRow const& r, int32_t begin, int32_t end, RadixSearch const (&searches)[kLevels], uint32_t active, TopKSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    __syncthreads(); // every thread is done reading the previous histograms
#pragma unroll
    for (int32_t l = 0; l < kLevels; ++l)
    {
        s.histogram[l * kRadixBins + tid] = 0u;
    }
    __syncthreads();
    for (int32_t base = begin; base < end; base += kTopKThreads) // whole warps iterate together
    {
        int32_t const e = base + tid;
        bool const candidate = e < end && topKCandidate(r, e);
        uint32_t const key = candidate ? orderedKey(r.scores[e]) : 0u;
#pragma unroll
        for (int32_t l = 0; l < kLevels; ++l)
        {
            if (((active >> l) & 1u) == 0u)
            {
                continue; // the same for every thread
            }
            RadixSearch const& search = searches[l];
            int32_t const bin = candidate && (key & search.prefixMask) == search.prefix
                ? static_cast<int32_t>(radixDigit(key, search.pass))
                : -1;
            unsigned const peers = __match_any_sync(kFullWarp, bin);
            if (bin >= 0 && __ffs(static_cast<int>(peers)) - 1 == tid % 32)
            {
                atomicAdd(&s.histogram[l * kRadixBins + bin], static_cast<uint32_t>(__popc(peers)));
            }
        }
    }
    __syncthreads();
}

//! Digit histogram of the candidates of [begin, end) matching the search's prefix into s.histogram (zeroed here).
__device__ __forceinline__ void blockHistogram(
    TopKRow const& r, int32_t begin, int32_t end, RadixSearch const& search, TopKSmem& s)
{
    RadixSearch const searches[1] = {search};
    blockHistogramLevels<1>(r, begin, end, searches, 1u, s);
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

//! Mark the kept candidates of [begin, end) once every level's search is over: a candidate gets mark + l for the first
//! level l whose set holds it. tiesBefore[l]: the candidates with key == T_l in the row before `begin` (multi-CTA
//! rows). Ties at a level's threshold are ranked in index order by a block scan per tile (only for the levels that keep
//! some but not all of them: the others take every key >= T_l).
template <int kLevels>
__device__ __forceinline__ void blockMarkLevels(TopKRow const& r, int32_t begin, int32_t end,
    RadixSearch const (&searches)[kLevels], uint8_t mark, int64_t const (&tiesBefore)[kLevels], TopKSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const lane = tid % 32;
    int32_t const warp = tid / 32;
    bool marks = false;
    int64_t running[kLevels];
#pragma unroll
    for (int32_t l = 0; l < kLevels; ++l)
    {
        marks = marks || searches[l].outcome == kRadixAll || searches[l].outcome == kRadixThreshold;
        running[l] = tiesBefore[l];
    }
    if (!marks)
    {
        return; // no level keeps anything (the same for every thread)
    }
    for (int32_t base = begin; base < end; base += kTopKThreads) // whole warps iterate together
    {
        int32_t const e = base + tid;
        bool const isCandidate = e < end && topKCandidate(r, e);
        uint32_t const key = isCandidate ? orderedKey(r.scores[e]) : 0u;
        int32_t label = -1;
#pragma unroll
        for (int32_t l = 0; l < kLevels; ++l)
        {
            RadixSearch const& q = searches[l];
            bool const threshold = q.outcome == kRadixThreshold;
            bool const rankTies = threshold && q.remaining < q.atThreshold; // the same for every thread
            bool in = isCandidate
                && (q.outcome == kRadixAll || (threshold && (key > q.prefix || (key == q.prefix && !rankTies))));
            if (rankTies)
            {
                bool const tie = isCandidate && key == q.prefix;
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
                in = in || (tie && running[l] + before < q.remaining);
                running[l] += tileTies;
            }
            label = label < 0 && in ? l : label;
        }
        if (label >= 0)
        {
            r.flags[e] = static_cast<uint8_t>(mark + label);
        }
    }
}

//! Mark the kept candidates of [begin, end) of one search (blockMarkLevels with one level).
__device__ __forceinline__ void blockMark(TopKRow const& r, int32_t begin, int32_t end, RadixSearch const& search,
    uint8_t mark, int64_t tiesBefore, TopKSmem& s)
{
    RadixSearch const searches[1] = {search};
    int64_t const ties[1] = {tiesBefore};
    blockMarkLevels<1>(r, begin, end, searches, mark, ties, s);
}

} // namespace criticalkv::kernels
