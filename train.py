"""
SAPO end to end: one peer's round loop (Algorithm 1 of arXiv 2509.08721) and a launcher for a swarm.

    python train.py                            # one peer, in silo (the paper's baseline)
    python train.py --peers 4                  # a swarm server + 4 peers on this machine's one GPU
    python train.py --swarm http://HOST:PORT --name alice   # join a swarm running elsewhere
    python train.py --plot runs/NAME           # reward per round of every peer, as an SVG

One round on one peer:
  1. draw I questions, one per task family drawn uniformly with replacement (reward.py);
  2. sample G completions of each with the peer's own model (sample.py);
  3. publish the I groups to the swarm server as decoded text (swarm.py): question, ground truth,
     task, metadata, completions, and whether each stopped; never token ids, log-probs or weights;
  4. poll the server for groups other peers published since the last poll;
  5. score every group with the *local* verifier; drop external groups that reward.verify_item
     rejects (a poisoned ground truth) or whose rewards are all equal (no advantage); draw J of the
     survivors uniformly (a survivor not drawn stays eligible for one more round, then it is stale);
  6. re-tokenise the I + J groups with the local tokenizer and take one GRPO step (grpo.py);
  7. log the round to metrics.jsonl, post it to the dashboard, checkpoint every --save-every rounds.
Peers never wait for each other: a peer trains on whatever external groups have arrived.

Defaults: I = 4 local and J = 4 external groups are the paper's best configuration (+94% cumulative
reward over peers in silo, with 8 Qwen2.5-0.5B peers). The others (G = 8, temperature 1.0, clip
0.2 / 0.28, no KL, DAPO's token-mean loss, 256 new tokens, one optimizer step per round) are common
GRPO settings, chosen to match what the paper's code is described to do where we know it.

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
- Trust: external groups whose answer does not follow from their question are dropped
  (reward.verify_item); the paper trusts the sender's ground truth.
- Weights are trained in float32 (bfloat16 autocast on CUDA) and copied into a bfloat16 sampler each
  round: pure-bf16 weights would round away updates of size 1e-6.
- No GPU: unless the flags are given, a CPU run shrinks G, I, J and the completion length so that it
  shows progress within minutes, and says so.
"""

