"""
The verifiable tasks of nanoSAPO: a question generator and a scorer per task family, the system
prompts and the chat prompt (prompt_ids), answer extraction from the last <answer>...</answer> span,
and `verify_item`, which lets a peer trust a question that another peer shared.

SAPO (arXiv 2509.08721, §4.1) trains on nine ReasoningGym families (PAPER_TASKS) with the configs of
the paper's code (PAPER_CONFIGS), rewarded by ReasoningGym's `score_answer`. Here all nine are written
with the standard library only: each scorer gives what reasoning_gym 0.1.25's gives (same formats, same
partial credit); each generator follows the config in our own code and wording, so items are alike,
not identical (`python tests/test_parity.py`; docs/rewards.md lists each difference, and why).

Deviations, and why:
- The paper's code never rewards propositional_logic (its items have no answer, worth 0: rl-swarm
  rgym_exp/src/rewards.py). We use rg's scorer: 1.0 for a non-trivial conclusion that follows.
- Trust: the paper's peers score shared rollouts against the sender's ground truth, an open problem
  it names. Here `verify_item` makes the item again (from its seed, or an easy item's drawn values)
  and accepts only an exact copy, of a task the receiver chose: no wrong answer, no foreign question.
- Easy families (one_digit_addition, ...) give a 135M model some reward; reproduce.py asks alphabet_position.
"""

import ast
import calendar
import contextlib
import datetime
import functools
import io
import itertools
import json
import math
import operator
import random
import re
import string
import threading
from decimal import Context, Decimal, localcontext
from fractions import Fraction

# ReasoningGym's default system prompt (reasoning_gym 0.1.25), which the paper's code chooses (rl-swarm).
RG_SYSTEM_PROMPT = (
    "Given a problem, your task is to answer the question by thinking step-by-step "
    "in a clear and specific manner.\n"
    "Once you have thought about the reasoning process, provide the answer in the following format:\n"
    "<answer>answer here</answer>\n"
    "Do not explain your reasoning inside the answer tags, provide only the final answer. When an example is "
    "provided, you should strictly follow the format of the output/answer in that example.\n"
)
SYSTEM_PROMPT = (
    "You are a careful problem solver. Think about the question step by step, then give your final "
    "answer inside <answer></answer> tags, for example <answer>42</answer>. Put only the final "
    "answer inside the tags, nothing else."
)
SYSTEM_PROMPTS = {"default": SYSTEM_PROMPT, "rg": RG_SYSTEM_PROMPT}

PAPER_TASKS = ["base_conversion", "basic_arithmetic", "arc_1d", "bf", "propositional_logic",
               "fraction_simplification", "decimal_arithmetic", "calendar_arithmetic", "binary_matrix"]
EASY_TASKS = ["one_digit_addition", "one_digit_multiplication", "two_digit_addition"]
TASKS = {}  # name -> Task, filled as each family below is defined

# -----------------------------------------------------------------------------
# the contract: extract_answer, Task, score, verify_item, solution, prompt_ids, get_task


def extract_answer(text):
    """The stripped text of the last <answer>...</answer> span, or None: the last match of
    re.finditer(r"<answer>(.*?)</answer>", text, re.DOTALL), as ReasoningGym reads it, found with
    str.find in linear time on any input: "a <answer>1</answer> b <answer> 2 </answer>" -> "2"."""
    if not isinstance(text, str):
        return None
    found, pos = None, 0
    while True:
        start = text.find("<answer>", pos)
        end = text.find("</answer>", start + 8) if start >= 0 else -1
        if end < 0:
            return None if found is None else found.strip()
        found, pos = text[start + 8:end], end + 9


class Task:
    """One task family. make(rng, **config) returns (question, answer, metadata), drawing only from rng;
    config is the family's entry of PAPER_CONFIGS (an easy family has none). score_answer(answer, item)
    is the reward in [0, 1] of an extracted answer (None if there is none; raising scores 0). WORKING is
    the worked example's line of working, filled in with the item's answer and metadata. An item is
    trusted by making it again: a seeded family (the paper's nine) makes it from random.Random(seed) and
    records metadata["seed"]; an unseeded one (the easy families) records every value it drew from the
    caller's rng as metadata, which verify() replays to make() (_Replay)."""

    name = ""  # the family's name, its key in TASKS
    seeded = True
    max_answer_chars = None  # a longer answer scores 0 (for scorers whose parsing is not linear time)
    WORKING = ""

    def score_answer(self, answer, item):
        """ReasoningGym's default rule: 1.0 for exactly the item's answer, len(item's answer) /
        len(answer) for an answer that contains it ("The answer is 42" -> 2/16), else 0.0."""
        if not answer or item["answer"] not in answer:
            return 0.0
        return len(item["answer"]) / len(answer)  # 1.0 for the answer itself

    def working(self, item):
        return self.WORKING.format_map({**item["metadata"], "answer": item["answer"]})

    def generate(self, rng):
        """A new item: made from a seed drawn from rng, or, unseeded, from rng itself."""
        if self.seeded:
            return self.from_seed(rng.randrange(2**32))
        question, answer, meta = self.make(rng)
        return {"task": self.name, "question": question, "answer": answer, "metadata": meta}

    def from_seed(self, seed):
        """The item a seeded family makes from random.Random(seed): {task, question, answer, metadata}."""
        question, answer, meta = self.make(random.Random(seed), **PAPER_CONFIGS[self.name])
        return {"task": self.name, "question": question, "answer": answer, "metadata": {**meta, "seed": seed}}

    def verify(self, item):
        """True iff making the item again gives exactly it (question, answer and metadata)."""
        meta = item["metadata"]
        if not self.seeded:  # replays the recorded values; one make() could not have drawn raises
            question, answer, values = self.make(_Replay([meta[k] for k in sorted(meta)]))
            fresh = {"question": question, "answer": answer, "metadata": values}
        elif type(meta.get("seed")) is int and 0 <= meta["seed"] < 2**32:
            fresh = self.from_seed(meta["seed"])
        else:
            return False
        # compared as JSON text, which tells 1, 1.0 and True apart
        return all(json.dumps(item[k], sort_keys=True) == json.dumps(fresh[k], sort_keys=True)
                   for k in ("question", "answer", "metadata"))


