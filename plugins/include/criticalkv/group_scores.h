// The per-token score of one KV head's group (criticalkv/selection/scores.py: layer_scores), shared by the
// group-score kernel (kernels/selection.cu: groupScoresKernel) and the host driver: from every query head's window
// attention Ā (raw), its squared window attention sum_j A_j^2 (squares, where the method asks for it) and its
// projected-value norms, the pooled attention S, CriticalKV's stage-2 score C and, for a group-scored method, the
// method's own score of older token i.
//
// Group-scored methods: a base method whose ranking is a sum over the group's query heads of a per-head term of the
// window quantities (HeadWindow). One struct per method (methods/<name>.h, listed in methods/registry.h:
// GroupScoredMethods) says what the term is; groupScoresAt<Method> below, the kernel template and the host driver are
// the pass every such method runs, and the shared allocation ranks by its score (shared_allocation.h). A method struct
// provides (all __host__ __device__, fp32):
//   static constexpr BaseMethod kBase;
//   static constexpr bool kWindowSquares;          // the window pass keeps sum_j A_j^2 (HeadWindow::squares)
//   static float headTerm(HeadWindow const& head);  // one query head's term of token i
//   static float groupScore(float sum, int32_t group); // the score from the terms' sum in head order
#pragma once

#include "criticalkv/methods.h"

#include <cmath>

namespace criticalkv
{

//! a * b rounded on its own, as the reference's separate tensor ops do (nvcc would otherwise fuse it into the
//! following addition; the host build uses -ffp-contract=off).
CKV_HD float multiplyRounded(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

struct GroupScores
{
    float attention; //!< S: window attention max-pooled over positions, mean over the group
    float critical;  //!< C: mean_h (P_h + eps) N_h, or kvpress's (mean P + eps) mean N (two-stage only)
    float method;    //!< a group-scored method's own score (0 for the others)
};

//! What one query head's window gives a group-scored method's term at older token i.
struct HeadWindow
{
    float mean;    //!< Ā_h[i]: the window queries' mean attention
    float pooled;  //!< Ā_h max-pooled over positions around i (pool_kernel)
    float squares; //!< sum_j A_h[j, i]^2 (0 unless the method's kWindowSquares)
    float norm;    //!< N_h[i]: the projected-value norm of the policy's kind (0 unless needsNorms)
};

//! The group score of a base method that is not group-scored: none.
struct NoGroupScore
{
    static constexpr bool kWindowSquares = false;
    CKV_HD static float headTerm(HeadWindow const& /*head*/)
    {
        return 0.0F;
    }
    CKV_HD static float groupScore(float /*sum*/, int32_t /*group*/)
    {
        return 0.0F;
    }
};

//! Scores of older token i of the group of query heads [firstHead, firstHead + group), Method's own score included
//! (NoGroupScore: none). raw, squares and norms point at head 0 of one sequence, rows of m floats ([H, m]); squares /
//! norms may be nullptr when the policy does not need them (methods.h, methods/registry.h).
template <typename Method = NoGroupScore>
CKV_HD GroupScores groupScoresAt(SelectConfig const& config, float const* raw, float const* squares,
    float const* norms, int32_t firstHead, int32_t group, int32_t m, int32_t i)
{
    int32_t const half = config.poolKernel / 2;
    int32_t const lo = i - half > 0 ? i - half : 0;
    int32_t const hi = i + half < m - 1 ? i + half : m - 1;
    bool const withNorms = needsNorms(config) && norms != nullptr;
    bool const withSquares = Method::kWindowSquares && squares != nullptr;
    float sumPooled = 0.0F;
    float sumCritical = 0.0F;
    float sumP = 0.0F;
    float sumN = 0.0F;
    float sumMethod = 0.0F;
    for (int32_t h = firstHead; h < firstHead + group; ++h)
    {
        float const* row = raw + static_cast<int64_t>(h) * m;
        float pooled = row[i];
        for (int32_t t = lo; t <= hi; ++t)
        {
            pooled = row[t] > pooled ? row[t] : pooled;
        }
        float const norm = withNorms ? norms[static_cast<int64_t>(h) * m + i] : 0.0F;
        float const p = config.stage2Scores == Stage2Scores::kPooled ? pooled : row[i];
        sumPooled += pooled;
        sumCritical += multiplyRounded(p + config.epsilon, norm);
        sumP += p;
        sumN += norm;
        float const square = withSquares ? squares[static_cast<int64_t>(h) * m + i] : 0.0F;
        sumMethod += Method::headTerm(HeadWindow{row[i], pooled, square, norm});
    }
    float const groupSize = static_cast<float>(group);
    GroupScores scores{};
    scores.attention = sumPooled / groupSize;
    scores.critical = config.gqaReduce == GqaReduce::kMean
        ? sumCritical / groupSize
        : multiplyRounded(sumP / groupSize + config.epsilon, sumN / groupSize);
    scores.method = Method::groupScore(sumMethod, group);
    return scores;
}

} // namespace criticalkv
