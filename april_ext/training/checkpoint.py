"""Run checkpoints: one directory per saved step, written atomically, checksummed, the newest K kept.

A checkpoint ``<dir>/step_000012/`` holds ``trainer/`` (model, optimizer, RNG: Trainer.save_checkpoint),
``scheduler.state`` (buffer with every partial rollout, counters, data position: Scheduler.save),
``environment.pkl`` when the rollout driver has state of its own (a multi-turn run's trajectories:
RolloutLoop.environment_state; a custom generate function's rewards: CustomGenerateRollout.environment_state),
``run.json`` (the step, the run's variant and the checkpoint format, RUN_FORMAT) and ``manifest.json`` (size
and sha256 of every other file). It is assembled in a temporary directory, every file and directory is fsynced, and
then it is renamed into place (april_ext.persistence.atomic_directory), so a process killed at any
moment leaves either the complete new checkpoint or none (temporary leftovers are ignored and cleaned
up). Loading checks every file against the manifest before anything is restored, so a damaged file
(truncated, overwritten, a flipped bit) raises CorruptStateError naming it; ``restore_newest`` (and
``check_resumable`` before a run starts) then falls back to the newest intact checkpoint. A damaged or
missing manifest, and a step directory without run.json, are damage like any other. Only a checkpoint
whose run.json carries no format (written by a version before RUN_FORMAT, some of them before manifests
existed) may lack a manifest: it is loaded unverified, with a warning.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from april_ext.errors import CorruptStateError, PersistenceError
from april_ext.persistence import (
    atomic_directory,
    atomic_write_json,
    digest_file,
    ensure_dir,
    is_temporary,
    read_json,
)
from april_ext.scheduler import Scheduler
from april_ext.trainer import Trainer
from april_ext.training.metrics import with_variant

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{6,})$")
_RUN_FILE = "run.json"
_SCHEDULER_FILE = "scheduler.state"
_ENVIRONMENT_FILE = "environment.pkl"
_TRAINER_DIR = "trainer"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "april_ext.checkpoint_manifest/1"
RUN_FORMAT = "april_ext.run_checkpoint/2"
"""run.json's ``format``: the checkpoint was written with a manifest, so one that lacks it is damaged."""
_FORMAT_KEY = "format"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str


def _files(root: str) -> list[str]:
    """Every file under ``root`` but the manifest, as sorted '/'-separated relative paths."""
    out = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if rel != MANIFEST_FILE:
                out.append(rel)
    return sorted(out)


def write_manifest(root: str) -> None:
    """Records size and sha256 of every file under ``root`` in ``root/manifest.json``."""
    files = {}
    for rel in _files(root):
        digest = digest_file(os.path.join(root, rel))
        files[rel] = {"size": digest.size, "sha256": digest.sha256}
    atomic_write_json(os.path.join(root, MANIFEST_FILE), {"format": MANIFEST_FORMAT, "files": files}, indent=1)


def verify_manifest(root: str) -> bool:
    """Checks every file listed in ``root/manifest.json`` (present, same size, same sha256): raises
    CorruptStateError naming the first damaged or missing file, a damaged manifest, or a missing one where
    run.json says RUN_FORMAT. Returns False when there is no manifest and run.json has no format (an older
    checkpoint, which cannot be checked), True when verified."""
    files = _listed_files(root)
    if files is None:
        return False
    manifest = os.path.join(root, MANIFEST_FILE)
    for rel, expected in sorted(files.items()):
        path = os.path.join(root, *rel.split("/"))
        if not os.path.isfile(path):
            raise CorruptStateError(f"{path}: missing (listed in {manifest})")
        digest = digest_file(path)
        if digest.size != expected["size"]:
            raise CorruptStateError(f"{path}: damaged: {digest.size} bytes, the manifest says {expected['size']}")
        if digest.sha256 != expected["sha256"]:
            raise CorruptStateError(f"{path}: damaged: sha256 {digest.sha256} differs from the manifest's "
                                    f"{expected['sha256']}")
    return True


