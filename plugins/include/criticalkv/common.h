// Shared macros of the framework-free CriticalKV headers. No TensorRT, ONNX Runtime or torch includes here.
#pragma once

#include "criticalkv/policy_fields.h" // BaseMethod, ValueNorm, GqaReduce, Stage2Scores (generated)

#include <cstdint>

#if defined(__CUDACC__)
#define CKV_HD __host__ __device__ __forceinline__
#else
#define CKV_HD inline
#endif

// A kernel block's shared variables: __shared__ on the GPU; under the CPU emulation (its blocks run one after another,
// testing/cuda_emulation.h) one static copy that every thread of the running block sees. For the kernels' .cuh files
// that the emulation tests compile with g++ (topk_block.cuh, key_scores.cuh).
#if defined(__CUDACC__)
#define CKV_BLOCK_SHARED __shared__
#else
#define CKV_BLOCK_SHARED static
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

} // namespace criticalkv
