// The launchers of the batched top-k (kernels/topk_device.cuh: runTopK, runMassCount) and of the selection flows
// (kernels/select_flows.cuh; pruned_pipeline_emulation.cpp wraps the flows' for kernels/pruned_flow.cuh) on the CPU: every launch through emulateLaunch (cuda_emulation.h), a memset a fill.
// For the *_emulation.cpp programs (include cuda_emulation.h first).
#pragma once

#include "select_flows.cuh"
#include "topk_device.cuh"

#include <algorithm>

//! Stream operations (kernel launches and memsets) an emulated launch sequence issued: what a CUDA graph of the
//! same sequence would hold.
struct LaunchCount
{
    int64_t kernels = 0;
    int64_t memsets = 0;
    int64_t topKCalls = 0;
    int64_t topKOperations = 0; //!< the top-k calls' own kernels and memsets

    int64_t operations() const
    {
        return kernels + memsets;
    }
};

//! runTopK / runMassCount's launcher on the CPU.
struct EmulatedTopKLaunch
{
    unsigned char* scratch;
    float const* limit = nullptr;
    int64_t* count = nullptr;
    LaunchCount* counter = nullptr;

    void counted(bool memset)
    {
        if (counter != nullptr)
        {
            (memset ? counter->memsets : counter->kernels) += 1;
            counter->topKOperations += 1;
        }
    }

    void rows(criticalkv::TopKRows const& p)
    {
        counted(false);
        emulateLaunch({static_cast<unsigned>(p.rows), 1, 1}, criticalkv::kTopKThreads, [&] {
            if (criticalkv::topKLevels(p) == 1)
            {
                criticalkv::kernels::topKRowKernel<1>(p);
            }
            else
            {
                criticalkv::kernels::topKRowKernel<criticalkv::kTopKMaxLevels>(p);
            }
        });
    }

    void zero(size_t bytes)
    {
        counted(true);
        std::fill(scratch, scratch + bytes, static_cast<unsigned char>(0));
    }

    void pass(criticalkv::TopKRows const& p, int32_t ctas, int32_t index)
    {
        counted(false);
        emulateLaunch({static_cast<unsigned>(ctas), static_cast<unsigned>(p.rows), 1}, criticalkv::kTopKThreads, [&] {
            if (criticalkv::topKLevels(p) == 1)
            {
                criticalkv::kernels::topKPassKernel<1>(p, scratch, ctas, index);
            }
            else
            {
                criticalkv::kernels::topKPassKernel<criticalkv::kTopKMaxLevels>(p, scratch, ctas, index);
            }
        });
    }

    void mark(criticalkv::TopKRows const& p, int32_t ctas)
    {
        counted(false);
        emulateLaunch({static_cast<unsigned>(ctas), static_cast<unsigned>(p.rows), 1}, criticalkv::kTopKThreads, [&] {
            if (criticalkv::topKLevels(p) == 1)
            {
                criticalkv::kernels::topKMarkKernel<1>(p, scratch, ctas);
            }
            else
            {
                criticalkv::kernels::topKMarkKernel<criticalkv::kTopKMaxLevels>(p, scratch, ctas);
            }
        });
    }

    void massPass(criticalkv::TopKRows const& p, int32_t ctas, int32_t index)
    {
        counted(false);
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
        counter.kernels += 1;
        emulateLaunch({grid.x, grid.y, grid.z}, static_cast<unsigned>(threads), [&] { fn(args...); });
    }

    void zero(void* pointer, size_t bytes)
    {
        counter.memsets += 1;
        std::fill(static_cast<unsigned char*>(pointer), static_cast<unsigned char*>(pointer) + bytes,
            static_cast<unsigned char>(0));
    }

    void* scratch;
    size_t scratchBytes;
    LaunchCount counter{};

    bool topK(criticalkv::TopKRows const& rows)
    {
        counter.topKCalls += 1;
        EmulatedTopKLaunch launch{static_cast<unsigned char*>(scratch), nullptr, nullptr, &counter};
        return criticalkv::kernels::runTopK(rows, scratch, scratchBytes, launch);
    }

    bool massCount(criticalkv::TopKRows const& rows, float const* limit, int64_t* count)
    {
        counter.topKCalls += 1;
        EmulatedTopKLaunch launch{static_cast<unsigned char*>(scratch), limit, count, &counter};
        return criticalkv::kernels::runMassCount(rows, limit, count, scratch, scratchBytes, launch);
    }
};
