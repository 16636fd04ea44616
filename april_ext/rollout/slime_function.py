"""slime's side of a custom generate function's contract: the function's type, its :class:`Sample` (slime's field
names, ``slime.utils.types.Sample``), the ``args`` and ``sampling_params`` slime hands it, and loading and checking
the function (``--custom-generate-function-path``). CustomGenerateRollout (slime_generate.py) drives it.

A function that imports ``slime.utils.types.Sample`` needs slime installed; one that reaches the enum through the
sample (``sample.Status.ABORTED`` or ``type(sample).Status``) runs with ours as with slime's.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.scheduler import SchedulerConfig

GenerateFn = Callable[..., Awaitable[Any]]
"""``async def generate(args, sample, sampling_params[, evaluation=...]) -> Sample | [Sample]``."""


@dataclass
class Sample:
    """One rollout sample with slime's field names and types (``slime.utils.types.Sample``). The fields the
    rollout reads back are tokens, response_length, loss_mask, rollout_log_probs, status and reward; the others
    are kept on the object between the calls of one sample (a resumed call gets the object its last call
    returned, when nothing of it was cut)."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    status: Sample.Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @property
    def effective_response_length(self) -> int:
        """The trained response tokens (loss mask 1), as slime counts them."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length


# ----------------------------------------------------------------------------------------------------- args


def slime_args(url: str, config: SchedulerConfig, sampling: SamplingParams | None = None, *, seed: int = 0,
               reward_key: str | None = None, **custom: Any) -> argparse.Namespace:
    """The ``args`` a generate function reads, with slime's names, from our settings: the server (``url``: the
    router, or the one server, that the function posts to), the scheduler's batch shape and response cap, and
    the sampling settings. ``partial_rollout`` is True when the scheduler over-samples (N' > N: unfinished
    samples are aborted and resumed), False for the synchronous baseline. ``custom`` adds attributes of the
    function's own (slime's ``--custom-config-path``), e.g. a tool's latency."""
    if not isinstance(config, SchedulerConfig):
        raise InvalidArgumentError(f"config is a {type(config).__name__}; a SchedulerConfig is required")
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme != "http" or not parts.hostname or parts.port is None or parts.path.strip("/"):
        raise InvalidArgumentError(f"url={url!r} is not allowed: http://HOST:PORT of the router or server the "
                                   f"function posts /generate to")
    sampling = sampling or SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise InvalidArgumentError(f"sampling is a {type(sampling).__name__}; a SamplingParams is required")
    if reward_key is not None and not isinstance(reward_key, str):
        raise InvalidArgumentError(f"reward_key={reward_key!r} is not allowed: None or the key of a dict reward")
    for name in custom:
        if not name.isidentifier():
            raise InvalidArgumentError(f"custom arg {name!r} is not allowed: an identifier (an attribute of args)")
    return argparse.Namespace(
        sglang_router_ip=parts.hostname, sglang_router_port=parts.port,
        rollout_batch_size=config.rollout_batch_size, n_samples_per_prompt=config.n_samples_per_prompt,
        over_sampling_batch_size=config.over_sampling_batch_size,
        partial_rollout=config.over_sampling_batch_size > config.rollout_batch_size,
        mask_offpolicy_in_partial_rollout=config.mask_offpolicy,
        rollout_max_response_len=config.max_response_len, rollout_temperature=sampling.temperature,
        rollout_top_p=sampling.top_p, rollout_top_k=sampling.top_k, rollout_stop=None,
        rollout_stop_token_ids=list(sampling.stop_token_ids) or None, rollout_skip_special_tokens=False,
        rollout_seed=seed, custom_generate_function_path=None, group_rm=False, reward_key=reward_key,
        **custom)


def sampling_params_of(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling_params dict slime hands a generate function (a fresh copy per call): max_new_tokens is the
    whole response cap; a function that resumes subtracts what the sample already has."""
    return {"temperature": args.rollout_temperature, "top_p": args.rollout_top_p, "top_k": args.rollout_top_k,
            "max_new_tokens": args.rollout_max_response_len, "stop": args.rollout_stop,
            "stop_token_ids": args.rollout_stop_token_ids,
            "skip_special_tokens": args.rollout_skip_special_tokens, "no_stop_trim": True,
            "spaces_between_special_tokens": False}


# ------------------------------------------------------------------------------------------------- loading


def load_generate_function(path: str) -> GenerateFn:
    """The function at ``path``: slime's form ``"pkg.module.fn"``, or ``"pkg.module:fn"``. The module must be
    importable (on sys.path: slime takes no file paths either). Raises ConfigError naming the path and what was
    wrong: not importable, no such attribute, not an async function, or a signature that does not take
    (args, sample, sampling_params)."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"custom generate function path {path!r} is not allowed: 'pkg.module.fn' or "
                          f"'pkg.module:fn'")
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr.isidentifier():
        raise ConfigError(f"custom generate function path {path!r} is not allowed: 'pkg.module.fn' or "
                          f"'pkg.module:fn' (a module on sys.path and a function in it)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"custom generate function {path!r}: module {module_name!r} cannot be imported ({exc}); "
                          f"it must be on sys.path (PYTHONPATH)") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"custom generate function {path!r}: module {module_name!r} has no attribute {attr!r}")
    try:
        check_generate_function(fn)
    except InvalidArgumentError as exc:
        raise ConfigError(f"custom generate function {path!r}: {exc}") from None
    return fn


def check_generate_function(fn: Any) -> bool:
    """Checks fn against slime's contract; returns whether it takes ``evaluation=`` (slime passes it then).
    Raises InvalidArgumentError for a non-callable, a sync function, or a wrong signature."""
    if not callable(fn):
        raise InvalidArgumentError(f"{fn!r} is not callable: an async def generate(args, sample, sampling_params)")
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        raise InvalidArgumentError(f"{_name(fn)} is not an async function: slime awaits "
                                   f"generate(args, sample, sampling_params), so it must be 'async def'")
    try:
        signature = inspect.signature(fn)
        signature.bind(None, None, None)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{_name(fn)} has signature {_signature(fn)}: it must take (args, sample, "
                                   f"sampling_params) and optionally evaluation=") from exc
    return "evaluation" in signature.parameters  # slime's test: a **kwargs function is not given it either


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _signature(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(unknown)"


def url_of(engine: Any) -> str:
    """The one address a generate function posts to: the adapter's router, or its only worker."""
    config = getattr(engine, "config", None)
    router = getattr(config, "router_url", None)
    workers = tuple(getattr(config, "worker_urls", ()) or ())
    if router:
        return str(router)
    if len(workers) == 1:
        return str(workers[0])
    raise ConfigError(f"a generate function posts to one address (slime's router): the engine has "
                      f"{len(workers)} worker urls and no router_url; give it a router_url, or pass "
                      f"args=slime_args(url, ...)")


__all__ = ["GenerateFn", "Sample", "check_generate_function", "load_generate_function", "sampling_params_of",
           "slime_args", "url_of"]
