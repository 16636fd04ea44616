"""The built-in multi-turn tool task: look a key up with a tool, then answer with what it returned.

Each prompt hides a small table, drawn from the seed and the prompt's position, so nothing in the prompt
tells the answer: the policy has to call the tool and copy what it says. The table is a chain of h distinct
keys K_0 -> K_1 -> ... -> K_{h-1} -> V, where V is value_len value tokens; h is 1 + a geometric draw
(half the prompts need one call, a quarter two, ...), capped at max_hops.

Prompt: [BOS, K_0, SEP]. A model turn is its tokens up to the stop token that ended it: EOT asks the tool,
EOS answers.
- A call turn looks up its last key token. The tool answers after a latency drawn from a lognormal (median
  and p99 configured), with [RESULT, K_{i+1}] for a key of the chain, [RESULT, V...] for the last one and
  [RESULT, NOT_FOUND] for a key not in the table. A call turn naming no key costs a turn but no tool call:
  [RESULT, NOT_FOUND] comes back at once.
- An answer turn's answer is its last value_len value tokens.
Tokens before a turn's last key (value) tokens are ignored, so a near-random policy already reaches the tool,
and the skill to learn is copying: the prompt's key into the first call, each tool output into the next turn.

Reward: 1 for the right answer after the tool returned V; found_credit (default 0.5) when the tool returned V
but the answer is wrong or missing; 0 otherwise, a right guess without the tool included (the policy must
call to answer). Without the partial credit a random-init policy almost never earns a reward: measured on the
tiny model, reward 1 only (found_credit 0) stayed at 0.02 over 300 GRPO steps, where 0.5 rose from 0.03 to
0.7-0.8 (docs/agentic.md). The reward is the environment's (EnvStep.reward): read off the flat response it
could not tell the tool's value tokens from the model's.

Target, one hop: K_0 EOT | RESULT V | V EOS (the environment's tokens between bars). A trajectory ends with
"answer", "max_tool_calls" (a call turn after max_tool_calls tool calls) or "max_turns" (a call in the last
of max_turns turns, which leaves no turn to answer).
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from april_ext.data_source import Prompt
from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.protocol.environment import EnvStep

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SEP_ID = 3
EOT_ID = 4
RESULT_ID = 5
NOT_FOUND_ID = 6
_FIRST_KEY = 7

FINISH_ANSWER = "answer"
FINISH_MAX_TOOL_CALLS = "max_tool_calls"
FINISH_MAX_TURNS = "max_turns"

# The standard normal's 99th percentile: a lognormal's p99 is median * exp(sigma * _Z99).
_Z99 = statistics.NormalDist().inv_cdf(0.99)


@dataclass(frozen=True)
class LognormalLatency:
    """Tool latencies in seconds: median_s * exp(sigma * z) for standard normal z, with sigma chosen so that
    the 99th percentile is p99_s (sigma = ln(p99_s / median_s) / z_0.99; p99_s == median_s: constant)."""

    median_s: float
    p99_s: float

    def __post_init__(self) -> None:
        for name in ("median_s", "p99_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"LognormalLatency.{name} must be a positive finite number of seconds, got {value!r}")
        if self.p99_s < self.median_s:
            raise ConfigError(f"LognormalLatency.p99_s must be >= median_s ({self.median_s}), got {self.p99_s!r}")

    @property
    def sigma(self) -> float:
        return math.log(self.p99_s / self.median_s) / _Z99

    def sample(self, rng: np.random.Generator, size: int | None = None) -> Any:
        """One latency (size None) or an array of ``size`` latencies drawn from ``rng``."""
        return self.median_s * np.exp(self.sigma * rng.standard_normal(size))


@dataclass(frozen=True)
class LookupTaskConfig:
    """n_keys, n_values: how many key and value tokens. value_len: the value's length in tokens. max_hops:
    the cap of the chain length h (the tool calls a perfect policy makes). max_tool_calls, max_turns: the
    most tool calls and model turns a trajectory may take (at least the hops, and the hops + 1 for the
    answer). found_credit: the reward when the tool returned the value but the answer is not right, in
    [0, 1) (0: reward 1 or 0). latency_median_s, latency_p99_s: the tool's lognormal latency. seed: the
    prompt stream and the environments' latency streams. n_prompts: the length of the stream as a data
    source."""

    n_keys: int = 8
    n_values: int = 8
    value_len: int = 1
    max_hops: int = 1
    max_tool_calls: int = 3
    max_turns: int = 4
    found_credit: float = 0.5
    latency_median_s: float = 0.02
    latency_p99_s: float = 0.5
    seed: int = 0
    n_prompts: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("n_keys", "n_values", "value_len", "max_hops", "max_tool_calls", "max_turns", "n_prompts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"LookupTaskConfig.{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.found_credit, bool) or not isinstance(self.found_credit, (int, float)) \
                or not 0 <= self.found_credit < 1:
            raise ConfigError(f"LookupTaskConfig.found_credit must be a number in [0, 1) (below the right answer's "
                              f"1), got {self.found_credit!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"LookupTaskConfig.seed must be an integer >= 0, got {self.seed!r}")
        if self.max_hops > self.n_keys:
            raise ConfigError(f"LookupTaskConfig.max_hops must be <= n_keys ({self.n_keys}: a chain's keys are "
                              f"distinct), got {self.max_hops}")
        if self.max_tool_calls < self.max_hops:
            raise ConfigError(f"LookupTaskConfig.max_tool_calls must be >= max_hops ({self.max_hops}), or the longest "
                              f"chains cannot be followed, got {self.max_tool_calls}")
        if self.max_turns < self.max_hops + 1:
            raise ConfigError(f"LookupTaskConfig.max_turns must be >= max_hops + 1 ({self.max_hops + 1}: the calls "
                              f"and the answer), got {self.max_turns}")
        try:
            LognormalLatency(self.latency_median_s, self.latency_p99_s)
        except ConfigError as err:
            raise ConfigError(f"LookupTaskConfig.latency_median_s / latency_p99_s: {err}") from None

    @property
    def latency(self) -> LognormalLatency:
        return LognormalLatency(self.latency_median_s, self.latency_p99_s)

    @property
    def vocab_size(self) -> int:
        return _FIRST_KEY + self.n_keys + self.n_values


@dataclass
class LookupState:
    """One trajectory's environment state: the prompt's hidden table (key token -> the tokens the tool
    answers), its value, the turns and tool calls so far, and whether the tool has returned the value.
    Plain data: it pickles."""

    table: dict[int, tuple[int, ...]]
    value: tuple[int, ...]
    turns: int = 0
    tool_calls: int = 0
    found: bool = False


class LookupTask:
    """Prompt generator (a scheduler DataSource), vocabulary and perfect turns of the task; its environment
    is LookupEnvironment."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    sep_id = SEP_ID
    eot_id = EOT_ID
    result_id = RESULT_ID
    not_found_id = NOT_FOUND_ID
    stop_token_ids = (EOT_ID, EOS_ID)
    """The stop tokens that end a model turn (SamplingParams.stop_token_ids of the rollout)."""

    def __init__(self, config: LookupTaskConfig | None = None) -> None:
        self.config = config or LookupTaskConfig()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def key_id(self, index: int) -> int:
        return _FIRST_KEY + index

    def value_id(self, index: int) -> int:
        return _FIRST_KEY + self.config.n_keys + index

    def is_key(self, token: int) -> bool:
        return _FIRST_KEY <= token < _FIRST_KEY + self.config.n_keys

    def is_value(self, token: int) -> bool:
        return _FIRST_KEY + self.config.n_keys <= token < self.vocab_size

    def __len__(self) -> int:
        return self.config.n_prompts

    def __getitem__(self, position: int) -> Prompt:
        """The prompt at a stream position; the same (seed, position) always gives the same prompt and table."""
        if not 0 <= position < self.config.n_prompts:
            raise IndexError(f"position {position} is outside [0, n_prompts={self.config.n_prompts})")
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, position])
        hops = min(int(rng.geometric(0.5)), cfg.max_hops)
        chain = tuple(self.key_id(int(k)) for k in rng.choice(cfg.n_keys, size=hops, replace=False))
        value = tuple(self.value_id(int(v)) for v in rng.integers(cfg.n_values, size=cfg.value_len))
        return Prompt(id=f"lookup-{cfg.seed}-{position}", token_ids=(BOS_ID, chain[0], SEP_ID),
                      metadata={"label": value, "chain": chain, "task": "lookup"})

    def prompts(self, start: int, count: int) -> list[Prompt]:
        return [self[p] for p in range(start, start + count)]

    def table(self, prompt: Prompt) -> dict[int, tuple[int, ...]]:
        """The prompt's hidden table: each chain key -> the next key, the last one -> the value."""
        chain, value = prompt.metadata["chain"], tuple(prompt.metadata["label"])
        return {key: (chain[i + 1],) if i + 1 < len(chain) else value for i, key in enumerate(chain)}

    def target(self, prompt: Prompt) -> list[tuple[int, ...]]:
        """The model turns that earn reward 1: one call per chain key, then the answer."""
        return [(key, EOT_ID) for key in prompt.metadata["chain"]] + [(*prompt.metadata["label"], EOS_ID)]

    def max_response_len(self) -> int:
        """Twice the longest perfect response (model and tool tokens of max_hops calls and the answer), so a
        policy has room for a wasted call or a longer turn while it learns."""
        calls = 4 * self.config.max_hops  # per hop: key, EOT, RESULT, the next key (the last: the value)
        return 2 * (calls + 2 * self.config.value_len)

    def model_config(self, **overrides: Any) -> Any:
        """A tiny Llama ModelConfig for this vocabulary (hidden 64, 2 layers, 4 heads), as the counting task's."""
        from april_ext.model import ModelConfig

        fields: dict[str, Any] = {
            "vocab_size": self.vocab_size, "hidden_size": 64, "intermediate_size": 192,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 3 + self.max_response_len() + 8, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        }
        fields.update(overrides)
        return ModelConfig(**fields)


