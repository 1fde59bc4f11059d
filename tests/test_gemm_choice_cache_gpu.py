"""On a Hopper GPU: a second FP8 GEMM chooser (as in a new process) takes the first one's choice from the
on-disk cache without timing; with the cache off it times again. Skipped without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infir2_rl.engines.native.fused_ops import QuantizedRows
from infir2_rl.engines.native.linears import CACHE_ENV, Fp8GemmChooser
from infir2_rl.fp8 import quant_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs a Hopper GPU",
    ),
]


def test_a_new_chooser_takes_the_cached_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "choices.json"
    monkeypatch.setenv(CACHE_ENV, str(path))
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, ws = quant_triton.quantize_weight(w)
    q, s_t = quant_triton.quantize_rows(torch.randn(16, 256, device="cuda", dtype=torch.bfloat16))
    rows = QuantizedRows(q, s_t, 16)
    first = Fp8GemmChooser(False)
    choice = first.pick(rows, wq, ws, None, torch.bfloat16)
    assert first.cached == 0 and len(first.timings) == 1
    (section,) = json.loads(path.read_text()).values()
    assert list(section.values()) == [str(choice)]
    second = Fp8GemmChooser(False)
    assert str(second.pick(rows, wq, ws, None, torch.bfloat16)) == str(choice)
    assert second.cached == 1 and not second.timings  # nothing timed
    uncached = Fp8GemmChooser(False, cache=False)
    uncached.pick(rows, wq, ws, None, torch.bfloat16)
    assert uncached.cached == 0 and len(uncached.timings) == 1
