"""
Speed of nanoSAPO's hand-written parts, measured side by side with Hugging Face transformers on the
same shapes and batch, and the load the rollout server takes.

    python bench.py                     # sampling: our generate() vs transformers' generate()
    python bench.py --train             # one GRPO training step's forward + backward: tokens/s, peak memory
    python bench.py --swarm             # the rollout server under 32 simulated peers on loopback
    python bench.py --device cuda --model qwen2.5-0.5b --batch 64 256 --json

Sampling: both samplers draw at temperature 1 with no top-k/top-p, exactly --new-tokens tokens per
row (stop tokens off), from --batch random prompts of --prompt-tokens tokens. They run alternately
after a warm-up, --repeats times each, and the best time of each counts. On CUDA the report adds the
share of the memory-bandwidth roofline: every decode step must read all weights and the KV cache
filled so far, so (bytes per step x steps / time) / peak bandwidth says how close to the hardware
limit the sampler runs.

Training: our model's final hidden states go through grpo.hidden_logprobs (the log-prob of each
target token, computed chunk by chunk and recomputed in the backward pass), against transformers'
model whose full logits go through log_softmax + gather, the usual way. Both backpropagate the mean
log-prob over a (batch x seq) batch. Peak memory is torch.cuda.max_memory_allocated on CUDA and the
peak resident memory above the process's size after imports on the CPU; each side runs in a fresh
process of its own, so neither sees the other's memory.

Swarm: a server in a subprocess and --peers simulated peers (threads) that each publish one batch
of groups and fetch the others' every round, for --rounds rounds: posts per second, p50/p99 fetch
latency, and acknowledged groups missing from a final full read (must be 0).

--model takes a model folder or Hub id (sampling only), or one of the shapes below with random
weights (no download). This file follows no part of the SAPO paper; it exists because a SAPO peer
spends most of its time sampling and training, and a swarm lives or dies by its server.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch

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


def bench_train(args, name, device, dtype):
    """Each side runs in a fresh process of its own, so its peak memory is its own: weights, gradients,
    activations and temporaries (torch.cuda.max_memory_allocated on CUDA, peak resident memory above
    the process's size after imports on the CPU). Random weights of the right shape."""
    results = []
    for batch in args.batch:
        sides = {}
        for side in ("ours", "hf"):
            cmd = [sys.executable, os.path.abspath(__file__), "--train-side", side, "--model", name,
                   "--device", str(device), "--dtype", str(dtype).removeprefix("torch."), "--batch", str(batch),
                   "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
                   "--repeats", str(args.repeats)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"bench.py: the {side} training step failed:\n{out.stderr[-2000:]}")
            sides[side] = json.loads(out.stdout.strip().splitlines()[-1])
        T = args.prompt_tokens + args.new_tokens
        r = dict(what="train", model=name, device=str(device), batch=batch, seq=T,
                 tok_per_s=sides["ours"]["tok_per_s"], hf_tok_per_s=sides["hf"]["tok_per_s"])
        r["ratio"] = r["tok_per_s"] / r["hf_tok_per_s"]
        r.update(peak_gb=sides["ours"]["peak_bytes"] / 1e9, hf_peak_gb=sides["hf"]["peak_bytes"] / 1e9)
        r["memory_ratio"] = r["peak_gb"] / max(r["hf_peak_gb"], 1e-9)
        results.append(r)
        report(r, args)
    return results


def train_side(args):
    """One side of --train in this process: forward + backward of the mean log-prob of every token."""
    import resource
    import grpo
    import model as M
    from transformers import AutoConfig, AutoModelForCausalLM
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    base_rss = rss_bytes()
    torch.manual_seed(0)
    cfg_dict = dict(SHAPES[args.model[0]])
    if args.train_side == "ours":
        model = M.Transformer(M.config_from_hf(cfg_dict), cfg_dict).to(device=device, dtype=dtype)
        model.init_rope()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg_dict), dtype=dtype,
                                                     attn_implementation="sdpa")
    model.train()
    batch, T = args.batch[0], args.prompt_tokens + args.new_tokens
    ids = torch.randint(0, 32000, (batch, T), generator=torch.Generator().manual_seed(batch)).to(device)

    def step():
        if args.train_side == "ours":
            logp = grpo.hidden_logprobs(model.hidden(ids[:, :-1]), model.lm_head.weight, ids[:, 1:])
        else:
            logits = model(ids[:, :-1]).logits
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        logp.mean().backward()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()  # warm-up; the gradients exist from here on, as in training
    times = [timed(step, device) for _ in range(args.repeats)]
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    print(json.dumps(dict(tok_per_s=batch * (T - 1) / min(times), peak_bytes=peak)))


