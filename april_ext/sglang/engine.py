"""SGLangEngine: the RolloutEngine API served by SGLang over HTTP (the facade of the adapter).

generate() streams /generate and yields per-event deltas (requests.py); abort() returns partial outputs
(aborts.py); weight updates (april_ext.weights), memory release / resume and health go to every worker, which
the worker pool routes to (workers.py). With config.worker_timeout_s, failover.py takes dead or stalled
workers out of the pool (their requests end as resumable ABORT partials) and brings them back. The
argument checks, request ids, memory tags and the stream that aborts when its consumer leaves are those
of every engine (april_ext.protocol).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Any

from april_ext.batch import FinishReason
from april_ext.errors import AprilError, ConfigError, InvalidArgumentError
from april_ext.protocol.engine_base import RequestStream, check_weight_version, generate_args, stream_until_finish
from april_ext.protocol.memory_tags import memory_tags
from april_ext.protocol.outputs import GenerationChunk, GenerationOutput
from april_ext.protocol.request_ids import RequestIds, abort_ids
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.protocol.sglang_wire import PAUSE_MODES
from april_ext.sglang.aborts import Aborter
from april_ext.sglang.background import cancel_and_wait
from april_ext.sglang.client import HTTPClient, refused
from april_ext.sglang.config import SGLangEngineConfig
from april_ext.sglang.errors import SGLangConnectionError, SGLangHTTPError
from april_ext.sglang.failover import Failover
from april_ext.sglang.profiles import ServerProfile
from april_ext.sglang.requests import RequestState, generate_payload, weight_version_of
from april_ext.sglang.workers import WorkerPool
from april_ext.weights.broadcast import WeightBroadcaster
from april_ext.weights.sources import HELD_ELSEWHERE, WeightsSource
from april_ext.weights.transport import push_weights

logger = logging.getLogger(__name__)

# Weights sent by the processes that hold them (a trainer rank), not by this one.
# weight_versions() for a server whose release labels no weights (SGLang 0.4.x).
UNLABELLED = "unlabelled"


@dataclass(frozen=True)
class SGLangEngineStats:
    """This client's view: requests in flight per url, counters since start, the last weight version."""

    in_flight: dict[str, int]
    requests: int
    generated_tokens: int
    aborted: int
    weight_version: int


