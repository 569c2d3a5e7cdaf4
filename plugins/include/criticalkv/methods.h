// What each base method needs from the pipeline, in one place: which scores it computes, which norm it uses,
// and whether its heads share the layer's slots. The kernels, the host driver and the workspace layout ask
// these questions instead of comparing method names.
#pragma once

#include "criticalkv/select_params.h"

namespace criticalkv
{

// The traits come from the generated registry (policy_fields.h: methodTraits, one row per base method), so a new base
// method declares them in the Python spec (criticalkv.methods.base.BaseMethod's flags) and nowhere else.

//! The method ranks older tokens by window-attention scores (every base but full and streamingllm).
CKV_HD bool needsScores(SelectConfig const& config)
{
    return methodTraits(config.base).scored;
}

//! The layer's H_kv * r slots are shared across heads with a per-head floor (adakv, laprox).
CKV_HD bool sharedAllocation(SelectConfig const& config)
{
    return methodTraits(config.base).sharedAllocation;
}

//! The base itself scores with l2 projected-value norms and squared window attention (laprox).
CKV_HD bool ownL2Norms(SelectConfig const& config)
{
    return methodTraits(config.base).ownL2Norms;
}

//! The base's score reads every window query's attention row, not only their mean (the row-scored methods of
//! methods/registry.h: defensivekv; their norms and the pruned stage 2 ask this trait, the kernels the registry).
CKV_HD bool rowScores(SelectConfig const& config)
{
    return methodTraits(config.base).rowScores;
}

//! Its attention is max-pooled over positions (pool_kernel) before it ranks; kvzip's score is not.
CKV_HD bool poolsAttention(SelectConfig const& config)
{
    return methodTraits(config.base).pools;
}

//! It ranks by a per-entry score computed outside the layer (kvzip: the scores input [B, H_kv, n]), not the window's.
CKV_HD bool externalScores(SelectConfig const& config)
{
    return methodTraits(config.base).externalScores;
}

//! It keeps the first sink_tokens valid tokens before ranking (kvzip; per layer: SequenceInfo::candidateStart).
CKV_HD bool keepsSinks(SelectConfig const& config)
{
    return methodTraits(config.base).keepsSinks;
}

//! Its budget is shared across every layer of the model (selected after the last layer: model_level.h).
CKV_HD bool modelLevel(SelectConfig const& config)
{
    return methodTraits(config.base).modelLevel;
}

//! Projected-value norms are needed: by CriticalKV's stage 2 or by a base that scores with them.
CKV_HD bool needsNorms(SelectConfig const& config)
{
    return ownL2Norms(config) || rowScores(config) || (needsScores(config) && config.twoStage != 0);
}

//! Norm the stage-2 / LaProx score uses.
CKV_HD ValueNorm normKind(SelectConfig const& config)
{
    return ownL2Norms(config) ? ValueNorm::kL2 : config.valueNorm;
}

//! CriticalKV's stage 2 computes exact L1 norms for a few candidates only (pruned_stage2.h, docs/operator.md step 6a):
//! the pipeline and the host driver then hold the L1 upper bounds in `norms` and their group score U in `critical`.
//! Every two-stage policy with value_norm=l1 (criticalkv, pyramid-criticalkv, ada-criticalkv); l2 norms go through
//! the Gram matrix at full price already, and the methods whose base scores with the norms need all of them.
CKV_HD bool prunedStage2On(SelectConfig const& config)
{
    return config.twoStage != 0 && needsScores(config) && !ownL2Norms(config) && !rowScores(config)
        && normKind(config) == ValueNorm::kL1;
}

} // namespace criticalkv
