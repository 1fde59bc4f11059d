"""The megatron backend (local spec) on one CUDA GPU against the torch backend on the same weights: BF16
autocast over FP32 masters, FP8 linears on the Hopper fast path (cuBLASLt blockwise GEMMs). Skipped on CPU."""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig  # noqa: E402
from infir2_rl.data.datasets import load_sft_examples  # noqa: E402
from infir2_rl.data.synthetic import make_data  # noqa: E402
from infir2_rl.models.factory import init_model  # noqa: E402
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch  # noqa: E402
from infir2_rl.trainers.megatron.layers import ParallelLinear  # noqa: E402
from infir2_rl.trainers.megatron.trainer import MegatronTrainer  # noqa: E402
from infir2_rl.trainers.microbatch import bucket_length, micro_batches, pad_length  # noqa: E402
from infir2_rl.trainers.torch.trainer import TorchTrainer  # noqa: E402
from infir2_rl.types import TokenBatch  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("own_process_group")]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[TokenBatch]]:
    root = tmp_path_factory.mktemp("megatron_gpu")
    # 128-aligned projections (2 heads of 128, MLP 512): one FP8 GEMM per fused linear, on the fast path.
    model = init_model(
        root / "model",
        preset="tiny",
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=512,
    )
    paths = make_data(root / "data", num_sft=320, num_rl=4, num_test=4)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    examples, _ = load_sft_examples(paths.sft_train, tok)
    return model, [to_token_batch(examples[i : i + 16], tok.pad_token_id) for i in range(0, 320, 16)]


def make(backend: str, model: Path, fp8: bool, cuda_graphs: bool | str = "auto") -> Any:
    args = (
        ModelConfig(path=str(model)),
        TrainerConfig(cuda_graphs=cuda_graphs),  # type: ignore[arg-type]
        OptimizerConfig(warmup_ratio=0.0, lr=2e-3),
    )
    if backend == "megatron":
        return MegatronTrainer(*args, total_steps=20, fp8=fp8)
    return TorchTrainer(*args, total_steps=20, fp8=fp8)


@pytest.mark.parametrize("fp8", [False, True])
def test_logprobs_equal_the_torch_backend_in_bf16(assets: tuple, fp8: bool) -> None:
    model, batches = assets
    torch_tr, mega = make("torch", model, fp8), make("megatron", model, fp8)
    assert mega.device.type == "cuda" and mega.compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in mega.params)
    if fp8:
        linear = next(m for m in mega.model.modules() if isinstance(m, ParallelLinear) and m.role == "qkv")
        # q|k|v as one GEMM on the weight as it is (head_dim 128: megatron's order permutes whole blocks)
        assert linear.role == "qkv" and linear.direct and not linear.identity_order
        assert all(p.w_fp8_t is None for p in linear.fp8_parts())  # no W^T kept: backward makes it
    ref, got = torch_tr.forward_logprobs(batches[:2]), mega.forward_logprobs(batches[:2])
    for a, b in zip(ref, got, strict=True):
        diff = (a - b).abs()
        # BF16 compute: the two backends differ in attention kernels and GEMM order, not in the weights; FP8
        # re-rounds those differences to e4m3 steps (one H100 run measured mean 0.0075 with FP8, under 5e-3 without).
        assert diff.max() < 0.1 and diff.mean() < (1.5e-2 if fp8 else 5e-3), (diff.max(), diff.mean())
    if fp8:
        ref_export, got_export = dict(torch_tr.export_weights()), dict(mega.export_weights())
        assert set(got_export) == set(ref_export)
        for name, value in ref_export.items():
            if value.dtype == torch.float8_e4m3fn or name.endswith("weight_scale_inv"):
                assert torch.equal(got_export[name].float(), value.float()), name


def test_twenty_sft_steps_track_the_torch_backend_and_resume_exactly(assets: tuple, tmp_path: Path) -> None:
    model, batches = assets
    losses = {}
    for backend in ("torch", "megatron"):
        trainer = make(backend, model, fp8=True)
        losses[backend] = [
            trainer.train_step(micro_batches(b, 8), SftLossFn(), num_target_tokens(b)).loss for b in batches
        ]
    assert all(math.isfinite(x) for x in losses["megatron"])
    assert losses["megatron"][-1] < losses["megatron"][0] - 0.5
    assert losses["megatron"] == pytest.approx(losses["torch"], rel=3e-2)
    trainer = make("megatron", model, fp8=True)
    for b in batches[:2]:
        trainer.train_step([b], SftLossFn(), num_target_tokens(b))
    trainer.save(tmp_path / "ck")
    expected = trainer.train_step([batches[2]], SftLossFn(), num_target_tokens(batches[2]))
    resumed = make("megatron", model, fp8=True)
    resumed.load(tmp_path / "ck")
    got = resumed.train_step([batches[2]], SftLossFn(), num_target_tokens(batches[2]))
    assert got.loss == pytest.approx(expected.loss, rel=1e-4) and got.lr == expected.lr


