"""The te megatron spec's calls held against the source of the versions it runs with (it never ran: Transformer
Engine does not install on these machines).

Sources, read with ``ast`` and never imported (``.ci/te_contract.sh`` unpacks them into ``.ci-te``, pyproject's
``te-contract`` extra; ``INFIR2_TE_CONTRACT_DIR`` moves it):

* Transformer Engine ``TE_VERSION`` (docker/Dockerfile's pin), pure-Python part of its wheel;
* megatron-core 0.19.2 (the image's) and the megatron-core installed here (0.16 on Python 3.11: CI's), whose
  configs are also constructed live with our keywords.

What is checked: every keyword we pass to megatron's TransformerConfig, DistributedDataParallelConfig and
OptimizerConfig is a field (with the values we pick among its Literal choices); every method or attribute we
use on megatron's DDP and optimizers exists (and te.py uses no other: the list is derived from its source);
megatron's TE spec fuses the norms into the linears our mapping names; megatron's FP8 wiring builds TE's
``Float8BlockScaling`` and enters TE's ``fp8_model_init``/``fp8_autocast``, which this TE exports; TE's recipe
reads the FP32-scales variable we set, its blockwise tensor holds the attributes we read, and its scale shape
(lifted from TE and run here) is the padding we drop.

Outside CI a missing source skips these tests with the command; under CI (``CI`` set) it fails.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")

from infir2_rl.config import OptimizerConfig  # noqa: E402
from infir2_rl.trainers.megatron import hf_mapping as hfm  # noqa: E402
from infir2_rl.trainers.megatron import model as mmodel  # noqa: E402
from infir2_rl.trainers.megatron import te  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path(os.environ.get("INFIR2_TE_CONTRACT_DIR", ROOT / ".ci-te"))
TE = SOURCE / "transformer_engine"
_INSTALL = (
    "bash .ci/te_contract.sh (pip download --no-deps of pyproject's te-contract extra, unpacked into .ci-te)"
)

if not (TE / "pytorch").is_dir() or not (SOURCE / "megatron" / "core").is_dir():
    if os.environ.get("CI"):
        raise RuntimeError(f"TE contract source missing at {SOURCE}: CI must fetch it ({_INSTALL})")
    pytest.skip(f"TE contract source not at {SOURCE}: {_INSTALL}", allow_module_level=True)

_installed = importlib.util.find_spec("megatron.core")
assert _installed is not None and _installed.submodule_search_locations
MEGATRON = {
    "image": SOURCE / "megatron" / "core",
    "installed": Path(list(_installed.submodule_search_locations)[0]),
}
megatron_versions = pytest.mark.parametrize("which", sorted(MEGATRON))


# ---------------------------------------------------------------------- ast helpers
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _class(path: Path, name: str) -> ast.ClassDef:
    found = [n for n in ast.walk(_tree(path)) if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"class {name} not in {path}"
    return found[0]


def _function(path: Path, name: str) -> ast.FunctionDef:
    found = [n for n in ast.walk(_tree(path)) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"function {name} not in {path}"
    return found[0]


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _members(cls: ast.ClassDef) -> set[str]:
    """Methods and class-level names (``param_groups = property(...)``)."""
    assigned = {
        t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
    }
    return set(_methods(cls)) | assigned


def _fields(cls: ast.ClassDef) -> dict[str, ast.expr]:
    """Dataclass fields: name -> annotation."""
    return {
        n.target.id: n.annotation
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def _self_attributes(node: ast.AST) -> set[str]:
    """Attributes assigned as ``self.X = ...`` (or ``X.Y = ...`` for any X) anywhere under ``node``."""
    out = set()
    for n in ast.walk(node):
        targets = (
            n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        )
        out |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
    return out


def _accepts(fn: ast.FunctionDef, names: Iterable[str], positional: Iterable[str] = ()) -> None:
    args = fn.args
    params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    if args.kwarg is None:
        missing = sorted(set(names) - set(params))
        assert not missing, f"{fn.name} takes no {missing}"
    ordered = [a.arg for a in args.posonlyargs + args.args if a.arg != "self"]
    assert ordered[: len(list(positional))] == list(positional), (fn.name, ordered)


def _literal_choices(annotation: ast.expr) -> set[Any]:
    return {n.value for n in ast.walk(annotation) if isinstance(n, ast.Constant) and n.value is not None}


def _te_kwargs(fp8: bool) -> dict[str, Any]:
    arch = hfm.Arch(28, 3584, 28, 4, 128, 18944, 152064, False, True, 1e6, 1e-6, 32768)  # Qwen2.5-7B
    return mmodel.transformer_config_kwargs(arch, spec="te", fp8=fp8, tp=2, cp=1, recompute=False)


# ---------------------------------------------------------------------- pins
def test_the_source_is_the_pinned_versions() -> None:
    assert [p.name for p in SOURCE.glob("transformer_engine-*.dist-info")] == [
        f"transformer_engine-{te.TE_VERSION}.dist-info"
    ]
    assert [p.name for p in SOURCE.glob("megatron_core-*.dist-info")] == [
        f"megatron_core-{te.MEGATRON_IMAGE_VERSION}.dist-info"
    ]
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    assert f"ARG TE_VERSION={te.TE_VERSION}\n" in dockerfile
    assert f"ARG MEGATRON_CORE_VERSION={te.MEGATRON_IMAGE_VERSION}\n" in dockerfile
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"transformer_engine=={te.TE_VERSION}", "megatron-core=={te.MEGATRON_IMAGE_VERSION}"' in pyproject


# ---------------------------------------------------------------------- megatron configs
@megatron_versions
@pytest.mark.parametrize("fp8", [True, False])
def test_transformer_config_takes_our_te_keywords(which: str, fp8: bool) -> None:
    core = MEGATRON[which]
    fields = _fields(_class(core / "model_parallel_config.py", "ModelParallelConfig"))
    fields |= _fields(_class(core / "transformer/transformer_config.py", "TransformerConfig"))
    kwargs = _te_kwargs(fp8)
    assert not sorted(set(kwargs) - set(fields)), sorted(set(kwargs) - set(fields))
    if fp8:
        assert kwargs["fp8"] in _literal_choices(fields["fp8"])
        assert kwargs["fp8_recipe"] in _literal_choices(fields["fp8_recipe"])


def test_installed_megatron_builds_our_configs() -> None:
    """Constructed live: their __post_init__ checks (fp8_param needs fp8, ...) run on our keywords."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**_te_kwargs(fp8=True))
    assert (config.fp8, config.fp8_recipe, config.fp8_param) == ("e4m3", "blockwise", True)
    assert config.calculate_per_token_loss
    ddp = DistributedDataParallelConfig(**te.ddp_config_kwargs(fp8=True))
    assert ddp.use_distributed_optimizer and ddp.fp8_param_gather and ddp.grad_reduce_in_fp32
    cfg = OptimizerConfig(lr=3e-6, min_lr=0.0, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-8)
    opt = MegatronOptimizerConfig(**te.optimizer_config_kwargs(cfg))
    assert (opt.lr, opt.adam_beta2, opt.weight_decay, opt.clip_grad) == (3e-6, 0.98, 0.1, 0.0)


