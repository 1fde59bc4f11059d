"""Our SGLang requests and reply parsing held against the pinned SGLang wheel's own code (not our reading of it).

The wheel is installed without its dependencies into a directory of its own (pyproject's ``sglang-contract``
extra; ``.ci/run`` does it and sets ``INFIR2_SGLANG_CONTRACT_DIR``). Three kinds of check:

* real classes, in a subprocess (``tests/sglang_probe.py``): ``SamplingParams`` built from our sampling dicts
  and verified; our weight payload through ``MultiprocessingSerializer``, ``SafeUnpickler`` and
  ``FlattenedTensorBucket``;
* real functions lifted from SGLang's files and run here: the finish-reason classes, the log-prob formatting of
  ``/generate`` replies, the tokenizer manager's context-length validation;
* SGLang's source read with ``ast``: every path our engine calls is a route with our method, and every body we
  send has only fields of that route's request class and all of its required ones (SGLang ignores unknown
  keys silently); our server flags are ``ServerArgs`` fields.

Outside CI a missing wheel skips these tests with the install command; under CI (``CI`` set) it fails.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from infir2_rl.engines.sglang import protocol as P
from infir2_rl.types import GenerateRequest, SamplingParams, WeightBucket

ROOT = Path(__file__).resolve().parents[1]
SGLANG_DIR = Path(os.environ.get("INFIR2_SGLANG_CONTRACT_DIR", ROOT / ".ci-sglang"))
SRT = SGLANG_DIR / "sglang" / "srt"
_INSTALL = "bash .ci/sglang_contract.sh (pip install --no-deps --target .ci-sglang of pyproject's sglang-contract extra)"

if not SRT.is_dir():
    if os.environ.get("CI"):
        raise RuntimeError(f"SGLang contract wheel missing at {SGLANG_DIR}: CI must install it ({_INSTALL})")
    pytest.skip(f"SGLang contract wheel not installed at {SGLANG_DIR}: {_INSTALL}", allow_module_level=True)


def _tree(relative: str) -> ast.Module:
    return ast.parse((SRT / relative).read_text())


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _fields(classes: dict[str, ast.ClassDef], name: str) -> dict[str, bool]:
    """Field name -> required, over the class and its bases in the same file."""
    node, fields = classes[name], {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(_fields(classes, base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            fields[stmt.target.id] = stmt.value is None
    return fields


def _routes() -> dict[str, tuple[set[str], str | None]]:
    """Path -> (HTTP methods, request class of the body) from http_server.py's decorators."""
    routes: dict[str, tuple[set[str], str | None]] = {}
    for fn in ast.walk(_tree("entrypoints/http_server.py")):
        if not isinstance(fn, ast.AsyncFunctionDef):
            continue
        body_cls = None
        if fn.args.args and fn.args.args[0].annotation is not None:
            names = [n.id for n in ast.walk(fn.args.args[0].annotation) if isinstance(n, ast.Name)]
            body_cls = next((n for n in names if n.endswith(("ReqInput", "Req"))), None)
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args):
                continue
            if not isinstance(dec.args[0], ast.Constant):
                continue
            kind = dec.func.attr
            methods = {kind.upper()} if kind in ("get", "post", "put") else set()
            for kw in dec.keywords:
                if kw.arg == "methods":
                    methods = {e.value for e in kw.value.elts}  # type: ignore[attr-defined]
            routes[dec.args[0].value] = (methods, body_cls)
    return routes


def _calls() -> list[tuple[str, str, str | None, dict[str, Any] | None]]:
    """(method, path, SGLang request class, our body) for every call our engine makes."""
    request = GenerateRequest("r", [1, 2, 3], n=2, params=SamplingParams(max_new_tokens=4), seed=3)
    bucket = WeightBucket(5, 0, 1, ["w"], [torch.ones(1)])
    meta = [(torch.float8_e4m3fn, (128, 128))]
    tags = {"tags": [P.TAG_KV_CACHE, P.TAG_WEIGHTS, P.TAG_CUDA_GRAPH]}
    return [
        ("POST", "/generate", "GenerateReqInput", P.generate_payload(request)),
        ("POST", "/update_weights_from_tensor", "UpdateWeightsFromTensorReqInput",
         P.update_tensor_payload(["x"], bucket.version, bucket.is_last)),
        ("POST", "/update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput",
         P.update_distributed_payload(["w"], meta, 5, True, "g")),
        ("POST", "/init_weights_update_group", "InitWeightsUpdateGroupReqInput", P.init_group_payload("h", 1, 1, 3, "g")),
        ("POST", "/release_memory_occupation", "ReleaseMemoryOccupationReqInput", tags),
        ("POST", "/resume_memory_occupation", "ResumeMemoryOccupationReqInput", tags),
        ("POST", "/pause_generation", "PauseGenerationReqInput", {"mode": "abort"}),
        ("POST", "/continue_generation", "ContinueGenerationReqInput", {}),
        ("POST", "/weights_checker", "CheckWeightsReqInput", {"action": "checksum"}),
        ("POST", "/abort_request", "AbortReq", {"abort_all": True}),
        ("POST", "/flush_cache", None, None),
        ("GET", "/health_generate", None, None),
        ("GET", "/health", None, None),
    ]  # fmt: skip


