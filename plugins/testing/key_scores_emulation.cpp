// CPU emulation of the key-score pass (kernels/key_scores.cuh) of every key-scored method of the C++ registry
// (criticalkv/methods/registry.h), included as is and run with every CTA's threads as fibers (cuda_emulation.h), beside
// the host driver's pass (host/select_host.cpp: keyScores). Not built by CMake: tests/plugins/test_key_scores_emulation.py
// compiles it and compares both with each method's PyTorch reference.
//   key_scores_emulation IN OUT
// IN: int32 header [B, H_kv, n, d_h, window, budget], int32 lengths [B], float32 keys [B, H_kv, n, d_h].
// OUT: per registered method: int32 its BaseMethod value, float32 the kernel's scores, the host driver's scores, each
//     [B, H_kv, n] (NaN where neither writes: sequences kept whole; [m, n) as each leaves it).
#include "cuda_emulation.h"

#include "key_scores.cuh"
#include "select_host.h"

#include "criticalkv/methods/registry.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <vector>

using namespace criticalkv;

namespace
{

struct HostKeys
{
    float const* keys;
    int32_t kvHeads, n, d;

    float operator()(int32_t b, int32_t g, int32_t j, int32_t c) const
    {
        return keys[((static_cast<int64_t>(b) * kvHeads + g) * n + j) * d + c];
    }
};

struct Problem
{
    SelectShape shape;
    int32_t window, budget;
    std::vector<int32_t> lengths;
    std::vector<float> keys;
};

template <typename Method>
void runMethod(Problem const& p, std::ofstream& out)
{
    SelectConfig config{};
    config.base = Method::kBase;
    config.budget = p.budget;
    config.minBudget = p.window;
    config.window = p.window;
    config.poolKernel = 1;
    config.layerBudget = p.budget - p.window;
    config.capacity = p.shape.n;
    RuntimeBudget const budget{nullptr, nullptr};
    SelectShape const& s = p.shape;
    size_t const cells = static_cast<size_t>(s.batch) * s.kvHeads * s.n;
    std::vector<float> kernel(cells, NAN), host(cells, NAN);
    kernels::KeyScoreArgs const args{config, s, p.lengths.data(), budget, kernel.data()};
    HostKeys const keys{p.keys.data(), s.kvHeads, s.n, s.headDim};
    emulateLaunch({static_cast<unsigned>(s.kvHeads), static_cast<unsigned>(s.batch), 1}, kernels::kKeyScoreThreads,
        [&] { kernels::keyScoresKernel<Method>(args, keys); });
    for (int32_t b = 0; b < s.batch; ++b)
    {
        SequenceInfo const info = sequenceInfo(config, budget, s, p.lengths.data(), b);
        for (int32_t g = 0; g < s.kvHeads && info.compress; ++g)
        {
            host::keyScores(config, s, p.keys.data(), b, g, info.validStart,
                &host[(static_cast<size_t>(b) * s.kvHeads + g) * s.n]);
        }
    }
    int32_t const base = static_cast<int32_t>(Method::kBase);
    out.write(reinterpret_cast<char const*>(&base), sizeof(base));
    out.write(reinterpret_cast<char const*>(kernel.data()), static_cast<std::streamsize>(cells * sizeof(float)));
    out.write(reinterpret_cast<char const*>(host.data()), static_cast<std::streamsize>(cells * sizeof(float)));
}

template <typename... Methods>
void runAll(MethodList<Methods...>, Problem const& p, std::ofstream& out)
{
    (runMethod<Methods>(p, out), ...);
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 3)
    {
        std::fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
        return 2;
    }
    std::ifstream in(argv[1], std::ios::binary);
    int32_t header[6] = {};
    in.read(reinterpret_cast<char*>(header), sizeof(header));
    Problem p{};
    p.shape = SelectShape{header[0], header[1], header[1], header[2], header[4], header[3], 1};
    p.window = header[4];
    p.budget = header[5];
    p.lengths.resize(static_cast<size_t>(header[0]));
    in.read(reinterpret_cast<char*>(p.lengths.data()), static_cast<std::streamsize>(p.lengths.size() * sizeof(int32_t)));
    p.keys.resize(static_cast<size_t>(header[0]) * header[1] * header[2] * header[3]);
    in.read(reinterpret_cast<char*>(p.keys.data()), static_cast<std::streamsize>(p.keys.size() * sizeof(float)));
    if (!in)
    {
        std::fprintf(stderr, "%s: short input\n", argv[1]);
        return 2;
    }
    std::ofstream out(argv[2], std::ios::binary);
    runAll(KeyScoredMethods{}, p, out);
    return out ? 0 : 1;
}
