"""Per-token scores of a transformers causal LM without its full-vocabulary logits, padded or packed.

The model runs as usual up to its final hidden states; the lm_head module's forward is swapped, for the
duration of one call, for the chunked log-prob function of ``trainers/token_scores.py``, so the model
returns B x L x k scores (log-prob, and entropy when asked) in place of B x L x V logits. Swapping the
forward (not the module) keeps the parameter tree, tied embeddings, FSDP2's root hooks (they unshard the
lm_head weight around the root's forward and backward) and gradient checkpointing as they are.

Two layouts of a micro-batch (right-padded rows, ``TokenBatch``):

* padded: the B x L batch as it is, with its attention mask.
* packed: the real tokens of all rows back to back in one row of N = sum of lengths, ``position_ids``
  restarting at 0 for each sequence and no attention mask. On CUDA attention is varlen flash attention
  over each sequence alone (varlen_attention.py); elsewhere transformers builds a block-diagonal causal
  mask from the position ids (``masking_utils.find_packed_sequence_indices``) for SDPA. Either way no
  token attends across a sequence boundary, and no padding is computed. Scores are put back in the B x L layout, so
  loss functions see the same ``TokenScores`` either way.

A position t is scored (token t from the hidden state at t - 1) where ``select_BL[:, t]`` is set and t is
not the first token of its row; in the packed row that second rule is what keeps the last hidden state of
one sequence from scoring the first token of the next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from infir2_rl.trainers.token_scores import DEFAULT_CHUNK_TOKENS, chunked_token_scores
from infir2_rl.trainers.torch.varlen_attention import use_varlen, varlen_available, varlen_kwargs
from infir2_rl.types import TokenScores


@contextmanager
def _lm_head_forward(model: nn.Module, forward: Callable[[Tensor], Tensor]) -> Iterator[nn.Module]:
    head = model.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise NotImplementedError(
            f"model {type(model).__name__}: fused token scoring needs a bias-free nn.Linear lm_head, found {head!r}"
        )
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        raise NotImplementedError(
            f"model {type(model).__name__} rescales its logits after the lm_head; fused token scoring would "
            "skip that: not supported"
        )
    head.forward = forward  # type: ignore[method-assign]  # an instance attribute shadows the method
    try:
        yield head
    finally:
        del head.forward


def _positions(attention_mask_BL: Tensor) -> Tensor:
    """0, 1, 2, ... along each right-padded row (pads get their row's running count; they are never used)."""
    return (attention_mask_BL.long().cumsum(1) - 1).clamp_min(0)


def _no_mask(model: nn.Module) -> dict[str, None] | None:
    """The ``attention_mask`` argument under which the model builds no mask and every layer attends causally:
    the per-layer-type mapping ``{"full_attention": None}``, taken as given by the models that build their
    masks per layer type (transformers' Qwen2 and Qwen3: they set ``has_sliding_layers``) when they have no
    sliding-window layers. None for any other model (its mask is then built as usual; a plain None would not
    do, since transformers then searches the position ids for packed sequences, a wait for the device; under
    varlen attention, a custom implementation, it builds no mask at all)."""
    base = getattr(model, "base_model", model)
    return {"full_attention": None} if getattr(base, "has_sliding_layers", True) is False else None


def nonzero_counted(mask: Tensor, count: int | None) -> Tensor:
    """Indices of the set entries of a 1-D mask; with their ``count`` known, without waiting for the device."""
    if count is None:
        return torch.nonzero(mask).squeeze(1)
    return torch.nonzero_static(mask, size=count).squeeze(1)


def score_tokens(
    model: nn.Module,
    input_ids_BL: Tensor,
    attention_mask_BL: Tensor,
    select_BL: Tensor,
    *,
    temperature: float,
    need_entropy: bool,
    compute_dtype: torch.dtype,
    packed: bool,
    autocast: Callable[[], Any],
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    packed_length: Callable[[int], int] | None = None,
    fused: bool = False,
    lengths: Sequence[int] | None = None,
    num_selected: int | None = None,
    mask_free: bool | None = None,
) -> TokenScores:
    """Scores of ``input_ids_BL`` (right-padded rows) at the selected positions; zeros elsewhere.

    ``packed_length`` (packed, under the trainer's layer graphs): the packed row of N real tokens is padded
    to ``packed_length(N)`` tokens, a sequence of its own that nothing scores (``varlen_kwargs(padded_to=)``),
    so that rows of any composition share a few captured shapes. ``fused``: the chunks' softmax work in
    Triton (``token_scores.chunked_token_scores``).

    ``lengths`` (each row's real tokens) and ``num_selected`` (how many positions the scores cover), when the
    caller knows them on the host (``TokenBatch.counts``), spare every wait for the device: the positions come
    from ``nonzero_static`` of that size. ``num_selected`` must be the count of ``select_BL & attention_mask``
    at positions t >= 1. ``mask_free`` (default: on CUDA, with ``lengths`` given): padded rows run without an
    attention mask (right padding: causal attention keeps every pad out of every real token's output, so only
    the unscored pads' values change; transformers' mask builder waited to find whether the mask could be
    skipped, and SDPA with a padding mask cannot take the flash kernel). On CPU there is no wait to spare, and
    the mask stays: the CPU path keeps its numerics to the last bit (the demo's outcome swings with them)."""
    B, L = input_ids_BL.shape
    real = attention_mask_BL.bool()
    select = select_BL.bool() & real
    select[:, 0] = False
    if packed:
        # The real tokens' flat indices, found once (one device wait where the count is not given; boolean
        # indexing waited per use).
        flat = nonzero_counted(real.reshape(-1), None if lengths is None else sum(lengths))
        ids, pos, sel = (
            t.reshape(-1).index_select(0, flat)[None]
            for t in (input_ids_BL, _positions(attention_mask_BL), select)
        )
        n = ids.shape[1]
        padded_to = None if packed_length is None else packed_length(n)
        if padded_to is not None and padded_to > n:
            extra = padded_to - n
            ids = torch.nn.functional.pad(ids, (0, extra))
            pos = torch.cat([pos, torch.arange(extra, device=pos.device)[None]], dim=1)
            sel = torch.nn.functional.pad(sel, (0, extra))
        first = pos == 0
        sel = sel & ~first
        kwargs: dict[str, Any] = {"attention_mask": None, "position_ids": pos}
        attention: Any = nullcontext()
        if varlen_available(ids.device):  # flash over each sequence alone (varlen_attention.py)
            if lengths is None:
                seq_lens = attention_mask_BL.sum(1)
                kwargs |= varlen_kwargs(seq_lens[seq_lens > 0], padded_to)
            else:
                kwargs |= varlen_kwargs([n for n in lengths if n > 0], padded_to, ids.device)
            attention = use_varlen(model)
    else:
        attention = nullcontext()
        ids, sel = input_ids_BL, select
        if mask_free is None:
            mask_free = lengths is not None and input_ids_BL.is_cuda
        no_mask = _no_mask(model) if mask_free else None
        kwargs = {"attention_mask": attention_mask_BL if no_mask is None else no_mask}
    k = 2 if need_entropy else 1
    head = model.get_output_embeddings()  # type: ignore[operator]

    def forward(hidden_BTH: Tensor) -> Tensor:
        # The scored positions as flat indices, found once: token rows + 1 is scored from the hidden state at
        # rows. Boolean indexing instead made each use (two gathers, the scatter of the scores, and
        # their backward: five per micro-batch) wait for the device to count the mask, and every wait left
        # the GPU idle while the host caught up (docs/performance.md, "The GPU waiting for the host").
        # No row's first position is selected (set above, padded and packed), so rows - 1 stays in its row.
        rows = nonzero_counted(sel.reshape(-1), num_selected) - 1
        logp, entropy = chunked_token_scores(
            hidden_BTH.reshape(-1, hidden_BTH.shape[-1]).index_select(0, rows),
            head.weight,
            ids.reshape(-1).index_select(0, rows + 1),
            temperature=temperature,
            need_entropy=need_entropy,
            compute_dtype=compute_dtype,
            chunk_tokens=chunk_tokens,
            fused=fused,
        )
        values = logp[:, None] if entropy is None else torch.stack((logp, entropy), dim=1)
        return values.new_zeros(sel.numel(), k).index_copy(0, rows + 1, values).view(*sel.shape, k)

    with _lm_head_forward(model, forward), attention, autocast():
        scores = model(input_ids=ids, use_cache=False, **kwargs).logits  # type: ignore[operator]
    if packed:  # the real tokens back in place, without the pads of packed_length
        scores = scores.new_zeros(B * L, k).index_copy(0, flat, scores[0, :n]).view(B, L, k)
    return TokenScores(logprobs_BL=scores[..., 0], entropy_BL=scores[..., 1] if need_entropy else None)
