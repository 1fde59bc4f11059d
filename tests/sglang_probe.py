"""Runs our SGLang payloads through the pinned SGLang wheel's own classes, in a process of its own.

Usage: ``python tests/sglang_probe.py SGLANG_DIR`` prints one JSON object (see ``main``). SGLANG_DIR holds the
wheel installed with ``--no-deps`` (the ``sglang-contract`` extra of pyproject.toml; ``.ci/run`` installs it).
Only light modules of SGLang are imported: ``sampling/sampling_params.py``, ``utils/common.py``
(``MultiprocessingSerializer``, ``SafeUnpickler``) and ``weight_sync/tensor_bucket.py``. They import triton
and torchvision at module level without using them for what is tested here, so SGLang's own triton stub
(``sglang/_triton_stub.py``, made for machines without triton) and an empty torchvision module stand in, and
the ``sglang`` package's ``__init__`` (the frontend language, with IPython and more) is skipped. A separate
process keeps those stand-ins away from the rest of the test session.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any


def install_shims(sglang_dir: Path) -> None:
    sys.path.insert(0, str(sglang_dir))
    spec = importlib.util.spec_from_file_location(
        "_sglang_triton_stub", sglang_dir / "sglang/_triton_stub.py"
    )
    assert spec is not None and spec.loader is not None
    stub: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stub)
    stub.install()

    class TorchvisionStandIn:
        def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
            if fullname.split(".")[0] != "torchvision":
                return None
            module = stub._MockModule(fullname)
            sys.modules[fullname] = module
            parent, _, child = fullname.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, module)
            return module.__spec__

    # transformers must decide "no torchvision" before the stand-in exists.
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    sys.meta_path.insert(0, TorchvisionStandIn())
    package = types.ModuleType("sglang")
    package.__path__ = [str(sglang_dir / "sglang")]
    package.__spec__ = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
    sys.modules["sglang"] = package


def check_sampling_params() -> dict[str, Any]:
    """Each of our sampling dicts built into SGLang's ``SamplingParams`` and verified as its server does."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    from infir2_rl.engines.sglang import protocol as P
    from infir2_rl.types import GenerateRequest
    from infir2_rl.types import SamplingParams as Ours

    out: dict[str, Any] = {}
    cases = {
        "rl": Ours(temperature=1.1, max_new_tokens=32, stop_token_ids=[7]),
        "greedy": Ours(greedy=True, max_new_tokens=8),
    }
    for name, params in cases.items():
        body = P.generate_payload(GenerateRequest("r", [1, 2], n=2, params=params, seed=2**40 + 5))
        built = [SamplingParams(**d) for d in body["sampling_params"]]
        for b in built:
            b.verify(vocab_size=1000)
        out[name] = [
            {"temperature": b.temperature, "top_k": b.top_k, "seed": b.sampling_seed, "no_stop_trim": b.no_stop_trim,
             "stop_token_ids": sorted(b.stop_token_ids or []), "max_new_tokens": b.max_new_tokens}
            for b in built
        ]  # fmt: skip
    try:
        SamplingParams(not_a_field=1)
        out["unknown_field_rejected"] = False
    except TypeError:
        out["unknown_field_rejected"] = True
    return out


def check_flattened_bucket() -> dict[str, Any]:
    """Our per-rank payload through SGLang's serializer, its SafeUnpickler and its bucket reconstruction."""
    import torch
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    from infir2_rl.engines.sglang import protocol as P

    g = torch.Generator().manual_seed(0)
    names = ["l.q.weight", "l.q.weight_scale_inv", "l.norm.weight"]
    tensors = [
        (torch.randn(256, 128, generator=g) * 50).to(torch.float8_e4m3fn),
        torch.rand(2, 1, generator=g) + 0.1,
        torch.randn(128, generator=g).to(torch.bfloat16),
    ]
    wire = MultiprocessingSerializer.serialize(
        P.flattened_bucket(names, tensors, FlattenedTensorMetadata), output_str=True
    )
    received = MultiprocessingSerializer.deserialize(wire)  # SafeUnpickler, as every TP rank does
    bucket = FlattenedTensorBucket(
        flattened_tensor=received["flattened_tensor"], metadata=received["metadata"]
    )
    rebuilt = bucket.reconstruct_tensors()
    theirs = FlattenedTensorBucket(named_tensors=list(zip(names, tensors))).get_flattened_tensor()
    return {
        "wire_is_str": isinstance(wire, str),
        "names": [n for n, _ in rebuilt],
        "same_bytes": [
            t.dtype == s.dtype
            and t.shape == s.shape
            and torch.equal(t.view(torch.uint8), s.view(torch.uint8))
            for (_, t), s in zip(rebuilt, tensors)
        ],
        "nccl_layout_equal": torch.equal(P.flat_bytes(tensors), theirs),
    }


def main() -> None:
    install_shims(Path(sys.argv[1]))
    print(
        json.dumps({"sampling_params": check_sampling_params(), "flattened_bucket": check_flattened_bucket()})
    )


if __name__ == "__main__":
    main()
