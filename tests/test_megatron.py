"""MegatronTrainer against the embedded model and the torch trainer, on a CPU through the compatibility
layer. One module-scoped fixture creates the process group and model-parallel state and destroys them
afterwards, so other test modules see no torch.distributed state."""

from __future__ import annotations

import copy
import os
import uuid

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")

import torch.distributed as dist  # noqa: E402
from _megatron_runtime import megatron_runtime  # noqa: E402, F401 - the module's runtime (autouse)
from _trainer_utils import make_batch, make_model  # noqa: E402
from _update_bound import OptimizerRecord, assert_same_gradients, assert_weights_within_adam_bound  # noqa: E402

from april_ext.algorithms import AlgorithmConfig  # noqa: E402
from april_ext.engine import EngineConfig, EngineCore  # noqa: E402
from april_ext.errors import (  # noqa: E402
    ConfigError,
    CorruptStateError,
    InvalidArgumentError,
    InvalidStateError,
)
from april_ext.model import LlamaForCausalLM, ModelConfig, load_pretrained, save_pretrained  # noqa: E402
from april_ext.protocol import SamplingParams  # noqa: E402
from april_ext.trainer import TorchTrainer, TrainerConfig  # noqa: E402
from april_ext.trainer.megatron import (  # noqa: E402
    MegatronTrainer,
    MegatronTrainerConfig,
    compat,
    parallel,
)
from april_ext.trainer.megatron.model import (  # noqa: E402
    MegatronCausalLM,
    build_gpt_model,
    length_buckets,
)

# megatron-core runs unmodified on a GPU (the CPU patches are not applied there), so the tests use it.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Identical math in fp32; on a GPU the kernels' reduction orders differ between the two models.
TOL = {"rtol": 1e-5, "atol": 1e-5} if DEVICE.type == "cpu" else {"rtol": 1e-4, "atol": 1e-4}

MODELS = {
    # GQA with q/k/v biases (Qwen2), head_dim other than hidden / heads, llama3 RoPE scaling.
    "gqa_qwen2": ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, head_dim=12, qkv_bias=True,
                             model_type="qwen2", rope_type="llama3", rope_theta=500.0,
                             rope_scaling={"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                                           "original_max_position_embeddings": 16}),
    # Tied embeddings with MQA.
    "tied_mqa": ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
}


def random_model(config: ModelConfig, seed: int) -> LlamaForCausalLM:
    """Random norms and biases too, so a misplaced norm or bias changes the logits."""
    model = LlamaForCausalLM(config)
    model.init_weights(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=generator))
    return model