def _manifest_files(root: str) -> dict[str, dict[str, Any]] | None:
    """The manifest's entries (relative path -> size and sha256); None without a manifest."""
    manifest = os.path.join(root, MANIFEST_FILE)
    if not os.path.exists(manifest):
        return None
    raw = read_json(manifest)
    files = raw.get("files") if isinstance(raw, dict) and raw.get("format") == MANIFEST_FORMAT else None
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
            for e in files.values()):
        raise CorruptStateError(f"{manifest}: not a {MANIFEST_FORMAT} manifest")
    return files


def _listed_files(root: str) -> dict[str, dict[str, Any]] | None:
    """The manifest's entries; None for an older checkpoint without one; CorruptStateError for a damaged
    manifest, or a missing one where run.json says RUN_FORMAT."""
    files = _manifest_files(root)
    if files is None and _written_with_manifest(root):
        raise CorruptStateError(f"{os.path.join(root, MANIFEST_FILE)}: missing, though run.json says the checkpoint "
                                f"was written with one ({RUN_FORMAT})")
    return files


def _written_with_manifest(root: str) -> bool:
    """Whether run.json carries RUN_FORMAT (this version's checkpoints always have a manifest); a missing or
    unreadable run.json is damage (CorruptStateError): a complete checkpoint has one."""
    run_file = os.path.join(root, _RUN_FILE)
    if not os.path.isfile(run_file):
        raise CorruptStateError(f"{run_file}: missing (every complete checkpoint has one)")
    run = read_json(run_file)
    if not isinstance(run, dict):
        raise CorruptStateError(f"{run_file}: not a run state (a JSON object)")
    return run.get(_FORMAT_KEY) == RUN_FORMAT


def _presence_problem(root: str) -> str | None:
    """Why the checkpoint at ``root`` is damaged, found without reading any file's bytes but run.json's and the
    manifest's: run.json or the manifest missing or damaged, or a file the manifest lists absent; None when
    nothing is (or, for an older checkpoint without a manifest, nothing can be checked)."""
    try:
        files = _listed_files(root)
    except CorruptStateError as err:
        return str(err)
    if files is None:
        return None
    paths = (os.path.join(root, *rel.split("/")) for rel in sorted(files))
    absent = next((path for path in paths if not os.path.isfile(path)), None)
    return None if absent is None else f"{absent}: missing (listed in {os.path.join(root, MANIFEST_FILE)})"


