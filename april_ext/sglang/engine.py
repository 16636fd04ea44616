"""SGLangEngine: the rollout-engine API of april_ext.engine.AsyncEngine, served by SGLang over HTTP.

generate() streams /generate and turns SGLang's cumulative events into per-event deltas (tokens,
behavior logprobs, the weight version of the event). abort() returns partial outputs. Weight updates,
memory release / resume and health go to every worker. Requests are spread over worker urls
(least-loaded or round-robin), or sent to a router whose /workers lists the workers for the calls
that must reach each of them (aborts, weights, memory).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from april_ext.batch import FinishReason
from april_ext.errors import (
    AprilError,
    ConfigError,
    InvalidArgumentError,
    UnknownIdError,
)
from april_ext.model.checkpoint import safetensors_files, save_safetensors
from april_ext.protocol import GenerationChunk, GenerationOutput, SamplingParams
from april_ext.protocol.sglang_wire import (
    MEMORY_TAGS,
    PAUSE_MODES,
    encode_named_tensors,
)
from april_ext.sglang.client import HTTPClient
from april_ext.sglang.errors import SGLangBadRequestError, SGLangHTTPError

logger = logging.getLogger(__name__)

_BALANCE = ("least_loaded", "round_robin")
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass(frozen=True)
class SGLangEngineConfig:
    """Where the servers are and how to talk to them.

    worker_urls: SGLang servers; requests go to the least-loaded (fewest requests in flight from this
    client) or round-robin. router_url instead: requests go to the router, and the workers it lists
    (GET /workers, or /list_workers on older routers) receive aborts, weight updates and memory calls.
    timeout_s bounds a control call and the silence between two events of a stream. retries with
    exponential backoff from backoff_s apply to connection failures of idempotent calls only.
    initial_weight_version: the version reported for a server's non-numeric label (SGLang's "default").
    abort_timeout_s: how long abort() waits for the aborted streams to end; abort_resend_s: interval at
    which the abort is re-sent meanwhile (an abort can overtake its request on another connection).
    max_connections: the client's connection pool size (0 = unlimited).
    stream: True streams /generate (a chunk per event, so the scheduler sees tokens as they come);
    False sends one non-streaming request per generate() and yields one chunk at its end (or its abort),
    which parses each response once instead of once per event (cumulative events cost O(L^2) for a
    response of L tokens). SGLang holds weight updates until the requests in flight end (unless they
    are aborted), so one response never spans two weight versions. timeout_s then bounds the whole response.
    weight_sync_dir: a directory every server can read at the same path (shared file system). When set,
    update_weights with named tensors writes them there as model.safetensors and loads them with
    /update_weights_from_disk, which real SGLang servers accept; unset, they travel in the request.
    """

    worker_urls: tuple[str, ...] = ()
    router_url: str | None = None
    balance: str = "least_loaded"
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    retries: int = 3
    backoff_s: float = 0.2
    initial_weight_version: int = 0
    abort_timeout_s: float = 60.0
    abort_resend_s: float = 0.5
    max_connections: int = 0
    weight_sync_dir: str | None = None
    stream: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.worker_urls, str):
            raise ConfigError("SGLangEngineConfig.worker_urls must be a sequence of urls, not one string")
        urls = tuple(_base_url(u, "worker_urls") for u in self.worker_urls)
        object.__setattr__(self, "worker_urls", urls)
        if self.router_url is not None:
            object.__setattr__(self, "router_url", _base_url(self.router_url, "router_url"))
        if bool(urls) == (self.router_url is not None):
            raise ConfigError("SGLangEngineConfig needs exactly one of worker_urls (non-empty) or router_url, "
                              f"got worker_urls={list(urls)} router_url={self.router_url!r}")
        if self.balance not in _BALANCE:
            raise ConfigError(f"SGLangEngineConfig.balance must be one of {_BALANCE}, got {self.balance!r}")
        for name in ("timeout_s", "connect_timeout_s", "abort_timeout_s", "abort_resend_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"SGLangEngineConfig.{name} must be a number > 0, got {value!r}")
        for name in ("retries", "max_connections", "initial_weight_version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"SGLangEngineConfig.{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.stream, bool):
            raise ConfigError(f"SGLangEngineConfig.stream must be True or False, got {self.stream!r}")
        if self.weight_sync_dir is not None:
            if not isinstance(self.weight_sync_dir, (str, os.PathLike)) or not os.fspath(self.weight_sync_dir):
                raise ConfigError(f"SGLangEngineConfig.weight_sync_dir must be None or a directory path, "
                                  f"got {self.weight_sync_dir!r}")
            object.__setattr__(self, "weight_sync_dir", os.path.abspath(os.fspath(self.weight_sync_dir)))
        if not isinstance(self.backoff_s, (int, float)) or self.backoff_s < 0:
            raise ConfigError(f"SGLangEngineConfig.backoff_s must be a number >= 0, got {self.backoff_s!r}")


def _base_url(url: Any, name: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"SGLangEngineConfig.{name}: {url!r} is not an http:// or https:// url")
    return url.rstrip("/")


def wire_rid(request_id: str) -> str:
    """The rid sent to SGLang. SGLang aborts every request whose rid starts with the given one, so ids
    are made prefix-free by a length prefix: aborting "s-1" must not abort "s-10"."""
    return f"{len(request_id)}:{request_id}"


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    url: str
    queue: asyncio.Queue[GenerationChunk | BaseException] = field(default_factory=asyncio.Queue)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def output(self) -> GenerationOutput:
        return GenerationOutput(self.request_id, list(self.prompt_ids), list(self.token_ids), list(self.logprobs),
                                list(self.versions), self.finish_reason, self.matched_stop)


@dataclass(frozen=True)
class SGLangEngineStats:
    """This client's view: requests in flight per url, counters since start, the last weight version."""

    in_flight: dict[str, int]
    requests: int
    generated_tokens: int
    aborted: int
    weight_version: int