@pytest.mark.parametrize("name", MODELS)
def test_gpt_model_logits_equal_the_embedded_model(name: str) -> None:
    config = MODELS[name]
    ours = random_model(config, seed=5)
    megatron = MegatronCausalLM(config)
    megatron.load_weights(ours.named_parameters())
    ours, megatron = ours.to(DEVICE), megatron.to(DEVICE)
    ids = torch.randint(0, config.vocab_size, (41,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    cu = torch.tensor([0, 17, 18, 41], device=DEVICE)
    with torch.no_grad():
        expected = ours(ids, cu_seqlens=cu)
        got = megatron(ids, cu_seqlens=cu)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOL)
    exported = megatron.hf_weights()
    for key, tensor in ours.named_parameters():
        if not (config.tie_word_embeddings and key == "lm_head.weight"):
            assert torch.equal(exported[key], tensor), key


def test_conversion_names_are_the_gpt_models_own() -> None:
    config = MODELS["gqa_qwen2"]
    gpt = build_gpt_model(config)
    megatron = MegatronCausalLM(config)
    names = {k for k in gpt.state_dict() if not k.endswith("_extra_state")}
    assert names == {k for k, _ in megatron.gpt.named_parameters()}
    # The te layout follows the renames the local spec itself declares for Transformer-Engine checkpoints.
    from april_ext.trainer.megatron import hf_to_megatron

    te = set(hf_to_megatron(random_model(config, 0).named_parameters(), config, layout="te"))
    rename = gpt.decoder.layers[0].submodules_config.sharded_state_dict_keys_map
    local_as_te = set()
    for key in names:
        for old, new in rename.items():
            key = key.replace(f".{old}", f".{new}")
        local_as_te.add(key)
    assert te == local_as_te


def trainer_config(**changes: object) -> TrainerConfig:
    base = {"lr": 1e-2, "micro_batch_tokens": 40, "grad_clip": 0.5, "mixed_precision": "fp32",
            "algorithm": AlgorithmConfig(kl_loss_coef=0.05, kl_loss_type="k3", max_staleness=None)}
    return TrainerConfig(**{**base, **changes})


# REINFORCE++ with the KL reward shaping, whitened per-token advantages and AReaL's decoupled loss.
SHAPED = AlgorithmConfig.reinforce_plus_plus(kl_coef=0.2, kl_loss_coef=0.05, kl_loss_type="k3", gamma=0.9,
                                             normalize_advantages=True, use_decoupled_loss=True,
                                             behav_imp_weight_cap=3.0, max_staleness=None)


def train_both(minibatches: int, algorithm: AlgorithmConfig | None, plant: str | None = None
               ) -> tuple[list[tuple[dict, dict]], TorchTrainer, MegatronTrainer, OptimizerRecord, OptimizerRecord]:
    """Two steps of the torch and the Megatron trainer from the same weights on the same batches: their
    metrics and what their optimizers saw. ``plant`` puts a defect into the Megatron side (PLANTED)."""
    model = make_model(3)
    config = trainer_config(minibatches=minibatches, **({"algorithm": algorithm} if algorithm else {}))
    torch_trainer = TorchTrainer(copy.deepcopy(model), config)
    megatron = MegatronTrainer(MegatronTrainerConfig(model=model.config, trainer=config), model.named_parameters())
    if plant is not None:
        PLANTED[plant](megatron)
    expected_record, got_record = OptimizerRecord(torch_trainer), OptimizerRecord(megatron)
    metrics = []
    for step in range(2):
        batch = make_batch(model, step, seed=step)
        metrics.append((torch_trainer.train_step(batch), megatron.train_step(batch)))
    return metrics, torch_trainer, megatron, expected_record, got_record


def check_same_update(torch_trainer: TorchTrainer, megatron: MegatronTrainer, expected_record: OptimizerRecord,
                      got_record: OptimizerRecord) -> None:
    """The gradients each optimizer step was fed, then the weights within what Adam makes of their
    differences (tests/_update_bound.py: no tolerance sits on reduction-order noise)."""
    assert_same_gradients(got_record, expected_record)
    ours = dict(torch_trainer.export_weights(to_cpu=True).tensors)
    exported = megatron.export_weights(to_cpu=True)
    theirs = list(exported)  # an export streams once
    assert exported.version == torch_trainer.version and [n for n, _ in theirs] == list(ours)
    assert_weights_within_adam_bound(dict(theirs), ours, got_record, expected_record)


def _scale_one_gradient(megatron: MegatronTrainer) -> None:
    param = megatron.model.gpt.decoder.layers[1].mlp.linear_fc2.weight

    def scale(*_: object) -> None:
        param.grad.mul_(1.01)

    megatron.optimizer.register_step_pre_hook(scale)


def _transpose_one_weight(megatron: MegatronTrainer) -> None:
    weight = megatron.model.gpt.decoder.layers[0].self_attention.linear_proj.weight
    assert weight.shape[0] == weight.shape[1]
    with torch.no_grad():
        weight.copy_(weight.t().clone())


def _drop_one_micro_batch(megatron: MegatronTrainer) -> None:
    loss, calls = megatron._loss, [0]
    run = loss._micro_batch

    def skipping(*args: object) -> None:
        calls[0] += 1
        if calls[0] != 2:
            run(*args)

    object.__setattr__(loss, "_micro_batch", skipping)


PLANTED = {"gradient_scaled_by_1.01": _scale_one_gradient, "one_layer_weight_transposed": _transpose_one_weight,
           "one_micro_batch_dropped": _drop_one_micro_batch}


@pytest.mark.parametrize("minibatches, algorithm", [(1, None), (2, None), (1, SHAPED), (2, SHAPED)])
def test_train_step_matches_the_torch_trainer(minibatches: int, algorithm: AlgorithmConfig | None) -> None:
    metrics, torch_trainer, megatron, expected_record, got_record = train_both(minibatches, algorithm)
    for step, (expected, got) in enumerate(metrics):
        for key in ("loss", "grad_norm", "entropy", "n_loss_tokens", "optimizer_steps", "version"):
            assert got[key] == pytest.approx(expected[key], rel=TOL["rtol"], abs=TOL["atol"] / 10), (step, key)
    assert megatron.version == torch_trainer.version == 2
    assert len(got_record.gradients) == 2 * minibatches
    check_same_update(torch_trainer, megatron, expected_record, got_record)


@pytest.mark.parametrize("plant", PLANTED)
def test_the_comparison_with_the_torch_trainer_fails_on_a_planted_defect(plant: str) -> None:
    """The gradient and weight checks alone (not the metrics) catch each defect."""
    _, torch_trainer, megatron, expected_record, got_record = train_both(2, SHAPED, plant)
    with pytest.raises(AssertionError):
        check_same_update(torch_trainer, megatron, expected_record, got_record)


def test_the_weight_bound_fails_on_weights_a_hundred_thousandth_off() -> None:
    _, torch_trainer, megatron, expected_record, got_record = train_both(2, SHAPED)
    ours = dict(torch_trainer.export_weights(to_cpu=True).tensors)
    theirs = dict(megatron.export_weights(to_cpu=True))
    assert_weights_within_adam_bound(theirs, ours, got_record, expected_record)
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.norm.weight"):
        with pytest.raises(AssertionError, match=name):
            assert_weights_within_adam_bound({**theirs, name: theirs[name] * (1 + 1e-5)}, ours, got_record,
                                             expected_record)


def test_exported_weights_load_into_the_engine() -> None:
    model = make_model(4)
    megatron = MegatronTrainer(MegatronTrainerConfig(model=model.config, trainer=trainer_config(lr=5e-2)),
                               model.named_parameters())
    megatron.train_step(make_batch(model, 0))
    core = EngineCore(make_model(9), EngineConfig(num_blocks=16, block_size=8, memory_tag_prefix="megatron-test-"))
    exported = megatron.export_weights(to_cpu=True)
    tensors = list(exported)  # an export streams once
    loaded = core.update_weights(tensors, version=exported.version)
    assert sorted(loaded) == sorted(n for n, _ in tensors)
    prompt = [1, 2, 3, 4]
    out = core.generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert out.versions == [1] * 6
    # The engine's behavior logprobs are the trained policy's: the Megatron model scores them the same.
    tokens = torch.tensor(prompt + out.token_ids, device=DEVICE)
    with torch.no_grad():
        logits = megatron.model(tokens)
    logp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, tokens[1:, None]).squeeze(1)
    torch.testing.assert_close(logp[len(prompt) - 1:].cpu(), torch.tensor(out.logprobs), rtol=1e-4, atol=1e-4)


