"""Run assembly: one factory builds each kind of trainer (torch, Megatron) and of engine (embedded, SGLang)
from a TrainConfig; a bad kind is refused naming the allowed ones; and the run takes any trainer and
engine satisfying the protocols (here a scripted engine and a trainer proxy), with the same weight
hand-off for every pair."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.request
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

import pytest
import torch

from april_ext import ConfigError, InvalidArgumentError
from april_ext.batch import FinishReason
from april_ext.engine import AsyncEngine
from april_ext.model import LlamaForCausalLM, iter_safetensors
from april_ext.protocol import GenerationChunk, GenerationOutput, RolloutEngine, SamplingParams, Trainer
from april_ext.trainer import TorchTrainer
from april_ext.training import TrainConfig, TrainingRun
from april_ext.training import config as config_module
from april_ext.training.engines import ENGINE_KINDS, build_engine
from april_ext.training.trainers import TRAINER_KINDS, build_trainer

from _sglang_utils import live_server
from _torch_threads import one_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(counting_median=3.0, counting_sigma=0.8, counting_max_count=12, counting_symbols=2, hidden_size=16,
            num_layers=1, rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4,
            max_num_seqs=64, num_blocks=256, lr=0.003, progress=False, plots=False)


def tiny(tmp_path, **changes) -> TrainConfig:
    return TrainConfig(**{**TINY, "output_dir": str(tmp_path / "run"), "num_steps": 2, **changes})


def counting_model(config: TrainConfig, seed: int = 0) -> LlamaForCausalLM:
    from april_ext.tasks import CountingTask, CountingTaskConfig

    task = CountingTask(CountingTaskConfig(n_symbols=config.counting_symbols, max_count=config.counting_max_count,
                                           median_count=config.counting_median, sigma=config.counting_sigma))
    model = LlamaForCausalLM(task.model_config(hidden_size=config.hidden_size, intermediate_size=3 * config.hidden_size,
                                               num_hidden_layers=config.num_layers))
    model.init_weights(seed)
    return model


def with_kind(config: TrainConfig, **kinds: str) -> TrainConfig:
    """The config with a kind TrainConfig itself would refuse (the factories check at their own boundary)."""
    for name, value in kinds.items():
        object.__setattr__(config, name, value)
    return config


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in trainer.export_weights()}


# ----- the factories -----------------------------------------------------------------------------------


def test_the_factories_build_exactly_the_kinds_train_config_allows():
    assert TRAINER_KINDS == config_module.TRAINERS
    assert ENGINE_KINDS == config_module.ENGINES


@pytest.mark.parametrize("factory, field, allowed", [("trainer", "trainer", TRAINER_KINDS),
                                                     ("engine", "engine", ENGINE_KINDS)])
def test_a_bad_kind_is_refused_naming_the_allowed_kinds(tmp_path, factory, field, allowed):
    config = with_kind(tiny(tmp_path), **{field: "jax"})
    with pytest.raises(ConfigError, match=re.escape(f"TrainConfig.{field}='jax' is not allowed: one of {allowed}")):
        if factory == "trainer":
            build_trainer(config, counting_model(config))
        else:
            build_engine(config, TorchTrainer(counting_model(config)), counting_model(config).config)


def test_torch_trainer_from_a_train_config(tmp_path):
    config = tiny(tmp_path, algorithm="dapo", lr=0.02, micro_batch_tokens=64, temperature=0.7, top_p=0.9,
                  colocate=True, kl_loss_coef=0.1)
    model = counting_model(config)
    with build_trainer(config, model, "factory-torch-") as trainer:
        assert isinstance(trainer, TorchTrainer) and isinstance(trainer, Trainer)
        assert trainer.model is model and trainer.version == 0
        settings = trainer.config
        assert settings.lr == 0.02 and settings.micro_batch_tokens == 64
        assert settings.temperature == 0.7 and settings.top_p == 0.9
        assert settings.algorithm.dynamic_sampling and settings.algorithm.kl_loss_coef == 0.1
        assert settings.colocated and settings.memory_tag == "factory-torch-trainer"


def test_megatron_trainer_from_a_train_config(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")
    from april_ext.trainer.megatron import MegatronTrainer

    config = tiny(tmp_path, trainer="megatron", lr=0.02)
    model = counting_model(config, seed=3)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    with build_trainer(config, model) as trainer:
        assert isinstance(trainer, MegatronTrainer) and isinstance(trainer, Trainer)
        assert trainer.config.lr == 0.02 and trainer.version == 0
        exported = weights(trainer)
        assert all(torch.equal(exported[name], value) for name, value in expected.items())
        assert torch.distributed.is_initialized()
    assert not torch.distributed.is_initialized()  # the factory tore its process group down


def test_embedded_engine_starts_on_the_trainers_weights_and_version(tmp_path):
    config = tiny(tmp_path)
    trainer = TorchTrainer(counting_model(config, seed=4), initial_version=5)
    expected = weights(trainer)
    seed_state = torch.get_rng_state()

    async def build() -> None:
        async with build_engine(config, trainer, trainer.model.config, "factory-embedded-") as engine:
            assert isinstance(engine, AsyncEngine) and isinstance(engine, RolloutEngine)
            assert engine.health()["weight_version"] == 5
            served = dict(engine.core.model.named_parameters())
            assert all(torch.equal(served[name].cpu(), value) for name, value in expected.items())
            assert served["lm_head.weight"].data_ptr() != trainer.model.lm_head.weight.data_ptr()
        assert engine.health()["status"] == "stopped"

    asyncio.run(build())
    # Building the engine's model drew nothing from the run's seeded RNG stream.
    assert torch.equal(torch.get_rng_state(), seed_state)


def test_sglang_engine_on_running_servers_gets_the_trainers_weights_and_version(tmp_path):
    config = tiny(tmp_path, engine="sglang", sglang_urls=("http://127.0.0.1:1",), model="unused")
    trainer = TorchTrainer(counting_model(config, seed=4), initial_version=7)
    with live_server(counting_model(config, seed=9), weight_version="17", block_size=16) as server:
        config = config.replace(sglang_urls=(server.url,))

        async def build() -> list[str]:
            from april_ext.sglang import SGLangEngine

            async with build_engine(config, trainer, trainer.model.config) as engine:
                assert isinstance(engine, SGLangEngine) and isinstance(engine, RolloutEngine)
                return list((await engine.weight_versions()).values())

        assert asyncio.run(build()) == ["7"]
        with urllib.request.urlopen(f"{server.url}/model_info", timeout=5) as resp:
            assert json.loads(resp.read())["weight_version"] == "7"
    # Pushed the way every later sync goes: through the weight-sync directory.
    synced = dict(iter_safetensors(tmp_path / "run" / "sglang" / "weight_sync"))
    assert all(torch.equal(synced[name], value) for name, value in weights(trainer).items())


# ----- the run over any protocol objects ---------------------------------------------------------------


class ScriptedEngine:
    """A RolloutEngine that is no engine of april_ext: every request is answered at once with the
    prompt's symbol repeated 1-4 times (by the request's seed) and the stop token. It records the
    weight updates and memory calls it receives."""

    def __init__(self, version: int) -> None:
        self.started_at = version
        self.version = version
        self.updates: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.memory_calls: list[tuple[str, tuple[str, ...] | None]] = []

    async def generate(self, input_ids: Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[GenerationChunk]:
        assert params is not None and params.stop_token_ids and params.seed is not None
        await asyncio.sleep(0)
        tokens = [int(input_ids[1])] * (1 + params.seed % 4) + [params.stop_token_ids[0]]
        yield GenerationChunk(request_id or "r", tokens, [-1.0] * len(tokens), self.version, FinishReason.STOP,
                              params.stop_token_ids[0])

    async def abort(self, request_ids: str | Iterable[str] | None = None) -> list[GenerationOutput]:
        return []  # every request finished as it started

    async def update_weights(self, weights: Any, version: int) -> None:
        self.updates.append((version, {name: t.detach().cpu().clone() for name, t in weights}))
        self.version = version

    async def release_memory(self, tags: Iterable[str] | None = None) -> None:
        self.memory_calls.append(("release", None if tags is None else tuple(tags)))

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        self.memory_calls.append(("resume", None if tags is None else tuple(tags)))

    def stats(self) -> dict[str, int]:
        return {"updates": len(self.updates)}

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "weight_version": self.version}


class TrainerProxy:
    """A Trainer that is no trainer of april_ext: the protocol's members only, forwarded to a real one."""

    def __init__(self, inner: Trainer) -> None:
        self._inner = inner
        self.calls: list[str] = []

    @property
    def version(self) -> int:
        return self._inner.version

    def train_step(self, batch):
        self.calls.append("train_step")
        return self._inner.train_step(batch)

    def export_weights(self, *, to_cpu: bool = False):
        return self._inner.export_weights(to_cpu=to_cpu)

    def save_checkpoint(self, path, extra=None) -> None:
        self.calls.append("save_checkpoint")
        self._inner.save_checkpoint(path, extra)

    def load_checkpoint(self, path):
        self.calls.append("load_checkpoint")
        return self._inner.load_checkpoint(path)

    def offload(self) -> None:
        self.calls.append("offload")
        self._inner.offload()

    def onload(self) -> None:
        self.calls.append("onload")
        self._inner.onload()


