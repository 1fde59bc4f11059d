"""A BF16 model with FP32 masters in the trainer (trainer.param_dtype, trainers/torch/master_weights.py), on CPU
with model.dtype bfloat16: the masters stay FP32 and exact through a checkpoint, gradients accumulate in FP32,
and training follows the FP32-parameter path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch
from infir2_rl.trainers.microbatch import micro_batches
from infir2_rl.trainers.torch.master_weights import MasterWeights
from infir2_rl.trainers.torch.trainer import TorchTrainer, resolve_param_dtype


def test_param_dtype_rules() -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    assert resolve_param_dtype("auto", bf16, fsdp=False) == bf16
    assert resolve_param_dtype("auto", fp32, fsdp=False) == fp32  # the CPU demo
    assert resolve_param_dtype("auto", bf16, fsdp=True) == fp32
    assert resolve_param_dtype("float32", bf16, fsdp=False) == fp32
    with pytest.raises(ValueError, match="compute dtype"):
        resolve_param_dtype("bfloat16", fp32, fsdp=False)
    with pytest.raises(ValueError, match="FSDP"):
        resolve_param_dtype("bfloat16", bf16, fsdp=True)
    with pytest.raises(ValueError, match="torch backend"):
        TrainerConfig(backend="megatron", param_dtype="bfloat16")


def test_gradients_accumulate_in_fp32_into_the_masters() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    masters = MasterWeights(lin)
    weight_master = masters.optimizer_params[0]
    assert lin.weight.dtype == torch.bfloat16 and all(
        m.dtype == torch.float32 for m in masters.optimizer_params
    )
    xs = [torch.randn(8, 64, dtype=torch.bfloat16) for _ in range(3)]
    for x in xs:
        lin(x).float().square().sum().backward()
        assert lin.weight.grad is None  # handed to the master at once
    w_grads = []
    for x in xs:
        w = lin.weight.detach().clone().requires_grad_()
        torch.nn.functional.linear(x, w, lin.bias.detach()).float().square().sum().backward()
        assert w.grad is not None and w.grad.dtype == torch.bfloat16
        w_grads.append(w.grad.float())
    # Each backward's BF16 gradient, summed in FP32 (three rounded steps would lose the small ones).
    assert torch.equal(weight_master.grad, w_grads[0] + w_grads[1] + w_grads[2])
    masters.zero_grad()
    assert weight_master.grad is not None and not weight_master.grad.any()
    masters.release_grads()  # freed between eager steps; the next gradient allocates it again, zeroed
    assert weight_master.grad is None and all(seg.grads is None for seg in masters.segments)
    lin(xs[0]).float().square().sum().backward()
    assert weight_master.grad is not None and torch.equal(weight_master.grad, w_grads[0])


def _trainer(model: Path, param_dtype: str, fp8: bool) -> TorchTrainer:
    # Eager on a GPU too (the CUDA layer graphs keep every gradient buffer: tests/test_layer_graphs_gpu.py).
    return TorchTrainer(
        ModelConfig(path=str(model), dtype="bfloat16"),
        TrainerConfig(param_dtype=param_dtype, cuda_graphs=False),  # type: ignore[arg-type]
        OptimizerConfig(lr=1e-3),
        fp8=fp8,
        total_steps=8,
    )


@pytest.mark.parametrize("fp8", [False, True])
def test_bf16_model_trains_like_fp32_parameters_and_resumes_exactly(tmp_path: Path, fp8: bool) -> None:
    model = init_model(tmp_path / "model", preset="tiny")
    paths = make_data(tmp_path / "data", num_sft=64, num_rl=4, num_test=4)
    losses: dict[str, list[float]] = {}
    for param_dtype in ("float32", "bfloat16"):
        trainer = _trainer(model, param_dtype, fp8)
        examples, _ = load_sft_examples(paths.sft_train, trainer.tokenizer)
        batches = [
            to_token_batch(examples[i : i + 16], trainer.tokenizer.pad_token_id) for i in range(0, 64, 16)
        ]
        losses[param_dtype] = [
            trainer.train_step(micro_batches(b, 8), SftLossFn(), num_target_tokens(b)).loss
            for b in batches[:3]
        ]
    assert trainer.master_weights is not None
    quantized = {id(m.weight) for m in trainer.model.modules() if hasattr(m, "export_fp8")}
    assert len(quantized) == len(trainer.fp8_linears) and bool(quantized) == fp8
    for p in trainer.model.parameters():  # FP8 weights are their own FP32 masters; the rest is BF16
        assert p.dtype == (torch.float32 if id(p) in quantized else torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in trainer.params)
    # The same training up to BF16 activations: the losses agree to ~1e-3 relative.
    for a, b in zip(losses["float32"], losses["bfloat16"], strict=True):
        assert b == pytest.approx(a, rel=2e-3)
    assert losses["bfloat16"][-1] < losses["bfloat16"][0]

    # The checkpoint holds the FP32 masters, not their BF16 rounding; resume continues bit for bit.
    trainer.save(tmp_path / "ck")
    saved = load_file(str(tmp_path / "ck" / "hf" / "model.safetensors"))
    norm = saved["model.norm.weight"]
    master = trainer.params[[n for n, _ in trainer.model.named_parameters()].index("model.norm.weight")]
    assert norm.dtype == torch.float32 and torch.equal(norm, master.detach().cpu())
    assert not torch.equal(norm, norm.to(torch.bfloat16).float())  # trained masters are not BF16 values
    last = batches[3]
    expected = trainer.train_step(micro_batches(last, 8), SftLossFn(), num_target_tokens(last))
    resumed = _trainer(model, "bfloat16", fp8)
    resumed.load(tmp_path / "ck")
    got = resumed.train_step(micro_batches(last, 8), SftLossFn(), num_target_tokens(last))
    assert (got.loss, got.grad_norm) == (expected.loss, expected.grad_norm)
    for a, b in zip(trainer.params, resumed.params, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(trainer.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_deleted_trainer_frees_its_model(tmp_path: Path) -> None:
    import gc
    import weakref

    model = init_model(tmp_path / "model", preset="tiny")
    trainer = _trainer(model, "bfloat16", fp8=True)
    alive = weakref.ref(trainer.model)
    del trainer
    gc.collect()
    assert alive() is None  # no reference cycle through the gradient hooks keeps it


def test_one_segment_per_decoder_layer_and_gradients_allocated_as_they_arrive(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model", preset="tiny")
    trainer = _trainer(model, "bfloat16", fp8=True)
    masters = trainer.master_weights
    assert masters is not None
    layers = len(trainer.model.model.layers)  # type: ignore[union-attr]
    assert len(masters.segments) == layers + 1
    assert all(seg.grads is None for seg in masters.segments)
    seen: list[bool] = []
    layer0 = next(trainer.model.model.layers[0].parameters())  # type: ignore[union-attr, index]
    first = next(seg for seg in masters.segments if any(p is layer0 for p, _, _ in seg.slots))
    # When the last layer's input gradient is out, the first layer's buffer does not exist yet.
    last = trainer.model.model.layers[-1]  # type: ignore[union-attr, index]
    last.register_full_backward_hook(lambda *_: seen.append(first.grads is None))
    paths = make_data(tmp_path / "data", num_sft=8, num_rl=4, num_test=4)
    examples, _ = load_sft_examples(paths.sft_train, trainer.tokenizer)
    batch = to_token_batch(examples[:8], trainer.tokenizer.pad_token_id)
    trainer.train_step([batch], SftLossFn(), num_target_tokens(batch))
    assert seen == [True]
    assert all(seg.grads is None for seg in masters.segments)  # released after the step (eager)


def test_fp8_linears_keep_their_fp8_weights_beside_the_masters(tmp_path: Path) -> None:
    from infir2_rl.fp8.linear import Fp8Linear
    from infir2_rl.fp8.quant import quantize_weight_blockwise

    model = init_model(tmp_path / "model", preset="tiny")
    trainer = _trainer(model, "bfloat16", fp8=True)
    masters = trainer.master_weights
    assert masters is not None
    linears = [m for m in trainer.model.modules() if isinstance(m, Fp8Linear)]
    regions = [seg.fp8 for seg in masters.segments if seg.fp8 is not None]
    assert len(regions) == len(trainer.model.model.layers)  # type: ignore[union-attr]
    kept = {m.kept_fp8.w_fp8.untyped_storage().data_ptr() for m in linears if m.kept_fp8 is not None}
    assert all(m.kept_fp8 is not None for m in linears)
    assert sum(r.codes.numel() for r in regions) == sum(m.weight.numel() for m in linears)

    def assert_fresh() -> None:
        for m in linears:
            w_fp8, scale_inv = m.export_fp8()
            assert m.kept_fp8 is not None and w_fp8 is m.kept_fp8.w_fp8  # the buffers, not a copy
            ref_w, ref_s = quantize_weight_blockwise(m.weight.detach())
            assert torch.equal(w_fp8.view(torch.uint8), ref_w.view(torch.uint8)) and torch.equal(
                scale_inv, ref_s
            )

    assert_fresh()
    paths = make_data(tmp_path / "data", num_sft=8, num_rl=4, num_test=4)
    examples, _ = load_sft_examples(paths.sft_train, trainer.tokenizer)
    batch = to_token_batch(examples[:8], trainer.tokenizer.pad_token_id)
    before = [m.export_fp8()[0].clone() for m in linears]
    trainer.train_step([batch], SftLossFn(), num_target_tokens(batch))
    assert_fresh()  # torch's AdamW on CPU: the trainer marks them stale, the next use quantizes again
    assert any(
        not torch.equal(a.view(torch.uint8), m.export_fp8()[0].view(torch.uint8))
        for a, m in zip(before, linears)
    )
    # A checkpoint load writes the masters through views whose writes the parameters' version counters miss.
    sd = {k: v.clone() for k, v in masters.state_dict(trainer.model).items()}
    for k in sd:
        if k.endswith("q_proj.weight"):
            sd[k].mul_(2.0)
    masters.load_state_dict(trainer.model, sd)
    assert_fresh()
    assert len(kept) == len(regions)  # one FP8 buffer per decoder layer


def test_q_k_v_kept_one_after_another_run_as_one_view() -> None:
    from infir2_rl.fp8 import grouped
    from infir2_rl.fp8.linear import Fp8Linear

    torch.manual_seed(0)
    attn = nn.Module()
    for name, rows in (("q_proj", 256), ("k_proj", 128), ("v_proj", 128)):
        setattr(attn, name, Fp8Linear(128, rows))
    masters = MasterWeights(attn)
    assert grouped.group_projections(attn) == 1
    group = attn.q_proj._group
    assert group is not None
    stacked = group._fp8_weight()
    parts = [m.export_fp8() for m in group.members]
    # The stack is the kept buffers themselves (no copy), equal to the members' FP8 weights stacked.
    region = masters.segments[0].fp8
    assert region is not None and stacked.w_fp8.data_ptr() == region.codes.data_ptr()
    assert torch.equal(stacked.w_fp8.view(torch.uint8), torch.cat([w for w, _ in parts]).view(torch.uint8))
    assert torch.equal(stacked.scale_inv, torch.cat([s for _, s in parts]))
    x = torch.randn(4, 128, requires_grad=True)
    outs = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    sum(o.square().sum() for o in outs).backward()
    assert all(
        m.main_grad is not None and m.main_grad.abs().sum() > 0
        for m in (attn.q_proj.weight, attn.v_proj.weight)
    )


def test_the_layer_graphs_stale_check_finds_what_the_per_module_check_finds(tmp_path: Path) -> None:
    """``refresh_kept_fp8`` (the check the layer graphs make before each micro-batch, inlined for host time)
    refreshes exactly the kept weights ``refresh_fp8`` would: none when fresh, one whose weight was written in
    place (version), one whose weight was replaced (storage); afterwards they equal the quantizer's."""
    from infir2_rl.fp8.linear import Fp8Linear, refresh_kept_fp8
    from infir2_rl.fp8.quant import quantize_weight_blockwise

    model = init_model(tmp_path / "model", preset="tiny")
    trainer = _trainer(model, "bfloat16", fp8=True)
    linears = [m for m in trainer.model.modules() if isinstance(m, Fp8Linear)]
    for m in linears:
        m.export_fp8()  # fresh
    assert refresh_kept_fp8(linears) == 0
    a, b = linears[0], linears[3]
    with torch.no_grad():
        a.weight.mul_(0.5)  # in place: a version bump
    b.weight.data = b.weight.data.clone() * 2.0  # new storage, same version counter value possible
    assert sorted(id(m) for m in linears if m._kept_key != m._kept_stamp()) == sorted((id(a), id(b)))
    assert refresh_kept_fp8(linears) == 2
    assert refresh_kept_fp8(linears) == 0
    for m in (a, b):
        assert m.kept_fp8 is not None
        ref_w, ref_s = quantize_weight_blockwise(m.weight.detach())
        assert torch.equal(m.kept_fp8.w_fp8.view(torch.uint8), ref_w.view(torch.uint8))
        assert torch.equal(m.kept_fp8.scale_inv, ref_s)
