"""
The verifiable tasks of nanoSAPO: a question generator and a verifier per task family, the system
prompt, and answer extraction from the last <answer>...</answer> span.

SAPO (arXiv 2509.08721, §4.1) trains on nine ReasoningGYM "specialties": base_conversion,
basic_arithmetic, arc_1d, bf, propositional_logic, fraction_simplification, decimal_arithmetic,
calendar_arithmetic and binary_matrix. Each question has one exactly checkable answer, so the reward
of a completion is 1.0 when its last <answer>...</answer> holds an answer equal to the ground truth,
else 0.0. Every family here is a `Task` that does four things: sample a small JSON `metadata` dict
from an rng, render the question text from it, solve it, and say when two answers are equal.

Deviations from the paper, and why:
- The generators are written from scratch in the spirit of ReasoningGYM's generators of the same
  names, not identical to them: same idea per family, different wording, sizes and variety (e.g. our
  propositional_logic evaluates a formula under given truth values; our arc_1d has five row
  transformations). So numbers are not comparable one to one with the paper's.
- The paper's reward is ReasoningGYM's scorer (which gives partial credit on some tasks); ours is
  strict 0/1 with the per-family equivalences listed in each family's docstring.
- Trust: in the paper a peer scores shared rollouts against the ground truth the *sender* attached,
  which the paper names as an open trust problem. `verify_item` closes it here: the receiver
  re-renders the question from the metadata, checks it equals the question shown to the model, and
  re-derives the answer itself, so a receiver can drop any item where they disagree.
- Very easy families (one_digit_addition, ...) are added so that a 135M-parameter model gets some
  reward at all (see DESIGN.md); the paper's nine are far too hard for it.
- Optional: names `rg:NAME` use the real `reasoning_gym` package when it is installed (it is not a
  dependency). For those, verify_item can only ask ReasoningGYM's scorer whether the sent answer
  scores 1.0 against the sent entry; it cannot rule out forged metadata.

Standard library only.
"""

import calendar
import datetime
import json
import math
import re
from decimal import Decimal, localcontext
from fractions import Fraction

SYSTEM_PROMPT = (
    "You are a careful problem solver. Think about the question step by step, then give your final "
    "answer inside <answer></answer> tags, for example <answer>42</answer>. Put only the final "
    "answer inside the tags, nothing else."
)

MAX_COMPLETION_CHARS = 10_000  # only the last 10k characters of a completion are looked at
MAX_ANSWER_CHARS = 2_000       # a longer answer span is wrong (and too costly to parse)
MAX_QUESTION_CHARS = 5_000     # a longer question or metadata from a peer is rejected
MAX_BF_STEPS = 100_000         # the bf interpreter gives up after this many instructions

# -----------------------------------------------------------------------------
# answer extraction and number parsing


def extract_answer(text):
    """The stripped text of the last <answer>...</answer> span, or None.

    Same result as the last match of re.finditer(r"<answer>(.*?)</answer>", text, re.DOTALL), found
    with str.find so it is linear time on any input:
    "a <answer>1</answer> b <answer> 2 </answer>" -> "2".
    """
    if not isinstance(text, str):
        return None
    text = text[-MAX_COMPLETION_CHARS:]
    found, pos = None, 0
    while True:
        start = text.find("<answer>", pos)
        if start < 0:
            break
        end = text.find("</answer>", start + 8)
        if end < 0:
            break
        found, pos = text[start + 8:end], end + 9
    return None if found is None else found.strip()


# ASCII digits only ("٤٢" is not a number here), exponent at most 3 digits (no "1e999999")
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]{1,60}(?:\.[0-9]{0,60})?|\.[0-9]{1,60})(?:[eE][+-]?[0-9]{1,3})?")


def parse_number(s):
    """An exactly parsed decimal number as a Fraction, or None: " +4.20e1 " -> Fraction(42)."""
    if not isinstance(s, str) or len(s) > 200:
        return None
    s = s.strip()
    if not _NUMBER_RE.fullmatch(s):
        return None
    return Fraction(s)


def _int_answer(s):
    """An integer answer in any exact decimal spelling ("42", "42.0", "4.2e1"), else None."""
    x = parse_number(s)
    return x.numerator if x is not None and x.denominator == 1 else None


def _is_int(x, lo, hi):
    """True if x is a real int (not a bool) with lo <= x <= hi."""
    return type(x) is int and lo <= x <= hi


# -----------------------------------------------------------------------------
# the Task base class


