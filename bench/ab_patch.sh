#!/usr/bin/env bash
# A/B of a code change on one machine: a benchmark run with the tree as it is (A) and with PATCH reverted (B),
# alternating A B A B so that drift hits both alike. From the repository root:
#
#   bash bench/ab_patch.sh PATCH OUT_DIR [rollout.py flags...]     # default flags: --batch-sizes 64 256
#                                                                     #   --new-tokens 128 --repeats 3
#   BENCH="python bench/train_step.py --cuda-graphs on" bash bench/ab_patch.sh PATCH OUT_DIR
#
# PATCH is a diff that the tree already contains (e.g. `git diff OLD NEW -- FILE > PATCH`). Without BENCH the
# benchmark is bench/rollout.py and the batch rows of each run are printed (compare the FP8 ms per decode
# step: tokens/s includes the prefill, which varies more). With BENCH, that command runs instead and each
# run's whole output goes to OUT_DIR/A1.log, B1.log, ...; its last AB_TAIL lines (default 30) are printed.
# The tree is left as it was found. Examples: bench/patches/ (docs/performance.md, sessions 21 and 22).
set -eu
patch_file=${1:?usage: bash bench/ab_patch.sh PATCH OUT_DIR [rollout.py flags...]}
out=${2:?usage: bash bench/ab_patch.sh PATCH OUT_DIR [rollout.py flags...]}
shift 2
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(--batch-sizes 64 256 --new-tokens 128 --repeats 3)
mkdir -p "$out"
patch --dry-run -s -R -p1 < "$patch_file" > /dev/null  # the tree must contain the change
run() {
    if [ -n "${BENCH:-}" ]; then
        bash -c "$BENCH" > "$out/$1.log" 2>&1 || echo "$1: exit $?"
        tail -n "${AB_TAIL:-30}" "$out/$1.log" | sed "s/^/$1 /"
    else
        python bench/rollout.py "${flags[@]}" --out "$out/$1.json" 2>&1 | grep -E "^ +[0-9]+ \|" | sed "s/^/$1 /"
    fi
}
trap 'patch -s -p1 --forward -r - < "$patch_file" > /dev/null || true' EXIT  # the change back in, whatever happens
for round in 1 2; do
    run "A$round"
    patch -s -R -p1 < "$patch_file"
    run "B$round"
    patch -s -p1 < "$patch_file"
done
