"""Taps for the train/rollout mismatch probe (``bench/mismatch_probe.py``): every op's output, recorded.

Shapes: B rows, T positions of one forward call, F features of one op (heads flattened: H * D).

Two recorders fill one ``Taps`` (name -> position -> (B, F) tensor on the host, in the op's own dtype):

* ``hf_taps(model, taps)``: a transformers Qwen2 model (the trainer's, with ``Fp8Linear``s, or the eager
  engine's, with ``Fp8InferenceLinear``s), by forward hooks on its modules plus a wrapper around
  ``modeling_qwen2.apply_rotary_pos_emb`` (rotary is a function, not a module). Nothing in the model changes:
  hooks only copy outputs. ``taps.start`` is the position of the call's first token (set by the caller).
* ``runner_decode(runner, ...)``: the model runner's ``Qwen2Runner.decode`` step, op by op with the same
  kernels (``fused_ops``, ``attention``, ``linears``) in the same order, recording each output. In FP8 on
  CUDA the norm, SiLU*up and decode attention kernels quantize their output for the next GEMM (``QuantizedRows``); the tap
  records those FP8 codes and scales as the engine's own, and also runs the same kernel without quantizing
  (on a copy) to record the values the codes were made from. Eager, not a graph replay: the engine's tests
  check graph replay equals eager decode of the same runner bit for bit.

Op names, in forward order: ``embed``, then per layer i ``Li.input_norm, Li.q, Li.k, Li.v, Li.q_rope,
Li.k_rope, Li.attn, Li.o_proj, Li.post_norm, Li.gate, Li.up, Li.silu_mul, Li.down``, then ``final_norm``,
``logits``, ``logprob``. ``FP8_INPUT_OPS`` are the ops whose output is a FP8 linear's input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infir2_rl.engines.native import attention, fused_ops
from infir2_rl.engines.native.fused_ops import QuantizedRows

LAYER_OPS = (
    "input_norm", "q", "k", "v", "q_rope", "k_rope", "attn", "o_proj",
    "post_norm", "gate", "up", "silu_mul", "down",
)  # fmt: skip
# Ops whose output feeds an FP8 linear (q|k|v, o, gate|up, down), by the layer-op name.
FP8_INPUT_OPS = ("input_norm", "attn", "post_norm", "silu_mul")


def op_names(num_layers: int) -> list[str]:
    """Every op name in forward order."""
    layers = [f"L{i}.{op}" for i in range(num_layers) for op in LAYER_OPS]
    return ["embed", *layers, "final_norm", "logits", "logprob"]


class Taps:
    """Recorded op outputs: ``values[name][position]`` = (B, F); ``codes[name][position]`` = (q (B, K) e4m3,
    scales (B, K/128)) where the engine quantized an activation itself (runner, FP8 on CUDA)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[int, Tensor]] = {}
        self.codes: dict[str, dict[int, tuple[Tensor, Tensor]]] = {}
        self.start = 0  # position of the current call's first token
        self.layer = -1  # layer whose attention runs now (set by a pre-hook; rotary has no module)

    def add(self, name: str, x_BTF: Tensor, start: int | None = None) -> None:
        if getattr(x_BTF, "_infir2_unwritten", False):  # trainers/torch/fused_layers.py: values never written
            raise RuntimeError(
                f"probe: {name} is an output its producer did not write (only its FP8 quantization)"
            )
        start = self.start if start is None else start
        x = x_BTF.detach().to("cpu", copy=True)
        slot = self.values.setdefault(name, {})
        for t in range(x.shape[1]):
            slot[start + t] = x[:, t]

    def add_codes(self, name: str, rows: QuantizedRows, position: int) -> None:
        q = rows.q[: rows.m].detach().cpu()
        scales = rows.s_t[:, : rows.m].t().detach().cpu()
        self.codes.setdefault(name, {})[position] = (q, scales)

    def stacked(self, name: str, positions: list[int]) -> Tensor | None:
        """(B, len(positions), F) of the recorded positions, or None if any is missing."""
        slot = self.values.get(name, {})
        if not positions or any(p not in slot for p in positions):
            return None
        return torch.stack([slot[p] for p in positions], dim=1)


