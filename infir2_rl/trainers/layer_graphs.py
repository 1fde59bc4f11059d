"""The decoder layers' forward and backward replayed from CUDA graphs (``trainer.cuda_graphs``).

Why: on a GPU the torch trainer's step is host-bound, the FP8 one most (docs/performance.md: device kernels
add up to 0.70 of an FP8 step, 0.94 of a BF16 one). Per decoder layer and micro-batch the host runs Python autograd
Functions, sets up cuBLASLt for each scaled_mm and launches dozens of kernels, slower than the GPU runs
them. Replaying each layer's forward and backward from a CUDA graph takes that host work out; what stays
eager is the embedding, the final norm, the token scores, the loss and the optimizer. Both trainer backends use
it: the torch backend over HF decoder layers, the megatron backend over megatron's (``trainers/megatron/graphs.py``
presents them with HF's signature).

How, for one input shape (captured on its first use, at most ``max_shapes`` training and
``max_forward_only_shapes`` forward-only shapes, 64 each; the trainer pads its training micro-batches to a
length bucket, ``trainers/microbatch.bucket_length``, so that few shapes occur):

* Forward graphs of layers 0..n-1 are captured in that order, layer i ending with a copy of its output into
  the buffer layer i+1 reads; backward graphs in reverse, layer i copying its input gradient where layer
  i-1's backward reads its output gradient. These boundary buffers (``_Boundaries``) are shared by every
  training shape that fits them: per shape they would cost two FP32 activations per layer (2.8 GiB at 1.5B
  x 8,192 tokens), and a padded batch has dozens of shapes. The copies cost ~1.9 ms of a 281 ms FP8 step
  at 1.5B x 8,192 (docs/performance.md, run D).
* The backward graph adds the parameter gradients into ``.grad`` itself (a BF16 parameter with an FP32 master,
  master_weights.py: into the master's gradient, ``main_grad``, in FP32). Those tensors must therefore
  stay the same tensors from capture on: the trainer zeroes them in place (``zero_grad(set_to_none=False)``)
  and every replay checks their identity (``GradsReplaced`` otherwise, never a silent write to freed memory).
* FP8: an ``Fp8Linear`` with a kept FP8 weight (the trainer's FP32 masters give each one: master_weights.py)
  is read from those buffers by the graph, which the flat AdamW rewrites as it steps the masters; each
  capture and each micro-batch's first replay quantize any that are stale first (``fp8.linear.refresh_kept_fp8``:
  after a checkpoint load, or with another optimizer; the megatron backend's linears through ``refresh``). Without kept buffers ``Fp8Linear`` skips its weight cache
  while a capture runs, so the weight quantization is part of the forward graph and each replay quantizes
  the current master weights.
* All shapes share one memory pool. That is safe here because one micro-batch replays every layer's forward
  and backward of one shape before any other shape replays, and each buffer a graph reads is written by the
  same micro-batch's replays (or copied in) first. It is also what keeps many shapes affordable: the trainer
  runs its micro-batches largest first, the first capture grows the pool by the working memory of that shape
  (saved activations, temporaries) and smaller shapes' captures fit in its blocks (bench/train_packed.py,
  1.5B, H100: +24.9 GiB for the 8,192-token packed row, then +0.0 GiB for each of 11 smaller ones; padded,
  +27.4 GiB, then 0.0-0.35 GiB for each of 12).

Forwards without gradients (old log-probs, evaluation, the dense-trainer mismatch scoring) get graphs of their
own, forward only, per shape: layer i's graph ends by copying its output into one of two ping-pong buffers,
which layer i+1 reads. The input and the two ping-pong buffers are shared by every forward-only shape that
fits them, as the training boundaries are (so the last layer's output, which the caller reads, is valid until
the next forward-only replay of any shape), and a forward-only shape costs ~no memory of its own: their cap
is the training one (it was 16 while each shape kept its own three buffers, and rows sorted by length met 32
shapes in one RL batch, so 30 of 52 scoring micro-batches ran eagerly; docs/performance.md, session 37). The
trainer pads such batches to a length bucket too. A training forward whose backward has not run yet and a
replayed forward without gradients cannot interleave (the forward counter below refuses the backward).

Packed micro-batches (``trainer.pack_sequences``) pass varlen attention arguments to every layer: the offsets
``cu_seq_lens_q/k`` (one tensor) and the longest length ``max_length_q/k`` (an int, baked into the kernel's
grid). They are part of the shape's key (offsets count and max length), the offsets are copied into a static
buffer like the rotary tables, and scoring pads the packed row so that both depend only on its padded
length (``varlen_attention.varlen_kwargs(padded_to=)``).

A call runs the layer's own (eager) forward when the layer is called with a KV cache or other extra
arguments, a training forward's layer is in eval mode or its input needs no gradient, the shape limit of its
kind (training, or without gradients) is reached, or, after the first shape, the free GPU memory looks too
small for another (logged once each). Such an eager micro-batch cannot use the pool's memory, so the pool and
the eager work must fit side by side (a padded 1.5B FP8 batch with 16 shapes captured ran out of memory
that way while each shape kept its own buffers between layers). Capture needs the autocast weight cache off (``torch.autocast(...,
cache_enabled=False)``): a cached cast made during a capture would be graph memory that later eager code
reads.

Layers are found as ``model.model.layers`` (transformers' Qwen2/Llama layout), or given as ``layers``, and
patched per instance (``layer.forward``), so parameter names, state dicts and checkpoints are unchanged. Given
``forwards``, one function per layer with a decoder layer's signature, the graphs capture those instead and
nothing is patched: the caller runs layer i as ``LayerGraphs.call(i, ...)`` (the ``true_on_policy`` walk,
whose layers are functions of the modules, not their forwards: trainers/torch/invariant_scoring.py; megatron's
TransformerLayers behind HF's signature: trainers/megatron/graphs.py). ``refresh``, where given, runs before
each micro-batch's replays beside ``refresh_kept_fp8`` (the megatron linears' kept FP8 weights).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from infir2_rl.fp8.linear import Fp8Linear, refresh_kept_fp8
from infir2_rl.graph_capture import capture, warmup_stream

log = logging.getLogger(__name__)

# Eager runs of a layer on the warm-up stream before its capture: Triton compiles, cuBLAS(Lt) handles and
# workspaces, cuDNN's attention plans and the FP8 self-check happen there, not inside a capture. Every layer
# for the first shape of a code path (``_key``: dtypes, mask, varlen, FP8, gradients), the first layer of each
# kind alone for later shapes of that path (``_warm_up_layers``: layer 0 in Qwen2.5): layers of a kind run the
# same kernels on the same shapes, and those set-ups are per process, not per module. The warm-up was ~70% of all
# capture time (two eager forward+backward passes of the whole model per shape; docs/performance.md, session 39).
WARMUP_ITERS = 2
# The keyword arguments of varlen attention (varlen_attention.varlen_kwargs); any other runs eagerly.
VARLEN_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"})


def _varlen(kwargs: dict[str, Any]) -> tuple[Tensor, int] | None:
    """(offsets, max length) of packed-sequence arguments that one static buffer can stand for, else None."""
    if set(kwargs) != VARLEN_KEYS:
        return None
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    if kwargs["cu_seq_lens_k"] is not cu or kwargs["max_length_k"] != max_len or not isinstance(cu, Tensor):
        return None
    return cu, int(max_len)


def drop_for_room(device: torch.device, wanted_bytes: int, graphs: LayerGraphs | None) -> bool:
    """A trainer's ``make_room`` (``TrainerBackend``): colocated with a rollout engine, before a rollout, while the
    GPU's free memory is below ``wanted_bytes`` (what the engine's KV cache wants, ``NativeEngine.memory_wanted``),
    return this process's cached blocks, then drop the layer graphs (their pool and buffers; the next step
    captures its shapes again). A GPU with room is left as it is. Without this, at 16K responses on an 80 GB GPU
    the torch trainer kept ~57 GiB through the rollout and the engine decoded 32 of its 64 rows at a time
    (docs/performance.md, session 48). True when the graphs went."""
    if device.type != "cuda" or torch.cuda.mem_get_info(device)[0] >= wanted_bytes:
        return False
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(device)[0]
    if free >= wanted_bytes or graphs is None or graphs.num_shapes == 0:
        return False
    graphs.release()
    torch.cuda.empty_cache()
    after = torch.cuda.mem_get_info(device)[0]
    log.info(
        "trainer: layer graphs dropped before the rollout (free GPU memory %.1f -> %.1f GiB; the engine's KV "
        "cache wants %.1f): the next step captures its shapes again",
        free / 2**30, after / 2**30, wanted_bytes / 2**30,
    )  # fmt: skip
    return True


class GradsReplaced(RuntimeError):
    """A parameter's ``.grad`` is no longer the tensor the backward graphs write into."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"trainer.cuda_graphs: {type(model).__name__} has no decoder layers at model.model.layers"
        )
    return layers


