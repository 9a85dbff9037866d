"""Directories raylm writes for its users (prepared data, exported models): built whole under a
temporary name beside the target and renamed into place, so that a failure, a second writer or
a crash never leaves a half directory under the target's name, and nothing raylm did not write
is ever deleted.

An existing target is replaced only when its own marker file (``manifest.json`` of a
preparation, ``raylm_export.json`` of an export) proves raylm wrote it, and, for exports, that
it is of the same kind (or ``overwrite`` says another kind may go). A target that is, or
contains, something the output is made from (a source file, the LoRA base model, the run
directory) is refused before anything is written. A rename within one directory is atomic on
POSIX filesystems, including the shared ones clusters mount.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path


class OutputError(ValueError):
    """An output directory raylm must not write into; the message says why and what to do."""


def _contains(directory: Path, path: Path) -> bool:
    return path == directory or directory in path.parents


def written_by_raylm(directory: Path, marker: str, key: str) -> dict | None:
    """The marker file's contents when ``directory`` holds one naming ``key`` (raylm wrote the
    directory), else None."""
    try:
        info = json.loads((directory / marker).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and key in info else None


def check_output(out: str | os.PathLike, *, what: str, marker: str, key: str,
                 inputs: Iterable[tuple[str, str | os.PathLike]] = (),
                 kind: str | None = None, overwrite: bool = False) -> Path:
    """``out`` resolved, once it is clear that writing it damages nothing: it holds none of
    ``inputs`` (``(name, path)`` pairs: what the output is made from), and it is missing,
    empty, or an earlier output raylm wrote (``marker`` naming ``key``; of ``kind`` unless
    ``overwrite``). ``what`` names the option, as the user wrote it."""
    out = Path(out).expanduser().resolve()
    for name, path in inputs:
        p = Path(path).expanduser().resolve()
        if p.exists() and _contains(out, p):
            raise OutputError(f"{what} {out} holds {name} {p}: writing the output there would "
                              f"replace what it is made from; choose another directory.")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{what} {out} is a file; name a directory.")
    if not out.is_dir() or not any(out.iterdir()):
        return out
    info = written_by_raylm(out, marker, key)
    if info is None:
        raise OutputError(f"{what} {out} holds files raylm did not write; choose a new or "
                          f"empty directory (raylm replaces only its own earlier output).")
    if kind is not None and info[key] != kind and not overwrite:
        raise OutputError(f"{what} {out} holds an earlier output of another kind "
                          f"({info[key]}, not {kind}); pass --overwrite to replace it, or "
                          f"choose another directory.")
    return out


def staging(out: Path) -> Path:
    """A new, empty directory beside ``out`` to build it in (same filesystem, so the final
    rename is atomic), named so that it is clearly raylm's and unique to this writer."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.raylm-{uuid.uuid4().hex[:12]}.tmp"
    tmp.mkdir()
    return tmp


def publish(tmp: Path, out: Path, *, same: bool = False) -> bool:
    """Rename the finished ``tmp`` to ``out``. An existing ``out`` (checked by
    :func:`check_output`, or an identical output another writer published meanwhile when
    ``same``) is moved aside first and removed after. Returns False when ``same`` and another
    writer's copy was already there: it is kept and ``tmp`` removed."""
    try:
        os.rename(tmp, out)  # a missing or empty target: one atomic step
        return True
    except OSError:
        if not out.is_dir():
            raise
    if same:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    old = out.parent / f".{out.name}.raylm-{uuid.uuid4().hex[:12]}.old"
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return True


def discard(tmp: Path) -> None:
    """Remove an unfinished ``tmp`` (the output failed; the target is untouched)."""
    shutil.rmtree(tmp, ignore_errors=True)
