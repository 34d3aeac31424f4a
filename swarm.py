"""
The swarm: one small HTTP server that stores the rollouts peers publish, and the client a peer uses
to publish its own rollouts and receive everyone else's.

SAPO ("Sharing is Caring", arXiv 2509.08721, Sec. 3 and Algorithm 1) trains a swarm of peers, each
with its own small language model. Every round a peer generates G completions for each of its I local
questions, shares those decoded rollouts (text: question, answer, completions; never rewards or
weights; beyond the paper, optionally the sampled token ids and log-probs) with the swarm, and trains on
its I local groups plus J groups drawn from what the other peers shared. Peers never wait for each other.

How this file does it, in reading order:
- Whatever arrives from outside (a request, a file read back, a server's reply) is checked against one
  table of fields and limits by one function, `check`. Every other bound is a figure in `Limits`.
- RolloutStore, the core: POST /rollouts appends a batch file and numbers its groups 1, 2, 3, ...
  (`seq`); GET /rollouts?after=SEQ reads the groups after a sequence number.
- SwarmServer, the HTTP around it (`python swarm.py --dir swarm_data --port 8000`, standard library
  only), built so that slow or hostile clients cannot take it down.
- SwarmClient, what a peer uses: its calls only touch in-memory queues and a thread does the HTTP, so
  training never waits for the network. With the server down a peer trains in silo (the paper's
  baseline) and catches up when it returns.
- A dashboard: peers POST /metrics once a round; GET / draws every peer's local reward per round.

Deviations from the paper, and why:
- The paper's swarm ran on Gensyn's RL Swarm, where peers exchange rollouts over a peer-to-peer DHT.
  Here one HTTP server holds them: one file on the standard library instead of a networking stack, and
  enough for the paper's experiments (a handful of peers on one machine or one LAN). The price is a
  single point of failure, softened by the outbox and by peers training on regardless.
- Delivery is by polling (every Limits.poll_seconds), so an external rollout reaches other peers a
  round late at worst. SAPO tolerates this by design: peers never wait and use whatever has arrived.
- A peer receives every group published since its last poll; dropping zero-advantage groups and
  sampling J of the rest is the receiving peer's job (train.py), as in the paper. A peer that joins
  with no saved cursor starts from the newest Limits.recent_groups groups, not the whole history.
- Storage is bounded in bytes (--keep-bytes): the oldest batches are deleted; the paper does not say.
- The server does not judge content: an optional shared bearer token guards it, and beyond that it
  only checks shapes and sizes. Receivers do the judging: they reward external completions with their
  own verifier and drop groups whose answer does not follow from their question (reward.verify_item,
  in train.py), so nobody can inject fake rewards or fake ground truth.
"""

import argparse
import asyncio
import bisect
import collections
import errno
import hmac
import html
import json
import math
import os
import re
import signal
import socket
import ssl
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

try:
    import fcntl     # POSIX: the server locks its folder so two servers never share one
    import resource  # POSIX: the descriptor limit sets how many connections the server may hold
except ImportError:
    fcntl = resource = None


class Limits:
    """Every bound in one place (sizes in bytes): what keeps a sender from making the server hold more,
    and a server from making a client hold more."""
    body_bytes = 8 << 20        # one request body (413 beyond it)
    completion_tokens = 8192    # token ids (and log-probs) of one completion in a group
    page_bytes = 1 << 20        # one reply page of /rollouts or /metrics (a page holds at least one item)
    page_groups = 1024          # groups in one /rollouts page (?limit=, default 256)
    scan_groups = 16 * 1024     # groups one read may step over (the reader's own, which it excludes)
    keep_bytes = 256 << 20      # default --keep-bytes: batches kept, on disk and (the same bytes) in memory
    metrics_bytes = 8 << 20     # metrics rows kept, in memory and in metrics.jsonl
    replies = 20_000            # idempotency records (one per batch), kept after their batch is deleted
    peers = 1024                # peers in the table; the one seen least recently goes first
    connections = 1000          # open connections (fewer under a low descriptor limit); at the cap, the
                                # connection waiting longest for a request is closed for a new one
    in_flight_bytes = 64 << 20  # request bodies and replies held at once, all connections together
    request_seconds = 10.0      # whole-request deadline: the server's to read one, the client's per call
    line_bytes = 8192           # the request line (414 beyond it) and each header line (431)
    header_lines = 64           # header lines in one request (431 beyond it)
    workers = 4                 # threads answering complete GETs, and as many for POSTs (which wait
                                # for each other's fsync: reads must not wait behind them)
    backlog = 128               # connections the kernel queues before the server accepts them
    outbox_bytes = 64 << 20     # client: unsent batches and metrics; the oldest go first beyond it
    inbox_bytes = 64 << 20      # client: received groups not yet fetched; the oldest go first beyond it
    reply_bytes = 32 << 20      # client: the largest reply it reads
    poll_seconds = 1.0          # client: how often it asks for new groups
    recent_groups = 64          # client: a new peer starts with the newest this many groups (two rounds
                                # of an 8-peer swarm at I = 4), not with the whole history


# -----------------------------------------------------------------------------
# What may arrive from outside (requests, files read back, a server's replies): one table, one check.

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # peer names: safe in URLs, logs and HTML
BATCH_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
SEQ, ROUND, TIME = ("int", 10**15), ("int", 10**12), ("float", 1e11)
GROUP = {  # field -> (kind, limit): a rollout group on the wire (DESIGN.md)
    "task": ("label", 256), "question": ("text", 16_000), "answer": ("text", 4_000),
    "metadata": ("object", 16_000), "completions": ("texts", (64, 32_000)),
    "stopped": ("flags", "completions"), "model": ("text", 256),  # the last three: optional, all or none
    "token_ids": ("ids", "completions"), "logprobs": ("logprobs", "token_ids"), "tokenizer": ("label", 64)}
OPTIONAL = {"metadata": {}, "model": "", "token_ids": None, "logprobs": None, "tokenizer": None}  # None: left out
STORED = {**GROUP, "peer": ("name", NAME), "round": ROUND, "seq": SEQ, "time": TIME}  # as served
PUBLISH = {"peer": ("name", NAME), "round": ROUND, "batch_id": ("name", BATCH_ID), "groups": ("list", (256, GROUP))}
BATCH = {**PUBLISH, "time": TIME, "groups": ("list", (256, STORED))}                # a batch file
REPLY = {"peer": ("name", NAME), "batch_id": ("name", BATCH_ID), "accepted": ("int", 256), "seq": SEQ}
PRUNED = {"seq": SEQ, "replies": ("list", (None, REPLY))}                           # pruned.json
METRICS = {"peer": ("name", NAME), "round": ROUND, "metrics": ("numbers", 64)}
ROW = {**METRICS, "n": SEQ, "time": TIME}                                           # a metrics.jsonl line
PAGE = {"groups": ("list", (None, None)), "next": SEQ, "last": SEQ}                 # a GET /rollouts reply
HEALTH = {"last_seq": SEQ}


