// The launcher of the fixed launch sequences written as host templates over a launcher (kernels/select_flows.cuh:
// runSelection, ...; kernels/pruned_flow.cuh: runPrunedStage2) on a stream; the CPU emulation has its own
// (testing/topk_emulated_launch.h). Included by kernels/selection.cu and kernels/pruned.cu.
#pragma once

#include "criticalkv/kernels.h"
#include "select_flow_args.h"

#include <cuda_runtime_api.h>

namespace criticalkv::kernels
{

//! The flows' launcher on a stream: kernels, memsets and top-k calls in order, the first error kept (later steps are
//! then skipped).
struct FlowLaunch
{
    void* scratch;
    size_t scratchBytes;
    cudaStream_t stream;
    cudaError_t status = cudaSuccess;

    template <typename... Params, typename... Args>
    void kernel(void (*fn)(Params...), Grid3 grid, int threads, Args const&... args)
    {
        if (status == cudaSuccess)
        {
            fn<<<dim3(grid.x, grid.y, grid.z), threads, 0, stream>>>(args...);
            status = cudaGetLastError();
        }
    }

    void zero(void* pointer, size_t bytes)
    {
        if (status == cudaSuccess && bytes > 0)
        {
            status = cudaMemsetAsync(pointer, 0, bytes, stream);
        }
    }

    bool topK(TopKRows const& rows)
    {
        if (status == cudaSuccess)
        {
            status = launchTopK(rows, scratch, scratchBytes, stream);
        }
        return status == cudaSuccess;
    }

    bool massCount(TopKRows const& rows, float const* limit, int64_t* count)
    {
        if (status == cudaSuccess)
        {
            status = launchMassCount(rows, limit, count, scratch, scratchBytes, stream);
        }
        return status == cudaSuccess;
    }

    cudaError_t finish(bool accepted) const
    {
        return status != cudaSuccess ? status : (accepted ? cudaSuccess : cudaErrorInvalidValue);
    }
};

} // namespace criticalkv::kernels
