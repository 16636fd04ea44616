"""Torch tensors over allocator memory: on every device a tensor made here owns its allocation (a
DLPack capsule whose deleter frees it), so pausing its tag releases the tensor's memory while the
tensor object and its data pointer stay as they are."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from april_ext import _C
from april_ext.errors import InvalidArgumentError
from april_ext.memory.control import _check_tag, current_region
from april_ext.memory.devices import resolve

_mem = _C.memory
# Offsets of tensors packed into one allocation are multiples of this (covers every dtype and
# vectorized loads).
_PACK_ALIGN = 256
# torch addresses a tensor's bytes with int64: no allocation a tensor can view is larger than this.
MAX_TENSOR_BYTES = 2**63 - 1


def _check_shape(shape: object) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else shape
    if isinstance(dims, torch.Size):
        dims = tuple(dims)
    if not isinstance(dims, Sequence) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise InvalidArgumentError(f"shape={shape!r} is not allowed: use an int or a sequence of ints")
    if any(d < 0 for d in dims):
        raise InvalidArgumentError(f"shape={shape!r} is not allowed: dimensions must be >= 0")
    return tuple(dims)


def _check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype={dtype!r} is not allowed: use a torch.dtype")
    return dtype


def _resolve_tag(tag: str | None, cpu_backup: bool | None) -> tuple[str, bool]:
    """Explicit arguments win; otherwise the innermost region of this thread supplies them."""
    frame = current_region()
    if tag is None:
        if frame is None:
            raise InvalidArgumentError("tag=None is only allowed inside `with april_ext.memory.region(tag):`")
        tag = frame[0]
    _check_tag(tag)
    if cpu_backup is None:
        cpu_backup = frame[1] if frame is not None and frame[0] == tag else False
    if not isinstance(cpu_backup, bool):
        raise InvalidArgumentError(f"cpu_backup={cpu_backup!r} is not allowed: use True, False or None")
    return tag, cpu_backup


def _raw_bytes(nbytes: int, tag: str, device: str | torch.device, cpu_backup: bool) -> torch.Tensor:
    """A flat uint8 tensor of nbytes (> 0) that owns a new allocation."""
    kind, index, _ = resolve(device)
    addr = _mem.allocate(nbytes, kind, index, tag, cpu_backup)
    try:
        capsule = _mem.export_allocation(addr)
    except BaseException:
        _mem.free(addr)
        raise
    return torch.from_dlpack(capsule)


def empty(
    shape: int | Sequence[int],
    dtype: torch.dtype,
    *,
    tag: str,
    device: str | torch.device = "cpu",
    cpu_backup: bool = False,
) -> torch.Tensor:
    """An uninitialized contiguous tensor in allocator memory under tag.

    The tensor owns its allocation: it is freed when the tensor (and every view of it) dies. A
    tensor with no elements holds no allocation and is a plain torch tensor.
    """
    dims = _check_shape(shape)
    dtype = _check_dtype(dtype)
    tag, cpu_backup = _resolve_tag(tag, cpu_backup)
    _, _, dev = resolve(device)
    nbytes = math.prod(dims) * dtype.itemsize
    if nbytes > MAX_TENSOR_BYTES:
        # Not OutOfMemoryError: no device could ever hold it, so freeing memory and retrying cannot help.
        raise InvalidArgumentError(
            f"shape={shape!r} of {str(dtype).replace('torch.', '')} is {nbytes} bytes, over the largest tensor "
            f"of {MAX_TENSOR_BYTES} bytes (2**63 - 1, torch's int64 byte offsets)")
    if nbytes == 0:
        return torch.empty(dims, dtype=dtype, device=dev)
    return _raw_bytes(nbytes, tag, dev, cpu_backup).view(dtype).view(dims)


def _pack(tensors: Sequence[torch.Tensor], tag: str, cpu_backup: bool) -> list[torch.Tensor]:
    """Copies of tensors in one allocation per device, each a contiguous view at an aligned offset."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for device, indices in by_device.items():
        offsets = []
        total = 0
        for i in indices:
            offsets.append(total)
            total += -(-tensors[i].numel() * tensors[i].element_size() // _PACK_ALIGN) * _PACK_ALIGN
        raw = _raw_bytes(max(total, 1), tag, device, cpu_backup)
        for i, offset in zip(indices, offsets):
            src = tensors[i]
            nbytes = src.numel() * src.element_size()
            view = raw[offset : offset + nbytes].view(src.dtype).view(src.shape)
            view.copy_(src)
            out[i] = view
    return [t for t in out if t is not None]


def to_region(tensor: torch.Tensor, tag: str | None = None, *, cpu_backup: bool | None = None) -> torch.Tensor:
    """A contiguous copy of tensor in allocator memory under tag (default: the current region's),
    on the tensor's device."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"tensor={type(tensor).__name__} is not allowed: use a torch.Tensor")
    tag, cpu_backup = _resolve_tag(tag, cpu_backup)
    return _pack([tensor.detach()], tag, cpu_backup)[0]


def _move_into_region(holders: Iterable[torch.Tensor], tag: str, cpu_backup: bool) -> int:
    """Rebinds the .data of each distinct tensor to a packed copy; returns the bytes moved."""
    unique: dict[int, torch.Tensor] = {}
    for t in holders:
        unique.setdefault(id(t), t)
    tensors = list(unique.values())
    copies = _pack([t.detach() for t in tensors], tag, cpu_backup)
    for t, copy in zip(tensors, copies):
        t.data = copy
    return sum(t.numel() * t.element_size() for t in tensors)


def move_module_to_region(
    module: torch.nn.Module,
    tag: str | None = None,
    *,
    cpu_backup: bool | None = None,
    include_buffers: bool = True,
) -> int:
    """Moves the parameters (and buffers) of module into one allocation per device under tag.

    Parameter objects keep their identity (optimizers holding them stay valid); tied parameters
    stay tied. Gradients are not moved. Returns the number of bytes moved.
    """
    if not isinstance(module, torch.nn.Module):
        raise InvalidArgumentError(f"module={type(module).__name__} is not allowed: use a torch.nn.Module")
    tag, cpu_backup = _resolve_tag(tag, cpu_backup)
    holders = [p for p in module.parameters() if p.numel() > 0]
    if include_buffers:
        holders += [b for b in module.buffers() if b.numel() > 0]
    return _move_into_region(holders, tag, cpu_backup) if holders else 0


def move_optimizer_to_region(
    optimizer: torch.optim.Optimizer, tag: str | None = None, *, cpu_backup: bool | None = None
) -> int:
    """Moves the optimizer's state tensors (e.g. Adam moments) into one allocation per device under
    tag. Call it after the state exists (after the first step). Returns the number of bytes moved."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(f"optimizer={type(optimizer).__name__} is not allowed: use a torch.optim.Optimizer")
    tag, cpu_backup = _resolve_tag(tag, cpu_backup)
    keys: list[tuple[dict, str]] = []
    for state in optimizer.state.values():
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() > 0:
                keys.append((state, name))
    if not keys:
        return 0
    copies = _pack([state[name].detach() for state, name in keys], tag, cpu_backup)
    for (state, name), copy in zip(keys, copies):
        state[name] = copy
    return sum(c.numel() * c.element_size() for c in copies)


def allocation_info(tensor: torch.Tensor) -> dict:
    """What the allocator knows about the allocation a tensor from empty / to_region starts at: the keys
    addr, logical_bytes, physical_bytes, kind ("cpu", "cuda" or "hip"), index (the device index), tag,
    cpu_backup and paused."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"tensor={type(tensor).__name__} is not allowed: use a torch.Tensor")
    return dict(_mem.info(tensor.untyped_storage().data_ptr()))
