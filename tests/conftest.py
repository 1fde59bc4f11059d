"""Shared test setup: offline HF, fixed seeds, GPU tests skipped where no GPU is present."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _collect_cycles_before_exit() -> Iterator[None]:
    """Free what reference cycles still hold once the last test is done, while the interpreter is whole.

    Tests that break a weight group on purpose (tests/test_weight_sync_nccl.py) leave its gloo process group,
    TCPStore and their native threads (7 of them) in cycles that only the garbage collector frees; without
    this they are still running when the interpreter finalizes. One CI run (session 58) segfaulted at exit
    after every test had passed; native threads alive during finalization are a known cause of that, though
    that run's stacks were not captured.
    """
    yield
    import gc

    gc.collect()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Run a module's torch ops on one thread, as Ray gives each CPU actor one core.

    On a 2-core machine shared with other work, 2-thread tiny matmuls are an order of magnitude slower
    (thread oversubscription); one thread also makes float32 accumulation order repeatable.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A local Ray for one test module: 2 CPUs, no dashboard, driver logs off. The stages' own
    ``ensure_ray`` finds it up and uses it; a CLI started meanwhile runs without a dashboard too."""
    import ray

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INFIR2_RAY_DASHBOARD", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def own_process_group() -> Iterator[None]:
    """For a module that builds the megatron trainer in the pytest process: it makes a one-rank process group
    there (gloo on CPU, NCCL on a GPU) and megatron's parallel state; both are torn down after the module, so
    later tests run in a process without them, as they do alone, and the interpreter does not exit with a
    process group's threads still up (a GPU group brings a watchdog thread that polls CUDA events)."""
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
