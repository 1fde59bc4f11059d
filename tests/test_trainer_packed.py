"""TorchTrainer with packed micro-batches (trainer.pack_sequences) gives the padded trainer's loss, gradient
norm, updated weights and log-probs (CPU, FP32, FP8 emulated)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch
from infir2_rl.trainers.microbatch import micro_batches
from infir2_rl.trainers.torch.trainer import TorchTrainer
from infir2_rl.types import TokenBatch


@pytest.mark.parametrize("fp8", [False, True])
def test_packed_and_padded_train_the_same(tmp_path: Path, fp8: bool) -> None:
    model = init_model(tmp_path / "model", preset="tiny", num_hidden_layers=2)
    paths = make_data(tmp_path / "data", num_sft=16, num_rl=4, num_test=4)
    trainers = {
        packed: TorchTrainer(
            ModelConfig(path=str(model)),
            TrainerConfig(pack_sequences=packed),
            OptimizerConfig(warmup_ratio=0.0),
            fp8=fp8,
            total_steps=4,
            device="cpu",  # the CPU's packed path (on a GPU: tests/test_trainer_fused_gpu.py)
        )
        for packed in (False, True)
    }
    examples, _ = load_sft_examples(paths.sft_train, trainers[False].tokenizer)
    batch = to_token_batch(examples[:8], trainers[False].tokenizer.pad_token_id)
    lengths = batch.attention_mask.sum(1)
    assert lengths.min() < lengths.max()  # ragged rows: padding is really skipped
    (logp_packed,) = trainers[True].forward_logprobs([batch], temperature=1.1)
    (logp_padded,) = trainers[False].forward_logprobs([batch], temperature=1.1)
    torch.testing.assert_close(logp_packed, logp_padded, rtol=1e-5, atol=1e-5)
    start = {name: p.detach().clone() for name, p in trainers[False].model.named_parameters()}
    stats = {
        packed: t.train_step(micro_batches(batch, 4), SftLossFn(), num_target_tokens(batch))
        for packed, t in trainers.items()
    }
    assert stats[True].loss == pytest.approx(stats[False].loss, rel=1e-5)
    # FP8: wgrad quantizes X and dY in 128-token tiles, and packing changes which tokens share a tile (no
    # padding rows): FP8 rounding noise, ~2e-4 of the norm here, not a different gradient.
    assert stats[True].grad_norm == pytest.approx(stats[False].grad_norm, rel=1e-3 if fp8 else 1e-5)
    padded_params = dict(trainers[False].model.named_parameters())
    lr = OptimizerConfig().lr
    flipped = total = 0
    for name, p in trainers[True].model.named_parameters():
        if not fp8:
            torch.testing.assert_close(p, padded_params[name], rtol=1e-5, atol=2e-5, msg=name)
            continue
        # Adam's first step moves every weight by ~lr one way or the other, so a per-element bound of 2 lr
        # would hold for any two gradients. FP8 noise may flip the direction only where a gradient is tiny:
        # the updates must agree almost everywhere, and every update must have moved by ~lr.
        moved, other = p.detach() - start[name], padded_params[name].detach() - start[name]
        flipped += int(((moved - other).abs() > lr / 2).sum())
        total += moved.numel()
    if fp8:  # 1,243 of 434,048 (0.29%) here on 2026-11-29; a wrong gradient flips about half
        assert flipped < 0.01 * total, f"{flipped} of {total} updates differ"


def test_pack_sequences_auto_packs_only_where_varlen_flash_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.pack_sequences: "auto" packs on a CUDA device with varlen flash attention and BF16/FP16
    compute, not under true_on_policy nor where the rows are sorted by length; true/false are kept as given."""
    from infir2_rl.trainers.torch import trainer as trainer_mod
    from infir2_rl.trainers.torch import varlen_attention

    cpu, cuda, bf16 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16
    resolve = trainer_mod.resolve_pack_sequences
    assert resolve("auto", cpu, torch.float32, False) is False  # the CPU demo keeps padded rows
    assert resolve("auto", cpu, bf16, False) is False
    assert resolve(True, cpu, torch.float32, False) is True and resolve(False, cuda, bf16, False) is False
    asked: list[tuple[torch.device, bool]] = []

    def available(device: torch.device, warn: bool = True) -> bool:
        asked.append((device, warn))
        return device.type == "cuda"

    monkeypatch.setattr(varlen_attention, "varlen_available", available)
    assert resolve("auto", cuda, bf16, False) is True
    assert asked == [(cuda, False)]  # asked quietly: auto pads where it cannot pack, nothing to warn about
    assert resolve("auto", cuda, torch.float16, False) is True
    assert resolve("auto", cuda, torch.float32, False) is False  # flash runs in BF16/FP16 only
    assert resolve("auto", cuda, bf16, True) is False  # true_on_policy's walk scores padded rows
    assert resolve("auto", cuda, bf16, False, sorted_rows=True) is False  # sorted padded rows beat packing
    assert resolve(True, cuda, bf16, False, sorted_rows=True) is True
    assert resolve("auto", cuda, bf16, False, eager_attention=True) is False  # eager attention asked for
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda device, warn=True: False)
    assert resolve("auto", cuda, bf16, False) is False  # no torch.nn.attention.varlen


