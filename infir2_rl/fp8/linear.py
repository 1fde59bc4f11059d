"""FP8 linear modules and the functions that swap them into a transformers model.

* ``Fp8Linear``: a drop-in ``nn.Linear`` for training. Its Parameters (the master weight, FP32 or BF16, and
  the bias) are unchanged; each forward quantizes the weight in 128x128 blocks (cached until the weight
  changes) and runs fprop/dgrad/wgrad in blockwise FP8 (``ops.py``). ``export_fp8()`` returns the exact
  bytes and scales the forward used, which is what weight sync sends to the rollout engines. Given buffers
  of its own (``keep_fp8_in``: the trainer's FP32 masters do, trainers/torch/master_weights.py), it keeps
  the FP8 weight there, where the optimizer can write it as it updates the master and CUDA graphs read it.
* ``Fp8InferenceLinear``: W8A8 for rollout. Holds only the FP8 weight and its FP32 ``weight_scale_inv``
  (the checkpoint format), quantizes activations per 1x128 tile at run time.
* ``fp8_disabled(model)``: a context in which every ``Fp8Linear`` runs as a plain linear on its master
  weight (how a BF16 trainer would score the same tokens; used to measure that mismatch in the same run).
* ``swap_to_fp8_training`` / ``swap_to_fp8_inference``: replace the decoder linears (q, k, v, o, gate, up,
  down projections) and nothing else; embeddings, lm_head and norms stay in higher precision. Model files
  never mention FP8.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from infir2_rl.fp8 import gemm, ops, quant_triton
from infir2_rl.fp8.ops import Fp8Weight, fp8_linear, fp8_linear_forward
from infir2_rl.fp8.quant import FP8_DTYPE, quantize_weight_blockwise

if TYPE_CHECKING:
    from infir2_rl.fp8.grouped import ProjectionGroup

DECODER_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run in blockwise FP8; parameters and state dict are unchanged.

    The FP8 weight is cached per weight version (``weight._version``, bumped by in-place tensor ops such as
    ``load_state_dict`` or the unfused AdamW) and storage, so micro-batches of one step share one
    quantization. Writes through ``weight.data`` and torch's fused optimizers (``AdamW(fused=True)``, the
    CUDA default here: checked in torch 2.13, ``_version`` stays put) bypass the version counter: call
    ``invalidate_fp8_cache()`` after them (the trainers do, after every optimizer step). The cache holds 1 byte per weight; the
    GPU dgrad's W^T is made by each backward and freed after it (``ops._fast_backward``).

    Kept FP8 weight (``keep_fp8_in(w_fp8, scale_inv)``): the quantization lives in those buffers instead of
    the cache, stamped with the weight's version and storage. A forward that finds the stamp stale quantizes
    into them in place; an optimizer that writes them itself as it updates the master (the flat AdamW,
    trainers/flat_adamw.py) stamps them with ``mark_fp8_fresh``, and then no forward quantizes at all. A CUDA
    graph captured over the forward reads the buffers, so whoever replays it checks the stamps first
    (``refresh_fp8``; trainers/layer_graphs.py does, once per micro-batch, through ``refresh_kept_fp8``),
    and a capture that finds them stale refuses.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        pow2_scales: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.pow2_scales = pow2_scales
        # False runs a plain (dense) linear on the master weight: see `fp8_disabled`.
        self.fp8_enabled = True
        self._fp8_cache: tuple[tuple[object, ...], Fp8Weight] | None = None
        # Set by ``grouped.group_projections``: the fused q|k|v linear this module's forward goes through.
        self._group: ProjectionGroup | None = None
        # True where the input's producer keeps it for its own backward (the attention's output, o_proj's
        # input: ``mark_kept_inputs``): the weight gradient's token tiles are then made from it at backward.
        self.input_kept = False
        # The kept FP8 weight (keep_fp8_in) and the weight key it was made from (None: stale).
        self._kept: Fp8Weight | None = None
        self._kept_key: tuple[int, int] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, pow2_scales: bool = False) -> Fp8Linear:
        """An ``Fp8Linear`` that shares ``linear``'s Parameter objects (no copy)."""
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta", pow2_scales=pow2_scales)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def _weight_key(self) -> tuple[object, ...]:
        w = self.weight
        return (w._version, w.data_ptr(), w.device, w.dtype, tuple(w.shape), self.pow2_scales)

    def invalidate_fp8_cache(self) -> None:
        self._fp8_cache = None
        self._kept_key = None
        if self._group is not None:
            self._group.invalidate()

    def keep_fp8_in(self, w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Keep the FP8 weight in these buffers from now on: ``w_fp8`` (N, K) float8_e4m3fn and ``scale_inv``
        (ceil(N/128), ceil(K/128)) FP32, both contiguous on the weight's device (class docstring)."""
        n, k = self.out_features, self.in_features
        shapes = ((n, k), (_ceil_div(n, 128), _ceil_div(k, 128)))
        if (
            (w_fp8.dtype, scale_inv.dtype) != (FP8_DTYPE, torch.float32)
            or (tuple(w_fp8.shape), tuple(scale_inv.shape)) != shapes
            or not (w_fp8.is_contiguous() and scale_inv.is_contiguous())
            or w_fp8.device != self.weight.device
        ):
            raise ValueError(
                f"keep_fp8_in: expected contiguous {FP8_DTYPE} {shapes[0]} and float32 {shapes[1]} on "
                f"{self.weight.device}, got {w_fp8.dtype} {tuple(w_fp8.shape)} and {scale_inv.dtype} "
                f"{tuple(scale_inv.shape)} on {w_fp8.device}"
            )
        self._kept, self._kept_key = Fp8Weight(w_fp8, scale_inv), None
        self._fp8_cache = None

    @property
    def kept_fp8(self) -> Fp8Weight | None:
        """The buffers given to ``keep_fp8_in``, or None."""
        return self._kept

    def _kept_stamp(self) -> tuple[int, int]:
        # The kept buffers fix the device, dtype, shape and pow2 setting: the version and storage suffice (a
        # shorter key than _weight_key: it is checked for every linear before each graphed micro-batch).
        # The weight read from ``_parameters``: ``nn.Module.__getattr__``'s Python fallback is the slow part of
        # a ``self.weight`` (refresh_kept_fp8).
        w: torch.Tensor | None = self._parameters.get("weight")
        if w is None:  # a weight set as a plain attribute
            w = self.weight
        return (w._version, w.data_ptr())

    def kept_fp8_fresh(self) -> bool:
        """Whether the kept FP8 weight is the quantization of the weight as it is now (False without one)."""
        return self._kept is not None and self._kept_key == self._kept_stamp()

    def mark_fp8_fresh(self) -> None:
        """The kept FP8 weight is the quantization of the weight as it is now (its writer says so)."""
        self._kept_key = self._kept_stamp()
        if self._kept is not None:
            ops.forget_dequantized(self._kept.w_fp8)

    @torch.no_grad()
    def refresh_fp8(self) -> bool:
        """Quantize the weight into the kept buffers if their stamp is stale; returns whether it did.

        The buffers are written without a version bump (a Triton kernel, or a copy through ``.data``): the
        kept weights of a layer are views of one buffer sharing one version counter, so a bump for k_proj's
        would fail the backward of q_proj, which saved its own, unchanged, view. Readers that cache by version
        are told directly (``mark_fp8_fresh``)."""
        if self._kept is None or self._kept_key == self._kept_stamp():
            return False
        w = self.weight.detach()
        kept = self._kept
        if gemm.fast_path_ok(w, self.out_features, self.in_features):
            quant_triton.quantize_weight(w, self.pow2_scales, out=(kept.w_fp8, kept.scale_inv))
        else:
            w_fp8, scale_inv = quantize_weight_blockwise(w, pow2_scales=self.pow2_scales)
            kept.w_fp8.data.copy_(w_fp8)
            kept.scale_inv.data.copy_(scale_inv)
        self.mark_fp8_fresh()
        return True

    def _fp8_weight(self) -> Fp8Weight:
        # Not under a ``torch.no_grad`` decorator: entering and leaving it cost ~5 us of host time per call, and
        # this runs for every FP8 linear in each eager forward and in each weight-sync export (196 per push at
        # 1.5B); only the quantizing branches need it (``refresh_fp8`` has its own).
        if isinstance(self.weight, DTensor):
            # Under FSDP2 the module holds its shard between forwards; quantizing it would give another
            # tensor's bytes (and the Triton quantizer would read past a shard).
            raise RuntimeError(
                "Fp8Linear: the weight is an FSDP shard outside a forward; export with "
                "TorchTrainer.export_weights() or call export_fp8() from a forward hook"
            )
        kept = self._kept
        if kept is not None and self._kept_key == self._kept_stamp():
            # Fresh kept buffers (the flat AdamW wrote them with the master): nothing to refresh, captured or
            # not, so no CUDA capture query (a weight sync exports 196 linears at 1.5B through here).
            return kept
        capturing = self.weight.is_cuda and torch.cuda.is_current_stream_capturing()
        if kept is not None:  # stale
            if capturing:
                raise RuntimeError(
                    "Fp8Linear: a CUDA graph capture found the kept FP8 weight stale (refresh_fp8 before "
                    "capturing: the graph reads the buffers, it does not quantize)"
                )
            self.refresh_fp8()
            return kept
        if capturing:
            # Inside a CUDA graph capture (trainers/layer_graphs.py) the quantization is recorded, so
            # every replay quantizes the weight as it is then; caching the captured tensors would hand graph
            # memory to later eager code.
            return self._quantize()
        key = self._weight_key()
        if self._fp8_cache is None or self._fp8_cache[0] != key:
            self._fp8_cache = (key, self._quantize())
        return self._fp8_cache[1]

    @torch.no_grad()
    def _quantize(self) -> Fp8Weight:
        w = self.weight.detach()
        if gemm.fast_path_ok(w, self.out_features, self.in_features):
            return Fp8Weight(*quant_triton.quantize_weight(w, self.pow2_scales))  # W^T: made in backward
        return Fp8Weight(*quantize_weight_blockwise(w, pow2_scales=self.pow2_scales))

    def export_fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight_fp8 (N, K), weight_scale_inv (ceil(N/128), ceil(K/128)))`` exactly as forward uses them.
        With kept buffers these are the buffers themselves, rewritten by the next optimizer step like every
        other parameter a weight sync reads."""
        fp8w = self._fp8_weight()
        return fp8w.w_fp8, fp8w.scale_inv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return F.linear(x, self.weight, self.bias)  # autocast applies as to any nn.Linear
        if self._group is not None:
            return self._group.output(self, x)
        return self.run(x, self.weight, self.bias, self._fp8_weight())

    def run(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8w: Fp8Weight
    ) -> torch.Tensor:
        """The FP8 linear of ``x`` with ``fp8w`` (the quantization of ``weight``) and ``bias``, in this module's
        settings: ``forward``'s body, which ``grouped.ProjectionGroup`` also runs on its fused weight."""
        w_fp8, scale_inv = fp8w.w_fp8, fp8w.scale_inv
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        # The autocast dtype out, x rounded to it before quantization (``ops.autocast_output``); q, k and v (gate
        # and up) share one quantization of their common input (ops._quantize_input_fast), and each gradient
        # comes back BF16-rounded in FP32, so they add in FP32 as under autocast.
        out_dtype, round_to = ops.autocast_output(x)
        pow2 = self.pow2_scales
        if not needs_grad:  # inference (e.g. old log-probs): the W8A8 path, no tensors kept for backward
            return fp8_linear_forward(x, w_fp8, scale_inv, bias, pow2, out_dtype=out_dtype, round_to=round_to)
        return fp8_linear(
            x, weight, bias, fp8w, pow2, out_dtype=out_dtype, round_to=round_to, input_kept=self.input_kept
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8=e4m3 blockwise, pow2_scales={self.pow2_scales}"


class Fp8InferenceLinear(nn.Module):
    """W8A8 linear: buffers ``weight`` (float8_e4m3fn, N x K) and ``weight_scale_inv`` (FP32), optional
    ``bias``; activations are quantized per 1x128 tile at run time and the output has the input's dtype.

    ``module.to(dtype)`` leaves ``weight`` and ``weight_scale_inv`` in their formats (it moves devices only).
    """

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        pow2_scales: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.pow2_scales = pow2_scales
        nb, kb = _ceil_div(out_features, 128), _ceil_div(in_features, 128)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale_inv", torch.ones(nb, kb, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, pow2_scales: bool = False) -> Fp8InferenceLinear:
        """Quantize ``linear``'s current weight with the training quantizer (same bytes as ``Fp8Linear``)."""
        bias = linear.bias
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=bias is not None,
            device=linear.weight.device,
            dtype=bias.dtype if bias is not None else torch.bfloat16,
            pow2_scales=pow2_scales,
        )
        if isinstance(linear, Fp8Linear) and linear.pow2_scales == pow2_scales:
            w_fp8, scale_inv = linear.export_fp8()
        else:
            with torch.no_grad():
                w_fp8, scale_inv = quantize_weight_blockwise(linear.weight.detach(), pow2_scales=pow2_scales)
        new.load_fp8_(w_fp8, scale_inv)
        if bias is not None and new.bias is not None:
            new.bias.copy_(bias.detach())
        return new

    @torch.no_grad()
    def load_fp8_(self, weight_fp8: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Copy a new FP8 weight and its scales in place (weight sync: storage and shapes are kept)."""
        for dst, src in self.fp8_copies(weight_fp8, scale_inv):
            dst.copy_(src)

    def fp8_copies(
        self, weight_fp8: torch.Tensor, scale_inv: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (destination, source) pairs ``load_fp8_`` copies, after checking dtype and shapes: for a caller
        that batches many tensors' copies (``weight_sync.receiver``, through ``buckets.copy_pairs``)."""
        if weight_fp8.dtype != FP8_DTYPE or tuple(weight_fp8.shape) != tuple(self.weight.shape):
            raise ValueError(
                f"weight_fp8 {weight_fp8.dtype} {tuple(weight_fp8.shape)}: expected {FP8_DTYPE} "
                f"{tuple(self.weight.shape)}; quantize with quantize_weight_blockwise first"
            )
        if tuple(scale_inv.shape) != tuple(self.weight_scale_inv.shape):
            raise ValueError(
                f"weight_scale_inv shape {tuple(scale_inv.shape)}: expected {tuple(self.weight_scale_inv.shape)} "
                "(one FP32 scale per 128x128 block)"
            )
        return [(self.weight, weight_fp8), (self.weight_scale_inv, scale_inv)]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp8InferenceLinear:  # type: ignore[override]
        # Module.to(dtype) casts every floating buffer, FP8 ones included; casting the FP32 scales to BF16
        # would lose precision. Keep both formats and follow only the device change.
        keep = {"weight": self.weight, "weight_scale_inv": self.weight_scale_inv}
        super()._apply(fn, recurse)
        for name, old in keep.items():
            new = self._buffers[name]
            assert new is not None
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear_forward(x, self.weight, self.weight_scale_inv, self.bias, self.pow2_scales)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"W8A8 e4m3 blockwise, pow2_scales={self.pow2_scales}"
        )