def test_pinned_wheel_is_the_version_our_code_and_image_name() -> None:
    dist = [p.name for p in SGLANG_DIR.glob("sglang-*.dist-info")]
    assert dist == [f"sglang-{P.SGLANG_VERSION}.dist-info"]
    assert f'"sglang=={P.SGLANG_VERSION}"' in (ROOT / "pyproject.toml").read_text()
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    assert f"ARG SGLANG_VERSION={P.SGLANG_VERSION}\n" in dockerfile


def test_image_keeps_the_torch_and_transformers_sglang_pins() -> None:
    """The Dockerfile asserts its base has these versions; they must be the ones SGLang's wheel requires."""
    metadata = (SGLANG_DIR / f"sglang-{P.SGLANG_VERSION}.dist-info" / "METADATA").read_text()
    pins = dict(re.findall(r"^Requires-Dist: (torch|transformers)==(\S+)$", metadata, re.M))
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    assert f"ARG TORCH_VERSION={pins['torch']}\n" in dockerfile, pins
    assert f"ARG TRANSFORMERS_VERSION={pins['transformers']}\n" in dockerfile, pins


def test_every_path_the_engine_calls_is_listed_here() -> None:
    source = (ROOT / "infir2_rl/engines/sglang/engine.py").read_text()
    used = set(re.findall(r'"(/[a-z_]+)"', source))
    assert used and used <= {path for _, path, _, _ in _calls()}


def test_our_requests_match_sglang_routes_and_request_classes() -> None:
    routes, classes = _routes(), _classes(_tree("managers/io_struct.py"))
    for method, path, cls, body in _calls():
        assert path in routes, f"SGLang {P.SGLANG_VERSION} has no route {path}"
        methods, body_cls = routes[path]
        assert method in methods, f"{path}: SGLang accepts {methods}, we send {method}"
        assert body_cls == cls, f"{path}: SGLang parses {body_cls}, we build for {cls}"
        if body is None:
            continue
        fields = _fields(classes, cls)  # type: ignore[arg-type]
        unknown = set(body) - set(fields)
        missing = {f for f, required in fields.items() if required} - set(body)
        assert not unknown, f"{path}: SGLang's {cls} has no fields {unknown} (they would be ignored)"
        assert not missing, f"{path}: SGLang's {cls} requires {missing}"


def test_memory_tags_pause_mode_and_checker_action_are_sglangs() -> None:
    constants = (SRT / "constants.py").read_text()
    for tag in (P.TAG_WEIGHTS, P.TAG_KV_CACHE, P.TAG_CUDA_GRAPH):
        assert re.search(rf'GPU_MEMORY_TYPE_\w+ = "{tag}"', constants), tag
    pause = _classes(_tree("managers/io_struct.py"))["PauseGenerationReqInput"]
    assert "'abort'" in ast.unparse(pause)
    checker = (SRT / "utils/weight_checker.py").read_text()
    assert (
        'action == "checksum"' in checker
        and '"per_engine_checksum"' in (SRT / "entrypoints/http_server.py").read_text()
    )


def test_launch_flags_are_server_args_fields() -> None:
    server_args = _classes(_tree("server_args.py"))["ServerArgs"]
    bool_fields, value_fields = set(), set()
    for stmt in server_args.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            flag = "--" + stmt.target.id.replace("_", "-")
            is_bool = ast.unparse(stmt.annotation).replace(" ", "").startswith("A[bool,")
            (bool_fields if is_bool else value_fields).add(flag)
    opts = P.LaunchOptions(
        "/m", 1, 2, gpu_share=0.4, deterministic=True, random_seed=1, context_length=8,
        max_running_requests=256, dtype="bfloat16",
    )  # fmt: skip
    args = P.launch_command(opts)[3:]  # after "python -m sglang.launch_server"
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag in bool_fields | value_fields, (
            f"{flag} is not a ServerArgs flag of SGLang {P.SGLANG_VERSION}"
        )
        i += 1 if flag in bool_fields else 2