class CheckpointManager:
    """Saves and finds checkpoints under ``directory``, keeping the newest ``keep`` of them."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise PersistenceError(f"keep={keep!r} is not allowed: an int >= 1")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep = keep

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint directory (``step_N``), oldest first. Each was renamed into place complete, so one
        without run.json is damaged: loading or checking it says so, and the older ones are used instead."""
        if not os.path.isdir(self.directory):
            return []
        out = []
        for name in os.listdir(self.directory):
            match = _NAME.match(name)
            if match and os.path.isdir(os.path.join(self.directory, name)):
                out.append(CheckpointInfo(int(match.group(1)), os.path.join(self.directory, name)))
        return sorted(out, key=lambda c: c.step)

    def latest(self) -> CheckpointInfo | None:
        found = self.list()
        return found[-1] if found else None

    def save(self, step: int, trainer: Trainer, scheduler: Scheduler, run_state: dict[str, Any],
             environment: bytes | None = None) -> str:
        """Writes the checkpoint of ``step`` (the number of completed training steps) atomically, with a
        multi-turn run's ``environment`` state of the same moment as the scheduler's."""
        final = os.path.join(ensure_dir(self.directory), f"step_{step:06d}")
        with atomic_directory(final) as tmp:
            trainer.save_checkpoint(os.path.join(tmp, _TRAINER_DIR))
            scheduler.save(os.path.join(tmp, _SCHEDULER_FILE))
            if environment is not None:
                with open(os.path.join(tmp, _ENVIRONMENT_FILE), "wb") as handle:
                    handle.write(environment)
            atomic_write_json(os.path.join(tmp, _RUN_FILE), {_FORMAT_KEY: RUN_FORMAT, "step": step, **run_state})
            write_manifest(tmp)
        self._prune()
        return final

    def verify(self, info: CheckpointInfo) -> bool:
        """Checks the checkpoint's files against its manifest (CorruptStateError naming a damaged file, a
        damaged manifest, or a missing manifest or run.json); False for an older checkpoint without a manifest,
        which cannot be checked."""
        return verify_manifest(info.path)

    def load(self, info: CheckpointInfo, trainer: Trainer, scheduler: Scheduler) -> dict[str, Any]:
        """Verifies the checkpoint, then restores trainer and scheduler from it; returns its run state
        (run.json but its format; the variant under metrics.VARIANT, also from a checkpoint that wrote it under
        "mode"). A damaged checkpoint raises CorruptStateError before anything is restored."""
        if not self.verify(info):
            logger.warning("checkpoint %s has no %s (written by an older april_ext): loading it unverified",
                           info.path, MANIFEST_FILE)
        run_state = dict(read_json(os.path.join(info.path, _RUN_FILE)))
        run_state.pop(_FORMAT_KEY, None)
        trainer.load_checkpoint(os.path.join(info.path, _TRAINER_DIR))
        scheduler.load(os.path.join(info.path, _SCHEDULER_FILE))
        return with_variant(run_state)

    def run_state(self, info: CheckpointInfo) -> dict[str, Any]:
        """A checkpoint's run state (run.json: the step, the variant, the W&B run id), as ``load`` returns it."""
        return with_variant(dict(read_json(os.path.join(info.path, _RUN_FILE))))

    def read_environment(self, info: CheckpointInfo) -> bytes | None:
        """The multi-turn environment state a loaded checkpoint holds (checked with the rest by ``load``'s
        manifest check); None when it has none."""
        path = os.path.join(info.path, _ENVIRONMENT_FILE)
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as handle:
            return handle.read()

    def restore_newest(self, trainer: Trainer, scheduler: Scheduler) -> CheckpointInfo | None:
        """Loads the newest checkpoint that is intact and returns it, logging a warning for each newer
        damaged one and the one used instead; None when there is no checkpoint, CorruptStateError when
        every one is damaged. (A damaged checkpoint without a manifest may fail after part of it was
        restored; the older one loaded next overwrites all of it.)"""
        damaged: dict[str, str] = {}
        for info in reversed(self.list()):
            try:
                self.load(info, trainer, scheduler)
            except CorruptStateError as err:
                logger.warning("checkpoint %s is damaged: %s", info.path, err)
                damaged[info.path] = str(err)
                continue
            if damaged:
                logger.warning("resuming from checkpoint %s instead of the damaged newer %s", info.path,
                               ", ".join(damaged))
            return info
        if damaged:
            raise CorruptStateError(f"every checkpoint under {self.directory!r} is damaged: "
                                    + "; ".join(damaged.values()))
        return None

    def check_resumable(self, check_trainer: Callable[[str], None]) -> None:
        """Before a run starts (its ranks launched, its model built): the file presence part of
        ``restore_newest``, reading no file's bytes but run.json's and the manifest's. The checkpoint it would
        load, the newest with an intact run.json and manifest whose files are all there, has its trainer
        directory checked by ``check_trainer`` (which raises, e.g. PersistenceError for a sharded checkpoint
        lacking a shard); each newer one is logged as damaged; CorruptStateError when every checkpoint is
        damaged, as ``restore_newest`` would raise."""
        damaged = []
        for info in reversed(self.list()):
            problem = _presence_problem(info.path)
            if problem is None:
                check_trainer(os.path.join(info.path, _TRAINER_DIR))
                return
            logger.warning("checkpoint %s is damaged: %s", info.path, problem)
            damaged.append(problem)
        if damaged:
            raise CorruptStateError(f"every checkpoint under {self.directory!r} is damaged: " + "; ".join(damaged))

    def _prune(self) -> None:
        for info in self.list()[:-self.keep]:
            shutil.rmtree(info.path, ignore_errors=True)
        for name in os.listdir(self.directory):
            if is_temporary(name):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)


__all__ = ["MANIFEST_FILE", "RUN_FORMAT", "CheckpointInfo", "CheckpointManager", "verify_manifest", "write_manifest"]