def _decoder_linears(
    model: nn.Module, types: tuple[type, ...] = (nn.Linear,)
) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(full name, parent, attribute, module) for each linear of exactly one of ``types`` named like a
    decoder projection (exact types: subclasses such as LoRA or already-swapped layers are left alone)."""
    found = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if attr in DECODER_LINEAR_NAMES and type(child) in types:
                assert isinstance(child, nn.Linear)
                full = f"{parent_name}.{attr}" if parent_name else attr
                found.append((full, parent, attr, child))
    return found


def swap_to_fp8_training(model: nn.Module, pow2_scales: bool = False) -> list[str]:
    """Replace decoder ``nn.Linear``s by ``Fp8Linear`` sharing the same Parameters; returns swapped names.

    Parameters keep their identity, so an optimizer built before the swap keeps working.
    """
    swapped = []
    for full, parent, attr, child in _decoder_linears(model):
        setattr(parent, attr, Fp8Linear.from_linear(child, pow2_scales=pow2_scales))
        swapped.append(full)
    return swapped


def swap_to_fp8_inference(model: nn.Module, pow2_scales: bool = False) -> list[str]:
    """Replace decoder ``nn.Linear``s (or ``Fp8Linear``s) by ``Fp8InferenceLinear`` quantized from their
    current weights; returns swapped names."""
    swapped = []
    for full, parent, attr, child in _decoder_linears(model, (nn.Linear, Fp8Linear)):
        setattr(parent, attr, Fp8InferenceLinear.from_linear(child, pow2_scales=pow2_scales))
        swapped.append(full)
    return swapped


def mark_kept_inputs(model: nn.Module) -> int:
    """Set ``input_kept`` on each SDPA attention's ``o_proj`` ``Fp8Linear`` (Qwen2/Llama layout:
    ``self_attn.o_proj``, ``self_attn.config._attn_implementation == "sdpa"``); returns how many. Its input is
    the attention's output, which SDPA's flash and memory-efficient kernels and varlen flash attention keep for
    their backward, so an FP8 copy of it is 1 byte per element for nothing (0.33 GiB at 1.5B and 8,192 tokens;
    docs/performance.md). Only for those attentions: elsewhere (eager attention keeps its weights, not its
    output) the linear would keep 2 bytes per element where it kept 1."""
    count = 0
    for name, attn in model.named_modules():
        o_proj = getattr(attn, "o_proj", None)
        sdpa = getattr(getattr(attn, "config", None), "_attn_implementation", None) == "sdpa"
        if name.rpartition(".")[2] == "self_attn" and type(o_proj) is Fp8Linear and sdpa:
            o_proj.input_kept = True
            count += 1
    return count


@contextlib.contextmanager
def fp8_disabled(model: nn.Module) -> Iterator[int]:
    """Run every ``Fp8Linear`` of ``model`` as a dense linear inside the block; yields how many there are."""
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    previous = [m.fp8_enabled for m in linears]
    for m in linears:
        m.fp8_enabled = False
    try:
        yield len(linears)
    finally:
        for m, enabled in zip(linears, previous, strict=True):
            m.fp8_enabled = enabled


def refresh_kept_fp8(modules: Sequence[Fp8Linear]) -> int:
    """``refresh_fp8`` for each module whose kept FP8 weight is stale; returns how many were. The test runs
    here, inline: the trainer's layer graphs make it for every FP8 linear before each micro-batch, and through
    ``refresh_fp8`` (its ``torch.no_grad`` and a ``self.weight`` lookup) it took ~1.7 ms of host time per micro-batch at
    1.5B (196 linears) while the GPU waited (docs/performance.md, "The GPU waiting for the host")."""
    stale = [m for m in modules if m._kept is not None and m._kept_key != m._kept_stamp()]
    for m in stale:
        m.refresh_fp8()
    return len(stale)
