"""Config loading, overrides and validation: one test per rule, each checking the message names the field."""

import re
from pathlib import Path
from typing import Any

import pytest

from infir2_rl.cli import main
from infir2_rl.config import (
    ConfigError,
    apply_overrides,
    load_pipeline_config,
    load_pipeline_stages,
    load_stage_config,
    parse_stage_config,
    validate_paths,
)
from infir2_rl.fp8.checkpoint import cast_checkpoint
from infir2_rl.models.factory import init_model

CONFIGS = sorted(Path(__file__).resolve().parents[1].glob("configs/**/*.yaml"))


def _err(data: dict) -> str:
    with pytest.raises(ConfigError) as e:
        parse_stage_config(data)
    return str(e.value)


def test_every_shipped_config_validates() -> None:
    assert len(CONFIGS) >= 5
    for path in CONFIGS:
        assert path.read_text().startswith("# Run:"), f"{path} must open with the command that runs it"
        assert main(["check-config", str(path)]) == 0, path


def test_7b_recipe_values() -> None:
    base = CONFIGS[0].parent if CONFIGS[0].parent.name == "configs" else CONFIGS[0].parents[1]
    sft = load_stage_config(base / "sft_stage1.yaml")
    assert (sft.trainer.epochs, sft.trainer.global_batch_size, sft.trainer.max_tokens_per_gpu) == (
        5,
        64,
        32768,
    )
    assert (sft.optimizer.lr, sft.optimizer.min_lr, sft.optimizer.warmup_ratio) == (2e-5, 2e-6, 0.05)
    assert sft.optimizer.betas == (0.9, 0.95) and sft.optimizer.weight_decay == 0.0
    rl1, rl2 = load_stage_config(base / "rl_stage1_8k.yaml"), load_stage_config(base / "rl_stage2_16k.yaml")
    for rl in (rl1, rl2):
        assert rl.kind == "rl" and rl.precision == "unified_fp8" and rl.train_fp8 and rl.rollout_fp8
        assert (rl.rollout.prompts_per_step, rl.rollout.n_samples_per_prompt) == (128, 16)
        assert rl.global_batch_size == 2048 and rl.rollout.over_sampling_prompts == 384
        assert (rl.algorithm.eps_clip_low, rl.algorithm.eps_clip_high, rl.algorithm.kl_coef) == (
            0.2,
            0.28,
            0.0,
        )
        assert rl.algorithm.tis and rl.algorithm.tis_high == 2.0
        assert (rl.optimizer.lr, rl.optimizer.schedule, rl.optimizer.weight_decay) == (1e-6, "constant", 0.1)
        assert rl.optimizer.betas == (0.9, 0.98) and rl.optimizer.grad_clip == 1.0
    assert (rl1.rollout.max_response_len, rl1.rollout.temperature) == (8192, 1.0)
    assert (rl2.rollout.max_response_len, rl2.rollout.temperature) == (16384, 1.1)


def test_overrides_are_parsed_as_yaml() -> None:
    data = apply_overrides({}, ["optimizer.lr=1e-6", "optimizer.betas=[0.9,0.98]", "data.test_path=null"])
    assert data == {"optimizer": {"lr": 1e-6, "betas": [0.9, 0.98]}, "data": {"test_path": None}}
    with pytest.raises(ConfigError, match="section.field=value"):
        apply_overrides({}, ["optimizer.lr"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"seed": 1}, ["seed.x=2"])


def test_unknown_key() -> None:
    assert _err({"trainer": {"learning_rate": 1.0}}).startswith("trainer.learning_rate: unknown key")


def test_wrong_type() -> None:
    assert _err({"trainer": {"num_workers": "two"}}).startswith("trainer.num_workers='two'")


def test_grpo_needs_two_samples() -> None:
    msg = _err({"kind": "rl", "rollout": {"n_samples_per_prompt": 1}})
    assert msg.startswith("rollout.n_samples_per_prompt=1: must be >= 2 for GRPO")


def test_global_batch_divisible_by_micro_batch_times_dp() -> None:
    msg = _err({"trainer": {"global_batch_size": 30, "micro_batch_size": 4, "num_workers": 2}})
    assert msg.startswith("trainer.global_batch_size=30") and "4 x 2 = 8" in msg


