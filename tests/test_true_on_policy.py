"""true_on_policy on CPU: the shared walk computes what transformers computes, and every refusal is one line.

Bit equality between trainer and engine is the GPU kernels' promise (tests/test_true_on_policy_gpu.py);
here the walk (models/invariant.py) runs on its torch references, which checks its wiring (rotary tables,
grouped-query attention, biases, norms, the lm_head and temperature) and its backward against the
transformers model in the same dtype.
"""

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.config.stage import RlStageConfig
from infir2_rl.fp8.linear import swap_to_fp8_training
from infir2_rl.models import invariant
from infir2_rl.models.factory import init_model
from infir2_rl.trainers.torch import invariant_scoring


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """Single-threaded torch for this module (see conftest.one_thread)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tp") / "tiny", preset="tiny", seed=4)


def _hf_scores(model: torch.nn.Module, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = model(input_ids=ids).logits.float() / temperature
    return torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_walk_equals_the_transformers_forward_and_backward(model_dir: Path, fp8: bool) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    if fp8:
        swap_to_fp8_training(model)
    ids = torch.randint(10, 300, (3, 24), generator=torch.Generator().manual_seed(0))
    select = torch.ones_like(ids, dtype=torch.bool)
    select[2, 15:] = False  # a shorter row: its tail is not scored
    logp, entropy = invariant_scoring.score_tokens(model, ids, select, temperature=1.1, need_entropy=True)
    assert entropy is not None and (entropy[:, 1:][select[:, 1:]] > 0).all()
    assert (logp[~select] == 0).all() and (logp[:, 0] == 0).all()
    ref = _hf_scores(model, ids, 1.1)
    picked = select[:, 1:]
    assert (logp[:, 1:][picked] - ref[picked]).abs().max() < 2e-3

    # Gradients of the same loss through both paths (invariant forward, plain torch backward).
    params = [p for p in model.parameters() if p.requires_grad]
    grads_walk = torch.autograd.grad(logp[:, 1:][picked].sum(), params, allow_unused=True)
    grads_hf = torch.autograd.grad(_hf_scores(model, ids, 1.1)[picked].sum(), params, allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), grads_walk, grads_hf):
        assert a is not None and b is not None, name
        rel = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)
        # BF16 rounding alone puts the two within ~2%; FP8 quantizes the output gradients, so their small
        # forward differences move every parameter's gradient by ~4-6% (all alike: a wiring error is O(1)).
        assert rel < (0.1 if fp8 else 0.05), f"{name}: relative gradient difference {rel:.3f}"


def test_rope_tables_match_transformers(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    cos, sin = invariant.rope_tables(model.config, 64, torch.device("cpu"))
    ref_cos, ref_sin = model.model.rotary_emb(cos, torch.arange(64)[None])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


def test_unsupported_models_are_refused_by_name(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        invariant.check_model(model)


def test_trainer_and_engine_refuse_without_the_gpu_kernels(model_dir: Path) -> None:
    from infir2_rl.engines.native.engine import NativeEngine
    from infir2_rl.trainers.torch.trainer import TorchTrainer

    with pytest.raises(ValueError, match="true_on_policy needs a CUDA device with Triton"):
        TorchTrainer(
            ModelConfig(path=str(model_dir), dtype="float32"),
            TrainerConfig(),
            OptimizerConfig(),
            fp8=False,
            total_steps=1,
            device="cpu",
            true_on_policy=True,
        )
    with pytest.raises(ValueError, match="true_on_policy needs the runner decode path on a CUDA device"):
        NativeEngine(str(model_dir), fp8=False, device="cpu", true_on_policy=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"precision": "bf16_train_fp8_rollout"}, "a BF16 trainer cannot reproduce"),
        (
            {"rollout": {"backend": "sglang"}, "weight_sync": {"self_check_layers": 0}},
            "rollout.backend=native",
        ),
        ({"trainer": {"num_workers": 2}}, "trainer.num_workers=1"),
        ({"trainer": {"fsdp_param_dtype": "bfloat16"}}, "trainer.fsdp_param_dtype auto or float32"),
        ({"trainer": {"pack_sequences": True}}, "trainer.pack_sequences auto or false"),
        ({"model": {"gradient_checkpointing": True}}, "model.gradient_checkpointing=false"),
    ],
)
def test_the_stage_setting_refuses_what_is_not_built(overrides: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RlStageConfig(true_on_policy=True, **overrides)
    assert RlStageConfig(true_on_policy=True).true_on_policy


def test_the_walk_runs_each_decoder_layer_through_the_given_function(model_dir: Path) -> None:
    """``score_tokens(layers=...)`` is how the trainer's CUDA graphs run the walk's layers (LayerGraphs.call):
    each layer once, in order, with the same result as the walk's own eager layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    ids = torch.randint(10, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    select = torch.ones_like(ids, dtype=torch.bool)
    forwards = invariant_scoring.layer_forwards(model)
    calls: list[int] = []

    def layers(i: int, hidden: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append(i)
        assert hidden.shape == (2, 16, model.config.hidden_size)
        return forwards[i](hidden, **kwargs)

    given, _ = invariant_scoring.score_tokens(
        model, ids, select, temperature=1.0, need_entropy=False, layers=layers
    )
    own, _ = invariant_scoring.score_tokens(model, ids, select, temperature=1.0, need_entropy=False)
    assert calls == list(range(model.config.num_hidden_layers))
    assert torch.equal(given, own)
    with pytest.raises(ValueError, match="no attention mask or KV cache"):
        forwards[0](torch.zeros(1, 4, model.config.hidden_size), attention_mask=torch.ones(1, 4))


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_the_gemm_probe_fuses_weights_as_the_engine_does(fp8: bool) -> None:
    """invariant_ops.plan checks cuBLAS's fused q|k|v (gate|up) GEMM against the separate ones on a fused weight
    it builds itself; that weight and its column offsets must be the engine's (linears.FusedLinear)."""
    from torch import nn

    from infir2_rl.engines.native.linears import FusedLinear
    from infir2_rl.fp8.linear import Fp8InferenceLinear
    from infir2_rl.fp8.quant import quantize_weight_blockwise
    from infir2_rl.models import invariant_ops as ops

    gen = torch.Generator().manual_seed(0)
    sizes, k = [200, 64, 64], 256  # a part that is not a whole number of 128-row blocks
    modules: list[nn.Module] = []
    parts: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for n in sizes:
        w = torch.randn(n, k, generator=gen)
        if fp8:
            m = Fp8InferenceLinear(k, n, bias=True)
            m.weight, m.weight_scale_inv = quantize_weight_blockwise(w)
            parts.append((m.weight.clone(), m.weight_scale_inv.clone()))
        else:
            m = nn.Linear(k, n, bias=True).to(torch.bfloat16)
            m.weight.data.copy_(w)
            parts.append((m.weight.detach().clone(), None))
        modules.append(m)
    fused = FusedLinear(modules, None, torch.bfloat16, invariant=True)
    w_all, s_all = ops._fused_weight(parts)
    assert [sl.start for sl in fused.part_slices] == ops._fused_starts(sizes, fp8)[:-1]
    assert fused.out_features == ops._fused_starts(sizes, fp8)[-1] == w_all.shape[0]
    assert torch.equal(
        fused.weight.view(torch.uint8) if fp8 else fused.weight, w_all.view(torch.uint8) if fp8 else w_all
    )
    if fp8:
        assert fused.scale is not None and s_all is not None and torch.equal(fused.scale, s_all)


def test_a_one_part_split_adds_the_bias_as_torch_and_partials_sum_from_the_first() -> None:
    """``SplitPartials``' torch twin (what the consumer kernels compute, ``fused_ops._sum_partials``): one part
    in BF16 plus the bias rounds as torch's ``y + bias`` (the deferred q|k|v bias under true_on_policy); FP32
    partials sum from partial 0 in order, so a sum of negative zeros stays -0.0 as torch's ``p0 + p1`` does."""
    from infir2_rl.engines.native.fused_ops import SplitPartials

    gen = torch.Generator().manual_seed(0)
    y = torch.randn(33, 96, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    got = SplitPartials(y[None], torch.bfloat16, bias).total()
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), (y + bias).view(torch.int16))
    parts = torch.randn(3, 5, 7, generator=gen)
    parts[:, 0, 0] = -0.0
    total = SplitPartials(parts, torch.float32).total()
    assert torch.equal(total, parts[0] + parts[1] + parts[2]) and torch.signbit(total[0, 0])


