"""Deprecated: the collective weight update moved to april_ext.weights (docs/weight_sync.md). The names
users caught or built from here still resolve there, with a DeprecationWarning."""

from __future__ import annotations

from april_ext.deprecation import renamed

__getattr__ = renamed(__name__, {
    "WeightBroadcastError": "april_ext.weights.broadcast.WeightBroadcastError",
    "WeightBroadcaster": "april_ext.weights.broadcast.WeightBroadcaster",
    "WeightSender": "april_ext.weights.sender.WeightSender",
    "BroadcastSource": "april_ext.weights.sources.BroadcastSource",
    "StagedSource": "april_ext.weights.sources.StagedSource",
    "GroupHost": "april_ext.weights.sources.GroupHost",
    "BucketMeta": "april_ext.weights.sources.BucketMeta",
})