def protocol_factories(engines: list[ScriptedEngine], trainers: list[TrainerProxy]):
    @contextlib.contextmanager
    def trainer_factory(config: TrainConfig, model: LlamaForCausalLM, prefix: str) -> Iterator[Trainer]:
        with build_trainer(config, model, prefix) as inner:
            trainers.append(TrainerProxy(inner))
            yield trainers[-1]

    @contextlib.asynccontextmanager
    async def engine_factory(config: TrainConfig, trainer: Trainer, model_config, prefix: str):
        engines.append(ScriptedEngine(trainer.version))
        yield engines[-1]

    return dict(trainer_factory=trainer_factory, engine_factory=engine_factory)


async def run_steps(config: TrainConfig, **factories) -> list[dict[str, Any]]:
    async with TrainingRun(config, **factories) as run:
        while not run.done:
            await run.step()
        return (await run.finish()).history


@pytest.mark.parametrize("colocate", [False, True])
def test_a_run_takes_any_engine_and_trainer_satisfying_the_protocols(tmp_path, colocate):
    engines: list[ScriptedEngine] = []
    trainers: list[TrainerProxy] = []
    history = asyncio.run(run_steps(tiny(tmp_path, colocate=colocate, num_steps=3),
                                    **protocol_factories(engines, trainers)))
    (engine,), (trainer,) = engines, trainers
    assert [r["step"] for r in history] == [1, 2, 3] and [r["policy_version"] for r in history] == [0, 1, 2]
    for row in history:
        assert row["rollout/batch_groups"] == 2
        assert all(2 <= n <= 5 for n in row["rollout/response_lens"])  # the script's answers
        assert row["train/version"] == row["step"]
        assert "engine/server_weight_versions" not in row  # no servers behind this engine
    # Each update reached the engine as the trainer's weights with its new version.
    assert [version for version, _ in engine.updates] == [1, 2, 3]
    final = weights(trainer)
    assert all(torch.equal(engine.updates[-1][1][name], value) for name, value in final.items())
    assert trainer.calls.count("train_step") == 3 and trainer.calls[-1] == "save_checkpoint"
    if colocate:
        # Per step: rollout (engine resumed), training (engine released), weights resumed for the sync;
        # at the end both sides resident again.
        step = [("resume", None), ("release", None), ("resume", ("weights",))]
        assert engine.memory_calls == step * 3 + [("resume", None)]
        assert trainer.calls.count("offload") == 3 and trainer.calls.count("onload") == 4
    else:
        assert engine.memory_calls == [] and "offload" not in trainer.calls


