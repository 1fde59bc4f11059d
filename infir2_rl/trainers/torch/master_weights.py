"""FP32 master weights kept beside a BF16 model (``trainer.param_dtype: bfloat16``, the GPU default).

Why: with FP32 parameters under BF16 autocast (``param_dtype: float32``, the CPU path) every forward casts
each weight to BF16, every backward casts its gradient back to FP32, and the residual stream, the norms and
their saved activations stay FP32. At the 1.5B shape on an H100 a BF16 model (with the flat AdamW) made the
BF16 step 13% and the FP8 step 10% shorter (docs/performance.md, "A BF16 model with FP32 masters"). Here the model's
parameters are BF16, so activations flow in BF16 as in the rollout engine, and the FP32 values live where
the update needs them.

Layout. The parameters are split into segments: one per decoder layer (``model.layers.<i>.``) and one for
the rest (embeddings, final norm, lm_head). A segment holds its parameters' values in flat buffers, first
those the forward computes with, then those it only quantizes (the FP8 decoder linears' weights):

* ``flat`` (FP32): the masters, the exact weights the optimizer steps. A computed parameter is a BF16 view
  of ``copy``, which ``copy_to_model`` (or the flat AdamW, trainers/flat_adamw.py) rounds the masters into
  after each update; a quantized parameter stays FP32 and *is* its view of ``flat`` (a BF16 copy would cost
  2 bytes per weight and round it twice before FP8).
* ``fp8`` (``Fp8Region``, when the segment has FP8 linears): their FP8 weights and scales, in the order of
  their masters, which each ``Fp8Linear`` keeps there (``keep_fp8_in``). The flat AdamW writes them as it
  updates the masters (trainers/flat_adamw.py), so no forward quantizes a weight again: the FP8 step at
  1.5B had quantized every decoder weight from its FP32 master in each micro-batch's forward (3.2 ms of a
  129 ms step at 4,096 tokens, H100). q, k and v lie one after another, so their stack is a view
  (fp8/grouped.py).
* ``grads`` (FP32): gradients accumulate in FP32, as before. Each parameter's gradient of a backward (BF16,
  or FP32 from an FP8 wgrad) is added into its master's gradient (``param.main_grad``, a view of ``grads``)
  as soon as autograd has it (a post-accumulate-grad hook) and dropped. On a GPU the linears' weight
  gradients skip that: an FP8 linear's wgrad adds into ``main_grad`` inside its GEMM (``ops.WGRAD_INTO``:
  cuBLASLt with beta = 1), and each ``nn.Linear`` with a BF16 weight becomes a ``MainGradLinear`` whose dW
  GEMM does the same (``torch.addmm`` with an FP32 output): no dW is written and read again. The chunked token
  scores add the lm_head's dW chunk by chunk the same way (``WGRAD_INTO`` on every master's parameter,
  trainers/token_scores.py), and a tied embedding's own gradient then arrives alone through the hook. The first
  gradient of a segment allocates its buffer, so a backward allocates gradients layer by layer as it frees
  activations, as autograd did (one buffer for the model, allocated with the first gradient, raised the FP8
  step's peak by 2.6 GiB at 1.5B). ``release_grads`` frees them between eager steps (as
  ``zero_grad(set_to_none=True)`` did). The CUDA layer graphs add into these views themselves
  (trainers/layer_graphs.py), so they need them before capture and keep them (``ensure_grads``).

``optimizer_params`` are what the optimizer steps, in the model's parameter order (so that optimizer states
in checkpoints line up whatever ``param_dtype`` is): each parameter's master, a view of its segment's
``flat``. Checkpoints read ``state_dict`` (the masters, FP32) and restore them with ``load_state_dict``, so
resume stays exact. Not with FSDP (it keeps its own FP32 shards and gathers BF16 copies:
``trainer.fsdp_param_dtype``).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infir2_rl.fp8 import gemm
from infir2_rl.fp8.linear import Fp8Linear
from infir2_rl.fp8.ops import WGRAD_INTO


def computed_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a forward computes with directly, i.e. all but the FP8 linears' weights, which it only
    quantizes (128x128 blocks from the FP32 value): those stay FP32 in a BF16 model."""
    quantized = {id(m.weight) for m in model.modules() if isinstance(m, Fp8Linear)}
    return [p for p in model.parameters() if id(p) not in quantized]


