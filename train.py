"""
SAPO end to end: one peer's round loop (Algorithm 1 of arXiv 2509.08721) and a launcher for a swarm.

    python train.py                            # one peer in silo: the paper's baseline, I = 8, J = 0
    python train.py --peers 4                  # a swarm server + 4 peers on this machine's one GPU
    python train.py --peers 4 --model A,B      # a mixed swarm: peer0 runs A, peer1 B, peer2 A, ...
    python train.py --swarm http://HOST:PORT --name alice   # join a swarm running elsewhere
    python train.py --plot runs/NAME           # local reward per round of every peer, as an SVG

One round on one peer (Algorithm1.round, below, which says how a synchronous swarm calls its halves):
  1. draw I questions, one per task family drawn uniformly with replacement (reward.py);
  2. sample G completions of each with the peer's own model (sample.py), and score them;
  3. publish the I groups to the swarm server as decoded text, never weights (swarm.py);
  4. take, never waiting, a sample of what the others published recently (4J groups, every producer alike);
  5. re-tokenise and re-score each locally, drop those that reward.verify_item rejects, and choose J by the
     selection rule (RULES; the paper's drops the groups whose rewards are all equal, draws J uniformly);
  6. take one GRPO step on the I + J groups (grpo.py);
  7. log the round to metrics.jsonl and the dashboard; checkpoint every --save-every rounds.

I = 4 and J = 4 are the paper's best (+94% cumulative reward over the silo, 8 Qwen2.5-0.5B peers; a CPU
gets smaller defaults); its silo baseline is 8/0, so a peer with J = 0 or no swarm takes I + J as I. The
questions, sampling and external draws of a peer are separate random streams of --seed (stream), so a
swarm and a silo peer of one seed are paired runs.

Deviations from the paper, and why:
- Learning rate: AdamW at --lr 1e-5, clipped at 1.0; the paper's text says Adam at 0.001, its code 1e-5
  or 1e-6 (docs/learning-rate.md measures 1e-5 against 1e-6 on SmolLM2-135M).
- Tasks: the default 135M model scores almost nothing on the paper's nine; `--tasks auto` gives it easy ones.
- --one-shot (on by default) puts a worked example first: without it a 135M model rarely uses the answer tags.
- Old log-probs: a shared completion's are the receiver's own, as in the paper (grpo.py; --shared-logprobs
  takes the sender's). Trust: beyond the paper, a shared item must verify (reward.verify_item).
- Precision: float32 weights, trained under bfloat16 autocast where native, are copied each round into
  a bfloat16 (older GPUs: float16) sampler; weights in bfloat16 would round away updates of 1e-6.
"""

import argparse
import copy
import ctypes
import dataclasses
import functools
import glob
import hashlib
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import reward
import swarm
if __name__ != "__main__":  # python train.py reads its flags first, so that a wrong one is refused before
    import grpo             # torch loads; then import_torch, below the marker line, imports these five
    import model as M
    import sample
    import torch
    from tqdm import tqdm

# -----------------------------------------------------------------------------
# random streams, a group of rollouts, another peer's group made this peer's, and the selection rule


def stream(seed, *names):
    """Its own random.Random for one use of a seed, e.g. stream(seed, "questions", r): no other draw moves it."""
    return random.Random("/".join(map(str, (seed,) + names)))  # a str seed is hashed (SHA-512), not hash()


@dataclasses.dataclass
class Group:
    """One question and its G completions, ready to train on."""
    item: dict         # the question's dict: reward.py's fields (an external group's: the wire fields too)
    prompt: list       # token ids
    completions: list  # token ids of each, ending with the stop token if it stopped
    texts: list        # what each completion says: the text its reward scores
    stopped: list      # whether each ended with a stop token
    rewards: list      # one per completion
    arrived: int = 0   # the receiver's round in which an external group came
    logprobs: list = None  # each completion's sampling log-probs (an external one's: its sender's, or None)
    external: bool = False  # taken from the swarm (external_group), not sampled by this peer


