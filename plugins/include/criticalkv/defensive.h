// defensivekv (criticalkv/methods/defensivekv.py), shared by the kernels and the host driver: the per-row pool and
// rescale of the window attention, the defensive group score, stage 1 by cumulative attention mass, and the selection
// flow (stage-1 tokens ranked first, then adakv's shared allocation, shared_allocation.h).
//
// For KV head g, query heads h in g, window queries j and older tokens i (m of them, valid from validStart):
//   P[h, j, i]   = (sum of A[h, j, t] over t in [i - k/2, i + k/2] clipped to [0, m)) / k, 0 for padding
//   R[h, j, i]   = P / total[h, j] * mass[h, j]    (total: sum_i P; mass: sum_i A; as avg_pool_rows)
//   worst[g, i]  = max over h, j of R;  prior = mean over the valid i of worst
//   defensive[i] = max(worst, prior) * Nbar[i] / sum_i Nbar   (Nbar: the group's mean projected-value norm)
//   stage1[i]    = Abar[i] / sum_i Abar                      (Abar: the group's mean of the window-mean attention)
// Stage 1 keeps per head the most massive tokens while the cumulative mass (sorted descending, summed exactly as int64
// in units of 2^-48: fixedMass, fixedLimit, as the reference's stage1_count) stays below stage1_mass - the layer's
// window mass, at most r; those rank STAGE1_OFFSET above every other in the shared allocation. Every float operation is the reference's, in its order
// (sums over tokens excepted: accumulated in double here, in a vectorised float cascade by torch).
#pragma once

#include "criticalkv/group_scores.h"
#include "criticalkv/radix_select.h"
#include "criticalkv/shared_allocation.h"

#include <cmath>