def test_make_room_returns_the_cached_blocks_then_drops_the_graphs(assets: tuple) -> None:
    """Before a colocated rollout the megatron backend returns its allocator's cached blocks where the GPU's free
    memory is below what the engine wants, then drops its layer graphs (True), and keeps both where it is not;
    eager (cuda_graphs=false) it has no graphs and says False. Training goes on after, capturing again."""
    model, batches = assets
    gc.collect()  # earlier tests' trainers (graphed ones hold pools no empty_cache returns while they live)
    torch.cuda.empty_cache()
    for graphs in (False, True):
        trainer = make("megatron", model, fp8=True, cuda_graphs=graphs)
        trainer.train_step(micro_batches(batches[0], 8), SftLossFn(), num_target_tokens(batches[0]))
        assert (trainer.layer_graphs is not None) == graphs
        scratch = torch.empty(
            256 << 20, dtype=torch.uint8, device=trainer.device
        )  # 256 MiB cached once freed
        del scratch
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        assert cached >= 256 << 20
        assert trainer.make_room(0) is False  # room enough: the cache (and the graphs) stay
        assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() == cached
        if graphs:
            assert trainer.layer_graphs is not None and trainer.layer_graphs.num_shapes == 1
        assert trainer.make_room(2**62) is graphs  # more than any GPU has: the cache goes, then the graphs
        assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() <= cached - (256 << 20)
        stats = trainer.train_step(micro_batches(batches[1], 8), SftLossFn(), num_target_tokens(batches[1]))
        assert math.isfinite(stats.loss)
        if graphs:
            assert trainer.layer_graphs is not None and trainer.layer_graphs.num_shapes == 1
        del trainer, stats
        gc.collect()  # (patched layers and their graphs reference each other: a cycle)
        torch.cuda.empty_cache()


@pytest.mark.parametrize("fp8", [False, True])
def test_graphed_layers_train_and_score_as_the_eager_layers(assets: tuple, fp8: bool) -> None:
    """trainer.cuda_graphs on the megatron backend (trainers/megatron/graphs.py): megatron's TransformerLayers
    replayed from CUDA graphs train and score as the eager ones, over micro-batches of two shapes and four
    optimizer steps, scoring with FP8 on and off between them; both shapes run from graphs in every step."""
    from test_layer_graphs_gpu import assert_graphed_trains_as_eager

    model, batches = assets
    eager = make("megatron", model, fp8=fp8, cuda_graphs=False)
    graphed = make("megatron", model, fp8=fp8, cuda_graphs=True)
    assert eager.layer_graphs is None and graphed.layer_graphs is not None
    # Two shapes, padded to their buckets here so the eager trainer sees what the graphed one pads them to
    # (FP8's wgrad tiles run along the flattened tokens: another padding quantizes other tiles).
    mbs = [micro_batches(batches[0], 8)[0], micro_batches(batches[1], 4)[0]]  # 8 and 4 rows
    mbs = [pad_length(b, bucket_length(b.input_ids.shape[1])) for b in mbs]
    assert len({tuple(b.input_ids.shape) for b in mbs}) == 2
    assert_graphed_trains_as_eager(eager, graphed, mbs, fp8)


def test_non_finite_gradient_skips_the_fused_update_and_the_schedule(assets: tuple) -> None:
    """On CUDA AdamW is fused and the skip is decided on the device (``optim.step_unless_nonfinite``): a NaN
    loss leaves weights and the schedule untouched, and the next finite step trains."""
    from test_trainer_backend import NanLoss

    model, batches = assets
    trainer = make("megatron", model, fp8=True)
    assert isinstance(trainer, MegatronTrainer) and trainer.optimizer.defaults.get("fused")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    stats = trainer.train_step(micro_batches(batches[0], 8), NanLoss(), total_units=1)
    assert stats.skipped and math.isnan(stats.grad_norm) and trainer.num_skipped == 1
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert trainer.scheduler.last_epoch == 0
    stats = trainer.train_step(micro_batches(batches[1], 8), SftLossFn(), num_target_tokens(batches[1]))
    assert not stats.skipped and math.isfinite(stats.loss) and trainer.scheduler.last_epoch == 1
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("fp8", [False, True])
def test_recomputed_layers_compute_what_the_forward_computed(
    assets: tuple, fp8: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model.gradient_checkpointing (megatron's full recompute, which reruns each layer inside backward): the
    rerun is under the trainer's autocast as the forward was (attention in BF16, where it ran in FP32 on SDPA's
    math kernel before: megatron's CheckpointFunction does not restore autocast), and two steps train as
    without recompute: the same losses, gradient norms and weights up to the backward's own nondeterminism."""
    from infir2_rl.trainers.megatron.layers import SdpaAttention

    model, batches = assets
    seen: list[tuple[bool, torch.dtype]] = []  # (grad enabled: the recompute, query dtype) per attention call
    attend = SdpaAttention.forward

    def spy(self: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((torch.is_grad_enabled(), query.dtype))
        return attend(self, query, *args, **kwargs)

    monkeypatch.setattr(SdpaAttention, "forward", spy)
    runs = []
    for checkpointing in (False, True):
        trainer = MegatronTrainer(
            ModelConfig(path=str(model), gradient_checkpointing=checkpointing),
            TrainerConfig(cuda_graphs=False),
            OptimizerConfig(warmup_ratio=0.0, lr=2e-3),
            total_steps=20,
            fp8=fp8,
        )
        seen.clear()
        stats = [
            trainer.train_step(micro_batches(b, 8), SftLossFn(), num_target_tokens(b)) for b in batches[:2]
        ]
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        runs.append((stats, weights, list(seen)))
        del trainer
        gc.collect()
    (plain, plain_w, _), (ckpt, ckpt_w, ckpt_seen) = runs
    recomputed = [dtype for grad, dtype in ckpt_seen if grad]
    assert recomputed and all(d == torch.bfloat16 for d in recomputed), set(recomputed)
    assert plain[0].loss == ckpt[0].loss  # the same forward before any update
    for a, b in zip(plain, ckpt, strict=True):
        assert math.isclose(a.loss, b.loss, rel_tol=1e-3) and math.isclose(
            a.grad_norm, b.grad_norm, rel_tol=2e-2
        )
    for (
        name,
        w,
    ) in plain_w.items():  # (Adam's first steps move a weight by ~lr whatever its gradient's size, so
        # a gradient near 0 whose sign the backward's atomics flip moves it the other way: means, not maxima)
        assert (ckpt_w[name] - w).abs().mean() < 1e-4, name
