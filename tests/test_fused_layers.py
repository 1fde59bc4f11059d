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
    assert counts == {"rms_norm": 2 * n + 1, "swiglu_mlp": n, "rope_attention": n}
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


def test_rotary_runs_transformers_function_off_the_gpu_and_the_dispatcher_is_installed_once(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernels are CUDA-only (tests/test_fused_rope_gpu.py); here the plumbing: the fused attention marks its
    # calls, the modeling module's apply_rotary_pos_emb is wrapped once, and on CPU the wrapper calls
    # transformers' function inside and outside a fused attention, so outputs do not move.
    from transformers.models.qwen2 import modeling_qwen2

    from infir2_rl.trainers.torch import fused_rope

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    fused_layers.apply_fused_layers(model)
    assert type(model.model.layers[0].self_attn).__name__ == "FusedQwen2Attention"
    dispatcher = modeling_qwen2.apply_rotary_pos_emb
    assert isinstance(dispatcher, fused_rope._Dispatcher)
    assert fused_rope.install(modeling_qwen2) and modeling_qwen2.apply_rotary_pos_emb is dispatcher
    seen: list[bool] = []
    original = dispatcher.original

    def counting(*args: object, **kwargs: object) -> object:
        seen.append(fused_rope._ACTIVE.get())
        return original(*args, **kwargs)

    monkeypatch.setattr(dispatcher, "original", counting)
    ids = torch.randint(0, plain.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, model(ids).logits)
    n = plain.config.num_hidden_layers
    assert seen == [False] * n + [True] * n  # the plain model's calls, then the fused attentions' (marked)
    assert not fused_rope._ACTIVE.get()  # the mark ends with the forward
    attention = model.model.layers[0].self_attn  # a wrapper class above the fused one (as FSDP2 makes)
    attention.__class__ = type("Wrapped", (type(attention),), {})
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, model(ids).logits)


def test_only_silu_mlps_without_bias_are_swapped(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model.config.hidden_act = "gelu"
    for layer in model.model.layers:
        layer.mlp.config = model.config
    counts = fused_layers.apply_fused_layers(model)
    assert counts["swiglu_mlp"] == 0 and counts["rms_norm"] > 0


def test_norms_link_to_their_fp8_readers_and_o_proj_is_marked(model_dir: Path) -> None:
    # The plumbing of the FP8 handovers (the kernels: tests/test_fused_layers_gpu.py): each decoder layer's two
    # norms learn which FP8 linears read them, o_proj learns that SDPA keeps its input, and on CPU (no fast
    # path) the norms plan nothing, so outputs do not move.
    from infir2_rl.fp8.linear import mark_kept_inputs, swap_to_fp8_training

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    n = model.config.num_hidden_layers
    fused_layers.apply_fused_layers(model)
    assert fused_layers.link_norms_to_fp8_linears(model) == 0  # dense readers: nothing to plan for
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    swap_to_fp8_training(model)
    with torch.no_grad():
        before = model(ids).logits
    modules = list(dict(model.named_modules()))
    assert fused_layers.link_norms_to_fp8_linears(model) == 2 * n
    layer = model.model.layers[0]
    assert layer.input_layernorm._fp8_readers == [
        layer.self_attn.q_proj,
        layer.self_attn.k_proj,
        layer.self_attn.v_proj,
    ]
    assert layer.post_attention_layernorm._fp8_readers == [layer.mlp.gate_proj, layer.mlp.up_proj]
    assert not hasattr(model.model.norm, "_fp8_readers")  # the final norm feeds the lm_head
    assert fused_layers._norm_plan(layer.input_layernorm, torch.zeros(1, 9, model.config.hidden_size)) is None
    assert mark_kept_inputs(model) == n
    assert layer.self_attn.o_proj.input_kept and not layer.mlp.down_proj.input_kept
    assert list(dict(model.named_modules())) == modules  # plain attributes: no submodules, no new names
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_planned_outputs_are_written_where_a_hook_can_see_them() -> None:
    # The norms and SwiGLU skip writing an output only FP8 linears read; a forward hook on the producer, a
    # pre-hook on a reader or a global module hook (the mismatch probe's taps) can read it, so it is written.
    producer, reader = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert not fused_layers._hooks_see_output(producer, [reader])
    handle = producer.register_forward_hook(lambda m, i, o: None)
    assert fused_layers._hooks_see_output(producer, [reader])
    handle.remove()
    handle = reader.register_forward_pre_hook(lambda m, i: None)
    assert fused_layers._hooks_see_output(producer, [reader])
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    assert fused_layers._hooks_see_output(producer, [reader])
    handle.remove()
    assert not fused_layers._hooks_see_output(producer, [reader])
