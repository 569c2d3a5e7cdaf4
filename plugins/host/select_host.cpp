#include "select_host.h"
#include "pruned_row_host.h"

#include "criticalkv/group_scores.h"
#include "criticalkv/head_selection.h"
#include "criticalkv/kept_positions.h"
#include "criticalkv/methods/registry.h"
#include "criticalkv/model_level.h"
#include "criticalkv/pruned_stage2.h"
#include "criticalkv/radix_select.h"
#include "criticalkv/row_scores.h"
#include "criticalkv/shared_allocation.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>

namespace criticalkv::host
{
namespace
{

void validateShape(SelectConfig const& config, SelectShape const& s)
{
    if (s.batch <= 0 || s.heads <= 0 || s.kvHeads <= 0 || s.n <= 0 || s.headDim <= 0 || s.hidden <= 0)
    {
        throw std::invalid_argument("shape: every dimension must be positive");
    }
    if (s.heads % s.kvHeads != 0)
    {
        throw std::invalid_argument("queries: " + std::to_string(s.heads) + " query heads are not a multiple of "
            + std::to_string(s.kvHeads) + " KV heads");
    }
    if (s.queryLen < windowLength(config, s.n))
    {
        throw std::invalid_argument("queries: " + std::to_string(s.queryLen)
            + " window queries given, the policy needs min(window, n) = " + std::to_string(windowLength(config, s.n)));
    }
    if (config.capacity <= 0)
    {
        throw std::invalid_argument("capacity: must be positive");
    }
}

} // namespace

//! Ā and sum_j A_j^2 of query head h over the m older positions (window attention, causal inside the window), and
//! when rows is not null every window query's attention row over them ([w, m], 0 where a key is not seen).
void windowScores(SelectConfig const& config, SelectShape const& s, HostInputs const& in, int32_t b, int32_t h,
    int32_t validStart, float* raw, float* squares, float* rows)
{
    int32_t const n = s.n;
    int32_t const d = s.headDim;
    int32_t const w = windowLength(config, n);
    int32_t const m = n - w;
    int32_t const g = h / (s.heads / s.kvHeads);
    float const scale = static_cast<float>(std::sqrt(static_cast<double>(d)));
    float const* keys = in.keys + (static_cast<int64_t>(b) * s.kvHeads + g) * n * d;
    std::fill(raw, raw + m, 0.0F);
    std::fill(squares, squares + m, 0.0F);
    if (rows != nullptr)
    {
        std::fill(rows, rows + static_cast<int64_t>(w) * m, 0.0F);
    }
    std::vector<float> logits(static_cast<size_t>(n));
    for (int32_t j = 0; j < w; ++j)
    {
        float const* q = in.queries + ((static_cast<int64_t>(b) * s.heads + h) * s.queryLen + (s.queryLen - w + j)) * d;
        int32_t const last = n - w + j; // keys <= last are visible, and keys >= validStart
        float rowMax = -INFINITY;
        for (int32_t i = validStart; i <= last; ++i)
        {
            float dot = 0.0F;
            for (int32_t k = 0; k < d; ++k)
            {
                dot += q[k] * keys[static_cast<int64_t>(i) * d + k];
            }
            logits[i] = dot / scale;
            rowMax = std::max(rowMax, logits[i]);
        }
        if (validStart > last)
        {
            continue; // a padded query of a short sequence: never scored
        }
        float sum = 0.0F;
        for (int32_t i = validStart; i <= last; ++i)
        {
            sum += std::exp(logits[i] - rowMax);
        }
        for (int32_t i = validStart; i < std::min(m, last + 1); ++i)
        {
            float const p = std::exp(logits[i] - rowMax) / sum;
            raw[i] += p;
            squares[i] += p * p;
            if (rows != nullptr)
            {
                rows[static_cast<int64_t>(j) * m + i] = p;
            }
        }
    }
    for (int32_t i = 0; i < m; ++i)
    {
        raw[i] /= static_cast<float>(w);
    }
}

namespace
{

//! The sequential radix select as the flows' top-k primitive (select_flow.h).
struct HostTopK
{
    void operator()(float const* scores, uint8_t* flags, int64_t len, int64_t period, int64_t firstValid, int64_t k,
        uint8_t mark) const
    {
        selectTopK(scores, flags, len, period, firstValid, k, mark);
    }

