"""
The GRPO update in plain torch: group-normalised advantages, the clipped surrogate with an optional
k3 KL penalty, the completion tokens' log-probs (each group packed into one row), the optimizer step.
SAPO (arXiv 2509.08721, Sec. 3 and Algorithm 1) trains every peer with exactly this update: it changes
which rollouts go into the batch (local groups plus J from the swarm), not the loss.

The math, for one question q with G completions o_1..o_G scored r_1..r_G by the verifier:

    A_i      = (r_i - mean(r)) / (std(r) + eps)                 one advantage per completion
    ratio_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | ...)   = exp(logp_it - old_logp_it)
    l_it     = -min(ratio_it * A_i, clip(ratio_it, 1 - epsilon, 1 + epsilon_high) * A_i)
               + beta * (exp(ref_it - logp_it) - (ref_it - logp_it) - 1)       (k3 KL, optional)
    loss     = sum_it M_it * l_it / sum_it M_it                 ("token_mean", other choices below)

M is the completion mask: 1 on completion tokens up to and including the first stop token, 0 on the
prompt and on padding. A worked example with one group of G = 4 and epsilon = 0.2, epsilon_high = 0.28:

    rewards r = [1, 0, 0, 1]: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.5774
    A = [0.5, -0.5, -0.5, 0.5] / (0.5774 + 1e-4) = [0.8659, -0.8659, -0.8659, 0.8659]
    completion 1 has two tokens with ratio [1.0, 1.5] (mask [1, 1]):
      token 1: ratio 1.0 is inside [0.8, 1.28]  -> l = -1.0 * 0.8659  = -0.8659, dl/dlogp = -0.8659
      token 2: ratio 1.5 > 1.28 and A > 0     -> l = -1.28 * 0.8659 = -1.1083, dl/dlogp = 0 (clipped)
    token_mean over these two tokens: (-0.8659 - 1.1083) / 2 = -0.9871

The clip only removes gradient that would push a ratio further out of the trust region in the
direction the advantage favours: ratio < 1 - epsilon with A < 0, or ratio > 1 + epsilon_high with A > 0.

Where this deviates from the paper, or goes beyond it:
- The paper's code takes one optimizer step a round on fresh log-probs: the ratio is exactly 1
  (REINFORCE with group-normalised advantages) and the clip never acts; here it does with --inner-steps > 1.
- The paper's peers share no probabilities, so "old" is the receiver's own model for shared rows too.
  Beyond the paper, step() can take the senders' log-probs (`behaviour`) for them: their ratio is
  pi_receiver / pi_sender, each token's weight bounded by DUAL_CLIP * |A| whatever a sender claims.

How a group is packed (pack, after Prefix Grouper, arXiv 2506.05433): one row holds the prompt once, then
each completion, cut after its first stop token, at RoPE positions from P (the prompt's length) on. A
token sees the prompt and its own completion only, so every hidden state is the one a row of its own would
give, with the prompt computed once, not G times. The hidden state before a token scores it: the prompt's
last scores a completion's first. Here the stop token is 2 and P = 2:

    group = ([5, 6], [[7, 8, 2, 9], [4]])   (prompt, completions); the 9 follows a stop and is dropped
    index  id  pos  sees 0 1 2 3 4 5        the packed row; an x marks an index the token may see
      0     5   0        x
      1     6   1        x x
      2     7   2        x x x
      3     8   3        x x x x
      4     2   4        x x x x x
      5     4   2        x x       x        completion 2 starts again at P, sees the prompt and itself
    src   = [[1, 2, 3], [1, -, -]]          the index whose hidden state scores each completion token
    M     = [[1, 1, 1], [1, 0, 0]]          one row per completion, as grpo_loss takes them (logp: (2, 3))
"""

import torch
from torch.utils.checkpoint import checkpoint

