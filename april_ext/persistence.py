"""Atomic file and directory writes, and checksums: the one place april_ext writes state files.

A file is written to a temporary name in the target's directory (unique to the process, thread and
call), flushed, fsynced, renamed over the target, and the directory is fsynced: a reader sees the old
file or the new one, never a part of one, and concurrent writers to one path each replace it whole.
New files and directories get the umask's permissions (0o666 / 0o777 minus the umask, as open() and
mkdir() give), not mkstemp's 0o600: a server running as another user must be able to read synced
weights. Every failure raises PersistenceError naming the path and the cause; nothing temporary is
left behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from april_ext.errors import AprilError, CorruptStateError, PersistenceError

_calls = itertools.count()
_TEMP_MARK = ".tmp-"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileDigest:
    """Size in bytes and sha256 (hex) of a file's contents."""

    size: int
    sha256: str


def _temp_name(path: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}{_TEMP_MARK}{os.getpid()}-{threading.get_ident()}-{next(_calls)}")


def is_temporary(name: str) -> bool:
    """Whether a directory entry is a leftover of an interrupted atomic write (a killed process)."""
    return name.startswith(".") and _TEMP_MARK in name


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Makes the entries of a directory (a rename into it) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise PersistenceError(f"syncing directory {os.fspath(path)!r} failed: {err}") from None


def ensure_dir(path: str | os.PathLike[str]) -> str:
    """Creates a directory and its parents when missing; returns its path."""
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise PersistenceError(f"cannot create directory {path!r}: {err}") from None
    return path


def _os_cause(err: OSError) -> str:
    """The OS error without the temporary file's name, which means nothing to the caller."""
    return f"{err.strerror} (errno {err.errno})" if err.strerror else str(err)


def _fsync_file(path: str) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


@contextlib.contextmanager
def _removed_on_error(temp: str, what: str, wrapped: type[Exception]) -> Iterator[None]:
    """Removes the temporary ``temp`` when the block raises; an exception of class ``wrapped`` (but an
    AprilError) becomes PersistenceError "<what> failed: <cause>", chained."""
    try:
        yield
    except AprilError:
        _remove(temp)
        raise
    except wrapped as err:
        _remove(temp)
        cause = _os_cause(err) if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
        raise PersistenceError(f"{what} failed: {cause}") from err
    except BaseException:
        _remove(temp)
        raise


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """Replaces ``path`` by what ``write(temp_path)`` writes into a fresh temporary file beside it (for
    serializers that take a path: safetensors, torch.save). An exception of the callback other than an
    AprilError becomes PersistenceError (serializers report a full disk as RuntimeError), chained."""
    final = os.path.abspath(os.fspath(path))
    temp = _temp_name(final)
    with _removed_on_error(temp, f"writing {final!r}", Exception):
        # O_EXCL with mode 0o666: the kernel applies the umask, and no other writer shares this file.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
        write(temp)
        # Serializers may replace the file by one of their own (safetensors makes it 0o600).
        os.chmod(temp, mode)
        _fsync_file(temp)
        os.replace(temp, final)
    fsync_dir(os.path.dirname(final))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replaces ``path`` by ``data`` atomically."""
    def write(temp: str) -> None:
        with open(temp, "wb") as handle:
            handle.write(data)

    atomic_write(path, write)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Replaces ``path`` by ``text`` atomically."""
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike[str], value: Any, *, indent: int | None = None) -> None:
    """Replaces ``path`` by ``value`` as JSON atomically (serialized before the file is touched)."""
    atomic_write_text(path, json.dumps(value, indent=indent))


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON value of a state file: PersistenceError when it cannot be read, CorruptStateError (naming
    the file) when it is not JSON."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except OSError as err:
        raise PersistenceError(f"reading {path!r} failed: {_os_cause(err)}") from None
    except ValueError as err:
        raise CorruptStateError(f"{path}: damaged JSON ({err})") from None


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[str]:
    """``with atomic_directory(p) as temp:`` fill ``temp``; on a clean exit every file and directory
    under it is fsynced and it replaces ``p``: an older ``p`` is renamed aside, the new one renamed into
    place, the old one removed, so ``p`` holds the old directory or the complete new one, never a
    mixture (a crash between the two renames leaves no ``p`` and the old one under a temporary name,
    which is_temporary recognises). On an exception ``temp`` is removed and ``p`` left as it was."""
    final = os.path.abspath(os.fspath(path))
    temp = _temp_name(final)
    try:
        os.mkdir(temp, 0o777)
    except OSError as err:
        raise PersistenceError(f"cannot create a temporary directory for {final!r}: {err}") from None
    with _removed_on_error(temp, f"writing directory {final!r}", OSError):
        yield temp
        _fsync_tree(temp)
        if os.path.lexists(final):
            old = _temp_name(final)
            os.rename(final, old)
            try:
                os.rename(temp, final)
            except OSError:
                os.rename(old, final)
                raise
            _remove(old)
        else:
            os.rename(temp, final)
    fsync_dir(os.path.dirname(final))


def _fsync_tree(root: str) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(os.path.join(dirpath, name))
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def digest_file(path: str | os.PathLike[str]) -> FileDigest:
    """Size and sha256 of a file, read in 1 MiB chunks."""
    sha = hashlib.sha256()
    size = 0
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                sha.update(chunk)
                size += len(chunk)
    except OSError as err:
        raise PersistenceError(f"reading {os.fspath(path)!r} failed: {err}") from None
    return FileDigest(size, sha.hexdigest())


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 (hex) of a file, read in 1 MiB chunks."""
    return digest_file(path).sha256


__all__ = ["FileDigest", "atomic_directory", "atomic_write", "atomic_write_bytes", "atomic_write_json",
           "atomic_write_text", "digest_file", "ensure_dir", "fsync_dir", "is_temporary", "read_json", "sha256_file"]
