"""trainer.fsdp_param_dtype: what FSDP2 gathers for the forward, on a one-rank gloo group in this process.

BF16 gather keeps FP32 masters and optimizer state, the FP8 linears quantize the gathered BF16 weight, and
the weight-sync export sends exactly those FP8 bytes. Data-parallel equality with one worker (FP32 gather,
the CPU default) is in tests/test_trainer_group.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
from infir2_rl.fp8.linear import Fp8Linear
from infir2_rl.fp8.quant import quantize_weight_blockwise
from infir2_rl.models.factory import init_model
from infir2_rl.stages.sft_eval import SftLossFn, num_target_tokens
from infir2_rl.trainers.torch.distributed import free_port, resolve_fsdp_param_dtype
from infir2_rl.trainers.torch.trainer import TorchTrainer
from infir2_rl.types import TokenBatch
from infir2_rl.weight_sync.service import same_bytes


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """Single-threaded torch for this module (see conftest.one_thread)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", num_hidden_layers=2)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    if dist.is_initialized():  # an in-process megatron trainer of an earlier test keeps its one-rank group
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_auto_gathers_bf16_only_on_gpus_computing_in_bf16() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_fsdp_param_dtype("auto", cpu, torch.float32) == torch.float32
    assert resolve_fsdp_param_dtype("auto", gpu, torch.bfloat16) == torch.bfloat16
    assert resolve_fsdp_param_dtype("auto", gpu, torch.float32) == torch.float32
    assert resolve_fsdp_param_dtype("bfloat16", cpu, torch.float32) == torch.bfloat16
    assert resolve_fsdp_param_dtype("float32", gpu, torch.bfloat16) == torch.float32
    with pytest.raises(ValueError, match="fsdp_param_dtype"):
        TrainerConfig(fsdp_param_dtype="float16")  # type: ignore[arg-type]


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("setting", ["bfloat16", "float32"])
def test_the_forward_gathers_the_set_dtype_and_the_export_sends_what_it_quantized(
    model_dir: Path, setting: str
) -> None:
    trainer = TorchTrainer(
        ModelConfig(path=str(model_dir)),
        TrainerConfig(fsdp_param_dtype=setting),  # type: ignore[arg-type]
        OptimizerConfig(),
        fp8=True,
        total_steps=2,
        device="cpu",
        fsdp=True,
    )
    gathered = getattr(torch, setting)
    assert trainer.fsdp and trainer.fsdp_param_dtype == gathered
    name, linear = next((n, m) for n, m in trainer.model.named_modules() if isinstance(m, Fp8Linear))
    seen: dict[str, object] = {}

    def record(module: Fp8Linear, args: object, out: object) -> None:
        seen["dtype"] = module.weight.dtype
        seen["fp8"] = module.export_fp8()  # the quantization this forward ran with
        seen["weight"] = module.weight.detach().clone()

    linear.register_forward_hook(record)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, trainer.model.config.vocab_size, (2, 12), generator=gen)
    batch = TokenBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones(2, 12))
    stats = trainer.train_step([batch], SftLossFn(), num_target_tokens(batch))
    assert stats.loss > 0 and not stats.skipped and seen["dtype"] == gathered
    # The masters, their gradients' home and AdamW's moments stay FP32 whatever is gathered.
    assert all(p.dtype == torch.float32 for p in trainer.params)
    moments = [t for s in trainer.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert moments and all(t.dtype == torch.float32 for t in moments)
    trainer.forward_logprobs([batch])  # a forward on the updated weights: what the rollout must receive
    with pytest.raises(RuntimeError, match="FSDP shard outside a forward"):
        linear.export_fp8()  # between forwards the module holds a shard, not the weight it trains with
    exported = dict(trainer.export_weights(fp8=True))
    w_fp8, scale_inv = seen["fp8"]  # type: ignore[misc]
    assert same_bytes(w_fp8, exported[f"{name}.weight"])
    assert same_bytes(scale_inv, exported[f"{name}.weight_scale_inv"])
    master = seen["weight"].float()  # type: ignore[attr-defined]
    _, scale_from_master = quantize_weight_blockwise(
        master if setting == "float32" else exported_master(trainer, name)
    )
    # BF16 gather quantizes BF16(master), not the FP32 master: the scales (amax / 448) differ.
    assert torch.equal(scale_from_master, scale_inv) == (setting == "float32")


def exported_master(trainer: TorchTrainer, name: str) -> torch.Tensor:
    """The FP32 master of ``name`` (gathered without rounding): FP8-off export."""
    return dict(trainer.export_weights(fp8=False))[f"{name}.weight"]


@pytest.mark.usefixtures("one_rank_group")
def test_an_fsdp_resume_refuses_weights_that_do_not_fit_the_model(model_dir: Path, tmp_path: Path) -> None:
    """FSDP2 loads with strict=False (a tied lm_head is not saved); a checkpoint with a renamed or missing
    weight is refused by name before anything loads, as the one-GPU path refuses it."""
    from safetensors.torch import load_file, save_file

    def trainer() -> TorchTrainer:
        return TorchTrainer(
            ModelConfig(path=str(model_dir)), TrainerConfig(), OptimizerConfig(), fp8=True, total_steps=2,
            device="cpu", fsdp=True,
        )  # fmt: skip

    first = trainer()
    assert first.fsdp
    first.save(tmp_path / "ckpt")
    trainer().load(tmp_path / "ckpt")  # the checkpoint as written loads
    (weights_file,) = (tmp_path / "ckpt" / "hf").glob("*.safetensors")
    weights = load_file(str(weights_file))
    name = next(n for n in weights if n.endswith("mlp.down_proj.weight"))
    weights[name.replace("down_proj", "down_projection")] = weights.pop(name)
    save_file(weights, str(weights_file))
    with pytest.raises(ValueError, match=r"weights do not match the model \(missing \['model.layers"):
        trainer().load(tmp_path / "ckpt")
