"""A trainer checkpoint directory: the weights the trainer writes (a Hugging Face checkpoint, plus the
KL reference), and ``trainer_state.pt`` (format, version, step, optimizer, RNG states, trainer config,
the caller's ``extra``). Written in a temporary directory next to the target and renamed into place."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from april_ext.errors import CorruptStateError, InvalidArgumentError, PersistenceError
from april_ext.persistence import atomic_directory, atomic_write, ensure_dir

STATE_FILE = "trainer_state.pt"
REFERENCE_FILE = "reference.safetensors"

_EXTRA_LEAVES = (type(None), bool, int, float, str, bytes, torch.Tensor)


def write_checkpoint(path: str | os.PathLike[str], save_weights: Callable[[str], None],
                     state: dict[str, Any]) -> None:
    """``save_weights(directory)`` and ``state`` into a temporary directory next to ``path``, then renamed
    to ``path`` (april_ext.persistence.atomic_directory): it holds either the previous checkpoint or the
    complete new one."""
    path = os.path.abspath(os.fspath(path))
    ensure_dir(os.path.dirname(path))
    with atomic_directory(path) as tmp:
        save_weights(tmp)
        atomic_write(os.path.join(tmp, STATE_FILE), lambda temp: torch.save(state, temp))


def read_state(path: str, checkpoint_format: str) -> dict[str, Any]:
    """The trainer state of the checkpoint directory ``path``, which must be of ``checkpoint_format``."""
    state_file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_file):
        raise PersistenceError(f"{path!r} is not a trainer checkpoint: {STATE_FILE} is missing")
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises pickle / zip / runtime errors for damaged files
        raise CorruptStateError(f"{state_file}: unreadable trainer state ({err})") from None
    if not isinstance(state, dict) or state.get("format") != checkpoint_format:
        raise CorruptStateError(f"{state_file}: not a {checkpoint_format} state")
    return state


def check_extra(value: Any, where: str) -> None:
    """Rejects at save time what torch.load(weights_only=True) could not read back."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise InvalidArgumentError(f"{where} has a key {key!r} of type {type(key).__name__}; "
                                           f"keys must be str or int")
            check_extra(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_extra(item, f"{where}[{i}]")
    elif not isinstance(value, _EXTRA_LEAVES):
        raise InvalidArgumentError(f"{where} is a {type(value).__name__}; a checkpoint's extra may hold "
                                   f"tensors, numbers, strings, bytes, None, lists, tuples and dicts")


def plain(value: Any) -> Any:
    """Config values as types torch.load(weights_only=True) accepts."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def rng_state() -> dict[str, Any]:
    """The torch, CUDA, numpy and Python RNG states, as types torch.load(weights_only=True) accepts."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": plain(random.getstate()),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npst = state["numpy"]
    np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


__all__ = ["REFERENCE_FILE", "STATE_FILE", "check_extra", "plain", "read_state", "rng_state", "set_rng_state",
           "write_checkpoint"]
