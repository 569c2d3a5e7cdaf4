// The C++ registry of the native methods that bring their own score: one line per method, one list per kind of
// score. The kernels, the host driver (host/select_host.cpp) and the workspace layout (kernels.h) run the pass of
// every method listed here; what else a method asks of the pipeline comes from its traits (the generated
// methodTraits, declared in Python).
// * Key-scored methods (key_scores.h; kernel template kernels/key_scores.cuh, launched by kernels/pipeline.cu): their
//   scores are then ranked as kvzip's external scores.
// * Group-scored methods (group_scores.h; kernel template kernels/selection.cu: groupScoresKernel): a score per KV
//   head's group from its query heads' window attention and value norms, ranked by the shared allocation.
// * Row-scored methods (row_scores.h; kernel templates kernels/selection.cu: rowPartsKernel, rowTotalsKernel,
//   rowFinishKernel, and the flow kernels/select_flows.cuh: runRowRanking, runRowSelection): a score and a stage-1
//   mass per KV head's group from its heads' window rows (their rescaled average pools' maximum), value norms and
//   window attention; stage 1 by cumulative mass, then the shared allocation on the score. Their generated trait
//   rowScores must be set (the window pass computes the rows for it).
#pragma once

#include "criticalkv/key_scores.h"
#include "criticalkv/methods/keydiff.h"
#include "criticalkv/methods/defensivekv.h"
#include "criticalkv/methods/laprox.h"

namespace criticalkv
{

using KeyScoredMethods = MethodList<
    methods::KeyDiff>;

//! Whether the base method scores its tokens from its keys (a method of KeyScoredMethods).
CKV_HD bool keyScored(SelectConfig const& config)
{
    return listed(KeyScoredMethods{}, config.base);
}

//! Call f(Method{}) with the key-scored method of `base` (host code); false when `base` is not one.
template <typename F>
inline bool forKeyScoredMethod(BaseMethod base, F&& f)
{
    return dispatchMethod(KeyScoredMethods{}, base, static_cast<F&&>(f));
}

using GroupScoredMethods = MethodList<
    methods::LaProx>;

//! Whether the base method ranks by a group score of its own (a method of GroupScoredMethods): the workspace then
//! holds its scores (methodScores, [B, H_kv, m]) and the shared allocation ranks by them.
CKV_HD bool groupScored(SelectConfig const& config)
{
    return listed(GroupScoredMethods{}, config.base);
}

//! The scores the shared allocation ranks by (shared_allocation.h; a row-scored method passes its own ranking): a
//! group-scored method's own score, else the pooled attention (adakv).
CKV_HD float const* sharedRanking(SelectConfig const& config, float const* attention, float const* methodScores)
{
    return groupScored(config) ? methodScores : attention;
}

//! Whether the window pass keeps sum_j A_j^2 of every (query head, older token) for the base's group score.
template <typename... Methods>
CKV_HD bool anyWindowSquares(MethodList<Methods...>, BaseMethod base)
{
    return (false || ... || (base == Methods::kBase && Methods::kWindowSquares));
}

CKV_HD bool windowSquares(SelectConfig const& config)
{
    return anyWindowSquares(GroupScoredMethods{}, config.base);
}

//! Call f(Method{}) with the group-scored method of `base`, else f(NoGroupScore{}) (host code: the launcher and the
//! host driver pick their template instance with it).
template <typename F>
inline void forGroupScore(BaseMethod base, F&& f)
{
    if (!dispatchMethod(GroupScoredMethods{}, base, f))
    {
        f(NoGroupScore{});
    }
}

using RowScoredMethods = MethodList<
    methods::DefensiveKV,
    methods::LayerDefensiveKV>;

//! Whether the base method is row-scored (a method of RowScoredMethods): the window pass then keeps the pooled rows,
//! the workspace holds its buffers (its workspaceBytes) and its scores and flow run instead of the group scores'.
CKV_HD bool rowScored(SelectConfig const& config)
{
    return listed(RowScoredMethods{}, config.base);
}

//! Call f(Method{}) with the row-scored method of `base` (host code: the launchers, the workspace layout and the host
//! driver pick their template instance with it); false when `base` is not one.
template <typename F>
inline bool forRowScoredMethod(BaseMethod base, F&& f)
{
    return dispatchMethod(RowScoredMethods{}, base, static_cast<F&&>(f));
}

} // namespace criticalkv
