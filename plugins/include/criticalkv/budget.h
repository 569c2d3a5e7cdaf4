// Budget arithmetic shared by the CUDA kernels and the host C++ version; mirrors criticalkv/selection/budget.py.
//
// The Python rules round through `round(x, 9)` before ceil/floor so that float noise (0.3 * 10 =
// 3.0000000000000004) does not move a count. CPython's round(x, 9) is the double nearest to the correctly
// rounded 9-decimal value of x (round half to even). For 0 <= x < 2^22 that value lies above the integer
// k = floor(x) exactly when frac(x) > 5e-10 and reaches k + 1 exactly when frac(x) > 0.9999999995, so
// ceil(round(x, 9)) and floor(round(x, 9)) need only two comparisons of the exact fraction x - k with the
// smallest doubles above those decimals. tests/plugins/test_plugin_budget.py checks this against Python.
#pragma once

#include "criticalkv/common.h"

#include <cmath>

namespace criticalkv
{

//! Smallest double above 5e-10: frac >= this <=> round(frac, 9) > 0.
constexpr double kRound9Up = 0x1.12e0be826d695p-31;
//! Smallest double above 0.9999999995: frac >= this <=> round(frac, 9) == 1.
constexpr double kRound9Down = 0x1.fffffffbb47d1p-1;
//! The round-9 helpers are exact below this bound (r, budgets and counts are far smaller).
constexpr double kRound9Limit = 4194304.0; // 2^22

//! a * b rounded once (no fused multiply-add on the device, where nvcc would otherwise contract a*b - k).
CKV_HD double mulRoundNearest(double a, double b)
{
#if defined(__CUDA_ARCH__)
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}

//! ceil(round(x, 9)) for 0 <= x < 2^22.
CKV_HD int64_t ceilRound9(double x)
{
    double const k = floor(x);
    double const frac = x - k;
    return static_cast<int64_t>(k) + (frac >= kRound9Up ? 1 : 0);
}

//! floor(round(x, 9)) for 0 <= x < 2^22.
CKV_HD int64_t floorRound9(double x)
{
    double const k = floor(x);
    double const frac = x - k;
    return static_cast<int64_t>(k) + (frac >= kRound9Down ? 1 : 0);
}

//! Tokens stage 1 keeps by attention alone out of a head's r: min(r, ceil(alpha * r)) (budget.stage1_count).
CKV_HD int64_t stage1Count(double alpha, int64_t r)
{
    if (r <= 0)
    {
        return 0;
    }
    int64_t const first = ceilRound9(mulRoundNearest(alpha, static_cast<double>(r)));
    return first < r ? first : r;
}

//! Tokens every head keeps by its own scores under shared allocation (budget.head_floor).
CKV_HD int64_t headFloor(double adaFloor, int64_t r)
{
    if (adaFloor <= 0.0 || r <= 0)
    {
        return 0;
    }
    int64_t floor = floorRound9(mulRoundNearest(adaFloor, static_cast<double>(r)));
    floor = floor > 1 ? floor : 1;
    return floor < r ? floor : r;
}

} // namespace criticalkv
