"""TrainConfig: every setting of an ``april-ext train`` run, validated; read from TOML and command-line flags.

Field names are the flag names RL users know from slime / Megatron (``rollout_batch_size`` is
``--rollout-batch-size``); a TOML config file uses the same names as keys. Precedence: defaults, then
the config file, then flags. Every SchedulerConfig field is a TrainConfig field too, adopted from it
(type, default, allowed values, docs) and validated by it, so its errors read as SchedulerConfig's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from april_ext.algorithms import KL_SHAPED_ADVANTAGES
from april_ext.errors import ConfigError
from april_ext.scheduler import SchedulerConfig
from april_ext.settings import MAX_SEED, adopt
from april_ext.strategies import STRATEGIES, configure
from april_ext.trainer.megatron.parallel import MegatronParallelConfig
from april_ext.training.config_rules import (
    ALGORITHMS,
    ENGINES,
    IMPORT_PATH,
    PARALLEL_SETTINGS,
    SCHEDULER_SETTINGS,
    TASKS,
    TRAINERS,
    EngineKind,
    KlType,
    LossAggregation,
    LrDecayStyle,
    OptimizerKind,
    RayRouting,
    RewardKind,
    RmType,
    TrainerKind,
    WeightSync,
    bad,
    check_async,
    check_colocated_carry,
    check_custom_generate,
    check_environment,
    check_lookup,
    check_parallel,
    check_ray,
    check_sglang,
    check_type,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

# A run's batch is the counting task's on a CPU: 8 groups, not SchedulerConfig's 32.
@dataclass(frozen=True)
@adopt(SchedulerConfig, defaults={"rollout_batch_size": 8})
@adopt(MegatronParallelConfig, exclude=("timeout_s",))
class TrainConfig:
    """One training run. See docs/loop.md for the table of fields. The scheduler's settings (rollout_batch_size,
    refill, max_staleness, ...) are every SchedulerConfig field, and the parallel layout
    (tensor_model_parallel_size, ...) every MegatronParallelConfig field but its timeout, adopted after the
    fields written here."""

    # --- data and task
    task: str | None = "counting"
    """Built-in task ("counting"; "lookup": multi-turn with a tool, docs/agentic.md), or None when --data gives a
    prompt file."""
    data: str | None = None
    """JSONL / Parquet prompt file (math answers are verified against label_key)."""
    tokenizer: str | None = None
    """Local Hugging Face tokenizer directory; None with data: the model directory (as slime takes the tokenizer
    from --hf-checkpoint)."""
    prompt_key: str = "prompt"
    """Record field holding the prompt (text or chat); dotted keys walk nested objects."""
    label_key: str = "label"
    """Record field holding the reference answer."""
    num_epochs: int | None = None
    """Passes over the prompt file before the data runs out (slime's --num-epoch); None: the file cycles, pass
    after pass, until num_steps, as slime's data source does."""
    rollout_shuffle: bool = False
    """Visit the prompt file in a new permutation each pass, drawn from (seed, pass); False: file order (slime's
    --rollout-shuffle and default)."""
    counting_median: float = 4.0
    """Counting task: median target count N (log-normal, so a long tail of large N)."""
    counting_sigma: float = 1.0
    """Counting task: log-normal sigma of N (larger: longer tail)."""
    counting_max_count: int = 24
    """Counting task: the cap of N."""
    counting_symbols: int = 4
    """Counting task: distinct symbols X."""
    lookup_max_hops: int = 1
    """Lookup task: the cap of a prompt's chain length (the tool calls a perfect trajectory makes)."""
    max_turns: int = 4
    """Lookup task: model turns per trajectory at most (a tool call in the last one ends it: "max_turns")."""
    max_tool_calls: int = 3
    """Lookup task: tool calls per trajectory at most (one more ends it: "max_tool_calls")."""
    tool_latency_median_s: float = 0.02
    """Lookup task: the tool's latency, lognormal with this median (seconds)..."""
    tool_latency_p99_s: float = 0.5
    """...and this 99th percentile (equal to the median: a constant latency)."""
    tool_timeout_s: float = 30.0
    """Multi-turn tasks: seconds one environment step (a tool call) may take; past it the trajectory ends with
    "tool_timeout" and reward 0."""
    max_concurrent_tool_calls: int | None = None
    """Multi-turn tasks: environment steps running at once at most (real tools have rate limits); None: no cap."""
    environment_path: str | None = None
    """A multi-turn Environment of your own by import path ("pkg.module:make"; docs/agentic.md), over data's
    prompts: an Environment object, or a callable returning one (given the run's tokenizer when it takes a
    parameter). Its final rewards are the samples'; its optional stop_token_ids end a turn besides EOS."""
    # --- model
    model: str | None = None
    """Hugging Face checkpoint directory; None builds a tiny random model for the counting task."""
    hidden_size: int = 64
    """Tiny counting model: hidden size (intermediate size is 3x)."""
    num_layers: int = 2
    """Tiny counting model: decoder layers."""
    # --- rollout (the other scheduler settings are adopted from SchedulerConfig)
    max_response_len: int | None = None
    """Response token cap per sample; None: the counting task's longest answer, or 1024 with data."""
    strategy: str | None = None
    """A named long-tail strategy (april_ext.strategies.STRATEGIES: april, april_carry, seer, april_seer,
    rollpacker, rollpacker_extra, april_tail, sortedrl; docs/strategies.md): the scheduler settings it stands
    for, applied to the run's; a scheduler setting given with a value other than its default wins over the
    strategy's, and the combination is what is validated."""
    partial_rollout: bool = True
    """APRIL (over-sample, abort when N groups are done, resume partials) vs the synchronous baseline (N' = N,
    batch refill, fixed over-sampling)."""
    async_rollout: bool = False
    """Asynchronous run (docs/async.md): the rollout of the next batches runs while the trainer trains, at most
    max_head_offpolicyness versions ahead; new weights reach the engines between two rollout steps."""
    max_head_offpolicyness: int = 1
    """async_rollout: d, the versions the rollout may run ahead of the trainer (AReaL's name): the batch trained at
    version b is generated once version b - d is in every engine. 0: no overlap (the synchronous loop)."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling (<= 0: off)."""
    # --- engine
    max_num_seqs: int = 256
    """Engine: sequences running at once."""
    num_blocks: int = 2048
    """Engine: KV cache pages."""
    block_size: int = 16
    """Engine: tokens per KV page."""
    device: str = "cpu"
    """Engine and trainer device ("cpu", "cuda", "cuda:1")."""
    engine: EngineKind = "embedded"
    """Rollout engine: "embedded" (in-process) or "sglang" (SGLang servers over HTTP)."""
    sglang_urls: tuple[str, ...] = ()
    """engine=sglang: running SGLang worker urls (comma-separated on the command line); they must serve model."""
    sglang_router_url: str | None = None
    """engine=sglang: an SGLang router url instead of sglang_urls."""
    sglang_launch: bool = False
    """engine=sglang: start sglang_num_servers servers on this machine, loading the run's initial weights."""
    sglang_num_servers: int = 1
    """sglang_launch: servers started."""
    sglang_module: str = "sglang.launch_server"
    """sglang_launch: the server module run as python -m (april_ext.server is the embedded stand-in)."""
    sglang_args: str = ""
    """sglang_launch: extra server flags, shell-quoted (e.g. "--mem-fraction-static 0.7")."""
    sglang_launch_timeout_s: float = 600.0
    """sglang_launch: seconds a server may take to become healthy."""
    sglang_weight_sync_dir: str | None = None
    """engine=sglang: directory the servers load new weights from (a shared file system); None:
    <output_dir>/sglang/weight_sync."""
    sglang_stream: bool = True
    """engine=sglang: stream responses (tokens as they come) or one non-streaming request per sample."""
    sglang_worker_timeout_s: float | None = 60.0
    """engine=sglang or ray: failover. A server that refuses connections, or sends nothing (no token, no /health
    answer) for this many seconds, is removed; its requests are resumed on the others, and it rejoins with
    the current weights when it answers again (docs/sglang.md). None: no failover."""
    sglang_priority: bool = False
    """engine=sglang or ray: send each request's predicted remaining length as its SGLang priority when
    dispatch_order sorts by it (longest_predicted_first: longer first; shortest_first: shorter first). SGLang
    servers must run with --enable-priority-scheduling (put it in sglang_args); the embedded server always orders
    its waiting requests by priority."""
    weight_sync: WeightSync = "disk"
    """engine=sglang or ray: how new weights reach the servers: "disk" (written to sglang_weight_sync_dir and loaded
    with /update_weights_from_disk; any SGLang release, needs a shared file system), "tensor" (in
    /update_weights_from_tensor requests; the embedded server only) or "broadcast" (SGLang's collective update:
    this process broadcasts to every server through a process group; docs/weight_sync.md)."""
    weight_sync_bucket_mb: float = 64.0
    """weight_sync=broadcast: MiB of tensors per /update_weights_from_distributed call."""
    weight_sync_timeout_s: float = 60.0
    """weight_sync=broadcast: seconds joining the weight group, each HTTP call of an update and each collective
    may wait (the broadcasting side's and, for the embedded server, the server's --weight-group-timeout)."""
    # --- training
    trainer: TrainerKind = "torch"
    """Trainer: "torch" (april_ext.model) or "megatron" (a megatron-core GPTModel; needs april_ext[megatron])."""
    algorithm: str = "grpo"
    """grpo, drgrpo, dapo (clip-higher + dynamic-sampling filter), gspo, reinforce_plus_plus (per-token
    discounted returns) or reinforce_plus_plus_baseline (group-mean baseline); slime's --advantage-estimator."""
    lr: float = 2e-3
    """AdamW learning rate."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss term to the initial policy (0: none); slime's --kl-loss-coef, on the command line
    with --use-kl-loss as in slime. Before the rename this was kl_coef."""
    kl_coef: float = 0.0
    """slime's --kl-coef: KL reward shaping before the advantages (the per-token KL of the policy before the
    update to the initial policy, weighted by this, enters reinforce_plus_plus's token rewards and is subtracted
    from reinforce_plus_plus_baseline's advantages); grpo, drgrpo, dapo and gspo ignore it, as slime does."""
    kl_loss_type: KlType = "k1"
    """KL estimator of the KL loss and the KL reward shaping: k1, k2, k3 or low_var_kl (k3 clipped to [-10, 10]);
    slime's --kl-loss-type and default."""
    gamma: float = 1.0
    """Discount of reinforce_plus_plus's returns (slime's --gamma)."""
    normalize_advantages: bool = False
    """Whiten the per-token advantages over the batch's loss tokens (slime's --normalize-advantages)."""
    use_decoupled_loss: bool | None = None
    """AReaL's decoupled PPO: clip against the proximal policy (the weights before the update) and weight each
    token by pi_prox / pi_behavior (the rollout's log-prob); excludes tis_cap. None: on in an asynchronous run
    without tis_cap whose rollout runs ahead (its tokens are a version or more behind), off otherwise (see
    decoupled_loss)."""
    behav_imp_weight_cap: float | None = None
    """use_decoupled_loss: tokens whose pi_prox / pi_behavior exceeds this (> 1) are dropped from the loss (AReaL's
    filter); None: no cap."""
    eps_clip: float | None = None
    """PPO clip range below 1 (ratio >= 1 - eps_clip); None: the algorithm's (0.2; GSPO 3e-4)."""
    eps_clip_high: float | None = None
    """PPO clip range above 1 (ratio <= 1 + eps_clip_high); None: eps_clip when that is set, else the
    algorithm's (0.2; DAPO 0.28; GSPO 4e-4)."""
    tis_cap: float | None = None
    """Truncated importance sampling cap for off-policy tokens (resumed partials); None: off."""
    tis_floor: float = 0.0
    """Lower clip of the truncated importance weight (slime's --tis-clip-low); 0: none. Needs tis_cap."""
    global_batch_size: int | None = None
    """Samples per optimizer step (whole groups: a multiple of n_samples_per_prompt dividing
    rollout_batch_size * n_samples_per_prompt); None: the whole batch, one optimizer step per rollout."""
    micro_batch_tokens: int = 8192
    """Trainer: token budget of one forward/backward."""
    micro_batch_size: int | None = None
    """Trainer: at most this many samples in one forward/backward besides the token budget (slime's
    --micro-batch-size); None: the token budget alone."""
    num_steps: int | None = 20
    """Training steps of the run (a resumed run counts its earlier steps); None: until the num_epochs passes over
    the prompt file are used up."""
    seed: int = 0
    """Seeds the task stream, model init, request sampling and RNGs."""
    deterministic_rollout: bool = True
    """The embedded engine steps in lockstep with the rollout loop and rewards reach the scheduler in the order
    the groups completed, so a run repeats exactly for a seed, APRIL and carry included (RolloutLoop's
    deterministic; docs/loop.md, "Deterministic rollouts"). False: the engine steps as fast as it can, which
    lets the engine's thread run ahead of the loop (timing decides where an abort cuts). SGLang engines ignore
    it."""
    custom_rm_path: str | None = None
    """Reward function by import path, "pkg.module:fn" (or "pkg.module.fn"), instead of the task's; see
    custom_rm_kind for its signatures."""
    custom_rm_kind: RewardKind = "auto"
    """How custom_rm_path is called: "sample" fn(prompt, response_ids) -> float, "batch" fn(prompts,
    responses) -> list[float] (one group per call), "group" fn(prompt, responses) -> list[float]; sync or
    async. "auto" reads it from the function's `reward_kind` attribute, else from its parameter names."""
    custom_rm_text: bool = False
    """custom_rm_path gets each response as text decoded with the tokenizer (skipping special tokens) instead
    of token ids; needs data."""
    custom_rm_timeout_s: float = 300.0
    """Seconds one call of custom_rm_path may take; past that the run stops with an error naming it."""
    custom_generate_function_path: str | None = None
    """slime's custom generate function by import path ("pkg.module.fn" or "pkg.module:fn"; docs/training.md):
    ``async def generate(args, sample, sampling_params) -> Sample`` runs each sample's whole multi-turn rollout
    against the SGLang servers itself (engine='sglang'), under the scheduler with partial rollouts; the
    samples' own rewards are kept, custom_rm_path or the task's reward function scores the rest."""
    dynamic_sampling_filter_path: str | None = None
    """Group filter by import path: fn(rewards: list[float]) -> bool (False drops the group); replaces the
    algorithm's (DAPO's rejection of uniform groups)."""
    eval_interval: int = 0
    """Evaluate on held-out prompts every k steps (0: never); eval metrics join that step's metrics row."""
    eval_prompt_data: str | None = None
    """Held-out prompt file (JSONL / Parquet, read with data's keys and tokenizer); None: eval_counting_prompts
    held-out prompts of the counting task."""
    n_samples_per_eval_prompt: int = 1
    """Samples per held-out prompt (pass@k with k = this)."""
    eval_counting_prompts: int = 32
    """Counting task: held-out prompts per evaluation (a stream of their own, seed + 1)."""
    colocate: bool = False
    """Pause the trainer's memory while the engine generates and the engine's while the trainer trains."""
    num_threads: int | None = None
    """torch intra-op threads; None leaves torch's default."""
    distributed_timeout_minutes: float = 10.0
    """Across ranks (torchrun): the limit of every collective and of a rank's wait for rank 0's next command."""
    # --- optimiser, loss, reference, reward and evaluation sampling: slime's flags of these (docs/loop.md)
    optimizer: OptimizerKind = "adam"
    """The optimizer (Megatron's --optimizer): "adam", Adam with decoupled weight decay (AdamW), as Megatron's."""
    weight_decay: float = 0.0
    """Decoupled weight decay of the optimizer (Megatron's --weight-decay, whose default is 0.01)."""
    adam_beta1: float = 0.9
    """Adam's beta1 (Megatron's --adam-beta1)."""
    adam_beta2: float = 0.999
    """Adam's beta2 (Megatron's --adam-beta2)."""
    adam_eps: float = 1e-8
    """Adam's epsilon (Megatron's --adam-eps)."""
    clip_grad: float = 1.0
    """Clip the gradient to this global norm (Megatron's --clip-grad); 0: no clipping."""
    lr_decay_style: LrDecayStyle = "constant"
    """Learning-rate schedule after the warmup (Megatron's --lr-decay-style): constant, linear or cosine decay
    from lr to min_lr over lr_decay_iters optimizer steps."""
    lr_warmup_iters: int = 0
    """Optimizer steps of the linear warmup from 0 to lr (Megatron's --lr-warmup-iters)."""
    lr_decay_iters: int | None = None
    """The optimizer step at which the decay reaches min_lr (Megatron's --lr-decay-iters); None: the run's last
    (num_steps x optimizer steps per rollout), as Megatron's train_iters."""
    min_lr: float = 0.0
    """The learning rate at the end of the decay (Megatron's --min-lr)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus this times the mean entropy of pi_train over the loss tokens (slime's
    --entropy-coef)."""
    loss_aggregation: LossAggregation | None = None
    """How token losses make the batch loss: "token" (over all loss tokens of the batch; slime's
    --calculate-per-token-loss) or "sequence" (each sample's mean first); None: the algorithm's (gspo "sequence",
    the others "token")."""
    ref_load: str | None = None
    """Hugging Face checkpoint directory of the KL reference policy (slime's --ref-load, which takes Megatron's
    format there); None: the initial weights. Used when a KL term needs a reference (kl_loss_coef > 0, or kl_coef
    with a reinforce_plus_plus estimator)."""
    rm_type: RmType | None = None
    """With data, slime's built-in reward by name (--rm-type): "math" (1 for the right final answer, else 0),
    "deepscaler" (the same for the text after the last </think>, 0 without one), "dapo" (1 or -1); None: math.
    Excludes custom_rm_path."""
    eval_temperature: float | None = None
    """Sampling temperature of evaluation (slime's --eval-temperature); None: temperature's."""
    eval_top_p: float | None = None
    """Nucleus mass of evaluation (slime's --eval-top-p); None: top_p's."""
    eval_top_k: int | None = None
    """Top-k of evaluation (slime's --eval-top-k; <= 0: off); None: top_k's."""
    eval_max_response_len: int | None = None
    """Response cap of evaluation (slime's --eval-max-response-len); None: the rollouts' cap."""
    # --- Ray (april_ext.cluster, docs/scaling.md)
    ray: bool = False
    """Run on Ray: one actor per trainer rank, one per rollout engine (each owning a server), the engines behind
    sglang-router; the driver keeps the scheduler and the rollout loop."""
    ray_address: str | None = None
    """ray: the cluster to join ("auto", "host:6379", "ray://host:10001"); None: RAY_ADDRESS, else a local
    cluster started by the run."""
    actor_num_nodes: int = 1
    """ray: nodes of the trainer (slime's --actor-num-nodes)."""
    actor_num_gpus_per_node: int = 1
    """ray: trainer ranks per node, one GPU each (slime's --actor-num-gpus-per-node); on a CPU, ranks per node."""
    rollout_num_gpus: int | None = None
    """ray: GPUs of all rollout engines (slime's --rollout-num-gpus); None: the trainer's when colocated, else
    rollout_num_gpus_per_engine (one engine). On a CPU each counts as an engine slot of ray_num_cpus_per_actor."""
    rollout_num_gpus_per_engine: int = 1
    """ray: GPUs of one engine, its tensor parallel size (slime's --rollout-num-gpus-per-engine)."""
    num_gpus_per_node: int = 8
    """ray: GPUs of a node (slime's --num-gpus-per-node); an engine must fit on one node."""
    ray_num_cpus_per_actor: float = 1.0
    """ray: CPUs each trainer and engine actor reserves (on a CPU-only cluster its only resource)."""
    ray_routing: RayRouting = "router"
    """ray: how requests reach the engines. "router": through sglang-router (policy cache_aware: a divided rollout's
    continuation returns to the engine holding its KV while the engines are balanced). "least_loaded": straight
    to the engine with the fewest KV tokens as it last reported them plus those sent since (no router; a
    continuation goes wherever the load is least, a re-prefill when that is another engine). docs/scaling.md."""
    ray_router_url: str | None = None
    """ray: a running sglang-router the engines register with; None: the run launches one on the driver
    (ray_routing "router" only)."""
    ray_timeout_s: float = 600.0
    """ray: seconds a trainer call (train step, checkpoint, export) may take, also the process-group timeout,
    and the startup limit of the actors, placement groups and router."""
    ray_engine_max_restarts: int = 3
    """ray: times Ray restarts an engine actor that died (it gets the current weights before it rejoins)."""
    ray_engine_check_interval_s: float = 1.0
    """ray: seconds between two liveness checks of the engine actors by the driver."""
    # --- outputs
    output_dir: str = "april_runs/run"
    """metrics.jsonl, plots and (unless save is set) checkpoints go here."""
    save: str | None = None
    """Checkpoint directory; None: <output_dir>/checkpoints."""
    save_interval: int = 0
    """Checkpoint every k steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept."""
    resume: bool = False
    """Continue from the newest checkpoint in the checkpoint directory (a fresh start when there is none)."""
    load: str | None = None
    """Continue from the newest checkpoint in this directory (a fresh start when there is none) and save new
    ones to the checkpoint directory; None: resume decides."""
    use_tensorboard: bool = False
    """Also write the metrics as TensorBoard event files under <output_dir>/tensorboard (needs april_ext[logging])."""
    use_wandb: bool = False
    """Also log the metrics to Weights & Biases (needs april_ext[logging]); WANDB_MODE=offline keeps the run local."""
    wandb_project: str = "april_ext"
    """use_wandb: the W&B project."""
    wandb_dir: str | None = None
    """use_wandb: where the W&B run directory goes; None: <output_dir>."""
    wandb_group: str | None = None
    """use_wandb: the W&B group of the run (slime's --wandb-group)."""
    plots: bool = True
    """Write PNG plots at the end."""
    progress: bool = True
    """Show tqdm progress bars."""

    def __post_init__(self) -> None:
        if isinstance(self.sglang_urls, list):  # TOML arrays arrive as lists
            object.__setattr__(self, "sglang_urls", tuple(self.sglang_urls))
        for f in fields(self):
            if f.name not in SCHEDULER_SETTINGS and f.name not in PARALLEL_SETTINGS:
                check_type(self, f.name, getattr(self, f.name))
        if self.strategy is not None and self.strategy not in STRATEGIES:
            bad("strategy", self.strategy, f"None or one of {', '.join(repr(n) for n in STRATEGIES)}")
        self.scheduler_config()  # built and validated here, once: the run and its engine read the same one
        check_parallel(self)
        if self.task is not None and self.task not in TASKS:
            bad("task", self.task, f"one of {TASKS}, or None with data")
        if (self.task is None) == (self.data is None):
            bad("task", self.task, f"exactly one of task and data (data={self.data!r})")
        if self.task == "lookup":
            check_lookup(self)
        if self.environment_path is not None:
            check_environment(self)
        if self.data is not None and self.model is None:
            bad("model", None, "a checkpoint directory when data is given (the tiny model is for the counting task)")
        for name in ("counting_max_count", "counting_symbols", "hidden_size", "num_layers",
                     "max_num_seqs", "num_blocks", "block_size", "micro_batch_tokens", "keep_checkpoints",
                     "n_samples_per_eval_prompt", "eval_counting_prompts"):
            if getattr(self, name) < 1:
                bad(name, getattr(self, name), "an int >= 1")
        self._check_data_bounds()
        self._check_optimisation()
        if self.custom_rm_text and (self.custom_rm_path is None or self.data is None):
            bad("custom_rm_text", True, "False unless custom_rm_path and data are given (the text is decoded "
                "with data's tokenizer)")
        if self.eval_prompt_data is not None and self.data is None:
            bad("eval_prompt_data", self.eval_prompt_data, "None unless data is given (it is read with data's "
                "tokenizer and keys; the counting task evaluates on eval_counting_prompts held-out prompts)")
        if self.eval_prompt_data is not None and self.eval_interval == 0:
            bad("eval_interval", 0, "an int >= 1 when eval_prompt_data is given (0 never evaluates)")
        for name in ("seed", "save_interval", "eval_interval"):
            if getattr(self, name) < 0:
                bad(name, getattr(self, name), "an int >= 0")
        if self.seed > MAX_SEED:
            bad("seed", self.seed, "an int in [0, 2**63 - 1]")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            bad("micro_batch_size", self.micro_batch_size, "None or an int >= 1")
        if self.num_threads is not None and not 1 <= self.num_threads <= 4096:
            bad("num_threads", self.num_threads, "None or an int in [1, 4096]")
        for name, allowed in (("algorithm", ALGORITHMS), ("engine", ENGINES), ("trainer", TRAINERS),
                              ("custom_rm_kind", typing.get_args(RewardKind)),
                              ("kl_loss_type", typing.get_args(KlType)),
                              ("optimizer", typing.get_args(OptimizerKind)),
                              ("lr_decay_style", typing.get_args(LrDecayStyle))):
            if getattr(self, name) not in allowed:
                bad(name, getattr(self, name), f"one of {allowed}")
        for name, allowed in (("loss_aggregation", typing.get_args(LossAggregation)),
                              ("rm_type", typing.get_args(RmType))):
            if getattr(self, name) not in (None, *allowed):
                bad(name, getattr(self, name), f"None or one of {allowed}")
        for name in ("counting_median", "lr", "custom_rm_timeout_s"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                bad(name, getattr(self, name), "a finite number > 0")
        if self.counting_median < 1:
            bad("counting_median", self.counting_median, "a finite number >= 1")
        for name in ("counting_sigma", "kl_loss_coef", "kl_coef", "temperature"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                bad(name, getattr(self, name), "a finite number >= 0")
        if self.tis_cap is not None and (not math.isfinite(self.tis_cap) or self.tis_cap <= 0):
            bad("tis_cap", self.tis_cap, "None or a finite number > 0")
        if self.tis_floor != 0 and (self.tis_cap is None or not 0 <= self.tis_floor < self.tis_cap):
            bad("tis_floor", self.tis_floor, f"0, or a number in [0, tis_cap) with tis_cap set (tis_cap={self.tis_cap})")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "a number in (0, 1]")
        if not 0 <= self.gamma <= 1:
            bad("gamma", self.gamma, "a number in [0, 1]")
        if self.behav_imp_weight_cap is not None and (not self.decoupled_loss or not math.isfinite(
                self.behav_imp_weight_cap) or self.behav_imp_weight_cap <= 1):
            bad("behav_imp_weight_cap", self.behav_imp_weight_cap, "None, or a finite number > 1 with "
                f"use_decoupled_loss (use_decoupled_loss={self.use_decoupled_loss})")
        if self.use_decoupled_loss and self.tis_cap is not None:
            bad("tis_cap", self.tis_cap, "None with use_decoupled_loss (the decoupled loss weights each token by "
                "pi_prox / pi_behavior itself; behav_imp_weight_cap caps it)")
        for name in ("eps_clip", "eps_clip_high"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0 or (name == "eps_clip" and value >= 1)):
                bad(name, value, "None or a finite number in [0, 1)" if name == "eps_clip"
                    else "None or a finite number >= 0")
        if self.global_batch_size is not None:
            n, total = self.n_samples_per_prompt, self.rollout_batch_size * self.n_samples_per_prompt
            if self.global_batch_size < 1 or self.global_batch_size % n or total % self.global_batch_size:
                bad("global_batch_size", self.global_batch_size,
                    f"None or a multiple of n_samples_per_prompt ({n}) that divides rollout_batch_size * "
                    f"n_samples_per_prompt ({total})")
        if self.custom_generate_function_path is not None:
            check_custom_generate(self)
        for name in ("custom_rm_path", "dynamic_sampling_filter_path", "custom_generate_function_path",
                     "environment_path"):
            path = getattr(self, name)
            if path is not None and not IMPORT_PATH.fullmatch(path):
                bad(name, path, "an import path 'pkg.module:function' or 'pkg.module.function'")
        check_sglang(self)
        check_ray(self)
        check_colocated_carry(self, self.scheduler_config())
        check_async(self, self.scheduler_config())

    @property
    def decoupled_loss(self) -> bool:
        """use_decoupled_loss as run: None is on in an asynchronous run that overlaps (max_head_offpolicyness > 0)
        unless it corrects with tis_cap (TIS)."""
        if self.use_decoupled_loss is not None:
            return self.use_decoupled_loss
        return self.async_rollout and self.max_head_offpolicyness > 0 and self.tis_cap is None

    def _check_data_bounds(self) -> None:
        """num_steps and num_epochs, the two bounds of a run's length, and the settings of a prompt file's passes."""
        for name in ("num_epochs", "num_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                bad(name, value, "None or an int >= 1")
        for name, value in (("num_epochs", self.num_epochs), ("rollout_shuffle", self.rollout_shuffle)):
            if value not in (None, False) and self.data is None:
                bad(name, value, f"{'None' if name == 'num_epochs' else 'False'} unless data is given (the built-in "
                    "tasks are generated streams, not files read in passes)")
        if self.num_steps is None and self.num_epochs is None:
            bad("num_steps", None, "an int >= 1, or None with num_epochs set (train until the passes over the "
                "prompt file are used up)")

    def _check_optimisation(self) -> None:
        """The optimiser, schedule, loss, reward and evaluation sampling settings slime's flags reach."""
        for name in ("weight_decay", "clip_grad", "min_lr", "entropy_coef"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                bad(name, getattr(self, name), "a finite number >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                bad(name, getattr(self, name), "a number in [0, 1)")
        if not math.isfinite(self.adam_eps) or self.adam_eps <= 0:
            bad("adam_eps", self.adam_eps, "a finite number > 0")
        if self.min_lr > self.lr:
            bad("min_lr", self.min_lr, f"a number <= lr ({self.lr})")
        if self.lr_warmup_iters < 0:
            bad("lr_warmup_iters", self.lr_warmup_iters, "an int >= 0")
        if self.lr_decay_iters is not None and self.lr_decay_iters <= self.lr_warmup_iters:
            bad("lr_decay_iters", self.lr_decay_iters, f"None or an int > lr_warmup_iters ({self.lr_warmup_iters})")
        if self.lr_decay_style != "constant" and self.lr_decay_iters is None and self.num_steps is None:
            bad("lr_decay_iters", None, f"an int with lr_decay_style={self.lr_decay_style!r} when num_steps is None "
                "(the decay ends at the run's last optimizer step, unknown then)")
        if self.rm_type is not None and (self.data is None or self.custom_rm_path is not None):
            bad("rm_type", self.rm_type, "None unless data is given without custom_rm_path (the counting task has "
                "its reward, and custom_rm_path replaces the built-in ones)")
        if self.eval_temperature is not None and (not math.isfinite(self.eval_temperature) or self.eval_temperature < 0):
            bad("eval_temperature", self.eval_temperature, "None or a finite number >= 0")
        if self.eval_top_p is not None and not 0 < self.eval_top_p <= 1:
            bad("eval_top_p", self.eval_top_p, "None or a number in (0, 1]")
        if self.eval_max_response_len is not None and self.eval_max_response_len < 1:
            bad("eval_max_response_len", self.eval_max_response_len, "None or an int >= 1")

    @property
    def lr_decay_end(self) -> int | None:
        """The optimizer step at which the learning-rate decay ends: lr_decay_iters, else the run's last."""
        if self.lr_decay_iters is not None or self.num_steps is None:
            return self.lr_decay_iters
        return self.num_steps * self.minibatches

    def lookup_task_config(self) -> Any:
        """The lookup task's settings (april_ext.tasks.LookupTaskConfig) for ``seed``."""
        from april_ext.tasks import LookupTaskConfig

        return LookupTaskConfig(max_hops=self.lookup_max_hops, max_turns=self.max_turns,
                                max_tool_calls=self.max_tool_calls, latency_median_s=self.tool_latency_median_s,
                                latency_p99_s=self.tool_latency_p99_s, seed=self.seed)

    def parallel_config(self) -> MegatronParallelConfig:
        """The parallel layout as a MegatronParallelConfig, which validates it (ConfigErrors name
        MegatronParallelConfig); its timeout is distributed_timeout_minutes."""
        return MegatronParallelConfig(**{name: getattr(self, name) for name in PARALLEL_SETTINGS},
                                      timeout_s=60.0 * self.distributed_timeout_minutes)

    def scheduler_config(self, max_response_len: int | None = None) -> SchedulerConfig:
        """The scheduler settings as a SchedulerConfig (the strategy applied), built and validated once with the
        config (ConfigErrors name SchedulerConfig). ``max_response_len`` stands in for a max_response_len of None
        (the run passes its task's cap; without it, SchedulerConfig's default does). The baseline's N' = N is
        scheduler_config_for's."""
        if max_response_len is None or self.max_response_len is not None:
            return self._scheduler
        return self._configure_scheduler(max_response_len)

    @functools.cached_property
    def _scheduler(self) -> SchedulerConfig:
        return self._configure_scheduler(self.max_response_len)

    def _configure_scheduler(self, cap: int | None) -> SchedulerConfig:
        values = {name: getattr(self, name) for name in SCHEDULER_SETTINGS}
        if cap is None:
            del values["max_response_len"]
        else:
            values["max_response_len"] = cap
        return configure(values, self.strategy)

    @property
    def checkpoint_dir(self) -> str:
        return self.save if self.save is not None else os.path.join(self.output_dir, "checkpoints")

    @property
    def resume_dir(self) -> str | None:
        """Where the run looks for a checkpoint to continue from; None: it starts fresh."""
        if self.load is not None:
            return self.load
        return self.checkpoint_dir if self.resume else None

    @property
    def tokenizer_dir(self) -> str | None:
        return self.tokenizer if self.tokenizer is not None else self.model

    @property
    def minibatches(self) -> int:
        """Optimizer steps per rollout batch (global_batch_size's)."""
        if self.global_batch_size is None:
            return 1
        return self.rollout_batch_size * self.n_samples_per_prompt // self.global_batch_size

    def replace(self, **changes: Any) -> TrainConfig:
        """This config with ``changes``, validated again; an unknown name raises ConfigError."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ConfigError(f"TrainConfig.replace: unknown setting(s) {unknown}; known settings: "
                              f"{sorted(f.name for f in fields(self))}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, where: str = "config") -> TrainConfig:
        """A config from a mapping of field names (dashes allowed); unknown names raise ConfigError."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where}: a table of settings is required, got {type(values).__name__}")
        names = {f.name for f in fields(cls)}
        clean = {}
        for key, value in values.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where}: setting names are strings, got {key!r}")
            name = key.replace("-", "_")
            if name not in names:
                raise ConfigError(f"{where}: unknown setting {key!r}; known settings: {sorted(names)}")
            clean[name] = value
        return cls(**clean)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> TrainConfig:
        """Reads a TOML file (top-level keys, or a [train] table) and applies ``overrides`` on top."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as handle:
                values = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from None
        except OSError as err:
            raise ConfigError(f"config file {path!r} cannot be read: {err.strerror or err}") from None
        if set(values) == {"train"} and isinstance(values["train"], dict):
            values = values["train"]
        # TOML has no null: the string "none" stands for None in optional settings.
        values = {k: (None if isinstance(v, str) and v.lower() == "none" else v) for k, v in values.items()}
        from_file = "kl_coef" in values and "kl_coef" not in overrides
        values.update(overrides)
        config = cls.from_dict(values, where=path)
        if from_file and config.kl_coef > 0 and config.algorithm not in KL_SHAPED_ADVANTAGES:
            # A file from before the rename would silently lose its KL loss: kl_coef named its weight.
            raise ConfigError(f"{path}: kl_coef = {config.kl_coef} with algorithm {config.algorithm!r} has no effect: "
                              f"kl_coef is slime's KL reward shaping now (used by {KL_SHAPED_ADVANTAGES}); the KL "
                              f"loss weight it named before is kl_loss_coef (slime's k1 by default, kl_loss_type = "
                              f"'k3' for the former loss): rename the key")
        return config


__all__ = ["ALGORITHMS", "ENGINES", "PARALLEL_SETTINGS", "SCHEDULER_SETTINGS", "TASKS", "TRAINERS", "TrainConfig"]
