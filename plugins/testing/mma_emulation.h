// CPU versions of the warp-level instructions of kernels/mma_primitives.cuh, for running the tensor-core tile bodies
// (kernels/mma_tiles.cuh) under the thread emulation of cuda_emulation.h (one std::thread per CUDA thread). Every
// warp-collective instruction posts its lane's operands to the warp's exchange slots, meets the other 31 lanes at a
// barrier, computes its result from the slots and meets them again before the slots can be reused:
// * ldmatrixX4: register q of a lane = row (lane >> 2), columns 2 (lane % 4), +1 of the 8x8 matrix whose row addresses
//   lanes 8q..8q+7 gave (criticalkv/mma_layout.h: ldmatrixElement);
// * mmaSync: A, B rebuilt from the 32 lanes' fragments by aFragment / bFragment, D by cFragment; the products exact,
//   their sum with C exact, then rounded toward zero (a model of the tensor core's truncating fp32 accumulation);
// * cpAsync16: the copy is deferred to the cpAsyncWait that retires its group (the latest moment the hardware may
//   complete it), so a read before the wait sees stale shared memory;
// * shflXor through the slots (and warpMax / warpSum of device_utils.cuh over it).
// Included after cuda_emulation.h, before the tile bodies. Not built by CMake (tests/plugins compile it with g++).
#pragma once

#include "criticalkv/mma_layout.h"

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <vector>

struct __nv_bfloat16
{
    uint16_t bits;
};

struct __half
{
    uint16_t bits;
};

