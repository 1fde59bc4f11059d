"""Is a checkpoint directory what its save wrote? A manifest of file sizes and cheap structural reads.

A save records ``MANIFEST.json`` (every file's size in bytes) before it writes DONE. ``problem(path)``
then answers, without reading the tensors:

* every file of the manifest is present with its recorded size (a truncated copy, a disk that lost the
  tail of a file, a file deleted by hand);
* every ``*.safetensors`` file has a readable header whose tensors cover the file exactly (safetensors
  checks this when it opens a file);
* every ``*.pt`` file (``torch.save``'s zip format) has a readable central directory, which sits at the
  end of the file, so a truncated one fails;
* ``stage_state.json`` parses.

Not detected: bytes flipped inside a tensor (it would take a checksum over every byte, tens of GB for a
7B model's weights and optimizer state at each save); such a checkpoint fails when it is loaded, and the
error names its directory. Directories saved before manifests existed get the structural reads only.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

MANIFEST_FILE = "MANIFEST.json"


def file_sizes(directory: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``directory``, in sorted order."""
    sizes = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = Path(root) / name
            sizes[str(path.relative_to(directory))] = path.stat().st_size
    return dict(sorted(sizes.items()))


def write_manifest(directory: Path) -> None:
    """Record the size of every file already in ``directory`` (call it after the trainer wrote its files)."""
    sizes = file_sizes(directory)
    with (directory / MANIFEST_FILE).open("w") as f:
        f.write(json.dumps(sizes, indent=1))
        f.flush()
        os.fsync(f.fileno())


def _structure_problem(path: Path) -> str | None:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as exc:  # SafetensorError is not an OSError
            return f"{path.name} is not a complete safetensors file ({exc})"
    elif path.suffix == ".pt":
        try:
            with zipfile.ZipFile(path) as z:
                z.infolist()
        except (zipfile.BadZipFile, OSError) as exc:
            return f"{path.name} is not a complete torch.save file ({exc})"
    return None


def problem(directory: Path, state_file: str) -> str | None:
    """Why ``directory`` is not a usable checkpoint (one phrase), or None when it is."""
    manifest = directory / MANIFEST_FILE
    expected: dict[str, int] | None = None
    if manifest.is_file():
        try:
            expected = json.loads(manifest.read_text())
        except json.JSONDecodeError as exc:
            return f"{MANIFEST_FILE} does not parse ({exc.msg})"
    actual = file_sizes(directory)
    if expected is not None:
        for rel, size in expected.items():
            if rel not in actual:
                return f"{rel} is missing"
            if actual[rel] != size:
                return f"{rel} has {actual[rel]} bytes, the save wrote {size}"
    try:
        json.loads((directory / state_file).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"{state_file} is unreadable ({type(exc).__name__}: {exc})"
    for rel in actual:
        found = _structure_problem(directory / rel)
        if found is not None:
            return found
    return None
