// DefensiveKV (criticalkv/methods/defensivekv.py), shared by the kernels and the host driver: a row-scored method
// (row_scores.h: the window rows' average pools rescaled to each row's mass, their max per query head and token, are
// the form's pass): its defensive group score, stage 1 by cumulative attention mass, and its selection flow (stage-1
// tokens ranked first, then adakv's shared allocation, shared_allocation.h). layer-defensivekv (LayerDefensiveKV below)
// ranks the same way layer by layer (model_level.h).
//
// For KV head g, query heads h in g and older tokens i (m of them, valid from validStart), from the rows' pass:
//   worst[g, i]  = max over h of pooledMax[h, i];  prior = mean over the valid i of worst
//   defensive[i] = max(worst, prior) * Nbar[i] / sum_i Nbar   (Nbar: the group's mean projected-value norm)
//   stage1[i]    = Abar[i] / sum_i Abar                      (Abar: the group's mean of the window-mean attention)
// Stage 1 keeps per head the most massive tokens while the cumulative mass (sorted descending, summed exactly as int64
// in units of 2^-48: mass_count.h, as the reference's stage1_count) stays below stage1_mass - the layer's window mass,
// at most r; those rank kStage1Offset above every other in the shared allocation. Every float operation is the
// reference's, in its order (sums over tokens excepted: accumulated in double here, in a vectorised float cascade by
// torch).
//
// What it asks of the pipeline: the generated trait rowScores (the rows' pass and the value norms) and its line in
// methods/registry.h (RowScoredMethods), which instantiates the row-scored kernels, flows and host steps over this
// struct; its workspace is workspaceBytes.
#pragma once

#include "criticalkv/mass_count.h"
#include "criticalkv/row_scores.h"
#include "criticalkv/shared_allocation.h"

#include <cmath>

namespace criticalkv::methods
{

struct DefensiveKV
{
    static constexpr BaseMethod kBase = BaseMethod::kDefensiveKV;
    //! Offset that ranks stage-1 tokens above every other (defensive scores lie in [0, 1]).
    static constexpr float kStage1Offset = 2.0F;

    //! The per-token parts of one KV group before its sums over tokens.
    struct Parts
    {
        float worst;     //!< max over the group's heads (and window queries) of R
        float norm;      //!< mean over the group's heads of the projected-value norm, 0 on padding
        float attention; //!< mean over the group's heads of the window-mean attention, 0 on padding
    };

    //! headWorst, raw, norms: [H, m] rows of one sequence (headWorst[h, i] = max over j of R[h, j, i]).
    CKV_HD static Parts partsAt(float const* headWorst, float const* raw, float const* norms, int32_t firstHead,
        int32_t group, int32_t m, int32_t validStart, int32_t i)
    {
        Parts parts{-INFINITY, 0.0F, 0.0F};
        float sumNorm = 0.0F;
        float sumAttention = 0.0F;
        for (int32_t h = firstHead; h < firstHead + group; ++h)
        {
            int64_t const at = static_cast<int64_t>(h) * m + i;
            parts.worst = headWorst[at] > parts.worst ? headWorst[at] : parts.worst;
            sumNorm += norms[at];
            sumAttention += raw[at];
        }
        bool const valid = i >= validStart;
        parts.norm = valid ? sumNorm / static_cast<float>(group) : 0.0F;
        parts.attention = valid ? sumAttention / static_cast<float>(group) : 0.0F;
        return parts;
    }

    //! The group's sums over its valid older tokens (accumulated in double by the callers) and its window mass.
    struct Totals
    {
        float prior;        //!< mean over the valid tokens of worst (the clamp)
        float normSum;      //!< sum of the parts' norm
        float attentionSum; //!< sum of the parts' attention
        float windowMass;   //!< 1 - mean over the group's rows (h, j) of their mass over the older tokens
    };

    CKV_HD static Totals totals(double worstSum, double normSum, double attentionSum, double rowMassSum,
        int32_t validCount, int32_t rows)
    {
        Totals t{};
        t.prior = static_cast<float>(worstSum) / static_cast<float>(validCount > 1 ? validCount : 1);
        t.normSum = static_cast<float>(normSum);
        t.attentionSum = static_cast<float>(attentionSum);
        t.windowMass = 1.0F - static_cast<float>(rowMassSum) / static_cast<float>(rows);
        return t;
    }

