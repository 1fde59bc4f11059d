"""The q, k and v projections of an attention as one FP8 linear in the trainer (``group_projections``).

Why: each FP8 linear quantizes its output gradient and its weight, transposes the weight and runs three
GEMMs; for k and v (N = 256 at 1.5B, 512 at 7B) these are too small for FP8 to gain. One linear over the
stacked weights (N = 2,048 at 1.5B, 4,608 at 7B) does each of these once: 2-3% of a 1.5B training step
with CUDA graphs, ~0.5% of a 7B layer's linears (``bench/train_step.py --qkv-group both``,
``bench/fp8_linear.py``; docs/performance.md). Every part's N is a multiple of 128, so
every 128x128 weight block and 1x128 gradient tile holds the same values as before and the quantized
operands are the same codes; what can differ is the FP32 summation order of the GEMMs and the input
gradient, which is now one GEMM rounded once instead of three rounded and added.

How: the members stay ``Fp8Linear`` modules with their own Parameters, so checkpoints, the optimizer, weight
sync (``export_fp8``) and FSDP see no change. The first member called with an input computes every member's
output in one ``Fp8Linear.run`` and keeps the others' outputs for their calls with the same input (the same
tensor object, version, grad mode and autocast state), as ``ops._quantize_input_fast`` keeps one
quantization of it; a member called with another input computes the group again. Autograd routes the
gradients: the outputs are column slices of one output (the narrow ones copied, so that the attention keeping
v for backward does not keep q and k), the biases are concatenated, and the weight handed to the FP8 linear
is a stand-in (``_StackedWeight``) whose backward splits dW by rows (or, where the members' FP32 gradients lie
one after another, the wgrad adds into their stack inside the GEMM: ``ops.WGRAD_INTO``). The FP8 linear reads
only its quantization, which is the members' FP8 weights stacked (kept per member quantization; a view, not a
copy, when the members keep their FP8 weights one after another: ``Fp8Linear.keep_fp8_in``, as the trainer's
FP32 masters lay them out).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from infir2_rl.fp8.linear import Fp8Linear
from infir2_rl.fp8.ops import WGRAD_INTO, Fp8Weight

GROUPS = (("q_proj", "k_proj", "v_proj"),)


def _placeholder(like: torch.Tensor, rows: int) -> torch.Tensor:
    """A (rows, K) tensor of ``like``'s dtype and device without memory (one element, expanded)."""
    return like.new_zeros(()).expand(rows, like.shape[1])


