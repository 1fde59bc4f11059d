"""trainer.cuda_graphs=auto guards memory before capturing another shape (``LayerGraphs._memory_allows``);
the decision is plain arithmetic over the allocator's numbers, checked here on CPU with those numbers faked. Also
the per-kind shape caps and which layers warm up before a capture, with the captures faked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from infir2_rl.models.factory import init_model
from infir2_rl.trainers.layer_graphs import LayerGraphs

GIB = 2**30


def _graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check_memory: bool) -> LayerGraphs:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(init_model(tmp_path / "model", preset="tiny"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)  # a CPU build has no pools
    return LayerGraphs(model, check_memory=check_memory)


def _free(monkeypatch: pytest.MonkeyPatch, driver_free: int, reserved: int, allocated: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (driver_free, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def _fake_captures(graphs: LayerGraphs, monkeypatch: pytest.MonkeyPatch, record: Callable[..., None]) -> None:
    """Captures replaced by ``record(kind, hidden, warm)`` ("training" or "scoring", the warmed-up layers), each
    returning a stand-in of its kind; the CUDA calls around a capture made no-ops."""

    def fake(kind: str) -> Callable[..., object]:
        def run(hidden: torch.Tensor, mask: object, pe: object, kwargs: object, warm: list[int]) -> object:
            record(kind, hidden, warm)
            return type("G", (), {"forward_only": kind == "scoring"})()

        return run

    monkeypatch.setattr(graphs, "_capture", fake("training"))
    monkeypatch.setattr(graphs, "_capture_forward_only", fake("scoring"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)


def test_auto_captures_another_shape_only_when_memory_looks_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    graphs = _graphs(tmp_path, monkeypatch, check_memory=True)
    hidden = torch.zeros(32, 320, 64)  # FP32: 2.5 MiB
    act = hidden.numel() * hidden.element_size()
    _free(monkeypatch, driver_free=0, reserved=0, allocated=0)
    assert graphs._memory_allows(hidden, forward_only=False)  # the first training shape: always
    # As if the first capture (this shape) grew the pool by 1000 B per element.
    graphs._capture_bytes_per_element = 1000.0
    graphs._largest_training = hidden.numel()
    # A shape no larger fits in the shared pool: it needs the margin only, a tenth of its scaled growth.
    need = 100 * hidden.numel()
    # Free = the driver's free memory + the allocator's cached, unallocated blocks.
    _free(monkeypatch, driver_free=need // 2, reserved=need, allocated=need // 2)
    assert graphs._memory_allows(hidden, forward_only=False)
    _free(monkeypatch, driver_free=need // 2 - 1, reserved=need, allocated=need // 2)
    assert not graphs._memory_allows(hidden, forward_only=False)
    # A shape twice as large needs the pool to grow by its second half, and its margin.
    double = torch.zeros(64, 320, 64)
    need2 = 1000 * hidden.numel() + 100 * double.numel()
    _free(monkeypatch, driver_free=need2, reserved=0, allocated=0)
    assert graphs._memory_allows(double, forward_only=False)
    _free(monkeypatch, driver_free=need2 - 1, reserved=0, allocated=0)
    assert not graphs._memory_allows(double, forward_only=False)
    # Forward-only shapes need room for 8 activations, 5 where a shared buffer set already fits them.
    _free(monkeypatch, driver_free=8 * act, reserved=0, allocated=0)
    assert graphs._memory_allows(hidden, forward_only=True)
    _free(monkeypatch, driver_free=8 * act - 1, reserved=0, allocated=0)
    assert not graphs._memory_allows(hidden, forward_only=True)
    graphs._boundaries(hidden, forward_only=True)
    _free(monkeypatch, driver_free=5 * act, reserved=0, allocated=0)
    assert graphs._memory_allows(hidden, forward_only=True)
    _free(monkeypatch, driver_free=5 * act - 1, reserved=0, allocated=0)
    assert not graphs._memory_allows(hidden, forward_only=True)


def test_without_the_check_every_shape_is_allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    graphs = _graphs(tmp_path, monkeypatch, check_memory=False)  # cuda_graphs=true: the user asked for them
    graphs._capture_bytes_per_element = 1e12
    _free(monkeypatch, driver_free=0, reserved=0, allocated=0)
    assert graphs._memory_allows(torch.zeros(4, 64, 64), forward_only=False)


def test_after_a_refusal_no_later_shape_of_that_kind_is_captured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log line says "it and later new shapes run eagerly", and the code must do so: a training shape
    captured after other micro-batches ran their backward eagerly fails on the GPU (layer_graphs.py)."""
    graphs = _graphs(tmp_path, monkeypatch, check_memory=True)
    captured: list[tuple[int, ...]] = []
    monkeypatch.setattr(graphs, "_capture", lambda hidden, *a: captured.append(tuple(hidden.shape)))
    monkeypatch.setattr(
        graphs, "_capture_forward_only", lambda hidden, *a: captured.append(tuple(hidden.shape))
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    pe = (torch.zeros(1), torch.zeros(1))
    big, small = torch.zeros(8, 64, 64), torch.zeros(2, 64, 64)
    graphs._capture_bytes_per_element = 1000.0
    need_small = 2 * 1000 * small.numel()
    _free(monkeypatch, driver_free=need_small, reserved=0, allocated=0)  # enough for small, not for big
    assert graphs._capture_or_none(("big",), big, None, pe) is None
    assert graphs._capture_or_none(("small",), small, None, pe) is None  # would fit, but after a refusal
    assert captured == []
    with torch.no_grad():  # forward-only shapes are another kind, with their own refusal
        graphs._capture_or_none(("scoring",), small, None, pe)
    assert captured == [(2, 64, 64)]


def test_training_and_forward_only_shapes_have_caps_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training shapes are capped at 64 (a padded RL-shaped batch meets ~47, and FP8 past the cap runs eagerly,
    host-bound), forward-only shapes too (they share their buffers, ``_boundaries``), each kind counted apart."""
    graphs = _graphs(tmp_path, monkeypatch, check_memory=False)
    assert (graphs.max_shapes, graphs.max_forward_only_shapes) == (64, 64)
    graphs.max_shapes, graphs.max_forward_only_shapes = 3, 2
    captured: list[tuple[str, int]] = []
    _fake_captures(graphs, monkeypatch, lambda kind, hidden, warm: captured.append((kind, hidden.shape[0])))
    pe = (torch.zeros(1), torch.zeros(1))
    for rows in range(1, 6):
        graphs._capture_or_none(("train", rows), torch.zeros(rows, 64, 8), None, pe)
        with torch.no_grad():
            graphs._capture_or_none(("score", rows), torch.zeros(rows, 64, 8), None, pe)
    assert [r for kind, r in captured if kind == "training"] == [1, 2, 3]
    assert [r for kind, r in captured if kind == "scoring"] == [1, 2]


def test_shapes_of_a_kind_share_the_buffers_between_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shape of a kind that fits a buffer set reads and writes the same memory (no memory per shape); a
    larger shape adds a set; training and forward-only shapes never share (a training forward's activations
    must outlive a scoring forward run before its backward)."""
    graphs = _graphs(tmp_path, monkeypatch, check_memory=False)
    n = len(graphs.layers)
    big = graphs._boundaries(torch.zeros(4, 64, 8), forward_only=True)
    small = graphs._boundaries(torch.zeros(2, 32, 8), forward_only=True)
    assert len(big) == len(small) == 3  # the input and two ping-pong outputs
    assert [t.shape for t in small] == [torch.Size([2, 32, 8])] * 3
    assert [t.data_ptr() for t in small] == [t.data_ptr() for t in big]
    assert len({t.data_ptr() for t in big}) == 3
    larger = graphs._boundaries(torch.zeros(8, 64, 8), forward_only=True)
    assert larger[0].data_ptr() not in {t.data_ptr() for t in big}
    assert len(graphs._boundary_sets[True]) == 2
    training = graphs._boundaries(torch.zeros(2, 32, 8), forward_only=False)
    assert len(training) == 2 * n + 2  # each layer's input (and the last output), and their gradients
    assert not {t.data_ptr() for t in training} & {t.data_ptr() for t in big + larger}
    assert (
        graphs._boundaries(torch.zeros(1, 32, 8), forward_only=False)[0].data_ptr() == training[0].data_ptr()
    )


def test_later_shapes_of_a_code_path_warm_up_layer_0_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every layer warms up before the first capture of a code path (``_key``'s first part), layer 0 alone before
    its later shapes (the warm-up was ~70% of capture time, docs/performance.md session 39); another code path
    (forward-only, FP8 off, ...) starts again with every layer."""
    graphs = _graphs(tmp_path, monkeypatch, check_memory=False)
    n = len(graphs.layers)
    assert n > 1
    warmed: list[tuple[str, list[int]]] = []
    _fake_captures(graphs, monkeypatch, lambda kind, hidden, warm: warmed.append((kind, list(warm))))
    pe = (torch.zeros(1), torch.zeros(1))
    for rows in (4, 2, 1):
        graphs._capture_or_none((("bf16", "train"), rows), torch.zeros(rows, 64, 8), None, pe)
        with torch.no_grad():
            graphs._capture_or_none((("bf16", "score"), rows), torch.zeros(rows, 64, 8), None, pe)
    graphs._capture_or_none((("fp8 off", "train"), 4), torch.zeros(4, 64, 8), None, pe)
    every, first = list(range(n)), [0]
    assert warmed == [
        ("training", every), ("scoring", every), ("training", first), ("scoring", first),
        ("training", first), ("scoring", first), ("training", every),
    ]  # fmt: skip


def test_layers_of_another_kind_warm_up_their_first_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sliding-window layer runs other attention kernels than a full-attention one, so a later shape warms up the
    first layer of each kind (``_warm_up_layers``)."""
    from infir2_rl.trainers.layer_graphs import _warm_up_layers

    graphs = _graphs(tmp_path, monkeypatch, check_memory=False)
    layers = graphs.layers
    assert len(layers) >= 4
    assert _warm_up_layers(layers) == [0]
    layers[2].self_attn.sliding_window = 16  # type: ignore[union-attr]
    layers[3].self_attn.sliding_window = 16  # type: ignore[union-attr]
    assert _warm_up_layers(layers) == [0, 2]
