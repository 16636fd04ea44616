"""DistributedMegatronTrainer across real processes (torchrun, gloo on the CPU) against the embedded
TorchTrainer in this process: per-token log-probs and two train steps' metrics must equal one process's
within fp32 tolerance for every layout, the whole gradients each optimizer step is fed (gathered from the
ranks) norm-wise, and the gathered weights within what AdamW makes of the gradients' differences
(tests/_update_bound.py: no tolerance sits on reduction-order noise, which Adam magnifies). Each torchrun
launch runs several layouts (tests/megatron_dist_worker.py), since each rank spends seconds importing
megatron-core."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")

from _torchrun import check_a_failing_rank_stops_every_rank
from _torchrun import torchrun as launch
from _trainer_utils import make_batch, make_model
from _update_bound import OptimizerRecord, assert_same_gradients, assert_weights_within_adam_bound
from megatron_dist_worker import VARIANTS, GradientRecorder, layout_key, tiny_model, trainer_config

from april_ext.errors import ConfigError, InvalidArgumentError, InvalidStateError
from april_ext.trainer import TorchTrainer
from april_ext.trainer.megatron import parallel
from april_ext.trainer.megatron.distributed_trainer import DistributedMegatronTrainer, optimizer_config
from april_ext.trainer.megatron.packed import pack
from april_ext.trainer.megatron.parallel import MegatronParallelConfig
from april_ext.trainer.megatron.sharded import padded_vocab_size
from april_ext.trainer.megatron.trainer import MegatronTrainer, MegatronTrainerConfig

WORKER = Path(__file__).with_name("megatron_dist_worker.py")
LAUNCH_TIMEOUT_S = 420


def torchrun(nproc: int, out: Path, *layouts: str) -> subprocess.CompletedProcess[str]:
    return launch(WORKER, nproc, LAUNCH_TIMEOUT_S, str(out), *layouts)


@dataclass(frozen=True)
class Gathered:
    """The gradients a distributed run's ranks gathered (megatron_dist_worker.GradientRecorder)."""

    gradients: list[dict[str, torch.Tensor]]


def one_process(variant: str | None, shaped: bool, steps: int = 2) -> dict[str, Any]:
    """The embedded trainer on the same weights, batches and settings as the worker, with what its optimizer
    saw (the reference of tests/_update_bound.py)."""
    model = tiny_model(3, variant)
    trainer = TorchTrainer(copy.deepcopy(model), trainer_config(shaped))
    record = OptimizerRecord(trainer)
    batches = [make_batch(model, step, seed=step) for step in range(steps)]
    return {"logprobs": trainer.token_logprobs(batches[0]),
            "metrics": [trainer.train_step(b) for b in batches],
            "weights": dict(trainer.export_weights(to_cpu=True).tensors), "record": record}


Reference = dict[tuple[str | None, bool], dict[str, Any]]


@pytest.fixture(scope="module")
def reference() -> Reference:
    """By model variant (megatron_dist_worker.VARIANTS; None: the plain model) and whether the objective is
    the shaped one."""
    keys = [(variant, False) for variant in (None, *VARIANTS)] + [(None, True)]
    return {key: one_process(*key) for key in keys}


@pytest.fixture(scope="module")
def resume_reference() -> dict[str, Any]:
    """The three steps of megatron_dist_worker.save_and_resume (one before the checkpoint, two after)."""
    return one_process(None, False, steps=3)


def check_layout(out: Path, name: str, expected: Reference) -> None:
    got = torch.load(out / f"{name}.pt", weights_only=False)
    assert got["round_trip"] is True, f"{name}: the weights gathered right after loading differ from the HF ones"
    assert got["staged"] is True, f"{name}: the pipeline stages' exports are not the parts of the whole export"
    check(got, name, expected[layout_key(name)])


