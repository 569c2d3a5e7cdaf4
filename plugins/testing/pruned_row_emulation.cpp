// CPU emulation of the kernels' pruned stage-2 block executor (kernels/pruned_row.cuh) running prunedStage2 (pruned_stage2.h) with
// every thread of a 512-thread block: one fiber per CUDA thread (cuda_emulation.h), __syncthreads() a barrier, shared-memory
// atomics std::atomic_ref. Per trial (one KV head's row after stage 1: bounds U, exact scores C <= U) the block must
// give the host driver's executor (host/pruned_row_host.h, linked with select_host.cpp) the same flags and the same
// number of exact scores computed, each computed once, and both must keep the unpruned top-k of C. Random and
// adversarial rows: tight bounds (U = C), all bounds equal, exact-score ties at the threshold, near-ties within the
// margin, padding. Also the GPU rounds' stop rule by count (stage2SettledByCount) == stage2Settled on this executor's
// k-th exact score. Not built by CMake: compiled by tests/plugins/test_plugin_kernel_emulation.py.
//   pruned_row_emulation SEED TRIALS   -> exit 0 when every trial agrees
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_emulation.h"

#include "pruned_row_host.h"

#include "criticalkv/radix_select.h"

#include "pruned_row.cuh"

using namespace criticalkv;