class Task:
    """One task family. A subclass sets `name` and `difficulty` and writes four small methods:
    sample(rng) -> metadata, render(metadata) -> question, solve(metadata) -> answer, and
    normalize(answer) -> a canonical value (None if the answer is malformed); two answers agree
    when both normalize to the same non-None value. metadata must be JSON with plain types."""

    name = "task"
    difficulty = 1

    def __init__(self, difficulty=None):
        if difficulty is not None:
            self.difficulty = difficulty

    # --- what a family writes
    def sample(self, rng):
        raise NotImplementedError

    def render(self, meta):
        raise NotImplementedError

    def solve(self, meta):
        raise NotImplementedError

    def normalize(self, answer):
        return answer.strip()

    def working(self, meta):
        """One or two lines of working shown before the answer in the worked example."""
        return ""

    # --- what every family gets
    def generate(self, rng):
        """A new item {task, question, answer, metadata}, drawing only from rng."""
        meta = self.sample(rng)
        return {"task": self.name, "question": self.render(meta), "answer": self.solve(meta), "metadata": meta}

    def same(self, a, b):
        """True if answers a and b (str) are equal under this family's equivalence."""
        if not isinstance(a, str) or not isinstance(b, str) or len(a) > MAX_ANSWER_CHARS or len(b) > MAX_ANSWER_CHARS:
            return False
        na = self.normalize(a)
        return na is not None and na == self.normalize(b)

    def score(self, item, completion):
        """1.0 if the completion's last <answer> equals item["answer"], else 0.0."""
        return 1.0 if self.same(extract_answer(completion), item["answer"]) else 0.0

    def verify(self, item):
        """True iff the question is the one rendered from the metadata and the answer is right."""
        meta, question = item["metadata"], item["question"]
        if not isinstance(meta, dict) or not isinstance(question, str) or len(question) > MAX_QUESTION_CHARS:
            return False
        if len(json.dumps(meta)) > MAX_QUESTION_CHARS:
            return False
        if self.render(meta) != question:
            return False
        return self.same(item["answer"], self.solve(meta))

    def solution(self, item):
        """A short worked solution: a line of working, then <answer>...</answer>."""
        work = self.working(item["metadata"])
        return (work + "\n" if work else "") + f"<answer>{item['answer']}</answer>"


# -----------------------------------------------------------------------------
# very easy families, for small models and tests


class Addition(Task):
    """a + b with `difficulty`-digit numbers; integer answer, any exact spelling ("8", "8.0").
    Example (difficulty 1): "What is 3 + 5?" -> "8"."""

    op = "+"

    def __init__(self, name, difficulty):
        self.name, self.difficulty = name, difficulty

    def sample(self, rng):
        lo = 0 if self.difficulty == 1 else 10 ** (self.difficulty - 1)
        return {"a": rng.randint(lo, 10 ** self.difficulty - 1), "b": rng.randint(lo, 10 ** self.difficulty - 1)}

    def render(self, meta):
        a, b = meta["a"], meta["b"]
        if not (_is_int(a, 0, 10**9) and _is_int(b, 0, 10**9)):
            raise ValueError("bad operands")
        return f"What is {a} {self.op} {b}?"

    def solve(self, meta):
        return str(meta["a"] + meta["b"] if self.op == "+" else meta["a"] * meta["b"])

    def normalize(self, answer):
        return _int_answer(answer)

    def working(self, meta):
        return f"{meta['a']} {self.op} {meta['b']} = {self.solve(meta)}."


class Multiplication(Addition):
    """a * b with `difficulty`-digit numbers; integer answer, any exact spelling.
    Example (difficulty 1): "What is 3 * 5?" -> "15"."""

    op = "*"


class LargerNumber(Task):
    """Which of two different `difficulty`-digit numbers is larger; answer that number (exact value).
    Near chance for a guessing model: copying either number scores half the time.
    Example (difficulty 2): "Which number is larger, 37 or 52? Answer with the larger number." -> "52"."""

    name, difficulty = "larger_number", 2

    def sample(self, rng):
        lo = 0 if self.difficulty == 1 else 10 ** (self.difficulty - 1)
        a, b = rng.sample(range(lo, 10 ** self.difficulty), 2)
        return {"a": a, "b": b}

    def render(self, meta):
        a, b = meta["a"], meta["b"]
        if not (_is_int(a, 0, 10**9) and _is_int(b, 0, 10**9)) or a == b:
            raise ValueError("bad numbers")
        return f"Which number is larger, {a} or {b}? Answer with the larger number."

    def solve(self, meta):
        return str(max(meta["a"], meta["b"]))

    def normalize(self, answer):
        return _int_answer(answer)

    def working(self, meta):
        return f"{self.solve(meta)} is larger than {min(meta['a'], meta['b'])}."


class RepeatNumber(Task):
    """Repeat a `difficulty`-digit number; exact value.
    Example (difficulty 1): "Repeat this number: 7" -> "7"."""

    name, difficulty = "repeat_number", 1

    def sample(self, rng):
        return {"n": rng.randint(0 if self.difficulty == 1 else 10 ** (self.difficulty - 1), 10 ** self.difficulty - 1)}

    def render(self, meta):
        if not _is_int(meta["n"], 0, 10**9):
            raise ValueError("bad number")
        return f"Repeat this number: {meta['n']}"

    def solve(self, meta):
        return str(meta["n"])

    def normalize(self, answer):
        return _int_answer(answer)

    def working(self, meta):
        return f"The number is {meta['n']}."


