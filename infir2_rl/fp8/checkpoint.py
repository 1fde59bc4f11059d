"""BF16 HF checkpoint -> blockwise FP8 HF checkpoint, its loader, and the FP8 named tensors for weight sync.

Output format (what SGLang, vLLM and transformers' FineGrainedFP8 read): each decoder linear weight
``model.layers.N.<...>.{q,k,v,o,gate,up,down}_proj.weight`` becomes float8_e4m3fn with an FP32
``<...>.weight_scale_inv`` of shape (ceil(N/128), ceil(K/128)) beside it; every other tensor is copied
bit for bit; ``config.json`` gains ``quantization_config``. The cast streams one shard at a time (peak
memory about one shard), writes into a temporary directory beside the output and renames it at the end,
so a failure leaves no partial output.

What the cast refuses (ValueError naming the file or tensor, so ``infir2-rl cast-fp8`` exits 2): a NaN or
infinity in any floating tensor (quantizing would hide it: see ``quant.py``), an index that disagrees
with its shards (a tensor the index names but its shard lacks, a tensor in a shard the index does not
name or maps to another shard, a shard it names that is absent), and a shard whose bytes do not match
its header (truncated or corrupt), named by file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from infir2_rl.fp8.cast_checks import (
    INDEX_NAME,
    check_finite,
    check_index,
    config_of,
    shard_keys,
    weight_map_of,
)
from infir2_rl.fp8.linear import DECODER_LINEAR_NAMES, Fp8InferenceLinear, Fp8Linear
from infir2_rl.fp8.quant import quantize_weight_blockwise

_DECODER_WEIGHT = re.compile(r"^(?:.*\.)?(?:" + "|".join(DECODER_LINEAR_NAMES) + r")\.weight$")
# Files that hold weights in another format: copying them would ship stale unquantized duplicates.
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
_SKIP_NAMES = {"config.json", INDEX_NAME, "pytorch_model.bin.index.json"}


@dataclass(frozen=True)
class CastReport:
    """What ``cast_checkpoint`` did: tensor counts, bytes of safetensors read and written, wall time."""

    num_quantized: int
    num_kept: int
    bytes_in: int
    bytes_out: int
    seconds: float


def is_decoder_linear_weight(name: str) -> bool:
    """True for HF names like ``model.layers.3.mlp.down_proj.weight``."""
    return _DECODER_WEIGHT.match(name) is not None


def _shard_files(model_dir: Path) -> list[str]:
    weight_map = weight_map_of(model_dir)
    if weight_map is not None:
        return sorted(set(weight_map.values()))
    return sorted(p.name for p in model_dir.glob("*.safetensors"))


def _check_input(input_dir: Path) -> tuple[dict, list[str]]:
    config_path = input_dir / "config.json"
    if not input_dir.is_dir():
        what = "a file, not a directory" if input_dir.exists() else "no such directory"
        raise ValueError(f"input_dir={input_dir}: {what}; pass a Hugging Face model directory")
    if not config_path.is_file():
        raise ValueError(f"input_dir={input_dir}: no config.json found; pass a Hugging Face model directory")
    try:
        config = config_of(input_dir)
    except ValueError as exc:
        raise ValueError(f"{config_path}: {exc}; pass a Hugging Face model directory") from exc
    if config.get("quantization_config") is not None:
        method = config["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"input_dir={input_dir}: config.json already has quantization_config (quant_method={method}); "
            "cast a BF16/FP32 checkpoint instead"
        )
    shards = _shard_files(input_dir)
    if not shards:
        raise ValueError(
            f"input_dir={input_dir}: no *.safetensors weights found; save the model with safetensors"
        )
    # Header-only scan, so a quantized, truncated or mis-indexed input is refused before any work.
    keys_by_shard = {shard: shard_keys(input_dir / shard) for shard in shards}
    for shard, keys in keys_by_shard.items():
        for key, dtype in keys.items():
            if dtype.startswith("F8") or key.endswith("weight_scale_inv"):
                raise ValueError(
                    f"input_dir={input_dir}: tensor {key} ({dtype}) in {shard} is already FP8-quantized; "
                    "cast a BF16/FP32 checkpoint instead"
                )
    check_index(input_dir, keys_by_shard)
    if not any(is_decoder_linear_weight(k) for keys in keys_by_shard.values() for k in keys):
        raise ValueError(
            f"input_dir={input_dir}: no decoder linear weight (model.layers.N.self_attn.q_proj.weight and the"
            " like) in its shards, so nothing would be quantized; pass a Qwen2/Llama-style HF checkpoint"
        )
    return config, shards


def _cast_shard(
    src: Path, dst: Path, block_size: int, pow2_scales: bool, device: torch.device
) -> tuple[list[str], int, int, set[str]]:
    out: dict[str, torch.Tensor] = {}
    num_q = num_kept = 0
    kept_2d_modules: set[str] = set()
    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata() or {}
        for key in f.keys():  # noqa: SIM118
            t = f.get_tensor(key)
            check_finite(t, key, src)
            if is_decoder_linear_weight(key) and t.dim() == 2 and t.is_floating_point():
                q, s = quantize_weight_blockwise(t.to(device), block_size=block_size, pow2_scales=pow2_scales)
                out[key] = q.cpu()
                out[key[: -len("weight")] + "weight_scale_inv"] = s.cpu()
                num_q += 1
            else:
                out[key] = t
                num_kept += 1
                if key.endswith(".weight") and t.dim() == 2:
                    kept_2d_modules.add(key[: -len(".weight")])
    save_file(out, str(dst), metadata={**metadata, "format": "pt"})
    return list(out), num_q, num_kept, kept_2d_modules


def cast_checkpoint(
    input_dir: str | Path,
    output_dir: str | Path,
    pow2_scales: bool = False,
    block_size: int = 128,
    progress: bool = True,
    device: str | torch.device | None = None,
) -> CastReport:
    """Write an FP8 copy of the HF checkpoint ``input_dir`` to the new directory ``output_dir``.

    ``device`` runs the quantizer there (default: CUDA when present, else CPU; both give the same bytes).
    Raises ValueError for an existing output, an input without config.json or already quantized, a
    non-finite tensor, an index that disagrees with the shards, or an unreadable shard (module docstring).
    """
    start = time.perf_counter()
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    if block_size != 128:
        raise ValueError(f"block_size={block_size}: only 128 is supported (the format's [128, 128] blocks)")
    if output_dir.exists():
        raise ValueError(f"output_dir={output_dir}: already exists; choose a new path or delete it first")
    parent = next(p for p in output_dir.absolute().parents if p.exists())  # the root exists
    if not parent.is_dir():
        raise ValueError(f"output_dir={output_dir}: {parent} is a file, not a directory; choose another path")
    config, shards = _check_input(input_dir)
    dev = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output_dir.parent, prefix=f".{output_dir.name}.partial-"))
    try:
        weight_map: dict[str, str] = {}
        num_q = num_kept = bytes_in = bytes_out = 0
        kept_modules: set[str] = set()
        for shard in tqdm(shards, desc="cast-fp8", unit="shard", disable=not progress):
            names, q, kept, kept_2d = _cast_shard(
                input_dir / shard, tmp / shard, block_size, pow2_scales, dev
            )
            weight_map.update(dict.fromkeys(names, shard))
            num_q, num_kept = num_q + q, num_kept + kept
            kept_modules |= kept_2d
            bytes_in += (input_dir / shard).stat().st_size
            bytes_out += (tmp / shard).stat().st_size
        index = {"metadata": {"total_size": bytes_out}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        for item in sorted(input_dir.iterdir()):  # tokenizer, generation config, chat template, README...
            if item.is_file() and item.name not in _SKIP_NAMES and not item.name.endswith(_SKIP_SUFFIXES):
                shutil.copy2(item, tmp / item.name)
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [block_size, block_size],
            "modules_to_not_convert": sorted(kept_modules | {"lm_head"}),
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.rename(tmp, output_dir)  # atomic on one filesystem; fails if output_dir appeared meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return CastReport(num_q, num_kept, bytes_in, bytes_out, time.perf_counter() - start)


def load_fp8_model(
    fp8_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Build the HF causal LM of an FP8 directory with ``Fp8InferenceLinear`` decoder linears.

    Everything that is not a decoder linear is loaded in ``dtype``; the FP8 weights and scales are copied
    as stored. Works offline (HF_HUB_OFFLINE=1): only local files are read.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    fp8_dir = Path(fp8_dir)
    config = AutoConfig.from_pretrained(fp8_dir, local_files_only=True)
    qcfg = getattr(config, "quantization_config", None)
    if qcfg is None:
        raise ValueError(
            f"fp8_dir={fp8_dir}: config.json has no quantization_config; run cast-fp8 on it first"
        )
    del config.quantization_config
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for module in list(model.modules()):
        for attr, child in list(module.named_children()):
            if attr in DECODER_LINEAR_NAMES and type(child) is nn.Linear:
                new = Fp8InferenceLinear(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    device=device,
                    dtype=dtype,
                )
                setattr(module, attr, new)
    expected = set(model.state_dict().keys())
    loaded: set[str] = set()
    for shard in _shard_files(fp8_dir):
        with safe_open(str(fp8_dir / shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        result = model.load_state_dict(tensors, strict=False)
        if result.unexpected_keys:
            raise ValueError(
                f"fp8_dir={fp8_dir}: {shard} holds tensors the model lacks: {result.unexpected_keys[:5]}"
            )
        loaded |= set(tensors)
        del tensors
    state = model.state_dict()
    loaded_ptrs = {state[k].data_ptr() for k in loaded}
    missing = [
        k for k in expected - loaded if state[k].data_ptr() not in loaded_ptrs
    ]  # tied weights are fine
    if missing:
        raise ValueError(
            f"fp8_dir={fp8_dir}: checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)"
        )
    return model.eval()


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without autograd history: a ``detach()`` only where there is some (each is host time, 534 per push)."""
    return t.detach() if t.requires_grad else t


