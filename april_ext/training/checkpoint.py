"""Run checkpoints: one directory per saved step, written atomically, the newest K kept.

A checkpoint ``<dir>/step_000012/`` holds ``trainer/`` (model, optimizer, RNG: Trainer.save_checkpoint),
``scheduler.state`` (buffer with every partial rollout, counters, data position: Scheduler.save) and
``run.json`` (the step and the metrics lines written so far). It is assembled in a temporary
directory, every file and directory is fsynced, and then it is renamed into place, so a process killed
at any moment leaves either the complete new checkpoint or none (temporary leftovers are ignored and
cleaned up).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from april_ext.errors import PersistenceError
from april_ext.scheduler import Scheduler
from april_ext.trainer import Trainer

_NAME = re.compile(r"^step_(\d{6,})$")
_RUN_FILE = "run.json"
_SCHEDULER_FILE = "scheduler.state"
_TRAINER_DIR = "trainer"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str


def _fsync_tree(root: str) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves and finds checkpoints under ``directory``, keeping the newest ``keep`` of them."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise PersistenceError(f"keep={keep!r} is not allowed: an int >= 1")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep = keep

    def list(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest first."""
        if not os.path.isdir(self.directory):
            return []
        out = []
        for name in os.listdir(self.directory):
            match = _NAME.match(name)
            if match and os.path.isfile(os.path.join(self.directory, name, _RUN_FILE)):
                out.append(CheckpointInfo(int(match.group(1)), os.path.join(self.directory, name)))
        return sorted(out, key=lambda c: c.step)

    def latest(self) -> CheckpointInfo | None:
        found = self.list()
        return found[-1] if found else None

    def save(self, step: int, trainer: Trainer, scheduler: Scheduler, run_state: dict[str, Any]) -> str:
        """Writes the checkpoint of ``step`` (the number of completed training steps) atomically."""
        final = os.path.join(self.directory, f"step_{step:06d}")
        try:
            os.makedirs(self.directory, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".step_{step:06d}.tmp-", dir=self.directory)
        except OSError as err:
            raise PersistenceError(f"cannot create a checkpoint in {self.directory!r}: {err}") from None
        try:
            trainer.save_checkpoint(os.path.join(tmp, _TRAINER_DIR))
            scheduler.save(os.path.join(tmp, _SCHEDULER_FILE))
            with open(os.path.join(tmp, _RUN_FILE), "w", encoding="utf-8") as handle:
                json.dump({"step": step, **run_state}, handle)
            _fsync_tree(tmp)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.directory)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PersistenceError(f"writing checkpoint {final!r} failed: {err}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return final

    def load(self, info: CheckpointInfo, trainer: Trainer, scheduler: Scheduler) -> dict[str, Any]:
        """Restores trainer and scheduler from a checkpoint; returns its run state (run.json)."""
        try:
            with open(os.path.join(info.path, _RUN_FILE), encoding="utf-8") as handle:
                run_state = json.load(handle)
        except (OSError, json.JSONDecodeError) as err:
            raise PersistenceError(f"{info.path}: unreadable {_RUN_FILE} ({err})") from None
        trainer.load_checkpoint(os.path.join(info.path, _TRAINER_DIR))
        scheduler.load(os.path.join(info.path, _SCHEDULER_FILE))
        return dict(run_state)

    def _prune(self) -> None:
        for info in self.list()[:-self.keep]:
            shutil.rmtree(info.path, ignore_errors=True)
        for name in os.listdir(self.directory):
            if name.startswith(".step_") and ".tmp-" in name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)


__all__ = ["CheckpointInfo", "CheckpointManager"]
