"""
Draws assets/round.svg: one real round of a small synchronous swarm of the toy (4 peers, 4/4, the lab's
settings), from what its peers held that round: each peer's I local groups and their rewards, what they
published to the store, and what peer0 did with the swarm's sample: re-tokenised, re-scored by its own
verifier, kept or dropped by the selection rule, pooled, J drawn, and the GRPO step's batch.

    python docs/round.py                 # runs rounds 0-27 (about a minute on 2 CPU cores), draws round 27
    python docs/round.py --round 12 --out /tmp/round.svg

Every count and dot in the picture comes from the run; nothing is drawn by hand.
"""

import argparse
import html
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import reproduce  # noqa: E402
import train  # noqa: E402


class Recorder(reproduce.CountingPeer):
    """A peer that keeps, for one round (`at`), its local groups, what it fetched, what each fetched group
    became (external_group's Group, or None), its pool and what it drew."""
    at, peers = None, []

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        Recorder.peers.append(self)
        self.held = {}

    def collect(self, r):
        collected = super().collect(r)
        if r == self.at:
            self.held["local"] = collected["groups"]
        return collected

    def choose_external(self, r):
        if r != self.at:
            return super().choose_external(r)
        fetch, got, a = self.client.fetch, [], self.args
        self.client.fetch = lambda: got.extend(fetch()) or got
        leftover = len(self.pool)  # undrawn groups of the last round, before this round's come
        external, counts = super().choose_external(r)
        self.client.fetch = fetch
        received = [train.external_group(self.tok, g, self.stop_id, a.max_new_tokens, a.one_shot, lambda *x: None,
                                         a.system_prompt, a.task_list) for g in got]
        self.held.update(fetched=got, received=received, drawn=external, leftover=leftover, pooled=len(self.pool))
        return external, counts


def run_round(at, folder):
    """Rounds 0..at of the lab's toy swarm (seed 0, 4 peers, 4/4) with Recorder peers; returns them."""
    s = reproduce.parse_args(["--preset", "lab", "--seeds", "1", "--rounds", str(at + 1), "--configs", "8/0,4/4",
                              "--jobs", "1", "--sample-every", "0", "--out", folder,
                              "--toy-cache", os.path.join(ROOT, "runs", "toys")])
    models, _ = reproduce.build_toys(s, [0], folder, s.guess, s.known)
    Recorder.at, Recorder.peers = at, []
    reproduce.run(s, models[0], (4, 4), 0, os.path.join(folder, "round"), Peer=Recorder)
    return s, Recorder.peers


# -----------------------------------------------------------------------------
# the drawing

GREEN, GREY, INK, FADED, BLUE = "#2e8b57", "#c8c8c8", "#222", "#999", "#3b6fb6"


def text(x, y, s, size=13, anchor="start", weight="normal", color=INK):
    return (f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'fill="{color}">{html.escape(str(s))}</text>')


def group(x, y, rewards, faded=False, mark=None):
    """A group as a row of G dots, filled for a completion that scored 1, hollow for 0; outlined when
    mark is given (its colour)."""
    out = []
    if mark:
        out.append(f'<rect x="{x - 4}" y="{y - 8}" width="{11 * len(rewards) + 6}" height="16" rx="4" '
                   f'fill="none" stroke="{mark}" stroke-width="2"/>')
    for k, r in enumerate(rewards):
        fill = (GREEN if r > 0 else "white") if not faded else (FADED if r > 0 else "white")
        out.append(f'<circle cx="{x + 11 * k + 4}" cy="{y}" r="4" fill="{fill}" '
                   f'stroke="{FADED if faded else INK}" stroke-width="1"/>')
    return "".join(out)


def arrow(x1, y1, x2, y2, color=INK):
    return (f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{color}" stroke-width="1.5" '
            f'marker-end="url(#head)"/>')


def peers_row(peers, y):
    """Each peer's I local groups (sampled by its own model, scored by its own verifier), side by side."""
    out = []
    for k, p in enumerate(peers):
        x = 20 + 245 * k
        local = p.held["local"]
        mixed = sum(train.informative(g) for g in local)
        out.append(f'<rect x="{x}" y="{y}" width="230" height="{44 + 22 * len(local)}" rx="8" fill="#f6f8fb" '
                   f'stroke="{GREY}"/>')
        out.append(text(x + 10, y + 20, f"{p.name}: its I = {len(local)} local groups", weight="bold"))
        for i, g in enumerate(local):
            out.append(group(x + 14, y + 40 + 22 * i, g.rewards, mark=BLUE if train.informative(g) else None))
        out.append(text(x + 115, y + 44, f"{mixed} of {len(local)} informative", size=12))
        out.append(text(x + 115, y + 60, "(outlined blue)", size=12, color=BLUE))
    return out


