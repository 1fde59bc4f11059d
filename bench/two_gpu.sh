#!/usr/bin/env bash
# Issue 17's runs, for ONE machine with TWO GPUs (what ran on 2 x H200 and what did not: docs/performance.md,
# "Two GPUs"). From the repository root, with the project installed (or `source .devbundle/setup.sh`):
#
#   bash bench/two_gpu.sh OUT_DIR [PART...]       # PART: tests dp sync rl megatron (default: all, in that order)
#
# tests     The nccl transport on real NCCL first (trainer actor on GPU 0, engine actor on GPU 1): pushes land byte
#           for byte, and a killed engine fails the push within weight_sync.timeout_s while the trainer process
#           survives (torch's NCCL wait-with-timeout abort path); then the one-GPU -m gpu tests of the pieces used.
# dp        The 100m GPU pipeline (configs/gpu/pipeline_100m.yaml, unified_fp8) four times: on GPU 0 alone
#           (one trainer worker, its engine colocated), then on both GPUs with trainer.num_workers=2 and one
#           colocated engine per GPU: as replicas (trainer.data_parallel=replicate, what auto picks at this
#           size), and under FSDP2 (=fsdp) gathering BF16 (trainer.fsdp_param_dtype=auto, the GPU default) and
#           FP32 (=float32). Prints each stage's median step times beside the one-GPU run's.
# sync      bench/weight_sync_nccl.py: trainer on GPU 0, engine on GPU 1, Qwen2.5-1.5B shape, object store vs
#           nccl push (goal: nccl push <= 100 ms); JSON in OUT_DIR/sync.json.
# rl        The same pipeline with its RL stages disaggregated (trainer on GPU 0, engine on GPU 1,
#           weight_sync.transport=nccl): RL step times beside dp's one-GPU colocated run (cuda_ipc).
# megatron  The same pipeline with trainer.backend=megatron at tensor_parallel_size=2 over both GPUs (needs
#           pip install -e '.[megatron]'); step times beside the torch backend's one-GPU run.
#
# Each pipeline run is cut at LIMIT_S seconds (default 1500); its metrics are kept whatever happens. EXTRA (a
# space-separated list of overrides, e.g. "sft:trainer.max_steps=40 rl:rollout.num_steps=6") is appended to every
# pipeline run, to shorten the stages when only step times are wanted; PIPELINE picks another pipeline YAML
# (configs/gpu/pipeline_100m_steps.yaml: SFT 1 -> cast -> RL 1 only). Step times
# are medians over a stage's steps after its first (start-up and CUDA-graph capture excluded), read from the
# run's metrics.jsonl: perf/step_time_s (trainer), time/<phase>_s (RL phases), weight_sync/push_s.
set -u
out=${1:?usage: bash bench/two_gpu.sh OUT_DIR [tests|dp|sync|rl|megatron ...]}
shift
parts=${*:-tests dp sync rl megatron}
mkdir -p "$out"
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 INFIR2_RAY_DASHBOARD=0  # minimal Ray: no dashboard
gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -lt 2 ]; then echo "bench/two_gpu.sh needs two GPUs; this machine has $gpus"; exit 1; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' | tee -a "$out/gpus.txt"

pipeline() {  # pipeline NAME VISIBLE_GPUS [overrides...]: one run of the 100m pipeline, logged to OUT_DIR/NAME.log
    local name=$1 visible=$2; shift 2
    echo "== $name (GPUs $visible): $*"
    local start; start=$(date +%s)
    CUDA_VISIBLE_DEVICES=$visible timeout "${LIMIT_S:-1500}" python -m infir2_rl.cli demo \
        --pipeline "${PIPELINE:-configs/gpu/pipeline_100m.yaml}" --preset 100m --precision unified_fp8 --out "$out/$name" "$@" ${EXTRA:-} \
        >"$out/$name.log" 2>&1
    echo "   exit $? after $(( $(date +%s) - start )) s; $(grep -c 'finished in' "$out/$name.log") stages finished"
}

