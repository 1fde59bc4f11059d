"""docker/Dockerfile's pins against pyproject.toml: the image must install the project without replacing the base's
torch and transformers (pyproject's ranges hold them) and with a megatron-core the image's Python can run. The
SGLang wheel's own torch/transformers pins are checked in test_sglang_contract.py (it has the wheel)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from infir2_rl.engines.sglang.protocol import SGLANG_VERSION

ROOT = Path(__file__).resolve().parents[1]


def dockerfile_args() -> dict[str, str]:
    """``ARG NAME=value`` lines of the Dockerfile (the same name must not get two values)."""
    args: dict[str, str] = {}
    for name, value in re.findall(r"^ARG (\w+)=(\S+)$", (ROOT / "docker/Dockerfile").read_text(), re.M):
        assert args.setdefault(name, value) == value, f"ARG {name} set to {args[name]} and {value}"
    return args


def _requirements(names: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in names]
    return {r.name.lower(): r for r in reqs}


def test_image_pins_sit_in_pyprojects_ranges() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = _requirements(project["dependencies"])
    args = dockerfile_args()
    assert args["SGLANG_VERSION"] == SGLANG_VERSION
    assert Version(args["TORCH_VERSION"]) in deps["torch"].specifier, (args["TORCH_VERSION"], deps["torch"])
    transformers = Version(args["TRANSFORMERS_VERSION"])
    assert transformers in deps["transformers"].specifier, (transformers, deps["transformers"])
    megatron = _requirements(project["optional-dependencies"]["megatron"])["megatron-core"]
    assert Version(args["MEGATRON_CORE_VERSION"]) in megatron.specifier
    python = Version(args["PYTHON_VERSION"])
    assert python in SpecifierSet(project["requires-python"]) and python >= Version(
        "3.12"
    )  # megatron-core >= 0.17


def test_image_installs_what_it_pins_and_builds_te_against_its_torch() -> None:
    text = (ROOT / "docker/Dockerfile").read_text()
    assert re.search(r"^FROM lmsysorg/sglang:v\$\{SGLANG_VERSION\}-\$\{CUDA_TAG\}$", text, re.M)
    assert dockerfile_args()["CUDA_TAG"] == "cu130"  # TE's core_cu13 and megatron-core's te extra
    te_install = re.search(
        r"pip install [^\n]*--no-build-isolation[^\n]*\\\n\s*\"transformer_engine\[pytorch", text
    )
    assert te_install, "Transformer Engine's PyTorch extension must build with --no-build-isolation"
    for pin in (
        "TE_VERSION",
        "MEGATRON_CORE_VERSION",
        "TORCH_VERSION",
        "TRANSFORMERS_VERSION",
        "PYTHON_VERSION",
    ):
        assert "${" + pin + "}" in text, f"ARG {pin} is declared but never used or checked"
    assert "--no-deps" not in text  # it hid the base's torch/transformers conflict until run time
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs", ".ci-venv", ".ci-sglang"} <= set(ignored)
