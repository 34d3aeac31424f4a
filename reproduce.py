"""
The paper's experiment in one command: peers that share rollouts (a swarm) against peers that train
alone (in silo), at the same batch size, with the paper's table and figure for this machine's run.

    python reproduce.py                  # --preset toy on a CPU (5 seeds), gpu on CUDA
    python reproduce.py --preset lab     # a class's lab: the silo against a swarm in minutes, one verdict
    python reproduce.py --seeds 10       # more seeds (or --seeds 3,7,11): a tighter interval
    python reproduce.py --sweep          # where sharing helps: gain against initial success rate
    python reproduce.py --mixed          # two toys of other sizes and tokenizers, each against its own silo
    python reproduce.py --diagnose       # also measure what shared completions do to their receivers

SAPO (arXiv 2509.08721, Sec. 4, Table 1 and Fig. 2) compares configurations I/J: every round every
peer trains on I groups of its own and J drawn from what the other peers shared, I + J = 8, and 8/0
is the silo baseline. The measure is cumulative reward, every peer's reward summed over every round,
as a ratio to 8/0 seed by seed (peer k of every configuration gets the same questions and sampling
seeds). I/J+NAME runs the receivers' selection rule NAME of train.RULES instead of the paper's (4/4+is,
beyond the paper, trains shared completions against their senders' log-probs; 4/4+keep-all keeps shared
groups whose rewards are all equal; 4/4+plausible only those the receiver's own model could have written;
4/4+whole only the shared completions that fit the receiver's own length limit uncut).
docs/reproduce.md says what the toy is, why sharing helps it, and what the lab, the diagnosis, the sweep
and the mixed swarm found.

Deviations from the paper, and why:
- Peers run in one process and trade through a real swarm.py server on loopback, in synchronous
  rounds as in the paper's controlled runs (--async: round-robin), so a run is deterministic.
- Scale: the toy (--preset toy, built and pre-trained here in about a minute) has 26 facts to learn,
  8 peers and 150 rounds, not nine task families and 2,000 rounds. The gpu preset (the default
  model, 100 rounds of 8/0 and 4/4) has not yet run on a GPU; it prints its own time estimate first.
- Reward: the toy's is strict 0/1 (alphabet_position is not a ReasoningGym family); the gpu preset
  scores with reward.py, which agrees with ReasoningGym (partial credit included).
"""

import argparse
import ast
import concurrent.futures
import functools
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import random
import shutil
import time

import torch

import grpo
import model as M
import reward
import swarm
import train

# -----------------------------------------------------------------------------
# settings: what each preset runs; every value can be overridden by its flag

PRESETS = {
    # tiny models built here, on the CPU (4 configurations x 3 seeds took 7 minutes on 2 quiet cores)
    "toy": dict(configs="8/0,6/2,4/4,4/4+is,2/6", peers=8, seeds=5, rounds=150, generations=8, max_new_tokens=None,
                lr=1e-3, micro_tokens=4096, model="toy", tasks="alphabet_position", guess=0.3, one_shot=False,
                device="cpu"),
    # a class's lab: the toy's silo against a swarm of 4, sized to end in minutes on 2 CPU cores
    "lab": dict(configs="8/0,4/4", peers=4, seeds=4, rounds=100, generations=8, max_new_tokens=None, lr=1e-3,
                micro_tokens=4096, model="toy", tasks="alphabet_position", guess=0.3, one_shot=False, device="cpu"),
    # the default model (or --model) on one GPU; the size is a guess until measured: the estimate
    # printed before the run starts says how long it will take on this machine
    "gpu": dict(configs="8/0,4/4", peers=8, seeds=1, rounds=100, generations=8, max_new_tokens=256,
                lr=1e-5, micro_tokens=8192, model=M.DEFAULT_MODEL, tasks="auto", guess=None, one_shot=True,
                device="cuda"),
}
TOY_PRESETS = ("toy", "lab")  # the presets that build their models here (TOYS)
MIXED_CONFIGS = "8/0,4/4,4/4+is"  # --mixed's default --configs
# --sweep: toys from rare to common success, as (--guess, --known): success ~ guess / 26 + known
SWEEP_TOYS = [(0.1, 0.0), (0.3, 0.0), (0.3, 0.25), (0.3, 0.5), (1.0, 0.0)]  # the last: uniform guesses alone
SWEEP_CONFIGS = "8/0,4/4,4/4+is"  # --sweep's default --configs
SWEEP_PEERS = [2, 4, 8]         # --sweep: swarm sizes
PAPER = {"8/0": 561.79, "6/2": 854.43, "4/4": 1093.31, "2/6": 945.87}  # cumulative reward, paper Table 1


def parse_args(argv=None):
    presets = "; ".join(f"{n}: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in d.items()
                                      if v is not None and k not in ("one_shot", "device"))
                        for n, d in PRESETS.items())
    p = argparse.ArgumentParser(description="swarm against silo: the SAPO paper's comparison (arXiv 2509.08721)",
                                epilog=f"A flag left out takes its preset's value. Presets: {presets}.")
    train.one_line(p, "reproduce.py")  # errors: one line, and where to look
    a = p.add_argument
    a("--preset", choices=sorted(PRESETS), default=None, help="toy on a CPU, gpu on CUDA (default: by device); "
      "lab: a class's lab, 8/0 against 4/4 in minutes on a CPU")
    a("--configs", default=None, help="comma list of I/J configurations, 8/0 (the silo) the baseline; I/J+NAME runs "
      "the selection rule NAME of train.RULES: " + ", ".join(train.RULES))
    a("--peers", type=int, default=None, help="peers per configuration (paper: 8)")
    a("--seeds", default=None, help="paired seeds per configuration: a count N (seeds 0 to N-1) or a comma list "
      "such as 3,7,11 (one seed: 7,)")
    a("--rounds", type=int, default=None, help="rounds per run")
    a("--generations", type=int, default=None, help="G: completions per question")
    a("--max-new-tokens", type=int, default=None, help="completion length limit in tokens")
    a("--lr", type=float, default=None, help="learning rate of every peer")
    a("--model", default=None, help="model folder or Hub id, or a comma list whose models the peers take in turn; "
      "toy preset: the toys built here, 'toy' (word-level) or 'toy,chars' (--mixed)")
    a("--mixed", action="store_true", help="toy: a mixed swarm, the word-level toy and a larger character-level one "
      f"in turn (--model toy,chars), each against its own silo (default --configs {MIXED_CONFIGS})")
    a("--tasks", default=None, help="gpu preset: train.py's --tasks")
    a("--micro-tokens", type=int, default=None, help="tokens per forward/backward, whole groups (same result, less memory)")
    a("--guess", type=float, default=None, help="toy: fraction of pre-training answers that are uniform guesses")
    a("--known", type=float, default=0.0, help="toy: fraction of the questions it is pre-trained to answer right (0)")
    a("--pretrain-steps", type=int, default=1000, help="toy: supervised steps that build the toy model (1000)")
    a("--sample-every", type=int, default=10, help="write some completions to samples.jsonl every K rounds (10)")
    a("--async", dest="sync", action="store_false", help="round-robin peers instead of synchronous rounds")
    a("--diagnose", action="store_true", help="also measure, per round, log-probs and gradient norms of own vs "
      "shared completions (slower; results.json and table.md get a diagnosis by quarter of the run)")
    a("--sweep", action="store_true", help="toy: gain of 4/4 and 4/4+is over 8/0 against initial success, per swarm size")
    a("--sweep-toys", default=None, help="--sweep: comma list of toys as guess:known (default: "
      + ",".join(f"{g}:{k}" for g, k in SWEEP_TOYS) + ")")
    a("--sweep-peers", default=None, help="--sweep: comma list of swarm sizes (default: "
      + ",".join(map(str, SWEEP_PEERS)) + ")")
    a("--jobs", type=int, default=None, help="runs in parallel (default: CPU cores for toy, 1 on a GPU)")
    a("--out", default=None, help="run folder (default: runs/reproduce-<date-time>); one that holds a run gets "
      "the new run in a sub-folder, run-2, run-3, ...")
    a("--toy-cache", default=os.path.join("runs", "toys"), help="toy presets: where built toys are kept and "
      "reused, by everything that decides them (default: runs/toys)")
    args = p.parse_args(argv)
    if args.preset is None:
        args.preset = "gpu" if torch.cuda.is_available() else "toy"
    if args.sweep and args.configs is None:
        args.configs = SWEEP_CONFIGS
    if args.mixed:
        args.model, args.configs = args.model or "toy,chars", args.configs or MIXED_CONFIGS
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.preset in TOY_PRESETS and not set(args.model.split(",")) <= set(TOYS):
        p.error(f"the toy preset builds its models: --model is a comma list of {', '.join(TOYS)}")
    if args.max_new_tokens is None:  # the toy's: its longest answer and the stop token
        args.max_new_tokens = max(TOYS[kind]["max_new_tokens"] for kind in args.model.split(","))
    check_args(p, args)
    args.jobs = args.jobs or ((os.cpu_count() or 1) if args.device == "cpu" else 1)
    args.out = args.out or os.path.join("runs", time.strftime("reproduce-%Y%m%d-%H%M%S"))
    return args


