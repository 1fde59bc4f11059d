"""Weight sync: bounded buckets, versioned pushes, stale rejection, and the read-back self-check."""

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from fp8_states import perturbed_fp8_state
from torch import Tensor

from infir2_rl.config.components import WeightSyncConfig
from infir2_rl.engines.native.engine import NativeEngine
from infir2_rl.models.factory import init_model
from infir2_rl.types import StaleWeightsError, WeightBucket, WeightSyncError
from infir2_rl.weight_sync.buckets import build_buckets
from infir2_rl.weight_sync.digest import Digest
from infir2_rl.weight_sync.service import WeightSyncService, same_bytes


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """Single-threaded torch for this module (see conftest.one_thread)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


def test_buckets_are_bounded_ordered_and_keep_fp8_pairs_together() -> None:
    named = [
        ("a.weight", torch.zeros(100, dtype=torch.float32)),  # 400 B
        ("q.weight", torch.zeros(300, dtype=torch.float8_e4m3fn)),  # 300 B
        ("q.weight_scale_inv", torch.ones(2, dtype=torch.float32)),  # 8 B, must stay with q.weight
        ("big.weight", torch.zeros(2000, dtype=torch.uint8)),  # larger than a bucket: alone
        ("b.weight", torch.zeros(10, dtype=torch.float32)),
    ]
    buckets = build_buckets(named, max_bytes=700, version=5)
    # a (400) + q pair (308) > 700 closes the first bucket; big travels alone; b starts a new one.
    assert [b.names for b in buckets] == [
        ["a.weight"],
        ["q.weight", "q.weight_scale_inv"],
        ["big.weight"],
        ["b.weight"],
    ]
    assert all(b.version == 5 and b.num_buckets == 4 for b in buckets)
    assert [b.index for b in buckets] == [0, 1, 2, 3] and buckets[-1].is_last
    assert all(b.num_bytes <= 700 for b in buckets if b.names != ["big.weight"])
    merged = build_buckets(named[:3], max_bytes=10_000, version=0)
    assert len(merged) == 1 and merged[0].num_bytes == 708
    with pytest.raises(ValueError, match="appears twice"):
        build_buckets(named[:1] * 2, max_bytes=10_000, version=0)


def test_push_reaches_every_engine_and_bytes_match(model_dir: Path) -> None:
    engines = [NativeEngine(str(model_dir), fp8=True, device="cpu") for _ in range(2)]
    service = WeightSyncService(engines, WeightSyncConfig(bucket_size_mb=1, self_check_layers=2))
    state = perturbed_fp8_state(model_dir, seed=1)
    stats = service.push(iter(state), version=1)
    assert stats.version == 1 and stats.num_tensors == len(state) and stats.num_buckets >= 1
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in state)
    # 2 of the tiny model's 4 decoder layers: 7 FP8 linears x (weight + scale), q/k/v biases, 2 norms each;
    # and with layer 0's window, the tensors outside the layers.
    outside = [n for n, _ in state if ".layers." not in n]
    assert sorted(outside) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert stats.num_checked == 2 * (7 * 2 + 3 + 2) + 3 and stats.checked_engine == 0
    for engine in engines:
        assert engine.health().weight_version == 1
        held = engine.read_weights([n for n, _ in state])
        assert all(same_bytes(t, held[n]) for n, t in state)
    stats2 = service.push(iter(perturbed_fp8_state(model_dir, seed=2)), version=2)
    assert stats2.checked_engine == 1  # the self-check rotates over engines


def test_versions_must_increase_and_engines_refuse_stale_pushes(model_dir: Path) -> None:
    engine = NativeEngine(str(model_dir), fp8=True, device="cpu")
    service = WeightSyncService([engine], WeightSyncConfig())
    service.push(perturbed_fp8_state(model_dir, seed=1), version=3)
    with pytest.raises(ValueError, match="must increase"):
        service.push(perturbed_fp8_state(model_dir, seed=1), version=3)
    # A second service (e.g. a restarted driver that lost track) cannot roll the engine back either.
    with pytest.raises(StaleWeightsError):
        WeightSyncService([engine], WeightSyncConfig()).push(
            perturbed_fp8_state(model_dir, seed=2), version=2
        )
    assert engine.health().weight_version == 3


class CorruptingEngine:
    """Forwards to an engine but flips one byte of one tensor on its way in (a transport/loader fault)."""

    def __init__(self, engine: NativeEngine, victim: str) -> None:
        self.engine, self.victim = engine, victim

    def update_weights(self, bucket: WeightBucket) -> None:
        tensors = []
        for name, t in zip(bucket.names, bucket.tensors):
            if name == self.victim:
                t = t.clone()
                t.view(torch.uint8).view(-1)[0] ^= 0x01  # the sender's tensor is left intact
            tensors.append(t)
        self.engine.update_weights(
            WeightBucket(bucket.version, bucket.index, bucket.num_buckets, bucket.names, tensors)
        )

    def read_weights(self, names: Sequence[str]) -> dict[str, Tensor]:
        return self.engine.read_weights(names)

    def weight_digests(self, names: Sequence[str]) -> dict[str, Digest]:
        return self.engine.weight_digests(names)

    def health(self):  # type: ignore[no-untyped-def]
        return self.engine.health()


def test_self_check_catches_a_corrupted_tensor(model_dir: Path) -> None:
    victim = "model.layers.1.mlp.down_proj.weight"
    engine = CorruptingEngine(NativeEngine(str(model_dir), fp8=True, device="cpu"), victim)
    service = WeightSyncService([engine], WeightSyncConfig(self_check_layers=2))
    with pytest.raises(WeightSyncError, match=victim):
        service.push(perturbed_fp8_state(model_dir, seed=1), version=1)


def test_self_check_rotates_layers_until_it_finds_the_fault(model_dir: Path) -> None:
    victim = "model.layers.3.self_attn.k_proj.weight_scale_inv"
    engine = CorruptingEngine(NativeEngine(str(model_dir), fp8=True, device="cpu"), victim)
    service = WeightSyncService([engine], WeightSyncConfig(self_check_layers=2))
    service.push(perturbed_fp8_state(model_dir, seed=1), version=1)  # checks layers 0 and 1: misses it
    with pytest.raises(WeightSyncError, match=victim):
        service.push(perturbed_fp8_state(model_dir, seed=2), version=2)  # layers 2 and 3


class FailingEngine:
    """An engine whose bucket load raises ``error`` (as ``call_all`` raises for a remote one)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def update_weights(self, bucket: WeightBucket) -> None:
        raise self.error