namespace criticalkv
{

//! Offset that ranks stage-1 tokens above every other (defensive scores lie in [0, 1]).
constexpr float kStage1Offset = 2.0F;
//! torch.finfo(torch.float32).tiny: the reference's clamp of every normalising sum.
constexpr float kTinyFloat = 1.17549435e-38F;

//! Older tokens [lo, hi] that the average pool of token i sums (zero padding outside [0, m)).
struct PoolSpan
{
    int32_t lo;
    int32_t hi;
};

CKV_HD PoolSpan poolSpan(int32_t kernel, int32_t m, int32_t i)
{
    int32_t const half = kernel / 2;
    return PoolSpan{i - half > 0 ? i - half : 0, i + half < m - 1 ? i + half : m - 1};
}

//! The pooled value from the sum over the span: avg_pool1d with count_include_pad divides by the kernel.
CKV_HD float averagePool(float spanSum, int32_t kernel)
{
    return spanSum / static_cast<float>(kernel);
}

//! P[i] of one attention row over the m older tokens (row[t] is 0 on padding), 0 for a padding token.
CKV_HD float averagePooledAt(float const* row, int32_t kernel, int32_t m, int32_t validStart, int32_t i)
{
    if (i < validStart)
    {
        return 0.0F;
    }
    PoolSpan const span = poolSpan(kernel, m, i);
    float sum = 0.0F;
    for (int32_t t = span.lo; t <= span.hi; ++t)
    {
        sum += row[t];
    }
    return averagePool(sum, kernel);
}

//! R = P / total * mass: the pooled row rescaled to keep its own mass (unchanged when the row has none).
CKV_HD float rescaledPooled(float pooled, float mass, float total)
{
    if (!(total > 0.0F))
    {
        return pooled;
    }
    return multiplyRounded(pooled / (total > kTinyFloat ? total : kTinyFloat), mass);
}

//! The per-token parts of one KV group before its sums over tokens. headWorst, raw, norms: [H, m] rows of one
//! sequence (headWorst[h, i] = max over j of R[h, j, i]).
struct DefensiveParts
{
    float worst;     //!< max over the group's heads (and window queries) of R
    float norm;      //!< mean over the group's heads of the projected-value norm, 0 on padding
    float attention; //!< mean over the group's heads of the window-mean attention, 0 on padding
};

CKV_HD DefensiveParts defensivePartsAt(float const* headWorst, float const* raw, float const* norms, int32_t firstHead,
    int32_t group, int32_t m, int32_t validStart, int32_t i)
{
    DefensiveParts parts{-INFINITY, 0.0F, 0.0F};
    float sumNorm = 0.0F;
    float sumAttention = 0.0F;
    for (int32_t h = firstHead; h < firstHead + group; ++h)
    {
        int64_t const at = static_cast<int64_t>(h) * m + i;
        parts.worst = headWorst[at] > parts.worst ? headWorst[at] : parts.worst;
        sumNorm += norms[at];
        sumAttention += raw[at];
    }
    bool const valid = i >= validStart;
    parts.norm = valid ? sumNorm / static_cast<float>(group) : 0.0F;
    parts.attention = valid ? sumAttention / static_cast<float>(group) : 0.0F;
    return parts;
}

//! The group's sums over its valid older tokens (accumulated in double by the callers) and its window mass.
struct DefensiveTotals
{
    float prior;        //!< mean over the valid tokens of worst (the clamp)
    float normSum;      //!< sum of the parts' norm
    float attentionSum; //!< sum of the parts' attention
    float windowMass;   //!< 1 - mean over the group's rows (h, j) of their mass over the older tokens
};

CKV_HD DefensiveTotals defensiveTotals(double worstSum, double normSum, double attentionSum, double rowMassSum,
    int32_t validCount, int32_t rows)
{
    DefensiveTotals t{};
    t.prior = static_cast<float>(worstSum) / static_cast<float>(validCount > 1 ? validCount : 1);
    t.normSum = static_cast<float>(normSum);
    t.attentionSum = static_cast<float>(attentionSum);
    t.windowMass = 1.0F - static_cast<float>(rowMassSum) / static_cast<float>(rows);
    return t;
}

//! The defensive score of a token: max(worst, prior) times its share of the group's norms.
CKV_HD float defensiveScore(DefensiveParts const& p, DefensiveTotals const& t)
{
    float const defended = p.worst > t.prior ? p.worst : t.prior;
    return multiplyRounded(defended, p.norm / (t.normSum > kTinyFloat ? t.normSum : kTinyFloat));
}

//! The stage-1 mass of a token: its share of the group's attention over the older tokens.
CKV_HD float stage1MassOf(DefensiveParts const& p, DefensiveTotals const& t)
{
    return p.attention / (t.attentionSum > kTinyFloat ? t.attentionSum : kTinyFloat);
}

//! Stage 1's threshold: stage1_mass minus the layer's window mass (the mean of its groups' window masses), fp32.
//! totals: [heads] of one sequence.
CKV_HD float stage1Limit(SelectConfig const& config, DefensiveTotals const* totals, int32_t heads)
{
    float sum = 0.0F;
    for (int32_t g = 0; g < heads; ++g)
    {
        sum += totals[g].windowMass;
    }
    return config.stage1Mass - sum / static_cast<float>(heads);
}

//! The ranking of the shared allocation: stage-1 tokens STAGE1_OFFSET above the others.
CKV_HD float stage1Ranking(float defensive, bool first)
{
    return first ? defensive + kStage1Offset : defensive;
}

//! Stage 1 sums masses in units of 2^-kMassFixedBits (criticalkv/methods/defensivekv.py MASS_FIXED_BITS): integer sums
//! are exact in any order (a block's atomics, a host loop, torch's and ONNX Runtime's CumSum alike).
constexpr int kMassFixedBits = 48;
constexpr float kMassScale = 281474976710656.0F; // 2^48

//! floor(mass * 2^48): exact (a power-of-two scaling, then a floor of a float). mass in [0, 2^15).
CKV_HD int64_t fixedMass(float mass)
{
    return static_cast<int64_t>(floorf(mass * kMassScale));
}

//! ceil(limit * 2^48): an integer sum C is below limit * 2^48 exactly when C < fixedLimit(limit). |limit| < 2^15.
CKV_HD int64_t fixedLimit(float limit)
{
    return static_cast<int64_t>(ceilf(limit * kMassScale));
}

//! A 256-bin histogram of candidates by radix digit with the sum of their fixedMass per bin.
struct MassHistogram
{
    uint32_t const* counts;
    unsigned long long const* sums;
};

//! Where a mass count stands (radixMassCount, pass by pass): the digits fixed so far, the fixed-point sum and the
//! number of the candidates above the prefix, and the count once done.
struct MassSearch
{
    uint32_t prefix;
    uint32_t prefixMask;
    int64_t above;      //!< int64 sum of fixedMass of the candidates above the prefix
    int64_t aboveCount; //!< how many they are
    int32_t pass;       //!< next pass
    int32_t done;       //!< 1: count is the answer
    int64_t count;
};

CKV_HD MassSearch massBegin()
{
    return MassSearch{0u, 0u, 0, 0, 0, 0, 0};
}

//! The digit of one pass's histogram where the cumulative sum (best first, starting from `above`) reaches `bound`:
//! the highest digit d with above + sum of sums[d..255] >= bound (-1 when none; such a digit has candidates, since
//! the sums are non-negative), and the sum and count of the candidates in the digits above it.
struct MassDigit
{
    int32_t digit;
    int64_t aboveSum;
    int64_t aboveCount;
};

CKV_HD MassDigit chooseMassDigit(MassHistogram const& h, int64_t above, int64_t bound)
{
    MassDigit choice{-1, 0, 0};
    for (int d = kRadixBins - 1; d >= 0; --d)
    {
        if (h.counts[d] == 0)
        {
            continue;
        }
        if (above + choice.aboveSum + static_cast<int64_t>(h.sums[d]) < bound)
        {
            choice.aboveSum += static_cast<int64_t>(h.sums[d]);
            choice.aboveCount += h.counts[d];
            continue;
        }
        choice.digit = d;
        break;
    }
    return choice;
}

//! Apply the histogram of pass s.pass (its digit choice `c` from chooseMassDigit, and the count at that digit).
CKV_HD void massAdvance(MassSearch& s, MassDigit const& c, int64_t countAtDigit, int64_t bound)
{
    s.above += c.aboveSum;
    s.aboveCount += c.aboveCount;
    if (c.digit < 0)
    {
        s.done = 1; // every candidate of this prefix stays below the limit
        s.count = s.aboveCount;
        return;
    }
    s.prefix |= static_cast<uint32_t>(c.digit) << (32 - kRadixBits * (s.pass + 1));
    s.prefixMask = radixPrefixMask(s.pass);
    s.pass += 1;
    if (s.pass < kRadixPasses)
    {
        return;
    }
    // The candidates equal to the crossing one: add them one by one.
    int64_t const value = fixedMass(orderedValue(s.prefix));
    int64_t cumulative = s.above;
    s.done = 1;
    s.count = s.aboveCount + countAtDigit;
    for (int64_t j = 1; j <= countAtDigit; ++j)
    {
        cumulative += value;
        if (!(cumulative < bound))
        {
            s.count = s.aboveCount + j - 1;
            return;
        }
        if (value == 0)
        {
            return; // the sum no longer grows: all of them
        }
    }
}

//! How many candidates, taken best first, keep the cumulative sum of their (non-negative) scores below `limit`:
//! #{k >= 1 : cum_k < fixedLimit(limit)}, cum_k the int64 sum of fixedMass of the k best. The executor supplies
//!   MassHistogram massHistogram(pass, prefix, prefixMask)   counts and fixedMass sums of the candidates matching prefix
// (radix_select.h's passes): the digit holding the first candidate whose cumulative sum reaches the limit is fixed
// pass by pass; among the candidates equal to it, the count is found by adding them one by one. fixedMass is monotone,
// so the k best by score are the k largest fixed masses, and the integer sums make the bins' order irrelevant.
CKV_FLOW_TEMPLATE
template <typename Exec>
CKV_HD int64_t radixMassCount(Exec& exec, float limit)
{
    int64_t const bound = fixedLimit(limit);
    MassSearch s = massBegin();
    while (!s.done)
    {
        MassHistogram const h = exec.massHistogram(s.pass, s.prefix, s.prefixMask);
        MassDigit const c = chooseMassDigit(h, s.above, bound);
        massAdvance(s, c, c.digit >= 0 ? static_cast<int64_t>(h.counts[c.digit]) : 0, bound);
    }
    return s.count;
}

//! Stage 1 of one KV head keeps its mass count, at most r (the head's older tokens of the budget).
CKV_HD int64_t stage1Keep(int64_t massCount, int64_t r)
{
    return massCount < r ? massCount : r;
}

//! defensivekv's ranking of one sequence's older tokens: stage 1 by mass per head, then the defensive score with the
//! stage-1 tokens first (defensivekv.py: priority; layer-defensivekv's model-wide ranking is this, layer by layer).
//! defensive, stage1, ranking, flags: [heads, m] (flags cleared by the caller, cleared again on return); r: older tokens
//! per head (SequenceInfo::r); limit: stage1Limit. The executor is the flows' top-k primitive (select_flow.h) and also
//! supplies
//!   int64_t massCount(scores, flags, len, period, firstValid, limit)   radixMassCount over the candidates
//!   void rankStage1(defensive, flags, ranking, len)   ranking = stage1Ranking(defensive, flags != 0), flags cleared
CKV_FLOW_TEMPLATE
template <typename Exec>
CKV_HD void rankDefensive(Exec& exec, float const* defensive, float const* stage1, float* ranking, uint8_t* flags,
    int32_t heads, int32_t m, int32_t firstValid, int64_t r, float limit)
{
    for (int32_t g = 0; g < heads; ++g)
    {
        int64_t const offset = static_cast<int64_t>(g) * m;
        int64_t const count = stage1Keep(exec.massCount(stage1 + offset, flags + offset, m, m, firstValid, limit), r);
        exec(stage1 + offset, flags + offset, m, m, firstValid, count, kChosenByAttention);
    }
    exec.rankStage1(defensive, flags, ranking, static_cast<int64_t>(heads) * m);
}

//! Mark one sequence's chosen older tokens (defensivekv): its ranking (rankDefensive), then the shared allocation on
//! it. ranking is scratch; the rest as rankDefensive's.
CKV_FLOW_TEMPLATE
template <typename Exec>
CKV_HD void selectDefensive(Exec& exec, SelectConfig const& config, float const* defensive, float const* stage1,
    float* ranking, uint8_t* flags, int32_t heads, int32_t m, int32_t firstValid, int64_t r, float limit)
{
    rankDefensive(exec, defensive, stage1, ranking, flags, heads, m, firstValid, r, limit);
    selectShared(exec, config, ranking, flags, heads, m, firstValid, r);
}

} // namespace criticalkv
