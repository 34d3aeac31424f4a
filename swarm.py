"""
The swarm: one small HTTP server that stores the rollouts peers publish, and the client a peer uses
to publish its own rollouts and poll for everyone else's.

SAPO ("Sharing is Caring", arXiv 2509.08721, Sec. 3 and Algorithm 1) trains a swarm of peers, each
with its own small language model. Every round a peer generates G completions for each of its I local
questions, shares those decoded rollouts (text only: question, answer, completions; never rewards,
token ids, log-probs or weights) with the swarm, and trains on its I local groups plus J groups drawn
from what the other peers shared. Peers never wait for each other: a peer takes whatever has arrived.

How this file does it:
- Server (standard library only): `python swarm.py --dir swarm_data --port 8000`. Each accepted
  POST /rollouts becomes one JSON file `batch-NNNNNNNN.json` in --dir, written atomically and fsynced
  before the reply, so an acknowledged batch survives kill -9 and nothing half-written is ever served.
  The server numbers stored groups 1, 2, 3, ... (`seq`) in publication order; a restart reloads the
  folder and continues the numbering. Readers poll GET /rollouts?after=SEQ&exclude=ME.
- Client (`requests`): `SwarmClient(url, peer)`. publish() retries briefly and then keeps the batch
  in a small outbox for later; fetch() returns the new external groups and remembers its cursor.
  Neither ever raises into the training loop: with the server down a peer simply trains in silo
  (the paper's baseline) and catches up when it comes back.
- Dashboard: peers POST /metrics once a round; GET / draws every peer's reward per round.

Deviations from the paper, and why:
- The paper's swarm ran on Gensyn's RL Swarm, where peers exchange rollouts over a peer-to-peer DHT.
  Here one HTTP server holds them: a few hundred readable lines instead of a networking stack, and
  enough for the paper's experiments (a handful of peers on one machine or one LAN). The price is a
  single point of failure, softened by the outbox and by peers training on regardless.
- Delivery is by polling, so an external rollout reaches other peers one round late at worst. SAPO
  tolerates this by design: peers never wait and use whatever has arrived.
- A peer receives every group published since its last poll; dropping zero-advantage groups and
  sampling J of the rest is the receiving peer's job (train.py), as in the paper.
- Storage is bounded (--keep-groups): the oldest batches are deleted; the paper does not discuss it.
- The server does not judge content: an optional shared bearer token guards writes, and beyond
  that it only checks shapes and sizes. Receivers do the judging: they reward external completions
  with their own verifier and drop groups whose answer does not follow from their question
  (reward.verify_item, in train.py), so nobody can inject fake rewards or fake ground truth.
"""

import argparse
import bisect
import collections
import hmac
import html
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

try:
    import fcntl  # POSIX: lets the server lock its folder so two servers never share one
except ImportError:
    fcntl = None
try:
    import requests  # the client needs it; the server runs on the standard library alone
except ImportError:
    requests = None

# -----------------------------------------------------------------------------
# Limits. Everything a request can make the server hold is bounded by one of these.
MAX_BODY_BYTES = 8 * 1024 * 1024      # request body size cap (413 beyond it)
MAX_GROUPS_PER_POST = 256             # groups in one POST /rollouts
MAX_COMPLETIONS = 64                  # completions in one group (G)
MAX_COMPLETION_CHARS = 32_000         # characters in one completion
MAX_QUESTION_CHARS = 16_000           # characters in one question
MAX_ANSWER_CHARS = 4_000              # characters in one ground-truth answer
MAX_NAME_CHARS = 256                  # characters in a task or model name
MAX_METADATA_CHARS = 16_000           # size of a group's metadata, as compact JSON
MAX_METADATA_DEPTH = 8                # nesting of dicts/lists inside metadata
MAX_METRICS_KEYS = 64                 # numbers in one POST /metrics
MAX_METRICS_ROWS = 20_000             # metrics rows kept, in memory and in metrics.jsonl
DEFAULT_LIMIT, MAX_LIMIT = 256, 1024  # groups per GET /rollouts page
MAX_SCAN = 16 * MAX_LIMIT             # groups one GET may look at (skipping the excluded peer's)
DEFAULT_KEEP_GROUPS = 200_000         # retention; memory is about this many times a group's size
PEER_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
BATCH_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
BATCH_FILE_RE = re.compile(r"batch-(\d{8,})\.json")  # the only files the server ever reads back
TMP_PREFIX = ".tmp-"                  # files being written; never acknowledged, removed on start
METRICS_FILE = "metrics.jsonl"
LOCK_FILE = "swarm.lock"
JSON = "application/json"


def _log(message):
    print(f"swarm server: {message}", file=sys.stderr, flush=True)


# -----------------------------------------------------------------------------
# Checking what a request sends. Every problem becomes one sentence for the sender.

class BadRequest(Exception):
    def __init__(self, message, status=400, headers=None):
        super().__init__(message)
        self.message, self.status, self.headers = message, status, headers or {}


