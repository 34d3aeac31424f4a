"""
Speed of nanoSAPO's hand-written parts, measured side by side with Hugging Face transformers on the
same shapes and batch, the load the rollout server takes, and how far reward.py's scorers agree with
ReasoningGym's.

    python bench.py                     # sampling: our generate() vs transformers' generate()
    python bench.py --train             # one GRPO step: packed groups, row by row, transformers
    python bench.py --swarm             # the rollout server under 32 simulated peers, then both stores under 200
    python bench.py --attack            # what the server and the client survive (docs/swarm.md, Reliability)
    python bench.py --attack --against DIR  # the same, against DIR/swarm.py (another checkout)
    python bench.py --parity 200        # reward.py vs reasoning_gym 0.1.25, 200 items per family
    python bench.py --lines             # the reading path (each file up to its marker line) against its budget
    python bench.py --device cuda --model qwen2.5-0.5b --batch 64 256 --json

Sampling: both samplers draw at temperature 1 with no top-k/top-p, exactly --new-tokens tokens per
row (stop tokens off), from --batch random prompts of --prompt-tokens tokens. They run alternately
after a warm-up, --repeats times each, and the best time of each counts. On CUDA the report adds the
share of the memory-bandwidth roofline: every decode step must read all weights and the KV cache
filled so far, so (bytes per step x steps / time) / peak bandwidth says how close to the hardware
limit the sampler runs.

Training: one GRPO step (grpo.step, AdamW) on --batch completions of real one-shot prompts (the
default model's tokenizer; --tasks easy or paper), G to a prompt, each of --completion-tokens tokens,
three ways: packed (each group one row, the prompt once), row by row (the same step with each
(prompt, completion) its own group: the prompt once per completion, as per-row trainers do), and
transformers' model row by row (full logits, log_softmax, gather, the usual way). Completion tokens
per second, peak memory (torch.cuda.max_memory_allocated on CUDA, the peak resident memory above the
process's size after imports on the CPU; each side in a fresh process of its own), and the achieved
FLOP/s (the step's model FLOPs over its time) against a large matmul's, measured in the same run.

Swarm: a server in a subprocess and --peers simulated peers (threads) that each publish one batch
of groups and fetch a sampled read of the others' every round, for --rounds rounds: posts per second,
p50/p99 sync and read latency (bench_swarm says which is which), acknowledged groups missing from a final
full read, and groups a peer received twice or of its own (all must be 0). Then both stores, the server
and a durable redis-server, under --store-peers simulated peers (bench_stores): posts/s, sampled reads of
16 groups (and, from the server, everything after a cursor, as a dashboard reads), bytes a peer reads a
round, the store's CPU per post and read.

Attack: a flood of slow connections, crafted hostile requests, kill -9 under concurrent writers, a
client facing servers that misbehave (silent, trickling, garbage, a 32 MB reply, a poisoned group, a Redis
answering 16 MB or 200,000 entries), a server filled far past --keep-bytes, then the store's own bounds
(tiny batches, the post that prunes, 30,000 writers, unread replies) and one dishonest writer (a Sybil under many names, posting as alice, a
flood under --keep-bytes 4M, 500 connections queueing writes), these last against a shared token and
against per-peer credentials (the attack_* functions). --against DIR runs DIR/swarm.py instead (an older
checkout, measured in the same hour); --quick shrinks the new cases to check that they run.

Parity (needs reasoning_gym installed): for each of the paper's nine families, N of ReasoningGym's
items with the paper's config and N of ours, each scored by both scorers on its reference answer and
on near misses a model might write (near_misses below); docs/rewards.md has the table.

--model takes a model folder or Hub id (sampling only), or one of the shapes below with random
weights (no download). This file follows no part of the SAPO paper; it exists because a SAPO peer
spends most of its time sampling and training, a swarm lives or dies by its server, and rewards
measured here are only comparable with the paper's if our scorers agree with ReasoningGym's.
"""

import argparse
import collections
import itertools
import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from decimal import Context, Decimal, localcontext

import torch

import reward

HERE = os.path.dirname(os.path.abspath(__file__))
# config.json of the two shapes bench.py knows, with random weights (no download needed)
SHAPES = {
    "smollm2-135m": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152,
                         hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936,
                         hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True),
}
PEAK_BANDWIDTH = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA A100-SXM4-80GB": 2.04e12}  # bytes/s


def load_pair(name, device, dtype):
    """Our Transformer and transformers' model holding the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    import model as M
    if name in SHAPES:
        hf_cfg = AutoConfig.for_model(**SHAPES[name])
        torch.manual_seed(0)
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation="sdpa")
        cfg_dict = dict(SHAPES[name])
        ours = M.Transformer(M.config_from_hf(cfg_dict), cfg_dict).to(device=device, dtype=dtype)
        ours.load_state_dict(hf.state_dict(), strict=not cfg_dict["tie_word_embeddings"])
        ours.init_rope()
    else:
        folder = M.resolve(name)
        ours, _ = M.load_folder(folder, device=device, dtype=dtype)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device)
    return ours.eval(), hf.eval()


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def bench_sampling(args, name, device, dtype):
    import sample
    ours, hf = load_pair(name, device, dtype)
    cfg = ours.cfg
    results = []
    for batch in args.batch:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, min(cfg.vocab_size, 32000), (batch, args.prompt_tokens), generator=g)
        lists = prompts.tolist()

        def run_ours():
            out = sample.generate(ours, lists, max_new_tokens=args.new_tokens, temperature=1.0)
            assert all(len(o) == args.new_tokens for o in out)

        def run_hf():
            ids = prompts.to(device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, pad_token_id=0)
            assert out.shape[1] == args.prompt_tokens + args.new_tokens

        with torch.no_grad():
            run_ours(), run_hf()  # warm-up
            ours_t, hf_t = [], []
            for _ in range(args.repeats):
                ours_t.append(timed(run_ours, device))
                hf_t.append(timed(run_hf, device))
        tokens = batch * args.new_tokens
        r = dict(what="sample", model=name, device=str(device), batch=batch,
                 tok_per_s=tokens / min(ours_t), hf_tok_per_s=tokens / min(hf_t))
        r["ratio"] = r["tok_per_s"] / r["hf_tok_per_s"]
        if torch.device(device).type == "cuda":
            r["roofline_pct"] = 100 * roofline_fraction(ours, batch, args, min(ours_t))
        results.append(r)
        report(r, args)
    return results


def roofline_fraction(model, batch, args, seconds):
    """Bytes every decode step must read (all weights + the KV cache so far) over peak bandwidth."""
    cfg = model.cfg
    elt = model.lm_head.weight.element_size()
    weight_bytes = sum(p.numel() for p in model.parameters()) * elt
    kv_per_slot = 2 * cfg.n_layers * batch * cfg.n_kv_heads * cfg.head_dim * elt
    avg_context = args.prompt_tokens + args.new_tokens / 2
    total = args.new_tokens * (weight_bytes + kv_per_slot * avg_context)
    name = torch.cuda.get_device_name(model.lm_head.weight.device)
    peak = next((bw for key, bw in PEAK_BANDWIDTH.items() if name.startswith(key)), None)
    if peak is None:  # another GPU: measure a device-to-device copy (reads + writes), after a warm-up
        x = torch.empty(2**28, dtype=torch.uint8, device=model.lm_head.weight.device)
        y = x.clone()
        t = min(timed(lambda: y.copy_(x), "cuda") for _ in range(5))
        peak = 2 * x.numel() / t
    return total / seconds / peak


def rss_bytes():
    """This process's resident memory now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

# -----------------------------------------------------------------------------
# the training step: packed groups against the same step row by row and against transformers


MEAN_PROMPT_TOKENS = {"easy": 110, "paper": 298}  # one-shot prompts, the default model's tokenizer (200 of each)
TRAIN_DEFAULTS = dict(  # --train's, as train.py's on a CPU and on a GPU: --tasks auto, G, --max-new-tokens, ...
    cpu=dict(tasks=["easy"], generations=[4], completion_tokens=[64], micro_tokens=1024, grad_checkpoint=True),
    cuda=dict(tasks=["paper"], generations=[8], completion_tokens=[256], micro_tokens=8192, grad_checkpoint=False))


def train_prompts(tasks, n, seed=0):
    """n one-shot prompts of reward.py's `tasks` ("easy" or "paper"), as the default model's tokenizer
    writes them for a peer (reward.prompt_ids), from a local copy of it (the Hugging Face cache or
    nanoSAPO's own). Without one, random ids of the mean length those prompts have, said on stderr."""
    import model as M
    from transformers import AutoTokenizer
    rng = random.Random(seed)
    for folder in (lambda: M.cache_root() + "/SmolLM2-135M-Instruct-Q4_1", lambda: snapshot(M.DEFAULT_MODEL)):
        try:
            tok = AutoTokenizer.from_pretrained(folder())
        except (OSError, ValueError):
            continue
        names = reward.task_names(tasks)
        return [reward.prompt_ids(tok, reward.get_task(rng.choice(names)).generate(rng), True) for _ in range(n)]
    print(f"bench.py: no local copy of {M.DEFAULT_MODEL}'s tokenizer: random prompts of "
          f"{MEAN_PROMPT_TOKENS[tasks]} tokens, the mean of the real ones", file=sys.stderr)
    return [[rng.randrange(1000, 30000) for _ in range(MEAN_PROMPT_TOKENS[tasks])] for _ in range(n)]


def snapshot(repo):
    from huggingface_hub import snapshot_download
    return snapshot_download(repo, local_files_only=True)


def step_flops(cfg, prompt_lengths, G, C, packed):
    """Model FLOPs of one training step on groups of G completions of C tokens (forward and backward,
    3 forwards; recomputed activations not counted): 2 per weight per token through the blocks, 4 x
    heads x head_dim per layer for each (query, key it may see), the output layer on completion
    tokens only. Packed, each prompt counts once; row by row, once per completion."""
    weights = cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + cfg.n_heads * cfg.head_dim * cfg.dim
    per_token = 2 * cfg.n_layers * (weights + 3 * cfg.dim * cfg.hidden_dim)
    per_key = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    total = 0
    for P in prompt_lengths:
        copies, completions = (1, G) if packed else (G, 1)
        keys = P * (P + 1) // 2 + completions * (C * P + C * (C + 1) // 2)
        total += copies * (per_token * (P + completions * C) + per_key * keys)
    return 3 * (total + 2 * cfg.dim * cfg.vocab_size * G * C * len(prompt_lengths))