class BadRequest(Exception):
    """What the other side got wrong, in one sentence, with the HTTP status that says so."""
    def __init__(self, message, status=400, headers=None):
        super().__init__(message)
        self.message, self.status, self.headers = message, status, headers or {}


def _want(ok, message, status=400, headers=None):
    if not ok:
        raise BadRequest(message, status, headers)


def _sane(x):  # a number any chart can draw: finite and not absurd (a 400-digit integer is not); no bools
    return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) <= 1e15


def _too_deep(x, levels):
    children = x.values() if isinstance(x, dict) else x if isinstance(x, list) else ()
    return levels < 0 or any(_too_deep(child, levels - 1) for child in children)


def _dumps(x):  # compact UTF-8 JSON: what is stored, served and sent
    return json.dumps(x, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def check(obj, fields, where=""):
    """Check a JSON object against a table of fields -> a clean copy holding only those fields, or
    BadRequest with one sentence naming the first problem."""
    _want(isinstance(obj, dict), f"{where or 'The body'} must be a JSON object.")
    clean = {}
    for field, (kind, limit) in fields.items():
        path = f"{where}.{field}" if where else field
        if field not in obj:
            _want(field in OPTIONAL, f"{where or 'The body'} is missing the field '{field}'.")
            if OPTIONAL[field] is not None:
                clean[field] = OPTIONAL[field]
            continue
        v = obj[field]
        if kind in ("text", "label"):  # a label (a task name) may not be empty
            ok = isinstance(v, str) and len(v) <= limit and (v or kind == "text")
            rule = f"a {'non-empty ' * (kind == 'label')}string of at most {limit} characters"
        elif kind == "name":
            ok, rule = isinstance(v, str) and limit.fullmatch(v), f"a string matching {limit.pattern}"
        elif kind in ("int", "float"):  # JSON true is no number here; a float may be written as an int
            ok = _sane(v) and (kind == "float" or isinstance(v, int)) and 0 <= v <= limit
            rule = f"a whole number from 0 to {limit}" if kind == "int" else f"a number from 0 to {limit:g}"
        elif kind == "object":
            ok = isinstance(v, dict) and not _too_deep(v, 8) and len(_dumps(v)) <= limit
            rule = f"a JSON object nested at most 8 deep and at most {limit} bytes as JSON"
        elif kind == "texts":
            ok = isinstance(v, list) and 0 < len(v) <= limit[0] and all(
                isinstance(t, str) and len(t) <= limit[1] for t in v)
            rule = f"a list of 1 to {limit[0]} strings of at most {limit[1]} characters each"
        elif kind == "flags":  # one boolean per item of another field
            n = len(clean[limit])
            ok = isinstance(v, list) and len(v) == n and all(isinstance(s, bool) for s in v)
            rule = f"a list of {n} booleans, one per completion"
        elif kind == "ids":  # per completion, the ids of its sampled tokens
            ok = isinstance(v, list) and len(v) == len(clean[limit]) and all(isinstance(c, list) and len(
                c) <= Limits.completion_tokens and all(type(x) is int and 0 <= x < 2**31 for x in c) for c in v)
            rule = f"one list per completion of at most {Limits.completion_tokens} ids from 0 to 2**31 - 1"
        elif kind == "logprobs":  # per token id, its log-prob when it was sampled: finite, at most 0
            ok = limit in clean and isinstance(v, list) and [len(c) if isinstance(c, list) else -1 for c in v] == [
                len(c) for c in clean[limit]] and all(_sane(x) and x <= 0 for c in v for x in c)
            rule = "one list per completion of numbers <= 0, one per token id"
        elif kind == "numbers":
            ok = isinstance(v, dict) and len(v) <= limit and all(
                0 < len(k) <= 64 and (x is None or _sane(x)) for k, x in v.items())
            rule = f"an object of at most {limit} names (1 to 64 characters) to numbers within ±1e15 or null"
            v = {k: None if x is None else float(x) for k, x in v.items()} if ok else v
        elif kind == "list":  # limit: (most items or None, the table each item must pass or None)
            ok, rule = isinstance(v, list) and len(v) <= (limit[0] or len(v)), f"a list of at most {limit[0]} items"
            v = [check(x, limit[1], f"{path}[{i}]") for i, x in enumerate(v)] if ok and limit[1] else v
        _want(ok, f"{path} must be {rule}.")
        clean[field] = v
    _want(len({f in clean for f in ("token_ids", "logprobs", "tokenizer") if f in fields}) < 2,
          f"{where or 'The body'} must have token_ids, logprobs and tokenizer together, or none of them.")
    return clean


def _finite(text):  # JSON may spell numbers that cannot be served back as JSON: NaN, Infinity, 1e999
    if not math.isfinite(x := float(text)):
        raise ValueError(f"{text[:20]} is not a finite number")
    return x


def parse_json(raw):
    """Strict JSON -> a Python value, or BadRequest: no NaN or Infinity, nothing nested too deeply."""
    try:
        return json.loads(raw, parse_float=_finite, parse_constant=_finite)
    except RecursionError:
        raise BadRequest("The JSON is nested too deeply.") from None
    except ValueError as e:  # includes JSONDecodeError, bodies that are not UTF-8, 5000-digit numbers
        raise BadRequest(f"The body is not valid JSON: {str(e)[:120]}.") from None


def _log(message):
    print(f"swarm server: {message}", file=sys.stderr, flush=True)


# -----------------------------------------------------------------------------
# Storage: one file per accepted batch, and an in-memory index of everything kept.

class RolloutStore:
    """The folder of batch files and its in-memory index: the heart of the server.

        publish()  POST /rollouts: number the groups after the newest seq, write them as one batch file
                   named after its last seq (batch-000000000042.json), then index them
        read()     GET /rollouts?after=SEQ: the indexed groups with seq > SEQ, from memory

    The batch file is written atomically and fsynced before publish() returns, so an acknowledgement
    means the batch survives kill -9 and nothing half-written is ever served; and as its name holds its
    last seq, a restart continues the numbering whatever the files hold. Two locks: `write_lock` lets
    one writer at a time touch the folder (one global order; a post costs one fsync), and `lock` guards
    the in-memory state for the moment an update or a read takes, so readers never wait for a disk."""

    def __init__(self, folder, keep_bytes=Limits.keep_bytes):
        self.folder, self.keep_bytes = os.path.abspath(folder), keep_bytes
        self.write_lock, self.lock = threading.Lock(), threading.Lock()
        self.index = []                           # (seq, peer, group as UTF-8 JSON) per kept group, in order
        self.batches = collections.deque()        # (file name, peer, batch_id, groups, bytes), oldest first
        self.kept_bytes = 0                       # bytes of the kept batch files
        self.last_seq = 0                         # seq of the newest group ever stored: never reused
        self.pruned = 0                           # seq of the newest group retention deleted
        self.replies = collections.OrderedDict()  # (peer, batch_id) -> reply; outlives the batch (bounded)
        self.peers = collections.OrderedDict()    # peer -> {"last_seen", "last_round", "groups"}, by recency
        self.metrics, self.metrics_bytes = [], 0  # (n, peer, row as a JSON line, row) per kept metrics row
        self.closed = False
        self.folder_fd = self._lock_folder()
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    def publish(self, peer, round_, batch_id, groups):
        """Store one batch (or recognise a retry of one) -> {"accepted": groups, "seq": its last seq}."""
        with self.write_lock:
            if (peer, batch_id) in self.replies or not groups:  # a retry gets the first reply: stored once
                return self.replies.get((peer, batch_id), {"accepted": 0, "seq": self.last_seq})
            now, first = time.time(), self.last_seq + 1
            record = {"peer": peer, "round": round_, "batch_id": batch_id, "time": now, "groups": [
                {**g, "peer": peer, "round": round_, "seq": first + k, "time": now} for k, g in enumerate(groups)]}
            name, data = f"batch-{first + len(groups) - 1:012d}.json", _dumps(record)
            self._write_atomic(name, data)  # durable now: only from here on may anyone see it
            with self.lock:
                self._add(name, record, len(data))
            self._retain()
            return self.replies[(peer, batch_id)]

    def read(self, after, exclude, limit):
        """Groups with seq > after not from `exclude` -> (their JSON texts, next cursor, last seq)."""
        with self.lock:
            return (*_page(self.index, after, limit, exclude), self.last_seq)

    def _add(self, name, record, size):
        peer, groups = record["peer"], record["groups"]
        self.index.extend((g["seq"], peer, _dumps(g)) for g in groups)
        self.batches.append((name, peer, record["batch_id"], len(groups), size))
        self.kept_bytes += size
        self.last_seq = groups[-1]["seq"]
        self._remember(peer, record["batch_id"], {"accepted": len(groups), "seq": self.last_seq})
        self._seen(peer, record["round"], record["time"], len(groups))

    def _remember(self, peer, batch_id, reply):
        self.replies[(peer, batch_id)] = reply
        while len(self.replies) > Limits.replies:
            self.replies.popitem(last=False)

    def _seen(self, peer, round_, when, published=0):
        p = self.peers.pop(peer, None) or {"last_seen": 0.0, "last_round": 0, "groups": 0}
        p.update(last_seen=max(p["last_seen"], when), last_round=max(p["last_round"], round_),
                 groups=p["groups"] + published)
        self.peers[peer] = p  # (re)inserted last: the peer seen least recently is first to go
        while len(self.peers) > Limits.peers:
            self.peers.popitem(last=False)

    def _retain(self):
        """Past --keep-bytes, delete the oldest batches down to 90% of it (the newest always stays). First
        pruned.json records the newest deleted seq and the deleted batches' idempotency records, so after
        a restart the numbering goes on and a late retry of a deleted batch is still not stored twice."""
        if self.kept_bytes <= self.keep_bytes or len(self.batches) < 2:
            return
        with self.lock:
            doomed = []
            while self.kept_bytes > 0.9 * self.keep_bytes and len(self.batches) > 1:
                name, _, _, n, size = self.batches.popleft()
                del self.index[:n]
                self.kept_bytes -= size
                doomed.append(name)
            self.pruned = int(doomed[-1][6:18])  # batch-<12 digits>.json
            kept = {(p, b) for _, p, b, _, _ in self.batches}
            gone = [{"peer": p, "batch_id": b, **r} for (p, b), r in self.replies.items() if (p, b) not in kept]
        self._write_atomic("pruned.json", _dumps({"seq": self.pruned, "replies": gone}))
        for name in doomed:
            self._remove(name)

    def _load(self):
        """Read the folder back: pruned.json, every batch file in seq order, metrics.jsonl. Whatever a file
        holds, a bad one is logged and skipped, and no seq named by a file is ever used again."""
        pruned = self._read("pruned.json", PRUNED)
        if pruned:
            self.pruned = self.last_seq = pruned[0]["seq"]
            for r in pruned[0]["replies"]:
                self._remember(r["peer"], r["batch_id"], {"accepted": r["accepted"], "seq": r["seq"]})
        for name in sorted(os.listdir(self.folder)):  # 12-digit names: in seq order
            found = re.fullmatch(r"batch-(\d{12})\.json", name)
            last = int(found.group(1)) if found else 0
            if name.startswith(".tmp-") or (found and last <= self.pruned):
                self._remove(name)  # a write that never finished (never acknowledged), or a deleted batch
                continue
            batch = self._read(name, BATCH) if found else None
            seqs = [g["seq"] for g in batch[0]["groups"]] if batch else []
            if seqs and seqs[0] > self.last_seq and seqs == list(range(seqs[0], last + 1)):
                self._add(name, *batch)
            elif batch:
                _log(f"skipping batch file {name}: its groups are not numbered up to the seq in its name")
            self.last_seq = max(self.last_seq, last)  # its name alone uses up the numbers, even if unreadable
        bad, path = 0, os.path.join(self.folder, "metrics.jsonl")
        for line in open(path, "rb") if os.path.exists(path) else ():
            try:
                row = check(parse_json(line), ROW)
                _want(not self.metrics or row["n"] > self.metrics[-1][0], "out of order")
                self._keep_metrics(row)
            except BadRequest:
                bad += 1  # e.g. the last line, cut short by kill -9
        if bad:
            _log(f"skipped {bad} unreadable lines in metrics.jsonl")
        if self.last_seq:
            _log(f"reloaded {len(self.index)} groups in {len(self.batches)} batches from {self.folder}; "
                 f"numbering continues after seq {self.last_seq}")
        self._retain()

    def _read(self, name, fields):
        """A JSON file of the folder checked against a table -> (clean object, bytes), or None if it is
        missing or bad (logged)."""
        try:
            with open(os.path.join(self.folder, name), "rb") as f:
                data = f.read()
            return check(parse_json(data), fields, name), len(data)
        except FileNotFoundError:
            return None
        except (OSError, BadRequest) as e:
            _log(f"skipping unreadable {name} ({getattr(e, 'message', e)!s:.200})")

    # -- metrics: an append-only log, bounded in bytes

    def add_metrics(self, peer, round_, metrics):
        with self.write_lock:
            row = {"n": self.metrics[-1][0] + 1 if self.metrics else 1, "peer": peer, "round": round_,
                   "time": time.time(), "metrics": metrics}
            with open(os.path.join(self.folder, "metrics.jsonl"), "ab") as f:  # best effort: no fsync
                f.write(_dumps(row) + b"\n")
                size = f.tell()
            with self.lock:
                self._keep_metrics(row)
            if size > 2 * Limits.metrics_bytes:  # keep the file bounded too: rewrite it with the rows kept
                self._write_atomic("metrics.jsonl", b"".join(m[2] for m in self.metrics))

    def _keep_metrics(self, row):
        line = _dumps(row) + b"\n"
        self.metrics.append((row["n"], row["peer"], line, row))
        self.metrics_bytes += len(line)
        if self.metrics_bytes > Limits.metrics_bytes:  # drop the oldest tenth at once, not row by row
            drop = 0
            while self.metrics_bytes > 0.9 * Limits.metrics_bytes:
                self.metrics_bytes -= len(self.metrics[drop][2])
                drop += 1
            del self.metrics[:drop]
        self._seen(row["peer"], row["round"], row["time"])

    def read_metrics(self, after):
        with self.lock:
            return (*_page(self.metrics, after, None, None), self.metrics[-1][0] if self.metrics else 0)

    def snapshot(self):
        with self.lock:
            return {"groups": len(self.index), "first_seq": self.index[0][0] if self.index else 0,
                    "last_seq": self.last_seq, "peers": {p: dict(v) for p, v in self.peers.items()},
                    "metrics": [m[3] for m in self.metrics]}

    # -- the folder itself

    def _lock_folder(self):
        """-> an open descriptor of the folder, flock-ed: a second server on it is refused, and no stray
        `rm` of a lock file can change that (there is none)."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd = os.open(self.folder, os.O_RDONLY)
            open(os.path.join(self.folder, ".tmp-probe"), "wb").close()  # can we write here?
        except OSError as e:
            raise ValueError(f"cannot use --dir {self.folder} ({e.strerror or e}); "
                             "give a folder the server can create and write.") from None
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ValueError(f"another swarm server is already using --dir {self.folder}; "
                             "stop it or choose another folder.") from None
        return fd

    def _write_atomic(self, name, data):
        """Write bytes to folder/name so that anyone (a reader, a restart after kill -9) sees all or nothing:
        a temporary file, fsynced, renamed over the name, and the rename fsynced too."""
        tmp = os.path.join(self.folder, ".tmp-" + name)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.folder, name))
            os.fsync(self.folder_fd)
        except OSError:
            self._remove(".tmp-" + name)
            raise

    def _remove(self, name):
        try:
            os.remove(os.path.join(self.folder, name))
        except FileNotFoundError:
            pass
        except OSError as e:  # pruned.json says it is deleted: the next start tries again
            _log(f"could not delete {name} ({e.strerror})")

    def close(self):
        with self.write_lock:
            if not self.closed:
                self.closed = True
                os.close(self.folder_fd)  # releases the folder lock


def _page(entries, after, limit, exclude):
    """entries: (number, peer, UTF-8 JSON, ...) in number order -> (the JSON texts after `after` that are
    not `exclude`'s, the number to continue after): at most `limit` (None: any) and Limits.page_bytes,
    unless one text alone is larger. The next number passes over the excluded entries too, so a reader
    who skips its own groups does not read them again and again."""
    start = bisect.bisect_right(entries, after, key=lambda entry: entry[0])
    texts, size, next_number = [], 0, after
    for number, peer, text, *_ in entries[start:start + Limits.scan_groups]:
        if len(texts) == limit or (texts and size + len(text) > Limits.page_bytes):
            break
        next_number = number
        if peer != exclude:
            texts.append(text)
            size += len(text) + 1
    return texts, next_number


# -----------------------------------------------------------------------------
# HTTP server: an asyncio loop reads requests; worker threads answer them; errors are one JSON sentence.

ROUTES = {"/": {"GET": "page"}, "/health": {"GET": "health"}, "/peers": {"GET": "peers"},
          "/rollouts": {"GET": "get_rollouts", "POST": "post_rollouts"},
          "/metrics": {"GET": "get_metrics", "POST": "post_metrics"}}
JSON = "application/json"
Request = collections.namedtuple("Request", "method target headers body close")


def _error(message):
    return _dumps({"error": message})


async def _readline(reader, status, what):
    """One line of a request's head; one longer than Limits.line_bytes is answered with `status`."""
    try:
        return (await reader.readuntil(b"\n")).decode("latin-1")
    except asyncio.LimitOverrunError:
        raise BadRequest(f"{what} is longer than {Limits.line_bytes} bytes.", status) from None


def _int_param(query, name, default, lowest, highest):
    values = query.get(name)
    if not values:
        return default
    _want(re.fullmatch(r"[0-9]{1,15}", values[-1]) and lowest <= int(values[-1]) <= highest,
          f"{name} must be a whole number from {lowest} to {highest}.")
    return int(values[-1])


class SwarmServer:
    """The HTTP side of the store. One asyncio loop (in a thread) reads each request whole under a
    deadline, so a slow or idle connection costs a buffer, not a thread; two small pools of threads
    answer complete requests, one for reads and one for writes. A request's way through:

        _accept -> _connection (waits for a request) -> _exchange: _read_request (under the deadline),
        _answer in a worker thread (route, token, then one short method per route), _send the reply

    shutdown() stops serving, closes the connections, then the store."""

    def __init__(self, store, host, port, token=None, public_reads=False, verbose=False):
        self.store, self.token, self.public_reads, self.verbose = store, token, public_reads, verbose
        self.listener = socket.create_server((host, port), backlog=Limits.backlog,
                                             family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.listener.setblocking(False)
        self.server_address = self.listener.getsockname()
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if resource else -1  # -1: no limit
        # every connection holds a descriptor: leave 64 of them for the batch files
        self.max_connections = max(4, min(Limits.connections, soft - 64)) if soft > 0 else Limits.connections
        self.open, self.waiting = set(), {}  # all connections; those waiting for a request (a dict keeps
                                             # insertion order: the first has waited longest)
        self.in_flight = 0                   # bytes of request bodies and replies held right now
        self.pools = {method: ThreadPoolExecutor(Limits.workers, thread_name_prefix=f"swarm-{method}")
                      for method in ("GET", "POST")}
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(lambda loop, context: _log(
            f"{context['message']} {context.get('exception')!r:.200}"))
        self.accepting = self.loop.create_task(self._accept())
        self.thread = threading.Thread(target=self.loop.run_forever, name="swarm-server", daemon=True)
        self.thread.start()

    async def _accept(self):
        """Accept one connection at a time, so the cap holds before the next: at the cap, the connection
        that has waited longest for a request is closed. Out of descriptors: pause, never spin."""
        while True:
            try:
                sock, _ = await self.loop.sock_accept(self.listener)
            except OSError as e:
                _log(f"cannot accept connections for now ({e.strerror}); trying again in 1 s")
                await asyncio.sleep(1)
                continue
            if len(self.open) >= self.max_connections:
                if not self.waiting:  # every connection is being answered: this one must go
                    sock.close()
                    continue
                next(iter(self.waiting)).transport.abort()
                await asyncio.sleep(0)  # let it close, giving its descriptor back
            try:
                reader, writer = await asyncio.open_connection(sock=sock, limit=Limits.line_bytes)
            except OSError:
                sock.close()
                continue
            self.open.add(writer)
            self.loop.create_task(self._connection(reader, writer))

    async def _connection(self, reader, writer):
        """One connection: wait for a request, then exchange it for a reply; repeat while it stays open."""
        writer.transport.set_write_buffer_limits(0)  # so that drain() returns once the reply has left
        try:
            while True:
                self.waiting[writer] = None
                first = await asyncio.wait_for(reader.read(1), Limits.request_seconds)  # idle: just close
                del self.waiting[writer]
                if first in (b"", b"\x16") or not await self._exchange(first, reader, writer):
                    return  # gone, closing, or a TLS handshake (this server speaks plain HTTP)
        except BadRequest as e:  # the rest of the request is unread: answer, then close
            try:
                await self._send(writer, e.status, JSON, _error(e.message), e.headers, close=True)
            except (OSError, asyncio.TimeoutError):
                pass
        except (OSError, EOFError, asyncio.TimeoutError):
            pass  # a client that hangs up, idles or stops reading its reply is not news
        finally:
            self.open.discard(writer)
            self.waiting.pop(writer, None)
            writer.transport.abort()

    async def _exchange(self, first, reader, writer):
        """Read one request whole under the deadline, answer it in a worker thread, send the reply -> keep
        the connection open? A coroutine of its own, so that no body or reply outlives the exchange while
        the connection waits for the next request; the body counts in self.in_flight until then."""
        body = bytearray()
        try:
            try:
                request = await asyncio.wait_for(self._read_request(first, reader, writer, body),
                                                 Limits.request_seconds)
            except asyncio.TimeoutError:
                raise BadRequest(f"The request did not arrive whole within {Limits.request_seconds:g} s.",
                                 408) from None
            reply = await self.loop.run_in_executor(self.pools.get(request.method, self.pools["GET"]),
                                                    self._answer, request)
            await self._send(writer, *reply, close=request.close, head_only=request.method == "HEAD")
        finally:
            self.in_flight -= len(body)
        if self.verbose:
            _log(f"{writer.get_extra_info('peername')} {request.method} {request.target[:200]} {reply[0]}")
        return not request.close

    async def _read_request(self, first, reader, writer, body):
        """The rest of the request line, the headers, and the body (into `body`) -> Request. The body
        counts towards Limits.in_flight_bytes as its bytes arrive, so a sender who only declares a length
        costs nothing."""
        parts = (first.decode("latin-1") + await _readline(reader, 414, "The request line")).split()
        _want(len(parts) == 3 and parts[2] in ("HTTP/1.0", "HTTP/1.1"),
              "This server speaks plain HTTP/1.1 and did not understand the request line.")
        method, target, version = parts
        headers, lines = {}, 0
        while (line := await _readline(reader, 431, "A header line")).strip():
            lines += 1
            _want(lines <= Limits.header_lines, f"The request has more than {Limits.header_lines} header lines.", 431)
            name, colon, value = line.partition(":")
            _want(colon and name.strip(), "Each header line must be 'Name: value'.")
            headers[name.strip().lower()] = value.strip()
        length = headers.get("content-length", "0")
        _want("transfer-encoding" not in headers and (method != "POST" or "content-length" in headers),
              "A POST needs a Content-Length header (no chunked bodies).", 411)
        _want(re.fullmatch(r"[0-9]{1,12}", length), "Content-Length must be a whole number.")
        _want(int(length) <= Limits.body_bytes, f"The body is {length} bytes; the limit is {Limits.body_bytes}.", 413)
        if int(length) and headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while len(body) < int(length):
            chunk = await reader.read(min(1 << 16, int(length) - len(body)))
            if not chunk:
                raise EOFError("the client hung up")
            if self.in_flight + len(chunk) > Limits.in_flight_bytes:
                raise BadRequest("The server is busy; send it again in a moment.", 503, {"Retry-After": "1"})
            self.in_flight += len(chunk)  # given back by _exchange once the reply has gone
            body += chunk
        close = version == "HTTP/1.0" or headers.get("connection", "").lower() == "close"
        return Request(method, target, headers, body, close)

    async def _send(self, writer, status, content_type, body, headers=None, close=False, head_only=False):
        if len(body) > 65536 and self.in_flight + len(body) > Limits.in_flight_bytes:  # bound what waits
            status, content_type, body = 503, JSON, _error("The server is busy; ask again in a moment.")
            headers = {"Retry-After": "1"}
        head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n" \
               f"Content-Length: {len(body)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        data = (head + "Connection: close\r\n" * close + "\r\n").encode() + (b"" if head_only else body)
        self.in_flight += len(data)
        try:
            writer.write(data)
            await asyncio.wait_for(writer.drain(), Limits.request_seconds)  # a reader too slow is cut off
        finally:
            self.in_flight -= len(data)

    def _answer(self, request):
        """A complete request -> (status, content type, body, headers). Runs in a worker thread."""
        try:
            path, _, query = request.target.partition("?")
            _want(path.startswith("/"), "The request target must be a path such as /rollouts.")
            methods = ROUTES.get(path)
            _want(methods is not None, f"There is no {path[:80]} here; the paths are {', '.join(ROUTES)}.", 404)
            allowed = ", ".join(methods)
            _want(request.method in methods, f"{path} accepts only {allowed}, not {request.method[:20]}.", 405,
                  {"Allow": allowed})
            if self.token and (request.method != "GET" or not self.public_reads):  # public reads: GETs need none
                scheme, _, given = request.headers.get("authorization", "").partition(" ")
                _want(scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("latin-1"),
                                                                         self.token.encode()),  # constant time
                      "This server needs the header 'Authorization: Bearer <token>'; pass the swarm token.", 401,
                      {"WWW-Authenticate": "Bearer"})
            _want(query.count("&") < 16, "The query string has too many fields.")
            q = parse_qs(query, keep_blank_values=True)
            return (*getattr(self, "_" + methods[request.method])(q, request.body), {})
        except BadRequest as e:
            return e.status, JSON, _error(e.message), e.headers
        except Exception as e:
            if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):  # the sender keeps its data: later
                return 507, JSON, _error("The server's disk is full, so nothing was stored; send it again later."), {}
            _log(f"unexpected error in {request.method[:20]} {request.target[:200]}: {e!r:.300}")
            return 500, JSON, _error("The server hit an unexpected error; it was logged and the server "
                                     "keeps serving."), {}

    # --- one method per route: (query, body) -> (status, content type, body bytes)

    def _post_rollouts(self, q, body):
        b = check(parse_json(body), PUBLISH)
        return 200, JSON, _dumps(self.store.publish(b["peer"], b["round"], b["batch_id"], b["groups"]))

    def _get_rollouts(self, q, body):
        after = _int_param(q, "after", 0, 0, 10**15)
        limit = _int_param(q, "limit", 256, 1, Limits.page_groups)
        exclude = q.get("exclude", [""])[-1]
        _want(not exclude or NAME.fullmatch(exclude), f"exclude must be a peer name matching {NAME.pattern}.")
        texts, next_seq, last_seq = self.store.read(after, exclude, limit)
        # groups are kept as JSON text, so a page is joined, not re-encoded
        return 200, JSON, b'{"groups":[' + b",".join(texts) + b'],"next":%d,"last":%d}' % (next_seq, last_seq)

    def _post_metrics(self, q, body):
        b = check(parse_json(body), METRICS)
        self.store.add_metrics(b["peer"], b["round"], b["metrics"])
        return 200, JSON, b'{"ok":true}'

    def _get_metrics(self, q, body):
        texts, next_n, last_n = self.store.read_metrics(_int_param(q, "after", 0, 0, 10**15))
        return 200, JSON, b'{"metrics":[' + b",".join(texts) + b'],"next":%d,"last":%d}' % (next_n, last_n)

    def _health(self, q, body):
        snap = self.store.snapshot()
        return 200, JSON, _dumps({"ok": True, "groups": snap["groups"], "peers": len(snap["peers"]),
                                  "last_seq": snap["last_seq"]})

    def _peers(self, q, body):
        return 200, JSON, _dumps({"peers": self.store.snapshot()["peers"]})

    def _page(self, q, body):
        return 200, "text/html; charset=utf-8", render_page(self.store.snapshot()).encode()

    def shutdown(self):
        """Stop serving: close the listener and every connection, let running answers finish, close the store."""
        if self.loop.is_closed():
            return

        async def stop():
            self.accepting.cancel()
            self.listener.close()
            for writer in list(self.open):
                writer.transport.abort()
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            if tasks:  # each ends on its own once its connection is gone (or its answer is done)
                await asyncio.wait(tasks, timeout=Limits.request_seconds)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        for pool in self.pools.values():
            pool.shutdown(wait=True)
        self.loop.close()
        self.store.close()


def check_token(token):
    """None, or a token of 1 to 256 visible ASCII characters (it travels in an HTTP header)."""
    if token and not re.fullmatch(r"[!-~]{1,256}", token):
        raise ValueError("the swarm token must be 1 to 256 printable ASCII characters without spaces.")
    return token or None


def start_server(dir, host="127.0.0.1", port=0, token=None, keep_bytes=Limits.keep_bytes,
                 public_reads=False, verbose=False):
    """Start a server in a daemon thread -> (server, "http://host:port"). Stop it with server.shutdown().
    With a token every request needs it, except GETs when public_reads is true. Raises ValueError with
    one sentence when the folder, port or settings cannot be used."""
    token = check_token(token)
    if not isinstance(keep_bytes, int) or keep_bytes < 1:
        raise ValueError("--keep-bytes must be a size of at least 1 byte.")
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError("--port must be a whole number from 0 to 65535.")
    store = RolloutStore(dir, keep_bytes)
    try:
        server = SwarmServer(store, host, port, token, public_reads, verbose)
    except OSError as e:
        store.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}); "
                         "choose another --host or --port.") from None
    return server, f"http://{f'[{host}]' if ':' in host else host}:{server.server_address[1]}"