def test_checkpoint_restores_the_run_exactly(tmp_path) -> None:
    model = make_model(6)
    config = MegatronTrainerConfig(model=model.config, trainer=trainer_config())
    trainer = MegatronTrainer(config, model.named_parameters(), initial_version=7)
    batches = [make_batch(model, 7 + i, seed=i) for i in range(2)]
    trainer.train_step(batches[0])
    path = tmp_path / "ckpt"
    trainer.save_checkpoint(path, extra={"data_position": 12})
    trainer.save_checkpoint(path, extra={"data_position": 12})  # replaces the previous one atomically
    trainer_weights_at_save = [(n, t.clone()) for n, t in trainer.export_weights()]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    expected = trainer.train_step(batches[1])
    # The policy in the checkpoint is a plain HF directory: the engine's loader and a new trainer read it.
    assert isinstance(load_pretrained(path), LlamaForCausalLM)
    restarted = MegatronTrainer.from_pretrained(path, trainer_config())
    assert restarted.megatron_config.model == model.config
    for (name, a), (_, b) in zip(restarted.export_weights(), trainer_weights_at_save):
        assert torch.equal(a, b), name
    fresh = MegatronTrainer(config, make_model(1).named_parameters())
    assert fresh.load_checkpoint(path) == {"data_position": 12}
    assert fresh.version == 8
    got = fresh.train_step(batches[1])
    assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
    for (name, a), (_, b) in zip(trainer.export_weights(), fresh.export_weights()):
        assert torch.equal(a, b), name


