"""The native rollout engine: batched sampling on a transformers model with a KV cache, FP8 W8A8 optional.

The model is the HF causal LM (decoder linears swapped for ``Fp8InferenceLinear`` in FP8 mode, built
from the same quantizer the trainer uses). Two decode paths, one sampling rule (``sampling.py``):

* ``decode_path="runner"`` (``"auto"`` picks it on CUDA for Qwen2 models): the engine's own model runner
  (``model_runner.py``: fused QKV and gate|up sharing the HF model's tensors, ``fused_ops.py`` kernels,
  ``attention.py``), a slot KV cache (``kv_cache.py``), the decode step captured in CUDA graphs per padded
  batch size (``cuda_graphs.py``, ``cuda_graphs=False`` runs it eagerly) and continuous batching with a
  shared prefill per prompt (``scheduler.py``). On CPU it runs the same math eagerly (tests).
* ``decode_path="eager"`` (``"auto"`` on CPU: CI and the demo): the loop below over transformers'
  ``DynamicCache``, unchanged.

``true_on_policy=True`` (CUDA, BF16 model, Qwen2): the runner decodes by the trainer's batch-invariant walk
(``models/invariant.py``), so the trainer's log-probs of the samples equal the engine's bit for bit.

Why not transformers' continuous batching (checked in transformers 5.23,
``generation/continuous_batching``): ``generate_batch`` / ``ContinuousBatchingManager`` can return
per-token log-probs (``ContinuousBatchingConfig.return_logprobs``: ``log(softmax(processed scores))``
of the sampled token) and would run our FP8 linears (the model is called as a plain module on a
flattened ``[1, tokens]`` batch, and our activation quantization is per token). But it samples with
``torch.multinomial`` from the one global torch RNG seeded once per manager (``set_tp_seed``), so
samples depend on scheduling and a request cannot carry its own seed; it needs the paged attention
implementations and a background thread; and its log-prob is the log of a float32 probability (which
loses precision against ``log_softmax`` for unlikely tokens). A batched loop over ``DynamicCache``
gives per-sample seeds, exact log-probs and a simple abort in ~150 lines, so that is what this is.

The decode loop. Requests expand to rows (one per sample); rows are processed in chunks of at most
``max_batch_size``, longest prompts first. Prompts are left-padded, with ``position_ids`` counted over
real tokens only (``cumsum(mask) - 1``), so a left-padded row sees exactly the positions and keys it
would see alone. Each step feeds the last token of every live row; a row that emits one of its stop
tokens (kept in the response, finish "stop") or reaches ``max_new_tokens`` (finish "length") is
removed from the batch and from the KV cache (``DynamicCache.batch_select_indices``), so finished rows
cost nothing. ``abort()`` (thread-safe) makes the running ``generate`` return at the next step with
finish "abort" for unfinished rows. Rows do not join a running chunk (no continuous batching): a chunk
runs until its longest row ends. Shared prompt prefixes of the n samples are recomputed per row.

Weights (both paths: the runner's fused buffers are the HF modules' tensors). ``update_weights`` loads a
bucket in place through ``weight_sync.receiver.WeightReceiver`` (FP8 bytes + scales copied into the
``Fp8InferenceLinear`` buffers, other tensors cast into their parameters; versions only move forward,
older buckets raise ``StaleWeightsError``). With ``weight_sync.transport: cuda_ipc`` the bucket is an
``IpcBucket`` of handles to the colocated trainer's GPU tensors, copied GPU to GPU (an engine on CPU
refuses it and says to use ``object_store``). With ``weight_sync.transport: nccl`` the engine joins the
trainer's weight group (``init_weights_update_group``) and receives each bucket by broadcast
(``update_weights_from_distributed``; ``weight_sync/nccl.py``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from infir2_rl.engines.sampling import RowSampling, row_key, sample_tokens
from infir2_rl.types import EngineHealth, FinishReason, GenerateRequest, Sample, WeightBucket
from infir2_rl.weight_sync.broadcast import TensorMeta
from infir2_rl.weight_sync.digest import Digest
from infir2_rl.weight_sync.group import WEIGHT_GROUP_NAME
from infir2_rl.weight_sync.receiver import WeightReceiver
from infir2_rl.weight_sync.transport import IpcBucket

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Row:
    request: GenerateRequest
    index: int


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """ "auto" = bfloat16 on GPU, float32 on CPU (CPU has no fast bfloat16 matmul and tests want exact fp32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'")
    return _DTYPES[dtype]


class NativeEngine:
    """An ``EngineBackend`` on transformers (see the module docstring)."""

    def __init__(
        self,
        model_path: str,
        *,
        fp8: bool,
        fp8_checkpoint: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        max_batch_size: int = 256,
        pow2_scales: bool = False,
        decode_path: Literal["auto", "eager", "runner"] = "auto",
        cuda_graphs: bool = True,
        true_on_policy: bool = False,
    ) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from infir2_rl.fp8.checkpoint import load_fp8_model
        from infir2_rl.fp8.linear import Fp8InferenceLinear, swap_to_fp8_inference
        from infir2_rl.models.factory import load_model

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: must be >= 1")
        if fp8_checkpoint is not None and not fp8:
            raise ValueError(
                f"fp8_checkpoint={fp8_checkpoint!r} with fp8=False: drop the checkpoint or set fp8=True"
            )
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.fp8 = fp8
        self.max_batch_size = max_batch_size
        self.model_path = fp8_checkpoint or model_path
        model: nn.Module
        if fp8_checkpoint is not None:
            model = load_fp8_model(fp8_checkpoint, device=self.device, dtype=self.dtype)
        else:
            model, _ = load_model(model_path, dtype=self.dtype, device=self.device)
            if fp8:
                swap_to_fp8_inference(model, pow2_scales=pow2_scales)
        self._fp8_modules: dict[str, Fp8InferenceLinear] = {
            name: m for name, m in model.named_modules() if isinstance(m, Fp8InferenceLinear)
        }
        for m in self._fp8_modules.values():
            m.pow2_scales = pow2_scales  # activations must be quantized like the trainer's
        if fp8 and not self._fp8_modules:
            raise ValueError(
                f"model_path={self.model_path!r}: fp8=True but no decoder linear was found to swap"
            )
        self.model = model.eval()
        config: Any = model.config
        self.config = config
        self.vocab_size = int(config.vocab_size)
        self.pad_token_id = int(config.pad_token_id if config.pad_token_id is not None else 0)
        self._receiver = WeightReceiver(model)
        self._abort = threading.Event()
        # Held by generate and weight/memory changes, so weights never change under a running batch.
        self._lock = threading.RLock()
        self._released = False
        self._logged_cpu_memory_noop = False
        self.num_decode_steps = 0  # decode steps run so far (tests and progress)
        self._capture_s_read = 0.0  # what graph_capture_s last reported as the total
        self.true_on_policy = true_on_policy
        self._scheduler = self._make_scheduler(decode_path, cuda_graphs)

    def _make_scheduler(self, decode_path: str, cuda_graphs: bool) -> Any:
        """The model runner + continuous batching (CUDA graphs on GPU) for "runner", or for "auto" on CUDA
        with a Qwen2 model; None keeps the eager transformers loop below (the CPU path)."""
        if decode_path not in ("auto", "eager", "runner"):
            raise ValueError(f"decode_path={decode_path!r}: use 'auto', 'eager' or 'runner'")
        from infir2_rl.engines.native.model_runner import SUPPORTED_MODEL_TYPES, Qwen2Runner
        from infir2_rl.engines.native.scheduler import Scheduler

        if self.true_on_policy and (decode_path == "eager" or self.device.type != "cuda"):
            raise ValueError(
                f"true_on_policy needs the runner decode path on a CUDA device (got decode_path={decode_path!r},"
                f" device {self.device}): its batch-invariant kernels are CUDA-only"
            )
        if decode_path == "eager" or (decode_path == "auto" and self.device.type != "cuda"):
            return None
        if (
            self.config.model_type not in SUPPORTED_MODEL_TYPES
            and decode_path == "auto"
            and not self.true_on_policy
        ):
            logger.warning(
                "native engine: model_type %r has no graph decode runner (%s); decoding with the SLOW eager "
                "transformers loop", self.config.model_type, SUPPORTED_MODEL_TYPES,
            )  # fmt: skip
            return None
        # The runner shares (re-points) the model's tensors: weight sync reaches it.
        runner = Qwen2Runner(self.model, true_on_policy=self.true_on_policy)
        use_graphs = cuda_graphs and self.device.type == "cuda"
        return Scheduler(runner, self.max_batch_size, use_graphs, self.pad_token_id)

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        """All n samples of every request, in request order then sample index."""
        rows = [_Row(req, i) for req in requests for i in range(req.n)]
        for req in requests:
            if req.n < 1 or req.params.max_new_tokens < 1 or not req.prompt_ids:
                raise ValueError(
                    f"request {req.request_id!r}: needs n >= 1, max_new_tokens >= 1 and a non-empty prompt"
                    f" (got n={req.n}, max_new_tokens={req.params.max_new_tokens}, {len(req.prompt_ids)} prompt ids)"
                )
            if not req.params.greedy and req.params.temperature <= 0:
                raise ValueError(
                    f"request {req.request_id!r}: temperature={req.params.temperature} must be > 0"
                )
            # top_p 0 masked every token: NaN probabilities, and a garbage sample.
            if not 0 < req.params.top_p <= 1:
                raise ValueError(f"request {req.request_id!r}: top_p={req.params.top_p} must be in (0, 1]")
        if not requests:
            return []
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i].request.prompt_ids))
        results: dict[int, Sample] = {}
        with self._lock:
            # Cleared once this call holds the engine: an abort() for a call still running is not undone by the
            # next one that waits for it.
            self._abort.clear()
            if self._released:
                raise RuntimeError("generate() called after release_memory(): call resume_memory() first")
            if (pending := self._receiver.gate.pending) is not None:
                # Buckets load as they arrive: the model holds some of the new version and some of the old.
                raise RuntimeError(
                    f"generate() during an unfinished weight push of version {pending} (the engine holds version "
                    f"{self._receiver.version} and part of {pending}): finish the push first"
                )
            if self._scheduler is not None:
                return self._scheduler.generate(requests, self._abort, self._count_steps)
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start : start + self.max_batch_size]
                for i, sample in zip(chunk, self._generate_chunk([rows[i] for i in chunk])):
                    results[i] = sample
        return [results[i] for i in range(len(rows))]

    # no_grad, not inference_mode: the FP8 ops cache quantized inputs keyed by the tensor version counter,
    # which inference tensors do not have.
    @torch.no_grad()
    def _generate_chunk(self, rows: list[_Row]) -> list[Sample]:
        from transformers import DynamicCache

        num_rows, device = len(rows), self.device
        prompt_len = max(len(r.request.prompt_ids) for r in rows)
        input_ids = torch.full((num_rows, prompt_len), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((num_rows, prompt_len), dtype=torch.long)
        for b, r in enumerate(rows):
            ids = r.request.prompt_ids
            input_ids[b, prompt_len - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[b, prompt_len - len(ids) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
        params = [r.request.params for r in rows]
        sampling = RowSampling.build(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            greedy=[p.greedy for p in params],
            keys=[row_key(r.request.seed, r.index) for r in rows],
            vocab_size=self.vocab_size,
            device=device,
        )
        stop_sets = [set(p.stop_token_ids) for p in params]
        tokens_out: list[list[int]] = [[] for _ in rows]
        logprobs_out: list[list[float]] = [[] for _ in rows]
        finish: list[FinishReason | None] = [None] * num_rows
        live = list(range(num_rows))  # row index of each batch position

        cache = DynamicCache(config=self.config)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        next_pos = position_ids[:, -1] + 1
        step = 0
        while True:
            tokens, logprobs = sample_tokens(logits, sampling, step)
            keep: list[int] = []
            for pos, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
                b = live[pos]
                tokens_out[b].append(tok)
                logprobs_out[b].append(lp)
                if tok in stop_sets[b]:
                    finish[b] = "stop"
                elif len(tokens_out[b]) >= params[b].max_new_tokens:
                    finish[b] = "length"
                else:
                    keep.append(pos)
            if keep and self._abort.is_set():
                for pos in keep:
                    finish[live[pos]] = "abort"
                keep = []
            if not keep:
                break
            if len(keep) < len(live):
                idx = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(idx)
                attention_mask, tokens, next_pos = attention_mask[idx], tokens[idx], next_pos[idx]
                sampling = sampling.select(idx)
                live = [live[pos] for pos in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(live), 1))], dim=1)
            logits = self.model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            next_pos = next_pos + 1
            step += 1
            self.num_decode_steps += 1
        samples = []
        for b, r in enumerate(rows):
            reason = finish[b]
            assert reason is not None
            samples.append(
                Sample(
                    request_id=r.request.request_id,
                    index=r.index,
                    prompt_ids=list(r.request.prompt_ids),
                    response_ids=tokens_out[b],
                    logprobs=logprobs_out[b],
                    finish_reason=reason,
                )
            )
        return samples

    def _count_steps(self, steps: int) -> None:
        self.num_decode_steps += steps

    def close(self) -> None:
        """Shut down this engine's side of the weight group (``weight_sync.transport: nccl``), if it joined one."""
        if self._receiver.group is not None:
            self._receiver.group.close()
            self._receiver.group = None

    def abort(self) -> None:
        """Make the running ``generate`` return at its next decode step (unfinished rows: "abort")."""
        self._abort.set()

    # ---- weights --------------------------------------------------------------------------------
    def update_weights(self, bucket: WeightBucket | IpcBucket) -> None:
        """Copy one bucket in place (rules in ``weight_sync.receiver``); waits for a running generate."""
        with self._lock:
            self._receiver.load(bucket)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = WEIGHT_GROUP_NAME,
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> None:
        """Join the trainer's weight group (weight_sync.transport=nccl; the protocol is in weight_sync.nccl)."""
        self._receiver.join_group(
            master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s
        )

    def update_weights_from_distributed(
        self, version: int, index: int, num_buckets: int, names: Sequence[str], metas: Sequence[TensorMeta]
    ) -> None:
        """Receive bucket ``index`` by broadcast from trainer rank 0 and load it; waits for a running generate."""
        with self._lock:
            self._receiver.receive(version, index, num_buckets, names, metas)

    def read_weights(self, names: Sequence[str]) -> dict[str, Tensor]:
        """CPU copies of the engine's current tensors of those names (FP8 linears: the FP8 buffers)."""
        with self._lock:
            return self._receiver.read(names)

    def weight_digests(self, names: Sequence[str]) -> dict[str, Digest]:
        """Digests of those tensors, computed on the engine's device (the weight-sync self-check)."""
        with self._lock:
            return self._receiver.digests(names)

    def graph_capture_s(self) -> float | None:
        """Seconds spent capturing decode graphs since the last call (the RL step logs them,
        ``rollout/graph_capture_s``); None where nothing is captured (CPU, CUDA graphs off)."""
        if self._scheduler is None or not self._scheduler.use_graphs:
            return None
        total = self._scheduler.capture_seconds()
        since, self._capture_s_read = total - self._capture_s_read, total
        return since

    # ---- status and memory ----------------------------------------------------------------------
    def memory_wanted(self) -> int | None:
        """Free GPU bytes the last rollout's KV cache wanted (``Scheduler.memory_wanted``): what a colocated
        trainer makes room for before the next one. None on the CPU decode path or before the first call."""
        return self._scheduler.memory_wanted() if self._scheduler is not None else None

    def kv_slots_short(self) -> int | None:
        """KV-cache slots the last rollout wanted and did not get for memory (``Scheduler.slots_short``; its
        rows took turns); None on the CPU decode path or before the first call."""
        return self._scheduler.slots_short() if self._scheduler is not None else None

    def health(self) -> EngineHealth:
        """Not ok while a weight push is unfinished (a push that failed half-way left two versions mixed)."""
        pending = self._receiver.gate.pending
        return EngineHealth(
            ok=pending is None,
            weight_version=self._receiver.version,
            fp8=self.fp8,
            device=str(self.device),
            detail=f"native engine, {self.model_path}, {len(self._fp8_modules)} FP8 linears, dtype {self.dtype}"
            + (", memory released" if self._released else "")
            + (f", push of version {pending} unfinished" if pending is not None else ""),
        )

    def _move(self, where: Literal["cpu", "device"]) -> None:
        if self.device.type != "cuda":
            if not self._logged_cpu_memory_noop:
                logger.debug("release_memory/resume_memory are no-ops on %s", self.device)
                self._logged_cpu_memory_noop = True
            return
        with self._lock:
            self.model.to("cpu" if where == "cpu" else self.device)
            torch.cuda.empty_cache()  # the KV cache lives only inside generate(); this returns its blocks

    def release_memory(self) -> None:
        """Colocated GPU: give the GPU memory to the trainer. Graph decode path: free the KV cache, decode
        state and decode graphs and keep the weights resident (no copy; the next generate re-allocates and
        re-captures the decode graphs, without warm-ups for shapes seen before, cuda_graphs.py; the prefill
        graphs stay, prefill_graphs.py). Eager path: move the weights to host memory."""
        if self._scheduler is not None:
            with self._lock:
                self._scheduler.release(colocated=True)
        else:
            self._move("cpu")
        self._released = self.device.type == "cuda"

    def resume_memory(self) -> None:
        if self._scheduler is None:
            self._move("device")
        self._released = False
