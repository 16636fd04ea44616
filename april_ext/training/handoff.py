"""Colocated runs: the device memory that passes between a run's trainer and its engine, which one side
releases while the other works (new weights go through april_ext.weights.sync_weights). Written against the
Trainer and RolloutEngine protocols, so every pair (torch or Megatron, embedded or SGLang) goes the same way."""

from __future__ import annotations

from april_ext.protocol.rollout_engine import RolloutEngine
from april_ext.protocol.trainer import Trainer
from april_ext.weights.sync import sync_weights


class StepMemory:
    """Colocated mode: who holds memory when. The engine's memory is released while the trainer trains,
    the trainer's is paused while the engine generates (april_ext.memory under both)."""

    def __init__(self, engine: RolloutEngine, trainer: Trainer) -> None:
        self.engine = engine
        self.trainer = trainer

    async def to_rollout(self) -> None:
        self.trainer.offload()
        await self.engine.resume_memory(None)

    async def to_training(self) -> None:
        await self.engine.release_memory(None)
        self.trainer.onload()

    async def sync_weights(self) -> None:
        """New weights into the engine (its weights resumed for the copy, the KV cache still released)."""
        await self.engine.resume_memory(["weights"])
        await sync_weights(self.trainer, self.engine)

    async def finish(self) -> None:
        """Both sides resident again (for the final checkpoint and a clean shutdown)."""
        self.trainer.onload()
        await self.engine.resume_memory(None)


__all__ = ["StepMemory"]