def test_a_resumed_run_starts_its_engine_on_the_checkpoints_weights_and_version(tmp_path):
    asyncio.run(run_steps(tiny(tmp_path, num_steps=2), **protocol_factories([], [])))
    engines: list[ScriptedEngine] = []
    trainers: list[TrainerProxy] = []
    history = asyncio.run(run_steps(tiny(tmp_path, num_steps=3, resume=True),
                                    **protocol_factories(engines, trainers)))
    assert [r["step"] for r in history] == [1, 2, 3]
    assert trainers[0].calls[0] == "load_checkpoint"
    assert engines[0].started_at == 2 and [version for version, _ in engines[0].updates] == [3]


class _NotATrainer:
    version = 0

    def train_step(self, batch):
        raise AssertionError("never called")


def test_a_factory_building_something_else_is_refused_naming_the_missing_members(tmp_path):
    @contextlib.contextmanager
    def trainer_factory(config, model, prefix):
        yield _NotATrainer()

    async def enter() -> None:
        async with TrainingRun(tiny(tmp_path), trainer_factory=trainer_factory):
            raise AssertionError("entered")

    with pytest.raises(InvalidArgumentError, match=r"trainer factory built a _NotATrainer, which lacks the Trainer "
                                                   r"members \['export_weights', 'load_checkpoint', 'offload'"):
        asyncio.run(enter())