    int64_t massCount(float const* scores, uint8_t const* flags, int64_t len, int64_t period, int64_t firstValid,
        float limit) const;
};

//! A row-scored method's per-row step for query head h (the kernels' pooled-row passes, row_scores.h): R = the
//! rescaled average pool of every window query's row, pooledMax[i] = max over the rows; rowMass[j] = the row's mass
//! over the older tokens.
void pooledRows(SelectConfig const& config, float const* rows, int32_t w, int32_t m, int32_t validStart,
    float* pooledMax, float* rowMass)
{
    std::fill(pooledMax, pooledMax + m, -INFINITY);
    std::vector<float> pooled(static_cast<size_t>(m));
    for (int32_t j = 0; j < w; ++j)
    {
        float const* row = rows + static_cast<int64_t>(j) * m;
        double mass = 0.0;
        double total = 0.0;
        for (int32_t i = 0; i < m; ++i)
        {
            pooled[i] = PooledRows::averagePooledAt(row, config.poolKernel, m, validStart, i);
            mass += row[i];
            total += pooled[i];
        }
        rowMass[j] = static_cast<float>(mass);
        for (int32_t i = 0; i < m; ++i)
        {
            pooledMax[i] = std::max(
                pooledMax[i], PooledRows::rescaledPooled(pooled[i], rowMass[j], static_cast<float>(total)));
        }
    }
}

//! A row-scored Method's group step for one sequence (the kernels' rowParts, rowTotals, rowFinish): the parts, their
//! sums over the valid tokens, then the method's score and stage-1 mass of every older token; groupTotals: [H_kv].
template <typename Method>
void rowGroups(SelectShape const& s, float const* pooledMax, float const* raw, float const* norms,
    float const* rowMass, int32_t w, int32_t m, int32_t validStart, float* scores, float* massScores,
    typename Method::Totals* groupTotals)
{
    int32_t const group = s.heads / s.kvHeads;
    std::vector<typename Method::Parts> parts(static_cast<size_t>(m));
    for (int32_t g = 0; g < s.kvHeads; ++g)
    {
        double worstSum = 0.0, normSum = 0.0, attentionSum = 0.0, massSum = 0.0;
        for (int32_t i = 0; i < m; ++i)
        {
            parts[i] = Method::partsAt(pooledMax, raw, norms, g * group, group, m, validStart, i);
            worstSum += i >= validStart ? parts[i].worst : 0.0F;
            normSum += parts[i].norm;
            attentionSum += parts[i].attention;
        }
        for (int64_t row = static_cast<int64_t>(g) * group * w; row < static_cast<int64_t>(g + 1) * group * w; ++row)
        {
            massSum += rowMass[row];
        }
        typename Method::Totals const totals
            = Method::totals(worstSum, normSum, attentionSum, massSum, m - validStart, group * w);
        groupTotals[g] = totals;
        for (int32_t i = 0; i < m; ++i)
        {
            scores[static_cast<int64_t>(g) * m + i] = Method::score(parts[i], totals);
            massScores[static_cast<int64_t>(g) * m + i] = Method::stage1Mass(parts[i], totals);
        }
    }
}

} // namespace

void valueProjectionNorms(SelectShape const& s, float const* values, float const* oProj, int32_t b, int32_t h,
    int32_t count, ValueNorm kind, float* out)
{
    int32_t const d = s.headDim;
    int64_t const ld = static_cast<int64_t>(s.heads) * d; // o_proj row length
    int32_t const g = h / (s.heads / s.kvHeads);
    float const* v = values + (static_cast<int64_t>(b) * s.kvHeads + g) * s.n * d;
    float const* w = oProj + static_cast<int64_t>(h) * d; // W_O^h[k, c] = w[c * ld + k]
    if (kind == ValueNorm::kL2)
    {
        std::vector<float> gram(static_cast<size_t>(d) * d, 0.0F);
        for (int32_t k = 0; k < d; ++k)
        {
            for (int32_t l = 0; l < d; ++l)
            {
                float acc = 0.0F;
                for (int32_t c = 0; c < s.hidden; ++c)
                {
                    acc += w[c * ld + k] * w[c * ld + l];
                }
                gram[static_cast<size_t>(k) * d + l] = acc;
            }
        }
        std::vector<float> u(static_cast<size_t>(d));
        for (int32_t i = 0; i < count; ++i)
        {
            float const* vi = v + static_cast<int64_t>(i) * d;
            for (int32_t l = 0; l < d; ++l)
            {
                float acc = 0.0F;
                for (int32_t k = 0; k < d; ++k)
                {
                    acc += vi[k] * gram[static_cast<size_t>(k) * d + l];
                }
                u[l] = acc;
            }
            float quad = 0.0F;
            for (int32_t l = 0; l < d; ++l)
            {
                quad += u[l] * vi[l];
            }
            out[i] = std::sqrt(std::max(quad, 0.0F));
        }
        return;
    }
    for (int32_t i = 0; i < count; ++i)
    {
        float const* vi = v + static_cast<int64_t>(i) * d;
        float norm = 0.0F;
        for (int32_t c = 0; c < s.hidden; ++c)
        {
            float dot = 0.0F;
            for (int32_t k = 0; k < d; ++k)
            {
                dot += vi[k] * w[c * ld + k];
            }
            norm += std::fabs(dot);
        }
        out[i] = norm;
    }
}

void keyScores(SelectConfig const& config, SelectShape const& s, float const* keys, int32_t b, int32_t g,
    int32_t validStart, float* out)
{
    int32_t const n = s.n;
    int32_t const d = s.headDim;
    if (d > kMaxAnchorDim)
    {
        throw std::invalid_argument("keys: head dimension " + std::to_string(d) + " is over the key scores' "
            + std::to_string(kMaxAnchorDim));
    }
    float const* head = keys + (static_cast<int64_t>(b) * s.kvHeads + g) * n * d;
    auto const entry = [head, d](int32_t j, int32_t c) { return head[static_cast<int64_t>(j) * d + c]; };
    int32_t const m = n - windowLength(config, n);
    bool const known = forKeyScoredMethod(config.base, [&](auto method) {
        keyScoresOfHead<decltype(method)>(entry, n, d, validStart, m, out);
    });
    if (!known)
    {
        throw std::invalid_argument("keyScores: the policy's base method is not key-scored (methods/registry.h)");
    }
}

namespace
{

//! The radix select's data-parallel steps as loops over the row (radix_select.h).
struct HostRadixRow
{
    float const* scores;
    uint8_t* flags;
    int64_t len;
    int64_t period;
    int64_t firstValid;
    uint8_t mark;
    uint32_t bins[kRadixBins];

