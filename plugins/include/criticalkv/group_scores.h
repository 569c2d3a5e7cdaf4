// The per-token score of one KV head's group (criticalkv/selection/scores.py: layer_scores), shared by the
// group-score kernel and the host driver: from every query head's window attention Ā (raw), its squares
// (laprox) and its projected-value norms, the pooled attention S, CriticalKV's stage-2 score C and the LaProx
// importance of older token i.
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
    float laprox;    //!< sum_h ||A_h[:, i]||_2 N_h (laprox only)
};

//! Scores of older token i of the group of query heads [firstHead, firstHead + group). raw, squares and norms
//! point at head 0 of one sequence, rows of m floats ([H, m]); squares / norms may be nullptr when the policy
//! does not need them (methods.h).
CKV_HD GroupScores groupScoresAt(SelectConfig const& config, float const* raw, float const* squares,
    float const* norms, int32_t firstHead, int32_t group, int32_t m, int32_t i)
{
    int32_t const half = config.poolKernel / 2;
    int32_t const lo = i - half > 0 ? i - half : 0;
    int32_t const hi = i + half < m - 1 ? i + half : m - 1;
    bool const withNorms = needsNorms(config) && norms != nullptr;
    bool const withLaprox = ownL2Norms(config) && squares != nullptr;
    float sumPooled = 0.0F;
    float sumCritical = 0.0F;
    float sumP = 0.0F;
    float sumN = 0.0F;
    float sumL = 0.0F;
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
        if (withLaprox)
        {
            sumL += multiplyRounded(sqrtf(squares[static_cast<int64_t>(h) * m + i]), norm);
        }
    }
    float const groupSize = static_cast<float>(group);
    GroupScores scores{};
    scores.attention = sumPooled / groupSize;
    scores.critical = config.gqaReduce == GqaReduce::kMean
        ? sumCritical / groupSize
        : multiplyRounded(sumP / groupSize + config.epsilon, sumN / groupSize);
    scores.laprox = sumL;
    return scores;
}

} // namespace criticalkv