@megatron_versions
def test_ddp_and_optimizer_configs_take_our_keywords(which: str) -> None:
    core = MEGATRON[which]
    ddp = _fields(
        _class(core / "distributed/distributed_data_parallel_config.py", "DistributedDataParallelConfig")
    )
    assert not sorted(set(te.ddp_config_kwargs(True)) - set(ddp))
    opt = _fields(_class(core / "optimizer/optimizer_config.py", "OptimizerConfig"))
    ours = te.optimizer_config_kwargs(OptimizerConfig())
    assert not sorted(set(ours) - set(opt)), sorted(set(ours) - set(opt))
    # The optimizer name megatron's factory dispatches on.
    assert f"config.optimizer == '{ours['optimizer']}'" in (core / "optimizer/__init__.py").read_text()


# ---------------------------------------------------------------------- megatron DDP and optimizer API
def _te_py_uses() -> dict[str, set[str]]:
    """Attributes te.py reads on megatron's DDP (``ddp``), optimizers (``optimizer``, ``opt``) and TE (``te``)."""
    tree = ast.parse(Path(te.__file__).read_text())
    uses: dict[str, set[str]] = {"ddp": set(), "optimizer": set(), "te": set()}
    for n in ast.walk(tree):
        if not isinstance(n, ast.Attribute):
            continue
        base = n.value
        owner = (
            base.attr
            if isinstance(base, ast.Attribute)
            and isinstance(base.value, ast.Name)
            and base.value.id == "self"
            else base.id
            if isinstance(base, ast.Name)
            else None
        )
        if owner in ("ddp", "optimizer", "opt"):
            uses["optimizer" if owner == "opt" else owner].add(n.attr)
        elif owner == "te":
            uses["te"].add(n.attr)
    return uses


