// Tensor-core tiles of the value-norm stage (mma.sync m16n8k16, ldmatrix, cp.async; criticalkv/mma_layout.h has the
// lane layouts). Two block bodies, included by kernels/value_norms.cu (device) and by the CPU emulation
// (testing/value_norms_mma_emulation.cpp, which supplies the same primitives and one fiber per CUDA thread):
//
// * valueNormsMmaBlock: N[b, h, i] = sum_c |(V W_O^h)[i, c]| (or sqrt of the sum of squares) without storing V W_O.
//   One CTA holds a tile of kRows value rows of one KV head in shared memory (loaded once, with cp.async) and streams
//   W_O^h tiles of kCols hidden columns x d_h through a kStages-deep cp.async ring, for every query head of the group
//   and every column tile: the V tile is reused G * hidden / kCols times. Each warp owns a 64 x 64 block of the
//   product (4 x 8 m16n8 accumulators, 128 fp32 registers), k = d_h in steps of 16; the epilogue folds |x| (or x^2)
//   of the accumulator registers into per-row sums (no accumulator round-trip through shared memory); the rows' sums
//   meet across the 4 lanes of a quad (shuffles) and across the kWarpsN warps of a row (shared memory) once per head.
//   Optional gathered rows: a list of token indices per (sequence, KV head) with a count read on the device (CriticalKV's
//   pruned stage 2: the candidates of every head in one launch).
// * gramQuadBlock: q = v^T G_h v for every row, G_h = W_O^h W_O^h^T given as kPieces 16-bit pieces (G s = sum of the
//   pieces to ~2^-(8 kPieces) relative, s a power of two): the product V [rows x d_h] x pieces [d_h x d_h] on the
//   tensor cores with a fresh accumulator per k16 step summed in fp32 registers (near-fp32 accuracy whatever the
//   tensor core's internal rounding), the row dot with v in the epilogue (v read back from the shared V tile). Writes
//   sqrt(q) (value_norm=l2) or the pruned stage 2's L1 upper bound (pruned_stage2.h: l1UpperBoundTensorCore).
//
// Tile shape (value norms, kWarpsM = 4, kWarpsN = 2, kStages = 3: 256 rows x 128 columns, 8 warps):
// * registers: 128 accumulators + 16 A + 16 B fragment registers + 8 row sums + addressing, about 200 of the 255 a
//   thread may hold at one CTA of 256 threads per SM (__launch_bounds__(256, 1));
// * shared memory (d_h = 128, rows padded by 16 bytes against bank conflicts): V 256 x 136 x 2 = 68 KiB, W_O ring
//   3 x 128 x 136 x 2 = 102 KiB, row sums 2 KiB: 172 KiB (H100: 227 KiB per block). A100 (163 KiB) gets kStages = 2;
// * arithmetic intensity: a W_O tile (34 KiB with padding, 32 KiB from L2) feeds 256 x 128 x 128 x 2 = 8.4 MFLOP:
//   256 FLOP per L2 byte, so 0.5 PFLOP/s needs 2 TB/s of L2 -> SM traffic (W_O of a layer, 32 MiB, stays in L2);
// * shared-memory reads: per k16 step a warp issues 4 + 4 ldmatrix.x4 (4 KiB) for 32 mma (131 kFLOP): 128 B per mma,
//   ~80 B/clock per SM at 0.6 mma/clock, under the 128 B/clock the SM's shared memory delivers;
// * the epilogue costs one FADD per accumulator per column tile (128 per 256 mma per warp), ~6 % of the tensor time.
// A wgmma (sm_90a) version could reach closer to the H100's peak; not built (it needs
// -gencode=arch=compute_90a,code=sm_90a and TMA descriptors, and the plugin ships sm_80 / sm_90 code).
#pragma once

#include "criticalkv/mma_layout.h"
#include "criticalkv/pruned_stage2.h"
#include "criticalkv/select_params.h"

