"""Topology: who runs where in a Ray run, from TrainConfig's Ray settings (slime's flag names).

The trainer has ``actor_num_nodes * actor_num_gpus_per_node`` ranks, one GPU each; the rollout engines
share ``rollout_num_gpus`` GPUs, ``rollout_num_gpus_per_engine`` each (their tensor parallel size).
Disaggregated, each role has a placement group of its own; colocated, the engines are placed in the
trainer's bundles and both halves of a bundle alternate through pause / resume. Without a GPU
(TrainConfig.device "cpu") the same shapes are made of ``ray_num_cpus_per_actor`` CPUs, so the whole
topology runs on a CPU-only cluster. Plain arithmetic: nothing here talks to Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from april_ext.errors import ConfigError
from april_ext.training.config import TrainConfig

# Colocated on GPUs: the share of a bundle's GPU each side reserves (Ray only counts; both use the whole
# device in turn). Two shares below 1 let both actors sit in one single-GPU bundle.
_COLOCATED_GPU_SHARE = 0.5


@dataclass(frozen=True)
class Placement:
    """One actor's place: the placement group role ("trainer" / "rollout"), the bundle, and what it reserves."""

    role: str
    bundle: int
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class Topology:
    trainer_ranks: int
    num_engines: int
    gpus_per_engine: int
    use_gpus: bool
    colocate: bool
    cpus_per_actor: float

    @classmethod
    def from_config(cls, config: TrainConfig) -> Topology:
        """Checks the settings against each other: whole engines, an engine within a node, colocated
        engines on the trainer's GPUs one each, the embedded engine without tensor parallelism."""
        ranks = config.actor_num_nodes * config.actor_num_gpus_per_node
        per_engine = config.rollout_num_gpus_per_engine
        gpus = config.rollout_num_gpus
        if gpus is None:
            gpus = ranks if config.colocate else per_engine
        if gpus % per_engine:
            raise ConfigError(f"TrainConfig.rollout_num_gpus={gpus} is not allowed: a multiple of "
                              f"rollout_num_gpus_per_engine ({per_engine})")
        if per_engine > config.num_gpus_per_node:
            raise ConfigError(f"TrainConfig.rollout_num_gpus_per_engine={per_engine} is not allowed: at most "
                              f"num_gpus_per_node ({config.num_gpus_per_node}); an engine runs on one node")
        if config.actor_num_gpus_per_node > config.num_gpus_per_node:
            raise ConfigError(f"TrainConfig.actor_num_gpus_per_node={config.actor_num_gpus_per_node} is not "
                              f"allowed: at most num_gpus_per_node ({config.num_gpus_per_node})")
        if config.engine == "embedded" and per_engine != 1:
            raise ConfigError(f"TrainConfig.rollout_num_gpus_per_engine={per_engine} is not allowed with "
                              "engine='embedded': 1 (the embedded engine has no tensor parallelism)")
        if config.colocate and (gpus != ranks or per_engine != 1):
            raise ConfigError(f"TrainConfig.colocate with ray needs rollout_num_gpus equal to the trainer's GPUs "
                              f"({ranks}) and rollout_num_gpus_per_engine 1 (one engine beside each rank), got "
                              f"rollout_num_gpus={gpus}, rollout_num_gpus_per_engine={per_engine}")
        return cls(trainer_ranks=ranks, num_engines=gpus // per_engine, gpus_per_engine=per_engine,
                   use_gpus=config.device.startswith("cuda"), colocate=config.colocate,
                   cpus_per_actor=config.ray_num_cpus_per_actor)

    def bundles(self, role: str) -> list[dict[str, float]]:
        """The bundles of the role's placement group ([] for "rollout" when colocated: the trainer's hold both)."""
        if role == "trainer":
            cpus = self.cpus_per_actor * (2 if self.colocate else 1)
            return [self._bundle(cpus, 1) for _ in range(self.trainer_ranks)]
        if role == "rollout":
            return [] if self.colocate else [self._bundle(self.cpus_per_actor, self.gpus_per_engine)
                                             for _ in range(self.num_engines)]
        raise ConfigError(f"placement role {role!r} is not allowed: 'trainer' or 'rollout'")

    def _bundle(self, cpus: float, gpus: int) -> dict[str, float]:
        return {"CPU": cpus, "GPU": float(gpus)} if self.use_gpus else {"CPU": cpus}

    def trainer(self, rank: int) -> Placement:
        gpus = (_COLOCATED_GPU_SHARE if self.colocate else 1.0) if self.use_gpus else 0.0
        return Placement("trainer", rank, self.cpus_per_actor, gpus)

    def engine(self, index: int) -> Placement:
        if self.colocate:
            return Placement("trainer", index, self.cpus_per_actor, _COLOCATED_GPU_SHARE if self.use_gpus else 0.0)
        return Placement("rollout", index, self.cpus_per_actor, float(self.gpus_per_engine) if self.use_gpus else 0.0)


__all__ = ["Placement", "Topology"]
