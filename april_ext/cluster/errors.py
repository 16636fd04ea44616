"""The error of the Ray layer: an actor died, stalled past its timeout, or could not be placed."""

from __future__ import annotations

from april_ext.errors import AprilError


class ClusterError(AprilError, RuntimeError):
    """A trainer rank or engine actor died or did not answer in time, or the cluster cannot hold the
    topology; the message names the actor and what the run does about it."""


__all__ = ["ClusterError"]