#if defined(__CUDACC__)
#include "device_utils.cuh"
#include "mma_primitives.cuh"
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace criticalkv::kernels
{

//! A CTA of kWarpsM x kWarpsN warps, each owning 64 rows x 64 columns of the product, W_O tiles in a kStages ring.
template <int kWarpsM_, int kWarpsN_, int kStages_>
struct MmaTiles
{
    static constexpr int32_t kWarpsM = kWarpsM_;
    static constexpr int32_t kWarpsN = kWarpsN_;
    static constexpr int32_t kStages = kStages_;
    static constexpr int32_t kWarpRows = 64;
    static constexpr int32_t kWarpCols = 64;
    static constexpr int32_t kMTiles = kWarpRows / mma::kTileM; // 4
    static constexpr int32_t kNTiles = kWarpCols / mma::kTileN; // 8
    static constexpr int32_t kThreads = 32 * kWarpsM * kWarpsN;
    static constexpr int32_t kRows = kWarpRows * kWarpsM; //!< value rows (tokens) per CTA
    static constexpr int32_t kCols = kWarpCols * kWarpsN; //!< product columns per streamed tile

    static_assert(kStages >= 2, "the ring needs a tile in flight while one is read");

    //! Dynamic shared memory of a CTA for head dimension `headDim` (16-bit elements).
    static size_t sharedBytes(int32_t headDim)
    {
        size_t const stride = static_cast<size_t>(mma::paddedStride(headDim));
        return (static_cast<size_t>(kRows) + static_cast<size_t>(kStages) * kCols) * stride * 2
            + static_cast<size_t>(kWarpsN) * kRows * sizeof(float);
    }
};

//! Arguments of both tile bodies. Value rows are either every token i < numTokens, or the listed ones.
struct NormTileArgs
{
    SelectShape shape;
    void const* values;       //!< [B, H_kv, n, d_h]
    void const* oProj;        //!< [hidden, H d_h] (valueNormsMmaBlock)
    int32_t numTokens;        //!< row length of out, and the token count without a list
    float* out;               //!< [B, H, numTokens]: written at the listed tokens only (when listed)
    int32_t const* rowTokens; //!< [B, H_kv, rowStride] token indices (< numTokens), or nullptr: tokens 0..numTokens-1
    int32_t const* rowCounts; //!< [B, H_kv] how many of a head's list are valid (device, read by the kernel)
    int32_t rowStride;
    bool skipUncompressed;    //!< skip the sequences that are not compressed (config, budget, promptLengths)
    SelectConfig config;
    RuntimeBudget budget;
    int32_t const* promptLengths;
    // gramQuadBlock
    void const* gramPieces;   //!< [H, kPieces, d_h, d_h] 16-bit pieces of s_h G_h (G_h symmetric: row l = column l)
    float const* gramScale;   //!< [H] 1 / s_h (a power of two)
    float const* rowL1;       //!< [H, d_h] s_h[k] = sum_c |W_O^h[k, c]| (bound mode)
    float const* colL1;       //!< [H] c_h = max_c sum_k |W_O^h[k, c]| (bound mode)
    int32_t headSplit;        //!< valueNormsMmaBlock: CTAs sharing a KV head's group of query heads (blockIdx.y =
                              //!< g headSplit + part, part taking group / headSplit of them); 0 or 1: one CTA takes all
};

//! CTAs per KV head's group (NormTileArgs::headSplit, at least 1).
CKV_HD int32_t headSplitOf(NormTileArgs const& a)
{
    return a.headSplit > 1 ? a.headSplit : 1;
}

//! The headSplit of a value-norm launch of `ctas` CTAs (row tiles x KV heads x sequences) on a device running `slots`
//! of them at once: the divisor s of the group whose s x ctas CTAs fill the device's waves best (the busy fraction of
//! the last wave counted; the smaller s on a tie). A CTA then reloads its value rows for fewer query heads: one more
//! read of a V tile (d_h x 512 bytes) per extra CTA against 4 MiB of W_O streamed per head at Llama-3-8B sizes. E.g.
//! the pruned stage 2's first candidates at 32k (12 row tiles x 8 KV heads, group 4) on 132 SMs: 96 CTAs fill 73 % of
//! one wave, 384 fill 97 % of three.
CKV_HD int32_t chooseHeadSplit(int64_t ctas, int32_t group, int64_t slots)
{
    if (ctas <= 0 || slots <= 0 || group <= 1)
    {
        return 1;
    }
    int32_t best = 1;
    double bestFill = 0.0;
    for (int32_t split = 1; split <= group; ++split)
    {
        if (group % split != 0)
        {
            continue;
        }
        int64_t const total = ctas * split;
        int64_t const waves = (total + slots - 1) / slots;
        double const fill = static_cast<double>(total) / static_cast<double>(waves * slots);
        if (fill > bestFill + 1e-9)
        {
            best = split;
            bestFill = fill;
        }
    }
    return best;
}

//! The 32-bit word (two 16-bit elements) a thread reads at step w (0 <= w < d_h / 2) of its row of the V tile in
//! gramQuadBlock's bound epilogue (one thread per row, the rows of a warp consecutive): w with its two lowest bits
//! flipped by bits 3..4 of the row. With the tile's row stride of d_h / 2 + 4 words (mma::paddedStride), 4 times an odd
//! number for d_h % 16 == 0, rows r and r + 8 meet in one bank in the plain order; the flip sends the 4 rows of a bank
//! to 4 neighbouring words, so a warp's 32 reads hit 32 banks (tests: value_norms_mma_emulation banks). d_h / 2 is a
//! multiple of 8, so the flipped word stays inside the row.
CKV_HD int32_t boundRowWord(int32_t row, int32_t w)
{
    return w ^ ((row >> 3) & 3);
}

//! The rows of this CTA: [begin, begin + kRows) of the head's list (or of the tokens); count = the list's length.
struct TileRows
{
    int64_t head;  //!< b * H_kv + g
    int32_t begin;
    int32_t count;
};

__device__ __forceinline__ TileRows tileRowsOf(NormTileArgs const& a, int32_t rowsPerTile)
{
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    int32_t const g = static_cast<int32_t>(blockIdx.y) / headSplitOf(a);
    TileRows t{};
    t.head = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    t.begin = static_cast<int32_t>(blockIdx.x) * rowsPerTile;
    if (a.rowTokens != nullptr)
    {
        int32_t const count = a.rowCounts[t.head];
        t.count = count < 0 ? 0 : (count > a.rowStride ? a.rowStride : count);
    }
    else
    {
        t.count = a.numTokens;
    }
    if (a.skipUncompressed && !sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b).compress)
    {
        t.count = 0;
    }
    return t;
}

