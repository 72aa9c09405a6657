#!/usr/bin/env bash
# The AR vs diffusion speed study on the shipped models, plus 8B-shape forward-latency curves and each
# sampler's projected speed at that scale, written to one folder.
#
#   bash eval/gpu_study.sh [OUT]          # on a CUDA GPU: full settings, under 10 minutes
#   SMALL=1 bash eval/gpu_study.sh [OUT]  # small settings (the default where CUDA is missing): CPU-sized
#
# OUT (default runs/gpu_study_<date>) receives: results.json/.md and plots of the study, study.log;
# cost_model.json/.md, latency.png, projection.png, cost.log (8B-class targets: cost_model.md's grid says
# which configuration is valid on which target; the shipped diffusion model is block-causal, so its
# block-cached configurations are projected onto llada-8b+blockN, LLaDA-8B's shape with block-causal
# attention in the shipped model's blocks, and never onto the bidirectional llada-8b); selfcheck/ (the cost model
# on the shipped models' own shapes, projected from the same results: compare its projected speedups with
# the measured ones to see how far "forward time is all that counts" holds on this device); head_cost/ (fef's
# draft-head steps against the state call at HEAD_ARCH's shape, default llada-8b: eval/study/head_cost.py); trees/
# (configs/bench_trees.toml at batch 1 on the shipped models: draft trees against chains, ar_spec and fef);
# round_parts.log and compile/ (ROUNDS=0 skips: where a round's time goes at batch 1 and 8, and two-stream fef's head
# steps compiled, CUDA graphs on a GPU, and cut adaptively, against the eager chain);
# real_shape/ and real_shape_compile/ (eval/study/real_shape.py: REAL_ARCH, default llada-8b, random bf16 weights at
# REAL_LAYERS, default its full depth on a GPU, loaded by dllm.load from a hub-layout folder; sequential and fef w8 at
# batch 1 and 8: peak memory above the weights beside `dllm plan`'s, time per round, the sampler's share, syncs per
# round; the second folder with each layer's attention and MLP under torch.compile). Writing the full-depth random
# checkpoint (16 GB for LLaDA-8B, kept in REAL_CACHE) and loading it once per run adds several minutes.
#
# Overrides (environment): MODEL_AR, MODEL_DIFFUSION, MODEL_DRAFTER (folders; default the shipped models),
# PROMPTS, NUM_PROMPTS, MAX_NEW_TOKENS, BATCH_SIZE, REPEATS, WARMUP, THREADS, COST_ROLES (name=arch,...; a
# name may repeat to project onto several targets),
# COST_ARCHS (extra archs, comma-separated), COST_ROWS, COST_TOKENS, COST_CONTEXTS, COST_LAYERS, COST_REPS,
# SELFCHECK (0 to skip), HEAD_ARCH, HEAD_LAYERS, HEAD_COST (0 to skip), TREES (0 to skip), REAL_SHAPE (0 to skip),
# REAL_ARCH, REAL_LAYERS, REAL_BATCHES, REAL_SAMPLERS, REAL_NEW_TOKENS, REAL_TIME_LIMIT, REAL_COMPILE (0 to skip the
# compiled runs), REAL_CACHE, PYTHON.
set -euo pipefail

OUT=${1:-runs/gpu_study_$(date +%Y%m%d_%H%M%S)}
PY=${PYTHON:-python}
if [[ -z "${SMALL:-}" ]]; then
  if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then SMALL=0; else SMALL=1; fi
fi

if [[ "$SMALL" == 1 ]]; then  # a CPU: a few prompts, short answers, 1-2 layers of the 8B shapes
  : "${NUM_PROMPTS:=8}" "${MAX_NEW_TOKENS:=32}" "${BATCH_SIZE:=4}" "${REPEATS:=2}"
  : "${COST_ROWS:=1,4}" "${COST_TOKENS:=1,16}" "${COST_CONTEXTS:=0,64}" "${COST_LAYERS:=1,2}" "${COST_REPS:=2}"
  : "${SELF_ROWS:=1,8,32}" "${SELF_TOKENS:=1,8,64,256}" "${SELF_CONTEXTS:=0,128}"
