// Building blocks of the selection flows (head_selection.h, shared_allocation.h).
//
// A flow is written once as a __host__ __device__ template over a top-k primitive `TopK`, callable as
//   topK(scores, flags, len, period, firstValid, k, mark)
// which marks with `mark` the k best candidates of scores[0, len) (ties: lower index); candidates are the
// entries with flags[e] == 0 and (e % period) >= firstValid. The kernels pass a thread-block radix select
// (every thread of the block runs the flow with the same arguments), the host driver a sequential one; both
// are the radix select of radix.h.
#pragma once

#include "criticalkv/common.h"

// A __host__ __device__ template that calls a __device__-only functor is fine as long as the host instance is
// never emitted; this pragma tells nvcc not to warn about it.
#if defined(__CUDACC__)
#define CKV_FLOW_TEMPLATE _Pragma("nv_exec_check_disable")
#else
#define CKV_FLOW_TEMPLATE
#endif

namespace criticalkv
{

//! Flag values of a chosen older token (anything non-zero means kept).
constexpr uint8_t kChosenByAttention = 1;
constexpr uint8_t kChosenByCritical = 2;

} // namespace criticalkv
