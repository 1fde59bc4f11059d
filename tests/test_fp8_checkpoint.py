"""BF16 -> FP8 checkpoint cast, the FP8 loader, weight-sync tensors and the cast-fp8 command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from infir2_rl.fp8 import checkpoint as ckpt
from infir2_rl.fp8.checkpoint import cast_checkpoint, fp8_state_from_model, load_fp8_model
from infir2_rl.fp8.cli import build_parser, cast_fp8_main
from infir2_rl.fp8.linear import Fp8InferenceLinear, swap_to_fp8_training
from infir2_rl.fp8.quant import FP8_DTYPE, dequantize_weight_blockwise, quantize_weight_blockwise
from infir2_rl.trainers.torch.master_weights import MainGradLinear, MasterWeights


def _tiny_qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return Qwen2ForCausalLM(config)


def _read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = _tiny_qwen2().to(torch.bfloat16)
    path = tmp_path_factory.mktemp("bf16") / "model"
    model.save_pretrained(path, max_shard_size="200KB")  # several shards: the streaming path
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (path / "chat_template.jinja").write_text("{{ messages }}")
    (path / "stale_weights.bin").write_bytes(b"not copied")
    return path


@pytest.fixture(scope="module")
def fp8_dir(bf16_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fp8") / "model"
    report = cast_checkpoint(bf16_dir, out, progress=False, device="cpu")
    assert report.num_quantized == 14 and report.num_kept > 0 and report.bytes_out < report.bytes_in
    return out


def test_cast_output_format(bf16_dir: Path, fp8_dir: Path) -> None:
    assert len(list(bf16_dir.glob("*.safetensors"))) > 1
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
    }
    assert (fp8_dir / "tokenizer_config.json").is_file() and (fp8_dir / "chat_template.jinja").is_file()
    assert (fp8_dir / "generation_config.json").is_file() and not (fp8_dir / "stale_weights.bin").exists()
    src, dst = _read_all(bf16_dir), _read_all(fp8_dir)
    index = json.loads((fp8_dir / ckpt.INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(dst)
    for name, tensor in src.items():
        if ckpt.is_decoder_linear_weight(name):
            w_fp8, scale_inv = quantize_weight_blockwise(tensor)
            assert dst[name].dtype == FP8_DTYPE and torch.equal(
                dst[name].view(torch.uint8), w_fp8.view(torch.uint8)
            )
            scale_name = name.removesuffix("weight") + "weight_scale_inv"
            assert dst[scale_name].dtype == torch.float32 and torch.equal(dst[scale_name], scale_inv)
        else:  # bit-identical copy
            assert dst[name].dtype == tensor.dtype and torch.equal(dst[name], tensor)
    assert len(dst) == len(src) + 14


def test_single_shard_input_still_gets_an_index(tmp_path: Path) -> None:
    torch.manual_seed(1)
    src = tmp_path / "one"
    _tiny_qwen2().to(torch.bfloat16).save_pretrained(src)
    assert not (src / ckpt.INDEX_NAME).exists()
    cast_checkpoint(src, tmp_path / "out", progress=False)
    index = json.loads((tmp_path / "out" / ckpt.INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}


def test_load_fp8_model_logits_close_to_bf16(bf16_dir: Path, fp8_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32)
    ours = load_fp8_model(fp8_dir, dtype=torch.float32)
    assert isinstance(ours.model.layers[1].self_attn.k_proj, Fp8InferenceLinear)
    assert type(ours.lm_head) is nn.Linear
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        ref_logits, fp8_logits = reference(tokens).logits, ours(tokens).logits
    rel = float((fp8_logits - ref_logits).norm() / ref_logits.norm())
    assert rel < 0.1, rel
    assert torch.nn.functional.cosine_similarity(fp8_logits.flatten(), ref_logits.flatten(), dim=0) > 0.99


def test_transformers_own_fp8_loader_agrees(fp8_dir: Path) -> None:
    """transformers' FineGrainedFP8 reads our format; on CPU it dequantizes (it needs `accelerate`)."""
    pytest.importorskip("accelerate", reason="transformers' FP8 loader requires accelerate")
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    # On CPU it dequantizes to BF16 whatever dtype is asked for; compare in FP32 afterwards. With a GPU
    # present it would keep FP8 modules on CPU, so ask for the CPU behaviour explicitly there.
    extra = (
        {"quantization_config": FineGrainedFP8Config(dequantize=True)} if torch.cuda.is_available() else {}
    )
    theirs = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.bfloat16, **extra).float()
    assert type(theirs.model.layers[0].mlp.down_proj) is nn.Linear
    ours = load_fp8_model(fp8_dir, dtype=torch.float32)
    theirs_modules = dict(theirs.named_modules())
    for name, module in ours.named_modules():
        if isinstance(module, Fp8InferenceLinear):  # same dequantized weights, bit for bit
            deq = dequantize_weight_blockwise(module.weight, module.weight_scale_inv, dtype=torch.bfloat16)
            assert torch.equal(theirs_modules[name].weight, deq.float()), name
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        a, b = theirs(tokens).logits, ours(tokens).logits
    # Theirs dequantizes weights only (W8, BF16 math); ours also quantizes activations (W8A8).
    assert float((a - b).norm() / b.norm()) < 0.1
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_fp8_state_from_model_matches_cast_bytes(bf16_dir: Path, fp8_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    on_disk = _read_all(fp8_dir)
    plain = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)  # BF16 trainer
    trained = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    swap_to_fp8_training(trained)  # FP8 trainer: export_fp8 bytes
    loaded = load_fp8_model(fp8_dir, dtype=torch.bfloat16)  # inference modules: their buffers
    # A BF16 trainer with FP32 masters (the GPU default): its decoder linears become MainGradLinear, which
    # the export must still quantize (an exact-type check once sent them as BF16).
    with_masters = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32)
    masters = MasterWeights(with_masters)
    assert type(with_masters.model.layers[0].mlp.up_proj) is MainGradLinear and masters.segments
    for model in (plain, trained, loaded, with_masters):
        state = dict(fp8_state_from_model(model))
        assert set(state) == set(on_disk)
        for name, tensor in on_disk.items():
            assert state[name].dtype == tensor.dtype, name
            assert torch.equal(state[name].view(torch.uint8), tensor.view(torch.uint8)), name
    layer = trained.model.layers[0].mlp.up_proj
    state = dict(fp8_state_from_model(trained))
    assert state["model.layers.0.mlp.up_proj.weight"].data_ptr() == layer.export_fp8()[0].data_ptr()


