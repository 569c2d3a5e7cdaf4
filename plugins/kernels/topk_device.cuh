// The kernels of the batched top-k (criticalkv/topk.h) and the sequences that launch them, built from
// topk_block.cuh's steps. Included by kernels/topk.cu only (and by the emulation tests, compiled with g++).
//
// A row's search is radix_select.h's RadixSearch. Short rows (<= kTopKSingleCtaMax) take one CTA and one launch:
// topKRowKernel runs every pass over the row with the histogram in shared memory. Long rows are cut into chunks of
// kTopKChunk entries, one CTA each, and take one launch per pass (topKPassKernel): every CTA adds its chunk's
// histogram to the row's global one in the scratch, and the CTA that arrives last (an atomic count, the
// threadfence-reduction pattern) chooses the digit and writes the row's search for the next launch; topKMarkKernel
// then marks. No CTA waits for another, so no co-residency is assumed. Ties at the threshold go to the lower
// index: within a chunk by a block scan in index order, across chunks by the last pass's per-CTA histograms.
#pragma once

#include "topk_block.cuh"

namespace criticalkv::kernels
{

//! Row r's k at level l (0 past the call's levels: that level selects nothing).
__device__ __forceinline__ int64_t levelK(TopKRows const& p, int32_t level, int32_t row)
{
    return level < topKLevels(p) ? p.k[static_cast<int64_t>(level) * p.rows + row] : 0;
}

//! One CTA per row, the whole search in one launch (every level's in turn). grid (rows), block kTopKThreads.
//! kLevels: 1, or kTopKMaxLevels for a call of several levels (the levels past p.levels select nothing).
template <int kLevels>
__global__ void __launch_bounds__(kTopKThreads) topKRowKernel(TopKRows p)
{
    CKV_BLOCK_SHARED TopKSmem s;
    int32_t const row = static_cast<int32_t>(blockIdx.x);
    TopKRow const r = topKRow(p, row);
    RadixSearch searches[kLevels];
    int64_t ties[kLevels];
#pragma unroll
    for (int32_t l = 0; l < kLevels; ++l)
    {
        RadixSearch search = radixBegin(levelK(p, l, row));
        while (search.outcome == kRadixSearching)
        {
            blockHistogram(r, 0, r.len, search, s);
            DigitChoice choice{};
            int64_t total = 0;
            blockChooseDigit(search.remaining, s, choice, total);
            radixAdvance(search, total, choice);
        }
        searches[l] = search;
        ties[l] = 0;
    }
    blockMarkLevels<kLevels>(r, 0, r.len, searches, p.mark, ties, s);
}

//! Row `row`'s state in the scratch (topKRowStateBytes(levels) per row) and its global histograms
//! [levels][kRadixPasses][kRadixBins] right after the state's fixed part.
__device__ __forceinline__ TopKRowState* topKState(unsigned char* scratch, int32_t levels, int32_t row)
{
    return reinterpret_cast<TopKRowState*>(scratch + static_cast<size_t>(row) * topKRowStateBytes(levels));
}

__device__ __forceinline__ uint32_t* topKGlobalHistogram(TopKRowState* state, int32_t level, int32_t pass)
{
    return reinterpret_cast<uint32_t*>(reinterpret_cast<unsigned char*>(state) + sizeof(TopKRowState))
        + (static_cast<int64_t>(level) * kRadixPasses + pass) * kRadixBins;
}

//! The per-CTA digit histograms of the last pass, [levels, rows, ctasPerRow, kRadixBins].
__device__ __forceinline__ uint32_t* topKTails(unsigned char* scratch, int32_t rows, int32_t levels)
{
    return reinterpret_cast<uint32_t*>(
        scratch + alignTopKScratch(static_cast<size_t>(rows) * topKRowStateBytes(levels)));
}

//! A read of another CTA's result past the L1 cache.
template <typename T>
__device__ __forceinline__ T loadGlobal(T const* address)
{
    return __ldcg(address);
}

//! After this CTA added its histograms: tell whether it is the last of the row to do so (then every CTA's histograms
//! are in, visible to this one). Every thread calls it; its result is the same in all.
__device__ __forceinline__ bool arriveLast(uint32_t* arrived, int32_t ctas, TopKSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    __threadfence(); // the additions are visible before the arrival is
    __syncthreads();
    if (tid == 0)
    {
        s.last = atomicAdd(arrived, 1u) == static_cast<uint32_t>(ctas - 1) ? 1 : 0;
    }
    __syncthreads();
    bool const last = s.last != 0;
    if (last)
    {
        __threadfence();
    }
    return last;
}

//! Add this CTA's histogram (s.histogram, level 0) to the row's, and tell whether this CTA is the last of the row to do
//! so (arriveLast). Every thread calls it.
__device__ __forceinline__ bool addHistogram(uint32_t* global, uint32_t* arrived, int32_t ctas, TopKSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    if (s.histogram[tid] != 0u)
    {
        atomicAdd(&global[tid], s.histogram[tid]);
    }
    return arriveLast(arrived, ctas, s);
}

//! Pass `pass` of the rows longer than one CTA, for every level still searching at it: each CTA builds the levels'
//! histograms of its chunk in one read and adds them to the row's; the last CTA to arrive chooses every such level's
//! digit. grid (ctasPerRow, rows), block kTopKThreads.
template <int kLevels>
__global__ void __launch_bounds__(kTopKThreads) topKPassKernel(
    TopKRows p, unsigned char* scratch, int32_t ctas, int32_t pass)
{
    CKV_BLOCK_SHARED TopKSmem s;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const cta = static_cast<int32_t>(blockIdx.x);
    int32_t const row = static_cast<int32_t>(blockIdx.y);
    int32_t const levels = topKLevels(p);
    TopKRowState* state = topKState(scratch, levels, row);
    RadixSearch searches[kLevels];
    uint32_t active = 0u;
#pragma unroll
    for (int32_t l = 0; l < kLevels; ++l)
    {
        searches[l] = pass == 0 ? radixBegin(levelK(p, l, row)) : state->search[l];
        bool const searching = l < levels && searches[l].outcome == kRadixSearching && searches[l].pass == pass;
        active |= searching ? 1u << l : 0u;
    }
    if (active == 0u)
    {
        return; // every level's search ended at an earlier pass (or k <= 0)
    }
    TopKRow const r = topKRow(p, row);
    int32_t const begin = cta * kTopKChunk;
    int32_t const end = begin + kTopKChunk < r.len ? begin + kTopKChunk : r.len;
    blockHistogramLevels<kLevels>(r, begin, end, searches, active, s);
#pragma unroll
    for (int32_t l = 0; l < kLevels; ++l)
    {
        if (((active >> l) & 1u) == 0u)
        {
            continue;
        }
        uint32_t const count = s.histogram[l * kRadixBins + tid];
        if (pass == kRadixPasses - 1)
        {
            topKTails(scratch, p.rows, levels)[((static_cast<int64_t>(l) * p.rows + row) * ctas + cta) * kRadixBins + tid]
                = count;
        }
        if (count != 0u)
        {
            atomicAdd(&topKGlobalHistogram(state, l, pass)[tid], count);
        }
    }
    if (!arriveLast(&state->arrived[pass], ctas, s))
    {
        return;
    }
#pragma unroll
    for (int32_t l = 0; l < kLevels; ++l)
    {
        if (((active >> l) & 1u) == 0u)
        {
            continue;
        }
        s.histogram[l * kRadixBins + tid] = loadGlobal(&topKGlobalHistogram(state, l, pass)[tid]);
        __syncthreads();
        DigitChoice choice{};
        int64_t total = 0;
        blockChooseDigit(searches[l].remaining, s, choice, total, l);
        radixAdvance(searches[l], total, choice);
    }
    if (tid == 0)
    {
#pragma unroll
        for (int32_t l = 0; l < kLevels; ++l)
        {
            if (l < levels)
            {
                state->search[l] = searches[l]; // pass 0 writes every level's (k <= 0: nothing)
            }
        }
    }
}

//! The marks of the rows longer than one CTA, after the passes. grid (ctasPerRow, rows), block kTopKThreads.
template <int kLevels>
__global__ void __launch_bounds__(kTopKThreads) topKMarkKernel(TopKRows p, unsigned char* scratch, int32_t ctas)
{
    CKV_BLOCK_SHARED TopKSmem s;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const cta = static_cast<int32_t>(blockIdx.x);
    int32_t const row = static_cast<int32_t>(blockIdx.y);
    int32_t const levels = topKLevels(p);
    TopKRowState const* state = topKState(scratch, levels, row);
    RadixSearch searches[kLevels];
    int64_t tiesBefore[kLevels];
    TopKRow const r = topKRow(p, row);
    int32_t const begin = cta * kTopKChunk;
    int32_t const end = begin + kTopKChunk < r.len ? begin + kTopKChunk : r.len;
#pragma unroll
    for (int32_t l = 0; l < kLevels; ++l)
    {
        searches[l] = levelK(p, l, row) > 0 ? state->search[l] : radixBegin(0);
        tiesBefore[l] = 0;
        RadixSearch const& search = searches[l];
        if (search.outcome == kRadixThreshold && search.remaining < search.atThreshold)
        {
            // the ties at T in the chunks before this one: T's last digit in each earlier CTA's last-pass histogram
            uint32_t const* tails
                = topKTails(scratch, p.rows, levels) + (static_cast<int64_t>(l) * p.rows + row) * ctas * kRadixBins;
            uint32_t const digit = radixDigit(search.prefix, kRadixPasses - 1);
            unsigned long long mine = 0;
            for (int32_t c = tid; c < cta; c += kTopKThreads)
            {
                mine += tails[static_cast<int64_t>(c) * kRadixBins + digit];
            }
            tiesBefore[l] = static_cast<int64_t>(blockSum(mine, s));
        }
    }
    blockMarkLevels<kLevels>(r, begin, end, searches, p.mark, tiesBefore, s);
}

__device__ __forceinline__ MassRowState* massStates(unsigned char* scratch)
{
    return reinterpret_cast<MassRowState*>(scratch);
}

//! Pass `pass` of the mass count. grid (massCountCtas(len), rows), block kTopKThreads. The CTA that adds the last
//! histogram of a row advances its search and writes count[row] when the search ends.
__global__ void __launch_bounds__(kTopKThreads) massPassKernel(
    TopKRows p, float const* limit, int64_t* count, unsigned char* scratch, int32_t ctas, int32_t pass)
{
    CKV_BLOCK_SHARED TopKSmem s;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const cta = static_cast<int32_t>(blockIdx.x);
    int32_t const row = static_cast<int32_t>(blockIdx.y);
    MassRowState* state = massStates(scratch) + row;
    MassSearch search = pass == 0 ? massBegin() : state->search;
    if (search.done || search.pass != pass)
    {
        return;
    }
    TopKRow const r = topKRow(p, row);
    int32_t const begin = cta * kTopKChunk;
    int32_t const end = begin + kTopKChunk < r.len ? begin + kTopKChunk : r.len;
    blockMassHistogram(r, begin, end, search, s);
    if (s.sums[tid] != 0ull)
    {
        atomicAdd(&state->sums[pass][tid], s.sums[tid]);
    }
    if (!addHistogram(state->counts[pass], &state->arrived[pass], ctas, s))
    {
        return;
    }
    s.histogram[tid] = loadGlobal(&state->counts[pass][tid]);
    s.sums[tid] = loadGlobal(&state->sums[pass][tid]);
    __syncthreads();
    int64_t const bound = fixedLimit(limit[row]);
    MassDigit const choice = blockChooseMassDigit(search.above, bound, s);
    massAdvance(search, choice, choice.digit >= 0 ? static_cast<int64_t>(s.histogram[choice.digit]) : 0, bound);
    if (tid == 0)
    {
        state->search = search;
        if (search.done)
        {
            count[row] = search.count;
        }
    }
}

//! Whether launchTopK / launchMassCount accept these rows (a row's positions fit int32, every grid dimension fits).
__host__ __device__ inline bool topKRowsValid(TopKRows const& p)
{
    bool const empty = p.rows == 0 || p.len == 0;
    return p.rows >= 0 && p.len >= 0 && p.rows <= 65535 && p.stride >= p.len && p.levels >= 0
        && p.levels <= kTopKMaxLevels && static_cast<int32_t>(p.mark) + topKLevels(p) - 1 <= 255
        && (empty || (p.scores != nullptr && p.flags != nullptr && p.period >= 1));
}

//! launchTopK's sequence of launches over a launcher (kernels/topk.cu on a stream; the emulation test on the CPU), the
//! kernels instantiated for 1 level or kTopKMaxLevels (topKLevels(p) > 1: launchLevels picks the instance):
//!   rows(p)                       topKRowKernel, grid (rows)
//!   zero(bytes)                   the row states at the start of the scratch
//!   pass(p, ctas, pass)           topKPassKernel, grid (ctas, rows)
//!   mark(p, ctas)                 topKMarkKernel, grid (ctas, rows)
//! Returns false (and launches nothing) for invalid rows or a scratch smaller than topKScratchBytes(rows, len, levels).
template <typename Launcher>
__host__ bool runTopK(TopKRows const& p, void* scratch, size_t scratchBytes, Launcher& launch)
{
    if (!topKRowsValid(p) || p.k == nullptr || p.mark == 0)
    {
        return false;
    }
    if (p.rows == 0 || p.len == 0)
    {
        return true;
    }
    TopKPlan const plan = topKPlan(p.rows, p.len, topKLevels(p));
    if (plan.ctasPerRow == 1)
    {
        launch.rows(p);
        return true;
    }
    if (scratch == nullptr || scratchBytes < plan.scratchBytes)
    {
        return false;
    }
    launch.zero(plan.stateBytes);
    for (int32_t pass = 0; pass < kRadixPasses; ++pass)
    {
        launch.pass(p, plan.ctasPerRow, pass);
    }
    launch.mark(p, plan.ctasPerRow);
    return true;
}

//! launchMassCount's sequence: zero(bytes), then massPass(p, ctas, pass) for the passes (massPassKernel).
template <typename Launcher>
__host__ bool runMassCount(TopKRows const& p, float const* limit, int64_t* count, void* scratch, size_t scratchBytes,
    Launcher& launch)
{
    if (!topKRowsValid(p) || limit == nullptr || count == nullptr)
    {
        return false;
    }
    if (p.rows == 0)
    {
        return true;
    }
    size_t const bytes = massCountScratchBytes(p.rows, p.len);
    if (p.len == 0 || scratch == nullptr || scratchBytes < bytes)
    {
        return false;
    }
    launch.zero(bytes);
    for (int32_t pass = 0; pass < kRadixPasses; ++pass)
    {
        launch.massPass(p, massCountCtas(p.len), pass);
    }
    return true;
}

} // namespace criticalkv::kernels
