// The radix top-k select (radix.h's keys and digits) as one __host__ __device__ state machine, driven pass by pass
// by the batched top-k kernels (kernels/topk_device.cuh: a thread block per row, or several CTAs per row with one
// launch per pass), by the pruned stage-2 block executor and by the host driver. Every driver computes the same
// RadixSearch from the same histograms, so every driver keeps the same set.
//
// radixSelectTopK runs the whole search over an executor that supplies the data-parallel steps:
//   uint32_t const* histogram(pass, prefix, prefixMask)  256-bin histogram of the candidates whose key matches
//                                                       prefix under prefixMask, by their digit of `pass`
//   void markAll()                                      mark every candidate
//   void markBest(threshold, remaining, atThreshold)    mark the candidates with key > threshold and the first
//                                                       `remaining` (index order) of those with key == threshold
#pragma once

#include "criticalkv/radix.h"
#include "criticalkv/select_flow.h"

namespace criticalkv
{

//! A candidate of a top-k row: not yet chosen, and not left padding (e % period >= firstValid).
CKV_HD bool radixCandidate(uint8_t const* flags, int64_t e, int64_t period, int64_t firstValid)
{
    return flags[e] == 0 && (e % period) >= firstValid;
}

//! Where a radix search stands.
enum RadixOutcome : int32_t
{
    kRadixSearching = 0, //!< pass `pass` is next
    kRadixNothing = 1,   //!< k <= 0: mark nothing
    kRadixAll = 2,       //!< k >= the candidates: mark them all
    kRadixThreshold = 3, //!< mark key > prefix, and the first `remaining` with key == prefix (index order)
};

//! The state of one row's search. After kRadixThreshold: prefix is the threshold key T; when remaining ==
//! atThreshold every candidate with key >= T is kept (the search stops early once a digit's bin holds exactly the
//! remaining ones: T then has zero low bits, and key >= T is exactly "prefix above, or equal under prefixMask").
struct RadixSearch
{
    uint32_t prefix;
    uint32_t prefixMask;
    int64_t remaining;   //!< how many of the k are still to be taken among the candidates matching the prefix
    int64_t atThreshold; //!< candidates matching the prefix
    int32_t pass;        //!< next pass (kRadixSearching)
    int32_t outcome;     //!< RadixOutcome
};

CKV_HD RadixSearch radixBegin(int64_t k)
{
    return RadixSearch{0u, 0u, k, 0, 0, k <= 0 ? kRadixNothing : kRadixSearching};
}

//! Apply the histogram of pass s.pass, summarised as its total and the digit holding the `remaining`-th best
//! (chooseDigit on the host; a block-wide suffix sum in the kernels).
CKV_HD void radixAdvance(RadixSearch& s, int64_t total, DigitChoice const& choice)
{
    if (s.pass == 0 && s.remaining >= total)
    {
        s.outcome = kRadixAll;
        return;
    }
    s.prefix |= choice.digit << (32 - kRadixBits * (s.pass + 1));
    s.prefixMask = radixPrefixMask(s.pass);
    s.remaining -= choice.above;
    s.atThreshold = choice.atDigit;
    s.pass += 1;
    if (s.remaining == s.atThreshold || s.pass == kRadixPasses)
    {
        s.outcome = kRadixThreshold;
    }
}

//! The candidates of one digit histogram: its sum (only pass 0's is needed, for kRadixAll).
CKV_HD int64_t histogramTotal(uint32_t const* histogram)
{
    int64_t total = 0;
    for (int digit = 0; digit < kRadixBins; ++digit)
    {
        total += histogram[digit];
    }
    return total;
}

//! Mark the k best candidates (ties: lower index) through an executor (see the top of this file).
CKV_FLOW_TEMPLATE
template <typename Exec>
CKV_HD void radixSelectTopK(Exec& exec, int64_t k)
{
    RadixSearch s = radixBegin(k);
    while (s.outcome == kRadixSearching)
    {
        uint32_t const* histogram = exec.histogram(s.pass, s.prefix, s.prefixMask);
        radixAdvance(s, s.pass == 0 ? histogramTotal(histogram) : 0, chooseDigit(histogram, s.remaining));
    }
    if (s.outcome == kRadixAll)
    {
        exec.markAll();
    }
    else if (s.outcome == kRadixThreshold)
    {
        exec.markBest(s.prefix, s.remaining, s.atThreshold);
    }
}

} // namespace criticalkv