def receive(p, x, y):
    """peer0's side of steps 4-5: the sample it fetched, each group re-scored (dropped: faded), the pool, J drawn."""
    fetched, received, drawn = p.held["fetched"], p.held["received"], p.held["drawn"]
    drawn_ids = {(g.item["peer"], g.item["round"], g.item.get("seq")) for g in drawn}
    kept = [g for g in received if g is not None and p.rule.keep(g)]
    out = [text(x, y - 16, f"steps 4-5: {p.name} fetches a sample of the others' groups, {len(fetched)} of them "
                           f"(it asks for 4J = {4 * p.args.external}),", weight="bold"),
           text(x, y, "re-tokenises each with its own tokenizer and re-scores it with its own verifier",
                weight="bold")]
    for i, (g, got) in enumerate(zip(fetched, received)):
        cx, cy = x + 10 + 138 * (i % 7), y + 28 + 26 * (i // 7)
        rewards = got.rewards if got is not None else [0] * len(g["completions"])
        chosen = got is not None and (g["peer"], g["round"], g.get("seq")) in drawn_ids
        out.append(group(cx, cy, rewards, faded=got is None or not p.rule.keep(got), mark=GREEN if chosen else None))
    y2 = y + 28 + 26 * ((len(fetched) + 6) // 7)
    out.append(text(x, y2 + 2, f"The selection rule ({p.args.rule}: {p.rule.what}) keeps {len(kept)} and drops "
                               f"{len(fetched) - len(kept)} (faded: all equal).", size=12))
    out.append(text(x, y2 + 19, f"With {p.held['leftover']} left in the pool from the last round it draws J = "
                                f"{len(drawn)} (outlined green); {p.held['pooled']} stay pooled for the next round.",
                    size=12))
    return out, y2 + 19


def example(p, x, y):
    """One drawn completion as peer0 trains on it: the text sent, the ids it became, the reward it got."""
    g = next((g for g in p.held["drawn"] if any(g.rewards)), (p.held["drawn"] or [None])[0])
    if g is None:
        return []
    k = max(range(len(g.rewards)), key=lambda i: g.rewards[i])
    return [text(x, y, f"For example, from {g.item['peer']}: \u201c{g.item['question']}\u201d, sent as the text "
                       f"\u201c{g.texts[k]}\u201d,", size=12),
            text(x, y + 17, f"becomes {p.name}'s token ids {g.completions[k]} (the last is its stop token) and "
                            f"scores {g.rewards[k]:g} by {p.name}'s verifier.", size=12)]


def draw(s, peers, at):
    p0 = peers[0]
    top, local_h = 62, 44 + 22 * len(p0.held["local"])
    store_y = top + local_h + 40
    published = sum(len(p.held["local"]) for p in peers)
    I, J = s.config_list[1][:2]
    parts = [text(20, 26, f"One round of SAPO, round {at} of a real run: {len(peers)} toy peers, I = {I}, J = {J}, "
                          f"G = {s.generations}. A dot is a completion: filled if it scored 1.", size=15, weight="bold"),
             text(20, 46, "Steps 1-2: each peer draws I questions, samples G completions of each with its own model "
                          "and scores them with its own verifier.", size=12)]
    parts += peers_row(peers, top)
    for k in range(len(peers)):
        parts.append(arrow(135 + 245 * k, top + local_h + 3, 135 + 245 * k, store_y - 3))
    parts.append(f'<rect x="20" y="{store_y}" width="965" height="40" rx="8" fill="#fff8e6" stroke="#d9a400"/>')
    parts.append(text(502, store_y + 17, f"step 3: each peer publishes its groups to the store (swarm.py): "
                                         f"{published} this round", anchor="middle", weight="bold"))
    parts.append(text(502, store_y + 33, "as text (question, answer, completions), never rewards or weights",
                      anchor="middle", size=12))
    parts.append(arrow(135, store_y + 43, 135, store_y + 68))
    recv, y2 = receive(p0, 20, store_y + 102)
    parts += recv
    parts += example(p0, 20, y2 + 24)
    batch = p0.held["local"] + p0.held["drawn"]
    informative = sum(train.informative(g) for g in batch)
    y3 = y2 + 58
    parts.append(f'<rect x="20" y="{y3}" width="965" height="34" rx="8" fill="#eef6ee" stroke="{GREEN}"/>')
    parts.append(text(502, y3 + 22, f"step 6: {p0.name} takes one GRPO step on I + J = {len(batch)} groups, {informative}"
                                    " of them informative (rewards not all equal): only those move its policy",
                      anchor="middle", weight="bold"))
    others = "; ".join(f"{p.name} fetched {len(p.held['fetched'])}, kept "
                       f"{sum(g is not None and p.rule.keep(g) for g in p.held['received'])} and drew "
                       f"{len(p.held['drawn'])}" for p in peers[1:])
    parts.append(text(20, y3 + 56, f"The other peers did the same: {others}.", size=12))
    parts.append(text(20, y3 + 74, "Drawn by python docs/round.py from the peers' state in that round (the lab's "
                                   "toy, seed 0).", size=12, color=FADED))
    height = y3 + 86
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="1005" height="{height}" font-family="sans-serif">\n'
            '<defs><marker id="head" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
            f'<path d="M0,0 L8,4 L0,8 z" fill="{INK}"/></marker></defs>\n'
            f'<rect width="1005" height="{height}" fill="white"/>\n' + "\n".join(parts) + "\n</svg>\n")


def main(argv=None):
    p = argparse.ArgumentParser(description="draw one real round of the toy swarm as an SVG")
    p.add_argument("--round", type=int, default=27, help="the round to draw (the run goes from 0 to it)")
    p.add_argument("--out", default=os.path.join(ROOT, "assets", "round.svg"), help="the SVG to write")
    a = p.parse_args(argv)
    if a.round < 0:
        p.error("--round must be at least 0")
    with tempfile.TemporaryDirectory() as folder:
        s, peers = run_round(a.round, folder)
        svg = draw(s, peers, a.round)
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(svg)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
