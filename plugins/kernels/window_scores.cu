// Window attention scores: softmax of the w window queries of every query head over all n keys (causal inside
// the window, left padding masked), averaged over the queries (Ā), sum_j A_j^2 where a group-scored method asks for it
// (windowSquares: laprox), and for a row-scored method the rows' maximum of the rescaled average pools (pooledMax)
// and masses (row_scores.h).
//
// * fp16 / bf16, d_h % 16 == 0, d_h <= 128, w <= 128, pool kernel <= 49, 16-byte aligned Q and K, sm_80+
//   (windowScoresOnTensorCores): the tensor-core tiles of window_tiles.cuh, three launches: pass 1 (Q K^T on the
//   tensor cores, online softmax partials per key block), the combine, pass 3 (Q K^T again, probabilities to a shared
//   tile, Ā / sum A^2 / pooledMax per key). K is read twice; the pooled rows come out of the same two passes.
// * otherwise (fp32 included: its kept sets stay the host driver's): the SIMT kernels of window_simt.cuh, two passes
//   over K for Ā and two more for the pooled rows.
//
// Why not TensorRT's own layers (MatMul + Softmax + Reduce): they would materialise the [B, H, w, n]
// probabilities (w * n * 4 bytes per head: 16 MiB for w = 32, n = 128k) and run the selection outside the
// plugin anyway. Not measured on a GPU yet (docs/tensorrt_cost_model.md has the predictions).
#include "criticalkv/row_scores.h"
#include "criticalkv/kernels.h"
#include "device_utils.cuh"
#include "window_simt.cuh"
#include "window_tiles.cuh"

#include <cstdint>

