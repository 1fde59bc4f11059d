"""Fused projections of the model runner, and the one place where their GEMMs (BF16 or FP8 W8A8) run.

Fusion without a second copy. q|k|v and gate|up are each one GEMM over a concatenated weight. The fused
buffer is allocated once and each HF module's tensors are re-pointed at views of it (``weight``, ``bias``;
for ``Fp8InferenceLinear`` the FP8 ``weight`` and its ``weight_scale_inv``), so the HF model and the
runner share every byte: weight sync (``weight_sync.receiver``) copies into the HF module's tensors, which
writes straight into the runner's fused buffers, and captured CUDA graphs see the new weights (same
addresses). FP8 parts whose row count is not a multiple of 128 are padded with zero rows (scale 1) up to
one, so every part keeps its own 128x128 scale blocks; the padding columns of the output are never read.

The GEMM (``FusedLinear.__call__``):
* BF16 / FP32: ``F.linear``.
* FP8 on CPU (tests) or without the fast path: ``fp8.ops.fp8_linear_forward`` (emulation: the same FP8
  values, FP32 matmul), i.e. exactly what ``Fp8InferenceLinear`` computes.
* FP8 on a Hopper GPU (``run_fp8``), the input either BF16 or already FP8 (quantized by its producer in
  ``fused_ops``): per (M, N, K, input kind) the fastest of cuBLASLt ``scaled_mm`` blockwise and the Triton
  kernel of ``fp8_gemm`` in each candidate launch shape, timed once inside a CUDA graph by
  ``Fp8GemmChooser``, for decode sizes (M <= ``DECODE_MAX_ROWS``) and the prefill graphs' buckets
  (``prefill_graphs.py``: a few fixed M); the eager prefill's GEMMs (any M; the runner says so with
  ``prefill=True``) and any M > ``DECODE_MAX_ROWS`` take cuBLASLt, so no choice is timed per new M.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infir2_rl.engines.native import fp8_gemm
from infir2_rl.engines.native.fused_ops import QuantizedRows, SplitPartials
from infir2_rl.fp8 import cublaslt, quant_triton
from infir2_rl.fp8 import gemm as cublas_gemm
from infir2_rl.fp8.linear import Fp8InferenceLinear
from infir2_rl.fp8.ops import fp8_linear_forward
from infir2_rl.graph_capture import cold_copies, time_in_graph

logger = logging.getLogger(__name__)

_CUBLAS = "cublas scaled_mm"
# cuBLASLt's blockwise GEMM without workspace (``fp8/cublaslt.py``): at decode M = 256 its heuristic gives
# gate|up a static-scheduled kernel with no memset before each launch, 20 against 22 us (session 34).
_CUBLAS_NO_WS = "cublaslt no workspace"
DECODE_MAX_ROWS = 512  # GEMMs with more rows (prefill) always take cuBLASLt; the chooser times decode sizes


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


Choice = str | fp8_gemm.GemmConfig
Activation = Tensor | QuantizedRows


def run_fp8_partials(
    choice: Choice,
    x: Activation,
    w: Tensor,
    s: Tensor,
    bias: Tensor | None,
    pow2: bool,
    dtype: torch.dtype,
) -> Tensor | SplitPartials:
    """One W8A8 GEMM by ``choice``: cuBLASLt ``scaled_mm`` (after the quantize kernel unless x is already
    FP8) or the Triton kernel of ``fp8_gemm`` (quantizing x inside unless x is already FP8). A split-K
    Triton launch returns its partials unsummed (``fp8_gemm.w8a8_partials``), for a consumer kernel that
    sums them; ``run_fp8`` sums them."""
    if choice in (_CUBLAS, _CUBLAS_NO_WS):
        if isinstance(x, QuantizedRows):
            q, s_t, m = x.q, x.s_t, x.m
        else:
            (q, s_t), m = quant_triton.quantize_rows(x, pow2), x.shape[0]
        if choice == _CUBLAS:
            y = cublas_gemm.mm_1x128_128x128(q, s_t, w, s, dtype)[:m]
        else:
            y = cublaslt.mm_1x128_128x128_no_workspace(q, s_t, w, cublas_gemm.padded_grid(s), dtype)[:m]
        return y if bias is None else y + bias
    assert isinstance(choice, fp8_gemm.GemmConfig)
    if isinstance(x, QuantizedRows):
        return fp8_gemm.w8a8_partials(x.q, w, s, bias, choice, pow2, x.s_t, x.m, dtype)
    return fp8_gemm.w8a8_partials(x, w, s, bias, choice, pow2)


def run_fp8(
    choice: Choice,
    x: Activation,
    w: Tensor,
    s: Tensor,
    bias: Tensor | None,
    pow2: bool,
    dtype: torch.dtype,
) -> Tensor:
    """``run_fp8_partials`` with split-K partials summed (the sum kernel): the output (M, N)."""
    y = run_fp8_partials(choice, x, w, s, bias, pow2, dtype)
    return y if isinstance(y, Tensor) else fp8_gemm.sum_partials(y)


class Fp8GemmChooser:
    """Picks, per GEMM shape and input kind, the fastest FP8 implementation on this GPU.

    Each candidate is timed inside a CUDA graph (>= 10 calls per replay, median of 5 replays), as it runs
    in the decode graph: launch overhead excluded, which favours neither Triton's nor cuBLAS's launcher.
    The calls rotate over copies of the weight that together exceed twice the L2 cache (``cold_copies``),
    so each call reads its weight from device memory as every layer's GEMM does once per decode step. With
    one weight the chooser timed L2-resident weights and picked shapes 1.3x slower in the decode step at some
    sizes (``bench/decode_gemm.py``, docs/performance.md).
    """

    def __init__(self, pow2_scales: bool) -> None:
        self.pow2_scales = pow2_scales
        self.choice: dict[tuple[int, int, int, bool], Choice] = {}
        self.timings: dict[tuple[int, int, int, bool], dict[str, float]] = {}

    @staticmethod
    def _time(
        fn: Callable[[], Tensor] | list[Callable[[], Tensor]], calls: int = 10, replays: int = 5
    ) -> float:
        """Milliseconds per call (``graph_capture.time_in_graph``)."""
        return time_in_graph(fn, calls, replays)

    @staticmethod
    def cold_copies(*tensors: Tensor) -> int:
        """How many copies of ``tensors`` exceed twice the L2 cache (``graph_capture.cold_copies``)."""
        return cold_copies(*tensors)

    @staticmethod
    def bucket(m: int, prequant: bool) -> int:
        """The M a choice is kept under. Decode input (producer-quantized) comes in the few padded batch
        sizes of the decode graphs: exact. BF16 input (o_proj's, where the attention does not quantize) may
        come at any M: a power-of-two bucket, timed at the first M seen in it, so that new prompt lengths do not re-time
        every candidate in the middle of a generate call (it cost the first RL-shaped call 24 s)."""
        return m if prequant else 1 << max(m - 1, 0).bit_length()

    def pick(self, x: Activation, w: Tensor, s: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Choice:
        prequant = isinstance(x, QuantizedRows)
        m = x.m if isinstance(x, QuantizedRows) else x.shape[0]
        key = (self.bucket(m, prequant), w.shape[0], w.shape[1], prequant)
        if key in self.choice:
            return self.choice[key]
        options: list[Choice] = [*fp8_gemm.candidates(m, prequant)]
        if cublas_gemm.fast_path_ok(w, w.shape[0], w.shape[1]):
            options[:0] = [_CUBLAS, _CUBLAS_NO_WS]
        times = {}
        # The copies keep the grid's storage (rows stored apart: ``gemm.scale_grid``), so that cuBLASLt's
        # candidates are timed without the padded copy the engine's own grids spare them.
        copies = [(w, s)] + [
            (
                w.clone(),
                cublas_gemm.scale_grid(s.shape[0], s.shape[1], s.device).copy_(s)
                if s.stride(0) != s.shape[1]
                else s.clone(),
            )
            for _ in range(self.cold_copies(w, s) - 1)
        ]
        for option in options:
            try:
                times[str(option)] = self._time(
                    [
                        functools.partial(run_fp8, option, x, wc, sc, bias, self.pow2_scales, dtype)
                        for wc, sc in copies
                    ]
                )
            except Exception as exc:  # a launch shape this GPU or Triton cannot compile: not a candidate
                logger.warning("FP8 GEMM candidate %s failed at %s: %s", option, key, exc)
        if not times:
            raise RuntimeError(f"no FP8 GEMM implementation ran at (M, N, K, prequantized) = {key}")
        del copies
        best = min(times, key=lambda name: times[name])
        self.choice[key] = next(o for o in options if str(o) == best)
        self.timings[key] = times
        logger.info(
            "FP8 GEMM (M bucket, N, K, prequantized) %s, timed at M %d: %s %.1f us (cuBLAS %s us)",
            key, m, best, 1e3 * times[best], f"{1e3 * times[_CUBLAS]:.1f}" if _CUBLAS in times else "n/a",
        )  # fmt: skip
        return self.choice[key]


class FusedLinear:
    """One GEMM over sibling projections (list order), sharing storage with the HF modules (module doc)."""

    def __init__(
        self,
        modules: list[nn.Module],
        chooser: Fp8GemmChooser | None,
        out_dtype: torch.dtype,
        invariant: bool = False,
    ) -> None:
        self.fp8 = isinstance(modules[0], Fp8InferenceLinear)
        self.invariant = invariant  # true_on_policy: the batch-invariant GEMMs of models/invariant_ops
        if any(isinstance(m, Fp8InferenceLinear) != self.fp8 for m in modules):
            raise ValueError(
                f"cannot fuse FP8 and non-FP8 projections: {[type(m).__name__ for m in modules]}"
            )
        self.chooser = chooser
        self.out_dtype = out_dtype
        self.pow2_scales = bool(getattr(modules[0], "pow2_scales", False))
        has_bias = [getattr(m, "bias", None) is not None for m in modules]
        if len(set(has_bias)) > 1:
            raise ValueError("cannot fuse projections where only some have a bias")
        weights: list[Tensor] = [m.weight for m in modules]  # type: ignore[misc]
        biases: list[Tensor | None] = [getattr(m, "bias", None) for m in modules]
        k, device = weights[0].shape[1], weights[0].device
        align = 128 if self.fp8 and len(modules) > 1 else 1
        sizes = [w.shape[0] for w in weights]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + _round_up(n, align))
        self.out_features = offsets[-1]
        self.part_slices = [slice(o, o + n) for o, n in zip(offsets, sizes)]
        with torch.no_grad():
            self.weight = torch.zeros(self.out_features, k, dtype=weights[0].dtype, device=device)
            self.bias: Tensor | None = None
            if has_bias[0]:
                assert biases[0] is not None
                self.bias = torch.zeros(self.out_features, dtype=biases[0].dtype, device=device)
            self.scale: Tensor | None = None
            if self.fp8:
                kb = -(-k // 128)
                # rows stored 4-block aligned: cuBLASLt takes the grid without a padded copy per GEMM
                self.scale = cublas_gemm.scale_grid(-(-self.out_features // 128), kb, device)
            for module, sl in zip(modules, self.part_slices):
                self._bind(module, sl)

    def _bind(self, module: nn.Module, sl: slice) -> None:
        """Copy ``module``'s tensors into the fused buffers and re-point the module at views of them."""
        view = self.weight[sl]
        weight: Tensor = module.weight  # type: ignore[assignment]
        view.copy_(weight)
        if self.fp8:
            assert self.scale is not None and isinstance(module, Fp8InferenceLinear)
            blocks = slice(sl.start // 128, sl.start // 128 + module.weight_scale_inv.shape[0])
            self.scale[blocks].copy_(module.weight_scale_inv)
            module._buffers["weight"] = view
            module._buffers["weight_scale_inv"] = self.scale[blocks]
            if self.bias is not None:
                self.bias[sl].copy_(module.bias)  # type: ignore[arg-type]
                module._buffers["bias"] = self.bias[sl]
            return
        module.weight = nn.Parameter(view, requires_grad=False)
        if self.bias is not None:
            self.bias[sl].copy_(module.bias)  # type: ignore[arg-type]
            module.bias = nn.Parameter(self.bias[sl], requires_grad=False)

    def __call__(self, x: Activation, prefill: bool = False) -> Tensor:
        """x (M, K) -> (M, out_features); the FP8 path quantizes x per 1x128 tile like the trainer (x may
        arrive already quantized by its producer, ``fused_ops.QuantizedRows``). ``prefill``: an FP8 GEMM
        on the fast path takes cuBLASLt whatever M (prompt sizes vary, and cuBLASLt won every prefill shape
        timed, M 96..16,384), so no choice is timed per new M."""
        out = self._forward(x, prefill, False)
        assert isinstance(out, Tensor)
        return out

    def deferred(self, x: Activation) -> Tensor | SplitPartials:
        """``self(x)`` for a caller that hands the output to a kernel that sums a split-K launch's partials
        (and the bias) itself (``fused_ops.SplitPartials``: ``add_rms_norm``, ``rope_write_kv``): each
        split-K GEMM of the decode step saves the sum kernel's launch."""
        return self._forward(x, False, True)

    def _forward(self, x: Activation, prefill: bool, defer_sum: bool) -> Tensor | SplitPartials:
        if self.invariant:
            return self._invariant(x, defer_sum)
        if not self.fp8:
            assert isinstance(x, Tensor)
            return F.linear(x, self.weight, self.bias)
        assert self.scale is not None
        pow2 = self.pow2_scales
        rows = x.m if isinstance(x, QuantizedRows) else x.shape[0]
        if isinstance(x, Tensor) and (self.chooser is None or not fp8_gemm.available(x.device)):
            return fp8_linear_forward(x, self.weight, self.scale, self.bias, pow2)
        if prefill or rows > DECODE_MAX_ROWS or self.chooser is None:  # compute-bound: cuBLASLt's large tiles
            return run_fp8(_CUBLAS, x, self.weight, self.scale, self.bias, pow2, self.out_dtype)
        choice = self.chooser.pick(x, self.weight, self.scale, self.bias, self.out_dtype)
        run = run_fp8_partials if defer_sum else run_fp8
        return run(choice, x, self.weight, self.scale, self.bias, pow2, self.out_dtype)

    def input_rows(self, x: Tensor) -> int:
        """How many rows an input with x's row count should be allocated with: under true_on_policy in BF16,
        the rows its planned cuBLAS GEMM runs at (``invariant_ops.planned_input_rows``), else M."""
        if not self.invariant or self.fp8:
            return x.shape[0]
        from infir2_rl.models import invariant_ops

        return invariant_ops.planned_input_rows(x, False, *self.weight.shape)

    def _invariant(self, x: Activation, defer_sum: bool = False) -> Tensor | SplitPartials:
        """The batch-invariant GEMM (true_on_policy). ``defer_sum``: the output goes to a kernel that sums
        ``SplitPartials``. Where the plan splits K (FP8 down_proj at 1.5B), the chunks' FP32 results go
        unsummed, as the fast mode's split-K GEMMs do; where it adds the bias after rounding the product
        (cuBLAS), the product and the bias go as a one-part ``SplitPartials``: the consumer adds it, rounding
        as torch's ``y + bias`` does, and the broadcast add's launch goes."""
        from infir2_rl.models import invariant_ops

        if defer_sum and self.bias is None and isinstance(x, QuantizedRows):  # a split plan's partials
            assert self.scale is not None
            parts = invariant_ops.fp8_mm_partials(x.q, x.s_t, x.m, self.weight, self.scale)
            if parts is not None:
                return parts
        if defer_sum and self.bias is not None:
            rows = x.q if isinstance(x, QuantizedRows) else x
            if invariant_ops.bias_after_rounding(rows, self.fp8, *self.weight.shape):
                y = self._invariant_gemm(x, None)
                return SplitPartials(y[None], y.dtype, self.bias)
        return self._invariant_gemm(x, self.bias)

    def _invariant_gemm(self, x: Activation, bias: Tensor | None) -> Tensor:
        from infir2_rl.models import invariant_ops

        if not self.fp8:
            assert isinstance(x, Tensor)
            return invariant_ops.mm(x, self.weight, bias)
        assert self.scale is not None
        if isinstance(x, QuantizedRows):
            return invariant_ops.fp8_mm_quantized(
                x.q, x.s_t, x.m, self.weight, self.scale, bias, self.pow2_scales
            )
        return invariant_ops.fp8_mm(x, self.weight, self.scale, bias, self.pow2_scales)

    def split(self, y: Tensor) -> list[Tensor]:
        """The parts of a fused output (M, out_features), in module order."""
        return [y[:, sl] for sl in self.part_slices]
