// Fused projected-value norms: N[b, h, i] = || V[b, g(h), i] W_O^h || without materialising the
// [n, hidden] product. A 64-token tile of V and 64-column chunks of W_O^h go through shared memory; the
// product tile is reduced to sum |x| (L1) or sum x^2 (L2) in the epilogue and accumulated per token in fp32.
//
// * fp16 / bf16 with d_h % 16 == 0: tensor cores (WMMA 16x16x16, fp32 accumulate), sm_80 and newer. One block
//   loads its V tile once and loops over the query heads of the KV group and over the hidden dimension.
// * fp32 (and any d_h): a SIMT FMA kernel (4x4 register tile per thread). No TF32: that would lose the
//   precision the fp32 reference has.
// * L2 with a Gram scratch buffer (the pipeline's path, the reference's formula): G_h = W_O^h W_O^h^T [d_h, d_h]
//   once per launch (H d_h^2 d FLOPs, weights only), then N = sqrt(v^T G_h v) per token (2 d_h^2 FLOPs instead of
//   2 d_h d: d / d_h = 32x fewer for Llama-3-8B). fp32 throughout (SIMT).
// * L2 without one: the direct sum of squares of the product, on the paths above.
#include "criticalkv/kernels.h"
#include "criticalkv/pruned_stage2.h"
#include "device_utils.cuh"

#include <mma.h>

#include <cstdint>

