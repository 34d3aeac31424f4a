"""
SAPO end to end: one peer's round loop (Algorithm 1 of arXiv 2509.08721) and a launcher for a swarm.

    python train.py                            # one peer in silo: the paper's baseline, I = 8, J = 0
    python train.py --peers 4                  # a swarm server + 4 peers on this machine's one GPU
    python train.py --swarm http://HOST:PORT --name alice   # join a swarm running elsewhere
    python train.py --plot runs/NAME           # local reward per round of every peer, as an SVG

One round on one peer (Peer.round; a synchronous driver can call its two halves, collect and learn,
on every peer in turn):
  1. draw I questions, one per task family drawn uniformly with replacement (reward.py);
  2. sample G completions of each with the peer's own model (sample.py), and score them;
  3. publish the I groups to the swarm server as decoded text (swarm.py): question, ground truth,
     task, metadata, completions, and whether each stopped; never weights (nor log-probs, unless asked);
  4. take the groups other peers published since the last poll;
  5. re-tokenise each with the local tokenizer, score exactly the text that will be trained on with
     the *local* verifier, and drop groups that reward.verify_item rejects (a poisoned ground truth)
     or whose rewards are all equal (no advantage); pool the survivors and draw J uniformly;
  6. take one GRPO step on the I + J groups (grpo.py);
  7. log the round to metrics.jsonl, post it to the dashboard, checkpoint every --save-every rounds.
Peers never wait for each other: a peer trains on whatever external groups have arrived.

Defaults: I = 4 local and J = 4 external groups are the paper's best configuration (+94% cumulative
reward over peers in silo, with 8 Qwen2.5-0.5B peers). Its baseline, peers in silo, trains on 8/0:
I + J stays 8. So a peer with J = 0, or with no swarm to join, takes I = 8 unless --local is given
(on the CPU, where I and J shrink to 2 each, I = 4). The other defaults (G = 8, temperature 1.0, clip
0.2 / 0.28, no KL, DAPO's token-mean loss, 256 new tokens, one optimizer step per round) are common
GRPO settings, chosen to match what the paper's code is described to do where we know it.

Seeds, so that runs can be paired: a peer's questions, its sampling and its draws of external groups
come from separate random streams, each derived from its --seed alone. Round r's questions come from
a stream of their own (the first I questions of round r do not depend on I, J or on what arrived), so
a swarm peer and a silo peer with the same seed are asked the same questions with the same sampling
seeds. Peer k of a swarm launched with --seed S gets the seed peer_seed(S, k), a hash: no two
(S, k) share a peer, as S + k would.

External groups are taken as text, never as control: their completions are tokenised with special-
token strings kept as text (an "<|im_end|>" inside one is just characters), every row is trained only
up to its first stop token, and a completion longer than the local --max-new-tokens is cut there and
scored as cut: the reward always belongs to the tokens trained on. A pooled group is stale once its
producer has published a group POOL_ROUNDS rounds newer (the producer's rounds, not the receiver's:
a slow producer's groups are not aged by a fast receiver, and a late joiner does not train on a
backlog of old rounds).

Deviations from the paper, and why:
- Learning rate: the paper's text says Adam at 0.001, its code 1e-5 or 1e-6. We use AdamW at
  --lr 1e-5 with gradient clipping at 1.0: measured against 1e-6 on SmolLM2-135M (see README).
- Tasks: the paper's nine ReasoningGYM families are rewritten from scratch in reward.py. With the
  default 135M model they give ~0 reward, so `--tasks auto` picks an easy mix for that model
  (DESIGN.md, "Prompts for small models") and the paper's nine for any other model.
- One-shot prompt: with --one-shot (on by default) the prompt holds one worked example of the same
  task family as an earlier chat turn; without it a 135M model almost never uses the answer tags.
- Old log-probs: peers share text, never probabilities, so the ratio's "old" policy is the local
  model at the start of the round for external rollouts too. With --inner-steps 1 (paper) the ratio
  is 1 and the update is REINFORCE with group-normalised advantages; the clip acts from step 2 on.
  Beyond the paper, --shared-logprobs publishes sampling log-probs, and a receiver with the same tokenizer
  takes the sender's as "old" for shared rows (README, "Off-policy sharing"); local rows keep ratio 1.
- Trust: external groups whose answer does not follow from their question are dropped
  (reward.verify_item); the paper trusts the sender's ground truth.
- Weights are trained in float32 (bfloat16 autocast on CUDA) and copied into a bfloat16 sampler each
  round: pure-bf16 weights would round away updates of size 1e-6.
- No GPU: unless the flags are given, a CPU run shrinks G, I, J and the completion length so that it
  shows progress within minutes, and says so. To fit several peers in a CPU machine's memory it also
  recomputes activations in the backward pass (--grad-checkpoint) and uses micro-batches of 4; the
  gradient is the same either way.
"""

import argparse
import copy
import ctypes
import dataclasses
import functools
import glob
import hashlib
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

import torch

import grpo
import model as M
import reward
import sample
import swarm

# -----------------------------------------------------------------------------
# settings: every knob of a run, with its meaning; saved as settings.json beside the checkpoints


