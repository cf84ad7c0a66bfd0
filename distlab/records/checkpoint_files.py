"""A checkpoint folder's files on disk: the manifest (size and sha256 of every file) and the
atomic write (a temporary sibling, fsynced, then renamed into place). No torch here."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from distlab.errors import CheckpointCorrupt

FORMAT_VERSION = 2  # of the checkpoint folder: its manifest and distlab_checkpoint.json (2: trainable
# parameters only, the base named by identity; sharded streamed export)
MANIFEST = "MANIFEST.json"
META = "distlab_checkpoint.json"  # what the checkpoint is: run, step, world size, its settings' signature


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() != MANIFEST)


def write_manifest(root: Path) -> dict:
    files = {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in _files(root)}
    manifest = {"format_version": FORMAT_VERSION, "files": files}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def verify_manifest(root: str | os.PathLike) -> list[str]:
    """Problems found, each naming its file; empty when every file is as it was saved."""
    root = Path(root)
    try:
        listed = json.loads((root / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        return [f"{root / MANIFEST}: missing or unreadable manifest ({exc})"]
    problems = []
    for name, entry in listed.items():
        path = root / name
        if not path.is_file():
            problems.append(f"{path}: listed in the manifest but missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, the manifest says {entry['size']} (truncated?)")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest (altered)")
    for path in _files(root):
        if path.relative_to(root).as_posix() not in listed:
            problems.append(f"{path}: not listed in the manifest")
    return problems


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for item in [*path.rglob("*"), path]:
        _fsync(item)  # files and folders: a rename is only durable once the folder entries are


def replace_dir(tmp: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(final.parent)
    if old.exists():
        shutil.rmtree(old)


def step_folders(root: str | os.PathLike) -> list[Path]:
    """The step-<N> checkpoint folders under `root`, oldest first by step number (names are
    zero-padded to 6 digits only: by name, step-1000000 would sort before step-999999)."""
    found = [p for p in Path(root).glob("step-*") if p.name.split("-", 1)[1].isdigit() and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


def atomic_dir(final: str | os.PathLike):
    """A temporary sibling folder to write into; commit() fsyncs and renames it (one process)."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    def commit():
        fsync_tree(tmp)
        replace_dir(tmp, final)

    return tmp, commit


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def read_meta(root) -> dict:
    """The checkpoint's distlab_checkpoint.json; CheckpointCorrupt naming it when it is missing or unreadable."""
    path = Path(root) / META
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(f"{path}: missing or unreadable ({exc})") from None
