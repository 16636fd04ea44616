"""The error of the Ray layer: an actor died, stalled past its timeout, or could not be placed."""

from __future__ import annotations

from april_ext.errors import AprilError


class ClusterError(AprilError, RuntimeError):
    """A trainer rank or engine actor died or did not answer in time, or the cluster cannot hold the
    topology; the message names the actor and what the run does about it."""


class NoEngineLeftError(ClusterError):
    """A weight update failed and no engine that gets requests survived to take it again; the message names
    the update's failure (its __cause__) and the engines taken out."""


__all__ = ["ClusterError", "NoEngineLeftError"]
