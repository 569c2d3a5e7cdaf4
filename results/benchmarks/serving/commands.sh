#!/usr/bin/env bash
# The committed serving measurements, in the order they were taken (see README.md here for the load averages).
# Engines (engines/ is git-ignored), built before the measurements:
#   for spec in "criticalkv ckv256" "full full" "snapkv snapkv256" "ada-criticalkv adackv256"; do set -- $spec
#     .venv/bin/python scripts/build_engine.py --kv-policy $1 --budget 256 --max-input-len 2048 --max-new-tokens 256 \
#       --max-batch-size 8 --output engines/$2; done
#   .venv/bin/criticalkv bench setup-peers
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=results/benchmarks/serving
B=.venv/bin/criticalkv
PY=.venv/bin/python   # the laboratory's benchmarks: $PY -m benchmarks.NAME, from the repository root
# these runs were taken when `criticalkv serve` without --backend ran ONNX Runtime; it now runs OpenVINO on a CPU
# with bf16 (docs/openvino.md), so ONNX Runtime is pinned here to re-make them
export CRITICALKV_SERVE_BACKEND=${CRITICALKV_SERVE_BACKEND-onnxruntime}
uptime
# 1. ISL 2048, OSL 64, concurrency 8 (and 1): criticalkv b=256 vs full, one server after the other (py-spy profile)
$B bench serve --engine-dir engines/full --engine-dir engines/ckv256 --isl 2048 --osl 64 --concurrency 1,8 \
  --num-requests 2,16 --warmup 1 --profile --out $OUT --name isl2048_osl64 --no-progress
uptime
# 2. ISL 512, OSL 256, concurrency 1 vs 8 on criticalkv b=256 (continuous batching)
$B bench serve --engine-dir engines/ckv256 --isl 512 --osl 256 --concurrency 1,8 --num-requests 3,8 --warmup 1 \
  --profile --out $OUT --name isl512_osl256 --no-progress
uptime
# 3. KV bytes per sequence of the other policies (full and criticalkv: run 1)
$B bench serve --engine-dir engines/snapkv256 --engine-dir engines/adackv256 --isl 2048 --osl 4 --concurrency 1 \
  --num-requests 1 --warmup 0 --out $OUT --name kv_isl2048 --no-progress
uptime
# 4. one request, ISL 2048, OSL 16: criticalkv (ONNX Runtime) vs kvpress vs transformers
$B bench single --engine-dir engines/ckv256 --isl 2048 --new-tokens 16 --repeats 3 --out $OUT/single_request
uptime
# 5. AIPerf cross-check on one configuration
$B bench aiperf --engine-dir engines/ckv256 --isl 512 --osl 64 --concurrency 4 --num-requests 8 --warmup 1 --out $OUT \
  || echo "(the AIPerf cross-check exits 1 when a metric differs by more than 10 %)"
uptime
# 6. a short request (ISL 128, OSL 16) alone vs arriving during a long one's (ISL 2048, OSL 256) decode and its
#    prefill, interleaved on one server (engine ckv256 above; taken later, from 19:59 UTC, on another machine: see
#    README.md). First run, 7 rounds; its files were then renamed, and its .md / .png redrawn from its JSON after the
#    same-round ratios were added to the tables (benchmarks.interference.summarize_cases / write_all)
$PY -m benchmarks.interference --engine-dir engines/ckv256 --repeats 7 --warmup 1 --out $OUT --no-progress
for e in json md png; do mv $OUT/interference.$e $OUT/interference_first_run.$e; done
uptime
# 7. the same, 9 rounds
$PY -m benchmarks.interference --engine-dir engines/ckv256 --repeats 9 --warmup 1 --out $OUT --no-progress
uptime
$PY -m benchmarks.targets $OUT

# ---- The context cache, chunked prefill and one KV memory budget (taken 2026-11-24 11:24-12:25 UTC, idle) ----
# Engines with extend/select (the manifest format changed: rebuild), room for a 2,048-token context + its question:
#   for spec in "criticalkv ckv256" "full full"; do set -- $spec
#     .venv/bin/python scripts/build_engine.py --kv-policy $1 --budget 256 --max-input-len 2304 --max-new-tokens 256 \
#       --max-batch-size 8 --max-question-len 64 --output engines/ctx-$2; done
uptime
# 8. docqa: 16 documents (ISL 2048) x 8 questions (32 tokens) in a random order, concurrency 8, OSL 64; both servers
#    with --kv-memory-mib = 4 uncompressed 2,048-token contexts of the full engine (printed: 360 MiB for SmolLM2-135M)
#    and --context-cache-mib the same
$B bench docqa --engine-dir engines/ctx-full --engine-dir engines/ctx-ckv256 --docs 16 --questions 8 --isl 2048 \
  --question-tokens 32 --osl 64 --concurrency 8 --out $OUT --name docqa --no-progress
