"""Metrics sinks: TensorBoard event files and a W&B offline run, read back; the resolved config logged."""

from __future__ import annotations

import glob
import json
import os
import struct

import pytest
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext.training import TrainConfig, train
from april_ext.training.sinks import scalars

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"counting_max_count": 12, "counting_symbols": 2, "hidden_size": 16, "num_layers": 1,
        "rollout_batch_size": 2, "n_samples_per_prompt": 4, "over_sampling_batch_size": 4, "max_num_seqs": 64,
        "num_blocks": 256, "progress": False, "plots": False, "num_steps": 2}


def _rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def test_scalars_keep_numbers_and_spread_the_staleness_histogram():
    row = {"step": 3, "variant": "april", "rollout/reward_mean": 0.5, "rollout/staleness_histogram": [6, 2],
           "rollout/response_lens": [1, 2], "train/loss": float("nan"), "train/skipped": True}
    assert scalars(row) == {"rollout/reward_mean": 0.5, "rollout/staleness_histogram/0": 6.0,
                            "rollout/staleness_histogram/1": 2.0, "train/skipped": 1.0}


def test_tensorboard_event_files_hold_the_metrics_and_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    train(TrainConfig(**TINY, output_dir=str(out), use_tensorboard=True))
    rows = _rows(out / "metrics.jsonl")
    logdir = out / "tensorboard"
    assert glob.glob(str(logdir / "events.out.tfevents.*"))
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    events.Reload()
    for key in ("rollout/reward_mean", "rollout/tokens_per_s", "train/loss", "time/step_s"):
        logged = events.Scalars(key)
        assert [e.step for e in logged] == [1, 2]
        assert [e.value for e in logged] == pytest.approx([r[key] for r in rows], rel=1e-6)
    assert [e.step for e in events.Histograms("rollout/response_lens")] == [1, 2]
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"rollout_batch_size": 2' in config_text
    # The resolved config is also written next to metrics.jsonl at the start.
    config = json.loads((out / "config.json").read_text())
    assert config["rollout_batch_size"] == 2 and config["over_sampling_batch_size"] == 4
    assert config["checkpoint_dir"] == str(out / "checkpoints")


def _wandb_records(path: str):
    """The records of a .wandb file: a 7-byte header, then LevelDB-log framing (32 KiB blocks; each chunk a
    7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as handle:
        data = handle.read()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


@pytest.mark.slow
def test_wandb_offline_run_directory_holds_the_metrics_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "120")
    out = tmp_path / "run"
    train(TrainConfig(**TINY, output_dir=str(out), use_wandb=True, wandb_project="april-test"))
    rows = _rows(out / "metrics.jsonl")
    runs = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    history, config = [], {}
    for record in _wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    assert [h["_step"] for h in history] == [1, 2]
    for logged, row in zip(history, rows):
        assert logged["rollout/reward_mean"] == pytest.approx(row["rollout/reward_mean"])
        assert logged["train/loss"] == pytest.approx(row["train/loss"])
    assert config["rollout_batch_size"] == 2 and config["use_wandb"] is True and config["variant"] == "april"
    assert os.path.isdir(os.path.dirname(runs[0]))


def test_evaluation_rows_reach_metrics_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    train(TrainConfig(**{**TINY, "num_steps": 4}, output_dir=str(out), use_tensorboard=True, eval_interval=2,
                      n_samples_per_eval_prompt=3, eval_counting_prompts=5))
    rows = _rows(out / "metrics.jsonl")
    evaluated = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    for r in evaluated:
        assert r["eval/prompts"] == 5 and 0 <= r["eval/pass@1"] <= r["eval/pass@3"] <= 1
        assert 0 <= r["eval/reward_mean"] <= 1 and r["time/eval_s"] > 0
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("eval/reward_mean")] == [2, 4]


def _drop_newest_checkpoint(out) -> None:
    """As if the run had been killed after its last periodic checkpoint: the final one is gone."""
    import shutil

    newest = sorted((out / "checkpoints").iterdir())[-1]
    shutil.rmtree(newest)


def test_a_resumed_run_continues_its_tensorboard_history(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    base = dict(TINY, output_dir=str(out), use_tensorboard=True, save_interval=2)
    train(TrainConfig(**{**base, "num_steps": 3}))
    _drop_newest_checkpoint(out)  # the run resumes at step 2; its step 3 is logged again
    result = train(TrainConfig(**{**base, "num_steps": 4}, resume=True))
    assert result.resumed_from == 2
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    logged = events.Scalars("rollout/reward_mean")
    rows = _rows(out / "metrics.jsonl")
    assert [e.step for e in logged] == [1, 2, 3, 4]
    assert [e.value for e in logged] == pytest.approx([r["rollout/reward_mean"] for r in rows], rel=1e-6)


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run_in_its_group(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "120")
    out = tmp_path / "run"
    base = dict(TINY, output_dir=str(out), use_wandb=True, wandb_project="april-test", wandb_group="g1",
                save_interval=2)
    train(TrainConfig(**{**base, "num_steps": 3}))
    _drop_newest_checkpoint(out)
    train(TrainConfig(**{**base, "num_steps": 4}, resume=True))
    # In the order they were written: two sessions in one second share a directory name but for a "-1" suffix,
    # which sorts before the first's.
    runs = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")), key=os.path.getmtime)
    assert len(runs) == 2
    ids, steps, groups = [], [], []
    for path in runs:
        history = []
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.append(record.run.run_id)
                groups.append(record.run.run_group)
            elif kind == "history":
                history.append(next(json.loads(i.value_json) for i in record.history.item
                                    if (i.key or "/".join(i.nested_key)) == "_step"))
        steps.append(history)
    # One W&B run: the resumed session logs under the first one's id from the checkpoint's step on.
    assert len(set(ids)) == 1 and set(groups) == {"g1"}
    assert steps == [[1, 2, 3], [3, 4]]
    state = json.loads((out / "checkpoints" / "step_000004" / "run.json").read_text())
    assert state["wandb_run_id"] == ids[0]
