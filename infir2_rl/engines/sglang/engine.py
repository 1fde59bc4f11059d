"""SGLang rollout engine: one SGLang HTTP server per engine actor, driven through its native API.

NOT RUN: SGLang cannot be installed as a working server on the machines this was written on. The request
bodies and reply parsing (``protocol.py``) are held against the pinned SGLang wheel's own classes by
``tests/test_sglang_contract.py``; the call sequences below (memory handover, weight pushes, errors) are
tested against a fake server in ``tests/test_engine_sglang.py``. The GPU parts (CUDA IPC payloads, the
server itself) were never exercised: treat the first GPU run as their test.

Weight updates (``update_weights``, object store or CUDA IPC transport into this actor): for each TP rank r
the bucket is copied into one flat buffer on the actor's cuda:(base_gpu_id + r), the GPU that rank runs on,
and serialized with SGLang's ``MultiprocessingSerializer`` after ``monkey_patch_torch_reductions`` (the CUDA
IPC handle then names the GPU by UUID, so the server's rank maps it to its own device index); one request
carries the per-rank payloads with ``load_format="flattened_bucket"``. The buffers are dropped and
``torch.cuda.ipc_collect()`` run once the server answered. Generation is paused around a push
(``/pause_generation`` mode ``abort``: a push only comes between rollouts) and continued after its last bucket.

NCCL (engines on GPUs of their own): ``init_weights_update_group`` joins the trainer's group (layout from
``protocol.nccl_group_layout``), then for every bucket the trainer-side transport calls
``update_weights_from_distributed`` on each engine (it blocks in SGLang until the broadcast is done) and,
while those calls run, broadcasts ``protocol.flat_bytes(bucket.tensors)`` from group rank 0.

Memory handover (colocated, ``gpu_share`` set): ``release_memory`` pauses generation, flushes the radix
cache and releases every tag; ``resume_memory`` brings back the weights only; the push refills them (their
content was dropped) and its last bucket brings back the KV cache and CUDA graphs. ``generate`` refuses to run
on weights that were released and not pushed again.

Self-check: SGLang keeps fused, TP-sharded tensors under its own names, and 0.5.15's Qwen2/Qwen3 models do not
implement ``get_weights_by_name``, so ``read_weights`` cannot return what the trainer sent (the weight-sync
service's byte comparison needs ``weight_sync.self_check_layers=0`` with this backend; the config says so).
Instead, after each push's last bucket, ``/weights_checker`` (action ``checksum``) must answer for every TP
rank, and a checksum equal to the previous version's is logged as a warning (the push changed nothing;
legitimate only when the optimizer step was skipped).

Log-probs: SGLang returns ``log_softmax(logits / temperature)`` of the sampled token (before top-k/top-p)
unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB``, which this launcher never sets; that matches
the native engine and the trainer.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from infir2_rl.engines.sglang import protocol as P
from infir2_rl.fp8.cast_checks import config_of, is_blockwise_fp8
from infir2_rl.types import EngineHealth, GenerateRequest, Sample, WeightBucket
from infir2_rl.weight_sync.receiver import VersionGate
from infir2_rl.weight_sync.transport import IpcBucket, open_ipc_bucket

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SglangServer:
    """The ``sglang.launch_server`` subprocess of one engine."""

    def __init__(self, opts: P.LaunchOptions, startup_timeout_s: float) -> None:
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            raise RuntimeError(
                "rollout.backend=sglang but SGLang is not installed in this environment: use the GPU image"
                " (docker/README.md) or set rollout.backend=native"
            )
        self.base_url = f"http://127.0.0.1:{opts.port}"
        self.process = subprocess.Popen(P.launch_command(opts), env=P.server_env(opts, dict(os.environ)))
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"SGLang server exited with code {self.process.returncode} during startup")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=10) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        self.close()
        raise RuntimeError(f"SGLang server on port {opts.port} not healthy after {startup_timeout_s} s")

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


# How long /flush_cache may wait for the batch a pause aborted to leave SGLang's scheduler.
FLUSH_TIMEOUT_S = 30

_NO_READ_BACK = (
    "the SGLang engine cannot read back HF-named tensors (SGLang fuses and shards them, and its Qwen models"
    " lack get_weights_by_name): set weight_sync.self_check_layers=0; every push is checked with SGLang's"
    " /weights_checker instead"
)


class SglangEngine:
    """An ``EngineBackend`` driving one SGLang server (``server``: anything with ``base_url``, ``alive()``
    and ``close()``; ``SglangEngine.launch`` starts a real one)."""

    def __init__(
        self,
        server: Any,
        *,
        fp8: bool,
        tensor_parallel_size: int = 1,
        base_gpu_id: int = 0,
        colocated: bool = False,
        context_length: int,
        request_timeout_s: float = 3600.0,
    ) -> None:
        self.server, self.fp8, self.tp = server, fp8, tensor_parallel_size
        self.base_gpu_id, self.colocated = base_gpu_id, colocated
        self.context_length = context_length
        self.request_timeout_s = request_timeout_s
        self._gate = VersionGate()
        self._lock = threading.Lock()
        self._released: set[str] = set()
        # Weights were released (their memory content is gone) and no push has refilled them yet.
        self._weights_stale = False
        self._paused = False
        self._checksum: str | None = None
        self.group_name = "infir2_weight_sync"

    @classmethod
    def launch(
        cls, model_path: str, *, fp8: bool, tensor_parallel_size: int = 1, gpu_share: float | None = None,
        base_gpu_id: int = 0, deterministic: bool = False, startup_timeout_s: float = 900.0,
        max_running_requests: int | None = None, dtype: str = "auto",
    ) -> SglangEngine:  # fmt: skip
        """Start a server on ``model_path``; ``gpu_share`` (colocated) sets its memory fraction and memory saver.
        With ``fp8`` it must be an FP8 checkpoint (the stage config checks this before Ray starts, too)."""
        if fp8 and not is_blockwise_fp8(config_of(Path(model_path))):
            raise ValueError(
                f"{model_path}: not a blockwise FP8 checkpoint (config.json has no quantization_config with "
                "weight_block_size [128, 128]); SGLang would build BF16 linears and cast the pushed FP8 weights "
                "into them without their scales"
            )
        context_length = _context_length(model_path)
        opts = P.LaunchOptions(
            model_path, _free_port(), tensor_parallel_size, gpu_share, base_gpu_id, deterministic,
            context_length=context_length, max_running_requests=max_running_requests, dtype=dtype,
        )  # fmt: skip
        if not deterministic:
            log.warning(
                "SGLang engine without --enable-deterministic-inference: per-request seeds are ignored"
            )
        server = SglangServer(opts, startup_timeout_s)
        return cls(
            server, fp8=fp8, tensor_parallel_size=tensor_parallel_size, base_gpu_id=base_gpu_id,
            colocated=gpu_share is not None, context_length=context_length,
        )  # fmt: skip

    # ------------------------------------------------------------ HTTP
    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.server.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout_s) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as exc:
            raise P.SglangError(f"SGLang {path}: {P.error_message(exc.code, exc.read().decode())}") from None
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            return text

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._request("POST", path, body if body is not None else {})

    def _post_checked(self, path: str, body: dict[str, Any]) -> None:
        """A weight endpoint: HTTP 200 with ``success`` true, else ``SglangError`` with SGLang's message."""
        reply = self._post(path, body)
        if not isinstance(reply, dict) or not reply.get("success", False):
            raise P.SglangError(f"SGLang {path} failed: {reply}")

    # ------------------------------------------------------------ generation
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        with self._lock:
            if self._weights_stale or self._gate.pending is not None:
                raise RuntimeError(
                    "generate() on an SGLang engine whose weights were released and not pushed again, or "
                    "during an unfinished weight push: push weights first"
                )
            self._resume([P.TAG_KV_CACHE, P.TAG_CUDA_GRAPH])
            self._continue()
        sendable, budgets = [], []
        for r in requests:
            budget = P.fit_to_context(r, self.context_length)
            if budget is None:
                log.warning(
                    "request %s: prompt of %d tokens does not fit the context length %d; returned as aborted",
                    r.request_id, len(r.prompt_ids), self.context_length,
                )  # fmt: skip
            else:
                sendable.append(r)
                budgets.append(budget)
        # Concurrent HTTP requests so the server batches them (continuous batching on its side).
        with ThreadPoolExecutor(max_workers=max(1, min(64, len(sendable)))) as pool:
            replies = list(
                pool.map(lambda rb: self._post("/generate", P.generate_payload(*rb)), zip(sendable, budgets))
            )
        by_id = {r.request_id: P.parse_generate_response(r, out) for r, out in zip(sendable, replies)}
        return [s for r in requests for s in by_id.get(r.request_id, P.refused_samples(r))]

    def abort(self) -> None:
        self._post("/abort_request", {"abort_all": True})

    # ------------------------------------------------------------ weights
    def update_weights(self, bucket: WeightBucket | IpcBucket) -> None:
        if isinstance(bucket, IpcBucket):  # cuda_ipc transport: the trainer's buffer, mapped on our GPU
            bucket = open_ipc_bucket(bucket, torch.device("cuda", self.base_gpu_id))
        with self._lock:
            if self._gate.admit(bucket):
                self._open_push()
            payload = P.update_tensor_payload(
                self._serialize_per_rank(bucket), bucket.version, bucket.is_last
            )
            try:
                self._post_checked("/update_weights_from_tensor", payload)
            finally:
                del payload
                if torch.cuda.is_available():
                    torch.cuda.ipc_collect()  # the server has copied; free our per-rank buffers' IPC slots
            self._finish_bucket(bucket)

    def _serialize_per_rank(self, bucket: WeightBucket) -> list[str]:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        monkey_patch_torch_reductions()  # IPC handles carry the GPU's UUID, not this process's index
        out = []
        for rank in range(self.tp):
            device = torch.device("cuda", self.base_gpu_id + rank)
            tensors = [t.to(device, non_blocking=True) for t in bucket.tensors]
            payload = P.flattened_bucket(bucket.names, tensors, FlattenedTensorMetadata)
            torch.cuda.synchronize(device)  # written before the server's process reads it
            out.append(MultiprocessingSerializer.serialize(payload, output_str=True))
        return out

    def _open_push(self) -> None:
        self._pause()
        self._resume([P.TAG_WEIGHTS])  # a push into released weights would write to unmapped memory

    def _finish_bucket(self, bucket: WeightBucket) -> None:
        if not bucket.is_last:
            self._gate.commit(bucket)
            return
        self._weights_stale = False
        self._resume([P.TAG_KV_CACHE, P.TAG_CUDA_GRAPH])
        self._verify_push(bucket.version)
        self._gate.commit(bucket)
        self._continue()

    def _verify_push(self, version: int) -> None:
        reply = self._post("/weights_checker", {"action": "checksum"})
        checksum = P.checksum_of(reply, self.tp)
        if checksum == self._checksum:
            log.warning(
                "SGLang weights after version %d are bit-identical to the previous version's", version
            )
        self._checksum = checksum

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str | None = None,
        backend: str = "nccl",
        timeout_s: float | None = None,
    ) -> None:
        """Join the trainer's weight group (see the module docstring; call on every engine while the trainer
        joins): TP rank r of this server becomes group rank ``rank_offset + r``. ``timeout_s`` bounds the HTTP
        call (SGLang 0.5.15's request has no timeout field of its own)."""
        if group_name is not None:
            self.group_name = group_name
        body = P.init_group_payload(
            master_address, master_port, rank_offset, world_size, self.group_name, backend
        )
        reply = self._request("POST", "/init_weights_update_group", body, timeout=timeout_s)
        if not isinstance(reply, dict) or not reply.get("success", False):
            raise P.SglangError(f"SGLang /init_weights_update_group failed: {reply}")

    def update_weights_from_distributed(
        self, version: int, index: int, num_buckets: int, names: Sequence[str], metas: Sequence[tuple[torch.dtype, Sequence[int]]]
    ) -> None:  # fmt: skip
        """Receive one bucket by NCCL broadcast (blocks until the trainer's broadcast of it is done)."""
        marker = WeightBucket(version, index, num_buckets, list(names), [])
        with self._lock:
            if self._gate.admit(marker):
                self._open_push()
            body = P.update_distributed_payload(names, metas, version, marker.is_last, self.group_name)
            self._post_checked("/update_weights_from_distributed", body)
            self._finish_bucket(marker)

    def weight_digests(self, names: Sequence[str]) -> dict[str, Any]:
        raise NotImplementedError(_NO_READ_BACK)

    def read_weights(self, names: Sequence[str]) -> dict[str, Tensor]:
        raise NotImplementedError(_NO_READ_BACK)

    # ------------------------------------------------------------ memory and health
    def _pause(self) -> None:
        if not self._paused:
            self._post("/pause_generation", {"mode": "abort"})
            self._paused = True

    def _continue(self) -> None:
        if self._paused:
            self._post("/continue_generation", {})
            self._paused = False

    def _resume(self, tags: list[str]) -> None:
        wanted = [t for t in tags if t in self._released]
        if wanted:
            self._post("/resume_memory_occupation", {"tags": wanted})
            self._released.difference_update(wanted)

    def release_memory(self) -> None:
        if not self.colocated:
            return  # the server runs without the memory saver on GPUs of its own
        with self._lock:
            self._pause()
            # The aborted batch may still be leaving the scheduler: SGLang waits up to the timeout for idle
            # (without one it refuses at once while anything runs).
            self._request("POST", f"/flush_cache?timeout={FLUSH_TIMEOUT_S}")
            tags = [P.TAG_KV_CACHE, P.TAG_WEIGHTS, P.TAG_CUDA_GRAPH]
            self._post("/release_memory_occupation", {"tags": tags})
            self._released.update(tags)
            self._weights_stale = True

    def resume_memory(self) -> None:
        """Weights only: the push that follows refills them, and its last bucket resumes the KV cache."""
        with self._lock:
            self._resume([P.TAG_WEIGHTS])

    def health(self) -> EngineHealth:
        ok, detail = self.server.alive(), ""
        if not ok:
            detail = "server process exited"
        elif self._released:
            detail = f"memory released ({sorted(self._released)}); not probed"
        elif self._paused:  # /health_generate would wait for the pause and answer 503 after 20 s
            detail = "generation paused for a weight update; not probed"
        else:
            try:  # generates one token (waits behind running requests)
                self._request("GET", "/health_generate", timeout=60)
            except (OSError, P.SglangError) as exc:
                ok, detail = False, f"/health_generate: {exc}"
        return EngineHealth(
            ok=ok,
            weight_version=self._gate.version,
            fp8=self.fp8,
            device=f"sglang tp={self.tp}",
            detail=detail,
        )

    def close(self) -> None:
        self.server.close()


def _context_length(model_path: str) -> int:
    """The context length SGLang takes from the model's ``config.json`` (``max_position_embeddings``)."""
    config = config_of(Path(model_path))
    return int(config.get("text_config", config)["max_position_embeddings"])
