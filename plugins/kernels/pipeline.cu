// launchCriticalKVSelect: the operator of one layer as a sequence of kernels on one stream.
//
//   window attention [+ a row-scored method's pooled rows]  ->  value norms  ->  group scores (or the row-scored
//   method's)  ->  selection (plan kernels and batched top-k launches, select_flows.cuh)  ->  compaction  ->  gather
//
// CriticalKV with value_norm=l1 (prunedStage2On) prunes stage 2: the value-norm step writes L1 upper bounds from the
// Gram terms of W_O (launchPrunedBounds; the terms depend on the weights only, so a caller may compute them once per
// layer with launchPrunedTerms and pass them in SelectTensors::prunedTerms), the group-score kernel turns them into U,
// and launchPrunedStage2 computes exact norms on the tensor cores for the best candidates by U only, in a fixed number
// of rounds, its top-k calls on the same batched top-k (docs/operator.md step 6a).
//
// No host synchronisation and no allocation: the workspace (workspaceLayout) holds every intermediate, so the
// launch is CUDA-graph capturable. The request's budget b (the kv_budget input) stays in device memory: every
// kernel reads it, and PyramidKV's r_l = layer_budgets[b - window] is looked up on the device first (the table
// travels as kernel parameters). Sequences of at most b tokens (and every sequence under `full`) skip the
// scoring kernels and are written by the compaction directly.
#include "criticalkv/kernels.h"
#include "criticalkv/methods/registry.h"
#include "criticalkv/pruned_stage2.h"
#include "device_utils.cuh"
#include "key_scores.cuh"
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

