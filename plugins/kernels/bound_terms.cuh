// The weights-only terms of CriticalKV's pruned stage 2 bound (pruned_stage2.h, docs/operator.md step 6a): for every
// query head h, G_h = W_O^h W_O^h^T [d_h, d_h], s_h[k] = sum_c |W_O^h[k, c]| and c_h = max_c sum_k |W_O^h[k, c]|.
// Two block bodies over the same decomposition, included by kernels/value_norms.cu and by the CPU emulation
// (testing/value_norms_mma_emulation.cpp, testing/pruned_pipeline_emulation.cpp):
//
// * boundTermsSimtBlock (the fp32 path: launchL1Bounds, bitwise the host driver's): a CTA per (64 rows of G_h, h)
//   streams W_O^h in chunks of 64 hidden columns through shared memory (as floats, [c][k]) and keeps a 4 x (d_h / 16)
//   register tile of G per thread, each entry summed in the host driver's order (c ascending, products rounded on
//   their own); s_h for its 64 rows and (the CTA of the first rows) c_h from the same chunk, in the host order too.
//   The work is the same H d_h^2 hidden products as before, but with every weight read once per CTA from global
//   memory (it used to be read d_h times per entry pair, strided, by one thread per entry).
// * boundTermsTensorBlock (16-bit weights, d_h % 16 == 0, d_h <= 128: launchPrunedBounds's tensor-core path): the same
//   CTAs, 8 warps, G_h's 64 x d_h block on the tensor cores (mma.sync m16n8k16, A and B fragments both from the chunk
//   stored transposed, [k][c], by ldmatrix), a fresh accumulator per k16 step summed in fp32 registers: each step
//   rounds 16 exact products of 16-bit weights (at most 34 u of their magnitudes, as in gramQuadBlock), the fp32 sum
//   of the hidden / 16 steps at most gamma_{hidden/16}: far inside the gamma_{hidden + 3 d_h + 64} that
//   l1UpperBoundTensorCore's kappa grants the Gram entries. The next chunk's weights are loaded into registers while
//   the tensor cores work on the current one. s_h and c_h in their own order (the tensor path's bound needs no
//   bitwise agreement with the host driver, only its error terms).
//
// grid (ceil(d_h / 64), H); SIMT: kTermThreads threads and boundTermsSimtSharedBytes(d_h) of dynamic shared memory;
// tensor: kTermThreads threads, TermTileSmem static.
#pragma once

#include "criticalkv/mma_layout.h"
#include "criticalkv/pruned_stage2.h"
#include "l1_bounds.cuh"

#if defined(__CUDACC__)
#include "device_utils.cuh"
#include "mma_primitives.cuh"
#endif

#include <cstddef>
#include <cstdint>