def test_torch_trainer_checkpoints_are_refused(tmp_path) -> None:
    model = make_model(0)
    TorchTrainer(copy.deepcopy(model), trainer_config()).save_checkpoint(tmp_path / "torch")
    trainer = MegatronTrainer(MegatronTrainerConfig(model=model.config, trainer=trainer_config()))
    with pytest.raises(CorruptStateError, match="april_ext.megatron_trainer/1"):
        trainer.load_checkpoint(tmp_path / "torch")


def test_colocated_offload_releases_memory_and_training_is_unchanged() -> None:
    import april_ext.memory as mem

    model = make_model(2)
    tag = f"megatron-trainer-{uuid.uuid4().hex[:8]}"
    plain = MegatronTrainer(MegatronTrainerConfig(model=model.config, trainer=trainer_config()),
                            model.named_parameters())
    colocated = MegatronTrainer(MegatronTrainerConfig(model=model.config,
                                                      trainer=trainer_config(colocated=True, memory_tag=tag)),
                                model.named_parameters())
    pointers = [p.data_ptr() for p in colocated.params]
    grad_pointers = [p.grad.data_ptr() for p in colocated.params]
    for step in range(2):
        batch = make_batch(model, step, seed=step)
        plain.train_step(batch)
        colocated.train_step(batch)
        resident = mem.stats()[tag].resident_bytes
        colocated.offload()
        assert mem.stats()[tag].paused and mem.stats()[tag].resident_bytes == 0 < resident
        with pytest.raises(InvalidStateError, match="onload"):
            colocated.export_weights()
        colocated.onload()
        assert mem.stats()[tag].resident_bytes == resident
    # Megatron's linear layers accumulate into the region's gradient buffer; nothing moved out of it.
    assert [p.data_ptr() for p in colocated.params] == pointers
    assert [p.grad.data_ptr() for p in colocated.params] == grad_pointers
    for (name, a), (_, b) in zip(plain.export_weights(), colocated.export_weights()):
        assert torch.equal(a, b), name