class LookupEnvironment:
    """The task's Environment (april_ext.protocol.Environment): the tool is a lookup in the prompt's table,
    answering after a latency drawn from the config's lognormal. Each environment draws its latencies from
    its own stream of the config's seed, in the order the calls are made."""

    def __init__(self, task: LookupTask) -> None:
        self.task = task
        self._latency = task.config.latency
        # A spawned child of the seed: never the stream of a prompt (those are seeded by [seed, position]).
        self._rng = np.random.default_rng(np.random.SeedSequence(task.config.seed).spawn(1)[0])

    async def start(self, prompt: Prompt) -> LookupState:
        return LookupState(table=self.task.table(prompt), value=tuple(prompt.metadata["label"]))

    async def step(self, state: LookupState, model_turn: Sequence[int]) -> EnvStep:
        """The answer to one turn (module docstring). Updates ``state`` only after the tool's latency, so a
        cancelled step leaves it as it was. Raises InvalidArgumentError for a turn that does not end with
        one of the task's stop tokens (the loop passes a turn that stopped at one)."""
        task, cfg = self.task, self.task.config
        turn = list(model_turn)
        if not turn or turn[-1] not in task.stop_token_ids:
            raise InvalidArgumentError(f"a lookup turn ends with EOT ({EOT_ID}: a tool call) or EOS ({EOS_ID}: the "
                                       f"answer), got {turn[-8:]}")
        partial = cfg.found_credit if state.found else 0.0
        keys = [t for t in turn if task.is_key(t)]
        if turn[-1] == EOS_ID:
            answer = tuple(t for t in turn if task.is_value(t))[-cfg.value_len:]
            result = EnvStep.finish(1.0 if state.found and answer == state.value else partial, FINISH_ANSWER)
        elif state.turns + 1 >= cfg.max_turns:
            result = EnvStep.finish(partial, FINISH_MAX_TURNS, f"a tool call in the last of {cfg.max_turns} turns")
        elif not keys:
            result = EnvStep.observe((RESULT_ID, NOT_FOUND_ID))
        elif state.tool_calls >= cfg.max_tool_calls:
            result = EnvStep.finish(partial, FINISH_MAX_TOOL_CALLS, f"a tool call after {cfg.max_tool_calls} calls")
        else:
            await asyncio.sleep(float(self._latency.sample(self._rng)))
            output = state.table.get(keys[-1], (NOT_FOUND_ID,))
            state.tool_calls += 1
            state.found = state.found or output == state.value
            result = EnvStep.observe((RESULT_ID, *output))
        state.turns += 1
        return result


__all__ = [
    "FINISH_ANSWER",
    "FINISH_MAX_TOOL_CALLS",
    "FINISH_MAX_TURNS",
    "LognormalLatency",
    "LookupEnvironment",
    "LookupState",
    "LookupTask",
    "LookupTaskConfig",
]
