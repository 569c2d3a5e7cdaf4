// Shared macros of the framework-free CriticalKV headers. No TensorRT, ONNX Runtime or torch includes here.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CKV_HD __host__ __device__ __forceinline__
#else
#define CKV_HD inline
#endif

namespace criticalkv
{

//! Element type of the float tensors (queries, keys, values, o_proj_weight, kept_keys, kept_values).
enum class DType : int32_t
{
    kFloat32 = 0,
    kFloat16 = 1,
    kBFloat16 = 2,
};

//! Budget-allocation base method of a policy (KVPolicy.base).
enum class BaseMethod : int32_t
{
    kFull = 0,
    kStreamingLLM = 1,
    kSnapKV = 2,
    kPyramidKV = 3,
    kAdaKV = 4,
    kLaProx = 5,
};

enum class ValueNorm : int32_t
{
    kL1 = 0,
    kL2 = 1,
};

enum class GqaReduce : int32_t
{
    kMean = 0,
    kKvpress = 1,
};

enum class Stage2Scores : int32_t
{
    kPooled = 0,
    kRaw = 1,
};

} // namespace criticalkv