class SGLangEngine:
    """`async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,))) as engine:` then the AsyncEngine API."""

    def __init__(self, config: SGLangEngineConfig) -> None:
        if not isinstance(config, SGLangEngineConfig):
            raise ConfigError(f"SGLangEngine needs an SGLangEngineConfig, got {type(config).__name__}")
        self.config = config
        self._http = HTTPClient(timeout_s=config.timeout_s, connect_timeout_s=config.connect_timeout_s,
                                retries=config.retries, backoff_s=config.backoff_s,
                                max_connections=config.max_connections)
        self._inflight: dict[str, _Request] = {}
        self._load = {url: 0 for url in (config.worker_urls or (config.router_url,))}
        self._round_robin = itertools.cycle(list(self._load))
        self._background: set[asyncio.Task[Any]] = set()
        self._ids = itertools.count()
        self._weight_version = config.initial_weight_version
        self._requests = 0
        self._generated = 0
        self._aborted = 0
        self._health: dict[str, Any] = {"status": "error", "workers": {}, "error": "not started"}

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

    async def close(self) -> None:
        """Aborts this client's requests in flight (on their servers) and closes the connections."""
        if self._inflight:
            await self.abort()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._http.close()

    # Generation ---------------------------------------------------------------------------------------

    async def generate(self, input_ids: SequenceOf[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[GenerationChunk]:
        """Streams the request's chunks until one carries a finish reason. Each chunk holds the tokens
        and logprobs that are new in one SGLang event, tagged with the event's weight version. Leaving
        the iteration early aborts the request. Refused input raises SGLangBadRequestError."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.tolist()
        ids = list(input_ids)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise InvalidArgumentError(f"input_ids must be a non-empty sequence of token ids >= 0, got {ids[:8]}")
        rid = request_id if request_id is not None else f"sglang-{next(self._ids)}"
        if rid in self._inflight:
            raise InvalidArgumentError(f"request_id {rid!r} is already in use")
        url = self._pick_url()
        state = _Request(rid, ids, url)
        self._inflight[rid] = state
        self._load[url] += 1
        self._requests += 1
        state.task = asyncio.create_task(self._read(state, _payload(rid, ids, params)))
        finished = False
        try:
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished and not state.done.is_set():
                self._spawn(self._abort_states([state]))

    def _pick_url(self) -> str:
        if self.config.router_url is not None or self.config.balance == "round_robin":
            return next(self._round_robin)
        return min(self._load, key=self._load.__getitem__)

    async def _read(self, state: _Request, payload: dict[str, Any]) -> None:
        url = f"{state.url}/generate"
        try:
            if self.config.stream:
                async with self._http.events(url, payload) as events:
                    async for event in events:
                        self._deliver(state, self._delta(state, event, url))
            else:
                answer = await self._http.call("POST", url, {**payload, "stream": False}, idempotent=False)
                self._deliver(state, self._delta(state, answer, url))
            if state.finish_reason is None:
                raise SGLangHTTPError(url, 200, "the response ended without a finish reason")
        except Exception as exc:  # delivered to the consumer of generate(), which raises it
            state.queue.put_nowait(exc)
        finally:
            self._settle(state)

    def _deliver(self, state: _Request, chunk: GenerationChunk | None) -> None:
        if chunk is not None:
            state.queue.put_nowait(chunk)
            if chunk.finish_reason is not None:
                self._settle(state)

    def _settle(self, state: _Request) -> None:
        """The request is over (finish reason known, or the stream failed): it leaves the in-flight table
        at once, so its id is free again before the stream's closing [DONE] arrives."""
        if state.done.is_set():
            return
        state.done.set()
        self._load[state.url] -= 1
        if self._inflight.get(state.request_id) is state:
            del self._inflight[state.request_id]

    def _delta(self, state: _Request, event: Any, url: str) -> GenerationChunk | None:
        if not isinstance(event, dict) or "error" in event:
            message = event.get("error", {}).get("message", event) if isinstance(event, dict) else event
            raise SGLangBadRequestError(url, 200, str(message))
        meta = event.get("meta_info") or {}
        reason, matched = _finish(meta.get("finish_reason"), url)
        ids = event.get("output_ids") or []
        if 0 < len(ids) < len(state.token_ids):
            # An abort answer may carry no output_ids at all; fewer than before means deltas, not totals.
            raise SGLangHTTPError(url, 200, f"an event carries {len(ids)} output_ids after {len(state.token_ids)}: "
                                  "the server streams increments (--incremental-streaming-output); the adapter "
                                  "needs SGLang's default cumulative events")
        new_ids = ids[len(state.token_ids):]
        rows = meta.get("output_token_logprobs") or []
        if len(rows) < len(ids):
            raise SGLangHTTPError(url, 200, f"{len(ids)} output_ids but {len(rows)} output_token_logprobs: "
                                  "the server ignored return_logprob")
        new_logprobs = [float(row[0]) for row in rows[len(state.token_ids):len(ids)]]
        version = self._version_of(meta.get("weight_version"))
        state.token_ids.extend(new_ids)
        state.logprobs.extend(new_logprobs)
        state.versions.extend([version] * len(new_ids))
        self._generated += len(new_ids)
        if not new_ids and reason is None:
            return None
        if reason is not None:
            state.finish_reason, state.matched_stop = reason, matched
        return GenerationChunk(state.request_id, list(new_ids), new_logprobs, version, reason, matched)

    def _version_of(self, label: Any) -> int:
        """SGLang's weight_version label -> int: numeric labels as they are (this client sends
        str(version)); any other label ("default") is the initial version."""
        if isinstance(label, int) and not isinstance(label, bool):
            return label
        if isinstance(label, str) and label.lstrip("-").isdigit():
            return int(label)
        return self.config.initial_weight_version

    # Abort --------------------------------------------------------------------------------------------

    async def abort(self, request_ids: str | Iterable[str] | None = None) -> list[GenerationOutput]:
        """Aborts the requests (all of this client's when None) on their servers and returns their
        outputs once their streams end: finish reason ABORT with the partial response, or the natural
        finish reason of one that ended meanwhile. Ids not in flight raise UnknownIdError."""
        if request_ids is None:
            states = list(self._inflight.values())
            if states:
                await self._abort_all_and_wait(states)
        else:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            unknown = [i for i in ids if i not in self._inflight]
            if unknown:
                raise UnknownIdError(f"abort: request ids not in flight {unknown[:5]}")
            states = [self._inflight[i] for i in dict.fromkeys(ids)]
            await self._abort_states(states)
        self._aborted += sum(s.finish_reason is FinishReason.ABORT for s in states)
        return [s.output() for s in states]

    async def _abort_all_and_wait(self, states: list[_Request]) -> None:
        async def send() -> None:
            urls = await self.worker_urls()
            await asyncio.gather(*(self._http.call("POST", f"{u}/abort_request", {"rid": "", "abort_all": True},
                                                   idempotent=True) for u in urls))
        await self._until_done(states, send)

    async def _abort_states(self, states: list[_Request]) -> None:
        async def send() -> None:
            pending = [s for s in states if not s.done.is_set()]
            workers = await self.worker_urls() if self.config.router_url is not None else None
            calls = [self._http.call("POST", f"{url}/abort_request", {"rid": wire_rid(s.request_id)}, idempotent=True)
                     for s in pending for url in (workers if workers is not None else [s.url])]
            await asyncio.gather(*calls)
        await self._until_done(states, send)

    async def _until_done(self, states: list[_Request], send: Any) -> None:
        """Sends the abort, and again every abort_resend_s until every stream ended (an abort that
        overtakes its request finds nothing to abort); after abort_timeout_s the streams are cut."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.abort_timeout_s
        while True:
            await send()
            waiting = [s for s in states if not s.done.is_set()]
            if not waiting:
                return
            left = deadline - loop.time()
            if left <= 0:
                break
            waiters = [asyncio.ensure_future(s.done.wait()) for s in waiting]
            try:
                await asyncio.wait(waiters, timeout=min(self.config.abort_resend_s, left))
            finally:
                for waiter in waiters:
                    waiter.cancel()
        for state in states:
            if not state.done.is_set() and state.task is not None:
                state.task.cancel()
                state.finish_reason = FinishReason.ABORT
                state.queue.put_nowait(GenerationChunk(state.request_id, [], [], self._weight_version,
                                                       FinishReason.ABORT))
        await asyncio.gather(*(s.task for s in states if s.task is not None), return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        """Runs a fire-and-forget call (the abort of an abandoned stream); a failure is logged, since
        nobody awaits it."""
        async def quietly() -> None:
            try:
                await coro
            except AprilError as exc:
                logger.warning("SGLang background call failed: %s", exc)

        task = asyncio.ensure_future(quietly())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # Weights, memory, health --------------------------------------------------------------------------

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | str
                             | os.PathLike[str], version: int) -> list[str]:
        """Loads weights on every worker with weight_version str(version); returns the names loaded.
        A checkpoint directory (which the servers must see at the same path) uses
        /update_weights_from_disk, which real SGLang servers accept. Named tensors are written to
        weight_sync_dir and loaded the same way when it is set; otherwise they are sent to
        /update_weights_from_tensor as a base64 safetensors blob, which only the embedded server reads
        (SGLang's own serializer passes CUDA IPC handles between processes of one machine)."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise InvalidArgumentError(f"version must be an integer, got {version!r}")
        if not isinstance(weights, (str, os.PathLike)):
            tensors = dict(weights.items() if isinstance(weights, Mapping) else weights)
            if self.config.weight_sync_dir is None:
                payload = {"serialized_named_tensors": [encode_named_tensors(tensors)], "load_format": None}
                await self._load_weights("/update_weights_from_tensor", payload, version)
                return sorted(tensors)
            save_safetensors(tensors, self.config.weight_sync_dir)
            weights = self.config.weight_sync_dir
        path = os.path.abspath(os.fspath(weights))
        names = []
        for file in safetensors_files(path):
            with safe_open(file, framework="pt") as handle:
                names.extend(handle.keys())
        await self._load_weights("/update_weights_from_disk", {"model_path": path, "load_format": None}, version)
        return sorted(names)

    async def _load_weights(self, endpoint: str, payload: dict[str, Any], version: int) -> None:
        payload.update(weight_version=str(version), flush_cache=True, abort_all_requests=False)
        for url, answer in await self._broadcast(endpoint, payload):
            if not isinstance(answer, dict) or not answer.get("success", False):
                raise SGLangHTTPError(f"{url}{endpoint}", 200, f"weight update failed: {answer!r}")
        self._weight_version = version

    async def release_memory(self, tags: Iterable[str] | None = None) -> None:
        """Releases memory on every worker (tags of "weights", "kv_cache", "cuda_graph"; None = all).
        The servers must be idle: abort first."""
        await self._broadcast("/release_memory_occupation", {"tags": _tags(tags)})

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        await self._broadcast("/resume_memory_occupation", {"tags": _tags(tags)})

    async def resume_and_update(self, weights: Any, version: int) -> list[str]:
        """The two-stage resume of colocated RL: weights, then the update, then KV cache and graphs (so
        the KV cache is not resident while the new weights are loaded)."""
        await self.resume_memory(["weights"])
        names = await self.update_weights(weights, version)
        await self.resume_memory(["kv_cache", "cuda_graph"])
        return names

    async def pause_generation(self, mode: str = "abort") -> None:
        """/pause_generation on every worker: "abort" ends the running requests (their streams end with
        ABORT) and holds new ones until continue_generation; "retract" / "in_place" (SGLang only) keep them."""
        if mode not in PAUSE_MODES:
            raise InvalidArgumentError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        await self._broadcast("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._broadcast("/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._broadcast("/flush_cache", None)

    def health(self) -> dict[str, Any]:
        """The result of the last check_health() (made by start()): {"status": "ok" | "error",
        "workers": {url: "ok" | reason}, "weight_version", "error"}."""
        return dict(self._health, weight_version=self._weight_version)

    async def check_health(self) -> dict[str, Any]:
        """GET /health on every worker now; updates and returns health()."""
        try:
            urls = await self.worker_urls()
        except SGLangHTTPError as exc:
            self._health = {"status": "error", "workers": {}, "error": str(exc)}
            return self.health()
        results = await asyncio.gather(*(self._http.call("GET", f"{u}/health", idempotent=False) for u in urls),
                                       return_exceptions=True)
        workers = {u: "ok" if not isinstance(r, BaseException) else str(r) for u, r in zip(urls, results)}
        bad = [reason for reason in workers.values() if reason != "ok"]
        self._health = {"status": "error" if bad else "ok", "workers": workers, "error": bad[0] if bad else None}
        return self.health()

    async def server_info(self) -> dict[str, Any]:
        """GET /server_info of every worker, by url."""
        return dict(await self._broadcast("/server_info", None, method="GET"))

    async def weight_versions(self) -> dict[str, str]:
        """GET /get_weight_version of every worker: the label each server reports for its weights, by url."""
        return {url: str(answer.get("weight_version")) if isinstance(answer, dict) else str(answer)
                for url, answer in await self._broadcast("/get_weight_version", None, method="GET")}

    def stats(self) -> SGLangEngineStats:
        return SGLangEngineStats(dict(self._load), self._requests, self._generated, self._aborted,
                                 self._weight_version)

    async def worker_urls(self) -> list[str]:
        """The worker urls: the configured ones, or the router's list (GET /workers, else /list_workers)."""
        if self.config.router_url is None:
            return list(self.config.worker_urls)
        router = self.config.router_url
        try:
            answer = await self._http.call("GET", f"{router}/workers", idempotent=True)
        except SGLangHTTPError as exc:
            if exc.status != 404:
                raise
            answer = await self._http.call("GET", f"{router}/list_workers", idempotent=True)
        return _parse_workers(answer, router)

    async def _broadcast(self, endpoint: str, payload: Any, method: str = "POST") -> list[tuple[str, Any]]:
        urls = await self.worker_urls()
        answers = await asyncio.gather(*(self._http.call(method, f"{u}{endpoint}", payload, idempotent=True)
                                         for u in urls))
        return list(zip(urls, answers))


def _payload(rid: str, ids: list[int], params: SamplingParams) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                                "top_p": params.top_p, "top_k": params.top_k, "ignore_eos": params.ignore_eos,
                                "stop_token_ids": list(params.stop_token_ids), "no_stop_trim": True}
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    return {"rid": wire_rid(rid), "input_ids": ids, "sampling_params": sampling, "return_logprob": True,
            "stream": True}


def _finish(raw: Any, url: str) -> tuple[FinishReason | None, int | None]:
    if raw is None:
        return None, None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in _FINISH:
        raise SGLangHTTPError(url, 200, f"unknown finish_reason {raw!r}")
    if kind == "abort" and raw.get("status_code") is not None:
        # SGLang reports refused input (too long, bad parameters) as an abort with an HTTP status.
        raise SGLangBadRequestError(url, int(raw["status_code"]), str(raw.get("message")))
    matched = raw.get("matched")
    return _FINISH[kind], matched if isinstance(matched, int) and not isinstance(matched, bool) else None


def _tags(tags: Iterable[str] | None) -> list[str] | None:
    if tags is None:
        return None
    tags = [tags] if isinstance(tags, str) else list(tags)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise InvalidArgumentError(f"memory tags {bad} are not known (allowed: {list(MEMORY_TAGS)})")
    return tags


def _parse_workers(answer: Any, router: str) -> list[str]:
    items: Any = None
    if isinstance(answer, dict):
        items = answer.get("workers", answer.get("urls"))
    elif isinstance(answer, list):
        items = answer
    urls = []
    for item in items if isinstance(items, list) else []:
        url = item.get("url") if isinstance(item, dict) else item
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            urls.append(url.rstrip("/"))
    if not urls:
        raise SGLangHTTPError(router, 200, f"the router lists no worker urls: {answer!r}")
    return urls
