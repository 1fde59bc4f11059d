#!/usr/bin/env bash
# GPU learning comparison: the 100m pipeline (configs/gpu/pipeline_100m.yaml) in the three precision setups
# (unified_fp8, bf16_train_fp8_rollout, bf16), same seed, run side by side on ONE GPU, then
# `infir2-rl report` overlays them (compare_*.png). Usage, on a GPU machine from the repository root:
#
#   bash bench/gpu_learning.sh OUT_DIR [SEEDS] [overrides...]    # e.g. sft:trainer.max_steps=50 rl:rollout.num_steps=3
#   MODES="unified_fp8 unified_fp8+top" bash bench/gpu_learning.sh OUT_DIR "0 1"   # fast vs true_on_policy, 2 seeds
#   SHARED_SFT=1 MODES="unified_fp8 unified_fp8+top" bash bench/gpu_learning.sh OUT_DIR "0 1"
#
# SHARED_SFT=1 (modes of one precision, e.g. fast vs true_on_policy, which differ only in RL): the SFT stages
# run once per seed, under the first mode (one pipeline per seed at once, cut at SFT_LIMIT_S, default 330 s);
# the other modes start from a copy of that run directory, whose pipeline_state.json marks SFT done, so every
# mode's RL starts from the same SFT checkpoint and only the RL stages run side by side (cut at LIMIT_S).
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
if [ -n "${SHARED_SFT:-}" ]; then
    precisions=$(printf '%s\n' "${specs[@]%+top}" | sort -u | wc -l)
    [ "$precisions" = 1 ] || { echo "SHARED_SFT=1 needs modes of one precision, got: ${specs[*]}"; exit 2; }
    cfg=$(pwd)/configs/gpu
    printf 'name: gpu_100m_sft\nrun_dir: unused\nstages:\n  - name: sft_stage1\n    config: %s/sft_stage1.yaml\n  - name: sft_stage2\n    config: %s/sft_stage2.yaml\n' \
        "$cfg" "$cfg" >"$out/pipeline_sft.yaml"
    for seed in "${seeds[@]}"; do
        mkdir -p "$out/s$seed"
        timeout "${SFT_LIMIT_S:-330}" python -m infir2_rl.cli demo --pipeline "$out/pipeline_sft.yaml" \
            --preset 100m --precision "${specs[0]%+top}" --seed "$seed" --out "$out/s$seed/${modes[0]}" "$@" \
            >"$out/s$seed/sft.log" 2>&1 &
    done
    wait
    echo "SFT for seeds ${seeds[*]} done in $(( $(date +%s) - start )) s"
    for seed in "${seeds[@]}"; do
        for mode in "${modes[@]:1}"; do cp -r "$out/s$seed/${modes[0]}" "$out/s$seed/$mode"; done
    done
fi
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