def test_an_rl_token_budget_below_the_longest_row_is_refused_when_the_config_loads() -> None:
    """An RL row longer than trainer.max_tokens_per_gpu fits no micro-batch: refused here, not at the first
    update after a rollout; a budget that holds the longest row is accepted. (SFT keeps budgets below
    data.max_seq_len: its data is often shorter, and a row over the budget fails at the first step.)"""
    rl = {"kind": "rl", "data": {"max_prompt_tokens": 64}, "rollout": {"max_response_len": 16384}}
    msg = _err(rl | {"trainer": {"max_tokens_per_gpu": 16384}})
    assert msg.startswith("trainer.max_tokens_per_gpu=16384: below the longest row")
    assert "data.max_prompt_tokens 64 + rollout.max_response_len 16384 = 16448 tokens" in msg
    assert parse_stage_config(rl | {"trainer": {"max_tokens_per_gpu": 16448}}).longest_row() == 16448
    sft = {"kind": "sft", "data": {"max_seq_len": 4096}, "trainer": {"max_tokens_per_gpu": 2048}}
    assert parse_stage_config(sft).trainer.max_tokens_per_gpu == 2048


def test_rl_global_batch_follows_rollout() -> None:
    cfg = parse_stage_config({"kind": "rl", "rollout": {"prompts_per_step": 4, "n_samples_per_prompt": 4}})
    # Derived, not written into the trainer section: the section keeps what the user set (nothing).
    assert (
        cfg.global_batch_size == 16 and cfg.trainer.global_batch_size is None and cfg.updates_per_rollout == 1
    )
    cfg.rollout.n_samples_per_prompt = 8  # follows the rollout batch it is derived from
    assert cfg.global_batch_size == 32
    assert "must divide rollout.prompts_per_step" in _err(
        {"kind": "rl", "trainer": {"global_batch_size": 48}}
    )


@pytest.mark.parametrize(
    ("precision", "train_fp8", "rollout_fp8"),
    [("unified_fp8", True, True), ("bf16_train_fp8_rollout", False, True), ("bf16", False, False)],
)
def test_rl_precision_is_one_setting(precision: str, train_fp8: bool, rollout_fp8: bool) -> None:
    cfg = parse_stage_config({"kind": "rl", "precision": precision})
    assert (cfg.train_fp8, cfg.rollout_fp8) == (train_fp8, rollout_fp8)
    sft = parse_stage_config({"kind": "sft", "precision": "bf16"})
    assert sft.train_fp8 is False and parse_stage_config({}).train_fp8 is True
    assert _err({"kind": "sft", "precision": "unified_fp8"}).startswith("precision='unified_fp8'")


def test_moved_keys_name_their_new_home() -> None:
    for data in (
        {"kind": "rl", "weight_sync": {"mode": "bf16"}},
        {"kind": "rl", "rollout": {"fp8": True}},
        {"kind": "sft", "trainer": {"fp8": False}},
    ):
        msg = _err(data)
        assert "was replaced by the stage's top-level `precision`" in msg and "set precision" in msg, msg


def test_fields_of_the_other_kind_are_refused() -> None:
    assert _err({"kind": "rl", "trainer": {"epochs": 2}}).startswith(
        "trainer.epochs: a field of SFT stages only"
    )
    assert _err({"kind": "rl", "data": {"max_seq_len": 9}}).startswith(
        "data.max_seq_len: a field of SFT stages"
    )
    assert _err({"kind": "sft", "data": {"input_key": "q"}}).startswith(
        "data.input_key: a field of RL stages"
    )
    assert _err({"kind": "sft", "algorithm": {}}).startswith("algorithm: a section of RL stages only")
    assert _err({"kind": "sft", "trainer": {"bogus": 1}}).startswith("trainer.bogus: unknown key")


def test_every_transport_name_is_accepted_and_others_are_not() -> None:
    for name in ("auto", "object_store", "cuda_ipc", "nccl"):
        assert (
            parse_stage_config({"kind": "rl", "weight_sync": {"transport": name}}).weight_sync.transport
            == name
        )
    assert _err({"kind": "rl", "weight_sync": {"transport": "rdma"}}).startswith("weight_sync.transport")


def test_algorithm_section_is_the_algo_config() -> None:
    from infir2_rl.algo.config import AlgorithmConfig

    cfg = parse_stage_config({"kind": "rl", "algorithm": {"kl_coef": 0.05, "kl_type": "low_var_kl"}})
    assert isinstance(cfg.algorithm, AlgorithmConfig) and cfg.algorithm.needs_reference
    assert _err({"kind": "rl", "algorithm": {"mis_veto": 1e-4}}).startswith("algorithm.mis_veto: unknown key")
    assert _err({"kind": "rl", "algorithm": {"tis_low": 3.0}}).startswith("algorithm.tis_low=3.0")


