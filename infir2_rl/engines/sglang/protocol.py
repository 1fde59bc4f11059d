"""What our SGLang engine sends and reads, as pure functions: the server's command line, the request bodies
of its HTTP endpoints, and the parsing of its replies. Pinned to SGLang ``SGLANG_VERSION``; the contract
tests (``tests/test_sglang_contract.py``) hold every body here against that wheel's own classes and source.

Facts of SGLang 0.5.15.post1 this module relies on (files under ``python/sglang/srt/``):

* ``server_args.py``: every ``ServerArgs`` field is a flag named after it (``tp_size`` -> ``--tp-size``;
  there is no ``--tp``). ``--mem-fraction-static`` is the share of the GPU SGLang takes for weights
  and KV cache (default: chosen from the GPU size, ~0.8-0.9, which starves a colocated trainer), counted
  against the memory free when the server starts (``model_runner.py``): what the trainer holds then is
  not SGLang's to take;
  ``--base-gpu-id`` is the first visible GPU its TP ranks use (rank r on ``base + r``);
  ``--enable-memory-saver`` makes ``/release_memory_occupation`` possible; ``sampling_seed`` is only used
  with ``--enable-deterministic-inference`` (then per-request int64 seeds, default 42; 0.5.5 packed them as
  int32, so we keep seeds below 2**31 for either).
* ``entrypoints/http_server.py``: ``POST /generate`` (``GenerateReqInput``); weight endpoints answer
  ``{"success": bool, "message": str}`` with HTTP 400 on failure; ``/generate`` and memory endpoints answer
  400 with ``{"error": {"message": ...}}``; ``/flush_cache`` answers plain text (400 while requests run,
  unless ``?timeout=S`` lets it wait that long for them). ``GET /health_generate`` generates one token and
  waits while generation is paused (503 after 20 s); ``/health`` may generate one too (``environ.py``).
* ``managers/io_struct.py``: the request classes (field names used below). ``UpdateWeightsFromTensorReqInput
  .serialized_named_tensors`` holds one base64 string per TP rank; rank r deserializes entry r.
* ``model_executor/model_runner.py`` with ``load_format="flattened_bucket"``: the payload of a rank is
  ``{"flattened_tensor": uint8 tensor, "metadata": [obj with name, shape, dtype, start_idx, end_idx, numel]}``;
  tensors are the byte ranges of the flat buffer, packed back to back (``weight_sync/tensor_bucket.py``).
  ``/update_weights_from_distributed`` with that format receives one NCCL broadcast of the same layout.
* ``utils/common.py``: payloads are read with ``SafeUnpickler``, which accepts only torch/builtins/types and a
  few SGLang modules: nothing of ours may be pickled into them.
* ``managers/scheduler_components/weight_updater.py``: ``release_memory_occupation`` asserts an idle server;
  memory tags are ``weights``, ``kv_cache`` and ``cuda_graph`` (none = all). Released weights come back as
  garbage unless re-sent, so weights are resumed first, the push refills them, then the KV cache. CUDA-graph
  memory is under the memory saver only with ``SGLANG_MEMORY_SAVER_CUDA_GRAPH`` set in the server's
  environment (``runner_backend/full_cuda_graph_backend.py``), so a colocated server is started with it
  (``server_env``); without it releasing ``cuda_graph`` freed nothing.
* ``managers/tokenizer_manager.py``: a prompt of >= context-length tokens fails the whole ``/generate`` call
  with a 400, and so does prompt + ``max_new_tokens`` > context length; the scheduler is stricter
  (``INPUT_MARGIN`` below).
* ``/generate`` replies: ``meta_info.output_token_logprobs`` = ``[[logprob, token_id, text|None], ...]``,
  ``meta_info.finish_reason`` = ``{"type": "stop"|"length"|"abort", ...}`` (``schedule_batch.py``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from infir2_rl.engines.sampling import row_key
from infir2_rl.types import FinishReason, GenerateRequest, Sample

SGLANG_VERSION = "0.5.15.post1"
# Memory tags of /release_memory_occupation (sglang/srt/constants.py).
TAG_WEIGHTS, TAG_KV_CACHE, TAG_CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
# Seeds stay below 2**31: int64 in 0.5.15's scheduler, int32 in 0.5.5's.
SEED_LIMIT = 1 << 31
# Share of the engine's GPU share given to SGLang's static pool (weights + KV cache); the rest is for its
# activations and CUDA graphs, as SGLang's own default leaves ~10-20 % of a whole GPU.
STATIC_SHARE_OF_ENGINE_SHARE = 0.85


class SglangError(RuntimeError):
    """SGLang refused a request; the message carries its own reason."""


@dataclass(frozen=True)
class LaunchOptions:
    """How one SGLang server is started (``launch_command``)."""

    model_path: str
    port: int
    tensor_parallel_size: int = 1
    # Fraction of each GPU this engine may use (colocated with a trainer); None = SGLang's default (own GPUs).
    gpu_share: float | None = None
    # Index, among the GPUs this process sees, of TP rank 0's GPU.
    base_gpu_id: int = 0
    # Honour per-request seeds (batch-invariant kernels; slower).
    deterministic: bool = False
    random_seed: int | None = None
    context_length: int | None = None
    # rollout.max_batch_size: the most requests the server runs at once; None = SGLang's own limit.
    max_running_requests: int | None = None
    # The weights' and activations' dtype ("auto": SGLang's choice from the checkpoint).
    dtype: str = "auto"


def launch_command(opts: LaunchOptions) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", opts.model_path]
    cmd += ["--tp-size", str(opts.tensor_parallel_size), "--base-gpu-id", str(opts.base_gpu_id)]
    cmd += ["--host", "127.0.0.1", "--port", str(opts.port)]
    if opts.gpu_share is not None:
        if not 0 < opts.gpu_share <= 1:
            raise ValueError(f"gpu_share={opts.gpu_share}: must be in (0, 1], the engine's share of its GPU")
        fraction = round(opts.gpu_share * STATIC_SHARE_OF_ENGINE_SHARE, 3)
        # Colocated: SGLang must hand its memory back while the trainer runs.
        cmd += ["--mem-fraction-static", str(fraction), "--enable-memory-saver"]
    if opts.deterministic:
        cmd += ["--enable-deterministic-inference"]
    if opts.random_seed is not None:
        cmd += ["--random-seed", str(opts.random_seed)]
    if opts.context_length is not None:
        cmd += ["--context-length", str(opts.context_length)]
    if opts.max_running_requests is not None:
        cmd += ["--max-running-requests", str(opts.max_running_requests)]
    if opts.dtype != "auto":
        cmd += ["--dtype", opts.dtype]
    return cmd


# Where a colocated server releases memory: its CUDA graphs too (see the module docstring).
MEMORY_SAVER_ENV = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}


def server_env(opts: LaunchOptions, base: dict[str, str]) -> dict[str, str]:
    """The server process's environment: ``base`` plus, when colocated (the memory saver on), MEMORY_SAVER_ENV."""
    return {**base, **MEMORY_SAVER_ENV} if opts.gpu_share is not None else dict(base)