class _StackedWeight(torch.autograd.Function):
    """(W_1, ..., W_n) -> a placeholder (sum of N_i, K) tensor standing for their row stack, which nothing
    reads (the FP8 linear takes its shape, dtype and gradient only); backward splits dW by rows."""

    @staticmethod
    def forward(ctx: Any, *weights: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.rows = [w.shape[0] for w in weights]
        ctx.set_materialize_grads(False)  # no dW when the wgrad added it into the members' gradients
        return _placeholder(weights[0], sum(ctx.rows))

    @staticmethod
    def backward(ctx: Any, dw: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if dw is None:
            return (None,) * len(ctx.rows)
        return tuple(dw.split(ctx.rows, dim=0))


def _stacked_wgrad_into(stand_in: torch.Tensor) -> torch.Tensor | None:
    """``ops.WGRAD_INTO`` of a ``_StackedWeight`` stand-in: the row stack of its members' gradient targets
    when each member has one and they lie one after another (the trainer's FP32 masters lay q, k and v out
    so, and their gradients alike); else None, and dW is returned and split."""
    targets = []
    for w in stand_in._infir2_members:  # type: ignore[attr-defined]
        get = getattr(w, WGRAD_INTO, None)
        target = get(w) if get is not None else None
        if target is None:
            return None
        targets.append(target)
    return _adjacent_view(targets)


def _adjacent_view(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The row stack of contiguous 2-D ``parts`` of one width as a view, when each starts in their common
    storage where the one before it ends; else None."""
    first = parts[0]
    offset, width = first.storage_offset(), first.shape[1]
    for p in parts:
        if (
            p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or p.storage_offset() != offset
            or p.shape[1] != width
            or not p.is_contiguous()
        ):
            return None
        offset += p.numel()
    return first.as_strided((sum(p.shape[0] for p in parts), width), (width, 1))


class ProjectionGroup:
    """Linears that read one input, run as one FP8 linear (module docstring)."""

    def __init__(self, members: list[Fp8Linear]) -> None:
        why = self.unfit(members)
        if why:
            raise ValueError(f"cannot group these FP8 linears: {why}")
        first = members[0]
        self.members = members
        self.splits = [m.out_features for m in members]
        self.has_bias = first.bias is not None
        self._stacked: tuple[tuple[Fp8Weight, ...], Fp8Weight] | None = None
        self._pending: tuple[tuple[Any, ...], dict[int, torch.Tensor]] | None = None

    @staticmethod
    def unfit(members: list[Fp8Linear]) -> str | None:
        """Why ``members`` cannot run as one FP8 linear, or None."""
        if len({m.in_features for m in members}) != 1 or len({m.pow2_scales for m in members}) != 1:
            return "they must share in_features and pow2_scales"
        if len({m.bias is None for m in members}) != 1:
            return "they must all have a bias or none"
        if any(m.out_features % 128 for m in members[:-1]):
            return "out_features must be divisible by 128 (the last one's need not be)"
        return None

    def _fp8_weight(self) -> Fp8Weight:
        parts = tuple(m._fp8_weight() for m in self.members)
        if all(m.kept_fp8 is not None for m in self.members):
            # Kept FP8 weights (Fp8Linear.keep_fp8_in) laid out one after another, as MasterWeights lays out
            # q, k and v: their stack is a view of the same buffers, which the optimizer keeps current.
            w_fp8, scale_inv = (
                _adjacent_view([p.w_fp8 for p in parts]),
                _adjacent_view([p.scale_inv for p in parts]),
            )
            if w_fp8 is not None and scale_inv is not None:
                return Fp8Weight(w_fp8, scale_inv)
            self._stacked = None  # kept buffers change in place: a stacked copy would go stale unseen
            with torch.autocast(parts[0].w_fp8.device.type, enabled=False):
                return Fp8Weight(torch.cat([p.w_fp8 for p in parts]), torch.cat([p.scale_inv for p in parts]))
        capturing = parts[0].w_fp8.is_cuda and torch.cuda.is_current_stream_capturing()
        if (
            not capturing
            and self._stacked is not None
            and all(a is b for a, b in zip(self._stacked[0], parts, strict=True))
        ):
            return self._stacked[1]
        with torch.autocast(parts[0].w_fp8.device.type, enabled=False):  # autocast's cat rejects FP8
            stacked = Fp8Weight(torch.cat([p.w_fp8 for p in parts]), torch.cat([p.scale_inv for p in parts]))
        # Not kept from inside a CUDA graph capture: graph memory must not reach later eager code.
        self._stacked = None if capturing else (parts, stacked)
        return stacked

    def invalidate(self) -> None:
        """Forget the kept outputs (the members' weights changed: ``Fp8Linear.invalidate_fp8_cache``)."""
        self._pending = None

    def _key(self, x: torch.Tensor) -> tuple[Any, ...]:
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        return (
            weakref.ref(x),
            x._version,
            torch.is_grad_enabled(),
            autocast,
            torch.get_autocast_dtype(device) if autocast else None,
            tuple(m._weight_key() for m in self.members),
        )

    def output(self, member: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
        """``member(x)``: taken from the group's last run on this input, or computed with all members'."""
        index = self.members.index(member)
        key = self._key(x)
        if self._pending is not None:
            pending_key, outputs = self._pending
            if pending_key[0]() is x and pending_key[1:] == key[1:] and index in outputs:
                out = outputs.pop(index)
                if not outputs:
                    self._pending = None
                return out
        weight = _StackedWeight.apply(*(m.weight for m in self.members))  # no grad_fn if none needs one
        if all(hasattr(m.weight, WGRAD_INTO) for m in self.members):
            weight._infir2_members = [m.weight for m in self.members]
            setattr(weight, WGRAD_INTO, _stacked_wgrad_into)
        bias = None
        if self.has_bias:  # the master biases as they are
            with torch.autocast(x.device.type, enabled=False):
                bias = torch.cat([m.bias for m in self.members if m.bias is not None])
        y = self.members[0].run(x, weight, bias, self._fp8_weight())
        # The widest part stays a view of the output; the others are copies, so that a narrow part kept for
        # backward (v, by the attention) does not keep the whole output alive: 0.87 GiB more at 1.5B and
        # 8,192 tokens when all three were views.
        widest = self.splits.index(max(self.splits))
        parts = [p if i == widest else p.clone() for i, p in enumerate(y.split(self.splits, dim=-1))]
        out = parts.pop(index)
        self._pending = (key, {i if i < index else i + 1: p for i, p in enumerate(parts)})
        return out


def group_projections(model: nn.Module) -> int:
    """Run each attention's q, k and v ``Fp8Linear`` as one FP8 linear (module docstring); returns how many
    groups were made. A parent whose three projections are not all ``Fp8Linear``, or do not fit
    (``ProjectionGroup.unfit``: e.g. k and v of 64 features), is left alone."""
    count = 0
    for parent in model.modules():
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if all(type(m) is Fp8Linear for m in members) and not ProjectionGroup.unfit(members):  # type: ignore[arg-type]
                group = ProjectionGroup(members)  # type: ignore[arg-type]
                for m in group.members:
                    m._group = group
                count += 1
    return count


def ungroup_projections(model: nn.Module) -> None:
    """Undo ``group_projections``: every ``Fp8Linear`` runs on its own again."""
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m._group = None
