"""ServerPool: the rollout engine actors of a Ray run and their membership in the routing.

One actor per engine (server_host.ServerHost) in its bundle, restarted by Ray up to
``ray_engine_max_restarts`` times. Requests reach the engines through the sglang-router (ray_routing
"router", launched here or given by ray_router_url) or straight from the driver's SGLang client, least
loaded by the engines' reported KV ("least_loaded", no router); membership.py says which engines get them.
The driver checks every actor each ``ray_engine_check_interval_s``: an engine whose actor died, restarts
or does not answer leaves at once (the router itself would only mark it unhealthy); after a failed weight
update ``prune`` checks them at once, and also each server over HTTP (a SIGKILLed server is gone before its
actor notices); when its actor answers again, from a new server, the pool's ``rejoin`` hook gives it the
current weights and only then does it join.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from april_ext.cluster.errors import ClusterError
from april_ext.cluster.membership import DirectMembership, Membership, RouterMembership
from april_ext.cluster.network import RunNetwork
from april_ext.cluster.router import Router
from april_ext.cluster.server_host import ServerHost
from april_ext.cluster.session import RaySession
from april_ext.errors import AprilError
from april_ext.sglang import SGLangEngine, SGLangServerArgs
from april_ext.training.config import TrainConfig

logger = logging.getLogger(__name__)

EMBEDDED_SERVER = "april_ext.server"
"""The module an embedded engine actor serves (``april-ext serve``)."""


async def ray_result(ref: Any, timeout_s: float) -> Any:
    """An ObjectRef's value, awaited at most ``timeout_s`` (asyncio.TimeoutError after)."""
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the engines directly, as the SGLang client


def _server_silence(url: str, timeout_s: float) -> str | None:
    """None when the server at ``url`` answers GET /health over HTTP within ``timeout_s`` (any status: its
    process serves); else why not (refused or reset: it is gone; a timeout: it is stalled)."""
    try:
        with _DIRECT.open(f"{url}/health", timeout=timeout_s):
            return None
    except urllib.error.HTTPError:  # it answered (503 while paused, say): it serves
        return None
    except (urllib.error.URLError, OSError) as err:
        reason = err.reason if isinstance(err, urllib.error.URLError) else err
        return f"its server does not answer /health: {type(reason).__name__}: {reason}"


@dataclass
class ServerSlot:
    """One engine: its actor, its server (``pid`` of the actor, ``url``) and whether it gets requests."""

    index: int
    actor: Any
    pid: int = -1
    url: str = ""
    registered: bool = False
    dead: bool = False
    restarts_seen: int = 0


def server_args(config: TrainConfig, model_path: str, version: int, index: int, gpus: int) -> tuple[str, SGLangServerArgs]:
    """(module, launch flags) of engine ``index``'s server, on ``model_path`` labelled ``version``."""
    if config.engine == "embedded":
        extra = ("--weight-version", str(version), "--num-blocks", str(config.num_blocks), "--block-size",
                 str(config.block_size), "--max-num-seqs", str(config.max_num_seqs), "--device", config.device,
                 "--seed", str(config.seed + index), "--weight-group-timeout", str(config.weight_sync_timeout_s))
        return EMBEDDED_SERVER, SGLangServerArgs(model_path=model_path, enable_memory_saver=config.colocate,
                                                 extra_args=extra)
    extra = ("--weight-version", str(version), *shlex.split(config.sglang_args))
    return config.sglang_module, SGLangServerArgs(model_path=model_path, tp=gpus, enable_memory_saver=config.colocate,
                                                  extra_args=extra)


