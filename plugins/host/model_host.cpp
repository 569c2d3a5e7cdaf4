// Host version of the model-level allocation (plugins/include/criticalkv/model_level.h): written as the PyTorch
// reference states it (criticalkv/methods/defensivekv.py: nested_capped_mask, adakv.py: shared_allocation_mask,
// criticalkv/selection/layer.py: model_level_refine), level by level with explicit sorts, independently of the kernels'
// bisection (kernels/model_level.cuh), so that the emulation tests compare two different algorithms with the reference.
#include "select_host.h"

#include "criticalkv/head_selection.h"
#include "criticalkv/model_level.h"
#include "criticalkv/shared_allocation.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <vector>

namespace criticalkv::host
{
namespace
{

struct HostTopK
{
    void operator()(float const* scores, uint8_t* flags, int64_t len, int64_t period, int64_t firstValid, int64_t k,
        uint8_t mark) const
    {
        selectTopK(scores, flags, len, period, firstValid, k, mark);
    }
};

//! One head's eligible older tokens in its ranking's order: key descending, equal keys by position.
std::vector<int32_t> headOrder(float const* ranking, int32_t m, int32_t validStart)
{
    std::vector<int32_t> order(static_cast<size_t>(m > validStart ? m - validStart : 0));
    std::iota(order.begin(), order.end(), validStart);
    std::stable_sort(order.begin(), order.end(),
        [&](int32_t a, int32_t b) { return orderedKey(ranking[a]) > orderedKey(ranking[b]); });
    return order;
}

//! nested_capped_mask of one sequence: the count of every head (heads: N), r levels.
std::vector<int64_t> nestedCounts(SelectConfig const& config, std::vector<std::vector<uint32_t>> const& keys,
    int64_t available, int64_t r)
{
    int32_t const heads = static_cast<int32_t>(keys.size());
    std::vector<int64_t> counts(static_cast<size_t>(heads), 0);
    std::vector<int64_t> low(static_cast<size_t>(heads), 0);
    struct Candidate
    {
        uint32_t key;
        int32_t head;
        int64_t j;
    };
    std::vector<Candidate> candidates;
    for (int64_t t = 1; t <= r; ++t)
    {
        int64_t held = 0;
        candidates.clear();
        for (int32_t h = 0; h < heads; ++h)
        {
            LevelSpan const span = levelSpan(config, counts[h], available, t, heads);
            low[h] = span.low;
            held += span.low;
            for (int64_t j = 0; j < span.window; ++j)
            {
                candidates.push_back(Candidate{keys[h][static_cast<size_t>(span.low + j)], h, j});
            }
        }
        int64_t const need = std::max<int64_t>(heads * t - held, 0);
        // the flattened [N, N] window's top `need`: ties to the lower flat index (head, then its own order)
        std::stable_sort(candidates.begin(), candidates.end(),
            [](Candidate const& a, Candidate const& b) { return a.key > b.key; });
        counts = low;
        for (size_t c = 0; c < candidates.size() && static_cast<int64_t>(c) < need; ++c)
        {
            counts[candidates[c].head] += 1;
        }
    }
    return counts;
}

} // namespace

void allocateModel(SelectConfig const& config, ModelShape const& shape, int32_t const* promptLengths,
    int32_t const* kvBudget, float const* ranking, float const* attention, float const* critical, uint8_t* flags)
{
    SelectShape const rows = modelRows(shape);
    int32_t const heads = rows.kvHeads;
    int32_t const m = rows.n - windowLength(config, rows.n);
    if (config.keptSinks != 0)
    {
        throw std::invalid_argument("allocateModel: the model-level selection ranks its sinks (keptSinks must be 0)");
    }
    if (config.twoStage && (attention == nullptr || critical == nullptr))
    {
        throw std::invalid_argument("allocateModel: CriticalKV's refinement needs the attention and critical scores");
    }
    RuntimeBudget const runtime{kvBudget, nullptr};
    int64_t const rowsPerBatch = static_cast<int64_t>(heads) * m;
    std::fill(flags, flags + rows.batch * rowsPerBatch, 0);
    HostTopK topK;
    for (int32_t b = 0; b < rows.batch; ++b)
    {
        SequenceInfo const info = sequenceInfo(config, runtime, rows, promptLengths, b);
        if (!info.compress || m <= 0)
        {
            continue;
        }
        int64_t const base = b * rowsPerBatch;
        if (!modelCapped(config))
        {
            selectShared(topK, config, ranking + base, flags + base, heads, m, info.validStart, info.r);
        }
        else
        {
            std::vector<std::vector<int32_t>> orders;
            std::vector<std::vector<uint32_t>> keys;
            for (int32_t h = 0; h < heads; ++h)
            {
                float const* row = ranking + base + static_cast<int64_t>(h) * m;
                orders.push_back(headOrder(row, m, info.validStart));
                std::vector<uint32_t> k;
                for (int32_t i : orders.back())
                {
                    k.push_back(orderedKey(row[i]));
                }
                keys.push_back(std::move(k));
            }
            std::vector<int64_t> const counts = nestedCounts(config, keys, info.olderValid, info.r);
            for (int32_t h = 0; h < heads; ++h)
            {
                for (int64_t j = 0; j < counts[h]; ++j)
                {
                    flags[base + static_cast<int64_t>(h) * m + orders[h][static_cast<size_t>(j)]] = kChosenByAttention;
                }
            }
        }
        if (!config.twoStage)
        {
            continue;
        }
        // model_level_refine: the allocated sinks stay, the two stages choose the rest of each head's count
        int32_t const sinkEnd = std::min(m, info.validStart + (keepsSinks(config) ? config.sinkTokens : 0));
        for (int32_t h = 0; h < heads; ++h)
        {
            int64_t const at = base + static_cast<int64_t>(h) * m;
            uint8_t* row = flags + at;
            int64_t const allocated = std::count_if(row, row + m, [](uint8_t f) { return f != 0; });
            int64_t sinks = 0;
            for (int32_t i = 0; i < m; ++i)
            {
                bool const sink = i >= info.validStart && i < sinkEnd && row[i] != 0;
                sinks += sink ? 1 : 0;
                row[i] = sink ? kKeptSink : 0;
            }
            selectHead(topK, config, attention + at, critical + at, row, m, info.validStart, allocated - sinks);
        }
    }
}

} // namespace criticalkv::host
