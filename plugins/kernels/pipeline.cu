// launchCriticalKVSelect: the operator of one layer as a sequence of kernels on one stream.
//
//   window attention  ->  value norms  ->  [defensivekv: pooled rows]  ->  group scores  ->  selection (plan kernels
//   and batched top-k launches, select_flows.cuh)  ->  compaction  ->  gather
//
// CriticalKV with value_norm=l1 (prunedStage2On) prunes stage 2 like the host driver: the value-norm step writes
// L1 upper bounds from the Gram terms of W_O (launchL1Bounds), the group-score kernel turns them into U, and the
// per-head selection (prunedPrepareKernel, prunedExactKernel, prunedFinishKernel) computes exact norms for the best
// candidates by U only (docs/operator.md step 6a).
//
// No host synchronisation and no allocation: the workspace (workspaceLayout) holds every intermediate, so the
// launch is CUDA-graph capturable. The request's budget b (the kv_budget input) stays in device memory: every
// kernel reads it, and PyramidKV's r_l = layer_budgets[b - window] is looked up on the device first (the table
// travels as kernel parameters). Sequences of at most b tokens (and every sequence under `full`) skip the
// scoring kernels and are written by the compaction directly.
#include "criticalkv/kernels.h"
#include "criticalkv/pruned_stage2.h"
#include "device_utils.cuh"
#include "selection.cuh"