def test_the_split_rule_is_a_rule_of_the_shape() -> None:
    """Trainer and engines plan in separate processes and a split changes the bits, so whether an FP8 GEMM runs
    in K chunks is a function of its shape alone: 1.5B's down_proj (24 output tiles at 256 rows, 70 K blocks)
    splits, where it was measured to pay; 7B's down_proj (56 tiles), where it lost, and short K do not."""
    from infir2_rl.models import invariant_ops

    assert invariant_ops._split_wanted(1536, 8960)  # 1.5B down_proj
    assert not invariant_ops._split_wanted(3584, 18944)  # 7B down_proj
    assert not invariant_ops._split_wanted(1536, 1536)  # 1.5B o_proj: 12 K blocks
    assert invariant_ops.split_chunks(70) == [(0, 35), (35, 70)]
    assert invariant_ops.split_chunks(71) == [(0, 36), (36, 71)]


def test_silu_mul_reads_gate_and_up_apart_at_one_row_stride() -> None:
    """The walk's SiLU*up passes its two GEMM outputs to the engine's kernel without concatenating them
    (``fused_ops.silu_mul_apart(gate, up)``): the same values as the fused gate|up form; halves of different row
    strides, which the kernel cannot read at one stride, or columns that are not contiguous, are refused in one
    line."""
    import torch.nn.functional as F

    from infir2_rl.engines.native import fused_ops

    gate, up = torch.randn(5, 256), torch.randn(5, 256)
    apart = fused_ops.silu_mul_apart(gate, up)
    assert torch.equal(apart, fused_ops.silu_mul(torch.cat((gate, up), 1)))
    assert torch.equal(apart, F.silu(gate) * up)
    with pytest.raises(ValueError, match="one row stride"):
        fused_ops.silu_mul_apart(gate, torch.cat((gate, up), 1)[:, 256:])
    with pytest.raises(ValueError, match="columns contiguous"):  # a gate|up view the kernel cannot read
        fused_ops.silu_mul(torch.cat((gate, up), 1).t().contiguous().t())


def test_whole_sequence_attention_is_causal_and_refuses_rows_that_are_not_sequences() -> None:
    """``causal_rows`` (CPU: the torch reference of ``attention``): row b * L + t sees keys 0..t of sequence
    b; no sequences give no rows; rows that do not split into whole sequences get one ValueError."""
    import torch.nn.functional as F

    from infir2_rl.models import invariant_ops as ops

    torch.manual_seed(0)
    batch, length, heads, kv_heads, dim = 2, 5, 4, 2, 8
    q = torch.randn(batch * length, heads, dim)
    k, v = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    ref = F.scaled_dot_product_attention(
        q.view(batch, length, heads, dim).transpose(1, 2), k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
        is_causal=True,
    ).transpose(1, 2).reshape(batch * length, heads * dim)  # fmt: skip
    assert torch.allclose(ops.causal_rows(q, k, v), ref, atol=1e-5)
    empty = ops.causal_rows(q[:0], k[:0], v[:0])
    assert empty.shape == (0, heads * dim)
    with pytest.raises(ValueError, match="not whole sequences"):
        ops.causal_rows(q[:7], k, v)