def test_configuration_errors_name_the_field() -> None:
    config = MODELS["tied_mqa"]
    with pytest.raises(ConfigError, match=r"biases \(qkv_bias, o_bias, mlp_bias\) = \(True, True, False\)"):
        MegatronCausalLM(config.replace(qkv_bias=True, o_bias=True))
    model = MegatronCausalLM(config)
    with pytest.raises(InvalidArgumentError, match=r"cu_seqlens must rise strictly from 0 to len\(input_ids\) = 4"):
        model(torch.tensor([1, 2, 3, 4]), cu_seqlens=torch.tensor([0, 3, 3, 4]))
    with pytest.raises(InvalidArgumentError, match=r"packed \[T\] tensor, got shape \(1, 4\)"):
        model(torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(ConfigError, match="MegatronTrainerConfig.seed"):
        MegatronTrainerConfig(model=config, seed=-1)
    with pytest.raises(ConfigError, match="MegatronTrainerConfig.model"):
        MegatronTrainerConfig(model={"vocab_size": 3})  # type: ignore[arg-type]


def test_cpu_patches_apply_only_without_a_gpu() -> None:
    assert compat.apply_cpu_patches() == (not torch.cuda.is_available())


def test_runtime_can_be_torn_down_and_recreated() -> None:
    parallel.shutdown()
    assert not dist.is_initialized()
    parallel.initialize(seed=1)
    config = MODELS["tied_mqa"]
    model = MegatronCausalLM(config).to(DEVICE)
    with torch.no_grad():
        assert model(torch.tensor([1, 2, 3], device=DEVICE)).shape == (3, config.vocab_size)


def test_length_buckets_bound_the_padding() -> None:
    lengths = [5, 90, 7, 88, 1, 30, 31, 2, 64]
    buckets = length_buckets(lengths, 1.25)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for bucket in buckets:
        padded = max(lengths[i] for i in bucket) * len(bucket)
        assert len(bucket) == 1 or padded <= 1.25 * sum(lengths[i] for i in bucket)
    # 90, 88, 64 pad to 270 <= 1.25 x 242; adding 31 would pad to 360 > 1.25 x 273.
    assert buckets == [[1, 3, 8], [6, 5], [2, 0], [7], [4]]
    assert length_buckets([4, 4, 4], 1.0) == [[0, 1, 2]]
    assert length_buckets([3], 1.0) == [[0]]


def test_cpu_rng_tracker_forks_a_separate_stream() -> None:
    import inspect

    from megatron.core.tensor_parallel import random as mrandom

    tracker = compat.CpuRNGStatesTracker()
    tracker.add("stream", 7)
    outer = torch.get_rng_state()
    with tracker.fork("stream"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer)
    with tracker.fork("stream"):
        second = torch.rand(3)
    expected = torch.rand(6, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.cat([first, second]), expected)
    with pytest.raises(ValueError, match="already registered"):
        tracker.add("other", 7)
    with pytest.raises(ValueError, match="not registered"):
        with tracker.fork("missing"):
            pass
    default = inspect.signature(compat.CpuRNGStatesTracker.fork).parameters["name"].default
    assert default == mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME


def test_initialisation_is_seeded_and_leaves_the_global_rng_alone() -> None:
    config = MODELS["tied_mqa"]
    state = torch.get_rng_state()
    weights = [dict(MegatronTrainer(MegatronTrainerConfig(model=config, seed=seed)).export_weights())
               for seed in (3, 3, 4)]
    assert torch.equal(torch.get_rng_state(), state)
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), name
    assert not torch.equal(weights[0]["model.embed_tokens.weight"], weights[2]["model.embed_tokens.weight"])


def test_slimes_optimiser_entropy_bonus_and_reference_match_the_torch_trainer(tmp_path) -> None:
    """slime's --weight-decay / --adam-beta2 / --lr-decay-style with warmup / --entropy-coef / --ref-load give the
    Megatron trainer the torch trainer's update."""
    save_pretrained(make_model(9), tmp_path / "ref")
    model = make_model(3)
    config = trainer_config(weight_decay=0.1, betas=(0.9, 0.98), lr_warmup_iters=1, lr_decay_style="cosine",
                            lr_decay_iters=4, min_lr=1e-3, minibatches=2, reference=str(tmp_path / "ref"),
                            algorithm=AlgorithmConfig(kl_loss_coef=0.05, kl_loss_type="k3", entropy_coef=0.01))
    torch_trainer = TorchTrainer(copy.deepcopy(model), config)
    megatron = MegatronTrainer(MegatronTrainerConfig(model=model.config, trainer=config), model.named_parameters())
    expected_record, got_record = OptimizerRecord(torch_trainer), OptimizerRecord(megatron)
    for step in range(2):
        batch = make_batch(model, step, seed=step)
        expected, got = torch_trainer.train_step(batch), megatron.train_step(batch)
        for key in ("loss", "kl", "entropy", "lr"):
            assert got[key] == pytest.approx(expected[key], rel=TOL["rtol"], abs=TOL["atol"] / 10), (step, key)
    assert expected["kl"] > 0 and expected["lr"] < config.lr
    check_same_update(torch_trainer, megatron, expected_record, got_record)
