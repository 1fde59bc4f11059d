"""The decoder layers' forward and backward replayed from CUDA graphs (``trainer.cuda_graphs``).

Why: on a GPU the torch trainer's step is host-bound, the FP8 one most (docs/performance.md: device kernels
add up to 0.70 of an FP8 step, 0.94 of a BF16 one). Per decoder layer and micro-batch the host runs Python autograd
Functions, sets up cuBLASLt for each scaled_mm and launches dozens of kernels, slower than the GPU runs
them. Replaying each layer's forward and backward from a CUDA graph takes that host work out; what stays
eager is the embedding, the final norm, the token scores, the loss and the optimizer.

How, for one input shape (captured on its first use, at most ``max_shapes`` shapes; the trainer pads its
training micro-batches to a length bucket, ``trainers/microbatch.bucket_length``, so that few shapes occur):

* Forward graphs of layers 0..n-1 are captured in that order, layer i reading layer i-1's output buffer
  (no copy between layers); backward graphs in reverse, layer i writing its input gradient where layer
  i-1's backward reads its output gradient.
* The backward graph adds the parameter gradients into ``.grad`` itself. The ``.grad`` tensors must therefore
  stay the same tensors from capture on: the trainer zeroes them in place (``zero_grad(set_to_none=False)``)
  and every replay checks their identity (``GradsReplaced`` otherwise, never a silent write to freed memory).
* FP8: ``Fp8Linear`` skips its weight cache while a capture runs, so the weight quantization is part of the
  forward graph and each replay quantizes the current master weights.
* All shapes share one memory pool. That is safe here because one micro-batch replays every layer's forward
  and backward of one shape before any other shape replays, and each buffer a graph reads is written by the
  same micro-batch's replays (or copied in) first.

A call runs the layer's own (eager) forward when gradients are off (old log-probs, evaluation), the layer is
in eval mode, the model was called with a KV cache or extra attention arguments (packed sequences), or the
shape limit is reached (logged once). Capture needs the autocast weight cache off (``torch.autocast(...,
cache_enabled=False)``): a cached cast made during a capture would be graph memory that later eager code
reads.

Layers are found as ``model.model.layers`` (transformers' Qwen2/Llama layout) and patched per instance
(``layer.forward``), so parameter names, state dicts and checkpoints are unchanged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

WARMUP_ITERS = 2


@functools.cache
def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """One warm-up stream per device: cuBLAS(Lt) keeps a workspace per stream for the life of the process,
    so a new stream per capture would grow memory (as engines/native/cuda_graphs.warmup_stream explains)."""
    return torch.cuda.Stream(device)


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


def _fp8_state(layer: nn.Module) -> tuple[bool, ...]:
    return tuple(bool(getattr(m, "fp8_enabled", False)) for m in layer.modules() if hasattr(m, "fp8_enabled"))


class _ShapeGraphs:
    """Forward and backward CUDA graphs of every layer for one input shape, and their static buffers."""

    def __init__(self, n: int, clock: list[int]) -> None:
        self.fwd = [torch.cuda.CUDAGraph() for _ in range(n)]
        self.bwd = [torch.cuda.CUDAGraph() for _ in range(n)]
        self.inputs: list[Tensor] = []  # layer i's input (layer i-1's output buffer for i > 0)
        self.outputs: list[Tensor] = []
        self.grad_outputs: list[Tensor] = []  # layer i's output gradient (layer i+1's input gradient)
        self.grad_inputs: list[Tensor] = []
        self.cos: Tensor | None = None
        self.sin: Tensor | None = None
        self.mask: Tensor | None = None
        # The .grad tensors the backward graphs add into, in the order of LayerGraphs._all_params.
        self.grads: list[Tensor] = []
        # Forwards begun on any shape (one counter for all shapes: they share one memory pool). A backward
        # replay whose forward is no longer the latest would read activations another forward overwrote.
        self.clock = clock


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

    def __init__(self, model: nn.Module, max_shapes: int = 4) -> None:
        if not torch.cuda.is_available():
            raise ValueError("trainer.cuda_graphs needs a CUDA device")
        self.layers = list(decoder_layers(model))
        self.max_shapes = max_shapes
        self._eager: list[Callable[..., Tensor]] = [layer.forward for layer in self.layers]
        self._params = [[p for p in layer.parameters() if p.requires_grad] for layer in self.layers]
        self._all_params = [p for params in self._params for p in params]
        self._shapes: dict[tuple[Any, ...], _ShapeGraphs] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._active: tuple[_ShapeGraphs, tuple[Tensor, Tensor], Tensor | None] | None = None
        self._clock = [0]
        self._warned: set[str] = set()
        self.captures = 0
        self.replays = 0
        for i, layer in enumerate(self.layers):
            layer.forward = functools.partial(self._call, i)  # type: ignore[method-assign]

    @property
    def num_shapes(self) -> int:
        return len(self._shapes)

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
                    graphs = self._capture_or_none(key, hidden_states, attention_mask, position_embeddings)
                if graphs is not None:
                    self._begin(graphs, attention_mask, position_embeddings)
        elif self._active is not None:
            graphs, pe, mask = self._active
            if not (position_embeddings is pe and attention_mask is mask and not kwargs):
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
        out = _Replay.apply(hidden_states, graphs, i)
        assert isinstance(out, Tensor)
        return out

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
        if not (torch.is_grad_enabled() and layer.training and hidden.requires_grad and hidden.is_cuda):
            return None
        if past_key_values is not None or use_cache or kwargs or position_embeddings is None:
            return None  # a KV cache, or extra attention arguments (packed sequences): eager
        cos, sin = position_embeddings
        autocast = torch.is_autocast_enabled("cuda")
        if autocast and torch.is_autocast_cache_enabled():
            self._warn_once(
                "autocast", "autocast's weight cache is on (cache_enabled=True): layers run eagerly"
            )
            return None
        return (
            tuple(hidden.shape),
            hidden.dtype,
            tuple(cos.shape),
            cos.dtype,
            None if mask is None else (tuple(mask.shape), mask.dtype),
            torch.get_autocast_dtype("cuda") if autocast else None,
            _fp8_state(layer),
        )

    def _begin(
        self, graphs: _ShapeGraphs, mask: Tensor | None, position_embeddings: tuple[Tensor, Tensor] | None
    ) -> None:
        assert position_embeddings is not None and graphs.cos is not None and graphs.sin is not None
        for p, g in zip(self._all_params, graphs.grads, strict=True):
            if p.grad is not g:
                raise GradsReplaced(
                    "trainer.cuda_graphs: a parameter's .grad was replaced or set to None after the backward "
                    "graphs were captured (zero gradients in place: optimizer.zero_grad(set_to_none=False))"
                )
        graphs.cos.copy_(position_embeddings[0])
        graphs.sin.copy_(position_embeddings[1])
        if mask is not None:
            assert graphs.mask is not None
            graphs.mask.copy_(mask)
        self._active = (graphs, position_embeddings, mask)
        self._clock[0] += 1
        self.replays += 1

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
    ) -> _ShapeGraphs | None:
        if len(self._shapes) >= self.max_shapes:
            self._warn_once(
                "shapes",
                f"{self.max_shapes} input shapes captured already; micro-batches of other shapes run eagerly "
                f"(this one: {tuple(hidden.shape)})",
            )
            return None
        assert position_embeddings is not None
        graphs = self._capture(hidden, mask, position_embeddings)
        self._shapes[key] = graphs
        self.captures += 1
        log.info(
            "trainer.cuda_graphs: captured %d layers for input %s", len(self.layers), tuple(hidden.shape)
        )
        return graphs

    def _run_eager(self, i: int, x: Tensor, mask: Tensor | None, pe: tuple[Tensor, Tensor]) -> Tensor:
        return self._eager[i](x, attention_mask=mask, position_embeddings=pe)

    def _capture(self, hidden: Tensor, mask: Tensor | None, pe: tuple[Tensor, Tensor]) -> _ShapeGraphs:
        n = len(self.layers)
        graphs = _ShapeGraphs(n, self._clock)
        for p in self._all_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        graphs.grads = [p.grad for p in self._all_params]  # type: ignore[misc]

        # Warm-up on a side stream: Triton compiles, cuBLAS(Lt) handles and workspaces, and the FP8
        # self-check happen here, not inside a capture. Gradients go to autograd.grad's outputs, not .grad.
        side = warmup_stream(hidden.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(n):
                for _ in range(WARMUP_ITERS):
                    x = torch.randn_like(hidden).requires_grad_()
                    out = self._run_eager(i, x, mask, pe)
                    torch.autograd.grad(out, (x, *self._params[i]), torch.randn_like(out), allow_unused=True)
                    del x, out
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

        cos, sin = (t.detach().clone() for t in pe)
        graphs.cos, graphs.sin = cos, sin
        graphs.mask = None if mask is None else mask.detach().clone()
        x = torch.zeros_like(hidden).requires_grad_()
        outs: list[Tensor] = []
        for i in range(n):
            with torch.cuda.graph(graphs.fwd[i], pool=self._pool):
                out = self._run_eager(i, x, graphs.mask, (cos, sin))
            graphs.inputs.append(x)
            outs.append(out)  # keeps the captured autograd graph for the backward capture
            graphs.outputs.append(out.detach())
            x = out.detach().requires_grad_()

        grad_out = torch.zeros_like(outs[-1])
        grad_outputs: list[Tensor] = [grad_out] * n
        grad_inputs: list[Tensor] = [grad_out] * n
        for i in reversed(range(n)):
            params = self._params[i]
            grad_outputs[i] = grad_out
            with torch.cuda.graph(graphs.bwd[i], pool=self._pool):
                grads = torch.autograd.grad(outs[i], (graphs.inputs[i], *params), grad_out, allow_unused=True)
                into: list[Tensor] = []
                add: list[Tensor] = []
                for p, g in zip(params, grads[1:], strict=True):
                    if g is not None and p.grad is not None:
                        into.append(p.grad)
                        add.append(g)
                if into:
                    torch._foreach_add_(into, add)
            grad_in = grads[0]
            assert grad_in is not None
            grad_inputs[i] = grad_in
            grad_out = grad_in
            outs[i] = graphs.outputs[i]  # the captured autograd graph is no longer needed
        graphs.grad_outputs, graphs.grad_inputs = grad_outputs, grad_inputs
        torch.cuda.synchronize()
        return graphs
