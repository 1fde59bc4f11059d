"""Hold GPU memory so that other processes see a smaller GPU: an 80 GB H100's memory on a 141 GB H200.

Memory checks only (speed stays the bigger GPU's). The ballast allocates what makes the GPU's memory, as other
processes can use it, that of a GPU whose ``nvidia-smi`` total is ``--as-total-mib`` (default 81,559 MiB: an
H100 80GB HBM3), assuming both GPUs' drivers reserve the same: it reads the used memory of the idle GPU
(``nvidia-smi``, before this process touches it: the driver's reserve), then holds

    (this GPU's total - as-total-mib) - its own CUDA context

MiB, so that ``nvidia-smi`` used = reserve + (total - as-total-mib). It writes ``--ready-file`` once it holds
the memory (what it holds, what is left) and sleeps until killed. Usage, from the repository root:

    python bench/gpu_ballast.py --ready-file /tmp/ballast.ready &
    while [ ! -e /tmp/ballast.ready ]; do sleep 1; done; cat /tmp/ballast.ready
    ... the run to check ...
    kill %1

Run it on an otherwise idle GPU: memory other processes hold at start is counted as the driver's reserve.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

H100_80GB_TOTAL_MIB = 81_559  # nvidia-smi's memory.total of an NVIDIA H100 80GB HBM3


def smi_mib(device: int) -> tuple[int, int]:
    """(total, used) MiB of GPU ``device`` by nvidia-smi."""
    out = subprocess.run(
        [
            "nvidia-smi",
            "-i",
            str(device),
            "--query-gpu=memory.total,memory.used",
            "--format=csv,noheader,nounits",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    total, used = (int(x) for x in out.strip().split(","))
    return total, used


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--as-total-mib", type=int, default=H100_80GB_TOTAL_MIB)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--ready-file", type=Path, required=True)
    args = parser.parse_args(argv)
    total, reserve = smi_mib(args.device)
    if total <= args.as_total_mib:
        print(f"gpu_ballast: this GPU has {total} MiB, not more than --as-total-mib={args.as_total_mib}")
        return 2
    import torch

    torch.cuda.set_device(args.device)
    torch.zeros(1, device="cuda")  # the context
    _, with_context = smi_mib(args.device)
    context = with_context - reserve
    hold = (total - args.as_total_mib) - context
    ballast = torch.empty(hold * 2**20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    _, used = smi_mib(args.device)
    line = (
        f"gpu_ballast: GPU {args.device} total {total} MiB, reserve {reserve}, own context {context}, holding"
        f" {hold} MiB: used {used} MiB, left {total - used} MiB (a {args.as_total_mib}-MiB GPU with this"
        f" reserve leaves {args.as_total_mib - reserve})"
    )
    print(line, flush=True)
    args.ready_file.write_text(line + "\n")
    while ballast.numel():  # hold until killed
        time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