def _flat_heads(x_BHTD: Tensor) -> Tensor:
    b, h, t, d = x_BHTD.shape
    return x_BHTD.transpose(1, 2).reshape(b, t, h * d)


@contextlib.contextmanager
def hf_taps(model: nn.Module, taps: Taps) -> Iterator[None]:
    """Record every op of a transformers Qwen2 model into ``taps`` while inside the block (module doc)."""
    from transformers.models.qwen2 import modeling_qwen2

    inner: Any = model.model  # type: ignore[assignment]
    handles: list[Any] = []

    def out_hook(name: str) -> Any:
        return lambda _m, _inp, out: taps.add(name, out if isinstance(out, Tensor) else out[0])

    def in_hook(name: str) -> Any:
        return lambda _m, inp: taps.add(name, inp[0])

    handles.append(inner.embed_tokens.register_forward_hook(out_hook("embed")))
    for i, layer in enumerate(inner.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"L{i}."

        def set_layer(_m: nn.Module, _inp: Any, i: int = i) -> None:
            taps.layer = i

        handles.append(attn.register_forward_pre_hook(set_layer))
        handles.append(layer.input_layernorm.register_forward_hook(out_hook(p + "input_norm")))
        for proj, name in (
            (attn.q_proj, "q"),
            (attn.k_proj, "k"),
            (attn.v_proj, "v"),
            (attn.o_proj, "o_proj"),
        ):
            handles.append(proj.register_forward_hook(out_hook(p + name)))
        handles.append(attn.o_proj.register_forward_pre_hook(in_hook(p + "attn")))
        handles.append(layer.post_attention_layernorm.register_forward_hook(out_hook(p + "post_norm")))
        handles.append(mlp.gate_proj.register_forward_hook(out_hook(p + "gate")))
        handles.append(mlp.up_proj.register_forward_hook(out_hook(p + "up")))
        handles.append(mlp.down_proj.register_forward_pre_hook(in_hook(p + "silu_mul")))
        handles.append(mlp.down_proj.register_forward_hook(out_hook(p + "down")))
    handles.append(inner.norm.register_forward_hook(out_hook("final_norm")))

    original = modeling_qwen2.apply_rotary_pos_emb

    def rotary(q: Tensor, k: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        q_rot, k_rot = original(q, k, *args, **kwargs)
        taps.add(f"L{taps.layer}.q_rope", _flat_heads(q_rot))
        taps.add(f"L{taps.layer}.k_rope", _flat_heads(k_rot))
        return q_rot, k_rot

    modeling_qwen2.apply_rotary_pos_emb = rotary  # type: ignore[assignment]
    try:
        yield
    finally:
        modeling_qwen2.apply_rotary_pos_emb = original  # type: ignore[assignment]
        for h in handles:
            h.remove()
    if "L0.q_rope" not in taps.values:
        raise RuntimeError(
            "hf_taps: no rotary output was recorded: this transformers' Qwen2 attention no longer calls "
            "modeling_qwen2.apply_rotary_pos_emb; update the probe"
        )


def _norm(
    taps: Taps,
    name: str,
    h: Tensor,
    delta: Tensor | None,
    weight: Tensor,
    eps: float,
    quant: bool,
    pow2: bool,
) -> Tensor | QuantizedRows:
    """``fused_ops.add_rms_norm`` as the runner calls it, recording the output (and its FP8 codes)."""
    if not quant:
        out = fused_ops.add_rms_norm(h, delta, weight, eps)
        assert isinstance(out, Tensor)
        taps.add(name, out[:, None])
        return out
    raw = fused_ops.add_rms_norm(h.clone(), delta, weight, eps)  # the same kernel, values not quantized
    assert isinstance(raw, Tensor)
    taps.add(name, raw[:, None])
    out = fused_ops.add_rms_norm(h, delta, weight, eps, True, pow2)
    assert isinstance(out, QuantizedRows)
    taps.add_codes(name, out, taps.start)
    return out


@torch.no_grad()
def runner_decode(
    runner: Any, taps: Taps, tokens_B: Tensor, positions_B: Tensor, slots_B: Tensor, cache: Any
) -> Tensor:
    """``Qwen2Runner.decode`` op by op, recording every output at position ``taps.start``; returns logits."""
    quant, pow2, eps = runner.fp8 and tokens_B.is_cuda, runner.pow2, runner.eps
    h = F.embedding(tokens_B, runner.embed)
    taps.add("embed", h[:, None])
    delta: Tensor | None = None
    for i, layer in enumerate(runner.layers):
        p = f"L{i}."
        x = _norm(taps, p + "input_norm", h, delta, layer.input_norm, eps, quant, pow2)
        qkv = layer.qkv(x)
        for name, part in zip(("q", "k", "v"), layer.qkv.split(qkv)):
            taps.add(p + name, part[:, None])
        q = fused_ops.rope_write_kv(
            qkv, positions_B, slots_B, runner.cos, runner.sin, cache.k[i], cache.v[i],
            runner.num_heads, runner.num_kv_heads, runner.k_offset, runner.v_offset,
        )  # fmt: skip
        taps.add(p + "q_rope", q.reshape(q.shape[0], 1, -1))
        k_new = cache.k[i][slots_B, :, positions_B]  # (B, KVH, D), as rope_write_kv stored it
        taps.add(p + "k_rope", k_new.reshape(k_new.shape[0], 1, -1))
        lengths_B = positions_B + 1
        a = attention.decode(
            q, cache.k[i], cache.v[i], slots_B, lengths_B, runner.attention_impl, arrivals=cache.arrivals
        )
        assert isinstance(a, Tensor)
        taps.add(p + "attn", a[:, None])
        if quant and runner.quant_attention:  # the same kernel again, quantizing for o_proj
            aq = attention.decode(
                q, cache.k[i], cache.v[i], slots_B, lengths_B, runner.attention_impl, True, pow2, cache.arrivals
            )  # fmt: skip
            assert isinstance(aq, QuantizedRows)
            taps.add_codes(p + "attn", aq, taps.start)
            a = aq  # type: ignore[assignment]
        o = layer.o(a)
        taps.add(p + "o_proj", o[:, None])
        x = _norm(taps, p + "post_norm", h, o, layer.post_norm, eps, quant, pow2)
        gate_up = layer.gate_up(x)
        gate, up = layer.gate_up.split(gate_up)
        taps.add(p + "gate", gate[:, None])
        taps.add(p + "up", up[:, None])
        s = fused_ops.silu_mul(gate_up)
        assert isinstance(s, Tensor)
        taps.add(p + "silu_mul", s[:, None])
        if quant:
            sq = fused_ops.silu_mul(gate_up, True, pow2)
            assert isinstance(sq, QuantizedRows)
            taps.add_codes(p + "silu_mul", sq, taps.start)
            s = sq  # type: ignore[assignment]
        delta = layer.down(s)
        taps.add(p + "down", delta[:, None])
    x = fused_ops.add_rms_norm(h, delta, runner.final_norm, eps)
    assert isinstance(x, Tensor)
    taps.add("final_norm", x[:, None])
    logits = F.linear(x, runner.lm_head)
    taps.add("logits", logits[:, None])
    return logits


def runner_prefill_kv(runner: Any, taps: Taps, cache: Any, slots_B: Tensor, length: int) -> None:
    """Record the prefill's rotated keys and values as the cache holds them (positions 0..length-1)."""
    for i in range(runner.num_layers):
        k = cache.k[i][slots_B, :, :length]  # (B, KVH, L, D)
        v = cache.v[i][slots_B, :, :length]
        taps.add(f"L{i}.k_rope", _flat_heads(k), start=0)
        taps.add(f"L{i}.v", _flat_heads(v), start=0)
