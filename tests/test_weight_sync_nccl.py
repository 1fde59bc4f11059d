"""weight_sync.transport=nccl on CPU (gloo): the weight group, flat buckets, pushes to native engines in this
process (threads), stale refusal that keeps the group in step, and timeouts instead of hangs. The same
transport over real Ray actors (a trainer group and an engine actor) is in tests/test_weight_sync_nccl_ray.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from fp8_states import perturbed_fp8_state

from infir2_rl.config.components import WeightSyncConfig
from infir2_rl.config.stage import RlStageConfig
from infir2_rl.engines.native.engine import NativeEngine
from infir2_rl.models.factory import init_model
from infir2_rl.stages.rl_setup import resolve_transport
from infir2_rl.types import EngineHealth, StaleWeightsError, WeightSyncError
from infir2_rl.weight_sync.broadcast import BroadcastExport, unflatten_bytes
from infir2_rl.weight_sync.group import WeightGroup, host_store
from infir2_rl.weight_sync.nccl import NcclTransport
from infir2_rl.weight_sync.service import WeightSyncService, make_transport, same_bytes
from infir2_rl.weight_sync.transport import TensorSource


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """Single-threaded torch for this module (see conftest.one_thread)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


def _nccl_cfg(timeout_s: float = 20.0) -> WeightSyncConfig:
    return WeightSyncConfig(transport="nccl", bucket_size_mb=1, self_check_layers=2, timeout_s=timeout_s)


def _form_group(world: int, timeout_s: float) -> list[WeightGroup]:
    """A gloo weight group of `world` ranks in this process (rank 0 hosts the store), one thread per rank."""
    store, port = host_store("127.0.0.1", timeout_s)
    groups: list[Any] = [None] * world

    def join(rank: int) -> None:
        groups[rank] = WeightGroup.join(
            "127.0.0.1",
            port,
            rank,
            world,
            backend="gloo",
            timeout_s=timeout_s,
            store=store if rank == 0 else None,
        )

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g is not None for g in groups)
    return groups


def test_flat_buckets_round_trip_any_dtype_mix_at_any_offset() -> None:
    """The sender's buffer is SGLang's flattened layout (bytes back to back, no padding), and both the engine's
    unflatten and the sender's held buffer give every tensor back, unaligned ones included."""
    from infir2_rl.engines.sglang.protocol import flat_bytes

    tensors = [
        torch.randn(3, dtype=torch.bfloat16),  # 6 bytes: the next tensor starts unaligned
        torch.randn(2, 5),
        torch.randn(7, 9).to(torch.float8_e4m3fn),
        torch.tensor(3.5, dtype=torch.float64),  # a scalar at offset 6 + 40 + 63 = 109
    ]
    names = [f"t{i}" for i in range(len(tensors))]
    sender = BroadcastExport()
    (meta,) = sender.export(list(zip(names, tensors)), max_bytes=1 << 20, version=0)
    flat = sender.held[0].flat
    assert torch.equal(flat, flat_bytes(tensors)) and meta.num_bytes == flat.numel()
    back = unflatten_bytes(flat, meta.metas)
    assert all(same_bytes(a, b) and a.dtype == b.dtype for a, b in zip(tensors, back))
    held = sender.held[0].tensors(names)
    assert all(same_bytes(t, held[n]) and t.dtype == held[n].dtype for n, t in zip(names, tensors))
    with pytest.raises(ValueError, match="take"):
        unflatten_bytes(flat[:-1], meta.metas)


def test_group_broadcasts_and_a_missing_peer_times_out_instead_of_hanging() -> None:
    groups = _form_group(3, timeout_s=2.0)
    sent = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    received = [sent.clone(), torch.zeros_like(sent), torch.zeros_like(sent)]
    threads = [threading.Thread(target=g.broadcast_, args=(t, "test")) for g, t in zip(groups, received)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(r, sent) for r in received)
    # Rank 0 sends alone (the engines never call): it must give up at its timeout, not wait forever.
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="timeout_s=2.0"):
        groups[0].broadcast_(torch.zeros(1 << 20, dtype=torch.uint8), "lonely bucket")
    assert time.monotonic() - start < 10
    # The sequence can no longer be trusted: later broadcasts refuse at once.
    with pytest.raises(WeightSyncError, match="broke earlier"):
        groups[0].broadcast_(sent, "next bucket")


