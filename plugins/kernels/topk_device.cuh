// Device code of the batched top-k (criticalkv/topk.h, launched by kernels/topk.cu): block-wide steps over a chunk
// of a row and the kernels built from them. Plain CUDA C++ with no CUDA or CUB header of its own, so that the
// emulation tests (plugins/testing/topk_emulation.cpp) compile this very file with g++ and run it on the CPU
// (testing/cuda_emulation.h).
//
// A row's search is radix_select.h's RadixSearch. Short rows (<= kTopKSingleCtaMax) take one CTA and one launch:
// topKRowKernel runs every pass over the row with the histogram in shared memory. Long rows are cut into chunks of
// kTopKChunk entries, one CTA each, and take one launch per pass (topKPassKernel): every CTA adds its chunk's
// histogram to the row's global one in the scratch, and the CTA that arrives last (an atomic count, the
// threadfence-reduction pattern) chooses the digit and writes the row's search for the next launch; topKMarkKernel
// then marks. No CTA waits for another, so no co-residency is assumed. Ties at the threshold go to the lower
// index: within a chunk by a block scan in index order, across chunks by the last pass's per-CTA histograms.
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
    return TopKRow{p.scores + offset, p.flags + offset, p.len, p.period, p.firstValid != nullptr ? p.firstValid[row] : 0};
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