def parse_args(argv=None):
    """The run's settings: the flags (parser), then the CPU shrink and the silo rule (fill_defaults).
    A bad flag gets one sentence from argparse and exit status 2."""
    p = parser()
    args = p.parse_args(argv, argparse.Namespace(**dict.fromkeys(CPU_SHRINK)))  # None: not given
    args.token = getattr(args, "token", None) or os.environ.get("SWARM_TOKEN")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device} was asked for, but torch sees no CUDA GPU")
    if args.resume and not args.out:
        p.error("--resume needs --out: the run folder to continue")
    try:
        args.task_list = resolve_tasks(args.tasks, args.model)
    except ValueError as e:
        p.error(str(e))
    fill_defaults(p, args)
    return args


def parser():
    shrink = ", ".join(f"--{k.replace('_', '-')} {'on' if v is True else v}" for k, v in CPU_SHRINK.items())
    p = argparse.ArgumentParser(description="SAPO: swarm sampling policy optimization (arXiv 2509.08721)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog=f"The defaults shown are a GPU's. On the CPU the flags left unset take: {shrink}. "
                                       "Without --swarm or --peers, --external is 0 (in silo) and --local I + J.")
    a = p.add_argument
    # what to run
    a("--peers", type=at_least(0), nargs="?", const=4, default=0, help="start a swarm of N peers on this machine (alone: 4)")
    a("--swarm", type=matching(r"https?://\S+", "a URL such as http://10.0.0.5:8000"), help="URL of a swarm server to join")
    a("--name", type=matching(r"[A-Za-z0-9_.-]{1,64}", "1-64 letters, digits, '_', '.' or '-'"),
      help="this peer's name in the swarm (default: the host name and a random suffix)")
    a("--token", default=argparse.SUPPRESS,  # never shown: --help would print the secret of $SWARM_TOKEN
      help="bearer token of the swarm server, for reads and writes (default: $SWARM_TOKEN, which ps does not show)")
    a("--plot", metavar="RUN_DIR", help="write RUN_DIR/reward.svg from its metrics and exit")
    # model and tasks
    a("--model", default=M.DEFAULT_MODEL, help="model folder or Hugging Face Hub id (Llama, Qwen2, Qwen3)")
    a("--tasks", default="auto",
      help="comma list of reward.py tasks, or 'paper' (the nine), 'rg:paper' (the nine from reasoning_gym), "
           "'easy', 'auto' ('easy' for the default 135M model, 'paper' otherwise)")
    a("--system-prompt", default="default", choices=list(reward.SYSTEM_PROMPTS),
      help="the system prompt: ours, or 'rg', ReasoningGym's default one, which the paper used")
    a("--one-shot", action=argparse.BooleanOptionalAction, default=True,
      help="show one worked example of the task family as an earlier chat turn")
    # SAPO (the paper's best: I = 4, J = 4; its baseline in silo: I = 8, J = 0)
    a("--local", type=at_least(1), default=4,
      help="I: local questions per round (in silo, i.e. J = 0 or no swarm: I + J of the defaults, 8)")
    a("--external", type=at_least(0), default=4, help="J: external groups trained on per round (0: silo)")
    a("--generations", type=at_least(2), default=8, help="G: completions per question (GRPO compares them)")
    a("--rounds", type=at_least(1), default=2000, help="rounds to train")
    a("--max-new-tokens", type=at_least(1), default=256, help="completion length limit in tokens")
    a("--temperature", type=positive, default=1.0, help="sampling temperature")
    # GRPO
    a("--lr", type=positive, default=1e-5, help="AdamW learning rate (measured, see README)")
    a("--epsilon", type=fraction, default=0.2, help="lower clip: ratio >= 1 - epsilon")
    a("--epsilon-high", type=at_least(0.0, float), default=0.28, help="upper clip: ratio <= 1 + epsilon_high (DAPO)")
    a("--beta", type=at_least(0.0, float), default=0.0, help="weight of the k3 KL penalty to the initial model")
    a("--loss-type", default="token_mean", choices=["token_mean", "seq_mean", "constant"])
    a("--adv-scale", default="group", choices=["group", "batch", "none"], help="advantage normalisation")
    a("--inner-steps", type=at_least(1), default=1, help="optimizer steps on each round's batch (1: one step per round)")
    a("--max-grad-norm", type=positive, default=1.0, help="gradient clipping norm")
    a("--micro-batch", type=at_least(1), default=16, help="completions per forward/backward, gradients accumulated")
    a("--grad-checkpoint", action=argparse.BooleanOptionalAction, default=False,
      help="recompute activations in the backward pass")
    a("--shared-logprobs", action=argparse.BooleanOptionalAction, default=False,
      help="publish sampling log-probs, and train shared completions against their sender's (off: the paper's rule)")
    # machinery
    a("--seed", type=int, default=0,
      help="this peer's seed (questions, sampling, external draws, init); peer k of --peers gets peer_seed(seed, k)")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda, cpu, cuda:1, ...")
    a("--dtype", choices=["bfloat16", "float16", "float32"],
      help="dtype of the sampling copy of the weights (default: bfloat16 on CUDA, float32 on CPU)")
    a("--out", help="run folder (default: runs/<date-time>); each peer writes OUT/<name>/")
    a("--save-every", type=at_least(0), default=50, help="checkpoint every K rounds (0: only at the end)")
    a("--sample-every", type=at_least(0), default=10, help="write some completions to samples.jsonl every K rounds")
    a("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    a("--quiet", action="store_true", help="no progress bar (a line per round instead)")
    return p


# No GPU: a CPU is ~100x slower at this and several peers share its memory, so on the CPU the flags
# left unset take these values (main prints which). Micro-batches and checkpointing keep the gradient.
CPU_SHRINK = dict(local=2, external=2, generations=4, max_new_tokens=64, micro_batch=4, grad_checkpoint=True)


def fill_defaults(p, args):
    """Give the flags left unset (None) their defaults: CPU_SHRINK's on the CPU, the parser's elsewhere.
    A peer in silo (J = 0, or no swarm to join) takes I + J of those as I: the paper's baseline, 8/0
    against the swarm's 4/4, trains on as many groups a round. args.shrunk and args.silo say what
    happened, for main to print."""
    default = {k: CPU_SHRINK[k] if args.device == "cpu" else p.get_default(k) for k in CPU_SHRINK}
    if args.external is None and not (args.swarm or args.peers):
        args.external = 0
    args.silo = args.local is None and args.external == 0
    if args.silo:
        args.local = default["local"] + default["external"]
    args.shrunk = [k for k in CPU_SHRINK if getattr(args, k) is None and default[k] != p.get_default(k)]
    for k in CPU_SHRINK:
        if getattr(args, k) is None:
            setattr(args, k, default[k])


def at_least(low, kind=int):
    """An argparse type: a number of `kind` that is at least `low`."""
    def number(text):
        value = kind(text)  # a ValueError: argparse says "invalid int value"
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {text}")
        return value
    number.__name__ = kind.__name__
    return number


def positive(text):
    """An argparse type: a float above 0."""
    if not float(text) > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return float(text)


def fraction(text):
    """An argparse type: a float in [0, 1)."""
    if not 0 <= float(text) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, not {text}")
    return float(text)


def matching(pattern, what):
    """An argparse type: a string that fully matches the regular expression `pattern`."""
    def string(text):
        if not re.fullmatch(pattern, text):
            raise argparse.ArgumentTypeError(f"must be {what}, not {text!r}")
        return text
    return string


POOL_ROUNDS = 2  # a pooled external group is stale once its producer has published a group this many rounds newer


def resolve_tasks(spec, model_name):
    """--tasks as a list of task names; 'auto' is the easy mix for the default 135M model."""
    if spec == "auto":
        spec = "easy" if model_name == M.DEFAULT_MODEL else "paper"
    return reward.task_names(spec)  # raises ValueError naming the known tasks

# -----------------------------------------------------------------------------
# seeds: separate, named random streams, so that runs can be paired


def peer_seed(seed, k):
    """The seed of peer k in a swarm launched with --seed seed: a hash of both, 63 bits. (seed + k would
    make --seed 1's peer0 the same peer as --seed 0's peer1.)"""
    return int.from_bytes(hashlib.sha256(f"{seed}/{k}".encode()).digest()[:8], "big") >> 1


def stream(seed, *names):
    """A random.Random of its own for one use of a peer's seed, e.g. stream(seed, "questions", r): what it
    draws depends on (seed, names) only, never on how much another stream drew."""
    return random.Random("/".join(map(str, (seed,) + names)))  # a str seed is hashed (SHA-512), not hash()


# -----------------------------------------------------------------------------
# prompts and rollouts


def example_turns(task_name):
    """A fixed worked example of the family, as a user turn and an assistant turn."""
    item = reward.get_task(task_name).generate(random.Random(f"one-shot example of {task_name}"))
    return [{"role": "user", "content": item["question"]},
            {"role": "assistant", "content": reward.solution(item)}]


def prompt_ids(tokenizer, item, one_shot, system="default"):
    """Token ids of the chat prompt: system prompt (reward.SYSTEM_PROMPTS[system]), [a worked example],
    the question, assistant turn."""
    messages = [{"role": "system", "content": reward.SYSTEM_PROMPTS[system]}]
    if one_shot:
        try:
            messages += example_turns(item["task"])
        except Exception:  # a family this peer cannot generate (e.g. rg: without reasoning_gym)
            pass
    messages.append({"role": "user", "content": item["question"]})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclasses.dataclass
class Group:
    """One question and its G completions, ready to train on. item: the question's dict (reward.py's
    fields; for an external group the wire fields too); prompt and completions: token ids, a completion
    ending with the stop token if it stopped; texts: what each completion says, the text its reward
    scores; stopped: whether each ended with a stop token; rewards: one per completion; logprobs: each
    completion's sampling log-probs (an external one's: its sender's, or None)."""
    item: dict
    prompt: list
    completions: list
    texts: list
    stopped: list
    rewards: list
    logprobs: list = None


def retokenise(tokenizer, text, stopped, stop_id, max_new_tokens):
    """Another peer's completion as this peer's token ids, and the text those ids say.

    Special-token strings stay text (split_special_tokens): a completion holding "<|im_end|><|im_start|>
    user ..." is a string of ordinary tokens here, never a real end of turn. A completion that stopped
    gets the local stop token. One that does not fit in max_new_tokens is cut there and counts as not
    stopped; the returned text is decoded from the kept ids, so its reward is the reward of what is
    trained on (a correct answer cut off before its <answer> tag scores 0, not 1)."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if len(ids) + stopped > max_new_tokens:
        ids, stopped = ids[:max_new_tokens], False
    return ids + [stop_id] * stopped, tokenizer.decode(ids, skip_special_tokens=True), stopped


def external_group(tokenizer, g, stop_id, max_new_tokens, one_shot, log, system="default"):
    """Step 5 for one group another peer published: None if its answer does not follow from its question
    (reward.verify_item), if its question holds a special token's text, or if its rewards, by the local
    verifier on the re-tokenised text, are all equal (no advantage); otherwise the Group to train on."""
    if not reward.verify_item(g):
        log(f"dropped a group from {g.get('peer')}: its answer does not follow from its question")
        return None
    if any(t.special and t.content in g["question"] for t in tokenizer.added_tokens_decoder.values()):
        log(f"dropped a group from {g.get('peer')}: its question holds a special token of the chat template")
        return None  # the prompt is tokenised with its special tokens live: none may come from outside
    done = [retokenise(tokenizer, c, s, stop_id, max_new_tokens) for c, s in zip(g["completions"], g["stopped"])]
    ids, texts, stopped = (list(x) for x in zip(*done))
    rewards = [reward.score(g, text) for text in texts]
    if len(set(rewards)) < 2:
        return None
    same = g.get("tokenizer") == tokenizer_fingerprint(tokenizer)  # then swarm.py checked token_ids and logprobs
    return Group(g, prompt_ids(tokenizer, g, one_shot, system), ids, texts, stopped, rewards, [  # sender's log-probs
        g["logprobs"][k][:len(c)] if same and g["token_ids"][k][:len(c)] == c else None for k, c in enumerate(ids)])


@functools.lru_cache(maxsize=8)
def tokenizer_fingerprint(tokenizer):
    """A label for the vocabulary (every token's text and id): peers with the same label read ids alike."""
    return "vocab-" + hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:32]

# -----------------------------------------------------------------------------
# one peer


class Peer:
    """One SAPO peer: its model, optimizer, swarm client and round loop.

    client: a swarm client to use instead of one made from --swarm (a driver that runs several peers in
    one process passes its own). args are taken as they are: parse_args treats a peer without --swarm
    as one in silo, so with an injected client give --local and --external explicitly.
    round(r) is collect(r) then learn(r, ...): a synchronous swarm calls collect on every peer, lets
    the groups reach the server, then calls learn on every peer."""

    def __init__(self, args, log=print, client=None):
        self.args, self.log = args, log
        self.name = peer_name(args, log)
        self.dir = os.path.join(args.out, self.name)
        self.device = torch.device(args.device)
        self.sample_dtype = getattr(torch, args.dtype) if args.dtype else M.default_dtype(self.device)
        ckpt = last_checkpoint(self.dir)
        resuming = args.resume and ckpt is not None
        if os.path.exists(os.path.join(self.dir, "metrics.jsonl")) and not args.resume:
            raise SystemExit(f"{self.dir} already holds a run: pass --resume to continue it, or another --out")
        os.makedirs(self.dir, exist_ok=True)
        torch.manual_seed(args.seed)
        try:
            self.model, self.tok = M.load_model(ckpt["path"] if resuming else args.model, self.device, torch.float32, log=log)
        except (OSError, ValueError, RuntimeError) as e:  # a model that cannot be found or read
            raise SystemExit(f"train.py: {e}") from None
        self.model.grad_checkpoint = args.grad_checkpoint
        self.stop_ids = self.model.stop_ids or [self.tok.eos_token_id]
        self.stop_id = self.tok.eos_token_id if self.tok.eos_token_id in self.stop_ids else self.stop_ids[0]
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.stop_id
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
        # sampling runs in bf16 on CUDA from a copy refreshed after every step; on the CPU it is the model
        self.sampler = self.model
        if self.sample_dtype != torch.float32:
            self.sampler = copy.deepcopy(self.model).to(self.sample_dtype).eval()
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) if args.beta > 0 else None
        self.external_rng = stream(args.seed, "external")  # questions and sampling have a stream per round
        self.pool = []    # usable external groups (Group) not yet trained on
        self.newest = {}  # producer -> the newest round of it seen: what makes a pooled group stale
        self.start_round, cursor = 0, None
        if resuming:
            cursor = self.load_state(ckpt)
        elif args.resume:
            log(f"{self.dir}: no checkpoint yet, starting from round 0")
            open(os.path.join(self.dir, "metrics.jsonl"), "w").close()  # those rounds will run again
        self.client = client
        if client is None and args.swarm:  # with J = 0 a peer still shares its rollouts
            self.client = swarm.SwarmClient(args.swarm, self.name, token=args.token, cursor=cursor)
        with open(os.path.join(self.dir, "settings.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    # -- one round: Algorithm 1 of the paper ------------------------------------------------------

    def round(self, r):
        """One SAPO round: sample and share this peer's rollouts, then learn from them and the swarm's."""
        return self.learn(r, self.collect(r))

    def collect(self, r):
        """Steps 1-3: sample and score this round's local groups, publish them. Returns what learn()
        needs: the local groups and the time taken."""
        t0 = time.time()
        groups, sample_seconds = self.sample_local(r)
        self.publish(r, groups)
        return dict(groups=groups, sample_seconds=sample_seconds, seconds=time.time() - t0)

    def learn(self, r, collected):
        """Steps 4-7: choose J external groups, take a GRPO step on them and the local groups, log the round."""
        t0 = time.time()
        external, counts = self.choose_external()
        stats = self.update(collected["groups"] + external)
        release_memory()
        return self.log_round(r, collected, external, counts, stats, collected["seconds"] + time.time() - t0)

    def questions(self, r):
        """Step 1: I items, each of a task family drawn uniformly, from round r's own random stream. The
        first I items of round r are the same whatever I, J or the swarm: swarm and silo runs are paired."""
        rng = stream(self.args.seed, "questions", r)
        return [reward.get_task(rng.choice(self.args.task_list)).generate(rng) for _ in range(self.args.local)]

    def sample_local(self, r):
        """Steps 1-2: G completions of each of round r's questions from the peer's own model, each decoded
        and scored by the local verifier. Returns the groups and the seconds sampling took."""
        t0, args, G = time.time(), self.args, self.args.generations
        items = self.questions(r)
        prompts = [prompt_ids(self.tok, it, args.one_shot, args.system_prompt) for it in items]
        outs, logprobs = sample.generate(self.sampler, prompts, num_samples=G, max_new_tokens=args.max_new_tokens,
                                         temperature=args.temperature, eos_token_ids=self.stop_ids,
                                         seed=self.sampling_seed(r), logprobs=True)
        sample_seconds, groups = time.time() - t0, []
        for i, (item, prompt) in enumerate(zip(items, prompts)):
            ids = outs[i * G:(i + 1) * G]
            stopped = [len(o) > 0 and o[-1] in self.stop_ids for o in ids]
            texts = [self.tok.decode(o[:-1] if s else o, skip_special_tokens=True) for o, s in zip(ids, stopped)]
            groups.append(Group(item, prompt, ids, texts, stopped, [reward.score(item, t) for t in texts],
                                logprobs[i * G:(i + 1) * G]))
        return groups, sample_seconds

    def sampling_seed(self, r):
        return stream(self.args.seed, "sampling", r).getrandbits(63)

    def publish(self, r, groups):
        """Step 3: the round's groups as decoded text, never rewards (--shared-logprobs: ids, log-probs to 1e-4)."""
        if self.client is None:
            return
        model = os.path.basename(str(self.args.model).rstrip("/"))
        behaviour = lambda g: dict(token_ids=g.completions, tokenizer=tokenizer_fingerprint(self.tok),  # noqa: E731
                                   logprobs=[[round(max(x, -1e4), 4) for x in lp] for lp in g.logprobs])
        self.client.publish(r, [dict(task=g.item["task"], question=g.item["question"], answer=g.item["answer"],
                                     metadata=g.item["metadata"], completions=g.texts, stopped=g.stopped, model=model,
                                     **(behaviour(g) if self.args.shared_logprobs and g.logprobs else {})) for g in groups])

    def choose_external(self):
        """Steps 4-5: take what other peers published, keep the usable groups (external_group), pool them
        with earlier ones that are not stale yet, and draw J of the pool uniformly; the rest stay pooled."""
        args = self.args
        if self.client is None or args.external == 0:
            return [], dict(external_available=0, external_survived=0)
        fetched = self.client.fetch()
        for g in fetched:  # a group is stale once its producer has published one POOL_ROUNDS rounds newer
            self.newest[g["peer"]] = max(g["round"], self.newest.get(g["peer"], g["round"]))
        fresh = [x for x in (external_group(self.tok, g, self.stop_id, args.max_new_tokens, args.one_shot, self.log,
                                            args.system_prompt) for g in fetched) if x is not None]
        self.pool = [x for x in self.pool + fresh if self.newest[x.item["peer"]] - x.item["round"] < POOL_ROUNDS]
        # in production order, not arrival order: the same groups give the same draw however the network
        # interleaved the peers' posts (a synchronous swarm is then reproducible run to run)
        self.pool.sort(key=lambda x: (x.item["round"], x.item["peer"], x.item.get("seq", 0)))
        drawn = set(self.external_rng.sample(range(len(self.pool)), min(args.external, len(self.pool))))
        external = [x for k, x in enumerate(self.pool) if k in drawn]
        self.pool = [x for k, x in enumerate(self.pool) if k not in drawn]
        if len(external) < args.external:
            self.log(f"{len(external)} of J={args.external} external groups ({len(fetched)} new, {len(fresh)} usable)")
        return external, dict(external_available=len(fetched), external_survived=len(fresh))

    def batch(self, groups):
        """The groups as GRPO's batch: rows (prompt ids, completion ids), rewards, and group-normalised
        advantages, one per row."""
        rows = [(g.prompt, c) for g in groups for c in g.completions]
        rewards = torch.tensor([x for g in groups for x in g.rewards])
        return rows, rewards, grpo.group_advantages(rewards, [len(g.rewards) for g in groups], self.args.adv_scale)

    def behaviour(self, groups):
        """Per row: with --shared-logprobs, a shared completion's sender log-probs (external_group's), else None."""
        return [lp if "peer" in g.item else None for g in groups for lp in g.logprobs or [None] * len(g.completions)
                ] if self.args.shared_logprobs else None

    def update(self, groups):
        """Step 6: group-normalised advantages, then a GRPO step (grpo.step) unless they are all zero; the
        sampling copy gets the new weights. Returns the step's stats; `stepped` says whether it stepped."""
        a = self.args
        rows, _, adv = self.batch(groups)
        if not bool((adv != 0).any()):
            return dict(stepped=False, zero_adv_frac=1.0, train_tok_per_s=0.0)
        t0 = time.time()
        stats = grpo.step(self.model, self.opt, rows, adv.tolist(), self.pad_id, self.stop_ids, a.micro_batch,
                          a.inner_steps, a.max_grad_norm, a.temperature, self.ref_model, self.behaviour(groups),
                          epsilon=a.epsilon, epsilon_high=a.epsilon_high, beta=a.beta, loss_type=a.loss_type,
                          max_tokens=a.max_new_tokens)
        if self.sampler is not self.model:
            with torch.no_grad():
                for ps, pm in zip(self.sampler.parameters(), self.model.parameters()):
                    ps.copy_(pm)
        tokens = sum(len(c) for _, c in rows)
        return dict(stats, stepped=True, train_tok_per_s=tokens / max(time.time() - t0, 1e-9))

    def log_round(self, r, collected, external, counts, stats, seconds):
        """Step 7: a line of metrics.jsonl, some completions in samples.jsonl, and the dashboard."""
        local = collected["groups"]
        batch, outs = local + external, [c for g in local for c in g.completions]
        m = dict(round=r, stepped=stats.pop("stepped"),
                 local_reward=mean([x for g in local for x in g.rewards]),  # the skill: this peer's own rollouts
                 batch_reward=mean([x for g in batch for x in g.rewards]),  # the paper's figure: the training batch
                 **counts, external_used=len(external),
                 frac_zero_std_local=frac_zero_std(local), frac_zero_std_batch=frac_zero_std(batch),
                 completion_len=mean([len(c) for c in outs]),
                 truncated_frac=mean([float(not s) for g in local for s in g.stopped]),
                 sample_tok_per_s=sum(len(c) for c in outs) / max(collected["sample_seconds"], 1e-9),
                 round_seconds=seconds, **{k: round(v, 6) for k, v in stats.items()})
        with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(m) + "\n")
        if self.args.sample_every and r % self.args.sample_every == 0:
            with open(os.path.join(self.dir, "samples.jsonl"), "a") as f:
                for g in local[:2]:
                    for text, score in list(zip(g.texts, g.rewards))[:2]:
                        f.write(json.dumps(dict(round=r, task=g.item["task"], question=g.item["question"],
                                                answer=g.item["answer"], completion=text, reward=score)) + "\n")
        if self.client is not None:
            self.client.post_metrics(r, {k: float(v) for k, v in m.items() if isinstance(v, (int, float))})
        return m

    # -- the loop, checkpoints and resume ---------------------------------------------------------

    def run(self):
        args = self.args
        bar = None
        if not args.quiet:
            from tqdm import tqdm
            bar = tqdm(total=args.rounds, initial=self.start_round, desc=self.name, dynamic_ncols=True)
        r = self.start_round - 1
        for r in range(self.start_round, args.rounds):
            m = self.round(r)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(progress(m))
            else:
                self.log(f"round {r}: local_reward {m['local_reward']:.3f} (batch_reward {m['batch_reward']:.3f}, "
                         f"the paper's figure) external {m['external_used']} len {m['completion_len']:.0f} "
                         f"sample {m['sample_tok_per_s']:.0f} tok/s, {m['round_seconds']:.1f} s")
            if args.save_every and (r + 1) % args.save_every == 0:
                self.save(r)
        if bar is not None:
            bar.close()
        if r >= self.start_round and not (args.save_every and (r + 1) % args.save_every == 0):
            self.save(r)
        if self.client is not None:
            self.client.close()

    def save(self, round_):
        """checkpoint-<round>/: a Hugging Face folder transformers can load, plus optimizer, RNG and swarm
        cursor state (model.save_model renames it into place whole). Then checkpoint.json, the pointer
        resume reads, is replaced at once, and older checkpoints go: a stop at any moment leaves the
        pointer naming a whole checkpoint, with the length metrics.jsonl had when it was taken."""
        state = {"round": round_, "optimizer": self.opt.state_dict(), "torch_rng": torch.get_rng_state(),
                 "external_rng": json.dumps(self.external_rng.getstate()),
                 "cursor": getattr(self.client, "cursor", None)}
        name, metrics = f"checkpoint-{round_}", os.path.join(self.dir, "metrics.jsonl")
        M.save_model(self.model, self.tok, os.path.join(self.dir, name),
                     write_extra=lambda folder: torch.save(state, os.path.join(folder, "trainer_state.pt")))
        pointer = dict(round=round_, checkpoint=name, metrics_bytes=os.path.getsize(metrics) if os.path.exists(metrics) else 0)
        with open(os.path.join(self.dir, "checkpoint.json.tmp"), "w") as f:
            json.dump(pointer, f)
        os.replace(os.path.join(self.dir, "checkpoint.json.tmp"), os.path.join(self.dir, "checkpoint.json"))
        for old in glob.glob(os.path.join(glob.escape(self.dir), "checkpoint-*")):
            if os.path.basename(old) != name:
                shutil.rmtree(old, ignore_errors=True)

    def load_state(self, ckpt):
        """Optimizer and random state from a checkpoint (last_checkpoint's dict); returns the saved swarm
        cursor (None: none saved)."""
        state = torch.load(os.path.join(ckpt["path"], "trainer_state.pt"), map_location="cpu", weights_only=True)
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"].cpu())
        v, internal, gauss = json.loads(state["external_rng"])
        self.external_rng.setstate((v, tuple(internal), gauss))
        self.start_round = state["round"] + 1
        path = os.path.join(self.dir, "metrics.jsonl")  # lines after the checkpoint's: rounds that run again
        if os.path.exists(path) and os.path.getsize(path) > ckpt["metrics_bytes"]:
            os.truncate(path, ckpt["metrics_bytes"])
        self.log(f"resumed {self.name} from {ckpt['path']} at round {self.start_round}")
        return state["cursor"]


def last_checkpoint(folder):
    """The checkpoint that folder/checkpoint.json names (Peer.save), as a dict: round, checkpoint (its
    folder's name), metrics_bytes, and path; None before the first save."""
    try:
        with open(os.path.join(folder, "checkpoint.json")) as f:
            pointer = json.load(f)
    except FileNotFoundError:
        return None
    return dict(pointer, path=os.path.join(folder, pointer["checkpoint"]))


def peer_name(args, log):
    """--name, or else the host name plus a random suffix: two peers on one host must differ, because
    the server and the client leave out a peer's own groups by name. --resume without --name picks up
    this host's one peer in --out."""
    if args.name:
        return args.name
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:57] or "peer"
    if args.resume:
        mine = sorted(os.path.basename(d) for d in glob.glob(os.path.join(glob.escape(args.out), "*"))
                      if re.fullmatch(re.escape(host) + r"-[0-9a-f]{6}", os.path.basename(d)))
        if len(mine) == 1:
            return mine[0]
        if mine:
            raise SystemExit(f"{args.out} holds {len(mine)} peers of this host ({', '.join(mine)}): "
                             "pass --name to say which one to resume")
    name = f"{host}-{secrets.token_hex(3)}"
    log(f"this peer's name in the swarm: {name} (--name sets it)")
    return name