__device__ __forceinline__ int32_t tokenOf(NormTileArgs const& a, TileRows const& t, int32_t position)
{
    return a.rowTokens != nullptr ? a.rowTokens[t.head * a.rowStride + position] : position;
}

//! cp.async the CTA's value rows (zero rows past the list's end) into tile [kRows][stride].
template <typename T, typename Cfg>
__device__ __forceinline__ void loadValueTile(NormTileArgs const& a, TileRows const& t, T* tile)
{
    int32_t const d = a.shape.headDim;
    int32_t const stride = mma::paddedStride(d);
    int32_t const chunks = d / 8;
    T const* values = static_cast<T const*>(a.values) + t.head * a.shape.n * static_cast<int64_t>(d);
    for (int32_t e = static_cast<int32_t>(threadIdx.x); e < Cfg::kRows * chunks; e += Cfg::kThreads)
    {
        int32_t const row = e / chunks;
        int32_t const chunk = e - row * chunks;
        int32_t const position = t.begin + row;
        bool const valid = position < t.count;
        int64_t const token = valid ? tokenOf(a, t, position) : 0;
        cpAsync16(tile + row * stride + chunk * 8, values + token * d + chunk * 8, valid);
    }
}

//! The warp's A fragments of rows [row0, row0 + 16) and B fragments of columns [col0, col0 + 64) at depth k0.
template <typename Cfg, typename T>
__device__ __forceinline__ void loadFragmentsB(T const* bTile, int32_t stride, int32_t col0, int32_t k0,
    uint32_t (&bf)[Cfg::kNTiles][2])
{
    int32_t const lane = static_cast<int32_t>(threadIdx.x) & 31;
#pragma unroll
    for (int32_t nj = 0; nj < Cfg::kNTiles / 2; ++nj)
    {
        uint32_t r[4];
        ldmatrixX4(r, bTile + mma::fragmentBOffset(stride, col0 + nj * 16, k0, lane));
        bf[2 * nj][0] = r[0];
        bf[2 * nj][1] = r[1];
        bf[2 * nj + 1][0] = r[2];
        bf[2 * nj + 1][1] = r[3];
    }
}

template <typename T>
__device__ __forceinline__ void loadFragmentA(T const* aTile, int32_t stride, int32_t row0, int32_t k0, uint32_t (&af)[4])
{
    int32_t const lane = static_cast<int32_t>(threadIdx.x) & 31;
    ldmatrixX4(af, aTile + mma::fragmentAOffset(stride, row0, k0, lane));
}

