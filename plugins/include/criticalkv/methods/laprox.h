// LaProx: a layer-global importance from the window attention and the l2 projected-value norms, ranked by the shared
// allocation as adakv's pooled attention is. For older token i of one KV head's group of query heads h (A_h: the window
// queries' attention rows of head h, N_h[i] = ||V_i W_O^h||_2):
//   score_i = sum_h ||A_h[:, i]||_2 N_h[i]
// (criticalkv/methods/laprox.py is the reference). What it asks of the pipeline: the window pass's sum_j A_j^2 per
// (query head, older token) (kWindowSquares: the workspace's `squares`), the l2 norms (the generated trait ownL2Norms),
// and one score per (KV head, older token) (every group-scored method's `methodScores`); the pass around it is
// group_scores.h's.
#pragma once

#include "criticalkv/group_scores.h"

#include <cmath>

namespace criticalkv::methods
{

struct LaProx
{
    static constexpr BaseMethod kBase = BaseMethod::kLaProx;
    static constexpr bool kWindowSquares = true; //!< reads HeadWindow::squares

    //! One query head's term: ||A_h[:, i]||_2 N_h[i].
    CKV_HD static float headTerm(HeadWindow const& head)
    {
        return multiplyRounded(sqrtf(head.squares), head.norm);
    }

    //! The group's score: the sum of its heads' terms.
    CKV_HD static float groupScore(float sum, int32_t /*group*/)
    {
        return sum;
    }
};

} // namespace criticalkv::methods