def test_the_trainer_group_splits_by_the_workers_resolved_setting(tmp_path: Path) -> None:
    """A worker reports how "auto" resolved on its device (CPU: padded; an explicit true packs on CPU too,
    with the block-diagonal mask), and the group splits batches by that answer, not by the config's value
    (packed: the token budget counts real tokens). Without Ray: the classes are used directly."""
    from infir2_rl.actors.trainer_group import TrainerGroup
    from infir2_rl.actors.trainer_worker import TrainerWorker

    model = init_model(tmp_path / "model", preset="tiny", num_hidden_layers=1)
    for setting, expected in (("auto", False), (True, True)):
        worker = TrainerWorker.__new__(TrainerWorker)
        worker._backend = TorchTrainer(
            ModelConfig(path=str(model)),
            TrainerConfig(pack_sequences=setting),
            OptimizerConfig(),
            fp8=False,
            total_steps=1,
            device="cpu",  # "auto" packs on a GPU
        )
        assert worker.packs_sequences() is expected
    ids = torch.ones(4, 8, dtype=torch.long)
    mask = torch.tensor([[1] * 8, [1] * 2 + [0] * 6, [1] * 2 + [0] * 6, [1] * 2 + [0] * 6])
    batch = TokenBatch(input_ids=ids * mask, attention_mask=mask, loss_mask=mask.float())
    group = TrainerGroup.__new__(TrainerGroup)
    group.trainer_cfg = TrainerConfig(pack_sequences="auto", max_tokens_per_gpu=16)
    group.model_parallel, group.num_workers = 1, 1
    group.pads_to_buckets = False
    for packed, rows in ((False, [2, 2]), (True, [4])):  # padded: 2 rows x 8 <= 16; packed: 8+2+2+2 <= 16
        group.pack_sequences = packed
        (shard,) = group._shards(batch)
        assert [int(mb.input_ids.shape[0]) for mb in shard] == rows, packed
    # A worker that pads rows to length buckets (the layer graphs) has the bucket counted against the budget:
    # 8 tokens run as 64, so a budget of 128 takes 2 rows, not 16 (rows x 8).
    group.pack_sequences, group.pads_to_buckets = False, True
    group.trainer_cfg = TrainerConfig(pack_sequences="auto", max_tokens_per_gpu=128)
    (shard,) = group._shards(batch)
    assert [int(mb.input_ids.shape[0]) for mb in shard] == [2, 2]
    group.pads_to_buckets = False
    (shard,) = group._shards(batch)
    assert [int(mb.input_ids.shape[0]) for mb in shard] == [4]
