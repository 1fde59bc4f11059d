"""The rollout-engine actor: a plain class around an ``EngineBackend``, and the one place it becomes a Ray actor.

``RolloutEngine`` is usable (and unit-tested) without Ray; ``create_engines`` applies
``ray.remote(concurrency_groups=...)(RolloutEngine).options(...)`` in the engine slots of the stage's
``Placement`` (``placement.py`` decides where engines go and what share of a GPU they take). Colocated engines hand their GPU memory over
with ``release_memory`` / ``resume_memory`` around the trainer's phases.

Actors run up to ``MAX_CONCURRENCY`` calls at once (threaded actor) so that ``abort`` and ``health``
answer while a ``generate`` runs; the backend's own lock keeps weight updates out of a running batch.
``generate`` has a concurrency group of its own with one thread (``GENERATE_GROUP``), so every call runs on
the same thread: the native engine keeps per-thread state across calls (a colocated engine re-captures its
decode graphs after each release and skips their warm-ups only on a thread that ran them before,
``engines/native/cuda_graphs.py``; torch's cuBLAS handles are per thread), and on any of the default group's
threads each new thread would pay the warm-ups again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray
from torch import Tensor

from infir2_rl.config.components import RolloutConfig
from infir2_rl.types import EngineBackend, EngineHealth, GenerateRequest, Sample, WeightBucket

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from infir2_rl.actors.placement import Placement
    from infir2_rl.config.stage import RlStageConfig

log = logging.getLogger(__name__)
# Concurrent calls per engine actor besides generate: abort/health + a waiting weight update.
MAX_CONCURRENCY = 4
GENERATE_GROUP = "generate"  # generate's concurrency group: one thread (module docstring)


def make_engine_backend(
    rollout: RolloutConfig,
    model_path: str,
    *,
    fp8: bool,
    dtype: str = "auto",
    pow2_scales: bool = False,
    device: str = "auto",
    gpu_share: float | None = None,
    true_on_policy: bool = False,
) -> EngineBackend:
    """The backend ``rollout.backend`` names, loading ``rollout.fp8_checkpoint`` when FP8 and set, else ``model_path``.

    ``fp8``: generate with blockwise FP8 W8A8 decoder linears (the RL stage's ``rollout_fp8``, from its precision).
    ``gpu_share``: the engine's share of a GPU it shares with a trainer worker (colocated), None on GPUs of its own.
    ``true_on_policy``: decode with the trainer's batch-invariant forward (native backend only).
    """
    fp8_checkpoint = rollout.fp8_checkpoint if fp8 else None
    if rollout.backend == "native":
        from infir2_rl.engines.native.engine import NativeEngine

        return NativeEngine(
            model_path,
            fp8=fp8,
            fp8_checkpoint=fp8_checkpoint,
            dtype=dtype,
            device=device,
            max_batch_size=rollout.max_batch_size,
            pow2_scales=pow2_scales,
            true_on_policy=true_on_policy,
        )
    if rollout.backend == "sglang":
        from infir2_rl.engines.sglang.engine import SglangEngine

        if true_on_policy:
            raise ValueError(
                "true_on_policy is built for rollout.backend=native only (SGLang engines: not built)"
            )

        if fp8 and pow2_scales:
            log.warning(
                "rollout.backend=sglang with trainer.fp8_pow2_scales=true: SGLang loads the trainer's FP8 weights"
                " and power-of-two scales as sent, but quantizes activations with its own FP32 amax/448 scales,"
                " so trained and sampled activations are quantized by different rules"
            )
        return SglangEngine.launch(
            fp8_checkpoint or model_path,
            fp8=fp8,
            tensor_parallel_size=rollout.tensor_parallel_size,
            gpu_share=gpu_share,
            max_running_requests=rollout.max_batch_size,
            # model.dtype "auto" is BF16 on a GPU here; SGLang's own "auto" would run an FP32 checkpoint
            # (what the SFT stages save) in FP16
            dtype="bfloat16" if dtype == "auto" else dtype,
        )
    raise ValueError(f"rollout.backend={rollout.backend!r}: use 'native' or 'sglang'")


class RolloutEngine:
    """One rollout engine (a Ray actor in runs, a plain object in tests); forwards to its backend."""

    def __init__(
        self,
        rollout: RolloutConfig,
        model_path: str,
        *,
        fp8: bool,
        dtype: str = "auto",
        pow2_scales: bool = False,
        device: str = "auto",
        engine_index: int = 0,
        gpu_share: float | None = None,
        true_on_policy: bool = False,
    ) -> None:
        # Before the backend imports transformers / huggingface_hub, which read it at import time.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.engine_index = engine_index
        self._generate_threads: set[int] = set()
        self.in_process = rollout.backend == "native"  # SGLang's model lives in its server process
        self.backend = make_engine_backend(
            rollout,
            model_path,
            fp8=fp8,
            dtype=dtype,
            pow2_scales=pow2_scales,
            device=device,
            gpu_share=gpu_share,
            true_on_policy=true_on_policy,
        )

    @ray.method(concurrency_group=GENERATE_GROUP)
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        self._generate_threads.add(threading.get_ident())
        return self.backend.generate(requests)

    def generate_thread_count(self) -> int:
        """How many threads have run ``generate`` so far (1 in an actor: its group's one thread)."""
        return len(self._generate_threads)

    def update_weights(self, bucket: WeightBucket) -> None:
        self.backend.update_weights(bucket)

    def read_weights(self, names: Sequence[str]) -> dict[str, Tensor]:
        return self.backend.read_weights(names)

    def weight_digests(self, names: Sequence[str]) -> dict[str, Any]:
        return self.backend.weight_digests(names)

    # weight_sync.transport=nccl (the protocol and argument order: weight_sync/nccl.py).
    def init_weights_update_group(self, *args: Any) -> None:
        self.backend.init_weights_update_group(*args)  # type: ignore[attr-defined]

    def update_weights_from_distributed(self, *args: Any) -> None:
        self.backend.update_weights_from_distributed(*args)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Before the actor stops (``remote.stop_actors``): the backend lets go of what it holds outside this
        process (the native engine its side of the weight group, SGLang its server)."""
        self.backend.close()

    def abort(self) -> None:
        self.backend.abort()

    def health(self) -> EngineHealth:
        return self.backend.health()

    def release_memory(self) -> None:
        self.backend.release_memory()

    def resume_memory(self) -> None:
        self.backend.resume_memory()

    def _if_backend_says(self, method: str) -> Any:
        """The backend's answer to ``method`` (no arguments), None for a backend without it."""
        answer = getattr(self.backend, method, None)
        return answer() if answer is not None else None

    def memory_wanted(self) -> int | None:
        """Free GPU bytes the last rollout's KV cache wanted (native engines on a GPU); None where the engine
        does not say (SGLang sizes its cache from its own mem_fraction_static at launch)."""
        return self._if_backend_says("memory_wanted")  # type: ignore[no-any-return]

    def kv_slots_short(self) -> int | None:
        """KV-cache slots the last rollout wanted and did not get for memory (native engines); None where the
        engine does not say."""
        return self._if_backend_says("kv_slots_short")  # type: ignore[no-any-return]

    def graph_capture_s(self) -> float | None:
        """Decode-graph capture seconds since the last call; None for a backend that does not capture."""
        return self._if_backend_says("graph_capture_s")  # type: ignore[no-any-return]

    def memory(self) -> tuple[float, float] | None:
        """(peak, reserved) GiB of this process since the last call (``metrics.logger.memory_gb``), None when
        the engine's memory is not in this process (SGLang)."""
        from infir2_rl.metrics.logger import memory_gb

        return memory_gb(reset_peak=True) if self.in_process else None


def create_engines(cfg: RlStageConfig, placement: Placement) -> list[ActorHandle]:
    """Start ``cfg.rollout.num_engines`` engine actors in the placement's engine slots (Ray must be initialised)."""
    num = cfg.rollout.num_engines
    slots = len(placement.plan.engine.bundles)
    if slots < num:
        raise ValueError(f"rollout.num_engines={num}: the placement plan has {slots} engine slots")
    return [create_engine(cfg, placement, i) for i in range(num)]


def create_engine(cfg: RlStageConfig, placement: Placement, index: int) -> ActorHandle:
    """Start engine actor ``index`` in its placement slot (also used to replace a dead one)."""
    actor_cls: Any = ray.remote(concurrency_groups={GENERATE_GROUP: 1})(RolloutEngine)  # type: ignore[call-overload]
    return actor_cls.options(
        **placement.actor_options("engine", index), max_concurrency=MAX_CONCURRENCY
    ).remote(
        cfg.rollout,
        cfg.model.path,
        dtype=cfg.model.dtype,
        fp8=cfg.rollout_fp8,
        pow2_scales=cfg.trainer.fp8_pow2_scales,
        device="cuda" if placement.plan.use_gpu else "cpu",
        engine_index=index,
        gpu_share=placement.plan.engine.gpus if placement.plan.colocate else None,
        true_on_policy=cfg.true_on_policy,
    )
