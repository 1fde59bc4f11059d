"""The megatron ``te`` layer spec on a CPU without Transformer Engine: spec selection and its one-sentence
refusals, the FP8 export's cut of TE's fused blockwise bytes into HF projections, the fused-norm mapping
under tensor parallelism, the master-shard bookkeeping and the learning-rate schedule. Nothing here runs TE
(it is not installable on these machines); tests/test_megatron_te_contract.py holds our calls against its
source."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")

from infir2_rl.config import OptimizerConfig, RlStageConfig, SftStageConfig  # noqa: E402
from infir2_rl.config.parallel_rules import te_fp8_layout_problem  # noqa: E402
from infir2_rl.fp8.quant import quantize_weight_blockwise  # noqa: E402
from infir2_rl.models.factory import init_model  # noqa: E402
from infir2_rl.trainers.megatron import hf_mapping as hfm  # noqa: E402
from infir2_rl.trainers.megatron import model as mmodel  # noqa: E402
from infir2_rl.trainers.megatron import te  # noqa: E402
from infir2_rl.trainers.megatron.layers import part_rows  # noqa: E402
from infir2_rl.trainers.optim import build_scheduler  # noqa: E402

TE_IMPORTS = importlib.util.find_spec("transformer_engine") is not None
no_te = pytest.mark.skipif(TE_IMPORTS, reason="Transformer Engine is installed here")
# Qwen2.5-7B's shape facts (head_dim 128, MLP 18944 = 148 x 128) and the tiny demo model's (head_dim 32).
QWEN_7B = {
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "hidden_size": 3584,
    "intermediate_size": 18944,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("te") / "model", preset="tiny", num_hidden_layers=2)


def _one_sentence(message: str) -> None:
    assert "\n" not in message and message.count(". ") == 0, message


@pytest.fixture
def te_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend Transformer Engine imported with the configured scale rule (the checks after the import)."""
    monkeypatch.setattr(te, "import_problem", lambda pow2: None)
    monkeypatch.setattr(te, "recipe_problem", lambda pow2: None)


@no_te
def test_te_without_transformer_engine_is_one_sentence_and_auto_means_local() -> None:
    with pytest.raises(ValueError, match="trainer.megatron_spec=te needs Transformer Engine") as err:
        mmodel.resolve_spec("te", fp8=True)
    _one_sentence(str(err.value))
    assert "megatron_spec=local" in str(err.value)
    assert mmodel.resolve_spec("auto", fp8=True) == "local"
    assert mmodel.resolve_spec("local", fp8=True) == "local"


@no_te
def test_stage_with_te_spec_is_refused_before_any_actor(tiny: Path) -> None:
    from infir2_rl.actors.trainer_group import TrainerGroup

    cfg = SftStageConfig(
        model={"path": str(tiny)},
        trainer={"backend": "megatron", "megatron_spec": "te", "micro_batch_size": 2},
    )
    # The placement is never touched: the refusal comes first (no placement group, no actor).
    with pytest.raises(ValueError, match="needs Transformer Engine"):
        TrainerGroup(cfg, None, total_steps=1)  # type: ignore[arg-type]


def test_te_with_fp8_refuses_models_whose_projections_straddle_te_blocks(
    tiny: Path, te_imports: None
) -> None:
    import json

    hf = json.loads((tiny / "config.json").read_text())
    assert te_fp8_layout_problem(hf) is not None  # head_dim 32
    assert te_fp8_layout_problem(QWEN_7B) is None
    with pytest.raises(ValueError, match="head_dim .* multiples of 128") as err:
        mmodel.resolve_spec("te", fp8=True, hf_config=hf)
    _one_sentence(str(err.value))
    assert (
        mmodel.resolve_spec("te", fp8=False, hf_config=hf) == "te"
    )  # BF16 training: our quantizer at export
    assert mmodel.resolve_spec("auto", fp8=True, hf_config=QWEN_7B) == "te"  # auto takes TE where it imports


def test_te_refuses_dense_scoring_scale_rule_mismatch_and_context_parallelism(
    tiny: Path, te_imports: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="metrics.dense_trainer_mismatch=true") as err:
        mmodel.resolve_spec("te", fp8=True, hf_config=QWEN_7B, dense_forward=True)
    _one_sentence(str(err.value))
    rl = RlStageConfig(
        model={"path": str(tiny)},
        trainer={"backend": "megatron", "megatron_spec": "te", "micro_batch_size": 2},
        precision="bf16",
        metrics={"dense_trainer_mismatch": True},
    )
    assert mmodel.resolve_stage_spec(rl) == "te"  # dense scoring only matters with an FP8 trainer
    message = "trainer.fp8_pow2_scales=false but Transformer Engine's blockwise recipe ..."
    monkeypatch.setattr(te, "recipe_problem", lambda pow2: message)
    with pytest.raises(ValueError, match="fp8_pow2_scales"):
        mmodel.resolve_spec("te", fp8=True, hf_config=QWEN_7B)
    with pytest.raises(ValueError, match="context_parallel_size=2"):
        mmodel.resolve_spec("te", fp8=True, context_parallel_size=2)


