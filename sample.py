"""
Batched sampling with a preallocated KV cache (generate): how a SAPO peer makes G completions a question.

1. Prefill. The P prompts (token-id lists of different lengths) are left-padded to one length L and
   run through the model once, writing their keys and values into a cache preallocated for B = P * G
   rows and S = L + max_new_tokens slots. Left padding makes every row write the same slot each step:

       slot:        0    1    2    3  | 4    5  ...      (L = 4)
       prompt 0:   pad  pad   a    b  | s0   s1 ...      RoPE positions  -  -  0  1 | 2  3
       prompt 1:    c    d    e    f  | s0   s1 ...      RoPE positions  0  1  2  3 | 4  5

   Pads are never attended to, and each token's RoPE position counts from its own prompt's start, so
   the result equals running every prompt alone.
2. Decode. One token per row per step, sampled from the last logits (temperature, top-k, top-p) and
   fed back, until every row has produced a stop token or max_new_tokens are out. A completion that
   stopped keeps its stop token: the policy must learn to stop.

The cache is one plain tensor, (n_layers, 2, B, n_kv_heads, S, head_dim): per layer, keys (0) and
values (1). Row p * G + g holds sample g of prompt p. The prefill computes each prompt once, into the
first row of its group (the strided view cache[:, :, ::G]), then copies its L slots to the other rows:

       row 0  prompt 0, sample 0    <- prefill            (G = 2)
       row 1  prompt 0, sample 1    <- copy of row 0, slots 0..L-1
       row 2  prompt 1, sample 0    <- prefill
       row 3  prompt 1, sample 1    <- copy of row 2, slots 0..L-1

The decode step reads the filled slots 0..t, replayed as a CUDA graph where it can (GraphedDecode,
below the marker line). The SAPO paper (arXiv 2509.08721) samples with transformers' generate(); this
hand-written replacement has the same semantics (the tests compare greedy outputs token for token).
"""

import random
import sys

import torch

from model import Transformer, load_model


def sample_token(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None, logprob=False):
    """Pick one token per row from logits (B, V). temperature 0 is greedy. top_k keeps the k most
    likely tokens; top_p keeps the smallest set of most likely tokens whose probability reaches top_p
    (the nucleus); either renormalises what it keeps into p. Sampling uses argmax(p / E) with
    E ~ Exponential(1), which draws from p exactly and needs no GPU -> CPU synchronisation (unlike
    torch.multinomial). logprob=True also returns each token's log-prob under p (0 when greedy)."""
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return (tokens, torch.zeros_like(tokens, dtype=torch.float)) if logprob else tokens
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # probability of the more likely tokens
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # the first token is always kept
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p / sorted_p.sum(dim=-1, keepdim=True))
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    tokens = (probs / noise).argmax(dim=-1)
    return (tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()) if logprob else tokens


def prefill(model: Transformer, prompts, G, cache):
    """Run the P prompts once, left-padded to L tokens, into rows 0, G, 2G, ... of the cache, and copy
    each one's keys and values into the G - 1 rows after it. Returns the logits of each row's last
    prompt token (B, V) and each row's left pads (B,)."""
    device = cache.device
    L = max(len(p) for p in prompts)
    pads = torch.tensor([L - len(p) for p in prompts], device=device)
    idx = torch.tensor([[0] * (L - len(p)) + list(p) for p in prompts], device=device)
    keys = torch.arange(L, device=device)
    mask = (keys[:, None] >= keys) & (keys >= pads[:, None, None])  # (P, L, L): causal, and not a pad
    mask |= torch.eye(L, dtype=torch.bool, device=device)  # a pad query sees itself (else NaN)
    pos = (keys - pads[:, None]).clamp(min=0)
    h = model.hidden(idx, pos=pos, cache=cache[:, :, ::G], slots=keys, mask=mask[:, None])
    groups = cache.unflatten(2, (len(prompts), G))  # (n_layers, 2, P, G, n_kv_heads, S, head_dim)
    groups[:, :, :, 1:, :, :L] = groups[:, :, :, :1, :, :L]
    return model.lm_head(h[:, -1]).repeat_interleave(G, dim=0), pads.repeat_interleave(G)