    //! The defensive score of a token: max(worst, prior) times its share of the group's norms.
    CKV_HD static float score(Parts const& p, Totals const& t)
    {
        float const defended = p.worst > t.prior ? p.worst : t.prior;
        return multiplyRounded(defended, p.norm / (t.normSum > kTinyFloat ? t.normSum : kTinyFloat));
    }

    //! The stage-1 mass of a token: its share of the group's attention over the older tokens.
    CKV_HD static float stage1Mass(Parts const& p, Totals const& t)
    {
        return p.attention / (t.attentionSum > kTinyFloat ? t.attentionSum : kTinyFloat);
    }

    //! Stage 1's threshold: stage1_mass minus the layer's window mass (the mean of its groups' window masses), fp32.
    //! totals: [heads] of one sequence.
    CKV_HD static float stage1Limit(SelectConfig const& config, Totals const* totals, int32_t heads)
    {
        float sum = 0.0F;
        for (int32_t g = 0; g < heads; ++g)
        {
            sum += totals[g].windowMass;
        }
        return config.stage1Mass - sum / static_cast<float>(heads);
    }

    //! The ranking of the shared allocation: stage-1 tokens kStage1Offset above the others.
    CKV_HD static float stage1Ranking(float defensive, bool first)
    {
        return first ? defensive + kStage1Offset : defensive;
    }

    //! Stage 1 of one KV head keeps its mass count, at most r (the head's older tokens of the budget).
    CKV_HD static int64_t stage1Keep(int64_t massCount, int64_t r)
    {
        return massCount < r ? massCount : r;
    }

    //! The ranking of one sequence's older tokens: stage 1 by mass per head, then the defensive score with the
    //! stage-1 tokens first (defensivekv.py: priority; layer-defensivekv's model-wide ranking is this, layer by
    //! layer). defensive, stage1, ranking, flags: [heads, m] (flags cleared by the caller, cleared again on return);
    //! r: older tokens per head (SequenceInfo::r); limit: stage1Limit. The executor is the flows' top-k primitive
    //! (select_flow.h) and also supplies
    //!   int64_t massCount(scores, flags, len, period, firstValid, limit)   radixMassCount over the candidates
    CKV_FLOW_TEMPLATE
    template <typename Exec>
    CKV_HD static void rank(Exec& exec, float const* defensive, float const* stage1, float* ranking, uint8_t* flags,
        int32_t heads, int32_t m, int32_t firstValid, int64_t r, float limit)
    {
        for (int32_t g = 0; g < heads; ++g)
        {
            int64_t const offset = static_cast<int64_t>(g) * m;
            int64_t const count
                = stage1Keep(exec.massCount(stage1 + offset, flags + offset, m, m, firstValid, limit), r);
            exec(stage1 + offset, flags + offset, m, m, firstValid, count, kChosenByAttention);
        }
        for (int64_t e = 0; e < static_cast<int64_t>(heads) * m; ++e)
        {
            ranking[e] = stage1Ranking(defensive[e], flags[e] != 0);
            flags[e] = 0;
        }
    }

    //! Mark one sequence's chosen older tokens: its ranking (rank), then the shared allocation on it. ranking is
    //! scratch; the rest as rank's.
    CKV_FLOW_TEMPLATE
    template <typename Exec>
    CKV_HD static void select(Exec& exec, SelectConfig const& config, float const* defensive, float const* stage1,
        float* ranking, uint8_t* flags, int32_t heads, int32_t m, int32_t firstValid, int64_t r, float limit)
    {
        rank(exec, defensive, stage1, ranking, flags, heads, m, firstValid, r, limit);
        selectShared(exec, config, ranking, flags, heads, m, firstValid, r);
    }

    //! Its workspace (kernels.h: workspaceLayout): the form's buffers, its totals per KV head.
    static RowScoredBytes workspaceBytes(size_t b, size_t h, size_t hkv, size_t w, size_t m)
    {
        return RowScoredBytes{b * h * w * 2 * sizeof(float), b * h * m * sizeof(float), b * hkv * m * sizeof(float),
            b * hkv * m * sizeof(float), b * hkv * sizeof(Totals)};
    }
};

//! layer-defensivekv: DefensiveKV's scores and ranking layer by layer, its budget model-wide (model_level.h).
struct LayerDefensiveKV : DefensiveKV
{
    static constexpr BaseMethod kBase = BaseMethod::kLayerDefensiveKV;
};

} // namespace criticalkv::methods
