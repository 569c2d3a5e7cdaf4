// extern "C" launchers of the CUDA kernels for the GPU tests (libcriticalkv_cuda_test.so): raw device pointers
// (torch CUDA tensors' data_ptr()), synchronous, errors as text. Not used by the plugin.
#include "ckv_field.h"

#include "criticalkv/kernels.h"
#include "policy.h"

#include <cuda_runtime_api.h>

#include <climits>
#include <string>

using namespace criticalkv;

namespace
{

SelectShape toShape(int32_t const* s)
{
    return SelectShape{s[0], s[1], s[2], s[3], s[4], s[5], s[6]};
}

int32_t report(cudaError_t status, char* err, int32_t errLen)
{
    if (status == cudaSuccess)
    {
        status = cudaDeviceSynchronize();
    }
    if (status != cudaSuccess)
    {
        capi::writeMessage(std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status), err, errLen);
        return 1;
    }
    return 0;
}

//! Device scratch freed on scope exit.
struct DeviceBuffer
{
    void* ptr{nullptr};
    cudaError_t allocate(size_t bytes)
    {
        return bytes == 0 ? cudaSuccess : cudaMalloc(&ptr, bytes);
    }
    ~DeviceBuffer()
    {
        if (ptr != nullptr)
        {
            cudaFree(ptr);
        }
    }
};

} // namespace