def check_args(p, args):
    """parse_args' checks of the settings (the preset's values filled in): one sentence from argparse for
    what cannot run; the parsed --configs (config_list) and --sweep's toys and sizes into args."""
    try:
        args.config_list = parse_configs(args.configs)
        args.seeds = parse_seeds(args.seeds)
    except ValueError as e:
        p.error(str(e))
    if args.peers < 2 or args.rounds < 2 or args.generations < 2 or args.max_new_tokens < 1:
        p.error("need --peers >= 2, --rounds >= 2, --generations >= 2 and --max-new-tokens >= 1")
    if args.peers > 64:  # every peer of a run lives in this one process
        p.error("--peers is at most 64 (the paper's swarm has 8 peers)")
    if not (args.lr > 0 and args.micro_tokens >= 1 and args.pretrain_steps >= 1 and args.sample_every >= 0
            and (args.jobs is None or args.jobs >= 1)):
        p.error("--lr must be positive, --micro-tokens, --pretrain-steps and --jobs at least 1, "
                "--sample-every at least 0")
    if args.preset in TOY_PRESETS and not 0 < args.guess <= 1:
        p.error("--guess must be in (0, 1]: the toy needs some lucky guesses to learn from")
    if not 0 <= args.known <= 1:
        p.error("--known must be a fraction from 0 to 1")
    if args.sweep and args.preset not in TOY_PRESETS:
        p.error("--sweep varies the toy's pre-training: run it with --preset toy")
    if args.mixed and args.preset not in TOY_PRESETS:
        p.error("--mixed builds two toys: with --preset gpu give --model A,B (the peers take them in turn)")
    if args.sweep and "," in args.model:
        p.error("--sweep varies one toy's pre-training: leave out --mixed")
    try:
        args.toys = [tuple(float(x) for x in t.split(":")) for t in args.sweep_toys.split(",")] if args.sweep_toys \
            else SWEEP_TOYS
        args.sizes = [int(n) for n in args.sweep_peers.split(",")] if args.sweep_peers else SWEEP_PEERS
        if any(len(t) != 2 for t in args.toys):
            raise ValueError("a toy is guess:known")
    except ValueError:
        p.error("--sweep-toys is a comma list of guess:known such as 0.3:0,1:0, --sweep-peers one of sizes such as 2,8")
    if not all(0 < t[0] <= 1 and 0 <= t[1] <= 1 for t in args.toys) or \
            not all(2 <= n <= 64 for n in args.sizes):
        p.error("--sweep-toys needs 0 < guess <= 1 and 0 <= known <= 1, --sweep-peers sizes from 2 to 64")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--preset gpu needs a CUDA GPU; use --preset toy on a CPU")


def parse_configs(text):
    """'8/0,4/4,4/4+is' -> [(8, 0), (4, 4), (4, 4, "is")]: 8/0 first (the baseline), I >= 1, J >= 0.
    I/J runs the paper's selection rule; I/J+NAME the rule NAME of train.RULES (+is: shared completions
    trained against their senders' log-probs; +paper is I/J)."""
    configs = []
    for part in text.split(","):
        head, plus, rule = part.strip().partition("+")
        try:
            I, J = (int(x) for x in head.split("/"))
        except ValueError:
            raise ValueError(f"--configs: {part.strip()!r} is not I/J or I/J+RULE, e.g. 4/4") from None
        if I < 1 or J < 0 or I + J > 64:
            raise ValueError(f"--configs: {part.strip()} needs I >= 1, J >= 0 and I + J <= 64")
        if plus and (rule not in train.RULES or (J == 0) != in_silo(rule)):
            raise ValueError(f"--configs: {part.strip()}: a rule is one of {', '.join('+' + r for r in train.RULES)}"
                             f"; {', '.join('+' + r for r in train.RULES if in_silo(r))} run in silo (J = 0), "
                             "the others need shared groups (J > 0)")
        config = (I, J) if rule in ("", "paper") else (I, J, rule)
        if config not in configs:
            configs.append(config)
    if (8, 0) not in configs:
        raise ValueError("--configs must include 8/0: every ratio is taken against the silo baseline")
    return [(8, 0)] + [c for c in configs if c != (8, 0)]


def in_silo(rule):
    """Whether a rule of train.RULES is a silo baseline (Rule.silo: it changes what a peer makes of its own
    groups), not a receiver's selection rule: 8/0+resample and 8/0+positive-silo, never 4/4+resample."""
    return train.RULES[rule].silo


def name(config):
    """(4, 4) -> '4/4', (4, 4, 'is') -> '4/4+is'."""
    return f"{config[0]}/{config[1]}" + "".join("+" + rule for rule in config[2:])


def rule_of(config):
    """The selection rule a configuration runs: (4, 4) -> 'paper', (4, 4, 'keep-all') -> 'keep-all'."""
    return config[2] if len(config) > 2 else "paper"


def parse_seeds(value):
    """--seeds: a count, 3 -> [0, 1, 2], or a comma list, '3,7,11' -> [3, 7, 11] ('7,' -> [7])."""
    text = str(value).strip()
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()] if "," in text else list(range(int(text)))
    except ValueError:
        raise ValueError(f"--seeds: {text!r} is neither a count such as 5 nor a comma list such as 3,7,11") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds) or len(seeds) > 100:
        raise ValueError(f"--seeds: {text!r} must give 1 to 100 different seeds, none below 0")
    return seeds

# -----------------------------------------------------------------------------
# the toy: a word-level tokenizer and a 2-layer model, pre-trained here in seconds

