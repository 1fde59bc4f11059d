"""The FP8 linear as functions: W8A8 forward, and the training autograd Function (fprop, dgrad, wgrad).

Transformer Engine's Float8BlockScaling recipe, which InfiR2 trains with:

* fprop  Y  = X(1x128) . W(128x128)^T         tiles of X along K (hidden), W in 128x128 blocks
* dgrad  dX = dY(1x128) . W(128x128)          tiles of dY along N, the same FP8 weight read transposed
* wgrad  dW = dY^T(1x128) . X(1x128)          both quantized in 1x128 tiles along the token dimension M

Shape legend: M tokens (all leading dims flattened), K input features, N output features.

CUDA with a Hopper GPU: fused Triton quantizers + cuBLASLt (``gemm.py``). Everywhere else (CPU, or when
``gemm.fast_path_ok`` says no): *emulation* - quantize with the same quantizer, dequantize, matmul in FP32,
cast to the input dtype. Both see the same FP8 values; they differ only in accumulation order and in the
rounding of the output, which is why every FP8 code path can be tested on CPU. The emulation keeps the
dequantized FP32 weight per weight version (4 bytes per weight, CPU-sized models only) and quantizes the
wgrad operands along the token dimension in place of transposing them (``fake_quantize_tiles``): on a
2-core CPU these two made a tiny-model FP8 train step 2x faster.
The bias is never quantized. The master weight's dtype (FP32 or BF16) is the dtype of its gradient.

A weight may name where its gradient goes (``WGRAD_INTO``: the trainer's FP32 masters do,
trainers/torch/master_weights.py): then the GPU wgrad adds dW into that FP32 tensor inside the GEMM
(``cublaslt.add_mm_1x128_1x128``, beta = 1) and the backward returns no gradient for the weight. This saves a
write and a read of an FP32 dW and the separate add: 5.4 ms per micro-batch at the 1.5B shape with 8,192
tokens, H100 (``bench/wgrad_accumulate.py``); the sum is the same FP32 value, bit for bit.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from infir2_rl.fp8 import cublaslt, gemm, quant_triton
from infir2_rl.fp8.quant import dequantize_weight_blockwise, fake_quantize_tiles

# A forward GEMM standing in for cuBLASLt's: (x (M, K), w_fp8 (N, K), scale_inv, bias, pow2) -> y (M, N).
Fprop = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]


# A weight's attribute: a function of the weight that returns the FP32 tensor (its shape, contiguous) to add its
# gradient into, or None for a gradient returned as usual (module docstring).
WGRAD_INTO = "_infir2_wgrad_into"


def gradient_target(weight: torch.Tensor, caller: str) -> torch.Tensor | None:
    """The FP32 tensor that ``weight``'s ``WGRAD_INTO`` names for its gradient, checked (one ValueError naming
    ``caller`` if it is not FP32, contiguous and of the weight's shape); None where the weight names none."""
    get = getattr(weight, WGRAD_INTO, None)
    target = get(weight) if get is not None else None
    if target is not None and (
        target.dtype != torch.float32 or target.shape != weight.shape or not target.is_contiguous()
    ):
        raise ValueError(
            f"{caller}: a weight's gradient target must be FP32, contiguous, of shape {tuple(weight.shape)}; "
            f"got {target.dtype} {tuple(target.shape)}"
        )
    return target


def _wgrad_target(ctx: Any) -> torch.Tensor | None:
    weight = ctx.wgrad_weight
    if weight is None or not gemm.accumulate_ok(weight.device):
        return None
    return gradient_target(weight, "fp8_linear")


@dataclass(frozen=True)
class Fp8Weight:
    """A quantized weight as the GEMMs use it: FP8 bytes (N, K), FP32 ``scale_inv`` (Nb, Kb), and for the
    GPU dgrad optionally the transposes (K, N) and (Kb, Nb), made once per weight version."""

    w_fp8: torch.Tensor
    scale_inv: torch.Tensor
    w_fp8_t: torch.Tensor | None = None
    scale_inv_t: torch.Tensor | None = None


