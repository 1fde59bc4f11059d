"""TorchTrainer in-process (no Ray): accumulation, non-finite guard, log-prob alignment, exact save/load,
FP8 export, lr schedules, micro-batching."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from on_policy import check_first_update, rl_batch

from infir2_rl.algo.config import AlgorithmConfig
from infir2_rl.algo.loss_fns import GrpoLoss
from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.metrics import names
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch
from infir2_rl.trainers.microbatch import (
    compact,
    merge_rows,
    micro_batches,
    row_lengths,
    shard_bounds,
    shard_micro_batches,
    shard_rows,
    take_rows,
    unshuffle_rows,
)
from infir2_rl.trainers.optim import LrFactor
from infir2_rl.trainers.torch.trainer import TorchTrainer
from infir2_rl.types import LossOutput, TokenBatch, TokenScores


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TokenBatch]:
    root = tmp_path_factory.mktemp("trainer")
    model = init_model(root / "model", preset="tiny", num_hidden_layers=2)
    paths = make_data(root / "data", num_sft=40, num_rl=4, num_test=4)
    trainer = make_trainer(model)
    examples, _ = load_sft_examples(paths.sft_train, trainer.tokenizer)
    return model, to_token_batch(examples[:8], trainer.tokenizer.pad_token_id)


def make_trainer(model: Path, fp8: bool = False, total_steps: int = 10, **optim: float) -> TorchTrainer:
    # On the CPU wherever the tests run: on a GPU machine the default device computes in BF16, outside these
    # tests' FP32 tolerances (the accumulation test's grad-norm bound failed on an H200, 2026-11-28).
    return TorchTrainer(
        ModelConfig(path=str(model)),
        TrainerConfig(),
        OptimizerConfig(warmup_ratio=0.0, **optim),
        fp8=fp8,
        total_steps=total_steps,
        device="cpu",
    )


def params(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_accumulation_gives_the_global_mean_whatever_the_split(assets: tuple[Path, TokenBatch]) -> None:
    model, batch = assets
    units = num_target_tokens(batch)
    one, split = make_trainer(model), make_trainer(model)
    stats_one = one.train_step([batch], SftLossFn(), units)
    stats_split = split.train_step(micro_batches(batch, 3), SftLossFn(), units)  # 3 + 3 + 2 rows
    assert stats_one.loss == pytest.approx(stats_split.loss, rel=1e-6)
    assert stats_one.grad_norm == pytest.approx(stats_split.grad_norm, rel=1e-5)
    assert stats_one.num_sequences == stats_split.num_sequences == 8
    assert stats_one.num_tokens == stats_split.num_tokens == int(batch.attention_mask.sum())
    for name, value in params(one).items():
        # Adam divides by |g|: entries with near-zero gradients amplify rounding, hence atol ~ 1% of lr.
        torch.testing.assert_close(value, params(split)[name], rtol=1e-5, atol=2e-5)


def test_evaluate_loss_is_the_loss_a_step_reports_before_it_updates(assets: tuple[Path, TokenBatch]) -> None:
    """(sum of loss x units, units) over micro-batches, summed on the device and read once at the end."""
    model, batch = assets
    trainer = make_trainer(model)
    total, units = trainer.evaluate_loss(micro_batches(batch, 3), SftLossFn())
    assert units == num_target_tokens(batch)
    stats = trainer.train_step(micro_batches(batch, 3), SftLossFn(), units)
    assert total / units == pytest.approx(stats.loss, rel=1e-6)
    after, _ = trainer.evaluate_loss(micro_batches(batch, 3), SftLossFn())
    assert after < total  # the step lowered the loss on its own batch


def test_grpo_statistics_are_token_means_whatever_the_split(assets: tuple[Path, TokenBatch]) -> None:
    """train/tis_weight_mean and the other GRPO statistics are means over response tokens: they were averaged
    by sequences over micro-batches, so micro-batches of one row logged +25% here. A micro-batch with no
    response token (SGLang's refused prompts) adds nothing."""
    model, batch = assets
    gen = torch.Generator().manual_seed(0)
    mask = batch.loss_mask.clone()
    mask[3] = 0.0  # one row without a response token
    rl = TokenBatch(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        loss_mask=mask,
        old_logprobs=-torch.rand(mask.shape, generator=gen) * mask,
        advantages=torch.randn(mask.shape[0], generator=gen),
    )
    assert rl.old_logprobs is not None
    rl.rollout_logprobs = (rl.old_logprobs + 0.5 * torch.randn(mask.shape, generator=gen)) * mask
    w = torch.exp(rl.old_logprobs - rl.rollout_logprobs).clamp(0.0, 2.0)[:, 1:]
    true_mean = float((w * mask[:, 1:]).sum() / mask[:, 1:].sum())
    loss_fn = GrpoLoss(AlgorithmConfig(), 1.0)  # sample_token_mean: units are sequences
    for split in (8, 3, 1):
        stats = make_trainer(model).train_step(micro_batches(rl, split), loss_fn, rl.num_sequences)
        assert stats.metrics[names.TRAIN_TIS_WEIGHT_MEAN] == pytest.approx(true_mean, rel=1e-5), split


@pytest.mark.parametrize("fp8", [False, True])
def test_the_first_rl_update_needs_no_scoring_pass(assets: tuple[Path, TokenBatch], fp8: bool) -> None:
    """``GrpoLoss.old_from_scores`` with ``train_step(keep_logprobs=True)`` is the update a scoring pass before it
    gives (tests/on_policy.py), BF16 and FP8, over 3 micro-batches."""
    model, batch = assets
    check_first_update(lambda: make_trainer(model, fp8=fp8), rl_batch(batch), micro_batch_size=3)


def test_keep_logprobs_refuses_a_model_with_dropout(tmp_path: Path, assets: tuple[Path, TokenBatch]) -> None:
    """In training mode dropout changes the forward, so its log-probs are not the policy's old ones: one line."""
    _, batch = assets
    model = init_model(tmp_path / "model", preset="tiny", num_hidden_layers=2, attention_dropout=0.1)
    trainer = make_trainer(model)
    with pytest.raises(ValueError, match=r"drops activations in training \(config.attention_dropout=0.1\)"):
        trainer.train_step([batch], SftLossFn(), num_target_tokens(batch), keep_logprobs=True)
    assert trainer.step == 0
    assert trainer.train_step([batch], SftLossFn(), num_target_tokens(batch)).logprobs is None


class NanLoss:
    temperature = 1.0
    needs_entropy = False

    def __call__(self, scores: TokenScores, batch: TokenBatch) -> LossOutput:
        return LossOutput(loss=scores.logprobs_BL.mean() * math.nan, num_units=1)


def test_non_finite_gradient_skips_the_update_and_the_schedule(assets: tuple[Path, TokenBatch]) -> None:
    model, batch = assets
    trainer = make_trainer(model, schedule="cosine", min_lr=1e-4)
    before, lr_before = params(trainer), trainer.scheduler.get_last_lr()[0]
    stats = trainer.train_step([batch], NanLoss(), total_units=1)
    assert stats.skipped and math.isnan(stats.grad_norm) and trainer.num_skipped == 1
    assert all(torch.equal(v, params(trainer)[k]) for k, v in before.items())
    assert trainer.scheduler.get_last_lr()[0] == lr_before and trainer.scheduler.last_epoch == 0
    assert not trainer.optimizer.state  # AdamW never stepped: no moments were created
    assert all(p.grad is None for p in trainer.params)
    good = trainer.train_step([batch], SftLossFn(), num_target_tokens(batch))
    assert not good.skipped and math.isfinite(good.loss) and trainer.step == 2


def test_forward_logprobs_follow_the_token_batch_alignment(assets: tuple[Path, TokenBatch]) -> None:
    model, batch = assets
    trainer = make_trainer(model)
    (logp,) = trainer.forward_logprobs([batch], temperature=1.3)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    ref = torch.log_softmax(logits[:, :-1] / 1.3, dim=-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.attention_mask[:, 1:].bool()
    assert logp.shape == batch.input_ids.shape and logp.dtype == torch.float32
    assert torch.all(logp[:, 0] == 0) and torch.all(logp[:, 1:][~mask] == 0)
    torch.testing.assert_close(logp[:, 1:][mask], ref[mask], rtol=1e-5, atol=1e-5)


def test_save_then_load_continues_bit_identically(assets: tuple[Path, TokenBatch], tmp_path: Path) -> None:
    model, batch = assets
    units = num_target_tokens(batch)
    first = make_trainer(model, fp8=True)
    for _ in range(2):
        first.train_step(micro_batches(batch, 4), SftLossFn(), units)
    first.save(tmp_path / "ck")
    expected = first.train_step(micro_batches(batch, 4), SftLossFn(), units)

    second = make_trainer(model, fp8=True)
    second.load(tmp_path / "ck")
    assert second.step == 2
    got = second.train_step(micro_batches(batch, 4), SftLossFn(), units)
    assert (got.loss, got.grad_norm, got.lr) == (expected.loss, expected.grad_norm, expected.lr)
    assert all(torch.equal(v, params(second)[k]) for k, v in params(first).items())


def test_export_weights_are_hf_named_and_fp8_exact(assets: tuple[Path, TokenBatch]) -> None:
    model, _ = assets
    trainer = make_trainer(model, fp8=True)
    exported = dict(trainer.export_weights())
    hf_names = set(trainer.model.state_dict())
    for name in trainer.fp8_linears:
        module = trainer.model.get_submodule(name)
        w_fp8, scale_inv = module.export_fp8()
        assert exported[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(exported[f"{name}.weight"].view(torch.uint8), w_fp8.view(torch.uint8))
        assert torch.equal(exported[f"{name}.weight_scale_inv"], scale_inv)
    plain = {n for n in exported if not n.endswith("weight_scale_inv")}
    assert plain == hf_names - {"lm_head.weight"} and len(trainer.fp8_linears) == 2 * 7  # tied: not sent
    assert exported["model.embed_tokens.weight"].dtype == torch.float32


def test_export_for_a_bf16_engine_is_plain_and_loads(assets: tuple[Path, TokenBatch]) -> None:
    """precision=bf16: the trainer exports its plain tensors and a BF16 (non-FP8) engine takes them."""
    from infir2_rl.engines.native.engine import NativeEngine
    from infir2_rl.weight_sync.buckets import build_buckets

    model, _ = assets
    trainer = make_trainer(model, fp8=False)
    exported = dict(trainer.export_weights(fp8=False))
    assert set(exported) == set(trainer.model.state_dict()) - {"lm_head.weight"}  # tied: the embedding
    assert all(t.dtype == torch.float32 for t in exported.values())
    engine = NativeEngine(str(model), fp8=False, dtype="bfloat16", device="cpu")
    for bucket in build_buckets(exported.items(), 1 << 30, version=1):
        engine.update_weights(bucket)
    name = "model.layers.0.self_attn.q_proj.weight"
    held = engine.read_weights([name])[name]
    assert held.dtype == torch.bfloat16 and torch.equal(held, exported[name].to(torch.bfloat16))
    assert engine.health().weight_version == 1


def test_engines_get_dense_tensors_in_the_compute_dtype_and_land_the_same_bytes(
    assets: tuple[Path, TokenBatch],
) -> None:
    """A BF16 engine casts what it receives: sending BF16 instead of FP32 masters lands the same bytes; FP8
    bytes and FP32 scales are sent as they are; a tied lm_head is not sent (the engine's is its embedding)."""
    from infir2_rl.engines.native.engine import NativeEngine
    from infir2_rl.trainers.engine_export import for_engines
    from infir2_rl.weight_sync.buckets import build_buckets

    model, _ = assets
    as_held = list(make_trainer(model, fp8=True)._export_as_held(True))
    assert "lm_head.weight" in dict(as_held)
    sent = dict(for_engines(as_held, torch.bfloat16, tied_embeddings=True))
    assert "lm_head.weight" not in sent
    for name, held_tensor in as_held:
        if name == "lm_head.weight":
            continue
        if held_tensor.dtype == torch.float8_e4m3fn or name.endswith("weight_scale_inv"):
            assert sent[name].dtype == held_tensor.dtype, name
            assert torch.equal(sent[name].view(torch.uint8), held_tensor.view(torch.uint8)), name
        else:
            assert sent[name].dtype == torch.bfloat16, name
    engines = [NativeEngine(str(model), fp8=True, dtype="bfloat16", device="cpu") for _ in range(2)]
    for engine, push in zip(engines, (as_held, list(sent.items())), strict=True):
        for bucket in build_buckets(push, 1 << 30, version=1):
            engine.update_weights(bucket)
    names = [n for n, _ in as_held]
    a, b = engines[0].read_weights(names), engines[1].read_weights(names)
    assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in names)
    embed = engines[1].model.get_input_embeddings().weight
    assert embed.data_ptr() == engines[1].model.get_output_embeddings().weight.data_ptr()


def test_lr_schedules() -> None:
    cos = LrFactor(OptimizerConfig(lr=1.0, min_lr=0.1, warmup_ratio=0.2, schedule="cosine"), total_steps=10)
    factors = [cos(s) for s in range(10)]
    assert factors[:3] == [0.5, 1.0, 1.0]  # 2 warmup steps ramp linearly (never lr 0), cosine starts at peak
    assert all(a > b for a, b in zip(factors[2:], factors[3:]))  # then decays
    assert cos(10) == pytest.approx(0.1)  # reaches min_lr after the last step
    const = LrFactor(OptimizerConfig(lr=1.0, warmup_ratio=0.5, schedule="constant"), total_steps=4)
    assert [const(s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_micro_batches_cover_every_row_in_order_under_a_token_budget(assets: tuple[Path, TokenBatch]) -> None:
    _, batch = assets
    lengths = row_lengths(batch)
    budget = 2 * max(lengths)
    parts = micro_batches(batch, micro_batch_size=8, max_tokens_per_gpu=budget)
    assert len(parts) >= 4
    assert all(p.num_sequences * p.input_ids.shape[1] <= budget for p in parts)
    merged = merge_rows([p.input_ids * p.attention_mask for p in parts], batch.input_ids.shape[1])
    assert torch.equal(merged, batch.input_ids * batch.attention_mask)  # merge_rows pads with 0
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)]
    shards = shard_micro_batches(batch, world_size=2, micro_batch_size=3)
    assert [[p.num_sequences for p in s] for s in shards] == [[3, 1], [3, 1]]


def test_micro_batches_sent_to_ranks_carry_only_their_own_rows(assets: tuple[Path, TokenBatch]) -> None:
    # Micro-batches are views of the global batch, and a pickled view carries its whole buffer: Ray sent each
    # rank its micro-batch count times the global batch (96 MB for 2.6 MB of rows at 128 x 2,048 tokens).
    _, batch = assets
    parts = micro_batches(batch, micro_batch_size=2)
    assert any(p.input_ids.untyped_storage().nbytes() > p.input_ids.nbytes for p in parts)  # views
    for part in parts:
        own = compact(part)
        for name, value in own.tensors().items():
            original = part.tensors()[name]
            if value is None:
                assert original is None
                continue
            assert value.untyped_storage().nbytes() == value.nbytes, name
            assert torch.equal(value, original), name
        assert own.counts is part.counts


def test_sorted_shards_deal_rows_by_length_and_results_come_back_in_batch_order(
    assets: tuple[Path, TokenBatch],
) -> None:
    """trainer.sort_by_length: rows ordered by length, longest first, dealt to the ranks in turn; each rank's
    micro-batches hold rows of like length, and unshuffle_rows puts per-row results back in batch order."""
    _, batch = assets
    lengths = row_lengths(batch)
    assert shard_rows(lengths, 2) == [list(range(*b)) for b in shard_bounds(len(lengths), 2)]
    rows = shard_rows(lengths, 2, sort_by_length=True)
    flat = [i for index in rows for i in index]
    assert sorted(flat) == list(range(len(lengths))) and flat != list(range(len(lengths)))
    by_length = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    assert rows[0] == by_length[0::2] and rows[1] == by_length[1::2]
    for index in rows:
        assert [lengths[i] for i in index] == sorted((lengths[i] for i in index), reverse=True)
    assert shard_rows([5, 9, 9, 1], 1, sort_by_length=True) == [[1, 2, 0, 3]]  # ties keep batch order
    # The setting applies with a token budget only (a fixed micro_batch_size keeps batch order).
    assert TrainerConfig(max_tokens_per_gpu=100).sorts_rows and not TrainerConfig().sorts_rows
    assert not TrainerConfig(max_tokens_per_gpu=100, sort_by_length=False).sorts_rows
    # take_rows: the rows in the given order, cut to their longest, the host's counts taken with them.
    counted = batch.to("cpu")
    assert counted.counts is not None
    picked = take_rows(counted, rows[1])
    assert picked.input_ids.shape == (len(rows[1]), max(lengths[i] for i in rows[1]))
    for k, i in enumerate(rows[1]):
        assert torch.equal(picked.input_ids[k], batch.input_ids[i, : picked.input_ids.shape[1]])
        assert torch.equal(picked.loss_mask[k], batch.loss_mask[i, : picked.input_ids.shape[1]])
    assert picked.counts is not None and picked.counts.lengths == tuple(lengths[i] for i in rows[1])
    assert picked.counts.targets == tuple(counted.counts.targets[i] for i in rows[1])
    # Micro-batches of the sorted shards: per-row results merged in rank order, then unshuffled.
    budget = 2 * max(lengths)
    shards = shard_micro_batches(batch, 2, 8, budget, rows=rows)
    parts = [p.input_ids * p.attention_mask for shard in shards for p in shard]
    merged = merge_rows(parts, batch.input_ids.shape[1])
    assert not torch.equal(merged, batch.input_ids * batch.attention_mask)
    assert torch.equal(unshuffle_rows(merged, flat), batch.input_ids * batch.attention_mask)


def test_export_after_a_fused_optimizer_step_sends_the_updated_fp8_weights(
    assets: tuple[Path, TokenBatch],
) -> None:
    """torch's fused AdamW (the CUDA default) does not bump the weights' version counters, so the FP8 weight
    cache keyed on them went stale: the push after a step sent the pre-update bytes (found on an H100 by
    bench/true_on_policy.py). The fused optimizer runs on CPU too, which makes this a CPU test."""
    from infir2_rl.fp8.quant import quantize_weight_blockwise

    model, batch = assets
    trainer = make_trainer(model, fp8=True, lr=1e-3)
    trainer.optimizer = torch.optim.AdamW(trainer.params, lr=1e-3, fused=True)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    trainer.train_step([batch], SftLossFn(), num_target_tokens(batch))
    exported = dict(trainer.export_weights())
    for name in trainer.fp8_linears[:3]:
        w = trainer.model.get_submodule(name).weight
        w_fp8, scale_inv = quantize_weight_blockwise(w.detach())
        assert torch.equal(exported[f"{name}.weight"].view(torch.uint8), w_fp8.view(torch.uint8)), name
        assert torch.equal(exported[f"{name}.weight_scale_inv"], scale_inv), name
