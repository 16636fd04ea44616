"""Damaged checkpoints are detected, named, and skipped on resume. The checkpoints are real: written by a
short training run (the trainer's and scheduler's own save paths), then damaged on disk: a flipped
byte in each file, a truncated or garbage model.safetensors, a missing manifest (an older checkpoint)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import pytest

from april_ext import CorruptStateError, Scheduler, SchedulerConfig
from april_ext.model import LlamaForCausalLM, ModelConfig, iter_safetensors, load_pretrained, save_pretrained
from april_ext.tasks import CountingTask, CountingTaskConfig
from april_ext.trainer import TorchTrainer, TrainerConfig
from april_ext.training import CheckpointManager, TrainConfig, train
from april_ext.cli.train import check_before_start
from april_ext.training.checkpoint import RUN_FORMAT, write_manifest
from april_ext.training.metrics import read_metrics

from _torch_threads import one_thread, one_torch_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(counting_median=3.0, counting_sigma=0.8, counting_max_count=12, counting_symbols=2, hidden_size=16,
            num_layers=1, rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4,
            max_num_seqs=64, num_blocks=256, lr=0.003, progress=False, plots=False, save_interval=1,
            keep_checkpoints=3)
FILES = ["manifest.json", "run.json", "scheduler.state", "trainer/config.json", "trainer/model.safetensors",
         "trainer/trainer_state.pt"]


def tiny(output_dir, **changes) -> TrainConfig:
    return TrainConfig(**{**TINY, "output_dir": str(output_dir), "num_steps": 2, **changes})


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A finished 2-step run with checkpoints step_000001 and step_000002 (copied per test)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    with one_torch_thread():
        train(tiny(out))
    return out


@pytest.fixture
def run_dir(trained_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    return copy


def _flip(path, offset_fraction: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * offset_fraction)] ^= 0x10
    path.write_bytes(bytes(data))


def _restore_into_fresh(run_dir, info):
    """Loads a checkpoint into a fresh trainer and scheduler of the run's shape."""
    config = tiny(run_dir)
    task = CountingTask(CountingTaskConfig(n_symbols=2, max_count=12, median_count=3.0, sigma=0.8))
    # The architecture from the other (untouched) checkpoint: the one under test may be damaged.
    model = LlamaForCausalLM(ModelConfig.from_pretrained(run_dir / "checkpoints" / "step_000001" / "trainer"))
    trainer = TorchTrainer(model, TrainerConfig(lr=config.lr))
    scheduler = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4,
                                          max_response_len=task.max_response_len()), task)
    return CheckpointManager(config.checkpoint_dir).load(info, trainer, scheduler)


def test_the_manifest_lists_every_file_of_a_checkpoint(run_dir):
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    found = sorted(os.path.relpath(os.path.join(d, f), latest.path) for d, _, fs in os.walk(latest.path) for f in fs)
    assert found == FILES
    assert CheckpointManager(run_dir / "checkpoints").verify(latest) is True
    assert _restore_into_fresh(run_dir, latest)["step"] == 2


@pytest.mark.parametrize("name", FILES)
def test_a_flipped_byte_in_any_file_is_detected_and_named(run_dir, name):
    manager = CheckpointManager(run_dir / "checkpoints")
    latest = manager.latest()
    _flip(run_dir / "checkpoints" / "step_000002" / name)
    with pytest.raises(CorruptStateError, match="step_000002/" + ("" if name == "manifest.json" else name)):
        _restore_into_fresh(run_dir, latest)


def test_flipped_weight_bits_do_not_load_silently(run_dir):
    """The bit flip that once loaded as a 3.4e36 weight: the checksum catches it before the weights load."""
    path = run_dir / "checkpoints" / "step_000002" / "trainer" / "model.safetensors"
    _flip(path, 0.9)
    with pytest.raises(CorruptStateError, match=r"model\.safetensors: damaged: sha256"):
        _restore_into_fresh(run_dir, CheckpointManager(run_dir / "checkpoints").latest())


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_malformed_model_file_is_a_corrupt_state_error(run_dir, damage):
    path = run_dir / "checkpoints" / "step_000002" / "trainer" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else os.urandom(len(data)))
    with pytest.raises(CorruptStateError, match=r"step_000002/trainer/model\.safetensors"):
        _restore_into_fresh(run_dir, CheckpointManager(run_dir / "checkpoints").latest())
    # Outside a checkpoint (no manifest), the safetensors reader itself names the malformed file.
    with pytest.raises(CorruptStateError, match=r"model\.safetensors: not a valid safetensors file"):
        list(iter_safetensors(path.parent))
    with pytest.raises(CorruptStateError, match=r"model\.safetensors"):
        load_pretrained(path.parent)


def test_resume_falls_back_to_the_newest_intact_checkpoint(run_dir, caplog):
    _flip(run_dir / "checkpoints" / "step_000002" / "trainer" / "trainer_state.pt")
    with caplog.at_level(logging.WARNING, logger="april_ext.training.checkpoint"):
        resumed = train(tiny(run_dir, num_steps=3, resume=True))
    assert resumed.resumed_from == 1
    assert [r["step"] for r in resumed.history] == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step_000002 is damaged" in w and "trainer_state.pt" in w for w in warnings)
    ckpt = run_dir / "checkpoints"
    assert f"resuming from checkpoint {ckpt / 'step_000001'} instead of the damaged newer {ckpt / 'step_000002'}" \
        in warnings
    # The damaged checkpoint was rewritten by the resumed run, and every kept one is intact.
    manager = CheckpointManager(run_dir / "checkpoints")
    assert [c.step for c in manager.list()] == [1, 2, 3]
    assert all(manager.verify(c) for c in manager.list())


