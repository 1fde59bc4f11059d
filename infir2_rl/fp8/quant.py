"""Blockwise FP8 (e4m3) quantization: the one format shared by trainer, rollout engines and checkpoints.

The format (DeepSeek-V3, SGLang, vLLM, Transformer Engine's Float8BlockScaling, transformers' FineGrainedFP8):

* Element type ``torch.float8_e4m3fn``: 1 sign, 4 exponent, 3 mantissa bits, largest finite value 448,
  no infinities. Three mantissa bits mean a relative rounding error of at most 2^-4 = 6.25% per element
  (half a unit in the last place); the scale below puts each block's largest element at 448 so the block
  uses the full exponent range.
* Weights ``W`` (N, K) are cut into 128x128 blocks. Block (i, j) gets one FP32 number
  ``scale = amax(|W_block|) / 448``, and stores ``W_fp8 = round_e4m3(W_block * (1 / scale))``. The stored FP32
  tensor is the *dequant multiplier* ``weight_scale_inv`` of shape (ceil(N/128), ceil(K/128)):
  ``W ~= W_fp8.float() * weight_scale_inv[i, j]`` (the name ``_inv`` is historical: DeepSeek's code).
* Activations and output gradients ``X`` (..., K) are cut into 1x128 tiles along the last dimension, one
  FP32 scale per tile, same rule: scale shape (..., ceil(K/128)). A matrix product X @ W.T then needs
  only one scale per (row, K-block) on each side, which is what the tensor-core kernels consume.
* ``pow2_scales=True`` rounds every scale *up* to a power of two (Transformer Engine's default); up, so
  that ``amax / scale <= 448`` still holds and nothing clips. Power-of-two scales make dequantization an
  exact exponent shift, at the cost of up to 1 bit of dynamic range per block.
* The codes are ``round_e4m3(RN(x * r))`` with ``r = RN(1 / scale)``, one FP32 reciprocal per block and
  one FP32 product per element, each correctly rounded: Transformer Engine's and DeepSeek's rule (codes = x
  times a reciprocal scale), which CPU torch, CUDA torch and the Triton kernels all compute bit for bit.
  Against the exact quotient x / scale the product differs by at most ~1.5 FP32 ulps before the e4m3
  rounding, which changes a code only when x / scale lies within that of an e4m3 rounding midpoint. Until
  session 58 the rule was the correctly rounded quotient RN(x / scale); in the fused kernels that cost four
  more instructions per element (a remainder FMA, a test, a correction FMA and a select) and left the BF16
  token-tile quantizer issue-bound (docs/performance.md). With ``pow2_scales`` r is exact and both rules
  give the same codes.
* An all-zero block gets scale 1 (never 0, which would give 0/0 = NaN), and so does a block whose amax is
  so small (an FP32 subnormal below ~6e-43) that amax / 448 underflows to 0: its values round to 0. A
  scale that is an FP32 subnormal (amax below 448 * 2^-126 ~ 5.3e-36) is raised to 2^-126, FP32's smallest
  normal, so that r (at most 2^126) is finite; x * 2^126 is then exact and at most 448. Edge blocks (N or K
  not a multiple of 128) are padded with zeros, which never raise the amax, so the padding changes
  nothing.
* A block holding a NaN or an infinity gets scale NaN, so the whole block dequantizes to NaN. Why
  propagate rather than raise: these quantizers run inside every FP8 forward and backward, where a
  raise would need a device-to-host sync per tensor; a NaN instead flows into the loss and the gradient
  norm, where the trainer's non-finite guard skips the step and counts it (and N such steps in a row
  stop the stage). Why not scale 1, the all-zero rule: NaN compares false with 0, so a plain
  ``where(amax > 0, ...)`` sent a NaN block down that rule and silently turned its finite weights into
  e4m3 values of a block of scale 1 (0 for everything below 2^-10); an infinity gave scale inf and
  NaN for the infinity itself but 0 for every finite weight. Offline, ``cast-fp8`` checks every tensor
  and refuses a non-finite one by name before quantizing (``checkpoint.py``).

Error bound: for an element x in a block with scale s, ``|dequant(quant(x)) - x| <= 2^-4 * |x|`` for
|x| >= 2^-6 * s (e4m3's normal range), and ``<= 2^-10 * s`` below it (subnormal spacing 2^-9, halved).

CPU: plain torch (this file, the reference). CUDA: fused Triton kernels (``quant_triton.py``), one pass
over the input instead of the ~6 elementwise passes of the eager version (measured on an H200: eager 1x128
quantization of a 7B down-projection input took 2.05 ms, longer than the 1.0 ms FP8 GEMM it feeds).
The fused kernels compute the same numbers (the same reciprocal and products, round-to-nearest-even) and are
tested against this file on the GPU.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
# Largest finite e4m3fn value: 0b0_1111_110 = 1.75 * 2^8.
FP8_MAX = 448.0
# FP32's smallest normal, 2^-126: the least scale (``_scales_from_amax``), so that 1 / scale is finite.
MIN_SCALE = 2.0**-126


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_scale_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Round positive FP32 scales up to the next power of two (exact: works on the bit pattern).

    A float32 is 2^e * 1.m; it is already a power of two when the mantissa bits are 0, else the next one
    up is 2^(e+1), i.e. exponent field + 1 and mantissa cleared. Using log2/ceil instead can be off by one
    at exact powers of two, and the fused GPU kernel uses this same bit rule.
    """
    bits = scale.float().contiguous().view(torch.int32)
    exponent = bits & 0x7F800000
    rounded = torch.where((bits & 0x007FFFFF) != 0, exponent + 0x00800000, exponent)
    return rounded.view(torch.float32)