namespace
{

struct Row
{
    int32_t m;
    int32_t validStart;
    int64_t k;
    float margin;
    std::vector<float> bound, exact;
    std::vector<uint8_t> flags; // after stage 1
};

Row makeRow(std::mt19937& rng, int trial)
{
    Row r;
    r.m = 1 + static_cast<int32_t>(rng() % 2500);
    r.validStart = trial % 3 == 0 ? static_cast<int32_t>(rng() % (r.m / 3 + 1)) : 0;
    r.margin = trial % 2 == 0 ? stopMargin(576, 3) : stopMargin(4096, 4);
    r.bound.resize(r.m);
    r.exact.resize(r.m);
    r.flags.assign(r.m, 0);
    int const kind = trial % 6;
    int const levels = 1 + static_cast<int>(rng() % 8);
    for (int32_t i = 0; i < r.m; ++i)
    {
        float c = std::uniform_real_distribution<float>(0.0F, 1.0F)(rng);
        if (kind == 2 || kind == 3)
        {
            c = static_cast<float>(rng() % (levels + 1)) / static_cast<float>(levels); // exact-score ties
        }
        float u = c * std::uniform_real_distribution<float>(1.0F, 3.0F)(rng);
        if (kind == 1)
        {
            u = c; // tight bounds: the stop rule needs the margin
        }
        else if (kind == 3)
        {
            u = 2.0F; // every bound equal: the order is the index order
        }
        else if (kind == 4)
        {
            u = c * (1.0F + r.margin * static_cast<float>(rng() % 3)); // near-ties within the margin
        }
        else if (kind == 5)
        {
            u = c + 0.25F * static_cast<float>(rng() % 2); // bound far from C for half the tokens
        }
        r.exact[i] = c;
        r.bound[i] = u;
        r.flags[i] = rng() % 9 == 0 ? kChosenByAttention : 0;
    }
    int64_t eligible = 0;
    for (int32_t i = r.validStart; i < r.m; ++i)
    {
        eligible += r.flags[i] == 0 ? 1 : 0;
    }
    r.k = eligible > 1 ? 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(eligible - 1)) : 0;
    if (trial % 4 == 0 && eligible > 8)
    {
        r.k = 1 + static_cast<int64_t>(rng() % 4); // small k: many doubling rounds
    }
    return r;
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 3)
    {
        std::fprintf(stderr, "usage: %s SEED TRIALS\n", argv[0]);
        return 2;
    }
    std::mt19937 rng(static_cast<unsigned>(std::atoi(argv[1])));
    int const trials = std::atoi(argv[2]);
    int failures = 0;
    int64_t computed = 0;
    int64_t total = 0;
    for (int trial = 0; trial < trials; ++trial)
    {
        Row r = makeRow(rng, trial);
        std::vector<int32_t> order;
        for (int32_t i = r.validStart; i < r.m; ++i)
        {
            if (r.flags[i] == 0)
            {
                order.push_back(i);
            }
        }
        int64_t const eligible = static_cast<int64_t>(order.size());
        if (r.k <= 0 || r.k >= eligible)
        {
            continue; // selectHeadPruned handles these without the flow
        }
        // The unpruned selection: top-k of every exact score.
        std::vector<uint8_t> want = r.flags;
        host::selectTopK(r.exact.data(), want.data(), r.m, r.m, r.validStart, r.k, kChosenByCritical);

        // The host driver's executor.
        std::vector<uint8_t> hostFlags = r.flags;
        std::stable_sort(order.begin(), order.end(),
            [&](int32_t x, int32_t y) { return r.bound[x] > r.bound[y]; });
        auto hostScore = [&](int32_t i) { return r.exact[i]; };
        host::HostPrunedRow<decltype(hostScore)> hostRow{hostScore, r.bound.data(), hostFlags.data(), r.m,
            r.validStart, order, std::vector<float>(static_cast<size_t>(r.m), -INFINITY), 0};
        int64_t const hostDone = prunedStage2(hostRow, r.k, eligible, r.margin);

        // The block executor, every thread of a 512-thread block.
        std::vector<uint8_t> blockFlags = r.flags;
        std::vector<float> scratch(static_cast<size_t>(r.m), -INFINITY);
        std::vector<int> calls(static_cast<size_t>(r.m), 0);
        kernels::PrunedSmem smem{};
        std::vector<int64_t> got(kernels::kPrunedThreads, -1);
        runBlockFibers(0, 0, 0, kernels::kPrunedThreads, [&] {
            auto score = [&](int32_t i) {
                ++calls[i]; // one thread owns token i
                return r.exact[i];
            };
            kernels::BlockPrunedRow<decltype(score)> row{score, r.bound.data(), scratch.data(), blockFlags.data(), r.m,
                r.validStart, smem};
            got[threadIdx.x] = prunedStage2(row, r.k, eligible, r.margin);
        });
        int64_t called = 0;
        bool twice = false;
        for (int c : calls)
        {
            called += c;
            twice = twice || c > 1;
        }
        bool ok = hostFlags == want && blockFlags == want && called == hostDone && !twice;
        for (int t = 0; t < kernels::kPrunedThreads; ++t)
        {
            ok = ok && got[t] == hostDone;
        }
        if (!ok)
        {
            int64_t diffHost = 0, diffBlock = 0;
            for (int32_t i = 0; i < r.m; ++i)
            {
                diffHost += hostFlags[i] != want[i] ? 1 : 0;
                diffBlock += blockFlags[i] != want[i] ? 1 : 0;
            }
            std::printf("trial %d (m %d, k %lld, eligible %lld): host done %lld, block done %lld, calls %lld%s; "
                        "flags differing from the unpruned: host %lld, block %lld\n",
                trial, r.m, static_cast<long long>(r.k), static_cast<long long>(eligible),
                static_cast<long long>(hostDone), static_cast<long long>(got[0]), static_cast<long long>(called),
                twice ? " (a token computed twice)" : "", static_cast<long long>(diffHost),
                static_cast<long long>(diffBlock));
            ++failures;
        }
        computed += hostDone;
        total += eligible;
    }
    std::printf("pruned row: %d of %d trials differ; exact scores computed for %lld of %lld eligible tokens\n",
        failures, trials, static_cast<long long>(computed), static_cast<long long>(total));

    // The GPU rounds' stop rule (stage2SettledByCount: how many candidates clear the threshold) against stage2Settled
    // on the k-th exact score as this executor's kthExact finds it (the k best in radix order, then the smallest
    // non-NaN of them), on candidates with NaN, infinite, signed-zero and tied scores.
    float const special[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0F, -0.0F, 0.5F, 1.0F, 2.0F};
    int const cases = 50 * trials;
    int stopFailures = 0;
    for (int trial = 0; trial < cases; ++trial)
    {
        int32_t const count = 1 + static_cast<int32_t>(rng() % 40);
        std::vector<float> exact(static_cast<size_t>(count));
        for (float& x : exact)
        {
            x = rng() % 3 == 0 ? special[rng() % 9] : static_cast<float>(static_cast<int>(rng() % 17) - 8) / 4.0F;
        }
        int64_t const k = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(count));
        std::vector<uint8_t> best(static_cast<size_t>(count), 0);
        host::selectTopK(exact.data(), best.data(), count, count, 0, k, 1);
        float kth = INFINITY;
        for (int32_t i = 0; i < count; ++i)
        {
            kth = best[i] != 0 && exact[i] < kth ? exact[i] : kth;
        }
        // the best bound left out: never NaN (a maximum by float comparisons), -inf when every token is a candidate
        float const following = rng() % 2 == 0 ? special[2 + rng() % 7] : exact[rng() % exact.size()];
        if (std::isnan(following))
        {
            continue;
        }
        float const margin = trial % 2 == 0 ? stopMargin(576, 3) : 0.0F;
        int64_t clearing = 0;
        for (float x : exact)
        {
            clearing += !(x <= stopThreshold(following, margin)) ? 1 : 0;
        }
        if (stage2Settled(following, kth, margin) != stage2SettledByCount(following, clearing, k, margin))
        {
            if (stopFailures < 5)
            {
                std::printf("stop rule: following %g, k %lld, kth %g, clearing %lld: settled %d by kth, %d by count\n",
                    following, static_cast<long long>(k), kth, static_cast<long long>(clearing),
                    stage2Settled(following, kth, margin) ? 1 : 0,
                    stage2SettledByCount(following, clearing, k, margin) ? 1 : 0);
            }
            ++stopFailures;
        }
    }
    std::printf("stop rule by count: %d of %d cases differ\n", stopFailures, cases);
    return failures == 0 && stopFailures == 0 ? 0 : 1;
}