# -----------------------------------------------------------------------------
# the paper's nine families

_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _to_base(n, base):
    """n >= 0 written in base 2..16 with lowercase digits: _to_base(255, 16) -> "ff"."""
    out = ""
    while True:
        n, r = divmod(n, base)
        out = _DIGITS[r] + out
        if n == 0:
            return out


class BaseConversion(Task):
    """Convert a number from base a to base b (2..16), digits above 9 as lowercase letters.
    Harmless: upper/lower case, leading zeros. Not accepted: prefixes such as 0x, spaces inside.
    n is drawn below 2**(4*difficulty). Example: "Convert the base-16 number ff to base 2. ..."
    -> "11111111"."""

    name, difficulty = "base_conversion", 3

    def sample(self, rng):
        a, b = rng.sample(range(2, 17), 2)
        return {"number": _to_base(rng.randrange(1, 2 ** (4 * self.difficulty)), a), "from_base": a, "to_base": b}

    def render(self, meta):
        s, a, b = meta["number"], meta["from_base"], meta["to_base"]
        if not (_is_int(a, 2, 16) and _is_int(b, 2, 16) and isinstance(s, str) and 0 < len(s) <= 64):
            raise ValueError("bad base conversion")
        if any(c not in _DIGITS[:a] for c in s):
            raise ValueError("digit out of range")
        return (f"Convert the base-{a} number {s} to base {b}. Use lowercase letters a-f for digits "
                f"above 9 and write no prefix.")

    def solve(self, meta):
        return _to_base(int(meta["number"], meta["from_base"]), meta["to_base"])

    def normalize(self, answer):
        s = answer.strip().lower()
        if not s or len(s) > 200 or any(c not in _DIGITS[:16] for c in s):
            return None
        return s.lstrip("0") or "0"

    def working(self, meta):
        n = int(meta["number"], meta["from_base"])
        return f"{meta['number']} in base {meta['from_base']} is {n} in decimal, which is {self.solve(meta)} in base {meta['to_base']}."


_TOKEN_RE = re.compile(r"\s*(?:([0-9]+(?:\.[0-9]+)?)|(.))")


def evaluate(expr, allow_decimals=True):
    """Exact value (a Fraction) of an expression of numbers, + - * and parentheses; ValueError if
    malformed. evaluate("2 * (3 - 5) + 1.5") -> Fraction(-5, 2). Our own parser: never eval()."""
    if not isinstance(expr, str) or len(expr) > 500:
        raise ValueError("expression too long")
    tokens = []
    for m in _TOKEN_RE.finditer(expr.rstrip()):
        if m.group(1) is not None:
            if "." in m.group(1) and not allow_decimals:
                raise ValueError("decimal in an integer expression")
            tokens.append(Fraction(m.group(1)))
        elif m.group(2) in "+-*()":
            tokens.append(m.group(2))
        else:
            raise ValueError(f"bad character {m.group(2)!r}")
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def atom():  # number | "(" sum ")" | "-" atom
        t = take() if pos < len(tokens) else None
        if isinstance(t, Fraction):
            return t
        if t == "-":
            return -atom()
        if t == "(":
            v = total()
            if take() != ")":
                raise ValueError("missing )")
            return v
        raise ValueError("expected a number")

    def product():
        v = atom()
        while peek() == "*":
            take()
            v *= atom()
        return v

    def total():
        v = product()
        while peek() in ("+", "-"):
            v = v + product() if take() == "+" else v - product()
        return v

    try:
        value = total()
    except IndexError:
        raise ValueError("unexpected end") from None
    if pos != len(tokens):
        raise ValueError("trailing tokens")
    return value


def _random_expression(rng, n_ops, make_number):
    """A random expression with n_ops operators from + - *, parenthesised only where needed:
    e.g. "(12 - 7) * 3 + 40"."""
    if n_ops == 0:
        return make_number(), None
    k = rng.randint(0, n_ops - 1)
    (left, lop), (right, rop) = _random_expression(rng, k, make_number), _random_expression(rng, n_ops - 1 - k, make_number)
    op = rng.choice("+-*")
    if op == "*" and lop in ("+", "-"):
        left = f"({left})"
    if (op == "*" and rop is not None) or (op == "-" and rop in ("+", "-")):
        right = f"({right})"
    return f"{left} {op} {right}", op