def sampling_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request, in SGLang's range (see ``SEED_LIMIT``)."""
    return row_key(seed, index) % SEED_LIMIT


# SGLang's scheduler (0.5.15: managers/tp_worker.get_worker_info, utils.validate_input_length and
# scheduler.init_req_max_new_tokens) allows requests of max_req_len = context_length - 1 tokens; it aborts a
# prompt of max_req_len - INPUT_MARGIN tokens or more (which fails the whole /generate call the request is in)
# and cuts max_new_tokens to max_req_len - prompt - 1 (the KV pool's own bound aside).
INPUT_MARGIN = 5


def max_new_tokens_within(prompt_len: int, max_new_tokens: int, context_length: int) -> int | None:
    """``max_new_tokens`` SGLang's scheduler keeps for a prompt of ``prompt_len`` tokens, or None when it
    refuses the prompt (see INPUT_MARGIN)."""
    max_req_len = context_length - 1
    if prompt_len >= max_req_len - INPUT_MARGIN:
        return None
    return min(max_new_tokens, max_req_len - prompt_len - 1)


def fit_to_context(request: GenerateRequest, context_length: int) -> int | None:
    """``max_new_tokens`` SGLang will accept for this request, or None when its prompt alone is too long."""
    return max_new_tokens_within(len(request.prompt_ids), request.params.max_new_tokens, context_length)


