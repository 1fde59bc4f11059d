"""TrainerGroup on a real local Ray: 2 data-parallel actors (gradient all-reduce, and FSDP2 over gloo)
reproduce 1 actor on the same global batches; placement errors come before any actor starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from ray import cloudpickle

from infir2_rl.actors.trainer_group import TrainerGroup, placed_trainer_group
from infir2_rl.config import SftStageConfig
from infir2_rl.data.datasets import load_sft_examples
from infir2_rl.data.synthetic import make_data
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens, to_token_batch
from infir2_rl.trainers.microbatch import row_lengths, select_rows, shard_rows
from infir2_rl.types import LossOutput, TokenBatch, TokenScores


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[TokenBatch]]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("group")
    model = init_model(root / "model", preset="tiny", num_hidden_layers=2)
    paths = make_data(root / "data", num_sft=24, num_rl=4, num_test=4)
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples, _ = load_sft_examples(paths.sft_train, tokenizer)
    return model, [to_token_batch(examples[i : i + 8], tokenizer.pad_token_id) for i in (0, 8, 16)]


class LossWithMetric(SftLossFn):
    def __call__(self, scores: TokenScores, batch: TokenBatch) -> LossOutput:
        out = super().__call__(scores, batch)
        out.metrics["test/units"] = 1.0
        return out


# Ray workers cannot import this test module: ship its classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def stage_cfg(
    model: Path, num_workers: int, dtype: str = "auto", precision: str = "bf16", **trainer: object
) -> SftStageConfig:
    return SftStageConfig(
        model={"path": str(model), "dtype": dtype},
        precision=precision,
        trainer={
            "num_workers": num_workers,
            "global_batch_size": 8,
            "micro_batch_size": 2,
            **trainer,
        },
    )


def run(group: TrainerGroup, batches: list[TokenBatch]) -> tuple[list[float], list[float], torch.Tensor]:
    before = group.forward_logprobs(batches[0])
    stats = [
        group.train_step(b, SftLossFn(), num_target_tokens(b), keep_logprobs=i == 0)
        for i, b in enumerate(batches)
    ]
    # keep_logprobs: the first step's own log-probs of the trained tokens, back in batch order (sorted rows too)
    # and equal to a scoring pass's on the same weights; 0 off the loss mask.
    trained = batches[0].loss_mask > 0
    trained[:, 0] = False
    kept = stats[0].logprobs
    assert kept is not None and kept.shape == before.shape and stats[1].logprobs is None
    assert torch.equal(kept[trained], before[trained]) and not kept[~trained].any()
    return [s.loss for s in stats], [s.grad_norm for s in stats], group.forward_logprobs(batches[0])


@pytest.mark.usefixtures("ray_local")
def test_two_actors_train_like_one(assets: tuple[Path, list[TokenBatch]]) -> None:
    model, batches = assets
    results = {}
    runs = (
        (1, None, None, "auto", "auto"),
        (2, None, None, "auto", "auto"),
        (2, True, 150, "auto", "auto"),
        (2, True, 150, "auto", True),
        (2, True, None, "bfloat16", "auto"),
    )
    for num_workers, fsdp, budget, gather, pack in runs:
        # budget: token-budget micro-batches give the FSDP ranks unequal forward counts (dummy padding).
        # gather: trainer.fsdp_param_dtype ("auto" gathers the FP32 masters on CPU; bfloat16 is the GPU default).
        # pack: trainer.pack_sequences ("auto" pads on CPU; true packs, the GPU default for unsorted rows, here with
        # the mask). With the budget the rows are sorted by length (trainer.sort_by_length).
        cfg = stage_cfg(
            model, num_workers, max_tokens_per_gpu=budget, fsdp_param_dtype=gather, pack_sequences=pack
        )
        with placed_trainer_group(cfg, total_steps=5, fsdp=fsdp) as group:
            assert group.pack_sequences is (pack is True)
            if budget is not None:  # trainer.sort_by_length: these ranks get rows by length, not in order
                lengths = row_lengths(batches[0])
                assert shard_rows(lengths, 2, sort_by_length=True) != shard_rows(lengths, 2)
            key = (num_workers, fsdp, gather) if pack == "auto" else (num_workers, fsdp, "packed")
            results[key] = run(group, batches)
            if num_workers == 2 and fsdp is None:
                # One row for two ranks: rank 1 has no micro-batch and no loss metrics of its own.
                one_row = select_rows(batches[0], 0, 1)
                stats = group.train_step(one_row, LossWithMetric(), num_target_tokens(one_row))
                assert stats.metrics["test/units"] == 1.0 and stats.num_sequences == 1
                exported = group.export_weights()
                assert exported[1][0] == "model.layers.0.self_attn.q_proj.weight"
                # Decoder linears travel as FP8 (quantized at export when training in FP32) and survive Ray.
                assert exported[1][1].dtype == torch.float8_e4m3fn
                assert exported[2][0].endswith("weight_scale_inv")
            peak = group.train_step(batches[0], SftLossFn(), num_target_tokens(batches[0])).metrics
            assert peak["perf/peak_memory_gb"] > 0
    losses_1, norms_1, logp_1 = results[(1, None, "auto")]
    for key in ((2, None, "auto"), (2, True, "auto"), (2, True, "packed")):
        losses, norms, logp = results[key]
        # Same global batches -> same global-mean loss; only the summation order differs.
        assert losses == pytest.approx(losses_1, rel=1e-5), key
        assert norms == pytest.approx(norms_1, rel=1e-4), key
        torch.testing.assert_close(logp, logp_1, rtol=1e-4, atol=1e-4)
    assert losses_1[2] < losses_1[0]
    # BF16 gather on two FSDP ranks (FP32 masters, FP32 reduction): the same steps within BF16 rounding
    # (measured 2026-11-23: losses within 3e-4 relative, grad norms 0.5 %, log-probs 9e-3).
    losses, norms, logp = results[(2, True, "bfloat16")]
    assert losses == pytest.approx(losses_1, rel=3e-3) and norms == pytest.approx(norms_1, rel=2e-2)
    torch.testing.assert_close(logp, logp_1, rtol=0, atol=5e-2)
    assert losses != pytest.approx(losses_1, rel=1e-6)  # BF16 really was gathered


def _masters(worker: object) -> torch.Tensor:
    """Runs in a trainer actor: its FP32 masters and kept FP8 weights, as one byte string."""
    segments = worker.backend.master_weights.segments  # type: ignore[attr-defined]
    parts = [seg.flat.view(torch.uint8) for seg in segments]
    parts += [
        t.view(torch.uint8).flatten() for seg in segments if seg.fp8 for t in (seg.fp8.codes, seg.fp8.scales)
    ]
    return torch.cat(parts)


@pytest.mark.usefixtures("ray_local")
def test_replicas_with_fp32_masters_train_like_one_and_stay_bit_equal(
    assets: tuple[Path, list[TokenBatch]],
) -> None:
    """trainer.data_parallel=replicate (each rank the one-GPU path: a BF16 model with FP32 masters and kept FP8
    weights; the masters' gradients all-reduced per segment) against one worker, FP8 in BF16 compute."""
    model, batches = assets
    results, masters = {}, []
    for num_workers in (1, 2):
        cfg = stage_cfg(
            model, num_workers, dtype="bfloat16", precision="fp8", param_dtype="bfloat16",
            data_parallel="replicate",
        )  # fmt: skip
        with placed_trainer_group(cfg, total_steps=5) as group:
            assert group.fsdp is (False if num_workers == 2 else None)
            results[num_workers] = run(group, batches)
            if num_workers == 2:
                import ray

                masters = ray.get([w.__ray_call__.remote(_masters) for w in group.workers])
    losses_1, norms_1, logp_1 = results[1]
    losses, norms, logp = results[2]
    # BF16 compute: the ranks' micro-batch gradients are summed in another order than one worker's.
    assert losses == pytest.approx(losses_1, rel=1e-3) and norms == pytest.approx(norms_1, rel=1e-2)
    torch.testing.assert_close(logp, logp_1, rtol=0, atol=2e-2)
    # Each rank trained on its own rows, yet every update used the same summed gradients: the replicas (what
    # each rank exports to its own engine) are the same bytes.
    assert masters[0].numel() > 0 and torch.equal(masters[0], masters[1])


def _adam_steps(worker: object) -> list[float]:
    """Runs in a trainer actor: its optimizer's per-parameter step counts."""
    state = worker.backend.optimizer.state.values()  # type: ignore[attr-defined]
    return sorted({float(s["step"]) for s in state})


@pytest.mark.usefixtures("ray_local")
def test_an_fsdp_checkpoint_saved_before_the_first_update_leaves_the_optimizer_unstepped(
    assets: tuple[Path, list[TokenBatch]], tmp_path: Path
) -> None:
    """torch's get_optimizer_state_dict fills an empty optimizer by stepping it with zero gradients: AdamW's count
    became 1, so the first real update (bias-corrected as step 2) was ~26% smaller than an unsaved run's. Here:
    saved (as after a skipped first step), resumed into a fresh group, then one step each."""
    import ray

    model, batches = assets
    cfg = stage_cfg(model, 2)
    with placed_trainer_group(cfg, total_steps=5, fsdp=True) as group:
        group.save(tmp_path / "ckpt")
        assert ray.get([w.__ray_call__.remote(_adam_steps) for w in group.workers]) == [[], []]
        saved = group.train_step(batches[0], SftLossFn(), num_target_tokens(batches[0]))
        assert ray.get([w.__ray_call__.remote(_adam_steps) for w in group.workers]) == [[1.0], [1.0]]
        after_saved = group.forward_logprobs(batches[1])
    with placed_trainer_group(cfg, total_steps=5, fsdp=True) as group:
        group.load(tmp_path / "ckpt")
        resumed = group.train_step(batches[0], SftLossFn(), num_target_tokens(batches[0]))
        assert ray.get([w.__ray_call__.remote(_adam_steps) for w in group.workers]) == [[1.0], [1.0]]
        after_resumed = group.forward_logprobs(batches[1])
    with placed_trainer_group(cfg, total_steps=5, fsdp=True) as group:
        plain = group.train_step(batches[0], SftLossFn(), num_target_tokens(batches[0]))
        after_plain = group.forward_logprobs(batches[1])
    assert saved.loss == resumed.loss == plain.loss
    assert torch.equal(after_saved, after_plain) and torch.equal(after_resumed, after_plain)
    # Into replicas (only possible with checkpoint.allow_config_change) it failed at the first step, in AdamW.
    replicas = stage_cfg(model, 2, data_parallel="replicate")
    refused = r"written by fsdp trainer ranks, this run has replicate ones"
    with placed_trainer_group(replicas, total_steps=5) as group, pytest.raises(Exception, match=refused):
        group.load(tmp_path / "ckpt")


def test_data_parallel_auto_keeps_replicas_where_their_state_fits_one_gpu(
    assets: tuple[Path, list[TokenBatch]],
) -> None:
    from transformers import AutoModelForCausalLM

    from infir2_rl.trainers.torch import distributed as D

    model, _ = assets
    loaded = AutoModelForCausalLM.from_pretrained(model, local_files_only=True)
    assert D.count_parameters(str(model)) == sum(p.numel() for p in loaded.parameters())
    resolve = D.resolve_data_parallel

    def not_needed() -> int:
        raise AssertionError("the parameter count is read only for auto on GPUs with several workers")

    assert resolve("auto", 2, True, lambda: 1_543_714_304) is False  # Qwen2.5-1.5B: ~27 GiB per replica
    assert resolve("auto", 2, True, lambda: 3_085_938_688) is True  # Qwen2.5-3B: ~55 GiB, sharded
    assert resolve("auto", 2, False, not_needed) is None and resolve("auto", 1, True, not_needed) is None
    assert (
        resolve("replicate", 4, True, not_needed) is False and resolve("fsdp", 2, False, not_needed) is True
    )
    with pytest.raises(ValueError, match="torch backend"):
        stage_cfg(model, 2, backend="megatron", data_parallel="replicate")


@pytest.mark.usefixtures("ray_local")
def test_bad_trainer_settings_fail_before_actors_start(assets: tuple[Path, list[TokenBatch]]) -> None:
    model, _ = assets
    with pytest.raises(ValueError, match="trainer.megatron_spec=te"):
        cfg = stage_cfg(model, 1, backend="megatron", megatron_spec="te")
        TrainerGroup(cfg, None, total_steps=1)  # type: ignore[arg-type]
    cfg = SftStageConfig(
        model={"path": str(model)}, trainer={"num_workers": 3, "global_batch_size": 6, "micro_batch_size": 2}
    )
    with pytest.raises(ValueError, match="need 3 CPUs; the Ray cluster has 2"):
        placed_trainer_group(cfg, total_steps=1).__enter__()
    cfg = stage_cfg(model, 1)
    cfg.placement.use_gpu = "yes"
    with pytest.raises(ValueError, match="no GPUs"):
        placed_trainer_group(cfg, total_steps=1).__enter__()


def test_trainer_threads_set_the_worker_torch_threads(assets: tuple[Path, list[TokenBatch]]) -> None:
    """placement.trainer_threads reaches the worker (the demo's RL trainer computes on both cores)."""
    from infir2_rl.actors.trainer_worker import TrainerSpec, TrainerWorker

    model, _ = assets
    cfg = stage_cfg(model, 1)
    cfg.placement.trainer_threads = 1
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        spec = TrainerSpec(
            cfg.model, cfg.trainer, cfg.optimizer, total_steps=1, torch_threads=cfg.placement.trainer_threads
        )
        TrainerWorker(spec, rank=0, world_size=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_ray_counts_only_the_cpus_a_pinned_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from infir2_rl.actors import ray_runtime

    monkeypatch.setattr(ray_runtime.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(ray_runtime.os, "cpu_count", lambda: 16)
    assert ray_runtime._affinity_cpus() == 2  # taskset -c 0,1 on a 16-core machine
    monkeypatch.setattr(ray_runtime.os, "cpu_count", lambda: 2)
    assert ray_runtime._affinity_cpus() is None  # not pinned: Ray's own count (cgroup quotas included)


@pytest.mark.usefixtures("ray_local")
def test_cluster_gone_is_false_while_the_gcs_answers() -> None:
    """Teardown skips its Ray calls when this is true (tests/test_cli.py's group SIGTERM): it must not be true
    for a live cluster, or every stage would leave its actors and placement group behind."""
    from infir2_rl.actors.ray_runtime import cluster_gone

    assert cluster_gone() is False
