"""Where a run's metrics go besides metrics.jsonl: TensorBoard event files and Weights & Biases.

Each sink takes the resolved config once at the start and then one metrics row per step (the rows of
metrics.jsonl: ``rollout/...``, ``train/...``, ``time/...``, and ``eval/...`` on evaluation steps).
Numbers become scalars under their row key; ``rollout/response_lens`` becomes a histogram; the
staleness histogram becomes one scalar per staleness (``rollout/staleness_histogram/k``). Both sinks need
``pip install 'april_ext[logging]'``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from april_ext.errors import ConfigError

TENSORBOARD_DIR = "tensorboard"


class MetricsSink(Protocol):
    def log(self, step: int, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row by key (lists of numbers under ``key/index``; other values left out)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in ("step", "rollout/response_lens"):
            continue
        if isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value)):
            out[key] = float(value)
        elif isinstance(value, list) and key.endswith("histogram"):
            out.update({f"{key}/{i}": float(v) for i, v in enumerate(value)})
    return out


def _missing(what: str, err: ImportError) -> ConfigError:
    return ConfigError(f"{what} needs a package that is not installed ({err}): pip install 'april_ext[logging]'")


class TensorBoardSink:
    """Event files under ``logdir`` (open them with ``tensorboard --logdir <output_dir>/tensorboard``);
    the config is the text ``config`` at step 0. ``resumed_from``: the step of the checkpoint a resumed run
    continues from: it writes on in the same directory, and TensorBoard drops the earlier run's events after
    that step (which the resumed run logs again)."""

    def __init__(self, logdir: str, config: Mapping[str, Any], resumed_from: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise _missing("use_tensorboard", err) from None
        self.logdir = logdir
        self._writer = SummaryWriter(log_dir=logdir, purge_step=None if resumed_from is None else resumed_from + 1)
        # Markdown code block, so TensorBoard's text tab keeps the JSON's layout.
        text = "    " + json.dumps(dict(config), indent=2, sort_keys=True).replace("\n", "\n    ")
        self._writer.add_text("config", text, global_step=0)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        for key, value in scalars(row).items():
            self._writer.add_scalar(key, value, global_step=step)
        lens = row.get("rollout/response_lens")
        if lens:
            self._writer.add_histogram("rollout/response_lens", np.asarray(lens), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One W&B run (project ``project``, in ``group`` when given, its directory under ``directory``) with the
    config as the run's config; WANDB_MODE=offline keeps it local (``wandb sync`` uploads it later).
    ``run_id``: the id of the run a resumed training continues (kept in its checkpoints), so its history
    stays one run; None starts a new one."""

    def __init__(self, project: str, directory: str, name: str, config: Mapping[str, Any], *,
                 group: str | None = None, run_id: str | None = None) -> None:
        try:
            import wandb
        except ImportError as err:
            raise _missing("use_wandb", err) from None
        os.makedirs(directory, exist_ok=True)
        self._run = wandb.init(project=project, dir=directory, name=name, group=group, config=dict(config),
                               id=run_id, resume=None if run_id is None else "allow", reinit="create_new")
        self.run_dir: str = self._run.dir
        self.run_id: str = self._run.id

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        self._run.log(scalars(row), step=step)

    def close(self) -> None:
        self._run.finish()


__all__ = ["TENSORBOARD_DIR", "MetricsSink", "TensorBoardSink", "WandbSink", "scalars"]
