"""On one CUDA GPU: ``trainer.cuda_graphs`` (decoder layers replayed from CUDA graphs) trains and scores as
the eager trainer does, in BF16 and FP8, over micro-batches of two shapes and several optimizer steps, padded
or packed (varlen offsets copied into the graphs' buffer for rows of other compositions), and refuses to write gradients into replaced ``.grad`` tensors or to back-propagate through an overwritten
forward. "auto" turns the graphs on for both precisions on one GPU.
Skipped on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch
from infir2_rl.trainers.layer_graphs import GradsReplaced
from infir2_rl.trainers.microbatch import bucket_length, pad_length
from infir2_rl.trainers.torch.trainer import TorchTrainer
from infir2_rl.trainers.torch.varlen_attention import graph_max_len
from infir2_rl.types import TokenBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _trainer(model: Path, fp8: bool, graphs: bool, budget: int | None = None) -> TorchTrainer:
    return TorchTrainer(
        ModelConfig(path=str(model)),
        TrainerConfig(cuda_graphs=graphs, pack_sequences=budget is not None, max_tokens_per_gpu=budget),
        OptimizerConfig(lr=1e-3, warmup_ratio=0.0, schedule="constant"),
        fp8=fp8,
        total_steps=8,
        seed=0,
    )


def _two_shapes(tmp_path: Path, trainer: TorchTrainer) -> list[TokenBatch]:
    """Two micro-batches that stay two shapes after the trainer pads their lengths to a bucket (8 and 4 rows)."""
    paths = make_data(tmp_path / "data", num_sft=16, num_rl=4, num_test=4)
    examples, _ = load_sft_examples(paths.sft_train, trainer.tokenizer)
    batches = [to_token_batch(examples[:8], trainer.tokenizer.pad_token_id),
               to_token_batch(examples[8:12], trainer.tokenizer.pad_token_id)]  # fmt: skip
    # Padded to their buckets here, so the eager trainer sees the micro-batches the graphed one pads them to:
    # FP8's wgrad tiles run along the flattened tokens, so another padding would quantize other tiles.
    return [pad_length(b, bucket_length(b.input_ids.shape[1])) for b in batches]


@pytest.mark.parametrize("fp8", [False, True])
def test_graphed_layers_train_as_the_eager_layers(tmp_path: Path, fp8: bool) -> None:
    model = init_model(tmp_path / "model", preset="tiny")
    eager, graphed = _trainer(model, fp8, graphs=False), _trainer(model, fp8, graphs=True)
    assert eager.layer_graphs is None and graphed.layer_graphs is not None
    batches = _two_shapes(tmp_path, eager)
    assert_graphed_trains_as_eager(eager, graphed, batches, fp8)


def assert_graphed_trains_as_eager(eager: Any, graphed: Any, batches: list[TokenBatch], fp8: bool) -> None:
    """Four optimizer steps over ``batches`` (two shapes, padded to their buckets) by a trainer without and one
    with layer graphs (either backend), scoring with FP8 on and off between them: the same log-probs, losses and
    weights, and every shape of each kind replayed from graphs in every step."""
    units = sum(num_target_tokens(b) for b in batches)
    losses: dict[str, list[float]] = {"eager": [], "graphs": []}
    for step in range(4):
        # Scoring without gradients (old log-probs; with fp8=False the dense-trainer mismatch scoring) between
        # the steps, from forward-only graphs: before any update the weights are the same, so bit for bit.
        for fp8_scoring in (True, False):
            ref = eager.forward_logprobs(batches, fp8=fp8_scoring)
            got = graphed.forward_logprobs(batches, fp8=fp8_scoring)
            for a, b in zip(ref, got, strict=True):
                assert a.shape == b.shape
                if step == 0:
                    assert torch.equal(a, b)
                else:
                    assert float((a - b).abs().max()) < 1e-3
        for name, trainer in (("eager", eager), ("graphs", graphed)):
            stats = trainer.train_step(batches, SftLossFn(), units)
            assert not stats.skipped
            losses[name].append(stats.loss)
    graphs = graphed.layer_graphs
    # Both shapes ran from graphs: training (2 shapes) and scoring (2 shapes x FP8 on/off; BF16: on = off)...
    assert graphs.num_shapes == graphs.captures == 2 + (4 if fp8 else 2)
    assert graphs.replays == 4 * 2 + 4 * 2 * 2  # ...in every step
    # Every forward-only shape read and wrote one shared buffer set (the largest scored first), as every
    # training shape did another: equal log-probs above mean no shape's replay spoiled another's.
    assert [len(graphs._boundary_sets[kind]) for kind in (False, True)] == [1, 1]
    # The updates change the loss far more than graphs and eager differ: stale weights in a replay (an FP8
    # quantization cached at capture time, say) would show.
    assert abs(losses["eager"][-1] - losses["eager"][0]) > 1e-2
    for a, b in zip(losses["eager"], losses["graphs"], strict=True):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5)
    for (name, p), q in zip(eager.model.named_parameters(), graphed.model.parameters(), strict=True):
        err = float((p - q).detach().norm() / p.detach().norm().clamp_min(1e-12))
        assert err < 1e-4, name


def _packed_rows(vocab: int) -> list[TokenBatch]:
    """Packed micro-batches of other compositions in three lengths: rows of 256 and 192 tokens (no pads: each
    is its own length bucket) and two of 115 and 113 tokens, padded to 120; in no size order."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for lengths in ([100, 90, 66], [40, 120, 96], [50, 70, 72], [150, 42], [30, 55, 30], [40, 73]):
        longest = max(lengths)
        mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).long()
        loss_mask = mask.float()
        loss_mask[:, :8] = 0
        ids = torch.randint(1, vocab, (len(lengths), longest), generator=gen) * mask
        rows.append(TokenBatch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask))
    assert [bucket_length(int(b.attention_mask.sum())) for b in rows] == [256, 256, 192, 192, 120, 120]
    return rows