# -----------------------------------------------------------------------------
# advantages


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """One advantage per completion: its reward minus its group's mean, divided by a spread: for scale
    "group" each group's own unbiased std (GRPO), for "batch" the std of all the batch's rewards, for
    "none" nothing (Dr. GRPO). A group whose rewards are all equal, or of size 1, gets 0 (0 / (0 + eps)).
    rewards (n_groups * group_size,) laid end to end -> advantages of the same shape, e.g.
        rewards [1, 0, 0, 1,  1, 1, 1, 1], group_size 4, scale "group"
        -> [0.8659, -0.8659, -0.8659, 0.8659,  0, 0, 0, 0]
    group_size may also be a list of sizes, one per group, when groups differ (a peer trains on
    external groups sampled with another G): rewards [1, 0,  1, 1, 0], group_size [2, 3]."""
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', not {scale!r}.")
    n = rewards.numel()
    sizes = [group_size] * (n // max(group_size, 1)) if isinstance(group_size, int) else list(group_size)
    if min(sizes, default=0) < 1 or sum(sizes) != n:
        raise ValueError(f"{n} rewards cannot be split into groups of {group_size}; "
                         "pass rewards for whole groups laid end to end.")
    r = rewards.float().view(-1)
    groups = r.split(sizes)
    centred = torch.cat([g - g.mean() for g in groups])
    if scale == "none":
        return centred
    if scale == "group":  # unbiased, dividing by G - 1; a group of one has no spread: 0 / (0 + eps)
        spread = [g.std() if len(g) > 1 else g.new_zeros(()) for g in groups]
        std = torch.cat([s.expand(len(g)) for s, g in zip(spread, groups)])
    else:
        std = r.std() if r.numel() > 1 else r.new_zeros(())
    return centred / (std + eps)


# -----------------------------------------------------------------------------
# the loss


def grpo_loss(logprobs, old_logprobs, advantages, mask, epsilon=0.2, epsilon_high=0.28, beta=0.0,
              ref_logprobs=None, loss_type="token_mean", max_tokens=None, dual_clip=None, shared=None):
    """The clipped GRPO surrogate (plus beta * k3 KL when beta > 0), averaged over masked tokens.
    logprobs, old_logprobs, mask (M above) and ref_logprobs are (B, T); advantages (B,) has one per
    completion. All but logprobs are constants (detached). loss_type says how token losses average:
        "token_mean"  sum(M*l) / sum(M)                          (DAPO; the paper's code)
        "seq_mean"    the mean over rows of each row's token mean (original GRPO; an empty row is 0)
        "constant"    sum(M*l) / (B * max_tokens), max_tokens defaulting to T   (Dr. GRPO)
    dual_clip C (dual-clip PPO, Ye et al. 2020): where A < 0, on the rows that shared (B,) marks (all
    rows without it), a token's loss is at most C * |A|, whatever old_logprobs claim.
    Returns (loss, stats), in python floats: clip_low and clip_high (the shares of masked tokens whose
    gradient the clip removed), ratio_mean, kl (k3's masked mean, else 0) and zero_adv_frac (rows, A = 0)."""
    if loss_type not in ("token_mean", "seq_mean", "constant"):
        raise ValueError(f"loss_type must be 'token_mean', 'seq_mean' or 'constant', not {loss_type!r}.")
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs from a reference model; pass them or set beta to 0.")
    B, T = logprobs.shape
    M = mask.to(logprobs.dtype)
    A = advantages.detach().to(logprobs.device, logprobs.dtype)[:, None]  # (B, 1)
    ratio = torch.exp((logprobs - old_logprobs.detach()).clamp(max=20))  # e^20 is finite, past any clip
    per_token = -torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + epsilon_high) * A)
    if dual_clip is not None:
        bounded = torch.minimum(per_token, dual_clip * A.abs())
        per_token = bounded if shared is None else torch.where(shared[:, None], bounded, per_token)
    kl = None
    if ref_logprobs is not None:
        delta = ref_logprobs.detach() - logprobs
        kl = torch.exp(delta) - delta - 1  # k3: at least 0, and 0 only where the two agree
        if beta > 0:
            per_token = per_token + beta * kl

    n_tokens = M.sum().clamp(min=1)
    if loss_type == "token_mean":
        loss = (per_token * M).sum() / n_tokens
    elif loss_type == "seq_mean":
        loss = ((per_token * M).sum(dim=1) / M.sum(dim=1).clamp(min=1)).mean()
    else:
        loss = (per_token * M).sum() / (B * (max_tokens if max_tokens is not None else T))

    with torch.no_grad():  # every stat in one tensor, so that reading them syncs the GPU once
        low = ((ratio < 1 - epsilon) & (A < 0)).to(M.dtype)
        high = ((ratio > 1 + epsilon_high) & (A > 0)).to(M.dtype)
        kl_mean = (kl * M).sum() / n_tokens if kl is not None else M.new_zeros(())
        zero_adv = (A == 0).to(M.dtype).mean() if B else M.new_zeros(())
        values = torch.stack([(low * M).sum() / n_tokens, (high * M).sum() / n_tokens,
                              (ratio * M).sum() / n_tokens, kl_mean, zero_adv])
    return loss, dict(zip(["clip_low", "clip_high", "ratio_mean", "kl", "zero_adv_frac"], values.tolist()))


# -----------------------------------------------------------------------------
# packed groups and the log-probs of their completion tokens


