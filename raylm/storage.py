"""Where runs live: a local (or shared, mounted) directory, or object storage named by a URI.

``run.storage_path`` may be a path or any URI that pyarrow's filesystems open: ``s3://``,
``gs://``, ``abfs://``, ``hdfs://`` (and ``file://``, which the tests use to take the URI
path on local disk). Ray Train and Tune already write checkpoints through these filesystems;
this module gives raylm's own run files (``summary.json``, ``events.jsonl``, ``run.json``,
checkpoint markers, sweep outputs) the same reach, so a multi-node run needs no shared mount for
them.

Object stores have neither append nor rename, but a whole object appears at once. So a write is
one put (locally: a temporary file renamed into place), and appends exist only for local files;
the run's event log goes to object storage as numbered segments instead (raylm.run.record).
"""

from __future__ import annotations

import os
import posixpath
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pyarrow import fs as pafs

_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")
_SECRET_QUERY = re.compile(
    r"([?&](?:[A-Za-z0-9_.-]*(?:key|secret|token|password|passwd|signature|sig|credential)"
    r"[A-Za-z0-9_.-]*)=)[^&\s]*", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the credentials URIs in it may carry (``scheme://user:secret@host``, and
    query parameters named like keys, secrets, tokens, passwords or signatures) replaced by
    ``***``: what raylm prints and logs to MLflow goes through here."""
    return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


def is_uri(path: str | os.PathLike) -> bool:
    return "://" in str(path)


def normalize(path: str | os.PathLike) -> str:
    """A URI as given (without a trailing slash), a local path absolute with its folders'
    links resolved but not its own: a write replaces a link found there, never its target."""
    s = str(path)
    p = Path(os.path.abspath(os.path.expanduser(s)))
    return s.rstrip("/") if is_uri(s) else str(p.parent.resolve() / p.name if p.name else p)


def join(base: str | os.PathLike, *parts: str) -> str:
    b = str(base)
    return posixpath.join(b, *parts) if is_uri(b) else os.path.join(b, *parts)


def parent(path: str | os.PathLike) -> str:
    s = str(path).rstrip("/")
    return s.rsplit("/", 1)[0] if is_uri(s) else os.path.dirname(s)


def name(path: str | os.PathLike) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def _resolve(path: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    if is_uri(path):
        return pafs.FileSystem.from_uri(str(path))
    return pafs.LocalFileSystem(), normalize(path)


def size(path: str | os.PathLike) -> int | None:
    """Bytes in the file at ``path``; None if there is no file there."""
    fs, p = _resolve(path)
    info = fs.get_file_info(p)
    return info.size if info.type == pafs.FileType.File else None


def is_file(path: str | os.PathLike) -> bool:
    return size(path) is not None


def is_dir(path: str | os.PathLike) -> bool:
    fs, p = _resolve(path)
    return fs.get_file_info(p).type == pafs.FileType.Directory


def list_dirs(path: str | os.PathLike, kind=pafs.FileType.Directory) -> list[str]:
    """Names of the directories (or files of another ``kind``) directly under ``path``,
    sorted (none if it does not exist)."""
    fs, p = _resolve(path)
    infos = fs.get_file_info(pafs.FileSelector(p, allow_not_found=True))
    return sorted(i.base_name for i in infos if i.type == kind)


def list_files(path: str | os.PathLike) -> list[str]:
    return list_dirs(path, pafs.FileType.File)


def read_bytes(path: str | os.PathLike) -> bytes:
    """The file's bytes; FileNotFoundError if it does not exist."""
    return b"".join(read_chunks(path))


def read_chunks(path: str | os.PathLike, size: int = 8 << 20) -> Iterator[bytes]:
    """The file's bytes in pieces of ``size`` (for hashing a file larger than memory)."""
    fs, p = _resolve(path)
    if fs.get_file_info(p).type != pafs.FileType.File:
        raise FileNotFoundError(str(path))
    with fs.open_input_stream(p) as f:
        while chunk := f.read(size):
            yield chunk


def read_text(path: str | os.PathLike) -> str:
    return read_bytes(path).decode()


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace the file at ``path`` as a whole: readers see the old or the new, never a part."""
    if is_uri(path):
        fs, p = _resolve(path)
        fs.create_dir(posixpath.dirname(p), recursive=True)
        with fs.open_output_stream(p) as f:
            f.write(data)
        return
    target = Path(normalize(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, target)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode())


def remove(path: str | os.PathLike) -> None:
    """Delete the file at ``path`` if it is there."""
    fs, p = _resolve(path)
    try:
        fs.delete_file(p)
    except FileNotFoundError:
        pass


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append ``text`` to a local file (small single-line appends from several processes do
    not mix). Object storage has no append: write whole objects (see raylm.run.record)."""
    assert not is_uri(path), path
    target = Path(normalize(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644),
              "a") as f:  # a link there is refused (ELOOP), never appended through
        f.write(text)


def download(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy the directory ``src`` (a path or URI) into the local directory ``dst``."""
    fs, p = _resolve(src)
    Path(dst).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(p, str(dst), source_filesystem=fs,
                    destination_filesystem=pafs.LocalFileSystem())
    return Path(dst)


def upload(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy the local directory ``src`` to ``dst`` (a path or URI)."""
    fs, p = _resolve(dst)
    fs.create_dir(p, recursive=True)
    pafs.copy_files(str(src), p, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)
