"""``trainer.fused_kernels`` off the GPU: ``auto`` leaves the CPU's torch modules alone, ``true`` is refused
with one line, and the module swap (run on CPU, where the fused subclasses fall back to the parent's torch
code) changes neither the state dict nor a single output bit. The kernels themselves:
tests/test_fused_layers_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.models.factory import init_model
from infir2_rl.trainers.torch import fused_layers
from infir2_rl.trainers.torch.trainer import TorchTrainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("fused") / "model", preset="tiny")


def _trainer(model_dir: Path, fused: object) -> TorchTrainer:
    return TorchTrainer(
        ModelConfig(path=str(model_dir)),
        TrainerConfig(fused_kernels=fused),  # type: ignore[arg-type]
        OptimizerConfig(),
        fp8=False,
        total_steps=1,
        device="cpu",
    )


def test_auto_keeps_torch_modules_on_cpu_and_true_is_refused(model_dir: Path) -> None:
    assert TrainerConfig().fused_kernels == "auto"
    trainer = _trainer(model_dir, "auto")
    assert trainer.fused_layers == {}
    assert not any(type(m).__name__.startswith("Fused") for m in trainer.model.modules())
    with pytest.raises(ValueError, match=r"trainer.fused_kernels=true needs a CUDA device"):
        _trainer(model_dir, True)
    with pytest.raises(ValueError, match="fused_kernels"):
        TrainerConfig(fused_kernels="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fused_kernels=true is the torch backend"):
        TrainerConfig(backend="megatron", fused_kernels=True)
    assert TrainerConfig(backend="megatron").fused_kernels == "auto"  # the default does not refuse it


def test_swap_keeps_state_dict_and_outputs(model_dir: Path) -> None:
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    swapped = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    counts = fused_layers.apply_fused_layers(swapped)
    n = plain.config.num_hidden_layers
    assert counts == {"rms_norm": 2 * n + 1, "swiglu_mlp": n}
    layer = swapped.model.layers[0]
    assert (
        type(layer.mlp).__name__ == "FusedQwen2MLP"
        and type(layer.input_layernorm).__name__ == "FusedQwen2RMSNorm"
    )
    assert isinstance(layer.input_layernorm, type(plain.model.layers[0].input_layernorm))  # a subclass
    assert list(swapped.state_dict()) == list(plain.state_dict())
    assert fused_layers.apply_fused_layers(swapped) == counts  # idempotent: a fused class is not re-wrapped
    assert type(swapped.model.layers[0].mlp).__mro__[1].__name__ == "Qwen2MLP"
    ids = torch.randint(0, plain.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, swapped(ids).logits)  # CPU: the parent's torch code


def test_only_silu_mlps_without_bias_are_swapped(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.config.hidden_act = "gelu"
    for layer in model.model.layers:
        layer.mlp.config = model.config
    counts = fused_layers.apply_fused_layers(model)
    assert counts["swiglu_mlp"] == 0 and counts["rms_norm"] > 0