else
  : "${NUM_PROMPTS:=64}" "${MAX_NEW_TOKENS:=64}" "${BATCH_SIZE:=16}" "${REPEATS:=3}"
  : "${COST_ROWS:=1,4,16,64}" "${COST_TOKENS:=1,8,32,128}" "${COST_CONTEXTS:=0,256,1024}" "${COST_LAYERS:=2,4}"
  : "${COST_REPS:=5}"
  : "${SELF_ROWS:=1,4,16,64,144}" "${SELF_TOKENS:=1,8,32,128,256}" "${SELF_CONTEXTS:=0,128,256}"
fi
: "${PROMPTS:=synthetic}" "${WARMUP:=1}" "${SELFCHECK:=1}" "${COST_ARCHS:=}" "${HEAD_COST:=1}" "${HEAD_ARCH:=llada-8b}" "${TREES:=1}" "${ROUNDS:=1}"
if [[ "$SMALL" == 1 ]]; then : "${HEAD_LAYERS:=1,2}"; else : "${HEAD_LAYERS:=2,4}"; fi
: "${REAL_SHAPE:=1}" "${REAL_ARCH:=llada-8b}" "${REAL_BATCHES:=1,8}" "${REAL_SAMPLERS:=sequential,fef:window=8}"
: "${REAL_CACHE:=$HOME/.cache/dllm/real_shape}" "${REAL_COMPILE:=1}"
if [[ "$SMALL" == 1 ]]; then  # a CPU: 2 layers, short answers, no compiled runs
  : "${REAL_LAYERS:=2}" "${REAL_NEW_TOKENS:=64}" "${REAL_TIME_LIMIT:=300}"
  REAL_COMPILE=0
else
  : "${REAL_LAYERS:=$("$PY" -c "from dllm.eval.study.cost_model import ARCHS; print(ARCHS['$REAL_ARCH']['n_layers'])")}"
  : "${REAL_NEW_TOKENS:=256}" "${REAL_TIME_LIMIT:=300}"
fi

shipped() { "$PY" -c "from dllm.eval.study.bench import DEFAULT_MODELS; print(DEFAULT_MODELS['$1'])"; }
MODEL_AR=${MODEL_AR:-$(shipped ar)}
MODEL_DIFFUSION=${MODEL_DIFFUSION:-$(shipped diffusion)}
MODEL_DRAFTER=${MODEL_DRAFTER:-$(shipped drafter)}
# The block-causal 8B target takes the study model's block size (its block-cached call shapes need it).
BLOCK=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1] + '/config.json')).get('block_size') or '')" \
  "$MODEL_DIFFUSION" 2>/dev/null || true)
: "${COST_ROLES:=ar=qwen3-8b,diffusion=llada-8b${BLOCK:+,diffusion=llada-8b+block$BLOCK},drafter=qwen3-0.6b}"