namespace criticalkv
{
namespace kernels
{
namespace
{

constexpr int kTokenTile = 64;
constexpr int kColumnTile = 64;
constexpr int kSimtThreads = 256;
constexpr int kSimtDepth = 16;
constexpr int kWmmaThreads = 128;
constexpr int kWmmaPad = 8;  // elements of row padding (16 bytes) for the 16-bit tiles
constexpr int kAccPad = 4;   // floats of row padding of the accumulator tile

struct NormArgs
{
    SelectConfig config;
    bool skipUncompressed;
    int32_t const* promptLengths;
    RuntimeBudget budget;
    SelectShape shape;
    void const* values;
    void const* oProj;
    int32_t numTokens;
    float* out; // [B, H, numTokens]
};

__device__ __forceinline__ bool skipBatch(NormArgs const& a, int32_t b)
{
    return a.skipUncompressed && !sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress;
}

//! SIMT path. grid (token tiles, H, B), block kSimtThreads: thread (ty, tx) owns tokens ty*4.. and columns tx*4..
template <typename T, bool kL2>
__global__ void __launch_bounds__(kSimtThreads) valueNormsSimtKernel(NormArgs a)
{
    int32_t const tile = static_cast<int32_t>(blockIdx.x);
    int32_t const h = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    if (skipBatch(a, b))
    {
        return;
    }
    int32_t const d = a.shape.headDim;
    int32_t const n = a.shape.n;
    int32_t const hidden = a.shape.hidden;
    int64_t const ld = static_cast<int64_t>(a.shape.heads) * d;
    int32_t const g = h / (a.shape.heads / a.shape.kvHeads);
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const tx = tid % 16;
    int32_t const ty = tid / 16;
    int32_t const tokenBegin = tile * kTokenTile;

    __shared__ float valueTile[kSimtDepth][kTokenTile + 4];
    __shared__ float weightTile[kSimtDepth][kColumnTile + 4];

    T const* values = static_cast<T const*>(a.values) + (static_cast<int64_t>(b) * a.shape.kvHeads + g) * n * d;
    T const* weights = static_cast<T const*>(a.oProj) + static_cast<int64_t>(h) * d; // W_O^h[k, c] = weights[c*ld + k]

    float rowSum[4] = {0.0F, 0.0F, 0.0F, 0.0F};
    for (int32_t c0 = 0; c0 < hidden; c0 += kColumnTile)
    {
        float acc[4][4] = {};
        for (int32_t k0 = 0; k0 < d; k0 += kSimtDepth)
        {
            for (int32_t e = tid; e < kTokenTile * kSimtDepth; e += kSimtThreads)
            {
                int32_t const row = e / kSimtDepth;
                int32_t const kk = e % kSimtDepth;
                int32_t const token = tokenBegin + row;
                valueTile[kk][row] = token < a.numTokens && k0 + kk < d
                    ? toFloat(values[static_cast<int64_t>(token) * d + k0 + kk])
                    : 0.0F;
                int32_t const column = c0 + row;
                weightTile[kk][row] = column < hidden && k0 + kk < d
                    ? toFloat(weights[static_cast<int64_t>(column) * ld + k0 + kk])
                    : 0.0F;
            }
            __syncthreads();
#pragma unroll
            for (int32_t kk = 0; kk < kSimtDepth; ++kk)
            {
                float v[4];
                float wv[4];
#pragma unroll
                for (int32_t r = 0; r < 4; ++r)
                {
                    v[r] = valueTile[kk][ty * 4 + r];
                    wv[r] = weightTile[kk][tx * 4 + r];
                }
#pragma unroll
                for (int32_t r = 0; r < 4; ++r)
                {
#pragma unroll
                    for (int32_t c = 0; c < 4; ++c)
                    {
                        acc[r][c] = fmaf(v[r], wv[c], acc[r][c]);
                    }
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int32_t r = 0; r < 4; ++r)
        {
#pragma unroll
            for (int32_t c = 0; c < 4; ++c)
            {
                rowSum[r] += kL2 ? acc[r][c] * acc[r][c] : fabsf(acc[r][c]);
            }
        }
    }
    // The 16 threads sharing ty are 16 consecutive lanes of one warp.
#pragma unroll
    for (int32_t r = 0; r < 4; ++r)
    {
        for (int32_t offset = 8; offset > 0; offset >>= 1)
        {
            rowSum[r] += __shfl_xor_sync(0xffffffffu, rowSum[r], offset);
        }
    }
    if (tx == 0)
    {
        float* out = a.out + (static_cast<int64_t>(b) * a.shape.heads + h) * a.numTokens;
        for (int32_t r = 0; r < 4; ++r)
        {
            int32_t const token = tokenBegin + ty * 4 + r;
            if (token < a.numTokens)
            {
                out[token] = kL2 ? sqrtf(rowSum[r]) : rowSum[r];
            }
        }
    }
}

size_t wmmaSharedBytes(int32_t headDim)
{
    return 2 * static_cast<size_t>(kTokenTile) * (headDim + kWmmaPad) * 2 // value and weight tiles, 16-bit
        + static_cast<size_t>(kTokenTile) * (kColumnTile + kAccPad) * sizeof(float);
}

//! Tensor-core path for 16-bit inputs, d_h % 16 == 0. grid (token tiles, H_kv, B), block kWmmaThreads (4 warps,
//! each a 32x32 quarter of the 64x64 product tile).
template <typename T, bool kL2>
__global__ void __launch_bounds__(kWmmaThreads) valueNormsWmmaKernel(NormArgs a)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using namespace nvcuda;
    int32_t const tile = static_cast<int32_t>(blockIdx.x);
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    if (skipBatch(a, b))
    {
        return;
    }
    int32_t const d = a.shape.headDim;
    int32_t const n = a.shape.n;
    int32_t const hidden = a.shape.hidden;
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    int64_t const ld = static_cast<int64_t>(a.shape.heads) * d;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const tokenBegin = tile * kTokenTile;
    int32_t const stride = d + kWmmaPad;
    int32_t const vectorsPerRow = d / 8; // 8 x 16-bit = one uint4

    extern __shared__ __align__(128) unsigned char sharedBytes[];
    T* valueTile = reinterpret_cast<T*>(sharedBytes);         // [64 tokens][d + pad], row-major A
    T* weightTile = valueTile + kTokenTile * stride;           // [64 columns][d + pad]: column-major B (k fastest)
    float* accTile = reinterpret_cast<float*>(weightTile + kColumnTile * stride); // [64][64 + pad]

    T const* values = static_cast<T const*>(a.values) + (static_cast<int64_t>(b) * a.shape.kvHeads + g) * n * d;
    for (int32_t e = tid; e < kTokenTile * vectorsPerRow; e += kWmmaThreads)
    {
        int32_t const row = e / vectorsPerRow;
        int32_t const vec = e % vectorsPerRow;
        int32_t const token = tokenBegin + row;
        uint4 chunk = make_uint4(0, 0, 0, 0);
        if (token < a.numTokens)
        {
            chunk = *reinterpret_cast<uint4 const*>(values + static_cast<int64_t>(token) * d + vec * 8);
        }
        *reinterpret_cast<uint4*>(valueTile + row * stride + vec * 8) = chunk;
    }

    int32_t const warp = tid / 32;
    int32_t const warpRow = (warp / 2) * 32;
    int32_t const warpCol = (warp % 2) * 32;
    int32_t const sumRow = tid / 2;  // epilogue: two threads per token row
    int32_t const sumHalf = tid % 2;

    for (int32_t h = g * group; h < (g + 1) * group; ++h)
    {
        T const* weights = static_cast<T const*>(a.oProj) + static_cast<int64_t>(h) * d;
        float rowSum = 0.0F;
        for (int32_t c0 = 0; c0 < hidden; c0 += kColumnTile)
        {
            __syncthreads(); // value tile ready / previous chunk's weight and accumulator tiles consumed
            for (int32_t e = tid; e < kColumnTile * vectorsPerRow; e += kWmmaThreads)
            {
                int32_t const column = e / vectorsPerRow;
                int32_t const vec = e % vectorsPerRow;
                uint4 chunk = make_uint4(0, 0, 0, 0);
                if (c0 + column < hidden)
                {
                    chunk = *reinterpret_cast<uint4 const*>(weights + static_cast<int64_t>(c0 + column) * ld + vec * 8);
                }
                *reinterpret_cast<uint4*>(weightTile + column * stride + vec * 8) = chunk;
            }
            __syncthreads();

            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
            for (int i = 0; i < 2; ++i)
            {
#pragma unroll
                for (int j = 0; j < 2; ++j)
                {
                    wmma::fill_fragment(acc[i][j], 0.0F);
                }
            }
            for (int32_t kk = 0; kk < d; kk += 16)
            {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> aFrag[2];
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bFrag[2];
#pragma unroll
                for (int i = 0; i < 2; ++i)
                {
                    wmma::load_matrix_sync(aFrag[i], valueTile + (warpRow + i * 16) * stride + kk, stride);
                    wmma::load_matrix_sync(bFrag[i], weightTile + (warpCol + i * 16) * stride + kk, stride);
                }
#pragma unroll
                for (int i = 0; i < 2; ++i)
                {
#pragma unroll
                    for (int j = 0; j < 2; ++j)
                    {
                        wmma::mma_sync(acc[i][j], aFrag[i], bFrag[j], acc[i][j]);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
            {
#pragma unroll
                for (int j = 0; j < 2; ++j)
                {
                    wmma::store_matrix_sync(accTile + (warpRow + i * 16) * (kColumnTile + kAccPad) + warpCol + j * 16,
                        acc[i][j], kColumnTile + kAccPad, wmma::mem_row_major);
                }
            }
            __syncthreads();
            float part = 0.0F;
            float const* accRow = accTile + sumRow * (kColumnTile + kAccPad) + sumHalf * 32;
#pragma unroll 8
            for (int32_t c = 0; c < 32; ++c)
            {
                float const x = accRow[c];
                part += kL2 ? x * x : fabsf(x);
            }
            part += __shfl_xor_sync(0xffffffffu, part, 1);
            rowSum += part;
        }
        int32_t const token = tokenBegin + sumRow;
        if (sumHalf == 0 && token < a.numTokens)
        {
            a.out[(static_cast<int64_t>(b) * a.shape.heads + h) * a.numTokens + token] = kL2 ? sqrtf(rowSum) : rowSum;
        }
    }
#else
    __trap(); // the tensor-core path is only launched on sm_80 and newer
#endif
}

constexpr int kGramTile = 16;
constexpr int kQuadTokens = 32;
constexpr int kQuadColumns = 16;
constexpr int kQuadLanes = 8; // threads per token: each owns kQuadColumns / kQuadLanes Gram columns of a chunk
constexpr int kQuadThreads = kQuadTokens * kQuadLanes;

//! G[h, k, l] = sum_c W_O[c, h d_h + k] W_O[c, h d_h + l] in fp32. grid (ceil(d_h / 16), ceil(d_h / 16), H),
//! block 16 x 16: a 16 x 16 tile of G from 16-row slabs of W_O^h in shared memory.
template <typename T>
__global__ void __launch_bounds__(kGramTile * kGramTile) gramKernel(NormArgs a, float* gram)
{
    int32_t const d = a.shape.headDim;
    int32_t const h = static_cast<int32_t>(blockIdx.z);
    int32_t const k0 = static_cast<int32_t>(blockIdx.x) * kGramTile;
    int32_t const l0 = static_cast<int32_t>(blockIdx.y) * kGramTile;
    int32_t const tx = static_cast<int32_t>(threadIdx.x) % kGramTile;
    int32_t const ty = static_cast<int32_t>(threadIdx.x) / kGramTile;
    int64_t const ld = static_cast<int64_t>(a.shape.heads) * d;
    T const* weights = static_cast<T const*>(a.oProj) + static_cast<int64_t>(h) * d;
    __shared__ float left[kGramTile][kGramTile + 1];
    __shared__ float right[kGramTile][kGramTile + 1];
    float acc = 0.0F;
    for (int32_t c0 = 0; c0 < a.shape.hidden; c0 += kGramTile)
    {
        int32_t const c = c0 + ty;
        bool const row = c < a.shape.hidden;
        left[ty][tx] = row && k0 + tx < d ? toFloat(weights[static_cast<int64_t>(c) * ld + k0 + tx]) : 0.0F;
        right[ty][tx] = row && l0 + tx < d ? toFloat(weights[static_cast<int64_t>(c) * ld + l0 + tx]) : 0.0F;
        __syncthreads();
#pragma unroll
        for (int32_t cc = 0; cc < kGramTile; ++cc)
        {
            acc = fmaf(left[cc][ty], right[cc][tx], acc);
        }
        __syncthreads();
    }
    if (k0 + ty < d && l0 + tx < d)
    {
        gram[(static_cast<int64_t>(h) * d + k0 + ty) * d + l0 + tx] = acc;
    }
}

size_t quadSharedBytes(int32_t headDim)
{
    return (static_cast<size_t>(kQuadTokens) * (headDim + 1) + static_cast<size_t>(headDim) * (kQuadColumns + 1))
        * sizeof(float);
}

//! N[b, h, i] = sqrt(max(v_i^T G_h v_i, 0)) (the reference's l2 form). grid (ceil(numTokens / 32), H, B), block 256:
//! 8 threads per token, the token tile of V and 16-column chunks of G_h in shared memory.
template <typename T>
__global__ void __launch_bounds__(kQuadThreads) gramNormsKernel(NormArgs a, float const* gram)
{
    int32_t const h = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    if (skipBatch(a, b))
    {
        return;
    }
    int32_t const d = a.shape.headDim;
    int32_t const g = h / (a.shape.heads / a.shape.kvHeads);
    int32_t const tokenBegin = static_cast<int32_t>(blockIdx.x) * kQuadTokens;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    extern __shared__ float quadShared[];
    int32_t const stride = d + 1;
    float* valueTile = quadShared;                      // [kQuadTokens][d + 1]
    float* gramTile = valueTile + kQuadTokens * stride; // [d][kQuadColumns + 1]
    T const* values = static_cast<T const*>(a.values) + (static_cast<int64_t>(b) * a.shape.kvHeads + g) * a.shape.n * d;
    for (int32_t e = tid; e < kQuadTokens * d; e += kQuadThreads)
    {
        int32_t const t = e / d;
        int32_t const k = e - t * d;
        int32_t const token = tokenBegin + t;
        valueTile[t * stride + k] = token < a.numTokens ? toFloat(values[static_cast<int64_t>(token) * d + k]) : 0.0F;
    }
    int32_t const t = tid / kQuadLanes;
    int32_t const lane = tid % kQuadLanes;
    float const* v = valueTile + t * stride;
    float const* gramHead = gram + static_cast<int64_t>(h) * d * d;
    float quad = 0.0F;
    for (int32_t l0 = 0; l0 < d; l0 += kQuadColumns)
    {
        __syncthreads(); // value tile loaded / previous chunk consumed
        for (int32_t e = tid; e < d * kQuadColumns; e += kQuadThreads)
        {
            int32_t const k = e / kQuadColumns;
            int32_t const c = e - k * kQuadColumns;
            gramTile[k * (kQuadColumns + 1) + c] = l0 + c < d ? gramHead[static_cast<int64_t>(k) * d + l0 + c] : 0.0F;
        }
        __syncthreads();
        for (int32_t c = lane; c < kQuadColumns; c += kQuadLanes)
        {
            if (l0 + c >= d)
            {
                continue;
            }
            float u = 0.0F;
            for (int32_t k = 0; k < d; ++k)
            {
                u = fmaf(v[k], gramTile[k * (kQuadColumns + 1) + c], u);
            }
            quad = fmaf(u, v[l0 + c], quad);
        }
    }
    // The kQuadLanes threads of a token are consecutive lanes of one warp.
    for (int32_t offset = kQuadLanes / 2; offset > 0; offset >>= 1)
    {
        quad += __shfl_xor_sync(0xffffffffu, quad, offset);
    }
    int32_t const token = tokenBegin + t;
    if (lane == 0 && token < a.numTokens)
    {
        a.out[(static_cast<int64_t>(b) * a.shape.heads + h) * a.numTokens + token] = sqrtf(fmaxf(quad, 0.0F));
    }
}

template <typename T>
cudaError_t launchGramNormsTyped(NormArgs const& a, float* gram, cudaStream_t stream)
{
    uint32_t const gramTiles = static_cast<uint32_t>((a.shape.headDim + kGramTile - 1) / kGramTile);
    gramKernel<T><<<dim3(gramTiles, gramTiles, static_cast<uint32_t>(a.shape.heads)), kGramTile * kGramTile, 0,
        stream>>>(a, gram);
    size_t const shared = quadSharedBytes(a.shape.headDim);
    cudaError_t const status = allowDynamicSharedMemory(gramNormsKernel<T>, shared);
    if (status != cudaSuccess)
    {
        return status;
    }
    dim3 const grid(static_cast<uint32_t>((a.numTokens + kQuadTokens - 1) / kQuadTokens),
        static_cast<uint32_t>(a.shape.heads), static_cast<uint32_t>(a.shape.batch));
    gramNormsKernel<T><<<grid, kQuadThreads, shared, stream>>>(a, gram);
    return cudaGetLastError();
}

template <typename T, bool kL2>
cudaError_t launchNormsTyped(NormArgs const& a, cudaStream_t stream)
{
    uint32_t const tiles = static_cast<uint32_t>((a.numTokens + kTokenTile - 1) / kTokenTile);
    if constexpr (sizeof(T) == 2)
    {
        int device = 0;
        int major = 0;
        cudaError_t status = cudaGetDevice(&device);
        if (status == cudaSuccess)
        {
            status = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
        }
        if (status != cudaSuccess)
        {
            return status;
        }
        bool const aligned = reinterpret_cast<uintptr_t>(a.values) % 16 == 0
            && reinterpret_cast<uintptr_t>(a.oProj) % 16 == 0;
        if (aligned && major >= 8 && a.shape.headDim % 16 == 0)
        {
            size_t const shared = wmmaSharedBytes(a.shape.headDim);
            status = allowDynamicSharedMemory(valueNormsWmmaKernel<T, kL2>, shared);
            if (status != cudaSuccess)
            {
                return status;
            }
            dim3 const grid(tiles, static_cast<uint32_t>(a.shape.kvHeads), static_cast<uint32_t>(a.shape.batch));
            valueNormsWmmaKernel<T, kL2><<<grid, kWmmaThreads, shared, stream>>>(a);
            return cudaGetLastError();
        }
    }
    dim3 const grid(tiles, static_cast<uint32_t>(a.shape.heads), static_cast<uint32_t>(a.shape.batch));
    valueNormsSimtKernel<T, kL2><<<grid, kSimtThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

// BEGIN l1 bounds (tests/plugins/test_plugin_kernel_emulation.py runs this section on the CPU)
// CriticalKV's pruned stage 2 (pruned_stage2.h, docs/operator.md step 6a): the weights-only terms of the L1 upper
// bound and the bound of every older token, one thread per entry, through the same __host__ __device__ functions as
// the host driver (same floats, same summation order, products rounded on their own), so the bounds are bitwise the
// host driver's. Simple loops rather than tiles: the Gram matrices cost H d_h^2 hidden products per enqueue.
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
// END l1 bounds

constexpr int kBoundThreads = 256;

//! G_h and s_h. grid (ceil((d_h^2 + d_h) / kBoundThreads), H).
template <typename T>
__global__ void __launch_bounds__(kBoundThreads) boundTermsKernel(BoundArgs a)
{
    int64_t const e = static_cast<int64_t>(blockIdx.x) * kBoundThreads + threadIdx.x;
    boundTermAt<T>(a, static_cast<int32_t>(blockIdx.y), e);
}

//! c_h. grid (H), block kBoundThreads.
template <typename T>
__global__ void __launch_bounds__(kBoundThreads) columnL1Kernel(BoundArgs a)
{
    __shared__ float partial[kBoundThreads];
    columnL1Block<T>(a, static_cast<int32_t>(blockIdx.x), kBoundThreads, partial);
}

//! The bounds of every older token of the compressed sequences. grid (ceil(m / kBoundThreads), H, B).
template <typename T>
__global__ void __launch_bounds__(kBoundThreads) l1BoundsKernel(BoundArgs a)
{
    int32_t const i = static_cast<int32_t>(blockIdx.x) * kBoundThreads + static_cast<int32_t>(threadIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    if (i >= a.numTokens
        || (a.skipUncompressed && !sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress))
    {
        return;
    }
    l1BoundAt<T>(a, b, static_cast<int32_t>(blockIdx.y), i);
}

template <typename T>
cudaError_t launchL1BoundsTyped(BoundArgs const& a, cudaStream_t stream)
{
    int64_t const d = a.shape.headDim;
    uint32_t const heads = static_cast<uint32_t>(a.shape.heads);
    boundTermsKernel<T><<<dim3(static_cast<uint32_t>((d * d + d + kBoundThreads - 1) / kBoundThreads), heads),
        kBoundThreads, 0, stream>>>(a);
    columnL1Kernel<T><<<heads, kBoundThreads, 0, stream>>>(a);
    dim3 const grid(static_cast<uint32_t>((a.numTokens + kBoundThreads - 1) / kBoundThreads), heads,
        static_cast<uint32_t>(a.shape.batch));
    l1BoundsKernel<T><<<grid, kBoundThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

} // namespace
} // namespace kernels

cudaError_t launchValueProjectionNorms(SelectConfig const* config, RuntimeBudget budget, int32_t const* promptLengths,
    SelectShape const& shape, DType dtype, void const* values, void const* oProj, int32_t numTokens, ValueNorm kind,
    float* gram, float* out, cudaStream_t stream)
{
    if (shape.headDim <= 0 || shape.headDim > kMaxHeadDim || shape.kvHeads <= 0 || shape.heads % shape.kvHeads != 0
        || numTokens < 0 || numTokens > shape.n || shape.hidden <= 0)
    {
        return cudaErrorInvalidValue;
    }
    if (numTokens == 0)
    {
        return cudaSuccess;
    }
    kernels::NormArgs a{};
    if (config != nullptr)
    {
        a.config = *config;
        a.skipUncompressed = true;
    }
    a.promptLengths = promptLengths;
    a.budget = budget;
    a.shape = shape;
    a.values = values;
    a.oProj = oProj;
    a.numTokens = numTokens;
    a.out = out;
    return kernels::dispatchDType(dtype, [&](auto tag) {
        using T = decltype(tag);
        if (kind == ValueNorm::kL2 && gram != nullptr)
        {
            return kernels::launchGramNormsTyped<T>(a, gram, stream);
        }
        return kind == ValueNorm::kL2 ? kernels::launchNormsTyped<T, true>(a, stream)
                                      : kernels::launchNormsTyped<T, false>(a, stream);
    });
}

cudaError_t launchL1Bounds(SelectConfig const* config, RuntimeBudget budget, int32_t const* promptLengths,
    SelectShape const& shape, DType dtype, void const* values, void const* oProj, int32_t numTokens, float* gram,
    float* rowL1, float* colL1, float* bounds, cudaStream_t stream)
{
    if (shape.headDim <= 0 || shape.headDim > kMaxHeadDim || shape.kvHeads <= 0 || shape.heads % shape.kvHeads != 0
        || numTokens < 0 || numTokens > shape.n || shape.hidden <= 0 || gram == nullptr || rowL1 == nullptr
        || colL1 == nullptr || bounds == nullptr)
    {
        return cudaErrorInvalidValue;
    }
    if (numTokens == 0)
    {
        return cudaSuccess;
    }
    kernels::BoundArgs a{config != nullptr ? *config : SelectConfig{}, config != nullptr, budget, promptLengths, shape,
        values, oProj, numTokens, gram, rowL1, colL1, bounds};
    return kernels::dispatchDType(dtype, [&](auto tag) { return kernels::launchL1BoundsTyped<decltype(tag)>(a, stream); });
}

} // namespace criticalkv
