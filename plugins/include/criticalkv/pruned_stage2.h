// Exact pruning of CriticalKV's stage 2 (criticalkv/methods/pruned.py, docs/operator.md step 6a): an upper bound of
// the computed ||v W_O^h||_1 from the d_h x d_h Gram matrix G_h = W_O^h W_O^h^T, and the stop rule that lets stage 2
// compute the exact L1 norms of a few candidates only while keeping exactly the unpruned entries.
#pragma once

#include "criticalkv/common.h"
#include "criticalkv/group_scores.h" // multiplyRounded
#include "criticalkv/select_flow.h"

#include <cmath>

namespace criticalkv
{

constexpr float kUnitRoundoff = 5.9604644775390625e-8F; //!< 2^-24
constexpr float kSubnormalSlack = 1.1754943508222875e-38F; //!< 2^-126: a flushed subnormal product
constexpr int32_t kCandidateFactor = 2; //!< first candidate count = 2 k; it doubles until the stop rule holds

//! gamma_k = k u / (1 - k u): bound of the relative error of any k-term float32 sum or dot product.
CKV_HD float roundingGamma(float k)
{
    float const ku = multiplyRounded(k, kUnitRoundoff);
    return ku / (1.0F - ku);
}

//! rho: fl(C_i) <= fl(U_i) (1 + rho) for every token (pruned.stop_margin).
CKV_HD float stopMargin(int32_t hidden, int32_t group)
{
    return 2.0F
        * (roundingGamma(static_cast<float>(hidden)) + roundingGamma(static_cast<float>(group + 2))
            + multiplyRounded(2.0F, roundingGamma(static_cast<float>(group + 10))));
}

// Every product below that feeds a sum is rounded on its own (multiplyRounded): nvcc would otherwise fuse it into an
// FMA and the device's bounds and exact norms would differ from the host driver's (-ffp-contract=off) in the last bit.
// Weight(c, k) returns W_O^h[k, c] as float (c < hidden, k < d_h); Value(k) the token's v[k] as float.

//! The computed ||v W_O^h||_1, summed in this order: dot_c = sum_k v[k] W_O^h[k, c] (k ascending), then
//! sum_c |dot_c| (c ascending). The host driver's exact scores and the pipeline's pruned stage 2 both call it.
CKV_FLOW_TEMPLATE
template <typename Value, typename Weight>
CKV_HD float projectedL1Norm(Value const& value, Weight const& weight, int32_t headDim, int32_t hidden)
{
    float norm = 0.0F;
    for (int32_t c = 0; c < hidden; ++c)
    {
        float dot = 0.0F;
        for (int32_t k = 0; k < headDim; ++k)
        {
            dot += multiplyRounded(value(k), weight(c, k));
        }
        norm += std::fabs(dot);
    }
    return norm;
}

//! G_h[k, l] = sum_c W_O^h[k, c] W_O^h[l, c] (c ascending).
CKV_FLOW_TEMPLATE
template <typename Weight>
CKV_HD float gramEntry(Weight const& weight, int32_t k, int32_t l, int32_t hidden)
{
    float acc = 0.0F;
    for (int32_t c = 0; c < hidden; ++c)
    {
        acc += multiplyRounded(weight(c, k), weight(c, l));
    }
    return acc;
}

//! s_h[k] = sum_c |W_O^h[k, c]| (c ascending).
CKV_FLOW_TEMPLATE
template <typename Weight>
CKV_HD float rowL1Entry(Weight const& weight, int32_t k, int32_t hidden)
{
    float acc = 0.0F;
    for (int32_t c = 0; c < hidden; ++c)
    {
        acc += std::fabs(weight(c, k));
    }
    return acc;
}

//! sum_k |W_O^h[k, c]| (k ascending) of column c; c_h is the maximum over the columns (order-free).
CKV_FLOW_TEMPLATE
template <typename Weight>
CKV_HD float columnL1(Weight const& weight, int32_t c, int32_t headDim)
{
    float acc = 0.0F;
    for (int32_t k = 0; k < headDim; ++k)
    {
        acc += std::fabs(weight(c, k));
    }
    return acc;
}

//! Upper bound B of the computed ||v W_O^h||_1 (pruned.BoundTerms.upper). gram: [d_h, d_h] G_h; rowL1: [d_h]
//! s_h[r] = sum_j |W_O^h[r, j]|; colL1 = max_j sum_r |W_O^h[r, j]|.
CKV_FLOW_TEMPLATE
template <typename Value>
CKV_HD float l1UpperBoundOf(Value const& value, float const* gram, float const* rowL1, float colL1, int32_t headDim,
    int32_t hidden)
{
    float quad = 0.0F;
    float a = 0.0F;
    float maxAbs = 0.0F;
    for (int32_t l = 0; l < headDim; ++l)
    {
        float u = 0.0F;
        for (int32_t k = 0; k < headDim; ++k)
        {
            u += multiplyRounded(value(k), gram[k * headDim + l]);
        }
        float const vl = value(l);
        quad += multiplyRounded(u, vl);
        float const absV = std::fabs(vl);
        a += multiplyRounded(absV, rowL1[l]);
        maxAbs = absV > maxAbs ? absV : maxAbs;
    }
    float const d = static_cast<float>(hidden);
    float const dh = static_cast<float>(headDim);
    float const b = a * maxAbs * colL1;
    float const l2 = std::sqrt((quad > 0.0F ? quad : 0.0F)
        + multiplyRounded(roundingGamma(d + multiplyRounded(2.0F, dh) + 2.0F), b));
    return multiplyRounded(std::sqrt(d), l2) + multiplyRounded(roundingGamma(dh), a)
        + multiplyRounded(multiplyRounded(kSubnormalSlack, d), static_cast<float>(headDim + 2));
}

//! l1UpperBoundOf for v: [d_h] float.
CKV_HD float l1UpperBound(float const* v, float const* gram, float const* rowL1, float colL1, int32_t headDim,
    int32_t hidden)
{
    auto value = [v](int32_t k) { return v[k]; };
    return l1UpperBoundOf(value, gram, rowL1, colL1, headDim, hidden);
}

//! Relative residual of s G split into `pieces` 16-bit pieces (kernels/mma_tiles.cuh: gramQuadBlock): each piece holds
//! the rounding (to nearest) of what the previous ones left, 8 significant bits for bf16, 11 for fp16, so after p pieces
//! |s G - sum| <= 2^-(bits p) |s G| (+ fp16's subnormal spacing, an absolute term the bound adds apart); twice that.
CKV_HD float pieceResidual(int32_t pieces, bool half)
{
    float residual = 2.0F;
    float const step = half ? 4.8828125e-4F : 3.90625e-3F; // 2^-11, 2^-8
    for (int32_t p = 0; p < pieces; ++p)
    {
        residual *= step;
    }
    return residual;
}

//! Upper bound B of the L1 norm the tensor-core kernels compute (kernels/mma_tiles.cuh: valueNormsMmaBlock) from the
//! tensor-core quadratic form quad = fl(v^T G_h v) (gramQuadBlock), weighted = |v| . s_h, maxAbs = max |v_k|,
//! colL1 = c_h (docs/operator.md step 6a, "GPU"):
//!   B = sqrt(d) sqrt(max(quad, 0) + kappa weighted maxAbs c_h + tau (d_h maxAbs)^2) (1 + 2^-20)
//!       + gamma_{4 d_h} weighted + 2^-126 d (d_h + 2)
//! kappa = 2 gamma_{d + 3 d_h + 64} + 2 residual covers the Gram entries' fp32 sums over d, the pieces' residual, each
//! mma step's rounding (16 exact products summed with at most one unit in the last place of the largest addend lost
//! per addend, truncating: 34 u of their magnitudes) and the fp32 sums of the steps and of the row dot; tau (per
//! entry, absolute: fp16 pieces' subnormal spacing 2^-25 / s, 0 for bf16) the pieces' underflow. The computed L1
//! norm's own error: each k16 mma step of the dot products over d_h loses at most 34 u of its addends' magnitudes, at
//! most 2.2 d_h u of sum_k |v_k W_kc| in all (gamma_{4 d_h} weighted over the d columns), and its fp32 sum of the d
//! |x_c| at most gamma_d: fl(N) <= (1 + gamma_d) B, the same form as l1UpperBoundOf's, so the stop margin
//! (stopMargin) is unchanged. The (1 + 2^-20) absorbs this formula's own roundings.
CKV_HD float l1UpperBoundTensorCore(float quad, float weighted, float maxAbs, float colL1, float residual, float tau,
    int32_t headDim, int32_t hidden)
{
    float const d = static_cast<float>(hidden);
    float const dh = static_cast<float>(headDim);
    float const kappa = 2.0F * roundingGamma(d + 3.0F * dh + 64.0F) + 2.0F * residual;
    float const spread = dh * maxAbs;
    float const extra = kappa * weighted * maxAbs * colL1 + tau * spread * spread;
    float const l2 = std::sqrt((quad > 0.0F ? quad : 0.0F) + extra);
    return std::sqrt(d) * l2 * (1.0F + 9.5367431640625e-7F) + roundingGamma(4.0F * dh) * weighted
        + kSubnormalSlack * d * (dh + 2.0F);
}

//! Where CriticalKV's pruned stage 2 stands for one KV head of one sequence (kernels/pruned.cu, kernels/pruned_flow.cuh).
struct PrunedHeadState
{
    int64_t k;        //!< tokens stage 2 keeps
    int64_t eligible; //!< tokens stage 2 chooses from
    int64_t done;     //!< candidates whose exact score is known or being computed
    int32_t active;   //!< 1: the head still has candidates to rank (0: settled by stage 1 alone, or uncompressed)
    int32_t settled;  //!< 1: the stop rule held (or every eligible token is a candidate): no more rounds
};
static_assert(sizeof(PrunedHeadState) == 32, "the workspace layout's tests count 32 bytes per head");

//! What the k-th exact score must exceed for the stop rule: following (1 + margin).
CKV_HD float stopThreshold(float following, float margin)
{
    return following * (1.0F + margin);
}

//! The stop rule: no token whose bound is at most `following` can reach the k-th exact score `kth` (not even a tie).
CKV_HD bool stage2Settled(float following, float kth, float margin)
{
    return following == -INFINITY || stopThreshold(following, margin) < kth;
}

//! stage2Settled with the k-th exact score known through a count only: `clearing` candidates have an exact score that
//! is not <= stopThreshold (above it, or NaN). The k-th exact score (NaN ranks first in radix order, so with NaNs
//! among the k best it is the smallest non-NaN of them, +inf when all are NaN) exceeds a finite threshold exactly when
//! k candidates clear it, and nothing exceeds +inf. The GPU's rounds (kernels/pruned_flow.cuh) count, over the whole
//! grid, instead of selecting the k best.
CKV_HD bool stage2SettledByCount(float following, int64_t clearing, int64_t k, float margin)
{
    return following == -INFINITY || (stopThreshold(following, margin) < INFINITY && clearing >= k);
}

//! Stage 2 of one KV head with pruned exact scores, written once for the host driver (select_host.cpp) and a thread
//! block (kernels/pruned_row.cuh: BlockPrunedRow; every thread runs it with the same arguments). Requires
//! 0 < k < eligible. The executor supplies, over the eligible tokens of the row (stage 1 done):
//!   void addCandidates(count)  the `count` best non-candidates by bound (ties: lower index) become candidates,
//!                              with their exact group score C
//!   float nextBound()          the best bound among the non-candidates (-inf when none is left)
//!   float kthExact(k)          the k-th largest exact score among the candidates
//!   void keepBest(k)           mark the k best candidates by exact score (ties: lower index) kChosenByCritical
//! Returns how many tokens got their exact score. Candidates are a prefix of the bound order, so the kept set is
//! the unpruned one whenever the stop rule held (docs/operator.md step 6a).
CKV_FLOW_TEMPLATE
template <typename Exec>
CKV_HD int64_t prunedStage2(Exec& exec, int64_t k, int64_t eligible, float margin)
{
    int64_t c = kCandidateFactor * k < eligible ? kCandidateFactor * k : eligible;
    int64_t done = 0;
    while (true)
    {
        exec.addCandidates(c - done);
        done = c;
        if (c >= eligible)
        {
            break;
        }
        float const following = exec.nextBound();
        float const kth = exec.kthExact(k);
        if (stage2Settled(following, kth, margin))
        {
            break;
        }
        c = 2 * c < eligible ? 2 * c : eligible;
    }
    exec.keepBest(k);
    return done;
}

} // namespace criticalkv