def test_rl_sampling_must_be_plain_softmax() -> None:
    assert _err({"kind": "rl", "rollout": {"top_p": 0.95}}).startswith("rollout.top_p=0.95")


def test_torch_backend_has_no_tensor_parallel() -> None:
    msg = _err({"trainer": {"num_workers": 4, "tensor_parallel_size": 2}})
    assert "torch backend is data-parallel only" in msg


def test_bad_kind_and_values() -> None:
    assert _err({"kind": "dpo"}) == "kind: must be 'sft' or 'rl'"
    assert _err({"optimizer": {"lr": 1e-5, "min_lr": 1e-4}}).startswith("optimizer.min_lr=0.0001")
    assert _err({"optimizer": {"betas": [0.9, 1.5]}}).startswith("optimizer.betas[1]=1.5")


def test_missing_paths(tmp_path: Path) -> None:
    cfg = parse_stage_config(
        {"model": {"path": str(tmp_path)}, "data": {"train_path": str(tmp_path / "no.jsonl")}}
    )
    with pytest.raises(ValueError, match=r"^data.train_path='.*no.jsonl': no such file"):
        validate_paths(cfg)


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_stage_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_stage_config(bad)
    # A key written twice (PyYAML keeps the last silently), bytes that are not text, an unclosed override.
    dup = tmp_path / "dup.yaml"
    dup.write_text("kind: sft\noptimizer:\n  lr: 1e-3\n  lr: 1e-2\n")
    with pytest.raises(ConfigError, match=r"key 'lr' appears twice in one mapping \(lines 3 and 4\)"):
        load_stage_config(dup)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_stage_config(binary)
    ok = tmp_path / "ok.yaml"
    ok.write_text("kind: sft\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line 1, column 6"):
        load_stage_config(ok, ["optimizer.betas=[0.9,"])
    # placement.use_gpu=yes: YAML reads the word as a boolean; the setting takes it back as the word typed.
    assert load_stage_config(ok, ["placement.use_gpu=yes"]).placement.use_gpu == "yes"
    assert load_stage_config(ok, ["placement.use_gpu=no"]).placement.use_gpu == "no"
    # Every float setting is finite: inf passed the range checks that refuse nan.
    with pytest.raises(ConfigError, match="rollout.temperature.*finite number"):
        load_stage_config(ok, ["kind=rl", "rollout.temperature=.inf"])