def check(got: Mapping[str, Any], name: str, expected: Mapping[str, Any]) -> None:
    torch.testing.assert_close(torch.from_numpy(got["logprobs"]), torch.from_numpy(expected["logprobs"]),
                               rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: logprobs: {m}")
    check_metrics(got["metrics"], expected["metrics"], name)
    check_update(got, name, expected)


def check_metrics(got: list[dict[str, float]], expected: list[dict[str, float]], name: str) -> None:
    for step, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        for key in ("loss", "grad_norm", "entropy", "n_loss_tokens", "optimizer_steps", "version"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (name, step, key)


def check_update(got: Mapping[str, Any], name: str, expected: Mapping[str, Any]) -> None:
    """The gradients each optimizer step was fed, then the weights within what AdamW makes of their
    differences (tests/_update_bound.py)."""
    gathered = Gathered(got["gradients"])
    with named(name):
        assert_same_gradients(gathered, expected["record"])
        assert_weights_within_adam_bound(got["weights"], expected["weights"], gathered, expected["record"])


@contextlib.contextmanager
def named(name: str) -> Iterator[None]:
    """An assertion's message led by the layout it failed for."""
    try:
        yield
    except AssertionError as err:
        raise AssertionError(f"{name}: {err}") from err


def run_and_check(nproc: int, layouts: list[str], tmp_path: Path, reference: Reference,
                  *extra: str) -> None:
    """Launches ``layouts`` and the worker's ``extra`` modes, and checks each layout against the reference."""
    proc = torchrun(nproc, tmp_path, *layouts, *extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in layouts:
        check_layout(tmp_path, name, reference)


@pytest.mark.slow
def test_two_ranks_equal_one_process_and_resume_across_layouts(tmp_path: Path, reference: Reference,
                                                               resume_reference: dict[str, Any]) -> None:
    # TP=2, TP=2 with sequence parallelism, PP=2 (1F1B), DP=2 (tp1pp1 on two ranks), PP=2 with tied
    # embeddings (the last stage's copy), Qwen3-MoE at EP=2 (its experts split across the two ranks), a
    # vocabulary of 21 at TP=2 (padded to 22); the shaped objective at DP=2 and PP=2 (the advantages need the
    # log-probs every data-parallel rank's last stage holds); then a checkpoint saved at TP=2 resumed at
    # TP=1 x DP=2; the one-process MegatronTrainer refuses a world of two (it has no gradient all-reduce); a
    # checkpoint of the padded vocabulary is refused at TP=1. Then the comparison fails on a planted defect
    # (tp1pp1doplant: rank 1's distributed-optimizer shard of every gradient 1% off) and on weights a
    # hundred-thousandth off.
    layouts = ["tp2pp1", "tp2pp1sp", "tp1pp2", "tp1pp1", "tp1pp2tie", "tp1pp1ep2moe", "tp2pp1odd", "tp1pp1kl",
               "tp1pp2kl"]
    run_and_check(2, layouts, tmp_path, reference, "resume", "single", "odd_resume", "tp1pp1doplant")
    assert "runs in a world of one process, this one has 2" in torch.load(tmp_path / "single.pt")
    assert "padded to 22 rows, this layout pads it to 21" in torch.load(tmp_path / "odd_resume.pt")
    check_resumed(tmp_path / "resume.pt", resume_reference)
    check_fails_on_defects(tmp_path, reference[(None, False)])
    assert sorted(os.listdir(tmp_path)) == sorted(["resume_checkpoint", "resume.pt", "single.pt", "odd_checkpoint",
                                                   "odd_resume.pt", "tp1pp1doplant.pt", *(f"{n}.pt" for n in layouts)])


def check_resumed(path: Path, expected: Mapping[str, Any]) -> None:
    """Both runs of a save and resume at another layout, the saving trainer's three steps and its first step
    followed by the resumed trainer's two, equal the embedded trainer's three steps: a checkpoint that lost
    AdamW's state would put the resumed weights outside the bound."""
    result = torch.load(path, weights_only=False)
    assert result["got"]["extra"] == {"data_position": 12} and result["got"]["version"] == 1
    for run, name in (("expected", "the saving run"), ("got", "the resumed run")):
        check_metrics(result[run]["metrics"], expected["metrics"][1:], f"{path.stem}: {name}")
        check_update(result[run], f"{path.stem}: {name}", expected)


def check_fails_on_defects(out: Path, expected: Mapping[str, Any]) -> None:
    """The gradient and weight checks alone (not the metrics) catch a defect: a comparison that cannot fail
    would pass a broken trainer."""
    with pytest.raises(AssertionError, match="tp1pp1doplant: optimizer step 1: the gradient of"):
        check_update(torch.load(out / "tp1pp1doplant.pt", weights_only=False), "tp1pp1doplant", expected)
    got = torch.load(out / "tp2pp1.pt", weights_only=False)
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.norm.weight"):
        off = {**got, "weights": {**got["weights"], name: got["weights"][name] * (1 + 1e-5)}}
        with pytest.raises(AssertionError, match=f"tp2pp1: {name}: .* differ by more than Adam's bound"):
            check_update(off, "tp2pp1", expected)


@pytest.mark.slow
def test_four_ranks_equal_one_process(tmp_path: Path, reference: Reference,
                                      resume_reference: dict[str, Any]) -> None:
    # TP=2 x DP=2 with and without the distributed optimizer, TP=2 x PP=2; Qwen3-MoE at TP=2 x EP=2
    # (sequence parallel, which megatron-core's MoE layer needs with TP) and at DP=4 x EP=2 with the
    # distributed optimizer. Then a checkpoint with the distributed optimizer saved at TP=2 x DP=2 resumed
    # at TP=1 x DP=4.
    run_and_check(4, ["tp2pp1", "tp2pp1do", "tp2pp2", "tp2pp1ep2spmoe", "tp1pp1ep2domoe"], tmp_path, reference,
                  "resume_do")
    check_resumed(tmp_path / "resume_do.pt", resume_reference)


@pytest.mark.slow
def test_a_failing_rank_stops_every_rank(tmp_path: Path) -> None:
    check_a_failing_rank_stops_every_rank(WORKER, tmp_path, LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("shaped", [False, True])
def test_one_process_equals_the_embedded_trainer(reference: Reference, shaped: bool) -> None:
    # The whole distributed path (DDP, Megatron's optimizer, the schedule, packing) in a world of one; shaped:
    # per-token REINFORCE++ advantages with the KL reward shaping, whitening and AReaL's decoupled loss.
    model = make_model(3)
    try:
        trainer = DistributedMegatronTrainer(
            MegatronTrainerConfig(model=model.config, trainer=trainer_config(shaped)), model.named_parameters())
        record = GradientRecorder(trainer)
        batches = [make_batch(model, step, seed=step) for step in range(2)]
        got = {"logprobs": trainer.token_logprobs(batches[0]), "metrics": [trainer.train_step(b) for b in batches],
               "weights": dict(trainer.export_weights(to_cpu=True).tensors), "gradients": record.gradients}
        with pytest.raises(InvalidStateError, match="policy_version is 0 but the trainer holds version 2"):
            trainer.train_step(batches[0])
    finally:
        parallel.shutdown()
    check(got, "world of one", reference[(None, shaped)])


def test_pack_puts_samples_in_one_row_and_pads_to_the_multiple() -> None:
    tokens = torch.arange(10, 17)
    packed = pack(tokens, torch.tensor([0, 3, 4, 7]), multiple=4)
    assert packed.pad == 1 and packed.n_tokens == 7
    assert packed.input_ids.tolist() == [[10, 11, 12, 13, 14, 15, 16, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 0]]
    assert packed.params.qkv_format == "thd" and packed.params.max_seqlen_q == 3
    assert packed.params.cu_seqlens_q.tolist() == [0, 3, 4, 7, 8]
    assert pack(tokens, torch.tensor([0, 7])).pad == 0
    # A row as long as an expert-parallel peer's: at least `length`, then a multiple of 4.
    longer = pack(tokens, torch.tensor([0, 3, 4, 7]), multiple=4, length=10)
    assert longer.pad == 5 and longer.params.cu_seqlens_q.tolist() == [0, 3, 4, 7, 12]
    filler = pack(tokens[:0], torch.tensor([0]), length=5)
    assert filler.n_tokens == 0 and filler.input_ids.tolist() == [[0] * 5]
    assert filler.params.cu_seqlens_q.tolist() == [0, 5]
    with pytest.raises(InvalidArgumentError, match="T = 0 only with a length"):
        pack(tokens[:0], torch.tensor([0]))
    with pytest.raises(InvalidArgumentError, match="rising strictly from 0 to T = 7"):
        pack(tokens, torch.tensor([0, 3, 3, 7]))


def test_parallel_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="tensor_model_parallel_size must be an integer >= 1, got 0"):
        MegatronParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(ConfigError, match="context_parallel_size must be 1"):
        MegatronParallelConfig(context_parallel_size=2)
    with pytest.raises(ConfigError, match="sequence_parallel needs tensor_model_parallel_size > 1"):
        MegatronParallelConfig(sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"timeout_s must be a number in \(0, 6e8\]"):
        MegatronParallelConfig(timeout_s=0)
    config = MegatronParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert config.data_parallel_size(8) == 2
    with pytest.raises(ConfigError, match="the world has 6 ranks, not a multiple of"):
        config.data_parallel_size(6)
    model = make_model(0)
    with pytest.raises(ConfigError, match="needs DistributedMegatronTrainer"):
        MegatronTrainer(MegatronTrainerConfig(model=model.config, parallel=config))
    moe = tiny_model(0, "moe").config
    with pytest.raises(ConfigError, match="tensor_model_parallel_size > 1 needs sequence_parallel=True"):
        DistributedMegatronTrainer(MegatronTrainerConfig(
            model=moe, parallel=MegatronParallelConfig(tensor_model_parallel_size=2)))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="pipeline_model_parallel_size > 1 needs a GPU"):
            DistributedMegatronTrainer(MegatronTrainerConfig(
                model=moe, parallel=MegatronParallelConfig(pipeline_model_parallel_size=2)))
    assert [padded_vocab_size(v, tp) for v, tp in ((20, 2), (21, 2), (21, 4), (7, 1))] == [20, 22, 24, 7]


def test_optimizer_cpu_offload_reaches_megatron_s_optimizer_config_and_is_refused_on_a_cpu() -> None:
    # Megatron's --optimizer-cpu-offload / --optimizer-offload-fraction: its HybridDeviceOptimizer, run by the
    # precision-aware distributed optimizer (as Megatron-LM requires).
    with pytest.raises(ConfigError, match="optimizer_cpu_offload=True needs use_distributed_optimizer=True"):
        MegatronParallelConfig(optimizer_cpu_offload=True)
    with pytest.raises(ConfigError, match=r"optimizer_offload_fraction must be a number in \(0, 1\], got 1.5"):
        MegatronParallelConfig(use_distributed_optimizer=True, optimizer_cpu_offload=True, optimizer_offload_fraction=1.5)
    with pytest.raises(ConfigError, match=r"optimizer_offload_fraction=0.5 applies only with optimizer_cpu_offload"):
        MegatronParallelConfig(use_distributed_optimizer=True, optimizer_offload_fraction=0.5)
    offload = MegatronParallelConfig(use_distributed_optimizer=True, optimizer_cpu_offload=True,
                                     optimizer_offload_fraction=0.5)
    settings = trainer_config()
    # Built without Transformer Engine too (megatron-core 0.16.1 raised a TypeError: compat.patch_te_version_check).
    built = optimizer_config(settings, offload, bf16=True)
    assert (built.optimizer_cpu_offload, built.optimizer_offload_fraction, built.use_precision_aware_optimizer,
            built.use_distributed_optimizer, built.bf16, built.params_dtype) == (True, 0.5, True, True, True,
                                                                                torch.bfloat16)
    assert (built.optimizer, built.lr, built.clip_grad, built.decoupled_weight_decay) == ("adam", 1e-2, 0.5, True)
    plain = optimizer_config(settings, MegatronParallelConfig(use_distributed_optimizer=True), bf16=False)
    assert (plain.optimizer_cpu_offload, plain.use_precision_aware_optimizer, plain.use_distributed_optimizer,
            plain.params_dtype) == (False, False, True, torch.float32)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="optimizer_cpu_offload=True needs a GPU, and this trainer runs on cpu"):
            DistributedMegatronTrainer(MegatronTrainerConfig(model=make_model(0).config, parallel=offload))


def test_hf_weights_of_the_wrong_shape_are_refused_naming_the_parameter() -> None:
    model = make_model(0)
    weights = dict(model.named_parameters())
    gate = "model.layers.0.mlp.gate_proj.weight"
    weights[gate] = weights[gate][:-1]
    try:
        with pytest.raises(InvalidArgumentError, match=r"'decoder.layers.0.mlp.linear_fc1.weight': this rank's gate "
                                                        r"rows: shape \(\d+, \d+\) in the HF weights"):
            DistributedMegatronTrainer(MegatronTrainerConfig(model=model.config), weights)
    finally:
        parallel.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="optimizer CPU offload needs a GPU")
