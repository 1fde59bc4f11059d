"""HF (Qwen2 / Llama) <-> megatron-core GPTModel state dicts, and their tensor-parallel shards.

Megatron's layout of one decoder layer ``L = decoder.layers.{i}.``:

    L.self_attention.linear_qkv.weight   rows per KV group g: [q heads of g (q_per_group x head_dim); k_g; v_g]
    L.self_attention.linear_qkv.bias     the same row order (Qwen2; Llama has no q/k/v bias)
    L.self_attention.linear_proj.weight  = o_proj
    L.mlp.linear_fc1.weight              = cat(gate_proj, up_proj)   (SwiGLU splits it in two halves)
    L.mlp.linear_fc2.weight              = down_proj

Plain concatenation q|k|v would be wrong: megatron reshapes the fused output to [groups, (q_per_group + 2) x
head_dim] and splits each group, so the rows must be interleaved per group. The norms have two layouts:
the local spec keeps them as modules (``L.input_layernorm.weight``, ``L.pre_mlp_layernorm.weight``), the TE
spec fuses them into the following linear (``L.self_attention.linear_qkv.layer_norm_weight``,
``L.mlp.linear_fc1.layer_norm_weight``). Embedding ``embedding.word_embeddings.weight``, final norm
``decoder.final_layernorm.weight``, untied head ``output_layer.weight``.

Tensor parallelism splits a full megatron tensor into ``tp`` shards: qkv and fc1 by rows (fc1's gate and
up halves each split, shard = [gate_r; up_r]), proj and fc2 by columns, embedding and head by vocab rows
(the vocab padded with zero rows to a multiple of tp), everything else replicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Arch:
    """The shape facts of a Qwen2/Llama HF config that the mapping and the model need."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_groups: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    norm_eps: float
    max_positions: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> Arch:
        if cfg.model_type not in ("qwen2", "llama"):
            raise ValueError(
                f"model_type={cfg.model_type!r}: trainer.backend=megatron maps only qwen2 and llama models;"
                " use trainer.backend=torch"
            )
        unmapped = [
            what
            for what, present in (
                ("mlp_bias=true", bool(getattr(cfg, "mlp_bias", False))),
                ("attention_bias=true (an o_proj bias)", cfg.model_type == "llama" and bool(getattr(cfg, "attention_bias", False))),
                (f"hidden_act={getattr(cfg, 'hidden_act', 'silu')!r}", getattr(cfg, "hidden_act", "silu") != "silu"),
                ("use_sliding_window=true", bool(getattr(cfg, "use_sliding_window", False))),
            )
            if present
        ]  # fmt: skip
        if unmapped:  # loading would leave those weights out, or compute another model, without a word
            raise ValueError(
                f"{', '.join(unmapped)}: trainer.backend=megatron does not build this; use trainer.backend=torch"
            )
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope_type={rope.get('rope_type')!r}: the megatron backend implements plain RoPE only"
            )
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_groups=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            ffn_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            tied_embeddings=bool(cfg.tie_word_embeddings),
            qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            rope_theta=float(theta),
            norm_eps=cfg.rms_norm_eps,
            max_positions=cfg.max_position_embeddings,
        )

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_groups


