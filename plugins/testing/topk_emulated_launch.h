// The launchers of the batched top-k (kernels/topk_device.cuh: runTopK, runMassCount) and of the selection flows
// (kernels/select_flows.cuh; pruned_pipeline_emulation.cpp wraps the flows' for kernels/pruned_flow.cuh) on the CPU: every launch through emulateLaunch (cuda_emulation.h), a memset a fill.
// For the *_emulation.cpp programs (include cuda_emulation.h first).
#pragma once

#include "select_flows.cuh"
#include "topk_device.cuh"

#include <algorithm>

//! runTopK / runMassCount's launcher on the CPU.
struct EmulatedTopKLaunch
{
    unsigned char* scratch;
    float const* limit = nullptr;
    int64_t* count = nullptr;

    void rows(criticalkv::TopKRows const& p)
    {
        emulateLaunch({static_cast<unsigned>(p.rows), 1, 1}, criticalkv::kTopKThreads,
            [&] { criticalkv::kernels::topKRowKernel(p); });
    }

    void zero(size_t bytes)
    {
        std::fill(scratch, scratch + bytes, static_cast<unsigned char>(0));
    }

    void pass(criticalkv::TopKRows const& p, int32_t ctas, int32_t index)
    {
        emulateLaunch({static_cast<unsigned>(ctas), static_cast<unsigned>(p.rows), 1}, criticalkv::kTopKThreads,
            [&] { criticalkv::kernels::topKPassKernel(p, scratch, ctas, index); });
    }

    void mark(criticalkv::TopKRows const& p, int32_t ctas)
    {
        emulateLaunch({static_cast<unsigned>(ctas), static_cast<unsigned>(p.rows), 1}, criticalkv::kTopKThreads,
            [&] { criticalkv::kernels::topKMarkKernel(p, scratch, ctas); });
    }

    void massPass(criticalkv::TopKRows const& p, int32_t ctas, int32_t index)
    {
        emulateLaunch({static_cast<unsigned>(ctas), static_cast<unsigned>(p.rows), 1}, criticalkv::kTopKThreads,
            [&] { criticalkv::kernels::massPassKernel(p, limit, count, scratch, ctas, index); });
    }
};

//! select_flows.cuh's launcher: plan kernels through emulateLaunch, top-k and mass counts through the launcher above
//! with the plan's scratch.
struct EmulatedFlowLaunch
{
    template <typename... Params, typename... Args>
    void kernel(void (*fn)(Params...), criticalkv::kernels::Grid3 grid, int threads, Args const&... args)
    {
        emulateLaunch({grid.x, grid.y, grid.z}, static_cast<unsigned>(threads), [&] { fn(args...); });
    }

    void zero(void* pointer, size_t bytes)
    {
        std::fill(static_cast<unsigned char*>(pointer), static_cast<unsigned char*>(pointer) + bytes,
            static_cast<unsigned char>(0));
    }

    void* scratch;
    size_t scratchBytes;

    bool topK(criticalkv::TopKRows const& rows)
    {
        EmulatedTopKLaunch launch{static_cast<unsigned char*>(scratch)};
        return criticalkv::kernels::runTopK(rows, scratch, scratchBytes, launch);
    }

    bool massCount(criticalkv::TopKRows const& rows, float const* limit, int64_t* count)
    {
        EmulatedTopKLaunch launch{static_cast<unsigned char*>(scratch), limit, count};
        return criticalkv::kernels::runMassCount(rows, limit, count, scratch, scratchBytes, launch);
    }
};
