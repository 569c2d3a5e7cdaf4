// Launch functions of the CriticalKV CUDA kernels (kernels/*.cu). Framework-free: raw device pointers,
// cudaStream_t last, cudaError_t returned. The TensorRT plugin only unpacks tensors and calls
// launchCriticalKVSelect; the GPU tests call the stages one by one through testing/cuda_test_capi.cu.
#pragma once

#include "criticalkv/methods.h"
#include "criticalkv/methods/registry.h"
#include "criticalkv/model_level.h"
#include "criticalkv/pruned_stage2.h" // PrunedHeadState
#include "criticalkv/selection_plan.h"

#include <cuda_runtime_api.h>

#include <cstddef>

namespace criticalkv
{

//! Tensors of one CriticalKVSelect call (device pointers; float tensors of `dtype`, contiguous, row-major).
struct SelectTensors
{
    DType dtype;
    void const* queries;          //!< [B, H, queryLen, d_h]
    void const* keys;             //!< [B, H_kv, n, d_h]
    void const* values;           //!< [B, H_kv, n, d_h]
    void const* oProj;            //!< [hidden, H * d_h]
    int32_t const* promptLengths; //!< [B] or nullptr
    int32_t const* kvBudget;      //!< [1] the request's budget (clamped to [minBudget, budget]), or nullptr
    void* keptKeys;               //!< [B, H_kv, cap, d_h], cap = min(n, capacity)
    void* keptValues;             //!< [B, H_kv, cap, d_h]
    int32_t* keptLengths;         //!< [B, H_kv]
    int32_t* keptIndices;         //!< [B, H_kv, cap]
    void const* prunedTerms;      //!< or nullptr: the pruned stage 2's weights-only bound terms of this o_proj, filled
                                  //!< by launchPrunedTerms (same dtype, H, d_h, hidden) and reused instead of
                                  //!< recomputed (CriticalKV with value_norm=l1 only; ignored otherwise)
    float const* scores;          //!< [B, H_kv, n] fp32: the external scores of a kvzip policy (externalScores: required),
                                  //!< else nullptr
};

//! Byte offsets of the scratch buffers inside the workspace (each 256-byte aligned).
struct WorkspaceLayout
{
    size_t layerBudget; //!< int32 [1]: r_l resolved on the device from layer_budgets (PyramidKV with kv_budget)
    size_t partials;   //!< float4 [B, H, w, tiles]: per-key-block softmax partials of every window query
    size_t rowStats;   //!< float2 [B, H, w]: softmax (max, sum) of every window query
    size_t keyScores;  //!< float [B, H_kv, n]: a key-scored method's scores (methods/registry.h; no window attention)
    size_t raw;        //!< float [B, H, m]: Ā, window-mean attention of the older tokens
    size_t squares;    //!< float [B, H, m]: sum_j A_j^2 (a group-scored method's kWindowSquares: windowSquares)
    size_t norms;      //!< float [B, H, m]: ||V W_O^h|| (two-stage policies, laprox); pruned stage 2: the L1 upper
                       //!< bounds, overwritten with the exact norms at the candidates
    size_t gram;       //!< float [H, d_h, d_h]: W_O^h W_O^h^T (l2 norms: two-stage with value_norm=l2, laprox; the
                       //!< pruned stage 2's bound terms G_h)
    size_t gramPieces; //!< 16-bit [H, 3, d_h, d_h]: s_h G_h in pieces for the tensor cores (with gram)
    size_t gramScale;  //!< float [H]: 1 / s_h (with gram)
    size_t rowL1;      //!< float [H, d_h]: s_h[k] = sum_c |W_O^h[k, c]| (pruned stage 2)
    size_t colL1;      //!< float [H]: c_h = max_c sum_k |W_O^h[k, c]| (pruned stage 2)
    size_t attention;  //!< float [B, H_kv, m]: S
    size_t critical;   //!< float [B, H_kv, m]: C; pruned stage 2: U, the group score of the bounds
    size_t exact;      //!< float [B, H_kv, m]: the exact C of the candidates (pruned stage 2)
    size_t candidates; //!< int32 [B, H_kv, m]: a round's new candidates of every head (pruned stage 2)
    size_t candidateCounts; //!< int32 [B, H_kv]: how many (pruned stage 2)
    size_t prunedStates;    //!< PrunedHeadState [B, H_kv] (pruned stage 2)
    size_t prunedPlan;      //!< prunedPlanBytes: every head's k of the pruned stage 2's top-k calls (the candidate
                            //!< rounds' levels included), its stop count
    size_t methodScores; //!< float [B, H_kv, m]: a group-scored method's own score (groupScored: methods/registry.h)
    size_t flags;      //!< uint8 [B, H_kv, m]: chosen older tokens
    size_t headCounts; //!< int32 [B, H_kv]: adakv share of every head
    // a row-scored method's buffers (row_scores.h; sizes: the method's workspaceBytes, methods/registry.h)
    size_t rowSums;    //!< float2 [B, H, w]: (mass, pooled total) of every window query's row
    size_t pooledMax;  //!< float [B, H, m]: max over the window queries of the rescaled pooled rows
    size_t massScores; //!< float [B, H_kv, m]: the stage-1 mass
    size_t ranking;    //!< float [B, H_kv, m]: the shared allocation's ranking
    size_t totals;     //!< Method::Totals [B, H_kv]
    size_t plan;       //!< selectionPlanBytes: every row's k and first valid position of the selection's top-k calls
    size_t topK;       //!< selectionScratchBytes: launchTopK / launchMassCount's scratch
    size_t total;
};

constexpr size_t kWorkspaceAlignment = 256;

inline size_t alignWorkspace(size_t bytes)
{
    return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

//! Largest head dimension the kernels accept.
constexpr int32_t kMaxHeadDim = 256;
static_assert(kMaxAnchorDim >= kMaxHeadDim, "a key-scored method's anchor holds every head dimension the kernels take");

//! Most 16-bit pieces a Gram matrix is split into for the tensor cores (value_norms.cu: l2 norms 3, bounds 2).
constexpr size_t kGramPiecesMax = 3;


//! Scratch layout for `shape`. Every term grows with every dimension, so the layout of the largest shape of an
//! optimization profile bounds all smaller shapes (TensorRT's getWorkspaceSize relies on that).
inline WorkspaceLayout workspaceLayout(SelectConfig const& config, SelectShape const& s)
{
    WorkspaceLayout layout{};
    if (!needsScores(config))
    {
        return layout;
    }
    size_t const b = static_cast<size_t>(s.batch);
    size_t const h = static_cast<size_t>(s.heads);
    size_t const hkv = static_cast<size_t>(s.kvHeads);
    size_t const w = static_cast<size_t>(windowLength(config, s.n));
    size_t const m = static_cast<size_t>(s.n) - w;
    size_t const tiles = (static_cast<size_t>(s.n) + kKeyTile - 1) / kKeyTile;
    size_t offset = 0;
    auto take = [&offset](size_t bytes) {
        size_t const at = offset;
        offset += alignWorkspace(bytes);
        return at;
    };
    // always reserved: a layer without a budget table (pyramidkv's top layer at some budgets, every snapkv layer)
    // then needs the same workspace as its neighbours, so one workspace sized for any layer serves them all
    layout.layerBudget = take(sizeof(int32_t));
    bool const keyed = keyScored(config); // scored from its keys: no window attention
    layout.partials = take(keyed ? 0 : b * h * w * tiles * 4 * sizeof(float));
    layout.rowStats = take(keyed ? 0 : b * h * w * 2 * sizeof(float));
    layout.keyScores = take(keyed ? b * hkv * static_cast<size_t>(s.n) * sizeof(float) : 0);
    layout.raw = take(b * h * m * sizeof(float));
    layout.squares = take(windowSquares(config) ? b * h * m * sizeof(float) : 0);
    layout.norms = take(needsNorms(config) ? b * h * m * sizeof(float) : 0);
    bool const pruned = prunedStage2On(config);
    bool const gramOn = (needsNorms(config) && normKind(config) == ValueNorm::kL2) || pruned;
    size_t const d = static_cast<size_t>(s.headDim);
    layout.gram = take(gramOn ? h * d * d * sizeof(float) : 0);
    layout.gramPieces = take(gramOn ? h * kGramPiecesMax * d * d * 2 : 0);
    layout.gramScale = take(gramOn ? h * sizeof(float) : 0);
    layout.rowL1 = take(pruned ? h * d * sizeof(float) : 0);
    layout.colL1 = take(pruned ? h * sizeof(float) : 0);
    layout.attention = take(b * hkv * m * sizeof(float));
    layout.critical = take(config.twoStage ? b * hkv * m * sizeof(float) : 0);
    layout.exact = take(pruned ? b * hkv * m * sizeof(float) : 0);
    layout.candidates = take(pruned ? b * hkv * m * sizeof(int32_t) : 0);
    layout.candidateCounts = take(pruned ? b * hkv * sizeof(int32_t) : 0);
    layout.prunedStates = take(pruned ? b * hkv * sizeof(PrunedHeadState) : 0);
    layout.prunedPlan = take(pruned ? prunedPlanBytes(s.batch, s.kvHeads) : 0);
    layout.methodScores = take(groupScored(config) ? b * hkv * m * sizeof(float) : 0);
    layout.flags = take(b * hkv * m);
    layout.headCounts = take(b * hkv * sizeof(int32_t));
    RowScoredBytes rowBytes{};
    bool const rowsOn = rowScored(config);
    forRowScoredMethod(config.base, [&](auto method) { rowBytes = decltype(method)::workspaceBytes(b, h, hkv, w, m); });
    layout.rowSums = take(rowBytes.rowSums);
    layout.pooledMax = take(rowBytes.pooledMax);
    layout.massScores = take(rowBytes.massScores);
    layout.ranking = take(rowBytes.ranking);
    layout.totals = take(rowBytes.totals);
    layout.plan = take(selectionPlanBytes(s.batch, s.kvHeads));
    size_t topK = selectionScratchBytes(s.batch, s.kvHeads, static_cast<int32_t>(m), sharedAllocation(config) || rowsOn,
        rowsOn);
    if (pruned) // the candidate rounds' one top-k of kPrunedCandidateLevels levels
    {
        size_t const rounds = topKScratchBytes(s.batch * s.kvHeads, static_cast<int32_t>(m), kPrunedCandidateLevels);
        topK = rounds > topK ? rounds : topK;
    }
    layout.topK = take(topK);
    layout.total = offset;
    return layout;
}

//! The whole operator on one layer: window attention, value norms, group scores, selection, compaction and
//! gather, all on `stream` (no host synchronisation, CUDA-graph capturable). Returns cudaErrorInvalidValue for
//! shapes it does not support (docs/kernels.md, "Known limits") or a workspace smaller than workspaceLayout().total.
cudaError_t launchCriticalKVSelect(SelectConfig const& config, BudgetTable const& table, SelectShape const& shape,
    SelectTensors const& tensors, void* workspace, size_t workspaceBytes, cudaStream_t stream);

//! One layer's part of a model-level selection (model_level.h): the inputs of launchCriticalKVSelect, and its ranking
//! of the older tokens, with the base's and the critical scores for CriticalKV's refinement (each [B, H_kv, m] fp32,
//! m = n - min(window, n); attention / critical may be nullptr when not needed; zeros for sequences kept whole).
struct LayerRankingTensors
{
    DType dtype;
    void const* queries;
    void const* keys;
    void const* values;
    void const* oProj;
    int32_t const* promptLengths;
    int32_t const* kvBudget;
    float const* scores; //!< [B, H_kv, n] (layer-kvzip pair: required), else nullptr
    float* ranking;
    float* attention;
    float* critical;
};

//! One layer's ranking for the model-level selection, in launchCriticalKVSelect's workspace (workspaceLayout of the
//! same config and shape): layer-defensivekv's defensive score with the stage-1 tokens first (its window attention,
//! exact value norms, stage 1 by mass: the per-layer flow up to its shared allocation), or the kvzip pair's group score
//! of the external scores with the sinks first (and its critical score with exact norms). Asynchronous, no
//! allocation; the caller keeps every layer's ranking until the last layer (launchModelSelect).
cudaError_t launchLayerRanking(SelectConfig const& config, BudgetTable const& table, SelectShape const& shape,
    LayerRankingTensors const& tensors, void* workspace, size_t workspaceBytes, cudaStream_t stream);

//! One layer's tensors of a model-level selection: its full keys and values, its outputs (capacity: its own).
struct ModelLayerTensors
{
    void const* keys;     //!< [B, H_kv, n, d_h]
    void const* values;   //!< [B, H_kv, n, d_h]
    void* keptKeys;       //!< [B, H_kv, cap, d_h], cap = min(n, capacity)
    void* keptValues;     //!< [B, H_kv, cap, d_h]
    int32_t* keptLengths; //!< [B, H_kv]
    int32_t* keptIndices; //!< [B, H_kv, cap]
    int32_t capacity;
};

//! The inputs of launchModelSelect: every layer's ranking (and scores) concatenated layer-major, [B, L H_kv, m] fp32.
struct ModelSelectTensors
{
    DType dtype;
    int32_t const* promptLengths;
    int32_t const* kvBudget;
    float const* ranking;
    float const* attention; //!< CriticalKV's refinement (layer-kvzip-criticalkv), else nullptr
    float const* critical;  //!< idem
    ModelLayerTensors const* layers; //!< host array of L
};

//! Byte offsets of launchModelSelect's scratch (each 256-byte aligned).
struct ModelWorkspaceLayout
{
    size_t flags;        //!< uint8 [B, N, m]
    size_t plan;         //!< selectionPlanBytes(B, N)
    size_t counts;       //!< int32 [B, N] (head cap)
    size_t sortKeys[2];  //!< uint32 [B, N, sortStride] (head cap)
    size_t sortPositions[2];
    size_t layerFlags;   //!< uint8 [B, H_kv, m]: one layer's rows for its compaction
    size_t topK;         //!< the top-k calls' scratch
    size_t total;
    int32_t sortStride;
};

//! Scratch layout of launchModelSelect; non-decreasing in every dimension.
ModelWorkspaceLayout modelWorkspaceLayout(SelectConfig const& config, ModelShape const& shape);

//! The model-level selection after the last layer (kernels/model_level.cuh, model_level.h): the allocation of the
//! model's budget over every head of every layer, CriticalKV's refinement, then each layer's compaction and gather
//! into its outputs. config: the policy's (modelWide, keptSinks 0; capacity ignored: each layer's own). Returns
//! cudaErrorInvalidValue for a shape it does not support (a head cap over more than 1,024 heads) or a small workspace.
cudaError_t launchModelSelect(SelectConfig const& config, ModelShape const& shape, ModelSelectTensors const& tensors,
    void* workspace, size_t workspaceBytes, cudaStream_t stream);

//! Write r_l = table.values[b - window] of the runtime budget b = clamp(*kvBudget) into *layerBudget (device).
cudaError_t launchResolveLayerBudget(SelectConfig const& config, BudgetTable const& table, int32_t const* kvBudget,
    int32_t* layerBudget, cudaStream_t stream);

//! Arguments of launchWindowScores.
struct WindowScoreParams
{
    SelectConfig config;
    RuntimeBudget budget;
    SelectShape shape;
    DType dtype;
    void const* queries;          //!< [B, H, queryLen, d_h]: the last w = min(window, n) rows are the window
    void const* keys;             //!< [B, H_kv, n, d_h]
    int32_t const* promptLengths; //!< [B] or nullptr
    float* partials;              //!< scratch, WorkspaceLayout::partials (4 floats per window query and 64-key tile)
    float* rowStats;              //!< scratch, float2 [B, H, w]: softmax (max, sum) of every window query
    float* raw;                   //!< [B, H, m]: Ā, the window-mean attention of the older tokens
    float* squares;               //!< [B, H, m]: sum_j A_j^2 (windowSquares), or nullptr
    float* rowSums;               //!< float2 [B, H, w]: (mass, pooled total) of every window query's row over the older
                                  //!< tokens (a row-scored method's; with pooledMax)
    float* pooledMax;             //!< [B, H, m]: max over the window queries of the rescaled average-pooled rows
                                  //!< (row_scores.h), or nullptr
};

//! Window attention of every query head over the m = n - w older tokens (causal inside the window, left padding
//! masked; sequences that are not compressed are skipped): raw, squares and a row-scored method's pooled rows. On the
//! tensor cores (kernels/window_tiles.cuh: two mma.sync passes over K with the softmax statistics and the rows' masses
//! fused, a combine between them) when windowScoresOnTensorCores, else in fp32 SIMT (kernels/window_simt.cuh: two
//! passes, two more for the pooled rows).
cudaError_t launchWindowScores(WindowScoreParams const& params, cudaStream_t stream);

//! Whether launchWindowScores runs on the tensor cores for these inputs: fp16 / bf16, d_h % 16 == 0, d_h <= 128,
//! w <= 128, with pooled rows pool_kernel <= 49, 16-byte aligned queries and keys, compute capability >= 8.0.
bool windowScoresOnTensorCores(SelectConfig const& config, SelectShape const& shape, DType dtype, void const* queries,
    void const* keys, bool rows);

//! Scratch of the l2 norms through the Gram matrices (see WorkspaceLayout: gram, gramPieces, gramScale).
struct GramScratch
{
    float* gram;   //!< float [H, d_h, d_h]
    void* pieces;  //!< 16-bit [H, kGramPiecesMax, d_h, d_h]
    float* scale;  //!< float [H]
};

//! Gathered rows of a value-norm launch (CriticalKV's pruned stage 2: the candidates of every head in one launch).
struct GatheredRows
{
    int32_t const* tokens; //!< [B, H_kv, stride] token indices (< numTokens), or nullptr: every token
    int32_t const* counts; //!< [B, H_kv] how many of every list are valid (device; read by the kernels)
    int32_t stride;        //!< list capacity per head
    int32_t maxCount;      //!< upper bound of every count, known on the host: the grid covers that many rows per head
};

//! Arguments of launchValueNorms.
struct ValueNormParams
{
    SelectShape shape;
    DType dtype;
    void const* values;          //!< [B, H_kv, n, d_h]
    void const* oProj;           //!< [hidden, H * d_h]
    int32_t numTokens;           //!< tokens 0..numTokens-1 of every sequence; out's row length
    ValueNorm kind;
    float* out;                  //!< [B, H, numTokens]: every token, or only the listed ones
    GatheredRows rows;           //!< tokens == nullptr: every token
    SelectConfig const* config;  //!< non-null: uncompressed sequences (budget, promptLengths) are skipped
    RuntimeBudget budget;
    int32_t const* promptLengths;
    GramScratch gram;            //!< L2 through the Gram matrices when gram.gram != nullptr, else the direct sum
};

//! Whether the value-norm kernels run on the tensor cores for these inputs (16-bit, d_h % 16 == 0, d_h <= 128, 16-byte
//! aligned values and o_proj, compute capability >= 8.0); the pruned stage 2's bounds and exact norms follow the same
//! rule, so the bound always covers the kernel that computes the norm.
bool valueNormsOnTensorCores(SelectShape const& shape, DType dtype, void const* values, void const* oProj);

//! Projected-value norms out[b, h, i] = ||V[b, g(h), i] W_O^h|| (kernels/value_norms.cu, kernels/mma_tiles.cuh): on
//! the tensor cores (mma.sync, fp32 accumulate, never storing V W_O) when valueNormsOnTensorCores, else fp32 SIMT.
//! L2 through the Gram matrices: G_h in fp32, then v^T G_h v on the tensor cores (3 16-bit pieces of G_h) or in SIMT.
cudaError_t launchValueNorms(ValueNormParams const& params, cudaStream_t stream);

//! Bytes of the buffer launchPrunedTerms fills for one layer: G_h [H, d_h, d_h] fp32, its 16-bit pieces
//! [H, kGramPiecesMax, d_h, d_h], 1 / s_h [H], s_h [H, d_h], c_h [H], each 256-byte aligned.
size_t prunedTermsBytes(SelectShape const& shape);

//! The pruned stage 2's bound terms inside a launchPrunedTerms buffer (the workspace's gram, gramPieces, gramScale,
//! rowL1 and colL1 in the same form).
struct PrunedTerms
{
    GramScratch gram;
    float* rowL1;
    float* colL1;
};

PrunedTerms prunedTermsAt(void* buffer, SelectShape const& shape);

//! Which form launchPrunedTerms computes for o_proj: the tensor-core bound's (fp16 / bf16, d_h % 16 == 0, d_h <= 128,
//! 16-byte aligned o_proj, compute capability >= 8.0: G_h on the tensor cores and its 2 pieces) or the fp32 path's
//! (bitwise the host driver's). A select call reuses a buffer only where it takes the same path
//! (valueNormsOnTensorCores, which also asks for 16-byte aligned values); otherwise it computes the terms itself.
bool prunedTermsOnTensorCores(SelectShape const& shape, DType dtype, void const* oProj);

//! The weights-only terms of CriticalKV's pruned stage 2 bound for o_proj [hidden, H d_h] into `buffer`
//! (prunedTermsBytes): they depend on the weights alone, so a caller that keeps a layer's o_proj fixed computes them
//! once and passes them to every launchCriticalKVSelect of that layer (SelectTensors::prunedTerms). The buffer is valid
//! for exactly this o_proj content, dtype and shape's H, d_h, hidden: a caller that changes the weights in place must
//! compute them again.
cudaError_t launchPrunedTerms(SelectShape const& shape, DType dtype, void const* oProj, void* buffer, size_t bytes,
    cudaStream_t stream);

//! Arguments of launchPrunedBounds.
struct PrunedBoundParams
{
    SelectShape shape;
    DType dtype;
    void const* values;
    void const* oProj;
    int32_t numTokens;           //!< m: the older tokens
    SelectConfig const* config;  //!< non-null: uncompressed sequences are skipped
    RuntimeBudget budget;
    int32_t const* promptLengths;
    GramScratch gram;
    float* rowL1;                //!< [H, d_h]
    float* colL1;                //!< [H]
    float* bounds;               //!< [B, H, numTokens]
    bool termsReady;             //!< gram (with its pieces on the tensor path), rowL1 and colL1 already hold this
                                 //!< o_proj's terms in the form of this path (launchPrunedTerms): skip computing them
};

//! The pruned stage 2's L1 upper bounds of every older token: on the tensor cores (pruned_stage2.h:
//! l1UpperBoundTensorCore, bounding the tensor-core norms) when valueNormsOnTensorCores, else launchL1Bounds's
//! host-identical fp32 bounds (bounding the SIMT norms).
cudaError_t launchPrunedBounds(PrunedBoundParams const& params, cudaStream_t stream);

//! Arguments of launchPrunedStage2 (kernels/pruned.cu): CriticalKV's stage 2 with exact norms for candidates only.
struct PrunedStage2Params
{
    SelectConfig config;
    SelectShape shape;
    DType dtype;
    RuntimeBudget budget;
    int32_t const* promptLengths;
    void const* values;          //!< [B, H_kv, n, d_h]
    void const* oProj;           //!< [hidden, H * d_h]
    float const* raw;            //!< [B, H, m] window attention
    float const* squares;        //!< [B, H, m] or nullptr
    float* norms;                //!< [B, H, m]: the bounds; the candidates' exact norms are written over them
    float const* attention;      //!< [B, H_kv, m] S
    float const* critical;       //!< [B, H_kv, m] U, the group score of the bounds
    int32_t const* headCounts;   //!< [B, H_kv] each head's share (shared allocation), or nullptr: r of the sequence
    float* exact;                //!< [B, H_kv, m] scratch: the candidates' exact C
    uint8_t* flags;              //!< [B, H_kv, m] out: kChosenByAttention / kChosenByCritical
    int32_t* candidates;         //!< [B, H_kv, m] scratch
    int32_t* candidateCounts;    //!< [B, H_kv] scratch
    PrunedHeadState* states;     //!< [B, H_kv] scratch
    PrunedPlan plan;             //!< scratch: the heads' k of the top-k calls
    void* topKScratch;           //!< launchTopK's scratch for [B H_kv] rows of m with kPrunedCandidateLevels levels
                                 //!< (topKScratchBytes)
    size_t topKScratchBytes;
    float margin;                //!< stopMargin(hidden, group)
    int32_t maxCount;            //!< upper bound of every head's stage-2 count k, known on the host
};

//! Stage 1 and the pruned stage 2 of every KV head: a first round of min(2k, eligible) candidates by U, their exact
//! norms on the tensor cores in one launch over every head's list, and doubling rounds (4k, 8k, 16k, then every
//! eligible token) as further launches over the whole grid, each a no-op for the heads the stop rule already settled;
//! every top-k (stage 1 by S, the candidates by U, the k kept by exact C) is one launchTopK over all heads' rows. A
//! fixed number of launches, no host synchronisation (CUDA-graph capturable; k is read on the device).
cudaError_t launchPrunedStage2(PrunedStage2Params const& params, cudaStream_t stream);

//! The L1 upper bounds of CriticalKV's pruned stage 2 (pruned_stage2.h: l1UpperBoundOf), bitwise the host driver's:
//! gram [H, d_h, d_h], rowL1 [H, d_h], colL1 [H] from oProj (the weights-only terms, kernels/bound_terms.cuh:
//! boundTermsSimtBlock), then bounds [B, H, numTokens] of the first numTokens tokens of every sequence (one thread per
//! token and head); when config is given, uncompressed sequences are skipped. fp32 throughout.
cudaError_t launchL1Bounds(SelectConfig const* config, RuntimeBudget budget, int32_t const* promptLengths,
    SelectShape const& shape, DType dtype, void const* values, void const* oProj, int32_t numTokens, float* gram,
    float* rowL1, float* colL1, float* bounds, cudaStream_t stream);

//! The pruned stage 2 (pruned_stage2.h: prunedStage2) of one KV head's row by one thread block, on precomputed exact
//! scores: bound, scores [m]; exact [m] scratch; flags [m] after stage 1 (in: 0 eligible, out: kChosenByCritical on
//! the k kept); *done (device int64): how many exact scores it used. Requires 0 < k < eligible. For the GPU tests
//! (kernels == host driver); kernels/pruned_row.cuh.
cudaError_t launchPrunedRow(float const* bound, float const* scores, float* exact, uint8_t* flags, int32_t m,
    int32_t validStart, int64_t k, int64_t eligible, float margin, int64_t* done, cudaStream_t stream);

//! Mark the k[r] best candidates of every row with `mark`. Returns cudaErrorInvalidValue for a bad shape or a scratch
//! smaller than topKScratchBytes(rows, len). Several launches on `stream`; the scratch must not be shared with
//! work running concurrently.
cudaError_t launchTopK(TopKRows const& rows, void* scratch, size_t scratchBytes, cudaStream_t stream);

//! The row-scored methods' stage-1 count (mass_count.h: radixMassCount) of many rows: count[r] = how many candidates
//! of row r, taken best first, keep the cumulative sum of their (non-negative) scores below limit[r]. Candidates, rows
//! and the scores as launchTopK's (rows.k and rows.mark unused). count: [rows] int64 (device); limit: [rows] float.
cudaError_t launchMassCount(TopKRows const& rows, float const* limit, int64_t* count, void* scratch,
    size_t scratchBytes, cudaStream_t stream);

} // namespace criticalkv
