"""The adapter against each SGLang release line it supports (docs/sglang.md, "Compatibility"): the embedded
server mimics each line's endpoints and request fields (--sglang-compat), strictly, so every adaptation of
the adapter (info endpoint names, weight-version sources, update fields, pause modes, top_k) is exercised
over real HTTP."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from _engine_utils import greedy_reference, tiny_model
from _sglang_utils import get, live_server, post
from _torch_threads import one_torch_thread

from april_ext.errors import InvalidArgumentError
from april_ext.model import save_pretrained
from april_ext.protocol import SamplingParams
from april_ext.protocol.sglang_wire import (
    DIALECTS,
    SGLANG_RELEASE,
    dialect_for,
    version_tuple,
)
from april_ext.sglang import SGLangEngine, SGLangEngineConfig
from april_ext.sglang.engine import UNLABELLED
from april_ext.sglang.requests import generate_payload

PROMPT = [5, 17, 33, 2, 60]


def test_versions_map_to_the_newest_documented_release_not_newer() -> None:
    assert version_tuple("0.4.10.post2") == (0, 4, 10) and version_tuple("0.5.3rc1") == (0, 5, 3)
    assert [dialect_for(v).name for v in ("0.3.6", "0.4.10.post2", "0.5.0", "0.5.3", "0.5.8", "0.5.9", "0.5.14",
                                          "0.5.15.post1", "0.5.22", SGLANG_RELEASE, "0.6.1", None, "unknown")] == \
        ["0.4", "0.4", "0.4", "0.5.3", "0.5.3", "0.5.9", "0.5.9", "0.5.15", "0.5.15", "current", "current", "current",
         "current"]


def test_top_k_zero_is_sent_as_minus_one() -> None:
    """SGLang refuses top_k 0 (its "disabled" is -1); our SamplingParams disables the filter with any k <= 0."""
    for k, wire in ((0, -1), (-1, -1), (-7, -1), (20, 20)):
        assert generate_payload("r", [1], SamplingParams(top_k=k))["sampling_params"]["top_k"] == wire


async def _tokens(engine: SGLangEngine, params: SamplingParams) -> tuple[list[int], set[int]]:
    tokens, versions = [], set()
    async for chunk in engine.generate(PROMPT, params):
        tokens += chunk.token_ids
        versions.add(chunk.weight_version)
    return tokens, versions


@pytest.mark.parametrize("compat", sorted(DIALECTS))
def test_the_adapter_speaks_each_release_line(compat, tmp_path) -> None:
    first, second = tiny_model(seed=1), tiny_model(seed=2)
    save_pretrained(second, tmp_path / "ckpt")
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, top_k=0, ignore_eos=True)

    async def body(url: str):
        async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,))) as engine:
            profile = (await engine.server_profiles())[url]
            before = await _tokens(engine, greedy)
            names = await engine.update_weights(str(tmp_path / "ckpt"), version=3)
            after = await _tokens(engine, greedy)
            labels = await engine.weight_versions()
            info = (await engine.server_info())[url]
            try:
                await engine.pause_generation("retract")
                retract = "paused"
            except InvalidArgumentError as exc:
                retract = str(exc)
            await engine.continue_generation()
            await engine.pause_generation("abort")
            await engine.continue_generation()
            after_pause = await _tokens(engine, greedy)
            async with aiohttp.ClientSession() as session:
                paused = await get(session, f"{url}{DIALECTS[compat].server_info[0]}")
            return profile, before, names, after, labels, info, retract, after_pause, paused

    with one_torch_thread(), live_server(tiny_model(seed=1), sglang_compat=compat) as server:
        profile, before, names, after, labels, info, retract, after_pause, paused = asyncio.run(body(server.url))
    dialect = DIALECTS[compat]
    assert (profile.dialect, profile.version, info["version"]) == (dialect, dialect.version, dialect.version)
    assert profile.server_info_path == dialect.server_info[0]
    assert before == (greedy_reference(first, PROMPT, 6), {0})
    assert names  # the checkpoint's tensors
    # Tokens of the new weights carry version 3: from meta_info where the release labels weights, else the
    # adapter's own version.
    assert after == (greedy_reference(second, PROMPT, 6), {3}) and after_pause[1] == {3}
    assert labels == {server.url: "3" if dialect.weight_versions else UNLABELLED}
    if dialect.pause_has_modes:
        assert retract == "paused"
    else:
        assert "not served by" in retract and f"SGLang {dialect.version}" in retract
    assert paused[1]["paused"] is False


@pytest.mark.parametrize("compat", sorted(DIALECTS))
def test_each_release_line_is_mimicked_strictly(compat) -> None:
    """The compat server refuses what its release does not define (so the test above would catch an adapter
    that sent it) and serves only its release's info endpoints."""
    dialect = DIALECTS[compat]

    async def body(url: str):
        async with aiohttp.ClientSession() as session:
            paths = {p: (await get(session, f"{url}{p}"))[0] for p in
                     ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_weight_version")}
            relabel = (await post(session, f"{url}/update_weight_version", {"new_version": "v"}))[0]
            disk = await post(session, f"{url}/update_weights_from_disk",
                              {"model_path": "/nowhere", "weight_version": "1", "flush_cache": True})
            _, answer = await post(session, f"{url}/generate", {"input_ids": PROMPT,
                                                                "sampling_params": {"max_new_tokens": 2}})
            return paths, relabel, disk, answer

    with one_torch_thread(), live_server(tiny_model(), sglang_compat=compat) as server:
        paths, relabel, disk, answer = asyncio.run(body(server.url))
    served = {p for p, status in paths.items() if status == 200}
    assert served == {*dialect.server_info, *dialect.model_info,
                      *(("/get_weight_version",) if dialect.get_weight_version else ())}
    assert set(paths.values()) <= {200, 404}
    assert relabel == (200 if dialect.weight_versions else 404)  # 0.4.x labels no weights
    if "flush_cache" in dialect.disk_fields:
        assert disk[0] == 400 and "Failed to update weights" in disk[1]["message"]  # read, then the path fails
    else:
        assert disk[0] == 400 and "unknown fields" in disk[1]["error"]["message"]
    assert ("weight_version" in answer["meta_info"]) == dialect.weight_versions
