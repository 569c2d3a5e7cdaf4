// The C++ registry of the key-scored methods (key_scores.h): one line per method. The kernels
// (kernels/key_scores.cuh, launched by kernels/pipeline.cu), the host driver (host/select_host.cpp) and the workspace
// layout (kernels.h) run the pass for every method listed here; the rest of the pipeline ranks its scores as kvzip's
// external scores, per the method's traits (the generated methodTraits).
#pragma once

#include "criticalkv/key_scores.h"
#include "criticalkv/methods/keydiff.h"

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

} // namespace criticalkv