def grad_target(p: Tensor) -> Tensor | None:
    """The tensor a parameter's gradient is added into: its FP32 master's gradient when the model keeps FP32
    masters beside BF16 parameters (master_weights.py), else its ``.grad``."""
    main_grad = getattr(p, "main_grad", None)
    return main_grad if main_grad is not None else p.grad


def _fp8_state(layer: nn.Module) -> tuple[bool, ...]:
    return tuple(bool(getattr(m, "fp8_enabled", False)) for m in layer.modules() if hasattr(m, "fp8_enabled"))


def _warm_up_layers(layers: list[nn.Module]) -> list[int]:
    """The first layer of each kind (class, attention type and window, FP8 state): what a later shape of a code
    path warms up (``WARMUP_ITERS``). One kind in Qwen2.5: layer 0 alone; sliding-window layers run other
    attention kernels and would add their first one."""
    first: dict[tuple[Any, ...], int] = {}
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        kind = (
            type(layer),
            getattr(attn, "layer_type", None),
            getattr(attn, "sliding_window", None),
            _fp8_state(layer),
        )
        first.setdefault(kind, i)
    return sorted(first.values())


class _ShapeGraphs:
    """Forward and backward CUDA graphs of every layer for one input shape, and their static buffers."""

    def __init__(self, n: int, clock: list[int], forward_only: bool = False) -> None:
        self.forward_only = forward_only  # no gradients: no backward graphs, ping-pong output buffers
        self.fwd = [torch.cuda.CUDAGraph() for _ in range(n)]
        self.bwd = [torch.cuda.CUDAGraph() for _ in range(n)]
        self.inputs: list[Tensor] = []  # layer i's input (layer i-1's output buffer for i > 0)
        self.outputs: list[Tensor] = []
        self.grad_outputs: list[Tensor] = []  # layer i's output gradient (layer i+1's input gradient)
        self.grad_inputs: list[Tensor] = []
        self.cos: Tensor | None = None
        self.sin: Tensor | None = None
        self.mask: Tensor | None = None
        self.varlen: dict[str, Any] = {}  # packed sequences: the static offsets buffer and the max length
        # The .grad tensors the backward graphs add into, in the order of LayerGraphs._all_params.
        self.grads: list[Tensor] = []
        # Forwards begun on any shape (one counter for all shapes: they share one memory pool). A backward
        # replay whose forward is no longer the latest would read activations another forward overwrote.
        self.clock = clock