def progress(m):
    """A progress bar's numbers: the local reward (the skill) first; the batch reward beside it is the
    paper's figure, the mean over the training batch, external groups included."""
    return dict(reward=f"{m['local_reward']:.2f}", batch=f"{m['batch_reward']:.2f}", ext=m["external_used"])


def frac_zero_std(groups):
    """The share of groups whose rewards are all equal (no advantage: GRPO learns nothing from them)."""
    return mean([float(len(set(g.rewards)) == 1) for g in groups])


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def release_memory():
    """Give freed memory back to the operating system. glibc keeps it otherwise, so an idle CPU peer
    would sit at its training peak, and several peers on one machine add up to more than it has."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass

# -----------------------------------------------------------------------------
# the launcher: a server and N peers on one machine

# One peer's peak memory, per model parameter: measured for SmolLM2-135M on the CPU with the CPU
# defaults (3.2-3.3 GB, README "Memory"), with a little margin: 16 bytes a parameter are float32
# weights, gradients and AdamW state, the rest runtime and activations. On CUDA and for other models
# it is a rough guide, scaled by size.
PEER_BYTES_PER_PARAM = 26


def launch(args):
    """Start a swarm server on a free loopback port and args.peers peer processes, show their progress
    together, stop them all on Ctrl-C. A peer that dies is reported and the others go on; the launcher
    then exits non-zero, saying why where it can."""
    from tqdm import tqdm
    if not args.resume and glob.glob(os.path.join(args.out, "*", "metrics.jsonl")):
        raise SystemExit(f"{args.out} already holds a run: pass --resume to continue it, or another --out")
    try:  # once, here: a first download or GGUF dequantisation must not run in every peer at once
        folder = M.resolve(args.model)
    except (OSError, ValueError, RuntimeError) as e:
        raise SystemExit(f"train.py: {e}") from None
    check_memory(args.peers, args.device, count_params(folder))
    os.makedirs(args.out, exist_ok=True)
    children = []
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)  # the terminal closed: stop the children too
    try:
        url = start_server(args, children)
        print(f"swarm server {url}  (dashboard: open {url}/ in a browser)")
        procs = {f"peer{k}": start_peer(args, k, url, children) for k in range(args.peers)}
        bars = {n: tqdm(total=args.rounds, desc=n, position=k, dynamic_ncols=True) for k, n in enumerate(procs)}
        failed = {}
        while len(failed) < len(procs) and any(p.poll() is None for p in procs.values()):
            time.sleep(1.0)
            for n, proc in procs.items():
                last = last_metrics(os.path.join(args.out, n, "metrics.jsonl"))
                if last:
                    bars[n].n = last["round"] + 1
                    bars[n].set_postfix(progress(last), refresh=False)
                    bars[n].refresh()
                if proc.poll() not in (None, 0) and n not in failed:
                    failed[n] = f"{n} {why_stopped(proc.returncode)}: see {args.out}/{n}/log.txt"
                    tqdm.write(failed[n] + "; the others go on")
        for b in bars.values():
            b.close()
        print(f"{len(procs) - len(failed)} of {len(procs)} peers finished; metrics in {args.out}/<peer>/metrics.jsonl; "
              f"chart: python train.py --plot {args.out}")
        if failed:
            raise SystemExit("\n".join(failed.values()))
    except KeyboardInterrupt:
        print("\nstopping every peer and the server...")
        raise SystemExit(130)
    finally:
        stop_all(children)


def child_env(args):
    """The launcher's environment for a child: the token goes there, never on a command line (ps)."""
    return dict(os.environ, **({"SWARM_TOKEN": args.token} if args.token else {}))


