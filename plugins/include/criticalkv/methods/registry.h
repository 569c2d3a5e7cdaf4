// The C++ registry of the native methods that bring their own score: one line per method, one list per kind of
// score. The kernels, the host driver (host/select_host.cpp) and the workspace layout (kernels.h) run the pass of
// every method listed here; what else a method asks of the pipeline comes from its traits (the generated
// methodTraits, declared in Python).
// * Key-scored methods (key_scores.h; kernel template kernels/key_scores.cuh, launched by kernels/pipeline.cu): their
//   scores are then ranked as kvzip's external scores.
// * Group-scored methods (group_scores.h; kernel template kernels/selection.cu: groupScoresKernel): a score per KV
//   head's group from its query heads' window attention and value norms, ranked by the shared allocation.
#pragma once

#include "criticalkv/key_scores.h"
#include "criticalkv/methods/keydiff.h"
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

} // namespace criticalkv
