"""megatron's decoder layers replayed from CUDA graphs (``trainer.cuda_graphs`` with the local spec).

Why: eager, this backend's FP8 step is host-bound (1.77x its BF16 step at 1.5B x 4,096 on an H200,
docs/performance.md "Megatron backend"): per layer and micro-batch the host runs megatron's module code, our
FP8 autograd Functions and cuBLASLt set-ups slower than the GPU runs the kernels. The torch backend's
``LayerGraphs`` (trainers/layer_graphs.py) takes that host work out for HF layers; this module puts
megatron's ``TransformerLayer`` behind the same machinery, rather than megatron-core's own
``CudaGraphManager``, whose capture rules (RNG tracker, ``create_cudagraphs()`` after an eager pass over every
shape, an assertion on an unseen one) differ from those the rest of the trainer already follows.

How: each layer's ``forward`` is patched per instance (names, state dicts and checkpoints are unchanged). The
patched forward takes megatron's keywords (``hidden_states`` [s, b, h], ``attention_mask``, ``rotary_pos_emb``,
and the rest, all None in our GPTModel calls) and calls ``LayerGraphs.call`` with HF's (the rotary table as
``position_embeddings``, one tuple object per table, since the graphs check that every layer of a micro-batch
gets the one layer 0 got). ``LayerGraphs`` then replays the layer, or runs megatron's own forward eagerly where
its rules say (a keyword we did not expect that is not None, a shape past the cap, too little memory). It
returns ``(output, context)`` as megatron's layer does.

What the graphs need from the trainer (trainers/megatron/trainer.py): autocast without its weight cache, the
parameters' ``.grad`` zeroed in place, micro-batches padded to a length bucket and run largest first, the kept
FP8 weights refreshed before each micro-batch (``refresh``: layers.ParallelLinear), the graphs dropped to make
room for a colocated engine. Not with tensor parallelism (the row-parallel all-reduce inside a graph has not
run here), gradient checkpointing or the te spec.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from infir2_rl.trainers.layer_graphs import LayerGraphs


def _megatron_forward(
    forward: Callable[..., tuple[Tensor, Any]],
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    past_key_values: Any = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[Tensor, Tensor] | None = None,
    **kwargs: Any,
) -> Tensor:
    """Layer i in HF's signature (what ``LayerGraphs`` captures or runs eagerly): megatron's own forward."""
    out, _ = forward(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        rotary_pos_emb=None if position_embeddings is None else position_embeddings[0],
        **kwargs,
    )
    return out


class _RotaryPair:
    """The ``position_embeddings`` tuple for a rotary table: the same tuple object while the table is the
    same tensor (one GPTModel call passes one table to every layer)."""

    def __init__(self) -> None:
        self._table: Tensor | None = None
        self._pair: tuple[Tensor, Tensor] | None = None

    def __call__(self, table: Tensor | None) -> tuple[Tensor, Tensor] | None:
        if table is None:
            return None
        if table is not self._table:
            self._table, self._pair = table, (table, table)
        return self._pair


def _graphed_forward(
    graphs: LayerGraphs,
    i: int,
    pair: _RotaryPair,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    rotary_pos_emb: Tensor | None = None,
    context: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """The patched ``TransformerLayer.forward``: megatron's keywords in, ``(output, context)`` out."""
    extra = {k: v for k, v in kwargs.items() if v is not None}
    if context is not None:
        extra["context"] = context  # (GPT has no cross-attention: the layer runs eagerly and passes it on)
    out = graphs.call(
        i, hidden_states, attention_mask=attention_mask, position_embeddings=pair(rotary_pos_emb), **extra
    )
    return out, context


def install(decoder: nn.Module, check_memory: bool, refresh: Callable[[], object]) -> LayerGraphs:
    """Patch the layers of megatron's ``decoder`` (a TransformerBlock) to replay from CUDA graphs; returns the
    graphs (``release``, counters)."""
    layers = list(decoder.layers)  # type: ignore[arg-type]
    forwards: list[Callable[..., Tensor]] = [
        functools.partial(_megatron_forward, layer.forward) for layer in layers
    ]
    graphs = LayerGraphs(
        decoder, check_memory=check_memory, forwards=forwards, layers=layers, refresh=refresh
    )
    pair = _RotaryPair()
    for i, layer in enumerate(layers):
        layer.forward = functools.partial(_graphed_forward, graphs, i, pair)  # type: ignore[method-assign]
    return graphs