def _lift(relative: str, names: set[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute the named top-level classes/functions of an SGLang file (in source order) in ``namespace``."""
    tree = _tree(relative)
    picked = [n for n in tree.body if getattr(n, "name", None) in names]
    exec(compile(ast.Module(body=picked, type_ignores=[]), relative, "exec"), namespace)
    return namespace


def test_generate_replies_built_by_sglangs_code_parse_into_samples() -> None:
    import typing

    finish = _lift(
        "managers/schedule_batch.py",
        {"BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_MATCHED_STR", "FINISH_LENGTH", "FINISH_ABORT"},
        {"Union": typing.Union, "List": list},
    )
    tokenizer = _tree("managers/tokenizer_manager.py")
    manager = next(n for n in tokenizer.body if isinstance(n, ast.ClassDef) and n.name == "TokenizerManager")
    fmt = next(
        f for f in manager.body if isinstance(f, ast.FunctionDef) and f.name == "detokenize_logprob_tokens"
    )
    ns: dict[str, Any] = {"List": list}
    exec(compile(ast.Module(body=[fmt], type_ignores=[]), "tokenizer_manager.py", "exec"), ns)
    pairs = ns["detokenize_logprob_tokens"](None, [-0.25, -1.5], [11, 12], False)
    reasons = [finish["FINISH_MATCHED_TOKEN"](12).to_json(), finish["FINISH_LENGTH"](2).to_json(),
               finish["FINISH_ABORT"]("stop").to_json(), finish["FINISH_MATCHED_STR"]("x").to_json()]  # fmt: skip
    request = GenerateRequest("r", [1], n=4, params=SamplingParams())
    replies = [
        {"text": "", "meta_info": {"finish_reason": r, "output_token_logprobs": pairs}} for r in reasons
    ]
    samples = P.parse_generate_response(request, json.loads(json.dumps(replies)))  # as it crosses HTTP
    assert [s.finish_reason for s in samples] == ["stop", "length", "abort", "stop"]
    assert samples[0].response_ids == [11, 12] and samples[0].logprobs == [-0.25, -1.5]


def test_requests_we_send_pass_sglangs_context_length_validation() -> None:
    ns: dict[str, Any] = {}
    tree = _tree("managers/tokenizer_manager.py")
    manager = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TokenizerManager")
    fn = next(f for f in manager.body if isinstance(f, ast.FunctionDef) and f.name == "_validate_one_request")
    fn.args.args[1].annotation = None  # its type hint names classes we do not load
    # Our body is a dict: the embedding/multimodal branches keyed on these classes do not apply.
    ns.update(EmbeddingReqInput=type("E", (), {}), GenerateReqInput=type("G", (), {}), logger=None)
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "tokenizer_manager.py", "exec"), ns)
    validate, context = ns["_validate_one_request"], 16
    manager_state = types.SimpleNamespace(
        context_len=context, num_reserved_tokens=0, validate_total_tokens=True, is_generation=True,
        server_args=types.SimpleNamespace(allow_auto_truncate=False),
    )  # fmt: skip
    for prompt_len in (1, 9, 15, 16, 30):
        request = GenerateRequest("r", [1] * prompt_len, n=1, params=SamplingParams(max_new_tokens=12))
        budget = P.fit_to_context(request, context)
        body = P.generate_payload(request, budget)
        obj = types.SimpleNamespace(sampling_params=body["sampling_params"][0])
        if budget is None:  # we refuse it: so does SGLang
            with pytest.raises(ValueError, match="context length"):
                validate(manager_state, obj, body["input_ids"][0])
        else:
            validate(manager_state, obj, body["input_ids"][0])


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    owner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(f for f in owner.body if isinstance(f, ast.FunctionDef) and f.name == name)


def test_requests_we_send_pass_sglangs_scheduler_limits_unchanged() -> None:
    """The scheduler is stricter than the tokenizer manager: it aborts a prompt of max_req_len - 5 tokens or more
    (failing the whole /generate call it is in) and cuts max_new_tokens silently. What we send must pass both
    unaltered: SGLang's own functions run on our requests, and its margin read from ``get_worker_info``."""
    info = _method(_tree("managers/tp_worker.py"), "TpModelWorker", "get_worker_info")
    returned = next(n for n in ast.walk(info) if isinstance(n, ast.Return))
    assert isinstance(returned.value, ast.Tuple)
    margins = [
        e.right.value
        for e in returned.value.elts
        if isinstance(e, ast.BinOp) and isinstance(e.left, ast.Name) and e.left.id == "max_req_len"
        and isinstance(e.op, ast.Sub) and isinstance(e.right, ast.Constant)
    ]  # fmt: skip
    assert margins == [P.INPUT_MARGIN], "SGLang's max_req_input_len is no longer max_req_len - INPUT_MARGIN"
    assert "self.model_config.context_len - 1" in ast.unparse(info)  # max_req_len, the KV pool's bound aside
    ns: dict[str, Any] = {
        "logger": types.SimpleNamespace(warning=lambda *a: None),
        "Optional": Any,
        "Req": Any,
    }
    utils = _tree("managers/utils.py")
    validate = next(
        f for f in utils.body if isinstance(f, ast.FunctionDef) and f.name == "validate_input_length"
    )
    clip = _method(_tree("managers/scheduler.py"), "Scheduler", "init_req_max_new_tokens")
    exec(compile(ast.Module(body=[validate, clip], type_ignores=[]), "sglang", "exec"), ns)
    context, wanted = 64, 40
    for prompt_len in range(1, context + 2):
        request = GenerateRequest("r", [1] * prompt_len, n=1, params=SamplingParams(max_new_tokens=wanted))
        budget = P.fit_to_context(request, context)
        body = P.generate_payload(request, budget)
        req = types.SimpleNamespace(
            origin_input_ids=body["input_ids"][0],
            sampling_params=types.SimpleNamespace(
                max_new_tokens=body["sampling_params"][0]["max_new_tokens"]
            ),
        )
        scheduler = types.SimpleNamespace(page_size=1, max_req_len=context - 1, max_total_num_tokens=1 << 30)
        refused = ns["validate_input_length"](req, context - 1 - P.INPUT_MARGIN, False)
        if budget is None:  # we return it as aborted without sending it: SGLang would have refused it
            assert refused is not None, prompt_len
            continue
        assert refused is None, prompt_len
        ns["init_req_max_new_tokens"](scheduler, req)
        assert req.sampling_params.max_new_tokens == budget > 0, prompt_len  # SGLang keeps what we ask for


def test_the_memory_saver_variable_still_gates_cuda_graph_memory() -> None:
    """server_env sets MEMORY_SAVER_ENV for colocated servers: SGLang's graph backend must still read it."""
    (name,) = P.MEMORY_SAVER_ENV
    source = (SRT / "model_executor/runner_backend/full_cuda_graph_backend.py").read_text()
    assert f'get_bool_env_var("{name}")' in source and "enable_memory_saver" in source


def test_flush_cache_takes_the_timeout_we_send() -> None:
    route = next(
        f for f in _tree("entrypoints/http_server.py").body
        if isinstance(f, ast.AsyncFunctionDef) and f.name == "flush_cache"
    )  # fmt: skip
    assert [a.arg for a in route.args.args] == ["timeout"]


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/sglang_probe.py"), str(SGLANG_DIR)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_sampling_params_built_by_sglang_from_our_dicts(probe: dict[str, Any]) -> None:
    sampling = probe["sampling_params"]
    assert sampling["unknown_field_rejected"]
    rl, greedy = sampling["rl"], sampling["greedy"]
    assert [s["seed"] for s in rl] == [P.sampling_seed(2**40 + 5, i) for i in range(2)]
    assert all(s["temperature"] == 1.1 and s["no_stop_trim"] and s["stop_token_ids"] == [7] for s in rl)
    assert all(s["top_k"] > 1_000_000 for s in rl)  # -1 became "whole vocabulary"
    assert all(s["top_k"] == 1 and s["temperature"] == 1.0 for s in greedy)  # SGLang's greedy


def test_weight_payload_round_trips_through_sglangs_serializer_and_bucket(probe: dict[str, Any]) -> None:
    bucket = probe["flattened_bucket"]
    assert bucket["wire_is_str"] and bucket["names"] == [
        "l.q.weight",
        "l.q.weight_scale_inv",
        "l.norm.weight",
    ]
    assert bucket["same_bytes"] == [True, True, True]
    assert bucket["nccl_layout_equal"]


def test_dtype_names_resolve_as_sglang_resolves_them() -> None:
    for dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float32):
        assert getattr(torch, P.dtype_name(dtype)) is dtype
