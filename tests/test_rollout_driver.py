"""The rollout driver seam: the RolloutLoop and CustomGenerateRollout are both protocol.RolloutDriver (every member
there, with a signature the run can call), an object that lacks a member is not one, and a custom generate
rollout ends its calls through the engine's abort_all (protocol.AbortAllEngine: the SGLang adapter sends SGLang's
abort_all to every worker, the Ray engine forwards to it)."""

from __future__ import annotations

import asyncio
import inspect
import types
import typing
from typing import Any

import pytest
from _loop_utils import ScriptedEngine
from aiohttp import web

from april_ext import CorruptStateError, InvalidArgumentError, ListDataSource, Prompt, Scheduler, SchedulerConfig
from april_ext.cluster.ray_engine import RayEngine
from april_ext.protocol import AbortAllEngine, RolloutDriver, RolloutEngine, RolloutResult
from april_ext.rollout import RolloutLoop
from april_ext.rollout.slime_generate import CustomGenerateRollout, slime_args
from april_ext.sglang import SGLangEngine, SGLangEngineConfig

DATA = ListDataSource([Prompt(f"p{i}", [1, 5, 3, 3]) for i in range(8)])
MEMBERS = sorted(name for name in vars(RolloutDriver) if not name.startswith("_"))


def _config(**overrides: Any) -> SchedulerConfig:
    fields: dict[str, Any] = dict(rollout_batch_size=1, n_samples_per_prompt=1, over_sampling_batch_size=2,
                                  max_response_len=8)
    fields.update(overrides)
    return SchedulerConfig(**fields)


class _AbortAll:
    """An AbortAllEngine that counts its abort_all calls and lets the calls waiting on it return."""

    def __init__(self) -> None:
        self.calls = 0
        self.aborted = asyncio.Event()

    async def abort_all(self) -> None:
        self.calls += 1
        self.aborted.set()


