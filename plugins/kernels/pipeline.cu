// launchCriticalKVSelect: the operator of one layer as a sequence of kernels on one stream.
//
//   window attention  ->  value norms  ->  group scores  ->  radix selection  ->  compaction  ->  gather
//
// No host synchronisation and no allocation: the workspace (workspaceLayout) holds every intermediate, so the
// launch is CUDA-graph capturable. Sequences of at most `budget` tokens (and every sequence under `full` /
// `streamingllm`) skip the scoring kernels and are written by the compaction directly.
#include "criticalkv/kernels.h"
#include "device_utils.cuh"
#include "selection.cuh"

namespace criticalkv
{
namespace
{

bool shapeSupported(SelectConfig const& config, SelectShape const& s)
{
    return s.batch > 0 && s.heads > 0 && s.kvHeads > 0 && s.heads % s.kvHeads == 0 && s.n > 0 && s.headDim > 0
        && s.headDim <= kMaxHeadDim && s.hidden > 0 && s.queryLen >= windowLength(config, s.n) && config.capacity > 0
        && s.batch <= 65535 && s.heads <= 65535;
}

template <typename T>
T* at(void* workspace, size_t offset)
{
    return reinterpret_cast<T*>(static_cast<unsigned char*>(workspace) + offset);
}

size_t elementBytes(DType dtype)
{
    return dtype == DType::kFloat32 ? 4 : 2;
}

} // namespace

cudaError_t launchCriticalKVSelect(SelectConfig const& config, SelectShape const& shape, SelectTensors const& t,
    void* workspace, size_t workspaceBytes, cudaStream_t stream)
{
    if (!shapeSupported(config, shape))
    {
        return cudaErrorInvalidValue;
    }
    WorkspaceLayout const layout = workspaceLayout(config, shape);
    if (workspaceBytes < layout.total || (layout.total > 0 && workspace == nullptr))
    {
        return cudaErrorInvalidValue;
    }
    int32_t const m = shape.n - windowLength(config, shape.n);

    kernels::ScoreArgs s{};
    s.config = config;
    s.shape = shape;
    s.promptLengths = t.promptLengths;
    s.keptIndices = t.keptIndices;
    s.keptLengths = t.keptLengths;

    if (needsScores(config) && m > 0)
    {
        bool const laproxOn = config.base == BaseMethod::kLaProx;
        float* raw = at<float>(workspace, layout.raw);
        float* squares = laproxOn ? at<float>(workspace, layout.squares) : nullptr;
        cudaError_t status = launchWindowScores(config, shape, t.dtype, t.queries, t.keys, t.promptLengths,
            at<float>(workspace, layout.partials), at<float>(workspace, layout.rowStats), raw, squares, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
        float* norms = nullptr;
        if (needsNorms(config))
        {
            norms = at<float>(workspace, layout.norms);
            status = launchValueProjectionNorms(&config, t.promptLengths, shape, t.dtype, t.values, t.oProj, m,
                normKind(config), norms, stream);
            if (status != cudaSuccess)
            {
                return status;
            }
        }
        s.raw = raw;
        s.squares = squares;
        s.norms = norms;
        s.attention = at<float>(workspace, layout.attention);
        s.critical = config.twoStage ? at<float>(workspace, layout.critical) : nullptr;
        s.laprox = laproxOn ? at<float>(workspace, layout.laprox) : nullptr;
        s.flags = at<uint8_t>(workspace, layout.flags);
        s.headCounts = at<int32_t>(workspace, layout.headCounts);
        status = kernels::launchScoresAndSelection(s, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    cudaError_t status = kernels::launchCompact(s, stream);
    if (status != cudaSuccess)
    {
        return status;
    }
    kernels::GatherArgs g{};
    g.config = config;
    g.shape = shape;
    g.keptIndices = t.keptIndices;
    g.keys = t.keys;
    g.values = t.values;
    g.keptKeys = t.keptKeys;
    g.keptValues = t.keptValues;
    g.rowBytes = static_cast<int64_t>(shape.headDim) * static_cast<int64_t>(elementBytes(t.dtype));
    return kernels::launchGather(g, stream);
}

} // namespace criticalkv
