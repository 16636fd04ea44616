"""A multi-turn Environment of one's own for `april-ext train --environment-path calculator_env:CalculatorEnv`: the
model may call a calculator tool before it answers an arithmetic question from a prompt file.

Prompts come from the data file (JSONL / Parquet with the run's prompt and label keys), e.g.
``{"prompt": "what is 3 + 4 ?", "label": "7"}``. A model turn ends at one of the environment's stop tokens:
- ``[CALL]``: a tool call. The turn's last ``a op b`` (numbers, op one of + - *) is computed after
  ``latency_s`` seconds and the tool answers ``[RESULT] n`` (``[RESULT] [ERR]`` when the turn holds no
  expression, at once, or when n is not a word of the vocabulary);
- the tokenizer's EOS: the answer. Reward 1 when its last number is the label, else 0.
A call in the last of ``max_turns`` turns ends the trajectory ("max_turns", reward 0). A record whose label is not
a number cannot be started (``start`` raises): that trajectory ends with "start_error" and the run goes on.

The environment works on text through the run's tokenizer (the factory gets it), so any tokenizer whose vocabulary
has the ``[CALL]``, ``[RESULT]`` and ``[ERR]`` tokens works. The state is a plain dict (it pickles, as checkpoints
need), changed only after the tool's sleep (a step cancelled by its timeout or a restart leaves it as it was).

``python examples/calculator_env.py DIR`` writes a demo to DIR: a word-level tokenizer and a tiny random Llama
checkpoint (DIR/model), and train and eval prompt files; docs/agentic.md has the command that trains on it.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from april_ext.data_source import Prompt
from april_ext.protocol import EnvStep

CALL, RESULT, ERR = "[CALL]", "[RESULT]", "[ERR]"
_EXPRESSION = re.compile(r"(-?\d+)\s*([+*-])\s*(-?\d+)")
_NUMBER = re.compile(r"-?\d+")


class CalculatorEnv:
    """The Environment (april_ext.protocol.Environment): ``CalculatorEnv(tokenizer, latency_s=0.05, max_turns=4)``."""

    def __init__(self, tokenizer: Any, latency_s: float = 0.05, max_turns: int = 4) -> None:
        self.tokenizer = tokenizer
        self.latency_s = latency_s
        self.max_turns = max_turns
        self.call_id = int(tokenizer.convert_tokens_to_ids(CALL))
        self.stop_token_ids = (self.call_id,)
        """Ends a turn besides the tokenizer's EOS (the run adds this to its stop tokens)."""

    async def start(self, prompt: Prompt) -> dict[str, Any]:
        label = str(prompt.metadata["label"]).strip()
        if not _NUMBER.fullmatch(label):
            raise ValueError(f"label {label!r} is not a number")
        return {"label": int(label), "turns": 0, "calls": 0}

    async def step(self, state: dict[str, Any], model_turn: Sequence[int]) -> EnvStep:
        text = self.tokenizer.decode(list(model_turn), skip_special_tokens=False)
        if int(model_turn[-1]) != self.call_id:  # the answer
            numbers = _NUMBER.findall(text)
            reward = 1.0 if numbers and int(numbers[-1]) == state["label"] else 0.0
            state["turns"] += 1
            return EnvStep.finish(reward, "answer")
        if state["turns"] + 1 >= self.max_turns:
            state["turns"] += 1
            return EnvStep.finish(0.0, "max_turns", f"a tool call in the last of {self.max_turns} turns")
        expressions = _EXPRESSION.findall(text)
        output = ERR
        if expressions:
            await asyncio.sleep(self.latency_s)  # the tool's latency: the engine generates other samples meanwhile
            a, op, b = expressions[-1]
            value = int(a) + int(b) if op == "+" else int(a) - int(b) if op == "-" else int(a) * int(b)
            if self.tokenizer.convert_tokens_to_ids(str(value)) != self.tokenizer.unk_token_id:
                output = str(value)
            state["calls"] += 1
        state["turns"] += 1  # after the last await
        return EnvStep.observe(self.tokenizer.encode(f"{RESULT} {output}", add_special_tokens=False))


def make_demo(directory: str | Path, seed: int = 0) -> None:
    """A word-level tokenizer and a tiny random Llama in ``directory``/model, with train.jsonl (sums and products of
    0-4) and eval.jsonl (the sums)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from april_ext.model import LlamaForCausalLM, ModelConfig, save_pretrained

    out = Path(directory)
    words = ["[PAD]", "[BOS]", "[EOS]", CALL, RESULT, ERR, "what", "is", "?", "+", "-", "*",
             *(str(n) for n in range(17))]
    model = LlamaForCausalLM(ModelConfig(vocab_size=len(words), hidden_size=32, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128, eos_token_id=2, bos_token_id=1))
    model.init_weights(seed)
    save_pretrained(model, out / "model")
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[PAD]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]",
                            unk_token="[PAD]").save_pretrained(out / "model")
    pairs = [(a, op, b) for a in range(5) for b in range(5) for op in "+*"]
    records = [{"prompt": f"what is {a} {op} {b} ?", "label": str(a + b if op == "+" else a * b)} for a, op, b in pairs]
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if "+" in r["prompt"]))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/calculator_env.py DIR  (writes a demo model, tokenizer and prompts to DIR)")
    make_demo(sys.argv[1])
    print(f"wrote {sys.argv[1]}/model (tokenizer and tiny model), train.jsonl, eval.jsonl")
