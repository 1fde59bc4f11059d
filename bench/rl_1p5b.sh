#!/usr/bin/env bash
# Issue 20, item 4: unified FP8 RL at the Qwen2.5-1.5B shape (random weights, Qwen's 151,936-token vocabulary),
# trainer and native engine colocated on ONE GPU, STEPS RL steps (default 50) of configs/gpu/rl_stage1.yaml
# (32 prompts x 8 samples, T = 1.0), cuda_ipc weight sync after every step. Random weights rarely stop, so
# nearly every response runs to max_response_len: the heaviest case for memory. Dynamic sampling is off so
# every step trains (rewards are all 0, the update is ~0, but forward, backward and optimizer run in full).
# Prints, per step, the phase peaks (memory/{rollout,score,train,sync}_peak_gb and _reserved_gb), the
# step's phase times and the engine's decode-graph capture seconds in its rollout (rollout/graph_capture_s),
# then whether all STEPS steps finished. Usage, from the repository root on a GPU machine:
#
#   bash bench/rl_1p5b.sh OUT_DIR [overrides...]      # e.g. STEPS=10 ... rollout.max_response_len=128
#
# At the recipe's response length (64 responses of up to 8K tokens, ~50 s a step on an H200; docs/performance.md,
# "Unified FP8 RL at 1.5B", session 46), once per precision=bf16 / unified_fp8:
#   STEPS=3 bash bench/rl_1p5b.sh OUT_DIR precision=unified_fp8 rollout.max_response_len=8192 \
#       rollout.prompts_per_step=8 rollout.n_samples_per_prompt=8 rollout.over_sampling_prompts=8 \
#       trainer.max_tokens_per_gpu=16384
# and the second stage's 16K at T = 1.1 (~130-140 s a step; session 47): the same with rollout.max_response_len=16384
# rollout.temperature=1.1 trainer.max_tokens_per_gpu=18432 (a row of 16,448 tokens pads to the 18,432 bucket).
# The recipe's trainer for that stage (megatron, recompute; session 52, ~150 s a step): add
# trainer.backend=megatron model.gradient_checkpointing=true.
# A second table gives each step's response lengths, rollout tokens/s and train/rollout mismatch.
# An 80 GB GPU's memory on an H200: start bench/gpu_ballast.py first (its docstring; session 48 ran the 16K
# command so).
#
# LIMIT_S (default: none) cuts the run after that many seconds; the steps logged so far are still printed. Budget
# for the stage's final checkpoint after the last step (22-30 s at 1.5B on an H200): a cut there loses no step but
# exits 124.
# NUM_GPUS (default 1) is what the run's Ray head offers: with 2, e.g. placement.mode=disaggregate (trainer on
# one GPU, engine on the other, nccl weight sync) or trainer.num_workers=2 rollout.num_engines=2 (two trainer
# ranks, replicas at this size by trainer.data_parallel=auto, an engine colocated on each).
set -u
out=${1:?usage: bash bench/rl_1p5b.sh OUT_DIR [overrides...]}
shift
steps=${STEPS:-50}
# A stage resumes from its run directory's checkpoints: in a used OUT the run would continue (or find nothing to
# do) and print the old steps again as if measured now (session 40 lost a device call to that).
if [ -e "$out/run" ]; then
    echo "bench/rl_1p5b.sh: $out/run exists (an earlier run): give a new OUT_DIR, every measurement starts fresh" >&2
    exit 2
fi
mkdir -p "$out"
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
model=$(python -c 'import sys; sys.path.insert(0, "bench"); from train_step import model_dir; print(model_dir(False))')
python -m infir2_rl.cli make-data --out "$out/data" --num-sft 16 --num-rl 4096 >/dev/null
if ! command -v ray >/dev/null; then  # Ray importable (e.g. on PYTHONPATH) but its CLI not installed
    ray() { python -c 'import sys; from ray.scripts.scripts import main; sys.argv[0] = "ray"; main()' "$@"; }