extern "C"
{

    //! Number of visible CUDA devices (0 without a GPU or driver).
    int32_t ckv_cuda_device_count()
    {
        int count = 0;
        return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
    }

    //! Workspace bytes launchCriticalKVSelect needs for the policy and shape (-1 on an invalid policy).
    int64_t ckv_cuda_workspace_bytes(CkvField const* fields, int32_t count, int32_t const* shape)
    {
        PolicyConfig policy;
        if (!capi::parseFields(fields, count, policy, nullptr, 0))
        {
            return -1;
        }
        return static_cast<int64_t>(workspaceLayout(makeSelectConfig(policy), toShape(shape)).total);
    }

    //! The whole operator (launchCriticalKVSelect). dtype: 0 fp32, 1 fp16, 2 bf16. promptLengths and kvBudget
    //! (device int32 [1]) may be null. prunedTerms 1: the pruned stage 2's weights-only terms computed first by
    //! launchPrunedTerms and passed in (SelectTensors::prunedTerms; not timed).
    //! iterations > 1 re-runs it and returns the mean milliseconds per call in *milliseconds.
    int32_t ckv_cuda_select_layer(CkvField const* fields, int32_t count, int32_t const* shape, int32_t dtype,
        void const* queries, void const* keys, void const* values, void const* oProj, int32_t const* promptLengths,
        int32_t const* kvBudget, void* keptKeys, void* keptValues, int32_t* keptLengths, int32_t* keptIndices, int32_t iterations,
        float* milliseconds, int32_t prunedTerms, char* err, int32_t errLen)
    {
        try
        {
            PolicyConfig policy;
            if (!capi::parseFields(fields, count, policy, err, errLen))
            {
                return 1;
            }
            SelectConfig const config = makeSelectConfig(policy);
            SelectShape const s = toShape(shape);
            SelectTensors t{static_cast<DType>(dtype), queries, keys, values, oProj, promptLengths, kvBudget, keptKeys,
                keptValues, keptLengths, keptIndices, nullptr, nullptr};
            size_t const bytes = workspaceLayout(config, s).total;
            DeviceBuffer workspace;
            DeviceBuffer terms;
            cudaError_t status = workspace.allocate(bytes);
            if (status == cudaSuccess && prunedTerms != 0)
            {
                status = terms.allocate(prunedTermsBytes(s));
                status = status == cudaSuccess
                    ? launchPrunedTerms(s, static_cast<DType>(dtype), oProj, terms.ptr, prunedTermsBytes(s), nullptr)
                    : status;
                t.prunedTerms = terms.ptr;
            }
            cudaEvent_t start = nullptr;
            cudaEvent_t stop = nullptr;
            if (status == cudaSuccess)
            {
                status = launchCriticalKVSelect(config, budgetTable(policy), s, t, workspace.ptr, bytes, nullptr); // warm-up / result
            }
            if (status == cudaSuccess && iterations > 1)
            {
                cudaEventCreate(&start);
                cudaEventCreate(&stop);
                cudaEventRecord(start, nullptr);
                for (int32_t i = 0; i < iterations && status == cudaSuccess; ++i)
                {
                    status = launchCriticalKVSelect(config, budgetTable(policy), s, t, workspace.ptr, bytes, nullptr);
                }
                cudaEventRecord(stop, nullptr);
                cudaEventSynchronize(stop);
                float total = 0.0F;
                cudaEventElapsedTime(&total, start, stop);
                if (milliseconds != nullptr)
                {
                    *milliseconds = total / static_cast<float>(iterations);
                }
                cudaEventDestroy(start);
                cudaEventDestroy(stop);
            }
            return report(status, err, errLen);
        }
        catch (std::exception const& e)
        {
            capi::writeMessage(e.what(), err, errLen);
            return 2;
        }
    }

    //! launchCriticalKVSelect on a caller's stream and workspace, asynchronous (no allocation, no synchronisation):
    //! what a TensorRT enqueue does, and what the CUDA-graph capture test records. Returns the launch status.
    int32_t ckv_cuda_select_layer_async(CkvField const* fields, int32_t count, int32_t const* shape, int32_t dtype,
        void const* queries, void const* keys, void const* values, void const* oProj, int32_t const* promptLengths,
        int32_t const* kvBudget, void* keptKeys, void* keptValues, int32_t* keptLengths, int32_t* keptIndices, void* workspace,
        int64_t workspaceBytes, void* stream)
    {
        try
        {
            PolicyConfig policy;
            if (!capi::parseFields(fields, count, policy, nullptr, 0))
            {
                return -1;
            }
            SelectTensors t{static_cast<DType>(dtype), queries, keys, values, oProj, promptLengths, kvBudget, keptKeys,
                keptValues, keptLengths, keptIndices, nullptr, nullptr};
            return static_cast<int32_t>(launchCriticalKVSelect(makeSelectConfig(policy), budgetTable(policy), toShape(shape), t, workspace,
                static_cast<size_t>(workspaceBytes), static_cast<cudaStream_t>(stream)));
        }
        catch (std::exception const&)
        {
            return -2;
        }
    }

    //! Projected-value norms out [B, H, numTokens] fp32 of every sequence (no skipping). l2: 0 = L1, 1 = L2
    //! directly, 2 = L2 through the Gram matrices (the pipeline's path). rowTokens / rowCounts (device int32
    //! [B, H_kv, rowStride] / [B, H_kv], may be null): only the listed tokens (launchValueNorms's gathered rows).
    int32_t ckv_cuda_value_norms(int32_t const* shape, int32_t dtype, void const* values, void const* oProj,
        int32_t numTokens, int32_t l2, int32_t const* rowTokens, int32_t const* rowCounts, int32_t rowStride,
        int32_t maxCount, float* out, int32_t iterations, float* milliseconds, char* err, int32_t errLen)
    {
        SelectShape const s = toShape(shape);
        size_t const heads = static_cast<size_t>(s.heads);
        size_t const d = static_cast<size_t>(s.headDim);
        DeviceBuffer gram;
        DeviceBuffer pieces;
        DeviceBuffer scale;
        cudaError_t status = gram.allocate(l2 == 2 ? heads * d * d * sizeof(float) : 0);
        status = status == cudaSuccess ? pieces.allocate(l2 == 2 ? heads * kGramPiecesMax * d * d * 2 : 0) : status;
        status = status == cudaSuccess ? scale.allocate(l2 == 2 ? heads * sizeof(float) : 0) : status;
        ValueNormParams p{};
        p.shape = s;
        p.dtype = static_cast<DType>(dtype);
        p.values = values;
        p.oProj = oProj;
        p.numTokens = numTokens;
        p.kind = l2 ? ValueNorm::kL2 : ValueNorm::kL1;
        p.out = out;
        p.rows = GatheredRows{rowTokens, rowCounts, rowStride, maxCount};
        p.gram = GramScratch{static_cast<float*>(gram.ptr), pieces.ptr, static_cast<float*>(scale.ptr)};
        auto run = [&]() { return launchValueNorms(p, nullptr); };
        status = status == cudaSuccess ? run() : status;
        if (status == cudaSuccess && iterations > 1)
        {
            cudaEvent_t start = nullptr;
            cudaEvent_t stop = nullptr;
            cudaEventCreate(&start);
            cudaEventCreate(&stop);
            cudaEventRecord(start, nullptr);
            for (int32_t i = 0; i < iterations && status == cudaSuccess; ++i)
            {
                status = run();
            }
            cudaEventRecord(stop, nullptr);
            cudaEventSynchronize(stop);
            float total = 0.0F;
            cudaEventElapsedTime(&total, start, stop);
            if (milliseconds != nullptr)
            {
                *milliseconds = total / static_cast<float>(iterations);
            }
            cudaEventDestroy(start);
            cudaEventDestroy(stop);
        }
        return report(status, err, errLen);
    }

    //! The pruned stage 2's L1 upper bounds out [B, H, numTokens] fp32 of every sequence (launchL1Bounds).
    int32_t ckv_cuda_l1_bounds(int32_t const* shape, int32_t dtype, void const* values, void const* oProj,
        int32_t numTokens, float* out, char* err, int32_t errLen)
    {
        SelectShape const s = toShape(shape);
        size_t const heads = static_cast<size_t>(s.heads);
        size_t const d = static_cast<size_t>(s.headDim);
        DeviceBuffer gram;
        DeviceBuffer rowL1;
        DeviceBuffer colL1;
        cudaError_t status = gram.allocate(heads * d * d * sizeof(float));
        status = status == cudaSuccess ? rowL1.allocate(heads * d * sizeof(float)) : status;
        status = status == cudaSuccess ? colL1.allocate(heads * sizeof(float)) : status;
        if (status == cudaSuccess)
        {
            status = launchL1Bounds(nullptr, RuntimeBudget{}, nullptr, s, static_cast<DType>(dtype), values, oProj,
                numTokens, static_cast<float*>(gram.ptr), static_cast<float*>(rowL1.ptr),
                static_cast<float*>(colL1.ptr), out, nullptr);
        }
        return report(status, err, errLen);
    }

    //! Window scores raw / squares [B, H, m] of the compressed sequences of the policy given by fields; with rowMass
    //! and worst (both or neither) also defensivekv's rows: rowMass [B, H, w, 2], worst [B, H, m]. *tensorCores: 1 when
    //! the tensor-core path ran (windowScoresOnTensorCores), else 0.
    int32_t ckv_cuda_window_scores(CkvField const* fields, int32_t count, int32_t const* shape, int32_t dtype,
        void const* queries, void const* keys, int32_t const* promptLengths, float* raw, float* squares, float* rowMass,
        float* worst, int32_t* tensorCores, char* err, int32_t errLen)
    {
        try
        {
            PolicyConfig policy;
            if (!capi::parseFields(fields, count, policy, err, errLen))
            {
                return 1;
            }
            SelectConfig const config = makeSelectConfig(policy);
            SelectShape const s = toShape(shape);
            WorkspaceLayout const layout = workspaceLayout(config, s);
            DeviceBuffer partials;
            DeviceBuffer stats;
            cudaError_t status = partials.allocate(layout.rowStats - layout.partials);
            if (status == cudaSuccess)
            {
                status = stats.allocate(layout.raw - layout.rowStats);
            }
            if (status == cudaSuccess)
            {
                WindowScoreParams p{};
                p.config = config;
                p.shape = s;
                p.dtype = static_cast<DType>(dtype);
                p.queries = queries;
                p.keys = keys;
                p.promptLengths = promptLengths;
                p.partials = static_cast<float*>(partials.ptr);
                p.rowStats = static_cast<float*>(stats.ptr);
                p.raw = raw;
                p.squares = squares;
                p.rowSums = rowMass;
                p.pooledMax = worst;
                if (tensorCores != nullptr)
                {
                    *tensorCores = windowScoresOnTensorCores(config, s, p.dtype, queries, keys, worst != nullptr) ? 1 : 0;
                }
                status = launchWindowScores(p, nullptr);
            }
            return report(status, err, errLen);
        }
        catch (std::exception const& e)
        {
            capi::writeMessage(e.what(), err, errLen);
            return 2;
        }
    }

    //! Radix top-k of every row: flags [rows, len] uint8 (1 = kept). k: int64 [rows] device array.
    int32_t ckv_cuda_top_k_rows(float const* scores, int64_t const* k, uint8_t* flags, int32_t rows, int64_t len,
        char* err, int32_t errLen)
    {
        if (len > INT32_MAX)
        {
            return report(cudaErrorInvalidValue, err, errLen);
        }
        TopKRows const p{scores, flags, k, nullptr, rows, static_cast<int32_t>(len), len, static_cast<int32_t>(len), 1, 1};
        DeviceBuffer scratch;
        size_t const bytes = topKScratchBytes(rows, p.len);
        cudaError_t status = scratch.allocate(bytes);
        if (status == cudaSuccess && rows > 0 && len > 0)
        {
            status = cudaMemset(flags, 0, static_cast<size_t>(rows) * static_cast<size_t>(len));
        }
        if (status == cudaSuccess)
        {
            status = launchTopK(p, scratch.ptr, bytes, nullptr);
        }
        return report(status, err, errLen);
    }

    //! launchTopK on device arrays: flags [rows, len] uint8 in (0 = eligible) and out (the k best get `mark`; with
    //! levels > 1, k is [levels, rows] and a candidate gets mark + l for the first level l whose k best hold it);
    //! firstValid int32 [rows] or null. With iterations > 0, *microseconds gets the mean time of that many launches
    //! (cuda events around each; the flags restored before each), and the flags hold the last launch's result.
    int32_t ckv_cuda_top_k(float const* scores, uint8_t* flags, int64_t const* k, int32_t const* firstValid,
        int32_t rows, int32_t len, int32_t period, int32_t mark, int32_t levels, int32_t iterations, float* microseconds,
        char* err, int32_t errLen)
    {
        TopKRows const p{scores, flags, k, firstValid, rows, len, len, period, static_cast<uint8_t>(mark), levels};
        size_t const bytes = topKScratchBytes(rows, len, levels);
        size_t const flagBytes = static_cast<size_t>(rows > 0 ? rows : 0) * static_cast<size_t>(len > 0 ? len : 0);
        DeviceBuffer scratch;
        DeviceBuffer original;
        cudaError_t status = scratch.allocate(bytes);
        if (status == cudaSuccess)
        {
            status = original.allocate(flagBytes);
        }
        if (status == cudaSuccess && flagBytes > 0)
        {
            status = cudaMemcpy(original.ptr, flags, flagBytes, cudaMemcpyDeviceToDevice);
        }
        if (status == cudaSuccess)
        {
            status = launchTopK(p, scratch.ptr, bytes, nullptr);
        }
        if (status == cudaSuccess && iterations > 0)
        {
            cudaEvent_t start{};
            cudaEvent_t stop{};
            cudaEventCreate(&start);
            cudaEventCreate(&stop);
            float total = 0.0F;
            for (int32_t i = 0; i < iterations && status == cudaSuccess; ++i)
            {
                status = flagBytes > 0 ? cudaMemcpy(flags, original.ptr, flagBytes, cudaMemcpyDeviceToDevice)
                                       : cudaSuccess;
                cudaEventRecord(start, nullptr);
                if (status == cudaSuccess)
                {
                    status = launchTopK(p, scratch.ptr, bytes, nullptr);
                }
                cudaEventRecord(stop, nullptr);
                cudaEventSynchronize(stop);
                float ms = 0.0F;
                cudaEventElapsedTime(&ms, start, stop);
                total += ms;
            }
            cudaEventDestroy(start);
            cudaEventDestroy(stop);
            *microseconds = 1000.0F * total / static_cast<float>(iterations);
        }
        return report(status, err, errLen);
    }

    //! launchMassCount on device arrays: count int64 [rows] of the candidates (flags == 0, outside the left padding)
    //! whose cumulative sum, best first, stays below limit float [rows].
    int32_t ckv_cuda_mass_count(float const* scores, uint8_t* flags, int32_t const* firstValid, float const* limit,
        int64_t* count, int32_t rows, int32_t len, int32_t period, char* err, int32_t errLen)
    {
        TopKRows const p{scores, flags, nullptr, firstValid, rows, len, len, period, 1, 1};
        size_t const bytes = massCountScratchBytes(rows, len);
        DeviceBuffer scratch;
        cudaError_t status = scratch.allocate(bytes);
        if (status == cudaSuccess)
        {
            status = launchMassCount(p, limit, count, scratch.ptr, bytes, nullptr);
        }
        return report(status, err, errLen);
    }

    //! launchPrunedRow on device arrays (kernels.h).
    int32_t ckv_cuda_pruned_row(float const* bound, float const* scores, float* exact, uint8_t* flags, int32_t m,
        int32_t validStart, int64_t k, int64_t eligible, float margin, int64_t* done, char* err, int32_t errLen)
    {
        return report(launchPrunedRow(bound, scores, exact, flags, m, validStart, k, eligible, margin, done, nullptr),
            err, errLen);
    }

} // extern "C"
