// The host driver's executor of prunedStage2 (criticalkv/pruned_stage2.h), shared by select_host.cpp and the CPU
// emulation of the kernels' block executor (plugins/testing/pruned_row_emulation.cpp), which must agree with it.
#pragma once

#include "select_host.h"

#include "criticalkv/pruned_stage2.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

namespace criticalkv::host
{

constexpr uint8_t kLeftOut = 255; //!< an eligible token whose exact score was not needed (cleared afterwards)

//! prunedStage2's executor (pruned_stage2.h) as loops over one row: `order` is the eligible tokens sorted by bound
//! (stable, so ties go to the lower index), its first `done` the candidates.
template <typename ExactScore>
struct HostPrunedRow
{
    ExactScore& exactScore;
    float const* bound;
    uint8_t* flags;
    int32_t m;
    int32_t validStart;
    std::vector<int32_t> const& order;
    std::vector<float> exact;
    int64_t done;

    void addCandidates(int64_t count)
    {
        for (int64_t j = done; j < done + count; ++j)
        {
            exact[order[j]] = exactScore(order[j]);
        }
        done += count;
    }

    float nextBound() const
    {
        return done < static_cast<int64_t>(order.size()) ? bound[order[done]] : -INFINITY;
    }

    float kthExact(int64_t k) const
    {
        std::vector<float> best;
        for (int64_t j = 0; j < done; ++j)
        {
            best.push_back(exact[order[j]]);
        }
        std::nth_element(best.begin(), best.begin() + (k - 1), best.end(), std::greater<float>());
        return best[k - 1];
    }

    void keepBest(int64_t k)
    {
        int64_t const eligible = static_cast<int64_t>(order.size());
        for (int64_t j = done; j < eligible; ++j)
        {
            flags[order[j]] = kLeftOut;
        }
        selectTopK(exact.data(), flags, m, m, validStart, k, kChosenByCritical);
        for (int64_t j = done; j < eligible; ++j)
        {
            flags[order[j]] = 0;
        }
    }
};

} // namespace criticalkv::host
