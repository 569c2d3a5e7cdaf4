// CPU emulation of defensivekv's block mass count (kernels/selection.cu, the section between "BEGIN block mass row"
// and "END block mass row", copied by the test to block_mass_row_section.inc) run by radixMassCount (defensive.h)
// with every thread of a 512-thread block, as selectDefensiveKernel does: one std::thread per CUDA thread,
// __syncthreads() a std::barrier, shared-memory atomics as std::atomic_ref. Each thread's count must equal the host's
// (select_host.cpp's HostMassRow through the same flow). Not built by CMake: compiled by
// tests/plugins/test_plugin_kernel_emulation.py.
//   block_mass_count_emulation SEED TRIALS   -> exit 0 when every thread of every trial agrees with the host
#include <atomic>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "cuda_emulation.h"

#include "criticalkv/defensive.h"

namespace criticalkv::kernels
{
constexpr int kSelectThreads = 512; // selection.cu's
struct SelectSmem                   // the fields the section uses
{
    uint32_t histogram[kRadixBins];
    unsigned long long sums[kRadixBins];
};
#include "block_mass_row_section.inc"
} // namespace criticalkv::kernels

using namespace criticalkv;

namespace
{

constexpr int kLevels[] = {1, 3, 50, 0};
constexpr float kLimits[] = {-0.1F, 0.0F, 1e-4F, 0.3F, 0.5F, 0.9F, 1.0F, 1.5F};

struct HostMassRow // the host driver's executor (select_host.cpp)
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
                ++counts[radixDigit(key, pass)];
                sums[radixDigit(key, pass)] += static_cast<unsigned long long>(fixedMass(scores[e]));
            }
        }
        return MassHistogram{counts, sums};
    }
};

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
    for (int trial = 0; trial < trials; ++trial)
    {
        int64_t const len = 1 + static_cast<int64_t>(rng() % 3000);
        int const levels = kLevels[trial % 4]; // 0: continuous
        std::vector<float> scores(static_cast<size_t>(len));
        double total = 0.0;
        for (auto& x : scores)
        {
            x = levels ? static_cast<float>(rng() % (levels + 1)) : std::uniform_real_distribution<float>(0, 1)(rng);
            x = rng() % 10 == 0 ? 0.0F : x;
            total += x;
        }
        for (auto& x : scores)
            x = total > 0 ? static_cast<float>(x / total) : 0.0F;
        std::vector<uint8_t> flags(static_cast<size_t>(len), 0);
        for (int64_t e = 0; e < len; ++e)
            flags[e] = rng() % 7 == 0 ? 1 : 0; // already chosen
        int64_t const firstValid = trial % 3 == 0 ? static_cast<int64_t>(rng() % (len / 4 + 1)) : 0;
        float const limit = kLimits[trial % 8];
        HostMassRow host{scores.data(), flags.data(), len, len, firstValid, {}, {}};
        int64_t const want = radixMassCount(host, limit);

        kernels::SelectSmem smem{};
        std::vector<int64_t> got(kernels::kSelectThreads, -1);
        std::barrier<> barrier(kernels::kSelectThreads);
        gBarrier = &barrier;
        std::vector<std::thread> pool;
        for (int t = 0; t < kernels::kSelectThreads; ++t)
        {
            pool.emplace_back([&, t] {
                threadIdx = {static_cast<unsigned>(t), 0, 0};
                kernels::BlockMassRow row{scores.data(), flags.data(), len, len, firstValid, smem};
                got[t] = radixMassCount(row, limit);
            });
        }
        for (auto& thread : pool)
            thread.join();
        for (int t = 0; t < kernels::kSelectThreads; ++t)
        {
            if (got[t] != want)
            {
                std::printf("trial %d (len %lld, limit %g): thread %d counted %lld, the host %lld\n", trial,
                    static_cast<long long>(len), limit, t, static_cast<long long>(got[t]), static_cast<long long>(want));
                ++failures;
                break;
            }
        }
    }
    std::printf("block mass count: %d of %d trials differ from the host\n", failures, trials);
    return failures == 0 ? 0 : 1;
}
