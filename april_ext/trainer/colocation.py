"""Colocated mode: a trainer's weights, gradients and optimizer state in one april_ext.memory tag, so
that pausing the tag releases them all while the engine generates (weights and optimizer state with a
host backup; gradients, zero between steps, without)."""

from __future__ import annotations

import torch

from april_ext.model import LlamaForCausalLM


def move_to_region(models: list[LlamaForCausalLM], params: list[torch.nn.Parameter], tag: str,
                   device: torch.device) -> list[torch.Tensor]:
    """The models' parameters into the tag (backed up), and one flat gradient buffer per dtype for
    ``params`` (not backed up); returns the buffers (each ``.grad`` of ``params`` is a view of one)."""
    from april_ext import memory

    for model in models:
        memory.move_module_to_region(model, tag, cpu_backup=True)
    # One flat gradient buffer per dtype; autograd accumulates into existing .grad tensors in place.
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    buffers = []
    for dtype, group in by_dtype.items():
        flat = memory.empty(sum(p.numel() for p in group), dtype, tag=tag, device=device, cpu_backup=False)
        flat.zero_()
        offset = 0
        for p in group:
            p.grad = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        buffers.append(flat)
    return buffers


def move_optimizer_to_region(optimizer: torch.optim.Optimizer, tag: str) -> None:
    """The optimizer's state tensors into the tag (backed up); they exist only after its first step."""
    from april_ext import memory

    memory.move_optimizer_to_region(optimizer, tag, cpu_backup=True)


__all__ = ["move_optimizer_to_region", "move_to_region"]
