#!/usr/bin/env bash
# The CPU demo for several seeds at once, each run on 2 cores of its own (taskset), as on the 2-core
# machine the demo is sized for; a machine with 2N cores runs N seeds side by side. Usage, from the
# repository root:
#
#   bash bench/demo_seeds.sh OUT_DIR "0 1 2" [demo args and overrides...]    # e.g. rl:optimizer.lr=2e-4
#
# Each seed gets its own local Ray instance (own temp dir, no dashboard), OUT_DIR/s<seed>/ and
# OUT_DIR/s<seed>.log. CORE_OFFSET (default 0) is the first core used, JOBS (default cores/2) the number
# of runs at a time, LIMIT_S (default none) cuts each run (SIGINT) after that many seconds: running the
# same command again resumes every run where its checkpoints stopped. GPUs are hidden: this is the CPU demo.
# Ends with each run's held-out accuracy curve per stage (step:accuracy, from the stages' metrics.jsonl).
set -u
out=${1:?usage: bash bench/demo_seeds.sh OUT_DIR "SEEDS" [demo args...]}
seeds=${2:?usage: bash bench/demo_seeds.sh OUT_DIR "SEEDS" [demo args...]}
shift 2
jobs=${JOBS:-$(( $(nproc) / 2 ))}; (( jobs >= 1 )) || jobs=1
offset=${CORE_OFFSET:-0}
mkdir -p "$out"
export CUDA_VISIBLE_DEVICES="" INFIR2_RAY_DASHBOARD=0 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
slot=0
for seed in $seeds; do
    cores="$(( offset + 2 * slot )),$(( offset + 2 * slot + 1 ))"
    (
        export RAY_TMPDIR="/tmp/ray_demo_seeds_$(( offset + 2 * slot ))"
        mkdir -p "$RAY_TMPDIR"
        start=$(date +%s)
        ${LIMIT_S:+timeout -s INT "$LIMIT_S"} taskset -c "$cores" python -m infir2_rl.cli demo --seed "$seed" \
            --out "$out/s$seed" "$@" >>"$out/s$seed.log" 2>&1
        echo "seed $seed: exit $? after $(( $(date +%s) - start )) s on cores $cores" | tee -a "$out/s$seed.log"
    ) &
    slot=$(( slot + 1 ))
    if (( slot == jobs )); then wait; slot=0; fi
done
wait
# Held-out accuracy curve per seed and stage (step:accuracy), from each stage's metrics.jsonl.
python - "$out" $seeds <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for seed in sys.argv[2:]:
    curves = []
    for stage in ("sft_stage1", "sft_stage2", "rl_stage1", "rl_stage2"):
        path = out / f"s{seed}" / stage / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        points = [f"{r['step']}:{r['eval/accuracy']:.3f}" for r in rows if "eval/accuracy" in r]
        curves.append(f"{stage} " + " ".join(points))
    print(f"seed {seed}: " + " | ".join(curves))
PY