def _main_grad_of(param: Tensor) -> Tensor:
    """The parameter's master's FP32 gradient, its segment's buffer allocated if this is the first gradient of
    the step. Also each FP8 linear weight's ``ops.WGRAD_INTO``: its GPU wgrad adds dW here inside the GEMM."""
    if getattr(param, "main_grad", None) is None:
        segment = param._infir2_segment()  # type: ignore[attr-defined]
        if segment is None:
            raise RuntimeError("MasterWeights: a gradient for a parameter whose masters are gone")
        segment.ensure_grads()  # the segment's first gradient of this step
    return param.main_grad  # type: ignore[attr-defined,no-any-return]


class _LinearIntoMainGrad(torch.autograd.Function):
    """``x W^T + b`` for a BF16 weight with an FP32 master: the dW GEMM adds into the master's gradient itself
    (``torch.addmm`` with an FP32 output and beta = 1: FP32 accumulation and one rounding) and no BF16 dW is
    returned. Autograd's dW was a BF16 tensor (rounded once more) that the hook then added: 10 bytes of
    traffic per weight and micro-batch against 8, 4.5 ms at the 1.5B shape and 8,192 tokens, H100
    (``bench/wgrad_accumulate.py``). The FP8 linears do the same with cuBLASLt (fp8/ops.py ``WGRAD_INTO``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.param = weight  # the Parameter itself (saved tensors come back without its attributes)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dy2d = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            target = _main_grad_of(ctx.param)
            torch.addmm(target, dy2d.t(), x.reshape(-1, x.shape[-1]), out_dtype=torch.float32, out=target)
        db = dy2d.sum(0) if ctx.needs_input_grad[2] else None
        return dx, None, db


class MainGradLinear(nn.Linear):
    """An ``nn.Linear`` whose BF16 weight has an FP32 master (``MasterWeights`` switches the class): on a GPU its
    weight gradient is added into the master's by the GEMM (``_LinearIntoMainGrad``); elsewhere, or when the
    dtypes differ from what it expects, it is a plain ``nn.Linear``."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        dtype = (
            torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        )
        if not (x.is_cuda and w.requires_grad and torch.is_grad_enabled() and w.dtype == dtype):
            return super().forward(x)
        if self.bias is not None and self.bias.dtype != dtype:
            return super().forward(x)
        out = _LinearIntoMainGrad.apply(x.to(dtype), w, self.bias)
        assert isinstance(out, Tensor)
        return out


def _accumulate_into_main_grad(param: Tensor) -> None:
    """A parameter's gradient of one backward, added into its master's FP32 gradient and dropped. None when
    its GEMM added it already (``WGRAD_INTO``): torch runs this hook for an undefined gradient too."""
    if param.grad is None:
        return
    _main_grad_of(param).add_(param.grad)
    param.grad = None