    bool candidate(int64_t e) const
    {
        return radixCandidate(flags, e, period, firstValid);
    }

    uint32_t const* histogram(int pass, uint32_t prefix, uint32_t prefixMask)
    {
        std::fill(bins, bins + kRadixBins, 0u);
        for (int64_t e = 0; e < len; ++e)
        {
            uint32_t const key = orderedKey(scores[e]);
            if (candidate(e) && (key & prefixMask) == prefix)
            {
                ++bins[radixDigit(key, pass)];
            }
        }
        return bins;
    }

    void markAll()
    {
        for (int64_t e = 0; e < len; ++e)
        {
            if (candidate(e))
            {
                flags[e] = mark;
            }
        }
    }

    void markBest(uint32_t threshold, int64_t remaining, int64_t /*atThreshold*/)
    {
        int64_t tiesTaken = 0;
        for (int64_t e = 0; e < len; ++e)
        {
            if (!candidate(e))
            {
                continue;
            }
            uint32_t const key = orderedKey(scores[e]);
            if (key > threshold || (key == threshold && tiesTaken++ < remaining))
            {
                flags[e] = mark;
            }
        }
    }
};

} // namespace

void selectTopK(float const* scores, uint8_t* flags, int64_t len, int64_t period, int64_t firstValid, int64_t k,
    uint8_t mark)
{
    HostRadixRow row{scores, flags, len, period, firstValid, mark, {}};
    radixSelectTopK(row, k);
}

namespace
{

//! radixMassCount's data-parallel step as a loop over the row.
struct HostMassRow
{
    float const* scores;
    uint8_t const* flags;
    int64_t len;
    int64_t period;
    int64_t firstValid;
    uint32_t counts[kRadixBins];
    unsigned long long sums[kRadixBins];

    MassHistogram massHistogram(int pass, uint32_t prefix, uint32_t prefixMask)
    {
        std::fill(counts, counts + kRadixBins, 0u);
        std::fill(sums, sums + kRadixBins, 0ull);
        for (int64_t e = 0; e < len; ++e)
        {
            uint32_t const key = orderedKey(scores[e]);
            if (radixCandidate(flags, e, period, firstValid) && (key & prefixMask) == prefix)
            {
                uint32_t const digit = radixDigit(key, pass);
                ++counts[digit];
                sums[digit] += static_cast<unsigned long long>(fixedMass(scores[e]));
            }
        }
        return MassHistogram{counts, sums};
    }
};

int64_t HostTopK::massCount(float const* scores, uint8_t const* flags, int64_t len, int64_t period,
    int64_t firstValid, float limit) const
{
    HostMassRow row{scores, flags, len, period, firstValid, {}, {}};
    return radixMassCount(row, limit);
}

//! W_O^h[k, c] of query head h as pruned_stage2.h's Weight(c, k).
struct HeadWeight
{
    float const* w; //!< o_proj + h d_h
    int64_t ld;     //!< o_proj row length H d_h