class SGLangEngine:
    """`async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,))) as engine:` then the RolloutEngine API."""

    def __init__(self, config: SGLangEngineConfig) -> None:
        if not isinstance(config, SGLangEngineConfig):
            raise ConfigError(f"SGLangEngine needs an SGLangEngineConfig, got {type(config).__name__}")
        self.config = config
        self._http = HTTPClient.of(config)
        self._workers = WorkerPool(config, self._http)
        self._inflight: dict[str, RequestState] = {}
        self._aborter = Aborter(config, self._workers)
        self._broadcaster = self._new_broadcaster(self._workers)
        self._ids = RequestIds("sglang")
        self._weight_version = config.initial_weight_version
        self._held_in_place = False
        self._requests = 0
        self._generated = 0
        self._aborted = 0
        self._health: dict[str, Any] = {"status": "error", "workers": {}, "error": "not started"}
        # The last weights pushed, for a worker that rejoins; the lock keeps a rejoin and an update apart.
        self._weights: WeightsSource | None = None
        self._weights_lock = asyncio.Lock()
        self._load_reader: asyncio.Task[None] | None = None
        self._failover = None if config.worker_timeout_s is None else Failover(
            config, self._http, self._workers, self._inflight,
            lambda states: self._aborter.cut(states, self._weight_version), self._resync)

    async def __aenter__(self) -> SGLangEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Opens the connection pool and checks the workers' health (see health(); a failed check does
        not raise, so a server still starting can be waited for with check_health())."""
        await self._http.start()
        await self.check_health()
        if self._failover is not None:
            self._failover.start()
        config = self.config
        if config.balance == "least_loaded" and len(config.worker_urls) > 1 and config.load_interval_s is not None:
            self._load_reader = asyncio.create_task(self._read_loads(config.load_interval_s))

    async def _read_loads(self, interval_s: float) -> None:
        """The workers' load reports, read every interval_s for least-loaded routing."""
        while True:
            try:
                await self._workers.read_loads()
            except AprilError as exc:  # a worker's answer the adapter cannot read: route by requests in flight
                logger.warning("SGLang load readings: %s", exc)
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        """Aborts this client's requests in flight (on their servers) and closes the connections. A
        server that cannot be reached any more is logged, not raised: its requests are cut here, and
        the connections are closed whatever happens."""
        try:
            if self._inflight:
                states = list(self._inflight.values())
                try:
                    await self._aborter.abort_all(states, self._weight_version)
                except SGLangHTTPError as exc:
                    logger.warning("SGLangEngine.close: the requests in flight could not be aborted on their "
                                   "servers (%s); their streams are cut", exc)
                    await self._aborter.cut(states, self._weight_version)
            await self._aborter.drain()
            await self._broadcaster.close()
        finally:
            await cancel_and_wait([self._load_reader])
            self._load_reader = None
            if self._failover is not None:
                await self._failover.close()
            await self._http.close()

    # Generation ---------------------------------------------------------------------------------------

    def generate(self, input_ids: SequenceOf[int], params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[GenerationChunk]:
        """Streams the request's chunks until one carries a finish reason. Each chunk holds the tokens
        and logprobs that are new in one SGLang event, tagged with the event's weight version. Leaving
        the iteration early aborts the request. Refused input raises SGLangBadRequestError; a server
        that fails or dies mid-stream raises SGLangHTTPError / SGLangConnectionError naming its url; with
        failover, a lost connection or a stalled worker ends the stream as ABORT instead (the chunks so
        far hold every token), and SGLangNoWorkerError says that no worker is left."""
        return stream_until_finish(lambda: self._open(input_ids, params, request_id))

    async def _open(self, input_ids: SequenceOf[int], params: SamplingParams | None,
                    request_id: str | None) -> RequestStream:
        checked, params = generate_args(input_ids, params)
        ids = checked if isinstance(checked, list) else checked.tolist()
        rid = self._ids.claim(request_id, self._inflight)
        state = RequestState(rid, ids, self._workers.pick(len(ids)))
        state.opened = state.last_event = asyncio.get_running_loop().time()
        self._inflight[rid] = state
        self._requests += 1
        state.task = asyncio.create_task(self._read(state, generate_payload(rid, ids, params, self.config.priority)))

        async def receive() -> GenerationChunk:
            item = await state.queue.get()
            if isinstance(item, BaseException):
                raise item
            return item

        def abort() -> None:
            if not state.done.is_set():
                self._aborter.spawn(self._aborter.abort_states([state], self._weight_version))

        return RequestStream(receive, abort)

    async def _read(self, state: RequestState, payload: dict[str, Any]) -> None:
        try:
            while True:
                try:
                    await self._receive(state, payload)
                    break
                except SGLangConnectionError as exc:
                    if self._failover is None:
                        raise
                    if not self._fail_over(self._failover, state, exc):
                        return
        except Exception as exc:  # delivered to the consumer of generate(), which raises it
            state.queue.put_nowait(exc)
        finally:
            self._settle(state)

    async def _receive(self, state: RequestState, payload: dict[str, Any]) -> None:
        url = f"{state.url}/generate"
        if self.config.stream:
            async with self._http.events(url, payload) as events:
                async for event in events:
                    self._deliver(state, state.apply(event, url, self.config.initial_weight_version,
                                                     self._weight_version))
        else:
            answer = await self._http.call("POST", url, {**payload, "stream": False}, idempotent=False)
            self._deliver(state, state.apply(answer, url, self.config.initial_weight_version, self._weight_version))
        if state.finish_reason is None:
            raise SGLangHTTPError(url, 200, "the response ended without a finish reason")

    def _fail_over(self, failover: Failover, state: RequestState, exc: SGLangConnectionError) -> bool:
        """A request's connection failed: True to send it again (its worker refused the connection, so
        nothing of it ran: it goes to another worker), False when it ended as ABORT with its tokens so far.
        Raises SGLangNoWorkerError when no worker is left."""
        direct = self.config.router_url is None
        if direct and refused(exc) and not state.token_ids:
            self._workers.remove(state.url, f"refused connections ({exc})")
            url = self._workers.pick(len(state.prompt_ids))  # raises when none is left: then the request settles on its old url
            self._workers.release(state.url)
            state.url = url
            return True
        failover.suspect(state.url if direct else None)
        logger.warning("SGLang failover: %s ends as ABORT with its %d tokens so far: %s", state.request_id,
                       len(state.token_ids), exc)
        state.finish_reason = FinishReason.ABORT
        state.queue.put_nowait(GenerationChunk(state.request_id, [], [], self._weight_version, FinishReason.ABORT))
        return False

    def _deliver(self, state: RequestState, chunk: GenerationChunk | None) -> None:
        state.last_event = asyncio.get_running_loop().time()
        if self._failover is not None and self.config.router_url is None:
            self._failover.seen(state.url)
        if chunk is not None:
            self._generated += len(chunk.token_ids)
            state.queue.put_nowait(chunk)
            if chunk.finish_reason is not None:
                self._settle(state)

    def _settle(self, state: RequestState) -> None:
        """The request is over (finish reason known, or the stream failed): it leaves the in-flight table
        at once, so its id is free again before the stream's closing [DONE] arrives."""
        if state.done.is_set():
            return
        state.done.set()
        self._workers.release(state.url)
        if self._inflight.get(state.request_id) is state:
            del self._inflight[state.request_id]

    # Abort --------------------------------------------------------------------------------------------

    async def abort(self, request_ids: str | Iterable[str] | None = None) -> list[GenerationOutput]:
        """Aborts the requests (all of this client's when None) on their servers and returns their
        outputs once their streams end: finish reason ABORT with the partial response, or the natural
        finish reason of one that ended meanwhile. Unknown ids raise UnknownIdError, nothing aborted."""
        states = [self._inflight[i] for i in abort_ids(request_ids, self._inflight)]
        if request_ids is None:
            if states:
                await self._aborter.abort_all(states, self._weight_version)
        else:
            await self._aborter.abort_states(states, self._weight_version)
        self._aborted += sum(s.finish_reason is FinishReason.ABORT for s in states)
        return [s.output() for s in states]

    async def abort_all(self) -> None:
        """Aborts every request on every worker, also those this client did not send (a slime custom generate
        function's: protocol.AbortAllEngine); returns once each worker answered, not once the requests ended (this
        client's own streams end with the servers' ABORT answers). A request that reaches a worker after it runs
        on: the caller sends it again until its requests are back."""
        await self._aborter.send_abort_all()

    # Weights, memory, health --------------------------------------------------------------------------

    async def update_weights(self, weights: WeightsSource, version: int) -> list[str]:
        """Loads weights on every worker with weight_version str(version); returns the names loaded.
        A checkpoint directory or named tensors; see april_ext.weights.transport for the transports
        (SGLangEngineConfig.weight_sync). A stream of named tensors (an ExportedWeights) is read once:
        the disk sync and the tensor sync without failover hold one bucket of it at a time; the tensor sync
        with failover keeps the whole of it for a rejoining worker, as the broadcast does for its retry.
        A BroadcastSource or StagedSource (weight_sync "broadcast") or a TensorPoster ("tensor") is sent by the
        processes that hold the tensors; this one holds none of them, and keeps the source for a rejoining worker."""
        check_weight_version(version)
        streamed = self.config.weight_sync == "disk" or (self.config.weight_sync == "tensor" and self._failover is None)
        if not isinstance(weights, (str, os.PathLike, Mapping, *HELD_ELSEWHERE)) and not streamed:
            weights = dict(weights)
        async with self._weights_lock:
            # Requests held in place keep their KV: SGLang would fail the flush (it flushes only when idle).
            names = await push_weights(self._workers, weights, version, self.config.weight_sync,
                                       self.config.weight_sync_dir, self._broadcaster,
                                       flush_cache=not self._held_in_place)
            self._weight_version = version
            if self._failover is not None:
                self._weights = _kept(weights, self.config.weight_sync, self.config.weight_sync_dir)
        return names

    def reset_weight_group(self) -> None:
        """weight_sync="broadcast": a worker restarted (and so left the weight group) without a failed update
        noticing it; the next update builds the group again with every worker. A failed update, a changed
        worker list, or a worker rejoining after failover does this by itself."""
        self._broadcaster.reset()

    async def _push_one(self, one: WorkerPool, weights: WeightsSource) -> None:
        """The last weights onto one rejoining worker. With weight_sync "broadcast" it left the weight group
        when it went away: it gets them through a group of its own, and the next update builds the shared
        group again with every worker."""
        if self.config.weight_sync != "broadcast":
            await push_weights(one, weights, self._weight_version, self.config.weight_sync,
                               self.config.weight_sync_dir, self._broadcaster)
            return
        single = self._new_broadcaster(one)
        try:
            await push_weights(one, weights, self._weight_version, "broadcast", None, single)
        finally:
            await single.close()
        self._broadcaster.reset()

    def _new_broadcaster(self, workers: WorkerPool) -> WeightBroadcaster:
        return WeightBroadcaster(workers, bucket_bytes=int(self.config.weight_bucket_mb * 2**20),
                                 timeout_s=self.config.weight_sync_timeout_s,
                                 master_address=self.config.weight_sync_master_address)

    async def _resync(self, url: str) -> None:
        """Brings a returning worker up to date before it rejoins: what it still runs is aborted (those
        requests ended here when it was removed), the last weights are pushed, and the version it then
        reports must be the current one. Raises (an AprilError) when it cannot."""
        async with self._weights_lock:
            one = self._workers.only(url)
            await one.broadcast("/abort_request", {"rid": "", "abort_all": True})
            if self._weights is not None:
                await self._push_one(one, self._weights)
            profile = await one.profile(url)
            if profile.weight_version_path is not None:
                answer = await self._http.call("GET", f"{url}{profile.weight_version_path}", idempotent=True)
                label = answer.get("weight_version") if isinstance(answer, dict) else answer
                if weight_version_of(label, self.config.initial_weight_version) != self._weight_version:
                    raise SGLangHTTPError(f"{url}{profile.weight_version_path}", 200,
                                          f"reports weight version {label!r}, not the current {self._weight_version}")

    async def release_memory(self, tags: str | Iterable[str] | None = None) -> None:
        """Releases memory on every worker (tags of protocol.memory_tags: "weights", "kv_cache",
        "cuda_graph"; None = all). The servers must be idle: abort first."""
        await self._workers.broadcast("/release_memory_occupation", {"tags": _wire_tags(tags)})

    async def resume_memory(self, tags: str | Iterable[str] | None = None) -> None:
        await self._workers.broadcast("/resume_memory_occupation", {"tags": _wire_tags(tags)})

    async def resume_and_update(self, weights: WeightsSource, version: int) -> list[str]:
        """The two-stage resume of colocated RL: weights, then the update, then KV cache and graphs (so
        the KV cache is not resident while the new weights are loaded)."""
        await self.resume_memory(["weights"])
        names = await self.update_weights(weights, version)
        await self.resume_memory(["kv_cache", "cuda_graph"])
        return names

    async def pause_generation(self, mode: str = "abort") -> None:
        """/pause_generation on every worker: "abort" ends the running requests (their streams end with
        ABORT) and holds new ones until continue_generation; "retract" holds them with their KV cache freed
        (recomputed on continue), "in_place" holds them with it. Releases before the modes (whose pause
        always aborts) are sent no body, and a mode other than "abort" for one of them raises
        InvalidArgumentError naming the worker, before any worker is paused."""
        if mode not in PAUSE_MODES:
            raise InvalidArgumentError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        profiles = await self._workers.profiles()
        old = [f"{p.url} (SGLang {p.version})" for p in profiles if mode not in p.dialect.pause_modes]
        if old:
            raise InvalidArgumentError(f"pause_generation mode {mode!r} is not served by {', '.join(old)}: their "
                                       "release only aborts on pause; use mode 'abort'")
        await self._workers.broadcast("/pause_generation", lambda p: _with_modes(p, {"mode": mode}))
        self._held_in_place = mode == "in_place"

    async def continue_generation(self) -> None:
        await self._workers.broadcast("/continue_generation", lambda p: _with_modes(p, {}))
        self._held_in_place = False

    async def flush_cache(self) -> None:
        await self._workers.broadcast("/flush_cache", None)

    def health(self) -> dict[str, Any]:
        """The result of the last check_health() (made by start()): {"status": "ok" | "error",
        "workers": {url: "ok" | reason}, "removed": {url: reason}, "weight_version", "error"}."""
        return dict(self._health, weight_version=self._weight_version)

    async def check_health(self) -> dict[str, Any]:
        """GET /health on every worker now; updates and returns health()."""
        self._health = await self._workers.check_health()
        return self.health()

    async def server_info(self) -> dict[str, Any]:
        """The server info of every worker, by url (/server_info, or /get_server_info on older releases)."""
        return dict(await self._workers.each(
            lambda p: self._http.call("GET", f"{p.url}{p.server_info_path}", idempotent=True)))

    async def weight_versions(self) -> dict[str, str]:
        """The label each worker reports for its current weights, by url: from /model_info (current
        releases), /get_weight_version (0.5.x before its removal), or UNLABELLED for releases without
        weight versions (0.4.x)."""
        async def label(profile: ServerProfile) -> str:
            if profile.weight_version_path is None:
                return UNLABELLED
            answer = await self._http.call("GET", f"{profile.url}{profile.weight_version_path}", idempotent=True)
            return str(answer.get("weight_version")) if isinstance(answer, dict) else str(answer)

        return dict(await self._workers.each(label))

    async def server_profiles(self) -> dict[str, ServerProfile]:
        """What the adapter probed of each worker: its SGLang version and the dialect spoken to it."""
        return {p.url: p for p in await self._workers.profiles()}

    def pool_health(self) -> dict[str, Any]:
        """Failover's view now: "live" worker urls, "removed" {url: reason} (dropped ones too), and since start
        "removals" and "rejoins" (counts)."""
        pool = self._workers
        return {"live": pool.live(), "removed": {**{url: r.reason for url, r in pool.removed.items()}, **pool.dropped},
                "removals": pool.removals, "rejoins": pool.rejoins}

    def forget_worker(self, url: str) -> None:
        """Failover stops awaiting a removed worker whose server was replaced by one at another url."""
        self._workers.forget(url)

    def drop_worker(self, url: str, reason: str) -> None:
        """Direct worker urls: the worker gets no requests or calls until ``admit_worker``; what it runs ends
        as ABORT with its tokens so far (with failover), and failover does not bring it back by itself."""
        self._workers.drop(url, reason)

    def admit_worker(self, url: str) -> None:
        """Direct worker urls: a worker (new, or dropped before) that holds the current weights gets requests
        and calls from now on."""
        self._workers.admit(url)

    def stats(self) -> SGLangEngineStats:
        return SGLangEngineStats(dict(self._workers.load), self._requests, self._generated, self._aborted,
                                 self._weight_version)

    async def worker_urls(self) -> list[str]:
        """The worker urls: the configured ones, or the router's list."""
        return await self._workers.worker_urls()


def _kept(weights: WeightsSource, weight_sync: str, weight_sync_dir: str | None) -> WeightsSource:
    """What a rejoining worker will load: the directory the weights are in (with weight_sync "disk" the
    weight-sync directory holds the last tensors pushed), a BroadcastSource, StagedSource or TensorPoster
    itself (its holders export them again), else a CPU copy of the tensors (a trainer exports its live
    parameters, which its next update changes in place)."""
    if isinstance(weights, (str, os.PathLike, *HELD_ELSEWHERE)):
        return weights
    if weight_sync == "disk":
        assert weight_sync_dir is not None  # SGLangEngineConfig requires it for "disk"
        return weight_sync_dir
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights.items()}  # type: ignore[union-attr]


def _with_modes(profile: ServerProfile, body: dict[str, Any]) -> dict[str, Any] | None:
    """The pause / continue body: none for a release whose pause takes no modes (it reads no body)."""
    return body if profile.dialect.pause_has_modes else None


def _wire_tags(tags: str | Iterable[str] | None) -> list[str] | None:
    """The tags of a memory call; None stays None (SGLang's "all", whatever tags the server has)."""
    return None if tags is None else memory_tags(tags)


__all__ = ["UNLABELLED", "SGLangEngine", "SGLangEngineStats"]
