"""Live embedded servers on loopback and small HTTP helpers shared by the server and adapter tests."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
from _engine_utils import engine, tiny_model

from april_ext.model import LlamaForCausalLM, save_pretrained
from april_ext.server import ServerConfig, ServerThread
from april_ext.tasks import CountingTask, CountingTaskConfig

_servers = itertools.count()


@contextlib.contextmanager
def live_server(model: LlamaForCausalLM | None = None, *, memory_saver: bool = True,
                weight_version: str = "default", stream_interval: int = 1, sglang_compat: str = "current",
                tokenizer_path: str | None = None, api_key: str | None = None,
                **engine_overrides: Any) -> Iterator[ServerThread]:
    """The tiny engine (block size 4, 256 blocks, 16 sequences unless overridden) served on a free port.

    The engine owns `model` (it moves the parameters into its memory regions and updates them in place):
    keep a separate copy as the reference. Allocator tags are process-wide, so each server gets its own."""
    engine_overrides.setdefault("memory_tag_prefix", f"server{next(_servers)}-")
    core = engine(model if model is not None else tiny_model(), **engine_overrides)
    with ServerThread(core, ServerConfig(port=0, enable_memory_saver=memory_saver,
                                         weight_version=weight_version, stream_interval=stream_interval,
                                         sglang_compat=sglang_compat, tokenizer_path=tokenizer_path,
                                         api_key=api_key)) as server:
        yield server


async def post(session: aiohttp.ClientSession, url: str, body: Any = None) -> tuple[int, Any]:
    """POSTs JSON; returns (status, decoded JSON, or text when the body is not JSON)."""
    async with session.post(url, data=json.dumps(body) if body is not None else None,
                            headers={"Content-Type": "application/json"}) as resp:
        return resp.status, _decode(await resp.text())


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, _decode(await resp.text())


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


async def stream_events(session: aiohttp.ClientSession, url: str, body: Any) -> list[Any]:
    """POSTs a streaming /generate; returns every `data:` payload (JSON, or the string "[DONE]")."""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def engine_state(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    """The server's internal state: engine stats plus requests_in_flight."""
    _, info = await get(session, f"{base}/server_info")
    return dict(info["internal_states"][0])


async def in_flight(session: aiohttp.ClientSession, base: str) -> int:
    return int((await engine_state(session, base))["requests_in_flight"])


async def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    """Polls an async predicate every 10 ms until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def counting_checkpoint(path) -> str:
    """A tiny counting-task model saved as an HF checkpoint: what an external server serves."""
    task = CountingTask(CountingTaskConfig(n_symbols=2, max_count=12, median_count=3.0, sigma=0.8, seed=0))
    model = LlamaForCausalLM(task.model_config(hidden_size=16, intermediate_size=48, num_hidden_layers=1))
    model.init_weights(5)
    save_pretrained(model, path)
    return str(path)
