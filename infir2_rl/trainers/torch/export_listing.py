"""The trainer's weight-sync export listed once, and given again while the model holds the same tensors.

A push names the same tensors every step: the model's parameters and buffers and, in FP8, each decoder linear's
kept FP8 weight and scale grid (``Fp8Linear.keep_fp8_in``), all of which the optimizer rewrites in place.
Listing them is a walk over the model (``state_dict()``; in FP8 ``fp8_state_from_model`` too), host time per
module and per tensor on every push: 1.9-6.5 ms at 1.5B on the GPU hosts measured, FP8's walk 1.8x BF16's
(docs/performance.md, "Weight sync"). ``ExportRecorder`` watches one walk go by and, if every tensor it
yields is held by the model (a parameter or buffer, by object and address, or a linear's kept FP8 buffers),
makes an ``ExportListing`` of it. A later push takes the listing while ``ExportListing.current()`` finds
every holder still holding the same tensor at the same address; it first re-quantizes any kept FP8 weight that
is stale, the check each linear's ``export_fp8`` makes in the walk. A walk that yields a tensor the model does
not hold (a quantization made on the fly, a cast, a copy) gives no listing: such exports walk every push.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from infir2_rl.fp8.linear import Fp8Linear
from infir2_rl.weight_sync.copy_plan import Key, key

# Remembered for a walk that gave no listing, so that later pushes do not note their walks again.
UNLISTABLE = object()


class ExportListing:
    """The (name, tensor) pairs of one export, with what holds each tensor (see the module docstring)."""

    def __init__(
        self,
        named: list[tuple[str, Tensor]],
        held: list[tuple[dict[str, Any], str, Tensor, int]],
        kept: list[tuple[Fp8Linear, object]],
    ) -> None:
        self.named = named
        self._held = held  # (a module's _parameters or _buffers, key, the tensor there, its address)
        self._kept = kept  # (an FP8 linear, its kept FP8 weight object)

    def current(self) -> bool:
        """Whether the listed tensors are still the model's; stale kept FP8 weights are refreshed first."""
        for store, name, tensor, address in self._held:
            if store.get(name) is not tensor or tensor.data_ptr() != address:
                return False
        for linear, kept in self._kept:
            if linear.kept_fp8 is not kept:
                return False
            if not linear.kept_fp8_fresh():  # the weight changed since the optimizer wrote them (a load)
                linear.refresh_fp8()  # what its forward, and the walk's export_fp8, would do
        return True

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self.named)


class ExportRecorder:
    """Notes each (name, tensor) of a walk with what holds the tensor; ``listing()`` after the walk."""

    def __init__(self, model: nn.Module) -> None:
        # A tensor's holder by what an exported view of it is: address, dtype, shape, strides (copy_plan.key);
        # ("store", a module's _parameters or _buffers, the name there) or ("kept", a linear, its kept weight).
        self._holders: dict[Key, tuple[str, Any, Any]] = {}
        for module in model.modules():
            for store in (module._parameters, module._buffers):
                for name, tensor in store.items():
                    if tensor is not None:
                        self._holders[key(tensor)] = ("store", store, name)
            if isinstance(module, Fp8Linear) and module.kept_fp8 is not None:
                for tensor in (module.kept_fp8.w_fp8, module.kept_fp8.scale_inv):
                    self._holders[key(tensor)] = ("kept", module, module.kept_fp8)
        self._named: list[tuple[str, Tensor]] | None = []
        self._held: dict[tuple[int, str], tuple[dict[str, Any], str, Tensor, int]] = {}
        self._kept: dict[int, tuple[Fp8Linear, object]] = {}

    def add(self, name: str, tensor: Tensor) -> None:
        if self._named is None:
            return  # a tensor earlier in this walk had no holder
        holder = self._holders.get(key(tensor))
        if holder is None:
            self._named = None  # made for this push (a quantization, a cast, a copy): no listing
            return
        kind, owner, slot = holder
        if kind == "store":
            self._held[(id(owner), slot)] = (owner, slot, owner[slot], owner[slot].data_ptr())
        else:
            self._kept[id(owner)] = (owner, slot)
        self._named.append((name, tensor))

    def listing(self) -> ExportListing | None:
        """The listing of the walk seen, or None if one of its tensors is not held by the model."""
        if self._named is None:
            return None
        return ExportListing(self._named, list(self._held.values()), list(self._kept.values()))