def _want(ok, message):
    if not ok:
        raise BadRequest(message)


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not a round number


def _finite_float(text):
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"the number {text[:20]} is too large")
    return x


def _no_constant(name):
    raise ValueError(f"{name} is not allowed in JSON")


def parse_json(raw):
    """Strict JSON: no NaN or Infinity (they would not survive being served back as JSON)."""
    try:
        return json.loads(raw, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest("The JSON body is nested too deeply.") from None
    except ValueError as e:  # includes JSONDecodeError and bodies that are not UTF-8
        raise BadRequest(f"The body is not valid JSON: {str(e)[:120]}.") from None


def _too_deep(x, levels_left):
    if levels_left < 0:
        return True
    children = x.values() if isinstance(x, dict) else x if isinstance(x, list) else ()
    return any(_too_deep(child, levels_left - 1) for child in children)


def _check_peer(name, field="peer"):
    _want(isinstance(name, str) and PEER_RE.fullmatch(name),
          f"{field} must be 1 to 64 characters from A-Z, a-z, 0-9, '_', '.' and '-'.")


def _check_round(value):
    _want(_is_int(value) and 0 <= value < 10**12, "round must be a whole number of at least 0.")


def _check_text(value, field, max_chars, allow_empty=True):
    _want(isinstance(value, str), f"{field} must be a string.")
    _want(allow_empty or value, f"{field} must not be empty.")
    _want(len(value) <= max_chars, f"{field} has {len(value)} characters; the limit is {max_chars}.")


def check_group(g, where):
    """One group of the wire format (see DESIGN.md) -> a clean copy holding only the known fields."""
    _want(isinstance(g, dict), f"{where} must be a JSON object.")
    for key in ("task", "question", "answer", "completions", "stopped"):
        _want(key in g, f"{where} is missing the field '{key}'.")
    _check_text(g["task"], f"{where}.task", MAX_NAME_CHARS, allow_empty=False)
    _check_text(g["question"], f"{where}.question", MAX_QUESTION_CHARS)
    _check_text(g["answer"], f"{where}.answer", MAX_ANSWER_CHARS)
    metadata = g.get("metadata", {})
    _want(isinstance(metadata, dict), f"{where}.metadata must be a JSON object.")
    _want(not _too_deep(metadata, MAX_METADATA_DEPTH),
          f"{where}.metadata is nested more than {MAX_METADATA_DEPTH} levels deep.")
    _want(len(json.dumps(metadata, separators=(",", ":"))) <= MAX_METADATA_CHARS,
          f"{where}.metadata is larger than {MAX_METADATA_CHARS} characters of JSON.")
    completions, stopped = g["completions"], g["stopped"]
    _want(isinstance(completions, list) and completions,
          f"{where}.completions must be a non-empty list of strings.")
    _want(len(completions) <= MAX_COMPLETIONS,
          f"{where} has {len(completions)} completions; the limit is {MAX_COMPLETIONS}.")
    for k, text in enumerate(completions):
        _check_text(text, f"{where}.completions[{k}]", MAX_COMPLETION_CHARS)
    _want(isinstance(stopped, list) and len(stopped) == len(completions)
          and all(isinstance(s, bool) for s in stopped),
          f"{where}.stopped must be a list of {len(completions)} booleans, one per completion.")
    model = g.get("model", "")
    _check_text(model, f"{where}.model", MAX_NAME_CHARS)
    return {"task": g["task"], "question": g["question"], "answer": g["answer"],
            "metadata": metadata, "completions": completions, "stopped": stopped, "model": model}


def check_publish(body):
    """POST /rollouts body -> (peer, round, batch_id, clean groups)."""
    _want(isinstance(body, dict), "The body must be a JSON object.")
    for key in ("peer", "round", "batch_id", "groups"):
        _want(key in body, f"The body is missing the field '{key}'.")
    _check_peer(body["peer"])
    _check_round(body["round"])
    _want(isinstance(body["batch_id"], str) and BATCH_ID_RE.fullmatch(body["batch_id"]),
          "batch_id must be 1 to 128 characters from A-Z, a-z, 0-9, '_', '.', ':' and '-'.")
    groups = body["groups"]
    _want(isinstance(groups, list), "groups must be a list of groups.")
    _want(len(groups) <= MAX_GROUPS_PER_POST,
          f"The body has {len(groups)} groups; the limit per post is {MAX_GROUPS_PER_POST}.")
    clean = [check_group(g, f"groups[{i}]") for i, g in enumerate(groups)]
    return body["peer"], body["round"], body["batch_id"], clean


def check_metrics(body):
    """POST /metrics body -> (peer, round, {name: number or null})."""
    _want(isinstance(body, dict), "The body must be a JSON object.")
    for key in ("peer", "round", "metrics"):
        _want(key in body, f"The body is missing the field '{key}'.")
    _check_peer(body["peer"])
    _check_round(body["round"])
    metrics = body["metrics"]
    _want(isinstance(metrics, dict), "metrics must be a JSON object of names to numbers.")
    _want(len(metrics) <= MAX_METRICS_KEYS, f"metrics has more than {MAX_METRICS_KEYS} entries.")
    for name, value in metrics.items():
        _want(0 < len(name) <= 64, "Each metric name must be 1 to 64 characters.")
        _want(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)),
              f"The metric '{name[:64]}' must be a number or null.")
    return body["peer"], body["round"], metrics


