// CriticalKV's pruned stage 2 (docs/operator.md step 6a): launchPrunedStage2 enqueues pruned_flow.cuh's sequence
// (runPrunedStage2: plan kernels, launchTopK over every head's row for stage 1, for every round's candidates at once
// (4 levels) and for the k kept, rounds of [exact norms of every head's candidates on the tensor cores, their exact C,
// the stop rule's count]) on a stream,
// and launchPrunedRow runs prunedStage2's block executor on precomputed scores for the GPU tests.
#include "criticalkv/kernels.h"
#include "device_utils.cuh"
#include "flow_launch.cuh"
#include "pruned_flow.cuh"

namespace criticalkv
{
namespace kernels
{
namespace
{

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

//! runPrunedStage2's launcher on a stream: the flows' launcher and the norm launch over the candidate lists.
struct PrunedLaunch : FlowLaunch
{
    ValueNormParams exactNorms;

    void norms(int32_t listed)
    {
        if (status == cudaSuccess)
        {
            exactNorms.rows.maxCount = listed;
            status = launchValueNorms(exactNorms, stream);
        }
    }
};

} // namespace
} // namespace kernels

cudaError_t launchPrunedStage2(PrunedStage2Params const& p, cudaStream_t stream)
{
    int32_t const m = p.shape.n - windowLength(p.config, p.shape.n);
    PrunedPlan const& plan = p.plan;
    if (p.shape.batch <= 0 || p.shape.kvHeads <= 0 || p.shape.heads % p.shape.kvHeads != 0 || p.maxCount < 0
        || p.norms == nullptr || p.attention == nullptr || p.critical == nullptr || p.exact == nullptr
        || p.flags == nullptr || p.candidates == nullptr || p.candidateCounts == nullptr || p.states == nullptr
        || plan.first == nullptr || plan.rounds == nullptr || plan.next == nullptr || plan.keep == nullptr
        || plan.firstValid == nullptr || plan.following == nullptr || plan.clearing == nullptr)
    {
        return cudaErrorInvalidValue;
    }
    if (m <= 0)
    {
        return cudaSuccess;
    }
    kernels::PrunedFlowArgs const a{p.config, p.shape, p.budget, p.promptLengths, p.raw, p.squares, p.norms,
        p.attention, p.critical, p.headCounts, p.exact, p.flags, p.candidates, p.candidateCounts, p.states, p.margin,
        plan};
    kernels::PrunedLaunch launch{{p.topKScratch, p.topKScratchBytes, stream}, {}};
    ValueNormParams& norms = launch.exactNorms;
    norms.shape = p.shape;
    norms.dtype = p.dtype;
    norms.values = p.values;
    norms.oProj = p.oProj;
    norms.numTokens = m;
    norms.kind = ValueNorm::kL1;
    norms.out = p.norms;
    norms.rows = GatheredRows{p.candidates, p.candidateCounts, m, 0};
    bool const accepted = kernels::runPrunedStage2(a, p.maxCount, launch);
    return launch.finish(accepted);
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