def test_pipeline_resolves_stages(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("kind: sft\n")
    (tmp_path / "p.yaml").write_text(
        "run_dir: R\nstages:\n  - {name: a, config: s.yaml, overrides: ['seed=3']}\n  - {name: c, kind: cast_fp8}\n"
    )
    pipe = load_pipeline_config(tmp_path / "p.yaml")
    stages = load_pipeline_stages(pipe, tmp_path / "p.yaml")
    assert [n for n, _ in stages] == ["a", "c"] and stages[1][1] is None
    first = stages[0][1]
    assert first is not None and first.seed == 3 and first.run_dir == str(Path("R") / "a")
    (tmp_path / "d.yaml").write_text(
        "stages:\n  - {name: a, config: s.yaml}\n  - {name: a, config: s.yaml}\n"
    )
    with pytest.raises(ConfigError, match="repeat"):
        load_pipeline_config(tmp_path / "d.yaml")
    # A stage's name is its directory under run_dir: nothing may lead outside it or into the root itself.
    for name in ("''", "'../../etc'", "a/b", "'..'"):
        (tmp_path / "n.yaml").write_text(f"stages:\n  - {{name: {name}, config: s.yaml}}\n")
        with pytest.raises(ConfigError, match="a stage name is its directory under run_dir"):
            load_pipeline_config(tmp_path / "n.yaml")
    with pytest.raises(ConfigError, match="run_dir='': empty"):
        load_pipeline_config(tmp_path / "p.yaml", ["run_dir="])


def test_check_config_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: rl\nrollout:\n  n_samples_per_prompt: 1\n")
    assert main(["check-config", str(bad)]) == 2
    assert "rollout.n_samples_per_prompt=1" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text("kind: sft\n")
    assert main(["check-config", str(good), "optimizer.lr=0.5"]) == 0
    assert "lr: 0.5" in capsys.readouterr().out


@pytest.mark.parametrize("precision", ["unified_fp8", "bf16_train_fp8_rollout", "bf16"])
def test_demo_precision_switch_sets_every_stage(precision: str) -> None:
    from infir2_rl.config import load_pipeline_config
    from infir2_rl.pipeline import DEMO_PIPELINE, precision_overrides, resolve_stages

    pipeline = load_pipeline_config(DEMO_PIPELINE)
    stages = resolve_stages(DEMO_PIPELINE, pipeline, ["seed=3"], precision_overrides(precision))
    kinds = [cfg.kind for _, cfg in stages if cfg is not None]
    assert kinds == ["sft", "sft", "rl", "rl"]
    for _, cfg in stages:
        if cfg is None:
            continue
        assert cfg.seed == 3
        assert cfg.train_fp8 is (precision == "unified_fp8")
        if cfg.kind == "rl":
            assert cfg.precision == precision and cfg.rollout_fp8 is (precision != "bf16")
            assert cfg.updates_per_rollout == 2  # the demo's 256 samples in two optimizer steps


def test_unknown_precision_is_refused() -> None:
    from infir2_rl.pipeline import precision_overrides

    with pytest.raises(ValueError, match="choose one of"):
        precision_overrides("fp4")


def test_kind_prefixed_overrides_reach_only_that_kind() -> None:
    from infir2_rl.config import load_pipeline_config
    from infir2_rl.pipeline import DEMO_PIPELINE, resolve_stages, split_scoped_overrides

    common, by_kind = split_scoped_overrides(["seed=5", "sft:trainer.max_steps=7", "rl:rollout.num_steps=2"])
    assert common == ["seed=5"] and by_kind == {"sft": ["trainer.max_steps=7"], "rl": ["rollout.num_steps=2"]}
    stages = resolve_stages(DEMO_PIPELINE, load_pipeline_config(DEMO_PIPELINE), common, by_kind)
    for _, cfg in stages:
        if cfg is not None and cfg.kind == "sft":
            assert (cfg.seed, cfg.trainer.max_steps) == (5, 7)
        elif cfg is not None:
            assert (cfg.seed, cfg.rollout.num_steps) == (5, 2)


def test_stage_name_prefixed_overrides_reach_only_that_stage() -> None:
    from infir2_rl.config import load_pipeline_config
    from infir2_rl.pipeline import DEMO_PIPELINE, resolve_stages, split_scoped_overrides

    common, scoped = split_scoped_overrides(
        ["rl:rollout.num_steps=2", "rl_stage1:rollout.num_steps=9", "x=a:b"]
    )
    assert common == ["x=a:b"] and scoped == {
        "rl": ["rollout.num_steps=2"],
        "rl_stage1": ["rollout.num_steps=9"],
    }
    stages = dict(resolve_stages(DEMO_PIPELINE, load_pipeline_config(DEMO_PIPELINE), (), scoped))
    # The stage's own scope wins over its kind's; the other RL stage keeps the kind's value.
    assert stages["rl_stage1"].rollout.num_steps == 9  # type: ignore[union-attr]
    assert stages["rl_stage2"].rollout.num_steps == 2  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="rl_stage3"):
        resolve_stages(DEMO_PIPELINE, load_pipeline_config(DEMO_PIPELINE), (), {"rl_stage3": ["seed=1"]})


def test_rl_global_batch_must_divide_the_rollout_batch() -> None:
    from infir2_rl.config import load_stage_config

    path = Path(__file__).resolve().parents[1] / "configs" / "demo" / "rl_stage1.yaml"
    cfg = load_stage_config(path, ["trainer.global_batch_size=64"])
    assert cfg.updates_per_rollout == 4  # type: ignore[union-attr]
    assert load_stage_config(path).updates_per_rollout == 2  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="must divide"):
        load_stage_config(path, ["trainer.global_batch_size=100"])