def padded_vocab(arch: Arch, tp: int) -> int:
    return -(-arch.vocab_size // tp) * tp


def _norm_names(layer: str, fused: bool) -> tuple[str, str]:
    if fused:
        return (
            f"{layer}self_attention.linear_qkv.layer_norm_weight",
            f"{layer}mlp.linear_fc1.layer_norm_weight",
        )
    return f"{layer}input_layernorm.weight", f"{layer}pre_mlp_layernorm.weight"


def interleave_qkv(q: Tensor, k: Tensor, v: Tensor, arch: Arch) -> Tensor:
    """HF q/k/v (weights [rows, H] or biases [rows]) -> megatron's per-group [q_g; k_g; v_g] rows."""
    g, d = arch.num_groups, arch.head_dim
    tail = q.shape[1:]
    parts = (q.reshape(g, arch.q_per_group * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_qkv(qkv: Tensor, arch: Arch) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `interleave_qkv`."""
    g, d = arch.num_groups, arch.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (arch.q_per_group + 2) * d, *tail)
    q, k, v = grouped.split([arch.q_per_group * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


class _Reads(dict[str, Tensor]):
    """An HF state dict that remembers which names were read."""

    def __init__(self, hf: Mapping[str, Tensor]) -> None:
        super().__init__(hf)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Tensor:
        self.read.add(name)
        return super().__getitem__(name)


def hf_to_megatron(hf: Mapping[str, Tensor], arch: Arch, fused_norms: bool = False) -> dict[str, Tensor]:
    """Full (tp=1) megatron state dict from an HF one (``lm_head`` ignored when the embeddings are tied). An HF
    tensor the mapping does not read (a bias of a kind megatron's layer is built without, say) is an error:
    the model would have run without it."""
    hf = _Reads(hf)
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not arch.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        norm1, norm2 = _norm_names(m, fused_norms)
        out[norm1] = hf[f"{h}input_layernorm.weight"]
        out[norm2] = hf[f"{h}post_attention_layernorm.weight"]
        a = f"{h}self_attn."
        w = {p: hf[f"{a}{p}_proj.weight"] for p in "qkv"}
        out[f"{m}self_attention.linear_qkv.weight"] = interleave_qkv(w["q"], w["k"], w["v"], arch)
        if arch.qkv_bias:
            b = {p: hf[f"{a}{p}_proj.bias"] for p in "qkv"}
            out[f"{m}self_attention.linear_qkv.bias"] = interleave_qkv(b["q"], b["k"], b["v"], arch)
        out[f"{m}self_attention.linear_proj.weight"] = hf[f"{a}o_proj.weight"]
        mlp = f"{h}mlp."
        out[f"{m}mlp.linear_fc1.weight"] = torch.cat(
            [hf[f"{mlp}gate_proj.weight"], hf[f"{mlp}up_proj.weight"]]
        )
        out[f"{m}mlp.linear_fc2.weight"] = hf[f"{mlp}down_proj.weight"]
    ignored = {"lm_head.weight"} if arch.tied_embeddings else set()
    unread = sorted(n for n in set(hf) - hf.read - ignored if not n.endswith("rotary_emb.inv_freq"))
    if unread:
        raise ValueError(
            f"{len(unread)} HF tensors the megatron model has no place for (e.g. {unread[:3]}); use "
            "trainer.backend=torch"
        )
    return out


def megatron_to_hf(mc: Mapping[str, Tensor], arch: Arch, fused_norms: bool = False) -> dict[str, Tensor]:
    """Inverse of `hf_to_megatron` (vocab padding rows dropped); tied models get no ``lm_head.weight``."""
    v = arch.vocab_size
    out = {
        "model.embed_tokens.weight": mc["embedding.word_embeddings.weight"][:v],
        "model.norm.weight": mc["decoder.final_layernorm.weight"],
    }
    if not arch.tied_embeddings:
        out["lm_head.weight"] = mc["output_layer.weight"][:v]
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        norm1, norm2 = _norm_names(m, fused_norms)
        out[f"{h}input_layernorm.weight"] = mc[norm1]
        out[f"{h}post_attention_layernorm.weight"] = mc[norm2]
        a = f"{h}self_attn."
        for p, t in zip("qkv", split_qkv(mc[f"{m}self_attention.linear_qkv.weight"], arch)):
            out[f"{a}{p}_proj.weight"] = t
        if arch.qkv_bias:
            for p, t in zip("qkv", split_qkv(mc[f"{m}self_attention.linear_qkv.bias"], arch)):
                out[f"{a}{p}_proj.bias"] = t
        out[f"{a}o_proj.weight"] = mc[f"{m}self_attention.linear_proj.weight"]
        gate, up = mc[f"{m}mlp.linear_fc1.weight"].chunk(2)
        out[f"{h}mlp.gate_proj.weight"], out[f"{h}mlp.up_proj.weight"] = gate, up
        out[f"{h}mlp.down_proj.weight"] = mc[f"{m}mlp.linear_fc2.weight"]
    return out


# ---------------------------------------------------------------------- tensor-parallel shards
def split_kind(name: str) -> str:
    """How a megatron tensor is split over TP ranks: rows, columns, halves (fc1) or replicated."""
    if name.endswith(
        ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
    ):
        return "rows"
    if name.endswith("linear_fc1.weight"):
        return "halves"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "columns"
    return "replicated"


def pad_vocab(name: str, t: Tensor, arch: Arch, tp: int) -> Tensor:
    if name.endswith(("word_embeddings.weight", "output_layer.weight")) and t.shape[0] < padded_vocab(
        arch, tp
    ):
        return torch.cat([t, t.new_zeros(padded_vocab(arch, tp) - t.shape[0], *t.shape[1:])])
    return t


def shard(name: str, full: Tensor, rank: int, size: int) -> Tensor:
    """This TP rank's piece of a full megatron tensor (vocab tensors must already be padded)."""
    kind = split_kind(name)
    if size == 1 or kind == "replicated":
        return full
    if kind == "rows":
        return full.chunk(size, dim=0)[rank]
    if kind == "columns":
        return full.chunk(size, dim=1)[rank]
    gate, up = full.chunk(2)
    return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])


def unshard(name: str, pieces: list[Tensor]) -> Tensor:
    """Inverse of `shard` given every rank's piece in rank order."""
    kind = split_kind(name)
    if len(pieces) == 1 or kind == "replicated":
        return pieces[0]
    if kind == "rows":
        return torch.cat(pieces)
    if kind == "columns":
        return torch.cat(pieces, dim=1)
    halves = [p.chunk(2) for p in pieces]
    return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
