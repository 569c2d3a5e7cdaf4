// The radix top-k select (radix.h's keys and digits) as one __host__ __device__ flow, run by the kernels' thread
// blocks and by the host driver. An executor supplies the data-parallel steps:
//   uint32_t const* histogram(pass, prefix, prefixMask)  256-bin histogram of the candidates whose key matches
//                                                       prefix under prefixMask, by their digit of `pass`
//   void markAll()                                      mark every candidate
//   void markBest(threshold, remaining, atThreshold)    mark the candidates with key > threshold and the first
//                                                       `remaining` (index order) of those with key == threshold
// The kernels' executor builds the histogram in shared memory with the whole block and every thread then runs
// this flow on it (same arguments, same decisions); the host's loops over the row.
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

//! Mark the k best candidates (ties: lower index): 4 passes of 8 bits find the key T of the k-th best.
CKV_FLOW_TEMPLATE
template <typename Exec>
CKV_HD void radixSelectTopK(Exec& exec, int64_t k)
{
    if (k <= 0)
    {
        return;
    }
    uint32_t prefix = 0u;
    uint32_t prefixMask = 0u;
    int64_t remaining = k;
    int64_t atThreshold = 0;
    for (int pass = 0; pass < kRadixPasses; ++pass)
    {
        uint32_t const* histogram = exec.histogram(pass, prefix, prefixMask);
        if (pass == 0)
        {
            int64_t total = 0;
            for (int digit = 0; digit < kRadixBins; ++digit)
            {
                total += histogram[digit];
            }
            if (k >= total)
            {
                exec.markAll();
                return;
            }
        }
        DigitChoice const choice = chooseDigit(histogram, remaining);
        prefix |= choice.digit << (32 - kRadixBits * (pass + 1));
        prefixMask = radixPrefixMask(pass);
        remaining -= choice.above;
        atThreshold = choice.atDigit;
    }
    // prefix is the key T of the k-th best candidate; `remaining` of the atThreshold candidates equal to T are kept.
    exec.markBest(prefix, remaining, atThreshold);
}

} // namespace criticalkv