import argparse
import copy
import glob
import json
import os
import random
import re
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
    p = argparse.ArgumentParser(description="SAPO: swarm sampling policy optimization (arXiv 2509.08721)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    # what to run
    a("--peers", type=int, nargs="?", const=4, default=0, help="start a swarm of N peers on this machine (alone: 4)")
    a("--swarm", default=None, help="URL of a swarm server to join, e.g. http://10.0.0.5:8000")
    a("--name", default=None, help="this peer's name in the swarm (default: the host name)")
    a("--token", default=None, help="bearer token for writing to the swarm server")
    a("--plot", default=None, metavar="RUN_DIR", help="write RUN_DIR/reward.svg from its metrics and exit")
    # model and tasks
    a("--model", default=M.DEFAULT_MODEL, help="model folder or Hugging Face Hub id (Llama, Qwen2, Qwen3)")
    a("--tasks", default="auto", help="comma list of reward.py tasks, or 'paper', 'easy', 'auto'")
    a("--one-shot", action=argparse.BooleanOptionalAction, default=True,
      help="show one worked example of the task family as an earlier chat turn")
    # SAPO (the paper's best: I = 4, J = 4)
    a("--local", type=int, default=None, help="I: local questions per round (paper: 4)")
    a("--external", type=int, default=None, help="J: external groups trained on per round (paper: 4)")
    a("--generations", type=int, default=None, help="G: completions per question (default 8 on a GPU)")
    a("--rounds", type=int, default=2000, help="rounds to train")
    a("--max-new-tokens", type=int, default=None, help="completion length limit in tokens (default 256 on a GPU)")
    a("--temperature", type=float, default=1.0, help="sampling temperature")
    # GRPO
    a("--lr", type=float, default=1e-5, help="AdamW learning rate (measured, see README)")
    a("--epsilon", type=float, default=0.2, help="lower clip: ratio >= 1 - epsilon")
    a("--epsilon-high", type=float, default=0.28, help="upper clip: ratio <= 1 + epsilon_high (DAPO: 0.28)")
    a("--beta", type=float, default=0.0, help="weight of the k3 KL penalty to the initial model")
    a("--loss-type", default="token_mean", choices=["token_mean", "seq_mean", "constant"])
    a("--adv-scale", default="group", choices=["group", "batch", "none"], help="advantage normalisation")
    a("--inner-steps", type=int, default=1, help="optimizer steps on each round's batch (1: one step per round)")
    a("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    a("--micro-batch", type=int, default=16, help="completions per forward/backward (gradient accumulation)")
    a("--grad-checkpoint", action="store_true", help="recompute activations in the backward pass")
    # machinery
    a("--seed", type=int, default=0, help="seed of questions, sampling and init; peer k of --peers gets seed+k")
    a("--device", default=None, help="cuda, cpu, cuda:1, ... (default: cuda if available)")
    a("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
      help="dtype of the sampling copy of the weights (default: bfloat16 on CUDA, float32 on CPU)")
    a("--out", default=None, help="run folder (default: runs/<date-time>); each peer writes OUT/<name>/")
    a("--save-every", type=int, default=50, help="checkpoint every K rounds (0: only at the end)")
    a("--sample-every", type=int, default=10, help="write some completions to samples.jsonl every K rounds")
    a("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    a("--quiet", action="store_true", help="no progress bar (a line per round instead)")
    a("--peer-settings", default=None, help=argparse.SUPPRESS)  # used by the --peers launcher
    args = p.parse_args(argv)
    if args.peer_settings:  # a child of the launcher: every setting comes from the file
        with open(args.peer_settings) as f:
            args = argparse.Namespace(**json.load(f))
    check_args(p, args)
    return args


POOL_ROUNDS = 2  # an unused external group stays eligible this many rounds, then it is too stale

# a CPU is ~100x slower than a GPU at this: shrink what was not set explicitly
GPU_DEFAULTS = dict(local=4, external=4, generations=8, max_new_tokens=256)
CPU_DEFAULTS = dict(local=2, external=2, generations=4, max_new_tokens=64)


def check_args(p, args):
    """Fill device-dependent defaults and refuse bad flags with one sentence (argparse exits 2)."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device} was asked for, but torch sees no CUDA GPU")
    defaults = CPU_DEFAULTS if args.device == "cpu" else GPU_DEFAULTS
    args.shrunk = [k for k in defaults if getattr(args, k) is None and defaults[k] != GPU_DEFAULTS[k]]
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for flag in ("local", "generations", "max_new_tokens", "rounds", "micro_batch", "inner_steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.external < 0 or (args.peers or 0) < 0 or args.save_every < 0 or args.sample_every < 0:
        p.error("--external, --peers, --save-every and --sample-every cannot be negative")
    if args.generations < 2:
        p.error("--generations must be at least 2: GRPO compares completions within a group")
    if not args.temperature > 0:
        p.error("--temperature must be positive: GRPO needs sampled completions")
    if not (0 <= args.epsilon < 1 and args.epsilon_high >= 0 and args.lr > 0 and args.beta >= 0):
        p.error("need 0 <= --epsilon < 1, --epsilon-high >= 0, --lr > 0 and --beta >= 0")
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", args.name):
        p.error("--name must be 1-64 characters of letters, digits, '_', '.' or '-'")
    if args.swarm and not re.match(r"https?://", args.swarm):
        p.error("--swarm must be a URL such as http://10.0.0.5:8000")
    if args.resume and not args.out:
        p.error("--resume needs --out: the run folder to continue")
    try:
        args.task_list = resolve_tasks(args.tasks, args.model)
    except ValueError as e:
        p.error(str(e))


def resolve_tasks(spec, model_name):
    if spec == "auto":
        spec = "easy" if model_name == M.DEFAULT_MODEL else "paper"
    if spec == "paper":
        return list(reward.PAPER_TASKS)
    if spec == "easy":
        return list(reward.EASY_TASKS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError("--tasks is empty: give task names, or 'paper', 'easy' or 'auto'")
    for n in names:
        reward.get_task(n)  # raises ValueError naming the known tasks
    return names

# -----------------------------------------------------------------------------
# prompts and rollouts


def example_turns(task_name):
    """A fixed worked example of the family, as a user turn and an assistant turn."""
    item = reward.get_task(task_name).generate(random.Random(f"one-shot example of {task_name}"))
    return [{"role": "user", "content": item["question"]},
            {"role": "assistant", "content": reward.solution(item)}]


def prompt_ids(tokenizer, item, one_shot):
    """Token ids of the chat prompt: system prompt, [a worked example], the question, assistant turn."""
    messages = [{"role": "system", "content": reward.SYSTEM_PROMPT}]
    if one_shot:
        try:
            messages += example_turns(item["task"])
        except Exception:  # a family this peer cannot generate (e.g. rg: without reasoning_gym)
            pass
    messages.append({"role": "user", "content": item["question"]})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def external_ids(tokenizer, text, stopped, stop_id, max_new_tokens):
    """Re-tokenise another peer's completion; a completion that stopped gets the local stop token."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]
    if stopped and len(ids) < max_new_tokens:
        ids = ids + [stop_id]
    return ids


def usable_external(groups, log):
    """Step 5 for external groups: drop those whose answer does not follow from their question
    (reward.verify_item), re-score the rest with the local verifier, and keep those with some spread
    of reward (the others have zero advantage). Returns [(group, rewards)]."""
    usable = []
    for g in groups:
        if not reward.verify_item(g):
            log(f"dropped a group from {g.get('peer')}: its answer does not follow from its question")
            continue
        rewards = [reward.score(g, c) for c in g["completions"]]
        if len(set(rewards)) > 1:
            usable.append((g, rewards))
    return usable


# -----------------------------------------------------------------------------
# the GRPO step


def pad_rows(rows, pad_id, device):
    """rows: list of (prompt_ids, completion_ids). Returns ids (B, T) right-padded, and for the
    completion tokens: their positions in ids (B, Tc) and a mask (B, Tc), Tc = longest completion.

    Example, prompts [a b] and [c d e], completions [x y EOS] and [z]:
      ids  = [[a b x y EOS], [c d e z pad]]
      pos  = [[2 3 4], [3 3 3]]        (index of each completion token; padding repeats a valid one)
      mask = [[1 1 1], [1 0 0]]
    The hidden state at position pos - 1 predicts the token at pos."""
    T = max(len(p) + len(c) for p, c in rows)
    Tc = max(1, max(len(c) for _, c in rows))
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    pos = torch.zeros(len(rows), Tc, dtype=torch.long)
    mask = torch.zeros(len(rows), Tc, dtype=torch.bool)
    for b, (p, c) in enumerate(rows):
        ids[b, :len(p) + len(c)] = torch.tensor(p + c)
        pos[b] = (len(p) + torch.arange(Tc).clamp(max=max(len(c) - 1, 0))).clamp(max=T - 1)
        mask[b, :len(c)] = True
    return ids.to(device), pos.to(device), mask.to(device)


def completion_logprobs(model, ids, pos, temperature, autocast_dtype=None):
    """Log-probs (B, Tc) of the completion tokens ids[b, pos[b, j]] under the model. Only the completion
    positions go through the output layer, chunk by chunk (grpo.hidden_logprobs): the (B, T, vocab)
    logits are never held."""
    with torch.autocast(ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        h = model.hidden(ids)  # (B, T, dim)
    h = h.gather(1, (pos - 1)[:, :, None].expand(-1, -1, h.shape[-1]))  # states that predict them
    w = model.lm_head.weight
    if autocast_dtype is not None:
        h, w = h.to(autocast_dtype), w.to(autocast_dtype)
    return grpo.hidden_logprobs(h.to(w.dtype), w, ids.gather(1, pos), temperature)


def train_step(model, opt, rows, advantages, args, pad_id, ref_model=None):
    """GRPO on one round's rows: --inner-steps optimizer steps, each over micro-batches with gradient
    accumulation so that the loss equals one pass over the whole batch. Returns stats."""
    device = model.lm_head.weight.device
    amp = torch.bfloat16 if device.type == "cuda" else None
    adv = torch.tensor(advantages, dtype=torch.float32, device=device)
    chunks = [list(range(i, min(i + args.micro_batch, len(rows)))) for i in range(0, len(rows), args.micro_batch)]
    batches = [pad_rows([rows[i] for i in c], pad_id, device) for c in chunks]
    total_tokens = sum(int(m.sum()) for _, _, m in batches)
    old, ref = [None] * len(chunks), [None] * len(chunks)
    stats = {}
    model.train()
    for step in range(args.inner_steps):
        opt.zero_grad(set_to_none=True)
        agg = {}
        for k, (c, (ids, pos, mask)) in enumerate(zip(chunks, batches)):
            logp = completion_logprobs(model, ids, pos, args.temperature, amp)
            if old[k] is None:  # the policy that sampled, as far as this peer knows: itself, now
                old[k] = logp.detach()
            if args.beta > 0 and ref[k] is None:
                with torch.no_grad():
                    ref[k] = completion_logprobs(ref_model, ids, pos, args.temperature, amp)
            loss, s = grpo.grpo_loss(logp, old[k], adv[c], mask, args.epsilon, args.epsilon_high, args.beta,
                                     ref[k], args.loss_type, max_tokens=args.max_new_tokens)
            # weight each micro-batch so the sum of their losses is the whole batch's loss
            share = mask.sum().item() / max(total_tokens, 1) if args.loss_type == "token_mean" else len(c) / len(rows)
            (loss * share).backward()
            for key, v in dict(s, loss=loss.item()).items():
                agg[key] = agg.get(key, 0.0) + v * share
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        stats = dict(agg, grad_norm=float(grad_norm))
    model.eval()
    return stats

# -----------------------------------------------------------------------------
# one peer


class Peer:
    def __init__(self, args, log=print):
        self.args, self.log = args, log
        self.name = args.name or re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64] or "peer"
        self.dir = os.path.join(args.out, self.name)
        self.device = torch.device(args.device)
        self.sample_dtype = getattr(torch, args.dtype) if args.dtype else M.default_dtype(self.device)
        # the last checkpoint; "checkpoint.old" only exists if a stop came in the middle of replacing it
        ckpt = next((c for c in (os.path.join(self.dir, "checkpoint"), os.path.join(self.dir, "checkpoint.old"))
                     if os.path.exists(os.path.join(c, "trainer_state.pt"))), None)
        resuming = args.resume and ckpt is not None
        if os.path.exists(os.path.join(self.dir, "metrics.jsonl")) and not args.resume:
            raise SystemExit(f"{self.dir} already holds a run: pass --resume to continue it, or another --out")
        os.makedirs(self.dir, exist_ok=True)
        torch.manual_seed(args.seed)
        try:
            self.model, self.tok = M.load_model(ckpt if resuming else args.model, self.device, torch.float32, log=log)
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
        self.rng = random.Random(args.seed)
        self.pool = []  # (round received, group, rewards): usable external groups not yet trained on
        self.client, self.cursor = None, None  # cursor: where a resumed peer reads the swarm on from
        self.start_round = 0
        if resuming:
            self.load_state(ckpt)
        elif args.resume:
            log(f"{self.dir}: no checkpoint yet, starting from round 0")
            open(os.path.join(self.dir, "metrics.jsonl"), "w").close()  # those rounds will run again
        if args.swarm:  # with J = 0 a peer still shares its rollouts; cursor None: start from recent groups
            self.client = swarm.SwarmClient(args.swarm, self.name, token=args.token, cursor=self.cursor)
        with open(os.path.join(self.dir, "settings.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    # -- checkpoints ------------------------------------------------------------------------------

    def save(self, round_):
        """A Hugging Face folder transformers can load, plus optimizer, RNG and swarm cursor state,
        written together and renamed into place at once (model.save_model)."""
        state = {"round": round_, "optimizer": self.opt.state_dict(), "torch_rng": torch.get_rng_state(),
                 "rng": json.dumps(self.rng.getstate()), "cursor": self.client.cursor if self.client else None}
        M.save_model(self.model, self.tok, os.path.join(self.dir, "checkpoint"),
                     write_extra=lambda folder: torch.save(state, os.path.join(folder, "trainer_state.pt")))

    def load_state(self, ckpt):
        state = torch.load(os.path.join(ckpt, "trainer_state.pt"), map_location="cpu", weights_only=True)
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"].cpu())
        v, internal, gauss = json.loads(state["rng"])
        self.rng.setstate((v, tuple(internal), gauss))
        self.cursor = state.get("cursor")
        self.start_round = state["round"] + 1
        # metrics logged after that checkpoint belong to rounds that will be run again
        path = os.path.join(self.dir, "metrics.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                keep = [line for line in f if line.strip() and json.loads(line)["round"] <= state["round"]]
            with open(path, "w") as f:
                f.writelines(keep)
        self.log(f"resumed {self.name} from {ckpt} at round {self.start_round}")

    # -- one round --------------------------------------------------------------------------------

    def round(self, r):
        args, t0 = self.args, time.time()
        # 1. I local questions, one family drawn uniformly per question
        items = [reward.get_task(self.rng.choice(args.task_list)).generate(self.rng) for _ in range(args.local)]
        prompts = [prompt_ids(self.tok, it, args.one_shot) for it in items]
        # 2. G completions each
        t_sample = time.time()
        outs = sample.generate(self.sampler, prompts, num_samples=args.generations,
                               max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               eos_token_ids=self.stop_ids, seed=args.seed * 1_000_003 + r)
        t_sample = time.time() - t_sample
        G = args.generations
        stopped = [len(o) > 0 and o[-1] in self.stop_ids for o in outs]
        texts = [self.tok.decode(o[:-1] if s else o, skip_special_tokens=True) for o, s in zip(outs, stopped)]
        local_rewards = [reward.score(items[i // G], t) for i, t in enumerate(texts)]
        # 3. publish, 4. poll
        external, available, survived = [], 0, 0
        if self.client is not None:
            groups = [dict(task=it["task"], question=it["question"], answer=it["answer"], metadata=it["metadata"],
                           completions=texts[i * G:(i + 1) * G], stopped=stopped[i * G:(i + 1) * G],
                           model=os.path.basename(str(args.model).rstrip("/")))
                      for i, it in enumerate(items)]
            self.client.publish(r, groups)
            fetched = self.client.fetch() if args.external > 0 else []
            available = len(fetched)
            # 5. verify, re-score locally, keep groups with a reward spread, draw J uniformly
            fresh = usable_external(fetched, self.log)
            survived = len(fresh)
            self.pool = [x for x in self.pool if r - x[0] < POOL_ROUNDS] + [(r, g, rw) for g, rw in fresh]
            drawn = self.rng.sample(range(len(self.pool)), min(args.external, len(self.pool)))
            external = [self.pool[i][1:] for i in drawn]
            self.pool = [x for i, x in enumerate(self.pool) if i not in drawn]
            if len(external) < args.external:
                self.log(f"round {r}: {len(external)} of J={args.external} external groups "
                         f"({available} new, {survived} usable)")
        # 6. the training batch: local groups on their sampled ids, external ones re-tokenised
        rows, group_rewards = [], []
        for i in range(args.local):
            rows += [(prompts[i], outs[i * G + k]) for k in range(G)]
            group_rewards.append(local_rewards[i * G:(i + 1) * G])
        for g, rewards in external:
            p = prompt_ids(self.tok, g, args.one_shot)
            rows += [(p, external_ids(self.tok, c, s, self.stop_id, args.max_new_tokens))
                     for c, s in zip(g["completions"], g["stopped"])]
            group_rewards.append(rewards)
        batch_rewards = [x for g in group_rewards for x in g]
        advantages = grpo.group_advantages(torch.tensor(batch_rewards), [len(g) for g in group_rewards],
                                           args.adv_scale).tolist()
        t_train, stats = time.time(), {}
        if any(a != 0 for a in advantages):
            stats = train_step(self.model, self.opt, rows, advantages, args, self.pad_id, self.ref_model)
            if self.sampler is not self.model:
                with torch.no_grad():
                    for ps, pm in zip(self.sampler.parameters(), self.model.parameters()):
                        ps.copy_(pm)
        t_train = time.time() - t_train
        # 7. log
        train_tokens = sum(len(c) for _, c in rows)
        m = dict(round=r, local_reward=mean(local_rewards), batch_reward=mean(batch_rewards),
                 external_available=available, external_survived=survived, external_used=len(external),
                 frac_zero_std=mean([float(len(set(g)) == 1) for g in group_rewards]),
                 completion_len=mean([len(o) for o in outs]), truncated_frac=mean([float(not s) for s in stopped]),
                 sample_tok_per_s=sum(len(o) for o in outs) / max(t_sample, 1e-9),
                 train_tok_per_s=train_tokens / max(t_train, 1e-9) if stats else 0.0,
                 round_seconds=time.time() - t0, **{k: round(v, 6) for k, v in stats.items()})
        with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(m) + "\n")
        if args.sample_every and r % args.sample_every == 0:
            with open(os.path.join(self.dir, "samples.jsonl"), "a") as f:
                for i, it in enumerate(items[:2]):
                    for k in range(min(2, G)):
                        f.write(json.dumps(dict(round=r, task=it["task"], question=it["question"],
                                                answer=it["answer"], completion=texts[i * G + k],
                                                reward=local_rewards[i * G + k])) + "\n")
        if self.client is not None:
            self.client.post_metrics(r, {k: v for k, v in m.items() if isinstance(v, (int, float))})
        return m

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
                bar.set_postfix(reward=f"{m['batch_reward']:.2f}", ext=m["external_used"],
                                tok_s=f"{m['sample_tok_per_s']:.0f}")
            else:
                self.log(f"round {r}: local_reward {m['local_reward']:.3f} batch_reward {m['batch_reward']:.3f} "
                         f"external {m['external_used']} len {m['completion_len']:.0f} "
                         f"sample {m['sample_tok_per_s']:.0f} tok/s, {m['round_seconds']:.1f} s")
            if args.save_every and (r + 1) % args.save_every == 0:
                self.save(r)
        if bar is not None:
            bar.close()
        if r >= self.start_round and not (args.save_every and (r + 1) % args.save_every == 0):
            self.save(r)


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0

# -----------------------------------------------------------------------------
# the launcher: a server and N peers on one machine


def launch(args):
    """Start a swarm server on a free loopback port and args.peers peer processes, show their progress
    together, stop them all on Ctrl-C. A peer that crashes is reported; the others go on."""
    from tqdm import tqdm
    if not args.resume and glob.glob(os.path.join(args.out, "*", "metrics.jsonl")):
        raise SystemExit(f"{args.out} already holds a run: pass --resume to continue it, or another --out")
    os.makedirs(args.out, exist_ok=True)
    children = []

    def stop_all():
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

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)  # the terminal closed: stop the children too
    try:
        server_log = open(os.path.join(args.out, "server.log"), "a")
        server = subprocess.Popen([sys.executable, "-u", os.path.join(HERE, "swarm.py"), "--port", "0",
                                   "--dir", os.path.join(args.out, "swarm")] +
                                  (["--token", args.token] if args.token else []),
                                  stdout=subprocess.PIPE, stderr=server_log, text=True, start_new_session=True)
        children.append(server)
        line = server.stdout.readline()
        found = re.search(r"http://\S+", line)
        if not found:
            raise SystemExit(f"the swarm server did not start; see {args.out}/server.log")
        url = found.group(0)
        print(f"swarm server {url}  (dashboard: open {url}/ in a browser)")
        names = [f"peer{k}" for k in range(args.peers)]
        procs = {}
        for k, name in enumerate(names):
            settings = dict(vars(args), peers=0, swarm=url, name=name, seed=args.seed + k, quiet=True,
                            peer_settings=None)
            os.makedirs(os.path.join(args.out, name), exist_ok=True)
            path = os.path.join(args.out, name, "launch.json")
            with open(path, "w") as f:
                json.dump(settings, f, indent=2)
            log = open(os.path.join(args.out, name, "log.txt"), "a")
            env = dict(os.environ)
            if args.device == "cpu":  # share the cores instead of every peer fighting for all of them
                env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.peers)))
            procs[name] = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), "--peer-settings", path],
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
            children.append(procs[name])
        bars = {n: tqdm(total=args.rounds, desc=n, position=k, dynamic_ncols=True) for k, n in enumerate(names)}
        reported = set()
        while True:
            for n, proc in procs.items():
                last = last_metrics(os.path.join(args.out, n, "metrics.jsonl"))
                if last:
                    bars[n].n = last["round"] + 1
                    bars[n].set_postfix(reward=f"{last['batch_reward']:.2f}", ext=last["external_used"], refresh=False)
                    bars[n].refresh()
                code = proc.poll()
                if code not in (None, 0) and n not in reported:
                    reported.add(n)
                    tqdm.write(f"{n} stopped with exit code {code}: see {args.out}/{n}/log.txt; the others go on")
            if all(p.poll() is not None for p in procs.values()):
                break
            time.sleep(1.0)
        for b in bars.values():
            b.close()
        ok = sum(p.returncode == 0 for p in procs.values())
        print(f"{ok} of {len(procs)} peers finished; metrics in {args.out}/<peer>/metrics.jsonl; "
              f"chart: python train.py --plot {args.out}")
    except KeyboardInterrupt:
        print("\nstopping every peer and the server...")
    finally:
        stop_all()


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
    """RUN_DIR/reward.svg: each peer's batch reward per round, as a running mean over `window` rounds."""
    series = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "*", "metrics.jsonl"))):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        points, recent = [], []
        for row in rows:
            recent = (recent + [row["batch_reward"]])[-window:]
            points.append((row["round"], sum(recent) / len(recent)))
        series[os.path.basename(os.path.dirname(path))] = points
    if not series:
        raise SystemExit(f"no <peer>/metrics.jsonl under {run_dir}: give the folder of a run")
    out = os.path.join(run_dir, "reward.svg")
    with open(out, "w") as f:
        f.write(swarm.render_svg(series, title=f"batch reward, running mean over {window} rounds"))
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
