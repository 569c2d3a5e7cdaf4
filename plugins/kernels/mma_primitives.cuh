// The warp-level tensor-core and asynchronous-copy instructions of the tiled kernels (mma_tiles.cuh), as inline PTX
// (sm_80 and newer: mma.sync, ldmatrix and cp.async run on Ampere and Hopper alike). testing/mma_emulation.h defines
// the same functions for the CPU emulation, with the lane layouts of criticalkv/mma_layout.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace criticalkv::kernels
{

//! Four 8x8 matrices of 16-bit elements from shared memory (ldmatrix.x4); `row` is this lane's row address.
__device__ __forceinline__ void ldmatrixX4(uint32_t (&r)[4], void const* row)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t const address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
#else
    (void) row;
    r[0] = r[1] = r[2] = r[3] = 0u;
    __trap();
#endif
}

//! d += A B on the tensor cores (m16n8k16, fp32 accumulate); fragments as in criticalkv/mma_layout.h.
template <typename T>
__device__ __forceinline__ void mmaSync(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2]);

template <>
__device__ __forceinline__ void mmaSync<__nv_bfloat16>(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2])
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    (void) d;
    (void) a;
    (void) b;
    __trap();
#endif
}

template <>
__device__ __forceinline__ void mmaSync<__half>(float (&d)[4], uint32_t const (&a)[4], uint32_t const (&b)[2])
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    (void) d;
    (void) a;
    (void) b;
    __trap();
#endif
}

//! 16 bytes global -> shared without passing through registers (cp.async.cg, L2 only); zero-filled when !valid
//! (src-size 0: nothing is read, `global` must still be a valid address).
__device__ __forceinline__ void cpAsync16(void* shared, void const* global, bool valid)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t const address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
    int32_t const bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(bytes));
#else
    (void) shared;
    (void) global;
    (void) valid;
    __trap();
#endif
}

__device__ __forceinline__ void cpAsyncCommit()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

//! Wait until at most `kPending` of this thread's committed copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cpAsyncWait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

__device__ __forceinline__ float shflXor(float value, int32_t mask)
{
    return __shfl_xor_sync(0xffffffffu, value, mask);
}

//! Two 16-bit elements (x low) in one register.
template <typename T>
__device__ __forceinline__ uint32_t packPair(T x, T y)
{
    uint16_t const lo = *reinterpret_cast<uint16_t const*>(&x);
    uint16_t const hi = *reinterpret_cast<uint16_t const*>(&y);
    return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

//! 16 bytes from global memory (16-byte aligned).
__device__ __forceinline__ uint4 load16(void const* address)
{
    return *static_cast<uint4 const*>(address);
}

//! The 16-bit element in the low (lowHalf) or high (highHalf) half of a 32-bit word of shared memory, as float.
template <typename T>
__device__ __forceinline__ float lowHalf(uint32_t pair);
template <typename T>
__device__ __forceinline__ float highHalf(uint32_t pair);

template <>
__device__ __forceinline__ float lowHalf<__nv_bfloat16>(uint32_t pair)
{
    return __uint_as_float(pair << 16);
}

template <>
__device__ __forceinline__ float highHalf<__nv_bfloat16>(uint32_t pair)
{
    return __uint_as_float(pair & 0xFFFF0000u);
}

template <>
__device__ __forceinline__ float lowHalf<__half>(uint32_t pair)
{
    return __half2float(__ushort_as_half(static_cast<unsigned short>(pair & 0xFFFFu)));
}

template <>
__device__ __forceinline__ float highHalf<__half>(uint32_t pair)
{
    return __half2float(__ushort_as_half(static_cast<unsigned short>(pair >> 16)));
}

//! float -> T rounded to nearest even.
template <typename T>
__device__ __forceinline__ T fromFloat(float value);

template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float value)
{
    return __float2bfloat16_rn(value);
}

template <>
__device__ __forceinline__ __half fromFloat<__half>(float value)
{
    return __float2half_rn(value);
}

} // namespace criticalkv::kernels
