"""Runs stages in order and hands each stage's final checkpoint to the next.

    SFT 1 -> SFT 2 -> FP8 cast -> RL (short responses, T=1.0) -> RL (twice as long, T=1.1)

Every stage writes RUN_DIR/STAGE/final (an HF directory). The pipeline records finished stages in
RUN_DIR/pipeline_state.json, so a stopped pipeline skips what is done and the interrupted stage resumes
from its own latest checkpoint (stages resume by themselves when `checkpoint.resume` is true).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infir2_rl.config import (
    PipelineConfig,
    RlStageConfig,
    SftStageConfig,
    apply_overrides,
    load_pipeline_config,
    load_pipeline_stages,
    load_stage_config,
    validate_paths,
)
from infir2_rl.config.loader import ConfigError, parse_stage_config
from infir2_rl.errors import BadInput
from infir2_rl.stages.guards import check_reward, check_stage_data

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_PIPELINE = REPO_ROOT / "configs" / "demo" / "pipeline_demo.yaml"


def run_stage(cfg: SftStageConfig | RlStageConfig) -> Path:
    """Run one stage to completion; returns its final HF checkpoint directory. The stage starts Ray itself,
    after checking its input, so that bad input fails in seconds."""
    if cfg.kind == "sft":
        from infir2_rl.stages.sft import run_sft_stage

        return Path(run_sft_stage(cfg).final_checkpoint)
    from infir2_rl.stages.rl import run_rl_stage

    return Path(run_rl_stage(cfg).final_checkpoint)


def run_stage_file(path: str | Path, overrides: Sequence[str] = ()) -> Path:
    cfg = load_stage_config(path, overrides)
    validate_paths(cfg)
    check_stage_data(cfg)
    return run_stage(cfg)  # an RL stage loads its reward before Ray starts (stages/rl.py)


@dataclass
class PipelineState:
    """Which stages finished, and the checkpoint each one handed on."""

    path: Path
    finished: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> PipelineState:
        """The state in ``path`` (none: nothing finished); one line naming the file when it cannot be read."""
        if not path.exists():
            return cls(path)
        try:
            finished = json.loads(path.read_text())["finished"]
            if not isinstance(finished, dict) or not all(isinstance(v, str) for v in finished.values()):
                raise TypeError("'finished' is not a map of stage name to checkpoint path")
        except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
            raise BadInput(
                f"{path}: not a pipeline state this command wrote ({type(exc).__name__}: {exc}); restore it, or"
                " delete it to run every stage again (the stages' own checkpoints still resume them)"
            ) from exc
        return cls(path, dict(finished))

    def mark(self, name: str, checkpoint: Path) -> None:
        self.finished[name] = str(checkpoint)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"finished": self.finished}, indent=2))
        tmp.replace(self.path)  # atomic: a crash leaves the old or the new state, never half of one


def run_pipeline(
    path: str | Path,
    overrides: Sequence[str] = (),
    stage_overrides: Sequence[str] = (),
    adjust: Callable[[SftStageConfig | RlStageConfig], None] | None = None,
    scoped_overrides: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Path]:
    """Run a pipeline YAML. `stage_overrides` apply to every stage (e.g. `seed=1`), `scoped_overrides` to
    the stages of one kind or one stage name (``{"rl": ["precision=bf16"]}``); `adjust` edits each resolved stage
    config in place (the demo uses it to point data paths at the assets it built)."""
    pipeline = load_pipeline_config(path, overrides)
    resolved = resolve_stages(path, pipeline, stage_overrides, scoped_overrides, adjust)
    run_dir = Path(pipeline.run_dir)
    state = PipelineState.load(run_dir / "pipeline_state.json")
    # Check the inputs of every stage still to run before the first one starts (a typo in stage 4 should
    # not cost stages 1-3); only the first stage to run reads its own model.path, later ones get a checkpoint.
    todo = [(name, cfg) for name, cfg in resolved if name not in state.finished]
    for name, (what, used) in describe_casts(resolved).items():
        if not used and name not in state.finished:
            log.warning("stage %s: %s", name, what)
    casts_before = cast_before_each(resolved)
    for i, (name, cfg) in enumerate(todo):
        if cfg is not None:
            try:
                first = i == 0 and len(todo) == len(resolved)
                validate_paths(cfg, check_model=first, cast_before=casts_before[name])
                check_stage_data(cfg)  # one batch of usable rows, before Ray starts
                check_reward(cfg)  # an RL stage's reward imports
            except ValueError as e:
                raise ValueError(f"stage {name!r}: {e}") from e
    run_dir.mkdir(parents=True, exist_ok=True)
    outputs: dict[str, Path] = {}
    previous: Path | None = None
    fp8_dir: Path | None = None
    for name, cfg in resolved:
        if name in state.finished:
            done = Path(state.finished[name])
            if cfg is None:
                fp8_dir = done  # a cast hands its output to the engines, not to the next trainer
            else:
                previous, fp8_dir = done, None  # the cast was for this stage only (as when it runs, below)
            log.info("stage %s already finished -> %s (skipping)", name, done)
            outputs[name] = done
            continue
        t0 = time.perf_counter()
        if cfg is None:
            assert previous is not None  # validated: a cast is never first
            fp8_dir = _cast(previous, run_dir / name / "fp8")
            out = fp8_dir
        else:
            if previous is not None:
                cfg.model.path = str(previous)
            if isinstance(cfg, RlStageConfig) and fp8_dir is not None and cfg.rollout_fp8:
                cfg.rollout.fp8_checkpoint = str(fp8_dir)  # engines start from the cast checkpoint
            fp8_dir = None  # a cast is of the previous stage's output: a later stage starts elsewhere
            log.info("stage %s (%s) starts from %s", name, cfg.kind, cfg.model.path)
            out = run_stage(cfg)
            previous = out
        state.mark(name, out)
        outputs[name] = out
        log.info("stage %s finished in %.1f s -> %s", name, time.perf_counter() - t0, out)
    return outputs


def cast_before_each(
    resolved: Sequence[tuple[str, SftStageConfig | RlStageConfig | None]],
) -> dict[str, bool]:
    """Whether a cast_fp8 step comes right before each stage (it sets an FP8 RL stage's rollout.fp8_checkpoint)."""
    return {name: i > 0 and resolved[i - 1][1] is None for i, (name, _) in enumerate(resolved)}


def describe_casts(
    resolved: Sequence[tuple[str, SftStageConfig | RlStageConfig | None]],
) -> dict[str, tuple[str, bool]]:
    """What each cast stage of a resolved pipeline does, by name: (a line saying which checkpoint it casts, the
    last training stage's before it, since a cast never casts a cast, and who reads the result; whether anyone
    does). An RL stage with FP8 rollout right after it starts its engines from it; the last stage's cast is the
    pipeline's FP8 output; anything else never reads it."""
    out: dict[str, tuple[str, bool]] = {}
    trained: str | None = None
    for i, (name, cfg) in enumerate(resolved):
        if cfg is not None:
            trained = name
            continue
        nxt = resolved[i + 1] if i + 1 < len(resolved) else None
        used = nxt is None or (isinstance(nxt[1], RlStageConfig) and nxt[1].rollout_fp8)
        if nxt is None:
            use = "the pipeline's FP8 output"
        elif used:
            use = f"stage {nxt[0]!r} starts its rollout engines from it"
        else:
            what = "a cast" if nxt[1] is None else f"an {nxt[1].kind.upper()} stage"
            what += " without FP8 rollout" if isinstance(nxt[1], RlStageConfig) else ""
            use = f"UNUSED: the next stage, {nxt[0]!r}, is {what} and never reads it"
        out[name] = (f"cast the checkpoint of {trained!r} to blockwise FP8; {use}", used)
    return out


def resolve_stages(
    path: str | Path,
    pipeline: PipelineConfig,
    stage_overrides: Sequence[str] = (),
    scoped_overrides: Mapping[str, Sequence[str]] | None = None,
    adjust: Callable[[SftStageConfig | RlStageConfig], None] | None = None,
) -> list[tuple[str, SftStageConfig | RlStageConfig | None]]:
    """Each stage of a loaded pipeline as (name, config with overrides applied); None for a cast.

    `scoped_overrides` is keyed by stage kind (``sft``, ``rl``) or stage name; a kind's come before a name's,
    so the more specific wins."""
    stages = load_pipeline_stages(pipeline, path)
    scoped = scoped_overrides or {}
    unknown = set(scoped) - {"sft", "rl"} - {name for name, cfg in stages if cfg is not None}
    if unknown:
        trainable = ", ".join(name for name, cfg in stages if cfg is not None)
        raise ConfigError(
            f"override scope(s) {', '.join(sorted(unknown))}: use a stage kind (sft, rl) or a stage name of"
            f" {path} ({trainable})"
        )
    resolved: list[tuple[str, SftStageConfig | RlStageConfig | None]] = []
    for name, cfg in stages:
        extra = [
            *stage_overrides,
            *((*scoped.get(cfg.kind, ()), *scoped.get(name, ())) if cfg is not None else ()),
        ]
        if cfg is not None and extra:
            # Only what the YAML set, so that the overrides meet the YAML's values and not defaults.
            data: dict[str, Any] = cfg.model_dump(mode="json", exclude_unset=True)
            try:
                cfg = parse_stage_config(apply_overrides(data, extra))
            except ConfigError as e:
                # the unscoped override the error names, if one does
                bad = next((o for o in stage_overrides if o.split("=")[0].split(".")[0] in str(e)), None)
                hint = (
                    " (an override without a prefix goes to every stage: scope it to a kind or a stage name, e.g."
                    f" {'rl' if cfg.kind == 'sft' else 'sft'}:{bad})"
                    if bad
                    else ""
                )
                raise ConfigError(f"stage {name!r}: {e}{hint}") from None
        if cfg is not None and adjust is not None:
            adjust(cfg)
        resolved.append((name, cfg))
    return resolved


def _cast(src: Path, dst: Path) -> Path:
    from infir2_rl.fp8.checkpoint import cast_checkpoint

    if dst.exists():  # an earlier attempt finished the cast but died before recording it
        import shutil

        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    report = cast_checkpoint(src, dst)
    log.info("cast %s -> %s: %s", src, dst, report)
    return dst


PRECISIONS = ("unified_fp8", "bf16_train_fp8_rollout", "bf16")


def precision_overrides(precision: str) -> dict[str, list[str]]:
    """Per-kind overrides that run a whole pipeline in one precision setup (an RL stage's ``precision``):
    SFT trains in FP8 (``precision=fp8``) only for ``unified_fp8``; RL stages take it as their precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {', '.join(PRECISIONS)}")
    return {
        "sft": [f"precision={'fp8' if precision == 'unified_fp8' else 'bf16'}"],
        "rl": [f"precision={precision}"],
    }


def split_scoped_overrides(overrides: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Split scoped overrides from plain ones (every stage): ``sft:a.b=1`` / ``rl:a.b=1`` reach the stages
    of one kind, ``rl_stage1:a.b=1`` the stage of that name (checked against the pipeline in
    `resolve_stages`). A scope is the text before the first ``:`` when it is a bare name (no ``=`` or ``.``)."""
    common: list[str] = []
    by_scope: dict[str, list[str]] = {}
    for item in overrides:
        scope, sep, rest = item.partition(":")
        if sep and scope.isidentifier():
            by_scope.setdefault(scope, []).append(rest)
        else:
            common.append(item)
    return common, by_scope


# Overrides of a pipeline file's own fields; every other key on the command line is for its stages.
PIPELINE_KEYS = ("name", "run_dir")


def split_pipeline_overrides(
    overrides: Sequence[str],
) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """Command-line overrides of a pipeline file: (the pipeline's own: ``run_dir=``, ``name=``; every stage's;
    scoped ones as in `split_scoped_overrides`), so ``infir2-rl pipeline FILE optimizer.lr=1e-6
    rl:rollout.num_steps=3`` works as it does for the demo."""
    common, scoped = split_scoped_overrides(overrides)
    own = [o for o in common if o.partition("=")[0].strip() in PIPELINE_KEYS]
    return own, [o for o in common if o not in own], scoped


def run_demo(
    out: Path,
    seed: int = 0,
    overrides: Sequence[str] = (),
    *,
    pipeline: Path = DEMO_PIPELINE,
    preset: str = "tiny",
    precision: str | None = None,
) -> dict[str, Path]:
    """Build the model (random weights of `preset`) and data if absent, run the demo pipeline, print the
    summary, draw the report. `precision` (an RL stage's precision value) overrides the `precision` of
    every stage (SFT: fp8 only for unified_fp8); None keeps them. The GPU comparison runs this with `configs/gpu/pipeline_100m.yaml`."""
    from infir2_rl.data.synthetic import make_data
    from infir2_rl.metrics.report import make_report, print_summary, summarize
    from infir2_rl.models.factory import init_model

    if not Path(pipeline).exists():
        fix = (
            "run the demo from a source checkout installed with `pip install -e .`"
            if Path(pipeline) == DEMO_PIPELINE
            else "pass the path of a pipeline YAML to --pipeline"
        )
        raise ValueError(f"{pipeline} not found: {fix}")
    common, scoped_overrides = split_scoped_overrides(overrides)
    for kind, items in (precision_overrides(precision) if precision is not None else {}).items():
        scoped_overrides[kind] = [*items, *scoped_overrides.get(kind, [])]  # explicit ones win
    assets = out / "assets"
    model_dir, data_dir = assets / f"{preset}-model", assets / "data"
    if not (model_dir / "config.json").exists():
        init_model(model_dir, preset=preset, seed=seed)
    if not (data_dir / "rl_test.jsonl").exists():
        make_data(data_dir, seed=seed)
    t0 = time.perf_counter()
    outputs = run_pipeline(
        pipeline,
        overrides=[f"run_dir={out}"],
        stage_overrides=[f"seed={seed}", f"model.path={model_dir}", *common],
        adjust=lambda cfg: _relocate_data(cfg, data_dir),
        scoped_overrides=scoped_overrides,
    )
    log.info("demo pipeline finished in %.1f s", time.perf_counter() - t0)
    print_summary(summarize(out))
    for png in make_report(out):
        log.info("wrote %s", png)
    return outputs


def _relocate_data(cfg: SftStageConfig | RlStageConfig, data_dir: Path) -> None:
    """Keep each demo stage's data file names, but read them from the data directory the demo built."""
    cfg.data.train_path = str(data_dir / Path(cfg.data.train_path).name)
    if cfg.data.test_path is not None:
        cfg.data.test_path = str(data_dir / Path(cfg.data.test_path).name)
