// Budget arithmetic shared by the CUDA kernels and the host driver, in integers (criticalkv/methods/budget.py).
//
// alpha and ada_floor are exact decimals with at most 6 decimals (KVPolicy's rule), carried as integer
// millionths (policy_config.h: decimalMicros), so ceil(alpha * r) and floor(ada_floor * r) are exact integer
// divisions in both languages: no float rounding to reproduce. PyramidKV's per-layer budgets are computed once
// by Python at export and arrive as the `layer_budgets` field.
#pragma once

#include "criticalkv/common.h"

namespace criticalkv
{

//! Tokens stage 1 keeps by attention alone out of a head's r: min(r, ceil(alpha * r)), alpha = alphaMicros / 10^6.
CKV_HD int64_t stage1Count(int64_t alphaMicros, int64_t r)
{
    if (r <= 0)
    {
        return 0;
    }
    int64_t const first = (alphaMicros * r + kDecimalScale - 1) / kDecimalScale;
    return first < r ? first : r;
}

//! Tokens every head keeps by its own scores under shared allocation: min(r, max(1, floor(ada_floor * r))), or 0
//! when ada_floor is 0; ada_floor = floorMicros / 10^6.
CKV_HD int64_t headFloor(int64_t floorMicros, int64_t r)
{
    if (floorMicros <= 0 || r <= 0)
    {
        return 0;
    }
    int64_t floor = floorMicros * r / kDecimalScale;
    floor = floor > 1 ? floor : 1;
    return floor < r ? floor : r;
}

} // namespace criticalkv