class _Boundaries:
    """``count`` flat tensors between the decoder layers, shared by every shape of one kind with at most
    ``capacity`` elements. Training (2n + 2): layer i's input (i = n: the last layer's output), then their
    gradients; forward-only (3): the input and the two ping-pong outputs. One set serves any number of shapes
    (their replays never interleave, and each replay writes these before reading them), where each shape's own
    buffers would cost two activations per layer (training) or three (forward-only) each."""

    def __init__(self, count: int, like: Tensor) -> None:
        self.capacity = like.numel()
        self.dtype, self.device = like.dtype, like.device
        self.flats = [torch.zeros(self.capacity, dtype=like.dtype, device=like.device) for _ in range(count)]

    def fits(self, like: Tensor) -> bool:
        return like.numel() <= self.capacity and like.dtype == self.dtype and like.device == self.device

    def views(self, like: Tensor) -> list[Tensor]:
        return [flat[: like.numel()].view(like.shape) for flat in self.flats]


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, graphs: _ShapeGraphs, i: int) -> Tensor:  # type: ignore[override]
        static = graphs.inputs[i]
        if x.data_ptr() != static.data_ptr():  # layer 0, or a layer after an eager one
            static.copy_(x)
        graphs.fwd[i].replay()
        ctx.graphs, ctx.i, ctx.forward_number = graphs, i, graphs.clock[0]
        return graphs.outputs[i].detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        graphs, i = ctx.graphs, ctx.i
        if ctx.forward_number != graphs.clock[0]:
            raise RuntimeError(
                "trainer.cuda_graphs: a graphed forward ran between this micro-batch's forward and its backward "
                "(the graphs keep one micro-batch's activations: run backward before the next training forward)"
            )
        static = graphs.grad_outputs[i]
        if grad.data_ptr() != static.data_ptr():  # the last layer, or one before an eager layer
            static.copy_(grad)
        graphs.bwd[i].replay()
        return graphs.grad_inputs[i].detach(), None, None


