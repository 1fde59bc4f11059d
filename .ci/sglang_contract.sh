#!/usr/bin/env bash
# Installs pyproject's `sglang-contract` extra (the pinned SGLang wheel and the few light modules its request
# classes import) WITHOUT dependencies into a directory of its own (default .ci-sglang), for
# tests/test_sglang_contract.py. SGLang's own dependencies (CUDA kernels, a pinned torch) are never installed.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${INFIR2_SGLANG_CONTRACT_DIR:-.ci-sglang}"
mapfile -t REQS < <(python - <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["sglang-contract"]))
PY
)
rm -rf "$TARGET"
python -m pip install -q --no-deps --target "$TARGET" "${REQS[@]}"
echo "SGLang contract wheel in $TARGET: ${REQS[*]}"
