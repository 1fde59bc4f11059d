"""SGLang rollout engine: one SGLang HTTP server per engine actor, driven through its native API.

NOT RUN: SGLang cannot be installed on the machine this was written on (no GPU). The request and response
translation below is unit-tested as pure functions; the server process, CUDA IPC weight updates and
memory release were never exercised. Treat the first GPU run as the test. The endpoint names and
payloads were checked against SGLang's source (sgl-project/sglang):

* ``python/sglang/srt/entrypoints/http_server.py``: ``GET /health``, ``POST /generate`` (body
  ``io_struct.GenerateReqInput``), ``POST /update_weights_from_tensor`` (``UpdateWeightsFromTensorReqInput``:
  ``serialized_named_tensors`` one entry per TP rank, ``load_format``, ``flush_cache``,
  ``abort_all_requests``, ``weight_version``), ``POST /update_weights_from_distributed`` (``names``,
  ``dtypes``, ``shapes``, ``group_name``, ...; NCCL, not wired here), ``POST /get_weights_by_name``
  (``name``, ``truncate_size``), ``POST /abort_request`` (``rid`` / ``abort_all``),
  ``POST /release_memory_occupation`` and ``/resume_memory_occupation`` (optional ``tags``; the server
  must run with ``--enable-memory-saver``).
* ``python/sglang/srt/sampling/sampling_params.py``: ``max_new_tokens``, ``stop_token_ids``,
  ``temperature``, ``top_p``, ``top_k`` (-1 = whole vocabulary), ``n``, ``sampling_seed``,
  ``no_stop_trim``; temperature 0 means greedy.
* Response of ``/generate`` with ``return_logprob``: ``meta_info.output_token_logprobs`` is a list of
  ``[logprob, token_id, text]``, ``meta_info.finish_reason.type`` is "stop", "length" or "abort"
  (slime reads the same fields).
* ``update_weights_from_tensor`` payloads are ``MultiprocessingSerializer.serialize(named_tensors,
  output_str=True)`` (``sglang.srt.utils``): torch's ForkingPickler, i.e. CUDA IPC handles for GPU
  tensors. So the engine actor must be colocated with the server's GPU and move tensors there first.

Log-probs: SGLang returns ``log_softmax(logits / temperature)`` of the sampled token (before top-k/top-p)
unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set, which this launcher never sets; that
matches the native engine and the trainer. ``sampling_seed`` is only honoured by servers started with
``--enable-deterministic-inference``. FP8: the server loads the cast checkpoint (``quantization_config``
quant_method fp8, e4m3, weight_block_size [128, 128]) and weight updates copy FP8 bytes + scales as sent.
SGLang fuses q/k/v and gate/up projections, so ``read_weights`` of unfused HF names may fail there.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from infir2_rl.engines.sampling import row_key
from infir2_rl.types import EngineHealth, FinishReason, GenerateRequest, Sample, TensorMap, WeightBucket
from infir2_rl.weight_sync.receiver import VersionGate


def launch_command(model_path: str, tensor_parallel_size: int, port: int, memory_saver: bool) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path]
    cmd += ["--tp", str(tensor_parallel_size), "--host", "127.0.0.1", "--port", str(port)]
    return cmd + (["--enable-memory-saver"] if memory_saver else [])


def generate_payload(request: GenerateRequest) -> dict[str, Any]:
    """``/generate`` body for all n samples of a request: a batch of n copies, each with its own seed."""
    p = request.params
    sampling = [
        {
            "max_new_tokens": p.max_new_tokens,
            "stop_token_ids": list(p.stop_token_ids),
            "temperature": 0.0 if p.greedy else p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            # Keep the stop token in the output, as the native engine does.
            "no_stop_trim": True,
            "sampling_seed": row_key(request.seed, i),
        }
        for i in range(request.n)
    ]
    return {
        "input_ids": [list(request.prompt_ids) for _ in range(request.n)],
        "sampling_params": sampling,
        "return_logprob": True,
        "rid": [f"{request.request_id}-{i}" for i in range(request.n)],
    }


def _finish_reason(meta: dict[str, Any]) -> FinishReason:
    kind = (meta.get("finish_reason") or {}).get("type")
    if kind in ("stop", "length", "abort"):
        return kind  # type: ignore[no-any-return]
    raise ValueError(
        f"SGLang finish_reason {meta.get('finish_reason')!r}: expected type stop, length or abort"
    )


def parse_generate_response(
    request: GenerateRequest, outputs: list[dict[str, Any]] | dict[str, Any]
) -> list[Sample]:
    """Samples from a ``/generate`` response (a list of n outputs, or one output when n == 1)."""
    outs = outputs if isinstance(outputs, list) else [outputs]
    if len(outs) != request.n:
        raise ValueError(
            f"SGLang returned {len(outs)} outputs for request {request.request_id} with n={request.n}"
        )
    samples = []
    for i, out in enumerate(outs):
        meta = out["meta_info"]
        pairs = meta.get("output_token_logprobs") or []
        samples.append(
            Sample(
                request_id=request.request_id,
                index=i,
                prompt_ids=list(request.prompt_ids),
                response_ids=[int(item[1]) for item in pairs],
                logprobs=[float(item[0]) for item in pairs],
                finish_reason=_finish_reason(meta),
            )
        )
    return samples


def update_tensor_payload(
    bucket: WeightBucket, tensor_parallel_size: int, serialize: Callable[[list[tuple[str, Tensor]]], str]
) -> dict[str, Any]:
    """``/update_weights_from_tensor`` body: the bucket serialized once per TP rank; cache flushed after the last."""
    named = list(zip(bucket.names, bucket.tensors))
    return {
        "serialized_named_tensors": [serialize(named) for _ in range(tensor_parallel_size)],
        "flush_cache": bucket.is_last,
        "weight_version": str(bucket.version),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SglangEngine:
    """An ``EngineBackend`` backed by an SGLang server subprocess (see the module docstring: never run)."""

    def __init__(
        self,
        model_path: str,
        *,
        fp8: bool,
        tensor_parallel_size: int = 1,
        port: int | None = None,
        memory_saver: bool = True,
        startup_timeout_s: float = 900.0,
        request_timeout_s: float = 3600.0,
    ) -> None:
        if importlib.util.find_spec("sglang") is None:
            raise RuntimeError(
                "rollout.backend=sglang but SGLang is not installed in this environment: use the GPU image in"
                " docker/ (pip install 'sglang[all]') or set rollout.backend=native"
            )
        self.fp8, self.tp = fp8, tensor_parallel_size
        self.model_path = model_path
        self.port = port or _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.request_timeout_s = request_timeout_s
        self._gate = VersionGate()
        self._process = subprocess.Popen(
            launch_command(model_path, tensor_parallel_size, self.port, memory_saver)
        )
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"SGLang server exited with code {self._process.returncode} during startup"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=10) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        raise RuntimeError(f"SGLang server on port {self.port} not healthy after {timeout_s} s")

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(
            self.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=self.request_timeout_s) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip() else None

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        # Concurrent HTTP requests so the server batches them (continuous batching on its side).
        with ThreadPoolExecutor(max_workers=max(1, min(64, len(requests)))) as pool:
            outputs = list(pool.map(lambda r: self._post("/generate", generate_payload(r)), requests))
        return [s for req, out in zip(requests, outputs) for s in parse_generate_response(req, out)]

    def update_weights(self, bucket: WeightBucket) -> None:
        self._gate.admit(bucket)
        from sglang.srt.utils import MultiprocessingSerializer

        # CUDA IPC handles: the tensors must live on this actor's GPU until the server has copied them.
        on_gpu = WeightBucket(
            bucket.version, bucket.index, bucket.num_buckets, bucket.names, [t.cuda() for t in bucket.tensors]
        )
        result = self._post(
            "/update_weights_from_tensor",
            update_tensor_payload(
                on_gpu, self.tp, lambda nt: MultiprocessingSerializer.serialize(nt, output_str=True)
            ),
        )
        if not result or not result.get("success", False):
            raise RuntimeError(f"SGLang refused bucket {bucket.index} of version {bucket.version}: {result}")
        self._gate.commit(bucket)

    def read_weights(self, names: Sequence[str]) -> dict[str, Tensor]:
        out = TensorMap()
        for name in names:
            values = self._post("/get_weights_by_name", {"name": name, "truncate_size": 1 << 40})
            out[name] = torch.tensor(values, dtype=torch.float32)
        return out

    def abort(self) -> None:
        self._post("/abort_request", {"abort_all": True})

    def health(self) -> EngineHealth:
        alive = self._process.poll() is None
        return EngineHealth(
            ok=alive, weight_version=self._gate.version, fp8=self.fp8, device=f"sglang tp={self.tp}"
        )

    def release_memory(self) -> None:
        self._post("/release_memory_occupation", {})

    def resume_memory(self) -> None:
        self._post("/resume_memory_occupation", {})

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=60)
