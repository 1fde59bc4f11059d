"""INFIR2_* switches: one parsing rule (infir2_rl/env.py), and a switch that cannot take effect says so."""

from __future__ import annotations

import pytest
import torch

from infir2_rl.env import env_flag


def test_switches_read_the_usual_spellings_and_refuse_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFIR2_X", raising=False)
    assert env_flag("INFIR2_X", True) is True and env_flag("INFIR2_X", False) is False
    for raw, value in (
        ("1", True),
        (" TRUE ", True),
        ("on", True),
        ("Yes", True),
        ("0", False),
        ("off", False),
    ):
        monkeypatch.setenv("INFIR2_X", raw)
        assert env_flag("INFIR2_X", not value) is value, raw
    monkeypatch.setenv("INFIR2_X", "")
    assert env_flag("INFIR2_X", True) is True
    monkeypatch.setenv("INFIR2_X", "maybe")
    with pytest.raises(ValueError, match=r"INFIR2_X='maybe': use one of 1, true, on, yes \(on\)"):
        env_flag("INFIR2_X", True)


def test_pdl_asked_for_without_grid_dependency_control_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from infir2_rl.engines.native import pdl

    monkeypatch.setattr(pdl, "_HAVE_GDC", False)
    pdl._say_no_gdc.cache_clear()
    monkeypatch.delenv(pdl.ENV, raising=False)
    with caplog.at_level("WARNING"):
        assert not pdl.enabled(torch.device("cuda"))  # the default: nothing asked, nothing said
        assert "grid dependency control" not in caplog.text
        monkeypatch.setenv(pdl.ENV, "1")
        assert not pdl.enabled(torch.device("cuda")) and not pdl.enabled(torch.device("cuda"))
    assert caplog.text.count("INFIR2_PDL is set, but this Triton has no grid dependency control") == 1
    pdl._say_no_gdc.cache_clear()


def test_an_fp8_linear_the_gpu_path_cannot_align_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    from infir2_rl.fp8 import gemm

    gemm._say_emulated.cache_clear()
    with caplog.at_level("WARNING"):
        assert not gemm.fast_path_ok(torch.empty(0), 100, 64)  # off the GPU: no line (CPU always emulates)
        assert not caplog.text
        for _ in range(2):  # what fast_path_ok calls on a GPU for such a layer, at every forward
            gemm._say_emulated(100, 64)
    assert caplog.text.count("FP8 linear N=100, K=64 on a GPU: not multiples of 16") == 1
    gemm._say_emulated.cache_clear()
