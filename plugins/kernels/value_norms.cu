// Projected-value norms N[b, h, i] = || V[b, g(h), i] W_O^h || without materialising the [n, hidden] product, and
// the pruned stage 2's L1 upper bounds.
//
// * fp16 / bf16, d_h % 16 == 0, d_h <= 128 (valueNormsOnTensorCores): the tensor-core tiles of mma_tiles.cuh
//   (mma.sync m16n8k16 with ldmatrix and a cp.async ring of W_O tiles; |x| or x^2 folded in the accumulator
//   registers). Also over gathered rows (the pruned stage 2's candidates of every head in one launch).
// * fp32 (and any other d_h): a SIMT FMA kernel (4x4 register tile per thread), also over gathered rows. No TF32:
//   that would lose the precision the fp32 reference has.
// * L2 through the Gram matrices (value_norm=l2, laprox; the reference's formula): G_h = W_O^h W_O^h^T [d_h, d_h] in
//   fp32 once per launch (H d_h^2 d FLOPs, weights only; each thread sums 16-term fp32 chunks into a double, since a
//   plain running fp32 sum over d = 4096 lost 10x PyTorch's accuracy on 16-bit weights), then q = v^T G_h v per token:
//   on the tensor cores from 3 16-bit pieces of G_h (d / d_h = 32x fewer FLOPs than the product for Llama-3-8B, and
//   near-fp32 accuracy), or in SIMT fp32 on the other path.
// * The pruned stage 2's bounds: the weights-only terms (bound_terms.cuh: G_h on the tensor cores, or in the host
//   driver's order on the fp32 path; launchPrunedTerms computes them once for a caller that reuses them), then the same
//   quadratic forms from 2 pieces and l1UpperBoundTensorCore on the tensor-core path, the host driver's bitwise loops
//   (l1_bounds.cuh) on the fp32 path.
#include "criticalkv/kernels.h"
#include "criticalkv/pruned_stage2.h"
#include "bound_terms.cuh"
#include "device_utils.cuh"
#include "l1_bounds.cuh"
#include "mma_tiles.cuh"

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

using NormArgs = NormTileArgs;

__device__ __forceinline__ bool skipBatch(NormArgs const& a, int32_t b)
{
    return a.skipUncompressed && !sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress;
}

//! SIMT path. grid (row tiles, H, B), block kSimtThreads: thread (ty, tx) owns rows ty*4.. and columns tx*4.. (rows:
//! the tokens, or the listed ones of the head's list).
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
    TileRows rows{static_cast<int64_t>(b) * a.shape.kvHeads + g, tokenBegin, a.numTokens};
    if (a.rowTokens != nullptr)
    {
        int32_t const count = a.rowCounts[rows.head];
        rows.count = count < 0 ? 0 : (count > a.rowStride ? a.rowStride : count);
    }
    if (tokenBegin >= rows.count)
    {
        return;
    }

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
                int32_t const position = tokenBegin + row;
                valueTile[kk][row] = position < rows.count && k0 + kk < d
                    ? toFloat(values[static_cast<int64_t>(tokenOf(a, rows, position)) * d + k0 + kk])
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
            int32_t const position = tokenBegin + ty * 4 + r;
            if (position < rows.count)
            {
                out[tokenOf(a, rows, position)] = kL2 ? sqrtf(rowSum[r]) : rowSum[r];
            }
        }
    }
}

constexpr int kGramTile = 16;
constexpr int kQuadTokens = 32;
constexpr int kQuadColumns = 16;
constexpr int kQuadLanes = 8; // threads per token: each owns kQuadColumns / kQuadLanes Gram columns of a chunk
constexpr int kQuadThreads = kQuadTokens * kQuadLanes;