    float operator()(int32_t c, int32_t k) const
    {
        return w[c * ld + k];
    }
};

HeadWeight headWeight(SelectShape const& s, float const* oProj, int32_t h)
{
    return HeadWeight{oProj + static_cast<int64_t>(h) * s.headDim, static_cast<int64_t>(s.heads) * s.headDim};
}

//! ||v W_O^h||_1 of one token (pruned_stage2.h: projectedL1Norm, the same loops as valueProjectionNorms; the
//! pipeline's pruned stage 2 calls the same function).
float l1NormOfToken(SelectShape const& s, float const* vi, float const* oProj, int32_t h)
{
    auto value = [vi](int32_t k) { return vi[k]; };
    return projectedL1Norm(value, headWeight(s, oProj, h), s.headDim, s.hidden);
}

//! Weights-only terms of the L1 upper bound of query head h (pruned_stage2.h): G_h [d_h, d_h], s_h [d_h], c_h,
//! entry by entry with the functions the pipeline's bound-terms kernel calls.
struct BoundTerms
{
    std::vector<float> gram;
    std::vector<float> rowL1;
    float colL1 = 0.0F;
};

BoundTerms boundTerms(SelectShape const& s, float const* oProj, int32_t h)
{
    int32_t const d = s.headDim;
    HeadWeight const weight = headWeight(s, oProj, h);
    BoundTerms t{std::vector<float>(static_cast<size_t>(d) * d, 0.0F), std::vector<float>(static_cast<size_t>(d), 0.0F)};
    for (int32_t k = 0; k < d; ++k)
    {
        for (int32_t l = 0; l < d; ++l)
        {
            t.gram[static_cast<size_t>(k) * d + l] = gramEntry(weight, k, l, s.hidden);
        }
        t.rowL1[k] = rowL1Entry(weight, k, s.hidden);
    }
    for (int32_t c = 0; c < s.hidden; ++c)
    {
        t.colL1 = std::max(t.colL1, columnL1(weight, c, d));
    }
    return t;
}

//! CriticalKV's two stages for KV head g of sequence b with the pruned stage 2: `bound` [m] holds the upper bounds
//! U of C (group scores of the bounds); the exact C is computed for the candidates only, ranked by U, until the
//! stop rule holds. exactNorms: [H, m] scratch of the sequence. Returns the exact norms computed.
int64_t selectHeadPruned(SelectConfig const& config, SelectShape const& s, HostInputs const& in, int32_t b, int32_t g,
    int32_t m, int32_t validStart, int64_t count, float const* attention, float const* bound, float const* raw,
    float const* squares, float* exactNorms, uint8_t* flags)
{
    int32_t const group = s.heads / s.kvHeads;
    int64_t const first = stage1Count(config.alphaMicros, count);
    selectTopK(attention, flags, m, m, validStart, first, kChosenByAttention);
    int64_t const k = count - first;
    std::vector<int32_t> order;
    for (int32_t i = validStart; i < m; ++i)
    {
        if (flags[i] == 0)
        {
            order.push_back(i);
        }
    }
    int64_t const eligible = static_cast<int64_t>(order.size());
    if (k <= 0)
    {
        return 0;
    }
    if (k >= eligible)
    {
        for (int32_t i : order)
        {
            flags[i] = kChosenByCritical;
        }
        return 0;
    }
    std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return bound[x] > bound[y]; });
    float const* v = in.values + (static_cast<int64_t>(b) * s.kvHeads + g) * s.n * s.headDim;
    auto exactScore = [&](int32_t i)
    {
        for (int32_t h = g * group; h < (g + 1) * group; ++h)
        {
            exactNorms[static_cast<int64_t>(h) * m + i] = l1NormOfToken(s, v + static_cast<int64_t>(i) * s.headDim, in.oProj, h);
        }
        return groupScoresAt(config, raw, squares, exactNorms, g * group, group, m, i).critical;
    };
    HostPrunedRow<decltype(exactScore)> row{exactScore, bound, flags, m, validStart, order,
        std::vector<float>(static_cast<size_t>(m), -INFINITY), 0};
    return prunedStage2(row, k, eligible, stopMargin(s.hidden, group));
}

} // namespace

void l1UpperBounds(SelectShape const& s, float const* values, float const* oProj, int32_t b, int32_t h,
    int32_t count, float* out)
{
    BoundTerms const terms = boundTerms(s, oProj, h);
    int32_t const d = s.headDim;
    float const* v = values + (static_cast<int64_t>(b) * s.kvHeads + h / (s.heads / s.kvHeads)) * s.n * d;
    for (int32_t i = 0; i < count; ++i)
    {
        out[i] = l1UpperBound(v + static_cast<int64_t>(i) * d, terms.gram.data(), terms.rowL1.data(), terms.colL1, d,
            s.hidden);
    }
}

int64_t massCount(float const* scores, uint8_t const* flags, int64_t len, int64_t period, int64_t firstValid,
    float limit)
{
    return HostTopK{}.massCount(scores, flags, len, period, firstValid, limit);
}