//! The scores of the older tokens, then the selection stages of the policy (the flags of every KV head), given the
//! window scores and value norms in `s`; for the pruned stage 2 only the scores and the shared allocation.
cudaError_t selectOlderTokens(SelectConfig const& config, SelectShape const& shape, kernels::ScoreArgs const& s,
    void* workspace, WorkspaceLayout const& layout, cudaStream_t stream)
{
    kernels::SelectionRows rows{config, shape, s.promptLengths, s.budget, s.flags, s.headCounts,
        selectionPlan(at<void>(workspace, layout.plan), shape.batch, shape.kvHeads, at<void>(workspace, layout.topK),
            layout.total - layout.topK)};
    if (rowScored(config))
    {
        cudaError_t const status = kernels::launchRowScores(s, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
        // a row-scored method's scores lie in attention, its stage-1 masses in massScores (launchRowScores)
        kernels::RowSelectionArgs const d{rows, s.attention, s.massScores, s.ranking, s.totals};
        return kernels::launchRowSelection(d, stream);
    }
    cudaError_t status = kernels::launchGroupScores(s, stream);
    if (status != cudaSuccess)
    {
        return status;
    }
    kernels::SelectionArgs const a{rows, s.attention, s.critical, s.methodScores};
    if (!s.pruned)
    {
        return kernels::launchSelection(a, stream);
    }
    // CriticalKV's pruned stage 2: the shared allocation gives each head its share (ada-criticalkv), reselected in
    // it by launchPrunedStage2 (after this)
    return sharedAllocation(config) ? kernels::launchSharedAllocation(a, stream) : cudaSuccess;
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

namespace
{

//! What the score stages read of one layer's inputs (launchCriticalKVSelect's and launchLayerRanking's).
struct LayerInputs
{
    DType dtype;
    void const* queries;
    void const* keys;
    void const* values;
    void const* oProj;
    int32_t const* promptLengths;
    int32_t const* kvBudget;
    float const* scores;
    void const* prunedTerms;
};

//! The runtime budget of a call: r_l resolved on the device first where the layer reads it from the table.
cudaError_t resolveBudget(SelectConfig const& config, BudgetTable const& table, SelectShape const& shape,
    int32_t const* kvBudget, void* workspace, WorkspaceLayout const& layout, RuntimeBudget& budget,
    cudaStream_t stream)
{
    int32_t const m = shape.n - windowLength(config, shape.n);
    budget = RuntimeBudget{kvBudget, nullptr};
    if (kvBudget != nullptr && config.budgetTable && needsScores(config) && m > 0)
    {
        int32_t* resolved = at<int32_t>(workspace, layout.layerBudget);
        cudaError_t const status = launchResolveLayerBudget(config, table, kvBudget, resolved, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
        budget.layerBudget = resolved;
    }
    return cudaSuccess;
}

//! Entry c of key j of head g of sequence b, in fp32 (keyScoresKernel's loader).
template <typename T>
struct DeviceKeys
{
    T const* keys; //!< [B, H_kv, n, d_h]
    int32_t kvHeads;
    int32_t n;
    int32_t d;

    __device__ float operator()(int32_t b, int32_t g, int32_t j, int32_t c) const
    {
        return kernels::toFloat(keys[((static_cast<int64_t>(b) * kvHeads + g) * n + j) * d + c]);
    }
};

//! A key-scored layer's scores [B, H_kv, n] (methods/registry.h: the method's instance of keyScoresKernel).
cudaError_t launchKeyScores(SelectConfig const& config, SelectShape const& shape, DType dtype, void const* keys,
    int32_t const* promptLengths, RuntimeBudget const& budget, float* scores, cudaStream_t stream)
{
    kernels::KeyScoreArgs const args{config, shape, promptLengths, budget, scores};
    dim3 const grid(static_cast<uint32_t>(shape.kvHeads), static_cast<uint32_t>(shape.batch));
    cudaError_t status = cudaErrorInvalidValue;
    forKeyScoredMethod(config.base, [&](auto method) {
        using Method = decltype(method);
        status = kernels::dispatchDType(dtype, [&](auto zero) {
            using T = decltype(zero);
            DeviceKeys<T> const loader{static_cast<T const*>(keys), shape.kvHeads, shape.n, shape.headDim};
            kernels::keyScoresKernel<Method><<<grid, kernels::kKeyScoreThreads, 0, stream>>>(args, loader);
            return cudaGetLastError();
        });
    });
    return status;
}

//! The inputs of the group scores of one scored layer (m > 0) into the workspace: the window attention (a kvzip
//! layer: its external scores as every query head's raw attention; a key-scored layer: its key scores, the same way),
//! a row-scored method's pooled rows, and the value norms, or the pruned stage 2's L1 bounds unless `exactNorms`. Fills
//! `s` (raw, squares, norms, the row-scored buffers, pruned).
cudaError_t scoreInputs(SelectConfig const& config, SelectShape const& shape, LayerInputs const& t, bool exactNorms,
    void* workspace, WorkspaceLayout const& layout, kernels::ScoreArgs& s, cudaStream_t stream)
{
    int32_t const m = shape.n - windowLength(config, shape.n);
    bool const rowsOn = rowScored(config); // a row-scored method's rows come out of the same passes
    float* raw = at<float>(workspace, layout.raw);
    float* squares = windowSquares(config) ? at<float>(workspace, layout.squares) : nullptr;
    WindowScoreParams window{};
    cudaError_t status = cudaSuccess;
    if (externalScores(config) || keyScored(config))
    {
        float const* given = t.scores;
        if (keyScored(config))
        {
            float* keyed = at<float>(workspace, layout.keyScores);
            status = launchKeyScores(config, shape, t.dtype, t.keys, t.promptLengths, s.budget, keyed, stream);
            given = keyed;
        }
        kernels::ExternalRawArgs const copy{config, shape, t.promptLengths, s.budget, given, raw};
        status = status == cudaSuccess ? kernels::launchExternalRaw(copy, stream) : status;
    }
    else
    {
        window.config = config;
        window.budget = s.budget;
        window.shape = shape;
        window.dtype = t.dtype;
        window.queries = t.queries;
        window.keys = t.keys;
        window.promptLengths = t.promptLengths;
        window.partials = at<float>(workspace, layout.partials);
        window.rowStats = at<float>(workspace, layout.rowStats);
        window.raw = raw;
        window.squares = squares;
        window.rowSums = rowsOn ? at<float>(workspace, layout.rowSums) : nullptr;
        window.pooledMax = rowsOn ? at<float>(workspace, layout.pooledMax) : nullptr;
        status = launchWindowScores(window, stream);
    }
    if (status != cudaSuccess)
    {
        return status;
    }
    float* norms = nullptr;
    bool const pruned = prunedStage2On(config) && !exactNorms;
    GramScratch const gram{at<float>(workspace, layout.gram), at<void>(workspace, layout.gramPieces),
        at<float>(workspace, layout.gramScale)};
    if (pruned)
    {
        // CriticalKV's pruned stage 2: L1 upper bounds here (norms), U = their group score (critical) in the
        // group-score kernel, exact norms for the candidates only in launchPrunedStage2.
        norms = at<float>(workspace, layout.norms);
        // the weights-only terms: the caller's (launchPrunedTerms, same path) or computed into the workspace
        GramScratch termsGram = gram;
        float* rowL1 = at<float>(workspace, layout.rowL1);
        float* colL1 = at<float>(workspace, layout.colL1);
        bool const reuse = t.prunedTerms != nullptr
            && prunedTermsOnTensorCores(shape, t.dtype, t.oProj)
                == valueNormsOnTensorCores(shape, t.dtype, t.values, t.oProj);
        if (reuse)
        {
            PrunedTerms const given = prunedTermsAt(const_cast<void*>(t.prunedTerms), shape);
            termsGram = given.gram;
            rowL1 = given.rowL1;
            colL1 = given.colL1;
        }
        PrunedBoundParams bounds{};
        bounds.shape = shape;
        bounds.dtype = t.dtype;
        bounds.values = t.values;
        bounds.oProj = t.oProj;
        bounds.numTokens = m;
        bounds.config = &config;
        bounds.budget = s.budget;
        bounds.promptLengths = t.promptLengths;
        bounds.gram = termsGram;
        bounds.rowL1 = rowL1;
        bounds.colL1 = colL1;
        bounds.bounds = norms;
        bounds.termsReady = reuse;
        status = launchPrunedBounds(bounds, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    else if (needsNorms(config))
    {
        norms = at<float>(workspace, layout.norms);
        ValueNormParams p{};
        p.shape = shape;
        p.dtype = t.dtype;
        p.values = t.values;
        p.oProj = t.oProj;
        p.numTokens = m;
        p.kind = normKind(config);
        p.out = norms;
        p.config = &config;
        p.budget = s.budget;
        p.promptLengths = t.promptLengths;
        p.gram = normKind(config) == ValueNorm::kL2 ? gram : GramScratch{};
        status = launchValueNorms(p, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    if (rowsOn)
    {
        s.pooledMax = window.pooledMax;
        s.rowSums = reinterpret_cast<float2 const*>(window.rowSums);
        s.massScores = at<float>(workspace, layout.massScores);
        s.ranking = at<float>(workspace, layout.ranking);
        s.totals = at<void>(workspace, layout.totals);
    }
    s.raw = raw;
    s.squares = squares;
    s.norms = norms;
    s.pruned = pruned;
    return cudaSuccess;
}

bool inputsSupported(SelectConfig const& config, float const* scores)
{
    return !config.modelWide && (!externalScores(config) || scores != nullptr);
}

} // namespace

cudaError_t launchCriticalKVSelect(SelectConfig const& config, BudgetTable const& table, SelectShape const& shape,
    SelectTensors const& t, void* workspace, size_t workspaceBytes, cudaStream_t stream)
{
    if (!shapeSupported(config, shape) || !inputsSupported(config, t.scores))
    {
        return cudaErrorInvalidValue;
    }
    WorkspaceLayout const layout = workspaceLayout(config, shape);
    if (workspaceBytes < layout.total || (layout.total > 0 && workspace == nullptr))
    {
        return cudaErrorInvalidValue;
    }
    int32_t const m = shape.n - windowLength(config, shape.n);
    kernels::ScoreArgs s{};
    s.config = config;
    s.shape = shape;
    s.promptLengths = t.promptLengths;
    s.flags = at<uint8_t>(workspace, layout.flags);
    cudaError_t status = resolveBudget(config, table, shape, t.kvBudget, workspace, layout, s.budget, stream);
    if (status != cudaSuccess)
    {
        return status;
    }
    if (needsScores(config) && m > 0)
    {
        LayerInputs const inputs{t.dtype, t.queries, t.keys, t.values, t.oProj, t.promptLengths, t.kvBudget, t.scores,
            t.prunedTerms};
        status = scoreInputs(config, shape, inputs, false, workspace, layout, s, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
        s.attention = at<float>(workspace, layout.attention);
        s.critical = config.twoStage ? at<float>(workspace, layout.critical) : nullptr;
        s.methodScores = groupScored(config) ? at<float>(workspace, layout.methodScores) : nullptr;
        s.headCounts = at<int32_t>(workspace, layout.headCounts);
        status = selectOlderTokens(config, shape, s, workspace, layout, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
        if (s.pruned)
        {
            PrunedStage2Params p{};
            p.config = config;
            p.shape = shape;
            p.dtype = t.dtype;
            p.budget = s.budget;
            p.promptLengths = t.promptLengths;
            p.values = t.values;
            p.oProj = t.oProj;
            p.raw = s.raw;
            p.squares = s.squares;
            p.norms = const_cast<float*>(s.norms);
            p.attention = s.attention;
            p.critical = s.critical;
            p.headCounts = sharedAllocation(config) ? s.headCounts : nullptr;
            p.exact = at<float>(workspace, layout.exact);
            p.flags = s.flags;
            p.candidates = at<int32_t>(workspace, layout.candidates);
            p.candidateCounts = at<int32_t>(workspace, layout.candidateCounts);
            p.states = at<PrunedHeadState>(workspace, layout.prunedStates);
            p.plan = prunedPlan(at<void>(workspace, layout.prunedPlan), shape.batch, shape.kvHeads);
            p.topKScratch = at<void>(workspace, layout.topK);
            p.topKScratchBytes = layout.total - layout.topK;
            p.margin = stopMargin(shape.hidden, shape.heads / shape.kvHeads);
            p.maxCount = prunedMaxK(config, table, shape, m);
            status = launchPrunedStage2(p, stream);
            if (status != cudaSuccess)
            {
                return status;
            }
        }
        if (config.keptSinks > 0)
        {
            kernels::SelectionRows const rows{config, shape, t.promptLengths, s.budget, s.flags, nullptr, {}};
            status = kernels::launchMarkKeptSinks(rows, stream);
            if (status != cudaSuccess)
            {
                return status;
            }
        }
    }
    kernels::CompactArgs c{config, shape, t.promptLengths, s.budget, s.flags, t.keptIndices, t.keptLengths};
    status = kernels::launchCompact(c, stream);
    if (status != cudaSuccess)
    {
        return status;
    }
    return kernels::launchGather(
        kernels::gatherArgs(config, shape, t.dtype, t.keptIndices, t.keys, t.values, t.keptKeys, t.keptValues), stream);
}

cudaError_t launchLayerRanking(SelectConfig const& config, BudgetTable const& table, SelectShape const& shape,
    LayerRankingTensors const& t, void* workspace, size_t workspaceBytes, cudaStream_t stream)
{
    if (!shapeSupported(config, shape) || !modelLevel(config) || !needsScores(config) || t.ranking == nullptr
        || (externalScores(config) && t.scores == nullptr) || (config.twoStage && t.critical == nullptr))
    {
        return cudaErrorInvalidValue;
    }
    WorkspaceLayout const layout = workspaceLayout(config, shape);
    if (workspaceBytes < layout.total || (layout.total > 0 && workspace == nullptr))
    {
        return cudaErrorInvalidValue;
    }
    int32_t const m = shape.n - windowLength(config, shape.n);
    size_t const rowBytes = static_cast<size_t>(shape.batch) * shape.kvHeads * (m > 0 ? m : 0) * sizeof(float);
    kernels::ScoreArgs s{};
    s.config = config;
    s.shape = shape;
    s.promptLengths = t.promptLengths;
    s.flags = at<uint8_t>(workspace, layout.flags);
    // zeros where a sequence is kept whole (the stages below skip it)
    for (float* out : {t.ranking, t.attention, t.critical})
    {
        if (out != nullptr && rowBytes > 0)
        {
            cudaError_t const status = cudaMemsetAsync(out, 0, rowBytes, stream);
            if (status != cudaSuccess)
            {
                return status;
            }
        }
    }
    cudaError_t status = resolveBudget(config, table, shape, t.kvBudget, workspace, layout, s.budget, stream);
    if (status != cudaSuccess || m <= 0)
    {
        return status;
    }
    LayerInputs const inputs{t.dtype, t.queries, t.keys, t.values, t.oProj, t.promptLengths, t.kvBudget, t.scores,
        nullptr};
    status = scoreInputs(config, shape, inputs, true, workspace, layout, s, stream);
    if (status != cudaSuccess)
    {
        return status;
    }
    kernels::SelectionRows const rows{config, shape, t.promptLengths, s.budget, s.flags, nullptr,
        selectionPlan(at<void>(workspace, layout.plan), shape.batch, shape.kvHeads, at<void>(workspace, layout.topK),
            layout.total - layout.topK)};
    if (rowScored(config))
    {
        // a row-scored method (layer-defensivekv): its scores (zero where skipped), stage 1, the ranking into the
        // caller's buffer
        s.attention = at<float>(workspace, layout.attention);
        status = cudaMemsetAsync(s.attention, 0, rowBytes, stream);
        status = status == cudaSuccess ? kernels::launchRowScores(s, stream) : status;
        if (status != cudaSuccess)
        {
            return status;
        }
        kernels::RowSelectionArgs const d{rows, s.attention, s.massScores, t.ranking, s.totals};
        status = kernels::launchRowRanking(d, stream);
        if (status == cudaSuccess && t.attention != nullptr)
        {
            status = cudaMemcpyAsync(t.attention, s.attention, rowBytes, cudaMemcpyDeviceToDevice, stream);
        }
        return status;
    }
    // the kvzip pair: the group score of the external scores (and the critical score), then the sinks first
    s.attention = t.attention != nullptr ? t.attention : at<float>(workspace, layout.attention);
    s.critical = config.twoStage ? t.critical : nullptr;
    s.methodScores = nullptr;
    status = kernels::launchGroupScores(s, stream);
    if (status != cudaSuccess)
    {
        return status;
    }
    kernels::SinkRankingArgs const rank{config, shape, t.promptLengths, s.budget, s.attention, t.ranking};
    return kernels::launchSinkRanking(rank, stream);
}

} // namespace criticalkv