namespace criticalkv
{
namespace
{

bool shapeSupported(SelectConfig const& config, SelectShape const& s)
{
    return s.batch > 0 && s.heads > 0 && s.kvHeads > 0 && s.heads % s.kvHeads == 0 && s.n > 0 && s.headDim > 0
        && s.headDim <= kMaxHeadDim && s.hidden > 0 && s.queryLen >= windowLength(config, s.n) && config.capacity > 0
        && s.batch <= 65535 && s.heads <= 65535;
}

//! Table entries per resolve launch: 900 int32 + the config stay under the 4 KiB kernel-parameter limit.
constexpr int32_t kBudgetChunk = 900;

struct BudgetChunk
{
    int32_t first;
    int32_t count;
    int32_t values[kBudgetChunk];
};

//! One thread: if b - window falls in this chunk of layer_budgets, write r_l. One launch per chunk.
__global__ void resolveLayerBudgetKernel(SelectConfig config, int32_t const* kvBudget, BudgetChunk chunk, int32_t* out)
{
    int32_t const index = effectiveBudget(config, kvBudget) - config.window;
    if (index >= chunk.first && index < chunk.first + chunk.count)
    {
        *out = chunk.values[index - chunk.first];
    }
}

template <typename T>
T* at(void* workspace, size_t offset)
{
    return reinterpret_cast<T*>(static_cast<unsigned char*>(workspace) + offset);
}

size_t elementBytes(DType dtype)
{
    return dtype == DType::kFloat32 ? 4 : 2;
}

//! The scores of the older tokens, then the selection stages of the policy (the flags of every KV head), given the
//! window scores and value norms in `s`.
cudaError_t selectOlderTokens(SelectConfig const& config, SelectShape const& shape, kernels::ScoreArgs const& s,
    void* workspace, WorkspaceLayout const& layout, cudaStream_t stream)
{
    kernels::SelectionRows rows{config, shape, s.promptLengths, s.budget, s.flags, s.headCounts,
        selectionPlan(at<void>(workspace, layout.plan), shape.batch, shape.kvHeads, at<void>(workspace, layout.topK),
            layout.total - layout.topK)};
    if (rowScores(config))
    {
        cudaError_t const status = kernels::launchDefensiveScores(s, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
        // the defensive scores lie in attention, the stage-1 masses in stage1 (launchDefensiveScores)
        kernels::DefensiveSelectionArgs const d{rows, s.attention, s.stage1, s.ranking, s.totals};
        return kernels::launchDefensiveSelection(d, stream);
    }
    cudaError_t status = kernels::launchGroupScores(s, stream);
    if (status != cudaSuccess)
    {
        return status;
    }
    kernels::SelectionArgs const a{rows, s.attention, s.critical, s.laprox};
    if (!s.pruned)
    {
        return kernels::launchSelection(a, stream);
    }
    if (sharedAllocation(config))
    {
        status = kernels::launchSharedAllocation(a, stream); // each head's share, reselected by the pruned stages
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    return kernels::launchPrunedSelection(s, stream);
}

} // namespace

cudaError_t launchResolveLayerBudget(SelectConfig const& config, BudgetTable const& table, int32_t const* kvBudget,
    int32_t* layerBudget, cudaStream_t stream)
{
    if (kvBudget == nullptr || layerBudget == nullptr || table.values == nullptr
        || table.count < config.budget - config.window + 1)
    {
        return cudaErrorInvalidValue;
    }
    // Only the entries of runtime budgets b in [minBudget, budget] can be read.
    int32_t const begin = config.minBudget - config.window;
    int32_t const end = config.budget - config.window + 1;
    for (int32_t first = begin; first < end; first += kBudgetChunk)
    {
        BudgetChunk chunk{};
        chunk.first = first;
        chunk.count = end - first < kBudgetChunk ? end - first : kBudgetChunk;
        for (int32_t i = 0; i < chunk.count; ++i)
        {
            chunk.values[i] = table.values[first + i];
        }
        resolveLayerBudgetKernel<<<1, 1, 0, stream>>>(config, kvBudget, chunk, layerBudget);
    }
    return cudaGetLastError();
}

cudaError_t launchCriticalKVSelect(SelectConfig const& config, BudgetTable const& table, SelectShape const& shape,
    SelectTensors const& t, void* workspace, size_t workspaceBytes, cudaStream_t stream)
{
    if (!shapeSupported(config, shape))
    {
        return cudaErrorInvalidValue;
    }
    WorkspaceLayout const layout = workspaceLayout(config, shape);
    if (workspaceBytes < layout.total || (layout.total > 0 && workspace == nullptr))
    {
        return cudaErrorInvalidValue;
    }
    int32_t const m = shape.n - windowLength(config, shape.n);
    RuntimeBudget budget{t.kvBudget, nullptr};
    if (t.kvBudget != nullptr && config.budgetTable && needsScores(config) && m > 0)
    {
        int32_t* resolved = at<int32_t>(workspace, layout.layerBudget);
        cudaError_t const status = launchResolveLayerBudget(config, table, t.kvBudget, resolved, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
        budget.layerBudget = resolved;
    }

    kernels::ScoreArgs s{};
    s.config = config;
    s.shape = shape;
    s.promptLengths = t.promptLengths;
    s.budget = budget;
    s.flags = at<uint8_t>(workspace, layout.flags);

    if (needsScores(config) && m > 0)
    {
        bool const laproxOn = ownL2Norms(config); // squared attention and the LaProx ranking
        float* raw = at<float>(workspace, layout.raw);
        float* squares = laproxOn ? at<float>(workspace, layout.squares) : nullptr;
        cudaError_t status = launchWindowScores(config, budget, shape, t.dtype, t.queries, t.keys, t.promptLengths,
            at<float>(workspace, layout.partials), at<float>(workspace, layout.rowStats), raw, squares, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
        float* norms = nullptr;
        bool const pruned = prunedStage2On(config);
        if (pruned)
        {
            // CriticalKV's pruned stage 2: L1 upper bounds here (norms), U = their group score (critical) in the
            // group-score kernel, exact norms for the candidates only in the pruned selection kernels.
            norms = at<float>(workspace, layout.norms);
            status = launchL1Bounds(&config, budget, t.promptLengths, shape, t.dtype, t.values, t.oProj, m,
                at<float>(workspace, layout.gram), at<float>(workspace, layout.rowL1), at<float>(workspace, layout.colL1),
                norms, stream);
            if (status != cudaSuccess)
            {
                return status;
            }
            s.pruned = true;
            s.dtype = t.dtype;
            s.values = t.values;
            s.oProj = t.oProj;
            s.exactNorms = norms;
            s.exact = at<float>(workspace, layout.exact);
            s.margin = stopMargin(shape.hidden, shape.heads / shape.kvHeads);
        }
        else if (needsNorms(config))
        {
            norms = at<float>(workspace, layout.norms);
            status = launchValueProjectionNorms(&config, budget, t.promptLengths, shape, t.dtype, t.values, t.oProj, m,
                normKind(config), normKind(config) == ValueNorm::kL2 ? at<float>(workspace, layout.gram) : nullptr,
                norms, stream);
            if (status != cudaSuccess)
            {
                return status;
            }
        }
        if (rowScores(config))
        {
            float* worst = at<float>(workspace, layout.worst);
            float* rowMass = at<float>(workspace, layout.rowMass);
            status = launchDefensiveRows(config, budget, shape, t.dtype, t.queries, t.keys, t.promptLengths,
                at<float>(workspace, layout.rowStats), at<float>(workspace, layout.partials), rowMass, worst, stream);
            if (status != cudaSuccess)
            {
                return status;
            }
            s.worst = worst;
            s.rowMass = reinterpret_cast<float2 const*>(rowMass);
            s.stage1 = at<float>(workspace, layout.stage1);
            s.ranking = at<float>(workspace, layout.ranking);
            s.totals = at<DefensiveTotals>(workspace, layout.totals);
        }
        s.raw = raw;
        s.squares = squares;
        s.norms = norms;
        s.attention = at<float>(workspace, layout.attention);
        s.critical = config.twoStage ? at<float>(workspace, layout.critical) : nullptr;
        s.laprox = laproxOn ? at<float>(workspace, layout.laprox) : nullptr;
        s.headCounts = at<int32_t>(workspace, layout.headCounts);
        status = selectOlderTokens(config, shape, s, workspace, layout, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    kernels::CompactArgs c{config, shape, t.promptLengths, budget, s.flags, t.keptIndices, t.keptLengths};
    cudaError_t status = kernels::launchCompact(c, stream);
    if (status != cudaSuccess)
    {
        return status;
    }
    kernels::GatherArgs g{};
    g.config = config;
    g.shape = shape;
    g.keptIndices = t.keptIndices;
    g.keys = t.keys;
    g.values = t.values;
    g.keptKeys = t.keptKeys;
    g.keptValues = t.keptValues;
    g.rowBytes = static_cast<int64_t>(shape.headDim) * static_cast<int64_t>(elementBytes(t.dtype));
    return kernels::launchGather(g, stream);
}

} // namespace criticalkv
