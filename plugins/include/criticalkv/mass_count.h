// The cumulative-mass count (defensivekv's stage 1: criticalkv/methods/defensivekv.py stage1_count), shared by the
// kernels and the host driver: how many candidates, taken best first, keep the cumulative sum of their scores below a
// limit, found pass by pass over radix_select.h's digits with exact fixed-point sums (the kernels' launchMassCount,
// topk_block.cuh, and the host driver's radixMassCount).
#pragma once

#include "criticalkv/radix_select.h"
#include "criticalkv/select_flow.h"

#include <cmath>

namespace criticalkv
{

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

} // namespace criticalkv