def test_optimizer_cpu_offload_trains_as_the_gpu_optimizer() -> None:
    """Two steps with all and with half of the optimizer state offloaded equal the distributed optimizer on
    the GPU (fp32 parameters; the update is AdamW either way)."""
    model = make_model(3)
    batches = [make_batch(model, step, seed=step) for step in range(2)]
    runs = []
    for offload, fraction in ((False, 1.0), (True, 1.0), (True, 0.5)):
        split = MegatronParallelConfig(use_distributed_optimizer=True, optimizer_cpu_offload=offload,
                                       optimizer_offload_fraction=fraction)
        try:
            trainer = DistributedMegatronTrainer(MegatronTrainerConfig(
                model=model.config, trainer=trainer_config(), parallel=split), model.named_parameters())
            runs.append(([trainer.train_step(b) for b in batches], dict(trainer.export_weights(to_cpu=True))))
        finally:
            parallel.shutdown()
    (want_metrics, want_weights), *offloaded = runs
    for metrics, weights in offloaded:
        for mine, theirs in zip(metrics, want_metrics):
            for key in ("loss", "grad_norm", "entropy", "version"):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5), key
        for name, tensor in want_weights.items():
            torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_distributed_optimizer_checkpoint_resumes(tmp_path: Path) -> None:
    # megatron-core's default distributed-optimizer format is refused by its own dist_checkpointing, and
    # its fully_reshardable load fails with torch's Adam (KeyError 'step'; compat.torch_adam_state_loading).
    model = make_model(3)
    batches = [make_batch(model, step, seed=step) for step in range(3)]
    config = MegatronTrainerConfig(model=model.config, trainer=trainer_config(),
                                   parallel=MegatronParallelConfig(use_distributed_optimizer=True))
    try:
        first = DistributedMegatronTrainer(config, model.named_parameters())
        first.train_step(batches[0])
        first.save_checkpoint(tmp_path / "ckpt", extra={"data_position": 3})
        expected = [first.train_step(b) for b in batches[1:]]
        weights = dict(first.export_weights(to_cpu=True).tensors)
        parallel.shutdown()
        resumed = DistributedMegatronTrainer(config, make_model(1).named_parameters())
        assert resumed.load_checkpoint(tmp_path / "ckpt") == {"data_position": 3}
        # Two steps: a step tensor shared by every parameter would be off from the second on.
        got = [resumed.train_step(b) for b in batches[1:]]
        for mine, theirs in zip(got, expected):
            for key in ("loss", "grad_norm", "entropy", "version"):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-6), key
        for key, tensor in resumed.export_weights(to_cpu=True).tensors:
            torch.testing.assert_close(tensor, weights[key], rtol=1e-6, atol=1e-7)
    finally:
        parallel.shutdown()


