"""Final-answer verification for math prompts: extract the answer, normalise it, compare.

The answer is the content of the last \\boxed{...} (or \\fbox{...}); without one, the text after the last
"final answer is", "Answer:" or "####". Normalisation removes LaTeX wrappers and spacing and turns
numbers (integers, decimals, a/b, \\frac{a}{b}, percentages, thousands separators) into exact fractions,
so "0.5", "1/2", "\\frac{1}{2}" and "\\dfrac12" match; anything else is compared as normalised text.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_FINAL_PATTERNS = (
    re.compile(r"final answer is[:\s]*(.+)", re.IGNORECASE),
    re.compile(r"answer\s*:\s*(.+)", re.IGNORECASE),
    re.compile(r"####\s*(.+)"),
)
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")


def extract_answer(text: str) -> str | None:
    """The final answer of a response, or None if it states none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in _FINAL_PATTERNS:
        matches = list(pattern.finditer(text))
        if matches:
            answer = matches[-1].group(1).strip().splitlines()[0].strip()
            return answer.rstrip(".").strip() or None
    return None


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        # "\boxed 5": the argument is the next token.
        rest = text[start:].split(maxsplit=1)
        return rest[1].split()[0].rstrip(".$") if len(rest) == 2 else None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:i]
    return None


def normalize_answer(answer: str) -> str:
    """Canonical text of an answer: no $, spacing, \\left/\\right, \\text{}, degree signs or trailing dot."""
    s = answer.strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\mathrm\{([^{}]*)\}", r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""),
                     ("$", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^\\circ", ""),
                     ("^{\\circ}", ""), ("\\%", "%"), ("\\displaystyle", "")):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s)
    # \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    # A single "x=" prefix names the variable, not the answer.
    s = re.sub(r"^[a-zA-Z]=", "", s)
    return s.rstrip(".")


def _as_number(s: str) -> Fraction | None:
    s = s.replace(",", "") if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?", s) else s
    if s.endswith("%"):
        value = _as_number(s[:-1])
        return None if value is None else value / 100
    frac = re.fullmatch(r"([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if frac:
        num, den = _as_number(frac.group(2)), _as_number(frac.group(3))
        if num is None or den is None or den == 0:
            return None
        return -num / den if frac.group(1) == "-" else num / den
    slash = re.fullmatch(r"([+-]?[\d.]+)/([\d.]+)", s)
    if slash:
        num, den = _as_number(slash.group(1)), _as_number(slash.group(2))
        return None if num is None or den is None or den == 0 else num / den
    if _NUMBER.match(s):
        return Fraction(s)
    return None


def verify_math_answer(predicted: str | None, label: str | int | float) -> bool:
    """True when the predicted answer equals the label after normalisation (numerically when both are numbers)."""
    if predicted is None:
        return False
    pred, ref = normalize_answer(predicted), normalize_answer(str(label))
    pred_num, ref_num = _as_number(pred), _as_number(ref)
    if pred_num is not None and ref_num is not None:
        return pred_num == ref_num
    return pred == ref


def math_reward(response: str, label: str | int | float) -> float:
    """1.0 if the response's final answer matches the label, else 0.0."""
    return 1.0 if verify_math_answer(extract_answer(response), label) else 0.0