# -----------------------------------------------------------------------------
# Storage: one file per accepted batch, plus an in-memory index of everything kept.

def _write_atomic(folder, name, data):
    """Write bytes to folder/name so that anyone (a reader, a restart after kill -9) sees all or nothing."""
    tmp = os.path.join(folder, TMP_PREFIX + name)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, name))
    fd = os.open(folder, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RolloutStore:
    """The folder of batch files and the in-memory index. Two locks: `write_lock` lets one writer at a time
    touch the folder (which gives one global order; a post costs one fsync), and `lock` guards the
    in-memory state for the moment it takes to update or read it, so readers never wait for a disk."""

    def __init__(self, folder, keep_groups=DEFAULT_KEEP_GROUPS):
        self.folder = os.path.abspath(folder)
        self.keep_groups = keep_groups
        self.write_lock = threading.Lock()
        self.lock = threading.Lock()
        self.index = []                       # (seq, peer, group as JSON text) for each kept group, seq order
        self.batches = collections.deque()    # (batch number, peer, batch_id, groups) per kept file, oldest first
        self.replies = {}                     # (peer, batch_id) -> the reply that batch got
        self.peers = {}                       # peer -> {"last_seen", "last_round", "groups"}
        self.metrics = collections.deque(maxlen=MAX_METRICS_ROWS)
        self.metrics_lines = 0                # lines in metrics.jsonl; rewritten when it doubles
        self.last_seq = 0                     # seq of the newest group ever stored
        self.last_batch = 0                   # number of the newest batch file
        self.closed = False
        self.lock_file = self._open_folder()
        try:
            self._load_batches()
            self._load_metrics()
            self._delete(self._retain())
        except BaseException:
            self.close()
            raise

    def _open_folder(self):
        try:
            os.makedirs(self.folder, exist_ok=True)
            probe = os.path.join(self.folder, TMP_PREFIX + "probe")
            with open(probe, "wb"):
                pass
            os.remove(probe)
            lock_file = open(os.path.join(self.folder, LOCK_FILE), "a")
        except OSError as e:
            raise ValueError(f"cannot use --dir {self.folder} ({e.strerror or e}); "
                             "give a folder the server can create and write.") from None
        if fcntl is not None:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock_file.close()
                raise ValueError(f"another swarm server is already using --dir {self.folder}; "
                                 "stop it or choose another folder.") from None
        return lock_file

    def _load_batches(self):
        numbered = []
        for name in os.listdir(self.folder):
            if name.startswith(TMP_PREFIX):  # a write that never finished, so never acknowledged
                _log(f"removing leftover temporary file {name}")
                try:
                    os.remove(os.path.join(self.folder, name))
                except OSError:
                    pass
            elif BATCH_FILE_RE.fullmatch(name):
                numbered.append((int(BATCH_FILE_RE.fullmatch(name).group(1)), name))
        for batch_no, name in sorted(numbered):
            self.last_batch = max(self.last_batch, batch_no)  # never reuse a number, even a bad file's
            try:
                with open(os.path.join(self.folder, name), "rb") as f:
                    self._index_batch(batch_no, json.loads(f.read()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                _log(f"skipping unreadable batch file {name} ({e!r:.200})")
        if numbered:
            _log(f"reloaded {len(self.index)} groups in {len(self.batches)} batches from {self.folder}; "
                 f"numbering continues after seq {self.last_seq}")

    def _index_batch(self, batch_no, record):
        peer, batch_id, round_, groups = record["peer"], record["batch_id"], record["round"], record["groups"]
        seqs = [g["seq"] for g in groups]
        when = float(record.get("time", 0.0))
        if not (isinstance(peer, str) and isinstance(batch_id, str) and _is_int(round_) and seqs
                and all(_is_int(s) for s in seqs) and seqs[0] > self.last_seq
                and seqs == list(range(seqs[0], seqs[0] + len(seqs)))):
            raise ValueError("batch record is malformed or out of sequence")
        self.index.extend((g["seq"], peer, json.dumps(g, separators=(",", ":"))) for g in groups)
        self.last_seq = seqs[-1]
        self.batches.append((batch_no, peer, batch_id, len(groups)))
        self.replies[(peer, batch_id)] = {"accepted": len(groups), "seq": seqs[-1]}
        self._seen(peer, round_, when, published=len(groups))

    def _seen(self, peer, round_, when, published=0):
        p = self.peers.setdefault(peer, {"last_seen": 0.0, "last_round": 0, "groups": 0})
        p["last_seen"] = max(p["last_seen"], float(when))
        p["last_round"] = max(p["last_round"], round_)
        p["groups"] += published

    def _retain(self):
        """Forget whole oldest batches while over the limit (always keeping the newest) -> their files."""
        doomed = []
        while len(self.index) > self.keep_groups and len(self.batches) > 1:
            batch_no, peer, batch_id, n = self.batches.popleft()
            del self.index[:n]
            self.replies.pop((peer, batch_id), None)
            doomed.append(os.path.join(self.folder, f"batch-{batch_no:08d}.json"))
        return doomed

    def _delete(self, paths):
        for path in paths:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            except OSError as e:  # it will be deleted again after a restart
                _log(f"could not delete old batch file {os.path.basename(path)} ({e.strerror})")

    def publish(self, peer, round_, batch_id, groups):
        with self.write_lock:
            if self.closed:
                raise RuntimeError("the store is closed")
            now = time.time()
            with self.lock:
                reply = self.replies.get((peer, batch_id))
                if reply is not None or not groups:  # a retry of a stored batch: same reply, stored once
                    self._seen(peer, round_, now)
                    return reply or {"accepted": 0, "seq": self.last_seq}
            stamped = [{"peer": peer, "round": round_, "seq": self.last_seq + 1 + k, **g}
                       for k, g in enumerate(groups)]
            record = {"batch_id": batch_id, "peer": peer, "round": round_, "time": now, "groups": stamped}
            batch_no = self.last_batch + 1
            _write_atomic(self.folder, f"batch-{batch_no:08d}.json", json.dumps(record).encode())
            self.last_batch = batch_no  # durable now: only from here on may anyone see it
            with self.lock:
                self._index_batch(batch_no, record)
                doomed = self._retain()
            self._delete(doomed)
            return self.replies.get((peer, batch_id)) or {"accepted": len(groups), "seq": stamped[-1]["seq"]}

    def read(self, after, exclude, limit):
        """Groups with seq > after not from `exclude`, at most `limit` -> (JSON texts, next cursor, last seq)."""
        with self.lock:
            start = bisect.bisect_right(self.index, after, key=lambda entry: entry[0])
            texts, next_seq = [], after
            for i in range(start, min(len(self.index), start + MAX_SCAN)):
                if len(texts) == limit:
                    break
                seq, peer, text = self.index[i]
                next_seq = seq
                if peer != exclude:
                    texts.append(text)
            return texts, next_seq, self.last_seq

    def _load_metrics(self):
        path, bad = os.path.join(self.folder, METRICS_FILE), 0
        if not os.path.exists(path):
            return
        with open(path, "rb") as f:
            for line in f:
                try:
                    row = json.loads(line)
                    if not (isinstance(row, dict) and isinstance(row.get("peer"), str)
                            and _is_int(row.get("round")) and isinstance(row.get("metrics"), dict)):
                        raise ValueError("not a metrics row")
                    self._seen(row["peer"], row["round"], row["time"])
                    self.metrics.append(row)
                    self.metrics_lines += 1
                except (ValueError, KeyError, TypeError):
                    bad += 1  # e.g. the last line, cut short by kill -9
        if bad:
            _log(f"skipped {bad} unreadable lines in {METRICS_FILE}")

    def add_metrics(self, peer, round_, metrics):
        with self.write_lock:
            if self.closed:
                raise RuntimeError("the store is closed")
            row = {"peer": peer, "round": round_, "time": time.time(), "metrics": metrics}
            with open(os.path.join(self.folder, METRICS_FILE), "a") as f:  # best-effort: no fsync
                f.write(json.dumps(row) + "\n")
            self.metrics_lines += 1
            with self.lock:
                self.metrics.append(row)
                self._seen(peer, round_, row["time"])
                rows = list(self.metrics) if self.metrics_lines > 2 * MAX_METRICS_ROWS else None
            if rows is not None:  # keep the file bounded too: rewrite it with the rows kept
                _write_atomic(self.folder, METRICS_FILE, "".join(json.dumps(r) + "\n" for r in rows).encode())
                self.metrics_lines = len(rows)

    def snapshot(self, metrics=False):
        with self.lock:
            return {"groups": len(self.index), "first_seq": self.index[0][0] if self.index else 0,
                    "last_seq": self.last_seq, "peers": {p: dict(v) for p, v in self.peers.items()},
                    "metrics": list(self.metrics) if metrics else []}

    def close(self):
        with self.write_lock:
            self.closed = True
            self.lock_file.close()  # releases the folder lock


# -----------------------------------------------------------------------------
# Dashboard: an SVG line chart, and one self-contained HTML page.

COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def _esc(text):
    return html.escape(str(text), quote=True)  # safe in both HTML and XML


def render_svg(series, title="reward per round", ylabel="reward", xlabel="round", width=760, height=360):
    """{name: [(round, value), ...]} -> a standalone SVG document (a string) with one line per name."""
    left, right, top, bottom = 60, 170, 34, 46
    plot_w, plot_h = width - left - right, height - top - bottom
    lines = {name: sorted((x, y) for x, y in points
                          if isinstance(y, (int, float)) and math.isfinite(y)
                          and isinstance(x, (int, float)) and math.isfinite(x))
             for name, points in series.items()}
    lines = {name: pts for name, pts in lines.items() if pts}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left + plot_w / 2}" y="20" text-anchor="middle" font-size="14">{_esc(title)}</text>']
    if not lines:
        out.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" text-anchor="middle" '
                   'fill="#888">no data yet</text></svg>')
        return "\n".join(out)
    xs = [x for pts in lines.values() for x, _ in pts]
    ys = [y for pts in lines.values() for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    pad = (y1 - y0) * 0.05 or 0.5
    y0, y1 = y0 - pad, y1 + pad

    def px(x):
        return left + (x - x0) / (x1 - x0) * plot_w

    def py(y):
        return top + (y1 - y) / (y1 - y0) * plot_h

    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>')
    for xv in sorted({round(x0 + (x1 - x0) * k / 5) for k in range(6)}):  # rounds along the bottom
        out.append(f'<line x1="{px(xv):.1f}" y1="{top + plot_h}" x2="{px(xv):.1f}" y2="{top + plot_h + 5}" '
                   f'stroke="#444"/><text x="{px(xv):.1f}" y="{top + plot_h + 18}" '
                   f'text-anchor="middle">{xv}</text>')
    for k in range(6):  # values up the side
        yv = y0 + (y1 - y0) * k / 5
        out.append(f'<line x1="{left}" y1="{py(yv):.1f}" x2="{left + plot_w}" y2="{py(yv):.1f}" '
                   f'stroke="#ddd"/><text x="{left - 6}" y="{py(yv) + 4:.1f}" '
                   f'text-anchor="end">{yv:.3g}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle">{_esc(xlabel)}</text>')
    out.append(f'<text x="16" y="{top + plot_h / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {top + plot_h / 2})">{_esc(ylabel)}</text>')
    for k, (name, pts) in enumerate(sorted(lines.items())):
        colour = COLOURS[k % len(COLOURS)]
        pts = pts[::max(1, len(pts) // 2000)]  # a chart needs no more than ~2000 points a line
        if len(pts) == 1:
            out.append(f'<circle cx="{px(pts[0][0]):.1f}" cy="{py(pts[0][1]):.1f}" r="3" fill="{colour}"/>')
        else:
            coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>')
        ly = top + 10 + 18 * k
        out.append(f'<line x1="{left + plot_w + 12}" y1="{ly}" x2="{left + plot_w + 32}" y2="{ly}" '
                   f'stroke="{colour}" stroke-width="3"/><text x="{left + plot_w + 38}" y="{ly + 4}">'
                   f'{_esc(name[:24])}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _reward(metrics):
    for key in ("batch_reward", "local_reward"):
        value = metrics.get(key)
        if isinstance(value, (int, float)):
            return value
    return None


def render_page(snap):
    series, last = {}, {}
    for row in snap["metrics"]:  # later rows for the same round (after a resume) replace earlier ones
        value = _reward(row["metrics"])
        if value is not None:
            series.setdefault(row["peer"], {})[row["round"]] = value
        last.setdefault(row["peer"], {}).update(row["metrics"])
    chart = render_svg({p: sorted(s.items()) for p, s in series.items()},
                       title="batch_reward per round (local_reward where missing)")

    def cell(value):
        return "" if value is None else f"{value:.3f}" if isinstance(value, float) else _esc(value)

    rows = []
    for peer, info in sorted(snap["peers"].items()):
        m = last.get(peer, {})
        seen = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info["last_seen"]))
        rows.append(f"<tr><td>{_esc(peer)}</td><td>{info['last_round']}</td><td>{info['groups']}</td>"
                    f"<td>{cell(m.get('local_reward'))}</td><td>{cell(m.get('batch_reward'))}</td>"
                    f"<td>{seen}</td></tr>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="5"><title>nanoSAPO swarm</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}} td:first-child{{text-align:left}}</style>
</head><body><h1>nanoSAPO swarm</h1>
<p>{snap['groups']} groups kept (seq {snap['first_seq']} to {snap['last_seq']}), {len(snap['peers'])} peers.</p>
{chart}
<table><tr><th>peer</th><th>last round</th><th>groups published</th><th>last local_reward</th>
<th>last batch_reward</th><th>last seen</th></tr>
{"".join(rows)}
</table></body></html>"""


# -----------------------------------------------------------------------------
# HTTP: routes, one handler per route, errors as one JSON sentence.

ROUTES = {"/": {"GET": "page"}, "/health": {"GET": "health"}, "/peers": {"GET": "peers"},
          "/rollouts": {"GET": "get_rollouts", "POST": "post_rollouts"},
          "/metrics": {"GET": "get_metrics", "POST": "post_metrics"}}


def _int_param(query, name, default, lowest, highest):
    values = query.get(name)
    if not values:
        return default
    text = values[-1]
    _want(re.fullmatch(r"\d{1,15}", text) is not None, f"{name} must be a whole number of at least {lowest}.")
    value = int(text)
    _want(lowest <= value <= (highest if highest is not None else value),
          f"{name} must be between {lowest} and {highest}.")
    return value


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so a polling peer reuses one connection
    server_version = "nanoSAPO-swarm"
    timeout = 60                   # seconds an idle or slow connection may hold its thread
    disable_nagle_algorithm = True # headers and body go out at once (else a 40 ms delayed-ACK stall)

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_PATCH(self):
        self._dispatch("PATCH")

    def log_message(self, format, *args):  # quiet unless --verbose
        if self.server.verbose:
            _log(f"{self.address_string()} {format % args}")

    def _dispatch(self, method):
        self.body_read = False
        try:
            url = urlsplit(self.path)
            methods = ROUTES.get(url.path)
            if methods is None:
                raise BadRequest(f"There is no {url.path[:80]} here; the paths are "
                                 f"{', '.join(ROUTES)}.", 404)
            if method not in methods:
                allowed = ", ".join(methods)
                raise BadRequest(f"{url.path} accepts only {allowed}, not {method}.", 405, {"Allow": allowed})
            if method == "POST":
                self._check_token()
            status, content_type, body = getattr(self, "_" + methods[method])(url.query)
            self._reply(status, body, content_type)
        except BadRequest as e:
            self._reply(e.status, {"error": e.message}, JSON, e.headers)
        except Exception as e:  # a bug: say so in one sentence, log it, keep serving
            _log(f"unexpected error in {method} {self.path[:200]}: {e!r:.300}")
            self._reply(500, {"error": "The server hit an unexpected error; it was logged and the "
                                       "server keeps serving."}, JSON)

    def _check_token(self):
        token = self.server.token
        if token is None:
            return
        given = self.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        wanted = f"Bearer {token}".encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, wanted):
            raise BadRequest("This server needs the header 'Authorization: Bearer <token>' for writes; "
                             "pass the swarm token.", 401, {"WWW-Authenticate": "Bearer"})

    def _read_json(self):
        length = self.headers.get("Content-Length")
        if length is None or "Transfer-Encoding" in self.headers:
            raise BadRequest("A Content-Length header is required (no chunked bodies).", 411)
        _want(re.fullmatch(r"\d{1,12}", length.strip()) is not None, "Content-Length must be a whole number.")
        if int(length) > MAX_BODY_BYTES:
            raise BadRequest(f"The body is {int(length)} bytes; the limit is {MAX_BODY_BYTES}.", 413)
        raw = self.rfile.read(int(length))
        self.body_read = True
        _want(len(raw) == int(length), "The body ended before Content-Length bytes arrived.")
        return parse_json(raw)

    def _reply(self, status, body, content_type, headers=None):
        if not isinstance(body, bytes):
            body = json.dumps(body).encode() if content_type == JSON else body.encode()
        declared = self.headers.get("Content-Length", "0").strip() not in ("", "0") \
            or "Transfer-Encoding" in self.headers
        if declared and not self.body_read:  # the unread body would be taken for the next request
            self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", content_type + ("; charset=utf-8" if content_type != JSON else ""))
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _query(self, query):
        try:
            return parse_qs(query, keep_blank_values=True, max_num_fields=16)
        except ValueError:
            raise BadRequest("The query string has too many fields.") from None

    # --- one method per route: (query string) -> (status, content type, body)

    def _post_rollouts(self, query):
        peer, round_, batch_id, groups = check_publish(self._read_json())
        return 200, JSON, self.server.store.publish(peer, round_, batch_id, groups)

    def _get_rollouts(self, query):
        q = self._query(query)
        after = _int_param(q, "after", 0, 0, None)
        limit = _int_param(q, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        exclude = q.get("exclude", [""])[-1]
        if exclude:
            _check_peer(exclude, "exclude")
        texts, next_seq, last_seq = self.server.store.read(after, exclude, limit)
        # groups are kept as JSON text, so a page is joined, not re-encoded
        body = '{"groups":[' + ",".join(texts) + f'],"next":{next_seq},"last":{last_seq}}}'
        return 200, JSON, body.encode()

    def _post_metrics(self, query):
        peer, round_, metrics = check_metrics(self._read_json())
        self.server.store.add_metrics(peer, round_, metrics)
        return 200, JSON, {"ok": True}

    def _get_metrics(self, query):
        return 200, JSON, {"metrics": self.server.store.snapshot(metrics=True)["metrics"]}

    def _health(self, query):
        snap = self.server.store.snapshot()
        return 200, JSON, {"ok": True, "groups": snap["groups"], "peers": len(snap["peers"]),
                           "last_seq": snap["last_seq"]}

    def _peers(self, query):
        return 200, JSON, {"peers": self.server.store.snapshot()["peers"]}

    def _page(self, query):
        return 200, "text/html", render_page(self.server.store.snapshot(metrics=True))


class SwarmServer(ThreadingHTTPServer):
    """A thread per connection. shutdown() stops serving, closes open connections and the store."""
    daemon_threads = True

    def __init__(self, address, store, token=None, verbose=False):
        self.store, self.token, self.verbose = store, token, verbose
        self.open_connections, self.connections_lock = set(), threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        with self.connections_lock:
            self.open_connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self.connections_lock:
            self.open_connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address):  # a client hanging up is not news
        error = sys.exc_info()[1]
        if not isinstance(error, (ConnectionError, TimeoutError)):
            _log(f"connection from {client_address[0]} failed: {error!r:.200}")

    def shutdown(self):
        super().shutdown()
        self.server_close()
        with self.connections_lock:
            for connection in list(self.open_connections):
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.store.close()


def start_server(dir, host="127.0.0.1", port=0, token=None, keep_groups=DEFAULT_KEEP_GROUPS, verbose=False):
    """Start a server in a daemon thread -> (server, "http://host:port"). Stop it with server.shutdown().
    Raises ValueError with one sentence when the folder, port or settings cannot be used."""
    if not _is_int(keep_groups) or keep_groups < 1:
        raise ValueError("--keep-groups must be a whole number of at least 1.")
    if not _is_int(port) or not 0 <= port <= 65535:
        raise ValueError("--port must be a whole number from 0 to 65535.")
    store = RolloutStore(dir, keep_groups)
    try:
        server = SwarmServer((host, port), store, token or None, verbose)
    except OSError as e:
        store.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}); "
                         "choose another --host or --port.") from None
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},  # how soon shutdown() acts
                     name="swarm-server", daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}"


# -----------------------------------------------------------------------------
# Client: what a peer's training loop uses. It never raises once constructed.

class _Unreachable(Exception):
    """No usable answer (connection refused, timeout, 5xx, garbage): worth retrying later."""


class _Refused(Exception):
    """The server said the request itself is wrong (4xx): retrying the same bytes will not help."""


class SwarmClient:
    """One peer's view of the swarm. Not thread-safe: one client per peer loop."""

    def __init__(self, url, peer, token=None, timeout=5.0, retries=3, outbox_size=64, max_pages=4):
        if requests is None:
            raise RuntimeError("SwarmClient needs the requests package: pip install requests.")
        if not isinstance(peer, str) or not PEER_RE.fullmatch(peer):
            raise ValueError("peer must be 1 to 64 characters from A-Z, a-z, 0-9, '_', '.' and '-'.")
        self.url, self.peer = url.rstrip("/"), peer
        self.timeout, self.retries, self.max_pages = timeout, retries, max_pages
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"
        self.cursor = 0                                        # seq of the last group seen; fetch resumes after it
        self.outbox = collections.deque(maxlen=outbox_size)    # (round, JSON body) not yet acknowledged, oldest first
        self.dropped = 0                                       # batches pushed out of a full outbox
        self.down = False                                      # inside an outage (logged once)

    def _log(self, message):
        print(f"swarm client {self.peer}: {message}", file=sys.stderr, flush=True)

    def _went_down(self, reason):
        if not self.down:
            self.down = True
            self._log(f"server {self.url} unreachable ({reason}); training goes on, unsent batches wait "
                      f"in the outbox (up to {self.outbox.maxlen}) and fetches catch up when it is back")

    def _call(self, method, path, **kwargs):
        for attempt in range(2):
            try:
                r = self.session.request(method, self.url + path, timeout=self.timeout, **kwargs)
                break
            except requests.ConnectionError as e:  # also a kept-alive connection the server just closed:
                if attempt or isinstance(e, requests.Timeout):  # so one immediate retry (replays are safe)
                    raise _Unreachable(type(e).__name__) from None
            except Exception as e:  # any other requests/socket failure
                raise _Unreachable(type(e).__name__) from None
        if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
            try:
                message = r.json()["error"]
            except Exception:
                message = f"HTTP {r.status_code}"
            raise _Refused(f"HTTP {r.status_code}: {message}")
        if r.status_code != 200:
            raise _Unreachable(f"HTTP {r.status_code}")
        try:
            data = r.json()
        except ValueError:
            raise _Unreachable("the reply is not JSON") from None
        if not isinstance(data, dict):
            raise _Unreachable("the reply is not a JSON object")
        if self.down:
            self.down = False
            lost = f", {self.dropped} older ones were dropped" if self.dropped else ""
            self._log(f"server reachable again; re-sending {len(self.outbox)} held batches{lost}")
            self.dropped = 0
        return data

    def _post_batch(self, body):
        return self._call("POST", "/rollouts", data=body, headers={"Content-Type": JSON})

    def _flush_outbox(self):
        while self.outbox:
            round_, body = self.outbox[0]
            try:
                self._post_batch(body)
            except _Refused as e:
                self._log(f"dropping held batch of round {round_}: {e}")
            except _Unreachable as e:
                self._went_down(str(e))
                return  # still down: keep it for next time
            self.outbox.popleft()

    def publish(self, round, groups):
        """Share this round's groups. True if acknowledged now; otherwise the batch waits in the outbox
        (same batch_id, so the server stores it once however often it arrives)."""
        try:
            batch = {"peer": self.peer, "round": int(round),
                     "batch_id": f"{self.peer}-{int(round)}-{uuid.uuid4().hex[:12]}", "groups": list(groups)}
            body = json.dumps(batch, allow_nan=False)
        except (TypeError, ValueError) as e:
            self._log(f"round {round}'s groups cannot be sent as JSON ({e})")
            return False
        self._flush_outbox()
        tries = 1 if self.down else 1 + self.retries  # during an outage, do not stall the loop
        reason = "no answer"
        for attempt in range(tries):
            if attempt:
                time.sleep(0.2 * 2 ** (attempt - 1))  # 0.2, 0.4, 0.8 s
            try:
                self._post_batch(body)
                return True
            except _Refused as e:
                self._log(f"the server refused round {round}'s batch: {e}")
                return False
            except _Unreachable as e:
                reason = str(e)
        self._went_down(reason)
        if len(self.outbox) == self.outbox.maxlen:
            self.dropped += 1
        self.outbox.append((int(round), body))
        return False

    def fetch(self, limit=DEFAULT_LIMIT):
        """The groups other peers published since the previous call (up to max_pages pages of `limit`)."""
        self._flush_outbox()
        got = []
        for _ in range(self.max_pages):
            try:
                data = self._call("GET", "/rollouts",
                                  params={"after": self.cursor, "exclude": self.peer, "limit": limit})
            except _Unreachable as e:
                self._went_down(str(e))
                break
            except _Refused as e:
                self._log(f"the server refused a fetch: {e}")
                break
            groups, next_seq, last_seq = data.get("groups"), data.get("next"), data.get("last")
            if not isinstance(groups, list) or not _is_int(next_seq):
                self._went_down("a malformed reply")
                break
            if _is_int(last_seq) and last_seq < self.cursor:
                self._log(f"the server holds fewer groups than seen (seq {last_seq} < {self.cursor}); "
                          "it was probably given a new folder, so reading from the start")
                self.cursor = 0
                continue
            got.extend(g for g in groups if isinstance(g, dict) and g.get("peer") != self.peer)
            if next_seq <= self.cursor:
                break
            self.cursor = next_seq
            if not _is_int(last_seq) or next_seq >= last_seq:
                break
        return got

    def post_metrics(self, round, metrics):
        """Best effort, one try: per-round numbers for the dashboard. Non-finite values are sent as null."""
        try:
            clean = {str(k)[:64]: (float(v) if math.isfinite(v) else None) for k, v in metrics.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)}
            body = json.dumps({"peer": self.peer, "round": int(round), "metrics": clean})
            self._call("POST", "/metrics", data=body, headers={"Content-Type": JSON})
            return True
        except _Unreachable as e:
            self._went_down(str(e))
        except Exception as e:
            self._log(f"metrics of round {round} not recorded: {e}")
        return False

    def health(self):
        """The server's /health reply, or None when it cannot be reached."""
        try:
            return self._call("GET", "/health")
        except Exception:
            return None


# -----------------------------------------------------------------------------
# Command line: python swarm.py --dir swarm_data --host 127.0.0.1 --port 8000 [--token SECRET]

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence instead of usage + error
        print(f"swarm.py: {message}; see python swarm.py --help.", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    parser = _Parser(description="nanoSAPO swarm rollout server (see the docstring of swarm.py).")
    parser.add_argument("--dir", default="swarm_data", help="folder holding the batch files (created if missing)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for a LAN)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one")
    parser.add_argument("--token", default=os.environ.get("SWARM_TOKEN"),
                        help="require 'Authorization: Bearer TOKEN' for writes (default: $SWARM_TOKEN)")
    parser.add_argument("--keep-groups", type=int, default=DEFAULT_KEEP_GROUPS,
                        help="groups kept; beyond it the oldest batch files are deleted")
    parser.add_argument("--verbose", action="store_true", help="log every request on stderr")
    args = parser.parse_args(argv)
    try:
        server, url = start_server(args.dir, args.host, args.port, args.token, args.keep_groups, args.verbose)
    except ValueError as e:
        print(f"swarm.py: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"swarm server: {url}", flush=True)  # a launcher reads this line
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it like Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
