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

import glob
import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputError(ValueError):
    """An output directory raylm must not write into; the message says why and what to do."""


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
    if "://" in str(out):
        raise OutputError(f"{what} {out} is a URI: raylm writes this output to a local or "
                          f"mounted directory (renamed into place whole, which object storage "
                          f"cannot do); write it there and copy it to the bucket after.")
    out = Path(out).expanduser().resolve()
    for name, path in inputs:
        p = Path(path).expanduser().resolve()
        if p.exists() and (p == out or out in p.parents):
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
    rename is atomic), named so that it is clearly raylm's and unique to this writer: its
    host and pid, so that the staging directories of writers killed on this host (a killed
    export, preparation or reference pass) are removed here."""
    out.parent.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    for old in out.parent.glob(f".{glob.escape(out.name)}.raylm-*.tmp"):
        found = re.fullmatch(rf"\.{re.escape(out.name)}\.raylm-(.+)-([0-9]{{1,9}})-[0-9a-f]{{12}}"
                             rf"\.tmp", old.name)
        if (found and found.group(1) == host and old.is_dir() and not old.is_symlink()
                and not alive(int(found.group(2)))):
            shutil.rmtree(old, ignore_errors=True)
    tmp = out.parent / f".{out.name}.raylm-{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp"
    tmp.mkdir()
    return tmp


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        pass
    return True


def publish(tmp: Path, out: Path, *, same: bool = False,
            mine: tuple[str, str] | None = None) -> bool:
    """Rename the finished ``tmp`` to ``out``. An existing ``out`` (checked by
    :func:`check_output`, or an identical output another writer published meanwhile when
    ``same``) is moved aside first and removed after; ``mine``: the ``(marker, key)`` that
    proves raylm wrote it, checked again here, just before, since files may have arrived there
    during a long write. Returns False when ``same`` and another writer's copy was already
    there: it is kept and ``tmp`` removed."""
    try:
        os.rename(tmp, out)  # a missing or empty target: one atomic step
        return True
    except OSError:
        if not out.is_dir():
            raise
    if same:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    if mine is not None and written_by_raylm(out, *mine) is None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"{out} now holds files raylm did not write (they arrived while the "
                          f"output was being written); nothing was replaced. Choose a new or "
                          f"empty directory.")
    old = out.parent / f".{out.name}.raylm-{uuid.uuid4().hex[:12]}.old"
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return True


@contextmanager
def building(out: Path) -> Iterator[Path]:
    """A :func:`staging` directory for ``out``, removed if the block fails (the target is
    untouched); :func:`publish` it after."""
    tmp = staging(out)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
