"""EmbeddedServer: the SGLang HTTP API subset (shared/sglang-api.md) in front of an in-process engine (aiohttp):
any ServableEngine (april_ext.protocol), e.g. the embedded AsyncEngine or the SimulatedEngine.

The server owns no rollout state: it turns requests into engine calls and engine chunks into SGLang's
JSON. What it adds is what SGLang keeps above its scheduler: the table of requests in flight (for
prefix aborts and the idle checks of release / flush), the pause gate of /pause_generation and the
string weight-version labels (the engine counts versions as integers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from april_ext import __version__
from april_ext.deprecation import renamed
from april_ext.errors import (
    AprilError,
    ConfigError,
    InvalidArgumentError,
    UnknownIdError,
)
from april_ext.settings import MAX_GROUP_TIMEOUT_S
from april_ext.data.tokenizer import encode_prompt, load_tokenizer
from april_ext.protocol import HOLD_MODES, GenerationChunk, PausableEngine, SamplingParams, ServableEngine, sglang_wire
from april_ext.weights.receive import DistributedWeights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """host / port to listen on (port 0: any free port); model_path is reported by /server_info.
    weight_version: the label of the weights the engine starts with (SGLang's default is "default").
    enable_memory_saver: allow /release_memory_occupation (SGLang needs --enable-memory-saver for it).
    health_timeout_s: how long /health_generate waits for its one-token generation.
    stream_interval: a streamed request gets an event every this many tokens (and at its finish), as
    SGLang's --stream-interval; events are cumulative, so long responses want a larger interval.
    max_request_bytes: the largest request body; a larger one answers 413 before it is read (the default
    admits /update_weights_from_tensor blobs of small models; larger ones go through a checkpoint
    directory and /update_weights_from_disk).
    tokenizer_path: a Hugging Face tokenizer directory: /generate then takes `text` and answers with the
    detokenized output too (None: token ids only, as SGLang with --skip-tokenizer-init).
    sglang_compat: the SGLang release line whose endpoints and fields the server mimics (a key of
    april_ext.protocol.sglang_wire.DIALECTS: "0.4", "0.5.3" or "current"), so clients can be tested
    against each line over real HTTP.
    weight_group_timeout_s: how long joining the trainer's weight group and each broadcast may wait for the
    other ranks (the current dialect's /init_weights_update_group and /update_weights_from_distributed).
    api_key: as SGLang's --api-key: every request but /health and /health_generate must carry
    ``Authorization: Bearer <api_key>``, else it answers 401 (None: no check; a server bound beyond loopback
    without a key warns at its start). Never shown by repr, /server_info or the logs."""

    host: str = "127.0.0.1"
    port: int = 30000
    model_path: str | None = None
    weight_version: str = "default"
    enable_memory_saver: bool = False
    health_timeout_s: float = 20.0
    stream_interval: int = 1
    max_request_bytes: int = 64 << 20
    tokenizer_path: str | None = None
    sglang_compat: str = "current"
    weight_group_timeout_s: float = 60.0
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key
                                         or not self.api_key.isprintable() or " " in self.api_key):
            raise ConfigError("ServerConfig.api_key must be None or a non-empty string of printable characters "
                              "without spaces (it travels in an Authorization header)")
        if not isinstance(self.sglang_compat, str) or self.sglang_compat not in sglang_wire.DIALECTS:
            raise ConfigError(f"ServerConfig.sglang_compat must be one of {sorted(sglang_wire.DIALECTS)}, "
                              f"got {self.sglang_compat!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"ServerConfig.host must be a non-empty string, got {self.host!r}")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ConfigError(
                f"ServerConfig.port must be an integer in [0, 65535] (0 = any free port), got {self.port!r}")
        if not isinstance(self.weight_version, str):
            raise ConfigError(f"ServerConfig.weight_version must be a string, got {self.weight_version!r}")
        if not isinstance(self.stream_interval, int) or isinstance(self.stream_interval, bool) \
                or self.stream_interval < 1:
            raise ConfigError(f"ServerConfig.stream_interval must be an integer >= 1, got {self.stream_interval!r}")
        for name in ("weight_group_timeout_s", "health_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_GROUP_TIMEOUT_S:
                raise ConfigError(f"ServerConfig.{name} must be a finite number > 0 (at most 6e8 s), got {value!r}")
        if not isinstance(self.max_request_bytes, int) or isinstance(self.max_request_bytes, bool) \
                or self.max_request_bytes < 1:
            raise ConfigError(
                f"ServerConfig.max_request_bytes must be an integer >= 1, got {self.max_request_bytes!r}")
        if not isinstance(self.enable_memory_saver, bool):
            raise ConfigError(
                f"ServerConfig.enable_memory_saver must be True or False, got {self.enable_memory_saver!r}")
        for name in ("model_path", "tokenizer_path"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"ServerConfig.{name} must be None or a non-empty path, got {value!r}")


class _Output:
    """The cumulative output of one /generate request, rendered as SGLang's response object."""

    def __init__(self, rid: str, prompt_tokens: int, params: SamplingParams, return_logprob: bool,
                 stream_interval: int, decode: Any = None, versions: bool = True) -> None:
        self.rid = rid
        self.stream_interval = stream_interval
        self.decode = decode
        self.versions = versions
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = params.max_new_tokens
        self.return_logprob = return_logprob
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.last: GenerationChunk | None = None
        self.started = time.perf_counter()

    def add(self, chunk: GenerationChunk) -> None:
        self.output_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.last = chunk

    def render(self, version_label: str) -> dict[str, Any]:
        reason = None if self.last is None else self.last.finish_reason
        matched = None if self.last is None else self.last.matched_stop
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": sglang_wire.finish_reason_json(reason, matched, self.max_new_tokens, len(self.output_ids)),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            # The engine shares prefix blocks but does not count them per request.
            "cached_tokens": 0,
            "e2e_latency": time.perf_counter() - self.started,
        }
        if self.versions:
            meta["weight_version"] = version_label
        if self.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.logprobs, self.output_ids)]
        answer: dict[str, Any] = {"output_ids": list(self.output_ids), "meta_info": meta}
        if self.decode is not None:
            answer["text"] = self.decode(self.output_ids)
        return answer


