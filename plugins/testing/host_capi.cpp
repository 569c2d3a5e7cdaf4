// extern "C" shims of libcriticalkv_host.so: the host C++ version and the shared helpers, for ctypes tests.
// Every entry point catches exceptions and reports them through (err, errLen); none throws across the ABI.
#include "select_host.h"
#include "pruned_row_host.h"

#include "ckv_field.h"

#include "budget_host.h"
#include "policy.h"
#include "criticalkv/radix.h"

#include <cstring>
#include <exception>
#include <string>
#include <vector>

using namespace criticalkv;

namespace
{

using capi::writeMessage;

bool parse(CkvField const* fields, int32_t count, PolicyConfig& config, char* err, int32_t errLen)
{
    return capi::parseFields(fields, count, config, err, errLen);
}

void writeError(std::string const& message, char* err, int32_t errLen)
{
    writeMessage(message, err, errLen);
}

} // namespace

extern "C"
{

    //! 0 when the fields make a valid policy, else 1 with the error ("field: reason") in err.
    int32_t ckv_parse_policy(CkvField const* fields, int32_t count, char* err, int32_t errLen)
    {
        try
        {
            PolicyConfig config;
            return parse(fields, count, config, err, errLen) ? 0 : 1;
        }
        catch (std::exception const& e)
        {
            writeError(e.what(), err, errLen);
            return 2;
        }
    }

    //! The parsed policy in describePolicy form (float fields widened from float32) for round-trip checks.
    int32_t ckv_describe_policy(CkvField const* fields, int32_t count, char* out, int32_t outLen)
    {
        try
        {
            PolicyConfig config;
            if (!parse(fields, count, config, out, outLen))
            {
                return 1;
            }
            writeError(describePolicy(config), out, outLen);
            return 0;
        }
        catch (std::exception const& e)
        {
            writeError(e.what(), out, outLen);
            return 2;
        }
    }

    //! The effective budget b and the layer's selectable budget r_l of the policy given by fields, for the runtime
    //! budget *kvBudget (nullptr: the built one), resolved like the kernels; 0, or 1 with the error in err.
    int32_t ckv_budget_choice(CkvField const* fields, int32_t count, int32_t const* kvBudget, int32_t* budgetOut,
        int32_t* layerBudgetOut, char* err, int32_t errLen)
    {
        try
        {
            PolicyConfig config;
            if (!parse(fields, count, config, err, errLen))
            {
                return 1;
            }
            SelectConfig const c = makeSelectConfig(config);
            int32_t resolved = 0;
            RuntimeBudget runtime{kvBudget, nullptr};
            if (kvBudget != nullptr && c.budgetTable)
            {
                resolved = host::resolveLayerBudget(c, budgetTable(config), kvBudget);
                runtime.layerBudget = &resolved;
            }
            BudgetChoice const choice = resolveBudget(c, runtime);
            *budgetOut = choice.budget;
            *layerBudgetOut = choice.layerBudget;
            return 0;
        }
        catch (std::exception const& e)
        {
            writeError(e.what(), err, errLen);
            return 2;
        }
    }

    //! max_kept_per_head of the policy given by fields at the runtime budget *kvBudget (nullptr: the built one).
    int64_t ckv_max_kept_per_head(CkvField const* fields, int32_t count, int32_t const* kvBudget, int64_t n,
        int64_t kvHeads)
    {
        int32_t budget = 0;
        int32_t layerBudget = 0;
        if (ckv_budget_choice(fields, count, kvBudget, &budget, &layerBudget, nullptr, 0) != 0)
        {
            return -1;
        }
        PolicyConfig config;
        parse(fields, count, config, nullptr, 0);
        return maxKeptPerHead(makeSelectConfig(config), BudgetChoice{budget, layerBudget}, n, kvHeads);
    }

    int64_t ckv_stage1_count(int64_t alphaMicros, int64_t r)
    {
        return stage1Count(alphaMicros, r);
    }

    int64_t ckv_head_floor(int64_t floorMicros, int64_t r)
    {
        return headFloor(floorMicros, r);
    }

    int64_t ckv_decimal_micros(double value)
    {
        return decimalMicros(value);
    }

    uint32_t ckv_ordered_key(float value)
    {
        return orderedKey(value);
    }

    double ckv_widen_float32(float value)
    {
        return widenFloat32(value);
    }

    //! The radix select of the kernels, run on the host: marks the k best candidates with `mark`.
    void ckv_select_top_k(float const* scores, uint8_t* flags, int64_t len, int64_t period, int64_t firstValid,
        int64_t k, uint8_t mark)
    {
        host::selectTopK(scores, flags, len, period, firstValid, k, mark);
    }

    //! defensivekv's stage-1 count on the host (radixMassCount).
    int64_t ckv_mass_count(float const* scores, uint8_t const* flags, int64_t len, int64_t period, int64_t firstValid,
        float limit)
    {
        return host::massCount(scores, flags, len, period, firstValid, limit);
    }

    //! The host driver's pruned stage 2 of one row (prunedStage2 with HostPrunedRow) on precomputed exact scores:
    //! flags [m] after stage 1, updated in place. Returns how many exact scores it used, -1 unless 0 < k < eligible.
    int64_t ckv_host_pruned_row(float const* bound, float const* scores, uint8_t* flags, int32_t m,
        int32_t validStart, int64_t k, float margin)
    {
        std::vector<int32_t> order;
        for (int32_t i = validStart; i < m; ++i)
        {
            if (flags[i] == 0)
            {
                order.push_back(i);
            }
        }
        int64_t const eligible = static_cast<int64_t>(order.size());
        if (k <= 0 || k >= eligible)
        {
            return -1;
        }
        std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return bound[x] > bound[y]; });
        auto score = [scores](int32_t i) { return scores[i]; };
        host::HostPrunedRow<decltype(score)> row{score, bound, flags, m, validStart, order,
            std::vector<float>(static_cast<size_t>(m), -INFINITY), 0};
        return prunedStage2(row, k, eligible, margin);
    }

    //! The pruned stage 2's L1 upper bounds out [B, H, numTokens] (host::l1UpperBounds). shape = {B, H, H_kv, n,
    //! queryLen, d_h, hidden}.
    void ckv_host_l1_bounds(int32_t const* shape, float const* values, float const* oProj, int32_t numTokens,
        float* out)
    {
        SelectShape const s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6]};
        for (int32_t b = 0; b < s.batch; ++b)
        {
            for (int32_t h = 0; h < s.heads; ++h)
            {
                host::l1UpperBounds(s, values, oProj, b, h, numTokens,
                    out + (static_cast<int64_t>(b) * s.heads + h) * numTokens);
            }
        }
    }

    //! The whole operator on fp32 host arrays. shape = {B, H, H_kv, n, queryLen, d_h, hidden}; lengths and kvBudget
    //! may be nullptr; keptKeys / keptValues may be nullptr. Returns 0, or non-zero with the error in err.
    int32_t ckv_host_select_layer(CkvField const* fields, int32_t count, int32_t const* shape, float const* queries,
        float const* keys, float const* values, float const* oProj, int32_t const* promptLengths,
        int32_t const* kvBudget, int32_t* keptIndices,
        int32_t* keptLengths, float* keptKeys, float* keptValues, char* err, int32_t errLen)
    {
        try
        {
            PolicyConfig config;
            if (!parse(fields, count, config, err, errLen))
            {
                return 1;
            }
            SelectShape const s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6]};
            host::selectLayer(makeSelectConfig(config), budgetTable(config), s,
                host::HostInputs{queries, keys, values, oProj, promptLengths, kvBudget},
                host::HostOutputs{keptIndices, keptLengths, keptKeys, keptValues});
            return 0;
        }
        catch (std::exception const& e)
        {
            writeError(e.what(), err, errLen);
            return 2;
        }
    }

} // extern "C"
