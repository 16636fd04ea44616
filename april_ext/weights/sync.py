"""The one entry of a run's weight sync: the trainer's current weights into its engine, labelled with the
trainer's version. Written against the Trainer and RolloutEngine protocols, so every pair (torch or
Megatron, embedded or SGLang, one process or Ray) goes this way."""

from __future__ import annotations

from april_ext.protocol.rollout_engine import RolloutEngine, TrainerFedEngine
from april_ext.protocol.trainer import Trainer


async def sync_weights(trainer: Trainer, engine: RolloutEngine) -> None:
    """Named tensors in Hugging Face names, which every engine takes: the embedded engine copies them into its
    model, the SGLang engine sends them through the transport its weight_sync names (april_ext.weights
    .transport). An engine built with its trainer (TrainerFedEngine: a Ray run's) has the trainer's processes
    send them, so that this process never holds them."""
    if isinstance(engine, TrainerFedEngine):
        await engine.update_from_trainer(trainer.version)
    else:
        await engine.update_weights(trainer.export_weights(), trainer.version)


__all__ = ["sync_weights"]
