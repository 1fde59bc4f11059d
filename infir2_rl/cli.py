"""The `infir2-rl` command. Thin: parses arguments and calls the pipeline, stages and tools.

Exit codes (infir2_rl/errors.py): 0 success, 1 a run that failed, 2 bad input (config, paths, data,
arguments), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM). Every failure ends with one line naming the cause and the remedy; `-v` (anywhere
on the line) also prints the traceback.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

from infir2_rl.config import (
    ConfigError,
    dump_config,
    is_pipeline_file,
    load_pipeline_config,
    load_stage_config,
)
from infir2_rl.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, BadInput, describe

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Local Ray workers inherit this environment: keep per-actor weight-loading bars out of the job log.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

VERBOSE_FLAGS = ("-v", "--verbose")
VERBOSE_HELP = "debug logging, and the traceback of an error (anywhere on the command line)"
# models/factory.PRESETS' names, written out so that --help does not import transformers (a test keeps them equal).
PRESET_NAMES = ("tiny", "small", "100m", "qwen2.5-1.5b-shape", "qwen2.5-7b-shape")
CONFIG_HELP = "a stage YAML (kind: sft or rl) or a pipeline YAML (a list of stages)"
SEED_HELP = "seed of everything random here (an integer in [0, 2**63 - 1]; default 0)"


def _check_config(args: argparse.Namespace) -> int:
    from infir2_rl.config import validate_paths
    from infir2_rl.pipeline import cast_before_each, describe_casts, resolve_stages, split_pipeline_overrides
    from infir2_rl.stages.guards import check_reward

    if is_pipeline_file(args.config):
        own, for_stages, scoped = split_pipeline_overrides(args.overrides)
        pipeline = load_pipeline_config(args.config, own)
        print(dump_config(pipeline), end="")
        resolved = resolve_stages(args.config, pipeline, for_stages, scoped)
        casts, cast_before = describe_casts(resolved), cast_before_each(resolved)
        for i, (name, stage) in enumerate(resolved):
            if stage is None:
                print(f"# --- {name}: {casts[name][0]}")
                continue
            print(f"# --- {name} ---")
            print(dump_config(stage), end="")
            if args.paths:
                try:
                    validate_paths(stage, check_model=i == 0, cast_before=cast_before[name])
                    check_reward(stage)
                except ValueError as e:
                    raise ValueError(f"stage {name!r}: {e}") from e
    else:
        stage = load_stage_config(args.config, args.overrides)
        print(dump_config(stage), end="")
        if args.paths:
            validate_paths(stage)
            check_reward(stage)
    print(f"# {args.config}: OK", file=sys.stderr)
    return 0


def _run(args: argparse.Namespace) -> int:
    from infir2_rl.pipeline import run_pipeline, run_stage_file, split_pipeline_overrides

    if is_pipeline_file(args.config):
        own, for_stages, scoped = split_pipeline_overrides(args.overrides)
        run_pipeline(args.config, own, stage_overrides=for_stages, scoped_overrides=scoped)
    else:
        run_stage_file(args.config, args.overrides)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from infir2_rl.pipeline import DEMO_PIPELINE, run_demo

    pipeline = Path(args.pipeline) if args.pipeline else DEMO_PIPELINE
    run_demo(
        out=Path(args.out),
        seed=args.seed,
        overrides=args.overrides,
        pipeline=pipeline,
        preset=args.preset,
        precision=args.precision,
    )
    return 0


def _init_model(args: argparse.Namespace) -> int:
    from infir2_rl.models.factory import init_model

    path = init_model(args.out, preset=args.preset, seed=args.seed)
    print(f"wrote {args.preset} model to {path}")
    return 0


def _make_data(args: argparse.Namespace) -> int:
    from infir2_rl.data.synthetic import DATA_FILES, make_data

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {args.out!r} is a file: give a directory (it is created if absent)")
    existing = [f for f in DATA_FILES if (out / f).exists()]
    if existing:
        raise BadInput(
            f"--out {args.out!r} already holds {', '.join(existing)}: make-data does not overwrite; remove"
            " them or give another directory"
        )
    kwargs = {k: v for k, v in (("num_sft", args.num_sft), ("num_rl", args.num_rl)) if v is not None}
    paths = make_data(out, seed=args.seed, **kwargs)
    print(f"wrote synthetic math data to {args.out}:")
    for name, path in vars(paths).items():
        print(f"  {name}: {path}")
    return 0


def _cast_fp8(args: argparse.Namespace) -> int:
    from infir2_rl.fp8.cli import cast_fp8_main

    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    return cast_fp8_main(rest, raise_errors=True)


def _report(args: argparse.Namespace) -> int:
    from infir2_rl.metrics.report import make_comparison, make_report, print_summary, summarize

    if args.watch:
        from infir2_rl.metrics.watch import watch

        if len(args.run_dir) > 1:
            raise BadInput("--watch follows one run directory; give one")
        if not Path(args.run_dir[0]).is_dir():
            raise BadInput(
                f"{args.run_dir[0]!r} is not a directory: give the run directory of a stage or pipeline"
            )
        watch(args.run_dir[0], interval_s=args.interval)
        return 0
    if len(args.run_dir) > 1 and not args.compare_out:
        raise BadInput("several run directories: give --compare-out DIR for the comparison plots")
    if args.compare_out:  # refused before any run's PNGs are drawn
        compare = Path(args.compare_out).absolute()
        taken = next(p for p in (compare, *compare.parents) if p.exists())
        if not taken.is_dir():
            raise BadInput(f"--compare-out {args.compare_out!r}: {taken} is a file; give a directory")
    summaries = [summarize(run_dir) for run_dir in args.run_dir]  # every directory checked before drawing
    paths = []
    for run_dir, summary in zip(args.run_dir, summaries, strict=True):
        paths += make_report(run_dir)
        print_summary(summary, title=f"Run summary: {run_dir}")
    if len(args.run_dir) > 1:
        paths += make_comparison([Path(d) for d in args.run_dir], Path(args.compare_out))
    for p in paths:
        print(f"wrote {p}")
    return 0


def _positive_seconds(text: str) -> float:
    """argparse type for a number of seconds > 0 (its error names the option and the value)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _seed(text: str) -> int:
    """argparse type for a seed: an integer in [0, 2**63 - 1] (torch.manual_seed's range)."""
    from infir2_rl.config.stage import MAX_SEED

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer seed in [0, 2**63 - 1]")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infir2-rl", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    # Every subcommand takes -v too (`infir2-rl demo -v`, listed in its --help); SUPPRESS: a subcommand that
    # is not given it leaves the top-level value (`infir2-rl -v demo`) as it is.
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, parents=[verbose])
        p.set_defaults(fn=fn)
        return p

    p = add(
        "demo",
        _demo,
        "build the tiny model and data if absent, then run the InfiR2 pipeline at CPU scale: SFT 1 -> SFT 2 -> FP8"
        " cast -> RL 1 (64-token responses, T=1.0) -> RL 2 (128 tokens, T=1.1)",
    )
    p.add_argument("--out", default="runs/demo", help="run directory (assets/ and one folder per stage)")
    p.add_argument("--seed", type=_seed, default=0, help=SEED_HELP)
    p.add_argument(
        "--pipeline", default=None, help="pipeline YAML (default: configs/demo/pipeline_demo.yaml)"
    )
    p.add_argument(
        "--preset", default="tiny", help="model preset built when OUT/assets has none (tiny, 100m, ...)"
    )
    p.add_argument(
        "--precision",
        choices=["unified_fp8", "bf16_train_fp8_rollout", "bf16"],
        default=None,
        help="run every stage in this precision setup (SFT: precision=fp8 only for unified_fp8; RL: its precision);"
        " default: as the configs say",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides applied to every stage (optimizer.lr=1e-4), to the stages of one kind with a"
        " kind prefix (sft:trainer.max_steps=50, rl:rollout.num_steps=3), or to one stage with its name as"
        " prefix (rl_stage1:rollout.num_steps=80)",
    )

    for name, help in (
        ("run", "run a stage or pipeline YAML on local Ray (or the cluster in RAY_ADDRESS)"),
        ("pipeline", "run a pipeline YAML (same as `run` on a pipeline file)"),
    ):
        p = add(name, _run, help)
        p.add_argument("config", help=CONFIG_HELP)
        p.add_argument(
            "overrides",
            nargs="*",
            default=[],
            help="dotted overrides, e.g. optimizer.lr=1e-6; for a pipeline file also scoped to a stage kind or"
            " name (rl:rollout.num_steps=3), as for demo",
        )

    p = add("check-config", _check_config, "validate a stage or pipeline YAML and print the resolved config")
    p.add_argument("config", help=CONFIG_HELP)
    p.add_argument(
        "overrides", nargs="*", default=[], help="dotted overrides, as for run (optimizer.lr=1e-6, rl:seed=1)"
    )
    p.add_argument(
        "--paths",
        action="store_true",
        help="also require every input path to exist and each RL stage's rollout.reward to import",
    )

    p = add("init-model", _init_model, "write a Qwen2-architecture HF model + tokenizer built locally")
    p.add_argument("--out", required=True, help="new directory for the HF model (must be empty or absent)")
    p.add_argument("--preset", default="tiny", help=f"model size: {', '.join(PRESET_NAMES)} (default tiny)")
    p.add_argument("--seed", type=_seed, default=0, help=SEED_HELP)

    p = add("make-data", _make_data, "write deterministic synthetic math SFT and RL data (jsonl)")
    p.add_argument("--out", required=True, help="directory for the four jsonl files (created if absent)")
    p.add_argument("--seed", type=_seed, default=0, help=SEED_HELP)
    p.add_argument(
        "--num-sft",
        type=int,
        default=None,
        help="SFT training rows (default 20000; the test split is 500 rows)",
    )
    p.add_argument(
        "--num-rl",
        type=int,
        default=None,
        help="RL training prompts (default 4000; the test split is 500 rows)",
    )

    p = add("cast-fp8", _cast_fp8, "cast a BF16 HF checkpoint to blockwise FP8 (weight_scale_inv format)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="--input HF_DIR --output FP8_DIR [--pow2-scales]")

    p = add("report", _report, "plot a run's curves (PNG) and print its summary table; several runs: compare")
    p.add_argument("run_dir", nargs="+", help="run directories (a pipeline or one stage each)")
    p.add_argument(
        "--compare-out", default=None, help="with several runs: folder for the compare_*.png overlays"
    )
    p.add_argument(
        "--watch",
        action="store_true",
        help="live view of a running run: progress bar and ETA per stage, summary, PNGs redrawn (Ctrl-C ends)",
    )
    p.add_argument(
        "--interval", type=_positive_seconds, default=15.0, help="with --watch: seconds between refreshes"
    )
    return parser


def exit_within(code: int, seconds: float) -> None:
    """End the process with ``code`` after ``seconds`` even if shutting down hangs (a non-daemon thread, an
    atexit handler such as Ray's teardown), saying so in one line. Armed after Ctrl-C or SIGTERM: CI once saw
    a SIGTERM'd stage print its line and then not exit within 120 s (cause not found; it did not reproduce
    in 14 tries, with and without CPU load). A scheduler's SIGTERM must end the command."""

    def force() -> None:
        print(
            f"infir2-rl: shutdown did not finish within {seconds:g} s; exiting without it",
            file=sys.stderr,
            flush=True,
        )
        os._exit(code)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # -v anywhere: taken out before parsing and given to the top-level parser. argparse alone cannot take it
    # between a subcommand's positionals (`run cfg.yaml -v optimizer.lr=1` would leave the override
    # unrecognized), and cast-fp8 hands the rest of the line to its own parser. No argument of any command is
    # the bare word -v (an override has an `=`).
    verbose = [a for a in argv if a in VERBOSE_FLAGS][:1]
    argv = [*verbose, *(a for a in argv if a not in VERBOSE_FLAGS)]
    if argv[len(verbose) : len(verbose) + 1] == ["cast-fp8"]:
        # its own parser (infir2_rl/fp8/cli.py), so its --help lists its flags
        argv = [*verbose, "cast-fp8", "--", *argv[len(verbose) + 1 :]]
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return int(args.fn(args))
    except (Exception, KeyboardInterrupt) as exc:  # every failure ends in one line and a documented code
        code, line = describe(exc)
        if args.verbose:
            traceback.print_exc()
        kind = "config error" if isinstance(exc, ConfigError) else "error"
        hint = "" if args.verbose or code == 130 else " (run with -v for the traceback)"
        print(f"infir2-rl: {kind}: {line}{hint}", file=sys.stderr)
        if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
            exit_within(code, exit_grace_s())
        return code


def exit_grace_s() -> float:
    """``INFIR2_EXIT_GRACE_S`` (docs/reliability.md), read while a run is already ending: a bad value is said
    in one line and the default taken, so Ctrl-C or SIGTERM still end in their one line and exit code."""
    raw = os.environ.get("INFIR2_EXIT_GRACE_S", "60")
    try:
        grace = float(raw)
    except ValueError:
        grace = -1.0
    if not grace >= 0:  # also NaN
        print(
            f"infir2-rl: INFIR2_EXIT_GRACE_S={raw!r} is not a number of seconds >= 0; using 60",
            file=sys.stderr,
        )
        return 60.0
    return grace


if __name__ == "__main__":
    sys.exit(main())
