"""Length buckets for trainer.cuda_graphs: few shapes, bounded padding, and padded micro-batches that score and
lose exactly what the unpadded ones do at every real token (CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, to_token_batch
from infir2_rl.trainers.microbatch import bucket_length, pad_length
from infir2_rl.trainers.torch.trainer import TorchTrainer


def test_buckets_are_few_and_pad_at_most_an_eighth() -> None:
    assert [bucket_length(n) for n in (1, 64, 65, 80, 81, 128, 129, 257, 276, 8192, 8193, 8392)] == [
        64, 64, 72, 80, 88, 128, 144, 288, 288, 8192, 9216, 9216,
    ]  # fmt: skip
    lengths = range(1, 20_000)
    buckets = {bucket_length(n) for n in lengths}
    assert len(buckets) <= 8 * 9  # eight per doubling from 64 up
    assert all(n <= bucket_length(n) <= max(64, 1.125 * n) for n in lengths)
    assert all(bucket_length(b) == b for b in buckets)  # a bucket is its own bucket


def test_a_padded_micro_batch_scores_and_loses_as_the_unpadded_one(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model", preset="tiny")
    paths = make_data(tmp_path / "data", num_sft=8, num_rl=4, num_test=4)
    # CPU float32 even on a GPU machine (the tolerances are float32's).
    trainer = TorchTrainer(
        ModelConfig(path=str(model)),
        TrainerConfig(),
        OptimizerConfig(),
        fp8=False,
        total_steps=1,
        device="cpu",
    )
    examples, _ = load_sft_examples(paths.sft_train, trainer.tokenizer)
    batch = to_token_batch(examples[:8], trainer.tokenizer.pad_token_id).to(trainer.device)
    length = batch.input_ids.shape[1]
    padded = pad_length(batch, bucket_length(length) + 7)
    assert padded.input_ids.shape[1] == bucket_length(length) + 7
    assert torch.equal(padded.attention_mask[:, :length], batch.attention_mask)
    assert not padded.attention_mask[:, length:].any() and not padded.loss_mask[:, length:].any()
    loss_fn = SftLossFn()
    with torch.no_grad():
        a = trainer._loss_scores(batch, loss_fn)
        b = trainer._loss_scores(padded, loss_fn)
        real = batch.attention_mask.bool()
        torch.testing.assert_close(b.logprobs_BL[:, :length][real], a.logprobs_BL[real], rtol=1e-5, atol=1e-5)
        la, lb = loss_fn(a, batch), loss_fn(b, padded)
    assert la.num_units == lb.num_units
    assert float(lb.loss) == pytest.approx(float(la.loss), rel=1e-5)
    with pytest.raises(ValueError, match="tokens per row"):
        pad_length(padded, length)


@pytest.mark.parametrize("packed", [False, True])
def test_under_the_layer_graphs_micro_batches_run_largest_first(tmp_path: Path, packed: bool) -> None:
    """The first capture sizes the graphs' shared pool (layer_graphs.py); eager trainers keep the order."""
    from infir2_rl.types import TokenBatch

    model = init_model(tmp_path / "model", preset="tiny")
    # CPU even on a GPU machine: no layer graphs until the test sets them.
    trainer = TorchTrainer(
        ModelConfig(path=str(model)), TrainerConfig(pack_sequences=packed), OptimizerConfig(), fp8=False,
        total_steps=1, device="cpu",
    )  # fmt: skip

    def batch(rows: int, length: int, real: int) -> TokenBatch:
        mask = torch.zeros(rows, length, dtype=torch.long)
        mask[:, :real] = 1
        return TokenBatch(input_ids=mask.clone(), attention_mask=mask, loss_mask=mask.float())

    # Padded: rows x bucket(length) = 8 x 104, 1 x 576, 2 x 320; packed: bucket(real tokens) of 40, 570, 400.
    items: list[TokenBatch | None] = [batch(8, 100, 5), batch(1, 570, 570), batch(2, 300, 200)]
    assert trainer._graph_order(items) == [0, 1, 2]  # no layer graphs: as given
    trainer.layer_graphs = object()  # type: ignore[assignment]  # only its presence matters to the order
    assert trainer._graph_order(items) == ([1, 2, 0] if packed else [0, 2, 1])
