// libcriticalkv_ops.so: the C API behind the torch custom op criticalkv::select_layer (criticalkv/selection/op.py).
//
// Framework-free like the TensorRT plugin: the caller (torch, through ctypes) hands raw device pointers, a workspace
// it allocated with its own allocator and the stream to launch on; nothing here allocates, synchronises or knows
// torch, so a launch inside torch.cuda.graph() is captured like any other kernel. The policy arrives as the node's
// fields (the same names and parser as the plugin's creator: host/policy.h), so the op, the plugin and the ONNX node
// cannot disagree on a knob.
//
// Shapes (shape[7] = B, H, H_kv, n, queryLen, d_h, hidden):
//   queries [B, H, queryLen, d_h], keys / values [B, H_kv, n, d_h], o_proj [hidden, H * d_h]  (dtype 0 fp32, 1 fp16,
//   2 bf16); prompt_lengths [B] int32 or null; kv_budget [1] int32 on the device or null;
//   kept_keys / kept_values [B, H_kv, cap, d_h], kept_lengths [B, H_kv] int32, kept_indices [B, H_kv, cap] int32,
//   cap = min(n, capacity field).
//
// CriticalKV with value_norm=l1 (the pruned stage 2) computes weights-only terms of o_proj at every call (one pass over
// o_proj on the tensor cores); a caller that keeps a layer's o_proj fixed may compute them once with
// ckv_ops_pruned_terms (buffer size: ckv_ops_pruned_terms_bytes) and pass them to ckv_ops_select_layer_terms. The
// buffer belongs to that o_proj's content: weights changed in place need the terms again.
#include "ckv_field.h"

#include "criticalkv/kernels.h"
#include "policy.h"

#include <cuda_runtime_api.h>

#include <exception>
#include <string>

using namespace criticalkv;

namespace
{

//! ckv_ops_version(): bumped when a signature below changes (the Python binding checks it).
constexpr int32_t kOpsVersion = 1;

bool readShape(int32_t const* s, SelectShape& shape, char* err, int32_t errLen)
{
    if (s == nullptr)
    {
        capi::writeMessage("shape: null", err, errLen);
        return false;
    }
    shape = SelectShape{s[0], s[1], s[2], s[3], s[4], s[5], s[6]};
    if (shape.batch <= 0 || shape.heads <= 0 || shape.kvHeads <= 0 || shape.n <= 0 || shape.queryLen <= 0
        || shape.headDim <= 0 || shape.hidden <= 0)
    {
        capi::writeMessage("shape: every dimension (B, H, H_kv, n, queryLen, d_h, hidden) must be positive", err, errLen);
        return false;
    }
    if (shape.heads % shape.kvHeads != 0)
    {
        capi::writeMessage("shape: H = " + std::to_string(shape.heads) + " query heads are not a multiple of H_kv = "
                + std::to_string(shape.kvHeads),
            err, errLen);
        return false;
    }
    if (shape.headDim > kMaxHeadDim)
    {
        capi::writeMessage("shape: head_dim " + std::to_string(shape.headDim) + " exceeds the kernels' "
                + std::to_string(kMaxHeadDim),
            err, errLen);
        return false;
    }
    return true;
}

//! ckv_ops_select_layer's body; prunedTerms: a ckv_ops_pruned_terms buffer or null.
int32_t selectLayer(CkvField const* fields, int32_t count, int32_t const* shape, int32_t dtype, void const* queries,
    void const* keys, void const* values, void const* oProj, int32_t const* promptLengths, int32_t const* kvBudget,
    void* keptKeys, void* keptValues, int32_t* keptLengths, int32_t* keptIndices, void* workspace,
    int64_t workspaceBytes, void const* prunedTerms, void* stream, char* err, int32_t errLen)
{
    try
    {
        PolicyConfig policy;
        SelectShape s{};
        if (!capi::parseFields(fields, count, policy, err, errLen) || !readShape(shape, s, err, errLen))
        {
            return 1;
        }
        if (dtype < 0 || dtype > 2)
        {
            capi::writeMessage("dtype: " + std::to_string(dtype) + " (0 fp32, 1 fp16, 2 bf16)", err, errLen);
            return 1;
        }
        SelectConfig const config = makeSelectConfig(policy);
        size_t const needed = workspaceLayout(config, s).total;
        if (workspaceBytes < 0 || static_cast<size_t>(workspaceBytes) < needed)
        {
            capi::writeMessage("workspace: " + std::to_string(workspaceBytes) + " bytes given, "
                    + std::to_string(needed) + " needed",
                err, errLen);
            return 1;
        }
        SelectTensors const t{static_cast<DType>(dtype), queries, keys, values, oProj, promptLengths, kvBudget, keptKeys,
            keptValues, keptLengths, keptIndices, prunedTerms, nullptr};
        cudaError_t const status = launchCriticalKVSelect(config, budgetTable(policy), s, t, workspace,
            static_cast<size_t>(workspaceBytes), static_cast<cudaStream_t>(stream));
        if (status != cudaSuccess)
        {
            capi::writeMessage(std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status), err, errLen);
            return 1;
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        capi::writeMessage(e.what(), err, errLen);
        return 1;
    }
}

} // namespace