class _Replay:
    """What an unseeded family's make() draws from when an item is made again: each draw returns the
    item's next recorded value if make() could have drawn it there (same type, in the range or among
    the choices), else raises ValueError ("What is 1000000000 + 999999999?" as one_digit_addition)."""

    def __init__(self, values):
        self.values = iter(values)

    def _next(self, possible):
        value = next(self.values, None)
        if not possible(value):
            raise ValueError("a value the generator never draws")
        return value

    def randint(self, a, b):
        return self._next(lambda v: type(v) is int and a <= v <= b)

    def choice(self, seq):
        return self._next(lambda v: any(type(v) is type(x) and v == x for x in seq))


def score(item, completion):
    """Reward in [0, 1] of one completion for one item: its family's score_answer on the completion's
    last <answer> span; 0.0 for anything malformed, never raises."""
    task, answer = _task_of(item), extract_answer(completion)
    if task is None or (answer is not None and task.max_answer_chars and len(answer) > task.max_answer_chars):
        return 0.0
    try:
        x = float(task.score_answer(answer, item))
    except Exception:  # whatever a hostile item or completion makes a scorer raise
        return 0.0
    return x if 0.0 <= x <= 1.0 else 0.0


def verify_item(item, tasks=None):
    """True iff the item is of one of `tasks` (the receiver's choice; by default every family here and
    the nine rg:paper ones), well formed, and exactly what its family makes again from the item's seed
    (easy families: its recorded values), within VERIFY_SECONDS for an rg: task. Never raises."""
    allowed = list(TASKS) + ["rg:" + n for n in PAPER_TASKS] if tasks is None else tasks
    allowed = [allowed] if isinstance(allowed, str) else list(allowed)  # one name, or a list of them
    if not (isinstance(item, dict) and isinstance(item.get("task"), str) and item["task"] in allowed):
        return False
    task = _task_of(item)
    try:
        return bool(task and task.verify(item))
    except Exception:
        return False


def _task_of(item):
    """The Task of a well-formed item (a known task, a str question and answer, dict metadata), else None."""
    if not (isinstance(item, dict) and isinstance(item.get("metadata"), dict)
            and all(isinstance(item.get(k), str) for k in ("task", "question", "answer"))):
        return None
    try:
        return get_task(item["task"])
    except ValueError:
        return None


def solution(item):
    """A short worked solution: the family's line of working, then <answer>...</answer>."""
    work = get_task(item["task"]).working(item)
    return (work + "\n" if work else "") + f"<answer>{item['answer']}</answer>"


