"""The embedded server's --api-key (SGLang's semantics: `Authorization: Bearer <key>` on every route but the
health checks, 401 otherwise), the adapter sending it, the launcher passing it without showing it, and the
warning of a server bound beyond loopback without a key. Real servers on loopback."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from _engine_utils import engine, greedy_reference, tiny_model
from _sglang_utils import live_server
from _torch_threads import one_torch_thread

from april_ext.cli import build_parser
from april_ext.errors import ConfigError
from april_ext.model import save_pretrained
from april_ext.protocol import SamplingParams
from april_ext.server import ServerConfig, ServerThread
from april_ext.sglang import (
    SGLangEngine,
    SGLangEngineConfig,
    SGLangHTTPError,
    SGLangLaunchError,
    SGLangServerArgs,
    launch_sglang_server,
)

KEY = "run-key-0123456789"
PROMPT = [5, 17, 33, 2, 60]
# Every route of the current dialect a peer could call, with a body each accepts.
GUARDED = [("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}),
           ("POST", "/abort_request", {"abort_all": True}), ("POST", "/pause_generation", {}),
           ("POST", "/continue_generation", {}), ("POST", "/release_memory_occupation", {}),
           ("POST", "/resume_memory_occupation", {}), ("POST", "/update_weights_from_disk", {"model_path": "/x"}),
           ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}),
           ("POST", "/init_weights_update_group", {}), ("POST", "/update_weights_from_distributed", {}),
           ("POST", "/destroy_weights_update_group", {}), ("POST", "/update_weight_version", {"new_version": "x"}),
           ("GET", "/flush_cache", None), ("GET", "/server_info", None), ("GET", "/get_server_info", None),
           ("GET", "/model_info", None), ("GET", "/v1/loads", None)]


async def _status(session: aiohttp.ClientSession, method: str, url: str, body, token: str | None) -> tuple[int, str]:
    headers = {} if token is None else {"Authorization": token}
    async with session.request(method, url, json=body, headers=headers) as resp:
        return resp.status, await resp.text()


def test_every_route_but_the_health_checks_needs_the_key() -> None:
    async def body(url: str):
        async with aiohttp.ClientSession() as session:
            refused = {}
            for method, path, payload in GUARDED:
                for token in (None, "Bearer wrong", KEY, f"Basic {KEY}"):
                    refused[(path, token)] = await _status(session, method, url + path, payload, token)
            health = [await _status(session, "GET", url + p, None, None) for p in ("/health", "/health_generate")]
            right = [await _status(session, m, url + p, b, f"Bearer {KEY}")
                     for m, p, b in GUARDED if p in ("/generate", "/server_info", "/model_info")]
            return refused, health, right

    with one_torch_thread(), live_server(api_key=KEY) as server:
        refused, health, right = asyncio.run(body(server.url))
    for (path, token), (status, text) in refused.items():
        assert status == 401, (path, token, status, text)
        assert "Unauthorized" in text and "Authorization: Bearer <key>" in text and KEY not in text
    assert "the request had no Authorization header" in refused[("/generate", None)][1]
    assert "the request had a wrong Authorization header" in refused[("/generate", "Bearer wrong")][1]
    assert [status for status, _ in health] == [200, 200]
    assert [status for status, _ in right] == [200, 200, 200]
    assert KEY not in right[1][1]  # /server_info does not show it


def test_the_adapter_sends_the_key_and_without_it_is_refused(tmp_path) -> None:
    trained = tiny_model(seed=2)
    save_pretrained(trained, tmp_path / "ckpt")
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)

    async def body(url: str):
        async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,), api_key=KEY)) as engine:
            await engine.update_weights(str(tmp_path / "ckpt"), version=3)
            tokens = [t async for c in engine.generate(PROMPT, greedy) for t in c.token_ids]
            versions = await engine.weight_versions()
        async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,), retries=0)) as keyless:
            with pytest.raises(SGLangHTTPError) as caught:
                [c async for c in keyless.generate(PROMPT, greedy)]
        return tokens, versions, caught.value

    with one_torch_thread(), live_server(tiny_model(seed=1), api_key=KEY) as server:
        tokens, versions, err = asyncio.run(body(server.url))
    assert tokens == greedy_reference(trained, PROMPT, 5) and versions == {server.url: "3"}
    assert err.status == 401 and "Unauthorized" in str(err)
    config = SGLangEngineConfig(worker_urls=(server.url,), api_key=KEY)
    assert KEY not in repr(config) and KEY not in repr(ServerConfig(api_key=KEY))


@pytest.mark.parametrize("bad", ["", "two words", "line\nbreak", 7])
def test_a_key_that_cannot_travel_in_a_header_is_refused(bad) -> None:
    for build in (lambda: ServerConfig(api_key=bad), lambda: SGLangEngineConfig(worker_urls=("http://a:1",),
                                                                               api_key=bad)):
        with pytest.raises(ConfigError, match=r"api_key must be None or a non-empty string of printable"):
            build()


def test_serve_takes_api_key_and_the_launcher_passes_it_without_showing_it(tmp_path) -> None:
    args = build_parser().parse_args(["serve", "--model-path", "/ckpt", "--api-key", KEY])
    assert args.api_key == KEY
    save_pretrained(tiny_model(), tmp_path / "ckpt")
    launch = SGLangServerArgs(model_path=str(tmp_path / "ckpt"), api_key=KEY)
    assert KEY not in repr(launch) and launch.argv(1)[-2:] == ["--api-key", KEY]

    async def statuses(url: str) -> list[int]:
        async with aiohttp.ClientSession() as session:
            return [(await _status(session, "GET", f"{url}/server_info", None, token))[0]
                    for token in (None, f"Bearer {KEY}")]

    with launch_sglang_server(launch, module="april_ext.server", timeout_s=120,
                              log_path=str(tmp_path / "server.log")) as server:  # healthy: /health needs no key
        assert asyncio.run(statuses(server.url)) == [401, 200]
    assert KEY not in (tmp_path / "server.log").read_text()
    with pytest.raises(SGLangLaunchError) as caught:
        launch_sglang_server(launch, python=str(tmp_path / "no-python"), timeout_s=5)
    assert "'--api-key', '<hidden>'" in str(caught.value) and KEY not in str(caught.value)


def test_a_server_bound_beyond_loopback_without_a_key_warns_once(caplog) -> None:
    # 192.0.2.1 (TEST-NET-1) is on no interface here: the bind fails after the warning, so no test traffic
    # leaves loopback and no port is exposed.
    with caplog.at_level(logging.WARNING, logger="april_ext.server.app"):
        for host, key in (("192.0.2.1", None), ("192.0.2.1", KEY)):
            with pytest.raises(OSError):
                ServerThread(engine(tiny_model(), memory_tag_prefix="beyond-loopback-"), ServerConfig(host=host, port=0, api_key=key)).start()
        with live_server(), live_server(api_key=KEY):  # loopback: no warning, with or without a key
            pass
    warnings = [r.getMessage() for r in caplog.records if "beyond loopback" in r.getMessage()]
    assert warnings == ["the server binds 192.0.2.1, beyond loopback, without an API key: any peer that reaches "
                        "it can generate, update its weights, abort its requests and release its memory; start it "
                        "with --api-key (ServerConfig.api_key)"]

