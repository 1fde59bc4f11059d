#!/usr/bin/env bash
# A/B of a code change in the decode step, on one machine: bench/rollout.py with the tree as it is (A) and with
# PATCH reverted (B), alternating A B A B so that drift hits both alike. From the repository root:
#
#   bash bench/ab_patch.sh PATCH OUT_DIR [rollout.py flags...]     # default flags: --batch-sizes 64 256
#                                                                     #   --new-tokens 128 --repeats 3
#
# PATCH is a diff that the tree already contains (e.g. `git diff OLD NEW -- FILE > PATCH`). Prints the batch rows
# of each run (compare the FP8 ms per decode step: tokens/s includes the prefill, which varies more) and leaves
# the tree as it found it. Example: bench/patches/session21_quant_division.patch (docs/performance.md, session 21).
set -eu
patch_file=${1:?usage: bash bench/ab_patch.sh PATCH OUT_DIR [rollout.py flags...]}
out=${2:?usage: bash bench/ab_patch.sh PATCH OUT_DIR [rollout.py flags...]}
shift 2
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(--batch-sizes 64 256 --new-tokens 128 --repeats 3)
mkdir -p "$out"
patch --dry-run -s -R -p1 < "$patch_file" > /dev/null  # the tree must contain the change
run() { python bench/rollout.py "${flags[@]}" --out "$out/$1.json" 2>&1 | grep -E "^ +[0-9]+ \|" | sed "s/^/$1 /"; }
trap 'patch -s -p1 --forward -r - < "$patch_file" > /dev/null || true' EXIT  # the change back in, whatever happens
for round in 1 2; do
    run "A$round"
    patch -s -R -p1 < "$patch_file"
    run "B$round"
    patch -s -p1 < "$patch_file"
done