def _scales_from_amax(amax: torch.Tensor, pow2_scales: bool) -> torch.Tensor:
    # Divide by a tensor, not a Python scalar: on CUDA, torch turns division by a scalar into a
    # multiplication by its rounded reciprocal, which differs from amax/448 in the last bit (seen on an
    # H200) and would make CPU, CUDA-eager and Triton scales disagree.
    scale = amax / torch.full_like(amax, FP8_MAX)
    # All-zero block, or an amax so small that amax / 448 underflows to 0: scale 1 keeps 1 / scale finite
    # (a scale of 0 would turn the block into NaN). Tested on the scale, not the amax, for that underflow.
    scale = torch.where(scale > 0, scale.clamp(min=MIN_SCALE), torch.ones_like(scale))
    if pow2_scales:
        scale = round_scale_up_pow2(scale)
    # A NaN or inf in the block (amax NaN or inf): scale NaN, so the block dequantizes to NaN (module
    # docstring). After the pow2 rounding, whose bit rule would turn a NaN into -0.0.
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of FP32 ``x`` in tiles of ``scale`` (broadcast against x): round(x * RN(1 / scale))."""
    # The reciprocal as a tensor division: torch on CUDA turns a division *by a Python scalar* into a product
    # with a rounded reciprocal, but divides tensor by tensor correctly rounded, as the CPU and Triton do.
    reciprocal = torch.ones_like(scale) / scale
    # Clamp first: torch's cast maps out-of-range values to NaN rather than saturating (a NaN stays NaN).
    return (x * reciprocal).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check_block(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{name}={value}: must be a positive integer (128 is the format's block size)")


def quantize_weight_blockwise_eager(
    w: torch.Tensor, block_size: int = 128, pow2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (plain torch) 128x128 weight quantization; see the module docstring."""
    _check_block("block_size", block_size)
    if w.dim() != 2:
        raise ValueError(
            f"weight shape {tuple(w.shape)}: blockwise weight quantization needs a 2-D (N, K) tensor"
        )
    n, k = w.shape
    nb, kb = _ceil_div(n, block_size), _ceil_div(k, block_size)
    w32 = torch.nn.functional.pad(w.float(), (0, kb * block_size - k, 0, nb * block_size - n))
    blocks = w32.view(nb, block_size, kb, block_size)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = _scales_from_amax(amax, pow2_scales)
    q = _to_fp8(blocks, scale[:, None, :, None]).view(nb * block_size, kb * block_size)
    return q[:n, :k].contiguous(), scale


