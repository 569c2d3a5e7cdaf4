// The model-level selection (layer-defensivekv, layer-kvzip, layer-kvzip-criticalkv): every head of every layer is
// ranked together after the last layer (criticalkv/selection/layer.py: _select_model_level, model_level_mask,
// model_level_refine; criticalkv/methods/defensivekv.py: LayerDefensiveKV.model_allocate, nested_capped_mask). Shared
// by the kernels (kernels/model_level.cuh) and the host driver (host/model_host.cpp).
//
// The model's N = L * H_kv heads are rows of one [B, N, m] ranking, layer-major (head g of layer l is row l H_kv + g).
// Per sequence, r = min(valid older tokens, b - window) and every head has the same `available` = valid older tokens.
//   * no head cap (head_cap_ratio 0): the shared allocation with N heads (shared_allocation.h): each head its own top
//     floor(r), the other N (r - floor) slots over the flattened ranking (ties: lower layer, head, position);
//   * head_cap_ratio c > 0: the allocation nested in the budget. Level t = 1 .. r (the budget t + window): every head
//     first holds at least min(available, floor(t)); then the set grows to N t entries by the best need = N t - sum
//     entries among each head's next min(N, limit - held) entries of its own ranking, limit = min(available,
//     levelCap(t)) (ties: lower head, then the head's own order); the kept set of a head is its top `held` entries.
//     A head only ever holds entries of its own top min(available, levelCap(r)), so those are all a level reads.
// CriticalKV's two stages then choose inside each head's count (layer-kvzip-criticalkv): the allocated sinks first,
// then stage 1 by the base's score and stage 2 by the critical score over the rest (head_selection.h).
#pragma once

#include "criticalkv/budget.h"
#include "criticalkv/methods.h"
#include "criticalkv/radix.h"

namespace criticalkv
{

//! Offset that ranks a layer-kvzip sink above every other entry of the model-wide ranking (kvzip.py: SINK_OFFSET;
//! KVzip scores lie in [0, 1]). defensivekv's stage-1 tokens use the same offset (DefensiveKV::stage1Ranking).
constexpr float kSinkOffset = 2.0F;

//! Flag of a sink the model-wide allocation gave its head: kept, and out of the two stages' candidates.
constexpr uint8_t kKeptSink = 3;

//! A model of `layers` layers of one shape (every layer's B, H, H_kv, n, d_h, hidden are the same).
struct ModelShape
{
    SelectShape layer;
    int32_t layers;
};

//! N = L * H_kv, the heads of the model-wide ranking.
CKV_HD int32_t modelHeads(ModelShape const& shape)
{
    return shape.layers * shape.layer.kvHeads;
}

//! The rows of the model-wide ranking as one SelectShape: kvHeads = N, the other dimensions the layers'.
CKV_HD SelectShape modelRows(ModelShape const& shape)
{
    SelectShape rows = shape.layer;
    rows.kvHeads = modelHeads(shape);
    rows.heads = rows.kvHeads; // one query head per row: nothing reads the query heads of the model-wide rows
    return rows;
}

//! head_cap(ratio, b): floor(ratio * b) entries per head, window included (budget.py: head_cap); 0 when off.
CKV_HD int64_t headCap(int64_t ratioMicros, int64_t budget)
{
    return ratioMicros * budget / kDecimalScale;
}

//! older_cap at level t (the budget t + window): the older tokens a head may hold once the nested allocation reached t
//! (defensivekv.py: level_caps).
CKV_HD int64_t levelCap(int64_t ratioMicros, int32_t window, int64_t t)
{
    return headCap(ratioMicros, t + window) - window;
}

//! Whether the model-level allocation is capped (and so nested level by level).
CKV_HD bool modelCapped(SelectConfig const& config)
{
    return config.headCapMicros > 0;
}

//! The entries of its own ranking a head may ever hold in a capped allocation of r levels: its top
//! min(available, levelCap(r)) (levelCap grows with t; at least r, since the ratio is >= 1).
CKV_HD int64_t modelCandidates(SelectConfig const& config, int64_t available, int64_t r)
{
    if (r <= 0 || available <= 0)
    {
        return 0;
    }
    int64_t const cap = levelCap(config.headCapMicros, config.window, r);
    return cap < available ? cap : available;
}

//! A host bound of every head's candidates under a head cap: min(m, levelCap(budget - window)) at the built budget.
inline int32_t modelSortStride(SelectConfig const& config, int32_t m)
{
    int64_t const r = config.budget - config.window;
    int64_t const cap = modelCapped(config) ? levelCap(config.headCapMicros, config.window, r) : 0;
    return static_cast<int32_t>(cap < m ? (cap > 0 ? cap : 0) : m);
}

//! One head at one level: it holds at least `low` entries, and the level may add its next `window` ones.
struct LevelSpan
{
    int64_t low;
    int64_t window;
};

//! The span of a head holding `held` entries at level t (defensivekv.py: nested_capped_mask's counts1 and room).
CKV_HD LevelSpan levelSpan(SelectConfig const& config, int64_t held, int64_t available, int64_t t, int32_t heads)
{
    int64_t const cap = levelCap(config.headCapMicros, config.window, t);
    int64_t const limit = cap < available ? cap : available;
    int64_t const floorT = headFloor(config.adaFloorMicros, t);
    int64_t const floor = floorT < available ? floorT : available;
    int64_t const low = held > floor ? held : floor;
    int64_t room = limit - low;
    room = room < 0 ? 0 : (room > heads ? heads : room);
    return LevelSpan{low, room};
}

//! The ranking score of one older token of a layer-kvzip layer: its KVzip score, a sink (the first sink_tokens valid
//! older tokens) above every other (kvzip.py: LayerKVzip.priority).
CKV_HD float sinkRanking(float score, bool sink)
{
    return score + (sink ? kSinkOffset : 0.0F);
}

} // namespace criticalkv