int32_t resolveLayerBudget(SelectConfig const& config, BudgetTable const& table, int32_t const* kvBudget)
{
    int32_t const index = effectiveBudget(config, kvBudget) - config.window;
    if (table.values == nullptr || index < 0 || index >= table.count)
    {
        throw std::invalid_argument("layer_budgets: no entry for budget " + std::to_string(index + config.window));
    }
    return table.values[index];
}

namespace
{

//! The score stages of one layer on the kernels' buffers (kernels.h: WorkspaceLayout), sequence by sequence: window
//! scores (or the external scores of a kvzip layer), value norms (or the pruned stage 2's bounds), then the group
//! scores (a row-scored method's group step: rowGroupsOf). `exactNorms`: every norm exactly even where the selection
//! would prune stage 2 (the model-level refinement reads the critical score of every older token).
struct LayerScorer
{
    SelectConfig const& config;
    SelectShape const& s;
    HostInputs const& in;
    int32_t n, d, group, w, m;
    int64_t rowsPerBatch;
    bool pruned, rowsOn;
    std::vector<float> raw, squares, norms, attention, critical, methodScores;
    std::vector<BoundTerms> terms;
    std::vector<float> rows, pooledMax, rowSums, massScores, ranking; //!< a row-scored method's (row_scores.h)
    std::vector<float> keyed; //!< [H_kv, n] a key-scored method's scores of one sequence

    LayerScorer(SelectConfig const& c, SelectShape const& shape, HostInputs const& inputs, bool anyScored,
        bool exactNorms)
        : config(c)
        , s(shape)
        , in(inputs)
        , n(shape.n)
        , d(shape.headDim)
        , group(shape.heads / shape.kvHeads)
        , w(windowLength(c, shape.n))
        , m(shape.n - windowLength(c, shape.n))
        , rowsPerBatch(static_cast<int64_t>(shape.kvHeads) * m)
        , pruned(prunedStage2On(c) && !exactNorms)
        , rowsOn(rowScored(c))
    {
        if (externalScores(config) && in.scores == nullptr && anyScored)
        {
            throw std::invalid_argument("scores: " + std::string(config.base == BaseMethod::kKVzip ? "kvzip" : "layer-kvzip")
                + " ranks by scores computed outside the layer ([B, H_kv, n], a context reconstruction's); without them "
                  "its fallback (the window's max attention) runs only in the PyTorch reference");
        }
        size_t const perHead = static_cast<size_t>(s.batch) * s.heads * m;
        size_t const perKvHead = static_cast<size_t>(s.batch) * rowsPerBatch;
        raw.assign(perHead, 0.0F);
        squares.assign(perHead, 0.0F);
        norms.assign(needsNorms(config) ? perHead : 0, 0.0F);
        attention.assign(perKvHead, 0.0F);
        critical.assign(perKvHead, 0.0F);
        methodScores.assign(perKvHead, 0.0F);
        for (int32_t h = 0; pruned && anyScored && h < s.heads; ++h)
        {
            terms.push_back(boundTerms(s, in.oProj, h));
        }
        rows.assign(rowsOn ? static_cast<size_t>(w) * m : 0, 0.0F);
        pooledMax.assign(rowsOn ? perHead : 0, 0.0F);
        rowSums.assign(rowsOn ? static_cast<size_t>(s.batch) * s.heads * w : 0, 0.0F);
        massScores.assign(rowsOn ? perKvHead : 0, 0.0F);
        ranking.assign(rowsOn ? perKvHead : 0, 0.0F);
        keyed.assign(keyScored(config) ? static_cast<size_t>(s.kvHeads) * n : 0, 0.0F);
    }

