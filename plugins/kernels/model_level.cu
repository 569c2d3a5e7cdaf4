// launchModelSelect: the model-level selection after the last layer (model_level.cuh's allocation over every head of
// every layer, then each layer's compaction and gather), on one stream, in the caller's workspace.
#include "criticalkv/kernels.h"
#include "device_utils.cuh"
#include "selection.cuh"

namespace criticalkv
{
namespace
{

template <typename T>
T* at(void* workspace, size_t offset)
{
    return reinterpret_cast<T*>(static_cast<unsigned char*>(workspace) + offset);
}

//! One layer's rows [B, H_kv, m] of the model-wide flags [B, L H_kv, m]. grid (ceil(H_kv m / 256), B).
__global__ void __launch_bounds__(256) layerFlagsKernel(uint8_t const* model, uint8_t* layer, int32_t layerIndex,
    int32_t layers, int64_t rows)
{
    int64_t const e = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
    int64_t const b = blockIdx.y;
    if (e < rows)
    {
        layer[b * rows + e] = model[(b * layers + layerIndex) * rows + e];
    }
}

} // namespace

ModelWorkspaceLayout modelWorkspaceLayout(SelectConfig const& config, ModelShape const& shape)
{
    ModelWorkspaceLayout layout{};
    SelectShape const rows = modelRows(shape);
    size_t const b = static_cast<size_t>(rows.batch);
    size_t const heads = static_cast<size_t>(rows.kvHeads);
    int32_t const m = rows.n - windowLength(config, rows.n);
    if (m <= 0)
    {
        return layout;
    }
    bool const capped = modelCapped(config);
    layout.sortStride = capped ? modelSortStride(config, m) : 0;
    size_t offset = 0;
    auto take = [&offset](size_t bytes) {
        size_t const where = offset;
        offset += alignWorkspace(bytes);
        return where;
    };
    size_t const sorted = capped ? b * heads * static_cast<size_t>(layout.sortStride) : 0;
    layout.flags = take(b * heads * static_cast<size_t>(m));
    layout.plan = take(selectionPlanBytes(rows.batch, rows.kvHeads));
    layout.counts = take(capped ? b * heads * sizeof(int32_t) : 0);
    for (int i = 0; i < 2; ++i)
    {
        layout.sortKeys[i] = take(sorted * sizeof(uint32_t));
        layout.sortPositions[i] = take(sorted * sizeof(int32_t));
    }
    layout.layerFlags = take(b * static_cast<size_t>(shape.layer.kvHeads) * static_cast<size_t>(m));
    layout.topK = take(selectionScratchBytes(rows.batch, rows.kvHeads, m, true, false));
    layout.total = offset;
    return layout;
}

cudaError_t launchModelSelect(SelectConfig const& config, ModelShape const& shape, ModelSelectTensors const& t,
    void* workspace, size_t workspaceBytes, cudaStream_t stream)
{
    SelectShape const rows = modelRows(shape);
    SelectShape const& layer = shape.layer;
    if (shape.layers <= 0 || layer.batch <= 0 || layer.kvHeads <= 0 || layer.n <= 0 || layer.headDim <= 0
        || layer.headDim > kMaxHeadDim || t.layers == nullptr || t.ranking == nullptr || config.keptSinks != 0
        || !modelLevel(config) || (config.twoStage && (t.attention == nullptr || t.critical == nullptr))
        || rows.batch > 65535)
    {
        return cudaErrorInvalidValue;
    }
    ModelWorkspaceLayout const layout = modelWorkspaceLayout(config, shape);
    if (workspaceBytes < layout.total || (layout.total > 0 && workspace == nullptr))
    {
        return cudaErrorInvalidValue;
    }
    RuntimeBudget const budget{t.kvBudget, nullptr}; // no table: r = b - window for every layer
    int32_t const m = layer.n - windowLength(config, layer.n);
    uint8_t* flags = at<uint8_t>(workspace, layout.flags);
    cudaError_t status = cudaSuccess;
    if (m > 0)
    {
        kernels::SelectionRows const selectionRows{config, rows, t.promptLengths, budget, flags, nullptr,
            selectionPlan(at<void>(workspace, layout.plan), rows.batch, rows.kvHeads, at<void>(workspace, layout.topK),
                layout.total - layout.topK)};
        kernels::ModelArgs const args{selectionRows, t.ranking, t.attention, t.critical,
            at<int32_t>(workspace, layout.counts),
            {at<uint32_t>(workspace, layout.sortKeys[0]), at<uint32_t>(workspace, layout.sortKeys[1])},
            {at<int32_t>(workspace, layout.sortPositions[0]), at<int32_t>(workspace, layout.sortPositions[1])},
            layout.sortStride};
        status = kernels::launchModelAllocation(args, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    uint8_t* layerFlags = at<uint8_t>(workspace, layout.layerFlags);
    int64_t const layerRows = static_cast<int64_t>(layer.kvHeads) * (m > 0 ? m : 0);
    for (int32_t l = 0; l < shape.layers; ++l)
    {
        ModelLayerTensors const& out = t.layers[l];
        SelectConfig layerConfig = config;
        layerConfig.capacity = out.capacity;
        if (out.capacity <= 0)
        {
            return cudaErrorInvalidValue;
        }
        if (layerRows > 0)
        {
            dim3 const grid(static_cast<uint32_t>((layerRows + 255) / 256), static_cast<uint32_t>(layer.batch));
            layerFlagsKernel<<<grid, 256, 0, stream>>>(flags, layerFlags, l, shape.layers, layerRows);
        }
        kernels::CompactArgs const c{layerConfig, layer, t.promptLengths, budget, layerFlags, out.keptIndices,
            out.keptLengths};
        status = kernels::launchCompact(c, stream);
        if (status != cudaSuccess)
        {
            return status;
        }
        status = kernels::launchGather(kernels::gatherArgs(layerConfig, layer, t.dtype, out.keptIndices, out.keys,
                                           out.values, out.keptKeys, out.keptValues),
            stream);
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    return cudaSuccess;
}

} // namespace criticalkv
