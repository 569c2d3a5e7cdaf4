// CriticalKV's pruned stage 2, fp32 path (pruned_stage2.h, docs/operator.md step 6a): the weights-only terms of the
// L1 upper bound and the bound of every older token, one thread per entry, through the same __host__ __device__
// functions as the host driver (same floats, same summation order, products rounded on their own), so the bounds are
// bitwise the host driver's. Simple loops rather than tiles: the Gram matrices cost H d_h^2 hidden products per
// enqueue. Included by kernels/value_norms.cu and by the CPU emulation (testing/pruned_pipeline_emulation.cpp).
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

//! Entry e of query head h's bound terms: G_h[e / d_h, e % d_h] for e < d_h^2, s_h[e - d_h^2] for the next d_h.
template <typename T>
__device__ void boundTermAt(BoundArgs const& a, int32_t h, int64_t e)
{
    int32_t const d = a.shape.headDim;
    int64_t const ld = static_cast<int64_t>(a.shape.heads) * d;
    T const* w = static_cast<T const*>(a.oProj) + static_cast<int64_t>(h) * d;
    auto weight = [w, ld](int32_t c, int32_t k) { return toFloat(w[c * ld + k]); };
    int64_t const entries = static_cast<int64_t>(d) * d;
    if (e < entries)
    {
        int32_t const k = static_cast<int32_t>(e / d);
        int32_t const l = static_cast<int32_t>(e % d);
        a.gram[static_cast<int64_t>(h) * entries + e] = gramEntry(weight, k, l, a.shape.hidden);
    }
    else if (e < entries + d)
    {
        int32_t const k = static_cast<int32_t>(e - entries);
        a.rowL1[static_cast<int64_t>(h) * d + k] = rowL1Entry(weight, k, a.shape.hidden);
    }
}

//! c_h of query head h by one block of `threads` threads (every thread calls it; partial: [threads] shared).
template <typename T>
__device__ void columnL1Block(BoundArgs const& a, int32_t h, int32_t threads, float* partial)
{
    int32_t const d = a.shape.headDim;
    int64_t const ld = static_cast<int64_t>(a.shape.heads) * d;
    T const* w = static_cast<T const*>(a.oProj) + static_cast<int64_t>(h) * d;
    auto weight = [w, ld](int32_t c, int32_t k) { return toFloat(w[c * ld + k]); };
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    float best = 0.0F; // the host driver's start value
    for (int32_t c = tid; c < a.shape.hidden; c += threads)
    {
        float const column = columnL1(weight, c, d);
        best = column > best ? column : best;
    }
    partial[tid] = best;
    __syncthreads();
    if (tid == 0)
    {
        for (int32_t t = 1; t < threads; ++t)
        {
            best = partial[t] > best ? partial[t] : best;
        }
        a.colL1[h] = best;
    }
}

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