uptime
# 9. memory-bound decode: ISL 2048, OSL 256, concurrency 8, KV memory of 2 full sequences (2 x 2,304 tokens)
$B bench memory --engine-dir engines/ctx-full --engine-dir engines/ctx-ckv256 --isl 2048 --osl 256 --concurrency 8 \
  --num-requests 16 --warmup 1 --out $OUT --name memory_bound --no-progress
uptime
# 10. a short request (ISL 128, OSL 16) alone / during a long one's (ISL 2048, OSL 256) decode / during its prefill,
#     prefill not chunked vs chunks of 512 vs 256 (one server each, in this order)
$PY -m benchmarks.interference --engine-dir engines/ctx-ckv256 --prefill-chunk 0,512,256 --repeats 9 --warmup 1 --out $OUT \
  --name interference_chunked --no-progress
uptime
# 11. a 32-token question after a cached 2,048-token context vs the same request uncached (a new document each round)
$PY -m benchmarks.cached --engine-dir engines/ctx-full --engine-dir engines/ctx-ckv256 --isl 2048 --question-tokens 32 \
  --osl 4 --repeats 9 --warmup 1 --out $OUT --name cached_context
uptime
# 11a. What compressing a context with KVzip costs (--scoring-cost: prefill, re-read, selection in-process),
#      the re-read on the fused reconstruct graph, whole context vs kvzip_reread=chunk; engines built with
#      scripts/build_engine.py --kv-policy criticalkv --budget 256 --max-input-len 2304 --output engines/ctx-ckv256
#      (--context-policy kvzip, the default then) and ... --context-policy kvzip:kvzip_reread=chunk:kvzip_chunk=512
#      --output engines/ctx-ckv256-chunk512
$PY -m benchmarks.cached --engine-dir engines/ctx-ckv256 --engine-dir engines/ctx-ckv256-chunk512 --isl 2048 \
  --question-tokens 32 --osl 4 --repeats 5 --warmup 1 --scoring-cost --out $OUT --name cached_context_kvzip_fused
uptime
# 11c. the context cache's default context policy now (layer-kvzip-criticalkv:head_cap_ratio=3: KVzip's re-read, one
#      model-level selection with CriticalKV's two stages) against kvzip, on engines built as in 11a with
#      --context-policy layer-kvzip-criticalkv:head_cap_ratio=3 --output engines/ctx-lkc3-256
$PY -m benchmarks.cached --engine-dir engines/ctx-ckv256 --engine-dir engines/ctx-lkc3-256 --isl 2048 \
  --question-tokens 32 --osl 4 --repeats 5 --warmup 1 --scoring-cost --out $OUT --name cached_context_layer_kvzip_criticalkv
uptime
# 11d. the context cache's default context policy now (layer-kvzip-criticalkv:kvzip_score=surrogate:head_cap_ratio=6:
#      KVzip's score from the model's surrogate, no re-read) against the re-read's (11c), engine built as in 11a with
#      --context-policy layer-kvzip-criticalkv:kvzip_score=surrogate:head_cap_ratio=6 --output engines/ctx-lkcs6-256
$PY -m benchmarks.cached --engine-dir engines/ctx-lkc3-256 --engine-dir engines/ctx-lkcs6-256 --isl 2048 \
  --question-tokens 32 --osl 4 --repeats 5 --warmup 1 --scoring-cost --out $OUT --name cached_context_surrogate
uptime
# 11b. what one chunked-prefill step costs (the unit a short request waits for), and chunks of 128 served
.venv/bin/python -m benchmarks.chunks --engine-dir engines/ctx-ckv256 --chunks 512,256,128 --out $OUT
uptime
$PY -m benchmarks.interference --engine-dir engines/ctx-ckv256 --prefill-chunk 128 --repeats 9 --warmup 1 --out $OUT \
  --name interference_chunk128 --no-progress
