"""On a CUDA GPU: the fused RMSNorm and SwiGLU kernels (``trainers/torch/fused_layers.py``) compute what
transformers' Qwen2RMSNorm and ``silu(gate) * up`` compute, forward and backward, in FP32 and BF16; and a
trainer with ``fused_kernels`` on trains as one with them off (BF16 and FP8, with the layer graphs that
``auto`` turns on for FP8). Skipped on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch
from infir2_rl.trainers.microbatch import bucket_length, pad_length
from infir2_rl.trainers.torch import fused_layers
from infir2_rl.trainers.torch.trainer import TorchTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
)
@pytest.mark.parametrize(("m", "k"), [(1, 384), (37, 1536), (1000, 3584)])
def test_rms_norm_equals_qwen2_rmsnorm_forward_and_backward(
    x_dtype: torch.dtype, w_dtype: torch.dtype, m: int, k: int
) -> None:
    torch.manual_seed(0)
    ref = Qwen2RMSNorm(k, eps=1e-6).cuda().to(w_dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.1 * torch.randn(k))
    x = (3 * torch.randn(2, m, k, device="cuda")).to(x_dtype).requires_grad_()
    y_ref = ref(x)
    dy = torch.randn_like(y_ref)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, ref.weight), dy)

    x2 = x.detach().clone().requires_grad_()
    w2 = ref.weight.detach().clone().requires_grad_()
    y = fused_layers.rms_norm(x2, w2, 1e-6)
    dx, dw = torch.autograd.grad(y, (x2, w2), dy)
    assert y.dtype == y_ref.dtype and dx.dtype == x.dtype and dw.dtype == w_dtype
    # Only the order of the FP32 sums differs: a few FP32 ulps; where x * rsqrt(var) is rounded to BF16 (a
    # BF16 input), that moves an element by one BF16 ulp now and then.
    assert _rel(y, y_ref) <= (1e-5 if x_dtype == torch.float32 else 2**-7)
    if x_dtype != torch.float32:
        assert float((y.float() != y_ref.float()).float().mean()) < 0.01
    assert _rel(dx, dx_ref) <= (1e-4 if x_dtype == torch.float32 else 2**-7)
    # dw sums 2 x m products per element in FP32 (another order than torch's): 1e-4 of its largest is ~1 ulp
    # of the sum of magnitudes at m = 1000.
    assert _rel(dw, dw_ref) <= (1e-3 if w_dtype == torch.float32 else 2**-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_silu_times_up_forward_and_backward(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    g = (4 * torch.randn(33, 8960, device="cuda")).to(dtype).requires_grad_()
    u = torch.randn(33, 8960, device="cuda").to(dtype).requires_grad_()
    h_ref = torch.nn.functional.silu(g) * u
    dh = torch.randn_like(h_ref)
    dg_ref, du_ref = torch.autograd.grad(h_ref, (g, u), dh)
    g2, u2 = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    h = fused_layers.swiglu(g2, u2)
    dg, du = torch.autograd.grad(h, (g2, u2), dh)
    # The same roundings as torch's two ops: BF16 results agree but for the last bit of exp's rounding.
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    for got, want in ((h, h_ref), (dg, dg_ref), (du, du_ref)):
        assert got.dtype == want.dtype
        assert _rel(got, want) <= tol
        if dtype == torch.bfloat16:  # FP32 results part in the last bits of exp
            assert float((got != want).float().mean()) < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_engine_silu_mul_equals_this_swiglu_bit_for_bit(dtype: torch.dtype) -> None:
    """The engine's SiLU*up (``engines/native/fused_ops.silu_mul``, decode and prefill) and this module's
    SwiGLU compute ``silu(g) * u`` by one formula (Triton's exponential and its plain FP32 division), so a
    trainer and an engine fed the same gate and up hold the same MLP input (the engine's quantized form equals
    ``quantize_rows`` of its plain one: tests/test_engine_runner.py). Before session 61 the engine divided
    correctly rounded (``div_rn``) and this module by ``/`` (``div.full.f32``): in FP32 the quotients differ
    in the last bit; in BF16 that rarely survives the rounding (none of these 2.3M products differed)."""
    from infir2_rl.engines.native import fused_ops

    torch.manual_seed(0)
    g = (4 * torch.randn(257, 8960, device="cuda")).to(dtype)
    u = torch.randn(257, 8960, device="cuda").to(dtype)
    engine = fused_ops.silu_mul(torch.cat((g, u), 1))
    assert isinstance(engine, torch.Tensor)
    assert torch.equal(engine, fused_layers.swiglu(g, u))


def _trainer(model: Path, fp8: bool, fused: bool, **trainer: object) -> TorchTrainer:
    return TorchTrainer(
        ModelConfig(path=str(model)),
        TrainerConfig(fused_kernels=fused, **trainer),  # type: ignore[arg-type]
        OptimizerConfig(lr=1e-3, warmup_ratio=0.0, schedule="constant"),
        fp8=fp8,
        total_steps=8,
        seed=0,
    )


def _same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    assert a is not None and b is not None
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize(("m", "n"), [(300, 640), (1000, 8960), (37, 200), (128, 128)])
def test_quantizing_swiglu_gives_the_quantizers_codes_forward_and_backward(
    m: int, n: int, pow2: bool
) -> None:
    from infir2_rl.fp8 import ops, quant_triton

    torch.manual_seed(0)
    g = (2 * torch.randn(m, n, device="cuda")).bfloat16()
    u = (torch.randn(m, n, device="cuda") * torch.exp(torch.randn(m, 1, device="cuda"))).bfloat16()
    dh = torch.randn(m, n, device="cuda").bfloat16()
    g[m // 2] = 0.0
    h_ref = fused_layers.swiglu(g, u)
    dg_ref, du_ref = torch.autograd.grad(
        fused_layers.swiglu(g.requires_grad_(), u.requires_grad_()), (g, u), dh
    )

    handoff: list = []
    gq, uq = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    h = fused_layers._SwiGLUFn.apply(gq, uq, fused_layers.Fp8Plan(pow2, True, True, True), handoff)
    assert torch.equal(h, h_ref)
    # h's token tiles are made later (at down_proj's backward) from gate and up: the same bytes
    q, s_t, later, none = handoff[0]
    assert isinstance(later, ops.TokenTilesLater) and none is None
    assert later.inputs[0] is gq and later.inputs[1] is uq
    for a, b in zip(
        (q, s_t, *later.claim()(*later.inputs)), quant_triton.quantize_rows_and_cols(h_ref, pow2)
    ):
        assert _same_bytes(a, b)
    ops._given_grads.clear()
    dg, du = torch.autograd.grad(h, (gq, uq), dh)
    assert torch.equal(dg, dg_ref) and torch.equal(du, du_ref)
    given = {e[0]().data_ptr(): e[3] for e in ops._given_grads}
    for grad in (dg, du):
        for a, b in zip(given[grad.data_ptr()], quant_triton.quantize_rows_and_cols(grad, pow2)):
            assert _same_bytes(a, b)
    ops._given_grads.clear()


def test_fp8_mlp_takes_the_swiglu_quantizations_and_computes_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An FP8 Qwen2MLP under autocast: with the handoffs, down_proj's input and gate/up's output gradients are
    # not quantized again (3 of the 5 quantize_rows_and_cols calls of a forward+backward go), h's token
    # tiles are not kept from forward to backward, and the output and every gradient are the same bits as
    # without them.
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    from infir2_rl.fp8 import quant_triton
    from infir2_rl.fp8.linear import swap_to_fp8_training

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=256, intermediate_size=640, hidden_act="silu")
    mlp = Qwen2MLP(config).cuda()
    swap_to_fp8_training(mlp)
    assert fused_layers.apply_fused_layers(mlp)["swiglu_mlp"] == 1
    x = torch.randn(3, 100, 256, device="cuda")
    dy = torch.randn(3, 100, 256, device="cuda")
    calls: list[int] = []
    real = quant_triton.quantize_rows_and_cols

    def counting(t: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
        calls.append(t.shape[-1])
        return real(t, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(quant_triton, "quantize_rows_and_cols", counting)

    def run() -> list[torch.Tensor]:
        mlp.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mlp(xi)
        y.backward(dy.to(y.dtype))
        return [y.detach(), xi.grad, *(p.grad for p in mlp.parameters())]  # type: ignore[list-item]

    def saved_fp8_shapes() -> list[tuple[int, ...]]:
        shapes: list[tuple[int, ...]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == torch.float8_e4m3fn:
                shapes.append(tuple(t.shape))
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks, torch.autocast("cuda", dtype=torch.bfloat16):
            mlp(x.clone().requires_grad_())
        return shapes

    handed = run()
    assert sorted(calls) == [256, 256]  # x (gate/up's input) and down_proj's output gradient
    # h's token tiles (640 features x 384 tokens) are not kept for backward: made there from gate and up
    assert (640, 384) not in saved_fp8_shapes()
    calls.clear()
    monkeypatch.setattr(fused_layers, "_fp8_plan", lambda mlp, x: None)
    plain = run()
    assert sorted(calls) == [256, 256, 640, 640, 640]
    assert (640, 384) in saved_fp8_shapes()  # without the handoffs down_proj keeps them
    for a, b in zip(handed, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize(("m", "k"), [(300, 384), (37, 200), (1000, 1536), (8, 3584), (5, 64)])
def test_norm_quantizes_its_output_as_the_quantizers_do(m: int, k: int, pow2: bool) -> None:
    # The fused RMSNorm's row tiles (written with the output) and its token tiles (made later from x, the
    # weight and the inverse RMS) are quantize_rows's and quantize_cols's bytes for the same output.
    from infir2_rl.fp8 import ops, quant_triton

    torch.manual_seed(0)
    x = (torch.randn(m, k, device="cuda") * torch.exp(torch.randn(m, 1, device="cuda"))).bfloat16()
    w = (1 + 0.1 * torch.randn(k, device="cuda")).bfloat16()
    x[m // 2] = 0.0
    handoff: list = []
    y = fused_layers._RMSNormFn.apply(x, w, 1e-6, fused_layers.NormPlan(pow2, True), handoff)
    assert torch.equal(y, fused_layers.rms_norm(x, w, 1e-6))
    q, s_t, later, none = handoff[0]
    assert isinstance(later, ops.TokenTilesLater) and none is None
    tiles = later.claim()(*later.inputs)
    for a, b in zip((q, s_t, *tiles), quant_triton.quantize_rows_and_cols(y, pow2)):
        assert _same_bytes(a, b)


@pytest.mark.parametrize("pow2", [False, True])
def test_an_unwritten_norm_output_serves_its_fp8_readers_and_refuses_others(pow2: bool) -> None:
    # With skip_output the norm writes only the quantization: a planned FP8 reader computes what it computes
    # from the written output; a reader whose quantization differs (other pow2) raises instead of reading it.
    from infir2_rl.fp8.linear import Fp8Linear

    torch.manual_seed(0)
    x = torch.randn(300, 384, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(384, device="cuda")).bfloat16()
    linear = Fp8Linear(384, 256, bias=False, pow2_scales=pow2).cuda()
    written = fused_layers.rms_norm(x, w, 1e-6)
    with torch.no_grad():
        expected = linear(written)
        unwritten = fused_layers.rms_norm(x, w, 1e-6, fused_layers.NormPlan(pow2, False, skip_output=True))
        assert unwritten._infir2_unwritten
        assert torch.equal(linear(unwritten), expected)
        other = Fp8Linear(384, 256, bias=False, pow2_scales=not pow2).cuda()
        unwritten = fused_layers.rms_norm(x, w, 1e-6, fused_layers.NormPlan(pow2, False, skip_output=True))
        with pytest.raises(RuntimeError, match="never written"):
            other(unwritten)


def test_fp8_decoder_layer_keeps_no_fp8_copy_of_norm_or_attention_outputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A BF16 Qwen2 decoder layer with FP8 linears (q|k|v grouped) under autocast: with the norms linked to
    # their FP8 readers and o_proj marked, the layer keeps no token tiles of the norms' outputs or of the
    # attention output (three of them without), and its output and every gradient are the same bits (the
    # norms' and SwiGLU's outputs are then never written: only their quantizations are read).
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    from infir2_rl.fp8 import grouped
    from infir2_rl.fp8.linear import mark_kept_inputs, swap_to_fp8_training

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=256, intermediate_size=640, num_attention_heads=2, num_key_value_heads=1, head_dim=128
    )
    config._attn_implementation = "sdpa"
    layer = Qwen2DecoderLayer(config, 0).cuda().bfloat16()
    swap_to_fp8_training(layer)
    assert grouped.group_projections(layer) == 1
    fused_layers.apply_fused_layers(layer)
    assert fused_layers.link_norms_to_fp8_linears(layer) == 2
    assert mark_kept_inputs(layer) == 1
    x = torch.randn(3, 100, 256, device="cuda").bfloat16()
    dy = torch.randn(3, 100, 256, device="cuda").bfloat16()
    pos = torch.arange(100, device="cuda")[None].expand(3, -1)
    rope = Qwen2RotaryEmbedding(config).cuda()

    def run() -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        kept: dict[int, tuple[int, ...]] = {}  # FP8 tensors kept for backward, once each (gate and up share)

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == torch.float8_e4m3fn:
                kept[t.data_ptr()] = tuple(t.shape)
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks, torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(xi, position_embeddings=rope(xi, pos), position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dy)
        grads = [p.grad for p in layer.parameters()]
        return [out.detach(), xi.grad, *grads], list(kept.values())  # type: ignore[list-item]

    linked, shapes = run()
    assert shapes.count((256, 384)) == 0  # the 300 tokens' token tiles of a 256-wide input
    monkeypatch.setattr(fused_layers, "_norm_plan", lambda norm, x: None)
    layer.self_attn.o_proj.input_kept = False
    plain, plain_shapes = run()
    assert plain_shapes.count((256, 384)) == 3  # q|k|v's, o_proj's and gate/up's inputs
    for a, b in zip(linked, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8", [False, True])
def test_trainer_with_fused_kernels_trains_as_without(tmp_path: Path, fp8: bool) -> None:
    model = init_model(tmp_path / "model", preset="tiny")
    plain, fused = _trainer(model, fp8, fused=False), _trainer(model, fp8, fused=True)
    assert plain.fused_layers == {}
    n_layers = plain.model.config.num_hidden_layers
    linked = {"rms_norm_fp8": 2 * n_layers} if fp8 else {}  # each layer's two norms feed FP8 linears
    fused_counts = {"rms_norm": 2 * n_layers + 1, "swiglu_mlp": n_layers, "rope_attention": n_layers}
    assert fused.fused_layers == {**fused_counts, **linked}
    assert list(fused.model.state_dict()) == list(plain.model.state_dict())
    paths = make_data(tmp_path / "data", num_sft=16, num_rl=4, num_test=4)
    examples, _ = load_sft_examples(paths.sft_train, plain.tokenizer)
    pad = plain.tokenizer.pad_token_id
    batches = [to_token_batch(examples[:8], pad), to_token_batch(examples[8:12], pad)]
    batches = [pad_length(b, bucket_length(b.input_ids.shape[1])) for b in batches]
    units = sum(num_target_tokens(b) for b in batches)
    first = [a for a in plain.forward_logprobs(batches)]
    for a, b in zip(first, fused.forward_logprobs(batches), strict=True):
        # BF16 scores; in FP8 a tile whose input moved by an ulp can round to another e4m3 code
        assert float((a - b).abs().max()) < (1e-1 if fp8 else 2e-2)
    losses: dict[str, list[float]] = {"plain": [], "fused": []}
    for _ in range(4):
        for name, trainer in (("plain", plain), ("fused", fused)):
            stats = trainer.train_step(batches, SftLossFn(), units)
            assert not stats.skipped
            losses[name].append(stats.loss)
    # The updates move the loss far more than the two paths differ (a wrong gradient would not track).
    assert abs(losses["plain"][-1] - losses["plain"][0]) > 0.1
    for a, b in zip(losses["plain"], losses["fused"], strict=True):
        assert abs(a - b) <= 2e-3 * abs(a)
    # AdamW moves an element by ~lr per step whatever its gradient's size: where a tiny gradient's sign
    # differs between the two paths the element parts by up to 2 x lr per step.
    diffs = []
    for (name, p), q in zip(plain.model.named_parameters(), fused.model.parameters(), strict=True):
        assert float((p - q).abs().max()) < 1e-2, name
        diffs.append((p - q).detach().abs().flatten())
    assert float(torch.cat(diffs).mean()) < 1e-4  # over the whole model: most elements move alike


def test_fused_kernels_under_one_rank_fsdp_with_bf16_copies(tmp_path: Path) -> None:
    """BF16 inputs to the norm (FSDP2's BF16 forward copies) take the kernels' rounding branch."""
    model = init_model(tmp_path / "model", preset="tiny")
    paths = make_data(tmp_path / "data", num_sft=8, num_rl=4, num_test=4)
    losses = []
    for fused in (False, True):
        trainer = _trainer(model, False, fused=fused, fsdp_param_dtype="bfloat16")
        assert trainer.fsdp
        examples, _ = load_sft_examples(paths.sft_train, trainer.tokenizer)
        batch = to_token_batch(examples[:8], trainer.tokenizer.pad_token_id)
        stats = [trainer.train_step([batch], SftLossFn(), num_target_tokens(batch)) for _ in range(3)]
        losses.append([s.loss for s in stats])
    for a, b in zip(*losses, strict=True):
        assert abs(a - b) <= 5e-3 * abs(a)