def test_a_push_past_its_timeout_names_the_bucket_and_other_errors_pass_through(model_dir: Path) -> None:
    from ray.exceptions import GetTimeoutError

    state = perturbed_fp8_state(model_dir, seed=1)
    cfg = WeightSyncConfig(bucket_size_mb=1, timeout_s=3.0)
    with pytest.raises(WeightSyncError, match=r"version 4 hung on bucket 0 .*weight_sync.timeout_s=3.0"):
        WeightSyncService([FailingEngine(GetTimeoutError("no reply"))], cfg).push(iter(state), version=4)
    with pytest.raises(RuntimeError, match="engine crashed"):  # not a timeout: raised as it is
        WeightSyncService([FailingEngine(RuntimeError("engine crashed"))], cfg).push(iter(state), version=4)


@pytest.mark.parametrize(("engines", "layers", "k"), [(8, 28, 2), (2, 4, 2), (3, 28, 5), (1, 28, 2)])
def test_self_check_reads_back_every_tensor_of_every_engine(engines: int, layers: int, k: int) -> None:
    # With the window and the engine both stepping on every push, 8 engines x 28 layers (the 7B recipe) left
    # 14 layers of each engine never read back; the embedding and the final norm never were.
    service = WeightSyncService([object()] * engines, WeightSyncConfig(self_check_layers=k))
    outside = ["model.embed_tokens.weight", "model.norm.weight"]
    names = [outside[0]] + [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(layers)] + [outside[1]]
    pushes = engines * -(-layers // k)
    covered: dict[int, set[str]] = {e: set() for e in range(engines)}
    for n in range(pushes):
        service.num_pushes = n
        checked = service._checked_names(names)
        window = [x for x in checked if x not in outside]
        assert len(window) == k and (set(outside) <= set(checked)) == ("model.layers.0." in " ".join(window))
        covered[n % engines] |= set(checked)
    assert all(c == set(names) for c in covered.values()), {e: set(names) - c for e, c in covered.items()}


def test_fp8_tensors_survive_pickling_inside_buckets_and_tensor_maps() -> None:
    import pickle

    from infir2_rl.types import TensorMap

    w = torch.randn(3, 5).to(torch.float8_e4m3fn)
    bucket = pickle.loads(pickle.dumps(WeightBucket(2, 0, 1, ["w", "s"], [w, torch.ones(1)])))
    assert bucket.tensors[0].dtype == torch.float8_e4m3fn and same_bytes(w, bucket.tensors[0])
    assert bucket.version == 2 and bucket.names == ["w", "s"]
    back = pickle.loads(pickle.dumps(TensorMap({"w": w})))
    assert isinstance(back, TensorMap) and same_bytes(w, back["w"])