# -----------------------------------------------------------------------------
# Client: what a peer's training loop uses. It never raises and never waits for the network.

class SwarmClient:
    """One peer's view of the swarm. The training loop's calls only touch two queues; a daemon thread
    does all the HTTP, one exchange at a time, each under a deadline of Limits.request_seconds:

        publish(round, groups) -> outbox --(POST, oldest first, until acknowledged)--> server
        fetch() <- inbox <--(GET /rollouts?after=position, every Limits.poll_seconds)-- server

    Each batch carries a batch_id, so however often a send is retried the server stores it once. Both
    queues are bounded in bytes: beyond the bound the oldest entry goes, since SAPO wants fresh rollouts.
    `cursor` is the seq of the last group fetch() handed out: a checkpoint saves it, and passing it back
    as cursor= resumes there. cursor=None is a new peer: it starts with the server's newest
    Limits.recent_groups groups, not the whole history. The token defaults to $SWARM_TOKEN, so it need
    not appear on a command line. The client checks every group it receives with the same table that
    the server applies to what it is sent."""

    def __init__(self, url, peer, token=None, cursor=None):
        u = urlsplit(str(url))
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"the swarm URL must look like http://HOST:PORT, not {str(url)[:80]!r}.")
        if not isinstance(peer, str) or not NAME.fullmatch(peer):
            raise ValueError("peer must be 1 to 64 characters from A-Z, a-z, 0-9, '_', '.' and '-'.")
        token = check_token(token if token is not None else os.environ.get("SWARM_TOKEN"))
        self.peer, self.address = peer, (u.hostname, u.port or (443 if u.scheme == "https" else 80))
        self.head = f"Host: {u.netloc}\r\nContent-Type: {JSON}\r\n" + f"Authorization: Bearer {token}\r\n" * bool(token)
        self.base, self.tls = u.path.rstrip("/"), ssl.create_default_context() if u.scheme == "https" else None
        self.cond = threading.Condition()  # guards all that follows; notified when the thread gets somewhere
        self.outbox, self.outbox_bytes = collections.deque(), 0  # (path, body, what), oldest first
        self.inbox, self.inbox_bytes = collections.deque(), 0    # (group, bytes), oldest first
        self.polls = self.level = 0  # polls begun / the last one that ended level with the server
        self.down, self.dropped, self.wake, self.closing, self.sock = None, 0, False, False, None
        self.cursor = self.position = cursor  # the seq fetch() has handed out / the thread has read up to
        self.thread = threading.Thread(target=self._run, name=f"swarm-client-{peer}", daemon=True)
        self.thread.start()

    # --- the training loop's side: queues only

    def publish(self, round, groups):
        """Queue this round's groups for the swarm; returns at once."""
        if groups:
            self._queue("/rollouts", f"round {round}'s batch", lambda: {
                "peer": self.peer, "round": int(round), "groups": list(groups),
                "batch_id": f"{self.peer}-{int(round)}-{os.urandom(6).hex()}"})

    def post_metrics(self, round, metrics):
        """Queue per-round numbers for the dashboard (best effort); values that are not sane numbers go
        as null."""
        self._queue("/metrics", f"round {round}'s metrics", lambda: {"peer": self.peer, "round": int(round),
                    "metrics": {str(k)[:64]: float(v) if _sane(v) else None for k, v in list(metrics.items())[:64]}})

    def fetch(self):
        """The checked groups of other peers received since the previous call, oldest first."""
        with self.cond:
            groups = [g for g, _ in self.inbox]
            self.inbox.clear()
            self.inbox_bytes = 0
            self.cursor = self.position
            return groups

    def flush(self, timeout=10.0):
        """Wait until the outbox is empty and a poll begun after this call has caught up with the server
        -> True, or False if that took longer than timeout seconds."""
        with self.cond:
            polls, self.wake = self.polls, True
            self.cond.notify_all()
            return self.cond.wait_for(lambda: not self.outbox and self.level > polls, timeout)

    def close(self):
        """Stop the thread: it ends its current exchange at once and sends nothing more."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        try:
            if (sock := self.sock) is not None:  # (read once: the thread may clear it meanwhile)
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # the exchange had just ended
            pass
        self.thread.join(5)

    def _queue(self, path, what, make_body):
        """Put make_body() as JSON at the end of the outbox; what cannot be JSON is logged, never raised."""
        try:
            body = _dumps(make_body())
        except (TypeError, ValueError, OverflowError, AttributeError) as e:
            return self._log(f"{what} cannot be sent ({e})")
        with self.cond:
            self.outbox.append((path, body, what))
            self.outbox_bytes += len(body)
            while self.outbox_bytes > Limits.outbox_bytes and len(self.outbox) > 1:
                self.outbox_bytes -= len(self.outbox.popleft()[1])
                self.dropped += 1
            self.wake = True
            self.cond.notify_all()

    def _log(self, message):
        print(f"swarm client {self.peer}: {message}", file=sys.stderr, flush=True)

    # --- the thread's side: all the network. Any OSError means "no usable answer now: try again later".

    def _run(self):
        backoff = 0.0
        while not self.closing:
            with self.cond:
                entry = self.outbox[0] if self.outbox else None
            try:
                if entry is not None:
                    self._send(entry)
                elif self._poll():  # level with the server: wait for the next poll or a publish
                    self._sleep(Limits.poll_seconds)
                if self.down:
                    lost = f"; {self.dropped} older entries did not fit the outbox" if self.dropped else ""
                    self._log(f"server reachable again, sending what waited{lost}")
                    self.down, self.dropped = None, 0
                backoff = 0.0
            except OSError as e:
                if not self.down and not self.closing:
                    self._log(f"server unreachable ({str(e) or type(e).__name__}); training goes on, and what is "
                              f"unsent waits in the outbox (up to {Limits.outbox_bytes >> 20} MB) until it is back")
                self.down, backoff = str(e) or type(e).__name__, min(5.0, max(0.25, 2 * backoff))
                self._sleep(backoff)
            except Exception as e:  # a bug must not end the thread: log it, pause, go on
                self._log(f"unexpected error {e!r:.200}")
                self._sleep(1.0)

    def _sleep(self, seconds):
        with self.cond:
            self.cond.wait_for(lambda: self.wake or self.closing, seconds)
            self.wake = False

    def _send(self, entry):
        """POST the oldest outbox entry; it leaves the outbox once the server has it or refused it."""
        status, data = self._request("POST", entry[0], entry[1])
        if status != 200:  # a 4xx: the request itself is wrong, and sending the same bytes will not help
            self._log(f"the server refused {entry[2]}, so it is dropped: HTTP {status}: {_said(data)}")
        with self.cond:
            if self.outbox and self.outbox[0] is entry:  # (a full outbox may have dropped it meanwhile)
                self.outbox.popleft()
                self.outbox_bytes -= len(entry[1])
                self.cond.notify_all()

    def _poll(self):
        """Read one page after our position into the inbox -> True once level with the server."""
        with self.cond:
            self.polls += 1
            poll, position = self.polls, self.position
        if position is None:  # a new peer: start from the newest groups, not from the whole history
            position = max(0, self._get("/health", HEALTH)["last_seq"] - Limits.recent_groups)
        page = self._get(f"/rollouts?after={position}&exclude={self.peer}", PAGE)
        groups, bad, seq = [], [], position
        for g in page["groups"]:  # a server may be buggy or hostile: each group is checked on arrival
            try:
                g = check(g, STORED, "a received group")
                _want(seq < g["seq"] <= page["next"], "its seq is out of order")
                seq = g["seq"]
                groups += [(g, len(_dumps(g)))] if g["peer"] != self.peer else []
            except BadRequest as e:
                bad.append(e.message)
        if bad:
            self._log(f"dropped {len(bad)} malformed groups from the server (the first: {bad[0][:200]})")
        with self.cond:
            if page["last"] < position:  # the server lost groups we saw (a new folder?): start afresh
                self._log(f"the server's newest seq {page['last']} is below ours ({position}); starting afresh")
                self.position = None
                return False
            self.inbox.extend(groups)
            self.inbox_bytes += sum(size for _, size in groups)
            while self.inbox_bytes > Limits.inbox_bytes:
                self.inbox_bytes -= self.inbox.popleft()[1]
            self.position = max(position, page["next"])
            if page["next"] >= page["last"] or page["next"] <= position:  # nothing more to read for now
                self.level = poll
                self.cond.notify_all()
            return self.level == poll

    def _get(self, path, fields):
        status, data = self._request("GET", path)
        try:
            _want(status == 200, f"HTTP {status}: {_said(data)}")
            return check(data, fields)
        except BadRequest as e:
            raise ConnectionError(f"an unusable reply: {e.message:.200}") from None

    def _request(self, method, path, body=b""):
        """The one way this client talks: an HTTP/1.0 exchange on a fresh connection, with a deadline on
        all of it (connect, send, every byte of the reply) -> (status, the reply's JSON). Only a 200 with
        a JSON object or a 4xx that is the request's own fault comes back; all else is an OSError."""
        deadline, reply = time.monotonic() + Limits.request_seconds, bytearray()
        head = f"{method} {self.base}{path} HTTP/1.0\r\n{self.head}Content-Length: {len(body)}\r\n\r\n"
        with socket.create_connection(self.address, timeout=Limits.request_seconds) as raw:
            sock = self.tls.wrap_socket(raw, server_hostname=self.address[0]) if self.tls else raw
            self.sock = sock  # so that close() can end this exchange at once
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.sendall(head.encode() + body)
                while len(reply) <= Limits.reply_bytes:
                    if (left := deadline - time.monotonic()) <= 0:  # a trickle of bytes cannot outlast it
                        raise TimeoutError("no whole reply in time")
                    sock.settimeout(left)
                    if not (chunk := sock.recv(1 << 16)):
                        break
                    reply += chunk
            finally:
                self.sock = None
        head, _, payload = bytes(reply).partition(b"\r\n\r\n")
        status = re.match(rb"HTTP/1\.[01] (\d{3})\b", head)
        length = re.search(rb"\r\ncontent-length: *(\d+)", head, re.IGNORECASE)
        if not status or (length and int(length.group(1)) != len(payload)):
            raise ConnectionError("a reply that is not HTTP, or cut short")
        status = int(status.group(1))
        try:
            data = parse_json(payload)
        except BadRequest:
            data = None
        if (status != 200 and not 400 <= status < 500) or status in (408, 429):  # the server's trouble: later
            raise ConnectionError(f"HTTP {status}")
        if status == 200 and not isinstance(data, dict):
            raise ConnectionError("a reply that is not a JSON object")
        return status, data


def _said(data):  # the one sentence of an error reply
    return data.get("error") if isinstance(data, dict) else "(no message)"


# -----------------------------------------------------------------------------
# Dashboard: an SVG line chart, and one self-contained HTML page.

COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def _esc(text):
    return html.escape(str(text), quote=True)  # safe in both HTML and XML


def render_svg(series, title="reward per round", ylabel="reward", xlabel="round", width=760, height=360,
               bands=None, hline=None):
    """{name: [(round, value), ...]} -> a standalone SVG document (a string) with one line per name.
    bands: {name: [(round, low, high), ...]}, shaded in that line's colour; hline: a dashed level."""
    left, top, plot_w, plot_h = 60, 34, width - 230, height - 80  # margins for the axes and the legend
    lines = {name: sorted((x, y) for x, y in pts if _sane(x) and _sane(y)) for name, pts in sorted(series.items())}
    lines = {name: pts for name, pts in lines.items() if pts}
    bands = {name: [b for b in band if all(map(_sane, b))] for name, band in (bands or {}).items() if name in lines}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} '
           f'{height}" font-family="sans-serif" font-size="12"><rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left + plot_w / 2}" y="20" text-anchor="middle" font-size="14">{_esc(title)}</text>']
    if not lines:
        return "\n".join(out + [f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" text-anchor="middle" '
                                'fill="#888">no data yet</text></svg>'])
    xs, ys = [x for pts in lines.values() for x, _ in pts], [y for pts in lines.values() for _, y in pts]
    ys += [y for band in bands.values() for _, low, high in band for y in (low, high)] + [hline] * _sane(hline)
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    pad = (max(ys) - min(ys)) * 0.05 or 0.5
    y0, y1 = min(ys) - pad, max(ys) + pad

    def px(x):  # data to pixels
        return left + (x - x0) / (x1 - x0) * plot_w

    def py(y):
        return top + (y1 - y) / (y1 - y0) * plot_h

    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>')
    for xv in sorted({round(x0 + (x1 - x0) * k / 5) for k in range(6)}):  # rounds along the bottom
        out.append(f'<text x="{px(xv):.1f}" y="{top + plot_h + 18}" text-anchor="middle">{xv}</text>')
    for yv in (y0 + (y1 - y0) * k / 5 for k in range(6)):  # values up the side, with grid lines
        out.append(f'<line x1="{left}" y1="{py(yv):.1f}" x2="{left + plot_w}" y2="{py(yv):.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:.3g}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle">{_esc(xlabel)}</text>'
               f'<text x="16" y="{top + plot_h / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {top + plot_h / 2})">{_esc(ylabel)}</text>')
    if _sane(hline):
        out.append(f'<line x1="{left}" y1="{py(hline):.1f}" x2="{left + plot_w}" y2="{py(hline):.1f}" '
                   'stroke="#888" stroke-dasharray="5,4"/>')
    for k, (name, pts) in enumerate(lines.items()):
        colour, ly = COLOURS[k % len(COLOURS)], top + 10 + 18 * k
        edge = [(x, high) for x, _, high in bands.get(name, [])] + [(x, low) for x, low, _ in bands.get(name, [])[::-1]]
        if edge:
            out.append(f'<polygon fill="{colour}" fill-opacity="0.15" stroke="none" points="'
                       + " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in edge) + '"/>')
        pts = pts[::max(1, len(pts) // 2000)]  # a chart needs no more than ~2000 points a line
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<circle cx="{px(pts[0][0]):.1f}" cy="{py(pts[0][1]):.1f}" r="3" fill="{colour}"/>' if len(pts) == 1
                   else f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>')
        out.append(f'<line x1="{left + plot_w + 12}" y1="{ly}" x2="{left + plot_w + 32}" y2="{ly}" stroke="{colour}" '
                   f'stroke-width="3"/><text x="{left + plot_w + 38}" y="{ly + 4}">{_esc(name[:24])}</text>')
    return "\n".join(out + ["</svg>"])


def render_page(snap):
    """The dashboard: local_reward (the skill) per round of the 10 peers seen most recently, and a table."""
    series, last, drawn = {}, {}, list(snap["peers"])[-len(COLOURS):]
    for row in snap["metrics"]:  # later rows for the same round (after a resume) replace earlier ones
        if row["peer"] in drawn and row["metrics"].get("local_reward") is not None:
            series.setdefault(row["peer"], {})[row["round"]] = row["metrics"]["local_reward"]
        last.setdefault(row["peer"], {}).update(row["metrics"])
    chart = render_svg({p: sorted(s.items()) for p, s in series.items()}, title="local_reward per round")
    rows = []
    for peer, info in sorted(snap["peers"].items()):
        m = last.get(peer, {})
        cells = "".join(f"<td>{'' if m.get(k) is None else f'{m[k]:.3f}'}</td>" for k in ("local_reward", "batch_reward"))
        seen = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info["last_seen"]))
        rows.append(f"<tr><td>{_esc(peer)}</td><td>{info['last_round']}</td><td>{info['groups']}</td>{cells}<td>{seen}</td></tr>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="5"><title>nanoSAPO swarm</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}} td:first-child{{text-align:left}}</style>
</head><body><h1>nanoSAPO swarm</h1>
<p>{snap['groups']} groups kept (seq {snap['first_seq']} to {snap['last_seq']}), {len(snap['peers'])} peers.</p>
{chart}
<table><tr><th>peer</th><th>last round</th><th>groups published</th><th>last local_reward</th>
<th>last batch_reward (the paper's training-batch figure)</th><th>last seen</th></tr>
{"".join(rows)}
</table></body></html>"""


# -----------------------------------------------------------------------------
# Command line: python swarm.py --dir swarm_data --host 127.0.0.1 --port 8000 [--token-file FILE]

def _size(text):
    """'256M' -> 268435456: a byte count with an optional K, M or G."""
    found = re.fullmatch(r"([0-9]{1,15})([KMG]?)B?", text.strip().upper())
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 256M")
    return int(found.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[found.group(2)]


def _fail(message):  # every bad flag or setting: one sentence, exit status 2
    print(f"swarm.py: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    parser = argparse.ArgumentParser(description="nanoSAPO swarm rollout server (see the docstring of swarm.py).")
    parser.error = lambda message: _fail(f"{message}; see python swarm.py --help.")  # not usage + error
    parser.add_argument("--dir", default="swarm_data", help="folder holding the batch files (created if missing)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for a LAN)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one")
    parser.add_argument("--token", default=os.environ.get("SWARM_TOKEN"),
                        help="require 'Authorization: Bearer TOKEN' on every request (default: $SWARM_TOKEN, "
                             "which, unlike this flag, does not show in ps)")
    parser.add_argument("--token-file", help="read the token from this file instead")
    parser.add_argument("--public-reads", action="store_true",
                        help="with a token: let anyone GET (dashboard, rollouts, metrics); writes still need it")
    parser.add_argument("--keep-bytes", type=_size, default=Limits.keep_bytes,
                        help="batch bytes kept on disk and in memory, e.g. 256M (default); the oldest go first")
    parser.add_argument("--verbose", action="store_true", help="log every request on stderr")
    args = parser.parse_args(argv)
    try:
        if args.token_file:
            with open(args.token_file) as f:
                args.token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"cannot read --token-file {args.token_file} ({e})")
    try:
        server, url = start_server(args.dir, args.host, args.port, args.token, args.keep_bytes,
                                   args.public_reads, args.verbose)
    except (ValueError, OSError) as e:  # e.g. a folder or port it cannot use, a full disk at start
        _fail(e)
    print(f"swarm server: {url}", flush=True)  # a launcher reads this line
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it like Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