def bench_swarm(peers=32, rounds=20, groups_per_post=4, completions=8, completion_chars=600):
    """-> {"posts_per_s", "fetch_p50_ms", "fetch_p99_ms", "groups_posted", "groups_lost"}.
    posts_per_s counts acknowledged posts over the wall time of the whole run (fetches included);
    groups_lost counts acknowledged groups missing from a final full read (must be 0)."""
    import requests
    import swarm
    folder = tempfile.mkdtemp(prefix="swarm-bench-")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "swarm.py")
    proc = subprocess.Popen([sys.executable, script, "--dir", folder, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        m = re.fullmatch(r"swarm server: (http://\S+)", proc.stdout.readline().strip())
        if not m:
            raise RuntimeError("the swarm server did not start")
        url = m.group(1)
        acked = [[] for _ in range(peers)]       # (peer, round, question) of each acknowledged group
        fetch_ms = [[] for _ in range(peers)]
        start = threading.Barrier(peers + 1)
        filler = "Let me think step by step. " * (completion_chars // 27 + 1)

        def peer(k):
            client = swarm.SwarmClient(url, f"peer{k:03d}", timeout=30)
            start.wait()
            for r in range(rounds):
                groups = [{"task": "basic_arithmetic", "question": f"peer {k} round {r} question {i}",
                           "answer": str(i), "metadata": {"i": i},
                           "completions": [(f"{j} " + filler)[:completion_chars - 20] + f"<answer>{j}</answer>"
                                           for j in range(completions)],
                           "stopped": [True] * completions, "model": "bench"} for i in range(groups_per_post)]
                if client.publish(r, groups):
                    acked[k] += [(client.peer, r, g["question"]) for g in groups]
                t = time.perf_counter()
                client.fetch()
                fetch_ms[k].append(1000 * (time.perf_counter() - t))

        threads = [threading.Thread(target=peer, args=(k,)) for k in range(peers)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0

        stored, after = set(), 0
        while True:  # the final full read
            data = requests.get(url + "/rollouts", params={"after": after, "limit": swarm.MAX_LIMIT}, timeout=30).json()
            stored.update((g["peer"], g["round"], g["question"]) for g in data["groups"])
            if data["next"] == after:
                break
            after = data["next"]
        posted = [key for keys in acked for key in keys]
        times = sorted(ms for per_peer in fetch_ms for ms in per_peer)
        return {"posts_per_s": round(len(posted) / groups_per_post / wall, 1),
                "fetch_p50_ms": round(times[len(times) // 2], 2),
                "fetch_p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))], 2),
                "groups_posted": len(posted),
                "groups_lost": sum(key not in stored for key in posted)}
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)



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
    p.add_argument("--swarm", action="store_true", help="measure the rollout server under simulated peers")
    p.add_argument("--peers", type=int, default=32, help="--swarm: simulated peers")
    p.add_argument("--rounds", type=int, default=20, help="--swarm: rounds each peer posts and polls")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement")
    p.add_argument("--train-side", choices=["ours", "hf"], help=argparse.SUPPRESS)  # one side of --train
    args = p.parse_args()
    if args.train_side:
        return train_side(args)
    if args.swarm:
        r = dict(what="swarm", **bench_swarm(peers=args.peers, rounds=args.rounds))
        print(json.dumps(r) if args.json else "swarm: " + ", ".join(f"{k} {v:,.1f}" if isinstance(v, float)
                                                                    else f"{k} {v}" for k, v in r.items() if k != "what"))
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.py: --device cuda was asked for but torch sees no CUDA GPU")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cpu = device.type == "cpu"
    models = args.model or (["smollm2-135m"] if cpu else ["smollm2-135m", "qwen2.5-0.5b"])
    if args.batch is None:
        args.batch = ([4] if args.train else [8]) if cpu else ([64] if args.train else [1, 64, 256])
    torch.set_grad_enabled(args.train)
    if args.train and any(m not in SHAPES for m in models):
        sys.exit(f"bench.py: --train measures the shapes {', '.join(SHAPES)} (random weights)")
    for name in models:
        (bench_train if args.train else bench_sampling)(args, name, device, dtype)


if __name__ == "__main__":
    main()