async def _idle(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    return sample


def _loop() -> RolloutLoop:
    return RolloutLoop(ScriptedEngine(lambda ids: int(ids[2])), Scheduler(_config(), DATA), lambda p, r: 1.0)


def _custom(engine: Any = None, generate: Any = _idle) -> CustomGenerateRollout:
    config = _config()
    return CustomGenerateRollout(generate, Scheduler(config, DATA), engine or _AbortAll(),
                                 slime_args("http://127.0.0.1:1", config), reward_fn=lambda p, r: 1.0)


def _union(hint: Any) -> set[Any]:
    """The types a hint allows (a Union's members; NoneType for None)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return set(typing.get_args(hint))
    return {type(None) if hint is None else hint}


def _returns(member: Any) -> Any:
    fn = member.fget if isinstance(member, property) else member
    return typing.get_type_hints(fn).get("return")


@pytest.mark.parametrize("build", [_loop, _custom], ids=["RolloutLoop", "CustomGenerateRollout"])
def test_both_drivers_have_every_member_of_the_protocol_with_a_signature_the_run_can_call(build) -> None:
    async def body() -> Any:
        return build()

    driver = asyncio.run(body())
    assert isinstance(driver, RolloutDriver)
    cls = type(driver)
    for name in MEMBERS:
        wanted, given = inspect.getattr_static(RolloutDriver, name), inspect.getattr_static(cls, name)
        assert isinstance(given, property) == isinstance(wanted, property), name
        # The types it returns are among those the protocol allows (run_step: a RolloutResult).
        if _returns(wanted) is not None and name != "running_engine":
            assert _union(_returns(given)) <= _union(_returns(wanted)), name
        if isinstance(wanted, property):
            continue
        assert inspect.iscoroutinefunction(given) == inspect.iscoroutinefunction(wanted), name
        # Every parameter the protocol names, of the same kind; any other one has a default.
        want = list(inspect.signature(wanted).parameters.values())[1:]
        have = list(inspect.signature(given).parameters.values())[1:]
        assert [(p.name, p.kind) for p in have[:len(want)]] == [(p.name, p.kind) for p in want], name
        assert all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                   for p in have[len(want):]), name
    assert _returns(inspect.getattr_static(cls, "run_step")) is RolloutResult


@pytest.mark.parametrize("build", [_loop, _custom], ids=["RolloutLoop", "CustomGenerateRollout"])
def test_between_steps_both_drivers_lend_the_engine_and_report_what_they_carry(build) -> None:
    async def body() -> tuple[int, int]:
        driver = build()
        async with driver.running_engine():
            pass
        await driver.abort_carried()
        await driver.drain_rewards()
        state = driver.environment_state()
        if isinstance(driver, RolloutLoop):
            assert state is None  # no environment here
            with pytest.raises(InvalidArgumentError, match="no environment"):
                driver.load_environment_state(b"")
        else:
            # The function's rewards of samples whose group is not complete, kept for a resume (none yet).
            assert isinstance(state, bytes)
            driver.load_environment_state(state)
            with pytest.raises(CorruptStateError, match="cannot be read"):
                driver.load_environment_state(b"")
        await driver.close()
        return driver.carried, driver.pending_rewards

    assert asyncio.run(body()) == (0, 0)


def test_an_object_without_every_member_is_no_driver() -> None:
    class NoEngineBetweenSteps:
        carried = pending_rewards = 0

        async def run_step(self, policy_version: int) -> None: ...
        async def abort_carried(self) -> None: ...
        async def drain_rewards(self) -> None: ...
        def environment_state(self) -> None: ...
        def load_environment_state(self, data: bytes) -> None: ...
        async def close(self) -> None: ...

    assert not isinstance(NoEngineBetweenSteps(), RolloutDriver)
    NoEngineBetweenSteps.running_engine = lambda self: None  # type: ignore[attr-defined]
    assert isinstance(NoEngineBetweenSteps(), RolloutDriver)


def test_a_custom_generate_rollout_refuses_an_engine_that_cannot_abort_every_request() -> None:
    engine = ScriptedEngine(lambda ids: 1)
    assert isinstance(engine, RolloutEngine) and not isinstance(engine, AbortAllEngine)
    with pytest.raises(InvalidArgumentError, match=r"AbortAllEngine: abort_all\(\)"):
        _custom(engine)


def test_the_step_ends_its_calls_through_the_engines_abort_all() -> None:
    """Group 0's call finishes; group 1's returns ABORTED only once the engine's abort_all ran: the verdict that
    ends the step waits for it, and its sample is a partial for the next step."""
    engine = _AbortAll()

    async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
        if sample.index == 0:
            sample.tokens = [*sample.tokens, 9]
            sample.response_length, sample.loss_mask, sample.rollout_log_probs = 1, [1], [-1.0]
            sample.status = sample.Status.COMPLETED
        else:
            await engine.aborted.wait()
            sample.status = sample.Status.ABORTED
            sample.rollout_log_probs = []
        return sample

    async def body() -> Any:
        rollout = _custom(engine, generate)
        result = await asyncio.wait_for(rollout.run_step(0), 10)
        return result, rollout.scheduler.stats()

    result, stats = asyncio.run(body())
    assert engine.calls >= 1
    assert result.batch.n_groups == 1 and result.batch.sample_ids.tolist() == [0]
    assert stats["buffered_groups"] == 1


def test_the_sglang_adapter_and_the_ray_engine_abort_every_request_of_every_worker() -> None:
    assert issubclass(SGLangEngine, AbortAllEngine) and issubclass(RayEngine, AbortAllEngine)
    bodies: list[tuple[int, Any]] = []

    def app_of(index: int) -> web.Application:
        async def abort(request: web.Request) -> web.Response:
            bodies.append((index, await request.json()))
            return web.Response()

        async def health(request: web.Request) -> web.Response:
            return web.Response()

        app = web.Application()
        app.router.add_post("/abort_request", abort)
        app.router.add_get("/health", health)
        return app

    async def body() -> None:
        runners = [web.AppRunner(app_of(i)) for i in range(2)]
        urls = []
        for runner in runners:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        try:
            async with SGLangEngine(SGLangEngineConfig(worker_urls=tuple(urls))) as engine:
                await engine.abort_all()
        finally:
            for runner in runners:
                await runner.cleanup()

    asyncio.run(body())
    assert sorted(bodies, key=lambda b: b[0]) == [(0, {"rid": "", "abort_all": True}),
                                                    (1, {"rid": "", "abort_all": True})]