def retokenise(tokenizer, text, stopped, stop_id, max_new_tokens):
    """Another peer's completion as this peer's token ids, and the text those ids say. Special-token strings
    stay text (split_special_tokens): "<|im_end|><|im_start|>user ..." is ordinary tokens, never an end of
    turn. A stopped completion gets the local stop token; one over max_new_tokens is cut there and counts as
    not stopped. The text is decoded from the kept ids: its reward is that of what is trained on."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if len(ids) + stopped > max_new_tokens:
        ids, stopped = ids[:max_new_tokens], False
    return ids + [stop_id] * stopped, tokenizer.decode(ids, skip_special_tokens=True), stopped


def external_group(tokenizer, g, stop_id, max_new_tokens, one_shot, log, system="default", tasks=None):
    """Step 5 for a shared group: the Group re-tokenised and re-scored by the local verifier, for the rule
    (RULES); None if it is not UTF-8 text or not of `tasks` (the receiver's --tasks; None: any family), if
    its answer does not follow from its question (reward.verify_item) or its question has a special token."""
    if re.search("[\ud800-\udfff]", json.dumps(g, ensure_ascii=False)) or not reward.verify_item(g, tasks):
        log(f"dropped a group from {g.get('peer')}: not UTF-8 text, not one of this peer's tasks, "
            "or its answer does not follow from its question")
        return None
    # The prompt is tokenised with its special tokens live, so none may come from outside.
    if any(t.special and t.content in g["question"] for t in tokenizer.added_tokens_decoder.values()):
        log(f"dropped a group from {g.get('peer')}: its question holds a special token of the chat template")
        return None
    pairs = zip(g["completions"], g["stopped"])
    kept = [retokenise(tokenizer, c, s, stop_id, max_new_tokens) for c, s in pairs]
    ids, texts, stopped = (list(x) for x in zip(*kept))
    rewards = [reward.score(g, text) for text in texts]
    prompt = reward.prompt_ids(tokenizer, g, one_shot, system)
    # a sender's log-probs count where it reads ids as this peer does (and swarm.py checked them)
    same = g.get("tokenizer") == tokenizer_fingerprint(tokenizer)
    logprobs = [g["logprobs"][k][:len(c)] if same and g["token_ids"][k][:len(c)] == c else None
                for k, c in enumerate(ids)]
    return Group(g, prompt, ids, texts, stopped, rewards, logprobs=logprobs, external=True)


@functools.lru_cache(maxsize=8)
def tokenizer_fingerprint(tokenizer):
    """A label for the vocabulary (every token's text and id): peers with the same label read ids alike."""
    vocabulary = json.dumps(sorted(tokenizer.get_vocab().items()))
    return "vocab-" + hashlib.sha256(vocabulary.encode()).hexdigest()[:32]


def informative(group):  # the paper's filter: a group whose rewards are all equal has no advantage
    return len(set(group.rewards)) > 1


def draw_uniform(rng, pool, J):  # the paper's draw: the indices of J groups of the pool, each equally likely
    return rng.sample(range(len(pool)), min(J, len(pool)))


@dataclasses.dataclass(frozen=True)
class Rule:  # what a peer trains on, named in RULES: a receiver's selection rule (step 5), or a silo's
    what: str                    # what it does, in words: a run's log and its table say it
    keep: object = informative   # keep(group): whether a re-scored shared group may join the pool
    draw: object = draw_uniform  # draw(rng, pool, J): the indices of the pool's groups it draws
    pool_rounds: int = 2         # the rounds an undrawn shared group stays in the pool after it came
    flags: tuple = ()            # the settings it changes, as (flag, value) pairs
    judge: object = None         # judge(peer, groups): the kept groups that the receiver's own model keeps
    informative_only: bool = False  # the loss, its normaliser too, counts only informative groups
    resample: tuple = (0, 0)     # (target, cap): more questions until `target` are informative (collect)
    push_down: str = "all"       # whose completions below their group's mean are pushed down: all, own, none
    silo: bool = False           # a silo baseline, run with J = 0 only: it changes what a peer does alone


RULES = {  # the paper's rule first, the default; a variant is a line here (reproduce.py: I/J+NAME)
    "paper": Rule("drop shared groups whose rewards are all equal, draw J of the rest uniformly"),
    "keep-all": Rule("keep shared groups whose rewards are all equal too", keep=lambda g: True),
    "is": Rule("the paper's, against the senders' log-probs", flags=(("shared_logprobs", True),)),
    "plausible": Rule("the paper's, of the shared groups its own model could have written",
                      judge=lambda peer, groups: plausible(peer, groups)),  # below the marker line
    "whole": Rule("the paper's, of the shared completions that fit its own length limit uncut",
                  judge=lambda peer, groups: whole(peer, groups)),  # below the marker line
    "informative-norm": Rule("a silo whose loss counts only informative groups", informative_only=True,
                             silo=True),
    "resample": Rule("a silo that samples I more questions at a time until 5 groups are informative, within "
                     "512 completions (DAPO's dynamic sampling)", informative_only=True, resample=(5, 512),
                     silo=True),
    "positive": Rule("the paper's, but a shared completion below its group's mean is not pushed down: the "
                     "receiver learns another policy's successes, never its failures", push_down="own"),
    "positive-all": Rule("positive, and its own failures are not pushed down either", push_down="none"),
    "positive-silo": Rule("a silo that pushes down none of its failures: positive-all alone, the control",
                          push_down="none", silo=True),
    "is-wide": Rule("the paper's against the senders' log-probs, a shared token's ratio clipped at 3, not 1.28",
                    flags=(("shared_logprobs", True), ("epsilon_high", 2.0))),
}

# -----------------------------------------------------------------------------
# one peer's round


class Algorithm1:
    """One peer's SAPO round, Algorithm 1 of the paper: round(r) is collect(r), steps 1-3, then learn(r, ...),
    steps 4-7; a synchronous swarm calls collect on every peer, then learn on every peer. Peer, below the
    marker line, loads what __init__ takes, connects the swarm client, loops over rounds, saves checkpoints."""

    def __init__(self, args, model, tok, opt, sampler, ref_model, amp_dtype, folder, log=print):
        self.args, self.log = args, log    # the run's settings (parse_args), and a line for the user
        self.model = model                 # the policy: float32 weights, which update() trains
        self.amp_dtype = amp_dtype         # update()'s autocast dtype (model.autocast_dtype); None: float32
        self.tok = tok                     # its tokenizer: prompts, decoding, re-tokenising shared text
        self.opt = opt                     # AdamW over the model's parameters
        self.sampler = sampler             # what samples: the model, or a lower-precision copy of it
        self.ref_model = ref_model         # the frozen initial model of the KL penalty (beta > 0), else None
        self.client = None                 # the swarm client (publish, fetch, post_metrics); None: no swarm
        self.stop_ids = model.stop_ids or [tok.eos_token_id]  # the tokens that end a completion
        # the stop token a shared completion gets, and GRPO's padding (masked out of the loss)
        self.stop_id = tok.eos_token_id if tok.eos_token_id in self.stop_ids else self.stop_ids[0]
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.stop_id
        self.rule = RULES[args.rule]       # the selection rule: what of the swarm's groups it keeps and draws
        self.external_rng = stream(args.seed, "external")  # draws J of the pool
        self.pool = []                     # usable external groups (Group) not yet drawn
        self.own = []                      # this round's own groups, which a rule's judge may compare with
        self.dir = folder                  # OUT/<name>/: metrics.jsonl, samples.jsonl, the checkpoints

    def round(self, r):
        """One SAPO round: sample and share this peer's rollouts, then learn from them and the swarm's."""
        return self.learn(r, self.collect(r))

    def collect(self, r):
        """Steps 1-3: sample, score and publish this round's groups for learn(). A resampling silo (DAPO's
        dynamic sampling) then samples I more questions at a time (extra) until `target` are informative."""
        t0 = time.time()
        groups, sample_seconds = self.sample_local(r)
        self.publish(r, groups)
        (target, cap), extra = self.rule.resample, []
        for k in range(1, cap // (len(groups) * self.args.generations)):  # batch k + 1 stays within the cap
            if sum(map(informative, groups + extra)) >= target:
                break
            extra += self.sample_local(r, "more", k)[0]
        return dict(groups=groups, extra=extra, sample_seconds=sample_seconds, seconds=time.time() - t0)

    def learn(self, r, collected):
        """Steps 4-7: choose J external groups, take a GRPO step on them and the local groups, log the round."""
        t0, self.own = time.time(), collected["groups"]
        external, counts = self.choose_external(r)
        stats = self.update(collected["groups"] + collected.get("extra", []) + external)
        return self.log_round(r, collected, external, counts, stats, collected["seconds"] + time.time() - t0)

    def questions(self, r, *more):
        """Step 1: I items (--local), each of a task family drawn uniformly, from round r's own random
        stream. The first I items of round r are the same whatever I, J or the swarm: runs are paired."""
        rng = stream(self.args.seed, "questions", r, *more)
        items = []
        for _ in range(self.args.local):
            task = reward.get_task(rng.choice(self.args.task_list))
            items.append(task.generate(rng))
        return items

    def sample_local(self, r, *more):
        """Steps 1-2: G completions of each question of round r (`more`: of a further batch), decoded and
        scored by the local verifier -> (the groups, the seconds sampling took)."""
        t0, args, G = time.time(), self.args, self.args.generations
        items = self.questions(r, *more)
        prompts = [reward.prompt_ids(self.tok, it, args.one_shot, args.system_prompt) for it in items]
        seed = stream(args.seed, "sampling", r, *more).getrandbits(63)
        outs, logprobs = sample.generate(self.sampler, prompts, num_samples=G, seed=seed, logprobs=True,
                                         max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                         eos_token_ids=self.stop_ids)
        sample_seconds, groups = time.time() - t0, []
        for i, (item, prompt) in enumerate(zip(items, prompts)):
            ids = outs[i * G:(i + 1) * G]
            stopped = [len(o) > 0 and o[-1] in self.stop_ids for o in ids]
            texts = [self.tok.decode(o[:-1] if s else o, skip_special_tokens=True)  # without the stop token
                     for o, s in zip(ids, stopped)]
            rewards = [reward.score(item, t) for t in texts]
            sampled = logprobs[i * G:(i + 1) * G]
            groups.append(Group(item, prompt, ids, texts, stopped, rewards, logprobs=sampled))
        return groups, sample_seconds

    def publish(self, r, groups):
        """Step 3: the round's groups as decoded text, never rewards. Beyond the paper, --shared-logprobs
        adds the sampled token ids and their log-probs (to 1e-4), for a receiver's off-policy correction."""
        if self.client is None:
            return
        model = os.path.basename(str(self.args.model).rstrip("/"))
        shared = []
        for g in groups:
            extra = {}
            if self.args.shared_logprobs and g.logprobs:
                logprobs = [[round(max(x, -1e4), 4) for x in lp] for lp in g.logprobs]
                extra = dict(token_ids=g.completions, logprobs=logprobs,
                             tokenizer=tokenizer_fingerprint(self.tok))
            shared.append(swarm.wire_group(g.item["task"], g.item["question"], g.item["answer"],
                                           g.texts, g.stopped, g.item["metadata"], model, **extra))
        self.client.publish(r, shared)

    def choose_external(self, r):
        """Steps 4-5: take the swarm's sample, keep the usable groups (external_group) that the selection rule
        keeps, pool them with those of its last pool_rounds rounds, and draw J by the rule; the rest stay."""
        args = self.args
        if self.client is None or args.external == 0:
            return [], dict(external_available=0, external_survived=0)
        fetched = self.client.fetch()
        usable = (external_group(self.tok, g, self.stop_id, args.max_new_tokens, args.one_shot, self.log,
                                 args.system_prompt, args.task_list) for g in fetched)
        fresh = [dataclasses.replace(x, arrived=r) for x in usable if x is not None and self.rule.keep(x)]
        fresh = self.rule.judge(self, fresh) if self.rule.judge else fresh
        self.pool = [x for x in self.pool + fresh if r - x.arrived < self.rule.pool_rounds]
        # In production order, not arrival order: the same groups give the same draw, however posts interleave.
        self.pool.sort(key=lambda x: (x.item["round"], x.item["peer"], x.item.get("seq", 0)))
        drawn = set(self.rule.draw(self.external_rng, self.pool, args.external))
        external = [x for k, x in enumerate(self.pool) if k in drawn]
        self.pool = [x for k, x in enumerate(self.pool) if k not in drawn]
        if len(external) < args.external:
            self.log(f"{len(external)} of J={args.external} external groups "
                     f"({len(fetched)} new, {len(fresh)} usable)")
        return external, dict(external_available=len(fetched), external_survived=len(fresh))

    def batch(self, groups):
        """The groups as GRPO's batch: (prompt ids, [completion ids, ...]) each, to be packed into one row,
        the rewards, and group-normalised advantages, one per completion. A rule that pushes down only its
        own failures (RULES: positive) gives a shared completion below its group's mean 0; "none", any."""
        rewards = torch.tensor([x for g in groups for x in g.rewards])
        advantages = grpo.group_advantages(rewards, [len(g.rewards) for g in groups], self.args.adv_scale)
        if self.rule.push_down != "all":  # spared: shared completions ("own"), or every one ("none")
            spared = [g.external or self.rule.push_down == "none" for g in groups for _ in g.rewards]
            advantages = advantages.masked_fill(torch.tensor(spared) & (advantages < 0), 0.0)
        return [(g.prompt, g.completions) for g in groups], rewards, advantages

    def behaviour(self, groups):
        """Per completion, with --shared-logprobs: an external one's sender log-probs, else None."""
        if not self.args.shared_logprobs:
            return None
        return [lp if g.external else None
                for g in groups for lp in g.logprobs or [None] * len(g.completions)]

    def grpo_settings(self, groups):
        """grpo.step's settings: the run's flags, pad and stop tokens, autocast dtype, senders' log-probs."""
        a = self.args
        return dict(pad_id=self.pad_id, stop_ids=self.stop_ids, micro_tokens=a.micro_tokens,
                    inner_steps=a.inner_steps, max_grad_norm=a.max_grad_norm, temperature=a.temperature,
                    ref_model=self.ref_model, behaviour=self.behaviour(groups), autocast_dtype=self.amp_dtype,
                    epsilon=a.epsilon, epsilon_high=a.epsilon_high, beta=a.beta, loss_type=a.loss_type,
                    max_tokens=a.max_new_tokens)

    def update(self, groups):
        """Step 6: group-normalised advantages, then a GRPO step (grpo.step) unless they are all zero; the
        sampling copy gets the new weights. Returns the step's stats; `stepped` says whether it stepped."""
        if self.rule.informative_only and any(map(informative, groups)):  # a silo baseline (RULES)
            groups = [g for g in groups if informative(g)][:self.rule.resample[0] or None]  # resample: target
        batch, _, adv = self.batch(groups)
        if not bool((adv != 0).any()):
            return dict(stepped=False, zero_adv_frac=1.0, train_tok_per_s=0.0)
        t0 = time.time()
        stats = grpo.step(self.model, self.opt, batch, adv.tolist(), **self.grpo_settings(groups))
        if self.sampler is not self.model:
            with torch.no_grad():
                for ps, pm in zip(self.sampler.parameters(), self.model.parameters()):
                    ps.copy_(pm)
        tokens = sum(len(c) for g in groups for c in g.completions)
        return dict(stats, stepped=True, train_tok_per_s=tokens / max(time.time() - t0, 1e-9))

    def log_round(self, r, collected, external, counts, stats, seconds):
        """Step 7: the round's metrics, written as a line of metrics.jsonl."""
        local = collected["groups"]
        batch, outs = local + collected.get("extra", []) + external, [c for g in local for c in g.completions]
        m = dict(round=r, stepped=stats.pop("stepped"),
                 local_reward=mean([x for g in local for x in g.rewards]),  # the skill: its own rollouts
                 batch_reward=mean([x for g in batch for x in g.rewards]),  # the paper's figure
                 **counts, external_used=len(external),
                 frac_zero_std_local=mean([float(not informative(g)) for g in local]),  # no advantage
                 frac_zero_std_batch=mean([float(not informative(g)) for g in batch]),
                 completion_len=mean([len(c) for c in outs]),
                 truncated_frac=mean([float(not s) for g in local for s in g.stopped]),
                 sample_tok_per_s=sum(len(c) for c in outs) / max(collected["sample_seconds"], 1e-9),
                 round_seconds=seconds, **{k: round(v, 6) for k, v in stats.items()})
        with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(m) + "\n")
        return m


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


# ----- Nothing below this line is needed to understand SAPO: plumbing follows. -----
# The flags and their checks, the peer's loading, loop and checkpoints, the launcher, the plot, the command line.


# -----------------------------------------------------------------------------
# a receiver's judges beyond the paper, kept for their measurements: plausible, whole (docs/offpolicy.md)


def surprisal(peer, g):
    """A group's completions' -log-probs per character (a stop token is one) under the peer's own model."""
    batch = grpo.pack([(g.prompt, g.completions)], peer.pad_id, peer.stop_ids, peer.args.device)
    with torch.no_grad():
        logp = grpo.completion_logprobs(peer.model, batch, peer.args.temperature, peer.amp_dtype).sum(1)
    return [-lp / max(len(t) + s, 1) for lp, t, s in zip(logp.tolist(), g.texts, g.stopped)]


def plausible(peer, groups):
    """The shared groups the receiver could have written: half or more of their completions no more surprising
    per character to its own model than the median of its own this round, whatever tokenizer wrote them."""
    own = sorted(x for g in peer.own for x in surprisal(peer, g))
    median = own[len(own) // 2] if own else float("inf")
    return [g for g in groups if 2 * sum(x <= median for x in surprisal(peer, g)) >= len(g.completions)]


def whole(peer, groups):
    """Of each shared group, the completions that fit the receiver's own length limit as their sender wrote
    them, if they still disagree: one it must cut (retokenise) is a fragment no policy wrote, scored as if
    one had. In a swarm of one tokenizer and one limit only a text that re-tokenises longer is cut."""
    def uncut(text, stopped):  # retokenise's test, on the text as it was sent
        ids = peer.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return len(ids) + stopped <= peer.args.max_new_tokens
    kept = []
    for g in groups:
        k = [i for i, sent in enumerate(zip(g.item["completions"], g.item["stopped"])) if uncut(*sent)]
        part = {f: [getattr(g, f)[i] for i in k] for f in ("completions", "texts", "stopped", "rewards")}
        h = dataclasses.replace(g, **part, logprobs=g.logprobs and [g.logprobs[i] for i in k])
        kept += [h] * informative(h)
    return kept


def parse_args(argv=None):
    """The run's settings: the flags, then the device's defaults (device_defaults) where a flag leaves
    them, then the silo rule. A wrong flag gets one line (one_line) and exit status 2 before torch loads:
    the flags are read and checked first, by a parser that needs no device (--help, which shows this
    machine's defaults, loads torch first)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    device = resolve_device(one_line(device_flag()), argv) if {"-h", "--help"} & set(argv) else None
    p = one_line(parser(device, *device_defaults(device)["IJ"]))
    args = p.parse_args(argv)
    args.token = getattr(args, "token", None) or os.environ.get("SWARM_TOKEN")
    check_flags(p, args)
    check_resume(p, args)
    device = device or resolve_device(p, argv)  # torch loads here
    defaults = device_defaults(device)
    I, J = defaults.pop("IJ")
    for flag, value in dict(defaults, model=M.DEFAULT_MODEL).items():
        if getattr(args, flag) is None:  # (left to the device's default)
            setattr(args, flag, value)
    args.device, args.models = device, [m or args.model for m in args.models]
    auto = "easy" if M.DEFAULT_MODEL in args.models else "paper"  # the easy mix for the 135M default
    args.task_list = reward.task_names(auto if args.tasks == "auto" else args.tasks)
    # The silo rule: a peer with J = 0, or with no swarm to join, takes I + J as I (the paper's 8/0).
    if args.external is None:
        args.external = J if args.swarm or args.peers else 0
    if args.local is None:
        args.local = I if args.external else I + J
    apply_rule(p, args, argv)
    args.out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    return args


def check_flags(p, args):
    """parse_args' checks of what the flags say together, in one sentence each, before torch loads: the
    token, the models, the tasks, J without a swarm, and what a swarm group may hold (swarm.Limits)."""
    if args.resume and not args.out:
        p.error("--resume needs --out: the run folder to continue")
    args.models = [args.model]  # a folder is one model, even with a comma in its name
    if args.model and not os.path.isdir(args.model):
        args.models = args.model.split(",")
    if len(args.models) > 1 and not args.peers:
        p.error("--model takes a comma list only with --peers N, whose peers take the models in turn")
    try:
        if args.tasks != "auto":
            reward.task_names(args.tasks)
        swarm.check_token(args.token)
    except ValueError as e:  # its sentence names the known tasks, or what a token may hold
        p.error(str(e))
    if args.external and not (args.swarm or args.peers):  # J > 0, and nothing to take groups from
        p.error("--external needs --swarm URL or --peers N; "
                "without a swarm leave it out (in silo I takes I + J)")
    if not (args.swarm or args.peers):
        return
    caps = [("--generations", args.generations, swarm.Limits.group_completions, "completions a group"),
            ("--local", args.local, swarm.Limits.batch_groups, "groups a batch"),
            ("--max-new-tokens", args.max_new_tokens, swarm.Limits.completion_tokens, "tokens a completion")]
    for flag, value, most, what in caps:  # what the server takes; a default is always within it
        if (value or 0) > most:
            p.error(f"{flag} {value} is more than the {most} {what} of a swarm may hold: "
                    "give at most that, or train in silo (without --swarm or --peers)")


def apply_rule(p, args, argv):
    """The settings that --rule's rule sets (Rule.flags) into args; one sentence if a flag given says otherwise."""
    given = {f.split("=")[0] for f in argv}
    for flag, value in RULES[args.rule].flags:
        name = flag.replace("_", "-")
        if {f"--{name}", f"--no-{name}"} & given and getattr(args, flag) != value:
            p.error(f"--rule {args.rule} sets --{name} to {value}: leave --{name} out")
        setattr(args, flag, value)


def one_line(p, prog="train.py"):
    """The argparse parser p, its errors made one line: the sentence, and where to look."""
    p.error = lambda message: p.exit(2, f"{prog}: {message.rstrip('.')}; see python {prog} --help\n")
    return p


def import_torch():
    """The imports the top of this file leaves to python train.py until its flags are read."""
    global grpo, M, sample, torch, tqdm
    if "torch" in globals():  # (imported as a module: done at its top)
        return
    import grpo
    import model as M
    import sample
    import torch
    from tqdm import tqdm


def resolve_device(p, argv):
    """--device as a torch.device (by default cuda where torch sees a GPU, else cpu), or one line from p
    if torch knows no such device, or sees no GPU for it. Torch loads here (import_torch)."""
    import_torch()
    value = one_line(device_flag()).parse_known_args(argv)[0].device
    value = value or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)
    except RuntimeError:  # torch's own sentence lists every device type it knows
        p.error(f"argument --device: must be a device such as cuda, cuda:1, cpu or mps, not {value!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {device} was asked for, but torch sees no CUDA GPU")
    return device


def small_defaults(device):  # whether a torch.device gets the smaller defaults: a CPU, or anything but CUDA
    return device.type != "cuda"


def device_defaults(device):
    """The defaults that depend on the device (None: not yet known, all None): I and J (4 and 4, the
    paper's best), G, completion length, micro-batch, recomputed activations and the sampler's dtype.
    A CPU, or any device but a CUDA GPU, gets smaller ones (small_defaults): ~100x slower, it holds
    several peers in its memory."""
    if device is None:
        return dict(IJ=(None, None), generations=None, max_new_tokens=None, micro_tokens=None,
                    grad_checkpoint=None, dtype=None)
    cpu = small_defaults(device)
    return dict(IJ=(2, 2) if cpu else (4, 4), generations=4 if cpu else 8, max_new_tokens=64 if cpu else 256,
                micro_tokens=1024 if cpu else 8192, grad_checkpoint=cpu,
                dtype=str(M.default_dtype(device)).removeprefix("torch."))


def device_flag():  # --device alone, which resolve_device reads first; parser takes it over as a parent
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--device", help="cuda, cuda:1, cpu, mps, ... (default: cuda where torch sees a GPU, "
                                    "else cpu; any device but a CUDA GPU gets a CPU's smaller sizes)")
    return p


def parser(device, I, J):
    """Every flag, with its meaning and its default on `device`, I and J among them (device_defaults).
    With no device yet (None) those defaults are None, for parse_args to fill in."""
    defaults = device_defaults(device)
    if device is None or small_defaults(device):
        said = ("smaller than a GPU's (4, 4, 8, 256, 8192, off) for --local, --external, --generations, "
                "--max-new-tokens, --micro-tokens and --grad-checkpoint.")
    else:
        said = "a CPU's are smaller, see the README."
    p = argparse.ArgumentParser(description="SAPO: swarm sampling policy optimization (arXiv 2509.08721)",
                                formatter_class=Help, allow_abbrev=False, parents=[device_flag()],
                                epilog=f"The defaults shown are this machine's ({device}): "
                                       f"{said} {BAR_HELP}")
    a = p.add_argument
    # what to run
    a("--peers", type=at_least(0), nargs="?", const=4, default=0,
      help="start a swarm of N peers on this machine (alone: 4)")
    a("--swarm", type=swarm_url, help="URL of a swarm server to join (http://HOST:PORT, or https://)")
    a("--name", type=matching(swarm.NAME.pattern, swarm.NAMES),
      help=f"this peer's name in the swarm: {swarm.NAMES} (default: the host name and a random suffix)")
    a("--token", default=argparse.SUPPRESS,  # never shown: --help would print the secret of $SWARM_TOKEN
      help="bearer token of the swarm server, for reads and writes "
           "(default: $SWARM_TOKEN, which ps does not show)")
    a("--plot", metavar="RUN_DIR", help="write RUN_DIR/reward.svg from its metrics and exit")
    # model and tasks
    a("--model", default=M.DEFAULT_MODEL if device else None,
      help="model folder or Hub id (Llama, Qwen2, Qwen3); --peers: a comma list, in turn")
    a("--tasks", default="auto",
      help="comma list of reward.py tasks, or 'paper' (the nine), 'rg:paper' (the nine from reasoning_gym), "
           "'easy', 'auto' ('easy' for the default 135M model, 'paper' otherwise)")
    a("--system-prompt", default="default", choices=list(reward.SYSTEM_PROMPTS),
      help="the system prompt: ours, or 'rg', ReasoningGym's default one, which the paper used")
    a("--one-shot", action=argparse.BooleanOptionalAction, default=True,
      help="show one worked example of the task family as an earlier chat turn")
    learning_flags(a, I, J, defaults)
    machinery_flags(a, defaults)
    return p


def learning_flags(a, I, J, defaults):
    """parser's flags of SAPO (the paper's best: I = 4, J = 4; its baseline in silo: I = 8, J = 0) and GRPO."""
    a("--local", type=at_least(1),
      help=f"I: local questions per round (default: {I}; {I and I + J} in silo, with J = 0, "
           "as in the paper's baseline)")
    a("--external", type=at_least(0),
      help=f"J: external groups trained on per round (default: {J} with --swarm or --peers, else 0: in silo)")
    a("--generations", type=at_least(2), default=defaults["generations"],
      help="G: completions per question, compared by GRPO")
    a("--rounds", type=at_least(1), default=2000, help="rounds to train")
    a("--max-new-tokens", type=at_least(1), default=defaults["max_new_tokens"],
      help="completion length limit in tokens")
    a("--temperature", type=positive, default=1.0, help="sampling temperature")
    # GRPO
    a("--lr", type=positive, default=1e-5, help="AdamW learning rate (measured: docs/learning-rate.md)")
    a("--epsilon", type=fraction, default=0.2, help="lower clip: ratio >= 1 - epsilon")
    a("--epsilon-high", type=at_least(0.0, float), default=0.28,
      help="upper clip: ratio <= 1 + epsilon_high (DAPO)")
    a("--beta", type=at_least(0.0, float), default=0.0,
      help="weight of the k3 KL penalty to the initial model")
    a("--loss-type", default="token_mean", choices=["token_mean", "seq_mean", "constant"],
      help="how token losses are averaged: DAPO's token mean, GRPO's per-sequence mean, "
           "or Dr. GRPO's constant")
    a("--adv-scale", default="group", choices=["group", "batch", "none"], help="advantage normalisation")
    a("--inner-steps", type=at_least(1), default=1,
      help="optimizer steps on each round's batch (1: one step per round)")
    a("--max-grad-norm", type=positive, default=1.0, help="gradient clipping norm")
    a("--micro-tokens", type=at_least(1), default=defaults["micro_tokens"],
      help="tokens per forward and backward pass: whole groups, each packed into one row "
           "(a longer group goes alone)")
    a("--grad-checkpoint", action=argparse.BooleanOptionalAction, default=defaults["grad_checkpoint"],
      help="recompute activations in the backward pass")
    a("--shared-logprobs", action=argparse.BooleanOptionalAction, default=False,
      help="publish sampling log-probs, and train shared completions against their sender's "
           "(off: the paper's rule)")
    a("--rule", default="paper", choices=list(RULES), help="the receiver's selection rule, from RULES "
      "(above train.py's marker): " + "; ".join(f"{name}, {rule.what}" for name, rule in RULES.items()))


def machinery_flags(a, defaults):
    """parser's flags that set where and how a run goes, not what it learns."""
    a("--seed", type=int, default=0,
      help="this peer's seed (questions, sampling, external draws, init); "
           "peer k of --peers gets peer_seed(seed, k)")
    a("--dtype", choices=["bfloat16", "float16", "float32"], default=defaults["dtype"],
      help="sampling copy's dtype (bfloat16 on a CUDA GPU that has it natively, else float16; "
           "float32 off CUDA)")
    a("--out", type=writable_folder,
      help="run folder (default: runs/<date-time>); each peer writes OUT/<name>/")
    a("--save-every", type=at_least(0), default=50,
      help="checkpoint every K rounds (0: only at the end or on a stop)")
    a("--sample-every", type=at_least(0), default=10,
      help="write some completions to samples.jsonl every K rounds")
    a("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    a("--quiet", action="store_true", help="no progress bar (a line per round instead)")


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help with every default said once: argparse's "(default: X)", unless the help says it in words."""

    def _get_help_string(self, action):
        said = action.default is None or action.default is False or "default" in action.help
        return action.help if said else super()._get_help_string(action)


def at_least(low, kind=int, below=None, positive=False):
    """An argparse type: a number of `kind`, at least `low` and below `below` (positive: above 0 as well)."""
    def number(text):
        value = kind(text)  # a ValueError: argparse says "invalid int value"; NaN fails the test below
        if not (value >= low and (below is None or value < below) and (value > 0 or not positive)):
            bounds = "positive" if positive else f"at least {low}"
            bounds += f" and below {below}" if below else ""
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {text}")
        return value
    number.__name__ = kind.__name__
    return number


positive = at_least(0, float, positive=True)
fraction = at_least(0, float, below=1)  # in [0, 1)


def matching(pattern, what):
    """An argparse type: a string that fully matches the regular expression `pattern`."""
    def string(text):
        if not re.fullmatch(pattern, text):
            raise argparse.ArgumentTypeError(f"must be {what}, not {text!r}")
        return text
    return string


def swarm_url(text):
    """An argparse type: a swarm server's http(s) URL; Redis is a server's store, never a peer's."""
    if re.match(r"rediss?://", text, re.I):
        raise argparse.ArgumentTypeError(swarm.REDIS_PEER)
    return matching(r"https?://\S+", "a URL such as http://10.0.0.5:8000")(text)


def writable_folder(path):
    """An argparse type: a folder that exists or can be made, and written in (checked, not made yet)."""
    here = os.path.abspath(path)
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise argparse.ArgumentTypeError(f"{here} is a file, not a folder: give a folder for the run")
    if not os.access(here, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {here}: give a folder of yours")
    return path


def check_resume(p, args):
    """--resume without --name: the one peer in --out. One sentence, before any model loads, if --out
    holds none, several, a swarm launched with --peers N (swarm/ beside peer0, ...), or peers that have
    done their --rounds."""
    if not args.resume:
        return
    out, peers = args.out, sorted(glob.glob(os.path.join(glob.escape(args.out), "*", "settings.json")))
    if not args.name:
        peers = [os.path.basename(os.path.dirname(f)) for f in peers]
        launched = sum(bool(re.fullmatch(r"peer\d+", n)) for n in peers)
        launched *= os.path.isdir(os.path.join(out, "swarm"))  # peers of a launcher share its server's folder
        if launched and args.peers != launched:
            p.error(f"{out} holds a swarm of {launched} peers: resume it with "
                    f"python train.py --peers {launched} --resume --out {out}")
        if not peers:
            p.error(f"there is nothing to resume in {out}: no peer has started there; "
                    "leave out --resume to start")
        if len(peers) > 1 and not args.peers:
            p.error(f"{out} holds {len(peers)} peers ({', '.join(peers)}): "
                    "pass --name to say which one to resume")
        if args.peers and not launched:
            p.error(f"{out} holds no swarm launched with --peers: resume it without --peers")
        args.name = None if args.peers else peers[0]
    names = [f"peer{k}" for k in range(args.peers)] or [args.name]
    saved = [last_checkpoint(os.path.join(out, n)) for n in names]
    if all(c and c["round"] + 1 >= args.rounds for c in saved):
        p.error(f"{out} has done its --rounds {args.rounds}: --resume has nothing left to do; "
                "pass a larger --rounds")


# -----------------------------------------------------------------------------
# one peer: its state, its loop, its checkpoints


class Peer(Algorithm1):
    """One SAPO peer: what Algorithm1 takes, loaded; its swarm client; the loop over rounds; the
    checkpoints. client is one to use instead of --swarm's: a driver of several peers in one process
    passes its own (and parses --swarm too, or parse_args takes the peer for one in silo and refuses
    --external J > 0)."""

    def __init__(self, args, log=print, client=None):
        self.name = peer_name(args, log)
        folder = os.path.join(args.out, self.name)
        self.device = torch.device(args.device)
        ckpt = last_checkpoint(folder) if args.resume else None  # None: a fresh start
        if os.path.exists(os.path.join(folder, "metrics.jsonl")) and not args.resume:
            raise SystemExit(f"{folder} already holds a run: pass --resume to continue it, or another --out")
        torch.manual_seed(args.seed)
        model, tok, ref_model = load_models(args, folder, ckpt, self.device, log)
        os.makedirs(folder, exist_ok=True)  # (a run that cannot start leaves nothing behind)
        tidy(folder)
        model.grad_checkpoint = args.grad_checkpoint
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
        opt.register_step_pre_hook(lambda *_: setattr(self, "busy", True))  # the weights change: see run()
        # Sampling runs from a --dtype copy (model.default_dtype's pick), refreshed after every step, or in
        # float32 from the model itself.
        sampler = model
        if args.dtype != "float32":
            sampler = copy.deepcopy(model).to(getattr(torch, args.dtype)).eval()
        amp_dtype = M.autocast_dtype(self.device)  # the training autocast: bfloat16 where native, else None
        super().__init__(args, model, tok, opt, sampler, ref_model, amp_dtype, folder, log)
        self.start_round, seen = 0, []
        if ckpt:
            seen = self.load_state(ckpt)
        elif args.resume:  # (killed before its first checkpoint) the rows stay; a round's later row wins
            log(f"{self.dir}: no checkpoint yet, so it starts again from round 0; metrics.jsonl keeps "
                "its rows, and --plot and the dashboard show a round's newest")
        self.client = client
        if client is None and args.swarm:  # with J = 0 a peer still shares its rollouts
            self.client = connect(args, self.name, self.start_round, seen, log)
        with open(os.path.join(folder, "settings.json"), "w") as f:
            # never the token, nor a password in the URL: no secret goes to disk
            shown = {k: hide_password(v) if k == "swarm" and v else v for k, v in vars(args).items()
                     if k != "token"}
            json.dump(shown, f, indent=2, default=str)  # str: the device

    def learn(self, r, collected):
        """Algorithm1.learn, then the memory the step freed goes back to the operating system. glibc keeps
        it otherwise, so an idle CPU peer would sit at its training peak, and several peers on one machine
        would add up to more than it has."""
        m = super().learn(r, collected)
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: nothing to do
            pass
        return m

    def log_round(self, r, collected, external, counts, stats, seconds):
        """Algorithm1.log_round, then two completions of two local groups in samples.jsonl every
        --sample-every rounds, and the metrics on the swarm's dashboard. A stop waits for the round's end
        from here (busy), as it does from an optimizer step on."""
        self.busy = True
        m = super().log_round(r, collected, external, counts, stats, seconds)
        if self.args.sample_every and r % self.args.sample_every == 0:
            with open(os.path.join(self.dir, "samples.jsonl"), "a") as f:
                for g in collected["groups"][:2]:
                    for text, score in list(zip(g.texts, g.rewards))[:2]:
                        row = dict(round=r, task=g.item["task"], question=g.item["question"],
                                   answer=g.item["answer"], completion=text, reward=score)
                        f.write(json.dumps(row) + "\n")
        if self.client is not None:
            self.client.post_metrics(r, {k: float(v) for k, v in m.items() if isinstance(v, (int, float))})
        return m

    # -- the loop over rounds, checkpoints and resume -------------------------------------------------

    def run(self):
        """Rounds start_round to --rounds - 1, then a checkpoint of the last. Ctrl-C or SIGTERM (the
        launcher's stop) abandons the round in progress if its weights are unchanged: until its first
        optimizer step, which the optimizer's pre-hook marks (busy), or until it writes its metrics. A
        round past that point is finished first. Either way the last completed round is saved at once,
        with the state it ended with (kept), and --resume goes on at the next. Returns whether it stopped."""
        args, rows = self.args, []  # rows: the metrics of the rounds done
        done, kept = self.start_round - 1, self.trainer_state()  # the last completed round, and its state
        self.busy = self.stopping = False
        handlers = {sig: signal.signal(sig, self.interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        bar = tqdm(total=args.rounds, initial=self.start_round, desc=self.name, dynamic_ncols=True,
                   bar_format=BAR, disable=args.quiet)
        if self.client is not None and args.external:  # a first round, fresh or resumed, has external groups
            self.client.flush(FIRST_READ_SECONDS)  # (the read of round start_round, as an unstopped peer's)
        try:
            for r in range(self.start_round, args.rounds):
                m = self.learn(r, self.collect(r))  # (a stop before its step abandons round r)
                done, kept = r, self.trainer_state()
                if args.save_every and (r + 1) % args.save_every == 0:
                    self.save(r, kept)
                self.busy = False
                bar.update(1)
                rows.append(m)
                bar.set_postfix(progress(rows, args.rounds))
                if args.quiet:
                    self.log(f"round {r}: local_reward {m['local_reward']:.3f} "
                             f"(batch_reward {m['batch_reward']:.3f}, the paper's figure) "
                             f"external {m['external_used']} len {m['completion_len']:.0f} "
                             f"sample {m['sample_tok_per_s']:.0f} tok/s, {m['round_seconds']:.1f} s")
                if self.stopping:
                    break
        except KeyboardInterrupt:
            self.stopping = True
        self.busy = True  # the last checkpoint is written whatever arrives now
        bar.close()
        self.finish(done, kept)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        return self.stopping

    def finish(self, done, kept):
        """The end of run(): the last completed round saved (unless --save-every just did), saying so after
        a stop, and the swarm client closed. While a stopped peer saves, its folder holds SAVING, and the
        launcher waits for it."""
        args = self.args
        if self.stopping:
            say_saving(self.dir, True)
        if done >= self.start_round and not (args.save_every and (done + 1) % args.save_every == 0):
            self.save(done, kept)
        say_saving(self.dir, False)
        if self.stopping:
            self.log(f"stopped after round {done}, the last completed one, which is saved" if done >= 0
                     else "stopped before its first round ended: nothing to save")
        if self.client is not None:  # what is queued may go, then one line says what could not
            self.client.close(wait=FLUSH_SECONDS)

    def interrupt(self, signum, frame):
        """Ctrl-C or SIGTERM in run(): stop now if the weights are those of the last completed round, else
        after this round, saying meanwhile that it saves (SAVING)."""
        self.stopping = True
        if not self.busy:
            raise KeyboardInterrupt
        say_saving(self.dir, True)

    def trainer_state(self):
        """What a checkpoint keeps beside the weights, as it is now: the optimizer, the random states, the
        undrawn external pool, the swarm client's read state and the length of metrics.jsonl. The optimizer's
        tensors are its own (not copies): they change only in a step, and a round that steps is finished."""
        metrics = os.path.join(self.dir, "metrics.jsonl")
        return {"optimizer": self.opt.state_dict(), "torch_rng": torch.get_rng_state(),
                "external_rng": json.dumps(self.external_rng.getstate()), "pool": list(self.pool),
                "seen": list(getattr(self.client, "seen", [])),
                "metrics_bytes": os.path.getsize(metrics) if os.path.exists(metrics) else 0}

    def save(self, round_, state=None):
        """checkpoint-<round>/: a Hugging Face folder transformers can load, plus trainer_state.pt (state:
        trainer_state() at the end of round_, by default now). model.save_model renames it into place whole; then
        checkpoint.json, the pointer resume reads, is replaced at once, and older checkpoints go: a stop at
        any moment leaves the pointer naming a whole checkpoint, with the length metrics.jsonl had then."""
        name, state = f"checkpoint-{round_}", state or self.trainer_state()
        extra = dict(state, round=round_, pool=[dataclasses.asdict(x) for x in state["pool"]])
        M.save_model(self.model, self.tok, os.path.join(self.dir, name),
                     write_extra=lambda folder: torch.save(extra, os.path.join(folder, "trainer_state.pt")))
        with open(os.path.join(self.dir, "checkpoint.json.tmp"), "w") as f:
            json.dump(dict(round=round_, checkpoint=name, metrics_bytes=state["metrics_bytes"]), f)
        os.replace(os.path.join(self.dir, "checkpoint.json.tmp"), os.path.join(self.dir, "checkpoint.json"))
        tidy(self.dir)

    def load_state(self, ckpt):
        """A checkpoint's (last_checkpoint's dict) optimizer, random state and pool; returns the client's
        `seen`."""
        path = os.path.join(ckpt["path"], "trainer_state.pt")
        if not os.path.exists(path):  # (deleted to keep less: sample.py needs the weights only)
            raise SystemExit(f"train.py: {path} is gone, so --resume cannot go on; "
                             f"--model {ckpt['path']} starts anew")
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"].cpu())
        v, internal, gauss = json.loads(state["external_rng"])
        self.external_rng.setstate((v, tuple(internal), gauss))
        self.start_round, self.pool = state["round"] + 1, [Group(**x) for x in state.get("pool", [])]
        path = os.path.join(self.dir, "metrics.jsonl")  # lines after the checkpoint's: rounds that run again
        if os.path.exists(path) and os.path.getsize(path) > ckpt["metrics_bytes"]:
            os.truncate(path, ckpt["metrics_bytes"])
        self.log(f"resumed {self.name} from {ckpt['path']} at round {self.start_round}")
        return state.get("seen", [])


def load_models(args, folder, ckpt, device, log):
    """The policy and its tokenizer in float32, from the checkpoint ckpt or else --model, and with beta > 0
    the KL's reference: the initial model, --model, also after a resume. One sentence if one cannot load."""
    try:
        if ckpt and args.beta > 0:
            started = M.read_json(os.path.join(folder, "settings.json")).get("model")
            if started != args.model:
                raise ValueError(f"{folder} started from --model {started} (the KL's reference): "
                                 "resume with it")
        model, tok = M.load_model(ckpt["path"] if ckpt else args.model, device, torch.float32, log=log)
        ref_model = None
        if args.beta > 0:
            ref_model = M.load_model(args.model, device, torch.float32, log=log)[0]
    except (OSError, ValueError, RuntimeError) as e:  # a model that cannot be found or read
        raise SystemExit(f"train.py: {e}") from None
    return model, tok, ref_model


def connect(args, name, round_, seen, log=print):
    """The client of --swarm, reading 4J groups a round whatever the swarm's size, with the read state
    (round_, seen) of a resumed peer: as if it had never stopped. A server's first line says whether it
    answers (health)."""
    sample = max(1, min(4 * args.external, swarm.Limits.sample_groups))
    seed = stream(args.seed, "external", "reads").getrandbits(63)
    try:
        client = swarm.connect(args.swarm, name, token=args.token, sample=sample, seed=seed,
                               round=round_, seen=seen)
    except ValueError as e:  # a URL it cannot use
        raise SystemExit(f"train.py: --swarm: {e}") from None
    log(health(args.swarm, args.token))
    return client


def health(url, token=None):
    """One line on the swarm server at url, from its /health: its dashboard if it answers, else why not, and
    that the peer trains alone until it does (the client keeps trying)."""
    import requests
    shown = hide_password(url.rstrip("/"))
    try:
        reply = requests.get(f"{url.rstrip('/')}/health", timeout=5,
                             headers={"Authorization": f"Bearer {token}"} if token else {})
        if reply.ok:
            return f"swarm: {shown} answers; its dashboard: {shown}/"
        why = f"it answers HTTP {reply.status_code}"
    except requests.RequestException as e:
        found = re.search(r"\[Errno -?\d+\] [^'\")]+", str(e))
        why = found.group(0) if found else type(e).__name__
    return (f"swarm: {shown} does not answer ({why}): this peer trains on its own groups alone, and keeps "
            "trying to share them, until it does")


def hide_password(url):  # a URL as it may be shown or written: no password
    return re.sub(r"(://[^/@]*?):[^/@]*@", r"\1:***@", url)


SAVING = ".saving"  # a peer folder's file while a stopped peer writes its last checkpoint: wait for it


def say_saving(folder, on):
    """Whether the peer in folder is saving after a stop, said by SAVING (its pid) for the launcher."""
    path = os.path.join(folder, SAVING)
    if on:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    elif os.path.exists(path):
        os.remove(path)


def tidy(folder):
    """Remove from a peer folder what its checkpoint pointer does not name: older checkpoints, and what a
    save cut short left (a .tmp- folder, a checkpoint.json.tmp), or a stale SAVING. At a start, a resume
    and after every save: nothing half written stays on disk."""
    kept = (last_checkpoint(folder) or {}).get("checkpoint")
    for name in os.listdir(folder):
        if re.fullmatch(r"checkpoint-.*|\.tmp-.*", name) and name != kept:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        elif name in ("checkpoint.json.tmp", SAVING):
            os.remove(os.path.join(folder, name))


def last_checkpoint(folder):
    """folder/checkpoint.json (Peer.save) as a dict: round, checkpoint, metrics_bytes, path; None before any."""
    path = os.path.join(folder, "checkpoint.json")  # replaced whole (os.replace), never removed
    pointer = None
    if os.path.exists(path):
        with open(path) as f:
            pointer = json.load(f)
    return dict(pointer, path=os.path.join(folder, pointer["checkpoint"])) if pointer else None


def peer_name(args, log):
    """--name, or else the host name plus a random suffix: two peers on one host must differ, because
    the server and the client leave out a peer's own groups by name."""
    if args.name:
        return args.name
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:57].lstrip("_.-") or "peer"
    name = f"{host}-{secrets.token_hex(3)}"
    if args.swarm:  # (in silo it names the peer's folder only)
        log(f"this peer's name in the swarm: {name} (--name sets it)")
    return name


def peer_seed(seed, k):
    """The seed of peer k in a swarm launched with --seed seed: a hash of both, 63 bits. (seed + k would
    make --seed 1's peer0 the same peer as --seed 0's peer1.)"""
    return int.from_bytes(hashlib.sha256(f"{seed}/{k}".encode()).digest()[:8], "big") >> 1


def progress(rows, rounds):
    """A progress bar's numbers from a peer's metrics rows: the last one's local and batch reward and
    external groups; the pace from their mean round_seconds (the peer's own, as the launcher's clock
    counts start-up); the time left."""
    m, seconds = rows[-1], max(mean([row["round_seconds"] or 0.0 for row in rows]), 1e-9)
    left = (rounds - m["round"] - 1) * seconds
    return dict(reward=f"{m['local_reward']:.2f}", batch=f"{m['batch_reward']:.2f}",
                ext=int(m["external_used"]), pace=f"{60 / seconds:.2g} rounds/min",
                left=f"{left // 3600:.0f}h{left % 3600 // 60:02.0f}m")


BAR = "{desc}: {n_fmt}/{total_fmt} rounds{postfix} |{bar}|"  # no tqdm rate or clock: the pace is a peer's
BAR_HELP = ("A peer's progress bar: reward, its local reward; batch, its batch reward (the paper's figure); "
            "ext, the external groups of its last round; pace, its mean rounds a minute.")

# -----------------------------------------------------------------------------
# the launcher: a server and N peers on one machine

def launch(args, argv):
    """A swarm server on a free loopback port, in this process, and args.peers peer processes, each with a
    credential of its own (so each writes only as itself; reads need none unless --token); their progress
    together, from the metrics they post; on Ctrl-C all stop (each saves its last completed round). A peer
    that dies is reported and the others go on; the launcher then exits non-zero, saying why."""
    if not args.resume and glob.glob(os.path.join(args.out, "*", "metrics.jsonl")):
        raise SystemExit(f"{args.out} already holds a run: pass --resume to continue it, or another --out")
    models = [args.models[k % len(args.models)] for k in range(args.peers)]  # peer k takes them in turn
    try:  # each model once, here: a first download or GGUF dequantisation must not run in every peer at once
        sizes = {m: model_size(M.resolve(m)) for m in dict.fromkeys(models)}
        check_memory(args, [sizes[m] for m in models])
        print(run_line(args, [sizes[m][1] for m in models]))
        os.makedirs(args.out, exist_ok=True)
        tokens = {f"peer{k}": secrets.token_urlsafe(24) for k in range(args.peers)}  # one credential per peer
        server, url = swarm.start_server(os.path.join(args.out, "swarm"), token=args.token, peers=tokens,
                                         public_reads=not args.token, score=reward.score)  # in this process
    except (OSError, ValueError, RuntimeError) as e:
        raise SystemExit(f"train.py: {e}") from None
    children, failed, bars, stopped = [], {}, {}, False
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as Ctrl-C does
    signal.signal(signal.SIGHUP, signal.default_int_handler)  # the terminal closed: stop the children too
    try:
        print(f"dashboard: {url}/ (open it in a browser to see each peer's reward and latest completions)")
        procs = {n: start_peer(args, argv, k, url, children, tokens[n]) for k, n in enumerate(tokens)}
        # a bar a peer; in a mixed swarm each bar names its peer's model
        desc = {n: f"{n} ({label(models[k])})" if len(sizes) > 1 else n for k, n in enumerate(procs)}
        bars.update({n: tqdm(total=args.rounds, desc=desc[n], position=k, dynamic_ncols=True, bar_format=BAR)
                     for k, n in enumerate(procs)})
        watch(args, server, procs, bars, failed)
        print(f"{len(procs) - len(failed)} of {len(procs)} peers finished")
    except KeyboardInterrupt:
        stopped = True
    finally:
        for b in bars.values():  # each redrawn whole (over a ^C the terminal echoed), and never again
            b.close()
        if stopped:
            print("stopping every peer (each saves its last completed round) and the server...")
        stop_all(children)
        server.shutdown()
    print(next_steps(args, argv, stopped or bool(failed)))
    if stopped or failed:
        raise SystemExit(130 if stopped else "\n".join(failed.values()))


def watch(args, server, procs, bars, failed):
    """The launcher's loop until every peer has exited: each one's bar from the metrics it posts to the
    server, and a line for each that fails (failed: its name -> why, filled in here)."""
    seen, got = 0, {}  # the peers' metrics rows as the server got them
    while len(failed) < len(procs) and any(p.poll() is None for p in procs.values()):
        time.sleep(1.0)
        rows, seen, _ = server.store.read_metrics(seen)
        for row in map(json.loads, rows):
            got.setdefault(row["peer"], []).append(row["metrics"])
        for n, proc in procs.items():
            if n in got:
                bars[n].n = int(got[n][-1]["round"]) + 1
                bars[n].set_postfix(progress(got[n], args.rounds))  # and redraw
            if proc.poll() not in (None, 0) and n not in failed:
                failed[n] = f"{n} {why_stopped(proc.returncode)}: see {args.out}/{n}/log.txt"
                tqdm.write(failed[n] + "; the others go on")


def run_line(args, params):
    """What a run is, in a line: its folder, I, J, G, the completions' length, its rounds and device; and in
    another the disk its checkpoints take (params: each peer's parameter count). A peer keeps its newest
    checkpoint only: float32 weights and AdamW's two moments, 12 bytes a parameter (two checkpoints for a
    moment, while it writes the next)."""
    silo = " (in silo)" if not args.external else f", selection rule {args.rule}"
    each = sorted(12 * n / 1e9 for n in params)
    size = f"{each[0]:.2g} GB" if each[0] == each[-1] else f"{each[0]:.2g} to {each[-1]:.2g} GB"
    run = f"one a peer, about {sum(each):.2g} GB in all" if len(each) > 1 else "its newest only"
    return (f"run folder: {args.out}; I = {args.local}, J = {args.external}{silo}, G = {args.generations}, "
            f"{args.max_new_tokens} new tokens, {args.rounds} rounds on {args.device} "
            "(--help shows the defaults)\n"
            f"disk: a checkpoint takes about {size} (a third of it weights, the rest the optimizer's state); "
            f"the run keeps {run}, and twice that while it writes them")


def next_steps(args, argv, stopped):
    """Where a run that ended or stopped is, and the commands to chart it, to see a launched swarm's dashboard
    again, and to go on with it (a finished run: with twice its --rounds)."""
    flags = [f for f in without(argv, "--token") if f != "--resume"]
    if "--out" not in argv:
        flags += ["--out", args.out]
    if not stopped:
        flags = without(flags, "--rounds") + ["--rounds", str(2 * args.rounds)]
    said = f"the run is in {args.out}; chart it: python train.py --plot {shlex.quote(args.out)}\n"
    if args.peers:
        said += f"its dashboard again: python swarm.py --dir {shlex.quote(os.path.join(args.out, 'swarm'))}\n"
    return said + f"go on with it: {shlex.join(['python', 'train.py', *flags, '--resume'])}"


def without(argv, flag):
    """A command line without a flag and its value (a child's --token goes in its environment: ps shows argv)."""
    def dropped(k, f):
        return f == flag or f.startswith(flag + "=") or (k > 0 and argv[k - 1] == flag)
    return [f for k, f in enumerate(argv) if not dropped(k, f)]


def start_peer(args, argv, k, url, children, token=None):
    """Peer k as a child process: this command line's flags (a later flag wins) with its own name, seed
    (peer_seed), model (the models in turn), the server's URL and the run folder, and its token (else --token) in its
    environment. It reads the flags as the launcher did: the same machine, so the same defaults; --tasks auto
    as the launcher resolved it, so peers of different models draw from the same task families."""
    name, mixed = f"peer{k}", args.tasks == "auto" and len(args.models) > 1
    tasks = ["--tasks", ",".join(args.task_list)] * mixed  # the mix 'auto' gave the launcher, for every model
    flags = [*without(argv, "--token"), "--peers", "0", "--swarm", url, "--name", name, "--quiet", *tasks,
             "--seed", str(peer_seed(args.seed, k)), "--model", args.models[k % len(args.models)],
             "--out", args.out]
    os.makedirs(os.path.join(args.out, name), exist_ok=True)
    env = dict(os.environ, SAPO_LAUNCHED="1", **({"SWARM_TOKEN": token or args.token} if token or args.token
                                                  else {}))
    if args.device.type == "cpu":  # share the cores instead of every peer fighting for all of them
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.peers)))
    log = open(os.path.join(args.out, name, "log.txt"), "a")
    proc = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), *flags],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    children.append((proc, os.path.join(args.out, name)))  # (its folder says whether it saves: stop_all)
    return proc