SPECIALS = ["<pad>", "[UNK]", "<|im_start|>", "<|im_end|>"]
# the toy's chat template leaves out the system turn: its pre-training taught it the answer format, and
# a prompt of ~15 tokens instead of ~55 makes every round three times cheaper
CHAT_TEMPLATE = ("{% for m in messages if m['role'] != 'system' %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
                 "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def toy_tokenizer(tasks=("alphabet_position",)):
    """A word-level tokenizer for the toy: every word of the tasks' questions and worked solutions, the
    numbers 0-199, <answer> and </answer> as single tokens, a chat template without a system turn: a
    few hundred tokens. Text round-trips exactly (decode, then encode, gives the same ids), except
    for special tokens sampled inside a completion, which decoding drops."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    split = pre_tokenizers.Whitespace()
    texts = []
    for task in tasks:
        for i in range(200):
            item = reward.get_task(task).generate(random.Random(i))
            texts.append(item["question"] + " " + reward.solution(item))
    words = {w for t in texts for w, _ in split.pre_tokenize_str(t.replace("<answer>", " ").replace("</answer>", " "))}
    words = sorted(words | {str(i) for i in range(200)} | {"system", "user", "assistant"})
    vocab = {t: i for i, t in enumerate(SPECIALS + ["<answer>", "</answer>"] + words)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = split
    tk.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tk.add_tokens([AddedToken("<answer>", special=False), AddedToken("</answer>", special=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>",
                                   unk_token="[UNK]", chat_template=CHAT_TEMPLATE)


def chars_tokenizer(tasks=None):
    """The second toy's tokenizer: one token per character (printable ASCII; anything else is [UNK]), with
    <answer> and </answer> as single tokens and the same chat template. The same answer is other ids
    than the word-level toy's: "<answer> 17 </answer>" is 6 tokens here (the spaces and each digit), 3
    there. Text round-trips exactly (decoding joins the characters back)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + ["<answer>", "</answer>"] + [chr(c) for c in range(32, 127)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tk.add_tokens([AddedToken("<answer>", special=False), AddedToken("</answer>", special=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>", unk_token="[UNK]",
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


# the toys --model can name (toy preset): a tokenizer and a size each; "toy,chars" is a mixed swarm (--mixed)
# and the completion length limit its answer needs ("<answer> 17 </answer>" and the stop token)
TOYS = {"toy": dict(tokenizer=toy_tokenizer, dim=64, layers=2, max_new_tokens=4,  # 106k parameters
                    what="word-level tokenizer, 2 layers of width 64"),
        "chars": dict(tokenizer=chars_tokenizer, dim=96, layers=3, max_new_tokens=8,  # 269k parameters
                      what="one token per character, 3 layers of width 96")}


def toy_model(tok, dim=64, layers=2, seed=0):
    """A Llama-family transformer for `tok` (~110k parameters for alphabet_position at the defaults),
    weights N(0, 0.02), output layer untied from the embedding (tied, the noise of rare-reward steps on
    the output rows also moves the inputs, and the toy's answer format broke more often)."""
    hf = dict(model_type="llama", vocab_size=len(tok), hidden_size=dim, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * dim, hidden_act="silu",
              max_position_embeddings=512, rope_theta=1000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = M.Transformer(M.config_from_hf(hf), hf)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    model.stop_ids = [tok.eos_token_id]
    return model


def belief(task, item, known):
    """The toy's fixed answer to a question: the right one for a `known` fraction of the questions,
    otherwise the answer of another item. Both are drawn with the question as the seed, so the same
    question always gets the same belief."""
    if random.Random("known: " + item["question"]).random() < known:
        return item["answer"]
    rng = random.Random("belief: " + item["question"])
    while True:
        other = task.generate(rng)
        if other["answer"] != item["answer"]:
            return other["answer"]


def pretrain_toy(model, tok, task_name, guess, known=0.0, steps=1000, batch=16, lr=3e-3, seed=0):
    """Supervised steps on "<answer> A </answer>" + stop, where A is the question's belief, or with
    probability `guess` the answer of a random question (for alphabet_position right 1 time in 26)."""
    task, rng = reward.get_task(task_name), random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        rows = []
        for _ in range(batch):
            item = task.generate(rng)
            answer = task.generate(rng)["answer"] if rng.random() < guess else belief(task, item, known)
            completion = tok(f"<answer> {answer} </answer>", add_special_tokens=False)["input_ids"]
            rows.append((reward.prompt_ids(tok, item, False), [completion + [tok.eos_token_id]]))  # a group of one
        packed = grpo.pack(rows, tok.pad_token_id, [tok.eos_token_id])
        loss = -(grpo.completion_logprobs(model, packed, 1.0) * packed["M"]).sum() / packed["M"].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model.eval()


def build_toy(folder, guess, known=0.0, task_name="alphabet_position", steps=1000, log=print, seed=0, kind="toy"):
    """The toy model `kind` (TOYS) as a Hugging Face folder (built once; a folder already there is reused):
    its weights drawn and its pre-training questions drawn with `seed`, so seed s of a run has a toy of
    its own (seed 0's is the toy of a one-seed run)."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    t0, toy = time.time(), TOYS[kind]
    tok = toy["tokenizer"]([task_name])
    model = toy_model(tok, toy["dim"], toy["layers"], seed)
    model = pretrain_toy(model, tok, task_name, guess, known, steps, seed=seed)
    M.save_model(model, tok, folder)
    size = sum(p.numel() for p in model.parameters())
    log(f"built the toy model in {folder} ({size / 1e3:.0f}k parameters, {time.time() - t0:.0f} s)")
    return folder


def toy_folder(root, base, seed):
    """Where seed's toy goes: ROOT/BASE for seed 0 (e.g. toy-model), ROOT/BASE-seed1 for seed 1, ..."""
    return os.path.join(root, base + (f"-seed{seed}" if seed else ""))


def _build_job(job):
    """One toy, built into the cache in a worker process with its share of the cores, and its success before
    training (written beside it, before.json, for the next run)."""
    folder, kind, guess, known, task_name, steps, seed, max_new_tokens, threads = job
    torch.set_num_threads(threads)
    t0 = time.time()
    build_toy(folder, guess, known, task_name, steps, log=lambda *a: None, seed=seed, kind=kind)
    success = initial_success(folder, task_name, max_new_tokens=max_new_tokens)
    before = dict(toy_before(folder), **{str(max_new_tokens): success})
    with open(os.path.join(folder, "before.json.tmp"), "w") as f:
        json.dump(before, f)
    os.replace(os.path.join(folder, "before.json.tmp"), os.path.join(folder, "before.json"))
    return time.time() - t0, success


def toy_before(folder):
    """A cached toy's before.json: {max_new_tokens: (success per completion, share of mixed groups)}."""
    path = os.path.join(folder, "before.json")
    return {k: tuple(v) for k, v in M.read_json(path).items()} if os.path.exists(path) else {}


TOY_CODE = ("TOYS", "toy_tokenizer", "chars_tokenizer", "toy_model", "belief", "pretrain_toy", "build_toy",
            "initial_success")  # what of this file decides a toy (and its success before training)


@functools.lru_cache(maxsize=1)
def toy_code():
    """A hash of the code that decides a toy: TOY_CODE's text in this file, the files it calls and torch's
    version. A change to any of them builds the cached toys anew."""
    here = os.path.dirname(os.path.abspath(__file__))
    read = lambda name: open(os.path.join(here, name), encoding="utf-8").read()  # noqa: E731
    mine = read("reproduce.py")
    parts = [ast.get_source_segment(mine, node) for node in ast.parse(mine).body
             if getattr(node, "name", None) in TOY_CODE or any(getattr(t, "id", None) in TOY_CODE
                                                               for t in getattr(node, "targets", []))]
    parts += [read(name) for name in ("model.py", "grpo.py", "reward.py", "sample.py")] + [torch.__version__]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def toy_cached(cache, kind, seed, guess, known, steps, task_name):
    """A toy's folder in the cache, named by everything that decides it: its kind, task, --guess, --known,
    --pretrain-steps, seed and the code's version (toy_code)."""
    return os.path.join(cache, f"{kind}-{task_name}-guess{guess}-known{known}-steps{steps}-seed{seed}-{toy_code()}")


def build_toys(s, seeds, root, guess, known, base="toy", log=print):
    """Every seed's toys, each built with that seed (its weights and its pre-training questions), s.jobs at
    a time: seed s of a run trains on toys of its own, so a seed-to-seed spread includes the toy's. One
    toy per kind of s.model ('toy', or 'toy,chars' for a mixed swarm). Each is built once into s.toy_cache
    (toy_cached) and copied into root. Returns {seed: [folder per kind]} and {seed: [(success per
    completion, share of mixed groups) before training, per kind]}."""
    kinds = s.model.split(",")
    folders = {seed: [toy_folder(root, f"{base}-{'model' if kind == 'toy' else kind}", seed) for kind in kinds]
               for seed in seeds}
    cached = {(seed, i): toy_cached(s.toy_cache, kind, seed, guess, known, s.pretrain_steps, s.tasks)
              for seed in seeds for i, kind in enumerate(kinds)}
    threads = max(1, (os.cpu_count() or 1) // s.jobs)  # as in main, so seed 0's toy is a one-seed run's
    jobs = [(cached[seed, i], kind, guess, known, s.tasks, s.pretrain_steps, seed, s.max_new_tokens, threads)
            for seed in seeds for i, kind in enumerate(kinds)
            if str(s.max_new_tokens) not in toy_before(cached[seed, i])]
    if len(jobs) < len(cached):
        log(f"{len(cached) - len(jobs)} of {len(cached)} toys were built before: reused from {s.toy_cache}")
    if jobs:
        log(f"building {len(jobs)} toys, {min(s.jobs, len(jobs))} at a time, once: {s.toy_cache} keeps them for the "
            "next run")
    for job, (seconds, success) in pool_map(_build_job, jobs, min(s.jobs, len(jobs))) if jobs else ():
        log(f"built the toy model in {job[0]} ({train.count_params(job[0]) / 1e3:.0f}k parameters, {seconds:.0f} s; "
            f"before training {success[0]:.2%} of completions right, {success[1]:.0%} of groups mixed)")
    for (seed, i), folder in cached.items():
        if not os.path.exists(folders[seed][i]):
            shutil.copytree(folder, folders[seed][i], ignore=shutil.ignore_patterns("before.json*"))
    return folders, {seed: [toy_before(cached[seed, i])[str(s.max_new_tokens)] for i in range(len(kinds))]
                     for seed in seeds}


@torch.no_grad()
def initial_success(folder, task_name, one_shot=False, questions=256, G=8, max_new_tokens=4, seed=12345):
    """(reward per completion, fraction of groups with mixed rewards) of a model before any RL step."""
    import sample
    model, tok = M.load_model(folder, "cpu", torch.float32, log=lambda *a: None)
    rng = random.Random(seed)
    items = [reward.get_task(task_name).generate(rng) for _ in range(questions)]
    outs = sample.generate(model, [reward.prompt_ids(tok, it, one_shot) for it in items], num_samples=G,
                           max_new_tokens=max_new_tokens, eos_token_ids=model.stop_ids or [tok.eos_token_id],
                           seed=seed)
    rewards = [reward.score(items[i // G], tok.decode(o, skip_special_tokens=True)) for i, o in enumerate(outs)]
    groups = [rewards[i:i + G] for i in range(0, len(rewards), G)]
    return sum(rewards) / len(rewards), sum(len(set(g)) > 1 for g in groups) / len(groups)

# -----------------------------------------------------------------------------
# --diagnose: what a shared completion does to its receiver (why swarm peers slow down mid-run)


class CountingPeer(train.Peer):
    """A peer that also counts, each round, the external groups it trains on that another model sent
    (the wire's `model` field is not its own) and those it trains against their sender's log-probs
    (--shared-logprobs, where the sender's tokenizer is its own); the completions it sampled itself
    (a resampling silo's further batches too: the round's cost) and the informative groups its GRPO
    step was given (after a silo baseline's filter). learn() returns them beside the round's metrics
    (not in metrics.jsonl)."""

    def choose_external(self, r):
        external, counts = super().choose_external(r)
        own = train.label(self.args.model)
        with_logprobs = [g for g in external if any(lp is not None for lp in g.logprobs or [])]
        self.counts = dict(external_other_model=sum(g.item.get("model") != own for g in external),
                           external_sender_logprobs=len(with_logprobs))
        return external, counts

    def batch(self, groups):  # update() makes the batch of the groups it trains on, and only then
        self.trained = sum(map(train.informative, groups))
        return super().batch(groups)

    def learn(self, r, collected):
        sampled = sum(len(g.completions) for g in collected["groups"] + collected.get("extra", []))
        m = super().learn(r, collected)
        return dict(m, **self.counts, completions_sampled=sampled, informative_trained=self.trained)


class DiagnosedPeer(CountingPeer):
    """A peer that, before each GRPO step, also measures its batch split into its own groups and the
    shared ones (diagnose); learn() returns the measures beside the round's metrics."""

    def update(self, groups):
        self.diagnosis = diagnose(self, groups)
        return super().update(groups)

    def learn(self, r, collected):
        return dict(super().learn(r, collected), **self.diagnosis)


class NoStep:
    """An optimizer that leaves the weights alone: grpo.step given it measures the gradient, returns
    its norm (before clipping) and clears it."""

    def __init__(self, model):
        self.model = model

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def diagnose(peer, groups):
    """The peer's batch split into its own groups (local) and the shared ones (external): the mean
    reward of each, its mean log-prob per token under the current model (how off-policy shared text
    is), and the gradient norm of the peer's own GRPO step with the other kind's advantages set to 0
    (the same settings, normaliser and loss: grpo.step, given NoStep). grad_share is the shared half's
    share of the two norms, grad_external / (grad_local + grad_external); a kind absent from the batch
    gets None."""
    batch, rewards, adv = peer.batch(groups)
    external = torch.tensor([g.external for g in groups for _ in g.completions])
    packed = grpo.pack(batch, peer.pad_id, peer.stop_ids, peer.model.lm_head.weight.device)
    with torch.no_grad():
        logp = grpo.completion_logprobs(peer.model, packed, peer.args.temperature, peer.amp_dtype)
    out = {}
    for kind, keep in (("local", ~external), ("external", external)):
        if not keep.any():
            out.update({f"lp_{kind}": None, f"grad_{kind}": None, f"reward_{kind}": None})
            continue
        out[f"reward_{kind}"] = float(rewards[keep].mean())
        others_zero = (adv * keep).tolist()  # the other kind's advantages set to 0
        step = grpo.step(peer.model, NoStep(peer.model), batch, others_zero, **peer.grpo_settings(groups))
        out[f"grad_{kind}"] = step["grad_norm"]
        out[f"lp_{kind}"] = float(logp[keep][packed["M"][keep]].mean())
    out["grad_share"] = None
    if out["grad_local"] is not None and out["grad_external"] is not None:
        out["grad_share"] = out["grad_external"] / max(out["grad_local"] + out["grad_external"], 1e-12)
    return out


# -----------------------------------------------------------------------------
# one run: one configuration and one seed, N peers in this process trading through a real server


def peer_args(s, model, I, J, seed, k, folder, url, rule="paper"):
    """train.py's settings for peer k of a run (its defaults for this device, then this run's values, all
    checked by parse_args above), with the selection rule `rule` (train.RULES, and the flags it sets): its
    seed depends only on (seed, k), never on I, J or the rule."""
    args = train.parse_args(["--model", model, "--tasks", s.tasks, "--device", s.device, "--rule", rule])
    vars(args).update(out=folder, name=f"peer{k}", seed=train.peer_seed(seed, k), local=I, external=J,
                      generations=s.generations, max_new_tokens=s.max_new_tokens, lr=s.lr, rounds=s.rounds,
                      quiet=True, save_every=0, micro_tokens=s.micro_tokens, sample_every=s.sample_every,
                      one_shot=s.one_shot, swarm=url if J > 0 else None,
                      grad_checkpoint=args.grad_checkpoint and s.preset not in TOY_PRESETS)  # the toy is tiny
    return args


def run(s, models, config, seed, folder, Peer=None):
    """Train s.peers peers of configuration (I, J) for s.rounds rounds, peer k on models[k % len(models)]
    (a list of model folders, or one). Synchronous (s.sync): every peer samples and publishes, then every
    peer fetches and trains. Otherwise round-robin: each peer does its whole round in turn. Silo peers
    (J = 0) get no server. Returns per-peer lists of round metrics (CountingPeer's counts too). Peer: the
    class of the peers (default: CountingPeer, DiagnosedPeer with --diagnose)."""
    I, J, rule = config[0], config[1], rule_of(config)
    models = [models] if isinstance(models, str) else models
    os.makedirs(folder, exist_ok=True)
    server, url = swarm.start_server(os.path.join(folder, "swarm")) if J > 0 else (None, None)
    log_file = open(os.path.join(folder, "log.txt"), "a")
    peers, t0, cpu0 = [], time.time(), time.process_time()

    def settle(p, r):  # until p's batches are stored and a read it begins now is done
        if p.client is not None and not p.client.flush(timeout=60):
            print(f"round {r}: {p.name} did not catch up with the server in 60 s", file=log_file)
    try:
        Peer = Peer or (DiagnosedPeer if s.diagnose else CountingPeer)
        for k in range(s.peers):
            log = lambda *a, k=k: print(f"peer{k}:", *a, file=log_file, flush=True)  # noqa: E731
            peers.append(Peer(peer_args(s, models[k % len(models)], I, J, seed, k, folder, url, rule), log=log))
        history, seconds = [[] for _ in peers], []
        for r in range(s.rounds):
            t = time.time()
            if s.sync:  # each sampled read (flush() waits for one) begins once all it may see is settled:
                collected = []  # the same run every time
                for p in peers:  # one at a time: a peer's batch is stored before the next peer samples
                    collected.append(p.collect(r))
                    settle(p, r)
                for p in peers:  # then every peer reads the round's whole window
                    settle(p, r)
                for k, p in enumerate(peers):
                    history[k].append(p.learn(r, collected[k]))
                for p in peers:  # and the read each fetch() asked for ends before anyone samples again
                    settle(p, r)
            else:
                for k, p in enumerate(peers):
                    history[k].append(p.round(r))
            seconds.append(time.time() - t)
    finally:
        for p in peers:
            if p.client is not None:
                p.client.close()
        if server is not None:
            server.shutdown()
        log_file.close()
    return {"peers": history, "seconds": time.time() - t0, "cpu_seconds": time.process_time() - cpu0,
            "round_seconds": seconds}


def _run_job(job):
    """One (configuration, seed) run in a worker process, with its share of the cores."""
    s, models, config, seed, folder, threads = job
    torch.set_num_threads(threads)
    return config, seed, run(s, models, config, seed, folder)


def run_all(s, models, configs, seeds, folder, log=print):
    """Every configuration for every seed, s.jobs runs at a time; seed's runs on models[seed] (a list of model
    folders: peer k runs the k-th in turn). Returns {(config, seed): run}."""
    workers = min(s.jobs, len(configs) * len(seeds))
    jobs = [(s, models[seed], c, seed, os.path.join(folder, f"seed{seed}", name(c).replace("/", "-").replace("+", "-")),
             max(1, (os.cpu_count() or 1) // workers)) for seed in seeds for c in configs]
    results, t0 = {}, time.time()

    def report(config, seed, result):
        results[(config, seed)] = result
        cum, took = sum(m["local_reward"] for peer in result["peers"] for m in peer), (time.time() - t0) / 60
        pace = sum(x["seconds"] for x in results.values()) / len(results) / 60  # minutes a run, so far
        left = pace * (len(jobs) - len(results)) / workers  # runs still to finish, `workers` at a time
        log(f"  {name(config):>6} seed {seed}: cumulative local reward {cum:7.1f}  ({result['seconds']:.0f} s; "
            f"{len(results)}/{len(jobs)} runs done, {took:.1f} min, about {left:.0f} min left at this pace)")
    for job, result in pool_map(_run_job, jobs, workers):
        report(*result)
    return results


def pool_map(work, jobs, workers):
    """(job, work(job)) for every job, in this process if workers is 1, else `workers` processes at a time
    (in the order they finish)."""
    if workers == 1:
        yield from ((job, work(job)) for job in jobs)
        return
    # spawn, not fork: a forked child inherits the parent's OpenMP threads in an unusable state
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(work, job): job for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()

# -----------------------------------------------------------------------------
# statistics: the paper's cumulative reward, paired over seeds

# two-sided 95% quantiles of Student's t with 1..20 degrees of freedom (more: 2.0 is close enough)
T95 = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11,
       2.10, 2.09, 2.09]


def mean_se(xs):
    """Mean, standard error of the mean, 95% interval and the seed-to-seed spread (sample standard
    deviation) of a few numbers, None where undefined. [1.4, 1.5, 1.6] -> mean 1.5, sd 0.1, se 0.0577
    (sd / sqrt(3)), ci95 [1.25, 1.75] (t with 2 degrees of freedom: 4.30)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return dict(mean=None, se=None, ci95=None, sd=None)
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return dict(mean=m, se=None, ci95=None, sd=None)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    se, t = sd / math.sqrt(len(xs)), T95[len(xs) - 2] if len(xs) - 1 <= len(T95) else 2.0
    return dict(mean=m, se=se, ci95=[m - t * se, m + t * se], sd=sd)


def cumulative(result, key, rounds):
    """The paper's measure: `key` summed over every peer and the first `rounds` rounds."""
    return sum(m[key] for peer in result["peers"] for m in peer[:rounds])


def curve(result, window):
    """Per round: the mean over peers of each peer's running-mean local reward, and its min and max."""
    out = []
    for r in range(len(result["peers"][0])):
        values = [sum(m["local_reward"] for m in peer[max(0, r - window + 1):r + 1]) / min(window, r + 1)
                  for peer in result["peers"]]
        out.append((sum(values) / len(values), min(values), max(values)))
    return out


def summarise(runs, configs, seeds, rounds):
    """results.json's per-configuration figures: cumulative local and batch reward (whole run and first
    half) as mean +- s.e. over seeds and as ratios to 8/0 of the same seed; external groups used per
    round, and informative ones (rewards not all equal) trained on per round; the fraction of peer-rounds
    without an optimizer step; wall time; the curve for the figure; the cost (cost()).
    A configuration with a rule (4/4+is) also gets its local reward as a ratio to the same I/J under the
    paper's rule, seed by seed (ratio_to_paper_rule), where that ran, and every configuration its ratio to
    each silo baseline that ran (ratio_to_silo: 8/0+resample, ...)."""
    base, window, summary = (8, 0), max(1, rounds // 20), {}
    silos = [c for c in configs if c[1] == 0 and c != base]
    for c in configs:
        entry = {}
        for span, n in (("whole", rounds), ("first_half", rounds // 2)):
            for key in ("local_reward", "batch_reward"):
                values = [cumulative(runs[c, s], key, n) for s in seeds]
                bases = [cumulative(runs[base, s], key, n) for s in seeds]
                ratios = [v / b if b > 0 else None for v, b in zip(values, bases)]
                entry.setdefault(span, {})[f"cumulative_{key}"] = dict(mean_se(values), per_seed=values)
                entry[span][f"ratio_{key}"] = dict(mean_se(ratios), per_seed=ratios,
                                                   seeds_above_1=sum(r is not None and r > 1 for r in ratios))
            if len(c) > 2 and c[:2] in configs:
                plain = [cumulative(runs[c[:2], s], "local_reward", n) for s in seeds]
                ratios = [v / b if b > 0 else None for v, b in
                          zip(entry[span]["cumulative_local_reward"]["per_seed"], plain)]
                entry[span]["ratio_to_paper_rule"] = dict(mean_se(ratios), per_seed=ratios,
                                                          seeds_above_1=sum(r is not None and r > 1 for r in ratios))
            for silo in silos:
                bases = [cumulative(runs[silo, s], "local_reward", n) for s in seeds]
                ratios = [v / b if b > 0 else None for v, b in
                          zip(entry[span]["cumulative_local_reward"]["per_seed"], bases)]
                entry[span].setdefault("ratio_to_silo", {})[name(silo)] = dict(
                    mean_se(ratios), per_seed=ratios, seeds_above_1=sum(r is not None and r > 1 for r in ratios))
        rows = [m for s in seeds for peer in runs[c, s]["peers"] for m in peer]
        entry["external_groups_per_round"] = sum(m["external_used"] for m in rows) / len(rows)
        # groups trained on whose rewards are not all equal (the only ones GRPO learns from), local and shared
        entry["informative_groups_per_round"] = train.mean([m["informative_trained"] for m in rows])
        entry["rounds_without_step"] = sum(not m["stepped"] for m in rows) / len(rows)
        entry["minutes"] = sum(runs[c, s]["seconds"] for s in seeds) / 60
        entry["cpu_minutes"] = sum(runs[c, s]["cpu_seconds"] for s in seeds) / 60
        curves = [curve(runs[c, s], window) for s in seeds]
        entry["curve"] = {what: [sum(cv[r][i] for cv in curves) / len(curves) for r in range(rounds)]
                          for i, what in enumerate(("mean", "min", "max"))}
        entry["cost"] = cost([runs[c, s] for s in seeds], rounds)
        if "lp_local" in rows[0]:
            entry["diagnosis"] = diagnosis(runs, c, seeds, rounds)
        summary[name(c)] = entry
    return summary


def cost(results, rounds):
    """What a configuration's peers sampled themselves (CountingPeer's completions_sampled): per peer and
    round, per peer over the whole run, and per round the cumulative count of a peer (the mean over peers
    and seeds), which with the reward curve makes the cost curve (reward against completions sampled)."""
    peers = [peer for result in results for peer in result["peers"]]
    per_round = [sum(peer[r]["completions_sampled"] for peer in peers) / len(peers) for r in range(rounds)]
    cumulative = list(itertools.accumulate(per_round))
    return dict(completions_per_round=cumulative[-1] / rounds, completions_per_peer=cumulative[-1],
                cumulative_completions=cumulative)


def by_kind(runs, configs, seeds, rounds, kinds):
    """A mixed swarm, kind by kind (peer k runs kinds[k % len(kinds)]): summarise's figures for each kind's
    peers alone, so each kind's ratios are to the same peers in 8/0, its own silo (the same model, seeds
    and questions). Each configuration also gets: per round, the external groups another model sent
    (external_other_model) and those trained against their sender's log-probs (external_sender_logprobs);
    the local reward over the first and the last tenth of the run (start_reward, end_reward)."""
    out, tenth = {}, max(1, rounds // 10)
    for i, kind in enumerate(kinds):
        mine = {key: dict(r, peers=r["peers"][i::len(kinds)]) for key, r in runs.items()}
        summary = summarise(mine, configs, seeds, rounds)
        for c in configs:
            peers = [peer for seed in seeds for peer in mine[c, seed]["peers"]]
            rows = [m for peer in peers for m in peer]
            for key in ("external_other_model", "external_sender_logprobs"):
                summary[name(c)][f"{key}_per_round"] = train.mean([m.get(key, 0) for m in rows])
            summary[name(c)]["start_reward"] = train.mean([m["local_reward"] for peer in peers for m in peer[:tenth]])
            summary[name(c)]["end_reward"] = train.mean([m["local_reward"] for peer in peers for m in peer[-tenth:]])
        out[kind] = summary
    return out


DIAGNOSIS = ("reward_local", "reward_external", "lp_local", "lp_external", "grad_local", "grad_external",
             "grad_share", "grad_norm", "clip_low", "clip_high")


def diagnosis(runs, c, seeds, rounds):
    """--diagnose: the mean of each DIAGNOSIS key over peers and seeds, in each quarter of the run."""
    quarters = []
    for q in range(4):
        rows = [m for s in seeds for peer in runs[c, s]["peers"] for m in peer[q * rounds // 4:(q + 1) * rounds // 4]]
        values = {k: [m[k] for m in rows if m.get(k) is not None] for k in DIAGNOSIS}
        quarters.append({k: sum(v) / len(v) if v else None for k, v in values.items()})
    return quarters


def fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def pm(stat, digits=2):
    """'1.30 ± 0.12' from mean_se's dict; just the mean when there is no standard error (one seed)."""
    return fmt(stat["mean"], digits) + (f" ± {fmt(stat['se'], digits)}" if stat["se"] is not None else "")


def closing_sentence(summary, seeds):
    """One sentence: did sharing help here, by how much, how sure; against the paper's figure. Then, where
    4/4+is ran beside 4/4, one on the correction."""
    c = "4/4" if "4/4" in summary else max((k for k in summary if k != "8/0"),
                                           key=lambda k: summary[k]["whole"]["ratio_local_reward"]["mean"] or 0,
                                           default=None)
    if c is None:
        return "Only the silo configuration ran, so there is no comparison."
    r = summary[c]["whole"]["ratio_local_reward"]
    paper = f" The paper reports {PAPER[c] / PAPER['8/0']:.2f} for {c}." if c in PAPER else ""
    if r["mean"] is None:
        return f"The 8/0 peers earned no reward at all, so there is no ratio to report.{paper}"
    said = (f"{c} peers earned {r['mean']:.2f} times the cumulative reward of 8/0 peers with the same seeds"
            + (f" (± {r['se']:.2f} s.e.; 95% interval {r['ci95'][0]:.2f}–{r['ci95'][1]:.2f}; "
               f"{r['seeds_above_1']} of {len(seeds)} seeds above 1)" if r["ci95"] else " (one seed, so no interval)")
            + f", training on {summary[c]['informative_groups_per_round']:.1f} informative groups a round (rewards "
            f"not all equal) to 8/0's {summary['8/0']['informative_groups_per_round']:.1f}")
    if r["ci95"] and r["ci95"][0] > 1:
        verdict = "Sharing helped here: "
    elif r["ci95"] and r["ci95"][1] < 1:
        verdict = "Sharing hurt here: "
    else:
        verdict = "No clear effect of sharing here: "
    return verdict + said + "." + paper + correction_sentence(summary) + silos_sentence(summary, c)


def silos_sentence(summary, c):
    """' Against the silo baselines, 4/4 earned ...': c's ratio to each silo baseline that ran, with what a peer
    of each sampled a round; '' if none ran."""
    said = []
    for silo, r in summary[c]["whole"].get("ratio_to_silo", {}).items():
        ci = f" (95% interval {r['ci95'][0]:.2f}–{r['ci95'][1]:.2f})" if r["ci95"] else ""
        said.append(f"{fmt(r['mean'])} times {silo}'s{ci}, whose peers sampled "
                    f"{summary[silo]['cost']['completions_per_round']:.0f} completions a round and trained on "
                    f"{summary[silo]['informative_groups_per_round']:.1f} informative groups")
    if not said:
        return ""
    return (f" Against the silo baselines, {c} peers, which sampled {summary[c]['cost']['completions_per_round']:.0f}"
            f" completions a round, earned " + "; ".join(said) + ".")


def correction_sentence(summary):
    """' With the correction, 4/4+is earned ...': its ratio to 8/0 and to 4/4 of the same seeds; '' if it did not run."""
    e = summary.get("4/4+is")
    if e is None or "ratio_to_paper_rule" not in e["whole"] or e["whole"]["ratio_local_reward"]["mean"] is None:
        return ""
    r, p, h = e["whole"]["ratio_local_reward"], e["whole"]["ratio_to_paper_rule"], e["first_half"]["ratio_to_paper_rule"]
    if p["ci95"] is None:
        return f" With the correction, 4/4+is earned {r['mean']:.2f} times 8/0's, {p['mean']:.2f} times 4/4's (one seed)."
    verdict = "above" if p["ci95"][0] > 1 else "below" if p["ci95"][1] < 1 else "not clearly different from"
    return (f" With the correction, 4/4+is earned {r['mean']:.2f} times 8/0's (95% interval {r['ci95'][0]:.2f}–"
            f"{r['ci95'][1]:.2f}), {p['mean']:.2f} times 4/4's of the same seeds (95% interval {p['ci95'][0]:.2f}–"
            f"{p['ci95'][1]:.2f}: {verdict} the paper's rule; first half {h['mean']:.2f}).")

# -----------------------------------------------------------------------------
# outputs: results.json, table.md, reward.svg (the paper's Fig. 2 for this run), cost.svg


def settings(s):
    """The run's settings as results.json records them (the parsed --configs list left out)."""
    return {k: v for k, v in vars(s).items() if k not in ("config_list", "toys", "sizes")}


def machine():
    import platform
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), gpu=gpu,
                torch=torch.__version__, python=platform.python_version())


def header_md(s, seeds, minutes=None, estimated=None):
    """table.md's title, then what ran: the settings and each swarm configuration's selection rule
    (train.RULES), so that a run with another rule or setting never reads as the paper's."""
    m = machine()
    where = m["gpu"] or f"{m['cores']} CPU cores ({m['cpu']})"
    took = (f" in {minutes:.1f} minutes" if minutes is not None else "") + (
        f" (estimated beforehand: {estimated:.1f})" if estimated is not None else "")
    toy = f", guess {s.guess}, known {s.known}, {s.pretrain_steps} pre-training steps" * (s.preset in TOY_PRESETS)
    rules = []
    for c in s.config_list[1:]:
        r = train.RULES[rule_of(c)]
        rules.append(f"{name(c)}, {rule_of(c)}: {r.what}" + "".join(f" (sets --{k.replace('_', '-')} {v})"
                                                                     for k, v in r.flags))
    return [f"# Swarm against silo: {s.peers} peers, {s.rounds} rounds, {len(seeds)} paired seeds "
            f"({s.preset} preset){took} on {where}", "",
            f"Settings: G = {s.generations}, {s.max_new_tokens} new tokens, lr {s.lr}, model {s.model}, "
            f"tasks {s.tasks}{toy}, {'synchronous' if s.sync else 'round-robin'} rounds, seeds "
            f"{', '.join(map(str, seeds))}. Selection rules (train.RULES): " + ("; ".join(rules) or "none") + ".", ""]


def table_md(s, summary, seeds, sentence, minutes=None, estimated=None):
    """The paper's Table 1 for this run under header_md's settings and rules, then the per-seed values, each
    rule against the paper's, the diagnosis, the sentence and what the columns mean."""
    lines = header_md(s, seeds, minutes, estimated) + [
        "| I/J | cumulative local reward | ratio to 8/0 | 95% interval | seed-to-seed sd | seeds above 1 | "
        "first half: ratio | cumulative batch reward | ratio | external groups per round | informative groups "
        "per round | rounds without a step | run minutes | paper's ratio |", "|---" * 14 + "|"]
    for c, e in summary.items():
        w, h = e["whole"], e["first_half"]
        cum, bat, ratio = w["cumulative_local_reward"], w["cumulative_batch_reward"], w["ratio_local_reward"]
        ci = f"{ratio['ci95'][0]:.2f}–{ratio['ci95'][1]:.2f}" if ratio["ci95"] and c != "8/0" else "–"
        lines.append(f"| {c} | {pm(cum, 1)} | {pm(ratio)} | {ci} | {fmt(ratio['sd']) if c != '8/0' else '–'} | "
                     f"{ratio['seeds_above_1'] if c != '8/0' else '–'} | "
                     f"{pm(h['ratio_local_reward'])} | {pm(bat, 1)} | "
                     f"{pm(w['ratio_batch_reward'])} | {e['external_groups_per_round']:.2f} | "
                     f"{e['informative_groups_per_round']:.2f} | {e['rounds_without_step']:.0%} | {e['minutes']:.1f} | "
                     f"{fmt(PAPER[c] / PAPER['8/0']) if c in PAPER else '–'} |")
    lines += ["", "Per seed: cumulative local reward (ratio to 8/0 of the same seed).", "",
              "| I/J | " + " | ".join(f"seed {x}" for x in seeds) + " |", "|---" * (len(seeds) + 1) + "|"]
    for c, e in summary.items():
        w = e["whole"]
        cells = [f"{v:.1f}" + (f" ({r:.2f})" if c != "8/0" and r is not None else "")
                 for v, r in zip(w["cumulative_local_reward"]["per_seed"], w["ratio_local_reward"]["per_seed"])]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    paired = [(c, e) for c, e in summary.items() if "ratio_to_paper_rule" in e["whole"]]
    if paired:
        lines += ["", "Each rule against the same I/J without it (the paper's rule; for 8/0, the plain silo), seed by "
                  "seed: cumulative local reward of I/J+RULE over I/J's (mean ± s.e., 95% interval, seed-to-seed sd).",
                  "",
                  "| I/J | whole run | 95% interval | sd | seeds above 1 | first half | 95% interval |", "|---" * 7 + "|"]
        for c, e in paired:
            w, h = e["whole"]["ratio_to_paper_rule"], e["first_half"]["ratio_to_paper_rule"]
            cis = [f"{x['ci95'][0]:.2f}–{x['ci95'][1]:.2f}" if x["ci95"] else "–" for x in (w, h)]
            lines.append(f"| {c} | {pm(w)} | {cis[0]} | {fmt(w['sd'])} | {w['seeds_above_1']} | {pm(h)} | {cis[1]} |")
    lines += cost_md(summary) + silos_md(summary, seeds)
    if any("diagnosis" in e for e in summary.values()):
        lines += ["", "Diagnosis (--diagnose), by quarter of the run, mean over peers and seeds: reward, the peer's "
                  "own log-prob per token and the gradient norm of the loss on its own (local) and on shared "
                  "(external) groups alone, the shared half's share of the two norms (grad_share), the whole "
                  "step's gradient norm (clipped to 1 after) and clip fractions.",
                  "", "| I/J | quarter | " + " | ".join(DIAGNOSIS) + " |", "|---" * (len(DIAGNOSIS) + 2) + "|"]
        for c, e in summary.items():
            for q, d in enumerate(e.get("diagnosis", [])):
                lines.append(f"| {c} | {q + 1} | " + " | ".join(fmt(d[k]) for k in DIAGNOSIS) + " |")
    lines += ["", sentence, "",
              "Cumulative reward: summed over every peer and round (the paper's measure); local reward is the "
              "mean reward of a peer's own completions, batch reward that of its whole training batch (the "
              "paper's figure; it counts the shared groups, which always have mixed rewards). ± is one "
              "standard error over seeds (the seed-to-seed sd divided by the square root of the seeds); the 95% "
              "interval uses Student's t. Informative groups: those of a round's batch whose rewards are not "
              "all equal, the only ones GRPO learns from. Run minutes: wall time of the configuration's runs, "
              "added up (runs go in parallel)."]
    return "\n".join(lines) + "\n"


COST_POINTS = (0.25, 0.5, 0.75, 1.0)  # cost_md: shares of what an 8/0 peer samples over the run


def reward_at(entry, completions):
    """The configuration's local reward (its curve: running mean, peers and seeds) in the first round by
    which a peer had sampled `completions` on average; None if its peers never sampled that many."""
    cumulative = entry["cost"]["cumulative_completions"]
    r = next((r for r, x in enumerate(cumulative) if x >= completions - 1e-9), None)
    return None if r is None else entry["curve"]["mean"][r]


def completions_to(entry, reward_level):
    """Completions a peer had sampled (mean) by the first round its local reward (curve) reached reward_level;
    None if it never did."""
    r = next((r for r, y in enumerate(entry["curve"]["mean"]) if y >= reward_level), None)
    return None if r is None else entry["cost"]["cumulative_completions"][r]


def cost_md(summary):
    """table.md's cost table: what each configuration's peers sampled themselves, the informative groups
    they trained on, and the cost curve at a few points (reward against completions sampled)."""
    silo = summary["8/0"]
    total, end = silo["cost"]["completions_per_peer"], silo["curve"]["mean"][-1]
    points = [share * total for share in COST_POINTS]
    lines = ["", "Cost: what a peer sampled itself, per round and over the run; the informative groups its "
             "GRPO step was given per round; its local reward (running mean, as in the figure) once it had "
             f"sampled as many completions as an 8/0 peer samples in a quarter, half, three quarters and all of "
             f"the run; and the completions it had sampled when its local reward first reached 8/0's at the end "
             f"({end:.3f}). A shared group costs its receiver nothing to sample.", "",
             "| I/J | completions sampled per peer per round | informative groups trained per round | completions "
             "per peer, whole run | " + " | ".join(f"local reward at {x:,.0f} completions" for x in points)
             + " | completions to reach 8/0's end |", "|---" * (5 + len(points)) + "|"]
    for c, e in summary.items():
        reach = completions_to(e, end)
        lines.append(f"| {c} | {e['cost']['completions_per_round']:.1f} | {e['informative_groups_per_round']:.2f} | "
                     f"{e['cost']['completions_per_peer']:,.0f} | "
                     + " | ".join(fmt(reward_at(e, x), 3) for x in points)
                     + f" | {'not reached' if reach is None else f'{reach:,.0f}'} |")
    return lines


def silos_md(summary, seeds):
    """table.md's comparison with each silo baseline that ran (8/0+resample, ...): every other
    configuration's cumulative local reward over the baseline's, seed by seed."""
    silos = sorted({s for e in summary.values() for s in e["whole"].get("ratio_to_silo", {})})
    if not silos:
        return []
    lines = ["", "Against each silo baseline, seed by seed: cumulative local reward over the baseline's (mean ± "
             "s.e., 95% interval, seeds above 1).", "",
             "| I/J | " + " | ".join(f"over {b} | 95% interval | seeds above 1" for b in silos) + " |",
             "|---" * (1 + 3 * len(silos)) + "|"]
    for c, e in summary.items():
        if c in silos:
            continue
        cells = []
        for b in silos:
            x = e["whole"]["ratio_to_silo"][b]
            cells += [pm(x), f"{x['ci95'][0]:.2f}–{x['ci95'][1]:.2f}" if x["ci95"] else "–",
                      f"{x['seeds_above_1']}/{len(seeds)}"]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def cost_svg(summary):
    """The cost curve: each configuration's local reward (its figure's line) against the completions a
    peer had sampled itself by that round (mean over peers and seeds)."""
    lines = {c: list(zip(e["cost"]["cumulative_completions"], e["curve"]["mean"])) for c, e in summary.items()}
    return swarm.render_svg(lines, mean_over=0, xlabel="completions a peer sampled itself, cumulative",
                            ylabel="local reward", title="local reward against the completions a peer sampled "
                            "(running mean, mean of peers and seeds)")


def reward_svg(summary, rounds, kinds=None):
    """The paper's Fig. 2 for this run: per configuration, the peer-mean local reward (running mean) and
    the band from the worst to the best peer. A mixed swarm (kinds, by_kind's): a line per configuration
    and kind of peer, without bands."""
    window = max(1, rounds // 20)
    if kinds:
        lines = {f"{c} {kind}": list(enumerate(e["curve"]["mean"]))
                 for kind, configs in kinds.items() for c, e in configs.items()}
        return swarm.render_svg(lines, mean_over=0, ylabel="local reward", title=f"local reward, running mean over "
                                f"{window} rounds: the mean of each kind's peers")
    lines = {c: list(enumerate(e["curve"]["mean"])) for c, e in summary.items()}
    bands = {c: [(r, lo, hi) for r, (lo, hi) in enumerate(zip(e["curve"]["min"], e["curve"]["max"]))]
             for c, e in summary.items()}
    return swarm.render_svg(lines, bands=bands, mean_over=0, ylabel="local reward", title=f"local reward, running "
                            f"mean over {window} rounds: peer mean (line), worst to best peer (band)")


def kinds_md(kinds, seeds, described):
    """table.md's part for a mixed swarm: each kind of peer against its own silo (by_kind's figures)."""
    lines = ["", "Each kind of peer against its own silo. Peer k runs the k-th model in turn; a kind's ratio is its "
             "peers' cumulative local reward over the same peers' in 8/0 (the same model, seeds and questions), seed "
             "by seed: mean ± s.e. and the seed-to-seed sd. External groups per round: trained on, of them sent by "
             "the other model, and of them trained against the sender's log-probs (which only a sender with the "
             "same tokenizer has). Local reward over the first and the last tenth of the run: start → end.", "",
             "| kind | I/J | local reward, start → end | cumulative local reward | ratio to its silo | sd "
             "| seeds above 1 | first half: ratio | sd | external groups per round | from the other model "
             "| with the sender's log-probs | over I/J by the paper's rule | first half |", "|---" * 14 + "|"]
    for kind, summary in kinds.items():
        for c, e in summary.items():
            w, h = e["whole"], e["first_half"]
            r, rh = w["ratio_local_reward"], h["ratio_local_reward"]
            ratios = "– | – | – | – | – |" if c == "8/0" else \
                f"{pm(r)} | {fmt(r['sd'])} | {r['seeds_above_1']}/{len(seeds)} | {pm(rh)} | {fmt(rh['sd'])} |"
            over = f"{pm(w['ratio_to_paper_rule'])} | {pm(h['ratio_to_paper_rule'])}" if "ratio_to_paper_rule" in w \
                else "– | –"
            lines.append(f"| {kind} | {c} | {e['start_reward']:.3f} → {e['end_reward']:.3f} | "
                         f"{pm(w['cumulative_local_reward'], 1)} | {ratios} {e['external_groups_per_round']:.2f} | "
                         f"{e['external_other_model_per_round']:.2f} | {e['external_sender_logprobs_per_round']:.2f} | "
                         f"{over} |")
    return lines + (["", "The kinds: " + "; ".join(f"{k}, {what}" for k, what in described.items()) + "."] if described
                    else [])


def kinds_sentence(kinds):
    """' Kind by kind, ...: toy peers earned 1.30 times in 4/4 (95% interval ...), ...; chars peers ...'"""
    said = []
    for kind, summary in kinds.items():
        parts = []
        for c, e in summary.items():
            r = e["whole"]["ratio_local_reward"]
            if c != "8/0" and r["mean"] is not None:
                ci = f" (95% interval {r['ci95'][0]:.2f}–{r['ci95'][1]:.2f})" if r["ci95"] else ""
                parts.append(f"{r['mean']:.2f} times in {c}{ci}")
        said.append(f"{kind} peers earned " + ", ".join(parts) if parts else f"{kind} peers earned nothing in silo")
    return (" Kind by kind, against its own silo (cumulative local reward over the same peers' in 8/0): "
            + "; ".join(said) + ".")


def write_outputs(s, folder, summary, seeds, extra=None, kinds=None):
    """results.json, table.md, reward.svg and cost.svg into folder; returns the closing sentence. kinds: by_kind's
    figures of a mixed swarm (extra's `kinds` describes them)."""
    extra = extra or {}
    sentence = closing_sentence(summary, seeds) + (kinds_sentence(kinds) if kinds else "")
    results = dict(settings=settings(s), machine=machine(),
                   seeds=seeds, configurations=summary, sentence=sentence,
                   paper_ratio={c: PAPER[c] / PAPER["8/0"] for c in PAPER}, **extra,
                   **({"by_kind": kinds} if kinds else {}))
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    table = table_md(s, summary, seeds, sentence, extra.get("minutes"), extra.get("estimated_minutes"))
    with open(os.path.join(folder, "table.md"), "w") as f:
        f.write(table + ("\n".join(kinds_md(kinds, seeds, extra.get("kinds", {}))) + "\n" if kinds else ""))
    with open(os.path.join(folder, "reward.svg"), "w") as f:
        f.write(reward_svg(summary, s.rounds, kinds))
    with open(os.path.join(folder, "cost.svg"), "w") as f:
        f.write(cost_svg(summary))
    return sentence

# -----------------------------------------------------------------------------
# --sweep: where sharing helps and where it does not


def sweep(s, log=print):
    """For each toy of SWEEP_TOYS: build it (one per seed), measure its success before training (the mean
    over seeds); for each swarm size,
    run 8/0 and the other --configs (default SWEEP_CONFIGS) with paired seeds. A configuration's gain is
    its cumulative local reward over 8/0's, seed by seed; I/J+is also gets its gain over I/J. The toy
    pre-trained on uniform guesses alone (--guess 1) learnt nothing in silo in an earlier sweep, most
    likely because it learnt that the answer does not depend on the letter, and sharing made it worse."""
    seeds, configs, points = s.seeds, s.config_list, []
    for guess, known in s.toys:
        toy = f"guess{guess}-known{known}"
        models, before = build_toys(s, seeds, s.out, guess, known, f"toy-{toy}", log)
        success, mixed = (sum(b[0][i] for b in before.values()) / len(seeds) for i in (0, 1))  # mean over seeds
        for peers in s.sizes:
            log(f"{toy} (initial success {success:.2%}, mixed groups {mixed:.0%}, mean over seeds), {peers} peers:")
            t = argparse.Namespace(**dict(vars(s), peers=peers))
            runs = run_all(t, models, configs, seeds, os.path.join(s.out, f"{toy}-peers{peers}"), log)
            summary = summarise(runs, configs, seeds, s.rounds)
            points.append(dict(guess=guess, known=known, initial_success=success, mixed_groups=mixed, peers=peers,
                               silo_reward=summary["8/0"]["whole"]["cumulative_local_reward"]["mean"]
                               / (peers * s.rounds),
                               gains={c: dict(whole=e["whole"]["ratio_local_reward"],
                                              first_half=e["first_half"]["ratio_local_reward"],
                                              over_paper_rule=e["whole"].get("ratio_to_paper_rule"))
                                      for c, e in summary.items() if c != "8/0"}))
    with open(os.path.join(s.out, "results.json"), "w") as f:
        json.dump(dict(settings=settings(s), machine=machine(),
                       seeds=seeds, points=points), f, indent=1)
    names = [name(c) for c in configs[1:]]
    ruled = [c for c in names if "+" in c and c.split("+")[0] in names]
    lines = [f"# Gain over 8/0 (cumulative local reward, paired over {len(seeds)} seeds, {s.rounds} rounds)",
             "", "| guess | known | initial success per completion | groups with mixed rewards | peers | "
             "mean silo reward | " + " | ".join(f"{c}: gain, whole run | seeds above 1 | first half" for c in names)
             + "".join(f" | {c} over {c.split('+')[0]}" for c in ruled) + " |",
             "|---" * (6 + 3 * len(names) + len(ruled)) + "|"]
    for p in points:
        g = p["gains"]
        lines.append(f"| {p['guess']} | {p['known']} | {p['initial_success']:.2%} | {p['mixed_groups']:.0%} | "
                     f"{p['peers']} | {p['silo_reward']:.3f} | "
                     + " | ".join(f"{pm(g[c]['whole'])} | {g[c]['whole']['seeds_above_1']}/{len(seeds)} | "
                                  f"{pm(g[c]['first_half'])}" for c in names)
                     + "".join(f" | {pm(g[c]['over_paper_rule'])}" for c in ruled) + " |")
    with open(os.path.join(s.out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    gains = {f"{n} peers, {c}": [(math.log10(100 * p["initial_success"]), p["gains"][c]["whole"]["mean"])
                                 for p in points if p["peers"] == n and p["initial_success"] > 0]
             for c in names for n in s.sizes}
    with open(os.path.join(s.out, "sweep.svg"), "w") as f:
        f.write(swarm.render_svg(gains, title="gain from sharing over 8/0, cumulative local reward",
                                 xlabel="log10 of the % of completions right before training (0: 1%, 1: 10%)",
                                 ylabel="gain", hline=1.0, mean_over=0))
    print("\n".join(lines) + f"\nwrote {s.out}/results.json, table.md and sweep.svg")
    return points


# -----------------------------------------------------------------------------
# main


PROBE_ROUNDS = 4  # rounds of every configuration that the time estimate runs


def estimate_minutes(s, models, configs, seeds):
    """Minutes the runs will take on this machine, from a probe that runs as they will: every configuration
    for PROBE_ROUNDS rounds on seed 0's models, in as many worker processes at a time as the runs get (so
    the workers' start, the peers' loading and the runs' contention for the cores are in it). A run then
    costs its probe's seconds plus its probe's mean round (after round 0) for every further round, and the
    runs are laid out on the workers in the order run_all starts them. A machine that gets busier later
    takes longer than this: run_all says, as runs finish, how long is left at the pace they went."""
    workers = min(s.jobs, len(configs) * len(seeds))
    copies = -(-workers // len(configs))  # probes of each configuration, so that every worker is busy
    probe = argparse.Namespace(**dict(vars(s), rounds=PROBE_ROUNDS))
    t0 = time.time()
    runs = run_all(probe, {k: models[seeds[0]] for k in range(copies)}, configs, list(range(copies)),
                   os.path.join(s.out, "probe"), log=lambda *a: None)
    took = time.time() - t0
    cost = {c: sum(r["seconds"] + sum(r["round_seconds"][1:]) / (PROBE_ROUNDS - 1) * (s.rounds - PROBE_ROUNDS)
                   for (c2, _), r in runs.items() if c2 == c) / copies for c in configs}
    start = took - layout([runs[c, k]["seconds"] for k in range(copies) for c in configs], workers)  # workers' start
    return (max(0.0, start) + layout([cost[c] for _ in seeds for c in configs], workers)) / 60


def layout(seconds, workers):
    """The wall time of jobs of these seconds each on `workers` workers, each job started in turn on the
    first worker free: layout([3, 1, 2], 2) is 3 (worker 1: 3; worker 2: 1 then 2)."""
    free = [0.0] * workers
    for x in seconds:
        free[free.index(min(free))] += x
    return max(free)


LAB = ("The lab: 4 peers that train alone (8/0, 8 questions of their own a round) against 4 that share (4/4: 4 "
       "of their own, 4 groups the others shared), on a toy that learns 26 facts, each found only by a lucky "
       "guess, over paired seeds. Predict first: will 4/4 earn more cumulative reward than 8/0, by what ratio, "
       "and why? docs/reproduce.md says how to read the verdict.")


def run_folder(out):
    """The folder a run writes: --out, or, where that already holds something, its first free sub-folder
    run-2, run-3, ... (said in one line), so a second run into one --out keeps the first. One sentence
    if it cannot be made."""
    folder, n = out, 1
    while os.path.isdir(folder) and os.listdir(folder):
        n += 1
        folder = os.path.join(out, f"run-{n}")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"reproduce.py: cannot make the run folder {folder} ({e.strerror or e}); choose another --out")
    if n > 1:
        print(f"{out} holds an earlier run: this one goes to {folder}")
    return folder


def toys_extra(s, models, before):
    """results.json's account of a toy preset's models: success before training, mean and per seed, and each
    kind in words (printed before the runs start)."""
    seeds = s.seeds
    extra = dict(initial_success=sum(b[0][0] for b in before.values()) / len(seeds),
                 initial_mixed_groups=sum(b[0][1] for b in before.values()) / len(seeds),
                 initial_per_seed={kind: [before[seed][i] for seed in seeds]
                                   for i, kind in enumerate(s.model.split(","))})
    extra["kinds"] = {kind: f"{TOYS[kind]['what']}, {train.count_params(models[seeds[0]][i]) / 1e3:.0f}k parameters, "
                      f"{train.mean([v[0] for v in values]):.2%} of completions right and "
                      f"{train.mean([v[1] for v in values]):.0%} of groups mixed before training (mean over seeds)"
                      for i, (kind, values) in enumerate(extra["initial_per_seed"].items())}
    print("the toys: " + "; ".join(f"{kind}, {what}" for kind, what in extra["kinds"].items()))
    return extra


def main(argv=None):
    s = parse_args(argv)
    s.out = run_folder(s.out)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // s.jobs))  # as each of the parallel runs will
    if s.sweep:
        return sweep(s)
    if s.preset == "lab":
        print(LAB)
    seeds, extra = s.seeds, {}
    models = {seed: s.model.split(",") for seed in seeds}
    if s.preset in TOY_PRESETS:  # seed s trains on toys built with seed s
        models, before = build_toys(s, seeds, s.out, s.guess, s.known)
        extra = toys_extra(s, models, before)
    n_runs = len(s.config_list) * len(seeds)
    estimate = estimate_minutes(s, models, s.config_list, seeds) if s.rounds >= 10 else None
    about = f": about {estimate:.0f} minutes here, from a probe of every configuration" if estimate else ""
    print(f"{n_runs} runs ({', '.join(map(name, s.config_list))} x {len(seeds)} seeds) of {s.peers} peers x "
          f"{s.rounds} rounds, {min(s.jobs, n_runs)} at a time{about}")
    t0 = time.time()
    runs = run_all(s, models, s.config_list, seeds, s.out)
    summary = summarise(runs, s.config_list, seeds, s.rounds)
    kinds = by_kind(runs, s.config_list, seeds, s.rounds, s.model.split(",")) if "," in s.model else None
    sentence = write_outputs(s, s.out, summary, seeds, dict(extra, minutes=(time.time() - t0) / 60,
                                                            estimated_minutes=estimate), kinds)
    print(open(os.path.join(s.out, "table.md")).read())
    print(f"wrote {s.out}/results.json, table.md, reward.svg and cost.svg in {(time.time() - t0) / 60:.1f} minutes"
          + (f" (estimated {estimate:.0f})" if estimate else "") + "\n\n" + sentence)
    return sentence


if __name__ == "__main__":
    main()
