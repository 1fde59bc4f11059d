"""On one CUDA GPU (BF16 autocast, FP8 fast path on Hopper): fused token scores equal the logits path, the
FP8 linear's autocast output keeps the old FP8 gradients, packed equals padded, and the fused AdamW skips a
non-finite step on the device. Skipped on CPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from infir2_rl.algo.logprobs import scores_from_logits
from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.fp8.linear import Fp8Linear
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch
from infir2_rl.trainers.flat_adamw import FlatAdamW
from infir2_rl.trainers.microbatch import micro_batches
from infir2_rl.trainers.torch.scoring import score_tokens
from infir2_rl.trainers.torch.trainer import TorchTrainer
from infir2_rl.types import LossOutput, TokenBatch, TokenScores

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_fused_scores_equal_the_logits_path_under_bf16_autocast(packed: bool) -> None:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).cuda()
    lengths = [300, 77, 190, 256]
    ids = torch.randint(0, 8192, (4, 300), device="cuda")
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    select = mask.clone()
    select[:, :20] = 0
    sel = select.bool()
    sel[:, 0] = False

    def autocast() -> torch.autocast:
        return torch.autocast("cuda", dtype=torch.bfloat16)

    fused = score_tokens(
        model, ids, mask, select, temperature=0.8, need_entropy=True,
        compute_dtype=torch.bfloat16, packed=packed, autocast=autocast, chunk_tokens=128,
    )  # fmt: skip
    assert fused.entropy_BL is not None
    (-(fused.logprobs_BL.sum() + 0.1 * fused.entropy_BL.sum()) / 500).backward()
    g_fused = _grads(model)
    with autocast():
        logits = model(input_ids=ids, attention_mask=mask).logits
    plain = scores_from_logits(logits, ids, 0.8, need_entropy=True)
    assert plain.entropy_BL is not None
    (-((plain.logprobs_BL * sel).sum() + 0.1 * (plain.entropy_BL * sel).sum()) / 500).backward()
    g_plain = _grads(model)

    assert torch.all(fused.logprobs_BL[~sel] == 0)
    # Both paths take BF16 logits from the same BF16 GEMM and an FP32 softmax: equal up to summation order
    # (and, packed, up to the attention kernel seeing a block-diagonal mask instead of padding).
    assert _rel(fused.logprobs_BL[sel], plain.logprobs_BL[sel]) < 5e-3
    assert _rel(fused.entropy_BL[sel], plain.entropy_BL[sel]) < 5e-3
    assert g_fused.keys() == g_plain.keys()
    for name, grad in g_fused.items():
        assert _rel(grad, g_plain[name]) < 2e-2, name


def test_fp8_linear_autocast_output_keeps_the_fp8_gradients() -> None:
    torch.manual_seed(0)
    layer = Fp8Linear(1024, 512, bias=False).cuda()
    # x holds BF16 values: autocast quantizes x rounded to BF16 (as the engine holds it), here x itself, so
    # both runs quantize the same values to the same e4m3 codes.
    x = torch.randn(1000, 1024, device="cuda").bfloat16().float()
    g = torch.randn(1000, 512, device="cuda").bfloat16().float()  # the same dy for BF16 and FP32 outputs
    outs = {}
    for autocast in (False, True):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = layer(xi)
        (y.float() * g).sum().backward()
        assert xi.grad is not None and layer.weight.grad is not None
        outs[autocast] = (y.detach(), xi.grad, layer.weight.grad.clone())
        layer.weight.grad = None
    assert outs[False][0].dtype == torch.float32 and outs[True][0].dtype == torch.bfloat16
    assert _rel(outs[True][0], outs[False][0]) < 4e-3  # BF16 rounding of the same FP8 GEMM
    # dgrad comes back in BF16 under autocast (as a dense autocast linear's does): the same FP8 GEMM rounded.
    dx = outs[True][1]
    assert _rel(dx, outs[False][1]) < 4e-3 and dx.bfloat16().float().equal(dx)
    torch.testing.assert_close(outs[True][2], outs[False][2], rtol=0, atol=0)  # wgrad: same FP8 operands


def test_sibling_fp8_linears_under_autocast_quantize_their_shared_input_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """q, k and v read one FP32 tensor, quantized as its BF16 rounding (by the quantizer, no copy) once, its
    FP8 copy kept for backward once, and outputs and gradients equal three independent linears'."""
    from infir2_rl.fp8 import ops, quant_triton

    torch.manual_seed(0)
    layers = [Fp8Linear(1024, n, bias=True).cuda() for n in (768, 256, 256)]
    x = torch.randn(512, 1024, device="cuda")
    g = [torch.randn(512, layer.out_features, device="cuda") for layer in layers]
    calls = []
    real = quant_triton.quantize_rows_and_cols

    # Count the quantizations of the (512, 1024) input; the dy of each linear ((512, 768) or (512, 256)) is
    # quantized by the same function in backward.
    def counting(t: torch.Tensor, p: bool, round_to: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        calls.append(t.shape[1] == 1024)
        return real(t, p, round_to=round_to)

    monkeypatch.setattr(quant_triton, "quantize_rows_and_cols", counting)

    def run(shared: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        xi = x.clone().requires_grad_(True)
        outs = []
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for layer in layers:
                if not shared:
                    ops._last_input[0] = None  # forget the previous linear's quantization
                outs.append(layer(xi))
        sum((y.float() * gi).sum() for y, gi in zip(outs, g)).backward()
        grads = [xi.grad.clone()] + [layer.weight.grad.clone() for layer in layers]
        for layer in layers:
            layer.weight.grad = layer.bias.grad = None
        return [y.detach() for y in outs], grads

    calls.clear()
    shared_out, shared_grads = run(shared=True)
    assert sum(calls) == 1 and len(calls) == 1 + 3  # the input once, each dy once
    calls.clear()
    alone_out, alone_grads = run(shared=False)
    assert sum(calls) == 3 and len(calls) == 3 + 3
    assert all(torch.equal(a, b) for a, b in zip(shared_out, alone_out))
    assert all(torch.equal(a, b) for a, b in zip(shared_grads, alone_grads))


def _trainer(model: Path, fp8: bool, packed: bool = False) -> TorchTrainer:
    return TorchTrainer(
        ModelConfig(path=str(model)),
        TrainerConfig(pack_sequences=packed),
        OptimizerConfig(warmup_ratio=0.0),
        fp8=fp8,
        total_steps=4,
    )


@pytest.mark.parametrize("fp8", [False, True])
def test_packed_and_padded_train_alike_on_a_gpu(tmp_path: Path, fp8: bool) -> None:
    model = init_model(tmp_path / "model", preset="tiny")
    paths = make_data(tmp_path / "data", num_sft=16, num_rl=4, num_test=4)
    padded, packed = _trainer(model, fp8), _trainer(model, fp8, packed=True)
    examples, _ = load_sft_examples(paths.sft_train, padded.tokenizer)
    batch = to_token_batch(examples[:16], padded.tokenizer.pad_token_id)
    (lp_padded,) = padded.forward_logprobs([batch], temperature=1.0)
    (lp_packed,) = packed.forward_logprobs([batch], temperature=1.0)
    real = batch.attention_mask[:, 1:].bool()
    assert _rel(lp_packed[:, 1:][real], lp_padded[:, 1:][real]) < 1e-2
    units = num_target_tokens(batch)
    a = padded.train_step(micro_batches(batch, 8), SftLossFn(), units)
    b = packed.train_step(micro_batches(batch, 8), SftLossFn(), units)
    assert not a.skipped and not b.skipped
    assert b.loss == pytest.approx(a.loss, rel=1e-2)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=2e-2)


class NanLoss:
    temperature = 1.0
    needs_entropy = False

    def __call__(self, scores: TokenScores, batch: TokenBatch) -> LossOutput:
        return LossOutput(loss=scores.logprobs_BL.sum() * math.nan, num_units=1)


def test_fused_adamw_skips_a_non_finite_step_on_the_device(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model", preset="tiny")
    paths = make_data(tmp_path / "data", num_sft=8, num_rl=4, num_test=4)
    trainer = _trainer(model, fp8=True)
    # The skip decided on the device: torch's fused AdamW, or the flat AdamW of a BF16 model's masters.
    assert trainer.optimizer.defaults["fused"] or isinstance(trainer.optimizer, FlatAdamW)
    examples, _ = load_sft_examples(paths.sft_train, trainer.tokenizer)
    batch = to_token_batch(examples[:8], trainer.tokenizer.pad_token_id)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    stats = trainer.train_step([batch], NanLoss(), total_units=1)
    assert stats.skipped and math.isnan(stats.grad_norm) and trainer.scheduler.last_epoch == 0
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert all(float(s["step"]) == 0 for s in trainer.optimizer.state.values())  # the step was not counted
    good = trainer.train_step([batch], SftLossFn(), num_target_tokens(batch))
    assert not good.skipped and math.isfinite(good.loss) and trainer.scheduler.last_epoch == 1
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