uptime
# 11c. float16 KV buffers against float32 on the needle grid's 2,048-token prompts (engines/ckv256 as built above,
#      engines/ckv256-fp16 the same with --kv-dtype float16)
.venv/bin/python research/kv_precision.py --engine-dir engines/ckv256 --engine-dir engines/ckv256-fp16 \
  --lengths 2048 --samples 2 --out results/kv_precision --no-progress
# 12. the benchmark clients against a stand-in model with a known schedule (TTFT 300 ms, then 50 ms per token);
#     the AIPerf half runs when .peers/aiperf exists (criticalkv bench setup-peers --only aiperf)
.venv/bin/python -m pytest -q -s tests/bench/test_ground_truth.py
$PY -m benchmarks.targets $OUT

# ---- Replicas on Ray Serve (taken 2026-11-27 from 14:26 UTC on the shared 2-core VM, NOT idle: the
#      1-minute load average ran 10-290 while other jobs shared the machine; each file's table gives it per run) ----
# Engine: the README's policy with room for a context + question (context policy: the build's default,
#   layer-kvzip-criticalkv:kvzip_score=surrogate:head_cap_ratio=6):
#   .venv/bin/python scripts/build_engine.py --kv-policy criticalkv --budget 256 --max-input-len 2304 \
#     --max-new-tokens 256 --max-batch-size 8 --max-question-len 64 --output engines/ctx-ckv256
uptime
# 13. docqa (16 x 8, concurrency 8, OSL 64) on 1 replica (2 threads), 2 replicas with power-of-two routing, 2 with
#     context affinity + the shared store (1 thread each); every replica docqa's 4 uncompressed contexts of KV memory
#     (360 MiB) and cache; then a replica SIGKILLed with 4 streams in flight
$PY -m benchmarks.replicas --engine-dir engines/ctx-ckv256 --out $OUT --name replicas --no-progress
uptime
# 14. the same with 3 contexts of memory (270 MiB) per replica, power of two with the store too, no kill
$PY -m benchmarks.replicas --engine-dir engines/ctx-ckv256 --kv-contexts 3 --configs single,pow2,pow2-store,affinity \
  --no-fault --out $OUT --name replicas_kv3 --no-progress
# (replicas.md / replicas_kv3.md were then redrawn from their JSON by benchmarks.replicas.render after its ratio
#  table was added: no rerun)

# ---- the replicas' edges (taken 2026-11-29 from 11:31 UTC on the shared 2-core VM, NOT idle: load average 5-8) ----
# where `serve --replicas 2` listens, a 20 MB body's 413, processes left after a SIGKILLed launcher; each replica's
# memory; context requests with a replica SIGKILLed twice (results/benchmarks/serving/replicas_edge/README.md)
D=results/benchmarks/serving/replicas_edge
PYTHONPATH=$PWD .venv/bin/python $D/edges.py --engine-dir engines/smollm2-criticalkv --out $D/edges.json
PYTHONPATH=$PWD .venv/bin/python $D/memory.py --engine-dir engines/smollm2-criticalkv --served --out $D/memory_served.json
PYTHONPATH=$PWD .venv/bin/python $D/target.py --engine-dir engines/smollm2-criticalkv --max-seconds 900 \
  --out $D/target_1000.json
# (during that run, a second replica was SIGKILLed by hand: .venv/bin/python $D/kill_replica.py PORT, manual_kill.json)

# ---- The context cache in float16 (taken 2026-11-29 20:44-20:54 UTC, idle but for this run: cpu-exclusive; load
#      average 2.68 at the start (a job paused just before), 1.68 at the end) ----
# 15. docqa (16 x 8, concurrency 8, OSL 64, 4 uncompressed contexts of KV memory: 360 MiB) on the README's engine,
#     --context-cache-dtype float32 then float16 (interleaved in one call). The run's code: commit 96bd192 (its JSON
#     says 6763fb6-dirty: the float32 server started before the scheduler's last change was committed, which does
#     nothing with float32); the answers' agreement was added to its JSON and .md afterwards by
#     criticalkv.bench.docqa.dtype_agreement (no rerun)
$B bench docqa --engine-dir engines/smollm2-criticalkv --context-cache-dtype float32,float16 --out $OUT/docqa_cache_dtype
