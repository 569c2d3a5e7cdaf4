// The compaction (kept_positions.h's rule): every KV head's kept positions, ascending, into kept_indices (-1 padded)
// and their count into kept_lengths. Included by kernels/selection.cu and by the CPU emulation
// (testing/compact_emulation.cpp), so it uses no CUB.
//
// A grid of (position tiles, H_kv, B): each CTA owns kCompactTile positions of one head. A head with a fixed kept set
// (uncompressed, streamingllm) writes its slots directly (slot s of the output lies in the CTA owning position s, as
// cap <= n). A scored head: the CTA counts the kept positions before its tile (the flags set in the valid older range
// before it, plus the window positions before it, which are all kept) with 32-bit loads of four flags each, ranks its
// own kept positions by a block scan (8 consecutive positions per thread) and writes each to slot prefix + rank; the
// CTA of the last tile pads the rest with -1 and writes the count. No CTA waits for another and nothing is stored
// between launches: one launch, no scratch. The prefix count reads at most n flags per CTA (for 128k positions and 32
// tiles: 2 MiB per head from L2 in all), where one 512-thread CTA per head used to walk all n positions in sequence.
#pragma once

#include "criticalkv/kept_positions.h"
#include "criticalkv/select_params.h"
#include "select_flow_args.h" // Grid3
#include "topk_block.cuh"      // CKV_BLOCK_SHARED

