// Host C++ version of the CriticalKVSelect operator: a sequential driver of the kernels' __host__ __device__
// functions (group score, selection flows, compaction rule), in fp32. It is the CPU
// check of the kernels' logic against the PyTorch reference (tests/plugins/test_plugin_host_select.py).
#pragma once

#include "criticalkv/model_level.h"
#include "criticalkv/select_params.h"

#include <cstdint>
#include <vector>

namespace criticalkv::host
{

//! fp32 inputs (fp16/bf16 tensors are upcast by the caller, exactly as the reference's .float()).
struct HostInputs
{
    float const* queries;         //!< [B, H, queryLen, d_h]
    float const* keys;            //!< [B, H_kv, n, d_h]
    float const* values;          //!< [B, H_kv, n, d_h]
    float const* oProj;           //!< [hidden, H * d_h]
    int32_t const* promptLengths; //!< [B] or nullptr (every sequence n tokens)
    int32_t const* kvBudget;      //!< [1] the request's budget (clamped like the kernels), or nullptr (the built one)
    float const* scores = nullptr; //!< [B, H_kv, n] the external scores of a kvzip policy (its score input), else nullptr
};

//! Outputs, cap = min(n, capacity). keptKeys / keptValues may be nullptr (indices only).
struct HostOutputs
{
    int32_t* keptIndices; //!< [B, H_kv, cap], ascending, -1 padded
    int32_t* keptLengths; //!< [B, H_kv]
    float* keptKeys;      //!< [B, H_kv, cap, d_h], zero padded
    float* keptValues;    //!< [B, H_kv, cap, d_h]
};

//! Run the operator; throws std::invalid_argument on inconsistent shapes. table: the layer_budgets field.
void selectLayer(SelectConfig const& config, BudgetTable const& table, SelectShape const& shape, HostInputs const& in,
    HostOutputs const& out);

//! One layer's part of a model-level selection (model_level.h): its ranking of the older tokens (layer-defensivekv:
//! the defensive score with the stage-1 tokens first; the kvzip pair: the score with the sinks first) and, for
//! CriticalKV's refinement, the base's score (attention) and the critical score (with every exact norm), each
//! [B, H_kv, m], m = n - min(window, n); attention / critical may be nullptr. Sequences kept whole get zeros.
void layerRanking(SelectConfig const& config, BudgetTable const& table, SelectShape const& shape, HostInputs const& in,
    float* ranking, float* attention, float* critical);

//! The model-wide allocation and refinement (model_level.h) of `shape.layers` layers' rankings [B, N, m] (attention,
//! critical: CriticalKV's refinement, else nullptr): flags [B, N, m] of the kept older tokens (non-zero: kept).
void allocateModel(SelectConfig const& config, ModelShape const& shape, int32_t const* promptLengths,
    int32_t const* kvBudget, float const* ranking, float const* attention, float const* critical, uint8_t* flags);

//! Layer `layer`'s outputs from the model-wide flags [B, N, m] (its rows l H_kv .. (l + 1) H_kv - 1): the compaction
//! and the gather of its keys and values (config.capacity: this layer's).
void compactModelLayer(SelectConfig const& config, SelectShape const& shape, int32_t layer, int32_t layers,
    HostInputs const& in, uint8_t const* modelFlags, HostOutputs const& out);

//! r_l of the runtime budget: the device's resolve step (launchResolveLayerBudget) on the host.
int32_t resolveLayerBudget(SelectConfig const& config, BudgetTable const& table, int32_t const* kvBudget);

//! Mark the k best candidates of scores[0, len) (ties: lower index) with `mark` in flags. Candidates are the
//! entries with flags[e] == 0 and (e % period) >= firstValid. Same algorithm as the kernels' block select.
void selectTopK(float const* scores, uint8_t* flags, int64_t len, int64_t period, int64_t firstValid, int64_t k,
    uint8_t mark);

//! A row-scored method's stage-1 count (mass_count.h: radixMassCount): how many candidates, best first, keep the
//! cumulative sum of their scores below limit. Candidates as selectTopK's.
int64_t massCount(float const* scores, uint8_t const* flags, int64_t len, int64_t period, int64_t firstValid,
    float limit);

//! The window attention of query head h of sequence b (the window-score kernels' result): raw [m] Ā and squares [m]
//! sum_j A_j^2 over the m = n - w older positions, and when rows is not null every window query's row over them
//! ([w, m], 0 where a key is not seen). validStart: the sequence's first valid position.
void windowScores(SelectConfig const& config, SelectShape const& s, HostInputs const& in, int32_t b, int32_t h,
    int32_t validStart, float* raw, float* squares, float* rows);

//! A key-scored method's scores of KV head g of sequence b (criticalkv/key_scores.h: the kernel's pass, sequentially):
//! out [n], the scores of the older tokens in [0, m), 0 on left padding. validStart: the sequence's first valid
//! position. Throws std::invalid_argument when the policy's base is not key-scored (methods/registry.h).
void keyScores(SelectConfig const& config, SelectShape const& shape, float const* keys, int32_t b, int32_t g,
    int32_t validStart, float* out);

//! Projected-value norms of query head h for tokens [0, count): ||V[g(h), i] W_O^h|| (l1, or l2 through the
//! d_h x d_h Gram matrix like the reference). out: [count].
void valueProjectionNorms(SelectShape const& shape, float const* values, float const* oProj, int32_t b, int32_t h,
    int32_t count, ValueNorm kind, float* out);

//! The L1 upper bounds of CriticalKV's pruned stage 2 (pruned_stage2.h: l1UpperBoundOf) of query head h for tokens
//! [0, count) of sequence b, from the weights-only terms the host driver computes: what the pipeline's bound
//! kernels (launchL1Bounds) must give bit for bit. out: [count].
void l1UpperBounds(SelectShape const& shape, float const* values, float const* oProj, int32_t b, int32_t h,
    int32_t count, float* out);

} // namespace criticalkv::host
