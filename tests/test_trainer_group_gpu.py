"""TrainerGroup on two GPUs: two FSDP2 ranks over NCCL, with packed micro-batches (``trainer.pack_sequences:
auto`` packs unsorted rows on a GPU) and the BF16 gather of the GPU default, train like one worker on one GPU, in BF16 and
in FP8. The same comparison runs on CPU over gloo in ``test_trainer_group.py``. Needs two GPUs."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from infir2_rl.actors.trainer_group import placed_trainer_group
from infir2_rl.config import SftStageConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch
from infir2_rl.types import TokenBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.fixture(scope="module")
def ray_two_gpus() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[TokenBatch]]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("group_gpu")
    # 128-aligned projections, so the FP8 linears take the cuBLASLt fast path.
    model = init_model(
        root / "model", preset="tiny", hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=512, num_hidden_layers=2,
    )  # fmt: skip
    paths = make_data(root / "data", num_sft=48, num_rl=4, num_test=4)
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples, _ = load_sft_examples(paths.sft_train, tokenizer)
    return model, [to_token_batch(examples[i : i + 16], tokenizer.pad_token_id) for i in (0, 16, 32)]


@pytest.mark.usefixtures("ray_two_gpus")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_two_fsdp_ranks_with_packed_rows_train_like_one_gpu(
    assets: tuple[Path, list[TokenBatch]], precision: str
) -> None:
    model, batches = assets
    results = {}
    for num_workers, fsdp, budget in ((1, None, None), (2, True, 300)):
        # budget: token-budget micro-batches, so the two ranks run unequal numbers of forwards.
        cfg = SftStageConfig(
            model={"path": str(model)},
            precision=precision,
            trainer={
                "num_workers": num_workers,
                "global_batch_size": 16,
                "micro_batch_size": 4,
                "max_tokens_per_gpu": budget,
                "sort_by_length": False,  # sorted rows would make auto pad (trainer.sort_by_length)
            },
        )
        with placed_trainer_group(cfg, total_steps=5, fsdp=fsdp) as group:
            assert group.pack_sequences is True  # auto packs on a GPU (unsorted rows)
            stats = [group.train_step(b, SftLossFn(), num_target_tokens(b)) for b in batches]
            logp = group.forward_logprobs(batches[0])
            results[num_workers] = ([s.loss for s in stats], [s.grad_norm for s in stats], logp)
    (losses_1, norms_1, logp_1), (losses_2, norms_2, logp_2) = results[1], results[2]
    assert losses_1[-1] < losses_1[0]
    # BF16 gathers and BF16 compute: the same steps within BF16 rounding (CPU over gloo, FP32 gather: 1e-5).
    assert losses_2 == pytest.approx(losses_1, rel=5e-3), (losses_1, losses_2)
    assert norms_2 == pytest.approx(norms_1, rel=3e-2), (norms_1, norms_2)
    torch.testing.assert_close(logp_2.float(), logp_1.float(), rtol=0, atol=5e-2)
