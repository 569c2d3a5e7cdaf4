// CPU versions of the warp-level instructions of kernels/mma_primitives.cuh, for running the tensor-core tile bodies
// (kernels/mma_tiles.cuh) under the thread emulation of cuda_emulation.h (one fiber per CUDA thread). Every
// warp-collective instruction posts its lane's operands to the warp's exchange slots and meets the other 31 lanes at a
// barrier; the last lane to arrive computes every lane's result into the warp's result slots, which each lane then
// reads (a lane's next operands go to the operand slots, and the results change only once all 32 lanes met again):
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
inline float fromFloat<float>(float value)
{
    return value;
}

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

//! mma_primitives.cuh's load16: 16 bytes (cuda_emulation.h's uint4).
inline uint4 load16(void const* address)
{
    uint4 v;
    std::memcpy(&v, address, sizeof(v));
    return v;
}

//! mma_primitives.cuh's lowHalf / highHalf: the 16-bit element in either half of a 32-bit word, as float.
template <typename T>
float lowHalf(uint32_t pair)
{
    return toFloat(T{static_cast<uint16_t>(pair & 0xFFFFu)});
}

template <typename T>
float highHalf(uint32_t pair)
{
    return toFloat(T{static_cast<uint16_t>(pair >> 16)});
}

//! One warp's exchange slots for the tensor-core instructions (cuda_emulation.h's EmulatedWarp serves the shuffles,
//! ballots and matches of the other device code).
struct MmaWarp
{
    EmulatedBarrier sync{32};
    void const* rows[32];
    uint32_t a[32][4];
    uint32_t b[32][2];
    float c[32][4];
    float value[32];
    uint32_t loaded[32][4]; //!< results: ldmatrix registers
    float d[32][4];         //!< mma accumulators
    float shuffled[32];     //!< shflXor's sources
};

inline MmaWarp* tMmaWarp = nullptr; // the running fiber's (runEmulatedBlock sets them before every resume)

struct PendingCopy
{
    void* shared;
    void const* global;
    bool valid;
};

//! A thread's cp.async copies: the open group and the committed ones still in flight.
struct CopyQueue
{
    std::vector<PendingCopy> open;
    std::deque<std::vector<PendingCopy>> committed;
};
inline CopyQueue* tCopies = nullptr;

inline int32_t laneId()
{
    return static_cast<int32_t>(threadIdx.x) & 31;
}

inline void ldmatrixX4(uint32_t (&r)[4], void const* row)
{
    int32_t const lane = laneId();
    MmaWarp* const warp = tMmaWarp;
    warp->rows[lane] = row;
    warp->sync.arrive_and_wait([warp] {
        for (int32_t l = 0; l < 32; ++l)
        {
            mma::RowCol const e = mma::ldmatrixElement(l);
            for (int32_t q = 0; q < 4; ++q)
            {
                uint16_t const* source = static_cast<uint16_t const*>(warp->rows[q * 8 + e.row]);
                warp->loaded[l][q] = static_cast<uint32_t>(source[e.col]) | (static_cast<uint32_t>(source[e.col + 1]) << 16);
            }
        }
    });
    std::memcpy(r, warp->loaded[lane], sizeof(r));
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
    MmaWarp* const warp = tMmaWarp;
    std::memcpy(warp->a[lane], a, sizeof(a));
    std::memcpy(warp->b[lane], b, sizeof(b));
    std::memcpy(warp->c[lane], d, sizeof(d));
    warp->sync.arrive_and_wait([warp] {
        auto half = [](uint32_t reg, int32_t which) { return toFloat(T{static_cast<uint16_t>(reg >> (16 * which))}); };
        float matA[16][16];
        float matB[16][8];
        for (int32_t l = 0; l < 32; ++l)
        {
            for (int32_t r = 0; r < 4; ++r)
            {
                mma::RowCol const rc = mma::aFragment(l, r);
                matA[rc.row][rc.col] = half(warp->a[l][r], 0);
                matA[rc.row][rc.col + 1] = half(warp->a[l][r], 1);
            }
            for (int32_t r = 0; r < 2; ++r)
            {
                mma::RowCol const rc = mma::bFragment(l, r);
                matB[rc.row][rc.col] = half(warp->b[l][r], 0);
                matB[rc.row + 1][rc.col] = half(warp->b[l][r], 1);
            }
        }
        for (int32_t l = 0; l < 32; ++l)
        {
            for (int32_t e = 0; e < 4; ++e)
            {
                mma::RowCol const rc = mma::cFragment(l, e);
                double sum = warp->c[l][e];
                for (int32_t k = 0; k < 16; ++k)
                {
                    sum += static_cast<double>(matA[rc.row][k]) * static_cast<double>(matB[k][rc.col]);
                }
                warp->d[l][e] = truncateTowardZero(sum);
            }
        }
    });
    std::memcpy(d, warp->d[lane], sizeof(d));
}

inline void cpAsync16(void* shared, void const* global, bool valid)
{
    tCopies->open.push_back(PendingCopy{shared, global, valid});
}

inline void cpAsyncCommit()
{
    tCopies->committed.push_back(std::move(tCopies->open));
    tCopies->open.clear();
}

template <int kPending>
void cpAsyncWait()
{
    while (static_cast<int>(tCopies->committed.size()) > kPending)
    {
        for (PendingCopy const& copy : tCopies->committed.front())
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
        tCopies->committed.pop_front();
    }
}

inline float shflXor(float value, int32_t mask)
{
    int32_t const lane = laneId();
    MmaWarp* const warp = tMmaWarp;
    warp->value[lane] = value;
    warp->sync.arrive_and_wait([warp] { std::memcpy(warp->shuffled, warp->value, sizeof(warp->value)); });
    return warp->shuffled[lane ^ mask];
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
    std::vector<criticalkv::kernels::MmaWarp> warps(threads / 32);
    std::vector<criticalkv::kernels::CopyQueue> copies(threads);
    runBlockFibers(x, y, z, threads,
        [&] {
            fn();
            auto const& mine = *criticalkv::kernels::tCopies;
            if (!mine.committed.empty() || !mine.open.empty())
            {
                std::fprintf(stderr, "thread %u of block (%u, %u, %u) left copies in flight\n", threadIdx.x, x, y, z);
                std::abort();
            }
        },
        [&](unsigned t) {
            criticalkv::kernels::tMmaWarp = &warps[t / 32];
            criticalkv::kernels::tCopies = &copies[t];
        });
}