//! G[h, k, l] = sum_c W_O[c, h d_h + k] W_O[c, h d_h + l] (fp32 products and 16-term sums, double total). grid (ceil(d_h / 16), ceil(d_h / 16), H),
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
    double acc = 0.0; // 16-term fp32 chunks summed in double: a running fp32 sum over d terms loses ~d u
    for (int32_t c0 = 0; c0 < a.shape.hidden; c0 += kGramTile)
    {
        int32_t const c = c0 + ty;
        bool const row = c < a.shape.hidden;
        left[ty][tx] = row && k0 + tx < d ? toFloat(weights[static_cast<int64_t>(c) * ld + k0 + tx]) : 0.0F;
        right[ty][tx] = row && l0 + tx < d ? toFloat(weights[static_cast<int64_t>(c) * ld + l0 + tx]) : 0.0F;
        __syncthreads();
        float chunk = 0.0F;
#pragma unroll
        for (int32_t cc = 0; cc < kGramTile; ++cc)
        {
            chunk = fmaf(left[cc][ty], right[cc][tx], chunk);
        }
        acc += static_cast<double>(chunk);
        __syncthreads();
    }
    if (k0 + ty < d && l0 + tx < d)
    {
        gram[(static_cast<int64_t>(h) * d + k0 + ty) * d + l0 + tx] = static_cast<float>(acc);
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
void launchGram(NormArgs const& a, float* gram, cudaStream_t stream)
{
    uint32_t const gramTiles = static_cast<uint32_t>((a.shape.headDim + kGramTile - 1) / kGramTile);
    gramKernel<T><<<dim3(gramTiles, gramTiles, static_cast<uint32_t>(a.shape.heads)), kGramTile * kGramTile, 0,
        stream>>>(a, gram);
}

template <typename T>
cudaError_t launchGramNormsSimt(NormArgs const& a, float* gram, cudaStream_t stream)
{
    launchGram<T>(a, gram, stream);
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

template <typename T, typename Cfg, bool kL2>
__global__ void __launch_bounds__(Cfg::kThreads, 1) valueNormsMmaKernel(NormArgs a)
{
    extern __shared__ __align__(128) unsigned char mmaShared[];
    valueNormsMmaBlock<T, Cfg, kL2>(a, mmaShared);
}

template <typename T, typename Cfg, int kPieces, bool kBound>
__global__ void __launch_bounds__(Cfg::kThreads, 1) gramQuadKernel(NormArgs a)
{
    extern __shared__ __align__(128) unsigned char mmaShared[];
    gramQuadBlock<T, Cfg, kPieces, kBound>(a, mmaShared);
}

template <typename T, int kPieces>
__global__ void __launch_bounds__(kGramPieceThreads) gramPiecesKernel(float const* gram, int32_t headDim, T* pieces,
    float* inverseScale)
{
    __shared__ float partial[kGramPieceThreads];
    gramPiecesBlock<T, kPieces, kGramPieceThreads>(gram, headDim, pieces, inverseScale, partial);
}

//! Rows per head the grid must cover: every token, or the longest list.
int32_t rowsToCover(NormArgs const& a, int32_t maxCount)
{
    return a.rowTokens != nullptr ? (maxCount < a.rowStride ? maxCount : a.rowStride) : a.numTokens;
}

//! CTAs of `kernel` (Cfg::kThreads threads, `shared` bytes) the device runs at once: SMs x resident blocks per SM.
template <typename Cfg, typename Kernel>
cudaError_t residentSlots(Kernel kernel, size_t shared, int64_t& slots)
{
    int device = 0;
    int sms = 0;
    int perSm = 0;
    cudaError_t status = cudaGetDevice(&device);
    if (status == cudaSuccess)
    {
        status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    }
    if (status == cudaSuccess)
    {
        status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSm, kernel, Cfg::kThreads, shared);
    }
    slots = static_cast<int64_t>(sms) * (perSm > 0 ? perSm : 1);
    return status;
}

//! One launch of a tile kernel over the rows of every KV head (grid: row tiles, H_kv, B). splitHeads: spread a KV
//! head's query heads over up to `group` CTAs when that fills the device's waves better (chooseHeadSplit;
//! valueNormsMmaBlock only).
template <typename Cfg, typename Kernel>
cudaError_t launchTiles(Kernel kernel, NormArgs a, int32_t maxCount, cudaStream_t stream, bool splitHeads = false)
{
    int32_t const rows = rowsToCover(a, maxCount);
    if (rows <= 0)
    {
        return cudaSuccess;
    }
    size_t const shared = Cfg::sharedBytes(a.shape.headDim);
    cudaError_t status = allowDynamicSharedMemory(kernel, shared);
    if (status != cudaSuccess)
    {
        return status;
    }
    int64_t const rowTiles = (rows + Cfg::kRows - 1) / Cfg::kRows;
    a.headSplit = 1;
    if (splitHeads)
    {
        int64_t slots = 0;
        status = residentSlots<Cfg>(kernel, shared, slots);
        if (status != cudaSuccess)
        {
            return status;
        }
        a.headSplit = chooseHeadSplit(rowTiles * a.shape.kvHeads * a.shape.batch, a.shape.heads / a.shape.kvHeads, slots);
    }
    dim3 const grid(static_cast<uint32_t>(rowTiles), static_cast<uint32_t>(a.shape.kvHeads * a.headSplit),
        static_cast<uint32_t>(a.shape.batch));
    kernel<<<grid, Cfg::kThreads, shared, stream>>>(a);
    return cudaGetLastError();
}

//! Largest dynamic shared memory a block of this device may opt into.
cudaError_t sharedMemoryLimit(size_t& bytes)
{
    int device = 0;
    int limit = 0;
    cudaError_t status = cudaGetDevice(&device);
    if (status == cudaSuccess)
    {
        status = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    }
    bytes = static_cast<size_t>(limit);
    return status;
}

template <typename T, bool kL2>
cudaError_t launchNormsMma(NormArgs const& a, int32_t maxCount, cudaStream_t stream)
{
    size_t limit = 0;
    cudaError_t const status = sharedMemoryLimit(limit);
    if (status != cudaSuccess)
    {
        return status;
    }
    if (NormTiles::sharedBytes(a.shape.headDim) <= limit)
    {
        return launchTiles<NormTiles>(valueNormsMmaKernel<T, NormTiles, kL2>, a, maxCount, stream, true);
    }
    return launchTiles<NormTilesSmall>(valueNormsMmaKernel<T, NormTilesSmall, kL2>, a, maxCount, stream, true);
}

template <typename T, bool kL2>
cudaError_t launchNormsSimt(NormArgs const& a, int32_t maxCount, cudaStream_t stream)
{
    int32_t const rows = rowsToCover(a, maxCount);
    if (rows <= 0)
    {
        return cudaSuccess;
    }
    dim3 const grid(static_cast<uint32_t>((rows + kTokenTile - 1) / kTokenTile), static_cast<uint32_t>(a.shape.heads),
        static_cast<uint32_t>(a.shape.batch));
    valueNormsSimtKernel<T, kL2><<<grid, kSimtThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

//! s_h G_h in kPieces 16-bit pieces (scratch.gram holds G_h).
template <typename T, int kPieces>
void launchGramPieces(GramScratch const& scratch, int32_t heads, int32_t headDim, cudaStream_t stream)
{
    gramPiecesKernel<T, kPieces><<<static_cast<uint32_t>(heads), kGramPieceThreads, 0, stream>>>(
        scratch.gram, headDim, static_cast<T*>(scratch.pieces), scratch.scale);
}

//! The quadratic forms (kBound: the L1 bounds) from the pieces of scratch (piecesReady: already there, else made from
//! scratch.gram first).
template <typename T, int kPieces, bool kBound>
cudaError_t launchGramQuad(NormArgs a, GramScratch const& scratch, cudaStream_t stream, bool piecesReady = false)
{
    if (!piecesReady)
    {
        launchGramPieces<T, kPieces>(scratch, a.shape.heads, a.shape.headDim, stream);
    }
    a.gramPieces = scratch.pieces;
    a.gramScale = scratch.scale;
    if (a.shape.headDim <= GramTiles64::kCols)
    {
        return launchTiles<GramTiles64>(gramQuadKernel<T, GramTiles64, kPieces, kBound>, a, 0, stream);
    }
    return launchTiles<GramTiles128>(gramQuadKernel<T, GramTiles128, kPieces, kBound>, a, 0, stream);
}

constexpr int kBoundThreads = 256;

//! G_h, s_h and c_h in the host driver's order (bound_terms.cuh). grid (ceil(d_h / 64), H), block kTermThreads.
template <typename T>
__global__ void __launch_bounds__(kTermThreads) boundTermsSimtKernel(BoundArgs a)
{
    extern __shared__ float termsShared[];
    boundTermsSimtBlock<T>(a, termsShared);
}

//! G_h on the tensor cores, s_h and c_h (bound_terms.cuh). grid (ceil(d_h / 64), H), block kTermThreads.
template <typename T>
__global__ void __launch_bounds__(kTermThreads) boundTermsTensorKernel(BoundArgs a)
{
    __shared__ TermTileSmem smem;
    boundTermsTensorBlock<T>(a, smem);
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

dim3 termsGrid(SelectShape const& shape)
{
    return dim3(static_cast<uint32_t>((shape.headDim + kTermRows - 1) / kTermRows), static_cast<uint32_t>(shape.heads));
}

//! G_h, s_h, c_h bitwise the host driver's.
template <typename T>
cudaError_t launchBoundTermsSimt(BoundArgs const& a, cudaStream_t stream)
{
    size_t const shared = boundTermsSimtSharedBytes(a.shape.headDim);
    cudaError_t const status = allowDynamicSharedMemory(boundTermsSimtKernel<T>, shared);
    if (status != cudaSuccess)
    {
        return status;
    }
    boundTermsSimtKernel<T><<<termsGrid(a.shape), kTermThreads, shared, stream>>>(a);
    return cudaGetLastError();
}

//! G_h on the tensor cores, s_h, c_h, then the 2 pieces of s_h G_h the tensor-core bound reads.
template <typename T>
cudaError_t launchBoundTermsTensor(BoundArgs const& a, GramScratch const& scratch, cudaStream_t stream)
{
    boundTermsTensorKernel<T><<<termsGrid(a.shape), kTermThreads, 0, stream>>>(a);
    launchGramPieces<T, kGramPiecesBound>(scratch, a.shape.heads, a.shape.headDim, stream);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launchL1BoundsTyped(BoundArgs const& a, bool termsReady, cudaStream_t stream)
{
    if (!termsReady)
    {
        cudaError_t const status = launchBoundTermsSimt<T>(a, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    uint32_t const heads = static_cast<uint32_t>(a.shape.heads);
    dim3 const grid(static_cast<uint32_t>((a.numTokens + kBoundThreads - 1) / kBoundThreads), heads,
        static_cast<uint32_t>(a.shape.batch));
    l1BoundsKernel<T><<<grid, kBoundThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

} // namespace
} // namespace kernels

namespace
{

bool validShape(SelectShape const& shape, int32_t numTokens)
{
    return shape.batch > 0 && shape.headDim > 0 && shape.headDim <= kMaxHeadDim && shape.kvHeads > 0
        && shape.heads % shape.kvHeads == 0 && numTokens >= 0 && numTokens <= shape.n && shape.hidden > 0;
}

kernels::NormArgs normArgs(SelectShape const& shape, void const* values, void const* oProj, int32_t numTokens,
    float* out, SelectConfig const* config, RuntimeBudget budget, int32_t const* promptLengths)
{
    kernels::NormArgs a{};
    a.shape = shape;
    a.values = values;
    a.oProj = oProj;
    a.numTokens = numTokens;
    a.out = out;
    a.rowStride = numTokens;
    if (config != nullptr)
    {
        a.config = *config;
        a.skipUncompressed = true;
    }
    a.budget = budget;
    a.promptLengths = promptLengths;
    return a;
}

} // namespace

bool prunedTermsOnTensorCores(SelectShape const& shape, DType dtype, void const* oProj)
{
    if (dtype == DType::kFloat32 || shape.headDim % 16 != 0 || shape.headDim > kernels::GramTiles128::kCols
        || reinterpret_cast<uintptr_t>(oProj) % 16 != 0)
    {
        return false;
    }
    int device = 0;
    int major = 0;
    return cudaGetDevice(&device) == cudaSuccess
        && cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 8;
}

bool valueNormsOnTensorCores(SelectShape const& shape, DType dtype, void const* values, void const* oProj)
{
    return reinterpret_cast<uintptr_t>(values) % 16 == 0 && prunedTermsOnTensorCores(shape, dtype, oProj);
}

namespace
{

//! The pieces of prunedTermsBytes's buffer, in order.
struct PrunedTermsLayout
{
    size_t gram, pieces, scale, rowL1, colL1, total;
};

PrunedTermsLayout prunedTermsLayout(SelectShape const& shape)
{
    size_t const h = static_cast<size_t>(shape.heads > 0 ? shape.heads : 0);
    size_t const d = static_cast<size_t>(shape.headDim > 0 ? shape.headDim : 0);
    PrunedTermsLayout l{};
    size_t offset = 0;
    auto take = [&offset](size_t bytes) {
        size_t const at = offset;
        offset += alignWorkspace(bytes);
        return at;
    };
    l.gram = take(h * d * d * sizeof(float));
    l.pieces = take(h * kGramPiecesMax * d * d * 2);
    l.scale = take(h * sizeof(float));
    l.rowL1 = take(h * d * sizeof(float));
    l.colL1 = take(h * sizeof(float));
    l.total = offset;
    return l;
}

} // namespace

size_t prunedTermsBytes(SelectShape const& shape)
{
    return prunedTermsLayout(shape).total;
}

PrunedTerms prunedTermsAt(void* buffer, SelectShape const& shape)
{
    PrunedTermsLayout const l = prunedTermsLayout(shape);
    auto* base = static_cast<unsigned char*>(buffer);
    return PrunedTerms{GramScratch{reinterpret_cast<float*>(base + l.gram), base + l.pieces,
                           reinterpret_cast<float*>(base + l.scale)},
        reinterpret_cast<float*>(base + l.rowL1), reinterpret_cast<float*>(base + l.colL1)};
}

cudaError_t launchPrunedTerms(SelectShape const& shape, DType dtype, void const* oProj, void* buffer, size_t bytes,
    cudaStream_t stream)
{
    if (shape.heads <= 0 || shape.headDim <= 0 || shape.headDim > kMaxHeadDim || shape.hidden <= 0
        || oProj == nullptr || buffer == nullptr || bytes < prunedTermsBytes(shape))
    {
        return cudaErrorInvalidValue;
    }
    PrunedTerms const t = prunedTermsAt(buffer, shape);
    kernels::BoundArgs a{};
    a.shape = shape;
    a.oProj = oProj;
    a.gram = t.gram.gram;
    a.rowL1 = t.rowL1;
    a.colL1 = t.colL1;
    bool const tensorCores = prunedTermsOnTensorCores(shape, dtype, oProj);
    return kernels::dispatchDType(dtype, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        if constexpr (sizeof(T) == 2)
        {
            if (tensorCores)
            {
                return kernels::launchBoundTermsTensor<T>(a, t.gram, stream);
            }
        }
        return kernels::launchBoundTermsSimt<T>(a, stream);
    });
}

cudaError_t launchValueNorms(ValueNormParams const& p, cudaStream_t stream)
{
    bool const gathered = p.rows.tokens != nullptr;
    bool const gramPath = p.kind == ValueNorm::kL2 && p.gram.gram != nullptr;
    if (!validShape(p.shape, p.numTokens) || p.out == nullptr
        || (gathered && (p.rows.counts == nullptr || p.rows.stride <= 0 || p.rows.maxCount < 0 || gramPath)))
    {
        return cudaErrorInvalidValue;
    }
    if (p.numTokens == 0 || (gathered && p.rows.maxCount == 0))
    {
        return cudaSuccess;
    }
    kernels::NormArgs a = normArgs(p.shape, p.values, p.oProj, p.numTokens, p.out, p.config, p.budget,
        p.promptLengths);
    a.rowTokens = p.rows.tokens;
    a.rowCounts = p.rows.counts;
    a.rowStride = gathered ? p.rows.stride : p.numTokens;
    bool const tensorCores = valueNormsOnTensorCores(p.shape, p.dtype, p.values, p.oProj);
    return kernels::dispatchDType(p.dtype, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        if constexpr (sizeof(T) == 2)
        {
            if (tensorCores)
            {
                if (gramPath)
                {
                    if (p.gram.pieces == nullptr || p.gram.scale == nullptr)
                    {
                        return cudaErrorInvalidValue;
                    }
                    kernels::launchGram<T>(a, p.gram.gram, stream);
                    return kernels::launchGramQuad<T, kernels::kGramPiecesL2, false>(a, p.gram, stream);
                }
                return p.kind == ValueNorm::kL2 ? kernels::launchNormsMma<T, true>(a, p.rows.maxCount, stream)
                                                : kernels::launchNormsMma<T, false>(a, p.rows.maxCount, stream);
            }
        }
        if (gramPath)
        {
            return kernels::launchGramNormsSimt<T>(a, p.gram.gram, stream);
        }
        return p.kind == ValueNorm::kL2 ? kernels::launchNormsSimt<T, true>(a, p.rows.maxCount, stream)
                                        : kernels::launchNormsSimt<T, false>(a, p.rows.maxCount, stream);
    });
}

cudaError_t launchPrunedBounds(PrunedBoundParams const& p, cudaStream_t stream)
{
    if (!validShape(p.shape, p.numTokens) || p.gram.gram == nullptr || p.rowL1 == nullptr || p.colL1 == nullptr
        || p.bounds == nullptr)
    {
        return cudaErrorInvalidValue;
    }
    if (p.numTokens == 0)
    {
        return cudaSuccess;
    }
    kernels::BoundArgs const terms{p.config != nullptr ? *p.config : SelectConfig{}, p.config != nullptr, p.budget,
        p.promptLengths, p.shape, p.values, p.oProj, p.numTokens, p.gram.gram, p.rowL1, p.colL1, p.bounds};
    if (!valueNormsOnTensorCores(p.shape, p.dtype, p.values, p.oProj))
    {
        // the fp32 path: the host driver's terms and bounds, bit for bit
        return kernels::dispatchDType(p.dtype, [&](auto tag) {
            return kernels::launchL1BoundsTyped<decltype(tag)>(terms, p.termsReady, stream);
        });
    }
    if (p.gram.pieces == nullptr || p.gram.scale == nullptr)
    {
        return cudaErrorInvalidValue;
    }
    // G_h on the tensor cores, s_h and c_h (the weights-only terms) and G_h's pieces, unless given; then the bounds
    kernels::NormArgs a = normArgs(p.shape, p.values, p.oProj, p.numTokens, p.bounds, p.config, p.budget,
        p.promptLengths);
    a.rowL1 = p.rowL1;
    a.colL1 = p.colL1;
    return kernels::dispatchDType(p.dtype, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        if constexpr (sizeof(T) == 2)
        {
            if (!p.termsReady)
            {
                cudaError_t const status = kernels::launchBoundTermsTensor<T>(terms, p.gram, stream);
                if (status != cudaSuccess)
                {
                    return status;
                }
            }
            return kernels::launchGramQuad<T, kernels::kGramPiecesBound, true>(a, p.gram, stream, true);
        }
        return cudaErrorInvalidValue; // fp32 never takes the tensor-core path
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
    return kernels::dispatchDType(dtype, [&](auto tag) {
        return kernels::launchL1BoundsTyped<decltype(tag)>(a, false, stream);
    });
}

} // namespace criticalkv