class BasicArithmetic(Task):
    """An integer expression with + - * and parentheses, `difficulty` operators, operands 1..99.
    Harmless: any exact spelling of the integer ("-12", "-12.0", "-1.2e1"). Example:
    "What is the value of (12 - 7) * 3 + 40? Give the answer as an integer." -> "55"."""

    name, difficulty = "basic_arithmetic", 3

    def sample(self, rng):
        expr, _ = _random_expression(rng, self.difficulty, lambda: str(rng.randint(1, 99)))
        return {"expression": expr}

    def render(self, meta):
        evaluate(meta["expression"], allow_decimals=False)  # raises if malformed
        return f"What is the value of {meta['expression']}? Give the answer as an integer."

    def solve(self, meta):
        return str(evaluate(meta["expression"], allow_decimals=False))

    def normalize(self, answer):
        return _int_answer(answer)

    def working(self, meta):
        return f"Multiply before adding or subtracting, innermost parentheses first: {meta['expression']} = {self.solve(meta)}."


def _decimal_str(x):
    """A Fraction with a power-of-ten-friendly denominator as plain decimal text: 5/2 -> "2.5"."""
    if x == 0:
        return "0"
    with localcontext() as ctx:
        ctx.prec = 1000  # exact for the short decimals used here
        return format((Decimal(x.numerator) / Decimal(x.denominator)).normalize(), "f")


class DecimalArithmetic(Task):
    """Decimals with + - * and parentheses, `difficulty` operators, operands 0.01..99.99 with at most
    two decimals; exact answer. Harmless: any exact spelling of the same value ("2.50", "2.5", "25e-1").
    Example: "What is the value of 1.25 + 3.5 * 2? Give the exact decimal answer." -> "8.25"."""

    name, difficulty = "decimal_arithmetic", 2

    def sample(self, rng):
        def number():
            places = rng.randint(1, 2)
            return _decimal_str(Fraction(rng.randint(1, 99 * 10**places), 10**places))
        expr, _ = _random_expression(rng, self.difficulty, number)
        return {"expression": expr}

    def render(self, meta):
        evaluate(meta["expression"])  # raises if malformed
        return f"What is the value of {meta['expression']}? Give the exact decimal answer."

    def solve(self, meta):
        return _decimal_str(evaluate(meta["expression"]))

    def normalize(self, answer):
        return parse_number(answer)

    def working(self, meta):
        return f"Multiply before adding or subtracting, exactly: {meta['expression']} = {self.solve(meta)}."


class FractionSimplification(Task):
    """Reduce a/b to lowest terms. The answer must be "p/q" in lowest terms (spaces around the slash
    are harmless); an unreduced equal fraction or a decimal is wrong, since reducing is the task.
    Numerator and denominator of the reduced fraction have up to `difficulty` digits.
    Example: "Simplify the fraction 84/120. ..." -> "7/10"."""

    name, difficulty = "fraction_simplification", 2
    _FRACTION_RE = re.compile(r"\s*([+-]?[0-9]{1,60})\s*/\s*([0-9]{1,60})\s*")

    def sample(self, rng):
        top = 10 ** self.difficulty - 1
        while True:
            p, q = rng.randint(1, top), rng.randint(2, top)
            if math.gcd(p, q) == 1:
                k = rng.randint(2, 20)
                return {"numerator": p * k, "denominator": q * k}

    def render(self, meta):
        a, b = meta["numerator"], meta["denominator"]
        if not (_is_int(a, 0, 10**12) and _is_int(b, 1, 10**12)):
            raise ValueError("bad fraction")
        return f"Simplify the fraction {a}/{b}. Give the answer as a fraction p/q in lowest terms."

    def solve(self, meta):
        x = Fraction(meta["numerator"], meta["denominator"])
        return f"{x.numerator}/{x.denominator}"

    def normalize(self, answer):
        m = self._FRACTION_RE.fullmatch(answer)
        if not m:
            return None
        p, q = int(m.group(1)), int(m.group(2))
        return (p, q) if q > 0 and math.gcd(p, q) == 1 else None

    def working(self, meta):
        g = math.gcd(meta["numerator"], meta["denominator"])
        return f"gcd({meta['numerator']}, {meta['denominator']}) = {g}; divide both by {g}."


