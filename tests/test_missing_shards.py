"""A checkpoint lacking one of its files is refused with PersistenceError naming the file: a Hugging Face
checkpoint missing a shard its index lists (with the tensors in it), and a megatron-core distributed
checkpoint missing a shard (with the layout it was saved at and the one loading it); `april-ext train`
checks both before it launches ranks or builds a model. Formerly a raw FileNotFoundError in one process,
and under torchrun the ranks reading the shard died (ChildFailedError). The distributed checkpoint is
saved in a world of one."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from _refused import refused
from _torch_threads import one_torch_thread
from _trainer_utils import make_batch, make_model

from april_ext.errors import CorruptStateError, PersistenceError
from april_ext.model import iter_safetensors, load_pretrained
from april_ext.model.checkpoint import save_safetensors_sharded
from april_ext.trainer import TrainerConfig
from april_ext.training.checkpoint import write_manifest


@pytest.fixture
def sharded_hf(tmp_path: Path) -> tuple[Path, str]:
    """A sharded HF checkpoint of the counting model with its second shard deleted: (directory, shard)."""
    model = make_model(0)
    model.config.save_pretrained(tmp_path / "hf")
    save_safetensors_sharded(model.named_parameters(), tmp_path / "hf", shard_bytes=8192)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "hf" / shard).unlink()
    return tmp_path / "hf", shard


def test_a_hf_checkpoint_missing_a_shard_names_it_and_its_tensors(sharded_hf: tuple[Path, str]) -> None:
    directory, shard = sharded_hf
    for read in (lambda: list(iter_safetensors(directory)), lambda: load_pretrained(directory)):
        with pytest.raises(PersistenceError) as caught:
            read()
        message = str(caught.value)
        assert message.startswith(f"{directory / shard}: missing from the checkpoint")
        assert "model.safetensors.index.json puts" in message and "tensor(s) in it, such as model.layers." in message


def test_a_run_from_a_hf_checkpoint_missing_a_shard_is_refused_before_launch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sharded_hf: tuple[Path, str]) -> None:
    directory, shard = sharded_hf
    err = refused(monkeypatch, tmp_path, "--trainer", "megatron", "--tensor-model-parallel-size", "2",
                  "--nproc-per-node", "2", "--model", str(directory))
    assert isinstance(err, PersistenceError)
    assert str(err).startswith(f"{directory / shard}: missing from the checkpoint")


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory):
    """A DistributedMegatronTrainer in a world of one and a checkpoint it saved after one step (the
    optimizer has state to save only after a step)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")
    from april_ext.trainer.megatron import parallel
    from april_ext.trainer.megatron.distributed_trainer import DistributedMegatronTrainer
    from april_ext.trainer.megatron.trainer import MegatronTrainerConfig

    saved = tmp_path_factory.mktemp("distributed") / "ckpt"
    model = make_model(0)
    with one_torch_thread():
        try:
            trainer = DistributedMegatronTrainer(MegatronTrainerConfig(
                model=model.config, trainer=TrainerConfig(lr=1e-2, micro_batch_tokens=64)), model.named_parameters())
            trainer.train_step(make_batch(model, 0))
            trainer.save_checkpoint(saved)
            yield trainer, saved
        finally:
            parallel.shutdown()


def _without_a_shard(saved: Path, into: Path) -> Path:
    """A copy of the distributed checkpoint ``saved`` at ``into`` without its last shard file; that file."""
    shutil.copytree(saved, into)
    shard = sorted(into.glob("*.distcp"))[-1]
    shard.unlink()
    return shard


def test_a_distributed_checkpoint_missing_a_shard_names_it_and_the_layouts(distributed, tmp_path: Path) -> None:
    trainer, saved = distributed
    shard = _without_a_shard(saved, tmp_path / "ckpt")
    with pytest.raises(PersistenceError) as caught:
        trainer.load_checkpoint(tmp_path / "ckpt")
    message = str(caught.value)
    assert message.startswith(f"{shard}: missing from the distributed checkpoint (written by rank 0 of the saving run")
    assert "pieces of " in message and "tensor(s), such as decoder.layers." in message
    assert "saved at TP=1 PP=1 EP=1 DP=1, this run loads it at TP=1 PP=1 EP=1 DP=1" in message
    # The intact checkpoint still loads.
    trainer.load_checkpoint(saved)


def _run_checkpoint(saved: Path, directory: Path) -> Path:
    """A run checkpoint directory (training.CheckpointManager's step_000001) whose trainer state is a copy
    of the distributed checkpoint ``saved`` without its last shard; that shard."""
    step = directory / "step_000001"
    shard = _without_a_shard(saved, step / "trainer")
    (step / "run.json").write_text(json.dumps({"step": 1}))
    return shard


def test_resuming_a_distributed_checkpoint_missing_a_shard_is_refused_before_launch(
        distributed, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Without a manifest (an older checkpoint): the shard index names what is missing, and the layouts.
    shard = _run_checkpoint(distributed[1], tmp_path / "checkpoints")
    err = refused(monkeypatch, tmp_path, "--trainer", "megatron", "--tensor-model-parallel-size", "2",
                  "--nproc-per-node", "2", "--load", str(tmp_path / "checkpoints"))
    assert isinstance(err, PersistenceError)
    assert str(err).startswith(f"{shard}: missing from the distributed checkpoint")
    assert "saved at TP=1 PP=1 EP=1 DP=1, this run loads it at TP=2 PP=1 EP=1 DP=1" in str(err)


def test_resuming_when_every_checkpoint_lacks_a_file_is_refused_before_launch(
        distributed, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # With a manifest the run would skip the checkpoint as damaged; with none left it fails: so it does now,
    # before the launch.
    step = tmp_path / "checkpoints" / "step_000001"
    shutil.copytree(distributed[1], step / "trainer")
    (step / "run.json").write_text(json.dumps({"step": 1}))
    write_manifest(str(step))
    shard = sorted((step / "trainer").glob("*.distcp"))[-1]
    shard.unlink()
    err = refused(monkeypatch, tmp_path, "--trainer", "megatron", "--tensor-model-parallel-size", "2",
                  "--nproc-per-node", "2", "--load", str(tmp_path / "checkpoints"))
    assert isinstance(err, CorruptStateError)
    assert f"is damaged: {shard}: missing (listed in {step / 'manifest.json'})" in str(err)


@pytest.mark.parametrize("listed", ["/etc/passwd", "../outside.safetensors", "link.safetensors"])
def test_an_index_naming_a_file_outside_the_checkpoint_is_refused_before_it_is_opened(
        tmp_path: Path, listed: str) -> None:
    """The shards of an index are files inside its directory: an absolute path, a '..' or a link out is
    refused with PersistenceError naming the index and the shard (formerly the file was opened and parsed)."""
    model = make_model(0)
    hf = tmp_path / "hf"
    model.config.save_pretrained(hf)
    save_safetensors_sharded(model.named_parameters(), hf, shard_bytes=8192)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(next(hf.glob("*-of-*.safetensors")), outside)
    (hf / "link.safetensors").symlink_to(outside)
    index_path = hf / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = listed
    index_path.write_text(json.dumps(index))
    with pytest.raises(PersistenceError, match=re.escape(f"{index_path}: shard {listed!r} lies outside the "
                                                         f"checkpoint directory {hf}")):
        list(iter_safetensors(hf))
    with pytest.raises(PersistenceError, match="lies outside the checkpoint directory"):
        load_pretrained(hf)