//! Sum of a row's quad: the 4 lanes sharing groupID hold one row's columns; every lane gets the total.
__device__ __forceinline__ float quadSum(float value)
{
    value += shflXor(value, 1);
    value += shflXor(value, 2);
    return value;
}

//! Row sums of one warp's 64 rows (rowPart[mi][half]: row mi*16 + half*8 + groupID) into totals[warpN][kRows].
template <typename Cfg>
__device__ __forceinline__ void storeRowSums(float (&rowPart)[Cfg::kMTiles][2], float* totals, int32_t warpM,
    int32_t warpN)
{
    int32_t const lane = static_cast<int32_t>(threadIdx.x) & 31;
#pragma unroll
    for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
    {
#pragma unroll
        for (int32_t half = 0; half < 2; ++half)
        {
            float const total = quadSum(rowPart[mi][half]);
            if ((lane & 3) == 0)
            {
                totals[warpN * Cfg::kRows + warpM * Cfg::kWarpRows + mi * 16 + half * 8 + (lane >> 2)] = total;
            }
            rowPart[mi][half] = 0.0F;
        }
    }
}

//! The projected-value norms of one CTA's rows (see the file comment). grid (row tiles, H_kv, B), Cfg::kThreads.
template <typename T, typename Cfg, bool kL2>
__device__ void valueNormsMmaBlock(NormTileArgs const& a, unsigned char* shared)
{
    TileRows const t = tileRowsOf(a, Cfg::kRows);
    if (t.begin >= t.count)
    {
        return; // a tile past this head's list (the grid covers the longest one), or an uncompressed sequence
    }
    int32_t const d = a.shape.headDim;
    int32_t const hidden = a.shape.hidden;
    int32_t const split = headSplitOf(a);
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    int32_t const headsHere = group / split; // this CTA's query heads: firstHead ..
    int32_t const firstHead = (static_cast<int32_t>(blockIdx.y) / split) * group
        + (static_cast<int32_t>(blockIdx.y) % split) * headsHere;
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    int32_t const stride = mma::paddedStride(d);
    int32_t const chunks = d / 8;
    int64_t const ld = static_cast<int64_t>(a.shape.heads) * d;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const warp = tid / 32;
    int32_t const warpM = warp % Cfg::kWarpsM;
    int32_t const warpN = warp / Cfg::kWarpsM;

    T* aTile = reinterpret_cast<T*>(shared);
    T* ring = aTile + Cfg::kRows * stride;
    float* totals = reinterpret_cast<float*>(ring + Cfg::kStages * Cfg::kCols * stride);

    int32_t const columnTiles = (hidden + Cfg::kCols - 1) / Cfg::kCols;
    int32_t const tiles = headsHere * columnTiles;
    // W_O tile t: query head firstHead + t / columnTiles, hidden columns [c0, c0 + kCols) as rows [c][k] of the ring
    // slot t % kStages (W_O^h[k, c] = oProj[c, h d_h + k]: k contiguous, the "col" B operand as stored).
    auto loadWeights = [&](int32_t tile) {
        int32_t const h = firstHead + tile / columnTiles;
        int32_t const c0 = (tile % columnTiles) * Cfg::kCols;
        T* slot = ring + (tile % Cfg::kStages) * Cfg::kCols * stride;
        T const* weights = static_cast<T const*>(a.oProj) + static_cast<int64_t>(h) * d;
        for (int32_t e = tid; e < Cfg::kCols * chunks; e += Cfg::kThreads)
        {
            int32_t const row = e / chunks;
            int32_t const chunk = e - row * chunks;
            bool const valid = c0 + row < hidden;
            cpAsync16(slot + row * stride + chunk * 8, weights + (valid ? c0 + row : 0) * ld + chunk * 8, valid);
        }
    };

    loadValueTile<T, Cfg>(a, t, aTile); // joins the first group: it completes with W_O tile 0
    for (int32_t s = 0; s < Cfg::kStages - 1; ++s)
    {
        if (s < tiles)
        {
            loadWeights(s);
        }
        cpAsyncCommit(); // one group per slot, empty or not, so that the wait count below stays uniform
    }

    float rowPart[Cfg::kMTiles][2] = {};
    for (int32_t tile = 0; tile < tiles; ++tile)
    {
        // committed groups: kStages - 1 + tile; tile `tile` is group `tile` (plus the V rows in group 0)
        cpAsyncWait<Cfg::kStages - 2>();
        __syncthreads(); // tile visible to every warp; every warp done with the slot refilled next (tile - 1's)
        if (tile + Cfg::kStages - 1 < tiles)
        {
            loadWeights(tile + Cfg::kStages - 1);
        }
        cpAsyncCommit();
        T const* bTile = ring + (tile % Cfg::kStages) * Cfg::kCols * stride;

        float acc[Cfg::kMTiles][Cfg::kNTiles][4] = {};
        for (int32_t k0 = 0; k0 < d; k0 += mma::kTileK)
        {
            uint32_t af[Cfg::kMTiles][4];
#pragma unroll
            for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
            {
                loadFragmentA(aTile, stride, warpM * Cfg::kWarpRows + mi * 16, k0, af[mi]);
            }
            uint32_t bf[Cfg::kNTiles][2];
            loadFragmentsB<Cfg>(bTile, stride, warpN * Cfg::kWarpCols, k0, bf);
#pragma unroll
            for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
            {
#pragma unroll
                for (int32_t ni = 0; ni < Cfg::kNTiles; ++ni)
                {
                    mmaSync<T>(acc[mi][ni], af[mi], bf[ni]);
                }
            }
        }
        // epilogue: element e of acc[mi][ni] is row mi*16 + groupID + 8 (e >> 1) (mma_layout.h: cFragment)
#pragma unroll
        for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
        {
#pragma unroll
            for (int32_t ni = 0; ni < Cfg::kNTiles; ++ni)
            {
#pragma unroll
                for (int32_t e = 0; e < 4; ++e)
                {
                    float const x = acc[mi][ni][e];
                    rowPart[mi][e >> 1] += kL2 ? x * x : fabsf(x);
                }
            }
        }
        if ((tile + 1) % columnTiles == 0) // query head complete: its rows' sums out
        {
            int32_t const h = firstHead + tile / columnTiles;
            storeRowSums<Cfg>(rowPart, totals, warpM, warpN);
            __syncthreads();
            for (int32_t row = tid; row < Cfg::kRows; row += Cfg::kThreads)
            {
                int32_t const position = t.begin + row;
                if (position < t.count)
                {
                    float total = 0.0F;
                    for (int32_t wn = 0; wn < Cfg::kWarpsN; ++wn)
                    {
                        total += totals[wn * Cfg::kRows + row];
                    }
                    int64_t const at = (static_cast<int64_t>(b) * a.shape.heads + h) * a.numTokens + tokenOf(a, t, position);
                    a.out[at] = kL2 ? sqrtf(total) : total;
                }
            }
            // totals is written again only after the next tile's __syncthreads
        }
    }
    cpAsyncWait<0>(); // the trailing groups are empty; nothing is left in flight at exit
}