def matmul_flops(device, dtype):
    """FLOP/s of a large square matrix multiply in the step's compute dtype: what this machine can do."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b  # warm-up
    return 2 * n ** 3 / min(timed(lambda: a @ b, device) for _ in range(3))


def bench_train(args, name, device, dtype):
    """For each of --tasks, --batch, --generations and --completion-tokens: one GRPO step (AdamW, gradient
    clipping, the peer's micro-batches and checkpointing) on --batch completions, three ways, each in a
    fresh process of its own so that its peak memory is its own: grpo.step on packed groups; the same
    step with every (prompt, completion) row a group of its own (the prompt computed once per row);
    transformers' model on the same rows (train_side says how). Completion tokens per second, peak
    memory, and the achieved FLOP/s against a large matmul's, measured here in the same run."""
    import model as M
    cfg, peak, results = M.config_from_hf(dict(SHAPES[name])), matmul_flops(device, dtype), []
    for tasks, batch, G in ((t, b, g) for t in args.tasks for b in args.batch for g in args.generations):
        prompts = train_prompts(tasks, max(1, batch // G))
        for C in args.completion_tokens:
            r = dict(what="train", model=name, device=str(device), tasks=tasks, G=G, completion_tokens=C,
                     batch=G * len(prompts), prompt_tokens=sum(map(len, prompts)) / len(prompts),
                     matmul_tflops=peak / 1e12)
            for side in ("packed", "rows", "hf"):
                s = train_subprocess(args, side, name, device, dtype, prompts, G, C)
                flops = step_flops(cfg, [len(p) for p in prompts], G, C, side == "packed") / s["seconds"]
                r.update({f"{side}_tok_per_s": r["batch"] * C / s["seconds"], f"{side}_peak_gb": s["peak_bytes"] / 1e9,
                          f"{side}_tflops": flops / 1e12, f"{side}_matmul_pct": 100 * flops / peak})
            r.update(speedup=r["packed_tok_per_s"] / r["rows_tok_per_s"],
                     ratio=r["packed_tok_per_s"] / r["hf_tok_per_s"],
                     memory_ratio=r["packed_peak_gb"] / max(r["hf_peak_gb"], 1e-9))
            results.append(r)
            print(json.dumps(r) if args.json else
                  f"train {name} {device} {tasks} G={G} C={C} batch {r['batch']} (prompts of {r['prompt_tokens']:.0f} "
                  f"tokens): " + " | ".join(f"{side} {r[f'{side}_tok_per_s']:,.0f} tok/s {r[f'{side}_peak_gb']:.2f} GB "
                                           f"{r[f'{side}_matmul_pct']:.0f}%" for side in ("packed", "rows", "hf"))
                  + f" | packed {r['speedup']:.2f}x rows, {r['ratio']:.2f}x transformers (% of a matmul's "
                  f"{r['matmul_tflops']:.2f} TFLOP/s)", flush=True)
    return results


def train_subprocess(args, side, name, device, dtype, prompts, G, C):
    """One side of --train in a fresh process (train_side): its seconds and peak_bytes."""
    cmd = [sys.executable, os.path.abspath(__file__), "--train-side", side, "--model", name, "--device", str(device),
           "--dtype", str(dtype).removeprefix("torch."), "--repeats", str(args.repeats), "--generations", str(G),
           "--completion-tokens", str(C), "--micro-tokens", str(args.micro_tokens),
           "--grad-checkpoint" if args.grad_checkpoint else "--no-grad-checkpoint"]
    out = subprocess.run(cmd, input=json.dumps(prompts), capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"bench.py: the {side} training step failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_side(args):
    """One side of --train in this process, on the prompts that stdin holds (JSON), each with
    --generations completions of exactly --completion-tokens random tokens (no stop: every row as long),
    one advantage of +-1 each, float32 weights under --dtype autocast (none for float32), AdamW:
    "packed" and "rows" are grpo.step on the groups and on one group per row; "hf" is transformers'
    model row by row, in right-padded micro-batches of as many rows as --micro-tokens holds, its full
    logits through log_softmax, the surrogate at ratio 1 (-A x log-prob, token mean), the same clipping
    and optimizer. The best of --repeats steps after a warm-up; JSON: seconds, peak_bytes."""
    import resource
    import grpo
    import model as M
    from transformers import AutoConfig, AutoModelForCausalLM
    device, amp = torch.device(args.device), None if args.dtype == "float32" else getattr(torch, args.dtype)
    base_rss = rss_bytes()
    torch.manual_seed(0)
    rng, cfg_dict = random.Random(0), dict(SHAPES[args.model[0]])
    G, C, prompts = args.generations[0], args.completion_tokens[0], json.loads(sys.stdin.read())
    groups = [(p, [[rng.randrange(1000, 30000) for _ in range(C)] for _ in range(G)]) for p in prompts]
    adv = [rng.choice([-1.0, 1.0]) for _ in range(G * len(groups))]
    if args.train_side == "hf":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg_dict), dtype=torch.float32,
                                                     attn_implementation="sdpa")
        if args.grad_checkpoint:
            model.gradient_checkpointing_enable()
    else:
        model = M.Transformer(M.config_from_hf(cfg_dict), cfg_dict).to(device)
        model.grad_checkpoint = args.grad_checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows = [(p, [c]) for p, cs in groups for c in cs]

    def step():
        if args.train_side == "hf":
            return hf_rows_step(model, opt, [(p, cs[0]) for p, cs in rows], adv, args.micro_tokens, amp)
        grpo.step(model, opt, groups if args.train_side == "packed" else rows, adv, pad_id=0, stop_ids=[2],
                  micro_tokens=args.micro_tokens, autocast_dtype=amp)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()  # warm-up; AdamW's state exists from here on, as in training
    seconds = min(timed(step, device) for _ in range(args.repeats))
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    print(json.dumps(dict(seconds=seconds, peak_bytes=peak)))


def hf_rows_step(model, opt, rows, adv, micro_tokens, amp):
    """train_side's "hf": one step of transformers' model on rows (prompt, completion), every completion
    of the same length, as a per-row trainer computes it."""
    model.train()
    device, per = model.device, max(1, micro_tokens // max(len(p) + len(c) for p, c in rows))
    total = sum(len(c) for _, c in rows)
    for i in range(0, len(rows), per):
        part, T = rows[i:i + per], max(len(p) + len(c) for p, c in rows[i:i + per])
        ids = torch.tensor([p + c + [0] * (T - len(p) - len(c)) for p, c in part], device=device)
        lengths = torch.tensor([len(p) + len(c) for p, c in part], device=device)
        attention = (torch.arange(T, device=device) < lengths[:, None]).long()  # 1 on each row's tokens, 0 on padding
        at = torch.tensor([[len(p) - 1 + j for j in range(len(c))] for p, c in part], device=device)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            logits = model(input_ids=ids, attention_mask=attention).logits
        logp = torch.log_softmax(logits.float(), -1).gather(1, at[:, :, None].expand(-1, -1, logits.shape[-1]))
        logp = logp.gather(-1, torch.tensor([c for _, c in part], device=device)[..., None])[..., 0]
        (-(torch.tensor(adv[i:i + per], device=device)[:, None] * logp).sum() / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


SWARM_PY = os.path.join(HERE, "swarm.py")  # the server the swarm benches run (--against DIR: DIR/swarm.py)


def _server(folder=None, *flags, preexec_fn=None):
    """python swarm.py --port 0 in a subprocess -> (process, url, folder)."""
    folder = folder or tempfile.mkdtemp(prefix="swarm-bench-")
    proc = subprocess.Popen([sys.executable, SWARM_PY, "--dir", folder, "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=preexec_fn)
    m = re.fullmatch(r"swarm server: (http://\S+)", proc.stdout.readline().strip())
    if not m:
        proc.kill()
        raise RuntimeError("the swarm server did not start")
    return proc, m.group(1), folder


def _end(proc, folder, stop=None, threads=()):
    """An attack's end: its threads told to stop and joined, the server killed, its folder removed."""
    if stop is not None:
        stop.set()
    for t in threads:
        t.join()
    proc.kill()
    proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


def _groups(tag, n=4, completions=8, chars=600):
    import swarm
    filler = "Let me think step by step. " * (chars // 27 + 1)
    return [swarm.wire_group("basic_arithmetic", f"{tag} question {i}", str(i),
                             [(f"{j} " + filler)[:chars - 20] + f"<answer>{j}</answer>" for j in range(completions)],
                             [True] * completions, {"i": i}, "bench") for i in range(n)]


def _read_all(url, token=None):  # every group a server holds, by GET /rollouts?after=SEQ (as a dashboard or an audit reads)
    import requests
    stored, after, headers = [], 0, {"Authorization": f"Bearer {token}"} if token else {}
    while True:
        data = requests.get(url + "/rollouts", params={"after": after, "limit": 1024}, headers=headers,
                            timeout=30).json()
        stored += data["groups"]
        if data["next"] == after:
            return stored
        after = data["next"]


def _pct(values, q):
    values = sorted(values)
    return round(values[min(len(values) - 1, int(len(values) * q))], 2) if values else None


def bench_swarm(peers=32, rounds=20, groups_per_post=4, sample=16):
    """-> posts/s, publish()+fetch() time, sync time, sampled-read GET latency, groups lost, received twice
    or of the peer's own. Each simulated peer (a thread with its own client, reading `sample` groups a
    read) does per round: publish() and fetch() (timed: they only touch queues), flush() (timed as "sync":
    until its batch is acknowledged and a read begun after it is done), and one GET /rollouts?sample=K
    (timed as "read": the HTTP work the client's thread does per read). posts_per_s counts acknowledged
    posts over the whole run; groups_lost counts acknowledged groups missing from a final full read
    (GET ?after=), received_twice and received_own what no peer may be handed (all must be 0)."""
    import requests
    import swarm
    proc, url, folder = _server()
    try:
        acked, got = [[] for _ in range(peers)], [[] for _ in range(peers)]
        call_ms, sync_ms, fetch_ms = [], [], []
        start = threading.Barrier(peers + 1)

        def peer(k):
            client, session = swarm.connect(url, f"peer{k:03d}", sample), requests.Session()
            start.wait()
            for r in range(rounds):
                groups = _groups(f"peer {k} round {r}", groups_per_post)
                t = time.perf_counter()
                client.publish(r, groups)
                got[k] += [(g["peer"], g["seq"]) for g in client.fetch()]
                call_ms.append(1000 * (time.perf_counter() - t))
                t = time.perf_counter()
                if client.flush(120):
                    acked[k] += [(client.peer, r, g["question"]) for g in groups]
                sync_ms.append(1000 * (time.perf_counter() - t))
                t = time.perf_counter()
                session.get(url + "/rollouts", params={"sample": sample, "exclude": client.peer, "seed": r},
                            timeout=30).json()
                fetch_ms.append(1000 * (time.perf_counter() - t))
            client.flush(120)
            got[k] += [(g["peer"], g["seq"]) for g in client.fetch()]
            client.close()

        threads = [threading.Thread(target=peer, args=(k,)) for k in range(peers)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        stored = {(g["peer"], g["round"], g["question"]) for g in _read_all(url)}
        posted = [key for keys in acked for key in keys]
        return {"posts_per_s": round(len(posted) / groups_per_post / wall, 1),
                "calls_max_ms": round(max(call_ms), 3), "sync_p50_ms": _pct(sync_ms, 0.5),
                "sync_p99_ms": _pct(sync_ms, 0.99), "read_p50_ms": _pct(fetch_ms, 0.5),
                "read_p99_ms": _pct(fetch_ms, 0.99), "groups_posted": len(posted),
                "groups_lost": sum(key not in stored for key in posted),
                "groups_received_per_round": round(sum(map(len, got)) / peers / rounds, 1),
                "received_twice": sum(len(g) - len(set(g)) for g in got),
                "received_own": sum(p == f"peer{k:03d}" for k, g in enumerate(got) for p, _ in g)}
    finally:
        _end(proc, folder)


def _redis_server(folder):
    """redis-server on a free loopback port, durable (appendonly yes, appendfsync always) -> (process, url)."""
    import redis
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", folder, "--save", "",
                             "--appendonly", "yes", "--appendfsync", "always"], stdout=subprocess.DEVNULL)
    url, deadline = f"redis://127.0.0.1:{port}/0", time.time() + 30
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)


def bench_stores(peers=200, rounds=3, local=4, sample=16, workers=8):
    """Both stores in one run, the embedded server (a swarm.py process) and a durable redis-server, under
    `peers` simulated peers in this process: each round every peer publishes `local` groups, then reads
    once: a sampled read of `sample` groups ("sampled"), or, from the embedded server, everything after its
    cursor with GET /rollouts?after= as a dashboard reads ("cursor", up to 250 peers: beyond, it moves
    peers^2 x local groups a round). The peers' exchanges are those of the client's transports (one per
    peer, without a client's thread), from `workers` threads. -> per store: posts/s, read p50/p99 ms, bytes
    read per peer per round, the server's CPU ms per post and per read (from /proc), and its memory."""
    import requests
    import swarm
    from concurrent.futures import ThreadPoolExecutor
    folder, out = tempfile.mkdtemp(prefix="swarm-bench-"), {}
    bytes_per_group = len(swarm._dumps(_groups("x", 1)[0]))
    try:
        for store in ("http", "redis"):
            os.makedirs(os.path.join(folder, store))
            proc, url = _server(os.path.join(folder, store))[:2] if store == "http" else \
                _redis_server(os.path.join(folder, store))
            kind = swarm.HttpTransport if store == "http" else swarm.RedisTransport
            transports, http = [kind(url, f"peer{k:05d}", None) for k in range(peers)], threading.local()

            def post(k, r):
                groups = [swarm._dumps(g) for g in _groups(f"peer {k} round {r}", local)]
                assert transports[k].publish(r, groups, f"peer{k:05d}-{r}")["accepted"] == local

            def read(k, query):
                t, size, after = time.perf_counter(), 0, position[k]
                if query == "sampled":
                    size = sum(n for _, n in transports[k].sample(sample, random.getrandbits(63)))
                    return 1000 * (time.perf_counter() - t), size
                http.s = getattr(http, "s", None) or requests.Session()  # one connection pool a thread
                while True:  # a cursor read takes pages until it is level
                    page = http.s.get(f"{url}/rollouts?after={after}&exclude=peer{k:05d}", timeout=60).json()
                    size += len(swarm._dumps(page["groups"]))
                    if page["next"] in (after, page["last"]):
                        position[k] = page["next"]
                        return 1000 * (time.perf_counter() - t), size
                    after = page["next"]

            r = {"bytes_per_group": bytes_per_group}
            position, cpu0, t0 = [0] * peers, _cpu_seconds(proc.pid), time.perf_counter()
            modes = [("cursor", "cursor")] * (peers <= 250 and store == "http") + [("sampled", "sampled")]
            with ThreadPoolExecutor(workers) as pool:
                for mode, query in modes:
                    post_s = cpu_post = cpu_read = 0.0
                    reads = []
                    for rnd in range(rounds):
                        t, cpu = time.perf_counter(), _cpu_seconds(proc.pid)
                        list(pool.map(post, range(peers), [rnd + 10 * (mode == "sampled")] * peers))
                        post_s, cpu_post = post_s + time.perf_counter() - t, cpu_post + _cpu_seconds(proc.pid) - cpu
                        cpu = _cpu_seconds(proc.pid)
                        reads += list(pool.map(read, range(peers), [query] * peers))
                        cpu_read += (_cpu_seconds(proc.pid) - cpu) * (rnd > 0)
                    ms = [m for m, _ in reads[peers:]]  # the first round's reads include the history
                    r.update({f"{mode}_cpu_ms_per_read": 1000 * cpu_read / len(ms),
                              f"{mode}_posts_per_s": peers * rounds / post_s, f"{mode}_cpu_ms_per_post":
                              1000 * cpu_post / peers / rounds, f"{mode}_read_p50_ms": _pct(ms, 0.5),
                              f"{mode}_read_p99_ms": _pct(ms, 0.99),
                              f"{mode}_read_kb_per_peer_round": sum(b for _, b in reads[peers:]) / len(ms) / 1024})
            r.update(wall_s=time.perf_counter() - t0, server_cpu_s=_cpu_seconds(proc.pid) - cpu0,
                     server_rss_mb=_rss_mb(proc.pid))
            if store == "redis":
                import redis
                r["redis_used_memory_mb"] = redis.Redis.from_url(url).info("memory")["used_memory"] / 2**20
            out[store] = {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}
            for transport in transports:
                transport.close()
            proc.kill()
            proc.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


# -----------------------------------------------------------------------------
# --attack: what the server and the client survive (the figures of docs/swarm.md, Reliability)

def _cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid, field="VmRSS"):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024


def attack_flood(slow=500, seconds=20):
    """`slow` connections held open (a third idle, a third sending headers a byte every 2 s, a third
    declaring a body they never send; each reconnects when the server closes it) while an honest client
    alternates GET /health and POST /rollouts on fresh connections."""
    import socket
    proc, url, folder = _server()
    host, port = url[7:].rsplit(":", 1)
    stop, opened = threading.Event(), [0]

    def connect(k):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.setblocking(False)
        s.send([b"", b"GET /health HTTP/1.1\r\nHost: x\r\n", b"POST /rollouts HTTP/1.1\r\nContent-Length: 99\r\n\r\n{"][k % 3])
        opened[0] += 1
        return s

    def flood():
        conns = [connect(k) for k in range(slow)]
        while not stop.wait(2.0):
            for k, s in enumerate(conns):
                try:
                    if s.recv(65536) == b"":  # (a reply is read and dropped; a close makes a new one)
                        raise OSError("closed")
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    conns[k] = s = connect(k)
                if k % 3 == 1:
                    try:
                        s.send(b"X")
                    except OSError:
                        pass
        for s in conns:
            s.close()

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        time.sleep(3)  # let the flood build up
        cpu0, t0 = _cpu_seconds(proc.pid), time.time()
        honest = _honest(url, seconds)
        cpu = (_cpu_seconds(proc.pid) - cpu0) / (time.time() - t0)
        rss = _rss_mb(proc.pid, "VmHWM")
    finally:
        stop.set()
        flooder.join()
        _end(proc, folder)
    return {"slow_connections": slow, "slow_connects_made": opened[0], **honest, "server_cpu_cores": round(cpu, 3),
            "server_peak_rss_mb": round(rss, 1)}


def _honest(url, seconds, headers=None):
    """An honest client alternating GET /health and POST /rollouts on fresh connections for `seconds`
    -> its failures and latency percentiles (ms)."""
    import requests
    lat, errors, t0, r = {"GET /health": [], "POST /rollouts": []}, 0, time.time(), 0
    while time.time() < t0 + seconds:
        for what in lat:
            t = time.perf_counter()
            try:
                if what.startswith("GET"):
                    ok = requests.get(url + "/health", headers=headers, timeout=10).status_code == 200
                else:
                    ok = requests.post(url + "/rollouts", headers=headers, timeout=10, json={
                        "peer": "honest", "round": r, "batch_id": f"h{r}", "groups": _groups(r, 1)}).status_code == 200
            except requests.RequestException:
                ok = False
            lat[what].append(1000 * (time.perf_counter() - t))
            errors += not ok
        r += 1
        time.sleep(0.1)
    return {"honest_requests": sum(map(len, lat.values())), "honest_errors": errors,
            **{f"{w} p50_ms": _pct(v, 0.5) for w, v in lat.items()}, **{f"{w} p99_ms": _pct(v, 0.99) for w, v in lat.items()}}


def _descriptors(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def attack_busy_cap(busy=1100, limit=1024, seconds=15):
    """`busy` connections that each send one byte of a request line and stop (made again when the server
    closes them), against a server whose descriptor limit is `limit` (so a cap of limit - 64), while an
    honest client alternates GET and POST; the server's peak count of descriptors shows any overshoot."""
    import resource
    import socket
    proc, url, folder = _server(preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    host, port = url[7:].rsplit(":", 1)
    stop, made, peak = threading.Event(), [0], [0]

    def connect():
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.send(b"G")
            s.setblocking(False)
            made[0] += 1
            return s
        except OSError:
            return None

    def hold():
        conns = [connect() for _ in range(busy)]
        while not stop.wait(0.5):
            peak[0] = max(peak[0], _descriptors(proc.pid))
            for k, s in enumerate(conns):
                try:
                    if s is None or s.recv(65536) == b"":
                        raise OSError("closed")
                except BlockingIOError:
                    pass
                except OSError:
                    s and s.close()
                    conns[k] = connect()
        for s in conns:
            s and s.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        time.sleep(3)
        honest = _honest(url, seconds)
        return {"busy_connections": busy, "descriptor_limit": limit, "busy_connects_made": made[0], **honest,
                "server_peak_descriptors": peak[0], "server_alive": proc.poll() is None}
    finally:
        stop.set()
        holder.join()
        _end(proc, folder)


def attack_stalled_bodies(senders=8, seconds=15):
    """With a token: `senders` connections without it, each sending a body of 8 MB minus one byte and then
    stalling (again whenever the server closes them), while an honest client with the token alternates
    GET and POST."""
    import socket
    import swarm
    proc, url, folder = _server(None, "--token", "s3cret")
    host, port = url[7:].rsplit(":", 1)
    stop, made = threading.Event(), [0]
    size = swarm.Limits.body_bytes
    data = b"POST /rollouts HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size + b"x" * (size - 1)

    def sender():
        while not stop.is_set():
            try:
                with socket.create_connection((host, int(port)), timeout=2) as s:
                    made[0] += 1
                    s.sendall(data)
                    while not stop.is_set():
                        try:
                            if s.recv(65536) == b"":
                                break
                        except socket.timeout:
                            pass
            except OSError:
                time.sleep(0.05)

    threads = [threading.Thread(target=sender) for _ in range(senders)]
    for t in threads:
        t.start()
    try:
        time.sleep(3)
        honest = _honest(url, seconds, headers={"Authorization": "Bearer s3cret"})
        return {"stalled_senders": senders, "their_connects": made[0], **honest}
    finally:
        _end(proc, folder, stop, threads)


def attack_parse_bombs(writers=4, seconds=15):
    """`writers` clients posting bodies of nested empty objects without end: 8 MB of {"x":[{},{},...]}
    (2.8 million objects) and the largest such body the server parses (half a million, 1.5 MB), while
    GET /health is timed; the server's peak resident memory."""
    import requests
    import swarm
    proc, url, folder = _server()
    stop, statuses = threading.Event(), {}
    bodies = [b'{"x":[' + b"{}," * (swarm.Limits.body_bytes // 3 - 4) + b"{}]}",
              b'{"x":[' + b"{}," * (swarm.Limits.json_values // 2 - 2) + b"{}]}"]

    def bomber(w):
        session, k = requests.Session(), w
        while not stop.is_set():
            try:
                status = session.post(url + "/rollouts", data=bodies[k % 2], timeout=30).status_code
            except requests.RequestException:
                status = "error"
            statuses[status] = statuses.get(status, 0) + 1
            k += 1

    threads = [threading.Thread(target=bomber, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    health, t0 = [], time.time()
    try:
        while time.time() < t0 + seconds:
            t = time.perf_counter()
            try:
                requests.get(url + "/health", timeout=30)
            except requests.RequestException:
                pass
            health.append(1000 * (time.perf_counter() - t))
            time.sleep(0.05)
        return {"writers": writers, "bomb_replies": {str(k): v for k, v in sorted(statuses.items(), key=str)},
                "health_p50_ms": _pct(health, 0.5), "health_p99_ms": _pct(health, 0.99),
                "health_max_ms": round(max(health), 1), "server_peak_rss_mb": round(_rss_mb(proc.pid, "VmHWM"), 1)}
    finally:
        _end(proc, folder, stop, threads)


def _hostile_requests():
    """(class, raw bytes) of crafted requests; every one must get a 4xx or a clean close, never a 5xx."""
    def post(path, body, extra=b""):
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (path.encode(), len(body), extra, body)

    g = {"task": "t", "question": "q", "answer": "a", "completions": ["c"], "stopped": [True]}
    ok = {"peer": "p", "round": 1, "batch_id": "b", "groups": [g]}
    bad_values = [None, True, -1, 1.5, 10 ** 400, "", "x" * 40_000, "caf\u00e9 <b>", [], [1], {}, {"a": [None]}]
    bad_groups = [dict(g, **{field: v}) for field in g for v in bad_values if not (field == "question" and
                  v in ("", "caf\u00e9 <b>")) and not (field == "answer" and v in ("", "caf\u00e9 <b>"))]
    bad_groups += [{k: v for k, v in g.items() if k != field} for field in g] + [
        "x", None, 5, dict(g, metadata={"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": {}}}}}}}}}}),
        dict(g, completions=["c"] * 65, stopped=[True] * 65), dict(g, metadata={"k": "v" * 17_000})]
    bad_tops = [dict(ok, **{field: v}) for field in ok for v in bad_values if not (field == "groups" and v == [])]
    bad_tops += [{k: v for k, v in ok.items() if k != field} for field in ok] + [
        dict(ok, peer="../x"), dict(ok, batch_id="a/b"), dict(ok, groups=[g] * 300), [ok], "ok"]
    bad_bodies = [b"{", b"[" * 100_000, b"\xff\xfe", b"NaN", b'{"peer": 1e999}', b"1" * 5000, b"null", b"[]",
                  b'{"peer": "p", "round": Infinity}', b"\x00" * 100, b'{"a": "\\ud800"}',
                  json.dumps(dict(ok, groups=[dict(g, question="\ud800")])).encode(), b'{"a": "\xed\xa0\x80"}']
    metrics = [{"peer": "p", "round": 1, "metrics": m} for m in (
        {"a": 10 ** 400}, {"a": 1e300}, {"a": -1e16}, {"a": "x"}, {"a": [1]}, {"a": True}, {"": 1}, {"x" * 65: 1},
        {str(k): 1 for k in range(65)}, [1], None, {"\ud800": 1})] + [{"peer": "<b>", "round": 1, "metrics": {}},
                                                       {"peer": "p", "round": -1, "metrics": {}}]
    get = [b"GET /rollouts?after=-1 HTTP/1.1\r\n\r\n", b"GET /rollouts?limit=0 HTTP/1.1\r\n\r\n",
           b"GET /rollouts?limit=99999 HTTP/1.1\r\n\r\n", b"GET /rollouts?exclude=%3Cb%3E HTTP/1.1\r\n\r\n",
           b"GET /rollouts?" + b"&".join(b"a=%d" % k for k in range(40)) + b" HTTP/1.1\r\n\r\n",
           b"GET /metrics?after=x HTTP/1.1\r\n\r\n", b"GET /nope HTTP/1.1\r\n\r\n", b"GET /../etc/passwd HTTP/1.1\r\n\r\n"]
    methods = [b"%s %s HTTP/1.1\r\nConnection: close\r\n\r\n" % (m, p) for m in (b"HEAD", b"OPTIONS", b"PUT", b"DELETE",
               b"PATCH", b"TRACE", b"CONNECT", b"BREW", b"get") for p in (b"/", b"/health", b"/rollouts", b"/metrics")]
    protocol = [b"OPTIONS * HTTP/1.1\r\n\r\n",
                b"GET http://[::1/x HTTP/1.1\r\n\r\n", b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n",
                b"GET /health HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n",
                b"GET /health HTTP/1.1\r\n" + b"X: a\r\n" * 100 + b"\r\n", b"GET /health HTTP/2.0\r\n\r\n",
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"\x16\x03\x01\x00\xc8\x01\x00\x00\xc4\x03\x03" + bytes(190),
                b"\x00\x01\x02\r\n\r\n", b"GET /health\r\n\r\n", b"GET /health HTTP/1.1\r\nno colon\r\n\r\n",
                b"POST /rollouts HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                b"POST /rollouts HTTP/1.1\r\n\r\n", b"POST /rollouts HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                b"POST /rollouts HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n",
                b"POST /rollouts HTTP/1.1\r\nContent-Length: 100\r\n\r\n{",  # a lying length: waits for the deadline
                b"POST /metrics HTTP/1.1\r\nContent-Length: 10\r\nContent-Length: 99\r\n\r\n0123456789",
                b"POST /metrics HTTP/1.1\r\nContent-Length : 24\r\n\r\nGET /health HTTP/1.1\r\n\r\n",
                b"GET\t/health\tHTTP/1.1\r\n\r\n", b"GET /health HTTP/1.1\r\nX: a\r\n b\r\n\r\n"]
    return ([("bad JSON body", post(p, b)) for b in bad_bodies for p in ("/rollouts", "/metrics")]
            + [("bad batch", post("/rollouts", x)) for x in bad_tops]
            + [("bad group", post("/rollouts", dict(ok, batch_id=f"g{i}", groups=[x]))) for i, x in enumerate(bad_groups)]
            + [("unknown method", r) for r in methods]
            + [("bad metrics", post("/metrics", m)) for m in metrics]
            + [("bad query or path", r) for r in get] + [("protocol abuse", r) for r in protocol]
            + [("fuzzed (fuzzed_requests)", r) for _, r in fuzzed_requests(500, seed=1)])


def fuzzed_requests(n, seed=0):
    """n requests made by mutating valid ones at random (seeded) -> [(mutation, raw bytes)]: a value of the
    JSON body replaced by a hostile one (wrong types, lone surrogates, huge numbers, control characters,
    deep nesting), a field dropped or added, a query parameter changed, or the head bent (a header twice,
    a space before the colon, tabs for spaces, stray bytes). Every length is true, so none waits."""
    rng = random.Random(seed)
    group = {"task": "t", "question": "q", "answer": "a", "metadata": {"k": [1, {"z": "v"}]}, "completions": ["c", "d"],
             "stopped": [True, False], "model": "m"}
    bodies = {"/rollouts": {"peer": "p", "round": 1, "batch_id": "b", "groups": [group]},
              "/metrics": {"peer": "p", "round": 1, "metrics": {"loss": 0.5, "local_reward": None}}}
    nasty = [None, True, False, -1, 0, 2**63, 1.5, -0.0, 1e308, "", "\ud800", "a\udfff", "\ud83d\ude00", "\x00",
             "x" * 70_000, "caf\u00e9", "<b>", "../x", [], [None], [[[[[[[[[[[]]]]]]]]]]], {}, {"\ud800": 1}, {"": 1}]
    raw_nasty = ["1e999", "-1e999", "1" * 5000, "NaN", "-Infinity", '"\\ud800"', '"\\udc00\\ud800"', "[" * 50 + "]" * 50]

    def paths(x, here=()):  # every place a value sits in x
        yield here
        for k, v in (x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()):
            yield from paths(v, here + (k,))

    def head(method, target, body, extra=()):
        lines = [f"{method} {target} HTTP/1.1", "Host: x", "Connection: close", *extra]
        return ("\r\n".join(lines + [f"Content-Length: {len(body)}", "", ""])).encode("latin-1") + body

    out = []
    for _ in range(n):
        path = rng.choice(["/rollouts", "/metrics", "/rollouts?", "/health"])
        body, target = json.loads(json.dumps(bodies.get(path, {}))), path
        kind = rng.choice(["value", "raw value", "drop", "add", "query", "head"] if path in bodies else ["query", "head"])
        text = None
        if kind in ("value", "raw value", "drop", "add"):
            spot = rng.choice([p for p in paths(body) if p])
            parent = body
            for k in spot[:-1]:
                parent = parent[k]
            if kind == "value":
                parent[spot[-1]] = rng.choice(nasty)
            elif kind == "drop":
                del parent[spot[-1]]
            elif kind == "add" and isinstance(parent, dict):
                parent[rng.choice(["\ud800", "x" * 100, "seq", "time", "peer"])] = rng.choice(nasty)
            else:
                marker = "\u0001MARK\u0001"
                parent[spot[-1]] = marker
                text = json.dumps(body).replace(json.dumps(marker), rng.choice(raw_nasty))
        data = (text or json.dumps(body)).encode() if path in bodies else b""
        method = "POST" if path in bodies else "GET"
        if kind == "query":
            method, target = "GET", rng.choice(["/rollouts", "/metrics"]) + "?" + "&".join(
                f"{rng.choice(['after', 'limit', 'exclude', 'x'])}={rng.choice(['0', '-1', '1e3', '%ff', '%00', '%ud800', '9' * 20, '', 'a b', '1&after=2'])}"
                for _ in range(rng.randint(1, 4)))
            data = b""
        raw = head(method, target, data)
        if kind == "head":
            raw = rng.choice([head(method, target, data, [f"Content-Length: {len(data)}"]),
                              head(method, target, data, ["Authorization: Bearer x", "Authorization: Bearer y"]),
                              raw.replace(b"Host: x", b"Host : x"), raw.replace(b" ", b"\t", 2),
                              raw.replace(b"Host: x", b"Host: x\r\n x"), raw.replace(b"HTTP/1.1", b"HTTP/1.1 x", 1),
                              raw.replace(b"Host", bytes([rng.randrange(256)]) + b"Host"), raw.replace(b"\r\n", b"\n"),
                              raw.replace(b"Host: x", b"Host: \xff\x00")])
        out.append((kind, raw))
    return out


def _raw(url, data):
    """Send raw bytes -> the reply's status (0: closed without a reply)."""
    import socket
    host, port = url[7:].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        try:
            s.sendall(data)
            reply = s.recv(65536)
        except OSError:
            reply = b""
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", reply)
    return int(m.group(1)) if m else 0


def attack_hostile():
    """Every crafted request once, 16 at a time -> replies counted by class and status."""
    from concurrent.futures import ThreadPoolExecutor
    import requests
    proc, url, folder = _server()
    try:
        cases = _hostile_requests()
        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(lambda case: _raw(url, case[1]), cases))
        counts = {}
        for (cls, _), status in zip(cases, statuses):
            c = counts.setdefault(cls, {"requests": 0, "2xx": 0, "4xx": 0, "5xx": 0, "closed": 0})
            c["requests"] += 1
            c[f"{status // 100}xx" if status else "closed"] += 1
        alive = requests.get(url + "/health", timeout=5).json()
        return {"classes": counts, "stored_groups_after": alive["groups"], "server_alive": alive["ok"]}
    finally:
        _end(proc, folder)


def attack_kill9(cycles=10, writers=16):
    """kill -9 in the middle of `writers` concurrent writers, `cycles` times: every acknowledged batch
    must be there after each restart, once, under the seq it was acknowledged with."""
    import random
    import requests
    folder, acked, lost, duplicated = tempfile.mkdtemp(prefix="swarm-bench-"), {}, 0, 0
    try:
        for cycle in range(cycles):
            proc, url, _ = _server(folder)
            stop = threading.Event()

            def writer(w):
                session, i = requests.Session(), 0
                while not stop.is_set():
                    key = f"{cycle}-{w}-{i}"
                    try:
                        r = session.post(url + "/rollouts", timeout=10, json={
                            "peer": f"w{w}", "round": i, "batch_id": key, "groups": _groups(key, 2, 2, 100)})
                        if r.status_code == 200:
                            acked[key] = r.json()["seq"]
                    except requests.RequestException:
                        return
                    i += 1

            threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
            for t in threads:
                t.start()
            time.sleep(random.uniform(0.3, 1.0))
            proc.kill()
            proc.wait()
            stop.set()
            for t in threads:
                t.join()
        proc, url, _ = _server(folder)
        seen = {}
        for g in _read_all(url):
            key = g["question"].rsplit(" question ", 1)[0]
            seen.setdefault(key, []).append(g["seq"])
        proc.kill()
        proc.wait()
        for key, seq in acked.items():
            lost += key not in seen or seen[key][-1] != seq
        duplicated = sum(len(s) != 2 for s in seen.values())
        return {"cycles": cycles, "writers": writers, "batches_acknowledged": len(acked),
                "acknowledged_lost": lost, "batches_stored_twice": duplicated}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def attack_client(calls=50):
    """A client against a black hole (accepts, never answers), a trickle (a byte every 2 s), a server
    answering 500s and garbage, and a port nobody listens on: the slowest publish()/fetch()/post_metrics()
    call; then a real server comes up on the same port and everything queued must arrive once."""
    import socket
    import swarm
    results, servers = {}, []

    def hostile(kind, sock):
        conns = []
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                break
            conns.append(conn)

            def answer(conn=conn):
                try:
                    conn.recv(65536)
                    if kind == "500 or garbage":
                        conn.sendall(b"HTTP/1.1 500 Oops\r\nContent-Length: 2\r\n\r\nno" if len(conns) % 2 else b"\x00{[")
                    else:
                        for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n":
                            conn.send(bytes([byte]))
                            time.sleep(2)
                except OSError:
                    pass
            threading.Thread(target=answer, daemon=True).start()
        for conn in conns:
            conn.close()

    kinds = ["black hole", "trickle", "500 or garbage", "down"]
    socks = {}
    for kind in kinds:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        if kind != "down":
            s.listen(64)
        if kind in ("trickle", "500 or garbage"):
            threading.Thread(target=hostile, args=(kind, s), daemon=True).start()
        socks[kind] = s
    clients = {kind: swarm.connect(f"http://127.0.0.1:{s.getsockname()[1]}", f"p{k}", 4) for k, (kind, s) in
               enumerate(socks.items())}
    try:
        slowest = {kind: 0.0 for kind in kinds}
        for r in range(calls):
            for kind, c in clients.items():
                for call in (lambda: c.publish(r, _groups(r, 1)), c.fetch, lambda: c.post_metrics(r, {"x": 1.0})):
                    t = time.perf_counter()
                    call()
                    slowest[kind] = max(slowest[kind], time.perf_counter() - t)
            time.sleep(0.1)
        for kind, s in socks.items():
            port = s.getsockname()[1]
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
            servers.append(swarm.start_server(tempfile.mkdtemp(prefix="swarm-bench-"), port=port))
        for (server, url), (kind, c) in zip(servers, clients.items()):
            flushed = c.flush(60)
            rounds = [int(g["question"].split()[0]) for g in _read_all(url)]
            results[kind] = {"slowest_call_ms": round(1000 * slowest[kind], 2), "delivered_after": flushed,
                             "batches_delivered_once": sorted(rounds) == list(range(calls))}
        return results
    finally:
        for c in clients.values():
            c.close()
        for server, _ in servers:
            shutil.rmtree(server.store.folder, ignore_errors=True)
            server.shutdown()


def _fake_server(answer):
    """A server on loopback whose every GET is answered by answer(path) -> (status, body bytes)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = answer(self.path)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.handle_error = lambda request, address: None  # a client that hangs up mid-reply is no news here
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def _longest_stall(seconds, client=None):
    """The training thread: short steps of work, asking the client for a read (fetch(), which never
    waits) every 0.1 s, as a round would -> the longest it stood still, in seconds."""
    stall, asked = 0.0, 0.0
    last = t0 = time.perf_counter()
    while (now := time.perf_counter()) < t0 + seconds:
        stall, last = max(stall, now - last), now
        if client is not None and now > asked + 0.1:
            client.fetch()
            asked = now
        sum(range(2000))
    return stall


def attack_large_reply(mb=32, seconds=10, closes=5):
    """A server answering every read with `mb` MB of tiny JSON objects, {"groups":[{},{},...]}: the
    longest the training thread stood still while the client's thread took the reply (parsing holds the
    interpreter lock), and the slowest of `closes` close() calls made at moments after a reply went out."""
    import contextlib
    import io
    import swarm
    body = b'{"groups":[' + b",".join([b"{}"] * ((mb << 20) // 3)) + b'],"last":1}'
    sent = threading.Event()

    def answer(path):
        sent.set()
        return 200, body

    httpd, url = _fake_server(answer)
    log = io.StringIO()
    try:
        with contextlib.redirect_stderr(log):
            alone = _longest_stall(seconds / 2)  # what the machine's load alone costs
            client = swarm.connect(url, "victim", 16)
            stall = _longest_stall(seconds, client)
            client.close()
            slowest_close = 0.0
            for k in range(closes):  # at 0.05, 0.3, 0.55, ... s after a reply went out
                sent.clear()
                client = swarm.connect(url, "victim", 16)
                client.fetch()  # (asks for a read)
                sent.wait(30)
                time.sleep(0.05 + 0.25 * k)  # the reply is on its way: close() while the client's thread takes it
                t = time.perf_counter()
                client.close()
                slowest_close = max(slowest_close, time.perf_counter() - t)
        return {"reply_mb": mb, "training_thread_longest_stall_ms": round(1000 * stall, 1),
                "same_without_a_client_ms": round(1000 * alone, 1), "slowest_close_ms": round(1000 * slowest_close, 1),
                "log_lines": log.getvalue().count("swarm client")}
    finally:
        httpd.shutdown()


def attack_poisoned_reads(groups=40, seconds=8):
    """A server that serves, among the groups arriving at 5 a second, one whose question is a lone
    surrogate ("\\ud800", which UTF-8 cannot carry): how many of those published after it the client
    received, and the lines it logged."""
    import contextlib
    import io
    import swarm
    stored = []

    def answer(path):  # every sampled read: all the groups so far (the client hands out none twice)
        return 200, json.dumps({"groups": stored, "last": len(stored)}).encode()

    httpd, url = _fake_server(answer)
    log, got = io.StringIO(), []
    try:
        with contextlib.redirect_stderr(log):
            client = swarm.connect(url, "victim", swarm.Limits.sample_groups)
            for seq in range(1, groups + 1):
                stored.append({**_groups(seq, 1, 2, 80)[0], "peer": "other", "round": seq, "seq": seq, "time": 1.7e9})
                stored[-1]["question"] = "\ud800" if seq == 3 else stored[-1]["question"]
                time.sleep(seconds / groups)
                got += [g["seq"] for g in client.fetch()]
            client.flush(10)
            got += [g["seq"] for g in client.fetch()]
            client.close()
        return {"surrogate": {"published_after_the_poison": groups - 3, "received_of_those": len(set(got) - {1, 2}),
                              "log_lines": log.getvalue().count("swarm client")}}
    finally:
        httpd.shutdown()


def _fake_redis(answer):
    """A Redis-speaking server in a subprocess (so that what it sends is not this process's memory): +OK to
    every command but EVAL and EVAL_RO, answered by `answer`, Python source of a function (name, calls of it
    so far, send) -> None. -> (process, port)."""
    source = f"""import collections, socket, threading
{answer}
def serve(conn):
    f, calls = conn.makefile("rb"), collections.Counter()
    try:
        while (line := f.readline()):
            args = [f.read(int(f.readline()[1:]) + 2)[:-2] for _ in range(int(line[1:]))]
            name = args[0].upper().decode()
            calls[name] += 1
            answer(name, calls[name], conn.sendall) if name in ("EVAL", "EVAL_RO") else conn.sendall(b"+OK\\r\\n")
    except (OSError, ValueError):
        pass
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
while True:
    threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()
"""
    proc = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def attack_redis_reply(mb=16, entries=200_000, seconds=6):
    """A Redis answering every publish with `mb` MB of [{},{},...], then every read with `entries` entries:
    the longest the training thread stood still, and this process's resident memory after each, against
    the machine alone and the memory before (the client refuses both replies past its bounds, and drops
    the connection). Run it alone (--only Redis): other attacks leave this process larger."""
    import contextlib
    import io
    import swarm
    n, crlf = (mb << 20) // 3, b"\r\n"  # the bulk [{},{},...] holds n objects: 3n + 1 bytes
    head, tail, count = b"$%d" % (3 * n + 1) + crlf + b"[", b"{}]" + crlf, b"*%d" % entries + crlf
    fields = b"".join(b"$%d" % len(x) + crlf + x + crlf for x in b"peer p round 0 time 1.0 group {}".split())
    thousand = (b"*2" + crlf + b"$3" + crlf + b"1-0" + crlf + b"*8" + crlf + fields) * 1000  # stream entries
    answer = f"""def answer(name, calls, send):
    if name == "EVAL":
        send({head!r})
        for k in range(0, {n - 1}, 20000):
            send(b"{{}}," * min(20000, {n - 1} - k))
        send({tail!r})
    else:
        send({count!r})
        for _ in range({entries // 1000}):
            send({thousand!r})
"""
    proc, port = _fake_redis(answer)
    log, results = io.StringIO(), {"rss_before_mb": round(_rss_mb(os.getpid()), 1)}
    try:
        with contextlib.redirect_stderr(log):
            results["same_without_a_client_ms"] = round(1000 * _longest_stall(seconds / 2), 1)
            for what in ("publish", "read"):
                client = swarm.connect(f"redis://u:p@127.0.0.1:{port}/0", "victim", 16)
                client.publish(0, _groups(0, 1)) if what == "publish" else None
                results[f"{what}_longest_stall_ms"] = round(1000 * _longest_stall(seconds, client), 1)
                client.close()
                results[f"{what}_rss_after_mb"] = round(_rss_mb(os.getpid()), 1)
        results["log_lines"] = log.getvalue().count("swarm client")
        return results
    finally:
        proc.kill()
        proc.wait()


def attack_memory(keep_mb=64, post_mb=256, writers=4, largest=False):
    """Fill a server with --keep-bytes keep_mb far past it: its disk use and resident memory. Posts of
    32 groups of 8 completions of 1,000 characters (~260 KB), or with `largest` the largest valid bodies
    (4 groups of 64 completions of 31,000 characters: 7.6 MB)."""
    import requests
    proc, url, folder = _server(None, "--keep-bytes", f"{keep_mb}M")
    try:
        empty_rss, peak_disk = _rss_mb(proc.pid), 0
        shape, kb = ((4, 64, 31_000), 7_800) if largest else ((32, 8, 1000), 260)
        body = lambda w, i: {"peer": f"w{w}", "round": i, "batch_id": f"{w}-{i}", "groups": _groups(f"{w}-{i}", *shape)}
        posts = max(1, post_mb * 1024 // kb // writers)

        def writer(w):
            session = requests.Session()
            for i in range(posts):
                while session.post(url + "/rollouts", json=body(w, i), timeout=60).status_code == 503:
                    time.sleep(0.2)  # busy: in flight are 64 MB of bodies already; send it again

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak_disk = max(peak_disk, sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
                                           if os.path.exists(os.path.join(folder, n))))
            time.sleep(0.2)
        disk = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
        return {"keep_mb": keep_mb, "posted_mb": round(posts * writers * kb / 1024), "disk_mb": round(disk / 2**20, 1),
                "peak_disk_mb": round(peak_disk / 2**20, 1), "empty_rss_mb": round(empty_rss, 1),
                "final_rss_mb": round(_rss_mb(proc.pid), 1), "peak_rss_mb": round(_rss_mb(proc.pid, "VmHWM"), 1)}
    finally:
        _end(proc, folder)


# --attack, the store's own bounds and its writers: each case against a shared token and against one
# credential per peer (run both with --against DIR, where DIR/swarm.py predates --peers-file, and that
# column says so). "Honest" writers and readers act beside one attacker, "mallory".

def _guarded(names, *flags):
    """{"shared token": start, "per-peer credentials": start}: start() -> (server process, url, folder, token
    of a writer by name), the server run with `flags` and guarded the one way or the other."""
    tokens = {name: f"token-{name}" for name in names}

    def shared():
        return (*_server(None, "--token", "shared-token", *flags), lambda name: "shared-token")

    def per_peer():
        with tempfile.NamedTemporaryFile("w", suffix=".peers") as f:  # (read once, at the server's start)
            f.write("".join(f"{name} {token}\n" for name, token in tokens.items()))
            f.flush()
            return (*_server(None, "--peers-file", f.name, *flags), tokens.get)

    return {"shared token": shared, "per-peer credentials": per_peer}


def _each_guard(attack, names, *flags):
    """attack(url, token) in a fresh server for each guard -> {guard: its figures}; a server that cannot start
    (an older swarm.py without --peers-file) is said, not raised."""
    results = {}
    for guard, start in _guarded(names, *flags).items():
        try:
            proc, url, folder, token = start()
        except RuntimeError:
            results[guard] = "the server does not start with it"
            continue
        try:
            results[guard] = attack(url, token, proc)
        finally:
            _end(proc, folder)
    return results


def _post(session, url, token, name, round_, groups, batch_id=None):
    """A POST /rollouts as `name` with `token` -> (status, milliseconds)."""
    t = time.perf_counter()
    try:
        status = session.post(url + "/rollouts", headers={"Authorization": f"Bearer {token}"}, timeout=30, json={
            "peer": name, "round": round_, "batch_id": batch_id or f"{name}-{round_}", "groups": groups}).status_code
    except OSError:
        status = "error"
    return status, 1000 * (time.perf_counter() - t)


def _sampled_peers(url, token, reads, k=16, reader="reader"):
    import requests
    peers = []
    for seed in range(reads):
        page = requests.get(f"{url}/rollouts?sample={k}&exclude={reader}&seed={seed}", timeout=30,
                            headers={"Authorization": f"Bearer {token(reader)}"}).json()
        peers += [(g["peer"], g["question"]) for g in page["groups"]]
    return peers


def attack_sybil(names=100, honest=4, reads=100):
    """Four honest writers post two batches each; mallory posts two under each of `names` names (with
    per-peer credentials its own token, whatever it claims), then two as itself. Mallory's share of the
    groups in `reads` sampled reads of 16."""
    import requests
    writers = [f"h{k}" for k in range(honest)]

    def attack(url, token, proc):
        session, refused = requests.Session(), 0
        for r in range(2):
            for w in writers:
                _post(session, url, token(w), w, r, _groups(w, 4, 2, 100))
            for n in range(names):
                refused += _post(session, url, token("mallory"), f"m{n}", r, _groups("mallory", 4, 2, 100))[0] == 403
            _post(session, url, token("mallory"), "mallory", r, _groups("mallory", 4, 2, 100))
        drawn = _sampled_peers(url, token, reads)
        share = sum(q.startswith("mallory") for _, q in drawn) / max(1, len(drawn))
        return {"mallory_share": round(share, 3), "fair_share": round(1 / (honest + 1), 3),
                "writes_refused": refused, "groups_drawn": len(drawn)}

    return {"names": names, **_each_guard(attack, [*writers, "mallory", "reader"])}


def attack_impersonation(rounds=10, reads=100):
    """Alice posts a batch a round; after each, mallory posts two as alice (a window is a writer's newest
    two batches). Of the groups sampled reads draw "from alice", the share that are alice's own."""
    import requests

    def attack(url, token, proc):
        session, refused = requests.Session(), 0
        for r in range(rounds):
            _post(session, url, token("alice"), "alice", r, _groups("genuine", 4, 2, 100))
            _post(session, url, token("bob"), "bob", r, _groups("bob", 4, 2, 100))
            for j in range(2):
                status = _post(session, url, token("mallory"), "alice", 1000 + 2 * r + j, _groups("forged", 4, 2, 100))[0]
                refused += status == 403
        alice = [q for peer, q in _sampled_peers(url, token, reads) if peer == "alice"]
        return {"alice_groups_genuine": round(sum(q.startswith("genuine") for q in alice) / max(1, len(alice)), 3),
                "forged_writes_refused": refused}

    return _each_guard(attack, ["alice", "bob", "mallory", "reader"])


def _honest_posts(url, token, writers, seconds, pace=1.5):
    """Honest writers posting a batch of 4 groups each every `pace` s for `seconds` -> (POST ms, acknowledged
    batch ids)."""
    import requests
    times, acked, stop = [], [], time.time() + seconds

    def writer(w):
        session, r = requests.Session(), 0
        while time.time() < stop:
            status, ms = _post(session, url, token(w), w, r, _groups(f"{w}-{r}", 4, 8, 600))
            times.append(ms)
            if status == 200:
                acked.append(f"{w}-{r}")
            r += 1
            time.sleep(pace)

    threads = [threading.Thread(target=writer, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times, acked


def attack_flood_writer(seconds=20, flooders=4, keep="4M"):
    """Under --keep-bytes 4M: four honest writers post a batch of ~20 KB every 1.5 s (together less than the
    budget), alone for a while, then while mallory posts valid batches of ~40 KB from `flooders` connections
    at full rate. The honest groups still kept at the end, and the honest POST p50 alone and under the flood."""
    import requests
    writers = ["h0", "h1", "h2", "h3"]

    def attack(url, token, proc):
        alone, _ = _honest_posts(url, token, writers, seconds / 4)
        stop, flooded = threading.Event(), [0]

        def flood(f):
            session, r = requests.Session(), 0
            while not stop.is_set():
                flooded[0] += _post(session, url, token("mallory"), "mallory", r, _groups(f"m{f}-{r}", 8, 8, 600),
                                    f"m{f}-{r}")[0] == 200
                r += 1

        threads = [threading.Thread(target=flood, args=(f,)) for f in range(flooders)]
        for t in threads:
            t.start()
        t0 = time.time()
        under, acked = _honest_posts(url, token, writers, seconds)
        stop.set()
        for t in threads:
            t.join()
        mallory_mb = flooded[0] * len(json.dumps(_groups("m0-0", 8, 8, 600))) / 2**20 / (time.time() - t0)
        kept = {g["question"].rsplit(" question ", 1)[0] for g in _read_all(url, token("h0"))}
        return {"honest_batches": len(acked), "honest_kept": round(sum(a in kept for a in acked) / max(1, len(acked)), 3),
                "honest_post_p50_ms_alone": _pct(alone, 0.5), "honest_post_p50_ms_flood": _pct(under, 0.5),
                "mallory_acked_mb_per_s": round(mallory_mb, 1)}

    return {"keep_bytes": keep, **_each_guard(attack, [*writers, "mallory"], "--keep-bytes", keep)}


def attack_write_queue(connections=500, seconds=15):
    """Mallory holds `connections` connections, each posting tiny batches back to back; an honest writer
    posts one tiny batch at a time. Its POST p50 alone, then under the queue."""
    import requests

    def attack(url, token, proc):
        rounds, stop, sent = iter(range(10**9)), threading.Event(), collections.Counter()

        def honest(n):
            session = requests.Session()
            return [_post(session, url, token("honest"), "honest", r, _groups(f"h{r}", 1, 1, 50))[1]
                    for r in itertools.islice(rounds, n)]

        def queue(c):
            session, r = requests.Session(), 0
            while not stop.is_set():
                sent[_post(session, url, token("mallory"), "mallory", r, _groups("m", 1, 1, 50), f"m{c}-{r}")[0]] += 1
                r += 1

        alone = honest(50)

        threads = [threading.Thread(target=queue, args=(c,), daemon=True) for c in range(connections)]
        for t in threads:
            t.start()
        time.sleep(3)
        t0, under = time.time(), []
        while time.time() < t0 + seconds:
            under += honest(1)
        stop.set()
        for t in threads:
            t.join(60)
        return {"honest_post_p50_ms_alone": _pct(alone, 0.5), "honest_post_p50_ms_queue": _pct(under, 0.5),
                "honest_posts_under_queue": len(under), "mallory_replies": dict(sent)}

    return {"connections": connections, **_each_guard(attack, ["honest", "mallory"])}


def _disk_mb(folder):  # what a folder's files take on disk (their blocks)
    paths = [os.path.join(folder, name) for name in os.listdir(folder)]
    return sum(os.stat(p).st_blocks * 512 for p in paths if os.path.isfile(p)) / 2**20


def _tiny_posts(url, n, threads=4, name=lambda r: f"w{r % 4}"):
    """n tiny batches (one group of one short completion; batch r by name(r)), from `threads` threads -> POST ms."""
    import requests
    times = []

    def writer(w):
        session = requests.Session()
        for r in range(w, n, threads):
            times.append(_post(session, url, "", name(r), r, _groups(f"t{r}", 1, 1, 100), f"t{r}")[1])

    workers = [threading.Thread(target=writer, args=(w,)) for w in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return times


def attack_tiny_batches(n=100_000, keep="256M"):
    """n tiny batches under --keep-bytes `keep`: the files and disk they take, the server's memory, its
    start after kill -9 on that folder, and the slowest POST (the one that crosses --keep-bytes prunes)."""
    proc, url, folder = _server(None, "--keep-bytes", keep)
    try:
        t0 = time.time()
        times = _tiny_posts(url, n)
        seconds, rss = time.time() - t0, _rss_mb(proc.pid)
        time.sleep(2)  # (for the files retention is deleting)
        files, disk = len(os.listdir(folder)), _disk_mb(folder)
        proc.kill()
        proc.wait()
        t0 = time.time()
        proc, url, _ = _server(folder, "--keep-bytes", keep)
        start = time.time() - t0
        return {"batches": n, "keep_bytes": keep, "posts_per_s": round(n / seconds), "post_p99_ms": _pct(times, 0.99),
                "post_max_ms": round(max(times), 1), "files": files, "disk_mb": round(disk, 1),
                "server_rss_mb": round(rss, 1), "start_after_kill9_s": round(start, 2),
                "load_average": open("/proc/loadavg").read().split()[0]}
    finally:
        _end(proc, folder)


def attack_many_writers(writers=30_000, reads=200):
    """One tiny batch from each of `writers` writers, then `reads` sampled reads of 16 while another client
    asks GET /health: their latencies (a read that passes over every writer grows with their number)."""
    import requests
    proc, url, folder = _server()
    stop, health, reads_ms = threading.Event(), [], []

    def ask():
        while not stop.is_set():
            t = time.perf_counter()
            requests.get(url + "/health", timeout=30)
            health.append(1000 * (time.perf_counter() - t))
            time.sleep(0.01)

    asker = threading.Thread(target=ask)
    try:
        _tiny_posts(url, writers, 8, name=lambda r: f"w{r}")
        asker.start()
        for seed in range(reads):
            t = time.perf_counter()
            requests.get(f"{url}/rollouts?sample=16&seed={seed}", timeout=30)
            reads_ms.append(1000 * (time.perf_counter() - t))
        return {"writers": writers, "sample16_p50_ms": _pct(reads_ms, 0.5), "sample16_p99_ms": _pct(reads_ms, 0.99),
                "health_p50_ms": _pct(health, 0.5), "health_p99_ms": _pct(health, 0.99)}
    finally:
        _end(proc, folder, stop, [asker] if asker.ident else [])


def attack_unread_replies(readers=200, seconds=30):
    """`readers` connections each ask for a 1 MB page and never read it (a small receive buffer, so that
    the reply waits on the server's side): the kernel's TCP memory (all sockets, /proc/net/sockstat) and
    its orphaned sockets, 2 s in and `seconds` in."""
    import requests
    import socket
    proc, url, folder = _server()
    host, port = url[7:].rsplit(":", 1)
    try:
        for r in range(6):  # about 1.2 MB of groups: a page of 1 MB
            requests.post(url + "/rollouts", timeout=30, json={"peer": "a", "round": r, "batch_id": f"a{r}",
                                                               "groups": _groups(r, 7, 7, 30_000)})

        def sockstat():
            line = next(l for l in open("/proc/net/sockstat") if l.startswith("TCP:")).split()
            return dict(zip(line[1::2], map(int, line[2::2])))

        base, conns, seen = sockstat(), [], {}
        for _ in range(readers):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(b"GET /rollouts?after=0&limit=1024 HTTP/1.1\r\nHost: x\r\n\r\n")
            conns.append(s)
        t0 = time.time()
        for at in (2, seconds):
            time.sleep(max(0, t0 + at - time.time()))
            now = sockstat()
            seen[f"at_{at}s"] = {"tcp_mem_mb": round((now["mem"] - base["mem"]) * 4096 / 2**20, 1),
                                 "orphans": now["orphan"] - base["orphan"]}
        for s in conns:
            s.close()
        return {"readers": readers, **seen}
    finally:
        _end(proc, folder)


def bench_attack(args):
    global SWARM_PY
    SWARM_PY, q = os.path.join(os.path.abspath(args.against or HERE), "swarm.py"), args.quick
    print(f"server: {SWARM_PY}; load average {' '.join(open('/proc/loadavg').read().split()[:3])}", flush=True)
    attacks = {"slow-connection flood": lambda: attack_flood(args.slow), "hostile requests": attack_hostile,
               "busy connections at the cap": attack_busy_cap, "stalled bodies without the token": attack_stalled_bodies,
               "parse bombs": attack_parse_bombs, "kill -9 cycles": lambda: attack_kill9(args.cycles),
               "client vs bad servers": attack_client, "client vs a large reply": attack_large_reply,
               "client vs poisoned reads": attack_poisoned_reads, "client vs large Redis replies": attack_redis_reply,
               "memory and disk": attack_memory,
               "memory and disk, largest bodies": lambda: attack_memory(256, 512, 16, largest=True),
               "sybil: one writer under many names": lambda: attack_sybil(20 if q else 100, reads=20 if q else 100),
               "impersonation: posting as alice": lambda: attack_impersonation(3 if q else 10, 20 if q else 100),
               "flood: one writer at full rate under --keep-bytes 4M": lambda: attack_flood_writer(4 if q else 20),
               "write queue: many writer connections": lambda: attack_write_queue(50 if q else 500, 4 if q else 15),
               "tiny batches: files, disk, memory, start": lambda: attack_tiny_batches(*(
                   (3000, "1M") if q else (100_000, "256M"))),
               "pruning: the post that crosses --keep-bytes": lambda: attack_tiny_batches(*(
                   (3000, "300K") if q else (100_000, "24M"))),
               "many writers: sampled reads": lambda: attack_many_writers(*((1000, 20) if q else (30_000, 200))),
               "unread replies: kernel memory": lambda: attack_unread_replies(*((20, 25) if q else (200, 30)))}
    for name, fn in attacks.items():
        if args.only and not any(word in name for word in args.only):
            continue
        t0 = time.time()
        r = fn()
        print(json.dumps({"what": name, **r, "seconds": round(time.time() - t0, 1)}) if args.json else
              f"{name} ({time.time() - t0:.0f} s): {json.dumps(r)}", flush=True)


def report(r, args):
    if args.json:
        print(json.dumps(r), flush=True)
        return
    line = (f"{r['what']:6s} {r['model']:14s} {r['device']:5s} batch {r['batch']:4d}: "
            f"ours {r['tok_per_s']:10,.0f} tok/s   transformers {r['hf_tok_per_s']:10,.0f} tok/s   "
            f"ratio {r['ratio']:5.2f}x")
    if "roofline_pct" in r:
        line += f"   {r['roofline_pct']:.0f}% of the bandwidth roofline"
    if "peak_gb" in r:
        line += f"   peak memory {r['peak_gb']:.2f} GB vs {r['hf_peak_gb']:.2f} GB ({r['memory_ratio']:.2f}x)"
    print(line, flush=True)


# -----------------------------------------------------------------------------
# reward.py's scorers against reasoning_gym's: python bench.py --parity N


_OTHER_DIGITS = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")  # Arabic-Indic digits, which int() and Decimal() read


def near_misses(item):
    """Answers close to the item's answer, as a model might write them: other case, spacing and
    separators, equal numbers spelled otherwise, LaTeX, partial or padded answers, and nearly right
    ones (off by one, another weekday, an unreduced fraction, a premise instead of a conclusion)."""
    a, meta = item["answer"], item["metadata"]
    out = [a.upper(), a.lower(), a.title(), a.replace(" ", "  "), a.replace(" ", ", "), a.replace(" ", ""),
           a.replace("\n", " "), a.replace("\n", "\n\n"), f"The answer is {a}", f"{a}.", f"${a}$",
           f"\\boxed{{{a}}}", a[:len(a) // 2], a + a[-1:]]
    with localcontext(Context(prec=60)):
        try:
            x = Decimal(a)
            out += [str(x + 1), str(x - 1), str(-x), f"+{a}", f"0{a}", f"{a}0" if "." in a else f"{a}.0",
                    f"{x:,}", f"{x:e}", f"{x:.2f}", f"{x:.3f}", f"{x:.4f}", str(x + Decimal("0.0004")),
                    str(x - Decimal("0.0011")), str(float(x)), f"{a} days", a.translate(_OTHER_DIGITS)]
        except ArithmeticError:  # not a number
            pass
    if a in reward._DAYS:
        out += [reward._DAYS[(reward._DAYS.index(a) + 1) % 7], a[:3], f"It was a {a}."]
    if a in ("Yes", "No"):
        out += ["No" if a == "Yes" else "Yes", "True", "Y"]
    if "simplified_numerator" in meta:
        p, q, n, d = (meta[k] for k in ("simplified_numerator", "simplified_denominator", "numerator", "denominator"))
        latex = f"\\frac{{{p}}}{{{q}}}"
        out += [f"{p}/{q}", f"{p} / {q}", latex, f"${latex}$", f"\\dfrac{{ {p} }}{{ {q} }}", latex.upper(),
                f"{latex} is it", f"{n}/{d}", f"{2 * p}/{2 * q}", f"{q}/{p}", f"-{p}/{q}", f"{p}:{q}", f"{p / q:.3f}",
                f"{p}/{q} = {p / q:.2f}", f"{p}/{d}", f"{n}/{q}", f"{p}/{q}/1"]
    if re.fullmatch(r"[0-9]+( [0-9]+)*(\n[0-9]+( [0-9]+)*)*", a):  # a grid: arc_1d, binary_matrix
        rows = [[int(v) for v in line.split()] for line in a.split("\n")]
        lines = a.split("\n")
        out += [str(rows), str(tuple(map(tuple, rows))), json.dumps(rows), "[" + "]\n [".join(lines) + "]",
                str((int(a[0]) + 1) % 10) + a[1:], "\n".join(line + " " for line in lines), "; ".join(lines),
                reward._grid(zip(*rows)), str(rows[0]) if len(rows) == 1 else str(rows[:-1])]
    if "premises" in meta:
        premises = meta["premises"]
        ascii_ = a.replace("∧", "&").replace("∨", "|").replace("→", "->").replace("↔", "<->").replace("¬", "~")
        out += [ascii_, a.replace("∧", "and"), f"({a})", f"(({a}))", f"¬({a})", f"¬{a}", "¬¬" + a, *premises,
                f"({premises[0]} ∧ {premises[-1]})", "(P ∨ ¬P)", "P", "Q", "p", "Z", "P ∧ Q", "(P → P)"]
        m = re.fullmatch(r"\((¬?[A-Z]) (.) (¬?[A-Z])\)", a)
        if m:
            out.append(f"({m[3]} {m[2]} {m[1]})")
    seen = {a, ""}
    return [v for v in (v.strip() for v in out) if not (v in seen or seen.add(v)) and "answer>" not in v]


def parity(n, seed=0):
    """Agreement between our scorers and reasoning_gym's for each of the nine families: on n of rg's
    items (its reference answer, then near_misses of it) and on n of ours (rg's scorer must give our
    reference answer 1.0, and agree with ours on near misses). Returns a dict of counts per family
    and the disagreements as (family, whose item, answer, our score, rg's score)."""
    tag = "<answer>{}</answer>".format
    rows, diffs = [], []

    def agree(ours, theirs, answers, whose):
        """How many answers our scorer (on item ours) and rg's (on item theirs) give the same score."""
        scores = [(v, reward.score(ours, tag(v)), reward.score(theirs, tag(v))) for v in answers]
        diffs.extend((ours["task"], whose, v, a, b) for v, a, b in scores if not math.isclose(a, b, abs_tol=1e-9))
        return sum(math.isclose(a, b, abs_tol=1e-9) for _, a, b in scores)

    for name in reward.PAPER_TASKS:
        rg_task = reward.get_task("rg:" + name)
        rg_rng, our_rng = random.Random(f"parity {seed} {name} rg"), random.Random(f"parity {seed} {name} ours")
        row = dict(family=name, n=n, refs=0, variants=0, variants_n=0, accepts=0, ours=0, ours_n=0)
        for _ in range(n):
            theirs = rg_task.generate(rg_rng)
            mine, misses = {**theirs, "task": name}, near_misses(theirs)
            row["refs"] += agree(mine, theirs, [theirs["answer"]], "rg's")
            row["variants"] += agree(mine, theirs, misses, "rg's")
            row["variants_n"] += len(misses)
            ours = reward.TASKS[name].generate(our_rng)
            as_rg, misses = {**ours, "task": rg_task.name}, near_misses(ours)
            row["accepts"] += reward.score(as_rg, tag(ours["answer"])) == 1.0
            row["ours"] += agree(ours, as_rg, misses, "our")
            row["ours_n"] += len(misses)
        rows.append(row)
    return rows, diffs


def print_parity(n):
    """Print parity(n) as docs/rewards.md's Markdown table, then every disagreement."""
    from importlib.metadata import version
    rows, diffs = parity(n)
    rows.append({k: "all" if k == "family" else sum(r[k] for r in rows) for k in rows[0]})
    print(f"Agreement with reasoning_gym {version('reasoning-gym')} score_answer, {n} items per family\n")
    print("| family | rg's reference answers | rg's items, near misses | rg accepts our reference answers "
          "| our items, near misses |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k]}/{r[m]} ({100 * r[k] / max(r[m], 1):.1f}%)" for k, m in
                 (("refs", "n"), ("variants", "variants_n"), ("accepts", "n"), ("ours", "ours_n"))]
        print(f"| {r['family']} | " + " | ".join(cells) + " |")
    for name, whose, v, a, b in diffs:
        print(f"differs: {name}, {whose} item: answer {v!r}: ours {a:.4g}, rg {b:.4g}")

# -----------------------------------------------------------------------------
# the reading path: how much a student reads before each component file's marker line

COMPONENTS = ["reward.py", "model.py", "sample.py", "grpo.py", "swarm.py", "train.py"]  # the README's order
MARKER = "# ----- Nothing below this line is needed to understand SAPO: plumbing follows. -----"
BUDGETS = dict(reading=1700, whole=4550, function=60, readme=250)  # lines: reading path, six files, a function, README


def line_counts(folder=HERE):
    """Per component file: lines up to its marker (the reading path, docstrings included; the whole file
    when it has no marker), whole lines, and its longest function (name, lines)."""
    import ast
    rows = []
    for name in COMPONENTS:
        text = open(os.path.join(folder, name), encoding="utf-8").read()
        lines = text.splitlines()
        reading = next((k for k, line in enumerate(lines) if line.strip() == MARKER), len(lines))
        funcs = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        rows.append(dict(file=name, reading=reading, whole=len(lines), markers=lines.count(MARKER),
                         longest=max(funcs, key=lambda f: f[1], default=("-", 0))))
    return rows


def readme_lines(folder=HERE):
    with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
        return len(f.read().splitlines())


def print_lines():
    rows = line_counts()
    print("| file | reading path | whole file | longest function |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['file']} | {r['reading']} | {r['whole']} | {r['longest'][0]} ({r['longest'][1]}) |")
    reading, whole = sum(r["reading"] for r in rows), sum(r["whole"] for r in rows)
    longest = max(r["longest"][1] for r in rows)
    print(f"| all six | {reading} (budget {BUDGETS['reading']}) | {whole} (budget {BUDGETS['whole']}) | "
          f"{longest} (budget {BUDGETS['function']}) |")
    print(f"| README.md | | {readme_lines()} (budget {BUDGETS['readme']}) | |")
    missing = [r["file"] for r in rows if r["markers"] != 1]
    if missing:
        print(f"no single marker line in: {', '.join(missing)}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", nargs="+", default=None, help=f"folder, Hub id, or a shape: {', '.join(SHAPES)}")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="rows per batch (several allowed)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256, help="sampled tokens per row (training: seq = prompt + new)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each side; the best counts")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--train", action="store_true", help="measure a training step instead of sampling")
    p.add_argument("--tasks", nargs="+", choices=["easy", "paper"], help="--train: prompts of these tasks "
                   "(default: easy on a CPU, paper on CUDA)")
    p.add_argument("--generations", type=int, nargs="+", help="--train: G, completions per prompt (default: 4; CUDA 8)")
    p.add_argument("--completion-tokens", type=int, nargs="+", help="--train: tokens per completion (default: 64; CUDA 256)")
    p.add_argument("--micro-tokens", type=int, help="--train: tokens per forward and backward (default: train.py's)")
    p.add_argument("--grad-checkpoint", action=argparse.BooleanOptionalAction, help="--train: recompute "
                   "activations in the backward pass (default: train.py's, on for a CPU)")
    p.add_argument("--swarm", action="store_true", help="measure the rollout server under simulated peers")
    p.add_argument("--peers", type=int, default=32, help="--swarm: simulated peers")
    p.add_argument("--rounds", type=int, default=20, help="--swarm: rounds each peer posts and polls")
    p.add_argument("--store-peers", type=int, default=200, help="--swarm: simulated peers for both stores")
    p.add_argument("--attack", action="store_true", help="what the server and client survive (docs/swarm.md)")
    p.add_argument("--slow", type=int, default=500, help="--attack: slow connections held open")
    p.add_argument("--cycles", type=int, default=10, help="--attack: kill -9 cycles")
    p.add_argument("--only", nargs="+", help="--attack: only the attacks whose names hold one of these words")
    p.add_argument("--against", metavar="DIR", help="--attack: run the server from DIR/swarm.py (e.g. an older checkout)")
    p.add_argument("--quick", action="store_true", help="--attack: small sizes, to check the attacks run (no figures)")
    p.add_argument("--parity", type=int, metavar="N", help="reward.py's scorers vs reasoning_gym's, N items per family")
    p.add_argument("--lines", action="store_true", help="the reading path and file sizes against their budgets")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement")
    p.add_argument("--train-side", choices=["packed", "rows", "hf"], help=argparse.SUPPRESS)  # one side of --train
    args = p.parse_args()
    if args.train_side:
        return train_side(args)
    if args.lines:
        return print_lines()
    if args.parity is not None:
        if reward.reasoning_gym is None:
            p.error("--parity needs reasoning_gym: pip install reasoning-gym==0.1.25")
        if args.parity < 1:
            p.error("--parity needs a positive number of items")
        return print_parity(args.parity)
    if args.attack:
        return bench_attack(args)
    if args.swarm:
        if args.store_peers < 2:
            p.error("--store-peers needs at least 2 peers")
        r = dict(what="swarm", **bench_swarm(peers=args.peers, rounds=args.rounds))
        print(json.dumps(r) if args.json else "swarm: " + ", ".join(f"{k} {v:,.1f}" if isinstance(v, float)
                                                                    else f"{k} {v}" for k, v in r.items() if k != "what"))
        try:
            stores = bench_stores(peers=args.store_peers, rounds=3)
        except (ImportError, OSError, RuntimeError) as e:  # no redis-py, or no redis-server to start
            sys.exit(f"bench.py: the store bench needs redis-server and redis-py (pip install redis): {e}")
        for store, r in stores.items():
            print(json.dumps(dict(what=f"store {store}", **r)) if args.json else f"store {store}, "
                  f"{args.store_peers} peers: " + ", ".join(f"{k} {v}" for k, v in r.items()))
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.py: --device cuda was asked for but torch sees no CUDA GPU")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cpu = device.type == "cpu"
    models = args.model or (["smollm2-135m"] if cpu else ["smollm2-135m", "qwen2.5-0.5b"])
    if args.batch is None:
        args.batch = ([16] if args.train else [8]) if cpu else ([64] if args.train else [1, 64, 256])
    for k, v in TRAIN_DEFAULTS["cpu" if cpu else "cuda"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.train and min(args.batch + args.generations + args.completion_tokens + [args.micro_tokens]) < 1:
        p.error("--train needs a positive --batch, --generations, --completion-tokens and --micro-tokens")
    torch.set_grad_enabled(args.train)
    if args.train and any(m not in SHAPES for m in models):
        sys.exit(f"bench.py: --train measures the shapes {', '.join(SHAPES)} (random weights)")
    for name in models:
        (bench_train if args.train else bench_sampling)(args, name, device, dtype)


if __name__ == "__main__":
    main()
