"""ProcessTrainer: a trainer in a child process of its own, behind the Trainer protocol.

An asynchronous run on one machine trains while the embedded engine generates. In one process the two share one
interpreter lock, and with small models most of a step is Python holding it, so they would take turns instead of
overlapping; in a child process the trainer has its own, and each side runs on its own cores. The child is
spawned (a fork of a process with running threads is unsafe), builds the trainer with ``build(*args)`` and answers
one call at a time over a pipe. Tensors cross it in shared memory (torch.multiprocessing's pickling), so an
exported policy is not copied through the pipe. The child ends when its pipe closes: with :meth:`close`, or when
this process dies (even by SIGKILL).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from april_ext.batch import TrainingBatch
from april_ext.errors import InternalError
from april_ext.protocol.trainer import ExportedWeights, Trainer


def _serve(conn: Any, build: Callable[..., Trainer], args: tuple[Any, ...], num_threads: int, seed: int) -> None:
    """The child's loop: builds the trainer, then runs each call it receives and answers with the result or the
    error (the error itself where it pickles, else its text)."""
    torch.set_num_threads(num_threads)
    torch.manual_seed(seed)
    try:
        trainer = build(*args)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", _picklable(err)))
        return
    conn.send(("ok", trainer.version))
    while True:
        try:
            method, call_args, call_kwargs = conn.recv()
        except EOFError:  # the parent closed the pipe or died
            return
        if method == "close":
            conn.send(("ok", None))
            return
        try:
            result = getattr(trainer, method)(*call_args, **call_kwargs)
            if isinstance(result, ExportedWeights):
                # Copies: the live parameters change with the next update, the stream is read after it returns.
                result = (result.version, [(name, t.detach().to("cpu", copy=True)) for name, t in result.tensors])
            conn.send(("ok", (result, trainer.version)))
        except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises it
            conn.send(("error", _picklable(err)))


def _picklable(err: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any error that does not survive pickling is sent as its text
        return InternalError(f"the trainer process raised {type(err).__name__}: {err}\n{traceback.format_exc()}")


class ProcessTrainer:
    """The trainer ``build(*args)`` makes, run in a spawned child process with ``num_threads`` intra-op threads
    and torch seeded with ``seed``; it answers each Trainer call in turn. ``build`` and ``args`` must pickle (a
    module-level function; a model is sent by value, a checkpoint directory by name). Use as a context manager,
    or call :meth:`close`."""

    def __init__(self, build: Callable[..., Trainer], args: tuple[Any, ...] = (), *, num_threads: int = 1,
                 seed: int = 0, start_timeout_s: float = 300.0) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, build, args, num_threads, seed), daemon=True,
                                        name="april-ext-trainer")
        self._process.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise InternalError(f"the trainer process did not start within {start_timeout_s} s")
        self._version = int(self._answer())

    @property
    def version(self) -> int:
        return self._version

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        return self._call("train_step", batch)

    def export_weights(self, *, to_cpu: bool = False) -> ExportedWeights:
        version, tensors = self._call("export_weights", to_cpu=True)
        return ExportedWeights(version, tensors)

    def save_checkpoint(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        self._call("save_checkpoint", os.fspath(path), extra)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        return self._call("load_checkpoint", os.fspath(path))

    def offload(self) -> None:
        self._call("offload")

    def onload(self) -> None:
        self._call("onload")

    def close(self) -> None:
        """Ends the child (it finishes the call it is in); killed if it does not end within 30 s."""
        if self._process.is_alive() and not self._conn.closed:
            try:
                self._conn.send(("close", (), {}))
                if self._conn.poll(30):
                    self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                pass
        if not self._conn.closed:
            self._conn.close()
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def __enter__(self) -> ProcessTrainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            self._conn.send((method, args, kwargs))
        except (OSError, BrokenPipeError):
            raise self._gone() from None
        result, self._version = self._answer()
        return result

    def _answer(self) -> Any:
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._gone() from None
        if status == "error":
            raise value
        return value

    def _gone(self) -> InternalError:
        self._process.join(5)
        return InternalError(f"the trainer process (pid {self._process.pid}) ended (exit code "
                             f"{self._process.exitcode}); its error is printed above")


__all__ = ["ProcessTrainer"]
