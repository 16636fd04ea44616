"""Turns the device arguments users pass (``"cpu"``, ``"cuda:1"``, ``torch.device``) into the
(backend kind, index) pairs of the C++ core."""

from __future__ import annotations

import torch

from april_ext.errors import InvalidArgumentError


def gpu_kind() -> str:
    """The allocator backend behind torch's "cuda" devices: "hip" on ROCm builds of torch."""
    return "hip" if getattr(torch.version, "hip", None) else "cuda"


def resolve(device: str | torch.device) -> tuple[str, int, torch.device]:
    """Returns (kind, index, torch device) for a cpu or cuda device argument."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"device={device!r} is not a device: use 'cpu', 'cuda' or 'cuda:N'") from exc
    if dev.type == "cpu":
        return "cpu", 0, torch.device("cpu")
    if dev.type == "cuda":
        if dev.index is not None:
            index = dev.index
        else:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return gpu_kind(), index, torch.device("cuda", index)
    raise InvalidArgumentError(f"device={device!r} is not allowed: use 'cpu', 'cuda' or 'cuda:N'")