class TokenTilesLater:
    """An FP8 linear input's token tiles (wgrad's operand), made at backward by ``make(*inputs) -> (qt, st)``
    (``quant_triton.quantize_cols``'s layout and codes) instead of kept from forward to backward.

    For inputs that the backward can make again from tensors kept anyway: the fused SwiGLU's h from gate
    and up, an RMSNorm's output from its input, weight and inverse RMS (trainers/torch/fused_layers.py), an
    attention output that the attention keeps (``Fp8Linear.input_kept``). Offered in the place of ``qt`` in
    ``offer_input_quantization`` (``st`` None). Each FP8 linear that takes it ``claim``s it in its forward,
    saves ``inputs`` (autograd's saved tensors, so checkpointing hooks see them) and calls what ``claim``
    returned in its backward: linears that read one input (gate and up) share one making of the tiles,
    freed after the last of them has used it."""

    def __init__(
        self, make: Callable[..., tuple[torch.Tensor, torch.Tensor]], inputs: tuple[torch.Tensor, ...]
    ):
        self.inputs = inputs
        self._shared = _SharedTiles(make)

    def claim(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        self._shared.claims += 1
        return self._shared


class _SharedTiles:
    """``make(*inputs)`` once for all its claimants (``TokenTilesLater``); holds no tensor but the tiles, and
    those only between the first and the last claimant's backward."""

    def __init__(self, make: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.make, self.claims = make, 0
        self.tiles: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tiles = self.tiles if self.tiles is not None else self.make(*inputs)
        self.claims -= 1
        self.tiles = tiles if self.claims > 0 else None
        return tiles


# The last input quantized on the fast path. q, k and v projections (and gate and up) read the same
# activation tensor: quantizing it once (and saving one FP8 copy for backward) saves 3 of 5 input
# quantizations per decoder layer. The entry is keyed on the input tensor by object (a weak reference, so a
# freed tensor whose memory is reused can never match) and version counter (so an in-place change
# invalidates it), plus the dtype its values were rounded to before quantizing, and dropped when it dies.
_last_input: list[Any] = [None]
# The same for the token tiles made beside a caller's forward GEMM (``fp8_linear(fprop=...)``): q, k and v
# (gate and up) of the true_on_policy walk read one input, whose wgrad tiles are then made once and kept once.
_last_cols: list[Any] = [None]


def _current(slot: list[Any], x: torch.Tensor) -> tuple[Any, ...] | None:
    """The fields ``_remember`` kept in ``slot`` for ``x``, if its entry is x's as x is now; else None."""
    entry = slot[0]
    if entry is not None and entry[0]() is x and entry[1] == x._version:
        return entry[2:]  # type: ignore[no-any-return]
    return None


def _remember(slot: list[Any], x: torch.Tensor, *fields: Any) -> None:
    """Keep ``fields`` for ``x`` as the slot's one entry, dropped when x dies (its quantized copies with it)."""

    def drop(ref: weakref.ref) -> None:
        if slot[0] is not None and slot[0][0] is ref:
            slot[0] = None

    slot[0] = (weakref.ref(x, drop), x._version, *fields)


def _quantize_input_fast(
    x: torch.Tensor, x2d: torch.Tensor, pow2: bool, need_cols: bool, round_to: torch.dtype
) -> tuple[Any, ...]:
    kept = _current(_last_input, x)
    if kept is not None:
        dtype, entry_pow2, has_cols, out = kept
        if dtype == round_to and entry_pow2 == pow2 and (has_cols or not need_cols):
            return out  # type: ignore[no-any-return]
    if getattr(x, "_infir2_unwritten", False):
        raise RuntimeError(
            "FP8 linear: its input's values were never written (a fused producer quantized them for the FP8 "
            "linears it was planned for and skipped the tensor itself), and its quantization does not match "
            f"this linear (pow2 {pow2}, rounding to {round_to}, token tiles {need_cols}): "
            "trainers/torch/fused_layers.py"
        )
    if need_cols:
        out = quant_triton.quantize_rows_and_cols(x2d, pow2, round_to=round_to)
    else:
        out = (*quant_triton.quantize_rows(x2d, pow2, round_to=round_to), None, None)
    _remember(_last_input, x, round_to, pow2, need_cols, out)
    return out


def _token_tiles(x: torch.Tensor, x2d: torch.Tensor, pow2: bool, round_to: torch.dtype) -> Any:
    kept = _current(_last_cols, x)
    if kept is not None and kept[:2] == (round_to, pow2):
        return kept[2]
    out = quant_triton.quantize_cols(x2d, pow2, round_to=round_to)
    _remember(_last_cols, x, round_to, pow2, out)
    return out


def offer_input_quantization(
    x: torch.Tensor, pow2: bool, out: tuple[Any, ...], unwritten: bool = False
) -> None:
    """Hand the next FP8 linear that reads ``x`` its quantization, made by the kernel that produced ``x``.

    ``out`` is what ``quant_triton.quantize_rows_and_cols(x2d, pow2)`` returns (or ``quantize_rows``'s pair
    followed by two ``None``, or by a ``TokenTilesLater`` and ``None``), bit for bit; the fused SwiGLU
    (trainers/torch/fused_layers.py) quantizes its output for down_proj as it writes it.

    ``unwritten``: the producer did not write ``x``'s values at all (its only readers are FP8 linears that
    take ``out``: 2 bytes per element of writes saved). ``x`` is marked, and an FP8 linear that would have to
    quantize it itself raises instead of reading garbage; so does any reader that checks the mark.
    """
    if unwritten:
        x._infir2_unwritten = True  # type: ignore[attr-defined]
    has_cols = out[2] is not None
    _remember(_last_input, x, x.dtype, pow2, has_cols, out)


# Quantized output gradients handed over by the kernel that made them (the fused SwiGLU's backward makes
# gate_proj's and up_proj's), consumed by the FP8 linear's backward that receives that gradient tensor.
# Entries hold a weak reference and the version counter, as ``_last_input``; at most a few are pending.
_given_grads: list[tuple[Any, int, bool, tuple[Any, ...]]] = []


def offer_grad_quantization(dy: torch.Tensor, pow2: bool, out: tuple[Any, ...]) -> None:
    """As ``offer_input_quantization``, for the output gradient ``dy`` of an FP8 linear (all four parts)."""

    def _drop(ref: weakref.ref) -> None:
        _given_grads[:] = [e for e in _given_grads if e[0] is not ref]

    _given_grads.append((weakref.ref(dy, _drop), dy._version, pow2, out))
    del _given_grads[:-4]


def _take_given_grad(dy: torch.Tensor, pow2: bool) -> tuple[Any, ...] | None:
    for i, (ref, version, entry_pow2, out) in enumerate(_given_grads):
        if ref() is dy and version == dy._version and entry_pow2 == pow2:
            del _given_grads[i]
            return out
    return None


# Emulation: the dequantized FP32 copy of the last FP8 weights seen, keyed on the FP8 tensor object (weak
# reference + version counter, as above), so a weight is dequantized once per version, not at every forward,
# backward and decode step. Entries go when the FP8 tensor dies.
_dequant_cache: dict[int, tuple[Any, int, Any, int, torch.Tensor]] = {}


def forget_dequantized(w_fp8: torch.Tensor) -> None:
    """Drop the dequantized copy of ``w_fp8``: its bytes were rewritten without a version bump (kept FP8
    weights, ``Fp8Linear.keep_fp8_in``)."""
    _dequant_cache.pop(id(w_fp8), None)


def _dequantized_weight(w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    key = id(w_fp8)
    hit = _dequant_cache.get(key)
    if hit is not None:
        w_ref, w_version, s_ref, s_version, w_deq = hit
        if (
            w_ref() is w_fp8
            and w_version == w_fp8._version
            and s_ref() is scale_inv
            and s_version == scale_inv._version
        ):
            return w_deq
    w_deq = dequantize_weight_blockwise(w_fp8, scale_inv)

    def _drop(_: weakref.ref, k: int = key) -> None:
        _dequant_cache.pop(k, None)

    ref = weakref.ref(w_fp8, _drop)
    _dequant_cache[key] = (ref, w_fp8._version, weakref.ref(scale_inv), scale_inv._version, w_deq)
    return w_deq


def _gpu_out_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)


def _emulated_output(y32: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The emulated GEMM's FP32 result as the GPU path (`_fast_fprop`) and a dense autocast linear give it:
    rounded to ``dtype``, then the bias rounded to ``dtype`` added and the sum rounded. It added an FP32 bias to
    the FP32 result and rounded once, which under BF16 autocast moved a quarter of the biased outputs (q|k|v)
    by one BF16 ulp from the engine's."""
    return _add_bias(y32.to(dtype), bias)


def _emulated_mm(a_deq: torch.Tensor, b_deq: torch.Tensor) -> torch.Tensor:
    """FP32 matmul of dequantized operands; TF32 and autocast off so emulation stays a faithful reference."""
    with torch.autocast(a_deq.device.type, enabled=False):
        if a_deq.is_cuda:
            prev = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
            try:
                return a_deq @ b_deq.t()
            finally:
                torch.backends.cuda.matmul.allow_tf32 = prev
        return a_deq @ b_deq.t()


def autocast_output(x: torch.Tensor) -> tuple[torch.dtype, torch.dtype | None]:
    """(output dtype, ``round_to``) of an FP8 linear of ``x``. Under autocast the output has the autocast dtype, as
    nn.Linear's would: an FP32 input (the residual stream after RMSNorm) otherwise gives FP32 q/k/v/gate/up
    outputs, and every activation downstream (SiLU, the gate*up product) is then computed and kept for backward
    in FP32, twice the bytes of the BF16 model. And the values quantized are those a dense linear under autocast
    would multiply, x rounded to the autocast dtype (``round_to``): they are what a BF16 rollout engine holds at
    this point, while the FP32 values round to other e4m3 codes in ~2% of elements and to another scale in
    nearly every tile (docs/mismatch.md, source 1). The rounding happens inside the quantizer (no BF16 copy);
    the input gradient is rounded to that dtype too, as a dense autocast linear's is."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return x.dtype, None
    out_dtype = torch.get_autocast_dtype(device_type)
    return out_dtype, (out_dtype if x.dtype != out_dtype else None)


def fp8_linear_forward(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    pow2_scales: bool = False,
    out_dtype: torch.dtype | None = None,
    round_to: torch.dtype | None = None,
) -> torch.Tensor:
    """W8A8 ``x @ W^T + b`` with x quantized per 1x128 tile at run time; returns ``out_dtype`` (default x's).
    ``round_to``: quantize ``x.to(round_to)`` (autocast's rounding of an FP32 input), without making that copy
    on the GPU fast path (the quantizer rounds as it reads)."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = w_fp8.shape[0]
    dtype = out_dtype or x.dtype
    x2d = x.reshape(-1, k)
    m = x2d.shape[0]
    if m == 0:
        return x.new_zeros(*lead, n, dtype=dtype)
    if gemm.fast_path_ok(x2d, n, k):
        xq, xs_t, _, _ = _quantize_input_fast(x, x2d, pow2_scales, False, round_to or x.dtype)
        y = _fast_fprop(xq, xs_t, w_fp8, w_scale_inv, dtype, bias)[:m]
    else:
        x2d = x2d if round_to is None else x2d.to(round_to)
        y32 = _emulated_mm(
            fake_quantize_tiles(x2d, pow2_scales=pow2_scales), _dequantized_weight(w_fp8, w_scale_inv)
        )
        y = _emulated_output(y32, bias, dtype)
    return y.view(*lead, n)


def _fast_fprop(
    xq: torch.Tensor,
    xs_t: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    # The bias is added after the GEMM rather than in cuBLASLt's epilogue, which blockwise scaling does not
    # promise to support (and which would round once where this rounds the GEMM's output, then the sum); only
    # q/k/v have a bias in Qwen2. In place on the GEMM's output by a vectorized kernel where it can: torch's
    # broadcast add ran its strided kernel (quant_triton.add_row_bias_).
    y = gemm.mm_1x128_128x128(xq, xs_t, w_fp8, w_scale_inv, _gpu_out_dtype(dtype))
    if bias is not None and not quant_triton.add_row_bias_(y, bias.to(y.dtype)):
        y = _add_bias(y, bias)
    return y.to(dtype)


class _Fp8LinearFn(torch.autograd.Function):
    """Autograd for ``y = x @ W^T + b`` with all three GEMMs in blockwise FP8 (see module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        fp8w: Fp8Weight,
        pow2_scales: bool,
        out_dtype: torch.dtype,
        round_to: torch.dtype | None,
        fprop: Fprop | None = None,
        input_kept: bool = False,
    ) -> torch.Tensor:
        w_fp8, w_scale_inv = fp8w.w_fp8, fp8w.scale_inv
        lead, k = x.shape[:-1], x.shape[-1]
        n = weight.shape[0]
        x2d = x.reshape(-1, k)
        m = x2d.shape[0]
        fast = m > 0 and gemm.fast_path_ok(x2d, n, k)
        need_wgrad = ctx.needs_input_grad[1]
        round_to = round_to or x.dtype
        ctx.fast, ctx.m, ctx.pow2 = fast, m, pow2_scales
        ctx.wgrad_weight = weight if fast and need_wgrad and hasattr(weight, WGRAD_INTO) else None
        # dX is computed in the rounded input's dtype and then cast to x's: a dense linear under autocast
        # returns it through the backward of its input cast the same way.
        ctx.x_shape, ctx.x_dtype, ctx.grad_dtype, ctx.w_dtype = x.shape, x.dtype, round_to, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        if fast:
            # dgrad reads W^T (K, N). A caller that made it already (megatron's fused weights) passes it in;
            # otherwise backward transposes the FP8 weight when it runs: keeping W^T of every layer from
            # forward to backward cost 1 byte per weight (1.2 GiB at 1.5B) for a copy that takes one
            # byte-moving kernel to make (docs/performance.md, "W^T at backward").
            ctx.w_transposed = fp8w.w_fp8_t is not None and fp8w.scale_inv_t is not None
            w_b, s_b = (fp8w.w_fp8_t, fp8w.scale_inv_t) if ctx.w_transposed else (w_fp8, w_scale_inv)
            if not ctx.needs_input_grad[0]:
                w_b = s_b = None
            xtq: Any
            if fprop is not None:  # the caller's forward GEMM (true on-policy: the engine's invariant kernel)
                xtq, xts = _token_tiles(x, x2d, pow2_scales, round_to) if need_wgrad else (None, None)
                y = fprop(x2d.to(round_to), w_fp8, w_scale_inv, bias, pow2_scales)
                if y.dtype != out_dtype:
                    raise TypeError(f"fp8_linear: fprop returned {y.dtype}, the output dtype is {out_dtype}")
            elif input_kept and need_wgrad:
                # X is kept for backward by its producer anyway (fp8_linear's docstring): keep X, no FP8 copy.
                xq, xs_t, _, _ = _quantize_input_fast(x, x2d, pow2_scales, False, round_to)
                make = functools.partial(
                    quant_triton.quantize_cols, pow2_scales=pow2_scales, round_to=round_to
                )
                xtq, xts = TokenTilesLater(make, (x2d,)), None
                y = _fast_fprop(xq, xs_t, w_fp8, w_scale_inv, out_dtype, bias)[:m]
            else:
                # Row tiles for fprop; token tiles (transposed, FP8) are all that backward keeps of X.
                xq, xs_t, xtq, xts = _quantize_input_fast(x, x2d, pow2_scales, need_wgrad, round_to)
                y = _fast_fprop(xq, xs_t, w_fp8, w_scale_inv, out_dtype, bias)[:m]
            ctx.make_tiles = None
            if isinstance(xtq, TokenTilesLater):  # made at backward from tensors saved anyway
                if need_wgrad:
                    ctx.make_tiles = xtq.claim()
                ctx.save_for_backward(w_b, s_b, *(xtq.inputs if need_wgrad else ()))
            else:
                ctx.save_for_backward(w_b, s_b, xtq, xts)
        else:
            x2d = x2d.to(round_to)
            ctx.save_for_backward(w_fp8, w_scale_inv, x2d if need_wgrad else None)
            if m == 0:
                y = x2d.new_zeros(0, n, dtype=out_dtype)
            else:
                w_deq = _dequantized_weight(w_fp8, w_scale_inv)
                x_deq = fake_quantize_tiles(x2d, pow2_scales=pow2_scales)
                y = _emulated_output(_emulated_mm(x_deq, w_deq), bias, out_dtype)
        return y.view(*lead, n)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        n = dy.shape[-1]
        dy2d = dy.reshape(-1, n)
        if dy2d.stride(-1) != 1:
            dy2d = dy2d.contiguous()
        dx = dw = db = None
        if ctx.m == 0:
            dx = dy.new_zeros(ctx.x_shape) if need_dx else None
            dw = torch.zeros(n, ctx.x_shape[-1], dtype=ctx.w_dtype, device=dy.device) if need_dw else None
        elif ctx.fast:
            dx, dw = _fast_backward(ctx, dy2d, need_dx, need_dw, _take_given_grad(dy, ctx.pow2))
        else:
            dx, dw = _emulated_backward(ctx, dy2d, need_dx, need_dw)
        if need_db:
            db = dy2d.sum(0, dtype=torch.float32).to(ctx.b_dtype)
        if dx is not None:
            dx = dx.view(ctx.x_shape)
        return dx, dw, db, None, None, None, None, None, None


def _fast_backward(
    ctx: Any, dy2d: torch.Tensor, need_dx: bool, need_dw: bool, given: tuple[Any, ...] | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    w_b, s_b, *x_saved = ctx.saved_tensors
    xtq = xts = None
    if need_dw:  # X's token tiles, kept from forward or made now (TokenTilesLater)
        xtq, xts = ctx.make_tiles(*x_saved) if ctx.make_tiles is not None else x_saved
    m, pow2 = ctx.m, ctx.pow2
    dx = dw = None
    if need_dx and not ctx.w_transposed:
        w_b, s_b = quant_triton.transpose_fp8(w_b), s_b.t().contiguous()
    if given is not None:  # quantized by the kernel that made dY (offer_grad_quantization)
        dyq, dys_t, dytq, dyts = given
    elif need_dx and need_dw:
        dyq, dys_t, dytq, dyts = quant_triton.quantize_rows_and_cols(dy2d, pow2)
    elif need_dx:
        dyq, dys_t = quant_triton.quantize_rows(dy2d, pow2)
    elif need_dw:
        dytq, dyts = quant_triton.quantize_cols(dy2d, pow2)
    if need_dx:
        # dX = dY . W: the B operand is W^T (K, N) row-major with the transposed 128x128 scale grid.
        dx = gemm.mm_1x128_128x128(dyq, dys_t, w_b, s_b, _gpu_out_dtype(ctx.grad_dtype))[:m]
        dx = dx.to(ctx.grad_dtype).to(ctx.x_dtype)
    if need_dw:
        assert xtq is not None and xts is not None
        into = _wgrad_target(ctx)
        if into is not None:  # dW is added into its FP32 target by the GEMM and stays None
            operands = (t.contiguous() for t in (dytq, dyts, xtq, xts))
            cublaslt.add_mm_1x128_1x128(into, *operands)
        else:
            dw = gemm.mm_1x128_1x128(dytq, dyts, xtq, xts, _gpu_out_dtype(ctx.w_dtype)).to(ctx.w_dtype)
    return dx, dw


def _emulated_backward(
    ctx: Any, dy2d: torch.Tensor, need_dx: bool, need_dw: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    w_fp8, w_scale_inv, x2d = ctx.saved_tensors
    pow2 = ctx.pow2
    dx = dw = None
    if need_dx:
        w_deq = _dequantized_weight(w_fp8, w_scale_inv)
        dx = _emulated_mm(fake_quantize_tiles(dy2d, pow2_scales=pow2), w_deq.t())
        dx = dx.to(ctx.grad_dtype).to(ctx.x_dtype)
    if need_dw:
        # Token-dim tiles (zero padding of the last tile changes nothing): dW = dY^T . X, both tiled along M.
        dyt_deq = fake_quantize_tiles(dy2d, dim=0, pow2_scales=pow2).t()
        xt_deq = fake_quantize_tiles(x2d, dim=0, pow2_scales=pow2).t()
        dw = _emulated_mm(dyt_deq, xt_deq).to(ctx.w_dtype)
    return dx, dw


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fp8w: Fp8Weight,
    pow2_scales: bool = False,
    out_dtype: torch.dtype | None = None,
    round_to: torch.dtype | None = None,
    fprop: Fprop | None = None,
    input_kept: bool = False,
) -> torch.Tensor:
    """Differentiable FP8 linear; ``fp8w`` must be the quantization of ``weight``.

    ``out_dtype`` (default x's) is the output's dtype; the input gradient always comes back in x's dtype.
    ``round_to``: as in ``fp8_linear_forward``; the input gradient is then rounded to it before the cast to
    x's dtype, as autocast's cast of the input would round it. ``fprop``: on the GPU fast path,
    the forward GEMM ``fprop(x2d, w_fp8, scale_inv, bias, pow2) -> y`` (in the output dtype) instead of
    cuBLASLt's (true on-policy passes the engine's batch-invariant kernel, ``models/invariant_ops.fp8_mm``);
    the backward is the same either way. The CPU emulation ignores it. ``input_kept``: x's producer keeps x
    for its own backward (an attention its output), so on the GPU fast path this linear keeps x too and makes
    its token tiles at backward (``TokenTilesLater``) instead of keeping an FP8 copy; where x is not kept
    elsewhere this costs memory (2 bytes per element instead of 1).
    """
    out = _Fp8LinearFn.apply(
        x, weight, bias, fp8w, pow2_scales, out_dtype or x.dtype, round_to, fprop, input_kept
    )
    assert isinstance(out, torch.Tensor)
    return out
