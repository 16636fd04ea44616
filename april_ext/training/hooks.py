"""Reward and group-filter functions a run imports by path (``custom_rm_path``, ``dynamic_sampling_filter_path``),
and its multi-turn environment (``environment_path``: load_environment).

A path is "pkg.module:function" or "pkg.module.function"; the module must be importable (on sys.path).
A reward function has one of three kinds, each sync or ``async def``:

- "sample": ``fn(prompt, response_ids) -> float``, one call per sample;
- "group":  ``fn(prompt, responses) -> list[float]``, one call per group (its n samples);
- "batch":  ``fn(prompts, responses) -> list[float]``, parallel lists, one call per group (the rollout
  loop rewards each group as it completes, so a batch is one group).

``prompt`` is an april_ext Prompt (``prompt.metadata["label"]`` holds a data file's label), a response is
its token ids (a numpy int32 array), or its text when the reward is built with ``decode``. The kind is
the function's ``reward_kind`` attribute if it has one, else read from its parameter names (first
``prompts``: batch; second ``responses``: group; else sample), unless ``custom_rm_kind`` declares it.
Sync functions run in a daemon thread (one per group), so a slow one never holds up the event loop (and
the abort that ends a step), nor the exit of a run it failed; a call that raises or takes longer than
its timeout stops the run with an InvalidStateError naming the function and the prompt.

A group filter is ``fn(rewards: list[float]) -> bool`` (False drops the group); it is called on the
event loop, so it must be quick.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from april_ext.data_source import Prompt
from april_ext.errors import ConfigError, InvalidStateError
from april_ext.protocol import Environment

REWARD_KINDS = ("sample", "group", "batch")


def import_function(path: str, setting: str) -> Callable[..., Any]:
    """The callable at ``path`` ("pkg.module:name" or "pkg.module.name"); ConfigError naming ``setting``."""
    fn = _import_object(path, setting)
    if not callable(fn):
        raise ConfigError(f"{setting}={path!r} is a {type(fn).__name__}, not a function")
    return fn


def _import_object(path: str, setting: str) -> Any:
    """The object at ``path``; ConfigError naming ``setting``."""
    module_name, sep, name = path.partition(":")
    if not sep:
        module_name, _, name = path.rpartition(".")
    if not module_name or not name:
        raise ConfigError(f"{setting}={path!r} is not allowed: an import path 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{setting}={path!r}: cannot import module {module_name!r} ({err})") from None
    if not hasattr(module, name):
        raise ConfigError(f"{setting}={path!r}: module {module_name!r} has no attribute {name!r}")
    return getattr(module, name)


def _is_environment(value: Any) -> bool:
    """An Environment object (not a class) whose start and step are ``async def``."""
    return not isinstance(value, type) and isinstance(value, Environment) and all(
        inspect.iscoroutinefunction(getattr(value, name)) for name in ("start", "step"))


def load_environment(path: str, tokenizer: Any) -> tuple[Environment, tuple[int, ...]]:
    """``environment_path``'s Environment and the token ids that end a model turn besides the tokenizer's EOS.

    ``path`` names an Environment object, or a callable that returns one (a class, a factory function), called
    with the run's tokenizer when it takes one required parameter and with nothing when it takes none. The
    environment's optional ``stop_token_ids`` attribute (integers) lists the tokens that end a turn (a tool call's
    closing token). ConfigError, naming environment_path, for a path that does not import, an object that is not
    an Environment (async start(prompt) and async step(state, model_turn)) nor a callable returning one, a
    callable that raises, and stop_token_ids that are not token ids."""
    setting = "environment_path"
    target = _import_object(path, setting)
    env = target
    if not _is_environment(target):
        if not callable(target):
            raise ConfigError(f"{setting}={path!r} is a {type(target).__name__}: an Environment (async start(prompt) "
                              f"and async step(state, model_turn)) or a callable returning one is required")
        try:
            required = [p for p in inspect.signature(target).parameters.values()
                        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
        except (TypeError, ValueError):
            required = []
        if len(required) > 1:
            raise ConfigError(f"{setting}={path!r} takes {len(required)} required parameters "
                              f"{[p.name for p in required]}: a factory takes none or one (the run's tokenizer)")
        try:
            env = target(tokenizer) if required else target()
        except Exception as err:  # the user's factory: any failure is reported with its path
            raise ConfigError(f"{setting}={path!r}: building the environment raised {type(err).__name__}: "
                              f"{err}") from err
        if not _is_environment(env):
            raise ConfigError(f"{setting}={path!r} returned a {type(env).__name__}, which is not an Environment: "
                              f"it needs async start(prompt) and async step(state, model_turn)")
    stops = getattr(env, "stop_token_ids", ())
    try:
        ids = tuple(int(t) for t in stops)
        ok = all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in stops)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{setting}={path!r}: its stop_token_ids={stops!r} must be token ids (integers >= 0)")
    return env, ids


def reward_kind(fn: Callable[..., Any], path: str, declared: str = "auto") -> str:
    """The kind of reward function ``fn``: ``declared`` unless "auto", else its ``reward_kind`` attribute,
    else read from its parameter names."""
    if declared != "auto":
        if declared not in REWARD_KINDS:
            raise ConfigError(f"custom_rm_kind={declared!r} is not allowed: 'auto' or one of {REWARD_KINDS}")
        return declared
    kind = getattr(fn, "reward_kind", None)
    if kind is not None:
        if kind not in REWARD_KINDS:
            raise ConfigError(f"custom_rm_path={path!r}: its reward_kind={kind!r} is not one of {REWARD_KINDS}")
        return str(kind)
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        params = []
    if len(params) != 2:
        raise ConfigError(f"custom_rm_path={path!r}: its kind cannot be read from its required parameters "
                          f"{params}: a reward function takes two, (prompt, response), (prompt, responses) or "
                          f"(prompts, responses); or declare it with custom_rm_kind or a reward_kind attribute")
    if params[0] == "prompts":
        return "batch"
    return "group" if params[1] == "responses" else "sample"


async def _in_daemon_thread(work: Callable[[], Any], name: str) -> Any:
    """``work()`` in a new daemon thread: unlike the default executor's, a call that never returns does not
    hold up the event loop's shutdown or the process's exit after its timeout was reported."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, err: BaseException | None) -> None:
        if not future.done():
            future.set_exception(err) if err is not None else future.set_result(result)

    def run() -> None:
        try:
            result, err = work(), None
        except BaseException as caught:  # noqa: BLE001 - handed to the awaiting task, which raises it
            result, err = None, caught
        try:
            loop.call_soon_threadsafe(settle, result, err)
        except RuntimeError:  # the loop is closed: nobody waits for this call any more
            pass

    threading.Thread(target=run, name=f"reward {name}", daemon=True).start()
    return await future


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class ImportedReward:
    """A reward function imported by path, as the rollout loop calls it: ``await score_group(prompt,
    responses)`` per completed group (the loop prefers it to per-sample calls), each call bounded by
    ``timeout_s``; ``await reward(prompt, response)`` scores one response. ``decode`` (token ids -> text),
    when given, turns each response into text before ``fn`` sees it."""

    def __init__(self, fn: Callable[..., Any], path: str, kind: str, timeout_s: float,
                 decode: Callable[[Sequence[int]], str] | None = None) -> None:
        if kind not in REWARD_KINDS:
            raise ConfigError(f"reward kind {kind!r} is not allowed: one of {REWARD_KINDS}")
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ConfigError(f"custom_rm_timeout_s={timeout_s!r} is not allowed: a finite number > 0")
        self.fn, self.path, self.kind, self.timeout_s, self.decode = fn, path, kind, timeout_s, decode
        self.is_async = _is_async(fn)

    @classmethod
    def from_path(cls, path: str, kind: str = "auto", timeout_s: float = 300.0,
                  decode: Callable[[Sequence[int]], str] | None = None) -> ImportedReward:
        fn = import_function(path, "custom_rm_path")
        return cls(fn, path, reward_kind(fn, path, kind), timeout_s, decode)

    async def __call__(self, prompt: Prompt, response: Sequence[int]) -> float:
        return (await self.score_group(prompt, [response]))[0]

    async def score_group(self, prompt: Prompt, responses: Sequence[Sequence[int]]) -> list[float]:
        call = asyncio.ensure_future(self._call(prompt, responses))
        try:
            done, _ = await asyncio.wait({call}, timeout=self.timeout_s)
        except asyncio.CancelledError:
            call.cancel()
            raise
        if not done:
            call.cancel()
            raise InvalidStateError(f"reward function {self.path} took more than {self.timeout_s:g} s on prompt "
                                    f"{prompt.id!r} (custom_rm_timeout_s)")
        err = call.exception()
        if err is not None:
            raise InvalidStateError(f"reward function {self.path} failed on prompt {prompt.id!r}: "
                                    f"{type(err).__name__}: {err}") from err
        values = call.result()
        return self._check(prompt, values, len(responses))

    async def _call(self, prompt: Prompt, responses: Sequence[Sequence[int]]) -> Any:
        fn = self.fn
        if self.decode is not None:
            responses = [self.decode(list(r)) for r in responses]  # type: ignore[misc]
        if self.kind == "sample":
            if self.is_async:
                return list(await asyncio.gather(*(fn(prompt, r) for r in responses)))
            return await _in_daemon_thread(lambda: [fn(prompt, r) for r in responses], self.path)
        args = (prompt, list(responses)) if self.kind == "group" else ([prompt] * len(responses), list(responses))
        if self.is_async:
            return await fn(*args)
        return await _in_daemon_thread(lambda: fn(*args), self.path)

    def _check(self, prompt: Prompt, values: Any, n: int) -> list[float]:
        try:
            out = [float(v) for v in values]  # a sample function's values were gathered into a list
        except (TypeError, ValueError):
            out = []
        if len(out) != n or not all(math.isfinite(v) for v in out):
            wanted = "a finite number per sample" if self.kind == "sample" else f"a list of {n} finite numbers"
            raise InvalidStateError(f"reward function {self.path} ({self.kind}) returned {values!r} on prompt "
                                    f"{prompt.id!r}: {wanted} is required")
        return out


class ImportedFilter:
    """A group filter imported by path: ``filter(rewards) -> bool``, errors naming it."""

    def __init__(self, fn: Callable[..., Any], path: str) -> None:
        self.fn, self.path = fn, path

    @classmethod
    def from_path(cls, path: str) -> ImportedFilter:
        return cls(import_function(path, "dynamic_sampling_filter_path"), path)

    def __call__(self, rewards: Sequence[float]) -> bool:
        try:
            keep = self.fn(list(rewards))
        except Exception as err:  # the user's function: any failure is reported with its name
            raise InvalidStateError(f"group filter {self.path} failed on rewards {list(rewards)}: "
                                    f"{type(err).__name__}: {err}") from err
        if not isinstance(keep, (bool, np.bool_)):
            raise InvalidStateError(f"group filter {self.path} returned {keep!r} on rewards {list(rewards)}: "
                                    "True (keep the group) or False (drop it) is required")
        return bool(keep)


__all__ = ["REWARD_KINDS", "ImportedFilter", "ImportedReward", "import_function", "load_environment", "reward_kind"]