//! The quadratic forms q = v^T G_h v of one CTA's rows for every query head of the group (see the file comment);
//! bound: the L1 upper bound of pruned_stage2.h (l1UpperBoundTensorCore), else sqrt(max(q, 0)). Cfg::kCols >= d_h.
//! grid (row tiles, H_kv, B), Cfg::kThreads.
template <typename T, typename Cfg, int kPieces, bool kBound>
__device__ void gramQuadBlock(NormTileArgs const& a, unsigned char* shared)
{
    TileRows const t = tileRowsOf(a, Cfg::kRows);
    if (t.begin >= t.count)
    {
        return;
    }
    int32_t const d = a.shape.headDim;
    int32_t const group = a.shape.heads / a.shape.kvHeads;
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    int32_t const stride = mma::paddedStride(d);
    int32_t const chunks = d / 8;
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const lane = tid & 31;
    int32_t const warp = tid / 32;
    int32_t const warpM = warp % Cfg::kWarpsM;
    int32_t const warpN = warp / Cfg::kWarpsM;

    T* aTile = reinterpret_cast<T*>(shared);
    T* ring = aTile + Cfg::kRows * stride;
    float* totals = reinterpret_cast<float*>(ring + Cfg::kStages * Cfg::kCols * stride);

    int32_t const tiles = group * kPieces; // tile = (query head, piece): d_h rows l x d_h depth k
    auto loadPiece = [&](int32_t tile) {
        int32_t const h = g * group + tile / kPieces;
        int32_t const piece = tile % kPieces;
        T* slot = ring + (tile % Cfg::kStages) * Cfg::kCols * stride;
        T const* source = static_cast<T const*>(a.gramPieces) + (static_cast<int64_t>(h) * kPieces + piece) * d * d;
        for (int32_t e = tid; e < Cfg::kCols * chunks; e += Cfg::kThreads)
        {
            int32_t const row = e / chunks;
            int32_t const chunk = e - row * chunks;
            bool const valid = row < d;
            cpAsync16(slot + row * stride + chunk * 8, source + (valid ? row : 0) * d + chunk * 8, valid);
        }
    };

    loadValueTile<T, Cfg>(a, t, aTile);
    for (int32_t s = 0; s < Cfg::kStages - 1; ++s)
    {
        if (s < tiles)
        {
            loadPiece(s);
        }
        cpAsyncCommit();
    }

    float sum[Cfg::kMTiles][Cfg::kNTiles][4] = {};
    for (int32_t tile = 0; tile < tiles; ++tile)
    {
        cpAsyncWait<Cfg::kStages - 2>();
        __syncthreads();
        if (tile + Cfg::kStages - 1 < tiles)
        {
            loadPiece(tile + Cfg::kStages - 1);
        }
        cpAsyncCommit();
        T const* bTile = ring + (tile % Cfg::kStages) * Cfg::kCols * stride;
        for (int32_t k0 = 0; k0 < d; k0 += mma::kTileK)
        {
            uint32_t bf[Cfg::kNTiles][2];
            loadFragmentsB<Cfg>(bTile, stride, warpN * Cfg::kWarpCols, k0, bf);
#pragma unroll
            for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
            {
                uint32_t af[4];
                loadFragmentA(aTile, stride, warpM * Cfg::kWarpRows + mi * 16, k0, af);
#pragma unroll
                for (int32_t ni = 0; ni < Cfg::kNTiles; ++ni)
                {
                    // a fresh accumulator per k16 step, summed in fp32: the tensor core rounds only 16 products
                    float step[4] = {0.0F, 0.0F, 0.0F, 0.0F};
                    mmaSync<T>(step, af, bf[ni]);
#pragma unroll
                    for (int32_t e = 0; e < 4; ++e)
                    {
                        sum[mi][ni][e] += step[e];
                    }
                }
            }
        }
        if ((tile + 1) % kPieces != 0)
        {
            continue;
        }
        // query head complete: q_row = sum_l y[row, l] v[row, l], v from the shared V tile
        int32_t const h = g * group + tile / kPieces;
        float rowPart[Cfg::kMTiles][2] = {};
#pragma unroll
        for (int32_t mi = 0; mi < Cfg::kMTiles; ++mi)
        {
#pragma unroll
            for (int32_t ni = 0; ni < Cfg::kNTiles; ++ni)
            {
#pragma unroll
                for (int32_t e = 0; e < 4; ++e)
                {
                    mma::RowCol const rc = mma::cFragment(lane, e);
                    int32_t const row = warpM * Cfg::kWarpRows + mi * 16 + rc.row;
                    int32_t const col = warpN * Cfg::kWarpCols + ni * 8 + rc.col;
                    float const v = col < d ? toFloat(aTile[row * stride + col]) : 0.0F;
                    rowPart[mi][e >> 1] += sum[mi][ni][e] * v;
                    sum[mi][ni][e] = 0.0F;
                }
            }
        }
        storeRowSums<Cfg>(rowPart, totals, warpM, warpN);
        __syncthreads();
        float const inverseScale = a.gramScale[h];
        for (int32_t row = tid; row < Cfg::kRows; row += Cfg::kThreads)
        {
            int32_t const position = t.begin + row;
            if (position >= t.count)
            {
                continue;
            }
            float quad = 0.0F;
            for (int32_t wn = 0; wn < Cfg::kWarpsN; ++wn)
            {
                quad += totals[wn * Cfg::kRows + row];
            }
            quad *= inverseScale; // a power of two: exact
            float result = 0.0F;
            if constexpr (kBound)
            {
                // |v| . s_h and max |v_k| of this thread's row, two elements per 32-bit word in boundRowWord's order:
                // the 32 rows a warp reads at once fall in 32 different banks (a row stride of 4 x an odd number of
                // words put rows 8 apart in one bank: 4-way conflicts in the plain order)
                uint32_t const* words = reinterpret_cast<uint32_t const*>(aTile + row * stride);
                float const* s = a.rowL1 + static_cast<int64_t>(h) * d;
                float weighted = 0.0F;
                float maxAbs = 0.0F;
                for (int32_t w = 0; w < d / 2; ++w)
                {
                    int32_t const word = boundRowWord(row, w);
                    float const x0 = fabsf(lowHalf<T>(words[word]));
                    float const x1 = fabsf(highHalf<T>(words[word]));
                    weighted += x0 * s[2 * word];
                    weighted += x1 * s[2 * word + 1];
                    maxAbs = x0 > maxAbs ? x0 : maxAbs;
                    maxAbs = x1 > maxAbs ? x1 : maxAbs;
                }
                constexpr bool kHalf = std::is_same<T, __half>::value;
                float const tau = kHalf ? inverseScale * 2.98023223876953125e-8F : 0.0F; // 2^-25 / s
                result = l1UpperBoundTensorCore(quad, weighted, maxAbs, a.colL1[h], pieceResidual(kPieces, kHalf), tau,
                    d, a.shape.hidden);
            }
            else
            {
                result = sqrtf(quad > 0.0F ? quad : 0.0F);
            }
            int64_t const at = (static_cast<int64_t>(b) * a.shape.heads + h) * a.numTokens + tokenOf(a, t, position);
            a.out[at] = result;
        }
    }
    cpAsyncWait<0>();
}

