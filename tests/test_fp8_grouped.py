"""q, k and v as one FP8 linear in the trainer (``fp8.grouped``): the same outputs and gradients as three
FP8 linears, each module's own parameters and FP8 export unchanged, one quantization of the stacked weight
per weight version, and a member called with another input computing its own output (CPU: the emulated FP8
path, where the stacked GEMM sums in the same order, so the results are equal; the GPU test allows for
cuBLASLt's summation order)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infir2_rl.fp8 import grouped
from infir2_rl.fp8.linear import Fp8Linear


class _Attention(nn.Module):
    def __init__(self, hidden: int, q_out: int, kv_out: int, bias: bool) -> None:
        super().__init__()
        self.q_proj = Fp8Linear(hidden, q_out, bias=bias)
        self.k_proj = Fp8Linear(hidden, kv_out, bias=bias)
        self.v_proj = Fp8Linear(hidden, kv_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q[..., : k.shape[-1]] * k).sum(-1, keepdim=True) * v.mean(-1, keepdim=True) + q.sum(
            -1, keepdim=True
        )


def _grads(model: _Attention, x: torch.Tensor, autocast: bool) -> dict[str, torch.Tensor]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return _grads_on(model, x)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_qkv_gives_the_three_linears_outputs_and_gradients(bias: bool, autocast: bool) -> None:
    torch.manual_seed(0)
    model = _Attention(256, 384, 128, bias)
    x = torch.randn(2, 24, 256)
    plain = _grads(model, x, autocast)
    assert grouped.group_projections(model) == 1
    assert model.q_proj._group is model.k_proj._group is model.v_proj._group is not None
    fused = _grads(model, x, autocast)
    assert fused.keys() == plain.keys()
    for name in plain:
        if name == "dx" and autocast:
            # one GEMM over the stacked weight, rounded to BF16 once, against three linears' dX each rounded
            # to BF16 (as a dense autocast linear's) and added: equal up to those roundings
            err = (fused[name] - plain[name]).norm() / plain[name].norm()
            assert err < 2**-8, float(err)
        else:
            torch.testing.assert_close(fused[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
    # the weight and bias gradients, and the outputs, are the same numbers
    for name in ("out", "q_proj.weight", "k_proj.weight", "v_proj.weight"):
        torch.testing.assert_close(fused[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)
    group = model.q_proj._group
    assert group is not None and group._stacked is not None  # the group ran ...
    assert group._pending is None  # ... and k and v took the outputs it kept for them
    grouped.ungroup_projections(model)
    assert model.k_proj._group is None


def test_a_member_on_another_input_and_no_grad_and_weight_updates() -> None:
    torch.manual_seed(1)
    model = _Attention(256, 256, 128, True)
    x, other = torch.randn(8, 256), torch.randn(8, 256)
    with torch.no_grad():
        expected_k = model.k_proj(other)
        expected_q = model.q_proj(x)
    grouped.group_projections(model)
    group = model.q_proj._group
    assert group is not None
    with torch.no_grad():
        q = model.q_proj(x)
        k_other = model.k_proj(other)  # not the input q was computed on: computed again, on `other`
    torch.testing.assert_close(q, expected_q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(k_other, expected_k, rtol=1e-6, atol=1e-7)
    # one stacked quantization per weight version; an optimizer step makes a new one
    stacked = group._fp8_weight()
    assert group._fp8_weight() is stacked
    assert torch.equal(stacked.w_fp8[:256].view(torch.uint8), model.q_proj.export_fp8()[0].view(torch.uint8))
    with torch.no_grad():
        model.v_proj.weight.add_(0.5)
    assert group._fp8_weight() is not stacked  # and the v output kept from the `other` call is not reused:
    with torch.no_grad():
        torch.testing.assert_close(
            model.v_proj(other),
            grouped.Fp8Linear.run(
                model.v_proj, other, model.v_proj.weight, model.v_proj.bias, model.v_proj._fp8_weight()
            ),
            rtol=1e-6,
            atol=1e-7,
        )


def test_grouping_rejects_parts_that_do_not_fit_and_skips_unswapped_parents() -> None:
    with pytest.raises(ValueError, match="divisible by 128"):
        grouped.ProjectionGroup([Fp8Linear(256, 100), Fp8Linear(256, 128)])
    small_kv = _Attention(256, 256, 64, True)  # k and v of 64 features: left alone
    assert grouped.group_projections(small_kv) == 0 and small_kv.q_proj._group is None
    with pytest.raises(ValueError, match="divisible by 128"):
        grouped.ProjectionGroup([Fp8Linear(256, 100), Fp8Linear(256, 128)])
    with pytest.raises(ValueError, match="bias"):
        grouped.ProjectionGroup([Fp8Linear(256, 128, bias=True), Fp8Linear(256, 128, bias=False)])
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = (
        Fp8Linear(256, 128),
        nn.Linear(256, 128),
        Fp8Linear(256, 128),
    )
    assert grouped.group_projections(parent) == 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_tiny_qwen2_trains_the_same_grouped(checkpointing: bool) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from infir2_rl.fp8.linear import swap_to_fp8_training

    config = Qwen2Config(
        hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(Qwen2ForCausalLM(config))
        swap_to_fp8_training(models[-1])
        if checkpointing:  # the layers' forward runs again in backward: the group computes again there
            models[-1].gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        models[-1].train()
    assert grouped.group_projections(models[1]) == models[1].config.num_hidden_layers
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    losses: list[list[float]] = []
    for m in models:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses.append([])
        for _ in range(3):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            for mod in m.modules():
                if isinstance(mod, Fp8Linear):
                    mod.invalidate_fp8_cache()
            losses[-1].append(loss.item())
    plain, fused = losses
    # The first forward: the same FP8 codes, so the same loss up to FP32 summation order.
    assert fused[0] == pytest.approx(plain[0], rel=1e-5)
    # After two updates: 1e-4 relative or less where the BLAS sums the stacked GEMM in the three GEMMs' order
    # (AVX2 CPUs); on an AVX-512 Xeon, 2026-11-26, 7.1e-4: weights that differ by FP32 rounding after an
    # update can quantize to other e4m3 codes. A wrong grouping moves the loss by far more.
    assert fused[-1] == pytest.approx(plain[-1], rel=3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16])
def test_grouped_qkv_on_the_gpu_fast_path(master: torch.dtype) -> None:
    """cuBLASLt's blockwise GEMMs over the stacked weight: the same quantized operands, so outputs and
    weight gradients equal to FP32 summation order and the input gradient to BF16 rounding (one GEMM
    rounded once against three rounded and added)."""
    torch.manual_seed(0)
    model = _Attention(1536, 1536, 256, True).to("cuda", master)
    x = torch.randn(4, 512, 1536, device="cuda", dtype=master)
    autocast = master == torch.float32
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        plain = _grads_on(model, x)
        assert grouped.group_projections(model) == 1
        fused = _grads_on(model, x)
    group = model.q_proj._group
    assert group is not None and group._stacked is not None and group._pending is None
    for name in plain:
        err = float((fused[name].float() - plain[name].float()).norm() / plain[name].float().norm())
        assert err < (2**-7 if name == "dx" else 1e-3), (name, err)


def _grads_on(model: _Attention, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.float().sum().backward()
    assert x.grad is not None
    grads = {"out": out.detach(), "dx": x.grad}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grads[name] = p.grad.clone()
    return grads