class CalendarArithmetic(Task):
    """Two kinds: the weekday N days after a given date, or the number of days from one date to
    another. N is up to 100 * difficulty. Harmless: case of the weekday name; any exact spelling of
    the day count. Examples: "What day of the week is 10 days after Monday, 2024-01-01? ..."
    -> "Thursday"; "How many days are there from 2024-01-01 to 2024-03-01? ..." -> "60"."""

    name, difficulty = "calendar_arithmetic", 3

    def sample(self, rng):
        start = datetime.date(2000, 1, 1) + datetime.timedelta(days=rng.randrange(365 * 40))
        days = rng.randint(1, 100 * self.difficulty)
        if rng.random() < 0.5:
            return {"kind": "weekday", "start": start.isoformat(), "days": days}
        return {"kind": "between", "start": start.isoformat(), "end": (start + datetime.timedelta(days=days)).isoformat()}

    def _dates(self, meta):
        start = datetime.date.fromisoformat(meta["start"])
        if meta["kind"] == "weekday":
            if not _is_int(meta["days"], 0, 10**5):
                raise ValueError("bad day count")
            return start, start + datetime.timedelta(days=meta["days"])
        if meta["kind"] == "between":
            return start, datetime.date.fromisoformat(meta["end"])
        raise ValueError("unknown kind")

    def render(self, meta):
        start, end = self._dates(meta)
        if meta["kind"] == "weekday":
            return (f"What day of the week is {meta['days']} days after {calendar.day_name[start.weekday()]}, "
                    f"{start.isoformat()}? Answer with the weekday name, e.g. Monday.")
        return (f"How many days are there from {start.isoformat()} to {end.isoformat()}? That is, the "
                f"later date minus the earlier one. Give the answer as an integer.")

    def solve(self, meta):
        start, end = self._dates(meta)
        return calendar.day_name[end.weekday()] if meta["kind"] == "weekday" else str(abs((end - start).days))

    def normalize(self, answer):
        s = answer.strip()
        return s.lower() if s.lower() in (d.lower() for d in calendar.day_name) else _int_answer(s)

    def working(self, meta):
        start, end = self._dates(meta)
        if meta["kind"] == "weekday":
            return f"{meta['days']} = 7 * {meta['days'] // 7} + {meta['days'] % 7}, so move {meta['days'] % 7} weekdays on from {calendar.day_name[start.weekday()]}."
        return f"Count the days left in each month from {start.isoformat()} up to {end.isoformat()}: {self.solve(meta)} in all."


def _cells_tokens(answer):
    """Whitespace- or comma-separated cells as a tuple of ints: "1 0, 2" -> (1, 0, 2); None if not ints."""
    parts = answer.replace(",", " ").split()
    if not parts or len(parts) > 200 or not all(p.isascii() and p.isdigit() and len(p) <= 3 for p in parts):
        return None
    return tuple(int(p) for p in parts)


