"""Where the engine's weights and KV cache live: allocator regions that can be released and resumed."""

from __future__ import annotations

import torch
from torch import nn

from april_ext.errors import InvalidStateError

try:
    from april_ext import memory as allocator
except ImportError:  # the allocator branch is not merged yet: plain torch memory, no release
    allocator = None

MEMORY_TAGS = ("weights", "kv_cache")


class MemoryPlacement:
    """Allocates the engine's tensors in the tagged regions of april_ext.memory and pauses/resumes them.

    The KV cache is released without a host copy (it is flushed and recomputed); the weights keep one
    when `weights_cpu_backup`, so resume restores them without a reload.
    """

    def __init__(self, device: torch.device, *, weights_cpu_backup: bool) -> None:
        self.device = device
        self.backup = {"weights": weights_cpu_backup, "kv_cache": False}
        self.paused_tags: set[str] = set()

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> torch.Tensor:
        if allocator is None:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        tensor = allocator.empty(shape, dtype, tag=tag, device=str(self.device), cpu_backup=self.backup[tag])
        return tensor.zero_()

    def place_module(self, module: nn.Module, tag: str) -> nn.Module:
        """Moves every parameter's storage into region `tag` (tied parameters stay tied)."""
        moved: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for sub in module.modules():
                for name, param in list(sub.named_parameters(recurse=False)):
                    key = id(param)
                    if key not in moved:
                        data = self.allocate(tuple(param.shape), param.dtype, tag)
                        data.copy_(param.detach())
                        moved[key] = nn.Parameter(data, requires_grad=False)
                    setattr(sub, name, moved[key])
        return module

    def is_paused(self, tag: str) -> bool:
        return tag in self.paused_tags

    def release(self, tags: list[str]) -> None:
        if allocator is None:
            raise InvalidStateError("april_ext.memory is not available: memory cannot be released")
        for tag in tags:
            if tag not in self.paused_tags:
                allocator.pause(tag)
                self.paused_tags.add(tag)

    def resume(self, tags: list[str]) -> None:
        for tag in tags:
            if tag in self.paused_tags:
                allocator.resume(tag)
                self.paused_tags.discard(tag)