namespace criticalkv::kernels
{

inline float toFloat(float value)
{
    return value;
}

inline float toFloat(__nv_bfloat16 value)
{
    uint32_t const bits = static_cast<uint32_t>(value.bits) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

inline float toFloat(__half value)
{
    _Float16 h;
    std::memcpy(&h, &value.bits, sizeof(h));
    return static_cast<float>(h);
}

template <typename T>
T fromFloat(float value);

template <>
inline __nv_bfloat16 fromFloat<__nv_bfloat16>(float value)
{
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    bits += 0x7FFFu + ((bits >> 16) & 1u); // round to nearest even (finite inputs)
    return __nv_bfloat16{static_cast<uint16_t>(bits >> 16)};
}

template <>
inline __half fromFloat<__half>(float value)
{
    _Float16 const h = static_cast<_Float16>(value);
    __half out;
    std::memcpy(&out.bits, &h, sizeof(h));
    return out;
}

//! One warp's exchange slots for the tensor-core instructions (cuda_emulation.h's EmulatedWarp serves the shuffles,
//! ballots and matches of the other device code).
struct MmaWarp
{
    std::barrier<> sync{32};
    void const* rows[32];
    uint32_t a[32][4];
    uint32_t b[32][2];
    float value[32];
};

inline thread_local MmaWarp* tMmaWarp = nullptr;

struct PendingCopy
{
    void* shared;
    void const* global;
    bool valid;
};

inline thread_local std::vector<PendingCopy> tOpenGroup;
inline thread_local std::deque<std::vector<PendingCopy>> tCommitted;

inline int32_t laneId()
{
    return static_cast<int32_t>(threadIdx.x) & 31;
}

inline void ldmatrixX4(uint32_t (&r)[4], void const* row)
{
    int32_t const lane = laneId();
    tMmaWarp->rows[lane] = row;
    tMmaWarp->sync.arrive_and_wait();
    mma::RowCol const e = mma::ldmatrixElement(lane);
    for (int32_t q = 0; q < 4; ++q)
    {
        uint16_t const* source = static_cast<uint16_t const*>(tMmaWarp->rows[q * 8 + e.row]);
        r[q] = static_cast<uint32_t>(source[e.col]) | (static_cast<uint32_t>(source[e.col + 1]) << 16);
    }
    tMmaWarp->sync.arrive_and_wait();
}

inline float truncateTowardZero(double x)
{
    float f = static_cast<float>(x);
    if (std::fabs(static_cast<double>(f)) > std::fabs(x))
    {
        f = std::nextafter(f, 0.0F);
    }
    return f;
}

template <typename T>
void mmaSync(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2])
{
    int32_t const lane = laneId();
    std::memcpy(tMmaWarp->a[lane], a, sizeof(a));
    std::memcpy(tMmaWarp->b[lane], b, sizeof(b));
    tMmaWarp->sync.arrive_and_wait();
    auto half = [](uint32_t reg, int32_t which) { return toFloat(T{static_cast<uint16_t>(reg >> (16 * which))}); };
    float matA[16][16];
    float matB[16][8];
    for (int32_t l = 0; l < 32; ++l)
    {
        for (int32_t r = 0; r < 4; ++r)
        {
            mma::RowCol const rc = mma::aFragment(l, r);
            matA[rc.row][rc.col] = half(tMmaWarp->a[l][r], 0);
            matA[rc.row][rc.col + 1] = half(tMmaWarp->a[l][r], 1);
        }
        for (int32_t r = 0; r < 2; ++r)
        {
            mma::RowCol const rc = mma::bFragment(l, r);
            matB[rc.row][rc.col] = half(tMmaWarp->b[l][r], 0);
            matB[rc.row + 1][rc.col] = half(tMmaWarp->b[l][r], 1);
        }
    }
    for (int32_t e = 0; e < 4; ++e)
    {
        mma::RowCol const rc = mma::cFragment(lane, e);
        double sum = d[e];
        for (int32_t k = 0; k < 16; ++k)
        {
            sum += static_cast<double>(matA[rc.row][k]) * static_cast<double>(matB[k][rc.col]);
        }
        d[e] = truncateTowardZero(sum);
    }
    tMmaWarp->sync.arrive_and_wait();
}

inline void cpAsync16(void* shared, void const* global, bool valid)
{
    tOpenGroup.push_back(PendingCopy{shared, global, valid});
}

inline void cpAsyncCommit()
{
    tCommitted.push_back(std::move(tOpenGroup));
    tOpenGroup.clear();
}

template <int kPending>
void cpAsyncWait()
{
    while (static_cast<int>(tCommitted.size()) > kPending)
    {
        for (PendingCopy const& copy : tCommitted.front())
        {
            if (copy.valid)
            {
                std::memcpy(copy.shared, copy.global, 16);
            }
            else
            {
                std::memset(copy.shared, 0, 16);
            }
        }
        tCommitted.pop_front();
    }
}

inline float shflXor(float value, int32_t mask)
{
    int32_t const lane = laneId();
    tMmaWarp->value[lane] = value;
    tMmaWarp->sync.arrive_and_wait();
    float const other = tMmaWarp->value[lane ^ mask];
    tMmaWarp->sync.arrive_and_wait();
    return other;
}

//! device_utils.cuh's warp reductions (butterfly over the lanes, as on the device).
inline float warpMax(float value)
{
    for (int32_t offset = 16; offset > 0; offset >>= 1)
    {
        value = fmaxf(value, shflXor(value, offset));
    }
    return value;
}

inline float warpSum(float value)
{
    for (int32_t offset = 16; offset > 0; offset >>= 1)
    {
        value += shflXor(value, offset);
    }
    return value;
}

} // namespace criticalkv::kernels

//! Run one block of `threads` emulated threads (threads % 32 == 0), warps with their exchange slots (the tensor-core
//! instructions' and cuda_emulation.h's), fn() in each.
template <typename Fn>
void runEmulatedBlock(unsigned x, unsigned y, unsigned z, unsigned threads, Fn fn)
{
    std::barrier<> barrier(threads);
    gBarrier = &barrier;
    blockDim = ThreadIndex{threads, 1, 1};
    std::vector<criticalkv::kernels::MmaWarp> warps(threads / 32);
    std::vector<EmulatedWarp> shuffles(threads / 32);
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t)
    {
        pool.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            blockIdx = {x, y, z};
            criticalkv::kernels::tMmaWarp = &warps[t / 32];
            tWarp = &shuffles[t / 32];
            criticalkv::kernels::tOpenGroup.clear();
            criticalkv::kernels::tCommitted.clear();
            fn();
            if (!criticalkv::kernels::tCommitted.empty() || !criticalkv::kernels::tOpenGroup.empty())
            {
                std::fprintf(stderr, "thread %u of block (%u, %u, %u) left copies in flight\n", t, x, y, z);
                std::abort();
            }
        });
    }
    for (auto& thread : pool)
    {
        thread.join();
    }
}