step_times() {  # step_times RUN_DIR...: median per-step times of every stage, one row per run and stage
    python - "$@" <<'EOF'
import statistics, sys
from infir2_rl.metrics.report import load_run
keys = ("perf/step_time_s", "time/rollout_s", "time/train_s", "time/weight_sync_s", "weight_sync/push_s")
print(f"{'run':<24} {'stage':<12} {'steps':>5} " + " ".join(f"{k.split('/')[1].removesuffix('_s'):>12}" for k in keys) + "   (median s)")
for run in sys.argv[1:]:
    for stage in load_run(run):
        cells = []
        for key in keys:
            steps, values = stage.series(key)
            later = [v for s, v in zip(steps, values) if s > 1]
            cells.append(f"{statistics.median(later):12.3f}" if later else f"{'-':>12}")
        print(f"{run.rstrip('/').split('/')[-1]:<24} {stage.name:<12} {sum(1 for s in stage.steps if s > 0):>5} " + " ".join(cells))
EOF
}

for part in $parts; do
    case $part in
    tests)
        python -m pytest -q -p no:cacheprovider tests/test_weight_sync_nccl_ray.py -k gpu 2>&1 | tee "$out/tests_nccl.log"
        python -m pytest -q -p no:cacheprovider -m gpu tests/test_weight_sync_ipc.py tests/test_trainer_gpu.py \
            2>&1 | tail -5 | tee "$out/tests_gpu.log"
        ;;
    dp)
        [ -d "$out/one_gpu" ] || pipeline one_gpu 0
        # Same global batches: SFT's 64 conversations as 2 ranks x one micro-batch of 32, RL's 256 samples as 2 x 128.
        dp2=(sft:trainer.num_workers=2 sft:trainer.micro_batch_size=32 rl:trainer.num_workers=2 rl:rollout.num_engines=2)
        pipeline dp2_replicate 0,1 "${dp2[@]}" sft:trainer.data_parallel=replicate rl:trainer.data_parallel=replicate
        dp2+=(sft:trainer.data_parallel=fsdp rl:trainer.data_parallel=fsdp)
        pipeline dp2_bf16_gather 0,1 "${dp2[@]}"
        runs=("$out/one_gpu" "$out/dp2_replicate" "$out/dp2_bf16_gather")
        if [ "${DP_FP32:-1}" = 1 ]; then  # DP_FP32=0 skips the FP32-gather run
            pipeline dp2_fp32_gather 0,1 "${dp2[@]}" sft:trainer.fsdp_param_dtype=float32 rl:trainer.fsdp_param_dtype=float32
            runs+=("$out/dp2_fp32_gather")
        fi
        step_times "${runs[@]}" | tee "$out/dp_step_times.txt"
        ;;
    sync)
        python bench/weight_sync_nccl.py --out "$out/sync.json" 2>&1 | tee "$out/sync.log"
        ;;
    rl)
        [ -d "$out/one_gpu" ] || pipeline one_gpu 0
        pipeline disaggregated_nccl 0,1 rl:placement.mode=disaggregate rl:weight_sync.transport=nccl
        step_times "$out/one_gpu" "$out/disaggregated_nccl" | tee "$out/rl_step_times.txt"
        ;;
    megatron)
        [ -d "$out/one_gpu" ] || pipeline one_gpu 0
        pipeline megatron_tp2 0,1 sft:trainer.backend=megatron rl:trainer.backend=megatron \
            sft:trainer.tensor_parallel_size=2 rl:trainer.tensor_parallel_size=2 \
            sft:trainer.num_workers=2 rl:trainer.num_workers=2  # one model replica: TP ranks share each micro-batch
        step_times "$out/one_gpu" "$out/megatron_tp2" | tee "$out/megatron_step_times.txt"
        ;;
    *) echo "unknown part $part (tests, dp, sync, rl, megatron)"; exit 2 ;;
    esac
done