    //! Every score of sequence b (compressed); a row-scored method's: its window rows and norms only (rowGroupsOf
    //! follows).
    void score(int32_t b, SequenceInfo const& info)
    {
        int64_t const sequence = static_cast<int64_t>(b) * s.heads * m;
        // a key-scored method's scores (key_scores.cuh), then as kvzip's external scores
        for (int32_t g = 0; g < s.kvHeads && keyScored(config); ++g)
        {
            keyScores(config, s, in.keys, b, g, info.validStart, &keyed[static_cast<size_t>(g) * n]);
        }
        // window scores and value norms (window_scores.cu, value_norms.cu); kvzip: its external scores, unpooled
        for (int32_t h = 0; h < s.heads; ++h)
        {
            int64_t const row = sequence + static_cast<int64_t>(h) * m;
            if (keyScored(config))
            {
                float const* given = &keyed[static_cast<size_t>(h / group) * n];
                std::copy(given, given + m, &raw[row]);
            }
            else if (externalScores(config))
            {
                float const* given = in.scores + (static_cast<int64_t>(b) * s.kvHeads + h / group) * n;
                std::copy(given, given + m, &raw[row]);
            }
            else
            {
                windowScores(config, s, in, b, h, info.validStart, &raw[row], &squares[row],
                    rowsOn ? rows.data() : nullptr);
            }
            if (rowsOn)
            {
                pooledRows(config, rows.data(), w, m, info.validStart, &pooledMax[row],
                    &rowSums[(static_cast<size_t>(b) * s.heads + h) * w]);
            }
            if (pruned)
            {
                float const* v = in.values + (static_cast<int64_t>(b) * s.kvHeads + h / group) * n * d;
                for (int32_t i = 0; i < m; ++i)
                {
                    norms[row + i] = l1UpperBound(v + static_cast<int64_t>(i) * d, terms[h].gram.data(),
                        terms[h].rowL1.data(), terms[h].colL1, d, s.hidden);
                }
            }
            else if (needsNorms(config))
            {
                valueProjectionNorms(s, in.values, in.oProj, b, h, m, normKind(config), &norms[row]);
            }
        }
        int64_t const base = b * rowsPerBatch;
        if (rowsOn)
        {
            return;
        }
        // group scores (groupScoresKernel, the base's instance: methods/registry.h)
        forGroupScore(config.base, [&](auto method) {
            using Method = decltype(method);
            for (int32_t g = 0; g < s.kvHeads; ++g)
            {
                for (int32_t i = 0; i < m; ++i)
                {
                    GroupScores const scores = groupScoresAt<Method>(config, &raw[sequence], &squares[sequence],
                        norms.empty() ? nullptr : &norms[sequence], g * group, group, m, i);
                    int64_t const at = base + static_cast<int64_t>(g) * m + i;
                    attention[at] = scores.attention;
                    critical[at] = scores.critical;
                    methodScores[at] = scores.method;
                }
            }
        });
    }

    //! A row-scored Method's group step of sequence b after score(): its score in attention, its stage-1 mass in
    //! massScores; returns its totals ([H_kv]).
    template <typename Method>
    std::vector<typename Method::Totals> rowGroupsOf(int32_t b, SequenceInfo const& info)
    {
        int64_t const sequence = static_cast<int64_t>(b) * s.heads * m;
        int64_t const base = b * rowsPerBatch;
        std::vector<typename Method::Totals> totals(static_cast<size_t>(s.kvHeads));
        rowGroups<Method>(s, &pooledMax[sequence], &raw[sequence], &norms[sequence],
            &rowSums[static_cast<size_t>(b) * s.heads * w], w, m, info.validStart, &attention[base], &massScores[base],
            totals.data());
        return totals;
    }
};

//! The request's budget, resolved as on the device (pipeline.cu): r_l looked up first, then read by every stage.
struct ResolvedBudget
{
    int32_t resolved = 0;
    RuntimeBudget runtime{nullptr, nullptr};

    ResolvedBudget(SelectConfig const& config, BudgetTable const& table, int32_t const* kvBudget)
    {
        runtime.kvBudget = kvBudget;
        if (kvBudget != nullptr && config.budgetTable && needsScores(config))
        {
            resolved = resolveLayerBudget(config, table, kvBudget);
            runtime.layerBudget = &resolved;
        }
    }

