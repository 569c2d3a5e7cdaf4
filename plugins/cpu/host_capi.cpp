// extern "C" shims of libcriticalkv_host.so: the host C++ version and the shared helpers, for ctypes tests.
// Every entry point catches exceptions and reports them through (err, errLen); none throws across the ABI.
#include "select_host.h"

#include "ckv_field.h"

#include "criticalkv/budget_host.h"
#include "criticalkv/policy.h"
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

    //! The layer's selectable budget r_l (PyramidKV applied) of the policy given by fields; -1 on error.
    int64_t ckv_layer_budget(CkvField const* fields, int32_t count)
    {
        try
        {
            PolicyConfig config;
            if (!parse(fields, count, config, nullptr, 0))
            {
                return -1;
            }
            return makeSelectConfig(config).layerBudget;
        }
        catch (std::exception const&)
        {
            return -1;
        }
    }

    //! max_kept_per_head(policy, n, kv_heads, layer_idx, num_layers) of the policy given by fields; -1 on error.
    int64_t ckv_max_kept_per_head(CkvField const* fields, int32_t count, int64_t n, int64_t kvHeads)
    {
        try
        {
            PolicyConfig config;
            if (!parse(fields, count, config, nullptr, 0))
            {
                return -1;
            }
            SelectConfig const c = makeSelectConfig(config);
            return maxKeptPerHead(c.base, config.budget, config.window, config.ada_floor, config.pyramid_beta, n,
                kvHeads, config.layer_idx, config.num_layers);
        }
        catch (std::exception const&)
        {
            return -1;
        }
    }

    int64_t ckv_stage1_count(double alpha, int64_t r)
    {
        return stage1Count(alpha, r);
    }

    int64_t ckv_head_floor(double adaFloor, int64_t r)
    {
        return headFloor(adaFloor, r);
    }

    //! pyramid_layer_budgets(r, num_layers, beta) into out[num_layers]; 0 on success.
    int32_t ckv_pyramid_layer_budgets(int64_t r, int32_t numLayers, double beta, int64_t* out)
    {
        try
        {
            std::vector<int64_t> const budgets = pyramidLayerBudgets(r, numLayers, beta);
            std::copy(budgets.begin(), budgets.end(), out);
            return 0;
        }
        catch (std::exception const&)
        {
            return 1;
        }
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

    //! The whole operator on fp32 host arrays. shape = {B, H, H_kv, n, queryLen, d_h, hidden}; lengths may be
    //! nullptr; keptKeys / keptValues may be nullptr. Returns 0, or non-zero with the error in err.
    int32_t ckv_host_select_layer(CkvField const* fields, int32_t count, int32_t const* shape, float const* queries,
        float const* keys, float const* values, float const* oProj, int32_t const* promptLengths, int32_t* keptIndices,
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
            host::selectLayer(makeSelectConfig(config), s,
                host::HostInputs{queries, keys, values, oProj, promptLengths},
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
