"""Request priority (SamplingParams.priority, SGLang's request priority): the embedded engine admits waiting
requests by it, the embedded server reads it from /generate, and the SGLang adapter sends it when asked."""

from __future__ import annotations

import pytest
from _engine_utils import engine, prompts, tiny_model

from april_ext.errors import InvalidArgumentError
from april_ext.protocol import SamplingParams, sglang_wire
from april_ext.sglang.requests import generate_payload


def _params(priority: int | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True, priority=priority)


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    core = engine(tiny_model(), max_num_seqs=1)
    ids = {}
    for name, priority in (("none", None), ("low", 1), ("high", 9), ("low2", 1), ("none2", None), ("neg", -4)):
        ids[core.add_request(prompts(1, seed=len(ids))[0], _params(priority))] = name
    finished = []
    while core.has_unfinished():
        finished += [ids[c.request_id] for c in core.step() if c.finish_reason is not None]
    assert finished == ["high", "low", "low2", "neg", "none", "none2"]


def test_priority_is_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="priority must be None or a signed 64-bit integer"):
        SamplingParams(priority=2**63)
    with pytest.raises(InvalidArgumentError, match="priority must be None or a signed 64-bit integer"):
        SamplingParams(priority=True)


def test_the_server_reads_priority_and_the_adapter_sends_it_when_asked() -> None:
    request = sglang_wire.parse_generate({"input_ids": [1, 2], "priority": -7, "sampling_params": {}})
    assert request.params.priority == -7
    assert sglang_wire.parse_generate({"input_ids": [1]}).params.priority is None
    params = SamplingParams(priority=12)
    assert generate_payload("r", [1], params, priority=True)["priority"] == 12
    assert "priority" not in generate_payload("r", [1], params)
    assert "priority" not in generate_payload("r", [1], SamplingParams(), priority=True)
