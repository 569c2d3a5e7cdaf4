// CriticalKV's pruned stage 2 (docs/operator.md step 6a): launchPrunedStage2 enqueues the flow of pruned_flow.cuh
// (prepare, kPrunedRounds rounds of [exact norms of every head's candidates on the tensor cores, their exact C, the
// stop rule], finish), and launchPrunedRow runs prunedStage2's block executor on precomputed scores for the GPU tests.
#include "criticalkv/kernels.h"
#include "device_utils.cuh"
#include "pruned_flow.cuh"

namespace criticalkv
{
namespace kernels
{
namespace
{

constexpr int kScoreThreads = 256;

__global__ void __launch_bounds__(kPrunedThreads) prunedPrepareKernel(PrunedFlowArgs a)
{
    __shared__ PrunedSmem smem;
    prunedPrepareHead(a, smem);
}

__global__ void __launch_bounds__(kScoreThreads) prunedScoreKernel(PrunedFlowArgs a)
{
    prunedScoreAt(a, static_cast<int32_t>(blockIdx.x) * kScoreThreads + static_cast<int32_t>(threadIdx.x));
}

__global__ void __launch_bounds__(kPrunedThreads) prunedRoundKernel(PrunedFlowArgs a, int32_t lastRound)
{
    __shared__ PrunedSmem smem;
    prunedRoundHead(a, lastRound != 0, smem);
}

__global__ void __launch_bounds__(kPrunedThreads) prunedFinishKernel(PrunedFlowArgs a)
{
    __shared__ PrunedSmem smem;
    prunedFinishHead(a, smem);
}

//! prunedStage2 run by one block on precomputed exact scores `scores` (exact: [m] scratch; done: how many got their
//! exact score). For the GPU tests (launchPrunedRow).
__global__ void __launch_bounds__(kPrunedThreads) prunedRowKernel(float const* bound, float const* scores,
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

//! Upper bound of the candidates listed per head for norm launch `round`: the first 2k, then the new ones of each
//! doubling (2k, 4k, 8k: as many as were there), the last every remaining eligible token (at most m).
int32_t listBound(int32_t round, int32_t maxK, int32_t m)
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

} // namespace
} // namespace kernels

cudaError_t launchPrunedStage2(PrunedStage2Params const& p, cudaStream_t stream)
{
    int32_t const m = p.shape.n - windowLength(p.config, p.shape.n);
    if (p.shape.batch <= 0 || p.shape.kvHeads <= 0 || p.shape.heads % p.shape.kvHeads != 0 || p.maxCount < 0
        || p.norms == nullptr || p.attention == nullptr || p.critical == nullptr || p.exact == nullptr
        || p.flags == nullptr || p.candidates == nullptr || p.candidateCounts == nullptr || p.states == nullptr)
    {
        return cudaErrorInvalidValue;
    }
    if (m <= 0)
    {
        return cudaSuccess;
    }
    kernels::PrunedFlowArgs const a{p.config, p.shape, p.budget, p.promptLengths, p.raw, p.squares, p.norms,
        p.attention, p.critical, p.headCounts, p.exact, p.flags, p.candidates, p.candidateCounts, p.states, p.margin};
    dim3 const heads(static_cast<uint32_t>(p.shape.kvHeads), static_cast<uint32_t>(p.shape.batch));
    kernels::prunedPrepareKernel<<<heads, kernels::kPrunedThreads, 0, stream>>>(a);
    int32_t const maxK = p.maxCount < m ? p.maxCount : m;
    ValueNormParams norms{};
    norms.shape = p.shape;
    norms.dtype = p.dtype;
    norms.values = p.values;
    norms.oProj = p.oProj;
    norms.numTokens = m;
    norms.kind = ValueNorm::kL1;
    norms.out = p.norms;
    norms.rows = GatheredRows{p.candidates, p.candidateCounts, m, 0};
    for (int32_t round = 0; round <= kernels::kPrunedRounds; ++round)
    {
        int32_t const listed = kernels::listBound(round, maxK, m);
        norms.rows.maxCount = listed;
        cudaError_t const status = launchValueNorms(norms, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
        dim3 const scoreGrid(static_cast<uint32_t>((listed + kernels::kScoreThreads - 1) / kernels::kScoreThreads),
            static_cast<uint32_t>(p.shape.kvHeads), static_cast<uint32_t>(p.shape.batch));
        if (listed > 0)
        {
            kernels::prunedScoreKernel<<<scoreGrid, kernels::kScoreThreads, 0, stream>>>(a);
        }
        if (round < kernels::kPrunedRounds)
        {
            kernels::prunedRoundKernel<<<heads, kernels::kPrunedThreads, 0, stream>>>(
                a, round == kernels::kPrunedRounds - 1 ? 1 : 0);
        }
    }
    kernels::prunedFinishKernel<<<heads, kernels::kPrunedThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

cudaError_t launchPrunedRow(float const* bound, float const* scores, float* exact, uint8_t* flags, int32_t m,
    int32_t validStart, int64_t k, int64_t eligible, float margin, int64_t* done, cudaStream_t stream)
{
    if (m <= 0 || validStart < 0 || k <= 0 || k >= eligible || eligible > m)
    {
        return cudaErrorInvalidValue;
    }
    kernels::prunedRowKernel<<<1, kernels::kPrunedThreads, 0, stream>>>(
        bound, scores, exact, flags, m, validStart, k, eligible, margin, done);
    return cudaGetLastError();
}

} // namespace criticalkv