class Arc1D(Task):
    """A 1-D ARC puzzle: three input -> output example rows, then a test row; the same rule maps every
    row. Rules: shift the colored cells right or left by k, reverse the row, fill the gap between the
    two end cells of one color, or recolor every colored cell. Rows have 8 + difficulty cells.
    Harmless: spaces/commas between cells. Example (shift right by 1): examples "0 3 3 0 0 0 0 0 0 0"
    -> "0 0 3 3 0 0 0 0 0 0" ...; test "0 0 5 5 5 0 0 0 0 0" -> "0 0 0 5 5 5 0 0 0 0"."""

    name, difficulty = "arc_1d", 2
    RULES = ("shift_right", "shift_left", "reverse", "fill_gap", "recolor")

    def _apply(self, rule, param, row):
        n = len(row)
        if rule == "shift_right":
            return [0] * param + row[:n - param]
        if rule == "shift_left":
            return row[param:] + [0] * param
        if rule == "reverse":
            return row[::-1]
        if rule == "fill_gap":
            colored = [i for i, c in enumerate(row) if c]
            if not colored:
                return list(row)
            lo, hi = colored[0], colored[-1]
            return row[:lo] + [row[lo]] * (hi - lo + 1) + row[hi + 1:]
        if rule == "recolor":
            return [param if c else 0 for c in row]
        raise ValueError("unknown rule")

    def _random_row(self, rng, rule, param, n):
        row = [0] * n
        color = rng.randint(1, 9)
        if rule == "fill_gap":
            lo = rng.randrange(0, n - 3)
            hi = rng.randrange(lo + 2, n)
            row[lo] = row[hi] = color
        elif rule == "recolor":
            for i in rng.sample(range(n), rng.randint(2, n // 2)):
                row[i] = rng.choice([c for c in range(1, 10) if c != param])
        else:
            room = n - (param if rule.startswith("shift") else 0)
            length = rng.randint(1, max(1, room // 2))
            start = rng.randrange(0, room - length + 1) + (param if rule == "shift_left" else 0)
            row[start:start + length] = [color] * length
        return row

    def sample(self, rng):
        n = 8 + self.difficulty
        rule = rng.choice(self.RULES)
        param = rng.randint(1, 3) if rule.startswith("shift") else rng.randint(1, 9) if rule == "recolor" else 0
        return {"rule": rule, "param": param, "rows": [self._random_row(rng, rule, param, n) for _ in range(4)]}

    def _check(self, meta):
        rule, param, rows = meta["rule"], meta["param"], meta["rows"]
        if rule not in self.RULES or not _is_int(param, 0, 9) or not isinstance(rows, list) or not 2 <= len(rows) <= 6:
            raise ValueError("bad arc_1d metadata")
        for row in rows:
            if not isinstance(row, list) or not 3 <= len(row) <= 40 or not all(_is_int(c, 0, 9) for c in row):
                raise ValueError("bad row")
            if rule.startswith("shift") and param >= len(row):
                raise ValueError("shift too large")

    def render(self, meta):
        self._check(meta)
        rows, show = meta["rows"], lambda r: " ".join(map(str, r))
        lines = ["Find the rule that maps each input row to its output row, then apply it to the test input.", ""]
        for i, row in enumerate(rows[:-1], 1):
            lines += [f"Example {i}:", f"Input:  {show(row)}", f"Output: {show(self._apply(meta['rule'], meta['param'], row))}", ""]
        lines += ["Test input:", show(rows[-1]), "", "Give the output row as numbers separated by spaces."]
        return "\n".join(lines)

    def solve(self, meta):
        self._check(meta)
        return " ".join(map(str, self._apply(meta["rule"], meta["param"], meta["rows"][-1])))

    def normalize(self, answer):
        return _cells_tokens(answer)

    def working(self, meta):
        rule, p = meta["rule"], meta["param"]
        return {"shift_right": f"Every colored cell moves {p} to the right.",
                "shift_left": f"Every colored cell moves {p} to the left.",
                "reverse": "The row is reversed.",
                "fill_gap": "The cells between the two colored ends are filled with their color.",
                "recolor": f"Every colored cell becomes {p}."}[rule]


def run_bf(program, max_steps=MAX_BF_STEPS, max_output=1000):
    """The output of a brainf*ck program (',' reads 0); ValueError if it is malformed, runs more than
    max_steps instructions or prints more than max_output characters. run_bf("++++++++[>++++++++<-]>+.")
    -> "A". 300 cells of bytes that wrap at 256; moving off the tape is an error."""
    if not isinstance(program, str) or len(program) > MAX_QUESTION_CHARS:
        raise ValueError("program too long")
    code = [c for c in program if c in "+-<>[].,"]
    match, stack = {}, []
    for i, c in enumerate(code):
        if c == "[":
            stack.append(i)
        elif c == "]":
            if not stack:
                raise ValueError("unmatched ]")
            j = stack.pop()
            match[i], match[j] = j, i
    if stack:
        raise ValueError("unmatched [")
    tape, ptr, pc, steps, out = [0] * 300, 0, 0, 0, []
    while pc < len(code):
        steps += 1
        if steps > max_steps:
            raise ValueError("step limit reached")
        c = code[pc]
        if c == "+":
            tape[ptr] = (tape[ptr] + 1) % 256
        elif c == "-":
            tape[ptr] = (tape[ptr] - 1) % 256
        elif c == ">":
            ptr += 1
        elif c == "<":
            ptr -= 1
        elif c == ".":
            out.append(chr(tape[ptr]))
            if len(out) > max_output:
                raise ValueError("too much output")
        elif c == ",":
            tape[ptr] = 0
        elif c == "[" and tape[ptr] == 0:
            pc = match[pc]
        elif c == "]" and tape[ptr] != 0:
            pc = match[pc]
        if not 0 <= ptr < len(tape):
            raise ValueError("pointer left the tape")
        pc += 1
    return "".join(out)


class BF(Task):
    """What a brainf*ck program prints: a random lowercase word of `difficulty` letters. The program
    builds the first letter with a multiplication loop, then steps from letter to letter with + and -.
    Answer compared exactly (case-sensitive); only surrounding whitespace is harmless.
    Example: "++++++++++[>++++++++++<-]>--.++." prints "bd"."""

    name, difficulty = "bf", 3

    def sample(self, rng):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(self.difficulty))
        a = rng.randint(6, 12)
        b, r = divmod(ord(word[0]), a)
        parts = ["+" * a + "[>" + "+" * b + "<-]>" + "+" * r + "."]
        for prev, c in zip(word, word[1:]):
            d = ord(c) - ord(prev)
            parts.append(("+" * d if d > 0 else "-" * -d) + ".")
        return {"program": "".join(parts)}

    def render(self, meta):
        if not isinstance(meta["program"], str) or len(meta["program"]) > 2000:
            raise ValueError("bad program")
        return (f"What does this Brainf*ck program print?\n\n{meta['program']}\n\n"
                f"Give exactly the text it prints.")

    def solve(self, meta):
        return run_bf(meta["program"])

    def working(self, meta):
        first = self.solve(meta)[:1] or " "
        return f"The loop and the +/- after it set the cell to {ord(first)}, which prints {first}; each later . prints the next letter."


class PropositionalLogic(Task):
    """Truth value of a fully parenthesised formula over P, Q, R, S with given truth values, using
    not, and, or, -> (implies) and <-> (iff); `difficulty` connectives. Answer "True" or "False", case
    does not matter. Guessing scores half. Example: "P = True, Q = False. What is the truth value of
    (P and (not Q))?" -> "True"."""

    name, difficulty = "propositional_logic", 3
    VARS = ("P", "Q", "R", "S")
    BINARY = {"and": lambda a, b: a and b, "or": lambda a, b: a or b,
              "->": lambda a, b: (not a) or b, "<->": lambda a, b: a == b}

    def _formula(self, rng, n, variables):
        if n == 0:
            return rng.choice(variables)
        if rng.random() < 0.25:
            return f"(not {self._formula(rng, n - 1, variables)})"
        k = rng.randint(0, n - 1)
        op = rng.choice(list(self.BINARY))
        return f"({self._formula(rng, k, variables)} {op} {self._formula(rng, n - 1 - k, variables)})"

    def sample(self, rng):
        variables = self.VARS[:rng.randint(2, 4)]
        return {"formula": self._formula(rng, self.difficulty, variables),
                "values": {v: rng.random() < 0.5 for v in variables}}

    def _evaluate(self, formula, values):
        """Truth value of a formula string; ValueError if malformed."""
        if not isinstance(formula, str) or len(formula) > 1000:
            raise ValueError("bad formula")
        tokens = formula.replace("(", " ( ").replace(")", " ) ").split()
        pos = 0

        def term():
            nonlocal pos
            t = tokens[pos]
            pos += 1
            if t in values:
                return values[t]
            if t != "(":
                raise ValueError(f"unexpected {t!r}")
            if tokens[pos] == "not":
                pos += 1
                v = not term()
            else:
                left = term()
                op = tokens[pos]
                if op not in self.BINARY:
                    raise ValueError(f"unknown connective {op!r}")
                pos += 1
                v = self.BINARY[op](left, term())
            if tokens[pos] != ")":
                raise ValueError("missing )")
            pos += 1
            return v

        try:
            v = term()
        except (IndexError, RecursionError):
            raise ValueError("malformed formula") from None
        if pos != len(tokens):
            raise ValueError("trailing tokens")
        return v

    def _values(self, meta):
        values = meta["values"]
        if not isinstance(values, dict) or not values or not all(k in self.VARS and type(v) is bool for k, v in values.items()):
            raise ValueError("bad truth values")
        return values

    def render(self, meta):
        values = self._values(meta)
        self._evaluate(meta["formula"], values)
        given = ", ".join(f"{k} = {v}" for k, v in values.items())
        return (f"{given}. What is the truth value of {meta['formula']}? (-> is implies, <-> is if and "
                f"only if.) Answer True or False.")

    def solve(self, meta):
        return str(self._evaluate(meta["formula"], self._values(meta)))

    def normalize(self, answer):
        s = answer.strip().lower()
        return s if s in ("true", "false") else None

    def working(self, meta):
        given = ", ".join(f"{k} = {v}" for k, v in meta["values"].items())
        return f"Put in {given} and evaluate the innermost parentheses first: the formula is {self.solve(meta)}."


class BinaryMatrix(Task):
    """For every cell of a small 0/1 matrix, the number of up/down/left/right steps to the nearest 0.
    Matrices are n x n with n from 3 to difficulty. Answer: one row per line, numbers separated by
    spaces; harmless: extra spaces, commas between numbers, blank lines. Example: "0 1 1 / 1 1 1 /
    1 1 0" -> "0 1 2\\n1 2 1\\n2 1 0"."""

    name, difficulty = "binary_matrix", 5

    def sample(self, rng):
        n = rng.randint(3, max(3, self.difficulty))
        matrix = [[int(rng.random() < 0.7) for _ in range(n)] for _ in range(n)]
        matrix[rng.randrange(n)][rng.randrange(n)] = 0
        return {"matrix": matrix}

    def _check(self, matrix):
        if not isinstance(matrix, list) or not 1 <= len(matrix) <= 20:
            raise ValueError("bad matrix")
        if not all(isinstance(r, list) and len(r) == len(matrix[0]) and all(_is_int(c, 0, 1) for c in r) for r in matrix):
            raise ValueError("bad matrix rows")
        if not matrix[0] or len(matrix[0]) > 20 or all(all(r) for r in matrix):
            raise ValueError("matrix needs a 0")

    def render(self, meta):
        self._check(meta["matrix"])
        grid = "\n".join(" ".join(map(str, r)) for r in meta["matrix"])
        return ("For every cell of this binary matrix, find the distance to the nearest 0, counting "
                f"steps up, down, left or right.\n\n{grid}\n\n"
                "Answer with the matrix of distances: one row per line, numbers separated by spaces.")

    def solve(self, meta):
        matrix = meta["matrix"]
        self._check(matrix)
        h, w = len(matrix), len(matrix[0])
        dist = [[0 if matrix[i][j] == 0 else None for j in range(w)] for i in range(h)]
        frontier = [(i, j) for i in range(h) for j in range(w) if matrix[i][j] == 0]
        while frontier:  # breadth-first search from all zeros at once
            nxt = []
            for i, j in frontier:
                for a, b in ((i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)):
                    if 0 <= a < h and 0 <= b < w and dist[a][b] is None:
                        dist[a][b] = dist[i][j] + 1
                        nxt.append((a, b))
            frontier = nxt
        return "\n".join(" ".join(map(str, r)) for r in dist)

    def normalize(self, answer):
        rows = [_cells_tokens(line) for line in answer.strip().splitlines() if line.strip()]
        return tuple(rows) if rows and all(r is not None for r in rows) else None

    def working(self, meta):
        return "Start from every 0 at distance 0 and spread outwards one step at a time."


# -----------------------------------------------------------------------------
# optional: the real ReasoningGYM generators as tasks named "rg:NAME"

try:
    import reasoning_gym
except ImportError:
    reasoning_gym = None


class ReasoningGymTask(Task):
    """A task backed by the `reasoning_gym` package (only if installed): "rg:leg_counting" draws from
    reasoning_gym.create_dataset("leg_counting") and scores with that dataset's score_answer (which
    may give partial credit). metadata is made JSON-safe (non-JSON values become strings)."""

    def __init__(self, rg_name):
        self.rg_name, self.name = rg_name, "rg:" + rg_name
        self._scorer = reasoning_gym.create_dataset(rg_name, size=1, seed=0)

    def generate(self, rng):
        entry = reasoning_gym.create_dataset(self.rg_name, size=1, seed=rng.randrange(2**31))[0]
        meta = json.loads(json.dumps(entry.get("metadata", {}), default=str))
        return {"task": self.name, "question": entry["question"], "answer": str(entry["answer"]), "metadata": meta}

    def _score_answer(self, answer, item):
        if not isinstance(answer, str) or len(answer) > MAX_ANSWER_CHARS:
            return 0.0
        entry = {"question": item["question"], "answer": item["answer"], "metadata": item["metadata"]}
        x = float(self._scorer.score_answer(answer=answer, entry=entry))
        return x if 0.0 <= x <= 1.0 else 0.0

    def score(self, item, completion):
        return self._score_answer(extract_answer(completion), item)

    def verify(self, item):
        return self._score_answer(item["answer"], item) == 1.0  # cannot re-derive: see module docstring


# -----------------------------------------------------------------------------
# the registry and the module-level entry points

TASKS = {t.name: t for t in [
    BaseConversion(), BasicArithmetic(), Arc1D(), BF(), PropositionalLogic(),
    FractionSimplification(), DecimalArithmetic(), CalendarArithmetic(), BinaryMatrix(),
    Addition("one_digit_addition", 1), Multiplication("one_digit_multiplication", 1),
    Addition("two_digit_addition", 2), LargerNumber(), RepeatNumber(),
]}
PAPER_TASKS = ["base_conversion", "basic_arithmetic", "arc_1d", "bf", "propositional_logic",
               "fraction_simplification", "decimal_arithmetic", "calendar_arithmetic", "binary_matrix"]
EASY_TASKS = ["one_digit_addition", "one_digit_multiplication", "two_digit_addition"]
_RG_TASKS = {}


def get_task(name):
    """The Task called `name`: a plain name from TASKS, or "rg:NAME" for a reasoning_gym dataset."""
    if isinstance(name, str) and name in TASKS:
        return TASKS[name]
    if isinstance(name, str) and name.startswith("rg:"):
        if reasoning_gym is None:
            raise ValueError(f"Task {name!r} needs the reasoning_gym package: pip install reasoning-gym.")
        if name not in _RG_TASKS:
            try:
                _RG_TASKS[name] = ReasoningGymTask(name[3:])
            except Exception:
                raise ValueError(f"reasoning_gym has no dataset called {name[3:]!r}.") from None
        return _RG_TASKS[name]
    raise ValueError(f"Unknown task {name!r}; known tasks are {', '.join(TASKS)} (or rg:NAME with reasoning_gym installed).")


def _task_of(item):
    """The Task an item names, or None (for non-dicts, unknown names and unavailable rg: tasks)."""
    if not isinstance(item, dict) or not isinstance(item.get("task"), str):
        return None
    try:
        return get_task(item["task"])
    except ValueError:
        return None


def score(item, completion):
    """Reward in [0, 1] of one completion for one item; 0.0 for anything malformed, never raises."""
    task = _task_of(item)
    if task is None:
        return 0.0
    try:
        return float(task.score(item, completion))
    except Exception:
        return 0.0


def verify_item(item):
    """True iff the item is well formed and its answer agrees with the answer re-derived here from
    the question and metadata (the sender's ground truth is not trusted); never raises."""
    task = _task_of(item)
    if task is None:
        return False
    try:
        return bool(task.verify(item))
    except Exception:
        return False


def solution(item):
    """A short worked solution ending in <answer>...</answer>, for the item's family."""
    return get_task(item["task"]).solution(item)
