// CriticalKV's pruned stage 2, fp32 path (pruned_stage2.h, docs/operator.md step 6a): the bound of every older token,
// one thread per token and head, through the same __host__ __device__ functions as the host driver (same floats, same
// summation order, products rounded on their own), so the bounds are bitwise the host driver's; the weights-only terms
// it reads come from kernels/bound_terms.cuh. Included by kernels/value_norms.cu and by the CPU emulation.
#pragma once

#include "criticalkv/pruned_stage2.h"
#include "criticalkv/select_params.h"

#if defined(__CUDACC__)
#include "device_utils.cuh"
#endif

namespace criticalkv::kernels
{

struct BoundArgs
{
    SelectConfig config;
    bool skipUncompressed;
    RuntimeBudget budget;
    int32_t const* promptLengths;
    SelectShape shape;
    void const* values;
    void const* oProj;
    int32_t numTokens; // m: the older tokens
    float* gram;       // [H, d_h, d_h] G_h = W_O^h W_O^h^T
    float* rowL1;      // [H, d_h] s_h
    float* colL1;      // [H] c_h
    float* bounds;     // [B, H, numTokens]
};

//! bounds[b, h, i] = l1UpperBoundOf(V[b, g(h), i]) (the Gram terms of head h complete).
template <typename T>
__device__ void l1BoundAt(BoundArgs const& a, int32_t b, int32_t h, int32_t i)
{
    int32_t const d = a.shape.headDim;
    int32_t const g = h / (a.shape.heads / a.shape.kvHeads);
    T const* v = static_cast<T const*>(a.values) + ((static_cast<int64_t>(b) * a.shape.kvHeads + g) * a.shape.n + i) * d;
    auto value = [v](int32_t k) { return toFloat(v[k]); };
    a.bounds[(static_cast<int64_t>(b) * a.shape.heads + h) * a.numTokens + i] = l1UpperBoundOf(value,
        a.gram + static_cast<int64_t>(h) * d * d, a.rowL1 + static_cast<int64_t>(h) * d, a.colL1[h], d, a.shape.hidden);
}

} // namespace criticalkv::kernels
