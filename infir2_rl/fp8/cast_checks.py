"""What ``cast-fp8`` checks of its input before and while casting (see ``checkpoint.py``).

Each check raises ValueError naming the file or tensor and the fix, so the command exits 2 with one line:
the index (``model.safetensors.index.json``) must agree with the shards' headers, every shard must be a
complete safetensors file, and every floating tensor must be finite.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"


def config_of(model_dir: Path) -> dict:
    """The directory's config.json as a dict; ValueError whose message is the reason alone ("not valid JSON
    (...)" or "a JSON list, not an object"), for the caller to put after the path it names."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"a JSON {type(config).__name__}, not an object")
    return config


def is_blockwise_fp8(config: dict[str, Any]) -> bool:
    """Whether an HF ``config.json`` describes a checkpoint of 128x128-block FP8 weights with ``weight_scale_inv``
    (what ``checkpoint.cast_checkpoint`` writes and SGLang's Fp8Config reads)."""
    quant = config.get("quantization_config")
    return (
        isinstance(quant, dict)
        and quant.get("quant_method") == "fp8"
        and list(quant.get("weight_block_size") or []) == [128, 128]
    )


def weight_map_of(model_dir: Path) -> dict[str, str] | None:
    """The index's tensor -> shard map, or None for a directory without an index."""
    index = model_dir / INDEX_NAME
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{index}: not a safetensors index with a 'weight_map' ({type(exc).__name__}: {exc}); "
            "restore the file or delete it if the directory has a single model.safetensors"
        ) from exc
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' is not an object; restore the index file")
    return weight_map


def shard_keys(path: Path) -> dict[str, str]:
    """Tensor name -> dtype of a shard, from its header; a missing, truncated or corrupt shard is named."""
    if not path.is_file():
        raise ValueError(f"{path}: shard listed in {INDEX_NAME} does not exist; restore it or fix the index")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_slice(key).get_dtype() for key in f.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own SafetensorError (not an OSError)
        raise ValueError(
            f"{path}: unreadable safetensors shard ({type(exc).__name__}: {exc}); the file is truncated or "
            "corrupt: copy or download it again"
        ) from exc


def check_index(input_dir: Path, keys_by_shard: dict[str, dict[str, str]]) -> None:
    """Every tensor the index names is in the shard it names, and every tensor of a shard is indexed."""
    weight_map = weight_map_of(input_dir)
    if weight_map is None:
        return
    problems = []
    for name, shard in sorted(weight_map.items()):
        if name not in keys_by_shard.get(shard, {}):
            problems.append(f"{name} is mapped to {shard}, which lacks it")
    for shard, keys in sorted(keys_by_shard.items()):
        for name in sorted(set(keys) - {n for n, s in weight_map.items() if s == shard}):
            where = weight_map.get(name)
            problems.append(
                f"{name} in {shard} is " + (f"mapped to {where}" if where else "missing from the index")
            )
    if problems:
        raise ValueError(
            f"input_dir={input_dir}: {INDEX_NAME} disagrees with the shards ({len(problems)} tensors; "
            f"{'; '.join(problems[:3])}); re-save the checkpoint or fix the index"
        )


def check_finite(t: torch.Tensor, key: str, src: Path) -> None:
    if not t.is_floating_point():
        return
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return
    num_nan = int(torch.isnan(t).sum())
    num_inf = int((~finite).sum()) - num_nan
    raise ValueError(
        f"tensor {key} in {src}: {num_nan} NaN and {num_inf} infinite values; a cast would hide them "
        "(quantized blocks of NaN): fix or re-export the checkpoint (e.g. the last finite one of the run)"
    )
