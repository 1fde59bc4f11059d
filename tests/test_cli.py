"""The `infir2-rl` command on bad input: one line, exit 2, nothing overwritten (found by a review as a new user)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infir2_rl.cli import main
from infir2_rl.data.synthetic import DATA_FILES

REPO = Path(__file__).resolve().parents[1]


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().err


def test_make_data_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "data"
    out.mkdir()
    (out / "sft_train.jsonl").write_text("mine\n")
    assert main(["make-data", "--out", str(out), "--num-sft", "4", "--num-rl", "4"]) == 2
    assert "already holds sft_train.jsonl" in _err(capsys)
    assert (out / "sft_train.jsonl").read_text() == "mine\n" and not (out / "rl_train.jsonl").exists()
    assert main(["make-data", "--out", str(out / "sft_train.jsonl")]) == 2
    assert "is a file" in _err(capsys)
    fresh = tmp_path / "fresh"
    assert main(["make-data", "--out", str(fresh), "--num-sft", "4", "--num-rl", "4"]) == 0
    assert all((fresh / f).is_file() for f in DATA_FILES)


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_flag_works_with_cast_fp8(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cast = ["cast-fp8", "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "out")]
    argv = ["-v", *cast] if where == "before" else [*cast, "-v"]
    assert main(argv) == 2
    err = _err(capsys)
    assert "unrecognized arguments" not in err and "no such directory" in err


def test_pipeline_file_takes_stage_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    pipeline = str(REPO / "configs" / "pipeline_7b.yaml")
    argv = ["check-config", pipeline, "optimizer.lr=3e-5", "rl:rollout.num_steps=2", "run_dir=/tmp/r7b"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "run_dir: /tmp/r7b" in out and "lr: 3.0e-05" in out and "num_steps: 2" in out
    assert main(["check-config", pipeline, "rl_stage9:seed=1"]) == 2
    assert "rl_stage9" in _err(capsys)
    demo = str(REPO / "configs" / "demo" / "pipeline_demo.yaml")  # an RL section without the rl: scope
    assert main(["check-config", demo, "seed=1", "rollout.num_steps=3"]) == 2
    assert "scope it to a kind or a stage name, e.g. rl:rollout.num_steps=3" in _err(capsys)


def test_yaml_errors_name_the_line_and_empty_files_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: sft\nmodel:\n  path: x\n   dtype: [bfloat16\n")
    assert main(["check-config", str(bad)]) == 2
    assert "not valid YAML at line 4, column" in _err(capsys)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert main(["check-config", str(empty)]) == 2
    assert "is empty" in _err(capsys)
    assert main(["check-config", str(tmp_path)]) == 2
    assert "is a directory" in _err(capsys)


def test_placeholder_paths_are_named_as_placeholders(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--paths", str(REPO / "configs" / "sft_stage1.yaml")]) == 2
    assert "placeholder" in _err(capsys)


def test_report_refuses_bad_input_with_exit_2_before_drawing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "time": 0.0, "train/loss": 1.0}\n')
    assert main(["report", str(run), str(tmp_path / "nope")]) == 2  # no --compare-out
    assert "--compare-out" in _err(capsys)
    assert main(["report", str(run), str(tmp_path / "nope"), "--compare-out", str(tmp_path / "cmp")]) == 2
    assert not (run / "report").exists()  # nothing drawn for the good one first
    assert main(["report", str(tmp_path / "nope"), "--watch", "--interval", "0.1"]) == 2  # never waits
    assert "not a directory" in _err(capsys)


@pytest.mark.parametrize("to", ["process", "group"])
def test_sigterm_ends_a_stage_with_one_line_and_exit_143(to: str, tmp_path: Path) -> None:
    """`kill`, `timeout` and schedulers send SIGTERM: it once ended a stage with Ray's stack dump (exit 134).
    ``group``: sent to the command's whole process group, as `timeout` and `kill -TERM -PGID` do, it also ends
    the local Ray's GCS and raylet; the teardown then waited 60 s on the dead GCS and Ray aborted with exit 1."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from infir2_rl.data.synthetic import make_data
    from infir2_rl.models.factory import init_model

    model = init_model(tmp_path / "model", preset="tiny", num_hidden_layers=1)
    data = make_data(tmp_path / "data", num_sft=64, num_rl=4, num_test=4)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "infir2_rl.cli", "run", str(REPO / "configs" / "demo" / "sft_stage1.yaml")]
    argv += [f"model.path={model}", f"data.train_path={data.sft_train}", "data.test_path=null"]
    argv += [
        f"run_dir={run_dir}",
        "trainer.epochs=100000",
        "trainer.max_steps=100000",
        "metrics.progress_bar=false",
    ]
    env = {**os.environ, "INFIR2_RAY_DASHBOARD": "0"}
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env, start_new_session=to == "group")
    assert proc.stderr is not None
    lines = []
    deadline = time.monotonic() + 240
    for line in proc.stderr:  # wait until the trainer is placed: Ray and the stage are running
        lines.append(line)
        if "trainer group:" in line or time.monotonic() > deadline:
            break
    time.sleep(2.0)
    if to == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=120)
    err = "".join(lines) + rest
    assert proc.returncode == 143, err[-2000:]
    assert "infir2-rl: error: terminated (SIGTERM); rerun the same command to resume" in err
    assert "SIGTERM received" not in err  # no stack dump
    assert "stage failed: terminated (SIGTERM)" in (run_dir / "logs" / "stage.log").read_text()