# What the checks below hold against megatron's source; te.py may use no other attribute of these objects.
DDP_USES = {"zero_grad_buffer", "finish_grad_sync"}
OPTIMIZER_USES = {
    "zero_grad",
    "prepare_grads",
    "get_grad_norm",
    "get_parameters",
    "param_groups",
    "step_with_ready_grads",
    "chained_optimizers",  # ChainedOptimizer
    "model_param_gbuf_map",  # DistributedOptimizer
    "_get_model_param_range_map",  # DistributedOptimizer
    "optimizer",  # the inner torch optimizer over the FP32 shards
}


def test_te_py_uses_only_the_checked_megatron_and_te_names() -> None:
    uses = _te_py_uses()
    assert uses["ddp"] <= DDP_USES, uses["ddp"] - DDP_USES
    assert uses["optimizer"] <= OPTIMIZER_USES, uses["optimizer"] - OPTIMIZER_USES
    assert uses["te"] <= {"is_fp8_block_scaling_available"}, uses["te"]


@megatron_versions
def test_megatron_ddp_and_optimizers_have_what_te_py_calls(which: str) -> None:
    core = MEGATRON[which]
    ddp = _class(core / "distributed/distributed_data_parallel.py", "DistributedDataParallel")
    _accepts(
        _methods(ddp)["__init__"],
        ["config", "ddp_config", "module"],
        positional=["config", "ddp_config", "module"],
    )
    assert set(_methods(ddp)) >= DDP_USES
    _accepts(
        _function(core / "optimizer/__init__.py", "get_megatron_optimizer"),
        [],
        positional=["config", "model_chunks"],
    )
    optimizer_py = core / "optimizer/optimizer.py"
    base = _class(optimizer_py, "MegatronOptimizer")
    assert {
        "zero_grad",
        "prepare_grads",
        "get_grad_norm",
        "get_parameters",
        "param_groups",
        "step_with_ready_grads",
    } <= _members(base)
    assert "optimizer" in _self_attributes(_methods(base)["__init__"])
    chained = _class(optimizer_py, "ChainedOptimizer")
    assert "chained_optimizers" in _self_attributes(chained)
    assert {
        "prepare_grads",
        "get_grad_norm",
        "step_with_ready_grads",
        "param_groups",
    } <= _members(chained)
    dist_py = core / "optimizer/distrib_optimizer.py"
    dist_opt = _class(dist_py, "DistributedOptimizer")
    assert "_get_model_param_range_map" in _methods(dist_opt)
    assert "model_param_gbuf_map" in _self_attributes(dist_opt)
    # Master shards: each model param's FP32 shard is its ``main_param``, over a Range(start, end) of its
    # flattened elements, found under gbuf_range_map["param_map"][param]["param"].
    source = dist_py.read_text()
    assert "model_param.main_param = shard_main_param" in source
    assert 'gbuf_range_map["param_map"][param]' in source
    assert '"param": sub_param_range' in source
    assert {"start", "end"} <= _self_attributes(_class(dist_py, "Range"))
    clip = _function(core / "optimizer/clip_grads.py", "clip_grad_by_total_norm_fp32")
    _accepts(clip, [], positional=["parameters", "max_norm", "total_norm"])


@megatron_versions
def test_ddp_sums_gradients_with_per_token_loss(which: str) -> None:
    """calculate_per_token_loss: no 1/dp pre-scaling, so DP ranks' gradients are summed (our loss is already
    divided by the global batch's units)."""
    tree = _tree(MEGATRON[which] / "distributed/distributed_data_parallel.py")
    branches = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and ast.unparse(n.test) == "config.calculate_per_token_loss"
    ]
    assert len(branches) == 1
    assert "gradient_scaling_factor = 1.0" in [ast.unparse(n) for n in branches[0].body]