namespace criticalkv::kernels
{

constexpr int kTermThreads = 256;
constexpr int32_t kTermRows = 64;  //!< rows of G_h per CTA
constexpr int32_t kTermChunk = 64; //!< hidden columns of W_O^h per step

//! d_h rounded up to whole row blocks (the tiles' zero-padded rows).
CKV_HD int32_t termRowsPadded(int32_t headDim)
{
    return (headDim + kTermRows - 1) / kTermRows * kTermRows;
}

//! Dynamic shared memory of boundTermsSimtBlock: the chunk as floats [kTermChunk][padded d_h + 1] and a partial max
//! per thread.
inline size_t boundTermsSimtSharedBytes(int32_t headDim)
{
    return (static_cast<size_t>(kTermChunk) * static_cast<size_t>(termRowsPadded(headDim) + 1) + kTermThreads)
        * sizeof(float);
}

//! The fp32 path's terms (see the file comment): rows [64 blockIdx.x, + 64) of G_h, s_h of those rows, c_h (first row
//! block) of query head blockIdx.y. shared: boundTermsSimtSharedBytes(d_h).
template <typename T>
__device__ void boundTermsSimtBlock(BoundArgs const& a, float* shared)
{
    int32_t const d = a.shape.headDim;
    int32_t const padded = termRowsPadded(d);
    int32_t const stride = padded + 1; // a column walk (c_h) then hits 32 banks
    int32_t const rowBlock = static_cast<int32_t>(blockIdx.x) * kTermRows;
    int32_t const h = static_cast<int32_t>(blockIdx.y);
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const ty = tid / 16;
    int32_t const tx = tid % 16;
    int32_t const columnSteps = padded / 16; // this thread's columns l = tx + 16 j
    int64_t const ld = static_cast<int64_t>(a.shape.heads) * d;
    T const* w = static_cast<T const*>(a.oProj) + static_cast<int64_t>(h) * d;
    float* tile = shared;                                   // [kTermChunk][stride]: W_O^h[k, c0 + c] at [c][k]
    float* partial = shared + kTermChunk * stride;          // [kTermThreads]
    bool const columnThread = blockIdx.x == 0 && tid >= 64 && tid < 64 + kTermChunk;

    float acc[4][16] = {}; // rows rowBlock + 4 ty + i, columns tx + 16 j
    float rowSum = 0.0F;
    float columnBest = 0.0F; // the host driver's start value
    for (int32_t c0 = 0; c0 < a.shape.hidden; c0 += kTermChunk)
    {
        int32_t const columns = a.shape.hidden - c0 < kTermChunk ? a.shape.hidden - c0 : kTermChunk;
        __syncthreads(); // every thread is done with the previous chunk
        for (int32_t e = tid; e < kTermChunk * padded; e += kTermThreads)
        {
            int32_t const c = e / padded;
            int32_t const k = e - c * padded;
            tile[c * stride + k] = c < columns && k < d ? toFloat(w[(c0 + c) * ld + k]) : 0.0F;
        }
        __syncthreads();
        for (int32_t c = 0; c < columns; ++c)
        {
            float const* row = tile + c * stride;
            float left[4];
#pragma unroll
            for (int32_t i = 0; i < 4; ++i)
            {
                left[i] = row[rowBlock + ty * 4 + i];
            }
#pragma unroll
            for (int32_t j = 0; j < 16; ++j)
            {
                if (j < columnSteps)
                {
                    float const right = row[tx + 16 * j];
#pragma unroll
                    for (int32_t i = 0; i < 4; ++i)
                    {
                        acc[i][j] += multiplyRounded(left[i], right); // gramEntry's order: c ascending
                    }
                }
            }
        }
        if (tid < kTermRows)
        {
            for (int32_t c = 0; c < columns; ++c)
            {
                rowSum += fabsf(tile[c * stride + rowBlock + tid]); // rowL1Entry's order
            }
        }
        if (columnThread && tid - 64 < columns)
        {
            float const* column = tile + (tid - 64) * stride;
            float sum = 0.0F;
            for (int32_t k = 0; k < d; ++k)
            {
                sum += fabsf(column[k]); // columnL1's order
            }
            columnBest = sum > columnBest ? sum : columnBest;
        }
    }
    float* gram = a.gram + static_cast<int64_t>(h) * d * d;
#pragma unroll
    for (int32_t i = 0; i < 4; ++i)
    {
        int32_t const k = rowBlock + ty * 4 + i;
#pragma unroll
        for (int32_t j = 0; j < 16; ++j)
        {
            int32_t const l = tx + 16 * j;
            if (j < columnSteps && k < d && l < d)
            {
                gram[static_cast<int64_t>(k) * d + l] = acc[i][j];
            }
        }
    }
    if (tid < kTermRows && rowBlock + tid < d)
    {
        a.rowL1[static_cast<int64_t>(h) * d + rowBlock + tid] = rowSum;
    }
    if (blockIdx.x == 0)
    {
        partial[tid] = columnBest;
        __syncthreads();
        if (tid == 0)
        {
            float best = 0.0F;
            for (int32_t t = 0; t < kTermThreads; ++t)
            {
                best = partial[t] > best ? partial[t] : best;
            }
            a.colL1[h] = best;
        }
    }
}

//! The 16-bit element j (0..7, ascending addresses) of a 16-byte vector, in the low bits.
CKV_HD uint32_t halfOf(uint4 const& v, int32_t j)
{
    uint32_t const word = j < 2 ? v.x : (j < 4 ? v.y : (j < 6 ? v.z : v.w));
    return (word >> (16 * (j & 1))) & 0xFFFFu;
}

//! Row stride (16-bit elements) of boundTermsTensorBlock's chunk tile [k][c]: mma::paddedStride(kTermChunk), so that
//! its ldmatrix phases are conflict-free.
constexpr int32_t kTermTileStride = kTermChunk + 8;

//! The tensor path's chunk tile: W_O^h[k, c0 + c] at [k][c] for every padded row k (128 at most: d_h <= 128).
struct TermTileSmem
{
    alignas(16) uint16_t tile[128 * kTermTileStride];
    float columnBest[kTermThreads];
};

//! A transposing store task of the chunk: column pair `pair` (columns 2 pair, 2 pair + 1) of rows [8 octet, + 8).
//! Task t = thread + kTermThreads i: the 32 lanes of a warp take the 32 column pairs of one octet, so that each of
//! their 8 stores (one row each, 32-bit words: the pair) hits 32 banks: a word's bank is 4 row + pair (mod 32) for
//! the tile's 36-word rows, the same row for every lane. (Lanes over rows instead would meet every 8 rows: 288 words.)
struct TermTask
{
    int32_t pair;
    int32_t octet;
};

CKV_HD TermTask termTask(int32_t task)
{
    return TermTask{task & 31, task >> 5};
}

//! The tensor path's terms (see the file comment). Requires 16-bit T, d_h % 16 == 0, d_h <= 128, 16-byte aligned
//! W_O. grid (ceil(d_h / 64), H), kTermThreads threads.
template <typename T>
__device__ void boundTermsTensorBlock(BoundArgs const& a, TermTileSmem& s)
{
    int32_t const d = a.shape.headDim;
    int32_t const padded = termRowsPadded(d);
    int32_t const rowBlock = static_cast<int32_t>(blockIdx.x) * kTermRows;
    int32_t const h = static_cast<int32_t>(blockIdx.y);
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const lane = tid & 31;
    int32_t const warp = tid / 32;
    int32_t const warpRow = rowBlock + 32 * (warp / 4); // this warp's 32 rows of G_h
    int32_t const warpCol = 32 * (warp % 4);            // and 32 columns
    bool const mmaWarp = warpCol < padded;
    int64_t const ld = static_cast<int64_t>(a.shape.heads) * d;
    T const* w = static_cast<T const*>(a.oProj) + static_cast<int64_t>(h) * d;
    int32_t const tasks = (kTermChunk / 2) * (padded / 8); // column pairs x row octets
    constexpr int32_t kMaxTasks = (kTermChunk / 2) * (128 / 8) / kTermThreads; // 2 per thread at d_h 128
    uint4 next[kMaxTasks][2];
    // the chunk at c0 into registers: two 16-byte vectors (8 rows, columns 2 pair and 2 pair + 1) per task
    auto load = [&](int32_t c0) {
#pragma unroll
        for (int32_t i = 0; i < kMaxTasks; ++i)
        {
            int32_t const task = tid + kTermThreads * i;
            TermTask const t = termTask(task);
#pragma unroll
            for (int32_t q = 0; q < 2; ++q)
            {
                int32_t const c = c0 + 2 * t.pair + q;
                bool const valid = task < tasks && c < a.shape.hidden && 8 * t.octet < d;
                next[i][q] = valid ? load16(w + c * ld + 8 * t.octet) : uint4{0u, 0u, 0u, 0u};
            }
        }
    };
    load(0);
    float sum[2][4][4] = {}; // rows warpRow + 16 mi, columns warpCol + 8 ni (cFragment's elements)
    float rowSum = 0.0F;
    float columnBest = 0.0F;
    uint32_t* words = reinterpret_cast<uint32_t*>(s.tile);
    for (int32_t c0 = 0; c0 < a.shape.hidden; c0 += kTermChunk)
    {
        __syncthreads(); // every warp is done with the previous chunk
#pragma unroll
        for (int32_t i = 0; i < kMaxTasks; ++i)
        {
            int32_t const task = tid + kTermThreads * i;
            if (task >= tasks)
            {
                continue;
            }
            TermTask const t = termTask(task);
#pragma unroll
            for (int32_t j = 0; j < 8; ++j) // row 8 octet + j: (column 2 pair, column 2 pair + 1) as one word
            {
                uint32_t const lo = halfOf(next[i][0], j);
                uint32_t const hi = halfOf(next[i][1], j);
                words[(8 * t.octet + j) * (kTermTileStride / 2) + t.pair] = lo | (hi << 16);
            }
        }
        __syncthreads();
        if (c0 + kTermChunk < a.shape.hidden)
        {
            load(c0 + kTermChunk); // in flight while the tensor cores work on this chunk
        }
        if (mmaWarp)
        {
#pragma unroll
            for (int32_t k0 = 0; k0 < kTermChunk; k0 += mma::kTileK)
            {
                uint32_t af[2][4];
#pragma unroll
                for (int32_t mi = 0; mi < 2; ++mi)
                {
                    ldmatrixX4(af[mi], s.tile + mma::fragmentAOffset(kTermTileStride, warpRow + 16 * mi, k0, lane));
                }
                uint32_t bf[4][2];
#pragma unroll
                for (int32_t nj = 0; nj < 2; ++nj)
                {
                    uint32_t r[4];
                    ldmatrixX4(r, s.tile + mma::fragmentBOffset(kTermTileStride, warpCol + 16 * nj, k0, lane));
                    bf[2 * nj][0] = r[0];
                    bf[2 * nj][1] = r[1];
                    bf[2 * nj + 1][0] = r[2];
                    bf[2 * nj + 1][1] = r[3];
                }
#pragma unroll
                for (int32_t mi = 0; mi < 2; ++mi)
                {
#pragma unroll
                    for (int32_t ni = 0; ni < 4; ++ni)
                    {
                        float step[4] = {0.0F, 0.0F, 0.0F, 0.0F}; // 16 products rounded once, then an fp32 sum
                        mmaSync<T>(step, af[mi], bf[ni]);
#pragma unroll
                        for (int32_t e = 0; e < 4; ++e)
                        {
                            sum[mi][ni][e] += step[e];
                        }
                    }
                }
            }
        }
        int32_t const columns = a.shape.hidden - c0 < kTermChunk ? a.shape.hidden - c0 : kTermChunk;
        if (tid < kTermRows)
        {
            // s_h of row rowBlock + tid: its words in boundRowWord's order (the 32 rows of a warp in 32 banks)
            int32_t const row = rowBlock + tid;
            uint32_t const* rowWords = words + row * (kTermTileStride / 2);
            for (int32_t v = 0; v < kTermChunk / 2; ++v)
            {
                int32_t const word = v ^ ((row >> 3) & 3);
                uint32_t const pair = rowWords[word];
                rowSum += 2 * word < columns ? fabsf(lowHalf<T>(pair)) : 0.0F;
                rowSum += 2 * word + 1 < columns ? fabsf(highHalf<T>(pair)) : 0.0F;
            }
        }
        else if (blockIdx.x == 0 && tid < kTermRows + kTermChunk && tid - kTermRows < columns)
        {
            // a column's sum over the rows (two neighbouring columns share a word: no conflict)
            int32_t const c = tid - kTermRows;
            float column = 0.0F;
            for (int32_t k = 0; k < d; ++k)
            {
                uint32_t const pair = words[k * (kTermTileStride / 2) + c / 2];
                column += fabsf((c & 1) != 0 ? highHalf<T>(pair) : lowHalf<T>(pair));
            }
            columnBest = column > columnBest ? column : columnBest;
        }
    }
    if (mmaWarp)
    {
        float* gram = a.gram + static_cast<int64_t>(h) * d * d;
#pragma unroll
        for (int32_t mi = 0; mi < 2; ++mi)
        {
#pragma unroll
            for (int32_t ni = 0; ni < 4; ++ni)
            {
#pragma unroll
                for (int32_t e = 0; e < 4; ++e)
                {
                    mma::RowCol const rc = mma::cFragment(lane, e);
                    int32_t const k = warpRow + 16 * mi + rc.row;
                    int32_t const l = warpCol + 8 * ni + rc.col;
                    if (k < d && l < d)
                    {
                        gram[static_cast<int64_t>(k) * d + l] = sum[mi][ni][e];
                    }
                }
            }
        }
    }
    if (tid < kTermRows && rowBlock + tid < d)
    {
        a.rowL1[static_cast<int64_t>(h) * d + rowBlock + tid] = rowSum;
    }
    if (blockIdx.x == 0)
    {
        s.columnBest[tid] = columnBest;
        __syncthreads();
        if (tid == 0)
        {
            float best = 0.0F;
            for (int32_t t = 0; t < kTermThreads; ++t)
            {
                best = s.columnBest[t] > best ? s.columnBest[t] : best;
            }
            a.colL1[h] = best;
        }
    }
}

} // namespace criticalkv::kernels