def test_slimes_optimiser_entropy_bonus_and_reference_in_a_world_of_one(tmp_path: Path) -> None:
    """--weight-decay / --adam-beta2 / --lr-decay-style with warmup / --entropy-coef (the entropy's gradient
    through the vocabulary-parallel sums) / --ref-load through the distributed path equal the embedded trainer."""
    from april_ext.algorithms import AlgorithmConfig
    from april_ext.model import save_pretrained

    save_pretrained(make_model(9), tmp_path / "ref")
    settings = dataclasses.replace(
        trainer_config(), weight_decay=0.1, betas=(0.9, 0.98), lr_warmup_iters=1, lr_decay_style="linear",
        lr_decay_iters=4, reference=str(tmp_path / "ref"),
        algorithm=AlgorithmConfig(kl_loss_coef=0.05, kl_loss_type="k3", entropy_coef=0.01, max_staleness=None))
    model = make_model(3)
    embedded = TorchTrainer(copy.deepcopy(model), settings)
    record = OptimizerRecord(embedded)
    batches = [make_batch(model, step, seed=step) for step in range(2)]
    expected = {"logprobs": embedded.token_logprobs(batches[0]), "metrics": [embedded.train_step(b) for b in batches],
                "weights": dict(embedded.export_weights(to_cpu=True).tensors), "record": record}
    try:
        trainer = DistributedMegatronTrainer(MegatronTrainerConfig(model=model.config, trainer=settings),
                                             model.named_parameters())
        recorder = GradientRecorder(trainer)
        got = {"logprobs": trainer.token_logprobs(batches[0]), "metrics": [trainer.train_step(b) for b in batches],
               "weights": dict(trainer.export_weights(to_cpu=True).tensors), "gradients": recorder.gradients}
    finally:
        parallel.shutdown()
    assert expected["metrics"][0]["kl"] > 0 and expected["metrics"][1]["lr"] < settings.lr
    for step, (mine, theirs) in enumerate(zip(got["metrics"], expected["metrics"])):
        for key in ("kl", "lr"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (step, key)
    check(got, "world of one, slime's settings", expected)
