"""FP32 master weights kept beside a BF16 model (``trainer.param_dtype: bfloat16``, the GPU default).

Why: with FP32 parameters under BF16 autocast (``param_dtype: float32``, the CPU path) every forward casts
each weight to BF16, every backward casts its gradient back to FP32, and the residual stream, the norms and
their saved activations stay FP32. At the 1.5B shape on an H100 those casts and FP32 adds were ~25% of a
BF16 step's kernel time (docs/performance.md, "BF16 model, FP32 masters"). Here the model's parameters are
BF16, so activations flow in BF16 as in the rollout engine, and the FP32 values live only where the update
needs them:

* ``masters``: FP32 tensors, views of one flat buffer, holding the exact weights. The optimizer steps them
  (their ``.grad`` are views of one flat FP32 buffer), and ``copy_to_model`` then rounds them into the model's
  BF16 parameters (themselves views of one flat BF16 buffer: one kernel for the whole model).
* Gradients accumulate in FP32, as before: each BF16 parameter's gradient is added into its master's
  ``.grad`` (``param.main_grad``) as soon as autograd has it (a post-accumulate-grad hook), and the BF16
  ``.grad`` is dropped. The CUDA layer graphs add into ``main_grad`` themselves (layer_graphs.py).
* Parameters that the model only ever quantizes (the FP8 decoder linears' weights) are left FP32 and are their
  own masters, as before: a BF16 copy would cost 2 bytes per weight and round each weight twice.

Checkpoints read ``state_dict`` (the masters, FP32) and restore them with ``load_state_dict``, so resume stays
exact. Not with FSDP (it keeps its own FP32 shards and gathers BF16 copies: ``trainer.fsdp_param_dtype``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from infir2_rl.fp8.linear import Fp8Linear


def computed_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a forward computes with directly, i.e. all but the FP8 linears' weights, which it only
    quantizes (128x128 blocks from the FP32 value): those stay FP32 in a BF16 model."""
    quantized = {id(m.weight) for m in model.modules() if isinstance(m, Fp8Linear)}
    return [p for p in model.parameters() if id(p) not in quantized]


def _accumulate_into_main_grad(param: Tensor) -> None:
    grad = param.grad
    assert grad is not None
    param.main_grad.add_(grad)  # type: ignore[attr-defined]
    param.grad = None


class MasterWeights:
    """FP32 masters of ``params`` (moved to BF16 in place, see the module docstring)."""

    def __init__(self, params: Iterable[nn.Parameter], dtype: torch.dtype = torch.bfloat16) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MasterWeights: no trainable parameters to keep masters of")
        device = self.params[0].device
        numel = sum(p.numel() for p in self.params)
        self._master_flat = torch.empty(numel, dtype=torch.float32, device=device)
        self._grad_flat = torch.zeros(numel, dtype=torch.float32, device=device)
        self._model_flat = torch.empty(numel, dtype=dtype, device=device)
        self.masters: list[Tensor] = []
        offset = 0
        with torch.no_grad():
            for p in self.params:
                if p.dtype != torch.float32:
                    raise TypeError(f"MasterWeights: parameters must start FP32, got {p.dtype}")
                n = p.numel()
                master = self._master_flat[offset : offset + n].view_as(p)
                master.copy_(p)
                master.requires_grad_(True)  # what the optimizer steps (it is in no autograd graph)
                master.grad = self._grad_flat[offset : offset + n].view_as(p)
                model_copy = self._model_flat[offset : offset + n].view_as(p)
                p.data = model_copy  # the module keeps its Parameter object; its values are now BF16 views
                p.main_grad = master.grad  # type: ignore[attr-defined]
                p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
                self.masters.append(master)
                offset += n
        self.copy_to_model()

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the model's BF16 parameters (after each optimizer step)."""
        self._model_flat.copy_(self._master_flat)

    def zero_grad(self) -> None:
        self._grad_flat.zero_()

    def state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """``model.state_dict()`` with each kept parameter's entry replaced by its FP32 master."""
        by_ptr = {p.data_ptr(): m for p, m in zip(self.params, self.masters, strict=True)}
        return {k: by_ptr.get(v.data_ptr(), v) for k, v in model.state_dict().items()}

    @torch.no_grad()
    def load_state_dict(self, model: nn.Module, weights: Mapping[str, Tensor]) -> None:
        """Set the masters (and the model's BF16 copies) from FP32 ``weights`` named as in ``model``."""
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):  # a tied weight has several names
            names.setdefault(id(p), []).append(name)
        missing = []
        for p, master in zip(self.params, self.masters, strict=True):
            saved = [n for n in names[id(p)] if n in weights]
            if saved:
                master.copy_(weights[saved[0]])
            else:
                missing.append(names[id(p)][0])
        if missing:
            raise KeyError(f"MasterWeights: no saved value for {missing[:5]}")
        self.copy_to_model()
