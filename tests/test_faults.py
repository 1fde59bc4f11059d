"""Faults a user meets, one test (or more) per numbered item of issue 16's "What fails today".

Each test makes the fault happen for real (a NaN in a checkpoint, a truncated file, a killed Ray actor, a
diverging learning rate) and asserts what the user sees: the exit code, the one line naming the cause and
the remedy, the log, and what is (not) left on disk. docs/reliability.md maps the items to these tests.
The Ray tests share one local cluster, one tiny model and one data set (module-scoped fixtures).
"""

from __future__ import annotations

import errno
import json
import logging
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from infir2_rl.checkpoint import CheckpointManager, DataCursor, StageState, save_checkpoint
from infir2_rl.cli import main
from infir2_rl.data.datasets import load_prompt_examples
from infir2_rl.data.readers import read_records
from infir2_rl.data.scan import check_fills_batch, scan_prompt_rows
from infir2_rl.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, describe
from infir2_rl.fp8.checkpoint import cast_checkpoint
from infir2_rl.fp8.quant import (
    dequantize_weight_blockwise,
    fake_quantize_tiles,
    quantize_activation,
    quantize_weight_blockwise,
)
from infir2_rl.reward.math import MathReward
from infir2_rl.reward.protocol import score_batch

# ---------------------------------------------------------------- item 5: non-finite weights and blocks


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("pow2", [False, True])
def test_a_non_finite_block_dequantizes_to_nan_and_leaves_other_blocks_alone(bad: float, pow2: bool) -> None:
    w = torch.randn(256, 384) * 0.02
    w[5, 7] = bad  # block (0, 0)
    q, scale = quantize_weight_blockwise(w, pow2_scales=pow2)
    assert scale[0, 0].isnan()  # never scale 1 (the all-zero rule) nor inf
    assert torch.isfinite(scale.flatten()[1:]).all()
    back = dequantize_weight_blockwise(q, scale)
    assert back[:128, :128].isnan().all()  # the whole block says it is broken
    clean = w.clone()
    clean[5, 7] = 0.0
    ref = dequantize_weight_blockwise(*quantize_weight_blockwise(clean, pow2_scales=pow2))
    assert torch.equal(back[128:], ref[128:]) and torch.equal(back[:128, 128:], ref[:128, 128:])
    x = torch.randn(3, 256)
    x[1, 130] = bad
    xq, xs = quantize_activation(x, pow2_scales=pow2)
    assert xs[1, 1].isnan() and torch.isfinite(xs[0]).all() and xs[1, 0].isfinite()
    assert fake_quantize_tiles(x, dim=0, pow2_scales=pow2)[:, 130].isnan().all()


def _tiny_hf_model(path: Path, max_shard_size: str = "10GB") -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size=max_shard_size)
    return path


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _cast_cli(src: Path, dst: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["cast-fp8", "--input", str(src), "--output", str(dst), "--no-progress"])
    return code, capsys.readouterr().err.strip()


def test_cast_fp8_refuses_a_nan_weight_naming_the_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _tiny_hf_model(tmp_path / "bf16")
    shard = src / "model.safetensors"
    tensors = _tensors(shard)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 4] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    code, err = _cast_cli(src, tmp_path / "fp8", capsys)
    assert code == EXIT_BAD_INPUT
    assert f"tensor {name} in {shard}: 1 NaN and 0 infinite values" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "fp8").exists() and not list(tmp_path.glob(".fp8.partial-*"))


def test_cast_fp8_checks_the_index_against_the_shards(tmp_path: Path) -> None:
    src = _tiny_hf_model(tmp_path / "bf16", max_shard_size="200KB")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, shard = sorted(index["weight_map"].items())[0]
    # An index missing a tensor's entry.
    missing = {**index, "weight_map": {k: v for k, v in index["weight_map"].items() if k != name}}
    index_path.write_text(json.dumps(missing))
    with pytest.raises(ValueError, match=f"{name} in {shard} is missing from the index"):
        cast_checkpoint(src, tmp_path / "a", progress=False, device="cpu")
    # An index naming a tensor its shard lacks.
    extra = {**index, "weight_map": {**index["weight_map"], "model.layers.9.mlp.up_proj.weight": shard}}
    index_path.write_text(json.dumps(extra))
    with pytest.raises(
        ValueError, match=f"model.layers.9.mlp.up_proj.weight is mapped to {shard}, which lacks it"
    ):
        cast_checkpoint(src, tmp_path / "b", progress=False, device="cpu")
    index_path.write_text(json.dumps(index))
    # A truncated shard is named by file, not a bare SafetensorError.
    data = (src / shard).read_bytes()
    (src / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ValueError, match=f"{src / shard}: unreadable safetensors shard.*truncated or corrupt"
    ):
        cast_checkpoint(src, tmp_path / "c", progress=False, device="cpu")
    assert not any((tmp_path / d).exists() for d in "abc")


# ---------------------------------------------------------------- item 4: checkpoints