def test_an_interrupted_command_exits_even_when_its_shutdown_hangs() -> None:
    """After SIGTERM or Ctrl-C, a shutdown that hangs (here a non-daemon thread that never ends) must not keep
    the process alive: ``cli.exit_within`` ends it with the same code and one line."""
    import subprocess
    import sys
    import time

    code = (
        "import threading, time\n"
        "from infir2_rl.cli import exit_within\n"
        "threading.Thread(target=time.sleep, args=(600,)).start()\n"
        "exit_within(143, 1.0)\n"
        "raise SystemExit(143)\n"
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143, proc.stderr
    assert time.monotonic() - start < 60
    assert "infir2-rl: shutdown did not finish within 1 s; exiting without it" in proc.stderr


def test_a_sigterm_that_ray_turned_into_a_plain_keyboard_interrupt_still_exits_143(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray's ray.get re-raises a handler's KeyboardInterrupt subclass as a plain KeyboardInterrupt."""
    from infir2_rl import errors

    assert errors.describe(KeyboardInterrupt())[0] == errors.EXIT_INTERRUPTED
    monkeypatch.setattr(errors, "SIGTERM_RECEIVED", [True])
    code, line = errors.describe(KeyboardInterrupt())
    assert code == errors.EXIT_TERMINATED and "SIGTERM" in line
    # A SIGTERM to the process group ends the local Ray too: the error that surfaces may be Ray's (a call in
    # flight, or teardown replacing our Terminated), which ended the command with exit 1 on a loaded CI machine.
    for raised in (RuntimeError("Failed to connect to GCS"), ConnectionError("raylet died")):
        assert errors.describe(raised)[0] == errors.EXIT_TERMINATED


def test_a_bad_exit_grace_is_one_line_and_the_default(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """INFIR2_EXIT_GRACE_S is read while Ctrl-C or SIGTERM is already ending the run: a bad value must not
    turn that into a traceback and exit code 1."""
    from infir2_rl.cli import exit_grace_s

    monkeypatch.setenv("INFIR2_EXIT_GRACE_S", "2.5")
    assert exit_grace_s() == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("INFIR2_EXIT_GRACE_S", bad)
        assert exit_grace_s() == 60.0
        assert f"INFIR2_EXIT_GRACE_S={bad!r} is not a number" in capsys.readouterr().err


def test_a_ray_address_nothing_answers_at_is_one_line_not_a_hang() -> None:
    """ray.init retried an unreachable RAY_ADDRESS for minutes, printing only its own warnings."""
    import socket

    from infir2_rl.actors.ray_runtime import check_ray_address
    from infir2_rl.errors import BadInput

    with socket.socket() as s:  # a port nothing listens on (bound, then closed)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BadInput, match=rf"RAY_ADDRESS='127.0.0.1:{port}': nothing answers there"):
        check_ray_address(f"127.0.0.1:{port}", timeout_s=2.0)
    with pytest.raises(BadInput, match="write it as HOST:PORT"):
        check_ray_address("garbage")
    with socket.socket() as server:  # a listening port passes; so do the forms Ray resolves itself
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_ray_address(f"127.0.0.1:{server.getsockname()[1]}")
    check_ray_address("auto")
    check_ray_address("ray://head:10001")


def test_cast_fp8_and_os_errors_end_in_the_commands_one_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """cast-fp8 printed its own 'cast-fp8: error:' and no traceback with -v; an OS error on a path showed
    Python's '[Errno 20] ...' text. Both now end as every command does: 'infir2-rl: error: ...', exit 2."""
    assert main(["cast-fp8", "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o")]) == 2
    assert "infir2-rl: error: input_dir=" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main(["init-model", "--out", str(tmp_path / "afile" / "sub")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'afile' / 'sub'}: Not a directory; choose another path" in err and "Errno" not in err


def test_report_interval_and_init_model_on_a_file_are_one_clear_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit) as exit_info:
            main(["report", "--watch", str(tmp_path), "--interval", bad])
        assert exit_info.value.code == 2
        assert f"argument --interval: '{bad}' is not a number of seconds > 0" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main(["init-model", "--out", str(tmp_path / "afile")]) == 2
    assert "is a file: choose a new directory" in capsys.readouterr().err


def _failing_command(name: str, tmp_path: Path) -> list[str]:
    """A quick failing invocation of each subcommand (exit 2 before any work), -v to be placed in it."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    return {
        "demo": ["demo", "--pipeline", str(tmp_path / "nope.yaml")],
        "run": ["run", str(tmp_path / "nope.yaml"), "seed=1"],
        "pipeline": ["pipeline", str(tmp_path / "nope.yaml"), "seed=1"],
        "check-config": [
            "check-config",
            str(REPO / "configs" / "demo" / "rl_stage1.yaml"),
            "optimizer.lr=true",
        ],
        "init-model": ["init-model", "--out", str(afile)],
        "make-data": ["make-data", "--out", str(afile)],
        "cast-fp8": ["cast-fp8", "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o")],
        "report": ["report", str(tmp_path / "nope")],
    }[name]


def _commands() -> list[str]:
    import argparse

    from infir2_rl.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


@pytest.mark.parametrize("command", _commands())
def test_verbose_works_anywhere_on_the_line_for_every_command(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`infir2-rl demo -v` and `infir2-rl run cfg.yaml -v` were refused ('unrecognized arguments: -v'): -v was
    the top-level parser's only. Now every place works: before the command, right after it, at the end, and
    between a command's positional arguments (argparse alone leaves the rest of the line unrecognized there)."""
    argv = _failing_command(command, tmp_path)
    for flag in ("-v", "--verbose"):
        for at in sorted({0, 1, 2, len(argv)}):
            assert main([*argv[:at], flag, *argv[at:]]) == 2, (flag, at)
            err = _err(capsys)
            assert "unrecognized arguments" not in err and "Traceback" in err, (flag, at, err)
            assert err.rstrip().splitlines()[-1].startswith("infir2-rl: ") and "run with -v" not in err
    assert main(argv) == 2
    err = _err(capsys)
    assert "Traceback" not in err and "(run with -v for the traceback)" in err


def test_verbose_between_positionals_keeps_the_rest_of_the_line(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(REPO / "configs" / "demo" / "rl_stage1.yaml")
    assert main(["check-config", config, "-v", "optimizer.lr=0.5", "--verbose", "seed=7"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.5" in out and "seed: 7" in out


def test_check_config_says_what_each_cast_casts_and_who_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cast casts the last training stage's checkpoint (never a cast's), and only an RL stage with FP8 rollout
    right after it reads it (or nobody: the last stage's cast is the pipeline's output)."""
    demo = REPO / "configs" / "demo"
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        "name: p\nrun_dir: runs/p\nstages:\n"
        f"  - name: sft\n    config: {demo / 'sft_stage1.yaml'}\n"
        "  - name: cast_a\n    kind: cast_fp8\n"
        "  - name: cast_b\n    kind: cast_fp8\n"
        f"  - name: rl\n    config: {demo / 'rl_stage1.yaml'}\n"
        "  - name: cast_c\n    kind: cast_fp8\n"
    )
    assert main(["check-config", str(pipeline)]) == 0
    out = capsys.readouterr().out
    assert (
        "# --- cast_a: cast the checkpoint of 'sft' to blockwise FP8; UNUSED: the next stage, 'cast_b', is a cast"
        in out
    )
    assert (
        "# --- cast_b: cast the checkpoint of 'sft' to blockwise FP8; stage 'rl' starts its rollout engines"
        in out
    )
    assert "# --- cast_c: cast the checkpoint of 'rl' to blockwise FP8; the pipeline's FP8 output" in out
    assert main(["check-config", str(pipeline), "rl:precision=bf16"]) == 0
    assert (
        "cast_b: cast the checkpoint of 'sft' to blockwise FP8; UNUSED: the next stage, 'rl', is an RL stage without FP8"
        in (capsys.readouterr().out)
    )


def test_a_pipeline_warns_about_a_cast_nothing_reads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before any stage runs (here: before its bad model path stops it), a cast whose output the next stage never
    reads is a warning naming the cast."""
    import logging

    from infir2_rl.pipeline import run_pipeline

    demo = REPO / "configs" / "demo"
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        f"name: p\nrun_dir: {tmp_path / 'run'}\nstages:\n"
        f"  - name: sft\n    config: {demo / 'sft_stage1.yaml'}\n"
        "  - name: cast_a\n    kind: cast_fp8\n"
        f"  - name: sft_again\n    config: {demo / 'sft_stage2.yaml'}\n"
    )
    with caplog.at_level(logging.WARNING, logger="infir2_rl"), pytest.raises(ValueError, match="stage 'sft'"):
        run_pipeline(pipeline, stage_overrides=[f"model.path={tmp_path}"])  # not an HF model directory
    assert (
        "stage cast_a: cast the checkpoint of 'sft' to blockwise FP8; UNUSED: the next stage, 'sft_again', is an SFT"
        in (caplog.text)
    )


def test_a_pipeline_refuses_an_rl_reward_that_does_not_import_before_its_first_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reward used to be imported only when the RL stage started, after the SFT stages had trained."""
    from infir2_rl.data.synthetic import make_data
    from infir2_rl.models.factory import init_model

    model = init_model(tmp_path / "model", preset="tiny", num_hidden_layers=1)
    data = make_data(tmp_path / "data", num_sft=64, num_rl=64, num_test=4)
    run_dir = tmp_path / "run"
    argv = ["pipeline", str(REPO / "configs" / "demo" / "pipeline_demo.yaml"), f"run_dir={run_dir}"]
    argv += [f"model.path={model}", f"sft:data.train_path={data.sft_train}", "sft:data.test_path=null"]
    argv += [f"rl:data.train_path={data.rl_train}", "rl:data.test_path=null"]
    assert main([*argv, "rl:rollout.reward=no_such_module_here:score"]) == 2
    err = _err(capsys)
    assert "stage 'rl_stage1': rollout.reward='no_such_module_here:score': cannot import module" in err
    assert not run_dir.exists()  # nothing started
    check = [
        "check-config",
        "--paths",
        str(REPO / "configs" / "demo" / "rl_stage1.yaml"),
        f"model.path={model}",
    ]
    check += [f"data.train_path={data.rl_train}", "data.test_path=null", "rollout.reward=nonsense"]
    assert main(check) == 2
    assert "rollout.reward='nonsense': not a built-in" in _err(capsys)


@pytest.mark.parametrize("text", ["{oops", "{}", '{"finished": ["a"]}'])
def test_a_broken_pipeline_state_is_named_in_one_line(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "pipeline_state.json").write_text(text)
    argv = ["pipeline", str(REPO / "configs" / "demo" / "pipeline_demo.yaml"), f"run_dir={tmp_path}"]
    assert main(argv) == 2
    assert f"{tmp_path / 'pipeline_state.json'}: not a pipeline state this command wrote" in _err(capsys)


def test_help_names_every_model_preset_and_seeds_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from infir2_rl.cli import PRESET_NAMES
    from infir2_rl.models.factory import PRESETS

    assert sorted(PRESET_NAMES) == sorted(PRESETS)
    with pytest.raises(SystemExit) as exited:  # argparse's own one line and exit 2
        main(["init-model", "--out", "/nonexistent/x", "--seed", str(2**63)])
    assert exited.value.code == 2 and "is not an integer seed in [0, 2**63 - 1]" in _err(capsys)
    with pytest.raises(ValueError, match="less than or equal to 9223372036854775807"):
        from infir2_rl.config import SftStageConfig

        SftStageConfig.model_validate({"seed": 2**63})