@pytest.mark.parametrize("fp8", [False, True])
def test_packed_micro_batches_replay_as_the_eager_packed_ones(tmp_path: Path, fp8: bool) -> None:
    budget = 256
    model = init_model(tmp_path / "model", preset="tiny")
    plain = _trainer(model, fp8, False, budget)  # eager, each row at its own length and sequence count
    eager, graphed = _trainer(model, fp8, False, budget), _trainer(model, fp8, True, budget)
    assert graphed.layer_graphs is not None and graphed.packed_length is not None
    # The eager trainer pads its packed rows as the graphed one does: the same launches, so the same bits
    # where the kernels are deterministic (flash attention's backward adds dQ with atomics: gradients differ
    # in the last bits, and training steps drift apart slowly).
    eager.packed_length = graphed.packed_length
    batches = _packed_rows(len(eager.tokenizer))
    units = sum(num_target_tokens(b) for b in batches)
    losses: dict[str, list[float]] = {"plain": [], "eager": [], "graphs": []}
    for step in range(3):
        ref, got = eager.forward_logprobs(batches), graphed.forward_logprobs(batches)
        for a, b in zip(ref, got, strict=True):
            assert a.shape == b.shape
            if step == 0:
                assert torch.equal(a, b)  # every row replays its shape's graph with its own offsets
            else:
                assert float((a - b).abs().max()) < 2e-2
        if step == 0:  # against plain packing: other launches (pads, flash's split choice), close values
            for a, b in zip(plain.forward_logprobs(batches), got, strict=True):
                assert float((a - b).abs().mean()) < (5e-3 if fp8 else 1e-3)
        for name, trainer in (("plain", plain), ("eager", eager), ("graphs", graphed)):
            stats = trainer.train_step(batches, SftLossFn(), units)
            assert not stats.skipped
            losses[name].append(stats.loss)
    graphs = graphed.layer_graphs
    # Four launch shapes for training and four for scoring: three row lengths (256, 192, 120), and the rows of
    # 192 under two flash length bounds (varlen_attention.graph_max_len: 128 for [50, 70, 72], the row's
    # 192 for [150, 42]); six rows per pass, all replayed.
    assert [
        graph_max_len(max(ls), n) for ls, n in (([100, 90, 66], 256), ([50, 70, 72], 192), ([150, 42], 192))
    ] == [128, 128, 192]
    assert graphs.captures == graphs.num_shapes == 8
    assert graphs.replays == 3 * 6 * 2
    assert abs(losses["eager"][-1] - losses["eager"][0]) > 1e-2
    for name in ("plain", "graphs"):
        for a, b in zip(losses["eager"], losses[name], strict=True):
            assert b == pytest.approx(a, rel=2e-3), name
    for (name, p), q in zip(eager.model.named_parameters(), graphed.model.parameters(), strict=True):
        err = float((p - q).detach().norm() / p.detach().norm().clamp_min(1e-12))
        assert err < 2e-3, name


