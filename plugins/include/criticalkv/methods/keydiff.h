// KeyDiff (kvpress's KeyDiffPress): a question-agnostic score from the keys alone. For one KV head, with
// unit(x) = x / max(||x||_2, 1e-12) and the valid keys k_j (post-RoPE, as the cache holds them; j in [validStart, n),
// the window included):
//   a = mean_j unit(k_j),   score_i = 1 - unit(k_i) . unit(a)   (in [0, 2]: the keys least like the others score highest)
// and every head keeps the window and its top budget - window older tokens by the score (criticalkv/methods/keydiff.py
// is the reference). Everything in fp32; the pass around it is key_scores.h's (no workspace beyond its scores).
#pragma once

#include "criticalkv/key_scores.h"

#include <cmath>

namespace criticalkv::methods
{

struct KeyDiff
{
    static constexpr BaseMethod kBase = BaseMethod::kKeyDiff;
    static constexpr float kMinNorm = 1e-12F; //!< unit()'s floor of the norm (torch.nn.functional.normalize's eps)

    //! max(||k||_2, 1e-12): unit(k) = k / factor.
    CKV_FLOW_TEMPLATE
    template <typename Key>
    CKV_HD static float keyFactor(Key const& key, int32_t d)
    {
        float const norm = sqrtf(squaredNorm(key, d));
        return norm > kMinNorm ? norm : kMinNorm;
    }

    //! unit(k_j)[c]: the anchor sums them.
    CKV_HD static float anchorTerm(float entry, float factor)
    {
        return entry / factor;
    }

    //! unit(sum / count): the mean of the unit keys, normalised.
    CKV_HD static void finishAnchor(float* anchor, int32_t d, int32_t count)
    {
        float const total = static_cast<float>(count > 0 ? count : 1);
        for (int32_t c = 0; c < d; ++c)
        {
            anchor[c] = anchor[c] / total;
        }
        auto const entry = [anchor](int32_t c) { return anchor[c]; };
        float const norm = sqrtf(squaredNorm(entry, d));
        float const factor = norm > kMinNorm ? norm : kMinNorm;
        for (int32_t c = 0; c < d; ++c)
        {
            anchor[c] = anchor[c] / factor;
        }
    }

    //! 1 - unit(k_i) . unit(a).
    CKV_FLOW_TEMPLATE
    template <typename Key>
    CKV_HD static float score(Key const& key, float factor, float const* anchor, int32_t d)
    {
        float dot = 0.0F;
        for (int32_t c = 0; c < d; ++c)
        {
            dot += multiplyRounded(key(c) / factor, anchor[c]);
        }
        return 1.0F - dot;
    }
};

} // namespace criticalkv::methods
