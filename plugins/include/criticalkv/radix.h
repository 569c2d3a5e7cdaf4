// Radix-select helpers shared by the CUDA kernels and the host C++ version.
//
// Top-k rule of the operator (criticalkv/methods/topk.py): the k highest scores among the candidates,
// equal scores going to the lower index. Scores become order-preserving uint32 keys; a radix select over
// 4 passes of 8 bits finds the key T of the k-th best candidate and how many of the k lie strictly above T;
// the rest are the candidates with key T in ascending index order.
#pragma once

#include "criticalkv/common.h"

#include <cstring>

namespace criticalkv
{

constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
constexpr int kRadixPasses = 32 / kRadixBits;

//! Order-preserving map of a float onto uint32: a < b <=> key(a) < key(b). -0 and +0 map to one key (they
//! compare equal in torch's sort, so the tie rule decides between them). Every NaN maps to one key above +inf:
//! torch's descending sort (criticalkv/methods/topk.py) puts NaN first, so a NaN score ranks best, NaNs
//! among themselves by index.
CKV_HD uint32_t orderedKey(float value)
{
    uint32_t bits;
#if defined(__CUDA_ARCH__)
    bits = __float_as_uint(value);
#else
    std::memcpy(&bits, &value, sizeof(bits));
#endif
    if ((bits & 0x7fffffffu) == 0u)
    {
        bits = 0u; // -0 -> +0
    }
    if ((bits & 0x7fffffffu) > 0x7f800000u)
    {
        return 0xffffffffu; // NaN (any sign or payload); +inf maps to 0xff800000
    }
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

//! The float of a key of orderedKey (a NaN for NaN's key; +0 for the zeros'): reductions over the device combine
//! floats as keys (atomicMax on uint32) and read the result back.
CKV_HD float orderedValue(uint32_t key)
{
    uint32_t const bits = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
#if defined(__CUDA_ARCH__)
    return __uint_as_float(bits);
#else
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
#endif
}

//! The 8-bit digit of key examined by radix pass `pass` (0 = most significant).
CKV_HD uint32_t radixDigit(uint32_t key, int pass)
{
    return (key >> (32 - kRadixBits * (pass + 1))) & static_cast<uint32_t>(kRadixBins - 1);
}

//! Mask of the bits fixed after passes 0..pass.
CKV_HD uint32_t radixPrefixMask(int pass)
{
    return pass >= kRadixPasses - 1 ? 0xffffffffu : ~(0xffffffffu >> (kRadixBits * (pass + 1)));
}

//! Result of one radix pass: the digit the k-th best candidate has, how many candidates (with the same
//! prefix) lie in higher digits, and how many share the chosen digit.
struct DigitChoice
{
    uint32_t digit;
    int64_t above;
    int64_t atDigit;
};

//! Pick the digit holding the `remaining`-th best candidate from a 256-bin histogram (1 <= remaining <= sum).
CKV_HD DigitChoice chooseDigit(uint32_t const* histogram, int64_t remaining)
{
    int64_t above = 0;
    for (int digit = kRadixBins - 1; digit >= 0; --digit)
    {
        int64_t const count = histogram[digit];
        if (above + count >= remaining)
        {
            return DigitChoice{static_cast<uint32_t>(digit), above, count};
        }
        above += count;
    }
    return DigitChoice{0u, above, 0};
}

//! The tie rule as an order: a ranks before b when its score is higher, or equal with a lower index.
CKV_HD bool ranksBefore(uint32_t keyA, int64_t indexA, uint32_t keyB, int64_t indexB)
{
    return keyA > keyB || (keyA == keyB && indexA < indexB);
}

} // namespace criticalkv