class _Trainer:
    """Writes what a trainer group writes; `fail` raises the OSError a full disk gives, half-way."""

    def __init__(self, fail: OSError | None = None) -> None:
        self.fail = fail

    def save(self, directory: Path) -> None:
        (directory / "hf").mkdir()
        save_file({"w": torch.arange(1000.0)}, str(directory / "hf" / "model.safetensors"))
        if self.fail is not None:
            raise self.fail
        (directory / "train_state").mkdir()
        torch.save({"step": 1}, directory / "train_state" / "rank_0.pt")


def _state(step: int) -> StageState:
    return StageState(step=step, cursor=DataCursor(epoch=0, position=step), num_examples=10)


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = CheckpointManager(tmp_path, keep_last=3)
    save_checkpoint(_Trainer(), manager, _state(2))
    newest = save_checkpoint(_Trainer(), manager, _state(4))
    weights = newest.hf_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # the tail lost after the save
    with caplog.at_level(logging.WARNING):
        chosen = manager.latest()
    assert chosen is not None and chosen.step == 2
    assert f"checkpoint {newest.path} is damaged (hf/model.safetensors has" in caplog.text
    assert "skipping it and resuming from the previous complete one" in caplog.text
    # A truncated optimizer state (torch.save zip) without a manifest (an older checkpoint) is caught too.
    (newest.path / "MANIFEST.json").unlink()
    weights.write_bytes(_tensors_bytes())
    state_file = newest.path / "train_state" / "rank_0.pt"
    state_file.write_bytes(state_file.read_bytes()[:-30])
    assert manager.latest().step == 2  # type: ignore[union-attr]


def _tensors_bytes() -> bytes:
    from safetensors.torch import save

    return save({"w": torch.arange(1000.0)})


def test_a_failed_save_leaves_no_partial_directory_and_reads_as_one_line(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    good = save_checkpoint(_Trainer(), manager, _state(1))
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".tmp_step_000002" / "x"))
    with pytest.raises(OSError) as caught:
        save_checkpoint(_Trainer(fail=full), manager, _state(2))
    assert not list(tmp_path.glob(".tmp_*")) and manager.latest() == good
    code, line = describe(caught.value)
    assert code == EXIT_FAILED and line.startswith("disk full writing") and "resume" in line
    read_only = PermissionError(errno.EACCES, "Permission denied", "/runs/x/config.yaml")
    assert describe(read_only) == (
        EXIT_BAD_INPUT,
        "cannot write /runs/x/config.yaml (Permission denied): make the run directory writable or set run_dir="
        " to one that is",
    )
    assert describe(KeyboardInterrupt())[0] == EXIT_INTERRUPTED


# ---------------------------------------------------------------- item 8: data problems


def test_labels_are_strings_and_encoding_errors_are_counted(tmp_path: Path) -> None:
    from infir2_rl.models.tokenizer import build_tokenizer

    rows = [
        {"prompt": "What is 9+10?", "label": ["19"]},  # one-element list: its element
        {"prompt": "What is 2+2?", "label": 4},  # a number as written
        {"prompt": "What is 1+1?", "label": {"answer": "2"}},  # not a label
        {"prompt": "Two answers?", "label": ["1", "2"]},  # not one label
    ]
    path = tmp_path / "rl.jsonl"
    lines = [json.dumps(r).encode() for r in rows] + [b'{"prompt": "caf\xe9 au lait?", "label": "3"}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert [r.reason for r in read_records(path) if r.data is None] == ["bad_encoding"]
    examples, report = load_prompt_examples(path, build_tokenizer())
    assert [e.label for e in examples] == ["19", "4"]
    assert (report.bad_format, report.bad_encoding, report.num_kept, report.num_rows) == (2, 1, 2, 5)
    assert any("row 5: bad_encoding: not UTF-8 (byte e9 at column" in line for line in report.examples)
    scanned = scan_prompt_rows(path)  # the same verdicts without a tokenizer, before Ray starts
    assert (scanned.num_kept, scanned.bad_format, scanned.bad_encoding) == (2, 2, 1)
    with pytest.raises(
        ValueError, match=r"2 rows that can be used .* fewer than one batch of rollout.prompts_per_step=4"
    ):
        check_fills_batch(scanned, 4, "rollout.prompts_per_step")


# ---------------------------------------------------------------- item 9: rewards in parallel


def test_pathological_answers_cost_about_one_deadline_per_worker() -> None:
    deadline, workers, num_bad = 2.0, 2, 2
    reward = MathReward(timeout_s=deadline, num_workers=workers)
    tower = "<think>x</think>\\boxed{9^{9^{9^{9}}}}"  # math-verify never returns on this one
    fine = "<think>x</think>\\boxed{5}"
    try:
        assert score_batch(reward, [fine] * workers, ["5"] * workers) == [1.0] * workers  # start the children
        start = time.perf_counter()
        scores = score_batch(reward, [tower] * num_bad + [fine] * 16, ["5"] * (num_bad + 16))
        elapsed = time.perf_counter() - start
    finally:
        reward.close()
    assert scores == [0.0] * num_bad + [1.0] * 16
    assert reward.stats.num_timeouts == num_bad
    # One at a time this batch takes at least num_bad x deadline = 4 s; in parallel about one deadline (the
    # fine answers go to the spare children while the killed ones restart).
    assert elapsed < 0.75 * num_bad * deadline, elapsed
