"""The FP8 GEMM chooser's on-disk cache of choices (engines/native/linears.py ``ChoiceCache``): a second
process on the same kind of GPU takes the first one's picks; other GPUs, torch/Triton versions or kernel code
keep their own; a file that cannot be read or written costs a warning, never an error. CPU: the cache alone
(the chooser's GPU side is in tests/test_gemm_choice_cache_gpu.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from infir2_rl.engines.native.linears import CACHE_ENV, ChoiceCache, default_cache_path


def test_choices_survive_a_new_instance_per_section(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "choices.json"
    a = ChoiceCache(path, "H100 | torch 2.11")
    assert a.get("m 64 n 2048 k 1536") is None
    a.put("m 64 n 2048 k 1536", "triton bm64 bn32 sk1 w4 s3")
    other = ChoiceCache(path, "H200 | torch 2.11")  # another GPU model keeps its own
    other.put("m 64 n 2048 k 1536", "cublas scaled_mm")
    again = ChoiceCache(path, "H100 | torch 2.11")
    assert again.get("m 64 n 2048 k 1536") == "triton bm64 bn32 sk1 w4 s3"
    assert ChoiceCache(path, "H200 | torch 2.11").get("m 64 n 2048 k 1536") == "cublas scaled_mm"
    assert ChoiceCache(path, "H100 | torch 2.12").get("m 64 n 2048 k 1536") is None
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_an_unreadable_file_is_a_warning_and_the_choices_are_timed(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "choices.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING):
        cache = ChoiceCache(path, "s")
    assert cache.get("k") is None
    assert "not read" in caplog.text
    cache.put("k", "v")  # and the next write replaces it with a valid file
    assert ChoiceCache(path, "s").get("k") == "v"


def test_an_unwritable_place_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = ChoiceCache(blocker / "choices.json", "s")  # its directory would be a file
    with caplog.at_level(logging.WARNING):
        cache.put("k", "v")
    assert "not written" in caplog.text
    assert cache.get("k") == "v"  # this process keeps it


def test_where_the_cache_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_path() == tmp_path / "infir2_rl" / "fp8_gemm_choices.json"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine.json"))
    assert default_cache_path() == tmp_path / "mine.json"
    for off in ("off", "0", ""):
        monkeypatch.setenv(CACHE_ENV, off)
        assert default_cache_path() is None
