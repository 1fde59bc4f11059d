"""Trainer-side scoring under ``true_on_policy``: per-token log-probs by the engine's batch-invariant walk.

``score_tokens`` runs the walk of ``models/invariant.py`` (embedding, ``decoder_layer`` per layer, final
norm) over right-padded rows (each row attends within itself through ``invariant_ops.causal_attention``),
then the lm_head and log-softmax the way the engine's
sampler computes them (``_engine_chunk`` inside ``token_scores.chunked_token_scores``: the invariant BF16
GEMM and the sampler's chunked log-sum-exp), so the log-prob of a sampled token equals the engine's bit for
bit. The backward is the fast path's (``chunked_token_scores`` recomputes each chunk's logits with the
ordinary GEMM; on CUDA one Triton pass makes their gradient): only forward values enter the policy ratio.
Like ``scoring.py`` it never materialises the logits of the whole batch.

On a GPU the trainer replays the decoder layers from CUDA graphs (``LayerGraphs`` over ``layer_forwards``,
trainers/torch/trainer.py): the eager walk is host-bound (an FP8 layer is a few dozen Triton launches), and a
replay runs the same kernels on the same bytes, so the log-probs stay the engine's bit for bit
(tests/test_true_on_policy_gpu.py runs both).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from infir2_rl.models import invariant
from infir2_rl.models import invariant_ops as ops
from infir2_rl.trainers import token_scores_fused
from infir2_rl.trainers.token_scores import DEFAULT_CHUNK_TOKENS, chunked_token_scores


def _engine_chunk(
    h_c: Tensor, w: Tensor, targets_C: Tensor, temperature: float, need_z: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk as the engine scores it: the invariant lm_head GEMM, the sampler's log-sum-exp and
    ``z / T``; the entropy's logits (a metric and a bonus term) are not bit-matched to anything."""
    z = ops.mm(h_c, w)
    temps = torch.full((h_c.shape[0],), temperature, dtype=torch.float32, device=h_c.device)
    logp, lse = ops.token_logprobs(z, temps, targets_C)
    return logp, lse, z.float() / temperature if need_z else None


# layers(i, hidden (B, L, E), position_embeddings=(cos, sin)) -> hidden: decoder layer i of the walk, eager
# (``layer_forward``) or replayed from CUDA graphs (``LayerGraphs.call`` over ``layer_forwards``).
Layers = Callable[..., Tensor]


def layer_forward(
    layer: nn.Module,
    config: Any,
    hidden_BLE: Tensor,
    attention_mask: Tensor | None = None,
    position_embeddings: tuple[Tensor, Tensor] | None = None,
    **unused: Any,
) -> Tensor:
    """Decoder layer ``layer`` of the walk over right-padded rows (B, L, E) BF16, each row attending within
    itself; ``position_embeddings``: the walk's rotary tables (``invariant.rope_tables``, at least L rows).
    Its signature is a transformers decoder layer's, the one ``LayerGraphs`` calls and captures."""
    if attention_mask is not None or unused.get("past_key_values") is not None or unused.get("use_cache"):
        raise ValueError("true_on_policy: the walk's decoder layer takes no attention mask or KV cache")
    assert position_embeddings is not None
    batch, length, width = hidden_BLE.shape
    positions = torch.arange(length, device=hidden_BLE.device).repeat(batch)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kv = (t.view(batch, length, *t.shape[1:]).transpose(1, 2) for t in (k, v))
        return ops.causal_attention(q.view(batch, length, *q.shape[1:]), *kv).view(batch * length, -1)

    h = invariant.decoder_layer(
        layer, config, hidden_BLE.reshape(batch * length, width), positions, attend, *position_embeddings
    )
    return h.view(batch, length, width)


def layer_forwards(model: nn.Module) -> list[Callable[..., Tensor]]:
    """``layer_forward`` bound to each decoder layer of ``model``: what the trainer's ``LayerGraphs`` captures
    under ``true_on_policy`` (instead of the layers' transformers forwards)."""
    inner: Any = model.model  # type: ignore[assignment]
    return [functools.partial(layer_forward, layer, model.config) for layer in inner.layers]


def score_tokens(
    model: nn.Module,
    input_ids_BL: Tensor,
    select_BL: Tensor,
    *,
    temperature: float,
    need_entropy: bool,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    layers: Layers | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(log-probs (B, L), entropies (B, L) or None) of right-padded rows, zeros where not selected; position
    t is scored from the hidden state at t - 1, as ``trainers/torch/scoring.score_tokens`` does. ``layers``:
    how decoder layer i runs (default: ``layer_forward``, eagerly)."""
    batch, length = input_ids_BL.shape
    config: Any = model.config  # type: ignore[assignment]
    device = input_ids_BL.device
    tables = invariant.rope_tables(config, length, device)
    if layers is None:
        forwards = layer_forwards(model)
        layers = lambda i, h, **kw: forwards[i](h, **kw)  # noqa: E731
    inner: Any = model.model  # type: ignore[assignment]
    with torch.autocast(device.type, enabled=False):
        hidden = invariant.embed(model, input_ids_BL.reshape(-1)).view(batch, length, -1)
        for i in range(len(inner.layers)):
            hidden = layers(i, hidden, position_embeddings=tables)
        hidden = invariant.final_norm(model, hidden.reshape(batch * length, -1)).view(batch, length, -1)
        picked = select_BL.bool().clone()
        picked[:, 0] = False
        head: Any = model.get_output_embeddings()  # type: ignore[operator]
        logp, entropy = chunked_token_scores(
            hidden[:, :-1][picked[:, 1:]], head.weight, input_ids_BL[:, 1:][picked[:, 1:]],
            temperature=temperature, need_entropy=need_entropy, compute_dtype=invariant.DTYPE,
            chunk_tokens=chunk_tokens, chunk_scores=_engine_chunk,
            fused=token_scores_fused.available(device),  # the backward's Triton pass (forward: the engine's)
        )  # fmt: skip
    logp_BL = logp.new_zeros(batch, length)
    logp_BL[picked] = logp
    entropy_BL = None
    if entropy is not None:
        entropy_BL = entropy.new_zeros(batch, length)
        entropy_BL[picked] = entropy
    return logp_BL, entropy_BL