def generate_payload(request: GenerateRequest, max_new_tokens: int | None = None) -> dict[str, Any]:
    """``/generate`` body for all n samples of a request: a batch of n copies, each with its own seed."""
    p = request.params
    sampling = [
        {
            "max_new_tokens": p.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "stop_token_ids": list(p.stop_token_ids),
            # 0 is greedy in SGLang (top_k 1, log-probs of the temperature-1 softmax).
            "temperature": 0.0 if p.greedy else p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            # Keep the stop token in the output, as the native engine does.
            "no_stop_trim": True,
            "sampling_seed": sampling_seed(request.seed, i),
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


def refused_samples(request: GenerateRequest) -> list[Sample]:
    """The n samples of a request that was not sent (prompt longer than the context): empty, "abort"."""
    return [
        Sample(request.request_id, i, list(request.prompt_ids), [], [], "abort") for i in range(request.n)
    ]


def error_message(status: int, body: str) -> str:
    """SGLang's reason from an error reply: ``{success, message}``, ``{error: {message}}`` or plain text."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return f"HTTP {status}: {body.strip() or '(empty body)'}"
    if isinstance(parsed, dict):
        if isinstance(parsed.get("error"), dict) and "message" in parsed["error"]:
            return f"HTTP {status}: {parsed['error']['message']}"
        if "message" in parsed:
            return f"HTTP {status}: {parsed['message']}"
    return f"HTTP {status}: {body.strip()}"


# ---------------------------------------------------------------- weights
def flat_bytes(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors' bytes back to back in one uint8 tensor: SGLang's flattened-bucket layout (no padding).

    The NCCL path broadcasts exactly this buffer (``update_weights_from_distributed`` builds the same layout
    from names/dtypes/shapes on every rank)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def flattened_bucket(
    names: Sequence[str], tensors: Sequence[Tensor], metadata_cls: Callable[..., Any]
) -> dict[str, Any]:
    """One TP rank's ``load_format="flattened_bucket"`` payload; ``metadata_cls`` is SGLang's
    ``FlattenedTensorMetadata`` in the engine (a class its ``SafeUnpickler`` accepts)."""
    metadata, start = [], 0
    for name, t in zip(names, tensors):
        numel = t.numel() * t.element_size()
        metadata.append(
            metadata_cls(
                name=name, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=start + numel, numel=numel
            )
        )
        start += numel
    return {"flattened_tensor": flat_bytes(tensors), "metadata": metadata}


def update_tensor_payload(serialized_per_rank: Sequence[str], version: int, is_last: bool) -> dict[str, Any]:
    """``/update_weights_from_tensor`` body: one serialized flattened bucket per TP rank (rank r reads entry r);
    the radix cache is flushed after the last bucket of a push (cached prefixes hold old-weight KV)."""
    return {
        "serialized_named_tensors": list(serialized_per_rank),
        "load_format": "flattened_bucket",
        "flush_cache": is_last,
        "weight_version": str(version),
    }


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang resolves with ``getattr(torch, name)``."""
    return str(dtype).removeprefix("torch.")


def update_distributed_payload(
    names: Sequence[str], tensors_meta: Sequence[tuple[torch.dtype, Sequence[int]]], version: int, is_last: bool,
    group_name: str,
) -> dict[str, Any]:  # fmt: skip
    """``/update_weights_from_distributed`` body for one bucket broadcast as ``flat_bytes`` from group rank 0."""
    return {
        "names": list(names),
        "dtypes": [dtype_name(d) for d, _ in tensors_meta],
        "shapes": [list(s) for _, s in tensors_meta],
        "group_name": group_name,
        "load_format": "flattened_bucket",
        "flush_cache": is_last,
        "weight_version": str(version),
    }


def nccl_group_layout(num_engines: int, tensor_parallel_size: int) -> tuple[int, list[int]]:
    """World size of the trainer -> engines NCCL group and each engine's ``rank_offset``: the trainer's
    sending rank is 0, engine i's TP rank r is ``1 + i * tp + r``."""
    world = 1 + num_engines * tensor_parallel_size
    return world, [1 + i * tensor_parallel_size for i in range(num_engines)]


def init_group_payload(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
) -> dict[str, Any]:
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def checksum_of(reply: dict[str, Any], tensor_parallel_size: int) -> str:
    """SGLang's ``/weights_checker`` ``checksum`` reply -> the engine's checksum, after checking every TP rank
    answered (each rank hashes its own dequantized shards)."""
    ranks = reply.get("ranks") or []
    if len(ranks) != tensor_parallel_size or not reply.get("per_engine_checksum"):
        raise SglangError(
            f"/weights_checker answered for {len(ranks)} ranks of {tensor_parallel_size}: {str(reply)[:300]}"
        )
    return str(reply["per_engine_checksum"])