def test_joining_times_out_when_an_engine_never_comes() -> None:
    store, port = host_store("127.0.0.1", 1.0)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="not every member joined"):
        WeightGroup.join("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=1.0, store=store)
    assert time.monotonic() - start < 10


def test_nccl_push_reaches_every_engine_and_stale_buckets_keep_the_group_in_step(model_dir: Path) -> None:
    engines = [NativeEngine(str(model_dir), fp8=True, device="cpu") for _ in range(2)]
    service = WeightSyncService(engines, _nccl_cfg())
    assert isinstance(service.transport, NcclTransport)
    for version, seed in ((1, 1), (2, 2)):
        state = perturbed_fp8_state(model_dir, seed)
        stats = service.push(state, version=version)
        assert stats.num_buckets >= 2 and stats.num_checked > 0  # 1 MiB buckets: several broadcasts
        assert stats.bytes == sum(t.numel() * t.element_size() for _, t in state)
        for engine in engines:
            assert engine.health().weight_version == version
            held = engine.read_weights([n for n, _ in state])
            assert all(same_bytes(t, held[n]) for n, t in state)
    with pytest.raises(ValueError, match="pushes must increase"):
        service.push(state, version=2)
    # A second service (another sender, a new group) pushing an older version: the engines receive the
    # bucket, then refuse it; nothing is loaded and the same group serves the next push.
    source = TensorSource(perturbed_fp8_state(model_dir, 3))
    stale = WeightSyncService(engines, _nccl_cfg())
    with pytest.raises(StaleWeightsError, match="version 1 refused"):
        stale.push_from(source, fp8=True, version=1)
    assert all(same_bytes(t, engines[0].read_weights([n])[n]) for n, t in state)
    group = engines[0]._receiver.group
    source.named = state = perturbed_fp8_state(model_dir, 4)
    assert stale.push_from(source, fp8=True, version=3).version == 3
    assert engines[0]._receiver.group is group  # not re-formed: the stale bucket kept it in step
    assert all(same_bytes(t, engines[1].read_weights([n])[n]) for n, t in state)
    # Closed (what stop_actors asks before an engine actor exits): its side of the group is shut down.
    engines[0].close()
    assert engines[0]._receiver.group is None
    with pytest.raises(RuntimeError, match="not in the weight group"):
        engines[0].update_weights_from_distributed(4, 0, 1, [], [])
    engines[0].close()  # twice is fine


class _SilentEngine:
    """An engine that joins the group, then never receives (a hung or dead peer)."""

    def __init__(self, engine: NativeEngine) -> None:
        self.engine = engine

    def health(self) -> EngineHealth:
        return self.engine.health()

    def init_weights_update_group(self, *args: Any) -> None:
        self.engine.init_weights_update_group(*args)

    def update_weights_from_distributed(self, *args: Sequence[Any]) -> None:
        return None


def test_a_peer_that_stops_receiving_fails_the_push_within_the_timeout(model_dir: Path) -> None:
    silent = _SilentEngine(NativeEngine(str(model_dir), fp8=True, device="cpu"))
    service = WeightSyncService([silent], _nccl_cfg(timeout_s=2.0))
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="bucket 0 of version 1"):
        service.push(perturbed_fp8_state(model_dir, 1), version=1)
    assert time.monotonic() - start < 15


class _FailingLoadEngine(_SilentEngine):
    """An engine that receives each bucket, then fails to load it: the sender's broadcast completed, as NCCL's
    can with a dead receiver (seen on two H200s), so only the driver sees the push fail."""

    def update_weights_from_distributed(self, *args: Sequence[Any]) -> None:
        self.engine.update_weights_from_distributed(*args)
        raise RuntimeError("engine lost its weights while loading")


