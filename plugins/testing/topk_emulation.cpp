// CPU emulation of the batched top-k (kernels/topk_device.cuh, included as is): runTopK / runMassCount's launches
// with every CTA's threads as fibers (cuda_emulation.h), the CTAs of a launch one after another. Beside it, the
// host driver's sequential radix select and mass count (host/select_host.cpp) on the same rows. Not built by CMake:
// tests/plugins/test_plugin_kernel_emulation.py compiles it with g++ and compares the marks with topk_mask.
//   topk_emulation IN OUT
// IN: int32 rows, len, period, mark, levels; float scores[rows * len]; uint8 flags[rows * len]; int64 k[levels * rows];
//     int32 firstValid[rows]; float limit[rows]. With levels > 1 the host driver's flags are its radix select run per
//     level on the original flags, an entry taking mark + the first level that keeps it.
// OUT: uint8 flags[rows * len] (emulated kernels), uint8 flags[rows * len] (host driver), int64 count[rows]
//      (emulated mass count), int64 count[rows] (host driver), int32 ctasPerRow. The mass count runs on |score| of
//      the finite scores normalised per row (stage 1's masses), with the given flags.
#include "cuda_emulation.h"

#include "select_host.h"
#include "topk_emulated_launch.h"

#include <cmath>
#include <cstdio>
#include <vector>

using namespace criticalkv;

namespace
{

template <typename T>
bool readAll(std::FILE* f, std::vector<T>& v)
{
    return std::fread(v.data(), sizeof(T), v.size(), f) == v.size();
}

template <typename T>
void writeAll(std::FILE* f, std::vector<T> const& v)
{
    std::fwrite(v.data(), sizeof(T), v.size(), f);
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 3)
    {
        std::fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
        return 2;
    }
    std::FILE* in = std::fopen(argv[1], "rb");
    int32_t header[5];
    if (in == nullptr || std::fread(header, sizeof(int32_t), 5, in) != 5)
    {
        std::fprintf(stderr, "cannot read %s\n", argv[1]);
        return 2;
    }
    int32_t const rows = header[0], len = header[1], period = header[2], levels = header[4] > 1 ? header[4] : 1;
    size_t const total = static_cast<size_t>(rows) * static_cast<size_t>(len);
    std::vector<float> scores(total), limit(static_cast<size_t>(rows));
    std::vector<uint8_t> flags(total);
    std::vector<int64_t> k(static_cast<size_t>(rows) * levels);
    std::vector<int32_t> firstValid(static_cast<size_t>(rows));
    if (!readAll(in, scores) || !readAll(in, flags) || !readAll(in, k) || !readAll(in, firstValid)
        || !readAll(in, limit))
    {
        std::fprintf(stderr, "short input\n");
        return 2;
    }
    std::fclose(in);

    TopKRows p{scores.data(), nullptr, k.data(), firstValid.data(), rows, len, len, period,
        static_cast<uint8_t>(header[3]), levels};
    std::vector<uint8_t> device = flags;
    p.flags = device.data();
    std::vector<unsigned char> scratch(topKScratchBytes(rows, len, levels) + massCountScratchBytes(rows, len) + 1);
    // garbage in the scratch: the launches must not depend on its contents
    std::fill(scratch.begin(), scratch.end(), static_cast<unsigned char>(0xa5));
    EmulatedTopKLaunch launch{scratch.data()};
    if (!kernels::runTopK(p, scratch.data(), topKScratchBytes(rows, len, levels), launch))
    {
        std::fprintf(stderr, "runTopK refused the rows\n");
        return 1;
    }
    // The mass count's rows: |score| of the finite scores, normalised per row (masses, as stage 1's)
    std::vector<float> mass(total, 0.0F);
    for (int32_t r = 0; r < rows; ++r)
    {
        double sum = 0.0;
        for (int32_t e = 0; e < len; ++e)
        {
            float const x = scores[static_cast<size_t>(r) * len + e];
            mass[static_cast<size_t>(r) * len + e] = std::isfinite(x) ? std::fabs(x) : 0.0F;
            sum += mass[static_cast<size_t>(r) * len + e];
        }
        for (int32_t e = 0; e < len && sum > 0.0; ++e)
        {
            mass[static_cast<size_t>(r) * len + e] = static_cast<float>(mass[static_cast<size_t>(r) * len + e] / sum);
        }
    }
    std::vector<uint8_t> host = flags;
    std::vector<int64_t> deviceCount(static_cast<size_t>(rows), -1), hostCount(static_cast<size_t>(rows), -1);
    for (int32_t r = 0; r < rows; ++r)
    {
        size_t const at = static_cast<size_t>(r) * len;
        for (int32_t l = levels - 1; l >= 0; --l) // the first level keeping an entry marks it last
        {
            std::vector<uint8_t> level(flags.begin() + static_cast<std::ptrdiff_t>(at),
                flags.begin() + static_cast<std::ptrdiff_t>(at + len));
            host::selectTopK(&scores[at], level.data(), len, period, firstValid[r], k[static_cast<size_t>(l) * rows + r],
                static_cast<uint8_t>(p.mark + l));
            for (int32_t e = 0; e < len; ++e)
            {
                host[at + e] = level[e] != flags[at + e] ? level[e] : host[at + e];
            }
        }
        hostCount[r] = host::massCount(&mass[at], &flags[at], len, period, firstValid[r], limit[r]);
    }
    TopKRows m = p;
    m.scores = mass.data();
    m.flags = flags.data(); // the mass count reads the flags as given
    std::fill(scratch.begin(), scratch.end(), static_cast<unsigned char>(0x5a));
    launch.limit = limit.data();
    launch.count = deviceCount.data();
    if (!kernels::runMassCount(m, limit.data(), deviceCount.data(), scratch.data(), massCountScratchBytes(rows, len),
            launch))
    {
        std::fprintf(stderr, "runMassCount refused the rows\n");
        return 1;
    }
    std::FILE* out = std::fopen(argv[2], "wb");
    writeAll(out, device);
    writeAll(out, host);
    writeAll(out, deviceCount);
    writeAll(out, hostCount);
    int32_t const ctas = topKPlan(rows, len).ctasPerRow;
    std::fwrite(&ctas, sizeof(ctas), 1, out);
    std::fclose(out);
    return 0;
}
