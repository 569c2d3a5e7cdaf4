// GENERATED from criticalkv.policy.KVPolicy by criticalkv.engine.plugin_fields; do not edit.
// Regenerate: python -m criticalkv.engine.plugin_fields plugins/include/criticalkv/policy_fields.h
#pragma once

//! Every field of the CriticalKVSelect plugin creator, in order: the KVPolicy knobs, then the layer
//! fields. CKV_FIELD(kind, name, default) with kind STRING (kCHAR), INT (kINT32) or FLOAT (kFLOAT32).
#define CKV_FOR_EACH_PLUGIN_FIELD(CKV_FIELD) \
    CKV_FIELD(STRING, name, "criticalkv") \
    CKV_FIELD(INT, budget, 256) \
    CKV_FIELD(INT, window, 32) \
    CKV_FIELD(INT, pool_kernel, 7) \
    CKV_FIELD(FLOAT, alpha, 0.25) \
    CKV_FIELD(FLOAT, epsilon, 0.0001) \
    CKV_FIELD(STRING, value_norm, "l1") \
    CKV_FIELD(STRING, gqa_reduce, "mean") \
    CKV_FIELD(STRING, stage2_scores, "pooled") \
    CKV_FIELD(FLOAT, ada_floor, 0.2) \
    CKV_FIELD(FLOAT, pyramid_beta, 20.0) \
    CKV_FIELD(INT, sink_tokens, 4) \
    CKV_FIELD(INT, layer_idx, 0) \
    CKV_FIELD(INT, num_layers, 1) \
    CKV_FIELD(INT, capacity, 0)

//! CKV_POLICY(name, base method, two-stage) for every policy name.
#define CKV_FOR_EACH_POLICY(CKV_POLICY) \
    CKV_POLICY("full", kFull, 0) \
    CKV_POLICY("streamingllm", kStreamingLLM, 0) \
    CKV_POLICY("snapkv", kSnapKV, 0) \
    CKV_POLICY("pyramidkv", kPyramidKV, 0) \
    CKV_POLICY("adakv", kAdaKV, 0) \
    CKV_POLICY("laprox", kLaProx, 0) \
    CKV_POLICY("criticalkv", kSnapKV, 1) \
    CKV_POLICY("pyramid-criticalkv", kPyramidKV, 1) \
    CKV_POLICY("ada-criticalkv", kAdaKV, 1)

#define CKV_CHOICES_value_norm "l1", "l2"
#define CKV_CHOICES_gqa_reduce "mean", "kvpress"
#define CKV_CHOICES_stage2_scores "pooled", "raw"
