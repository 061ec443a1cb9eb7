"""Numbers and answers in free text: the final answer of a completion (GSM8K's "####", a LaTeX \\boxed{}, "the
answer is", else the last number), a reference answer, and whether two numbers match. Pure Python: the rewards,
the environments and the evaluation read answers here, without the reward suite's threads or processes."""

from __future__ import annotations

import re
from fractions import Fraction

# A number, optionally signed, with an optional $ before it, thousands commas, decimals and an optional
# "/denominator". The sign must touch the number and not follow a word character or closing bracket,
# so "16-3" and "16 - 3" read as 16 and 3. Anything after the number (%, units, words, a full stop) is
# ignored.
_NUMBER = re.compile(
    r"(?<![\w.)\]])(?P<neg>[-−])?\$?(?P<neg2>[-−])?"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s*/\s*(?P<den>\d+(?:\.\d+)?)(?![\d/]))?"
)


def _to_fraction(m: re.Match) -> Fraction | None:
    try:
        value = Fraction(m.group("num").replace(",", ""))
        if m.group("den"):
            value /= Fraction(m.group("den"))
    except (ValueError, ZeroDivisionError):
        return None
    return -value if (m.group("neg") or m.group("neg2")) else value


def parse_number(text: str, last: bool = False) -> Fraction | None:
    """The first (or last) number in `text` as an exact Fraction, or None when there is none."""
    matches = list(_NUMBER.finditer(text)) if last else [m for m in [_NUMBER.search(text)] if m]
    for m in reversed(matches) if last else matches:
        value = _to_fraction(m)
        if value is not None:
            return value
    return None


def _latex_to_text(s: str) -> str:
    # Just enough LaTeX for boxed answers: \frac{3}{4}, 1{,}200, \$, \%, thin spaces, \text{...}.
    s = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"\1/\2", s)
    s = s.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\ ", " ")
    s = s.replace("\\$", "$").replace("\\%", "%")
    return re.sub(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}", r" \1", s)


def _last_boxed(text: str) -> str | None:
    # Brace matching, because \boxed{\frac{3}{4}} nests.
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return text[i:]


_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?([^\n]*)", re.IGNORECASE)


def extract_final_answer(text: str, last_number_fallback: bool = True) -> Fraction | None:
    """The completion's final answer, trying in order and taking the first that holds a number:

    1. the last "#### N" (GSM8K's own format), 2. the last \\boxed{N}, 3. the last "answer is N" /
    "answer: N", 4. if `last_number_fallback`, the last number anywhere in the text.
    """
    text = _latex_to_text(text)
    hashes = _HASHES.findall(text)
    if hashes and (v := parse_number(hashes[-1])) is not None:
        return v
    boxed = _last_boxed(text)
    if boxed is not None and (v := parse_number(boxed)) is not None:
        return v
    answer_is = _ANSWER_IS.findall(text)
    if answer_is and (v := parse_number(answer_is[-1])) is not None:
        return v
    if last_number_fallback:
        return parse_number(text, last=True)
    return None


def parse_reference(answer: str) -> Fraction | None:
    """The reference number from a GSM8K answer field (its "#### N" line), or a bare number."""
    hashes = _HASHES.findall(answer)
    return parse_number(hashes[-1] if hashes else answer)


def numbers_match(a: Fraction, b: Fraction, abs_tol: float = 1e-6) -> bool:
    """Exact equality of fractions, or |a - b| <= abs_tol (decimals that went through floats).

    The tolerance is absolute, not relative, so that 1000000 and 1000001 never match.
    """
    return a == b or abs(float(a) - float(b)) <= abs_tol


def reference_output(answer: str) -> str:
    """The expected output in an answer field, stripped: the text after its last "####" when it has one (GSM8K's
    worked solutions), else the whole field."""
    hashes = _HASHES.findall(answer)
    return (hashes[-1] if hashes else answer).strip()