# ---------------------------------------------------------------------- megatron's TE spec and FP8 wiring
@megatron_versions
def test_te_spec_fuses_the_norms_into_the_linears_our_mapping_names(which: str) -> None:
    core = MEGATRON[which]
    spec_fn = _function(core / "models/gpt/gpt_layer_specs.py", "get_gpt_layer_with_transformer_engine_spec")
    args = spec_fn.args
    assert len(args.defaults) == len(args.args) and all(
        d is not None for d in args.kw_defaults
    )  # callable bare
    specs = (core / "models/gpt/gpt_layer_specs.py").read_text()
    assert "linear_qkv=backend.column_parallel_layer_norm_linear()" in specs
    assert "linear_fc1 = backend.column_parallel_layer_norm_linear()" in specs
    provider = _class(core / "extensions/transformer_engine_spec_provider.py", "TESpecProvider")
    returned = [
        n.value
        for n in ast.walk(_methods(provider)["column_parallel_layer_norm_linear"])
        if isinstance(n, ast.Return)
    ]
    assert [ast.unparse(r) for r in returned if r is not None] == ["TELayerNormColumnParallelLinear"]
    wrappers = core / "extensions/transformer_engine.py"
    assert (
        ast.unparse(_class(wrappers, "TELayerNormColumnParallelLinear").bases[0])
        == "te.pytorch.LayerNormLinear"
    )
    assert ast.unparse(_class(wrappers, "TERowParallelLinear").bases[0]) == "TELinear"
    assert ast.unparse(_class(wrappers, "TELinear").bases[0]) == "te.pytorch.Linear"
    # The module attributes the mapping's names walk through.
    for module, attr in (("attention", "linear_qkv"), ("mlp", "linear_fc1")):
        source = (core / f"transformer/{module}.py").read_text()
        assert re.search(rf"self\.{attr} = (build_module\(|submodules\.{attr}\()", source), (module, attr)
    # TE's LayerNormLinear registers the fused norm as ``layer_norm_weight`` and its GEMM weight as ``weight``.
    lnl = (TE / "pytorch/module/layernorm_linear.py").read_text()
    assert re.search(r'register_parameter\(\s*"layer_norm_weight"', lnl)
    assert 'self.weight_names = ["weight"]' in lnl and 'self.bias_names = ["bias"]' in lnl
    linear = (TE / "pytorch/module/linear.py").read_text()
    assert 'self.weight_names = ["weight"]' in linear
    assert set(te.TE_LINEAR_ROLES) == {
        "self_attention.linear_qkv",
        "self_attention.linear_proj",
        "mlp.linear_fc1",
        "mlp.linear_fc2",
    }
    arch = hfm.Arch(1, 256, 2, 2, 128, 256, 10, True, True, 1e4, 1e-6, 8)
    names = set(hfm.hf_to_megatron(_fake_hf(arch), arch, fused_norms=True))
    assert {
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
    } <= names


def _fake_hf(arch: hfm.Arch) -> dict[str, torch.Tensor]:
    h, q, kv, f = (
        arch.hidden_size,
        arch.num_heads * arch.head_dim,
        arch.num_groups * arch.head_dim,
        arch.ffn_size,
    )
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    return {
        "model.embed_tokens.weight": torch.zeros(arch.vocab_size, h),
        "model.norm.weight": torch.zeros(h),
        "model.layers.0.input_layernorm.weight": torch.zeros(h),
        "model.layers.0.post_attention_layernorm.weight": torch.zeros(h),
        **{f"{a}{p}_proj.weight": torch.zeros(n, h) for p, n in (("q", q), ("k", kv), ("v", kv))},
        **{f"{a}{p}_proj.bias": torch.zeros(n) for p, n in (("q", q), ("k", kv), ("v", kv))},
        f"{a}o_proj.weight": torch.zeros(h, q),
        f"{m}gate_proj.weight": torch.zeros(f, h),
        f"{m}up_proj.weight": torch.zeros(f, h),
        f"{m}down_proj.weight": torch.zeros(h, f),
    }


def _te_exports() -> set[str]:
    """Names ``transformer_engine.pytorch`` exports (its __init__'s imports and definitions)."""
    tree = _tree(TE / "pytorch/__init__.py")
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            names |= {a.asname or a.name for a in n.names}
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            names.add(n.name)
    return names