//! Gram pieces of query head blockIdx.x (every thread of a kThreads block calls it; partial: [kThreads] shared): the scale
//! s_h (1 for bf16; for fp16 the power of two putting max |G_h| s_h in [2^14, 2^15), inside fp16's range) and
//! pieces[h, p] (16-bit, rounded to nearest) with s_h G_h = sum_p pieces[h, p] + residual, each piece the rounding of
//! what the previous ones left (exact fp32 differences). inverseScale[h] = 1 / s_h.
template <typename T, int kPieces, int kThreads>
__device__ void gramPiecesBlock(float const* gram, int32_t headDim, T* pieces, float* inverseScale, float* partial)
{
    int32_t const h = static_cast<int32_t>(blockIdx.x);
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int64_t const entries = static_cast<int64_t>(headDim) * headDim;
    float const* g = gram + h * entries;
    float scale = 1.0F;
    if constexpr (std::is_same<T, __half>::value)
    {
        float largest = 0.0F;
        for (int64_t e = tid; e < entries; e += kThreads)
        {
            float const x = fabsf(g[e]);
            largest = x > largest ? x : largest;
        }
        partial[tid] = largest;
        __syncthreads();
        for (int32_t t = 0; t < kThreads; ++t) // every thread reads the same values: same scale everywhere
        {
            largest = partial[t] > largest ? partial[t] : largest;
        }
        int exponent = 0;
        frexpf(largest, &exponent); // largest = f 2^exponent, f in [0.5, 1)
        int32_t const shift = largest > 0.0F ? 15 - exponent : 0;
        scale = ldexpf(1.0F, shift < -126 ? -126 : (shift > 126 ? 126 : shift));
    }
    for (int64_t e = tid; e < entries; e += kThreads)
    {
        float rest = g[e] * scale; // a power of two: exact
        for (int32_t p = 0; p < kPieces; ++p)
        {
            T const piece = fromFloat<T>(rest);
            pieces[(static_cast<int64_t>(h) * kPieces + p) * entries + e] = piece;
            rest -= toFloat(piece); // exact: the rounding error of a float to fewer bits is a float
        }
    }
    if (tid == 0)
    {
        inverseScale[h] = 1.0F / scale;
    }
}

//! The configurations the launches use (value_norms.cu), shared with the emulation.
using NormTiles = MmaTiles<4, 2, 3>;     //!< 256 rows x 128 columns, 3-deep W_O ring (172 KiB at d_h = 128)
using NormTilesSmall = MmaTiles<4, 2, 2>; //!< the same, double-buffered (138 KiB: A100)
using GramTiles64 = MmaTiles<4, 1, 2>;   //!< quadratic forms, d_h <= 64: 256 rows x 64 columns
using GramTiles128 = MmaTiles<4, 2, 2>;  //!< d_h <= 128
constexpr int32_t kGramPiecesL2 = 3;     //!< pieces of the l2 norms' Gram matrices (near-fp32 accuracy)
constexpr int32_t kGramPiecesBound = 2;  //!< pieces of the pruned stage 2's bound (its error terms cover the rest)
constexpr int32_t kGramPieceThreads = 256;

} // namespace criticalkv::kernels