def _refuses(tmp_path: Path, src: Path, match: str) -> None:
    out = tmp_path / "refused"
    with pytest.raises(ValueError, match=match):
        cast_checkpoint(src, out, progress=False)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_refusals(tmp_path: Path, bf16_dir: Path, fp8_dir: Path) -> None:
    with pytest.raises(ValueError, match="already exists"):
        cast_checkpoint(bf16_dir, fp8_dir, progress=False)
    _refuses(tmp_path, fp8_dir, "already has quantization_config")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    save_file({"w": torch.randn(2, 2)}, str(no_config / "model.safetensors"))
    _refuses(tmp_path, no_config, "no config.json")
    sneaky = tmp_path / "sneaky"  # FP8 tensors but no quantization_config
    sneaky.mkdir()
    (sneaky / "config.json").write_text("{}")
    save_file({"a.q_proj.weight": torch.randn(4, 4).to(FP8_DTYPE)}, str(sneaky / "model.safetensors"))
    _refuses(tmp_path, sneaky, "already FP8-quantized")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    _refuses(tmp_path, empty, "no \\*.safetensors")
    with pytest.raises(ValueError, match="block_size=64"):
        cast_checkpoint(bf16_dir, tmp_path / "x", block_size=64, progress=False)
    # found by a review as a new user: each used to fail with a bare JSON or Python error, or (the last)
    # to write an "FP8" checkpoint in which nothing was quantized
    for name, config, match in [
        ("bad_json", "{oops", "config.json: not valid JSON"),
        ("list_json", "[]", "config.json: a JSON list, not an object"),
    ]:
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(config)
        _refuses(tmp_path, bad, match)
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "config.json").write_text("{}")
    save_file({"embed.weight": torch.randn(4, 4)}, str(unrelated / "model.safetensors"))
    _refuses(tmp_path, unrelated, "no decoder linear weight")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    _refuses(tmp_path, a_file, "a file, not a directory")
    with pytest.raises(ValueError, match="a_file is a file, not a directory"):
        cast_checkpoint(bf16_dir, a_file / "out", progress=False)


def test_failure_mid_cast_leaves_no_partial_output(
    tmp_path: Path, bf16_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real = ckpt.quantize_weight_blockwise

    def flaky(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls["n"] += 1
        if calls["n"] == 9:
            raise RuntimeError("disk on fire")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ckpt, "quantize_weight_blockwise", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        cast_checkpoint(bf16_dir, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_load_fp8_model_refuses_a_bf16_dir(bf16_dir: Path) -> None:
    with pytest.raises(ValueError, match="no quantization_config"):
        load_fp8_model(bf16_dir)


def test_cli(tmp_path: Path, bf16_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["--input", "a", "--output", "b"]).pow2_scales is False
    with pytest.raises(SystemExit):  # a real flag: "--pow2-scales False" is an error, never True
        build_parser().parse_args(["--input", "a", "--output", "b", "--pow2-scales", "False"])
    out = tmp_path / "pow2"
    assert (
        cast_fp8_main(["--input", str(bf16_dir), "--output", str(out), "--pow2-scales", "--no-progress"]) == 0
    )
    assert "14 tensors quantized" in capsys.readouterr().out
    scales = [t for k, t in _read_all(out).items() if k.endswith("weight_scale_inv")]
    assert all(torch.equal(s, torch.exp2(torch.log2(s).round())) for s in scales)
    assert cast_fp8_main(["--input", str(bf16_dir), "--output", str(out), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err
