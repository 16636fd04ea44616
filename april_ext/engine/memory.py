"""Where the engine's weights and KV cache live: allocator regions that can be released and resumed."""

from __future__ import annotations

import torch
from torch import nn

from april_ext import memory as allocator

# The memory tags (protocol.memory_tags) that own an allocator region; "cuda_graph" owns none here.
REGION_TAGS = ("weights", "kv_cache")


class MemoryPlacement:
    """Puts the engine's tensors in tagged regions of april_ext.memory and pauses / resumes them.

    Allocator tags are process-wide, so each engine's tags are `tag_prefix + "weights"` and
    `tag_prefix + "kv_cache"`. Each keeps a host copy while released when asked (`weights_cpu_backup`,
    `kv_cache_cpu_backup`), so resume restores it bit-exactly; a KV cache without one is flushed by the
    engine before release and recomputed. While a tag is released its tensors must not be touched.
    """

    def __init__(self, device: torch.device, *, tag_prefix: str, weights_cpu_backup: bool,
                 kv_cache_cpu_backup: bool) -> None:
        self.device = device
        self.tag_prefix = tag_prefix
        self.backup = {"weights": weights_cpu_backup, "kv_cache": kv_cache_cpu_backup}
        self.paused_tags: set[str] = set()

    def region_tag(self, tag: str) -> str:
        return self.tag_prefix + tag

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> torch.Tensor:
        tensor = allocator.empty(shape, dtype, tag=self.region_tag(tag), device=self.device,
                                 cpu_backup=self.backup[tag])
        return tensor.zero_()

    def place_module(self, module: nn.Module, tag: str) -> nn.Module:
        """Moves the module's parameters into region `tag` in place (identity and ties are kept)."""
        allocator.move_module_to_region(module, self.region_tag(tag), cpu_backup=self.backup[tag])
        return module

    def is_paused(self, tag: str) -> bool:
        return tag in self.paused_tags

    def release(self, tags: list[str]) -> None:
        for tag in (t for t in tags if t in REGION_TAGS):
            if tag not in self.paused_tags:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                allocator.pause(self.region_tag(tag))
                self.paused_tags.add(tag)

    def resume(self, tags: list[str]) -> None:
        for tag in (t for t in tags if t in REGION_TAGS):
            if tag in self.paused_tags:
                allocator.resume(self.region_tag(tag))
                self.paused_tags.discard(tag)

    def resident_bytes(self) -> dict[str, int]:
        """Physical bytes mapped now per tag with a region (0 while released)."""
        stats = allocator.stats()
        return {tag: stats[self.region_tag(tag)].resident_bytes if self.region_tag(tag) in stats else 0
                for tag in REGION_TAGS}