def test_te_needs_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    problem = te.runtime_problem(fp8=True)
    assert problem is not None and "needs a CUDA GPU" in problem
    _one_sentence(problem)


def test_te_config_keywords_select_blockwise_fp8_with_fp8_parameters(tiny: Path) -> None:
    from transformers import AutoConfig

    arch = hfm.Arch.from_hf_config(AutoConfig.from_pretrained(tiny))
    kw = mmodel.transformer_config_kwargs(arch, spec="te", fp8=True, tp=1, cp=1, recompute=False)
    assert (kw["fp8"], kw["fp8_recipe"], kw["fp8_param"]) == ("e4m3", "blockwise", True)
    assert kw["bf16"] and kw["params_dtype"] == torch.bfloat16 and kw["calculate_per_token_loss"]
    bf16 = mmodel.transformer_config_kwargs(arch, spec="te", fp8=False, tp=1, cp=1, recompute=False)
    assert "fp8" not in bf16 and "fp8_param" not in bf16
    local = mmodel.transformer_config_kwargs(arch, spec="local", fp8=True, tp=1, cp=1, recompute=False)
    assert "fp8" not in local and local["params_dtype"] == torch.float32  # the local spec's FP8 is ours


# ---------------------------------------------------------------------- TE's FP8 bytes -> HF projections
class _TeWeight:
    """What `te.te_fp8_weight` reads of TE's Float8BlockwiseQTensor (names held against TE's source)."""

    def __init__(self, w: torch.Tensor) -> None:
        w_fp8, scale_inv = quantize_weight_blockwise(w)  # stand-in for TE's quantization of the fused weight
        pad = -scale_inv.shape[1] % 4  # TE pads the scale columns to a multiple of 4 (get_scale_shape)
        self._rowwise_data = w_fp8.view(torch.uint8)
        self._rowwise_scale_inv = torch.cat(
            [scale_inv, torch.full((scale_inv.shape[0], pad), float("nan"))], 1
        )
        self._is_2D_scaled = True


def _arch(head_dim: int, ffn: int) -> hfm.Arch:
    return hfm.Arch(2, 256, 4, 2, head_dim, ffn, 100, False, True, 1e4, 1e-6, 64)


def _config(arch: hfm.Arch) -> SimpleNamespace:
    return SimpleNamespace(
        kv_channels=arch.head_dim, num_query_groups=arch.num_groups, num_attention_heads=arch.num_heads
    )


def test_te_fused_blocks_cut_into_each_hf_projections_own_grid() -> None:
    arch = _arch(head_dim=128, ffn=384)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 256, generator=g) for n in (4 * 128, 2 * 128, 2 * 128))
    gate, up = torch.randn(384, 256, generator=g), torch.randn(384, 256, generator=g) * 3
    for role, fused, hf_parts in (
        ("qkv", hfm.interleave_qkv(q, k, v, arch), (q, k, v)),
        ("fc1", torch.cat([gate, up]), (gate, up)),
    ):
        w_fp8, scale_inv = te.te_fp8_weight(_TeWeight(fused))
        assert not scale_inv.isnan().any()  # the padding columns are dropped
        got = te.block_parts(w_fp8, scale_inv, part_rows(role, _config(arch), fused.shape[0]))
        for (part_fp8, part_scale), hf in zip(got, hf_parts, strict=True):
            want_fp8, want_scale = quantize_weight_blockwise(hf)
            assert torch.equal(part_fp8.view(torch.uint8), want_fp8.view(torch.uint8))
            assert torch.equal(part_scale, want_scale)


def test_te_blocks_that_straddle_projections_and_bf16_weights_are_refused() -> None:
    arch = _arch(head_dim=64, ffn=384)
    fused = torch.randn(4 * 64 + 4 * 64, 256)
    w_fp8, scale_inv = te.te_fp8_weight(_TeWeight(fused))
    with pytest.raises(ValueError, match="straddle"):
        te.block_parts(w_fp8, scale_inv, part_rows("qkv", _config(arch), fused.shape[0]))
    with pytest.raises(ValueError, match="never runs silently in BF16"):
        te.te_fp8_weight(torch.nn.Parameter(torch.randn(128, 128, dtype=torch.bfloat16)))


def test_check_fp8_weights_finds_every_te_decoder_linear() -> None:
    def linear(w: object) -> torch.nn.Module:
        m = torch.nn.Module()
        m.weight = w  # type: ignore[assignment]
        return m

    layer = torch.nn.Module()
    layer.self_attention = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    for block, name in (
        ("self_attention", "linear_qkv"),
        ("self_attention", "linear_proj"),
        ("mlp", "linear_fc1"),
    ):
        getattr(layer, block).add_module(name, linear(_TeWeight(torch.randn(128, 128))))
    layer.mlp.add_module("linear_fc2", linear(torch.randn(128, 128)))  # a BF16 weight left
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([layer])
    assert [(i, role) for i, role, _ in te.te_linears(model)] == [
        (0, "qkv"),
        (0, "proj"),
        (0, "fc1"),
        (0, "fc2"),
    ]
    with pytest.raises(ValueError, match="never runs silently in BF16"):
        te.check_fp8_weights(model)
    layer.mlp.linear_fc2.weight = _TeWeight(torch.randn(128, 128))
    assert te.check_fp8_weights(model) == 4


