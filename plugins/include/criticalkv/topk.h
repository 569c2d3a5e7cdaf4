// The batched top-k primitive of the selection (kernels/topk.cu; launchTopK and launchMassCount are declared in
// kernels.h): many rows in a fixed sequence of launches, a k per row read on the device, eligibility from the
// caller's flags, the k best of every row marked in place. Framework-free (raw device pointers, the caller's
// scratch, cudaStream_t last, cudaError_t returned; this header needs no CUDA), no allocation, no host
// synchronisation: CUDA-graph capturable. docs/kernels.md ("Top-k") describes the design and its predicted cost.
//
// Rule (criticalkv/methods/topk.py: topk_mask; radix.h): the k highest scores among a row's candidates, a NaN of
// either sign above +inf, -0.0 equal to +0.0, equal scores to the lower index. A candidate is an entry e < len with
// flags[e] == 0 and (e % period) >= firstValid (left padding of every period-long segment is never chosen).
#pragma once

#include "criticalkv/mass_count.h"
#include "criticalkv/radix_select.h"

#include <cstddef>

namespace criticalkv
{

//! Most k a top-k call ranks a row by at once (TopKRows::levels).
constexpr int32_t kTopKMaxLevels = 4;

//! Rows of one top-k launch. Row r is scores[r * stride, r * stride + len) (flags the same).
//! With levels L > 1, one call selects L nested sets per row under the same rule: k[l * rows + r] best for level l,
//! and a candidate gets mark + l for the first level whose set holds it (the sets of a larger k hold those of a smaller
//! one, so the levels of non-decreasing k label the best k[0] with mark, the next k[1] - k[0] with mark + 1, ...): what
//! L calls with the differences as k would mark, in one sequence of launches (the pruned stage 2's candidate rounds).
struct TopKRows
{
    float const* scores;       //!< [rows, stride] (device)
    uint8_t* flags;            //!< [rows, stride] (device): 0 = eligible; the k best get `mark`, nothing else changes
    int64_t const* k;          //!< [levels, rows] (device): how many to mark; <= 0 marks none, >= the candidates all
    int32_t const* firstValid; //!< [rows] (device) or nullptr (0 for every row)
    int32_t rows;
    int32_t len;
    int64_t stride;  //!< >= len
    int32_t period;  //!< segment length of the left-padding rule, 1 .. len (a row of several heads: the head length)
    uint8_t mark;    //!< non-zero; mark + levels - 1 <= 255
    int32_t levels;  //!< 1 .. kTopKMaxLevels (0 counts as 1)
};

CKV_HD int32_t topKLevels(TopKRows const& p)
{
    return p.levels > 1 ? p.levels : 1;
}

//! Entries per CTA of a long row (each of its kTopKThreads threads reads 8 per pass), and the longest row that one
//! CTA handles alone in a single launch.
constexpr int32_t kTopKChunk = 2048;
constexpr int32_t kTopKSingleCtaMax = 2 * kTopKChunk;
constexpr int kTopKThreads = 256; // one thread per digit bin in the digit choice

//! Scratch state of one row of a multi-CTA top-k (zeroed at the start of every call): how many CTAs have added their
//! histograms at every pass, every level's search after the last pass (written by the CTA that adds the last
//! histogram), then (topKRowStateBytes) the global digit histogram of every level and pass, [levels][passes][bins].
struct TopKRowState
{
    uint32_t arrived[kRadixPasses];
    RadixSearch search[kTopKMaxLevels];
};

//! Bytes of one row's state with `levels` levels (a multiple of 16).
CKV_HD size_t topKRowStateBytes(int32_t levels)
{
    size_t const bytes = sizeof(TopKRowState)
        + static_cast<size_t>(levels > 1 ? levels : 1) * kRadixPasses * kRadixBins * sizeof(uint32_t);
    return (bytes + 15) / 16 * 16;
}

//! The same for the mass count (mass_count.h: radixMassCount): counts and int64 fixed-point sums per digit.
struct MassRowState
{
    uint32_t counts[kRadixPasses][kRadixBins];
    unsigned long long sums[kRadixPasses][kRadixBins];
    uint32_t arrived[kRadixPasses];
    MassSearch search;
};

//! How launchTopK runs `rows` rows of `len` entries: one CTA per row in one launch (ctasPerRow == 1, no scratch), or
//! ctasPerRow CTAs per row with one launch per radix pass; its scratch: a TopKRowState per row, then the digit
//! histogram of the last pass of every CTA (the ties at the threshold before each CTA's chunk).
struct TopKPlan
{
    int32_t ctasPerRow;
    size_t stateBytes;
    size_t scratchBytes;
};

constexpr size_t kTopKScratchAlignment = 256;

CKV_HD size_t alignTopKScratch(size_t bytes)
{
    return (bytes + kTopKScratchAlignment - 1) / kTopKScratchAlignment * kTopKScratchAlignment;
}

inline TopKPlan topKPlan(int32_t rows, int32_t len, int32_t levels = 1)
{
    TopKPlan plan{1, 0, 0};
    if (rows <= 0 || len <= kTopKSingleCtaMax)
    {
        return plan;
    }
    size_t const l = static_cast<size_t>(levels > 1 ? levels : 1);
    plan.ctasPerRow = (len + kTopKChunk - 1) / kTopKChunk;
    plan.stateBytes = alignTopKScratch(static_cast<size_t>(rows) * topKRowStateBytes(levels));
    plan.scratchBytes
        = plan.stateBytes
        + l * static_cast<size_t>(rows) * static_cast<size_t>(plan.ctasPerRow) * kRadixBins * sizeof(uint32_t);
    return plan;
}

//! Scratch launchTopK needs for `rows` rows of `len` entries and `levels` levels: none up to kTopKSingleCtaMax
//! entries, then about rows * levels * (4 KiB + len / 2) bytes. Non-decreasing in every argument (a workspace sized
//! for the largest shape fits every smaller one).
inline size_t topKScratchBytes(int32_t rows, int32_t len, int32_t levels = 1)
{
    return topKPlan(rows, len, levels).scratchBytes;
}

//! CTAs per row of the mass count (always the multi-CTA form; at least one).
inline int32_t massCountCtas(int32_t len)
{
    return len <= kTopKChunk ? 1 : (len + kTopKChunk - 1) / kTopKChunk;
}

//! Scratch launchMassCount needs: a MassRowState per row (about 12 KiB). Non-decreasing in both arguments.
inline size_t massCountScratchBytes(int32_t rows, int32_t /*len*/)
{
    return rows <= 0 ? 0 : alignTopKScratch(static_cast<size_t>(rows) * sizeof(MassRowState));
}

} // namespace criticalkv
