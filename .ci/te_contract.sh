#!/usr/bin/env bash
# Downloads pyproject's `te-contract` extra (the Transformer Engine and megatron-core wheels docker/Dockerfile pins)
# WITHOUT dependencies and unpacks their Python source into a directory of its own (default .ci-te), for
# tests/test_megatron_te_contract.py, which reads that source and never imports it: TE's CUDA library is not
# there, and megatron-core 0.19's wheel is for Python 3.12. About 4 MB; nothing is installed into the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${INFIR2_TE_CONTRACT_DIR:-.ci-te}"
mapfile -t REQS < <(python - <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["te-contract"]))
PY
)
rm -rf "$TARGET"
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
python -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform any -d "$WHEELS" "${REQS[@]}"
mkdir -p "$TARGET"
for wheel in "$WHEELS"/*.whl; do
  python -m zipfile -e "$wheel" "$TARGET"
done
echo "TE contract source in $TARGET: ${REQS[*]}"