def test_resume_with_every_checkpoint_damaged_is_a_corrupt_state_error(run_dir):
    for step in ("step_000001", "step_000002"):
        _flip(run_dir / "checkpoints" / step / "scheduler.state")
    with pytest.raises(CorruptStateError, match=r"every checkpoint .* is damaged: .*step_000002/scheduler\.state.*"
                                                r"step_000001/scheduler\.state"):
        train(tiny(run_dir, num_steps=3, resume=True))


def test_an_older_checkpoint_without_a_manifest_loads_unverified_with_a_warning(run_dir, caplog):
    """Checkpoints of versions before RUN_FORMAT (run.json without a format; the oldest have no manifest)
    still resume; the log says they were not verified."""
    manager = CheckpointManager(run_dir / "checkpoints")
    step = run_dir / "checkpoints" / "step_000002"
    (step / "run.json").write_text(json.dumps({"step": 2, "variant": "april"}))
    (step / "manifest.json").unlink()
    assert manager.verify(manager.latest()) is False
    with caplog.at_level(logging.WARNING, logger="april_ext.training.checkpoint"):
        assert _restore_into_fresh(run_dir, manager.latest()) == {"step": 2, "variant": "april"}
    assert any("step_000002 has no manifest.json" in r.getMessage() and "unverified" in r.getMessage()
               for r in caplog.records)


def _resume_as_the_cli_does(run_dir, caplog):
    """`april-ext train --resume`: the check before the start, then the run; (its result, the warnings)."""
    config = tiny(run_dir, num_steps=3, resume=True)
    with caplog.at_level(logging.WARNING, logger="april_ext.training.checkpoint"), one_torch_thread():
        check_before_start(config, 1)
        resumed = train(config)
    return resumed, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("damage", ["damaged manifest", "missing manifest", "missing run.json"])
def test_resume_passes_over_a_newest_checkpoint_whose_manifest_or_run_file_is_damaged_or_missing(
        run_dir, caplog, damage):
    """A checkpoint this version wrote always has run.json (with RUN_FORMAT) and a manifest: lacking either,
    or with a manifest that is not JSON, it is damaged, and the check before the start and the resume both
    fall back to the newest intact one (formerly the damaged manifest stopped the run before it started,
    the missing one switched the check off, and a step without run.json was skipped silently)."""
    step = run_dir / "checkpoints" / "step_000002"
    assert json.loads((step / "run.json").read_text())["format"] == RUN_FORMAT
    if damage == "damaged manifest":
        (step / "manifest.json").write_text('{"format": "april_ext.checkpoint_manifest/1", "files": {')
        expected = f"{step / 'manifest.json'}: damaged JSON"
    elif damage == "missing manifest":
        (step / "manifest.json").unlink()
        expected = f"{step / 'manifest.json'}: missing, though run.json says the checkpoint was written with one"
    else:
        (step / "run.json").unlink()
        expected = f"{step / 'run.json'}: missing (listed in {step / 'manifest.json'})"
    manager = CheckpointManager(run_dir / "checkpoints")
    with pytest.raises(CorruptStateError, match=re.escape(expected)):
        manager.verify(manager.latest())
    resumed, warnings = _resume_as_the_cli_does(run_dir, caplog)
    assert resumed.resumed_from == 1
    assert [r["step"] for r in resumed.history] == [1, 2, 3]
    # Logged by the check before the start and by the resume.
    assert sum(f"checkpoint {step} is damaged: {expected}" in w for w in warnings) == 2, warnings


def test_a_checkpoint_with_neither_run_file_nor_manifest_is_damaged(run_dir, caplog):
    step = run_dir / "checkpoints" / "step_000002"
    (step / "run.json").unlink()
    (step / "manifest.json").unlink()
    resumed, warnings = _resume_as_the_cli_does(run_dir, caplog)
    assert resumed.resumed_from == 1
    assert any(f"checkpoint {step} is damaged: {step / 'run.json'}: missing" in w for w in warnings)


def test_a_run_written_under_the_old_key_mode_resumes_with_its_variant(run_dir):
    """Rows and run.json said "mode" before the variant had its own key: they are read as "variant"."""
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    assert json.loads((run_dir / "checkpoints" / "step_000002" / "run.json").read_text()) == {
        "format": RUN_FORMAT, "step": 2, "variant": "april"}
    (run_dir / "checkpoints" / "step_000002" / "run.json").write_text(json.dumps({"step": 2, "mode": "april"}))
    write_manifest(latest.path)
    assert _restore_into_fresh(run_dir, latest) == {"step": 2, "variant": "april"}
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    old = [{("mode" if key == "variant" else key): value for key, value in row.items()} for row in rows]
    metrics.write_text("".join(json.dumps(row) + "\n" for row in old))
    assert read_metrics(str(metrics), 2) == rows
    with one_torch_thread():
        resumed = train(tiny(run_dir, num_steps=3, resume=True))
    assert resumed.history[:2] == rows and resumed.history[2]["variant"] == "april"
    assert all("mode" not in json.loads(line) for line in metrics.read_text().splitlines())


def test_a_standalone_model_directory_rejects_a_damaged_header(tmp_path):
    model = LlamaForCausalLM(ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    save_pretrained(model, tmp_path)
    path = tmp_path / "model.safetensors"
    _flip(path, 0.0)  # the header length
    with pytest.raises(CorruptStateError, match=str(path)):
        load_pretrained(tmp_path)