@dataclass
class Fp8Region:
    """The FP8 weights of a segment's FP8 linears (the back of ``flat``, from ``start``): ``codes`` holds each
    weight's e4m3 bytes at its master's offset minus ``start``, ``scales`` the 128x128 blocks' FP32 scales
    one weight after another, and ``blocks`` one row per 128x128 block for the flat AdamW's kernel: (master
    offset in ``flat``, N, K, block row, block column, scale index)."""

    start: int
    codes: Tensor
    scales: Tensor
    blocks: Tensor
    linears: list[Fp8Linear]
    pow2: bool
    aligned: bool  # every offset, K and start a multiple of 16 (quant_triton.quantize_weight_blocks)

    @staticmethod
    def build(flat: Tensor, start: int, linears: list[tuple[Fp8Linear, int]]) -> Fp8Region:
        """For ``linears`` given as (module, master offset in ``flat``), in offset order from ``start``."""
        pow2 = {m.pow2_scales for m, _ in linears}
        if len(pow2) != 1:
            raise ValueError("MasterWeights: FP8 linears of one segment must share pow2_scales")
        grids = [(-(-m.out_features // 128), -(-m.in_features // 128)) for m, _ in linears]
        codes = torch.empty(flat.numel() - start, dtype=torch.float8_e4m3fn, device=flat.device)
        scales = torch.empty(sum(nb * kb for nb, kb in grids), dtype=torch.float32, device=flat.device)
        rows = []
        s_off = 0
        for (m, offset), (nb, kb) in zip(linears, grids, strict=True):
            n, k = m.out_features, m.in_features
            m.keep_fp8_in(
                codes[offset - start : offset - start + n * k].view(n, k),
                scales[s_off : s_off + nb * kb].view(nb, kb),
            )
            index = torch.arange(nb * kb, dtype=torch.int64)
            fixed = torch.tensor([offset, n, k], dtype=torch.int64).expand(nb * kb, 3)
            rows.append(
                torch.cat([fixed, (index // kb)[:, None], (index % kb)[:, None], s_off + index[:, None]], 1)
            )
            s_off += nb * kb
        blocks = torch.cat(rows).to(flat.device)
        aligned = start % 16 == 0 and all(off % 16 == 0 and m.in_features % 16 == 0 for m, off in linears)
        return Fp8Region(start, codes, scales, blocks, [m for m, _ in linears], pow2.pop(), aligned)

    def mark_fresh(self) -> None:
        """The codes and scales are the quantization of the masters as they are now (the flat AdamW wrote them)."""
        for m in self.linears:
            m.mark_fp8_fresh()


@dataclass
class Segment:
    """The masters of a group of parameters (a decoder layer, or the rest) in flat buffers (module docstring)."""

    flat: Tensor  # FP32 masters: computed parameters first, then quantized ones
    copy: Tensor  # the computed parameters' BF16 values (the model's), the front of ``flat`` rounded
    slots: list[tuple[nn.Parameter, Tensor, int]]  # (parameter, its master, offset in flat)
    grads: Tensor | None = None
    fp8: Fp8Region | None = None  # the FP8 linears' kept FP8 weights (the back of flat)

    def ensure_grads(self) -> Tensor:
        """The FP32 gradient buffer, allocated (zeroed) and bound to the parameters if it was released."""
        if self.grads is None:
            self.grads = torch.zeros_like(self.flat)
            for p, master, offset in self.slots:
                master.grad = self.grads[offset : offset + p.numel()].view_as(p)
                p.main_grad = master.grad  # type: ignore[attr-defined]
        return self.grads

    def release_grads(self) -> None:
        self.grads = None
        for p, master, _ in self.slots:
            master.grad = None
            p.main_grad = None  # type: ignore[attr-defined]

    def copy_to_model(self) -> None:
        self.copy.copy_(self.flat[: self.copy.numel()])


def _segment_of(name: str) -> str:
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return ""


class MasterWeights:
    """FP32 masters of ``model``'s trainable parameters; the computed ones become BF16 (module docstring)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("MasterWeights: the model has no trainable parameters")
        if any(p.dtype != torch.float32 for _, p in named):
            raise TypeError(
                f"MasterWeights: parameters must start FP32, got {sorted({str(p.dtype) for _, p in named})}"
            )
        computed = {id(p) for p in computed_params(model)}
        fp8_linears = {id(m.weight): m for m in model.modules() if isinstance(m, Fp8Linear)}
        groups: dict[str, list[nn.Parameter]] = {}
        for name, p in named:
            groups.setdefault(_segment_of(name), []).append(p)
        with torch.no_grad():
            self.segments = [
                self._segment(params, computed, dtype, fp8_linears) for params in groups.values()
            ]
        master_of = {id(p): m for seg in self.segments for p, m, _ in seg.slots}
        if gemm.fused_wgrad_requested():  # BF16 linears: dW added into the master's gradient by the GEMM
            for module in model.modules():
                if (
                    type(module) is nn.Linear
                    and id(module.weight) in master_of
                    and id(module.weight) in computed
                ):
                    module.__class__ = MainGradLinear
        self.optimizer_params: list[Tensor] = [master_of[id(p)] for _, p in named]

    @staticmethod
    def _segment(
        params: list[nn.Parameter], computed: set[int], dtype: torch.dtype, fp8_linears: dict[int, Fp8Linear]
    ) -> Segment:
        layout = [p for p in params if id(p) in computed] + [p for p in params if id(p) not in computed]
        n_copy = sum(p.numel() for p in params if id(p) in computed)
        device = params[0].device
        seg = Segment(
            flat=torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=device),
            copy=torch.empty(n_copy, dtype=dtype, device=device),
            slots=[],
        )
        offset = 0
        for p in layout:
            n = p.numel()
            master = seg.flat[offset : offset + n].view_as(p)
            master.copy_(p)
            # The module keeps its Parameter object: BF16 values in ``copy``, or the master itself.
            p.data = seg.copy[offset : offset + n].view_as(p) if offset < n_copy else master
            master.requires_grad_(True)  # what the optimizer steps (it is in no autograd graph)
            # A module-level hook and a weak reference: a bound method would tie the parameters and their
            # segment into a cycle through C++ hook storage, which Python's collector cannot see.
            p._infir2_segment = weakref.ref(seg)  # type: ignore[attr-defined]
            p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
            # Whoever computes the whole gradient may add it into main_grad: an FP8 linear's GPU wgrad inside
            # its GEMM (fp8/ops.py), the chunked token scores the lm_head's (trainers/token_scores.py).
            if id(p) in fp8_linears or gemm.fused_wgrad_requested():
                setattr(p, WGRAD_INTO, _main_grad_of)
            seg.slots.append((p, master, offset))
            offset += n
        seg.copy_to_model()
        kept = [(fp8_linears[id(p)], off) for p, _, off in seg.slots if id(p) in fp8_linears]
        if kept:
            seg.fp8 = Fp8Region.build(seg.flat, n_copy, kept)
        return seg

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the model's BF16 parameters (after each optimizer step)."""
        for seg in self.segments:
            seg.copy_to_model()

    def ensure_grads(self) -> None:
        """Every segment's gradient buffer allocated and bound (the layer graphs add into them)."""
        for seg in self.segments:
            seg.ensure_grads()

    def all_reduce_grads(self) -> None:
        """SUM all-reduce of every segment's FP32 gradient buffer in place, over the default process group
        (``trainer.data_parallel: replicate``): one message per segment and no flattened copy of the gradients
        (1.5B: 6 GB). Every rank then holds the same sums, so the replicas' updates stay bit-equal."""
        import torch.distributed as dist

        for seg in self.segments:
            dist.all_reduce(seg.ensure_grads(), op=dist.ReduceOp.SUM)

    def zero_grad(self) -> None:
        for seg in self.segments:
            if seg.grads is not None:
                seg.grads.zero_()

    def release_grads(self) -> None:
        """Free the gradient buffers (between eager steps); the next gradients allocate them again, zeroed."""
        for seg in self.segments:
            seg.release_grads()

    def grad_norm(self) -> Tensor:
        """The global L2 norm of the gradients (one reduction per segment)."""
        norms = [torch.linalg.vector_norm(seg.grads) for seg in self.segments if seg.grads is not None]
        if not norms:
            return torch.zeros((), device=self.segments[0].flat.device)
        return torch.linalg.vector_norm(torch.stack(norms))

    def state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """``model.state_dict()`` with each parameter's entry replaced by its FP32 master."""
        by_ptr = {p.data_ptr(): m for seg in self.segments for p, m, _ in seg.slots}
        return {k: by_ptr.get(v.data_ptr(), v) for k, v in model.state_dict().items()}

    @torch.no_grad()
    def load_state_dict(self, model: nn.Module, weights: Mapping[str, Tensor]) -> None:
        """Set the masters (and the model's BF16 copies) from FP32 ``weights`` named as in ``model``."""
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):  # a tied weight has several names
            names.setdefault(id(p), []).append(name)
        missing = []
        for p, master, _ in (slot for seg in self.segments for slot in seg.slots):
            saved = [n for n in names[id(p)] if n in weights]
            if saved:
                master.copy_(weights[saved[0]])
            else:
                missing.append(names[id(p)][0])
        if missing:
            raise KeyError(f"MasterWeights: no saved value for {missing[:5]}")
        self.copy_to_model()
        for seg in self.segments:  # the kept FP8 weights are the old masters' (a copy into a master view
            if seg.fp8 is not None:  # does not move the parameter's version counter)
                for m in seg.fp8.linears:
                    m.invalidate_fp8_cache()
