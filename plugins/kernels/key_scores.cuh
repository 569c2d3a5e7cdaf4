// The key-score pass of a key-scored method (criticalkv/key_scores.h) as one kernel template over the method's struct
// (criticalkv/methods/<name>.h) and the keys' loader. Plain CUDA C++ with no CUDA header of its own, so that the
// emulation test (testing/key_scores_emulation.cpp) compiles this very file with g++ and runs it on the CPU.
#pragma once

#include "criticalkv/common.h" // CKV_BLOCK_SHARED
#include "criticalkv/key_scores.h"
#include "criticalkv/select_params.h"

namespace criticalkv::kernels
{

//! Threads of a key-score block: at least one per anchor entry.
constexpr int32_t kKeyScoreThreads = 256;
static_assert(kKeyScoreThreads >= kMaxAnchorDim, "one thread per anchor entry");

//! Arguments of keyScoresKernel.
struct KeyScoreArgs
{
    SelectConfig config;
    SelectShape shape;
    int32_t const* promptLengths;
    RuntimeBudget budget;
    float* scores; //!< [B, H_kv, n]: the scores of the older tokens in [0, m), 0 on left padding
};

//! One block per KV head of a compressed sequence, grid (H_kv, B), kKeyScoreThreads threads: the factors of the valid
//! keys (parked in `scores`), the anchor in shared memory (thread c sums entry c in position order, one thread
//! finishes it), then the scores of the older tokens over the factors. keys(b, g, j, c): entry c of key j of head g.
CKV_FLOW_TEMPLATE
template <typename Method, typename Keys>
__global__ void __launch_bounds__(kKeyScoreThreads) keyScoresKernel(KeyScoreArgs a, Keys keys)
{
    CKV_BLOCK_SHARED float anchor[kMaxAnchorDim];
    int32_t const g = static_cast<int32_t>(blockIdx.x);
    int32_t const b = static_cast<int32_t>(blockIdx.y);
    int32_t const tid = static_cast<int32_t>(threadIdx.x);
    SequenceInfo const info = sequenceInfo(a.config, a.budget, a.shape, a.promptLengths, b);
    if (!info.compress)
    {
        return;
    }
    int32_t const n = a.shape.n;
    int32_t const d = a.shape.headDim;
    int32_t const m = n - windowLength(a.config, n);
    float* out = a.scores + (static_cast<int64_t>(b) * a.shape.kvHeads + g) * n;
    for (int32_t j = tid; j < n; j += kKeyScoreThreads)
    {
        auto const key = [&keys, b, g, j](int32_t c) { return keys(b, g, j, c); };
        out[j] = j < info.validStart ? 0.0F : Method::keyFactor(key, d);
    }
    __syncthreads();
    if (tid < d)
    {
        float sum = 0.0F;
        for (int32_t j = info.validStart; j < n; ++j)
        {
            sum += Method::anchorTerm(keys(b, g, j, tid), out[j]);
        }
        anchor[tid] = sum;
    }
    __syncthreads();
    if (tid == 0)
    {
        Method::finishAnchor(anchor, d, n - info.validStart);
    }
    __syncthreads();
    for (int32_t i = info.validStart + tid; i < m; i += kKeyScoreThreads)
    {
        auto const key = [&keys, b, g, i](int32_t c) { return keys(b, g, i, c); };
        out[i] = Method::score(key, out[i], anchor, d);
    }
}

} // namespace criticalkv::kernels
