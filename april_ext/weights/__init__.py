"""Weight sync, in one place: how a trainer's new weights reach the engines, in one direction.

    trainer export  ->  transport  ->  engine update

- sync.py: the run's one entry, ``sync_weights(trainer, engine)`` after each update.
- sources.py: what the trainer side hands over (named tensors, a checkpoint directory, a BroadcastSource /
  StagedSource read bucket by bucket by the process holding it, a TensorPoster). Each trainer exports its
  own: the torch and Megatron trainers' ``export_weights``, a Ray trainer group's ranks
  (april_ext.cluster.rank_export), which implement these protocols.
- transport.py: ``push_weights``, the three transports of SGLangEngineConfig.weight_sync: "disk"
  (/update_weights_from_disk), "tensor" (/update_weights_from_tensor per bucket) and "broadcast"
  (broadcast.py, the HTTP side of SGLang's collective update; sender.py, its collective side, rank 0 of the
  group, where the tensors are; group.py, the process group as SGLang joins it).
- workers.py: what the transports need of an engine's workers (the SGLang adapter's WorkerPool is one).
- receive.py: the embedded server's end of the collective update (its endpoints). The embedded engine takes
  named tensors itself (AsyncEngine.update_weights copies them into its model).

Nothing here imports an engine, a trainer or the cluster: they import this.
"""

from __future__ import annotations

from april_ext.weights.broadcast import WeightBroadcastError, WeightBroadcaster
from april_ext.weights.sender import LocalHost, LocalSource, WeightSender
from april_ext.weights.sources import (
    BroadcastSource,
    BucketMeta,
    GroupHost,
    StagedSource,
    TensorPoster,
    WeightsSource,
    buckets,
)
from april_ext.weights.sync import sync_weights
from april_ext.weights.transport import post_tensors, push_weights

__all__ = [
    "BroadcastSource",
    "BucketMeta",
    "GroupHost",
    "LocalHost",
    "LocalSource",
    "StagedSource",
    "TensorPoster",
    "WeightBroadcastError",
    "WeightBroadcaster",
    "WeightSender",
    "WeightsSource",
    "buckets",
    "post_tensors",
    "push_weights",
    "sync_weights",
]
