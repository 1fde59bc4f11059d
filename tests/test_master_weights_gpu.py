"""The flat AdamW of a BF16 model's FP32 masters (trainers/flat_adamw.py) against torch's fused AdamW, on a GPU:
the same updates within FP32 rounding (clipped, weight decay, bias corrections), the BF16 copy written, a
non-finite norm skipping the step, and optimizer states that load into either."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infir2_rl.config import OptimizerConfig
from infir2_rl.trainers.flat_adamw import FlatAdamW
from infir2_rl.trainers.optim import build_optimizer, step_unless_nonfinite
from infir2_rl.trainers.torch.master_weights import MasterWeights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 300), nn.LayerNorm(300), nn.Linear(300, 70, bias=False)).cuda()


def test_flat_adamw_updates_as_torchs_fused_adamw() -> None:
    cfg = OptimizerConfig(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)
    reference = _model()
    ref_params = list(reference.parameters())
    ref_opt = build_optimizer(ref_params, cfg)
    assert ref_opt.defaults["fused"]
    model = _model()
    masters = MasterWeights(model)
    opt = build_optimizer(masters.optimizer_params, cfg, masters)
    assert isinstance(opt, FlatAdamW)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):
        grads = [
            torch.randn(p.shape, device="cuda", generator=gen) * (0.01 if step % 2 else 1.0)
            for p in ref_params
        ]
        if step == 3:
            grads[1][0] = float("nan")  # a non-finite norm: both skip
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.clone()
        masters.ensure_grads()
        buffers = [seg.grads for seg in masters.segments]
        for m, g in zip(masters.optimizer_params, grads, strict=True):
            assert m.grad is not None
            m.grad.copy_(g)
        for optimizer, params, norm in (
            (ref_opt, ref_params, torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))),
            (opt, masters.optimizer_params, masters.grad_norm()),
        ):
            skipped = step_unless_nonfinite(optimizer, params, norm, grad_clip=1.0)
            assert skipped == (step == 3)
        assert all(seg.grads is b for seg, b in zip(masters.segments, buffers, strict=True))
        for p, m in zip(ref_params, masters.optimizer_params, strict=True):
            torch.testing.assert_close(m, p.detach(), rtol=2e-6, atol=1e-7)
        for p, m in zip(model.parameters(), masters.optimizer_params, strict=True):
            assert p.dtype == torch.bfloat16 and torch.equal(p, m.detach().to(torch.bfloat16))
        masters.zero_grad()
    assert opt.steps == 4 and float(opt.state[masters.optimizer_params[0]]["step"]) == 4.0

    # Optimizer states move between the two: FlatAdamW -> torch AdamW and back.
    sd = opt.state_dict()
    other = build_optimizer(ref_params, cfg)
    other.load_state_dict(sd)
    for p, m in zip(ref_params, masters.optimizer_params, strict=True):
        torch.testing.assert_close(other.state[p]["exp_avg"], opt.state[m]["exp_avg"], rtol=0, atol=0)
        assert float(other.state[p]["step"]) == 4.0
    fresh_model = _model()
    fresh = MasterWeights(fresh_model)
    again = build_optimizer(fresh.optimizer_params, cfg, fresh)
    assert isinstance(again, FlatAdamW)
    again.load_state_dict(ref_opt.state_dict())
    assert again.steps == 4
    for p, m in zip(ref_params, fresh.optimizer_params, strict=True):
        torch.testing.assert_close(
            again.state[m]["exp_avg_sq"], ref_opt.state[p]["exp_avg_sq"], rtol=0, atol=0
        )
    assert all(v.abs().sum() > 0 for _, v in again.moments)  # the loaded values are in the buffers it reads


@pytest.mark.parametrize("pow2", [False, True])
def test_flat_adamw_writes_the_fp8_weights_of_the_masters_it_steps(pow2: bool) -> None:
    from infir2_rl.fp8 import quant_triton
    from infir2_rl.fp8.linear import Fp8Linear

    def model() -> nn.Module:
        torch.manual_seed(0)  # 300 and 200 rows, 96 and 300 columns: partial 128x128 blocks at both edges
        return nn.Sequential(
            Fp8Linear(96, 300, pow2_scales=pow2),
            nn.LayerNorm(300),
            Fp8Linear(300, 200, bias=False, pow2_scales=pow2),
        ).cuda()

    cfg = OptimizerConfig(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)
    reference = model()
    ref_params = list(reference.parameters())
    ref_opt = build_optimizer(ref_params, cfg)
    fp8_model = model()
    masters = MasterWeights(fp8_model)
    opt = build_optimizer(masters.optimizer_params, cfg, masters)
    assert isinstance(opt, FlatAdamW) and opt.keeps_fp8
    linears = [m for m in fp8_model.modules() if isinstance(m, Fp8Linear)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(4):
        grads = [torch.randn(p.shape, device="cuda", generator=gen) for p in ref_params]
        if step == 2:
            grads[0][0, 0] = float("inf")  # skipped: masters and FP8 weights stay as they were
        before = [m.export_fp8()[0].clone() for m in linears]
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.clone()
        masters.ensure_grads()
        for m, g in zip(masters.optimizer_params, grads, strict=True):
            assert m.grad is not None
            m.grad.copy_(g)
        ref_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        step_unless_nonfinite(ref_opt, ref_params, ref_norm, grad_clip=1.0)
        step_unless_nonfinite(opt, masters.optimizer_params, masters.grad_norm(), grad_clip=1.0)
        for p, m in zip(ref_params, masters.optimizer_params, strict=True):
            torch.testing.assert_close(m, p.detach(), rtol=2e-6, atol=1e-7)
        for lin, old in zip(linears, before, strict=True):
            assert lin.refresh_fp8() is False  # fresh: the optimizer wrote them
            w_fp8, scale_inv = lin.export_fp8()
            ref_w, ref_s = quant_triton.quantize_weight(lin.weight.detach(), pow2)
            assert torch.equal(w_fp8.view(torch.uint8), ref_w.view(torch.uint8))
            assert torch.equal(scale_inv, ref_s)
            assert torch.equal(w_fp8.view(torch.uint8), old.view(torch.uint8)) == (step == 2)
        masters.zero_grad()


def test_bf16_linears_add_their_weight_gradient_into_the_masters_in_fp32() -> None:
    from infir2_rl.trainers.torch.master_weights import MainGradLinear

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 300)).cuda()
    masters = MasterWeights(model)
    linear = model[0]
    assert type(linear) is MainGradLinear and linear.weight.dtype == torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(2)
    ref_w = torch.zeros(300, 96, dtype=torch.float64, device="cuda")
    ref_b = torch.zeros(300, dtype=torch.float64, device="cuda")
    for _ in range(3):  # micro-batches adding into one gradient
        x = torch.randn(4, 50, 96, device="cuda", generator=gen, dtype=torch.bfloat16)
        dy = torch.randn(4, 50, 300, device="cuda", generator=gen, dtype=torch.bfloat16)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = linear(x)
        y.backward(dy)
        ref_w += dy.reshape(-1, 300).double().t() @ x.reshape(-1, 96).double()
        ref_b += dy.reshape(-1, 300).double().sum(0)
    assert linear.weight.grad is None and linear.bias.grad is None  # both went into the masters' gradients
    w_master, b_master = masters.optimizer_params
    assert w_master.grad is not None and b_master.grad is not None
    # FP32 accumulation inside the GEMM: ~1e-7 relative. A BF16 dW added afterwards (what autograd returned)
    # is rounded to 8 bits of mantissa first: ~2e-3.
    rel = float((w_master.grad.double() - ref_w).norm() / ref_w.norm())
    assert rel < 1e-5, rel
    torch.testing.assert_close(
        b_master.grad.double(), ref_b, rtol=2e-2, atol=2e-1
    )  # a BF16 sum per micro-batch


def test_token_scores_add_the_lm_heads_weight_gradient_into_its_master_in_fp32() -> None:
    """The chunked token scores' dW of a (tied) lm_head goes into the master's FP32 gradient chunk by chunk
    (trainers/token_scores.py ``_wgrad_target``): the same FP32 sum the returned path rounds to BF16, bit for bit;
    it accumulates over micro-batches, and the tied embedding's own gradient still arrives through the hook."""
    from infir2_rl.trainers.token_scores import chunked_token_scores

    torch.manual_seed(0)
    vocab, hidden, n = 1000, 64, 300
    model = nn.Sequential(nn.Embedding(vocab, hidden)).cuda()
    masters = MasterWeights(model)
    weight = model[0].weight  # the lm_head's weight too, as in a tied model
    assert weight.dtype == torch.bfloat16
    (master,) = masters.optimizer_params
    gen = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(n, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    g_logp = torch.randn(n, device="cuda", generator=gen)

    def scores_loss(w: torch.Tensor) -> torch.Tensor:
        logp, _ = chunked_token_scores(h, w, targets, compute_dtype=torch.bfloat16, chunk_tokens=128)
        return (logp * g_logp).sum()

    plain = weight.detach().clone().requires_grad_(True)  # no master: dW is summed in FP32 and returned
    scores_loss(plain).backward()
    assert plain.grad is not None and plain.grad.dtype == torch.bfloat16

    scores_loss(weight).backward()  # micro-batch 1: the scores only
    assert weight.grad is None and master.grad is not None
    first = master.grad.clone()
    assert torch.equal(first.to(torch.bfloat16), plain.grad)  # the same FP32 sum, kept unrounded
    assert float(first.abs().sum()) > 0

    scores_loss(weight).backward()  # micro-batch 2: the same again, added on
    rel = float((master.grad.double() - 2 * first.double()).norm() / (2 * first.double()).norm())
    assert rel < 1e-6, rel

    before = master.grad.clone()
    ids = torch.randint(0, vocab, (40,), device="cuda", generator=gen)
    r = torch.randn(40, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    emb = model[0](ids)
    (emb * r).sum().backward()  # the embedding's gradient alone: through the hook, added in FP32
    expected_emb = torch.zeros(vocab, hidden, device="cuda", dtype=torch.bfloat16).index_add_(0, ids, r)
    assert weight.grad is None
    torch.testing.assert_close(master.grad, before + expected_emb.float(), rtol=0, atol=2e-2)
