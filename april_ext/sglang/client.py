"""HTTPClient: JSON calls and server-sent-event streams to SGLang servers, with errors that name the
url, status and body, and retries with exponential backoff for connection failures of idempotent calls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from april_ext.errors import InvalidStateError
from april_ext.sglang.config import SGLangEngineConfig
from april_ext.sglang.errors import SGLangBadRequestError, SGLangConnectionError, SGLangHTTPError

_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, asyncio.TimeoutError, ConnectionError)
# A response cut mid-body (the server died: its chunked stream ends early) is a payload error to aiohttp,
# but to the caller it is the same lost connection.
_STREAM_ERRORS = (*_CONNECTION_ERRORS, aiohttp.ClientPayloadError)


def http_error(url: str, status: int, body: str) -> SGLangHTTPError:
    return (SGLangBadRequestError if status == 400 else SGLangHTTPError)(url, status, body)


class HTTPClient:
    """One aiohttp session for every server. `timeout_s` bounds a whole control call and the silence
    between two events of a stream; `retries` and `backoff_s` apply to idempotent calls only. `api_key`: sent
    as a Bearer token with every call (servers and routers started with --api-key)."""

    def __init__(self, *, timeout_s: float, connect_timeout_s: float, retries: int, backoff_s: float,
                 max_connections: int, api_key: str | None = None) -> None:
        self._headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def of(cls, config: SGLangEngineConfig) -> HTTPClient:
        """A client with the timeouts, retries and connection limit ``config`` sets."""
        return cls(timeout_s=config.timeout_s, connect_timeout_s=config.connect_timeout_s, retries=config.retries,
                   backoff_s=config.backoff_s, max_connections=config.max_connections, api_key=config.api_key)

    async def start(self) -> None:
        if self._session is None:
            # limit 0 = unlimited: over-provisioned rollouts keep hundreds of streams open, and an abort
            # must never queue behind them for a pooled connection.
            connector = aiohttp.TCPConnector(limit=self.max_connections)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise InvalidStateError("the SGLang client is not started: use `async with SGLangEngine(...)` or start()")
        return self._session

    async def call(self, method: str, url: str, payload: Any = None, *, idempotent: bool,
                   timeout_s: float | None = None) -> Any:
        """Sends JSON, returns the decoded JSON answer (None for an empty body; text if it is not JSON).
        timeout_s replaces the client's bound for this call (a health probe's is shorter)."""
        total = self.timeout_s if timeout_s is None else timeout_s
        timeout = aiohttp.ClientTimeout(total=total, connect=min(self.connect_timeout_s, total))
        attempts = self.retries + 1 if idempotent else 1
        for attempt in range(attempts):
            try:
                async with self.session.request(method, url, json=payload, timeout=timeout) as resp:
                    body = await resp.text()
                    if resp.status >= 400:
                        raise http_error(url, resp.status, body)
                    return _decode(body)
            except _CONNECTION_ERRORS as exc:
                if attempt + 1 == attempts:
                    raise SGLangConnectionError(url, None, f"{type(exc).__name__}: {exc} (after {attempt + 1} "
                                                "attempts)") from exc
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    @asynccontextmanager
    async def events(self, url: str, payload: Any) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """POSTs a streaming request (never retried) and yields an iterator over its `data:` events,
        decoded, until `data: [DONE]`. A connection lost once the response started raises
        SGLangConnectionError saying that the stream broke."""
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s, sock_read=self.timeout_s)
        started = False
        try:
            async with self.session.post(url, json=payload, timeout=timeout) as resp:
                if resp.status >= 400:
                    raise http_error(url, resp.status, await resp.text())
                started = True
                yield _sse(resp, url)
        except _STREAM_ERRORS as exc:
            what = "broke its stream mid-response (the server died or dropped the connection)" if started else None
            raise SGLangConnectionError(url, None, f"{type(exc).__name__}: {exc}", what) from exc


def refused(exc: BaseException) -> bool:
    """The server could not be connected to at all (nothing listens on its port: it is gone), as opposed
    to a timeout or a connection lost mid-answer."""
    return isinstance(exc, SGLangConnectionError) and isinstance(exc.__cause__, aiohttp.ClientConnectorError)


def _decode(body: str) -> Any:
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body


async def _sse(resp: aiohttp.ClientResponse, url: str) -> AsyncIterator[dict[str, Any]]:
    # Events are split by hand: a cumulative event of a long response is far larger than the line
    # limit of aiohttp's readline-based iteration.
    buffer = b""
    async for data in resp.content.iter_any():
        buffer += data
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            raw, buffer = buffer[:end], buffer[end + 2:]
            for line in raw.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                text = line[5:].strip()
                if text == b"[DONE]":
                    return
                try:
                    yield json.loads(text)
                except ValueError as exc:
                    raise SGLangHTTPError(url, resp.status, f"a stream event is not JSON: {text[:200]!r}") from exc