namespace criticalkv::kernels
{

constexpr int kCompactThreads = 512;
constexpr int32_t kCompactPerThread = 8;
constexpr int32_t kCompactTile = kCompactThreads * kCompactPerThread; //!< positions per CTA
constexpr int kCompactWarps = kCompactThreads / 32;

//! The compaction: every head's kept positions, ascending, from its flags (or the fixed rule).
struct CompactArgs
{
    SelectConfig config;
    SelectShape shape;
    int32_t const* promptLengths;
    RuntimeBudget budget;
    uint8_t const* flags; // [B, H_kv, m]
    int32_t* keptIndices; // [B, H_kv, cap]
    int32_t* keptLengths; // [B, H_kv]
};

struct CompactSmem
{
    uint32_t warpTotals[kCompactWarps];
};

//! Non-zero bytes of a 32-bit word (per byte: bit 7 of (b & 0x7f) + 0x7f, or of b, is set iff b != 0; no carries).
CKV_HD int32_t nonZeroBytes(uint32_t word)
{
    uint32_t const set = ((word & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) | word;
    uint32_t const marks = set & 0x80808080u;
    return static_cast<int32_t>((marks >> 7) + (marks >> 15) + (marks >> 23) + (marks >> 31)) & 0xFF;
}

//! Non-zero flags in [begin, end) of `flags`, counted by the block's threads (each its share; summed by the caller).
__device__ __forceinline__ uint32_t countSetFlags(uint8_t const* flags, int32_t begin, int32_t end)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    uint32_t count = 0;
    if (end <= begin)
    {
        return 0;
    }
    // the unaligned head and tail byte by byte, the 4-byte aligned body as words
    uintptr_t const address = reinterpret_cast<uintptr_t>(flags + begin);
    int32_t const lead = static_cast<int32_t>((4 - (address & 3u)) & 3u);
    int32_t const bodyBegin = begin + (lead < end - begin ? lead : end - begin);
    int32_t const words = (end - bodyBegin) / 4;
    int32_t const bodyEnd = bodyBegin + 4 * words;
    for (int32_t p = begin + tid; p < bodyBegin; p += kCompactThreads)
    {
        count += flags[p] != 0 ? 1u : 0u;
    }
    uint32_t const* body = reinterpret_cast<uint32_t const*>(flags + bodyBegin);
    for (int32_t w = tid; w < words; w += kCompactThreads)
    {
        count += static_cast<uint32_t>(nonZeroBytes(body[w]));
    }
    for (int32_t p = bodyEnd + tid; p < end; p += kCompactThreads)
    {
        count += flags[p] != 0 ? 1u : 0u;
    }
    return count;
}

//! Exclusive prefix sum over the block of one value per thread (thread order); total: the block's sum, for every
//! thread. Every thread calls it.
__device__ __forceinline__ uint32_t compactExclusiveScan(uint32_t value, uint32_t& total, CompactSmem& s)
{
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    int32_t const lane = tid % 32;
    int32_t const warp = tid / 32;
    uint32_t inclusive = value;
    for (int offset = 1; offset < 32; offset *= 2)
    {
        uint32_t const y = __shfl_up_sync(0xffffffffu, inclusive, static_cast<unsigned>(offset));
        inclusive += lane >= offset ? y : 0u;
    }
    __syncthreads(); // warpTotals is free
    if (lane == 31)
    {
        s.warpTotals[warp] = inclusive;
    }
    __syncthreads();
    uint32_t before = 0;
    total = 0;
    for (int32_t w = 0; w < kCompactWarps; ++w)
    {
        before += w < warp ? s.warpTotals[w] : 0u;
        total += s.warpTotals[w];
    }
    return before + inclusive - value;
}

//! One CTA of the compaction: positions [blockIdx.x kCompactTile, + kCompactTile) of KV head (blockIdx.z, blockIdx.y).
//! grid (ceil(n / kCompactTile), H_kv, B), block kCompactThreads.
__device__ __forceinline__ void compactBlock(CompactArgs const& a, CompactSmem& s)
{
    int32_t const g = static_cast<int32_t>(blockIdx.y);
    int32_t const b = static_cast<int32_t>(blockIdx.z);
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    int32_t const n = a.shape.n;
    int32_t const m = n - windowLength(a.config, n);
    int32_t const cap = outputCapacity(a.config, n);
    int64_t const head = static_cast<int64_t>(b) * a.shape.kvHeads + g;
    int32_t* indices = a.keptIndices + head * cap;
    int32_t const begin = static_cast<int32_t>(blockIdx.x) * kCompactTile;
    int32_t const end = begin + kCompactTile < n ? begin + kCompactTile : n;
    bool const lastTile = end == n;
    int32_t const fixed = fixedKeptCount(a.config, info);
    if (fixed >= 0)
    {
        int32_t const slots = end < cap ? end : cap;
        for (int32_t slot = begin + tid; slot < slots; slot += kCompactThreads)
        {
            indices[slot] = slot < fixed ? fixedKeptPosition(a.config, info, n, slot) : -1;
        }
        if (blockIdx.x == 0 && tid == 0)
        {
            a.keptLengths[head] = fixed < cap ? fixed : cap;
        }
        return;
    }
    uint8_t const* flags = a.flags + head * m;
    // kept positions before this tile: the set flags of [validStart, min(begin, m)), then every position of [m, begin)
    int32_t const olderEnd = begin < m ? begin : m;
    uint32_t prefix = 0;
    compactExclusiveScan(countSetFlags(flags, info.validStart, olderEnd), prefix, s);
    prefix += begin > m ? static_cast<uint32_t>(begin - m) : 0u;
    // this tile's kept positions: kCompactPerThread consecutive ones per thread, ranked by a block scan
    int32_t const first = begin + tid * kCompactPerThread;
    uint32_t mine = 0u;
    uint32_t keptHere = 0u;
    for (int32_t j = 0; j < kCompactPerThread; ++j)
    {
        int32_t const p = first + j;
        bool const kept = p < end && scoredPositionKept(info, m, flags, p);
        mine |= kept ? 1u << j : 0u;
        keptHere += kept ? 1u : 0u;
    }
    uint32_t tileTotal = 0;
    uint32_t slot = prefix + compactExclusiveScan(keptHere, tileTotal, s);
    for (int32_t j = 0; j < kCompactPerThread; ++j)
    {
        if (((mine >> j) & 1u) != 0u)
        {
            if (slot < static_cast<uint32_t>(cap))
            {
                indices[slot] = first + j;
            }
            ++slot;
        }
    }
    if (lastTile)
    {
        uint32_t const total = prefix + tileTotal;
        for (int64_t pad = static_cast<int64_t>(total) + tid; pad < cap; pad += kCompactThreads)
        {
            indices[pad] = -1;
        }
        if (tid == 0)
        {
            a.keptLengths[head] = total < static_cast<uint32_t>(cap) ? static_cast<int32_t>(total) : cap;
        }
    }
}

//! The compaction's grid: (ceil(n / kCompactTile), H_kv, B).
inline Grid3 compactGrid(SelectShape const& shape)
{
    return Grid3{static_cast<uint32_t>((shape.n + kCompactTile - 1) / kCompactTile),
        static_cast<uint32_t>(shape.kvHeads), static_cast<uint32_t>(shape.batch)};
}

} // namespace criticalkv::kernels