@pytest.mark.parametrize("finished_rl1", [False, True])
def test_pipeline_resumed_after_the_cast_starts_rl_from_the_sft_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, finished_rl1: bool
) -> None:
    """The cast's output goes to the engines (rollout.fp8_checkpoint); the trainer starts from SFT 2's final.
    Resumed after RL 1 finished, RL 2 gets no cast (it once got SFT 2's, a stale model for its engines)."""
    import json

    from infir2_rl import pipeline
    from infir2_rl.data.synthetic import make_data

    data = make_data(tmp_path / "data", seed=0, num_sft=8, num_rl=32, num_test=8)  # one RL step of prompts
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    done = {"sft_stage1": run_dir / "s1", "sft_stage2": run_dir / "s2", "cast_fp8": run_dir / "cast" / "fp8"}
    if finished_rl1:
        done["rl_stage1"] = run_dir / "rl_stage1" / "final"
    (run_dir / "pipeline_state.json").write_text(
        json.dumps({"finished": {k: str(v) for k, v in done.items()}})
    )
    seen: dict[str, tuple[str, str | None]] = {}

    def fake_run_stage(cfg):  # type: ignore[no-untyped-def]
        seen[cfg.name] = (cfg.model.path, getattr(cfg.rollout, "fp8_checkpoint", None))
        return run_dir / cfg.name / "final"

    def relocate(cfg) -> None:  # type: ignore[no-untyped-def]
        cfg.data.train_path, cfg.data.test_path = str(data.rl_train), str(data.rl_test)

    monkeypatch.setattr(pipeline, "run_stage", fake_run_stage)
    pipeline.run_pipeline(pipeline.DEMO_PIPELINE, overrides=[f"run_dir={run_dir}"], adjust=relocate)
    if not finished_rl1:
        assert seen["rl_stage1"] == (str(done["sft_stage2"]), str(done["cast_fp8"]))
    assert seen["rl_stage2"] == (str(run_dir / "rl_stage1" / "final"), None)


def test_megatron_refuses_in_the_config_what_it_has_not_built() -> None:
    """Knobs the megatron backend cannot run fail at load with one sentence, before Ray or any actor."""
    from infir2_rl.config.stage import RlStageConfig

    with pytest.raises(ValueError, match="kl_coef=0.05 needs a reference model.*trainer.backend=torch"):
        RlStageConfig.model_validate({"trainer": {"backend": "megatron"}, "algorithm": {"kl_coef": 0.05}})
    with pytest.raises(ValueError, match="pack_sequences=true is implemented by the torch backend only"):
        RlStageConfig.model_validate({"trainer": {"backend": "megatron", "pack_sequences": True}})


def test_context_parallelism_is_refused_when_the_config_loads() -> None:
    """Not built in either megatron layer spec: refused at load, so a shipped config cannot ask for it."""
    msg = _err(
        {"kind": "sft", "trainer": {"backend": "megatron", "num_workers": 2, "context_parallel_size": 2}}
    )
    assert "trainer.context_parallel_size=2" in msg and "not built" in msg


def test_cuda_graphs_refuses_what_a_captured_graph_cannot_hold() -> None:
    """trainer.cuda_graphs: one line at load for megatron with TP or te, several workers, checkpointing; packed
    micro-batches and true_on_policy are graphed (their varlen offsets are a static buffer: layer_graphs.py)."""
    from infir2_rl.config.stage import RlStageConfig, SftStageConfig

    mega = {"cuda_graphs": True, "backend": "megatron"}
    assert (
        SftStageConfig.model_validate({"trainer": mega}).trainer.cuda_graphs is True
    )  # the local spec, TP 1
    for refused in ({"tensor_parallel_size": 2, "num_workers": 2}, {"megatron_spec": "te"}):
        with pytest.raises(ValueError, match="cuda_graphs=true with trainer.backend=megatron needs"):
            SftStageConfig.model_validate({"trainer": mega | refused})
    packed = SftStageConfig.model_validate({"trainer": {"cuda_graphs": True, "pack_sequences": True}})
    assert packed.trainer.cuda_graphs is True and packed.trainer.pack_sequences
    for sharded in (
        {"num_workers": 2, "data_parallel": "fsdp"},
        {"num_workers": 1, "fsdp_param_dtype": "bfloat16"},
        {"num_workers": 2, "backend": "megatron"},
    ):
        with pytest.raises(ValueError, match="cuda_graphs=true needs no FSDP"):
            SftStageConfig.model_validate({"trainer": {"cuda_graphs": True} | sharded})
    # replicas run each rank's one-GPU path, graphs included (as cuda_graphs auto does for them)
    for replicas in ("replicate", "auto"):
        two = {"cuda_graphs": True, "num_workers": 2, "data_parallel": replicas}
        assert SftStageConfig.model_validate({"trainer": two}).trainer.cuda_graphs is True
    with pytest.raises(ValueError, match="cuda_graphs=true needs model.gradient_checkpointing=false"):
        SftStageConfig.model_validate(
            {"trainer": {"cuda_graphs": True}, "model": {"gradient_checkpointing": True}}
        )
    # true_on_policy: the graphs replay its invariant walk's layers (trainers/torch/invariant_scoring.py)
    both = RlStageConfig.model_validate({"trainer": {"cuda_graphs": True}, "true_on_policy": True})
    assert both.trainer.cuda_graphs is True and both.true_on_policy
    assert SftStageConfig.model_validate({"trainer": {"cuda_graphs": True}}).trainer.cuda_graphs