def label(model):  # a model in a legend or a table: its folder or Hub name, without the path
    return os.path.basename(str(model).rstrip("/"))


STOP_SECONDS = 120  # how long a stopped peer may take to abandon or end its round before it is killed
FLUSH_SECONDS = 10  # at the end of a run, the longest a peer waits for the swarm to take what is still queued
FIRST_READ_SECONDS = 2  # at its start, the longest a peer waits for its first read of the swarm


def stop_all(children):
    """Stop every child (a process and its folder): SIGTERM, then SIGKILL after STOP_SECONDS. A peer whose
    folder holds SAVING writes its last checkpoint: it is waited for, however long the machine's load makes
    that, and then given the time its swarm client's last sends take (FLUSH_SECONDS, and a little)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not cut this short
        signal.signal(sig, signal.SIG_IGN)
    for proc, _ in children:
        proc.terminate()  # a no-op on one that has exited
    start = time.time()
    for proc, folder in children:
        deadline, said = start + STOP_SECONDS, False
        while proc.poll() is None:
            if os.path.exists(os.path.join(folder, SAVING)):
                deadline = max(deadline, time.time() + FLUSH_SECONDS + 5)
                if time.time() > start + STOP_SECONDS and not said:
                    print(f"waiting for {os.path.basename(folder)}, which is writing its checkpoint")
                    said = True
            elif time.time() > deadline:
                proc.kill()
                proc.wait()
            time.sleep(0.1)


OUT_OF_MEMORY = 3  # a peer's exit status when CUDA ran out of memory (main)
FEWER = "try fewer --peers, a lower --micro-tokens or --grad-checkpoint"


def why_stopped(code):
    """A peer's exit status in words, with the likely cause where one is known."""
    if code == -signal.SIGKILL:
        return "was killed by signal 9 (SIGKILL), probably out of memory; try fewer --peers"
    if code == OUT_OF_MEMORY:
        return f"ran out of GPU memory; {FEWER}"
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"stopped with exit code {code}"


