"""Final-answer verification for math prompts with HuggingFace's ``math-verify`` library.

The response's answer is what math-verify extracts: the \\boxed{...} content (every boxed answer of the
response, as a set when there are several), else a stated final answer ("The final answer is 17",
"Answer: $-3$", "#### 1,250"), else the last number or expression it finds. The label is parsed the same way
(as LaTeX inside $...$, else as plain text). Both are compared symbolically with sympy (0.5 = \\frac{1}{2},
2x+2 = 2(x+1), sets regardless of order); docs/training.md has the behaviour table. Needs
``pip install 'april_ext[math]'``.
"""

from __future__ import annotations

import functools
from typing import Any

from april_ext.errors import ConfigError


@functools.cache
def _library() -> Any:
    try:
        import math_verify
    except ImportError as err:
        raise ConfigError(f"the math reward needs the math-verify library ({err}): pip install 'april_ext[math]'") \
            from None
    return math_verify


def parse_answer(text: str) -> list[Any]:
    """What math-verify extracts from a response: sympy objects and their LaTeX strings ([] for none)."""
    # No signal-based timeout: rewards run in worker threads, where SIGALRM cannot be used.
    return list(_library().parse(text, parsing_timeout=None))


def _gold(label: str | float) -> list[Any]:
    text = str(label).strip()
    lib = _library()
    return list(lib.parse(f"${text}$", parsing_timeout=None) or lib.parse(text, parsing_timeout=None))


def verify_math_answer(response: str, label: str | float) -> bool:
    """True when the response's answer equals the label (math-verify's parse + verify)."""
    gold, predicted = _gold(label), parse_answer(response)
    if not gold or not predicted:
        return False
    return bool(_library().verify(gold, predicted, timeout_seconds=None))


def math_reward(response: str, label: str | float) -> float:
    """1.0 if the response's answer matches the label, else 0.0."""
    return 1.0 if verify_math_answer(response, label) else 0.0
