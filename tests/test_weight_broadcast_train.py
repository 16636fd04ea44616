"""`april-ext train --engine sglang --weight-sync broadcast`: the run launches two `april-ext serve` workers and
broadcasts the trainer's weights to them after every step."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext import ConfigError, cli
from april_ext.model import load_pretrained
from april_ext.training import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--counting-median", "3.0", "--counting-sigma", "0.8", "--counting-max-count", "12", "--counting-symbols",
        "2", "--hidden-size", "16", "--num-layers", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--over-sampling-batch-size", "4", "--max-num-seqs", "64", "--num-blocks", "256", "--no-progress",
        "--no-plots"]


@pytest.mark.slow
def test_cli_train_broadcasts_weights_to_two_launched_workers(tmp_path) -> None:
    out = tmp_path / "run"
    code = cli.main(["train", *TINY, "--num-steps", "3", "--output-dir", str(out), "--engine", "sglang",
                     "--sglang-launch", "--sglang-num-servers", "2", "--sglang-module", "april_ext.server",
                     "--sglang-args", "--num-blocks 256 --max-running-requests 64 --seed 0 --weight-group-timeout 30",
                     "--sglang-launch-timeout-s", "120", "--weight-sync", "broadcast",
                     "--weight-sync-bucket-mb", "0.01"])
    assert code == 0
    with open(out / "metrics.jsonl", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # After each step's sync, both workers report the trainer's new version.
    assert [r["engine/server_weight_versions"] for r in rows] == [["1"], ["2"], ["3"]]
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rows)
    # Nothing went through the disk path.
    assert not os.path.exists(out / "sglang" / "weight_sync")
    assert load_pretrained(out / "checkpoints" / "step_000003" / "trainer") is not None


def test_weight_sync_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="weight_sync"):
        TrainConfig(weight_sync="nccl")
    with pytest.raises(ConfigError, match="weight_sync"):
        TrainConfig(weight_sync="broadcast")  # the embedded engine takes the trainer's tensors directly
    with pytest.raises(ConfigError, match="weight_sync_bucket_mb"):
        TrainConfig(weight_sync_bucket_mb=0.0)