def test_cuda_graphs_on_a_cpu_trainer_is_one_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from infir2_rl.config import ModelConfig, OptimizerConfig, TrainerConfig
    from infir2_rl.models.factory import init_model
    from infir2_rl.trainers.torch.trainer import TorchTrainer

    model = init_model(tmp_path / "model", preset="tiny")
    with pytest.raises(ValueError, match="cuda_graphs=true needs one CUDA device"):
        TorchTrainer(
            ModelConfig(path=str(model)), TrainerConfig(cuda_graphs=True), OptimizerConfig(),
            fp8=False, total_steps=1, device="cpu",
        )  # fmt: skip
    # The default, "auto", is eager wherever the graphs cannot run (here: a CPU), with no error.
    from infir2_rl.config.stage import SftStageConfig

    auto = TorchTrainer(
        ModelConfig(path=str(model)),
        TrainerConfig(),
        OptimizerConfig(),
        fp8=False,
        total_steps=1,
        device="cpu",
    )
    assert auto.layer_graphs is None
    assert (
        SftStageConfig.model_validate(
            {"trainer": {"pack_sequences": True, "num_workers": 2}, "model": {"gradient_checkpointing": True}}
        ).trainer.cuda_graphs
        == "auto"
    )
    with pytest.raises(ValueError, match="cuda_graphs"):
        SftStageConfig.model_validate({"trainer": {"cuda_graphs": "sometimes"}})


