"""Input the embedded server refuses or survives: stop tokens beyond the vocabulary, non-finite weights
(either update path: a 400 naming the tensor, the weights kept), and a client gone mid-stream (one log line,
no traceback)."""

from __future__ import annotations

import asyncio
import logging
from unittest import mock

import aiohttp
import pytest
import torch
from aiohttp.test_utils import make_mocked_request
from _engine_utils import TINY, engine, greedy_reference, tiny_model
from _sglang_utils import live_server, post
from _torch_threads import one_torch_thread

from april_ext.model import save_pretrained
from april_ext.protocol import SamplingParams
from april_ext.server import EmbeddedServer, encode_named_tensors
from april_ext.engine import AsyncEngine
from april_ext.server.app import _Output

PROMPT = [5, 17, 33, 2, 60]


def _generate(stop: list[int]) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "stop_token_ids": stop}}


def test_stop_tokens_at_or_above_the_vocabulary_answer_400() -> None:
    async def body(url: str):
        async with aiohttp.ClientSession() as session:
            return [await post(session, f"{url}/generate", _generate(stop))
                    for stop in ([TINY.vocab_size - 1], [TINY.vocab_size], [3, TINY.vocab_size + 50])]

    with one_torch_thread(), live_server() as server:
        (ok, _), (at, at_body), (above, above_body) = asyncio.run(body(server.url))
    assert ok == 200 and at == above == 400
    assert at_body["error"]["message"] == (f"stop_token_ids contains [{TINY.vocab_size}] outside the vocabulary "
                                           f"[0, {TINY.vocab_size}): no token the model generates could match them")
    assert f"[{TINY.vocab_size + 50}] outside the vocabulary" in above_body["error"]["message"]


@pytest.mark.parametrize("path", ["/update_weights_from_tensor", "/update_weights_from_disk"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_answer_400_naming_the_tensor_and_the_weights_stay(tmp_path, path, value) -> None:
    served = tiny_model(seed=1)
    weights = dict(tiny_model(seed=2).named_parameters())
    bad = "model.layers.1.mlp.down_proj.weight"
    with torch.no_grad():
        weights[bad].fill_(value) if value != value else weights[bad][0, 0].fill_(value)
    if path == "/update_weights_from_disk":
        model = tiny_model(seed=2)
        model.load_state_dict(weights)
        save_pretrained(model, tmp_path / "ckpt")
        request = {"model_path": str(tmp_path / "ckpt"), "weight_version": "2"}
    else:
        request = {"serialized_named_tensors": [encode_named_tensors(weights)], "weight_version": "2"}

    async def body(url: str):
        async with aiohttp.ClientSession() as session:
            update = await post(session, f"{url}{path}", request)
            _, answer = await post(session, f"{url}/generate", {"input_ids": PROMPT, "sampling_params": {
                "max_new_tokens": 6, "temperature": 0}})
            return update, answer

    with one_torch_thread(), live_server(tiny_model(seed=1)) as server:
        (status, answer), generated = asyncio.run(body(server.url))
    assert status == 400 and answer["success"] is False
    assert f"weight {bad!r} holds non-finite values (NaN or infinity); weights must be finite" in answer["message"]
    # The served weights are the old ones, at the old version (formerly the update loaded and /generate gave zeros).
    assert generated["output_ids"] == greedy_reference(served, PROMPT, 6)
    assert generated["meta_info"]["weight_version"] == "default"


def test_a_client_gone_mid_stream_is_one_log_line(caplog) -> None:
    """A write that finds the connection reset (the client left before the handler's cancellation reached it)
    is logged on one line and the request ends aborted; formerly the error middleware logged a traceback."""

    async def body():
        server = EmbeddedServer(AsyncEngine(engine(tiny_model(), memory_tag_prefix="gone-mid-stream-")))
        await server.engine.start()
        writer = mock.Mock()
        writer.write = mock.AsyncMock(side_effect=ConnectionResetError("Cannot write to closing transport"))
        writer.write_headers = mock.AsyncMock()
        writer.write_eof = mock.AsyncMock()
        request = make_mocked_request("POST", "/generate", writer=writer)
        params = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)
        stream = server.engine.generate(PROMPT, params, "gone")
        output = _Output("gone", len(PROMPT), params, False, 1)
        try:
            response = await server._stream(request, stream, await anext(stream), output)
        finally:
            await stream.aclose()
        for _ in range(250):  # the abort reaches the engine loop shortly
            idle = server.engine.stats()
            if idle.running == idle.waiting == 0:
                break
            await asyncio.sleep(0.02)
        await server.engine.close()
        return response, idle

    with caplog.at_level(logging.DEBUG, logger="april_ext.server.app"):
        response, idle = asyncio.run(body())
    assert response.prepared
    records = [r for r in caplog.records if r.name == "april_ext.server.app"]
    assert [(r.levelno, r.getMessage(), r.exc_info) for r in records] == [
        (logging.INFO, "POST /generate: the client disconnected mid-stream (Cannot write to closing transport); "
                       "request gone aborted", None)]
    assert idle.running == idle.waiting == 0