def model_size(folder):
    """A model folder's Config (from config.json) and parameter count: the model built on the meta device."""
    cfg = M.config_from_hf(M.read_json(os.path.join(folder, "config.json")))
    with torch.device("meta"):
        model = M.Transformer(cfg)
    return cfg, sum(p.numel() for p in model.parameters())


def count_params(folder):
    """Parameters of a model folder, from its config.json: no tensor read."""
    return model_size(folder)[1]


def free_memory(device):
    """Bytes free for new peers: GPU memory on CUDA, else MemAvailable from /proc/meminfo; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


# A peer's peak memory (peer_memory), from its model's config and the run's flags. The constants were measured
# on the CPU with the SmolLM2-135M shape in float32, and on an H200 for CUDA's two (docs/performance.md).
RUNTIME_BYTES = {"cpu": 0.31e9, "cuda": 0.65e9}  # Python, torch and transformers; on a GPU its CUDA context
LAYER_FLOATS = (14, 4)  # floats a token keeps for the backward pass, per layer: 14 a dim, 4 a hidden_dim
MASK_BYTES = 5          # and bytes per layer, per query head of a key head, per position of its packed row
CHECKPOINTED_LAYERS = 10  # with --grad-checkpoint, a token keeps as much as this many layers do without
AUTOCAST_SHARE = 0.7    # the share of them a bfloat16 autocast keeps, with CUDA's allocator's slack
PROMPT_TOKENS = (120, 900)  # the longest prompt, one-shot example included: of the easy tasks, of the others


def peer_memory(cfg, params, args):
    """A peer's peak bytes on args.device: float32 weights and AdamW's two moments (12 bytes a parameter),
    the sampling copy (--dtype, none in float32) and the KL's reference (--beta); on top, the larger of
    sampling (the KV cache of I * G rows of prompt and --max-new-tokens) and training: the gradients, then
    the activations of a micro-batch (--micro-tokens, whole groups; --grad-checkpoint) or the optimizer
    step's temporaries (4 bytes a parameter), whichever is more."""
    prompt = PROMPT_TOKENS[not set(args.task_list) <= set(reward.EASY_TASKS)]
    row = prompt + args.generations * args.max_new_tokens  # a packed group
    tokens = max(1, args.micro_tokens // row) * row  # micro-batches hold whole groups, at least one
    tokens = min(tokens, (args.local + args.external) * row)
    rep = cfg.n_heads // cfg.n_kv_heads
    per_layer = 4 * (LAYER_FLOATS[0] * cfg.dim + LAYER_FLOATS[1] * cfg.hidden_dim) + MASK_BYTES * rep * row
    layers = CHECKPOINTED_LAYERS if args.grad_checkpoint else cfg.n_layers
    amp = AUTOCAST_SHARE if M.autocast_dtype(args.device) is not None else 1.0
    logits = 12 * min(tokens, 512) * cfg.vocab_size  # a chunk of the log-probs' logits, three times over
    activations = tokens * per_layer * layers * amp + logits
    sampler = 0 if args.dtype == "float32" else params * torch.finfo(getattr(torch, args.dtype)).bits // 8
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * args.local * args.generations \
        * (prompt + args.max_new_tokens) * (4 if args.dtype == "float32" else 2)
    training = 4 * params + max(activations, 4 * params)
    return (RUNTIME_BYTES.get(args.device.type, RUNTIME_BYTES["cpu"]) + 12 * params + sampler
            + 4 * params * (args.beta > 0) + max(kv, training))


def check_memory(args, sizes):
    """Refuse, in one sentence, peers that do not fit in free memory (sizes: each peer's (Config, parameter
    count)), by peer_memory: better than the kernel's OOM killer taking a peer in round 3, or CUDA's."""
    need, free = [peer_memory(cfg, n, args) for cfg, n in sizes], free_memory(args.device)
    if free is None or sum(need) <= free:
        return
    fits = next(k for k in range(len(need)) if sum(need[:k + 1]) > free)  # peers 0, 1, ... in turn
    where = "GPU memory" if args.device.type == "cuda" else "memory"
    raise SystemExit(f"train.py: {len(need)} peers need about {sum(need) / 1e9:.1f} GB of {where} "
                     f"(up to {max(need) / 1e9:.1f} GB each) but {free / 1e9:.1f} GB is free: "
                     + (f"try --peers {fits}." if fits else
                        "not even one peer fits; free some memory first, or lower --micro-tokens or add "
                        "--grad-checkpoint."))


def plot(run_dir):
    """RUN_DIR/reward.svg, every peer's reward per round (a dot a round, a line through the running mean
    of the last 5): on top the local reward, the peer's skill; below it the batch reward, the paper's figure,
    which also counts the external groups trained on (always of mixed reward, so it reads higher). A run in
    silo trains on its local groups only, where the two are the same: it gets the top chart alone. A round
    run twice (a resume that found no checkpoint) is drawn from its last row. In a swarm of several models
    each line is named by its peer and its model (settings.json). The charts are drawn by swarm.render_svg
    (swarm.py, the dashboard's, below its marker line)."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(run_dir), "*", "metrics.jsonl"))):
        with open(path) as f:
            rows = {row["round"]: row for row in map(json.loads, filter(str.strip, f))}  # a round's last row
        runs[os.path.basename(os.path.dirname(path))] = [rows[r] for r in sorted(rows)]
    runs = {n: rows for n, rows in runs.items() if rows and "local_reward" in rows[0]}  # not swarm/'s
    if not runs:
        raise SystemExit(f"no <peer>/metrics.jsonl under {run_dir}: give the folder of a run")
    settings = {n: os.path.join(run_dir, n, "settings.json") for n in runs}
    ran = {n: label(M.read_json(f).get("model", "?")) if os.path.exists(f) else "?"
           for n, f in settings.items()}
    if len(set(ran.values())) > 1:  # a mixed swarm: each line says its peer's model
        runs = {f"{n} {ran[n]}": rows for n, rows in runs.items()}
    kinds = [("local_reward", "local reward (the skill)"),
             ("batch_reward", "batch reward (the paper's figure)")]  # (a long title is cut at the left)
    if all(row["batch_reward"] == row["local_reward"] for rows in runs.values() for row in rows):
        kinds = kinds[:1]
    charts = []
    for k, (key, title) in enumerate(kinds):
        series = {name: [(row["round"], row[key]) for row in rows] for name, rows in runs.items()}
        chart = swarm.render_svg(series, title=f"{title}: dots, mean of the last 5 rounds (lines)")
        charts.append(chart.replace("<svg ", f'<svg y="{360 * k}" ', 1))  # one above the other
    out = os.path.join(run_dir, "reward.svg")
    with open(out, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="760" height="{360 * len(charts)}">\n'
                + "\n".join(charts) + "\n</svg>\n")
    print(f"wrote {out}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.plot:
        return plot(args.plot)
    if args.peers:
        return launch(args, argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the launcher's stop: as Ctrl-C
    try:
        peer = Peer(args)
        print(run_line(args, [sum(p.numel() for p in peer.model.parameters())]))
        stopped = peer.run()
    except KeyboardInterrupt:  # while the model loads
        stopped = True
    except torch.OutOfMemoryError as e:  # one sentence, and a status the launcher names (why_stopped)
        print(f"train.py: out of GPU memory ({str(e).splitlines()[0][:200]}); {FEWER}", file=sys.stderr)
        sys.exit(OUT_OF_MEMORY)
    if os.environ.get("SAPO_LAUNCHED"):  # a launched peer: the launcher's last lines say what to do next
        print("this peer was started by python train.py --peers N, whose last lines say how to go on")
    else:
        print(next_steps(args, argv, stopped))
    if stopped:
        sys.exit(130)


if __name__ == "__main__":
    main()