def test_replaced_grads_and_a_second_forward_are_refused(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model", preset="tiny")
    trainer = _trainer(model, fp8=True, graphs=True)
    batches = _two_shapes(tmp_path, trainer)
    units = sum(num_target_tokens(b) for b in batches)
    trainer.train_step(batches[:1], SftLossFn(), units)
    assert trainer.layer_graphs is not None and trainer.layer_graphs.captures == 1
    batch = batches[0].to(trainer.device)
    loss_fn = SftLossFn()
    # Two training forwards, then the first one's backward: its activations were overwritten.
    first = loss_fn(trainer._loss_scores(batch, loss_fn), batch).loss
    loss_fn(trainer._loss_scores(batch, loss_fn), batch)
    with pytest.raises(RuntimeError, match="between this micro-batch's forward and its backward"):
        first.backward()
    # A scoring forward (its own forward-only graphs) between a training forward and its backward, too.
    first = loss_fn(trainer._loss_scores(batch, loss_fn), batch).loss
    trainer.forward_logprobs([batches[0]])
    assert trainer.layer_graphs.captures == 2
    with pytest.raises(RuntimeError, match="between this micro-batch's forward and its backward"):
        first.backward()
    # What the trainer must not do with graphs: let the gradient tensors the graphs add into be replaced.
    if trainer.master_weights is not None:  # a BF16 model: its FP32 masters' gradient buffer
        trainer.master_weights.release_grads()
    else:
        trainer.optimizer.zero_grad(set_to_none=True)
    with pytest.raises(GradsReplaced):
        trainer.train_step(batches[:1], SftLossFn(), units)


@pytest.mark.parametrize("fp8", [False, True])
def test_graphs_dropped_to_make_room_free_their_memory_and_train_on(tmp_path: Path, fp8: bool) -> None:
    """``make_room`` (before a colocated rollout) keeps the graphs while the free memory suffices; else it drops
    them, their pool returns to the driver, and the next step captures its shapes again and trains as a twin
    that kept its graphs."""
    model = init_model(tmp_path / "model", preset="tiny")
    kept, dropping = _trainer(model, fp8, graphs=True), _trainer(model, fp8, graphs=True)
    batches = _two_shapes(tmp_path, kept)
    units = sum(num_target_tokens(b) for b in batches)
    for trainer in (kept, dropping):
        trainer.train_step(batches, SftLossFn(), units)
    graphs = dropping.layer_graphs
    assert graphs is not None and graphs.num_shapes == 2
    assert not dropping.make_room(0) and graphs.num_shapes == 2  # enough free memory: nothing dropped
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    assert dropping.make_room(2**62)  # more than any GPU has
    assert graphs.num_shapes == 0 and torch.cuda.memory_reserved() < before
    for _ in range(2):
        a = kept.train_step(batches, SftLossFn(), units)
        b = dropping.train_step(batches, SftLossFn(), units)
        assert not b.skipped and b.loss == pytest.approx(a.loss, rel=1e-4, abs=1e-5)
    assert graphs.num_shapes == 2 and graphs.captures == 4  # each shape captured again, once
    for (name, p), q in zip(kept.model.named_parameters(), dropping.model.parameters(), strict=True):
        err = float((p - q).detach().norm() / p.detach().norm().clamp_min(1e-12))
        assert err < 1e-4, name


def test_auto_turns_the_graphs_on_for_both_precisions_on_one_gpu(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model", preset="tiny")

    def auto(fp8: bool) -> TorchTrainer:
        return TorchTrainer(
            ModelConfig(path=str(model)), TrainerConfig(), OptimizerConfig(), fp8=fp8, total_steps=1, seed=0
        )

    assert TrainerConfig().cuda_graphs == "auto"
    for fp8 in (True, False):
        graphs = auto(fp8).layer_graphs
        assert graphs is not None and graphs.check_memory, f"fp8={fp8}"
