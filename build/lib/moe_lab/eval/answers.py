"""Math answer extraction: LLM-Adapters' numeric and AQuA-letter conventions, and boxed MATH answers.

LLM-Adapters (AGI-Edgerunners/LLM-Adapters, ``evaluate.py``) scores a generation by removing commas,
taking the LAST match of ``-?\\d+\\.?\\d*`` as a float (no number: wrong) and accepting it when
``abs(pred - float(gold)) <= 0.001``; AQuA takes the FIRST capital A-E anywhere in the stripped text.
``mode="llm_adapters"`` reproduces exactly that. The default ``mode="answer_is"`` first looks for the
phrase "the answer is" (case-insensitive, first occurrence) and takes, within the rest of that sentence,
the last number ("The answer is 40 - 29 = 11 holes." -> 11) or the first letter right after it ("The
answer is (D)." -> D); when the phrase is absent or its sentence holds none, it falls back to
LLM-Adapters' rule.

``extract_boxed`` / ``math_equal`` follow the MATH benchmark (Hendrycks et al.): the last ``\\boxed{}``
of the solution, compared after the reference ``_strip_string`` normalisation.
"""

from __future__ import annotations

import re

MODES = ("answer_is", "llm_adapters")
#: LLM-Adapters' tolerance ``miss = 0.001``.
TOLERANCE = 1e-3
_NUMBER = re.compile(r"-?\d+\.?\d*")
# The end of the sentence that holds "the answer is": a full stop before whitespace/end, or a newline.
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\n")
_ANSWER_IS_LETTER = re.compile(r"(?i:the answer is)[^\w\n]*?(?:(?i:option|choice)[^\w\n]*)?([A-E])(?![A-Za-z])")
_LETTER = re.compile(r"A|B|C|D|E")
_ANSWER_IS = re.compile(r"the answer is", re.IGNORECASE)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown extraction mode {mode!r}: choose one of {', '.join(MODES)}")


def extract_number(text: str, mode: str = "answer_is") -> float | None:
    """The predicted number of a generation (commas removed), or ``None`` when it contains none."""
    _check_mode(mode)
    text = text.replace(",", "")
    if mode == "answer_is":
        phrase = _ANSWER_IS.search(text)
        if phrase:
            end = _SENTENCE_END.search(text, phrase.end())
            numbers = _NUMBER.findall(text[phrase.end(): end.start() if end else len(text)])
            if numbers:
                return float(numbers[-1])
    numbers = _NUMBER.findall(text)
    return float(numbers[-1]) if numbers else None


def extract_letter(text: str, mode: str = "answer_is", letters: str = "ABCDE") -> str | None:
    """The predicted option letter (A-E) of a generation, or ``None`` when it contains none."""
    _check_mode(mode)
    text = text.strip()
    if mode == "answer_is":
        phrase = _ANSWER_IS.search(text)
        if phrase:
            match = _ANSWER_IS_LETTER.match(text, phrase.start())
            if match and match.group(1) in letters:
                return match.group(1)
    pattern = _LETTER if letters == "ABCDE" else re.compile("|".join(letters))
    found = pattern.findall(text)
    return found[0] if found else None


def parse_gold_number(answer) -> float:
    """A gold numeric answer as float (commas allowed); ``ValueError`` when it is not a number."""
    text = str(answer).replace(",", "").strip()
    if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
        raise ValueError(f"gold answer {answer!r} is not a number")
    return float(text)


def numbers_match(pred: float, gold: float, tolerance: float = TOLERANCE) -> bool:
    """LLM-Adapters' comparison ``abs(gold - pred) <= 0.001``."""
    return abs(gold - pred) <= tolerance


# ----------------------------------------------------------------------------------------------------
# Boxed answers (AIME, MATH-500, GPQA with a boxed letter)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else ``None``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_brace = text.find("{", start)
    if open_brace < 0:
        rest = text[start + len("\\boxed"):].strip()  # "\boxed 5"
        return rest.split("$")[0].split()[0] if rest else None
    depth = 0
    for i in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_brace + 1:i]
    return None


def extract_choice_letter(text: str, letters: str = "ABCD") -> str | None:
    """A reasoning model's option letter: inside the last ``\\boxed{}``, else right after "the answer is"."""
    boxed = extract_boxed(text)
    if boxed is not None:
        found = re.findall(f"[{letters}]", boxed.replace("\\text", ""))
        return found[0] if found else None
    phrase = _ANSWER_IS.search(text)
    match = _ANSWER_IS_LETTER.match(text, phrase.start()) if phrase else None
    return match.group(1) if match and match.group(1) in letters else None


def extract_final_answer(text: str) -> str | None:
    """A hard-reasoning final answer: the last ``\\boxed{}``, else the number after "the answer is",
    else the last number in the text."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    number = extract_number(text, "answer_is")
    if number is None:
        return None
    return str(int(number)) if number == int(number) else str(number)


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            if not part.startswith("{"):
                return s
            out += part
            continue
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def _fix_a_slash_b(s: str) -> str:
    a, sep, b = s.partition("/")
    if sep and a.isdigit() and b.isdigit() and s == f"{int(a)}/{int(b)}":
        return "\\frac{" + a + "}{" + b + "}"
    return s


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def normalize_math_answer(s: str) -> str:
    """The MATH benchmark's ``_strip_string`` normalisation of a LaTeX answer."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    if "\\text{ " in s:  # units on the right
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs) <= 2:  # "k = 5" -> "5"
        s = rhs
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def math_equal(pred: str | None, gold: str) -> bool:
    """MATH's ``is_equiv``: equal after ``normalize_math_answer``; numbers also equal within 1e-6."""
    if pred is None:
        return False
    a, b = normalize_math_answer(pred), normalize_math_answer(gold)
    if a == b:
        return True
    try:
        return abs(float(a.replace(",", "")) - float(b.replace(",", ""))) <= 1e-6
    except ValueError:
        return False
