"""What passes between a run's trainer and its engine: new weights after each update, and (colocated)
the device memory, which one side releases while the other works. Written against the Trainer and
RolloutEngine protocols, so every pair (torch or Megatron, embedded or SGLang) goes the same way."""

from __future__ import annotations

from april_ext.protocol.rollout_engine import RolloutEngine, TrainerFedEngine
from april_ext.protocol.trainer import Trainer


async def sync_weights(trainer: Trainer, engine: RolloutEngine) -> None:
    """The trainer's current weights into the engine, labelled with the trainer's version: named tensors
    in Hugging Face names, which every engine takes (the embedded engine copies them into its model, the
    SGLang engine writes them to its weight-sync directory and has every server load them from disk). An
    engine built with its trainer (TrainerFedEngine: a Ray run's) has the trainer's processes send them."""
    if isinstance(engine, TrainerFedEngine):
        await engine.update_from_trainer(trainer.version)
    else:
        await engine.update_weights(trainer.export_weights(), trainer.version)


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


__all__ = ["StepMemory", "sync_weights"]
