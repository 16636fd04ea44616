"""april_ext.persistence: atomic writes under concurrent writers (threads and processes), permissions
from the umask, failures that keep the old file and leave no temporary behind, and checksums."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import stat
import threading
from collections.abc import Iterator

import pytest
import torch

from april_ext import AprilError, PersistenceError
from april_ext.model.checkpoint import save_safetensors, save_safetensors_sharded
from april_ext.persistence import (
    atomic_directory,
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    digest_file,
    is_temporary,
    sha256_file,
)

PAYLOAD = 256 * 1024


def _payload(writer: int, round_: int) -> bytes:
    """A self-checking payload: its first 32 bytes are the sha256 of the rest."""
    body = bytes([(writer * 31 + round_) % 251]) * PAYLOAD + f"{writer}:{round_}".encode()
    return hashlib.sha256(body).digest() + body


def _whole(data: bytes) -> bool:
    return len(data) > 32 and hashlib.sha256(data[32:]).digest() == data[:32]


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _write_rounds(path: str, writer: int, rounds: int) -> None:
    for r in range(rounds):
        atomic_write_bytes(path, _payload(writer, r))


def test_concurrent_thread_writers_never_leave_a_partial_file(tmp_path):
    path = str(tmp_path / "state.bin")
    atomic_write_bytes(path, _payload(99, 0))
    stop = threading.Event()
    torn: list[int] = []

    def read() -> None:
        while not stop.is_set():
            with open(path, "rb") as handle:
                if not _whole(handle.read()):
                    torn.append(1)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=_write_rounds, args=(path, w, 15)) for w in range(6)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert not torn
    with open(path, "rb") as handle:
        assert handle.read() in {_payload(w, 14) for w in range(6)}
    assert os.listdir(tmp_path) == ["state.bin"]


def test_concurrent_process_writers_never_leave_a_partial_file(tmp_path):
    path = str(tmp_path / "state.bin")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_rounds, args=(path, w, 15)) for w in range(4)]
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):
        if os.path.exists(path):
            with open(path, "rb") as handle:
                assert _whole(handle.read())
    for p in procs:
        p.join()
        assert p.exitcode == 0
    with open(path, "rb") as handle:
        assert handle.read() in {_payload(w, 14) for w in range(4)}
    assert os.listdir(tmp_path) == ["state.bin"]


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_files_and_directories_get_the_umask_permissions(tmp_path, mask, file_mode, dir_mode):
    """A weight file synced to an inference server running as another user must be readable by it."""
    with _umask(mask):
        save_safetensors({"w": torch.ones(3)}, tmp_path / "sync")
        save_safetensors_sharded([("w", torch.ones(3))], tmp_path / "sharded", 2**20)
        atomic_write_text(tmp_path / "a.txt", "x")
        with atomic_directory(tmp_path / "ckpt") as temp:
            atomic_write_json(os.path.join(temp, "run.json"), {"step": 1})
    assert _mode(tmp_path / "sync" / "model.safetensors") == file_mode
    assert _mode(tmp_path / "sharded" / "model-00001-of-00001.safetensors") == file_mode
    assert _mode(tmp_path / "sharded" / "model.safetensors.index.json") == file_mode
    assert _mode(tmp_path / "a.txt") == file_mode
    assert _mode(tmp_path / "ckpt") == dir_mode
    assert _mode(tmp_path / "ckpt" / "run.json") == file_mode


def test_a_failing_writer_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "config.json"
    atomic_write_json(path, {"v": 1})

    def half_then_fail(temp: str) -> None:
        with open(temp, "w", encoding="utf-8") as handle:
            handle.write('{"v": ')
        raise RuntimeError("disk full")

    with pytest.raises(PersistenceError, match=r"config\.json.*RuntimeError: disk full") as info:
        atomic_write(path, half_then_fail)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert path.read_text() == '{"v": 1}'
    assert os.listdir(tmp_path) == ["config.json"]

    def interrupted(temp: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, interrupted)
    assert os.listdir(tmp_path) == ["config.json"]


def test_os_errors_become_persistence_errors_naming_path_and_cause(tmp_path):
    missing = tmp_path / "no_such_dir" / "x.bin"
    with pytest.raises(PersistenceError, match=r"no_such_dir/x\.bin.*No such file or directory"):
        atomic_write_bytes(missing, b"x")
    (tmp_path / "taken").mkdir()
    with pytest.raises(PersistenceError, match=r"taken.*Is a directory"):
        atomic_write_bytes(tmp_path / "taken", b"x")
    assert os.listdir(tmp_path) == ["taken"]
    assert issubclass(PersistenceError, AprilError) and issubclass(PersistenceError, OSError)


def test_atomic_directory_replaces_whole_or_not_at_all(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as temp:
        atomic_write_text(os.path.join(temp, "a"), "old")
    with pytest.raises(ValueError, match="half way"):
        with atomic_directory(target) as temp:
            atomic_write_text(os.path.join(temp, "a"), "new")
            raise ValueError("half way")
    assert (target / "a").read_text() == "old"
    with atomic_directory(target) as temp:
        atomic_write_text(os.path.join(temp, "b"), "new")
    assert os.listdir(target) == ["b"]
    assert os.listdir(tmp_path) == ["ckpt"]


def test_temporaries_are_recognised():
    assert is_temporary(".step_000002.tmp-12-34-5")
    assert not is_temporary("step_000002") and not is_temporary("model.safetensors")


def test_digests_stream_the_file(tmp_path):
    data = os.urandom(3 * (1 << 20) + 17)
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    digest = digest_file(tmp_path / "f")
    assert digest.size == len(data) and digest.sha256 == hashlib.sha256(data).hexdigest()
    assert sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()
    with pytest.raises(PersistenceError, match="missing"):
        digest_file(tmp_path / "missing")