def test_a_push_failed_on_the_driver_breaks_the_senders_group(model_dir: Path) -> None:
    failing = _FailingLoadEngine(NativeEngine(str(model_dir), fp8=True, device="cpu"))
    service = WeightSyncService([failing], _nccl_cfg(timeout_s=5.0))
    source = TensorSource(perturbed_fp8_state(model_dir, 1))
    with pytest.raises(RuntimeError, match="lost its weights"):
        service.push_from(source, fp8=True, version=1)
    # The sender's own broadcast succeeded; without the driver's word it would go on broadcasting into a group
    # whose collective sequence nobody can vouch for.
    source.export_broadcast_buckets(True, 1 << 20, 2)
    with pytest.raises(WeightSyncError, match="broke earlier.*bucket 0 of version 1: RuntimeError"):
        source.broadcast_bucket(0, 5.0)


def test_the_transport_name_makes_an_nccl_transport() -> None:
    transport = make_transport(_nccl_cfg(), ranks_per_engine=2)
    assert isinstance(transport, NcclTransport) and transport.ranks_per_engine == 2
    with pytest.raises(ValueError, match="ranks_per_engine=0"):
        NcclTransport(ranks_per_engine=0)


def test_nccl_is_auto_for_native_engines_on_gpus_of_their_own_and_refused_for_colocated_ones() -> None:
    nccl = RlStageConfig.model_validate({"weight_sync": {"transport": "nccl"}})
    assert resolve_transport(nccl, colocate=False) == "nccl"  # CPU (gloo), or engines on GPUs of their own
    with pytest.raises(ValueError, match="cannot connect two processes on one GPU"):
        resolve_transport(nccl, colocate=True, on_gpu=True)
    auto = RlStageConfig.model_validate({})
    assert resolve_transport(auto, colocate=False, on_gpu=True) == "nccl"
    assert resolve_transport(auto, colocate=False, on_gpu=False) == "object_store"  # CPU: as before
    sglang = RlStageConfig.model_validate(
        {"rollout": {"backend": "sglang"}, "weight_sync": {"self_check_layers": 0}}
    )
    assert resolve_transport(sglang, colocate=False, on_gpu=True) == "object_store"  # its NCCL join never ran


@pytest.mark.gpu
def test_planned_pushes_reach_the_emulated_fp8_layers_of_an_eager_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the second push on, a bucket laid out as before is copied by a plan's Triton kernel, which autograd
    does not see; the k and v projections here (N = 8) are too narrow for the FP8 GEMM and run on the cached
    dequantized weight, which kept the first planned push's values while the engine reported the new version
    (found on an H200). After each push the engine must sample what an engine given those weights by a first,
    tensor-by-tensor load samples."""
    import infir2_rl.weight_sync.receiver as receiver_module
    from infir2_rl.types import GenerateRequest, SamplingParams

    model = init_model(tmp_path / "m", "tiny", seed=0, num_attention_heads=16, num_key_value_heads=1)
    request = [
        GenerateRequest("a", list(range(5, 30)), n=2, params=SamplingParams(max_new_tokens=16), seed=1)
    ]

    def engine() -> NativeEngine:
        return NativeEngine(
            str(model), fp8=True, dtype="float32", device="cuda", decode_path="eager", cuda_graphs=False
        )

    def push(to: NativeEngine, version: int, state: list[tuple[str, torch.Tensor]]) -> None:
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in state])
        monkeypatch.setattr(receiver_module, "receive_flat", lambda group, meta, device: flat.clone())
        metas = [(t.dtype, tuple(t.shape)) for _, t in state]
        to.update_weights_from_distributed(version, 0, 1, [n for n, _ in state], metas)

    pushed = engine()
    pushed.generate(request)
    for version, seed in enumerate((1, 2, 3), start=1):
        state = [
            (n, t.cuda().contiguous()) for n, t in perturbed_fp8_state(model, seed) if n != "lm_head.weight"
        ]
        push(pushed, version, state)
        assert bool(pushed._receiver._plans), "a bucket laid out as the last one takes the copy plan"
        got = pushed.generate(request)
        fresh = engine()
        push(fresh, 1, state)  # its first push: loaded tensor by tensor
        want = fresh.generate(request)
        assert [s.response_ids for s in got] == [s.response_ids for s in want], f"push {version}"
        assert [s.logprobs for s in got] == [s.logprobs for s in want], f"push {version}"
