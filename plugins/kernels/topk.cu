// The batched top-k (criticalkv/topk.h) on a stream: topk_device.cuh's kernels in runTopK's sequence.
//
// Rows of at most kTopKSingleCtaMax entries: one launch, one CTA per row. Longer rows: a memset of the row states,
// one launch per radix pass (4) and one that marks, each with kTopKChunk entries per CTA. One launch per pass rather
// than a persistent kernel with a grid-wide barrier (FlashInfer's RadixTopKMultiCTA): no CTA ever waits for another,
// so nothing assumes that a row's CTAs are resident at once (a persistent kernel sized to the SM count deadlocks when
// another stream's kernels or a smaller MIG slice hold SMs), every launch is an ordinary graph node, and the CPU
// emulation runs the same kernels with the blocks one after another. The price is ~5 kernel boundaries per call
// (a few microseconds each in a CUDA graph) and a re-read of the chunk per pass from L2 instead of shared memory.
#include "criticalkv/kernels.h"
#include "device_utils.cuh"

#include "topk_device.cuh"

namespace criticalkv
{
namespace
{

struct StreamLaunch
{
    void* scratch;
    cudaStream_t stream;
    cudaError_t status = cudaSuccess;

    unsigned char* bytes() const
    {
        return static_cast<unsigned char*>(scratch);
    }

    void rows(TopKRows const& p)
    {
        if (topKLevels(p) == 1)
        {
            kernels::topKRowKernel<1><<<static_cast<uint32_t>(p.rows), kTopKThreads, 0, stream>>>(p);
        }
        else
        {
            kernels::topKRowKernel<kTopKMaxLevels><<<static_cast<uint32_t>(p.rows), kTopKThreads, 0, stream>>>(p);
        }
    }

    void zero(size_t size)
    {
        if (status == cudaSuccess)
        {
            status = cudaMemsetAsync(scratch, 0, size, stream);
        }
    }

    void pass(TopKRows const& p, int32_t ctas, int32_t index)
    {
        dim3 const grid(static_cast<uint32_t>(ctas), static_cast<uint32_t>(p.rows));
        if (topKLevels(p) == 1)
        {
            kernels::topKPassKernel<1><<<grid, kTopKThreads, 0, stream>>>(p, bytes(), ctas, index);
        }
        else
        {
            kernels::topKPassKernel<kTopKMaxLevels><<<grid, kTopKThreads, 0, stream>>>(p, bytes(), ctas, index);
        }
    }

    void mark(TopKRows const& p, int32_t ctas)
    {
        dim3 const grid(static_cast<uint32_t>(ctas), static_cast<uint32_t>(p.rows));
        if (topKLevels(p) == 1)
        {
            kernels::topKMarkKernel<1><<<grid, kTopKThreads, 0, stream>>>(p, bytes(), ctas);
        }
        else
        {
            kernels::topKMarkKernel<kTopKMaxLevels><<<grid, kTopKThreads, 0, stream>>>(p, bytes(), ctas);
        }
    }

    float const* limit = nullptr;
    int64_t* count = nullptr;

    void massPass(TopKRows const& p, int32_t ctas, int32_t index)
    {
        dim3 const grid(static_cast<uint32_t>(ctas), static_cast<uint32_t>(p.rows));
        kernels::massPassKernel<<<grid, kTopKThreads, 0, stream>>>(p, limit, count, bytes(), ctas, index);
    }

    cudaError_t finish() const
    {
        return status != cudaSuccess ? status : cudaGetLastError();
    }
};

} // namespace

cudaError_t launchTopK(TopKRows const& rows, void* scratch, size_t scratchBytes, cudaStream_t stream)
{
    StreamLaunch launch{scratch, stream};
    if (!kernels::runTopK(rows, scratch, scratchBytes, launch))
    {
        return cudaErrorInvalidValue;
    }
    return launch.finish();
}

cudaError_t launchMassCount(TopKRows const& rows, float const* limit, int64_t* count, void* scratch,
    size_t scratchBytes, cudaStream_t stream)
{
    StreamLaunch launch{scratch, stream};
    launch.limit = limit;
    launch.count = count;
    if (!kernels::runMassCount(rows, limit, count, scratch, scratchBytes, launch))
    {
        return cudaErrorInvalidValue;
    }
    return launch.finish();
}

} // namespace criticalkv