def quantize_activation_eager(
    x: torch.Tensor, tile: int = 128, pow2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (plain torch) 1x128 quantization along the last dimension; see the module docstring."""
    _check_block("tile", tile)
    if x.dim() < 1:
        raise ValueError("activation is a scalar: 1x128 quantization needs at least one dimension")
    k = x.shape[-1]
    kb = _ceil_div(k, tile)
    x32 = torch.nn.functional.pad(x.float(), (0, kb * tile - k))
    tiles = x32.view(*x.shape[:-1], kb, tile)
    amax = tiles.abs().amax(dim=-1)
    scale = _scales_from_amax(amax, pow2_scales)
    q = _to_fp8(tiles, scale[..., None]).view(*x.shape[:-1], kb * tile)
    return q[..., :k].contiguous(), scale


def _fused_available(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    from infir2_rl.fp8 import quant_triton

    return quant_triton.available()


def quantize_weight_blockwise(
    w: torch.Tensor, block_size: int = 128, pow2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight (N, K) to e4m3 with one FP32 dequant multiplier per 128x128 block.

    Returns ``(w_fp8, weight_scale_inv)`` with shapes (N, K) and (ceil(N/128), ceil(K/128)), so that
    ``dequantize_weight_blockwise(w_fp8, weight_scale_inv)`` approximates ``w``. On CUDA a fused Triton
    kernel is used when present (same numbers); elsewhere the plain torch reference.
    """
    if block_size == 128 and w.dim() == 2 and _fused_available(w):
        from infir2_rl.fp8 import quant_triton

        return quant_triton.quantize_weight(w, pow2_scales)
    return quantize_weight_blockwise_eager(w, block_size, pow2_scales)


def dequantize_weight_blockwise(
    w_fp8: torch.Tensor, scale_inv: torch.Tensor, block_size: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_weight_blockwise`: ``w_fp8 * scale_inv`` broadcast over 128x128 blocks."""
    n, k = w_fp8.shape
    nb, kb = _ceil_div(n, block_size), _ceil_div(k, block_size)
    if tuple(scale_inv.shape) != (nb, kb):
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)}: expected ({nb}, {kb}) for a ({n}, {k}) weight "
            f"with block_size={block_size}"
        )
    full = scale_inv.float().repeat_interleave(block_size, 0)[:n].repeat_interleave(block_size, 1)[:, :k]
    return (w_fp8.float() * full).to(dtype)


def quantize_activation(
    x: torch.Tensor, tile: int = 128, pow2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (..., K) to e4m3 with one FP32 scale per 1x128 tile of the last dimension.

    Returns ``(x_fp8, scale)`` with shapes (..., K) and (..., ceil(K/128)). On CUDA a fused Triton kernel
    is used when present (same numbers); elsewhere the plain torch reference.
    """
    if tile == 128 and x.dim() >= 1 and x.numel() > 0 and _fused_available(x):
        from infir2_rl.fp8 import quant_triton

        lead, k = x.shape[:-1], x.shape[-1]
        q, s_t = quant_triton.quantize_rows(x.reshape(-1, k), pow2_scales, pad_rows_to=1)
        return q.view(*lead, k), s_t.t().contiguous().view(*lead, -1)
    return quantize_activation_eager(x, tile, pow2_scales)


def dequantize_activation(
    x_fp8: torch.Tensor, scale: torch.Tensor, tile: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_activation`: ``x_fp8 * scale`` broadcast over 1x128 tiles."""
    k = x_fp8.shape[-1]
    kb = _ceil_div(k, tile)
    if tuple(scale.shape) != (*x_fp8.shape[:-1], kb):
        raise ValueError(
            f"activation scale shape {tuple(scale.shape)}: expected {(*x_fp8.shape[:-1], kb)} for "
            f"x_fp8 of shape {tuple(x_fp8.shape)} with tile={tile}"
        )
    full = scale.float().repeat_interleave(tile, dim=-1)[..., :k]
    return (x_fp8.float() * full).to(dtype)


def fake_quantize_tiles(
    x: torch.Tensor, dim: int = -1, tile: int = 128, pow2_scales: bool = False
) -> torch.Tensor:
    """Quantize a 2-D ``x`` to e4m3 in 1x``tile`` tiles along ``dim`` and dequantize it, in FP32.

    ``dim=-1`` (or 1) gives ``dequantize_activation(*quantize_activation(x))`` bit for bit; ``dim=0`` gives
    the same for the token-dimension tiles of the wgrad GEMM, i.e. the transpose of quantizing ``x.t()``,
    without materializing a transpose (on a 2-core CPU a transposing copy of a (4096, 384) tensor costs
    longer than the matmul it feeds). The CPU emulation of the FP8 linear uses it; the GPU fast path
    keeps the real FP8 tensors.
    """
    _check_block("tile", tile)
    if x.dim() != 2:
        raise ValueError(f"x shape {tuple(x.shape)}: fake_quantize_tiles needs a 2-D tensor")
    if dim not in (-1, 0, 1):
        raise ValueError(f"dim={dim}: must be 0 (token tiles) or -1/1 (feature tiles)")
    rows, cols = x.shape
    x32 = x.float()
    if dim == 0:
        nb = _ceil_div(rows, tile)
        padded = torch.nn.functional.pad(x32, (0, 0, 0, nb * tile - rows)) if rows % tile else x32
        tiles = padded.view(nb, tile, cols)
        scale = _scales_from_amax(tiles.abs().amax(dim=1, keepdim=True), pow2_scales)
    else:
        nb = _ceil_div(cols, tile)
        padded = torch.nn.functional.pad(x32, (0, nb * tile - cols)) if cols % tile else x32
        tiles = padded.view(rows, nb, tile)
        scale = _scales_from_amax(tiles.abs().amax(dim=2, keepdim=True), pow2_scales)
    deq = (_to_fp8(tiles, scale).float() * scale).view(padded.shape)
    return deq[:rows, :cols] if padded is not x32 else deq