common=(--device "${DEVICE:-auto}" --dtype "${DTYPE:-bfloat16}")
[[ -n "${THREADS:-}" ]] && common+=(--threads "$THREADS")
roles=()
for pair in ${COST_ROLES//,/ }; do roles+=(--role "$pair"); done
archs=()
for arch in ${COST_ARCHS//,/ }; do archs+=(--arch "$arch"); done

mkdir -p "$OUT"
echo "== study -> $OUT (SMALL=$SMALL)"
"$PY" -m dllm.eval.study.bench "${common[@]}" --model "ar=$MODEL_AR" --model "diffusion=$MODEL_DIFFUSION" \
  --model "drafter=$MODEL_DRAFTER" --prompts "$PROMPTS" --num-prompts "$NUM_PROMPTS" \
  --max-new-tokens "$MAX_NEW_TOKENS" --batch-size "$BATCH_SIZE" --repeats "$REPEATS" --warmup "$WARMUP" \
  --output "$OUT" 2>&1 | tee "$OUT/study.log"

echo "== cost model and projection (${COST_ROLES})"
"$PY" -m dllm.eval.study.bench --cost-model "${common[@]}" --results "$OUT/results.json" "${roles[@]}" \
  ${archs[@]+"${archs[@]}"} --cost-rows "$COST_ROWS" --cost-tokens "$COST_TOKENS" \
  --cost-contexts "$COST_CONTEXTS" --cost-layers "$COST_LAYERS" --cost-reps "$COST_REPS" \
  --output "$OUT" 2>&1 | tee "$OUT/cost.log"

if [[ "$SELFCHECK" != 0 ]]; then
  echo "== self-check: the shipped shapes on this device, projected from the same results"
  "$PY" -m dllm.eval.study.bench --cost-model "${common[@]}" --results "$OUT/results.json" \
    --role "ar=$MODEL_AR" --role "diffusion=$MODEL_DIFFUSION" --role "drafter=$MODEL_DRAFTER" \
    --cost-rows "$SELF_ROWS" --cost-tokens "$SELF_TOKENS" --cost-contexts "$SELF_CONTEXTS" \
    --cost-layers "${SELF_LAYERS:-full}" --cost-reps "$COST_REPS" \
    --output "$OUT/selfcheck" 2>&1 | tee "$OUT/selfcheck.log"
fi
if [[ "$HEAD_COST" != 0 ]]; then
  echo "== draft-head steps against the state call at ${HEAD_ARCH}'s shape"
  "$PY" -m dllm.eval.study.head_cost --arch "$HEAD_ARCH" --layers "$HEAD_LAYERS" --device "${DEVICE:-auto}" \
    --dtype "${DTYPE:-bfloat16}" --reps "$COST_REPS" --output "$OUT/head_cost" 2>&1 | tee "$OUT/head_cost.log"
fi
if [[ "$TREES" != 0 ]]; then
  echo "== draft trees against chains at batch 1 (configs/bench_trees.toml)"
  "$PY" -m dllm.eval.study.bench "${common[@]}" --config-file configs/bench_trees.toml --num-prompts "$NUM_PROMPTS" \
    --max-new-tokens "$MAX_NEW_TOKENS" --repeats "$REPEATS" --warmup "$WARMUP" --output "$OUT/trees" 2>&1 \
    | tee "$OUT/trees.log"
fi
if [[ "$ROUNDS" != 0 ]]; then
  echo "== where a round's time goes (eval/study/round_parts.py), and fef's compiled head step against the eager one"
  "$PY" -m dllm.eval.study.round_parts --batch-size 1 8 --num-prompts "$NUM_PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS" \
    --dtype "${DTYPE:-bfloat16}" 2>&1 | tee "$OUT/round_parts.log"
  "$PY" -m dllm.eval.study.bench "${common[@]}" --num-prompts "$NUM_PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS" \
    --batch-size 1 --repeats "$REPEATS" --warmup "$WARMUP" --baseline "fef ts w8 head" \
    --config "name=fef ts w8 head;model=two_stream;sampler=fef;window=8;draft=head" \
    --config "name=fef ts w8 head compile;model=two_stream;sampler=fef;window=8;draft=head;compile=true" \
    --config "name=fef ts w8 head cut0.05;model=two_stream;sampler=fef;window=8;draft=head;draft_cutoff=0.05" \
    --output "$OUT/compile" 2>&1 | tee "$OUT/compile.log"
fi
if [[ "$REAL_SHAPE" != 0 ]]; then
  real=(--arch "$REAL_ARCH" --layers "$REAL_LAYERS" --dtype "${DTYPE:-bfloat16}" --device "${DEVICE:-auto}"
        --batch-sizes "$REAL_BATCHES" --samplers "$REAL_SAMPLERS" --prompt-length 30 --max-new-tokens "$REAL_NEW_TOKENS"
        --time-limit "$REAL_TIME_LIMIT" --cache-dir "$REAL_CACHE")
  [[ -n "${THREADS:-}" ]] && real+=(--threads "$THREADS")
  echo "== real-shape study: $REAL_ARCH, random weights, $REAL_LAYERS layers, $REAL_SAMPLERS at batch $REAL_BATCHES"
  "$PY" -m dllm.eval.study.real_shape "${real[@]}" --output "$OUT/real_shape" 2>&1 | tee "$OUT/real_shape.log"
  if [[ "$REAL_COMPILE" != 0 ]]; then
    echo "== real-shape study under torch.compile (each layer's attention and MLP)"
    "$PY" -m dllm.eval.study.real_shape "${real[@]}" --compile --output "$OUT/real_shape_compile" 2>&1 \
      | tee "$OUT/real_shape_compile.log"
  fi
fi
echo "== done: $OUT"