    ResolvedBudget(ResolvedBudget const&) = delete;
    ResolvedBudget& operator=(ResolvedBudget const&) = delete;
};

std::vector<SequenceInfo> sequenceInfos(SelectConfig const& config, RuntimeBudget const& runtime, SelectShape const& s,
    int32_t const* promptLengths, bool& anyScored)
{
    std::vector<SequenceInfo> infos(static_cast<size_t>(s.batch));
    anyScored = false;
    for (int32_t b = 0; b < s.batch; ++b)
    {
        infos[b] = sequenceInfo(config, runtime, s, promptLengths, b);
        anyScored = anyScored || (infos[b].compress && needsScores(config));
    }
    return infos;
}

//! Compaction: ascending kept positions of every head (flags [B, H_kv, m] of a scored layer), then the gather of K
//! and V (kernels/compact.cuh, gatherKernel).
void compactLayer(SelectConfig const& config, SelectShape const& s, HostInputs const& in,
    std::vector<SequenceInfo> const& infos, uint8_t const* flags, HostOutputs const& out)
{
    int32_t const n = s.n;
    int32_t const d = s.headDim;
    int32_t const m = n - windowLength(config, n);
    int32_t const cap = outputCapacity(config, n);
    int64_t const rowsPerBatch = static_cast<int64_t>(s.kvHeads) * m;
    for (int32_t b = 0; b < s.batch; ++b)
    {
        SequenceInfo const& info = infos[b];
        for (int32_t g = 0; g < s.kvHeads; ++g)
        {
            std::vector<int32_t> kept;
            int32_t const fixed = fixedKeptCount(config, info);
            for (int32_t slot = 0; slot < fixed; ++slot)
            {
                kept.push_back(fixedKeptPosition(config, info, n, slot));
            }
            if (fixed < 0)
            {
                uint8_t const* row = &flags[b * rowsPerBatch + static_cast<int64_t>(g) * m];
                for (int32_t i = 0; i < n; ++i)
                {
                    if (scoredPositionKept(info, m, row, i))
                    {
                        kept.push_back(i);
                    }
                }
            }
            int64_t const head = static_cast<int64_t>(b) * s.kvHeads + g;
            int32_t const count = std::min(static_cast<int32_t>(kept.size()), cap);
            out.keptLengths[head] = count;
            for (int32_t slot = 0; slot < cap; ++slot)
            {
                int32_t const index = slot < count ? kept[slot] : -1;
                out.keptIndices[head * cap + slot] = index;
                for (float* dst : {out.keptKeys, out.keptValues})
                {
                    if (dst == nullptr)
                    {
                        continue;
                    }
                    float const* src = dst == out.keptKeys ? in.keys : in.values;
                    for (int32_t k = 0; k < d; ++k)
                    {
                        dst[(head * cap + slot) * d + k] = index >= 0 ? src[(head * n + index) * d + k] : 0.0F;
                    }
                }
            }
        }
    }
}

//! Mark a per-layer kvzip head's kept sinks (SequenceInfo: [validStart, candidateStart)) after its selection flows.
void markKeptSinks(SequenceInfo const& info, uint8_t* row)
{
    for (int32_t i = info.validStart; i < info.candidateStart; ++i)
    {
        row[i] = kKeptSink;
    }
}

} // namespace

void selectLayer(SelectConfig const& config, BudgetTable const& table, SelectShape const& s, HostInputs const& in,
    HostOutputs const& out)
{
    validateShape(config, s);
    if (config.modelWide)
    {
        throw std::invalid_argument("num_layers: a model-level policy selects one layer alone only in a one-layer "
                                    "model (selectModel selects the others)");
    }
    ResolvedBudget const budget(config, table, in.kvBudget);
    bool anyScored = false;
    std::vector<SequenceInfo> const infos = sequenceInfos(config, budget.runtime, s, in.promptLengths, anyScored);
    int32_t const m = s.n - windowLength(config, s.n);
    int64_t const rowsPerBatch = static_cast<int64_t>(s.kvHeads) * m;
    LayerScorer scorer(config, s, in, anyScored, false);
    std::vector<uint8_t> flags(static_cast<size_t>(s.batch) * rowsPerBatch, 0);
    std::vector<int64_t> headCounts(static_cast<size_t>(s.batch) * s.kvHeads, 0);
    std::vector<float> exactNorms(scorer.pruned ? static_cast<size_t>(s.heads) * m : 0, 0.0F);
    HostTopK topK;
    for (int32_t b = 0; b < s.batch && anyScored; ++b)
    {
        SequenceInfo const& info = infos[b];
        if (!info.compress)
        {
            continue;
        }
        scorer.score(b, info);
        int64_t const sequence = static_cast<int64_t>(b) * s.heads * m;
        int64_t const base = b * rowsPerBatch;
        if (scorer.rowsOn)
        {
            // a row-scored method: its scores, stage 1 and the shared allocation on its ranking
            forRowScoredMethod(config.base, [&](auto method) {
                using Method = decltype(method);
                std::vector<typename Method::Totals> const totals = scorer.rowGroupsOf<Method>(b, info);
                float const limit = Method::stage1Limit(config, totals.data(), s.kvHeads);
                Method::select(topK, config, &scorer.attention[base], &scorer.massScores[base], &scorer.ranking[base],
                    &flags[base], s.kvHeads, m, info.candidateStart, info.r, limit);
            });
            continue;
        }
        // shared allocation (select_flows.cuh: runSharedStage), then the per-head flow (runHeadStage)
        if (sharedAllocation(config))
        {
            selectShared(topK, config, sharedRanking(config, &scorer.attention[base], &scorer.methodScores[base]),
                &flags[base], s.kvHeads, m, info.candidateStart, info.r);
            for (int32_t g = 0; g < s.kvHeads; ++g)
            {
                uint8_t const* row = &flags[base + static_cast<int64_t>(g) * m];
                headCounts[static_cast<size_t>(b) * s.kvHeads + g]
                    = std::count_if(row, row + m, [](uint8_t f) { return f != 0; });
            }
        }
        if (config.twoStage || !sharedAllocation(config))
        {
            for (int32_t g = 0; g < s.kvHeads; ++g)
            {
                int64_t const row = base + static_cast<int64_t>(g) * m;
                std::fill(&flags[row], &flags[row] + m, 0);
                int64_t const count
                    = sharedAllocation(config) ? headCounts[static_cast<size_t>(b) * s.kvHeads + g] : info.r;
                if (scorer.pruned)
                {
                    selectHeadPruned(config, s, in, b, g, m, info.candidateStart, count, &scorer.attention[row],
                        &scorer.critical[row], &scorer.raw[sequence], &scorer.squares[sequence], exactNorms.data(),
                        &flags[row]);
                    continue;
                }
                selectHead(topK, config, &scorer.attention[row], &scorer.critical[row], &flags[row], m,
                    info.candidateStart, count);
            }
        }
        for (int32_t g = 0; g < s.kvHeads; ++g)
        {
            markKeptSinks(info, &flags[base + static_cast<int64_t>(g) * m]);
        }
    }
    compactLayer(config, s, in, infos, flags.data(), out);
}