class ServerPool:
    def __init__(self, config: TrainConfig, slots: list[ServerSlot], network: RunNetwork) -> None:
        self.config = config
        self.slots = slots
        self.network = network
        self._router: Router | None = None
        self._probe_timeout_s = max(2.0, 2 * config.ray_engine_check_interval_s)
        # A server that is gone refuses at once; a live one may be slow on a loaded machine (or busy loading).
        self._health_timeout_s = max(self._probe_timeout_s, min(config.weight_sync_timeout_s, config.ray_timeout_s))

    @classmethod
    async def start(cls, session: RaySession, config: TrainConfig, model_path: str, version: int) -> ServerPool:
        """Starts every engine actor (each launches its server on ``model_path``) and, with ray_routing
        "router", the router (or registers them with ``ray_router_url``), and waits until the router lists
        them all as healthy."""
        import ray

        topology, network = session.topology, session.network
        assert network is not None, "the session is entered"
        remote = ray.remote(ServerHost)
        run_dir = os.path.abspath(os.path.join(config.output_dir, "cluster"))
        slots = []
        for i in range(topology.num_engines):
            module, args = server_args(config, model_path, version, i, topology.gpus_per_engine)
            actor = remote.options(max_restarts=config.ray_engine_max_restarts,
                                   **session.actor_options(topology.engine(i))).remote(
                i, module, args, run_dir, config.sglang_launch_timeout_s, network)
            slots.append(ServerSlot(i, actor))
        pool = cls(config, slots, network)
        try:
            addresses = await asyncio.gather(*(ray_result(s.actor.address.remote(), config.ray_timeout_s)
                                               for s in slots))
        except (asyncio.TimeoutError, ray.exceptions.RayError) as err:
            pool.stop()
            raise ClusterError(f"the rollout engines did not start within ray_timeout_s={config.ray_timeout_s} s "
                               f"({type(err).__name__}: {err}); their logs are in {run_dir}") from None
        for slot, (pid, url) in zip(slots, addresses):
            slot.pid, slot.url, slot.registered = pid, url, True
        urls = [s.url for s in slots]
        if config.ray_routing == "least_loaded":
            logger.info("rollout: %d engines, each request to the least loaded: %s", len(slots), urls)
            return pool
        try:
            if config.ray_router_url is None:
                pool._router = await asyncio.to_thread(Router.launch, urls, os.path.join(run_dir, "router.log"),
                                                       config.ray_timeout_s, config.ray_timeout_s, network.api_key)
            else:
                pool._router = Router(config.ray_router_url, api_key=network.api_key)
                for url in urls:
                    await asyncio.to_thread(pool.router.add, url)
                await asyncio.to_thread(pool.router.wait_until, lambda w: all(w.get(u, {}).get("is_healthy")
                                                                              for u in urls),
                                        config.ray_timeout_s, f"list {urls} as healthy")
        except BaseException:
            pool.stop()
            raise
        logger.info("rollout: %d engines behind the router %s: %s", len(slots), pool.router.url, urls)
        return pool

    @property
    def router(self) -> Router:
        assert self._router is not None, "start() sets the router up with ray_routing 'router'"
        return self._router

    def membership(self, engine: SGLangEngine) -> Membership:
        """Who gets requests: the router's list, or (ray_routing "least_loaded") ``engine``'s worker pool."""
        if self._router is not None:
            return RouterMembership(self._router, self.config.ray_timeout_s)
        return DirectMembership(engine)

    async def watch(self, rejoin: Callable[[str, str], Awaitable[None]], members: Membership) -> None:
        """Checks the engines forever (cancel to stop): the silent ones leave ``members``, and after
        ``rejoin(old_url, url)`` (the current weights) the restarted ones join again."""
        while True:
            await asyncio.sleep(self.config.ray_engine_check_interval_s)
            for slot in self.slots:
                if slot.dead:
                    continue
                try:
                    await self._check(slot, rejoin, members)
                except AprilError as err:  # a rejoin that failed is tried again at the next check
                    logger.warning("rollout engine %d (%s) could not rejoin: %s", slot.index, slot.url, err)
                except Exception:  # nor does an unexpected one end the watch: the other engines still fail over
                    logger.exception("rollout engine %d (%s): its check failed; it is tried again at the next check",
                                     slot.index, slot.url)

    async def _check(self, slot: ServerSlot, rejoin: Callable[[str, str], Awaitable[None]],
                     members: Membership) -> None:
        import ray

        try:
            pid, url = await ray_result(slot.actor.address.remote(), self._probe_timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as err:
            slot.dead = isinstance(err, ray.exceptions.ActorDiedError)
            if slot.registered:
                await members.leave(slot.url, f"its actor is down ({type(err).__name__})")
                slot.registered = False
                logger.warning("rollout engine %d (%s) is down (%s): it gets no requests%s", slot.index,
                               slot.url, type(err).__name__,
                               "; no restarts left" if slot.dead else ", waiting for Ray to restart it")
            return
        if slot.registered and url == slot.url:
            return
        if url == slot.url and await self._server_silence(url, self._probe_timeout_s) is not None:
            return  # taken out for a server that does not answer (prune): its actor has not seen it die yet
        if slot.registered:  # restarted between two checks
            await members.leave(slot.url, "its actor restarted")
        old_url = slot.url
        slot.pid, slot.url, slot.registered = pid, url, False
        await rejoin(old_url, url)
        await members.join(url)
        slot.registered = True
        slot.restarts_seen += 1
        logger.warning("rollout engine %d is back (actor pid %d%s) and rejoined at %s with the current weights",
                       slot.index, pid, "" if url == old_url else ", restarted", url)

    def serving(self) -> frozenset[str]:
        """The urls of the engines that get requests now (and so every weight update)."""
        return frozenset(s.url for s in self.slots if s.registered)

    async def prune(self, members: Membership) -> bool:
        """Checks every engine that gets requests now (a weight update failed): one whose actor does not answer
        or answers from a new server, or whose server does not answer /health over HTTP (its actor may not
        have seen the server die yet: Ray restarts it later), leaves ``members`` at once, as the watch would
        take it off (and the watch brings it back). The engines are checked at once, each within the probe's
        timeout. True when any left."""
        slots = [s for s in self.slots if s.registered]
        reasons = await asyncio.gather(*(self._down(s) for s in slots))
        pruned = False
        for slot, reason in zip(slots, reasons):
            if reason is None or not slot.registered:  # up, or taken off by the watch meanwhile
                continue
            gone = slot.url
            await members.leave(gone, reason)
            slot.registered = False
            pruned = True
            logger.warning("rollout engine %d (%s) is down (%s): it gets no requests", slot.index, gone, reason)
        return pruned

    async def _down(self, slot: ServerSlot) -> str | None:
        """Why ``slot``'s engine cannot take a weight update now, or None when it can."""
        import ray

        try:
            _, url = await ray_result(slot.actor.address.remote(), self._probe_timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as err:
            slot.dead = slot.dead or isinstance(err, ray.exceptions.ActorDiedError)
            return f"its actor is down ({type(err).__name__})"
        if url != slot.url:
            return f"restarted at {url}"
        return await self._server_silence(url, self._health_timeout_s)

    async def _server_silence(self, url: str, timeout_s: float) -> str | None:
        return await asyncio.to_thread(_server_silence, url, timeout_s)

    def rank_beside(self, url: str) -> int | None:
        """The trainer rank that shares the device of the engine at ``url`` in a colocated run (engine i sits in
        trainer rank i's bundle: Topology.engine); None otherwise, or for a url not of the pool."""
        if not self.config.colocate:
            return None
        return next((s.index for s in self.slots if s.url == url), None)

    def states(self) -> dict[int, str]:
        return {s.index: "dead" if s.dead else "up" if s.registered else "down" for s in self.slots}

    async def server_rss_bytes(self) -> list[int]:
        """Each engine server's resident memory (colocated runs measure it)."""
        return list(await asyncio.gather(*(ray_result(s.actor.rss_bytes.remote(), self.config.ray_timeout_s)
                                           for s in self.slots)))

    def stop(self) -> None:
        """Stops the servers, the actors and a router launched by the run."""
        import ray

        refs = [s.actor.stop.remote() for s in self.slots]
        ray.wait(refs, num_returns=len(refs), timeout=30)
        for slot in self.slots:
            ray.kill(slot.actor, no_restart=True)
        if self._router is None:
            return
        if self._router.process is None:  # a router given by url keeps running: it forgets our engines
            for slot in self.slots:
                if slot.registered:
                    with contextlib.suppress(ClusterError):
                        self._router.remove(slot.url, self.config.ray_timeout_s)
        self._router.stop()


__all__ = ["EMBEDDED_SERVER", "ServerPool", "ServerSlot", "ray_result", "server_args"]