@megatron_versions
def test_megatron_builds_te_blockwise_fp8_from_our_config(which: str) -> None:
    """fp8_recipe="blockwise" -> TE's Float8BlockScaling; layers built under fp8_model_init (fp8_param) and run
    under fp8_autocast, names this TE exports."""
    core = MEGATRON[which]
    recipe_fn = ast.unparse(_function(core / "fp8_utils.py", "get_fp8_recipe"))
    assert re.search(
        r"Fp8Recipe\.blockwise.*\n\s*fp8_recipe = transformer_engine\.common\.recipe\.Float8BlockScaling\(",
        recipe_fn,
    )
    assert "transformer_engine.common.recipe.Format.E4M3" in recipe_fn
    context_fn = _function(core / "fp8_utils.py", "get_fp8_context")
    used = {
        n.attr
        for n in ast.walk(context_fn)
        if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "transformer_engine.pytorch"
    }
    assert {"fp8_autocast", "fp8_model_init"} <= used
    assert used <= _te_exports(), used - _te_exports()
    assert "config.fp8 if not is_init else config.fp8_param" in ast.unparse(context_fn)
    block = (core / "transformer/transformer_block.py").read_text()
    assert re.search(r"get_fp8_context\(\s*\n?\s*\w+, \w+ - 1, is_init=True", block)
    enums = _class(core / "enums.py", "Fp8Recipe")
    assert "blockwise" in {
        t.id for n in enums.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
    }


# ---------------------------------------------------------------------- Transformer Engine
def test_te_recipe_reads_the_fp32_scales_variable_and_blocks_weights_128x128() -> None:
    recipe = _class(TE / "common/recipe/__init__.py", "Float8BlockScaling")
    body = ast.unparse(recipe)
    assert f'os.getenv("{te.FP32_SCALES_ENV}", "0") == "1"' in body.replace("'", '"')
    assert "fp8_quant_fwd_weight = QParams(power_2_scale=not use_f32_scales" in body
    fields = {
        n.target.id: n.value
        for n in recipe.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert (
        ast.unparse(fields["w_block_scaling_dim"]) == "2"
        and ast.unparse(fields["x_block_scaling_dim"]) == "1"
    )
    assert "power_2_scale" in _fields(_class(TE / "common/recipe/__init__.py", "QParams"))


def test_te_exports_the_block_scaling_check_we_call() -> None:
    assert "is_fp8_block_scaling_available" in _te_exports()
    fn = _function(TE / "pytorch/quantization.py", "is_fp8_block_scaling_available")
    _accepts(fn, ["return_reason"])


def test_te_blockwise_tensor_holds_what_te_fp8_weight_reads() -> None:
    storage = _class(
        TE / "pytorch/tensor/storage/float8_blockwise_tensor_storage.py", "Float8BlockwiseQTensorStorage"
    )
    assert {"_rowwise_data", "_rowwise_scale_inv", "_is_2D_scaled"} <= set(
        _fields(storage)
    ) | _self_attributes(storage)
    tensor = _class(TE / "pytorch/tensor/float8_blockwise_tensor.py", "Float8BlockwiseQTensor")
    assert [ast.unparse(b) for b in tensor.bases] == ["Float8BlockwiseQTensorStorage", "QuantizedTensor"]
    quantizer = _class(TE / "pytorch/tensor/float8_blockwise_tensor.py", "Float8BlockQuantizer")
    assert "self.block_len = 128" in ast.unparse(_methods(quantizer)["__init__"])


def test_te_scale_shape_pads_columns_that_te_fp8_weight_drops() -> None:
    """TE's own ``get_scale_shape`` and ``round_up_to_nearest_multiple``, lifted and run on a 384 x 200 weight."""
    namespace: dict[str, Any] = {"math": math, "Iterable": Iterable, "Tuple": tuple}
    for path, name in (
        (TE / "pytorch/utils.py", "round_up_to_nearest_multiple"),
        (TE / "pytorch/tensor/float8_blockwise_tensor.py", "get_scale_shape"),
    ):
        fn = _function(path, name)
        exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    quantizer = SimpleNamespace(block_len=128, block_scaling_dim=2)
    shape = namespace["get_scale_shape"](quantizer, (384, 200), columnwise=False)
    assert shape == (3, 4)  # ceil(200 / 128) = 2 columns, padded to 4
    weight = SimpleNamespace(
        _rowwise_data=torch.zeros(384, 200, dtype=torch.uint8),
        _rowwise_scale_inv=torch.ones(shape),
        _is_2D_scaled=True,
    )
    w_fp8, scale_inv = te.te_fp8_weight(weight)
    assert w_fp8.dtype == torch.float8_e4m3fn and tuple(scale_inv.shape) == (3, 2)