class LayerGraphs:
    """Replays ``model``'s decoder layers from CUDA graphs when it trains (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        max_shapes: int = 64,
        max_forward_only_shapes: int = 64,
        check_memory: bool = False,
        forwards: list[Callable[..., Tensor]] | None = None,
        layers: list[nn.Module] | None = None,
        refresh: Callable[[], object] | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise ValueError("trainer.cuda_graphs needs a CUDA device")
        self.layers = list(decoder_layers(model)) if layers is None else list(layers)
        self._refresh = refresh
        # Shapes captured at most, per kind. Training: 64, since a padded RL-shaped batch meets ~47 shapes, and
        # micro-batches past the cap run eagerly, where FP8 is host-bound (docs/performance.md, session 29:
        # with 16, padded FP8 ran at 0.74-0.84x BF16's tokens/s; with all 47 graphed, 1.02-1.03x). Each shape
        # costs ~0.3-0.4 s of capture once at 1.5B (session 39, H200: 52 shapes in 18.5-22.4 s, their code
        # paths' first shapes included; 0.4-1.7 s before later shapes warmed up layer 0 alone) and ~no memory
        # (the pool and the buffers between layers are shared), a forward-only one too (module docstring).
        self.max_shapes = max_shapes
        self.max_forward_only_shapes = max_forward_only_shapes
        # check_memory ("auto" mode): before each shape after the first, compare the free memory with what
        # the first capture took (scaled by size) and run eagerly rather than risk running out.
        self.check_memory = check_memory
        self._capture_bytes_per_element: float | None = None  # the first training capture's pool growth
        self._largest_training = 0  # elements of the largest training input captured
        # Per kind (forward_only), the shared buffer sets: a larger shape after smaller ones adds a set.
        self._boundary_sets: dict[bool, list[_Boundaries]] = {False: [], True: []}
        # What each layer computes: its own forward (patched below), or the given functions (called through
        # ``call``; the true_on_policy walk, trainers/torch/invariant_scoring.py).
        if forwards is not None and len(forwards) != len(self.layers):
            raise ValueError(f"LayerGraphs: {len(forwards)} forwards for {len(self.layers)} decoder layers")
        self._eager: list[Callable[..., Tensor]] = (
            [layer.forward for layer in self.layers] if forwards is None else list(forwards)
        )
        self._params = [[p for p in layer.parameters() if p.requires_grad] for layer in self.layers]
        self._fp8 = [m for layer in self.layers for m in layer.modules() if isinstance(m, Fp8Linear)]
        self._all_params = [p for params in self._params for p in params]
        self._shapes: dict[tuple[Any, ...], _ShapeGraphs] = {}
        self._pool = torch.cuda.graph_pool_handle()
        # While a micro-batch's layers replay: its graphs, and the rotary tables, mask and offsets tensors every
        # layer must be called with (what layer 0 copied into the static buffers).
        self._active: tuple[_ShapeGraphs, tuple[Tensor, Tensor], Tensor | None, Tensor | None] | None = None
        self._clock = [0]
        self._warned: set[str] = set()
        # Kinds (forward_only flags) refused a capture for memory: no later shape of that kind is captured.
        # For training shapes this is also what keeps capture safe: once a layer has run its backward eagerly,
        # autograd keeps the parameters' AccumulateGrad nodes (made on the default stream) while the step's
        # graph lives, and a backward captured next on the side stream then fails ("operation would make the
        # legacy stream depend on a capturing blocking stream"; seen at 256 sequences in bench/train_packed.py).
        self._refused: set[bool] = set()
        # Code paths (``_key``'s first part) with a shape captured: later shapes warm up fewer layers (WARMUP_ITERS).
        self._warmed: set[tuple[Any, ...]] = set()
        self.captures = 0
        self.capture_s = 0.0  # wall time spent capturing (warm-up included), for benchmarks
        self.replays = 0
        if forwards is None:
            for i, layer in enumerate(self.layers):
                layer.forward = functools.partial(self._call, i)  # type: ignore[method-assign]

    def call(self, i: int, hidden_states: Tensor, **kwargs: Any) -> Tensor:
        """Layer i's forward (replayed, or eager where the module docstring says), for callers that run the
        layers themselves rather than through ``layer.forward``."""
        return self._call(i, hidden_states, **kwargs)

    @property
    def num_shapes(self) -> int:
        return len(self._shapes)

    def release(self) -> None:
        """Drop every captured graph, its memory pool and the buffers between layers, so that the caller's
        ``torch.cuda.empty_cache()`` returns them to the driver (a colocated engine's KV cache needs the room:
        ``TorchTrainer.make_room``). Later micro-batches capture their shapes again, in a new pool, without the
        all-layer warm-ups (those set-ups are per process). Only between micro-batches (no forward pending)."""
        self._shapes.clear()
        self._boundary_sets = {False: [], True: []}
        self._active = None
        self._refused.clear()  # a kind refused for memory may fit now
        self._largest_training = 0  # the new pool grows by the first shape's working memory again
        self._pool = torch.cuda.graph_pool_handle()

    # ------------------------------------------------------------------ dispatch
    def _call(
        self,
        i: int,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        **kwargs: Any,
    ) -> Tensor:
        graphs = None
        if i == 0:
            self._active = None
            key = self._key(
                hidden_states, attention_mask, past_key_values, use_cache, position_embeddings, kwargs
            )
            if key is not None:
                graphs = self._shapes.get(key)
                if graphs is None:
                    graphs = self._capture_or_none(
                        key, hidden_states, attention_mask, position_embeddings, kwargs
                    )
                if graphs is not None:
                    self._begin(graphs, attention_mask, position_embeddings, kwargs)
        elif self._active is not None:
            graphs, pe, mask, cu = self._active
            varlen = _varlen(kwargs)
            same_varlen = not kwargs if cu is None else varlen is not None and varlen[0] is cu
            if not (position_embeddings is pe and attention_mask is mask and same_varlen):
                graphs = None
        if graphs is None:
            return self._eager[i](
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        if i == len(self.layers) - 1:
            self._active = None
        if graphs.forward_only:
            return self._replay_forward_only(graphs, i, hidden_states)
        out = _Replay.apply(hidden_states, graphs, i)
        assert isinstance(out, Tensor)
        return out

    @staticmethod
    def _replay_forward_only(graphs: _ShapeGraphs, i: int, hidden: Tensor) -> Tensor:
        static = graphs.inputs[i]
        if hidden.data_ptr() != static.data_ptr():  # layer 0, or a layer after an eager one
            static.copy_(hidden)
        graphs.fwd[i].replay()
        return graphs.outputs[i]  # a ping-pong buffer: the next layer's replay overwrites the other one

    def _key(
        self,
        hidden: Tensor,
        mask: Tensor | None,
        past_key_values: Any,
        use_cache: bool | None,
        position_embeddings: tuple[Tensor, Tensor] | None,
        kwargs: dict[str, Any],
    ) -> tuple[Any, ...] | None:
        layer = self.layers[0]
        grad = torch.is_grad_enabled()
        if not hidden.is_cuda or (grad and not (layer.training and hidden.requires_grad)):
            return None
        if past_key_values is not None or use_cache or position_embeddings is None:
            return None  # a KV cache: eager
        varlen = _varlen(kwargs)
        if kwargs and varlen is None:
            self._warn_once("kwargs", f"layers called with {sorted(kwargs)}: they run eagerly")
            return None
        cos, sin = position_embeddings
        autocast = torch.is_autocast_enabled("cuda")
        if autocast and torch.is_autocast_cache_enabled():
            self._warn_once(
                "autocast", "autocast's weight cache is on (cache_enabled=True): layers run eagerly"
            )
            return None
        # (the code path: what decides which kernels run; the sizes)
        return (
            (
                hidden.dtype,
                cos.dtype,
                None if mask is None else mask.dtype,
                None if varlen is None else varlen[0].dtype,
                torch.get_autocast_dtype("cuda") if autocast else None,
                _fp8_state(layer),
                grad,
                layer.training,
            ),
            (
                tuple(hidden.shape),
                tuple(cos.shape),
                None if mask is None else tuple(mask.shape),
                None if varlen is None else (varlen[0].numel(), varlen[1]),
            ),
        )

    def _begin(
        self,
        graphs: _ShapeGraphs,
        mask: Tensor | None,
        position_embeddings: tuple[Tensor, Tensor] | None,
        kwargs: dict[str, Any],
    ) -> None:
        assert position_embeddings is not None and graphs.cos is not None and graphs.sin is not None
        self._refresh_fp8()  # the graphs read kept FP8 weights as they are (module docstring)
        if not graphs.forward_only:  # the backward graphs add into the .grad tensors of their capture
            self._check_grads(graphs)
        graphs.cos.copy_(position_embeddings[0])
        graphs.sin.copy_(position_embeddings[1])
        if mask is not None:
            assert graphs.mask is not None
            graphs.mask.copy_(mask)
        varlen = _varlen(kwargs)
        if varlen is not None:
            graphs.varlen["cu_seq_lens_q"].copy_(varlen[0])
        self._active = (graphs, position_embeddings, mask, None if varlen is None else varlen[0])
        self._clock[0] += 1
        self.replays += 1

    def _refresh_fp8(self) -> None:
        refresh_kept_fp8(self._fp8)
        if self._refresh is not None:
            self._refresh()

    def _check_grads(self, graphs: _ShapeGraphs) -> None:
        for p, g in zip(self._all_params, graphs.grads, strict=True):
            if grad_target(p) is not g:
                raise GradsReplaced(
                    "trainer.cuda_graphs: a parameter's .grad was replaced or set to None after the backward "
                    "graphs were captured (zero gradients in place: optimizer.zero_grad(set_to_none=False))"
                )

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("trainer.cuda_graphs: %s", message)

    # ------------------------------------------------------------------ capture
    def _capture_or_none(
        self,
        key: tuple[Any, ...],
        hidden: Tensor,
        mask: Tensor | None,
        position_embeddings: tuple[Tensor, Tensor] | None,
        kwargs: dict[str, Any] | None = None,
    ) -> _ShapeGraphs | None:
        forward_only = not torch.is_grad_enabled()
        kind = "forward-only" if forward_only else "training"
        cap = self.max_forward_only_shapes if forward_only else self.max_shapes
        if sum(g.forward_only == forward_only for g in self._shapes.values()) >= cap:
            self._warn_once(
                f"shapes-{kind}",
                f"{cap} {kind} input shapes captured already; micro-batches of other shapes run "
                f"eagerly (this one: {tuple(hidden.shape)})",
            )
            return None
        if forward_only in self._refused or not self._memory_allows(hidden, forward_only):
            self._refused.add(forward_only)
            return None
        assert position_embeddings is not None
        # The graphs read kept FP8 weights, so they must be current before the capture: a later shape warms up
        # layer 0 alone (``_warm_up_layers``), and only an eager forward would have refreshed the others.
        self._refresh_fp8()
        torch.cuda.synchronize()
        before, started = torch.cuda.memory_reserved(hidden.device), time.perf_counter()
        path = key[0]  # the code path (``_key``)
        warm = _warm_up_layers(self.layers) if path in self._warmed else list(range(len(self.layers)))
        if forward_only:
            graphs = self._capture_forward_only(hidden, mask, position_embeddings, kwargs or {}, warm)
        else:
            graphs = self._capture(hidden, mask, position_embeddings, kwargs or {}, warm)
        self._warmed.add(path)
        self.capture_s += time.perf_counter() - started  # both captures end with a synchronize
        grown = max(torch.cuda.memory_reserved(hidden.device) - before, 0)
        if not forward_only:
            if self._capture_bytes_per_element is None:
                self._capture_bytes_per_element = grown / hidden.numel()
            self._largest_training = max(self._largest_training, hidden.numel())
        self._shapes[key] = graphs
        self.captures += 1
        log.info(
            "trainer.cuda_graphs: captured %d layers (%s) for input %s; reserved memory +%.2f GiB",
            len(self.layers), kind, tuple(hidden.shape), grown / 2**30,
        )  # fmt: skip
        return graphs

    def _memory_allows(self, hidden: Tensor, forward_only: bool) -> bool:
        """In "auto" mode: is the free GPU memory (the driver's plus the allocator's cached blocks) enough for
        another shape? All shapes share one pool (their replays never interleave), and a shape no larger than
        one captured before fits in it: the pool grew by 0.0-0.35 GiB for each of 12 smaller shapes after
        24.9-28.4 GiB for the first (bench/train_packed.py, 1.5B, H100). So a new training shape needs the
        first capture's growth, scaled by size, beyond that of the largest shape captured, plus a tenth of its
        own as a margin. Forward-only shapes need 5 activations (the layer's working memory, a few
        activations' worth, in the shared pool), and 3 more where no shared buffer set fits them."""
        if not self.check_memory:
            return True
        if forward_only:
            new_set = not any(b.fits(hidden) for b in self._boundary_sets[True])
            need = (5.0 + 3.0 * new_set) * hidden.numel() * hidden.element_size()
        elif self._capture_bytes_per_element is None:
            return True  # the first training shape: the eager step at this shape needs about as much
        else:
            per_element = self._capture_bytes_per_element
            grows = max(hidden.numel() - self._largest_training, 0)
            need = per_element * grows + 0.1 * per_element * hidden.numel()
        dev = hidden.device
        free = (
            torch.cuda.mem_get_info(dev)[0]
            + torch.cuda.memory_reserved(dev)
            - torch.cuda.memory_allocated(dev)
        )
        if free >= need:
            return True
        self._warn_once(
            f"memory-{forward_only}",
            f"{free / 2**30:.1f} GiB free, a new {'forward-only' if forward_only else 'training'} shape "
            f"{tuple(hidden.shape)} needs about {need / 2**30:.1f} GiB: it and later new shapes run eagerly",
        )
        return False

    def _run_eager(
        self, i: int, x: Tensor, mask: Tensor | None, pe: tuple[Tensor, Tensor], varlen: dict[str, Any]
    ) -> Tensor:
        return self._eager[i](x, attention_mask=mask, position_embeddings=pe, **varlen)

    @staticmethod
    def _static(
        graphs: _ShapeGraphs, mask: Tensor | None, pe: tuple[Tensor, Tensor], kwargs: dict[str, Any]
    ) -> tuple[Tensor, Tensor]:
        """The buffers the graphs read the rotary tables (returned), the mask and the packed offsets from."""
        cos, sin = (t.detach().clone() for t in pe)
        graphs.cos, graphs.sin = cos, sin
        graphs.mask = None if mask is None else mask.detach().clone()
        varlen = _varlen(kwargs)
        if varlen is not None:
            cu = varlen[0].clone()
            graphs.varlen = {
                "cu_seq_lens_q": cu,
                "cu_seq_lens_k": cu,
                "max_length_q": varlen[1],
                "max_length_k": varlen[1],
            }
        return cos, sin

    def _capture_forward_only(
        self,
        hidden: Tensor,
        mask: Tensor | None,
        pe: tuple[Tensor, Tensor],
        kwargs: dict[str, Any],
        warm: list[int],
    ) -> _ShapeGraphs:
        n = len(self.layers)
        graphs = _ShapeGraphs(n, self._clock, forward_only=True)
        side = warmup_stream(hidden.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in warm:
                for _ in range(WARMUP_ITERS):
                    self._run_eager(i, torch.randn_like(hidden), mask, pe, kwargs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

        static_pe = self._static(graphs, mask, pe, kwargs)
        # Outside the captures, shared by the forward-only shapes: the input buffer and the two buffers the
        # layers' outputs alternate in.
        x, *pingpong = self._boundaries(hidden, forward_only=True)
        for i in range(n):
            buffer = pingpong[i % 2]
            with capture(graphs.fwd[i], self._pool):
                out = self._run_eager(i, x, graphs.mask, static_pe, graphs.varlen)
                if out.shape != buffer.shape or out.dtype != buffer.dtype:
                    raise RuntimeError(
                        f"trainer.cuda_graphs: layer {i} maps {tuple(hidden.shape)} {hidden.dtype} to "
                        f"{tuple(out.shape)} {out.dtype}; the graphs need the residual stream's shape and dtype"
                    )
                buffer.copy_(out)
            del out  # its memory returns to the pool: later layers' graphs may reuse it (they replay after)
            graphs.inputs.append(x)
            graphs.outputs.append(buffer)
            x = buffer
        torch.cuda.synchronize()
        return graphs

    def _boundaries(self, hidden: Tensor, forward_only: bool) -> list[Tensor]:
        """Views, shaped like ``hidden``, of a shared buffer set of the kind that fits it (``_Boundaries``)."""
        sets = self._boundary_sets[forward_only]
        for boundaries in sets:
            if boundaries.fits(hidden):
                return boundaries.views(hidden)
        count = 3 if forward_only else 2 * len(self.layers) + 2
        boundaries = _Boundaries(count, hidden)  # allocated outside any capture: not pool memory
        sets.append(boundaries)
        return boundaries.views(hidden)

    def _capture(
        self,
        hidden: Tensor,
        mask: Tensor | None,
        pe: tuple[Tensor, Tensor],
        kwargs: dict[str, Any],
        warm: list[int],
    ) -> _ShapeGraphs:
        n = len(self.layers)
        graphs = _ShapeGraphs(n, self._clock)
        for p in self._all_params:
            if grad_target(p) is None:
                p.grad = torch.zeros_like(p)
        graphs.grads = [grad_target(p) for p in self._all_params]  # type: ignore[misc]

        # Warm-up on a side stream: Triton compiles, cuBLAS(Lt) handles and workspaces, and the FP8
        # self-check happen here, not inside a capture. Gradients go to autograd.grad's outputs, never to
        # .grad; but a GEMM that adds a weight gradient into its FP32 target (FP8: fp8/ops.py WGRAD_INTO, into
        # a master's ``main_grad`` or, on the megatron backend, ``.grad``; BF16: master_weights.MainGradLinear)
        # writes it even here, so the targets (which may hold this step's earlier micro-batches) are put back
        # after the warm-up.
        side = warmup_stream(hidden.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in warm:
                targets = [t for t in (grad_target(p) for p in self._params[i]) if t is not None]
                kept = [t.clone() for t in targets]
                for _ in range(WARMUP_ITERS):
                    x = torch.randn_like(hidden).requires_grad_()
                    out = self._run_eager(i, x, mask, pe, kwargs)
                    torch.autograd.grad(out, (x, *self._params[i]), torch.randn_like(out), allow_unused=True)
                    del x, out
                for t, before in zip(targets, kept, strict=True):
                    t.copy_(before)
                del kept
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

        static_pe = self._static(graphs, mask, pe, kwargs)
        # The activations and gradients between layers live in buffers shared by every training shape.
        views = self._boundaries(hidden, forward_only=False)
        acts, grad_bufs = views[: n + 1], views[n + 1 :]
        outs: list[Tensor | None] = []
        for i in range(n):
            x = acts[i].detach().requires_grad_()  # the leaf the backward differentiates against
            with capture(graphs.fwd[i], self._pool):
                out = self._run_eager(i, x, graphs.mask, static_pe, graphs.varlen)
                with torch.no_grad():
                    acts[i + 1].copy_(out)
            graphs.inputs.append(x)
            graphs.outputs.append(acts[i + 1])
            outs.append(out)  # keeps the captured autograd graph for the backward capture

        for i in reversed(range(n)):
            params = self._params[i]
            layer_out = outs[i]
            assert layer_out is not None
            with capture(graphs.bwd[i], self._pool):
                grads = torch.autograd.grad(
                    layer_out, (graphs.inputs[i], *params), grad_bufs[i + 1], allow_unused=True
                )
                into: list[Tensor] = []
                add: list[Tensor] = []
                for p, g in zip(params, grads[1:], strict=True):
                    target = grad_target(p)
                    if g is not None and target is not None:
                        into.append(target)
                        add.append(g)
                if into:  # a BF16 gradient adds into an FP32 master's gradient in FP32 (an FP8 wgrad that
                    torch._foreach_add_(into, add)  # added itself inside its GEMM returned None: fp8/ops.py)
                assert grads[0] is not None
                grad_bufs[i].copy_(grads[0])
            outs[i] = None  # the captured autograd graph is no longer needed: its memory returns to the pool
            del layer_out, grads
        graphs.grad_outputs, graphs.grad_inputs = grad_bufs[1:], grad_bufs[:-1]
        torch.cuda.synchronize()
        return graphs