def start_server(args, children):
    """The rollout server as a child process on a free loopback port; returns its URL."""
    server_log = open(os.path.join(args.out, "server.log"), "a")
    env = child_env(args)
    server = subprocess.Popen([sys.executable, "-u", os.path.join(HERE, "swarm.py"), "--port", "0",
                               "--dir", os.path.join(args.out, "swarm")],
                              stdout=subprocess.PIPE, stderr=server_log, text=True, start_new_session=True, env=env)
    children.append(server)
    found = re.search(r"http://\S+", server.stdout.readline())
    if not found:
        raise SystemExit(f"the swarm server did not start; see {args.out}/server.log")
    return found.group(0)


def start_peer(args, k, url, children):
    """Peer k as a child process: this command line's settings, resolved here once and passed as flags,
    with its own name, seed (peer_seed) and the server's URL; the token goes in its environment."""
    name = f"peer{k}"
    flags = as_flags(argparse.Namespace(**dict(vars(args), peers=0, swarm=url, name=name, quiet=True,
                                               seed=peer_seed(args.seed, k))))
    os.makedirs(os.path.join(args.out, name), exist_ok=True)
    env = child_env(args)
    if args.device == "cpu":  # share the cores instead of every peer fighting for all of them
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.peers)))
    proc = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), *flags],
                            stdout=open(os.path.join(args.out, name, "log.txt"), "a"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    children.append(proc)
    return proc


def as_flags(args):
    """Settings as a command line that parse_args reads back into the same settings. Left out: what is
    derived from flags (task_list, silo, shrunk) and --token, which must not show in ps."""
    flags = []
    for action in parser()._actions:
        value, flag = getattr(args, action.dest, None), (action.option_strings or [None])[0]
        if flag is None or action.dest in ("help", "token") or value is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not False:  # False: a store_true flag not given
            flags += [flag] if value is True else [flag, str(value)]
    return flags


def stop_all(children):
    """Stop every child: SIGTERM, then SIGKILL after 15 s."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not cut this short
        signal.signal(sig, signal.SIG_IGN)
    for proc in children:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.time() + 15
    for proc in children:
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def why_stopped(code):
    """A peer's exit status in words, with the likely cause where one is known."""
    if code == -signal.SIGKILL:
        return "was killed by signal 9 (SIGKILL), probably out of memory; try fewer --peers"
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"stopped with exit code {code}"


def count_params(folder):
    """Parameters of a model folder, from its safetensors headers (no tensor is read)."""
    n = 0
    for path in glob.glob(os.path.join(glob.escape(folder), "*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        n += sum(math.prod(t["shape"]) for key, t in header.items() if key != "__metadata__")
    return n


def free_memory(device):
    """Bytes free for new peers: GPU memory on CUDA, else MemAvailable from /proc/meminfo; None if unknown."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_memory(peers, device, params):
    """Refuse, in one sentence, a --peers that does not fit in free memory: better than the kernel's OOM
    killer taking a peer in round 3."""
    need, free = params * PEER_BYTES_PER_PARAM, free_memory(device)
    if free is None or peers * need <= free:
        return
    fits = int(free // need)
    where = "GPU memory" if device.startswith("cuda") else "memory"
    raise SystemExit(f"train.py: {peers} peers need about {peers * need / 1e9:.1f} GB of {where} "
                     f"({need / 1e9:.1f} GB each) but {free / 1e9:.1f} GB is free: "
                     + (f"try --peers {fits}." if fits else "not even one peer fits; free some memory first."))


def last_metrics(path):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def plot(run_dir, window=10):
    """RUN_DIR/reward.svg, two charts of every peer's reward per round (a running mean over `window`
    rounds): on top the local reward, the peer's skill; below it the batch reward, the paper's figure,
    which also counts the external groups trained on (always of mixed reward, so it reads higher)."""
    charts = []
    for key, title in (("local_reward", "local reward (the skill)"),
                       ("batch_reward", "batch reward (the paper's figure: the training batch, external groups too)")):
        series = {}
        for path in sorted(glob.glob(os.path.join(glob.escape(run_dir), "*", "metrics.jsonl"))):
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            values = [row[key] for row in rows]
            series[os.path.basename(os.path.dirname(path))] = [
                (row["round"], mean(values[max(0, k + 1 - window):k + 1])) for k, row in enumerate(rows)]
        if not series:
            raise SystemExit(f"no <peer>/metrics.jsonl under {run_dir}: give the folder of a run")
        charts.append(swarm.render_svg(series, title=f"{title}, running mean over {window} rounds"))
    below = charts[1].replace("<svg ", '<svg y="360" ', 1)
    out = os.path.join(run_dir, "reward.svg")
    with open(out, "w") as f:  # the two charts, one above the other, in one SVG
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="760" height="720">\n{charts[0]}\n{below}\n</svg>\n')
    print(f"wrote {out}")


HERE = os.path.dirname(os.path.abspath(__file__))


def interrupt(signum, frame):  # SIGTERM from the launcher: stop as Ctrl-C would
    raise KeyboardInterrupt


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        return plot(args.plot)
    args.out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    if args.shrunk:
        print(f"no GPU: using smaller defaults for {', '.join('--' + k.replace('_', '-') for k in args.shrunk)} "
              f"({', '.join(f'{k}={getattr(args, k)}' for k in args.shrunk)}); set them to override")
    if args.silo:
        print(f"in silo (J = 0): I = {args.local} local groups a round, the I + J of a swarm peer "
              "(the paper's baseline, 8/0 against 4/4); --local sets it")
    if args.peers:
        return launch(args)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        Peer(args).run()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