fi
ray stop --force >/dev/null 2>&1
ray start --head --num-gpus="${NUM_GPUS:-1}" --include-dashboard=false --disable-usage-stats >"$out/ray_start.log" 2>&1 \
    || { cat "$out/ray_start.log"; exit 1; }
export RAY_ADDRESS=auto
start=$(date +%s)
timeout "${LIMIT_S:-86400}" python -m infir2_rl.cli run configs/gpu/rl_stage1.yaml \
    "model.path=$model" "data.train_path=$out/data/rl_train.jsonl" "data.test_path=null" \
    "run_dir=$out/run" "rollout.num_steps=$steps" rollout.eval_every=0 rollout.dynamic_sampling=false \
    rollout.max_response_len=256 data.max_prompt_tokens=64 trainer.micro_batch_size=32 \
    metrics.dense_trainer_mismatch=false "$@" >"$out/run.log" 2>&1
rc=$?
echo "exit $rc after $(( $(date +%s) - start )) s (log: $out/run.log)"
ray stop --force >/dev/null 2>&1
python - "$out/run/metrics.jsonl" "$steps" <<'EOF'
import json, sys
from pathlib import Path

path, want = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
rows = [r for r in rows if "memory/train_peak_gb" in r]
phases = ("rollout", "score", "train", "sync")
print("step | " + " | ".join(f"{p} peak/reserved GiB" for p in phases) + " | rollout / old_logprobs / train / weight_sync s"
      + " | decode-graph capture in the rollout s | weight sync phase / push / self-check ms")
for r in rows:
    cells = [f"{r.get(f'memory/{p}_peak_gb', float('nan')):6.2f} / {r.get(f'memory/{p}_reserved_gb', float('nan')):6.2f}" for p in phases]
    # old_logprobs: "-" when no row was scored before the first update (one update per rollout: stages/rl.py)
    times = " / ".join(f"{r[f'time/{t}_s']:.2f}" if f"time/{t}_s" in r else "-" for t in ("rollout", "old_logprobs", "train", "weight_sync"))
    capture = f"{r['rollout/graph_capture_s']:.3f}" if "rollout/graph_capture_s" in r else "-"
    sync = " / ".join(f"{r[k] * 1e3:.1f}" if k in r else "-" for k in ("time/weight_sync_s", "weight_sync/push_s", "weight_sync/check_s"))
    print(f"{r['step']:4d} | " + " | ".join(cells) + f" | {times} | {capture} | {sync}")
# What the step did: response lengths (random weights rarely stop), the rollout's tokens/s, the mismatch.
# Then whether the trainer dropped its layer graphs after the push so that the next rollout's KV cache fits
# (memory/trainer_graphs_dropped; stages/rl_setup.make_room_for_rollout) and that phase's seconds.
# rollout/kv_slots_short: KV-cache slots the rollout's rows wanted and the engine did not get for memory (they took turns).
print("step | response mean | response max | rollout tokens/s | KV slots short | K3 | mean |dlogp| | graphs dropped for the next rollout | make_room s")
fields = (("rollout/response_len_mean", ".0f"), ("rollout/response_len_max", ".0f"), ("rollout/tokens_per_s", ".0f"),
          ("rollout/kv_slots_short", ".0f"), ("mismatch/k3", ".3g"), ("mismatch/abs_logp_diff_mean", ".3g"),
          ("memory/trainer_graphs_dropped", ".0f"), ("time/make_room_s", ".3f"))
for r in rows:
    print(f"{r['step']:4d} | " + " | ".join(format(r[k], f) if k in r else "-" for k, f in fields))
for p in phases:
    vals = [r[f"memory/{p}_peak_gb"] for r in rows if f"memory/{p}_peak_gb" in r]
    res = [r[f"memory/{p}_reserved_gb"] for r in rows if f"memory/{p}_reserved_gb" in r]
    if vals:
        print(f"max over steps, {p}: peak {max(vals):.2f} GiB, reserved {max(res):.2f} GiB")
print(f"{len(rows)} of {want} steps logged: {'ALL' if len(rows) >= want else 'NOT ALL'}")
EOF
exit $rc
