"""On a CUDA GPU: the trainer's fused rotary embedding (``trainers/torch/fused_rope.py``) gives transformers'
``apply_rotary_pos_emb`` bits and layout forward and autograd's gradients backward, and a model whose attention
runs it computes the same logits and parameter gradients as the plain model. Skipped on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from infir2_rl.models.factory import init_model
from infir2_rl.trainers.torch import fused_layers, fused_rope

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, H, KH, L, D = 2, 12, 2, 300, 128


def _qk(layout: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the attention sees them: transposed views of a projection's output ("view"), of a column
    slice of a wider output (the grouped FP8 q|k|v, "slice"), or contiguous (B, H, L, D) tensors."""
    g = torch.Generator(device="cuda").manual_seed(0)
    if layout == "contiguous":
        q = torch.randn(B, H, L, D, device="cuda", generator=g).to(dtype)
        return q, torch.randn(B, KH, L, D, device="cuda", generator=g).to(dtype)
    width = (H + 2 * KH) * D + (128 if layout == "slice" else 0)
    out = torch.randn(B, L, width, device="cuda", generator=g).to(dtype) * 4
    if layout == "view":
        q_proj, k_proj = out[..., : H * D].contiguous(), out[..., H * D : (H + KH) * D].contiguous()
    else:
        q_proj, k_proj = out[..., : H * D], out[..., H * D : (H + KH) * D]
    return q_proj.view(B, L, H, D).transpose(1, 2), k_proj.view(B, L, KH, D).transpose(1, 2)


def _tables(batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(L, device="cuda", dtype=torch.float32)
    freqs = torch.outer(pos, 1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda") / D))
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(batch, -1, -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["view", "slice", "contiguous"])
@pytest.mark.parametrize("table_batch", [1, B])
def test_fused_rope_gives_transformers_bits_forward_and_backward(
    dtype: torch.dtype, layout: str, table_batch: int
) -> None:
    q, k = _qk(layout, dtype)
    cos, sin = _tables(table_batch, dtype)
    assert fused_rope.fusable(q, k, cos, sin)
    q1, k1 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    ours = fused_rope.rope(q1, k1, cos, sin)
    ref = apply_rotary_pos_emb(q2, k2, cos, sin)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)
        if layout != "contiguous":  # torch's layout for a transposed view; ours for every input
            assert a.stride() == b.stride()
    g = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.randn(t.shape, device="cuda", generator=g).to(dtype) for t in ref]
    grads[0] = grads[0].transpose(1, 2).contiguous().transpose(1, 2)  # SDPA's gradient layout, either way
    torch.autograd.backward(list(ours), grads)
    torch.autograd.backward(list(ref), grads)
    assert q1.grad is not None and q2.grad is not None and k1.grad is not None and k2.grad is not None
    assert torch.equal(q1.grad, q2.grad) and torch.equal(k1.grad, k2.grad)


def test_a_model_with_fused_rope_computes_the_plain_models_logits_and_gradients(tmp_path: Path) -> None:
    path = init_model(tmp_path / "model", preset="tiny")

    def load() -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, attn_implementation="eager", local_files_only=True
        )
        return model.cuda()

    plain, fused = load(), load()
    assert fused_rope.install(modeling_qwen2)
    n = 0
    for module in fused.modules():
        if type(module).__name__ in fused_layers._ATTENTION_CLASSES:
            module.__class__ = fused_layers._fused_subclass(type(module), fused_rope.fused_attention_forward)
            n += 1
    assert n == fused.config.num_hidden_layers
    calls = []
    launch = fused_rope._launch
    fused_rope._launch = lambda *a, **kw: calls.append(1) or launch(*a, **kw)  # type: ignore[assignment]
    try:
        ids = torch.randint(0, plain.config.vocab_size, (3, 50), device="cuda")
        out = [m(ids).logits for m in (plain, fused)]
        forward_calls = len(calls)
        for o in out:
            o.float().square().mean().backward()
    finally:
        fused_rope._launch = launch  # type: ignore[assignment]
    assert forward_calls == n  # the plain model of the same class ran transformers' function
    assert len(calls) == 2 * n  # and backward one launch per layer
    assert torch.equal(out[0], out[1])
    for (name, p), (_, f) in zip(plain.named_parameters(), fused.named_parameters(), strict=True):
        assert p.grad is not None and f.grad is not None
        assert torch.equal(p.grad, f.grad), name