# ---------------------------------------------------------------------- mapping, masters, schedule
def test_fused_norm_layout_round_trips_through_tensor_parallel_shards(tiny: Path) -> None:
    from transformers import AutoConfig

    from infir2_rl.trainers.torch.checkpoint_io import read_hf_weights

    arch = hfm.Arch.from_hf_config(AutoConfig.from_pretrained(tiny))
    hf = read_hf_weights(tiny)
    mc = hfm.hf_to_megatron(hf, arch, fused_norms=True)
    assert "decoder.layers.0.input_layernorm.weight" not in mc
    for name in ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"):
        assert hfm.split_kind(f"decoder.layers.0.{name}") == "replicated"  # TE keeps norms whole on each rank
    tp = 2
    padded = {n: hfm.pad_vocab(n, t, arch, tp) for n, t in mc.items()}
    pieces = {n: [hfm.shard(n, t, r, tp) for r in range(tp)] for n, t in padded.items()}
    back = hfm.megatron_to_hf({n: hfm.unshard(n, p) for n, p in pieces.items()}, arch, fused_norms=True)
    assert set(back) == set(hf) - {"lm_head.weight"}
    assert all(torch.equal(back[k], hf[k]) for k in back)


def test_master_shards_load_and_gather_by_their_ranges() -> None:
    """`TeRuntime`'s bookkeeping over a stand-in of megatron's distributed optimizer (attributes as in its source)."""
    params = {"a": torch.nn.Parameter(torch.zeros(2, 5)), "b": torch.nn.Parameter(torch.zeros(3))}
    spans = {"a": (3, 8), "b": (0, 3)}  # this rank owns a[3:8] (flattened) and all of b
    for name, (start, end) in spans.items():
        params[name].main_param = torch.zeros(end - start)  # type: ignore[attr-defined]

    class _Opt:
        model_param_gbuf_map = {p: None for p in params.values()}

        def _get_model_param_range_map(self, p: torch.nn.Parameter) -> dict[str, SimpleNamespace]:
            name = next(n for n, q in params.items() if q is p)
            return {"param": SimpleNamespace(start=spans[name][0], end=spans[name][1])}

    module = torch.nn.Module()
    for name, p in params.items():
        module.register_parameter(name, p)
    runtime = object.__new__(te.TeRuntime)
    runtime.module, runtime.optimizer, runtime.dp_group = (
        module,
        SimpleNamespace(chained_optimizers=[_Opt()]),
        None,
    )
    runtime.names = {id(p): n for n, p in module.named_parameters()}
    local = {"a": torch.arange(10.0).view(2, 5) + 0.25, "b": torch.tensor([-1.0, 2.0, 3.5])}
    runtime.load_masters(local)
    assert torch.equal(params["a"].main_param, local["a"].flatten()[3:8])  # type: ignore[attr-defined]
    assert torch.equal(params["a"].detach(), local["a"])
    masters = runtime.master_state()
    assert torch.equal(masters["b"], local["b"])
    assert torch.equal(masters["a"].flatten()[3:8], local["a"].flatten()[3:8])
    assert not masters["a"].flatten()[:3].any()  # other ranks' slices arrive by the sum over DP ranks
    assert set(runtime.master_state(lambda n: n != "a")) == {"b"}


def test_lr_schedule_follows_the_torch_backends_scheduler() -> None:
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_ratio=0.2, schedule="cosine")
    ours = te.LrSchedule(cfg, total_steps=10)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    ref = build_scheduler(opt, cfg, 10)
    for _ in range(10):
        assert ours.get_last_lr()[0] == pytest.approx(ref.get_last_lr()[0], rel=1e-12)
        ours.step()
        opt.step()
        ref.step()
    resumed = te.LrSchedule(cfg, total_steps=10)
    resumed.load_state_dict(ours.state_dict())
    assert resumed.get_last_lr() == ours.get_last_lr()


@pytest.mark.usefixtures("own_process_group")
def test_hf_state_can_leave_out_the_projections_whose_fp8_bytes_come_from_te(tiny: Path) -> None:
    from infir2_rl.config import ModelConfig, TrainerConfig
    from infir2_rl.trainers.megatron.trainer import MegatronTrainer, _is_te_linear_weight

    trainer = MegatronTrainer(
        ModelConfig(path=str(tiny)), TrainerConfig(), OptimizerConfig(), total_steps=1, fp8=False
    )
    full = trainer.hf_state()
    part = trainer.hf_state(lambda name: not _is_te_linear_weight(name))
    left_out = set(full) - set(part)
    assert left_out and all(n.endswith("_proj.weight") for n in left_out)
    assert "model.layers.0.self_attn.q_proj.bias" in part and "model.layers.0.input_layernorm.weight" in part
    assert all(torch.equal(part[k], full[k]) for k in part)
