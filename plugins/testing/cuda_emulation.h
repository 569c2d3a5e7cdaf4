// The CUDA built-ins the device code (kernel headers such as kernels/topk_device.cuh, the sections the older tests cut
// out of .cu files, and the shared __host__ __device__ flows) uses, for running it on the CPU with g++: one
// std::thread per CUDA thread of a block, __syncthreads() a std::barrier over them, blockIdx set by the driver loop
// before it starts a block's threads. Warp intrinsics exchange through a per-warp barrier of 32 threads (the
// device code calls them with full warps only, as the kernels do). emulateLaunch runs a grid's blocks one after
// another. Included first by every *_emulation.cpp (one program each), so the macros are set before any criticalkv
// header.
#pragma once

#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct ThreadIndex
{
    unsigned x, y, z;
};
thread_local ThreadIndex threadIdx, blockIdx;
ThreadIndex gridDim{1, 1, 1}, blockDim{1, 1, 1};
std::barrier<>* gBarrier = nullptr;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__
#define __restrict__
#define __syncthreads() gBarrier->arrive_and_wait()
#define __threadfence() std::atomic_thread_fence(std::memory_order_seq_cst)

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

template <typename T>
T atomicMax(T* address, T value)
{
    std::atomic_ref<T> ref(*address);
    T old = ref.load();
    while (old < value && !ref.compare_exchange_weak(old, value))
    {
    }
    return old;
}

//! One warp's exchange slots: every lane writes its value, the warp meets, every lane reads, the warp meets again.
struct EmulatedWarp
{
    std::barrier<> barrier{32};
    uint64_t slots[32] = {};
};
thread_local EmulatedWarp* tWarp = nullptr;

inline unsigned emulatedLane()
{
    return threadIdx.x % 32u;
}

//! Every lane's `value` (as 64 bits) after a full-warp exchange.
template <typename T>
void warpExchange(T value, uint64_t (&out)[32])
{
    static_assert(sizeof(T) <= sizeof(uint64_t), "warp exchange of at most 64 bits");
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    tWarp->slots[emulatedLane()] = bits;
    tWarp->barrier.arrive_and_wait();
    std::memcpy(out, tWarp->slots, sizeof(out));
    tWarp->barrier.arrive_and_wait();
}

template <typename T>
T warpSlot(uint64_t const (&all)[32], unsigned lane)
{
    T value;
    std::memcpy(&value, &all[lane], sizeof(T));
    return value;
}

inline void __syncwarp(unsigned = 0xffffffffu)
{
    tWarp->barrier.arrive_and_wait();
}

inline unsigned __ballot_sync(unsigned, int predicate)
{
    uint64_t all[32];
    warpExchange<int>(predicate != 0 ? 1 : 0, all);
    unsigned mask = 0;
    for (unsigned lane = 0; lane < 32; ++lane)
    {
        mask |= warpSlot<int>(all, lane) ? (1u << lane) : 0u;
    }
    return mask;
}

inline int __any_sync(unsigned mask, int predicate)
{
    return __ballot_sync(mask, predicate) != 0;
}

inline int __all_sync(unsigned mask, int predicate)
{
    return __ballot_sync(mask, predicate) == 0xffffffffu;
}

template <typename T>
T __shfl_sync(unsigned, T value, int source)
{
    uint64_t all[32];
    warpExchange(value, all);
    return warpSlot<T>(all, static_cast<unsigned>(source) % 32u);
}

template <typename T>
T __shfl_up_sync(unsigned, T value, unsigned delta)
{
    uint64_t all[32];
    warpExchange(value, all);
    unsigned const lane = emulatedLane();
    return lane >= delta ? warpSlot<T>(all, lane - delta) : value;
}

template <typename T>
T __shfl_down_sync(unsigned, T value, unsigned delta)
{
    uint64_t all[32];
    warpExchange(value, all);
    unsigned const lane = emulatedLane();
    return lane + delta < 32u ? warpSlot<T>(all, lane + delta) : value;
}

template <typename T>
T __shfl_xor_sync(unsigned, T value, int laneMask)
{
    uint64_t all[32];
    warpExchange(value, all);
    return warpSlot<T>(all, emulatedLane() ^ static_cast<unsigned>(laneMask));
}

template <typename T>
unsigned __match_any_sync(unsigned, T value)
{
    uint64_t all[32];
    warpExchange(value, all);
    T const mine = warpSlot<T>(all, emulatedLane());
    unsigned mask = 0;
    for (unsigned lane = 0; lane < 32; ++lane)
    {
        mask |= warpSlot<T>(all, lane) == mine ? (1u << lane) : 0u;
    }
    return mask;
}

inline int __popc(unsigned x)
{
    return __builtin_popcount(x);
}

inline int __popcll(unsigned long long x)
{
    return __builtin_popcountll(x);
}

inline int __ffs(int x)
{
    return __builtin_ffs(x);
}

inline unsigned __float_as_uint(float x)
{
    unsigned bits;
    std::memcpy(&bits, &x, sizeof(bits));
    return bits;
}

//! Run fn() as a grid of (grid.x, grid.y, grid.z) blocks of `threads` threads (1-D blocks, a multiple of 32):
//! blocks one after the other, a block's threads as std::threads meeting at one barrier, each warp at its own.
template <typename Fn>
void emulateLaunch(ThreadIndex grid, unsigned threads, Fn fn)
{
    gridDim = grid;
    blockDim = ThreadIndex{threads, 1, 1};
    for (unsigned z = 0; z < grid.z; ++z)
    {
        for (unsigned y = 0; y < grid.y; ++y)
        {
            for (unsigned x = 0; x < grid.x; ++x)
            {
                std::barrier<> barrier(static_cast<std::ptrdiff_t>(threads));
                gBarrier = &barrier;
                std::vector<std::unique_ptr<EmulatedWarp>> warps;
                for (unsigned w = 0; w < (threads + 31) / 32; ++w)
                {
                    warps.push_back(std::make_unique<EmulatedWarp>());
                }
                std::vector<std::thread> pool;
                pool.reserve(threads);
                for (unsigned t = 0; t < threads; ++t)
                {
                    pool.emplace_back([&, t, x, y, z] {
                        threadIdx = {t, 0, 0};
                        blockIdx = {x, y, z};
                        tWarp = warps[t / 32].get();
                        fn();
                    });
                }
                for (auto& thread : pool)
                {
                    thread.join();
                }
            }
        }
    }
}

//! A load past the L1 cache: a plain load here (blocks run one after another).
template <typename T>
T __ldcg(T const* address)
{
    return *address;
}