def test_model_and_data_paths_must_be_what_the_stage_reads(tmp_path: Path) -> None:
    """model.path (and rollout.fp8_checkpoint) must be an HF directory with config.json and weights, data
    paths files: checked with the paths, before Ray starts (a plain file or an empty directory failed later,
    inside a library, with exit code 1)."""
    from infir2_rl.config.stage import SftStageConfig, validate_paths

    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    afile, empty, config_only = tmp_path / "afile", tmp_path / "empty", tmp_path / "config_only"
    afile.write_text("x")
    empty.mkdir()
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")

    def check(model: Path, train: Path = data) -> None:
        validate_paths(
            SftStageConfig.model_validate(
                {"model": {"path": str(model)}, "data": {"train_path": str(train), "test_path": None}}
            )
        )

    with pytest.raises(ValueError, match=r"^model.path='.*afile': a file, not a directory"):
        check(afile)
    with pytest.raises(
        ValueError, match=r"no config.json and no weights \(\*.safetensors\) and no tokenizer"
    ):
        check(empty)
    with pytest.raises(ValueError, match=r"config_only': no weights \(\*.safetensors\) and no tokenizer"):
        check(config_only)
    import torch
    from safetensors.torch import save_file

    (config_only / "tokenizer.json").write_text("{}")
    (config_only / "model.safetensors").write_bytes(b"\xff" * 64)  # corrupt: its header does not read
    with pytest.raises(ValueError, match=r"^model.path: .*model.safetensors: unreadable safetensors shard"):
        check(config_only)
    save_file({"w": torch.zeros(2)}, str(config_only / "model.safetensors"))
    check(config_only)
    for text, what in [("{oops", "is not valid JSON"), ("[]", "is a JSON list, not an object")]:
        (config_only / "config.json").write_text(text)
        with pytest.raises(ValueError, match=f"^model.path: .*config.json {what}"):
            check(config_only)
    (config_only / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^data.train_path='.*empty': a directory"):
        check(config_only, empty)


def test_an_rl_stage_longer_than_the_models_positions_is_refused_before_ray(tmp_path: Path) -> None:
    """data.max_prompt_tokens + rollout.max_response_len above config.json's max_position_embeddings: one line
    at the path check (the GPU engine refused the whole rollout at its first long prompt; the CPU engine decoded
    past the model's positions)."""
    import torch
    from safetensors.torch import save_file

    from infir2_rl.config.stage import RlStageConfig, validate_paths

    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 1024}')
    (model / "tokenizer.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(model / "model.safetensors"))

    def check(prompt: int, response: int, backend: str = "native") -> None:
        validate_paths(
            RlStageConfig.model_validate(
                {
                    "model": {"path": str(model)},
                    "data": {"train_path": str(data), "test_path": None, "max_prompt_tokens": prompt},
                    "rollout": {"max_response_len": response, "backend": backend},
                    "precision": "bf16",
                    "weight_sync": {"self_check_layers": 0},
                }
            )
        )

    check(512, 512)
    with pytest.raises(
        ValueError,
        match=r"^data.max_prompt_tokens 512 \+ rollout.max_response_len 513 = 1025 exceeds the "
        r"max_position_embeddings 1024 of model.path='.*model': lower one of them$",
    ):
        check(512, 513)
    # SGLang's scheduler keeps two positions and wants the prompt 6 below the context (engines/sglang/protocol.py).
    check(512, 510, "sglang")
    with pytest.raises(ValueError, match=r"512 \+ rollout.max_response_len 511 does not fit SGLang's limits"):
        check(512, 511, "sglang")


def test_sglang_fp8_rollout_needs_an_fp8_checkpoint_to_start_from(tmp_path: Path) -> None:
    """SGLang started on a BF16 checkpoint builds BF16 linears; each push's FP8 bytes were then cast into them
    without their scales (SGLang only logs the scales it cannot place). The shipped 7B pipeline did this in its
    second RL stage, which had no cast before it."""
    from infir2_rl.config.stage import RlStageConfig, validate_paths
    from infir2_rl.pipeline import cast_before_each

    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    model = init_model(tmp_path / "model", "tiny", seed=0)

    def cfg(**rollout: Any) -> RlStageConfig:
        return RlStageConfig.model_validate(
            {
                "model": {"path": str(model)},
                "data": {"train_path": str(data), "test_path": None},
                "rollout": {"backend": "sglang", **rollout},
                "weight_sync": {"self_check_layers": 0},
            }
        )

    with pytest.raises(
        ValueError, match=r"^rollout.backend=sglang with precision=unified_fp8 starts its servers"
    ):
        validate_paths(cfg())
    validate_paths(cfg(), cast_before=True)  # a pipeline's cast sets rollout.fp8_checkpoint
    with pytest.raises(ValueError, match=r"fp8_checkpoint=.*no blockwise FP8 quantization_config"):
        validate_paths(cfg(fp8_checkpoint=str(model)))  # the BF16 model itself
    cast_checkpoint(model, tmp_path / "fp8")
    validate_paths(cfg(fp8_checkpoint=str(tmp_path / "fp8")))
    validate_paths(RlStageConfig.model_validate({**cfg().model_dump(), "precision": "bf16"}))
    sft, rl = object(), object()
    steps = [("s", sft), ("c", None), ("r1", rl), ("r2", rl), ("c2", None), ("r3", rl)]
    assert cast_before_each(steps) == {
        "s": False,
        "c": False,
        "r1": True,
        "r2": False,
        "c2": False,
        "r3": True,
    }  # type: ignore[arg-type]


def test_pipeline_errors_name_the_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing stage file or a stage's missing input path: the line names the pipeline stage it belongs to."""
    (tmp_path / "p.yaml").write_text("stages:\n  - {name: first, config: missing.yaml}\n")
    with pytest.raises(ConfigError, match=r"^stage 'first' \(missing.yaml\): config file .* does not exist"):
        load_pipeline_stages(load_pipeline_config(tmp_path / "p.yaml"), tmp_path / "p.yaml")
    (tmp_path / "s.yaml").write_text(f"kind: sft\ndata:\n  train_path: {tmp_path / 'no.jsonl'}\n")
    (tmp_path / "q.yaml").write_text("stages:\n  - {name: first, config: s.yaml}\n")
    assert main(["check-config", "--paths", str(tmp_path / "q.yaml"), "model.path=" + str(tmp_path)]) == 2
    assert "stage 'first': " in capsys.readouterr().err


def _config_classes() -> list[type]:
    """Every config class a user sets keys of: each section, both stage kinds, the pipeline file (every pydantic
    model the config modules define, so that a new one that forgets the shared base is checked as well)."""
    from pydantic import BaseModel

    from infir2_rl.algo import config as algo_config
    from infir2_rl.config import components, stage

    found = [
        c
        for module in (components, stage, algo_config)
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, BaseModel) and c.__module__ == module.__name__
    ]
    names = {c.__name__ for c in found}
    assert {"AlgorithmConfig", "OptimizerConfig", "RlStageConfig", "PipelineStage", "_StageBase"} <= names
    return found