def decode_step(model: Transformer, cache, tokens, t, pads, width):
    """Feed one token per row at cache slot t. tokens (B,), t a 0-dim long tensor on the model's
    device, pads (B,) left pads. Attention reads slots 0..width-1: t + 1 (the filled ones) in the eager
    loop, all S in the fixed-shape one; slots past t and pads are masked out. Returns logits (B, V)."""
    keys = torch.arange(width, device=tokens.device)
    mask = (keys >= pads[:, None]) & (keys <= t)  # (B, width): may attend
    pos = (t - pads)[:, None]  # (B, 1) RoPE position of the new token
    h = model.hidden(tokens[:, None], pos=pos, cache=cache, slots=t.view(1), mask=mask[:, None, None, :])
    return model.lm_head(h[:, -1])


@torch.no_grad()
def generate(model: Transformer, prompts, num_samples=1, max_new_tokens=256, temperature=1.0, top_k=0,
             top_p=1.0, eos_token_ids=(), seed=None, cuda_graph=True, logprobs=False):
    """num_samples completions of each prompt (token-id lists): len(prompts) * num_samples lists of new
    token ids, prompt-major, each ending with its stop token (one of eos_token_ids) or max_new_tokens
    long; seed makes the draw reproducible. logprobs=True also returns each sampled token's log-prob under
    what it was drawn from (temperature, top-k, top-p): the behaviour policy an off-policy receiver needs."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        empty = [[] for _ in range(len(prompts) * num_samples)]
        return (empty, [[] for _ in empty]) if logprobs else empty
    cfg, dtype, device = model.cfg, model.lm_head.weight.dtype, model.lm_head.weight.device
    B, L = len(prompts) * num_samples, max(len(p) for p in prompts)
    if L + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt ({L} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"{cfg.max_seq_len} positions")
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    stop = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
    S = L + max_new_tokens
    cache = torch.zeros(cfg.n_layers, 2, B, cfg.n_kv_heads, S, cfg.head_dim, device=device, dtype=dtype)
    logits, pads = prefill(model, prompts, num_samples, cache)

    def eager_step(tokens, t):  # reads only the filled slots 0..t
        return decode_step(model, cache, tokens, torch.tensor(t, device=device), pads, t + 1)
    step = eager_step
    if cuda_graph and device.type == "cuda":
        step = graphed_or_eager(model, cache, pads, eager_step)
    out = torch.zeros(B, max_new_tokens, dtype=torch.long, device=device)
    out_lp = torch.zeros(B, max_new_tokens, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    check_every = 8 if device.type == "cuda" else 1  # asking "all done?" costs a GPU -> CPU sync
    for n in range(1, max_new_tokens + 1):  # at least once: max_new_tokens >= 1 here
        tokens, out_lp[:, n - 1] = sample_token(logits, temperature, top_k, top_p, generator, True)
        out[:, n - 1] = tokens
        done |= torch.isin(tokens, stop)
        if n == max_new_tokens or (n % check_every == 0 and bool(done.all())):
            break
        logits = step(tokens, L + n - 1)

    stops, completions = set(eos_token_ids), []  # each row is cut after its first stop token
    for row in out[:, :n].tolist():
        end = next((i + 1 for i, tok in enumerate(row) if tok in stops), len(row))
        completions.append(row[:end])
    if not logprobs:
        return completions
    return completions, [lp[:len(c)] for lp, c in zip(out_lp.tolist(), completions)]


# ----- Nothing below this line is needed to understand SAPO: plumbing follows. -----
# The decode step captured in a CUDA graph (a speed-up on a GPU; the eager step above is the reference).


def graphed_or_eager(model, cache, pads, eager_step):
    """GraphedDecode, or eager_step with one log line where capturing fails (an old driver, a memory
    limit, an op that cannot be captured): a slower run, never a failed one."""
    try:
        return GraphedDecode(model, cache, pads)
    except Exception as e:
        why = f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0][:200]  # one line, whatever it says
        print(f"sample.py: the decode step runs eagerly: capturing it as a CUDA graph failed ({why})",
              file=sys.stderr)
        return eager_step


class GraphedDecode:
    """decode_step reading all S slots (those past t masked out), so its shapes never change: captured in a
    CUDA graph once per generate() call, with static input buffers, and replayed at every step. This removes
    the per-kernel launch cost that dominates decoding for models this small (the gpt-fast idea). The eager
    step stays the reference and what cuda_graph=False selects; a test checks both give the same logits
    on the CPU; docs/performance.md has its times on a GPU."""

    def __init__(self, model, cache, pads, step=decode_step):  # step: bench.py's compiled one, say
        S = cache.shape[-2]
        self.tokens = torch.zeros_like(pads)
        self.t = torch.full((), S - 1, dtype=torch.long, device=pads.device)  # a slot never read
        self.pads = pads
        with torch.cuda.device(pads.device):  # streams and graphs belong to the current device
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up (allocations, kernel choice) outside the graph
                for _ in range(2):
                    step(model, cache, self.tokens, self.t, self.pads, S)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = step(model, cache, self.tokens, self.t, self.pads, S)

    def __call__(self, tokens, t):
        self.tokens.copy_(tokens)
        self.t.fill_(t)
        self.graph.replay()  # replays on the device it was captured on
        return self.logits


# Command line: python sample.py MODEL "a question" [--task NAME]: what a model or a checkpoint says


def run_settings(path):
    """The settings.json of the train.py peer that wrote `path` (its folder, or a checkpoint-N in it), or {}:
    the system prompt, one-shot example, tasks and completion length it trained with."""
    import json
    import os
    for folder in (path, os.path.dirname(os.path.normpath(path))):
        found = os.path.join(os.path.expanduser(folder), "settings.json")
        if os.path.isfile(found) and os.path.isfile(os.path.join(os.path.dirname(found), "metrics.jsonl")):
            with open(found) as f:
                return json.load(f)
    return {}


def find_item(question, tasks, seed):
    """The item of one of `tasks` that asks `question` (each family's items of seeds seed to seed + 999), or
    None: then, if there are tasks, a question with the first one's one-shot example."""
    import reward
    for task in tasks:
        for k in range(seed, seed + 1000):
            item = reward.get_task(task).generate(random.Random(k))
            if question is None or item["question"] == question:
                return item
    return {"task": tasks[0] if tasks else None, "question": question, "answer": None}


def main(argv=None):
    import argparse
    import reward  # the tasks and the prompt a peer trains with
    p = argparse.ArgumentParser(description="Four completions of a question, asked as the peer that trained "
                                            "the model asked its own (its settings.json), rewarded if it is "
                                            "an item of one of its tasks or of --task.")
    p.add_argument("model", help="a model folder or Hub id, RUN/PEER/checkpoint-N, "
                                 "or RUN/PEER (its newest checkpoint)")
    p.add_argument("question", nargs="?", help="the question (default: an item that --task makes)")
    p.add_argument("--task", choices=sorted(reward.TASKS),
                   help="a family: it makes the question, or is searched for it")
    p.add_argument("--seed", type=int, default=0,
                   help="the seed of the draw and of --task's items (default: 0)")
    p.add_argument("--max-new-tokens", type=int,
                   help="completion length limit (default: the run's --max-new-tokens, else 256)")
    a = p.parse_args(argv)
    if not (a.question or a.task):
        p.error("give a question, or --task to make one")
    run = run_settings(a.model)  # {} for a model that no peer trained: the chat template alone
    item = find_item(a.question, [a.task] if a.task else run.get("task_list", []), a.seed)
    try:
        model, tok = load_model(a.model, "cuda" if torch.cuda.is_available() else "cpu")
    except (OSError, ValueError, RuntimeError) as e:
        raise SystemExit(f"sample.py: {e}") from None
    system, one_shot = run.get("system_prompt", "default"), run.get("one_shot", item["answer"] is not None)
    prompt = reward.prompt_ids(tok, item, one_shot, system)
    if run:
        example = f"a one-shot example of {item['task']}" if one_shot and item["task"] else "no example"
        print(f"asked as the run asked: its system prompt ({system}), {example}")
    longest = a.max_new_tokens or run.get("max_new_tokens", 256)
    outs = generate(model, [prompt], num_samples=4, seed=a.seed,
                    max_new_tokens=min(longest, model.cfg.max_seq_len - len(prompt)),
                    eos_token_ids=model.stop_ids or [tok.eos_token_id])
    scored = item["answer"] is not None
    print(f"question: {item['question']}" + (f"\nanswer: {item['answer']}" if scored else ""))
    for k, ids in enumerate(outs):
        text = tok.decode(ids, skip_special_tokens=True)
        rewarded = f", reward {reward.score(item, text):g}" if scored else ""
        print(f"--- completion {k + 1}{rewarded}:\n{text}")


if __name__ == "__main__":
    main()
