"""Group filters for the rollout loop: decide whether a finished, rewarded group is trained on."""

from __future__ import annotations

from collections.abc import Sequence


def reject_uniform_groups(rewards: Sequence[float]) -> bool:
    """DAPO dynamic sampling: keep a group only when its rewards are not all equal.

    A group whose samples all earn the same reward has zero GRPO advantage everywhere, so it would add
    tokens to the step without any gradient. Returns True to keep the group.
    """
    values = list(rewards)
    return len(values) > 0 and any(v != values[0] for v in values[1:])