void layerRanking(SelectConfig const& config, BudgetTable const& table, SelectShape const& s, HostInputs const& in,
    float* ranking, float* attention, float* critical)
{
    validateShape(config, s);
    if (!modelLevel(config) || !needsScores(config))
    {
        throw std::invalid_argument("layerRanking: the policy is not a model-level method");
    }
    ResolvedBudget const budget(config, table, in.kvBudget);
    bool anyScored = false;
    std::vector<SequenceInfo> const infos = sequenceInfos(config, budget.runtime, s, in.promptLengths, anyScored);
    int32_t const m = s.n - windowLength(config, s.n);
    int64_t const rowsPerBatch = static_cast<int64_t>(s.kvHeads) * m;
    size_t const total = static_cast<size_t>(s.batch) * rowsPerBatch;
    std::fill(ranking, ranking + total, 0.0F);
    for (float* out : {attention, critical})
    {
        if (out != nullptr)
        {
            std::fill(out, out + total, 0.0F);
        }
    }
    LayerScorer scorer(config, s, in, anyScored, true);
    std::vector<uint8_t> flags(total, 0);
    HostTopK topK;
    for (int32_t b = 0; b < s.batch && anyScored; ++b)
    {
        SequenceInfo const& info = infos[b];
        if (!info.compress)
        {
            continue;
        }
        scorer.score(b, info);
        int64_t const base = b * rowsPerBatch;
        if (scorer.rowsOn)
        {
            forRowScoredMethod(config.base, [&](auto method) {
                using Method = decltype(method);
                std::vector<typename Method::Totals> const totals = scorer.rowGroupsOf<Method>(b, info);
                float const limit = Method::stage1Limit(config, totals.data(), s.kvHeads);
                Method::rank(topK, &scorer.attention[base], &scorer.massScores[base], ranking + base, &flags[base],
                    s.kvHeads, m, info.validStart, info.r, limit);
            });
        }
        else
        {
            int32_t const sinkEnd = std::min(m, info.validStart + (keepsSinks(config) ? config.sinkTokens : 0));
            for (int32_t g = 0; g < s.kvHeads; ++g)
            {
                for (int32_t i = 0; i < m; ++i)
                {
                    int64_t const at = base + static_cast<int64_t>(g) * m + i;
                    ranking[at] = sinkRanking(scorer.attention[at], i >= info.validStart && i < sinkEnd);
                }
            }
        }
        if (attention != nullptr)
        {
            std::copy(&scorer.attention[base], &scorer.attention[base] + rowsPerBatch, attention + base);
        }
        if (critical != nullptr && config.twoStage)
        {
            std::copy(&scorer.critical[base], &scorer.critical[base] + rowsPerBatch, critical + base);
        }
    }
}

void compactModelLayer(SelectConfig const& config, SelectShape const& s, int32_t layer, int32_t layers,
    HostInputs const& in, uint8_t const* modelFlags, HostOutputs const& out)
{
    validateShape(config, s);
    ResolvedBudget const budget(config, BudgetTable{nullptr, 0}, in.kvBudget);
    bool anyScored = false;
    std::vector<SequenceInfo> const infos = sequenceInfos(config, budget.runtime, s, in.promptLengths, anyScored);
    int32_t const m = s.n - windowLength(config, s.n);
    int64_t const rows = static_cast<int64_t>(s.kvHeads) * m;
    std::vector<uint8_t> flags(static_cast<size_t>(s.batch) * rows, 0);
    for (int32_t b = 0; b < s.batch; ++b)
    {
        uint8_t const* from = modelFlags + (static_cast<int64_t>(b) * layers + layer) * rows;
        std::copy(from, from + rows, &flags[static_cast<size_t>(b) * rows]);
    }
    compactLayer(config, s, in, infos, flags.data(), out);
}

} // namespace criticalkv::host
