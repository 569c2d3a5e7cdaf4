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

//! One CTA per row, the whole search in one launch. grid (rows), block kTopKThreads.
__global__ void __launch_bounds__(kTopKThreads) topKRowKernel(TopKRows p)
{
    CKV_BLOCK_SHARED TopKSmem s;
    int32_t const row = static_cast<int32_t>(blockIdx.x);
    TopKRow const r = topKRow(p, row);
    RadixSearch search = radixBegin(p.k[row]);
    while (search.outcome == kRadixSearching)
    {
        blockHistogram(r, 0, r.len, search, s);
        DigitChoice choice{};
        int64_t total = 0;
        blockChooseDigit(search.remaining, s, choice, total);
        radixAdvance(search, total, choice);
    }
    blockMark(r, 0, r.len, search, p.mark, 0, s);
}

__device__ __forceinline__ TopKRowState* topKStates(unsigned char* scratch)
{
    return reinterpret_cast<TopKRowState*>(scratch);
}

//! The per-CTA digit histograms of the last pass, [rows, ctasPerRow, kRadixBins].
__device__ __forceinline__ uint32_t* topKTails(unsigned char* scratch, int32_t rows)
{
    return reinterpret_cast<uint32_t*>(scratch + alignTopKScratch(static_cast<size_t>(rows) * sizeof(TopKRowState)));
}

//! A read of another CTA's result past the L1 cache.
template <typename T>
__device__ __forceinline__ T loadGlobal(T const* address)
{
    return __ldcg(address);
}

//! Add this CTA's histogram to the row's, and tell whether this CTA is the last of the row to do so (then every
//! CTA's histogram is in, visible to this one). Every thread calls it; its result is the same in all.
__device__ __forceinline__ bool addHistogram(uint32_t* global, uint32_t* arrived, int32_t ctas, TopKSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    if (s.histogram[tid] != 0u)
    {
        atomicAdd(&global[tid], s.histogram[tid]);
    }
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

//! Pass `pass` of the rows longer than one CTA. grid (ctasPerRow, rows), block kTopKThreads.
__global__ void __launch_bounds__(kTopKThreads) topKPassKernel(
    TopKRows p, unsigned char* scratch, int32_t ctas, int32_t pass)
{
    CKV_BLOCK_SHARED TopKSmem s;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const cta = static_cast<int32_t>(blockIdx.x);
    int32_t const row = static_cast<int32_t>(blockIdx.y);
    TopKRowState* state = topKStates(scratch) + row;
    RadixSearch search = pass == 0 ? radixBegin(p.k[row]) : state->search;
    if (search.outcome != kRadixSearching || search.pass != pass)
    {
        return; // k <= 0, or the search ended at an earlier pass
    }
    TopKRow const r = topKRow(p, row);
    int32_t const begin = cta * kTopKChunk;
    int32_t const end = begin + kTopKChunk < r.len ? begin + kTopKChunk : r.len;
    blockHistogram(r, begin, end, search, s);
    if (pass == kRadixPasses - 1)
    {
        topKTails(scratch, p.rows)[(static_cast<int64_t>(row) * ctas + cta) * kRadixBins + tid] = s.histogram[tid];
    }
    if (!addHistogram(state->histogram[pass], &state->arrived[pass], ctas, s))
    {
        return;
    }
    s.histogram[tid] = loadGlobal(&state->histogram[pass][tid]);
    __syncthreads();
    DigitChoice choice{};
    int64_t total = 0;
    blockChooseDigit(search.remaining, s, choice, total);
    radixAdvance(search, total, choice);
    if (tid == 0)
    {
        state->search = search;
    }
}

//! The marks of the rows longer than one CTA, after the passes. grid (ctasPerRow, rows), block kTopKThreads.
__global__ void __launch_bounds__(kTopKThreads) topKMarkKernel(TopKRows p, unsigned char* scratch, int32_t ctas)
{
    CKV_BLOCK_SHARED TopKSmem s;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const cta = static_cast<int32_t>(blockIdx.x);
    int32_t const row = static_cast<int32_t>(blockIdx.y);
    if (p.k[row] <= 0)
    {
        return;
    }
    RadixSearch const search = topKStates(scratch)[row].search;
    TopKRow const r = topKRow(p, row);
    int32_t const begin = cta * kTopKChunk;
    int32_t const end = begin + kTopKChunk < r.len ? begin + kTopKChunk : r.len;
    int64_t tiesBefore = 0;
    if (search.outcome == kRadixThreshold && search.remaining < search.atThreshold)
    {
        // the ties at T in the chunks before this one: T's last digit in each earlier CTA's last-pass histogram
        uint32_t const* tails = topKTails(scratch, p.rows) + static_cast<int64_t>(row) * ctas * kRadixBins;
        uint32_t const digit = radixDigit(search.prefix, kRadixPasses - 1);
        unsigned long long mine = 0;
        for (int32_t c = tid; c < cta; c += kTopKThreads)
        {
            mine += tails[static_cast<int64_t>(c) * kRadixBins + digit];
        }
        tiesBefore = static_cast<int64_t>(blockSum(mine, s));
    }
    blockMark(r, begin, end, search, p.mark, tiesBefore, s);
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
    return p.rows >= 0 && p.len >= 0 && p.rows <= 65535 && p.stride >= p.len
        && (empty || (p.scores != nullptr && p.flags != nullptr && p.period >= 1));
}

//! launchTopK's sequence of launches over a launcher (kernels/topk.cu on a stream; the emulation test on the CPU):
//!   rows(p)                       topKRowKernel, grid (rows)
//!   zero(bytes)                   the row states at the start of the scratch
//!   pass(p, ctas, pass)           topKPassKernel, grid (ctas, rows)
//!   mark(p, ctas)                 topKMarkKernel, grid (ctas, rows)
//! Returns false (and launches nothing) for invalid rows or a scratch smaller than topKScratchBytes.
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
    TopKPlan const plan = topKPlan(p.rows, p.len);
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