namespace criticalkv
{
namespace kernels
{
namespace
{

// ------------------------------------------------------------------------------------------------ SIMT wrappers

template <typename T, bool kColumns>
__global__ void __launch_bounds__(kWindowThreads) windowAttentionKernel(WindowArgs a)
{
    extern __shared__ float simtShared[];
    windowAttentionBlock<T, kColumns>(a, simtShared);
}

__global__ void __launch_bounds__(kStatsThreads) softmaxStatsKernel(WindowArgs a)
{
    softmaxStatsBlock(a);
}

template <typename T, bool kRescale>
__global__ void __launch_bounds__(kRowThreads) pooledRowsKernel(PooledRowArgs a)
{
    extern __shared__ float simtShared[];
    pooledRowsBlock<T, kRescale>(a, simtShared);
}

__global__ void __launch_bounds__(kStatsThreads) rowSumsKernel(PooledRowArgs a)
{
    rowSumsBlock(a);
}

template <typename T>
cudaError_t launchWindowSimt(WindowArgs const& a, cudaStream_t stream)
{
    size_t const shared = windowSharedBytes(a.shape.headDim);
    cudaError_t status = allowDynamicSharedMemory(windowAttentionKernel<T, false>, shared);
    if (status == cudaSuccess)
    {
        status = allowDynamicSharedMemory(windowAttentionKernel<T, true>, shared);
    }
    if (status != cudaSuccess)
    {
        return status;
    }
    int32_t const m = a.shape.n - windowLength(a.config, a.shape.n);
    dim3 const keysGrid(static_cast<uint32_t>(a.tiles), static_cast<uint32_t>(a.shape.heads),
        static_cast<uint32_t>(a.shape.batch));
    windowAttentionKernel<T, false><<<keysGrid, kWindowThreads, shared, stream>>>(a);
    softmaxStatsKernel<<<dim3(static_cast<uint32_t>(a.shape.heads), static_cast<uint32_t>(a.shape.batch)),
        kStatsThreads, 0, stream>>>(a);
    if (m > 0)
    {
        dim3 const olderGrid(static_cast<uint32_t>((m + kKeyTile - 1) / kKeyTile),
            static_cast<uint32_t>(a.shape.heads), static_cast<uint32_t>(a.shape.batch));
        windowAttentionKernel<T, true><<<olderGrid, kWindowThreads, shared, stream>>>(a);
    }
    return cudaGetLastError();
}

template <typename T>
cudaError_t launchPooledRowsSimt(PooledRowArgs const& a, cudaStream_t stream)
{
    size_t const shared = pooledRowSharedBytes(a.shape.headDim);
    cudaError_t status = allowDynamicSharedMemory(pooledRowsKernel<T, false>, shared);
    if (status == cudaSuccess)
    {
        status = allowDynamicSharedMemory(pooledRowsKernel<T, true>, shared);
    }
    if (status != cudaSuccess)
    {
        return status;
    }
    dim3 const grid(static_cast<uint32_t>(a.olderTiles), static_cast<uint32_t>(a.shape.heads),
        static_cast<uint32_t>(a.shape.batch));
    pooledRowsKernel<T, false><<<grid, kRowThreads, shared, stream>>>(a);
    rowSumsKernel<<<dim3(static_cast<uint32_t>(a.shape.heads), static_cast<uint32_t>(a.shape.batch)),
        kStatsThreads, 0, stream>>>(a);
    pooledRowsKernel<T, true><<<grid, kRowThreads, shared, stream>>>(a);
    return cudaGetLastError();
}

//! The SIMT path: window attention, then the two pooled-row passes.
template <typename T>
cudaError_t launchSimtPath(WindowScoreParams const& p, cudaStream_t stream)
{
    int32_t const w = windowLength(p.config, p.shape.n);
    int32_t const m = p.shape.n - w;
    float const scale = static_cast<float>(sqrt(static_cast<double>(p.shape.headDim)));
    WindowArgs a{};
    a.config = p.config;
    a.shape = p.shape;
    a.queries = p.queries;
    a.keys = p.keys;
    a.promptLengths = p.promptLengths;
    a.budget = p.budget;
    a.partials = reinterpret_cast<float2*>(p.partials);
    a.rowStats = reinterpret_cast<float2*>(p.rowStats);
    a.raw = p.raw;
    a.squares = p.squares;
    a.tiles = (p.shape.n + kKeyTile - 1) / kKeyTile;
    a.scale = scale;
    cudaError_t status = launchWindowSimt<T>(a, stream);
    if (status != cudaSuccess || p.pooledMax == nullptr || m <= 0)
    {
        return status;
    }
    PooledRowArgs r{};
    r.config = p.config;
    r.shape = p.shape;
    r.queries = p.queries;
    r.keys = p.keys;
    r.promptLengths = p.promptLengths;
    r.budget = p.budget;
    r.rowStats = reinterpret_cast<float2 const*>(p.rowStats);
    r.partials = reinterpret_cast<float2*>(p.partials); // pass 1's partials are consumed: reused
    r.rowSums = reinterpret_cast<float2*>(p.rowSums);
    r.pooledMax = p.pooledMax;
    r.olderTiles = (m + kKeyTile - 1) / kKeyTile;
    r.scale = scale;
    return launchPooledRowsSimt<T>(r, stream);
}

// ------------------------------------------------------------------------------------------------ tensor-core path

constexpr int32_t kCombineThreads = 128;

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) windowStatsMmaKernel(WindowTileArgs a)
{
    extern __shared__ __align__(128) unsigned char windowShared[];
    windowStatsBlock<T, Cfg>(a, windowShared);
}

__global__ void __launch_bounds__(kCombineThreads) windowCombineKernel(WindowTileArgs a)
{
    windowCombineBlock(a, kCombineThreads);
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) windowColumnsMmaKernel(WindowTileArgs a)
{
    extern __shared__ __align__(128) unsigned char windowShared[];
    windowColumnsBlock<T, Cfg>(a, windowShared);
}

template <typename T, typename Cfg>
cudaError_t launchTensorPathTiles(WindowTileArgs a, cudaStream_t stream)
{
    size_t const shared = Cfg::sharedBytes(a.shape.headDim);
    cudaError_t status = allowDynamicSharedMemory(windowStatsMmaKernel<T, Cfg>, shared);
    if (status == cudaSuccess)
    {
        status = allowDynamicSharedMemory(windowColumnsMmaKernel<T, Cfg>, shared);
    }
    if (status != cudaSuccess)
    {
        return status;
    }
    planWindowTiles<Cfg>(a, 0);
    uint32_t const kvHeads = static_cast<uint32_t>(a.shape.kvHeads);
    uint32_t const batch = static_cast<uint32_t>(a.shape.batch);
    windowStatsMmaKernel<T, Cfg>
        <<<dim3(static_cast<uint32_t>(a.statsBlocks * a.rowChunks), kvHeads, batch), Cfg::kThreads, shared, stream>>>(a);
    windowCombineKernel<<<dim3(static_cast<uint32_t>(a.shape.heads), batch), kCombineThreads, 0, stream>>>(a);
    windowColumnsMmaKernel<T, Cfg>
        <<<dim3(static_cast<uint32_t>(a.columnBlocks * a.rowChunks), kvHeads, batch), Cfg::kThreads, shared, stream>>>(
            a);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launchTensorPath(WindowScoreParams const& p, cudaStream_t stream)
{
    WindowTileArgs a{};
    a.config = p.config;
    a.shape = p.shape;
    a.budget = p.budget;
    a.promptLengths = p.promptLengths;
    a.queries = p.queries;
    a.keys = p.keys;
    a.partials = p.partials;
    a.rowStats = p.rowStats;
    a.rowSums = p.pooledMax != nullptr ? p.rowSums : nullptr;
    a.raw = p.raw;
    a.squares = p.squares;
    a.pooledMax = p.pooledMax;
    a.scale = static_cast<float>(sqrt(static_cast<double>(p.shape.headDim)));
    if (p.shape.headDim <= 16 * WindowTiles64::kMaxSteps)
    {
        return launchTensorPathTiles<T, WindowTiles64>(a, stream);
    }
    return launchTensorPathTiles<T, WindowTiles128>(a, stream);
}

} // namespace
} // namespace kernels

bool windowScoresOnTensorCores(SelectConfig const& config, SelectShape const& shape, DType dtype, void const* queries,
    void const* keys, bool rows)
{
    int32_t const w = windowLength(config, shape.n);
    if (dtype == DType::kFloat32 || shape.headDim % 16 != 0 || shape.headDim > 16 * kernels::WindowTiles128::kMaxSteps
        || w > kernels::WindowTiles128::kRows || (rows && config.poolKernel / 2 > kernels::kMaxWindowHalo)
        || reinterpret_cast<uintptr_t>(queries) % 16 != 0 || reinterpret_cast<uintptr_t>(keys) % 16 != 0)
    {
        return false;
    }
    int device = 0;
    int major = 0;
    int sharedLimit = 0;
    return cudaGetDevice(&device) == cudaSuccess
        && cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 8
        && cudaDeviceGetAttribute(&sharedLimit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess
        && kernels::WindowTiles128::sharedBytes(shape.headDim) <= static_cast<size_t>(sharedLimit);
}

cudaError_t launchWindowScores(WindowScoreParams const& p, cudaStream_t stream)
{
    SelectShape const& s = p.shape;
    bool const rows = p.pooledMax != nullptr;
    if (s.batch <= 0 || s.n <= 0 || s.headDim <= 0 || s.headDim > kMaxHeadDim || s.kvHeads <= 0
        || s.heads % s.kvHeads != 0 || s.queryLen < windowLength(p.config, s.n) || p.partials == nullptr
        || p.rowStats == nullptr || p.raw == nullptr || (rows && p.rowSums == nullptr))
    {
        return cudaErrorInvalidValue;
    }
    if (s.n - windowLength(p.config, s.n) <= 0)
    {
        return cudaSuccess; // no older token to score
    }
    bool const tensorCores = windowScoresOnTensorCores(p.config, s, p.dtype, p.queries, p.keys, rows);
    return kernels::dispatchDType(p.dtype, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        if constexpr (sizeof(T) == 2)
        {
            if (tensorCores)
            {
                return kernels::launchTensorPath<T>(p, stream);
            }
        }
        return kernels::launchSimtPath<T>(p, stream);
    });
}

} // namespace criticalkv
