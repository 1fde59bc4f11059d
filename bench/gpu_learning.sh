#!/usr/bin/env bash
# GPU learning comparison: the 100m pipeline (configs/gpu/pipeline_100m.yaml) in the three precision setups
# (unified_fp8, bf16_train_fp8_rollout, bf16), same seed, run side by side on ONE GPU, then
# `infir2-rl report` overlays them (compare_*.png). Usage, on a GPU machine from the repository root:
#
#   bash bench/gpu_learning.sh OUT_DIR [SEEDS] [overrides...]    # e.g. sft:trainer.max_steps=50 rl:rollout.num_steps=3
#   MODES="unified_fp8 unified_fp8+top" bash bench/gpu_learning.sh OUT_DIR "0 1"   # fast vs true_on_policy, 2 seeds
#
# MODES (default: the three precision setups) lists the runs; a mode ending in "+top" runs its RL stages with
# true_on_policy=true (the trainer's log-probs equal the engine's bit for bit) and is named <mode>_top. SEEDS
# (default 0) may list several seeds: every (seed, mode) runs at once, in OUT_DIR/s<seed>/<mode>.
# One Ray head with 3 logical GPUs that all map to the one physical GPU (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES:
# every actor sees cuda:0), so each pipeline's placement group takes "its" GPU and the three runs overlap; a
# 100M model leaves the GPU mostly idle between kernel launches, so they slow each other down little. Each run
# is cut at LIMIT_S seconds (default 500) and the metrics are kept whatever happens. Writes OUT_DIR/s<seed>/<mode>/
# (full run dirs), OUT_DIR/s<seed>/<mode>.log and OUT_DIR/s<seed>/compare/; prints each run's summary table.
set -u
out=${1:?usage: bash bench/gpu_learning.sh OUT_DIR [SEEDS] [overrides...]}
read -r -a seeds <<< "${2:-0}"
shift $(( $# >= 2 ? 2 : 1 ))
read -r -a specs <<< "${MODES:-unified_fp8 bf16_train_fp8_rollout bf16}"
modes=("${specs[@]/+top/_top}")
mkdir -p "$out"
if ! command -v ray >/dev/null; then  # Ray importable (e.g. on PYTHONPATH) but its CLI not installed
    ray() { python -c 'import sys; from ray.scripts.scripts import main; sys.argv[0] = "ray"; main()' "$@"; }
fi
export RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ray stop --force >/dev/null 2>&1
ray start --head --num-gpus=$(( ${#modes[@]} * ${#seeds[@]} )) --include-dashboard=false --disable-usage-stats \
    >"$out/ray_start.log" 2>&1 || { cat "$out/ray_start.log"; exit 1; }
export RAY_ADDRESS=auto
start=$(date +%s)
for seed in "${seeds[@]}"; do
    mkdir -p "$out/s$seed"
    for spec in "${specs[@]}"; do
        mode=${spec/+top/_top}
        top=(); [ "$spec" != "${spec%+top}" ] && top=(rl:true_on_policy=true)
        timeout "${LIMIT_S:-500}" python -m infir2_rl.cli demo --pipeline configs/gpu/pipeline_100m.yaml \
            --preset 100m --precision "${spec%+top}" --seed "$seed" --out "$out/s$seed/$mode" "${top[@]}" "$@" \
            >"$out/s$seed/$mode.log" 2>&1 &
    done
done
wait
echo "$(( ${#modes[@]} * ${#seeds[@]} )) runs done in $(( $(date +%s) - start )) s"
ray stop --force >/dev/null 2>&1
for seed in "${seeds[@]}"; do
    d="$out/s$seed"
    for mode in "${modes[@]}"; do echo "== seed $seed $mode: $(grep -c 'finished in' "$d/$mode.log") stages finished"; done
    python -m infir2_rl.cli report "${modes[@]/#/$d/}" --compare-out "$d/compare" 2>&1 | grep -v "^wrote"
done
