"""Which tensor-parallel sizes a model allows on the megatron backend (read from its config.json).

TP shards attention by KV group and the MLP by rows of gate/up, so ``tp`` must divide the number of KV
heads and the intermediate size. With FP8 each shard is quantized on its own, so a shard must hold whole
128x128 blocks of the full weight: per rank, the q rows (heads x head_dim / tp), the k and v rows
(kv_heads x head_dim / tp) and the MLP rows (intermediate / tp) must be multiples of 128. Those rows are also
the column shards of o_proj and down_proj, so one rule covers both kinds of split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FP8_BLOCK = 128


def _dims(hf: dict[str, Any]) -> tuple[int, int, int, int]:
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return heads, kv, head_dim, hf["intermediate_size"]


def tensor_parallel_problem(hf: dict[str, Any], tp: int, fp8: bool) -> str | None:
    """Why ``tp`` does not fit the model (None when it does)."""
    heads, kv, head_dim, ffn = _dims(hf)
    if kv % tp or ffn % tp:
        return f"{kv} KV heads and intermediate size {ffn} must both be divisible by it"
    if fp8 and tp > 1:  # one rank quantizes each HF projection whole, on its own grid: any shape works
        rows = {"q": heads * head_dim // tp, "k/v": kv * head_dim // tp, "mlp": ffn // tp}
        bad = {k: v for k, v in rows.items() if v % FP8_BLOCK}
        if bad:
            return f"FP8 shards must hold whole 128-row blocks, but per-rank rows are {bad}"
    return None


def te_fp8_layout_problem(hf: dict[str, Any]) -> str | None:
    """Why Transformer Engine's FP8 bytes of this model's fused weights are not its HF projections' (None if they are).

    TE quantizes megatron's fused ``linear_qkv`` (per KV group: the group's q heads, k, v) and ``linear_fc1``
    (gate, up) on one 128x128 grid. Cut into HF projections, those bytes are each projection's own grid (what
    the engines receive) only when every projection's rows are whole 128-row blocks: head_dim and the
    intermediate size multiples of 128.
    """
    _, _, head_dim, ffn = _dims(hf)
    if head_dim % FP8_BLOCK or ffn % FP8_BLOCK:
        return (
            f"head_dim {head_dim} and intermediate size {ffn} must be multiples of 128 so that TE's 128-row FP8"
            " blocks of the fused qkv and gate/up weights are whole blocks of each HF projection (the bytes the"
            " engines get); use trainer.megatron_spec=local for this model"
        )
    return None


def allowed_tensor_parallel_sizes(hf: dict[str, Any], fp8: bool, limit: int = 64) -> list[int]:
    return [tp for tp in range(1, limit + 1) if tensor_parallel_problem(hf, tp, fp8) is None]


def check_tensor_parallel(hf: dict[str, Any], tp: int, fp8: bool) -> None:
    """One-sentence error naming the field, the reason and the sizes that work."""
    problem = tensor_parallel_problem(hf, tp, fp8)
    if problem is not None:
        allowed = allowed_tensor_parallel_sizes(hf, fp8)
        raise ValueError(
            f"trainer.tensor_parallel_size={tp} does not fit this model ({problem}); it allows {allowed}"
            f"{' with FP8 training (precision fp8 / unified_fp8)' if fp8 else ''}"
        )


def check_model_dir(path: str, tp: int, fp8: bool) -> None:
    """`check_tensor_parallel` on ``path``/config.json when it exists (a later pipeline stage's model does not
    yet; the trainer checks again when it starts)."""
    config = Path(path) / "config.json"
    if tp > 1 and config.is_file():
        check_tensor_parallel(json.loads(config.read_text()), tp, fp8)