def prompt_ids(tokenizer, item, one_shot, system="default"):
    """Token ids of the chat prompt a peer samples and trains with: the system prompt, [a worked example:
    a fixed item of the family and its solution], the question, the assistant's turn (the chat template)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPTS[system]}]
    if one_shot:
        with contextlib.suppress(Exception):  # no example where the family cannot be made here
            example = get_task(item["task"]).generate(random.Random(f"one-shot example of {item['task']}"))
            messages += [{"role": "user", "content": example["question"]},
                         {"role": "assistant", "content": solution(example)}]
    messages.append({"role": "user", "content": item["question"]})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def get_task(name):
    """The Task called `name`: one of TASKS, or "rg:NAME" for a reasoning_gym dataset (rg_task, the
    optional bridge at the end of this file)."""
    if isinstance(name, str) and name in TASKS:
        return TASKS[name]
    if isinstance(name, str) and name.startswith("rg:"):
        return rg_task(name[3:])
    raise ValueError(f"Unknown task {name!r}; known tasks are {', '.join(TASKS)}, the groups paper, easy "
                     f"and rg:paper, and rg:NAME for any reasoning_gym dataset.")


# -----------------------------------------------------------------------------
# the paper's configs, and one easy family


# The generator configs of the paper's code (rl-swarm rgym_exp/src/datasets.yaml, without seed and size).
PAPER_CONFIGS = {
    "base_conversion": {"min_base": 2, "max_base": 16, "min_value": 0, "max_value": 1000},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 6, "min_digits": 1, "max_digits": 4,
                         "operators": ["+", "-", "*", "/"], "allow_parentheses": True, "allow_negation": True,
                         "format_style": "natural", "whitespace": "single"},
    "arc_1d": {"min_size": 10, "max_size": 30, "num_train": 3},
    "bf": {"difficulty": 1},
    "propositional_logic": {"min_vars": 2, "max_vars": 4, "min_statements": 2, "max_statements": 4,
                            "min_complexity": 1, "max_complexity": 3},
    "fraction_simplification": {"min_value": 1, "max_value": 100, "min_factor": 2, "max_factor": 100,
                                "styles": ["plain", "latex_frac", "latex_dfrac"]},
    "decimal_arithmetic": {"min_terms": 2, "max_terms": 6, "min_num_decimal_places": 1,
                           "max_num_decimal_places": 3, "precision": 5},
    "calendar_arithmetic": {"year": 2023, "offset_upper_bound": 100, "leap_year_range": 200,
                            "tasks": ["count_days", "weekday_of_date", "is_leap_year",
                                      "recurring_event_day"]},
    "binary_matrix": {"min_n": 3, "max_n": 10, "p_zero": 0.25},
}


_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]{1,60}(?:\.[0-9]{0,60})?|\.[0-9]{1,60})(?:[eE][+-]?[0-9]{1,3})?")


def _int_answer(s):
    """An integer answer in any exact decimal spelling ("42", "42.0", "4.2e1"), else None. ASCII digits
    only ("٤٢" is not a number here), exponent at most 3 digits (no "1e999999")."""
    if not isinstance(s, str) or len(s) > 200 or not _NUMBER_RE.fullmatch(s.strip()):
        return None
    x = Fraction(s.strip())
    return x.numerator if x.denominator == 1 else None


class EasyTask(Task):
    """A very easy family, for small models: unseeded (its metadata is the values it drew), with a
    strict 0/1 reward for any exact spelling of the integer answer ("8", "8.0", "+8")."""

    seeded = False

    def score_answer(self, answer, item):
        x = _int_answer(answer)
        return 1.0 if x is not None and x == _int_answer(item["answer"]) else 0.0


class Arithmetic(EasyTask):
    """a + b or a * b with `digits`-digit numbers: "What is 3 + 5?" -> "8"."""

    def __init__(self, name, op, digits):
        self.name, self.op, self.digits = name, op, digits
        self.WORKING = "{a} " + op + " {b} = {answer}."

    def make(self, rng):
        low, high = (0 if self.digits == 1 else 10 ** (self.digits - 1)), 10 ** self.digits - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        return f"What is {a} {self.op} {b}?", str(a + b if self.op == "+" else a * b), {"a": a, "b": b}


TASKS.update({name: Arithmetic(name, op, digits) for name, op, digits in [
    ("one_digit_addition", "+", 1), ("one_digit_multiplication", "*", 1), ("two_digit_addition", "+", 2)]})

# ----- Nothing below this line is needed to understand SAPO: plumbing follows. -----
# The --tasks value, the paper's nine families, the other easy families, and the optional bridge
# to the reasoning_gym package.


def task_names(spec):
    """The task names that a --tasks value selects: a comma list of task names and the groups "paper"
    (the nine), "easy" and "rg:paper" (the nine from reasoning_gym, with the paper's configs).
    task_names("rg:paper,easy") -> ["rg:base_conversion", ..., "two_digit_addition"]."""
    groups = {"paper": PAPER_TASKS, "easy": EASY_TASKS, "rg:paper": ["rg:" + n for n in PAPER_TASKS]}
    names = []
    for part in str(spec).split(","):
        for name in groups.get(part.strip(), [part.strip()] if part.strip() else []):
            get_task(name)  # raises ValueError naming the known tasks
            names.append(name)
    if not names:
        raise ValueError("No tasks given: name tasks, or paper, easy or rg:paper.")
    return names


# -----------------------------------------------------------------------------
# the paper's nine families

MAX_ANSWER_CHARS = 2_000  # a longer answer scores 0 where parsing is not linear time


def _to_base(n, base):
    """n >= 0 written in base 2..36 with lowercase digits: _to_base(255, 16) -> "ff"."""
    digits = ""
    while True:
        n, r = divmod(n, base)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[r] + digits
        if n == 0:
            return digits


class BaseConversion(Task):
    """Convert a number 0..1000 between two different bases 2..16, digits above 9 as lowercase
    letters: "... convert the base-7 number 1234 to hexadecimal" -> "1d2". ReasoningGym's default
    rule, so "1D2" and "0x1d2" are not the answer (the latter earns 3/5 partial credit)."""

    name = "base_conversion"
    WORKING = ("In decimal the number is {decimal_value}; dividing by {target_base} again and again "
               "and reading the remainders backwards gives {answer}.")

    def make(self, rng, min_base, max_base, min_value, max_value):
        value = rng.randint(min_value, max_value)
        source, target = rng.sample(range(min_base, max_base + 1), 2)
        names = [{2: "binary", 16: "hexadecimal"}.get(base, f"base-{base}") for base in (source, target)]
        question = ("Convert a number from one base to another. If the target base is above 10, write "
                    "the digits above 9 as lowercase letters a-z.\n\n"
                    f"Now, convert the {names[0]} number {_to_base(value, source)} to {names[1]}.")
        meta = {"decimal_value": value, "source_base": source, "target_base": target}
        return question, _to_base(value, target), meta


def _evaluate(node, number=Decimal, divide=operator.truediv):
    """Value of a parsed expression (ast) of number literals, unary minus and + - * /, each literal
    read by `number`, each step rounded by the current Decimal context for Decimals. Only ever called
    on our own expressions: _evaluate(ast.parse("-( 7 - 3 ) * 2", mode="eval").body, int) -> -8."""
    if isinstance(node, ast.BinOp):
        ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: divide}
        return ops[type(node.op)](_evaluate(node.left, number, divide), _evaluate(node.right, number, divide))
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand, number, divide)
    return number(repr(node.value))


def _int_value(text):
    """The value of one of our integer expressions, computed as rg does (/ as //), or ArithmeticError
    where that is not its true value (a division rounds): _int_value("-( 12 * -5 ) / 4") -> 15."""
    node = ast.parse(text, mode="eval").body
    value = _evaluate(node, int, operator.floordiv)
    if value != _evaluate(node, Fraction):
        raise ArithmeticError("a division that rounds")
    return value


def _divisors(n):
    """The positive divisors of n != 0 (ArithmeticError past 10**12, too slow to find)."""
    n = abs(n)
    if n > 10**12:
        raise ArithmeticError("too large to factor")
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


class BasicArithmetic(Task):
    """Evaluate an integer expression of 2..6 numbers with 1..4 digits (either sign), + - * /, parentheses
    and negated groups: "Compute -( 12 * -5 ) / 4 + 7." -> "22". Drawn as ReasoningGym draws them (a divisor
    divides its dividend, which can have 5 to 8 digits), again where a division would round. ReasoningGym's
    default rule: the answer is the exact integer text ("22.0" earns 2/4)."""

    name = "basic_arithmetic"
    TEMPLATES = ("What is {}?", "Calculate {}.", "Compute {}.", "Evaluate: {}.")
    WORKING = ("Multiply and divide before adding and subtracting, innermost parentheses first: "
               "{expression} = {answer}.")

    def _terms(self, rng, n, digits):
        """The tokens of an expression of n numbers: a first part of k numbers (a group in parentheses,
        negated half of the time, or numbers joined by + - *), then an operator and the rest. After a /,
        the next number divides the first part's value (its last number's, unless it is a group); where
        the rest ends in a group, a correction inside that group makes the whole rest such a divisor."""
        number = lambda: str(rng.randint(1 - 10**digits, 10**digits - 1))
        k = rng.randint(1, n)
        if k > 1 and rng.random() < 0.5:
            left = [rng.choice(["(", "-("])] + self._terms(rng, k, digits) + [")"]
        else:
            left = [number()]
            for _ in range(k - 1):
                left += [rng.choice("+-*"), number()]
        if k == n:
            return left
        op = rng.choice("+-*/")
        if op != "/":
            return left + [op] + self._terms(rng, n - k, digits)
        dividend = _int_value(" ".join(left if left[-1] == ")" else left[-1:]))
        rest = self._terms(rng, n - k - 1, digits) if n - k > 1 else []
        if rest and rest[-1] == ")":
            value = _int_value(" ".join(rest))
            target = rng.choice(_divisors(math.gcd(dividend, value))) if value else 1
            return left + ["/"] + rest[:-1] + ["+", str(target - value), ")"]
        divisor = rng.choice(_divisors(dividend)) if dividend else rng.randint(1, 10**digits - 1)
        return left + ["/", str(divisor)] + (["+"] + rest if rest else [])

    def make(self, rng, min_terms, max_terms, min_digits, max_digits, **fixed):  # fixed: the operators
        while True:
            terms, digits = rng.randint(min_terms, max_terms), rng.randint(min_digits, max_digits)
            # a division that rounds, or a dividend too large to factor, draws again
            with contextlib.suppress(ArithmeticError):
                expression = " ".join(self._terms(rng, terms, digits))
                value = _int_value(expression)
                break
        return rng.choice(self.TEMPLATES).format(expression), str(value), {"expression": expression}


class DecimalArithmetic(Task):
    """Evaluate an expression of 2..6 decimals in (0, 10] with 1..3 decimal places, + - * / and random
    parentheses, computed to 5 significant digits: "(9.701/1.53)*7.101-(1.618/4.55) = ?" -> "44.668".
    ReasoningGym's rule: any number within 0.001 of the answer scores 1.0, anything else 0.0."""

    name = "decimal_arithmetic"
    WORKING = ("Multiply and divide before adding and subtracting, keeping 5 significant digits: "
               "{expression} = {answer}.")

    def _group(self, rng, numbers, ops):
        """numbers joined by ops, split at a random point and parenthesised half of the time."""
        if len(numbers) == 1:
            return numbers[0]
        k = rng.randint(1, len(numbers) - 1)
        left, right = self._group(rng, numbers[:k], ops[:k - 1]), self._group(rng, numbers[k:], ops[k:])
        text = left + ops[k - 1] + right
        return f"({text})" if rng.random() < 0.5 else text

    def make(self, rng, min_terms, max_terms, min_num_decimal_places, max_num_decimal_places, precision):
        while True:
            numbers = []
            for _ in range(rng.randint(min_terms, max_terms)):
                places = rng.randint(min_num_decimal_places, max_num_decimal_places)
                numbers.append(f"{rng.randint(1, 10 * 10**places) / 10**places:.{places}f}")
            expression = self._group(rng, numbers, [rng.choice("+-*/") for _ in numbers[1:]])
            with contextlib.suppress(ArithmeticError), localcontext(Context(prec=precision)):
                answer = str(_evaluate(ast.parse(expression, mode="eval").body))  # x / 0 raises: draw again
                break
        question = f"Compute this to {precision} significant digits and reply with the final value only."
        return question + f"\n{expression} = ?", answer, {"expression": expression}

    def score_answer(self, answer, item):
        # rg subtracts in the Decimal context its generator left set: precision 5 in the paper's config
        with localcontext(Context(prec=5)):
            return 1.0 if abs(Decimal(answer) - Decimal(item["answer"])) <= Decimal("0.001") else 0.0


class FractionSimplification(Task):
    """Reduce a fraction, plain or LaTeX, answered in the same style: "Simplify the fraction $\\frac{5952}{6624}$
    ..." -> "$\\frac{62}{69}$". ReasoningGym's rule: 1.0 for the reduced fraction in any style ("62/69" too), 0.1
    for one keeping the question's numerator or denominator, 0.05 another fraction, 0.01 no fraction at all."""

    name = "fraction_simplification"
    STYLES = {"plain": "{}/{}", "latex_frac": "$\\frac{{{}}}{{{}}}$", "latex_dfrac": "$\\dfrac{{{}}}{{{}}}$"}
    LATEX = re.compile(r"\\(?:frac|dfrac)\s*{\s*(\d+)\s*}\s*{\s*(\d+)\s*}", re.IGNORECASE)

    def make(self, rng, min_value, max_value, min_factor, max_factor, styles):
        p, q = rng.randint(min_value, max_value), rng.randint(min_value, max_value)
        g = math.gcd(p, q)
        p, q = sorted((p // g, q // g))
        k = rng.randint(min_factor, max_factor)
        style = rng.choice(styles)
        form = self.STYLES[style]
        question = (f"Simplify the fraction {form.format(p * k, q * k)} to lowest terms. Give only the "
                    f"simplified fraction, written the same way, as your answer.")
        meta = {"numerator": p * k, "denominator": q * k, "simplified_numerator": p,
                "simplified_denominator": q, "style": style}
        return question, form.format(p, q), meta

    def score_answer(self, answer, item):
        meta = item["metadata"]
        try:
            s = answer.strip().strip("$").strip()
            m = self.LATEX.match(s)  # at the start only, as rg reads it
            p, q = (m[1], m[2]) if m else s.split("/", 1)  # ValueError without a "/"
            p, q = int(p), int(q)  # int() also skips spaces and reads other scripts' digits, as rg's does
            if p == meta["simplified_numerator"] and q == meta["simplified_denominator"]:
                return 1.0
            return 0.1 if p == meta["numerator"] or q == meta["denominator"] else 0.05
        except Exception:
            return 0.01  # rg: no readable fraction, or no answer at all

    def working(self, item):
        n, d = item["metadata"]["numerator"], item["metadata"]["denominator"]
        return f"gcd({n}, {d}) = {math.gcd(n, d)}; divide both by it."


_DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()  # English in any locale
_MONTHS = [""] + ("January February March April May June July August September October November "
                  "December").split()


def _long_date(d, weekday=False):
    """datetime.date(2023, 7, 10) -> "July 10, 2023" (with weekday: "Monday, July 10, 2023")."""
    text = f"{_MONTHS[d.month]} {d.day}, {d.year}"
    return f"{_DAYS[d.weekday()]}, {text}" if weekday else text


class CalendarArithmetic(Task):
    """Four kinds of calendar question about 2023: the weekday of a date ("Monday"), how many times a weekday
    occurs between two dates at most 100 days apart ("8"), whether a year 1923..2123 is a leap year ("Yes"/"No"),
    the day of the month of the first..fourth or last weekday of a month ("19"). ReasoningGym's rules: an exact
    weekday 1.0, another 0.1, one in other case 0.05; a count or day exp(-5 x relative error); Yes/No any case."""

    name = "calendar_arithmetic"
    ORDINALS = ("first", "second", "third", "fourth", "last")
    WORKING_OF_KIND = {
        "weekday_of_date": "January 1, 2023 was a Sunday; count the days from it and take the remainder "
                           "after dividing by 7.",
        "count_days": "List the {weekday}s from {start_date} to {end_date}, and count them.",
        "is_leap_year": "A leap year is divisible by 4, except century years, "
                        "which must be divisible by 400.",
        "recurring_event_day": "Find the first {weekday} of the month, then add 7 days per week."}

    def make(self, rng, year, offset_upper_bound, leap_year_range, tasks):
        task = rng.choice(tasks)
        if task == "weekday_of_date":
            month = rng.randint(1, 12)
            day = datetime.date(year, month, rng.randint(1, calendar.monthrange(year, month)[1]))
            return (f"What day of the week was {_long_date(day)}? Answer with the weekday's full name.",
                    _DAYS[day.weekday()], {"task": task, "target_date": day.isoformat()})
        if task == "count_days":
            day_of_year = rng.randint(0, 364 + calendar.isleap(year))
            start = datetime.date(year, 1, 1) + datetime.timedelta(day_of_year)
            span = min(offset_upper_bound, (datetime.date(year, 12, 31) - start).days)
            end = start + datetime.timedelta(rng.randint(0, span))
            weekday = rng.randrange(7)
            dates = [start + datetime.timedelta(i) for i in range((end - start).days + 1)]
            count = sum(d.weekday() == weekday for d in dates)
            question = (f"How many {_DAYS[weekday]}s are there from {_long_date(start, True)} to "
                        f"{_long_date(end, True)}, counting both dates? Answer with a number.")
            return question, str(count), {"task": task, "year": year, "start_date": start.isoformat(),
                                          "end_date": end.isoformat(), "weekday": _DAYS[weekday]}
        if task == "is_leap_year":
            y = rng.randint(year - leap_year_range // 2, year + leap_year_range // 2)
            return (f"Is {y} a leap year? Answer with Yes or No.", "Yes" if calendar.isleap(y) else "No",
                    {"task": task, "year": y, "is_leap": calendar.isleap(y)})
        month, ordinal, weekday = rng.randint(1, 12), rng.choice(self.ORDINALS), rng.randrange(7)
        days = [d for d, w in calendar.Calendar().itermonthdays2(year, month) if d and w == weekday]
        # every month has at least 4 of each weekday
        day = days[-1] if ordinal == "last" else days[self.ORDINALS.index(ordinal)]
        question = (f"A meeting is held on the {ordinal} {_DAYS[weekday]} of {_MONTHS[month]} {year}. "
                    f"On which day of the month is it? Answer with a number, or -1 if there is no such day.")
        return question, str(day), {"task": "recurring_event_day", "year": year, "month": month,
                                    "ordinal": ordinal, "weekday": _DAYS[weekday]}

    def score_answer(self, answer, item):
        task, oracle = item["metadata"]["task"], item["answer"]
        if task == "weekday_of_date":
            answer = answer.strip()
            if answer == oracle:
                return 1.0
            return 0.1 if answer in _DAYS else 0.05 if answer.title() in _DAYS else 0.0
        if task == "is_leap_year":
            return float(answer.strip().lower() == oracle.lower())
        a, o = int(answer.strip()), int(oracle.strip())  # count_days, recurring_event_day; "4.0" raises: 0
        return float(a == 0) if o == 0 else math.exp(-5 * (abs(a - o) / o))

    def working(self, item):
        return self.WORKING_OF_KIND[item["metadata"]["task"]].format_map(item["metadata"])


def _grid(rows):
    """Rows of cells as text, one row per line: [[0, 1], [1, 2]] -> "0 1\\n1 2"."""
    return "\n".join(" ".join(str(x) for x in row) for row in rows)


class BinaryMatrix(Task):
    """Each cell's taxicab distance to the nearest 0 in an n x n matrix of 0s and 1s (n = 3..10, a quarter
    0s, at least one), as rows of numbers separated by single spaces. ReasoningGym's rule: 1.0 for exactly
    that text, 0.1 for the same matrix as a Python list of lists, else 0.0."""

    name = "binary_matrix"
    max_answer_chars = MAX_ANSWER_CHARS  # the exact answer is at most 299 characters
    WORKING = "Start from every 0 at distance 0 and spread outwards one step at a time."

    def make(self, rng, min_n, max_n, p_zero):
        n = rng.randint(min_n, max_n)
        cells = [0] + [0 if rng.random() < p_zero else 1 for _ in range(n * n - 1)]
        rng.shuffle(cells)
        matrix = [cells[i * n:(i + 1) * n] for i in range(n)]
        zeros = [(i, j) for i in range(n) for j in range(n) if matrix[i][j] == 0]
        dist = [[min(abs(i - a) + abs(j - b) for a, b in zeros) for j in range(n)] for i in range(n)]
        question = ("For every cell of the square matrix below, find the taxicab (Manhattan) distance to "
                    "the nearest 0. Answer with a matrix of the same size holding these distances.\n\n"
                    f"{_grid(matrix)}")
        return question, _grid(dist), {"matrix": matrix}

    def score_answer(self, answer, item):
        if answer == item["answer"]:
            return 1.0
        # a Python list of rows, read as a literal, never evaluated; anything else raises and scores 0
        return 0.1 if _grid(ast.literal_eval(answer)) == item["answer"] else 0.0


def _bf_add(d):
    """Code that adds d to the current cell: |d| pluses or minuses, or, when shorter, a loop on the next
    cell that adds a*b, then c more: _bf_add(115) -> ">++++++++[<++++++++++++++>-]<+++" (8 * 14 + 3)."""
    sign, n = ("+" if d > 0 else "-"), abs(d)
    loops = [">" + "+" * a + "[<" + sign * (n // a) + ">-]<" + sign * (n % a) for a in range(2, n // 2 + 1)]
    return min([sign * n] + loops, key=len)  # the first of the shortest


def _bf_print(text):
    """A program printing `text`, shaped like the output of the BF compiler ReasoningGym uses: clear two
    cells, then step the cell from character to character and print each one."""
    steps = itertools.pairwise([0] + [ord(ch) for ch in text])
    return ">[-]>[-]<" + "".join(_bf_add(b - a) + "." for a, b in steps) + "<"


# common five-letter words (ReasoningGym prints words from a Wordle list)
_WORDS = """about above actor agent album alive angle arena award basic beach black board brain brave brick
bring brown build candy chair charm cheap chest child clean clear cloud cover craft cream curve dream dress
drink eagle earth empty enjoy error extra faith field flame focus frame fresh fruit glass grace grain grass
guard guest guide heart hotel house human juice large laugh layer level lucky lunch magic match model money
month music noble north novel offer paint paper party phone piece pilot place plate power price prize queen
quiet radio range ready robot round royal scale sense shape share shelf short skill sleep smile solid sound
space sport stone storm story sunny table taste teach thing toast today tower trade trust truth uncle upper
value video visit watch wheel white whole write youth zebra""".split()


class BF(Task):
    """What a Brainf*ck program prints: a five-letter lowercase word, printed by a program shaped like
    ReasoningGym's (multiplication loops to reach a letter, + and - to step between letters).
    ReasoningGym's default rule: exactly the word, case included; "The output is spend" earns 5/20."""

    name = "bf"
    WORKING = ("Each loop [<...>-] adds its inner +s (or -s) once per count in the cell on its right; each . "
               "prints the current cell as a character.")

    def make(self, rng, difficulty):  # the paper's difficulty 1 is the only one we write
        word = rng.choice(_WORDS)
        program = _bf_print(word)
        question = (f"This is a BF (Brainf*ck) program. What does it print?\n\n{program}\n\n"
                    f"Reply with exactly what it prints and nothing else.")
        return question, word, {"program": program}


def _parse_logic(s):
    """A formula as ReasoningGym reads one, as a tree: a variable (any other text too), ("¬", x), or
    (op, left, right); outer parentheses dropped, ↔ binds loosest, then →, ∨, ∧ (each split at its
    rightmost occurrence outside parentheses), then ¬: "¬P ∧ (Q → R)" -> ("∧", ("¬", "P"), ("→", "Q", "R"))."""
    s = s.strip()
    if not s:
        raise ValueError("empty formula")
    if s[0] == "(" and s[-1] == ")":
        steps = map({"(": 1, ")": -1}.get, s[1:-1], itertools.repeat(0))
        depths = list(itertools.accumulate(steps, initial=0))
        if min(depths) == 0 == depths[-1]:  # one pair around it all
            return _parse_logic(s[1:-1])
    for op in (op for op in "↔→∨∧" if op in s):
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            if s[i] in "()":
                depth += 1 if s[i] == ")" else -1
            elif depth == 0 and s[i] == op:
                return (op, _parse_logic(s[:i]), _parse_logic(s[i + 1:]))
    return ("¬", _parse_logic(s[1:])) if s[0] == "¬" else s


def _holds(f, row):
    """Truth of a parsed formula f when the variables have the values in row (a dict)."""
    if isinstance(f, str):
        return row[f]
    if f[0] == "¬":
        return not _holds(f[1], row)
    a, b = _holds(f[1], row), _holds(f[2], row)
    return {"∧": a and b, "∨": a or b, "→": (not a) or b, "↔": a == b}[f[0]]


def _variables(f):
    return {f} if isinstance(f, str) else set().union(*map(_variables, f[1:]))


class PropositionalLogic(Task):
    """State a conclusion that follows from 2..4 premises over 2..4 variables P, Q, R, S (formulas up to 3
    levels deep with ¬ ∧ ∨ → ↔). ReasoningGym's rule, by truth table: 1.0 for a conclusion that follows and
    is not trivial, 0.25 for a trivial one (a bare variable or a tautology), 0.05 for one that does not
    follow, 0 for a capital letter that is no variable, or no formula. From "(P → Q)" and "P": "(P ∧ Q)" and
    "Q ∧ P" score 1.0, "Q" 0.25, "¬Q" 0.05; the item's answer is one conclusion worth 1.0. Premises are drawn
    as ReasoningGym draws them: about a fifth contradict themselves, and then every formula follows."""

    name = "propositional_logic"
    max_answer_chars = MAX_ANSWER_CHARS
    OPS = ("∧", "∨", "¬", "→", "↔")
    WORKING = "In every row of the truth table where all the premises are true, {answer} is true too."

    def _formula(self, rng, variables, depth):
        """A random formula as rg writes one: "P", "¬(P ∧ Q)", "((P → Q) ↔ ¬R)"."""
        if depth <= 1:
            return rng.choice(variables)
        op = rng.choice(self.OPS)
        if op == "¬":
            return "¬" + self._formula(rng, variables, depth - 1)
        return f"({self._formula(rng, variables, depth - 1)} {op} {self._formula(rng, variables, depth - 1)})"

    def _grade(self, premises, conclusion):
        """rg's grade of a parsed conclusion given parsed premises, by truth table."""
        names = sorted(set().union(_variables(conclusion), *map(_variables, premises)))
        if len(names) > 12:
            raise ValueError("too many variables")  # 2^n rows: rg would try them all
        rows = [dict(zip(names, bits)) for bits in itertools.product((False, True), repeat=len(names))]
        if not all(_holds(conclusion, r) for r in rows if all(_holds(p, r) for p in premises)):
            return 0.05
        trivial = isinstance(conclusion, str) or all(_holds(conclusion, r) for r in rows)
        return 0.25 if trivial else 1.0

    def make(self, rng, min_vars, max_vars, min_statements, max_statements, min_complexity, max_complexity):
        while True:
            variables = [chr(ord("P") + i) for i in range(rng.randint(min_vars, max_vars))]
            premises = [self._formula(rng, variables, rng.randint(min_complexity, max_complexity))
                        for _ in range(rng.randint(min_statements, max_statements))]
            parsed = [_parse_logic(p) for p in premises]
            shapes = ["¬" + a for a in variables] + [f"({a} {op} {b})" for a in variables for b in variables
                                                      if a != b for op in "∧∨→↔"]  # none is trivial
            good = [f for f in shapes if self._grade(parsed, _parse_logic(f)) == 1.0]  # those that follow
            if good:  # else only trivial conclusions follow: draw again
                break
        answer = rng.choice(good)
        listed = "\n".join(f"{i}. {p}" for i, p in enumerate(premises, 1))
        question = ("This is a propositional logic question. Given the premises below, state a conclusion "
                    "that follows from them; a bare variable or a tautology earns partial credit only.\n"
                    "Write it with these symbols: ∨ (or), ∧ (and), → (implies), ↔ (if and only if), "
                    "¬ (not).\n\n"
                    f"Premises:\n{listed}\n\nWhat can we conclude from the above statements?")
        return question, answer, {"premises": premises, "variables": variables}

    def score_answer(self, answer, item):
        meta = item["metadata"]
        if any(v not in meta["variables"] for v in re.findall("[A-Z]", answer)):
            return 0.0
        premises = [_parse_logic(p) for p in meta["premises"]]
        return self._grade(premises, _parse_logic(answer))  # an answer that is no formula raises: 0


def _row(n, start, block):
    """n empty cells, `block` written from cell `start` on, around the end: _row(5, 4, [7, 8]) -> [8, 0, 0, 0, 7]."""
    row = [0] * n
    for i, color in enumerate(block):
        row[(start + i) % n] = color
    return row


def _arc_move(rng, n, k, solid, wrap):
    """A block (one color, or many) moves k cells right; with wrap it runs around the row's end."""
    if wrap:
        size, pos = rng.randint(1, n), rng.randint(0, n - 1)
    else:
        size = rng.randint(1, n - k - 1)
        pos = rng.randint(0, n - size - k)
    block = [rng.randint(1, 9)] * size if solid else [rng.randint(1, 9) for _ in range(size)]
    return _row(n, pos, block), _row(n, pos + k, block)


def _arc_scattered(rng, n, kind):
    """A row about half colored 1..9, and what `kind` makes of it: "gravity": the colored cells fall to
    the left, in order; "gravity_counting": as that many 1s at the left; "gravity_one_step": each one
    with an empty cell on its left moves into it (scanning from the left); "change_to_five": each is 5."""
    inp = [rng.randint(1, 9) if rng.random() < 0.5 else 0 for _ in range(n)]
    kept = [c for c in inp if c]
    if kind == "gravity":
        return inp, kept + [0] * (n - len(kept))
    if kind == "gravity_counting":
        return inp, [1] * len(kept) + [0] * (n - len(kept))
    if kind == "change_to_five":
        return inp, [5 if c else 0 for c in inp]
    out = list(inp)
    for i in range(1, n):
        if out[i] and not out[i - 1]:
            out[i - 1], out[i] = out[i], 0
    return inp, out


def _arc_fill(rng, n):
    """The cells between two cells of one color take that color."""
    a, b = sorted(rng.sample(range(n), 2))
    color = rng.randint(1, 9)
    inp = [color if i in (a, b) else 0 for i in range(n)]
    return inp, [color if a <= i <= b else 0 for i in range(n)]


def _arc_reflect(rng, n):
    """A block with one odd-colored end cell is mirrored in place, so the odd cell changes ends."""
    size = rng.randint(2, n)
    c1 = rng.randint(1, 9)
    c2 = rng.choice([c for c in range(1, 9) if c != c1])
    block = [c1] * size
    block[0 if rng.random() < 0.5 else -1] = c2
    pos = rng.randint(0, n - size)
    return _row(n, pos, block), _row(n, pos, block[::-1])


def _arc_own_size(rng, n):
    """A block moves right by its own length."""
    size = rng.randint(1, n // 2)
    pos, color = rng.randint(0, n - 2 * size), rng.randint(1, 9)
    return _row(n, pos, [color] * size), _row(n, pos + size, [color] * size)


def _arc_touch(rng, n):
    """A block slides towards a dot of color 1 until it touches it (drawn again where it has no room)."""
    while True:
        size, dot, color = rng.randint(1, n - 1), rng.randint(0, n - 1), rng.randint(2, 9)
        sides = [s for s, ok in (("left", dot >= size), ("right", dot + size < n)) if ok]
        if sides:
            break
    if rng.choice(sides) == "left":
        start, end = rng.randint(0, dot - size), dot - size
    else:
        start, end = rng.randint(dot + 1, n - size), dot + 1
    inp, out = _row(n, start, [color] * size), _row(n, end, [color] * size)
    inp[dot] = out[dot] = 1  # the block never covers the dot
    return inp, out


# rule name -> (generator, its arguments, mirrored?). The names are ReasoningGym's for the 43 rules we
# have, except that gravity rules here are named after the side the cells move to.
ARC_RULES = {f"move_{k}pix_{'solid' if solid else 'colorful'}{'_wrapped' if wrap else ''}_{side}":
             (_arc_move, {"k": k, "solid": solid, "wrap": wrap}, side == "left")
             for k in (1, 2, 3, 4) for solid in (True, False) for wrap in (False, True)
             for side in ("right", "left")}
ARC_RULES.update({f"{kind}_{side}": (_arc_scattered, {"kind": kind}, side == "right")
                  for kind in ("gravity", "gravity_counting", "gravity_one_step")
                  for side in ("left", "right")})
ARC_RULES.update({"change_to_five": (_arc_scattered, {"kind": "change_to_five"}, False),
                  "two_points_and_fill": (_arc_fill, {}, False),
                  "reflect_block_with_border_pixel": (_arc_reflect, {}, False),
                  "move_block_by_own_size": (_arc_own_size, {}, False),
                  "block_touch_dot": (_arc_touch, {}, False)})


class Arc1D(Task):
    """A 1-D ARC puzzle: three input -> output rows of 10..30 cells (colors 0..9) share one of ARC_RULES;
    the answer is the test row's output, cells separated by single spaces. ReasoningGym's default rule:
    exactly that text ("0,0,5" or "[0 0 5]" earn nothing, "Output: 0 0 5" partial credit)."""

    name = "arc_1d"

    def make(self, rng, min_size, max_size, num_train):
        rule = rng.choice(sorted(ARC_RULES))
        n = rng.randint(min_size, max_size)
        fn, kwargs, mirrored = ARC_RULES[rule]
        pairs = [fn(rng, n, **kwargs) for _ in range(num_train + 1)]  # (input row, output row)
        pairs = [[row[::-1] for row in pair] if mirrored else pair for pair in pairs]
        lines = ["Find the common rule that maps each input grid to its output grid in the examples below.",
                 ""]
        for i, (inp, out) in enumerate(pairs[:-1], 1):
            lines += [f"Example {i}:", f"Input:  {_grid([inp])}", f"Output: {_grid([out])}", ""]
        lines += ["Below is a test input grid. Work out the rule, explain how you found it, then give the "
                  "output grid for the test input; your final answer is just that grid.",
                  "", "Input:", _grid([pairs[-1][0]])]
        return "\n".join(lines), _grid([pairs[-1][1]]), {"task_name": rule, "size": n}

    def working(self, item):
        rule = item["metadata"]["task_name"].replace("_", " ")
        return f"The rule is {rule}; applied to the test input it gives:"


# -----------------------------------------------------------------------------
# the other easy families


class RepeatNumber(EasyTask):
    """Repeat a 1-digit number: "Repeat this number: 7" -> "7"."""

    name = "repeat_number"
    WORKING = "The number is {answer}."

    def make(self, rng):
        n = rng.randint(0, 9)
        return f"Repeat this number: {n}", str(n), {"n": n}


class AlphabetPosition(EasyTask):
    """The position of a lowercase letter in the alphabet, from 1: "... the letter q ..." -> "17". To a
    model that does not know the alphabet, 26 facts each found by a lucky guess: reproduce.py's toy."""

    name = "alphabet_position"
    WORKING = "{letter} is letter number {answer}."

    def make(self, rng):
        letter = rng.choice(string.ascii_lowercase)
        position = string.ascii_lowercase.index(letter) + 1
        question = f"What is the position of the letter {letter} in the alphabet?"
        return question, str(position), {"letter": letter}


TASKS.update({task.name: task for task in [
    BaseConversion(), BasicArithmetic(), Arc1D(), BF(), PropositionalLogic(), FractionSimplification(),
    DecimalArithmetic(), CalendarArithmetic(), BinaryMatrix(), RepeatNumber(), AlphabetPosition()]})

# -----------------------------------------------------------------------------
# optional: the real ReasoningGym generators as tasks named "rg:NAME"

def _lazy(name):
    """The installed package `name`, loaded at its first use (reasoning_gym takes seconds: matplotlib and
    more, which a command that only reads its flags never needs), or None if it is not installed."""
    import importlib.util
    import sys
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reasoning_gym = _lazy("reasoning_gym")

VERIFY_SECONDS = 5.0  # the most an rg: item may take to be made again (the nine take milliseconds)
_RG_BUSY = threading.Lock()  # held while an rg: item is made again, by one thread at a time


class ReasoningGymTask(Task):
    """A reasoning_gym dataset as a task (if the package is installed): an "rg:bf" item is entry 0 of
    reasoning_gym.create_dataset("bf", seed=its seed, size=1, **the paper's config; rg's defaults beyond
    the nine), scored by that dataset's score_answer; its metadata is rg's (JSON-safe), the seed and the
    config; without an answer (propositional_logic) it takes the example answer. For the nine, an entry
    whose own answer scores below 1.0 (rg's fallback conclusion, an empty base_conversion answer) is never
    made: generate() draws another seed, verify() rejects it. rg's scorers trust the metadata: score a
    peer's rg item only after verify_item accepted it."""

    max_answer_chars = MAX_ANSWER_CHARS  # rg's parsers are not all linear time

    def __init__(self, rg_name):
        if reasoning_gym is None:
            raise ValueError(f"Task 'rg:{rg_name}' needs the reasoning_gym package: "
                             "pip install reasoning-gym==0.1.25.")
        self.rg_name, self.name = rg_name, "rg:" + rg_name
        self.config = PAPER_CONFIGS.get(rg_name, {})
        try:
            self._scorer = reasoning_gym.create_dataset(rg_name, seed=0, size=1, **self.config)
        except Exception:
            raise ValueError(f"reasoning_gym has no dataset called {rg_name!r}.") from None

    def _usable(self, item):
        return self.rg_name not in PAPER_TASKS or self.score_answer(item["answer"], item) == 1.0

    def generate(self, rng):
        while True:
            item = self.from_seed(rng.randrange(2**32))
            if self._usable(item):
                return item

    def from_seed(self, seed):
        with contextlib.redirect_stdout(io.StringIO()):  # rg's bf interpreter prints while it runs
            entry = reasoning_gym.create_dataset(self.rg_name, seed=seed, size=1, **self.config)[0]
        meta = json.loads(json.dumps(entry.get("metadata", {}), default=str))
        answer = entry["answer"] if entry["answer"] is not None else meta.get("example_answer")
        return {"task": self.name, "question": entry["question"], "answer": str(answer),
                "metadata": {**meta, "seed": seed, "config": json.loads(json.dumps(self.config))}}

    def verify(self, item):
        """Task.verify, given VERIFY_SECONDS on a thread of its own: False when it takes longer (it
        then finishes in the background, and rg: items are refused until it has)."""
        if not _RG_BUSY.acquire(blocking=False):
            return False
        result = []

        def run():
            try:
                result.append(Task.verify(self, item) and self._usable(item))
            finally:
                _RG_BUSY.release()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(VERIFY_SECONDS)
        return result == [True]

    def score_answer(self, answer, item):
        entry = {"question": item["question"], "answer": item["answer"], "metadata": item["metadata"]}
        return self._scorer.score_answer(answer=answer, entry=entry)


rg_task = functools.cache(ReasoningGymTask)  # the Task "rg:" + rg_name, made once
