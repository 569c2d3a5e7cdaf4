// The CUDA built-ins the device sections (plugins/kernels/*_section.inc and the shared __host__ __device__ flows)
// use, for running them on the CPU with g++: one std::thread per CUDA thread of a block, __syncthreads() a
// std::barrier over them, blockIdx set by the driver loop before it starts a block's threads. Included first by
// every *_emulation.cpp (one program each), so the macros are set before any criticalkv header.
#pragma once

#include <atomic>
#include <barrier>
#include <thread>

struct ThreadIndex
{
    unsigned x, y, z;
};
thread_local ThreadIndex threadIdx, blockIdx;
std::barrier<>* gBarrier = nullptr;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__
#define __syncthreads() gBarrier->arrive_and_wait()

struct float2
{
    float x, y;
};

inline float2 make_float2(float x, float y)
{
    return float2{x, y};
}

template <typename T>
T atomicAdd(T* address, T value)
{
    return std::atomic_ref<T>(*address).fetch_add(value);
}
