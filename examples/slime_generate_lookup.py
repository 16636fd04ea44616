"""A slime custom generate function (``--custom-generate-function-path slime_generate_lookup.generate``) for
april_ext's lookup task, written as a slime user writes one: it talks to the router's /generate itself and runs
the task's tool (a lookup in the prompt's hidden table) in between the model's turns.

Turns end at the task's stop tokens: EOT (a tool call: look up the turn's last key token) or EOS (the answer:
its last value tokens). The tool's output goes into the response with loss_mask 0 and logprob 0.0. The reward is
set here (as the task's environment gives it): 1 for the right answer after the tool returned the value, 0.5
when the tool returned it but the answer is wrong or missing, else 0.

Resumable (slime's --partial-rollout): everything the function needs to continue is in the sample's tokens and
loss mask, so a call that gets a sample with a response continues from it: after a tool call that has no output
yet it runs the tool, otherwise it generates the next tokens. A /generate that answers finish_reason "abort"
returns the sample as it is with status ABORTED.

The table comes from ``sample.metadata`` ("chain": the keys K_0..K_{h-1}, "label": the value tokens), which is
where a slime dataset's --metadata-key column puts it. The task's settings below are LookupTaskConfig's
defaults; ``args.lookup_tool_latency_s`` (a custom arg: slime's --custom-config-path) makes the tool slow.

Only aiohttp and the standard library: it runs under slime and under april_ext's CustomGenerateRollout, which
passes a Sample with slime's fields (the status enum is reached through the sample: ``sample.Status``).
"""

from __future__ import annotations

import asyncio

import aiohttp

BOS, EOS, SEP, EOT, RESULT, NOT_FOUND = 1, 2, 3, 4, 5, 6
FIRST_KEY, N_KEYS, N_VALUES = 7, 8, 8
MAX_TOOL_CALLS, MAX_TURNS, FOUND_CREDIT = 3, 4, 0.5


def _is_key(token: int) -> bool:
    return FIRST_KEY <= token < FIRST_KEY + N_KEYS


def _is_value(token: int) -> bool:
    return FIRST_KEY + N_KEYS <= token < FIRST_KEY + N_KEYS + N_VALUES


def _turns(response: list[int], mask: list[int]) -> list[tuple[bool, list[int]]]:
    """The response as runs of (model?, tokens)."""
    runs: list[tuple[bool, list[int]]] = []
    for token, m in zip(response, mask):
        if runs and runs[-1][0] == bool(m):
            runs[-1][1].append(token)
        else:
            runs.append((bool(m), [token]))
    return runs


def _reward(runs: list[tuple[bool, list[int]]], value: list[int], answer: list[int] | None) -> float:
    found = any(not model and tokens == [RESULT, *value] for model, tokens in runs)
    if answer is not None and found and answer == value:
        return 1.0
    return FOUND_CREDIT if found else 0.0


async def generate(args, sample, sampling_params):
    Status = sample.Status
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    chain = [int(k) for k in sample.metadata["chain"]]
    value = [int(v) for v in sample.metadata["label"]]
    table = {key: [chain[i + 1]] if i + 1 < len(chain) else value for i, key in enumerate(chain)}
    if not sample.tokens:
        sample.tokens = [BOS, chain[0], SEP]
    prompt_len = len(sample.tokens) - sample.response_length
    sample.loss_mask = list(sample.loss_mask or [])
    sample.rollout_log_probs = list(sample.rollout_log_probs or [])
    max_len = sampling_params["max_new_tokens"]  # the whole response's budget, tool tokens included
    latency = float(getattr(args, "lookup_tool_latency_s", 0.0))

    def append(tokens, mask, logprobs):
        sample.tokens += tokens
        sample.loss_mask += [mask] * len(tokens)
        sample.rollout_log_probs += logprobs
        sample.response_length += len(tokens)

    def finish(status, answer=None):
        runs = _turns(sample.tokens[prompt_len:], sample.loss_mask)
        sample.status = status
        sample.reward = _reward(runs, value, answer) if status is not Status.TRUNCATED else 0.0
        return sample

    async with aiohttp.ClientSession() as session:
        while True:
            runs = _turns(sample.tokens[prompt_len:], sample.loss_mask)
            last = runs[-1] if runs else None
            model_turns = [tokens for model, tokens in runs if model and tokens[-1] in (EOT, EOS)]
            if last is not None and last[0] and last[1][-1] == EOT:
                # A tool call without its output yet (also where a resumed sample may stop): run the tool.
                keys = [t for t in last[1] if _is_key(t)]
                calls = sum(1 for turn in model_turns[:-1] if any(_is_key(t) for t in turn))
                if len(model_turns) >= MAX_TURNS:
                    return finish(Status.COMPLETED)  # a call in the last turn: no turn left to answer
                if keys and calls >= MAX_TOOL_CALLS:
                    return finish(Status.COMPLETED)
                if keys and latency > 0:
                    await asyncio.sleep(latency)
                output = [RESULT, *table.get(keys[-1], [NOT_FOUND])] if keys else [RESULT, NOT_FOUND]
                output = output[:max_len - sample.response_length]
                append(output, 0, [0.0] * len(output))
            elif last is not None and last[0] and last[1][-1] == EOS:
                answer = [t for t in last[1] if _is_value(t)][-len(value):]
                return finish(Status.COMPLETED, answer)
            budget = max_len - sample.response_length
            if budget <= 0:
                return finish(Status.TRUNCATED)
            params = dict(sampling_params, max_new_tokens=budget, stop_token_ids=[EOT, EOS])
            payload = {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True}
            async with session.post(url, json=payload) as resp:
                resp.raise_for_status()
                output = await resp.json()
            meta = output["meta_info"]
            pairs = meta.get("output_token_logprobs") or []
            append([int(p[1]) for p in pairs], 1, [float(p[0]) for p in pairs])
            if "weight_version" in meta:
                sample.weight_versions.append(str(meta["weight_version"]))
            reason = meta["finish_reason"]["type"]
            if reason == "abort":
                sample.status = Status.ABORTED
                return sample
            if reason == "length":
                return finish(Status.TRUNCATED)