def test_no_number_setting_takes_a_boolean() -> None:
    """Pydantic's lax mode read `lr: true` as 1.0 (and yes/on too, which YAML reads as true): every int/float
    field of every config class, optional ones and number items of lists included, refuses a boolean by name."""
    from pydantic import ValidationError

    checked = []
    for cls in _config_classes():
        for name, field in cls.model_fields.items():
            text = re.sub(
                r"Literal\[[^\]]*\]", "", str(field.annotation)
            )  # `Literal['float32']` is no number
            if re.search(r"\bbool\b", text) or not re.search(r"\b(int|float)\b", text):
                continue
            value: object = [0.5, True] if text.startswith(("tuple", "list")) else True
            with pytest.raises(ValidationError) as e:
                cls.model_validate({name: value})
            first = e.value.errors()[0]
            key = f"{name}[1]" if isinstance(value, list) else name
            assert first["type"] == "bool_not_number" and first["msg"].startswith(
                f"{key}=true: must be a number"
            ), (cls.__name__, name, first)
            checked.append(f"{cls.__name__}.{name}")
    assert len(checked) > 40 and "OptimizerConfig.betas" in checked and "AlgorithmConfig.kl_coef" in checked
    assert (
        "TrainerConfig.max_tokens_per_gpu" in checked and "_StageBase.seed" in checked
    )  # int | None, top level


def test_a_boolean_for_a_number_is_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = "must be a number, not a boolean (YAML reads true/false, yes/no and on/off as booleans)"
    assert _err({"optimizer": {"lr": True}}) == f"optimizer.lr=true: {bad}; write the number"
    assert _err({"kind": "rl", "algorithm": {"kl_coef": False}}).startswith(f"algorithm.kl_coef=false: {bad}")
    assert _err({"optimizer": {"betas": [0.9, True]}}).startswith(f"optimizer.betas[1]=true: {bad}")
    assert _err({"trainer": {"max_tokens_per_gpu": True}}).startswith("trainer.max_tokens_per_gpu=true: must")
    assert _err({"seed": True}).startswith(f"seed=true: {bad}")
    ok = tmp_path / "ok.yaml"
    ok.write_text("kind: rl\n")
    for override, key in (
        ("optimizer.lr=true", "optimizer.lr=true"),
        ("rollout.top_k=on", "rollout.top_k=true"),
        ("data.num_eval_examples=no", "data.num_eval_examples=false"),
        ("weight_sync.timeout_s=yes", "weight_sync.timeout_s=true"),
    ):
        assert main(["check-config", str(ok), override]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"infir2-rl: config error: {key}: {bad}"), err
    (tmp_path / "lr.yaml").write_text("kind: sft\noptimizer:\n  lr: yes\n")
    with pytest.raises(ConfigError, match=r"^optimizer\.lr=true: must be a number"):
        load_stage_config(tmp_path / "lr.yaml")
    (tmp_path / "p.yaml").write_text(
        "stages:\n  - {name: first, config: ok.yaml, overrides: ['seed=true']}\n"
    )
    with pytest.raises(ConfigError, match=r"^stage 'first' \(ok.yaml\): seed=true: must be a number"):
        load_pipeline_stages(load_pipeline_config(tmp_path / "p.yaml"), tmp_path / "p.yaml")
    # Assignments are checked as well.
    cfg = parse_stage_config({"kind": "rl"})
    with pytest.raises(ValueError, match=r"lr=true: must be a number"):
        cfg.optimizer.lr = True  # type: ignore[assignment]


def test_numbers_and_real_booleans_still_load(tmp_path: Path) -> None:
    """The boolean rule leaves alone what is right: an int for a float, a None, true for a bool | "auto" field."""
    cfg = parse_stage_config(
        {
            "kind": "rl",
            "optimizer": {"lr": 1, "min_lr": 0, "betas": [0, 0.5]},
            "trainer": {
                "max_tokens_per_gpu": None,
                "cuda_graphs": False,
                "pack_sequences": True,
                "backend": "torch",
            },
            "placement": {"use_gpu": False},
            "model": {"gradient_checkpointing": True},
            "algorithm": {"tis": False, "kl_coef": 0},
            "true_on_policy": False,
        }
    )
    assert (
        cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float) and cfg.optimizer.betas == (0.0, 0.5)
    )
    assert cfg.trainer.pack_sequences is True and cfg.trainer.cuda_graphs is False
    assert cfg.placement.use_gpu == "no" and cfg.model.gradient_checkpointing is True
    assert cfg.algorithm.tis is False and cfg.kind == "rl"
    cfg.optimizer.lr = 3  # an assignment of a number still validates
    assert cfg.optimizer.lr == 3.0
