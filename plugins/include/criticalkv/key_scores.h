// Key-scored methods: a base method whose per-token score of a KV head reads that head's keys only (no query, no
// value, no window attention), through a summary of the head's keys (its anchor). One struct per method
// (methods/<name>.h, listed in methods/registry.h) says what the score is; this header, the kernel template
// kernels/key_scores.cuh and the host driver (host/select_host.cpp) are the one pass every such method runs:
//
//   1. every valid key j (positions [validStart, n), the window included) gets a factor f_j = Method::keyFactor(k_j);
//   2. the anchor's entry c = sum over the valid keys, in position order, of Method::anchorTerm(k_j[c], f_j), then
//      Method::finishAnchor(anchor, d_h, count) on the whole vector;
//   3. every older valid position i in [validStart, m) gets score_i = Method::score(k_i, f_i, anchor, d_h).
//
// The scores [B, H_kv, n] (0 on left padding; [m, n) unspecified) then go where kvzip's external scores go: copied to
// every query head of the group as its raw attention, unpooled, and ranked by the per-head flow (the base's traits).
// The kernel computes every entry in that very order with rounded products (multiplyRounded), so its scores are the
// host driver's bit for bit.
//
// A method struct provides (all __host__ __device__, fp32):
//   static constexpr BaseMethod kBase;
//   template <typename Key> static float keyFactor(Key const& key, int32_t d);      // key(c): entry c of the key
//   static float anchorTerm(float entry, float factor);
//   static void finishAnchor(float* anchor, int32_t d, int32_t count);
//   template <typename Key> static float score(Key const& key, float factor, float const* anchor, int32_t d);
#pragma once

#include "criticalkv/group_scores.h" // multiplyRounded
#include "criticalkv/select_flow.h"  // CKV_FLOW_TEMPLATE

namespace criticalkv
{

//! Largest head dimension of a key-scored method's anchor (the kernels' kMaxHeadDim).
constexpr int32_t kMaxAnchorDim = 256;

//! A list of method structs (methods/registry.h).
template <typename... Methods>
struct MethodList
{
};

//! Whether `base` is one of the list's methods.
template <typename... Methods>
CKV_HD bool listed(MethodList<Methods...>, BaseMethod base)
{
    return (false || ... || (base == Methods::kBase));
}

//! Call f(Method{}) for the list's method whose kBase is `base` (host only: the launchers and the host driver pick
//! their template instance with it). Returns false when none is.
template <typename F, typename... Methods>
inline bool dispatchMethod(MethodList<Methods...>, BaseMethod base, F&& f)
{
    bool found = false;
    ((!found && base == Methods::kBase ? (f(Methods{}), found = true) : false), ...);
    return found;
}

//! Squared l2 norm of a key, with rounded products (the pass's shared helper).
CKV_FLOW_TEMPLATE
template <typename Key>
CKV_HD float squaredNorm(Key const& key, int32_t d)
{
    float sum = 0.0F;
    for (int32_t c = 0; c < d; ++c)
    {
        float const x = key(c);
        sum += multiplyRounded(x, x);
    }
    return sum;
}

//! One KV head's pass, sequentially (the host driver; the kernel runs the same steps in parallel). keys(j, c): entry
//! c of key j; out: [n].
template <typename Method, typename Keys>
inline void keyScoresOfHead(Keys const& keys, int32_t n, int32_t d, int32_t validStart, int32_t m, float* out)
{
    float anchor[kMaxAnchorDim] = {};
    for (int32_t j = 0; j < n; ++j)
    {
        auto const key = [&keys, j](int32_t c) { return keys(j, c); };
        out[j] = j < validStart ? 0.0F : Method::keyFactor(key, d);
    }
    for (int32_t j = validStart; j < n; ++j)
    {
        for (int32_t c = 0; c < d; ++c)
        {
            anchor[c] += Method::anchorTerm(keys(j, c), out[j]);
        }
    }
    Method::finishAnchor(anchor, d, n - validStart);
    for (int32_t i = validStart; i < m; ++i)
    {
        auto const key = [&keys, i](int32_t c) { return keys(i, c); };
        out[i] = Method::score(key, out[i], anchor, d);
    }
}

} // namespace criticalkv
