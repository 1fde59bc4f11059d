"""Blockwise FP8 (e4m3): quantizers, FP8 linears for training and inference, checkpoint cast.

Start with ``quant.py`` (the format), then ``ops.py`` (the three GEMMs), ``linear.py`` (modules and swaps)
and ``checkpoint.py`` (cast, loader, weight-sync tensors).
"""

from infir2_rl.fp8.checkpoint import CastReport, cast_checkpoint, fp8_state_from_model, load_fp8_model
from infir2_rl.fp8.linear import (
    DECODER_LINEAR_NAMES,
    Fp8InferenceLinear,
    Fp8Linear,
    swap_to_fp8_inference,
    swap_to_fp8_training,
)
from infir2_rl.fp8.quant import (
    dequantize_activation,
    dequantize_weight_blockwise,
    quantize_activation,
    quantize_weight_blockwise,
)

__all__ = [
    "DECODER_LINEAR_NAMES",
    "CastReport",
    "Fp8InferenceLinear",
    "Fp8Linear",
    "cast_checkpoint",
    "dequantize_activation",
    "dequantize_weight_blockwise",
    "fp8_state_from_model",
    "load_fp8_model",
    "quantize_activation",
    "quantize_weight_blockwise",
    "swap_to_fp8_inference",
    "swap_to_fp8_training",
]