def pack(groups, pad_id, stop_ids, device="cpu"):
    """Groups (prompt ids, [completion ids, ...]) packed as the file's docstring draws them, each
    completion cut after its first stop token (any of stop_ids; the stop is trained, even when pad_id
    is a stop too). Returns tensors on device: per group, N rows right-padded with pad_id to length L,
    ids, pos and attn (N, 1, L, L; None, causal, when no group has two completions); per completion, B
    rows of Tc, src (an index into the N rows laid end to end), tokens (-1 where M is 0) and M."""
    def cut(c):  # up to and including the first stop token: nothing after a stop is trained
        return next((c[:k + 1] for k, token in enumerate(c) if token in stop_ids), c)

    def padded(lists, fill):  # right-padded to the longest, at least 1 wide
        width = max([1, *map(len, lists)])
        rows = [x + [fill] * (width - len(x)) for x in lists]
        return torch.tensor(rows, dtype=torch.long, device=device)

    groups = [(p, [cut(c) for c in cs]) for p, cs in groups]
    L = max(len(p) + sum(map(len, cs)) for p, cs in groups)
    rows, src = [], []
    for n, (p, cs) in enumerate(groups):
        P = len(p)
        ids, pos = list(p), list(range(P))
        part = [0] * P  # which part of the row each token belongs to: 0 the prompt, k the k-th completion
        for k, c in enumerate(cs, 1):
            scorers = [P - 1, *range(len(ids), len(ids) + len(c) - 1)]  # the prompt's last, then c's own
            src.append([n * L + i for i in scorers])
            ids += c
            pos += range(P, P + len(c))
            part += [k] * len(c)
        rows.append((ids, pos, part))
    ids, pos, part = (padded([row[i] for row in rows], fill) for i, fill in enumerate([pad_id, 0, -1]))
    causal = part.new_ones(L, L, dtype=torch.bool).tril()
    sees_prompt = part[:, None] == 0                   # (N, 1, L): the key is a prompt token
    same_part = part[:, None] == part[:, :, None]      # (N, L, L): query and key are in the same part
    attn = causal & (sees_prompt | same_part)
    attn = attn[:, None] if max(len(cs) for _, cs in groups) > 1 else None  # one completion: causal
    tokens = padded([c for _, cs in groups for c in cs], -1)
    return dict(ids=ids, pos=pos, attn=attn, src=padded(src, -1), tokens=tokens, M=tokens >= 0)


def completion_logprobs(model, batch, temperature, autocast_dtype=None):
    """Log-probs (B, Tc) of a packed batch's completion tokens, 0 where M is 0: log_softmax(h @ W.T /
    temperature) at each token, h the hidden state src names, at the sampling temperature (the policy
    trained is the one that sampled), chunk by chunk (hidden_logprobs): the logits are never held whole."""
    M, device = batch["M"], batch["ids"].device.type
    with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        h = model.hidden(batch["ids"], pos=batch["pos"], mask=batch["attn"])  # (N, L, dim)
    h = h.flatten(0, 1)[batch["src"][M]]                                       # (tokens, dim)
    h = h.to(autocast_dtype or h.dtype)
    logp = hidden_logprobs(h, model.lm_head.weight, batch["tokens"][M], temperature)
    return torch.zeros(M.shape, dtype=logp.dtype, device=logp.device).masked_scatter(M, logp)


# -----------------------------------------------------------------------------
# the step

DUAL_CLIP = 3.0  # a shared token's weight is at most 3 |A| (dual-clip PPO's usual C, Ye et al. 2020)