class _Versions:
    """String labels (SGLang's weight_version) of the engine's integer weight versions."""

    def __init__(self, label: str, current: int) -> None:
        self.current = current
        self._labels = {current: label}

    def label(self, version: int | None = None) -> str:
        version = self.current if version is None else version
        return self._labels.get(version, str(version))

    def relabel(self, label: str) -> None:
        self._labels[self.current] = label


def _json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(payload), status=status, content_type="application/json")


def _error(message: str, status: int = 400) -> web.Response:
    return _json_response(sglang_wire.error_json(message), status)


class _BodyTooLarge(InvalidArgumentError):
    """A request body over ServerConfig.max_request_bytes (answered with 413)."""


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Bad input and refused calls answer 400 with SGLang's {"error": {"message"}}; the server keeps serving."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except _BodyTooLarge as exc:
        response = _error(str(exc), 413)
        response.force_close()  # the rest of the body is not read: this connection cannot carry another request
        return response
    except (AprilError, ValueError) as exc:
        return _error(str(exc))
    except Exception as exc:  # an unexpected failure answers 500 and leaves the server up
        logger.exception("%s %s failed", request.method, request.path)
        return _error(f"internal error: {exc!r}", 500)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine (a loopback address or "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _unprotected(path: str) -> bool:
    # As SGLang's add_api_key_middleware: the health checks (/health, /health_generate) need no key.
    return path.startswith("/health")


def _authentication(api_key: str) -> Any:
    """The middleware that refuses a request without ``Authorization: Bearer <api_key>`` (401)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if _unprotected(request.path) or hmac.compare_digest(given, expected):
            return await handler(request)
        what = "no Authorization header" if not given else "a wrong Authorization header"
        return _error(f"Unauthorized: {request.path} needs 'Authorization: Bearer <key>' with the key the server was "
                      f"started with (--api-key); the request had {what}", 401)

    return authenticate


class EmbeddedServer:
    """Serves one engine over HTTP. `await server.start()` binds and returns the base url."""

    def __init__(self, engine: ServableEngine, config: ServerConfig | None = None) -> None:
        if not isinstance(engine, ServableEngine):
            raise ConfigError(f"EmbeddedServer serves a ServableEngine (e.g. AsyncEngine, SimulatedEngine), got a "
                              f"{type(engine).__name__}")
        self.engine = engine
        self.config = config or ServerConfig()
        self.dialect = sglang_wire.DIALECTS[self.config.sglang_compat]
        self.tokenizer = None if self.config.tokenizer_path is None else load_tokenizer(self.config.tokenizer_path)
        self._pause_mode: str | None = None
        self._active: dict[str, _Output] = {}
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._versions = _Versions(self.config.weight_version, engine.stats().weight_version)
        self._distributed = DistributedWeights(self._body, self._update_weights, self.config.weight_group_timeout_s)
        self._runner: web.AppRunner | None = None
        self.url: str | None = None
        self.port: int | None = None
        self.app = self._build_app()

    def _build_app(self) -> web.Application:
        checks = [] if self.config.api_key is None else [_authentication(self.config.api_key)]
        app = web.Application(middlewares=[*checks, _errors], client_max_size=self.config.max_request_bytes)
        routes = [
            ("POST", "/generate", self.generate), ("PUT", "/generate", self.generate),
            ("POST", "/abort_request", self.abort_request),
            ("POST", "/pause_generation", self.pause_generation),
            ("POST", "/continue_generation", self.continue_generation),
            ("POST", "/release_memory_occupation", self.release_memory),
            ("GET", "/release_memory_occupation", self.release_memory),
            ("POST", "/resume_memory_occupation", self.resume_memory),
            ("GET", "/resume_memory_occupation", self.resume_memory),
            ("POST", "/update_weights_from_disk", self.update_weights_from_disk),
            ("POST", "/update_weights_from_tensor", self.update_weights_from_tensor),
            ("GET", "/flush_cache", self.flush_cache), ("POST", "/flush_cache", self.flush_cache),
            ("GET", "/health", self.health), ("GET", "/health_generate", self.health_generate),
            ("GET", self.dialect.load_path, self.load),
        ]
        # The info endpoints of the release line the server mimics (their names moved between releases).
        routes += [("GET", path, self.server_info) for path in self.dialect.server_info]
        routes += [("GET", path, self.model_info) for path in self.dialect.model_info]
        if self.dialect.get_weight_version:
            routes.append(("GET", "/get_weight_version", self.weight_version))
        if self.dialect.weight_versions:
            routes.append(("POST", "/update_weight_version", self.update_weight_version))
        if self.dialect is sglang_wire.CURRENT:
            routes += self._distributed.routes()
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        return app

    # Lifecycle ----------------------------------------------------------------------------------------

    async def start(self) -> str:
        """Starts the engine loop and listens; returns the base url (with the real port when port was 0)."""
        if self.config.api_key is None and not is_loopback(self.config.host):
            logger.warning("the server binds %s, beyond loopback, without an API key: any peer that reaches it can "
                           "generate, update its weights, abort its requests and release its memory; start it with "
                           "--api-key (ServerConfig.api_key)", self.config.host)
        await self.engine.start()
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
        # lingering_time 0: a body left unread (one refused with 413) closes the connection instead of
        # being read and discarded.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, lingering_time=0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        self.url = f"http://{host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        """Aborts every request, stops listening and stops the engine loop."""
        self._unpaused.set()
        if self._runner is not None:
            await self.engine.abort()
            await self._runner.cleanup()
            self._runner = None
        self._distributed.close()
        await self.engine.close()

    async def __aenter__(self) -> EmbeddedServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # Generation ---------------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = sglang_wire.parse_generate(await self._body(request))
        input_ids = req.input_ids if req.text is None else self._encode(req.text)
        await self._unpaused.wait()
        rid = req.rid if req.rid is not None else uuid.uuid4().hex
        if rid in self._active:
            raise InvalidArgumentError(f"/generate: rid {rid!r} is already in flight")
        output = _Output(rid, len(input_ids), req.params, req.return_logprob,
                         req.stream_interval or self.config.stream_interval, self._decoder(req.skip_special_tokens),
                         self.dialect.weight_versions)
        # Registered before the engine sees it (no await in between), so an abort can always find it.
        self._active[rid] = output
        stream = self.engine.generate(input_ids, req.params, rid)
        try:
            first = await anext(stream)
            if req.stream:
                return await self._stream(request, stream, first, output)
            chunk = first
            while True:
                output.add(chunk)
                if chunk.finish_reason is not None:
                    return _json_response(output.render(self._versions.label(chunk.weight_version)))
                chunk = await anext(stream)
        finally:
            self._active.pop(rid, None)
            await stream.aclose()

    async def _stream(self, request: web.Request, stream: AsyncIterator[GenerationChunk], first: GenerationChunk,
                      output: _Output) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunk = first
        sent = 0
        try:
            while True:
                # Unsent tokens of another weight version go out first: one version per event.
                if output.last is not None and sent < len(output.output_ids) \
                        and chunk.weight_version != output.last.weight_version:
                    await self._event(response, output)
                    sent = len(output.output_ids)
                output.add(chunk)
                if chunk.finish_reason is not None or len(output.output_ids) - sent >= output.stream_interval:
                    await self._event(response, output)
                    sent = len(output.output_ids)
                if chunk.finish_reason is not None:
                    break
                chunk = await anext(stream)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except AprilError as exc:  # the headers are out: report in-band as SGLang does
            await response.write(b"data: " + json.dumps(sglang_wire.error_json(str(exc))).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError as exc:
            # The client left mid-stream and a write came before the handler's cancellation: nothing failed
            # here (generate's exit aborts the request), so one line, not a traceback.
            logger.info("%s %s: the client disconnected mid-stream (%s); request %s aborted", request.method,
                        request.path, exc, output.rid)
        return response

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgumentError("/generate: text needs a tokenizer: this server is token-only (start it with "
                                       "--tokenizer-path, or send input_ids)")
        return encode_prompt(self.tokenizer, text, where="/generate text")

    def _decoder(self, skip_special_tokens: bool) -> Any:
        """The output's text, as SGLang's detokenizer makes it (special tokens skipped by default)."""
        if self.tokenizer is None:
            return None
        tokenizer = self.tokenizer
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    async def _event(self, response: web.StreamResponse, output: _Output) -> None:
        assert output.last is not None
        event = output.render(self._versions.label(output.last.weight_version))
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang semantics: abort_all, or a rid that is in flight, which then aborts every request whose
        rid starts with it. Anything else is a no-op; the answer is always 200 with an empty body."""
        req = sglang_wire.parse_abort(await self._body(request))
        if req.abort_all:
            await self.engine.abort()
        elif req.rid in self._active:
            await self._abort([r for r in self._active if r.startswith(req.rid)])
        return web.Response(status=200)

    async def _abort(self, rids: list[str]) -> None:
        try:
            await self.engine.abort(rids)
        except UnknownIdError:
            # Some finished between our table and the engine; abort the others one by one.
            for rid in rids:
                try:
                    await self.engine.abort([rid])
                except UnknownIdError:
                    continue

    async def pause_generation(self, request: web.Request) -> web.Response:
        """New requests wait until /continue_generation. Mode "abort" aborts every request in flight;
        "retract" holds them and drops their KV cache (recomputed on continue, under the weights loaded by
        then); "in_place" holds them with their KV cache, which a weight update meanwhile keeps (they
        continue over it). The last two need a PausableEngine (AsyncEngine)."""
        mode = sglang_wire.parse_pause(await self._body(request), self.dialect)
        if mode != "abort" and not isinstance(self.engine, PausableEngine):
            raise InvalidArgumentError(f"/pause_generation: mode {mode!r} needs an engine that can hold its running "
                                       f"batch; {type(self.engine).__name__} cannot: use mode 'abort'")
        self._unpaused.clear()
        if mode == "abort":
            await self.engine.abort()
            if self._pause_mode in HOLD_MODES:
                await self.engine.continue_generation()  # type: ignore[attr-defined]
        else:
            await self.engine.pause_generation(mode)  # type: ignore[attr-defined]
        self._pause_mode = mode
        return _json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        sglang_wire.parse_continue(await self._body(request), self.dialect)
        if self._pause_mode in HOLD_MODES:
            await self.engine.continue_generation()  # type: ignore[attr-defined]
        self._pause_mode = None
        self._unpaused.set()
        return _json_response({"message": "Generation continued successfully.", "status": "ok"})

    # Memory and weights -------------------------------------------------------------------------------

    async def release_memory(self, request: web.Request) -> web.Response:
        tags = sglang_wire.parse_memory_tags(await self._body(request), "/release_memory_occupation")
        if not self.config.enable_memory_saver:
            return _error("/release_memory_occupation needs the server started with --enable-memory-saver")
        if self._active:
            return _error(f"/release_memory_occupation needs an idle server: {len(self._active)} requests are "
                          "running or queued (abort them or wait)")
        if tags is None or tags:
            await self.engine.release_memory(tags)
        return _json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = sglang_wire.parse_memory_tags(await self._body(request), "/resume_memory_occupation")
        if tags is None or tags:
            await self.engine.resume_memory(tags)
        return _json_response(None)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        req = sglang_wire.parse_weights_from_disk(await self._body(request), self.dialect)
        ok, message = await self._update_weights(req.model_path, req.weight_version, req.abort_all_requests,
                                                 req.model_path)
        return _json_response({"success": ok, "message": message, "num_paused_requests": 0}, 200 if ok else 400)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """Accepts base64 of a safetensors blob per TP rank; the embedded engine has one rank and loads
        the first blob (every rank's blob holds the same full tensors). Where the release labels weights, a
        call without weight_version is part of an update: its tensors load under the current version, and
        the call that carries weight_version commits the new one (the adapter sends a large update in buckets
        so, and tokens keep the old version until the last bucket is in)."""
        req = sglang_wire.parse_weights_from_tensor(await self._body(request), self.dialect)
        tensors = sglang_wire.decode_named_tensors(req.serialized[0])
        ok, message = await self._update_weights(tensors, req.weight_version, req.abort_all_requests,
                                                 "serialized_named_tensors[0]",
                                                 partial=req.weight_version is None and self.dialect.weight_versions)
        return _json_response({"success": ok, "message": message}, 200 if ok else 400)

    async def _update_weights(self, weights: Any, label: str | None, abort_all: bool,
                              source: str, *, partial: bool = False) -> tuple[bool, str]:
        """A failed update leaves the engine's weights and version as they were (it validates every
        tensor before copying any). ``partial``: the weights load under the current version."""
        if abort_all:
            await self.engine.abort()
        version = self._versions.current + (0 if partial else 1)
        new_label = label if label is not None else self._versions.label()
        try:
            await self.engine.update_weights(weights, version)
        except (AprilError, OSError, ValueError) as exc:
            return False, f"Failed to update weights from {source}: {exc}"
        self._versions.current = version
        self._versions.relabel(new_label)
        return True, f"Succeeded to update model weights. Weight version is {new_label}."

    async def update_weight_version(self, request: web.Request) -> web.Response:
        label, abort_all = sglang_wire.parse_weight_version(await self._body(request))
        if abort_all:
            await self.engine.abort()
        self._versions.relabel(label)
        return _json_response({"success": True, "message": f"Weight version updated to {label}",
                               "new_version": label})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self._active:
            return web.Response(text="Cache not flushed: requests are running or queued.\n", status=400)
        # An empty weight update is the engine's between-steps flush (same version, no tensors).
        await self.engine.update_weights({}, self._versions.current)
        return web.Response(text="Cache flushed.\n", status=200)

    # Health and info ----------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        ok = self.engine.health()["status"] in ("ok", "paused")
        return web.Response(status=200 if ok else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """A one-token greedy generation within health_timeout_s; 503 while memory is released."""
        if self.engine.health()["status"] != "ok":
            return web.Response(status=503)
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"

        async def one_token() -> None:
            async for _ in self.engine.generate([0], SamplingParams(max_new_tokens=1, temperature=0.0), rid):
                pass

        try:
            await asyncio.wait_for(one_token(), self.config.health_timeout_s)
        except (asyncio.TimeoutError, AprilError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def server_info(self, request: web.Request) -> web.Response:
        stats = dataclasses.asdict(self.engine.stats())
        info = {
            "model_path": self.config.model_path, "host": self.config.host, "port": self.port,
            "tp_size": 1, "skip_tokenizer_init": self.tokenizer is None,
            "tokenizer_path": self.config.tokenizer_path, "enable_memory_saver": self.config.enable_memory_saver,
            **self.engine.capacity(), "paused": not self._unpaused.is_set(), "pause_mode": self._pause_mode,
            "internal_states": [{**stats, "paused_tags": list(stats["paused_tags"]),
                                 "requests_in_flight": len(self._active),
                                 # their rids, so a client behind a router can tell which worker holds a request
                                 "rids_in_flight": sorted(self._active)}],
            # "version" is the SGLang release whose API is served: clients adapt to it.
            "version": self.dialect.version, "engine": "april_ext", "april_ext_version": __version__,
        }
        if self.dialect.weight_versions:
            info["weight_version"] = self._versions.label()
        return _json_response(info)

    async def load(self, request: web.Request) -> web.Response:
        """The release's load report: KV tokens in use, and those of the requests in flight beyond them (queued
        or still to prefill), which a client balancing over several servers reads."""
        stats, capacity = self.engine.stats(), self.engine.capacity()
        used = (stats.total_blocks - stats.free_blocks) * capacity["page_size"]
        held = sum(o.prompt_tokens + len(o.output_ids) for o in self._active.values())
        return _json_response(sglang_wire.load_json(
            self.dialect, used_tokens=used, waiting_tokens=max(0, held - used), running=stats.running,
            waiting=stats.waiting, capacity_tokens=capacity["max_total_num_tokens"],
            max_running=capacity["max_running_requests"]))

    async def model_info(self, request: web.Request) -> web.Response:
        info = {"model_path": self.config.model_path, "tokenizer_path": self.config.tokenizer_path,
                "is_generation": True}
        if self.dialect.weight_versions:
            info["weight_version"] = self._versions.label()
        return _json_response(info)

    async def weight_version(self, request: web.Request) -> web.Response:
        return _json_response({"weight_version": self._versions.label()})

    async def _body(self, request: web.Request) -> Any:
        """The JSON body, read only while it stays within max_request_bytes."""
        limit = self.config.max_request_bytes
        where = "(ServerConfig.max_request_bytes, `april-ext serve --max-request-bytes`)"
        if request.content_length is not None and request.content_length > limit:
            raise _BodyTooLarge(f"{request.path}: the request body of {request.content_length} bytes exceeds the "
                                f"limit of {limit} bytes {where}")
        data = bytearray()
        async for chunk in request.content.iter_any():
            data += chunk
            if len(data) > limit:  # a chunked body declares no length
                raise _BodyTooLarge(f"{request.path}: the request body has more than {limit} bytes, the limit "
                                    f"{where}")
        return sglang_wire.parse_json(bytes(data), request.path)


__getattr__ = renamed(__name__, {"EngineServer": "april_ext.server.app.EmbeddedServer"})
