"""The weight-sync export's listing (trainers/torch/export_listing.py): the first walk's tensors are given again
while the model holds them, with the same bytes a walk would give, and a walk runs whenever they are not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from infir2_rl.config.components import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch
from infir2_rl.trainers.engine_export import for_engines
from infir2_rl.trainers.torch.export_listing import UNLISTABLE, ExportListing
from infir2_rl.trainers.torch.trainer import TorchTrainer
from infir2_rl.types import TokenBatch

LINEAR = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TokenBatch]:
    root = tmp_path_factory.mktemp("listing")
    model = init_model(root / "model", preset="tiny", num_hidden_layers=2)
    paths = make_data(root / "data", num_sft=16, num_rl=4, num_test=4)
    trainer = make_trainer(model, fp8=False, param_dtype="float32")
    examples, _ = load_sft_examples(paths.sft_train, trainer.tokenizer)
    return model, to_token_batch(examples[:4], trainer.tokenizer.pad_token_id)


def make_trainer(model: Path, fp8: bool, param_dtype: str = "bfloat16") -> TorchTrainer:
    return TorchTrainer(
        ModelConfig(path=str(model), dtype="bfloat16"),
        TrainerConfig(param_dtype=param_dtype, cuda_graphs=False),  # type: ignore[arg-type]
        OptimizerConfig(lr=1e-2, warmup_ratio=0.0),
        fp8=fp8,
        total_steps=10,
        device="cpu",
    )


def walked(trainer: TorchTrainer, fp8: bool) -> dict[str, torch.Tensor]:
    """What a walk over the model exports now (the path every push took before the listing), as copies."""
    tied = bool(getattr(trainer.model.config, "tie_word_embeddings", False))
    named = for_engines(trainer._walk_export(fp8), trainer.compute_dtype, tied)
    return {name: t.clone() for name, t in named}


def assert_same_export(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)  # names and order
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), (
            name
        )


@pytest.mark.parametrize("fp8", [True, False])
def test_later_exports_are_the_listing_with_the_bytes_a_walk_gives(
    assets: tuple[Path, TokenBatch], fp8: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A BF16 model with FP32 masters (the GPU default) and, in FP8, kept FP8 weights: the second export lists
    no module, and after an optimizer step (on the CPU it leaves the kept FP8 weights stale: the listing
    re-quantizes them, as the walk's export_fp8 would) it sends the updated bytes."""
    model, batch = assets
    trainer = make_trainer(model, fp8)
    first = {name: t.clone() for name, t in trainer.export_weights(fp8)}
    assert_same_export(first, walked(trainer, fp8))
    assert isinstance(trainer._export_listings[fp8], ExportListing)
    trainer.train_step([batch], SftLossFn(), num_target_tokens(batch))

    def no_walk(*args: object) -> None:
        raise AssertionError("walked the model although the listing is current")

    monkeypatch.setattr(trainer, "_walk_export", no_walk)
    monkeypatch.setattr(nn.Module, "state_dict", no_walk)
    got = {name: t.clone() for name, t in trainer.export_weights(fp8)}
    monkeypatch.undo()
    want = walked(trainer, fp8)
    assert_same_export(got, want)
    assert not torch.equal(got[f"{LINEAR}.weight"].float(), first[f"{LINEAR}.weight"].float())


def test_a_replaced_tensor_makes_the_next_export_walk_and_list_again(assets: tuple[Path, TokenBatch]) -> None:
    model, _ = assets
    trainer = make_trainer(model, fp8=True)
    dict(trainer.export_weights())
    old = trainer._export_listings[True]
    # A parameter object replaced (a load that assigns), then a parameter's storage replaced in place.
    norm = trainer.model.get_submodule("model.norm")
    norm.weight = nn.Parameter(torch.full_like(norm.weight, 3.0))
    got = dict(trainer.export_weights())
    assert torch.equal(got["model.norm.weight"], norm.weight.detach())
    new = trainer._export_listings[True]
    assert isinstance(new, ExportListing) and new is not old
    embed = trainer.model.get_submodule("model.embed_tokens")
    embed.weight.data = torch.full_like(embed.weight, 2.0)
    got = dict(trainer.export_weights())
    assert torch.equal(got["model.embed_tokens.weight"], embed.weight.detach())
    assert trainer._export_listings[True] is not new
    # A linear's kept FP8 buffers replaced: its new buffers are exported.
    linear = trainer.model.get_submodule(LINEAR)
    kept = linear.kept_fp8
    assert kept is not None
    linear.keep_fp8_in(kept.w_fp8.clone(), kept.scale_inv.clone())
    linear.refresh_fp8()
    got = dict(trainer.export_weights())
    assert got[f"{LINEAR}.weight"].data_ptr() == linear.kept_fp8.w_fp8.data_ptr() != kept.w_fp8.data_ptr()
    assert_same_export(got, walked(trainer, True))


def test_an_export_made_for_each_push_is_never_listed(assets: tuple[Path, TokenBatch]) -> None:
    """FP32 parameters without kept FP8 weights (the CPU default): the FP8 weights are the linears' quantization
    cache, which a step replaces; a BF16 trainer's FP8 export (mixed precision) quantizes on the fly. Both walk
    every push and send the weights as they are then."""
    model, batch = assets
    for trainer, fp8 in ((make_trainer(model, True, "float32"), True), (make_trainer(model, False), True)):
        first = {name: t.clone() for name, t in trainer.export_weights(fp8)}
        assert trainer._export_listings[fp8] is UNLISTABLE
        trainer.train_step([batch], SftLossFn(), num_target_tokens(batch))
        trainer.fp8_step_boundary()
        got = dict(trainer.export_weights(fp8))
        assert_same_export(got, walked(trainer, fp8))
        assert not torch.equal(got[f"{LINEAR}.weight_scale_inv"], first[f"{LINEAR}.weight_scale_inv"])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False])
def test_on_a_gpu_the_listing_sends_what_the_fused_optimizer_wrote(
    assets: tuple[Path, TokenBatch], fp8: bool
) -> None:
    """The GPU defaults (BF16 model, FP32 masters, the flat AdamW writing the kept FP8 weights as it updates the
    masters, CUDA graphs, q|k|v grouped): after a step the listing sends the master's quantization (FP8) or its
    BF16 rounding, as a walk does."""
    from infir2_rl.fp8.quant import quantize_weight_blockwise

    model, batch = assets
    trainer = TorchTrainer(
        ModelConfig(path=str(model), dtype="bfloat16"),
        TrainerConfig(),
        OptimizerConfig(lr=1e-2, warmup_ratio=0.0),
        fp8=fp8,
        total_steps=10,
        device="cuda",
    )
    dict(trainer.export_weights(fp8))
    assert isinstance(trainer._export_listings[fp8], ExportListing)
    for _ in range(2):
        trainer.train_step([batch.to("cuda")], SftLossFn(), num_target_tokens(batch))
        got = {name: t.clone() for name, t in trainer.export_weights(fp8)}
        assert isinstance(trainer._export_listings[fp8], ExportListing)
        assert_same_export(got, walked(trainer, fp8))
        master = trainer.model.get_submodule(LINEAR).weight.detach()
        if fp8:
            w_fp8, scale_inv = quantize_weight_blockwise(master.float())
            assert torch.equal(got[f"{LINEAR}.weight"].view(torch.uint8), w_fp8.view(torch.uint8))
            assert torch.equal(got[f"{LINEAR}.weight_scale_inv"], scale_inv)
        else:
            assert torch.equal(got[f"{LINEAR}.weight"], master.to(torch.bfloat16))
