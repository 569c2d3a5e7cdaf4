// The pass of the row-scored methods (methods/registry.h: RowScoredMethods; defensivekv), shared by the kernels and
// the host driver: a base method whose score reads every window query's attention row over the older tokens, not only
// their mean, and which ranks by a score and a stage-1 mass of its own.
//
// The rows' part is the form's, computed by the window pass for every method of the list (kernels/window_simt.cuh,
// window_tiles.cuh; the host driver's pooledRows): for query head h, window query j and older token i (m of them,
// valid from validStart),
//   P[h, j, i]      = (sum of A[h, j, t] over t in [i - k/2, i + k/2] clipped to [0, m)) / k, 0 for padding
//   R[h, j, i]      = P / total[h, j] * mass[h, j]    (total: sum_i P; mass: sum_i A; as avg_pool_rows)
//   pooledMax[h, i] = max over j of R;  rowSums[h, j] = (mass, total)
// One struct per method (methods/<name>.h) says what it makes of them; the score kernels (kernels/selection.cu:
// rowPartsKernel, rowTotalsKernel, rowFinishKernel), the selection flow (kernels/select_flows.cuh: runRowRanking,
// runRowSelection) and the host driver are templates over it. A method struct provides (__host__ __device__, fp32):
//   static constexpr BaseMethod kBase;
//   struct Parts { float worst, norm, attention; };  // per (KV head, token): the max of pooledMax over the group's
//                                                    // heads, the mean norm, the mean window attention
//   struct Totals;                                   // per KV head, from the parts' sums over the valid tokens
//   static Parts partsAt(pooledMax, raw, norms, firstHead, group, m, validStart, i);
//   static Totals totals(worstSum, normSum, attentionSum, rowMassSum, validCount, rows);
//   static float score(Parts, Totals);  static float stage1Mass(Parts, Totals);
//   static float stage1Limit(config, Totals const* heads, int32_t count);  static int64_t stage1Keep(count, r);
//   static float stage1Ranking(float score, bool first);
//   template <typename Exec> static void rank(...), select(...);   // the sequential flow (host driver)
//   static RowScoredBytes workspaceBytes(b, h, hkv, w, m);          // its workspace (kernels.h: workspaceLayout)
#pragma once

#include "criticalkv/group_scores.h" // multiplyRounded

#include <cstddef>

namespace criticalkv
{

//! torch.finfo(torch.float32).tiny: the reference's clamp of every normalising sum.
constexpr float kTinyFloat = 1.17549435e-38F;

//! The rows' average pools and their rescaling to each row's mass (the form's shared pass).
struct PooledRows
{
    //! Older tokens [lo, hi] that the average pool of token i sums (zero padding outside [0, m)).
    struct PoolSpan
    {
        int32_t lo;
        int32_t hi;
    };

    CKV_HD static PoolSpan poolSpan(int32_t kernel, int32_t m, int32_t i)
    {
        int32_t const half = kernel / 2;
        return PoolSpan{i - half > 0 ? i - half : 0, i + half < m - 1 ? i + half : m - 1};
    }

    //! The pooled value from the sum over the span: avg_pool1d with count_include_pad divides by the kernel.
    CKV_HD static float averagePool(float spanSum, int32_t kernel)
    {
        return spanSum / static_cast<float>(kernel);
    }

    //! P[i] of one attention row over the m older tokens (row[t] is 0 on padding), 0 for a padding token.
    CKV_HD static float averagePooledAt(float const* row, int32_t kernel, int32_t m, int32_t validStart, int32_t i)
    {
        if (i < validStart)
        {
            return 0.0F;
        }
        PoolSpan const span = poolSpan(kernel, m, i);
        float sum = 0.0F;
        for (int32_t t = span.lo; t <= span.hi; ++t)
        {
            sum += row[t];
        }
        return averagePool(sum, kernel);
    }

    //! R = P / total * mass: the pooled row rescaled to keep its own mass (unchanged when the row has none).
    CKV_HD static float rescaledPooled(float pooled, float mass, float total)
    {
        if (!(total > 0.0F))
        {
            return pooled;
        }
        return multiplyRounded(pooled / (total > kTinyFloat ? total : kTinyFloat), mass);
    }
};

//! Bytes of the workspace buffers a row-scored method uses (its workspaceBytes; kernels.h: workspaceLayout). The
//! buffers' shapes are the form's; their sizes, the totals' above all, are the method's.
struct RowScoredBytes
{
    size_t rowSums;     //!< float2 [B, H, w]: (mass, pooled total) of every window query's row
    size_t pooledMax;   //!< float [B, H, m]: max over the window queries of the rescaled pooled rows
    size_t massScores;  //!< float [B, H_kv, m]: the stage-1 mass (the parts' scratch before)
    size_t ranking;     //!< float [B, H_kv, m]: the shared allocation's ranking (the parts' scratch before)
    size_t totals;      //!< Method::Totals [B, H_kv]
};

} // namespace criticalkv