def fp8_state_from_model(model: nn.Module, pow2_scales: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors for weight sync, in state-dict order, produced one module at a time.

    ``Fp8Linear``: the exact ``export_fp8()`` bytes as ``<prefix>.weight`` plus ``<prefix>.weight_scale_inv``.
    ``Fp8InferenceLinear``: its buffers. A plain decoder ``nn.Linear`` (BF16 trainer, FP8 rollout) is
    quantized on the fly with the same quantizer (``pow2_scales`` applies to these only). Everything else
    (embeddings, lm_head, norms, biases) is yielded detached, as is.
    """
    fp8_modules: dict[str, nn.Module] = {}
    plain: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, (Fp8Linear, Fp8InferenceLinear)):
            fp8_modules[name] = module
        elif isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in DECODER_LINEAR_NAMES:
            # nn.Linear or a subclass that computes the same (MasterWeights' MainGradLinear); Fp8Linear is above
            plain.add(name)
    # keep_vars: no detach() of the FP8 linears' master weights, which are not yielded (a weight sync walks
    # this per push: each skipped op is host time saved 196 times at 1.5B); the rest are detached below.
    for key, tensor in model.state_dict(keep_vars=True).items():
        prefix, _, leaf = key.rpartition(".")
        module = fp8_modules.get(prefix)
        if module is not None and leaf == "weight":
            if isinstance(module, Fp8Linear):
                w_fp8, scale_inv = module.export_fp8()
            else:
                assert isinstance(module, Fp8InferenceLinear)
                w_fp8, scale_inv = module.weight, module.weight_scale_inv
            yield key, _detached(w_fp8)
            if not scale_inv.is_contiguous():  # engine grids: rows apart
                scale_inv = scale_inv.contiguous()
            yield f"{prefix}.weight_scale_inv", _detached(scale_inv)
        elif module is not None and leaf == "weight_scale_inv":
            continue  # yielded right after its weight
        elif prefix in plain and leaf == "weight":
            with torch.no_grad():
                w_fp8, scale_inv = quantize_weight_blockwise(tensor.detach(), pow2_scales=pow2_scales)
            yield key, w_fp8
            yield f"{prefix}.weight_scale_inv", scale_inv
        else:
            yield key, _detached(tensor)