def step(model, opt, groups, advantages, *, pad_id, stop_ids, micro_tokens=4096, inner_steps=1,
         max_grad_norm=1.0, temperature=1.0, ref_model=None, behaviour=None, autocast_dtype=None,
         **loss_settings):
    """The GRPO update on groups (prompt ids, [completion ids, ...]), one advantage per completion in
    order: inner_steps optimizer steps, clipped to max_grad_norm, over micro-batches of whole packed
    groups (as many as fit in micro_tokens tokens if all were the longest) whose losses add up to the
    batch's, so the gradient does not depend on the split. "Old" log-probs are the model's before the
    first step, or under the dual clip a shared row's sender's (behaviour: per completion, None or its
    log-probs). ref_model is the KL's reference (beta > 0), autocast_dtype the forward's (None: float32);
    loss_settings go to grpo_loss. Returns the last step's stats, grad_norm among them."""
    device = model.lm_head.weight.device
    adv = torch.tensor(advantages, dtype=torch.float64)  # on the CPU (mps has no float64); grpo_loss moves it
    n = max(1, micro_tokens // max(len(p) + sum(map(len, cs)) for p, cs in groups))  # groups a micro-batch
    parts = [pack(groups[i:i + n], pad_id, stop_ids, device) for i in range(0, len(groups), n)]
    first = [sum(len(part["M"]) for part in parts[:k]) for k in range(len(parts))]  # each one's first row
    total_tokens = sum(int(part["M"].sum()) for part in parts)
    if loss_settings.get("max_tokens") is None:  # the longest completion: one normaliser for all
        loss_settings["max_tokens"] = max(part["M"].shape[1] for part in parts)
    shared = torch.tensor([lp is not None for lp in behaviour or [None] * len(adv)], device=device)
    token_mean = loss_settings.get("loss_type", "token_mean") == "token_mean"
    old, ref = [None] * len(parts), [None] * len(parts)
    model.train()
    opt.zero_grad(set_to_none=True)
    for _ in range(inner_steps):
        stats = {}
        for k, part in enumerate(parts):
            rows = slice(first[k], first[k] + len(part["M"]))
            logp = completion_logprobs(model, part, temperature, autocast_dtype)
            if old[k] is None:
                old[k] = behaviour_logprobs(logp, behaviour[rows]) if behaviour else logp.detach()
            if ref_model is not None and ref[k] is None:
                with torch.no_grad():
                    ref[k] = completion_logprobs(ref_model, part, temperature, autocast_dtype)
            loss, s = grpo_loss(logp, old[k], adv[rows], part["M"], ref_logprobs=ref[k],
                                dual_clip=DUAL_CLIP, shared=shared[rows], **loss_settings)
            # the loss weighted to add up to the batch's; per-token stats by the share of tokens, not rows
            tokens = part["M"].sum().item() / max(total_tokens, 1)
            share = tokens if token_mean else len(part["M"]) / len(adv)
            (loss * share).backward()
            for key, v in dict(s, loss=loss.item()).items():
                stats[key] = stats.get(key, 0.0) + v * (share if key == "loss" else tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)  # gradients live only during a step: between rounds, memory is free
    model.eval()
    zero_adv_frac = float((adv == 0).double().mean())  # over the whole batch, whatever the split
    return dict(stats, grad_norm=float(grad_norm), zero_adv_frac=zero_adv_frac)


# ----- Nothing below this line is needed to understand SAPO: plumbing follows. -----
# The senders' log-probs checked, and the completion tokens' log-probs chunk by chunk (never all the
# logits at once).


def behaviour_logprobs(own, behaviour):
    """The "old" log-probs (B, Tc) of a micro-batch: own (the model's, detached) on each row whose
    behaviour entry is None, else the sender's log-probs, token by token. Where a sender's value is
    not a finite log-prob (NaN, inf, > 0) or is missing (a list too short), own stays: ratio 1."""
    old = own.detach().clone()
    for b, lp in enumerate(behaviour):
        if lp is not None:
            lp = torch.tensor(lp[:old.shape[1]], dtype=old.dtype, device=old.device)
            old[b, :len(lp)] = torch.where(lp.isfinite() & (lp <= 0), lp, old[b, :len(lp)])
    return old


def hidden_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=512):
    """log softmax(hidden @ weight.T / temperature)[target] at every position, from the final (post-norm)
    hidden states and the output embedding, chunk_size rows at a time. Each chunk runs under
    torch.utils.checkpoint, which keeps only its inputs for the backward pass and recomputes its logits
    there: neither pass holds more than one chunk's logits, in float32 (float64 for float64 input) and
    the few (n, V) temporaries of their softmax and its gradient (about four at the backward's peak).
    The matmul runs in hidden's dtype; weight's gradient is summed over the chunks in weight's dtype.

    hidden (B, T, C), weight (V, C), targets (B, T) long -> (B, T) float32, e.g. B=16, T=64, C=576,
    V=49152: 2 chunks of (512, 49152) float32 logits, one at a time, instead of (1024, 49152) at once"""
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    starts = range(0, max(len(t), 1), chunk_size)  # no targets: one empty chunk
    chunks = [checkpoint(_chunk_logprobs, h[i:i + chunk_size], weight, t[i:i + chunk_size], temperature,
                         use_reentrant=False) for i in starts]
    return torch.cat(chunks).view(targets.shape)


def _chunk_logprobs(h, weight, t, temperature):
    """hidden_logprobs on one chunk of rows: h (n, C) -> (n,), everything kept for autograd."""
    z = h @ weight.to(h.dtype).t()                                             # (n, V)
    z = z.to(torch.promote_types(z.dtype, torch.float32)) / temperature        # the softmax in float32
    return z.gather(1, t[:, None]).squeeze(1) - z.logsumexp(1)
