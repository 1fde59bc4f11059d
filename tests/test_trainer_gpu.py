"""TorchTrainer on one CUDA GPU: BF16 autocast over FP32 masters with FP8 decoder linears (fast path on
Hopper), resume, export, greedy generation. Run on the GPU machine; skipped on CPU."""

from __future__ import annotations

import math
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

pytestmark = pytest.mark.gpu


def test_bf16_fp8_training_on_a_gpu(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model", preset="tiny")
    paths = make_data(tmp_path / "data", num_sft=64, num_rl=4, num_test=4)

    def make() -> TorchTrainer:
        return TorchTrainer(
            ModelConfig(path=str(model)), TrainerConfig(), OptimizerConfig(), fp8=True, total_steps=8
        )

    trainer = make()
    assert trainer.device.type == "cuda" and trainer.compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in trainer.params)  # FP32 masters
    examples, _ = load_sft_examples(paths.sft_train, trainer.tokenizer)
    batches = [to_token_batch(examples[i : i + 16], trainer.tokenizer.pad_token_id) for i in range(0, 64, 16)]
    losses = [
        trainer.train_step(micro_batches(b, 8), SftLossFn(), num_target_tokens(b)).loss for b in batches[:3]
    ]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())

    trainer.save(tmp_path / "ck")
    expected = trainer.train_step(micro_batches(batches[3], 8), SftLossFn(), num_target_tokens(batches[3]))
    resumed = make()
    resumed.load(tmp_path / "ck")
    got = resumed.train_step(micro_batches(batches[3], 8), SftLossFn(), num_target_tokens(batches[3]))
    assert got.loss == pytest.approx(expected.loss, rel=1e-3) and got.lr == expected.lr

    # The quantization a forward ran with (recorded in the forward: under FSDP2 the module holds its shard
    # between forwards); the export must send exactly those bytes. One GPU, "auto": no FSDP.
    assert not resumed.fsdp
    name = resumed.fp8_linears[0]
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    module = resumed.model.get_submodule(name)
    hook = module.register_forward_hook(lambda m, args, out: seen.update(fp8=m.export_fp8()))
    (logp,) = resumed.forward_logprobs([batches[0]], temperature=1.0)
    hook.remove()
    assert logp.shape == batches[0].input_ids.shape and torch.isfinite(logp).all()
    exported = dict(resumed.export_weights())
    w_fp8, scale_inv = seen["fp8"]
    assert torch.equal(exported[f"{name}.weight"].view(torch.uint8), w_fp8.view(torch.uint8))
    assert torch.equal(exported[f"{name}.weight_scale_inv"], scale_inv)
    completions = resumed.generate_greedy([examples[0].input_ids[:12]] * 3, max_new_tokens=8)
    assert len(completions) == 3 and all(0 < len(c) <= 8 for c in completions)
