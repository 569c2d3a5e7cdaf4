// Small device helpers shared by the .cu files (private to plugins/kernels).
#pragma once

#include "criticalkv/common.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace criticalkv::kernels
{

template <typename T>
__device__ __forceinline__ float toFloat(T value);

template <>
__device__ __forceinline__ float toFloat<float>(float value)
{
    return value;
}

template <>
__device__ __forceinline__ float toFloat<__half>(__half value)
{
    return __half2float(value);
}

template <>
__device__ __forceinline__ float toFloat<__nv_bfloat16>(__nv_bfloat16 value)
{
    return __bfloat162float(value);
}

__device__ __forceinline__ float warpMax(float value)
{
    for (int offset = 16; offset > 0; offset >>= 1)
    {
        value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    }
    return value;
}

__device__ __forceinline__ float warpSum(float value)
{
    for (int offset = 16; offset > 0; offset >>= 1)
    {
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    }
    return value;
}

//! Dispatch a functor templated on the element type.
template <typename Fn>
cudaError_t dispatchDType(DType dtype, Fn&& fn)
{
    switch (dtype)
    {
    case DType::kFloat32: return fn(float{});
    case DType::kFloat16: return fn(__half{});
    case DType::kBFloat16: return fn(__nv_bfloat16{});
    }
    return cudaErrorInvalidValue;
}

//! Opt a kernel into more than 48 KiB of dynamic shared memory when it needs it.
template <typename Kernel>
cudaError_t allowDynamicSharedMemory(Kernel kernel, size_t bytes)
{
    if (bytes <= 48 * 1024)
    {
        return cudaSuccess;
    }
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

} // namespace criticalkv::kernels