extern "C"
{

    __attribute__((visibility("default"))) int32_t ckv_ops_version()
    {
        return kOpsVersion;
    }

    //! Visible CUDA devices (0 without a GPU or driver: the library loads on any machine).
    __attribute__((visibility("default"))) int32_t ckv_ops_device_count()
    {
        int count = 0;
        return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
    }

    //! Workspace bytes of one select_layer call; -1 with the reason in err on a bad policy or shape.
    __attribute__((visibility("default"))) int64_t ckv_ops_workspace_bytes(
        CkvField const* fields, int32_t count, int32_t const* shape, char* err, int32_t errLen)
    {
        try
        {
            PolicyConfig policy;
            SelectShape s{};
            if (!capi::parseFields(fields, count, policy, err, errLen) || !readShape(shape, s, err, errLen))
            {
                return -1;
            }
            return static_cast<int64_t>(workspaceLayout(makeSelectConfig(policy), s).total);
        }
        catch (std::exception const& e)
        {
            capi::writeMessage(e.what(), err, errLen);
            return -1;
        }
    }

    //! launchCriticalKVSelect on `stream` into the caller's outputs and workspace: asynchronous, no allocation, no
    //! synchronisation. Returns 0, or nonzero with the reason in err (a bad policy, shape or workspace size, or the
    //! CUDA launch error).
    __attribute__((visibility("default"))) int32_t ckv_ops_select_layer(CkvField const* fields, int32_t count,
        int32_t const* shape, int32_t dtype, void const* queries, void const* keys, void const* values,
        void const* oProj, int32_t const* promptLengths, int32_t const* kvBudget, void* keptKeys, void* keptValues,
        int32_t* keptLengths, int32_t* keptIndices, void* workspace, int64_t workspaceBytes, void* stream, char* err,
        int32_t errLen)
    {
        return selectLayer(fields, count, shape, dtype, queries, keys, values, oProj, promptLengths, kvBudget, keptKeys,
            keptValues, keptLengths, keptIndices, workspace, workspaceBytes, nullptr, stream, err, errLen);
    }

    //! ckv_ops_select_layer with the pruned stage 2's weights-only terms of this o_proj computed beforehand
    //! (ckv_ops_pruned_terms; null: computed in the call): CriticalKV with value_norm=l1 then skips them.
    __attribute__((visibility("default"))) int32_t ckv_ops_select_layer_terms(CkvField const* fields, int32_t count,
        int32_t const* shape, int32_t dtype, void const* queries, void const* keys, void const* values,
        void const* oProj, int32_t const* promptLengths, int32_t const* kvBudget, void* keptKeys, void* keptValues,
        int32_t* keptLengths, int32_t* keptIndices, void* workspace, int64_t workspaceBytes, void const* prunedTerms,
        void* stream, char* err, int32_t errLen)
    {
        return selectLayer(fields, count, shape, dtype, queries, keys, values, oProj, promptLengths, kvBudget, keptKeys,
            keptValues, keptLengths, keptIndices, workspace, workspaceBytes, prunedTerms, stream, err, errLen);
    }

    //! Bytes of a layer's pruned-stage-2 terms buffer for shape (only H, d_h and hidden matter); -1 on a bad shape.
    __attribute__((visibility("default"))) int64_t ckv_ops_pruned_terms_bytes(int32_t const* shape, char* err,
        int32_t errLen)
    {
        SelectShape s{};
        if (!readShape(shape, s, err, errLen))
        {
            return -1;
        }
        return static_cast<int64_t>(prunedTermsBytes(s));
    }

    //! The pruned stage 2's weights-only terms of o_proj [hidden, H d_h] (dtype 0 fp32, 1 fp16, 2 bf16) into `terms`
    //! (ckv_ops_pruned_terms_bytes) on `stream`: once per layer, then passed to every ckv_ops_select_layer_terms of
    //! that layer while its o_proj keeps its content. Returns 0, or nonzero with the reason in err.
    __attribute__((visibility("default"))) int32_t ckv_ops_pruned_terms(int32_t const* shape, int32_t dtype,
        void const* oProj, void* terms, int64_t termsBytes, void* stream, char* err, int32_t errLen)
    {
        SelectShape s{};
        if (!readShape(shape, s, err, errLen))
        {
            return 1;
        }
        if (dtype < 0 || dtype > 2)
        {
            capi::writeMessage("dtype: " + std::to_string(dtype) + " (0 fp32, 1 fp16, 2 bf16)", err, errLen);
            return 1;
        }
        size_t const needed = prunedTermsBytes(s);
        if (termsBytes < 0 || static_cast<size_t>(termsBytes) < needed || terms == nullptr || oProj == nullptr)
        {
            capi::writeMessage("terms: " + std::to_string(termsBytes) + " bytes given, " + std::to_string(needed)
                    + " needed (and o_proj and terms must not be null)",
                err, errLen);
            return 1;
        }
        cudaError_t const status = launchPrunedTerms(s, static_cast<DType>(dtype), oProj, terms, needed,
            static_cast<cudaStream_t>(stream));
        if (status != cudaSuccess)
        {
            capi::writeMessage(std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status), err, errLen);
            return 1;
        }
        return 0;
    }

} // extern "C"
