"""
The swarm: the store that holds the rollouts peers share, and the client a peer shares them through.

SAPO ("Sharing is Caring", arXiv 2509.08721, Sec. 3 and Algorithm 1) trains a swarm of peers, each with its
own small language model. Every round a peer generates G completions for each of its I local questions,
shares those decoded rollouts (text; never rewards or weights) and trains on its I local groups plus J groups
drawn from what the others shared. No peer waits for another. Above the marker line, in memory: Store, the
rules of the shared pool, and Client, a peer's side, whose queues and threads keep training from waiting for
the network. Below it: RolloutStore (the Store on disk), RedisStore (in Redis, which several servers share),
the HTTP server (`python swarm.py --dir DIR` or `--redis URL`), connect(url), the dashboard, the command line.

Deviations from the paper, and why:
- The paper's peers exchange rollouts over a peer-to-peer network (Gensyn's RL Swarm); here one server holds
  them (or several over one Redis, which only the servers reach), a single point of failure: with the store
  down a peer trains alone (the paper's baseline) and catches up later.
- A peer does not receive everything shared: once a round it reads K = 4J groups drawn from the writers'
  newest batches, each writer alike, so a read costs the same in a swarm of 10 or 10,000; the receiver
  (train.py) drops zero-advantage groups and draws J of the rest, as in the paper. Reads are prefetched, so
  a rollout may reach the others a round late.
- Storage is bounded (--keep-bytes), which the paper leaves open; a group may carry its token ids and
  log-probs. A token guards the server, which checks only shapes and sizes: receivers score shared
  completions with their own verifier and drop groups whose answer does not follow from their question
  (reward.verify_item), so that no peer can inject a fake reward.
"""

import argparse
import asyncio
import bisect
import collections
import contextlib
import errno
import hashlib
import html
import json
import math
import os
import random
import re
import signal
import socket
import stat
import struct
import sys
import threading
import time
import types
import weakref
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from urllib.parse import parse_qs, unquote, urlsplit

import requests


def _dumps(x):  # compact UTF-8 JSON: what is stored, served and sent
    return json.dumps(x, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _now():  # the clock, kept within what a stored time may hold (0 to 1e11), so no clock spoils a file
    return min(max(time.time(), 0.0), 1e11)


# -----------------------------------------------------------------------------
# The store's rules: groups numbered in arrival order, read after a cursor, or drawn as a sample.

Batch = collections.namedtuple("Batch", "seq batch_id time texts cost")  # a kept batch (see Store.batches)


class Store:
    """The shared pool in memory, and its rules. RolloutStore, below the marker, keeps it on disk through
    the two persistence hooks at the end. A writer is a peer name (with per-peer credentials, its owner's).

        publish()  POST /rollouts: number the groups after the newest seq and keep them as one batch
        read()     GET /rollouts?after=SEQ: the kept groups with seq > SEQ (the dashboard, the load test)
        sample()   GET /rollouts?sample=K: K groups drawn from the recent window, every writer alike"""

    def __init__(self, budget=256 << 20, window_batches=2, window_seconds=600, page_bytes=1 << 20,
                 keep_replies=20_000, keep_peers=1024, scan_groups=16 << 10):
        self.budget = budget  # what the kept batches may cost before retention prunes
        self.window_batches = window_batches  # how many of each writer's newest batches a sample draws on,
        self.window_seconds = window_seconds  # if its newest batch is at most this many seconds old
        self.page_bytes = page_bytes      # a read's reply stops growing past this size (one group at least)
        self.keep_replies = keep_replies  # replies of pruned batches kept, so a late retry is stored once
        self.keep_peers = keep_peers      # rows of the peers table; the peer seen least recently goes first
        self.scan_groups = scan_groups    # groups one read may step over (the reader's own, which it skips)
        self.write_lock = threading.Lock()  # orders the writers: one batch is stored at a time
        self.lock = threading.Lock()        # guards the state below: readers never wait for a disk
        self.last_seq = 0    # seq of the newest group ever stored: never used again
        self.index = []      # (seq, writer, group as UTF-8 JSON, its batch's last seq) per kept group
        self.batches = {}    # writer -> its kept batches (Batch: last seq, id, arrival, texts, cost)
        self.kept_bytes = 0  # what the kept batches cost, all writers together
        self.replies = {}    # (writer, batch_id) -> the reply, of each kept and each recently pruned batch
        self.gone = collections.deque()  # (writer, batch_id) of the pruned batches whose replies are kept
        self.drawable = []   # the writers a sampled read draws from: each one's newest batch is recent
        self.fresh = collections.OrderedDict()  # writer -> its place in drawable, by newest batch's arrival
        self.peers = collections.OrderedDict()  # peer -> {"last_seen", "last_round", "groups"}, by recency

    def publish(self, peer, round_, batch_id, groups):
        """Store one batch, or recognise a retry of one -> {"accepted": its groups, "seq": its last seq}."""
        with self.write_lock:
            if (peer, batch_id) in self.replies or not groups:  # a retry gets the first reply: stored once
                return self.replies.get((peer, batch_id), {"accepted": 0, "seq": self.last_seq})
            now, first = _now(), self.last_seq + 1
            groups = [{**g, "peer": peer, "round": round_, "seq": first + k, "time": now}
                      for k, g in enumerate(groups)]
            record = {"peer": peer, "round": round_, "batch_id": batch_id, "time": now, "groups": groups}
            size = self._save(record)  # durable before anyone may see it
            with self.lock:
                self._add(record, size)
            self._retain()
            return self.replies[(peer, batch_id)]

    def read(self, after, exclude, limit):
        """Groups with seq > after, none of them `exclude`'s -> (their JSON texts, next cursor, last seq)."""
        with self.lock:
            texts, cursor = _page(self.index, after, limit, exclude, self.page_bytes, self.scan_groups)
            return texts, cursor, self.last_seq

    def sample(self, k, exclude, seed):
        """K groups drawn from the window, none of them `exclude`'s -> (their JSON texts, last seq). The
        window (decided here, never by what a sender claims) is each writer's newest window_batches (2)
        batches by arrival, if its newest arrived within window_seconds (600). Each draw picks a writer
        uniformly among those with window groups left, then one of its groups: every writer has the same
        chance whatever its speed or I, and a reply holds at most K groups (it stops past page_bytes, 1 MB).
        The same state and seed give the same draw. A lazy Fisher-Yates shuffle of the writers (one drawn dry
        swaps places with the last of the first n) makes it K draws, whatever the swarm's size."""
        rng, texts, size = random.Random(seed), [], 0
        left = {}   # writer -> its window groups not drawn yet, made when the writer is first drawn
        moved = {}  # the shuffle's swaps: a place -> the place in drawable whose writer now stands there
        with self.lock:
            self._expire(time.time() - self.window_seconds)
            n = len(self.drawable)  # the writers in the first n places still have groups to draw
            while n and len(texts) < k and size < self.page_bytes:
                i = rng.randrange(n)
                writer = self.drawable[moved.get(i, i)]
                if writer not in left:  # its window: the texts of its newest window_batches batches
                    kept = self.batches[writer]
                    left[writer] = [] if writer == exclude else [
                        t for j in range(1, min(len(kept), self.window_batches) + 1) for t in kept[-j].texts]
                if left[writer]:
                    texts.append(left[writer].pop(rng.randrange(len(left[writer]))))
                    size += len(texts[-1])
                if not left[writer]:  # drawn dry: the writer in place n - 1 takes place i
                    n -= 1
                    moved[i] = moved.get(n, n)
            return texts, self.last_seq

    def _add(self, record, size):  # (self.lock held) a stored batch joins the index, the draw and the tables
        peer, groups, last = record["peer"], record["groups"], record["groups"][-1]["seq"]
        texts = [_dumps(g) for g in groups]
        self.index.extend((g["seq"], peer, text, last) for g, text in zip(groups, texts))
        self._keep(peer, Batch(last, record["batch_id"], record["time"], texts, size))
        self.last_seq = last
        self.replies[(peer, record["batch_id"])] = {"accepted": len(groups), "seq": last}
        self._seen(peer, record["round"], record["time"], len(groups))

    def _keep(self, writer, batch):  # (self.lock held) a batch joins its writer's, and the writer goes last
        self.batches.setdefault(writer, collections.deque()).append(batch)
        self.kept_bytes += batch.cost
        if writer in self.fresh:
            self.fresh.move_to_end(writer)
        else:
            self.fresh[writer] = len(self.drawable)
            self.drawable.append(writer)

    def _expire(self, since):  # (self.lock held) writers with no batch since `since` leave the draw
        while self.fresh and self.batches[oldest := next(iter(self.fresh))][-1].time < since:
            self._undraw(oldest)

    def _undraw(self, writer):  # the last drawable writer takes its place, so that no list is shifted
        i, last = self.fresh.pop(writer), self.drawable.pop()
        if last != writer:
            self.drawable[i] = last
            self.fresh[last] = i

    def _seen(self, peer, round_, when, published=0):  # the peers table, the one seen most recently last
        p = self.peers.pop(peer, None) or {"last_seen": 0.0, "last_round": 0, "groups": 0}
        p.update(last_seen=max(p["last_seen"], when), last_round=max(p["last_round"], round_),
                 groups=p["groups"] + published)
        self.peers[peer] = p
        while len(self.peers) > self.keep_peers:
            self.peers.popitem(last=False)

    def _retain(self):
        """Retention by cost: past the budget, the writers holding most lose their oldest, to 90% of it."""
        pruned = []
        if self.kept_bytes > self.budget:
            with self.lock:
                pruned = self._prune(0.9 * self.budget)
        self._forget(pruned)

    def _prune(self, target):
        """(self.lock held) Cut by water-filling: writers above a level lose their oldest batches, the level
        at which all holdings, so cut, add up to target -> the pruned batches. The batch stored last stays."""
        held = {writer: sum(batch.cost for batch in kept) for writer, kept in self.batches.items()}
        costs, rest = sorted(held.values(), reverse=True), self.kept_bytes
        for k, cost in enumerate(costs):
            rest -= cost
            level = (target - rest) / (k + 1)
            if k + 1 == len(costs) or level >= costs[k + 1]:
                break
        pruned = []
        for writer in [w for w, cost in held.items() if cost > level]:
            kept = self.batches[writer]
            while kept and held[writer] > level and kept[0].seq != self.last_seq:
                batch = kept.popleft()
                pruned.append(batch)
                held[writer] -= batch.cost
                self.kept_bytes -= batch.cost
                self.gone.append((writer, batch.batch_id))
            if not kept:
                del self.batches[writer]
                if writer in self.fresh:
                    self._undraw(writer)
        dropped = {batch.seq for batch in pruned}
        self.index = [entry for entry in self.index if entry[3] not in dropped]
        while len(self.gone) > self.keep_replies:  # past keep_replies, the oldest reply records go
            del self.replies[self.gone.popleft()]
        return pruned

    def _save(self, record):  # a persistence hook: a batch, durable before anyone may see it -> its cost
        return len(_dumps(record))

    def _forget(self, pruned):  # a persistence hook, after retention: in memory, what it pruned is gone
        pass


# -----------------------------------------------------------------------------
# The peer's side: its training loop touches two queues; one thread talks to the store.

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # peer names: safe in URLs, logs and HTML
NAMES = ("1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit, in any case "
         "(Alice is alice)")


def _sane(x):  # a number any chart can draw: finite and not absurd (a 400-digit integer is not); no bools
    return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) <= 1e15


def _log(message, peer=None):  # a line of the server's log, or of peer's client's, lone surrogates escaped
    who = f"client {peer}" if peer else "server"  # (a reply may carry one, and no stream may refuse the line)
    print(f"swarm {who}: {message}".encode("utf-8", "backslashreplace").decode(), file=sys.stderr, flush=True)


class Refused(Exception):
    """The store refused an outbox entry as malformed: the same bytes would be refused again."""


class Client:
    """One peer's view of the swarm. The training loop's calls only touch two queues, bounded in bytes
    (past a bound the oldest entry goes: SAPO wants fresh rollouts); a writer thread and a reader thread,
    neither waiting for the other, talk to the store through a transport (LocalTransport's four calls).

        publish(round, groups) -> outbox --(the writer: oldest first, until acknowledged)--> store
        fetch() <- inbox <--(the reader: a sampled read of K groups, once per fetch() or flush())-- store

    A retried batch is stored once (it carries a batch_id); no group is handed out twice."""

    def __init__(self, peer, transport, sample, seed=0, round=0, seen=(), seen_cap=4096, inbox_cap=64 << 20,
                 outbox_cap=64 << 20, body_cap=8 << 20):
        self.peer = peer              # this peer's name: the store leaves its groups out of its reads
        self.transport = transport    # the store's end of the exchanges
        self.sample = sample          # K, the groups one read asks for
        self.inbox_cap = inbox_cap    # bytes of received groups the inbox holds; past it the oldest go
        self.outbox_cap = outbox_cap  # bytes of unsent entries the outbox holds; past it the oldest go
        self.body_cap = body_cap      # the largest request a store takes: a larger entry is dropped at once
        self.seed = seed    # the k-th read asked for in round r draws with (seed, r, k): kept over a restart
        self.round = round  # the round the next read is for (kept over a restart too)
        self.count = 0      # the reads asked for in that round so far
        self.seen = collections.deque(map(tuple, seen), maxlen=seen_cap)  # (seq, time) of groups handed out
        self.cond = threading.Condition()  # guards all that follows; notified when a thread gets somewhere
        self.outbox = collections.deque()  # entries to send, oldest first: (what, send, its arguments, bytes)
        self.outbox_bytes = 0              # their bytes
        self.inbox = collections.deque()   # groups received and not fetched yet, oldest first: (group, bytes)
        self.inbox_bytes = 0               # their bytes
        self.asked = collections.deque(maxlen=2)  # (round, k) of the reads asked for and not done; 2 at most
        self.reads_begun = self.reads_done = 0  # reads are numbered as they begin: the last begun, last done
        self.closing, self.troubled = False, set()  # whether the threads are to stop; the steps in trouble
        self.down, self.dropped = None, 0  # why the store does not answer (None if it does); entries dropped
        self.threads = [threading.Thread(target=self._run, args=job, name=f"swarm-{peer}", daemon=True)
                        for job in ((lambda: self.outbox, self._send), (lambda: self.asked, self._read))]
        for thread in self.threads:  # the writer and the reader
            thread.start()

    def publish(self, round, groups):
        """Queue this round's groups for the swarm; returns at once."""
        if groups:  # its round, its groups as JSON texts, and the id that makes a retry harmless
            self._enqueue(f"round {round}'s batch", self.transport.publish, lambda: (
                int(round), [_dumps(g) for g in groups], f"{self.peer}-{int(round)}-{os.urandom(6).hex()}"))

    def post_metrics(self, round, metrics):
        """Queue per-round numbers for the dashboard (best effort); what is not a sane number goes as null."""
        def make():  # -> its round and the row as one JSON text
            row = {str(k)[:64]: float(v) if _sane(v) else None for k, v in list(metrics.items())[:64]}
            return int(round), [_dumps(row)]
        self._enqueue(f"round {round}'s metrics", self.transport.post_metrics, make)

    def fetch(self):
        """Other peers' groups read since the last call, none handed out before; then asks for more."""
        with self.cond:
            seen = set(self.seen)
            fresh = {(g["seq"], g["time"]): g for g, _ in self.inbox if (g["seq"], g["time"]) not in seen}
            self.seen.extend(fresh)
            self.inbox.clear()
            self.inbox_bytes, self.round, self.count = 0, self.round + 1, 0
            self._ask()
            return list(fresh.values())

    def flush(self, timeout=10.0):
        """Wait until the outbox is empty, then for a read begun after that, which sees what this peer sent
        -> True, or False after `timeout` s."""
        end = time.monotonic() + timeout
        with self.cond:
            if not self.cond.wait_for(lambda: not self.outbox, timeout):
                return False
            begun = self.reads_begun
            self._ask()
            return self.cond.wait_for(lambda: self.reads_done > begun, end - time.monotonic())

    def close(self, wait=0.0):
        """Stop the threads once the outbox is empty or after `wait` seconds; a line says what was not sent."""
        with self.cond:
            self.cond.wait_for(lambda: not self.outbox, wait)
            self.closing = True
            self.cond.notify_all()
        self.transport.close()
        for thread in self.threads:
            thread.join(5)
        self._say_undelivered(wait)

    def _ask(self):  # (self.cond held) wake the reader for one more read of this round
        self.asked.append((self.round, self.count))
        self.count += 1
        self.cond.notify_all()

    def _enqueue(self, what, send, make):
        """make() -> send's arguments (round, JSON texts, ...), queued last in the outbox; or a log line."""
        try:
            args = make()
        except (TypeError, ValueError, OverflowError, AttributeError) as e:
            return _log(f"{what} cannot be sent ({e})", self.peer)
        size = sum(len(text) + 1 for text in args[1]) + 256  # (and room for what a request wraps them in)
        if size > self.body_cap:  # a store would refuse it (413): never held, even while it is down
            return _log(f"{what} is {size} bytes, over a request's {self.body_cap}, so it is dropped",
                        self.peer)
        with self.cond:
            self.outbox.append((what, send, args, size))
            self.outbox_bytes += size
            while self.outbox_bytes > self.outbox_cap and len(self.outbox) > 1:
                self.outbox_bytes -= self.outbox.popleft()[3]
                self.dropped += 1
            self.cond.notify_all()

    def _run(self, work, step):
        """A thread: step() whenever work() says there is some (the writer's: an outbox entry; the reader's:
        a read asked for), else wait for it. Trouble is waited out (0.25 s to 5 s), a bug's too."""
        backoff = 0.0
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closing or work())
                if self.closing:
                    return
            try:
                step()
                error, backoff = None, 0.0
            except Exception as e:  # (a bug must not end the thread either)
                error, backoff = e, min(5.0, max(0.25, 2 * backoff))
            self._said(step, error)
            with self.cond:  # (no wait after a step that went through)
                self.cond.wait_for(lambda: self.closing, backoff)

    def _said(self, step, e):
        """A step went through (e None) or met trouble (e). Trouble is said once however long it lasts: from
        the first thread that meets it until neither thread is in it."""
        with self.cond:
            if e is None and self.troubled == {step}:
                lost = f"; {self.dropped} older entries did not fit the outbox" * bool(self.dropped)
                waited = ", sending what waited" * (step == self._send)
                _log(f"the server answers again{waited}{lost}", self.peer)
                self.down, self.dropped = None, 0
            elif e is not None and not self.troubled and not self.closing:
                cause = e if isinstance(e, (OSError, BadRequest)) else f"unexpected error {e!r:.200}"
                _log(f"{cause}; training goes on, and what is unsent waits in the outbox (up to "
                     f"{self.outbox_cap >> 20} MB) until the server answers", self.peer)
            if e is not None:
                self.down = str(e) or type(e).__name__
            (self.troubled.discard if e is None else self.troubled.add)(step)

    def _send(self):
        """Deliver the oldest outbox entry. It leaves the outbox once the store acknowledged it, or refused
        it as malformed (Refused: the same bytes would be refused again); other trouble keeps it for later."""
        with self.cond:
            entry = self.outbox[0]
        what, send, args, size = entry
        try:
            send(*args)
        except Refused as e:
            _log(f"the server refused {what}, so it is dropped: {e}", self.peer)
        with self.cond:
            if self.outbox and self.outbox[0] is entry:  # (a full outbox may have dropped it meanwhile)
                self.outbox.popleft()
                self.outbox_bytes -= size
                self.cond.notify_all()

    def _read(self):
        """The oldest read fetch() or flush() asked for, into the inbox: the checked groups, none of ours."""
        with self.cond:
            self.reads_begun += 1
            read, asked = self.reads_begun, self.asked[0]
        seed = random.Random("/".join(map(str, (self.seed, *asked)))).getrandbits(63)
        drawn = self.transport.sample(self.sample, seed)
        fresh = [(g, n) for g, n in drawn if g["peer"].lower() != self.peer.lower()]
        with self.cond:
            self.inbox.extend(fresh)
            self.inbox_bytes += sum(size for _, size in fresh)
            while self.inbox_bytes > self.inbox_cap:  # past the bound the oldest go
                self.inbox_bytes -= self.inbox.popleft()[1]
            if self.asked and self.asked[0] == asked:  # (unless two newer reads were asked for meanwhile)
                self.asked.popleft()
            self.reads_done = read
            self.cond.notify_all()

    def _say_undelivered(self, wait):  # close()'s line on what never reached the store, and why
        batches = sum(send == self.transport.publish for _, send, _, _ in self.outbox)
        if self.outbox or self.dropped:
            lost = f", nor {self.dropped} older entries a full outbox let go" * bool(self.dropped)
            _log(f"{batches} batches and {len(self.outbox) - batches} metrics rows were not delivered"
                 f"{lost}: {self.down or f'the server had not taken them after {wait:g} s'}", self.peer)


# ----- Nothing below this line is needed to understand SAPO: plumbing follows. -----

try:
    import fcntl     # POSIX: the server locks its folder so two servers never share one
    import resource  # POSIX: the descriptor limit sets how many connections the server may hold
    import termios   # POSIX: TIOCOUTQ, what a socket has not delivered yet (_unsent)
except ImportError:
    fcntl = resource = termios = None


class Limits:
    """Every bound in one place (sizes in bytes): what a sender may make a server hold, and a server a client."""
    body_bytes = 8 << 20        # one request body (413 beyond); those over 1/8 of it are parsed one at a time
    json_values = 1 << 20       # values in a body (413 beyond) or a reply, counted before parsing (~45 ms)
    group_tokens = 1 << 17      # token ids in one group, so that any reply of groups stays within json_values
    completion_tokens = 8192    # token ids (and log-probs) of one completion in a group
    page_bytes = 1 << 20        # one reply page of /rollouts or /metrics (a page holds at least one item)
    page_groups = 1024          # groups in one /rollouts page (?limit=, default 256)
    scan_groups = 16 * 1024     # groups one read may step over (the reader's own, which it excludes)
    keep_bytes = 256 << 20      # default --keep-bytes: kept batches' cost (7/8 of it) and pruned.json (1/8)
    batch_overhead = 2048       # a kept batch's cost beyond its disk blocks: its memory (~2.3 KB, measured)
    metrics_bytes = 8 << 20     # metrics rows kept, in memory and in metrics.jsonl
    replies = 20_000            # idempotency records of pruned batches in memory (those of kept batches are
                                # all kept), whatever --keep-bytes; pruned.json keeps one per 4 KB of it
    peers = 1024                # peers in the table; the one seen least recently goes first
    connections = 1000          # open connections, fewer under a low descriptor limit (at the cap: _evict)
    in_flight_bytes = 64 << 20  # request bodies held at once, all connections together (503 beyond)
    made_bytes = 16 << 20       # replies made for a request (the dashboard, /peers) held at once (503 beyond)
    send_buffer = 128 << 10     # a connection's kernel send buffer (SO_SNDBUF, which the kernel doubles)
    request_seconds = 10.0      # whole-request deadline: the server's to read one, the client's per call
    line_bytes = 8192           # the request line (414 beyond it) and each header line (431)
    header_lines = 64           # header lines in one request (431 beyond it)
    workers = 4                 # threads answering GETs, as many for POSTs (reads never wait for an fsync)
    backlog = 128               # connections the kernel queues before the server accepts them
    outbox_bytes = 64 << 20     # client: unsent batches and metrics; the oldest go first beyond it
    inbox_bytes = 64 << 20      # client: received groups not yet fetched; the oldest go first beyond it
    reply_bytes = body_bytes + (64 << 10)  # client: the largest reply it reads (a body's groups, and more)
    sample_groups = 256         # groups one sampled read may ask for (?sample=K)
    window_batches = 2          # a sampled read draws from each producer's newest this many batches,
    window_seconds = 600        # of the producers whose newest batch arrived within this many seconds
    seen_seqs = 4096            # client: the seqs it remembers, so it hands out none twice
    batch_groups = 256          # groups one batch may hold (a POST's)
    group_completions = 64      # completions one group may hold (train.py refuses a larger --generations)
    completion_chars = 32_000   # characters of one completion
    question_chars = 16_000     # characters of a group's question
    metadata_bytes = 16_000     # bytes of its metadata as JSON
    answer_chars = 4_000        # characters of its ground truth
    name_chars = 256            # characters of its task's name, and of its model's
    redis_seconds = 5.0         # --redis: a Redis exchange's deadline (past it a 503), within the client's


# -----------------------------------------------------------------------------
# What arrives from outside (requests, files read back, replies) is checked by rules: rule(value, where) ->
# a clean copy, or BadRequest naming the first problem (where: what the value is; a body's may be left out).

class BadRequest(Exception):
    """What the other side got wrong, in one sentence, with the HTTP status that says so."""
    def __init__(self, message, status=400, headers=None):
        super().__init__(message)
        self.message, self.status, self.headers = message, status, headers or {}

    @property
    def reply(self):  # as the server sends it (made on use: a client's BadRequest may quote any text)
        return self.status, JSON, _dumps({"error": self.message}), self.headers


def _want(ok, message, status=400, headers=None):
    if not ok:
        raise BadRequest(message, status, headers)


def _too_deep(x, levels):
    children = x.values() if isinstance(x, dict) else x if isinstance(x, list) else ()
    return levels < 0 or any(_too_deep(child, levels - 1) for child in children)


def rule(test, says, convert=lambda value, where: value):
    """The rule "test(value) holds", which fails with "<where> must be <says>."; convert makes the copy."""
    def checked(value, where):
        _want(test(value), f"{where} must be {says}.")
        return convert(value, where)
    return checked


def text(most, least=0):
    says = f"a string of {least} to {most} characters"
    return rule(lambda v: isinstance(v, str) and least <= len(v) <= most, says)


def number(most, whole=True):  # JSON true is no number here; a float may be written as an int
    return rule(lambda v: _sane(v) and (isinstance(v, int) or not whole) and 0 <= v <= most,
                f"a {'whole ' * whole}number from 0 to {most:g}")


def items(most, each=None, least=0):  # a list of least to most values, each passing the rule each (None: any)
    return rule(lambda v: isinstance(v, list) and least <= len(v) <= most, f"a list of {least} to {most}"
                " items", lambda v, where: [each(x, f"{where}[{i}]") for i, x in enumerate(v)] if each else v)


def fields(table, optional={}, also=()):
    """The rule for a JSON object with the fields of `table` (field -> rule) -> a copy with only those.
    optional: field -> the value a missing field takes; also: (test of the copy, what it says) pairs."""
    def checked(value, where=""):
        it = where or "The body"
        _want(isinstance(value, dict), f"{it} must be a JSON object.")
        clean = {}
        for field, each in table.items():
            _want(field in value or field in optional, f"{it} is missing the field '{field}'.")
            if field in value:
                clean[field] = each(value[field], f"{where}.{field}" if where else field)
            elif optional[field] is not None:  # None: left out
                clean[field] = optional[field]
        for test, says in also:
            _want(test(clean), f"In {where or 'the body'}, {says}.")
        return clean
    return checked


PEER = rule(lambda v: isinstance(v, str) and NAME.fullmatch(v), NAMES, lambda v, where: v.lower())  # stored
BATCH_ID = rule(lambda v: isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", v),
                "an id of 1 to 128 characters from A-Z, a-z, 0-9 and '_.:-'")
SEQ, ROUND, TIME = number(10**15), number(10**12), number(1e11, whole=False)
TOKEN_ID = rule(lambda v: type(v) is int and 0 <= v < 2**31, "a token id from 0 to 2**31 - 1")
LOGPROB = rule(lambda v: _sane(v) and v <= 0, "a number <= 0")
GROUP = {  # field -> rule: a rollout group on the wire, within Limits
    "task": text(Limits.name_chars, 1), "question": text(Limits.question_chars),
    "answer": text(Limits.answer_chars),
    "metadata": rule(lambda v: isinstance(v, dict) and not _too_deep(v, 8)
                     and len(_dumps(v)) <= Limits.metadata_bytes,
                     f"a JSON object nested at most 8 deep and at most {Limits.metadata_bytes} bytes "
                     "as JSON"),
    "completions": items(Limits.group_completions, text(Limits.completion_chars), 1),
    "stopped": items(Limits.group_completions, rule(lambda v: isinstance(v, bool), "true or false")),
    "model": text(Limits.name_chars),
    # the last three, beyond the paper: optional, all or none (--shared-logprobs)
    "token_ids": items(Limits.group_completions, items(Limits.completion_tokens, TOKEN_ID)),
    "logprobs": items(Limits.group_completions, items(Limits.completion_tokens, LOGPROB)),
    "tokenizer": text(64, 1)}
OPTIONAL = {"metadata": {}, "model": "", "token_ids": None, "logprobs": None, "tokenizer": None}
ALSO = [(lambda g: len(g["stopped"]) == len(g["completions"]),
         "stopped must hold one boolean per completion"),
        (lambda g: len({f in g for f in ("token_ids", "logprobs", "tokenizer")}) == 1,
         "token_ids, logprobs and tokenizer must come together, or none of them"),
        (lambda g: "token_ids" not in g or [len(c) for c in g["logprobs"]] == [len(c) for c in g["token_ids"]]
         and len(g["token_ids"]) == len(g["completions"]),
         "token_ids and logprobs must hold a list per completion, one log-prob per token id"),
        (lambda g: sum(map(len, g.get("token_ids", []))) <= Limits.group_tokens,
         f"token_ids must hold at most {Limits.group_tokens} ids in all")]


def wire_group(task, question, answer, completions, stopped, metadata=None, model="", token_ids=None,
               logprobs=None, tokenizer=None):
    """A rollout group as a peer publishes it, with GROUP's fields. The last three, beyond the paper, come
    together or not at all: a completion's sampled token ids, their log-probs, the tokenizer's fingerprint."""
    group = dict(task=task, question=question, answer=answer, metadata={} if metadata is None else metadata,
                 completions=list(completions), stopped=list(stopped), model=model)
    if token_ids is not None:
        group.update(token_ids=token_ids, logprobs=logprobs, tokenizer=tokenizer)
    return group


STORED = fields({**GROUP, "peer": PEER, "round": ROUND, "seq": SEQ, "time": TIME}, OPTIONAL, ALSO)  # served
WIRE = fields(GROUP, OPTIONAL, ALSO)  # as published
PUBLISH = fields({"peer": PEER, "round": ROUND, "batch_id": BATCH_ID,
                  "groups": items(Limits.batch_groups, WIRE)})
BATCH = fields({"peer": PEER, "round": ROUND, "batch_id": BATCH_ID, "time": TIME,
                "groups": items(Limits.batch_groups, STORED)})
PRUNED = fields({"seq": SEQ, "replies": items(math.inf, fields(  # pruned.json
    {"peer": PEER, "batch_id": BATCH_ID, "accepted": number(256), "seq": SEQ}))})
NUMBERS = rule(lambda v: isinstance(v, dict) and len(v) <= 64
               and all(0 < len(k) <= 64 and (x is None or _sane(x)) for k, x in v.items()),
               "an object of at most 64 names (1 to 64 characters) to numbers within ±1e15 or null",
               lambda v, where: {k: None if x is None else float(x) for k, x in v.items()})
METRICS = fields({"peer": PEER, "round": ROUND, "metrics": NUMBERS})
ROW = fields({"n": SEQ, "peer": PEER, "round": ROUND, "time": TIME, "metrics": NUMBERS})  # metrics.jsonl
SAMPLE = fields({"groups": items(math.inf), "last": SEQ})  # a GET /rollouts?sample=K reply


def _finite(text):  # JSON may spell numbers that cannot be served back as JSON: NaN, Infinity, 1e999
    if not math.isfinite(x := float(text)):
        raise ValueError(f"{text[:20]} is not a finite number")
    return x


def parse_json(raw, surrogates=False, most=None):
    """Strict UTF-8 JSON -> a Python value, or BadRequest: no NaN or Infinity, no lone surrogate ("\\ud800":
    no UTF-8 can store or serve it), nothing nested too deeply, at most `most` values (Limits.json_values:
    each costs memory far beyond its bytes, an 8 MB body of {},{},... is 230 MB as Python objects).
    surrogates=True keeps lone surrogates: a client drops the one group that holds one, not its page."""
    try:
        text = raw.decode() if isinstance(raw, (bytes, bytearray)) else raw  # strict: no encoded surrogates
        most = most or Limits.json_values
        if text.count(",") + text.count("{") + text.count("[") > most:  # then count them outside strings
            _want(_values(text) <= most, f"The JSON holds more than {most} values; send fewer at once.", 413)
        value = json.loads(text, parse_float=_finite, parse_constant=_finite)
        if not surrogates and re.search(r"\\u[dD][89a-fA-F]", text):
            _dumps(value)  # raises UnicodeEncodeError on a lone surrogate
        return value
    except (ValueError, RecursionError) as e:  # not JSON or UTF-8, a lone surrogate, 5000 digits, too deep
        raise BadRequest(f"The body is not valid JSON: {str(e)[:120]}.") from None


def _values(text):  # what parsing a JSON text costs: its commas, objects and lists outside strings (linear)
    bare = re.sub(r'"[^"]*"', "", text.replace("\\\\", "").replace('\\"', ""))
    return bare.count(",") + bare.count("{") + bare.count("[")


# -----------------------------------------------------------------------------
# Storage on disk: one file per accepted batch (written atomically, fsynced), pruned.json and metrics.jsonl.

class RolloutStore(Store):
    """The Store on disk, under Limits' bounds: a locked folder of batch files, pruned.json (what retention
    deleted) and metrics.jsonl (the dashboard's rows), all read back when a server starts on it."""
    copies = ("pruned.json", "pruned-copy.json")  # two copies: a damaged one alone loses nothing

    def __init__(self, folder, keep_bytes=Limits.keep_bytes):
        # The batches get keep_bytes less an eighth and 8 KB; pruned.json's two copies take the rest, at most
        # 512 bytes a reply, so they keep the newest replies, one for each 4 KB of keep_bytes. In memory the
        # store keeps those of the last Limits.replies pruned batches, whatever keep_bytes (each ~0.45 KB).
        super().__init__(keep_bytes - keep_bytes // 8 - 8192, Limits.window_batches, Limits.window_seconds,
                         Limits.page_bytes, Limits.replies, Limits.peers, Limits.scan_groups)
        self.replies_on_disk = min(Limits.replies, max(16, keep_bytes // 4096))  # what pruned.json keeps
        self.folder = os.path.abspath(folder)     # the folder this server alone writes
        self.pruned = 0                           # seq of the newest group retention deleted
        self.metrics, self.metrics_bytes = [], 0  # (n, peer, row as a JSON line, row) per kept metrics row
        self.closed = self.metrics_cut = False    # metrics_cut: a failed write may have left half a line
        self.folder_fd, self.doomed = None, []  # doomed: files retention deletes once pruned.json says so
        self.deleter = ThreadPoolExecutor(1, thread_name_prefix="swarm-delete")  # deletes them, lock-free
        try:  # the folder itself is flocked (no lock file that `rm` could remove); files open relative to it
            os.makedirs(self.folder, exist_ok=True)
            self.folder_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
            self._remove(".tmp-probe")
            self._open(".tmp-probe", "wb").close()  # can we write here?
            if fcntl is not None:
                fcntl.flock(self.folder_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._load()
        except BaseException as e:
            self.deleter.shutdown(wait=True)
            if self.folder_fd is not None:
                os.close(self.folder_fd)
            if not isinstance(e, OSError):
                raise
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ValueError(f"another swarm server is already using --dir {self.folder}; stop it or "
                                 "choose another folder.") from None
            raise ValueError(f"cannot use --dir {self.folder} ({e.strerror or e}); give a folder it can "
                             "create and write.") from None

    def _save(self, record):  # the batch's file, named after its last seq -> its blocks, and its memory
        size = self._write_atomic(_batch_file(record["groups"][-1]["seq"]), _dumps(record))
        return size + Limits.batch_overhead

    def _forget(self, pruned):
        """The replies of pruned batches go into pruned.json (both copies), so that the numbering goes on
        after a restart and a late retry is stored once; then a thread deletes their files, holding no
        lock. A pruned.json the disk cannot take is logged: the files wait for the next try."""
        self.pruned = max([self.pruned] + [batch.seq for batch in pruned])
        self.doomed += [_batch_file(batch.seq) for batch in pruned]
        if not self.doomed:
            return
        gone = list(self.gone)[-self.replies_on_disk:]
        replies = [{"peer": p, "batch_id": b, **self.replies[(p, b)]} for p, b in gone]
        try:
            for name in self.copies:
                self._write_atomic(name, _dumps({"seq": self.pruned, "replies": replies}))
        except (OSError, BadRequest) as e:
            why = getattr(e, "message", e)
            return _log(f"cannot write pruned.json for now ({why}); pruned files wait for it")
        self.deleter.map(self._remove, self.doomed)  # (submitted at once)
        self.doomed = []

    def _load(self):
        """Read the folder back: pruned.json, every batch file in seq order, metrics.jsonl. Whatever a file
        holds, a bad one is logged and skipped, and no seq named by a file is ever used again."""
        for pruned in filter(None, (self._read(name, PRUNED) for name in self.copies)):
            self.pruned = max(self.pruned, pruned[0]["seq"])
            for r in pruned[0]["replies"]:
                if (r["peer"], r["batch_id"]) not in self.replies:
                    self.gone.append((r["peer"], r["batch_id"]))
                    self.replies[self.gone[-1]] = {"accepted": r["accepted"], "seq": r["seq"]}
        gone = {self.replies[key]["seq"] for key in self.gone}
        for name in sorted(os.listdir(self.folder_fd), key=lambda name: (len(name), name)):  # batches: by seq
            found = re.fullmatch(r"batch-(\d{12,16})\.json", name)
            last = int(found.group(1)) if found else 0
            if name.startswith(".tmp-") or last in gone:
                self._remove(name)  # a write that never finished (never acknowledged), or a pruned batch
                continue
            batch = self._read(name, BATCH) if found else None
            seqs = [g["seq"] for g in batch[0]["groups"]] if batch else []
            if seqs and seqs[0] > self.last_seq and seqs == list(range(seqs[0], last + 1)):
                self._add(batch[0], batch[1] + Limits.batch_overhead)  # (its cost, as _save counts it)
            elif batch:
                _log(f"skipping batch file {name}: its groups are not numbered up to the seq in its name")
            self.last_seq = max(self.last_seq, last)  # its name alone uses up the numbers, even if unreadable
        self.last_seq = max(self.last_seq, self.pruned)
        data, bad = self._read("metrics.jsonl"), 0
        for line in (data or b"").splitlines():
            try:
                row = ROW(parse_json(line))
                _want(not self.metrics or row["n"] > self.metrics[-1][0], "out of order")
                self._keep_metrics(row)
            except BadRequest:
                bad += 1  # e.g. the last line, cut short by kill -9
        if bad or data == b"" or data and not data.endswith(b"\n"):  # so no row is appended to half a line
            _log(f"skipped {bad} unreadable lines in metrics.jsonl") if bad else None
            self._write_atomic("metrics.jsonl", b"".join(m[2] for m in self.metrics))
        if self.last_seq:
            _log(f"reloaded {len(self.index)} groups in {sum(map(len, self.batches.values()))} batches from "
                 f"{self.folder}; numbering continues after seq {self.last_seq}")
        self._retain()

    def _read(self, name, rule=None):
        """A file of the folder -> its bytes, or with a rule (clean JSON, its bytes on disk); None if missing,
        and if unreadable or bad (logged): b"", or None with a rule."""
        try:
            with self._open(name) as f:
                data = f.read(4 * Limits.body_bytes + 1)  # more than this server ever writes in one file
                size = max(len(data), os.fstat(f.fileno()).st_blocks * 512)
            _want(len(data) <= 4 * Limits.body_bytes, "it is larger than any file this server writes")
            most = Limits.json_values + 8 * Limits.batch_groups  # a batch's, and what the server adds to it
            return (rule(parse_json(data, most=most), name), size) if rule else data
        except FileNotFoundError:
            return None
        except (OSError, BadRequest) as e:
            _log(f"skipping unreadable {name} ({getattr(e, 'message', e)!s:.200})")
            return None if rule else b""

    def add_metrics(self, peer, round_, metrics):
        with self.write_lock:
            row = {"n": self.metrics[-1][0] + 1 if self.metrics else 1, "peer": peer, "round": round_,
                   "time": _now(), "metrics": metrics}
            line = b"\n" * self.metrics_cut + _dumps(row) + b"\n"  # never onto a line cut short
            self.metrics_cut = True
            try:
                with self._open("metrics.jsonl", "ab") as f:  # best effort: no fsync
                    f.write(line)
                    size = f.tell()
            except OSError as e:  # a link, FIFO or folder in the way: the rewrite below replaces it
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
                size = math.inf
            self.metrics_cut = False  # (written whole, or rewritten whole below)
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
            texts, next_n = _page(self.metrics, after, None, None, self.page_bytes, self.scan_groups)
            return texts, next_n, self.metrics[-1][0] if self.metrics else 0

    def snapshot(self, metrics=False):  # (/health, which cursor readers ask often, walks no metrics rows)
        with self.lock:
            return {"groups": len(self.index), "first_seq": self.index[0][0] if self.index else 0,
                    "last_seq": self.last_seq, "peers": {p: dict(v) for p, v in self.peers.items()},
                    "metrics": [m[3] for m in self.metrics] if metrics else []}

    def _open(self, name, mode="rb"):
        """A regular file of the locked folder (never through a link, never a FIFO). Writing, a 503 if the folder's
        path now names another folder (`mv D D.old; mkdir D`): another server may write there, and ours be lost."""
        try:
            moved = mode != "rb" and not os.path.samestat(os.fstat(self.folder_fd), os.stat(self.folder))
        except FileNotFoundError:
            moved = True
        if moved:
            _log(f"{self.folder} was moved or replaced while this server ran; it stores nothing until "
                 "restarted")
            raise BadRequest("The server's folder was moved or replaced, so nothing was stored; send it "
                             "again once the server is restarted.", 503, {"Retry-After": "10"})
        flags = os.O_NOFOLLOW | os.O_NONBLOCK  # (and open adds O_CLOEXEC)
        f = open(name, mode, opener=lambda at, how: os.open(at, how | flags, 0o644, dir_fd=self.folder_fd))
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            f.close()
            raise OSError(errno.EINVAL, "not a regular file")
        return f

    def _write_atomic(self, name, data):
        """Bytes to folder/name, all or nothing even after kill -9: a temporary file, fsynced, renamed over the
        name (a link there is replaced, never followed), the rename fsynced -> the bytes it takes on disk."""
        try:
            self._remove(".tmp-" + name)  # whatever is in the way: a FIFO, a link, an empty folder
            with self._open(".tmp-" + name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                size = max(len(data), os.fstat(f.fileno()).st_blocks * 512)
            with contextlib.suppress(OSError):  # an empty folder in its way goes (a full one fails the rename)
                os.rmdir(name, dir_fd=self.folder_fd)
            os.replace(".tmp-" + name, name, src_dir_fd=self.folder_fd, dst_dir_fd=self.folder_fd)
            os.fsync(self.folder_fd)
            return size
        except OSError:
            self._remove(".tmp-" + name)
            raise

    def _remove(self, name):
        try:
            os.remove(name, dir_fd=self.folder_fd)  # a link is removed, not what it points to
        except IsADirectoryError:
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=self.folder_fd)
        except FileNotFoundError:
            pass
        except OSError as e:  # pruned.json says it is deleted: the next start tries again
            _log(f"could not delete {name} ({e.strerror})")

    def close(self):
        with self.write_lock:
            if not self.closed:
                self.closed = True
                self.deleter.shutdown(wait=True)
                os.close(self.folder_fd)  # releases the folder lock


def _batch_file(seq):  # a batch's file, named after its last seq: 12 digits or more, read back by value
    return f"batch-{seq:012d}.json"


def _page(entries, after, limit, exclude, page_bytes, scan_groups):
    """entries: (number, peer, UTF-8 JSON, ...) in number order -> (the JSON texts after `after` that are
    not `exclude`'s, the number to continue after, past the excluded ones too): at most `limit` (None: any)
    and page_bytes, unless one text alone is larger; at most scan_groups entries stepped over."""
    start = bisect.bisect_right(entries, after, key=lambda entry: entry[0])
    texts, size, next_number = [], 0, after
    for number, peer, text, *_ in entries[start:start + scan_groups]:
        if len(texts) == limit or (texts and size + len(text) > page_bytes):
            break
        next_number = number
        if peer != exclude:
            texts.append(text)
            size += len(text) + 1
    return texts, next_number


# -----------------------------------------------------------------------------
# Storage in Redis, for several servers serving one swarm: the Store's rules run inside Redis as Lua scripts,
# each one atomic. Only servers hold the password, and every request passed the server's checks before a
# script runs. The keys (NAME: a writer's name, lower-case):
#   sapo:seq              the newest seq handed out (one counter for every server)
#   sapo:log              each kept batch as "LAST FIRST NAME", scored by its last seq (the cursor reads)
#   sapo:w:NAME:batches   the writer's kept batches, oldest first, as "LAST FIRST TIME COST BATCH_ID"
#   sapo:w:NAME:groups    seq -> the group's JSON as served; two more fields, held and count: the writer's
#                         bytes and groups
#   sapo:fresh            the writers by their newest batch's time: those within the window are drawn
#   sapo:held             the writers by the bytes they hold: retention cuts the one holding most
#   sapo:kept             the kept batches' bytes and groups, all writers together
#   sapo:replies          "NAME BATCH_ID" -> the reply of each kept batch and of the newest pruned ones,
#   sapo:gone             whose ids it lists, oldest first (Limits.replies of them)
#   sapo:peers, sapo:seen the peers table ("LAST_SEEN LAST_ROUND GROUPS" a name) and its recency
#   sapo:metrics          the dashboard's rows as JSON, scored by their n; sapo:mstat: their count n and bytes
# sapo:fresh and sapo:held hold the member "" at -inf: where it is missing (a new Redis, or one cleared by
# hand), RedisStore._rebuild makes them again from each writer's own keys. Every loop has a bound whatever
# Redis holds, and a number goes into text only through int(), never Lua's `..`, which writes 1e14 as "1e+14".
_LUA = """local function int(x) return string.format('%d', x) end
local function clock()  -- Redis's clock, the same for every server: as exact text, and as a number
  local t = redis.call('TIME')
  return t[1] .. '.' .. string.format('%06d', tonumber(t[2])), t[1] + t[2] / 1e6
end
local function seen(w, now, round, published, keep)  -- Store._seen: the peers table, its oldest row out
  local _, r, g = (redis.call('HGET', 'sapo:peers', w) or ''):match('^(%S+) (%d+) (%d+)$')
  if r and tonumber(r) > tonumber(round) then round = r end
  redis.call('HSET', 'sapo:peers', w, now .. ' ' .. round .. ' ' .. int((tonumber(g) or 0) + published))
  redis.call('ZADD', 'sapo:seen', now, w)
  local extra = math.max(0, math.min(64, redis.call('ZCARD', 'sapo:seen') - keep))
  local gone = extra > 0 and redis.call('ZPOPMIN', 'sapo:seen', extra) or {}
  for i = 1, #gone, 2 do redis.call('HDEL', 'sapo:peers', gone[i]) end
end
"""
# Retention by cost (Store._retain): past the budget, the writer holding most loses its oldest batch, and so
# on to 90% of it (Store._prune's water-filling, one batch at a time), at most 256 batches a publish. The
# batch stored last stays; a writer left with none leaves every index; what is no batch is dropped.
_PRUNE = """local function prune(target, newest, replies)
  local kept, skip = tonumber(redis.call('HGET', 'sapo:kept', 'bytes')) or 0, 0
  for _ = 1, 256 do
    local w = redis.call('ZREVRANGE', 'sapo:held', skip, skip)[1]
    if kept <= target or not w or w == '' then return end
    local batches, groups = 'sapo:w:' .. w .. ':batches', 'sapo:w:' .. w .. ':groups'
    local d = redis.pcall('LINDEX', batches, 0)
    local last, first, cost, id = (type(d) == 'string' and d or ''):match('^(%d+) (%d+) %S+ (%d+) (%S+)$')
    if last == newest then skip = 1 else redis.pcall('LPOP', batches) end  -- (the next writer's turn)
    if last and last ~= newest then
      local seqs = {}
      for s = tonumber(first), math.min(tonumber(last), first + 255) do seqs[#seqs + 1] = int(s) end
      if #seqs > 0 then redis.call('HDEL', groups, unpack(seqs)) end
      redis.call('ZREM', 'sapo:log', last .. ' ' .. first .. ' ' .. w)
      redis.call('HINCRBY', groups, 'count', -#seqs)
      redis.call('HINCRBY', 'sapo:kept', 'groups', -#seqs)
      kept = redis.call('HINCRBY', 'sapo:kept', 'bytes', int(-cost))
      redis.call('ZADD', 'sapo:held', redis.call('HINCRBY', groups, 'held', int(-cost)), w)
      redis.call('RPUSH', 'sapo:gone', w .. ' ' .. id)
      if redis.call('LLEN', 'sapo:gone') > replies then
        redis.call('HDEL', 'sapo:replies', redis.call('LPOP', 'sapo:gone'))
      end
    end
    if type(d) ~= 'string' or redis.pcall('LLEN', batches) == 0 then
      redis.call('DEL', batches, groups)
      redis.call('ZREM', 'sapo:held', w)
      redis.call('ZREM', 'sapo:fresh', w)
    end
  end
end
"""
# Store.publish. ARGV: name, round, batch id, budget, replies kept, peers kept, a batch's overhead, window
# seconds, then each group's JSON less its closing brace, to which the script adds seq and time.
PUBLISH_LUA = _LUA + _PRUNE + """local w, id, n = ARGV[1], ARGV[1] .. ' ' .. ARGV[3], #ARGV - 8
local reply = redis.call('HGET', 'sapo:replies', id)
if reply then return reply end  -- a retry gets the first reply: stored once
if not (redis.call('ZSCORE', 'sapo:fresh', '') and redis.call('ZSCORE', 'sapo:held', '')
        and redis.call('EXISTS', 'sapo:kept') == 1) then return 'rebuild' end
local seq = tonumber(redis.call('GET', 'sapo:seq'))  -- and never below the newest kept batch
if not seq or seq < 0 or seq % 1 ~= 0 then seq = 0 end
seq = math.max(seq, tonumber(redis.call('ZRANGE', 'sapo:log', -1, -1, 'WITHSCORES')[2]) or 0)
if seq + n > 1e15 then return redis.error_reply('sapo:seq is past 10^15, the highest seq a group carries') end
if n == 0 then return '{"accepted":0,"seq":' .. int(seq) .. '}' end
local now, clock_now = clock()
local groups, cost, first, last = 'sapo:w:' .. w .. ':groups', tonumber(ARGV[7]), int(seq + 1), int(seq + n)
for i = 1, n do
  local text = ARGV[8 + i] .. ',"seq":' .. int(seq + i) .. ',"time":' .. now .. '}'
  redis.call('HSET', groups, int(seq + i), text)
  cost = cost + #text
end
redis.call('SET', 'sapo:seq', last)
local batch = table.concat({last, first, now, int(cost), ARGV[3]}, ' ')
redis.call('RPUSH', 'sapo:w:' .. w .. ':batches', batch)
redis.call('ZADD', 'sapo:log', last, last .. ' ' .. first .. ' ' .. w)
redis.call('HINCRBY', groups, 'count', n)
redis.call('ZADD', 'sapo:held', redis.call('HINCRBY', groups, 'held', int(cost)), w)
redis.call('ZADD', 'sapo:fresh', now, w)
redis.call('HINCRBY', 'sapo:kept', 'groups', n)
local kept = redis.call('HINCRBY', 'sapo:kept', 'bytes', int(cost))
reply = '{"accepted":' .. int(n) .. ',"seq":' .. last .. '}'
redis.call('HSET', 'sapo:replies', id, reply)
seen(w, now, ARGV[2], n, tonumber(ARGV[6]))
local cutoff = '(' .. string.format('%.6f', clock_now - ARGV[8])  -- Store._expire: the silent leave the draw
local old = redis.call('ZRANGEBYSCORE', 'sapo:fresh', '(-inf', cutoff, 'LIMIT', 0, 1024)
if #old > 0 then redis.call('ZREM', 'sapo:fresh', unpack(old)) end
if kept > tonumber(ARGV[4]) then prune(0.9 * ARGV[4], last, tonumber(ARGV[5])) end
return reply"""
# Store.sample, its lazy Fisher-Yates shuffle over the ranks of the writers within the window, with its own
# generator (Park-Miller's, seeded by the seed's digits). ARGV: K, the name left out, seed, page bytes, a
# group's most bytes, window batches, window seconds, batch groups, steps, then "NAME SEQ" of groups to skip.
# A name with no batches is skipped, costing a step and not a draw, and removed from sapo:fresh. A group over
# the most bytes, or one that would take a page past the page bytes (unless it is the first), is skipped.
# -> {stale names removed, the newest seq, then the name, seq and JSON text of each group drawn}
SAMPLE_LUA = _LUA + """if not redis.call('ZSCORE', 'sapo:fresh', '') then return 'rebuild' end
local k, page, most = tonumber(ARGV[1]), tonumber(ARGV[4]), tonumber(ARGV[5])
local wb, bg = tonumber(ARGV[6]), tonumber(ARGV[8])
local x = 0
for d in ARGV[3]:gmatch('%d') do x = (x * 10 + d) % 2147483647 end
x = x % 2147483646 + 1
local function rand(m) x = x * 16807 % 2147483647 return x % m end
local _, clock_now = clock()
local total = redis.call('ZCARD', 'sapo:fresh')
local n = redis.call('ZCOUNT', 'sapo:fresh', string.format('%.6f', clock_now - ARGV[7]), '+inf')
local base, out, size, left, moved, stale, skip = total - n, {}, 0, {}, {}, {}, {}  -- (the window: base on)
for i = 10, #ARGV do skip[ARGV[i]] = true end
local function window(p)  -- the seqs of p's newest window batches, or false if p has no batches
  local ds = redis.pcall('LRANGE', 'sapo:w:' .. p .. ':batches', -wb, -1)
  if type(ds) ~= 'table' or ds.err or #ds == 0 then return false end
  local seqs = {}
  for _, d in ipairs(p ~= ARGV[2] and ds or {}) do
    local last, first = d:match('^(%d+) (%d+) ')
    last, first = tonumber(last), tonumber(first)
    if last and first <= last and last - first < bg then for s = first, last do seqs[#seqs + 1] = s end end
  end
  return seqs
end
for _ = 1, tonumber(ARGV[9]) do
  if #out == 3 * k or n == 0 or size >= page then break end
  local i = rand(n)
  local p = redis.call('ZRANGE', 'sapo:fresh', base + (moved[i] or i), base + (moved[i] or i))[1]
  if not p then break end
  if left[p] == nil then
    left[p] = window(p)
    if not left[p] then stale[#stale + 1], left[p] = p, {} end
  end
  local seqs = left[p]
  if #seqs > 0 then
    local j = rand(#seqs) + 1
    local s, key = int(seqs[j]), 'sapo:w:' .. p .. ':groups'
    seqs[j] = seqs[#seqs]
    seqs[#seqs] = nil
    local len = not skip[p .. ' ' .. s] and redis.pcall('HSTRLEN', key, s)
    if type(len) == 'number' and 0 < len and len <= most and (#out == 0 or size + len <= page) then
      out[#out + 1], out[#out + 2], out[#out + 3], size = p, s, redis.call('HGET', key, s), size + len
    end
  end
  if #seqs == 0 then  -- drawn dry: the writer in place n - 1 takes place i
    n = n - 1
    moved[i] = moved[n] or n
  end
end
for i = 1, #stale, 1000 do redis.call('ZREM', 'sapo:fresh', unpack(stale, i, math.min(i + 999, #stale))) end
local newest = tonumber(redis.call('GET', 'sapo:seq')) or 0
return {int(#stale), int(math.min(math.max(newest, 0), 1e15)), unpack(out)}"""
# Store.read (_page's rule): the groups after a seq, in seq order. ARGV: after, the name left out, limit,
# page bytes, steps (batches and groups stepped over), a group's most bytes. -> {next, newest seq, texts...}
READ_LUA = _LUA + """local out, size, nxt, steps = {}, 0, tonumber(ARGV[1]), tonumber(ARGV[5])
local limit, page, most, cursor = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[6]), ARGV[1]
local function walk()
  while steps > 0 do
    local found = redis.call('ZRANGEBYSCORE', 'sapo:log', '(' .. cursor, '+inf', 'WITHSCORES', 'LIMIT', 0, 64)
    if #found == 0 then return end
    for i = 1, #found, 2 do
      local last, first, w = found[i]:match('^(%d+) (%d+) (%S+)$')
      last, first, cursor, steps = tonumber(last), tonumber(first), found[i + 1], steps - 1
      if not last or first > last or last - first > 255 then  -- no batch: stepped over
        nxt = math.max(nxt, math.min(tonumber(cursor) or nxt, 1e15))
      else
        local key = 'sapo:w:' .. w .. ':groups'
        for s = math.max(first, nxt + 1), last do
          local len = w ~= ARGV[2] and redis.pcall('HSTRLEN', key, int(s)) or 0
          len = type(len) == 'number' and len <= most and len or 0
          if #out == limit or steps <= 0 or (#out > 0 and len > 0 and size + len > page) then return end
          if len > 0 then out[#out + 1], size = redis.call('HGET', key, int(s)), size + len + 1 end
          nxt, steps = s, steps - 1
        end
      end
    end
  end
end
walk()
local newest = tonumber(redis.call('GET', 'sapo:seq')) or 0
return {int(nxt), int(math.min(math.max(newest, 0), 1e15)), unpack(out)}"""
# A dashboard row (RolloutStore.add_metrics). ARGV: name, round, the metrics as JSON, metrics bytes, peers
# kept. Past the bytes the oldest rows go, at most 256 a call.
METRICS_LUA = _LUA + """local now = clock()
local n = redis.call('HINCRBY', 'sapo:mstat', 'n', 1)
local row = '{"n":' .. int(n) .. ',"peer":"' .. ARGV[1] .. '","round":' .. ARGV[2] .. ',"time":' .. now
            .. ',"metrics":' .. ARGV[3] .. '}'
redis.call('ZADD', 'sapo:metrics', int(n), row)
local bytes = redis.call('HINCRBY', 'sapo:mstat', 'bytes', #row)
for _ = 1, 256 do
  if bytes <= tonumber(ARGV[4]) then break end
  local gone = redis.call('ZPOPMIN', 'sapo:metrics')
  if #gone == 0 then break end
  bytes = redis.call('HINCRBY', 'sapo:mstat', 'bytes', -#gone[1])
end
seen(ARGV[1], now, ARGV[2], 0, tonumber(ARGV[5]))
return int(n)"""
# RedisStore._rebuild's steps. REBUILD_LUA puts the writers named in ARGV back into sapo:fresh and sapo:held
# from their own keys -> {their bytes, their groups}; SEAL_LUA then sets the totals (ARGV: bytes, groups) and
# the two markers, unless another server has already.
REBUILD_LUA = _LUA + """local bytes, groups = 0, 0
for _, w in ipairs(ARGV) do
  local d = redis.pcall('LINDEX', 'sapo:w:' .. w .. ':batches', -1)
  local now = type(d) == 'string' and d:match('^%d+ %d+ (%S+) ')
  local held = tonumber(redis.pcall('HGET', 'sapo:w:' .. w .. ':groups', 'held'))
  local count = tonumber(redis.pcall('HGET', 'sapo:w:' .. w .. ':groups', 'count'))
  if now and tonumber(now) and held and count then
    redis.call('ZADD', 'sapo:fresh', now, w)
    redis.call('ZADD', 'sapo:held', int(held), w)
    bytes, groups = bytes + held, groups + count
  end
end
return {int(bytes), int(groups)}"""
SEAL_LUA = """if redis.call('ZSCORE', 'sapo:fresh', '') and redis.call('ZSCORE', 'sapo:held', '')
   and redis.call('EXISTS', 'sapo:kept') == 1 then return 0 end
if #ARGV == 0 then return 1 end
redis.call('HSET', 'sapo:kept', 'bytes', ARGV[1], 'groups', ARGV[2])
redis.call('ZADD', 'sapo:fresh', '-inf', '')
redis.call('ZADD', 'sapo:held', '-inf', '')
return 0"""


class RedisStore:
    """The Store's interface (publish, read, sample, add_metrics, read_metrics, snapshot, close) over Redis,
    so that SwarmServer serves it unchanged and several servers serve one swarm: redis://[USER@]HOST:PORT/DB,
    rediss:// for TLS with one option, ?ssl_ca_certs=FILE; the password in the URL or $SWARM_REDIS_PASSWORD.
    keep_bytes bounds what the kept batches cost (their groups' bytes and Limits.batch_overhead each; give
    every server of a swarm the same). Redis not answering within Limits.redis_seconds, or refusing, is one
    log line while it lasts and a 503 with Retry-After (507 where Redis is out of memory)."""

    def __init__(self, url, keep_bytes=Limits.keep_bytes):
        try:
            import redis
        except ImportError:
            raise ValueError("--redis needs the redis package: pip install redis") from None
        u, shape = urlsplit(url), "--redis must look like redis://HOST:6379/0 (rediss:// for TLS)"
        try:  # (u.port raises ValueError on a port that is no number)
            tls, port, options = u.scheme.lower() == "rediss", u.port, parse_qs(u.query, True)
            _want(u.scheme.lower() in ("redis", "rediss") and u.hostname, shape)
            _want(re.fullmatch(r"/?[0-9]{0,5}", u.path), shape)
        except (ValueError, BadRequest):
            raise ValueError(shape + ".") from None
        if set(options) - {"ssl_ca_certs"} or (options and not tls):
            raise ValueError(f"{shape}: it takes one option, ?ssl_ca_certs=FILE with rediss://, not "
                             f"{', '.join(sorted(options))[:80]}.")
        password = os.environ.get("SWARM_REDIS_PASSWORD") or None
        if u.password is not None and password:
            raise ValueError("give the Redis password in the --redis URL or in $SWARM_REDIS_PASSWORD, "
                             "not both.")
        self.redis = redis.Redis(  # (no retries: a request waits Limits.redis_seconds at most)
            host=u.hostname, port=port or 6379, db=int(u.path.strip("/") or 0), ssl=tls,
            username=unquote(u.username) if u.username else None, protocol=2,
            password=unquote(u.password) if u.password is not None else password,
            socket_timeout=Limits.redis_seconds, socket_connect_timeout=Limits.redis_seconds,
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
            **({"ssl_ca_certs": options["ssl_ca_certs"][-1]} if options else {}))
        self.budget, self.where = keep_bytes, f"{u.hostname}:{port or 6379}"
        self.errors, self.refusal = (redis.RedisError, OSError, ValueError), redis.ResponseError
        self.down = None  # why Redis does not answer, while it does not
        self.rebuilding = threading.Lock()  # one rebuild at a time in this server
        try:
            self.redis.ping()
        except self.errors as e:
            self.redis.close()
            raise ValueError(f"cannot use Redis at {self.where} ({str(e)[:200]}); check --redis, "
                             "$SWARM_REDIS_PASSWORD and that Redis runs.") from None
        self._rebuild()

    def publish(self, peer, round_, batch_id, groups):
        texts = [_dumps({**g, "peer": peer, "round": round_})[:-1] for g in groups]  # the script ends each
        reply = self._script(PUBLISH_LUA, peer, round_, batch_id, self.budget, Limits.replies, Limits.peers,
                             Limits.batch_overhead, Limits.window_seconds, *texts)
        return json.loads(reply)

    def read(self, after, exclude, limit):
        reply = self._script(READ_LUA, after, exclude or "", limit, Limits.page_bytes, Limits.scan_groups,
                             Limits.body_bytes)
        return [text for text in reply[2:] if _servable(text)], int(reply[0]), int(reply[1])

    def sample(self, k, exclude, seed):
        """Store.sample's draw. A group no client could take (_servable) is skipped: the read is drawn again
        (the same seed) passing it over, and so is a read that found stale names before K groups (on the
        cleaner index), while Limits.redis_seconds allow."""
        deadline, skip = time.monotonic() + Limits.redis_seconds, []
        while True:
            reply = self._script(SAMPLE_LUA, k, exclude or "", seed, Limits.page_bytes, Limits.body_bytes,
                                 Limits.window_batches, Limits.window_seconds, Limits.batch_groups,
                                 Limits.scan_groups, *skip)
            drawn = [(b"%s %s" % (name, seq), text, _servable(text)) for name, seq, text in
                     zip(reply[2::3], reply[3::3], reply[4::3])]
            skip += [group for group, _, good in drawn if not good]
            if all(good for *_, good in drawn) and (reply[0] == b"0" or len(drawn) >= k) or \
                    time.monotonic() > deadline:
                return [text for _, text, good in drawn if good], int(reply[1])

    def add_metrics(self, peer, round_, metrics):
        self._script(METRICS_LUA, peer, round_, _dumps(metrics), Limits.metrics_bytes, Limits.peers)

    def read_metrics(self, after):
        """The rows with n > after, a page -> (their JSON texts, the n to go on after, the newest n)."""
        found = self._call(self.redis.zrangebyscore, "sapo:metrics", f"({after}", "+inf", start=0, num=256,
                           withscores=True)
        texts, size, next_n = [], 0, after
        for text, n in found:
            if texts and size + len(text) > Limits.page_bytes:
                break
            next_n = max(next_n, min(int(n), 10**15))
            with contextlib.suppress(BadRequest, ValueError):  # (a row no server wrote is skipped)
                texts.append(_dumps(ROW(parse_json(text))))
                size += len(text) + 1
        newest = self._call(self.redis.hget, "sapo:mstat", "n")
        return texts, next_n, int(newest) if newest and newest.isdigit() else next_n

    def snapshot(self, metrics=False):
        """Store.snapshot's figures: the groups kept, the first and newest seq, the peers (the one seen most
        recently last), and with metrics the dashboard's rows (up to Limits.metrics_bytes of them)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget("sapo:kept", "groups").zrange("sapo:log", 0, 0).get("sapo:seq")
        pipe.zrevrange("sapo:seen", 0, Limits.peers - 1)
        groups, first, last, names = self._call(pipe.execute)
        peers = {}
        rows = self._call(self.redis.hmget, "sapo:peers", names) if names else []
        for name, row in zip(reversed(names), reversed(rows)):
            found = re.fullmatch(rb"([0-9.]{1,30}) ([0-9]{1,13}) ([0-9]{1,16})", row or b"")
            if found and NAME.fullmatch(name.decode("latin-1")):
                peers[name.decode()] = {"last_seen": min(float(found[1]), 1e11), "last_round": int(found[2]),
                                        "groups": int(found[3])}
        rows, after, size = [], 0, 0
        while metrics and size < Limits.metrics_bytes:
            texts, after, newest = self.read_metrics(after)
            rows += [json.loads(text) for text in texts]
            size += sum(map(len, texts))
            if after >= newest or not texts:
                break
        number = (lambda x: int(x) if x and x.isdigit() and int(x) <= 10**15 else 0)
        oldest = (first[0].split(b" ") if first else []) + [b"", b""]  # "LAST FIRST NAME" of the oldest batch
        return {"groups": number(groups), "first_seq": number(oldest[1]), "last_seq": number(last),
                "peers": peers, "metrics": rows}

    def close(self):
        self.redis.close()

    def _script(self, source, *args):
        """Run one of the scripts above -> its reply; first _rebuild where it says an index is missing."""
        reply = self._call(self.redis.eval, source, 0, *args)
        if reply == b"rebuild":
            self._rebuild()
            reply = self._call(self.redis.eval, source, 0, *args)
        return reply

    def _rebuild(self):
        """Put every writer back into the draw and retention indexes from its own keys, found by SCAN (a page
        of keys at a time, so that no call holds Redis for long), if an index or the totals are missing. Until
        they are back, every server's publishes wait, so the totals add up whatever other servers do."""
        with self.rebuilding:
            if self._call(self.redis.eval, SEAL_LUA, 0) == 0:
                return
            cursor, done, totals = 0, set(), [0, 0]
            while True:
                cursor, keys = self._call(self.redis.scan, cursor, match="sapo:w:*:batches", count=1000)
                names = {key[len("sapo:w:"):-len(":batches")] for key in keys} - done
                done |= names
                if names:
                    got = self._call(self.redis.eval, REBUILD_LUA, 0, *names)
                    totals = [totals[0] + int(got[0]), totals[1] + int(got[1])]
                if cursor == 0:
                    break
            self._call(self.redis.eval, SEAL_LUA, 0, *totals)
            _log(f"indexed {len(done)} writers' batches in Redis at {self.where}") if done else None

    def _call(self, command, *args, **kwargs):
        """One Redis exchange -> its reply; or BadRequest, a 503 with Retry-After (507: Redis is out of
        memory), and one log line while the trouble lasts."""
        try:
            reply = command(*args, **kwargs)
        except self.errors as e:
            why, full = f"{type(e).__name__}: {e}"[:300], "OOM" in str(e)
            status, says = (507, "is out of memory") if full else (503, "refuses it") if \
                isinstance(e, self.refusal) else (503, "does not answer")
            if self.down != why:
                self.down = why
                _log(f"Redis at {self.where} {says} ({why}); requests get {status} until it answers")
            raise BadRequest(f"The server's Redis {says}, so nothing was done; send it again in a moment.",
                             status, {"Retry-After": "5"}) from None
        if self.down:
            self.down = None
            _log(f"Redis at {self.where} answers again")
        return reply


def _servable(text):
    """Whether a group read back from Redis is one a client can take: JSON within Limits (else skipped)."""
    try:
        _want(len(text) <= Limits.body_bytes and (len(text) < 2 * Limits.json_values
                                                  or _values(text.decode()) <= Limits.json_values), "")
        return isinstance(json.loads(text, parse_float=_finite, parse_constant=_finite), dict)
    except (BadRequest, ValueError, RecursionError):
        return False


# -----------------------------------------------------------------------------
# HTTP server: an asyncio loop reads requests; worker threads answer them; errors are one JSON sentence.

ROUTES = {"/": "GET", "/health": "GET", "/peers": "GET", "/rollouts": "GET, POST", "/metrics": "GET, POST"}
JSON = "application/json"
BUSY = "The server is busy; send it again in a moment."  # (503, with Retry-After: 1)
Request = collections.namedtuple("Request", "method target body peer")  # peer: _read_request


async def _readline(reader, status, what):  # a line of a request's head; past Limits.line_bytes: `status`
    try:
        return (await reader.readuntil(b"\n")).decode("latin-1")
    except asyncio.LimitOverrunError:
        raise BadRequest(f"{what} is longer than {Limits.line_bytes} bytes.", status) from None


async def _drop_input(reader, most=1 << 20):  # what a refused client still sends: up to 1 MB of it
    while most > 0 and (chunk := await reader.read(1 << 16)):
        most -= len(chunk)


def _loop_error(loop, context):  # (Python 3.11 raises InvalidStateError when a connection meets an
    if not isinstance(context.get("exception"), asyncio.InvalidStateError):  # accept cancelled at shutdown)
        _log(f"{context['message']} {context.get('exception')!r:.200}")


def _unsent(sock):  # bytes written to a socket that its peer has not acknowledged yet (0 where none can tell)
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (AttributeError, OSError, ValueError):
        return 0


def _listed(head, texts, tail):  # a reply's pieces: head, the texts (of a JSON list) comma by comma, tail
    pieces = [head]
    for k, text in enumerate(texts):
        pieces += [b",", text] if k else [text]
    return pieces + [tail]


def _chunks(pieces, size=1 << 16):
    """Byte strings -> their bytes in chunks of `size` (the last one shorter), each copied once, when made."""
    views, have = [], 0  # the parts of the next chunk: views of the pieces, no copies
    for piece in pieces:
        view = memoryview(piece)
        while view:
            views.append(view[:size - have])
            have, view = have + len(views[-1]), view[len(views[-1]):]
            if have == size:
                yield b"".join(views)
                views, have = [], 0
    if views:
        yield b"".join(views)


def _int_param(query, name, default, lowest, highest):
    value = query.get(name, [str(default)])[-1]
    _want(re.fullmatch(r"[0-9]{1,19}", value) and lowest <= int(value) <= highest,
          f"{name} must be a whole number from {lowest} to {highest}.")
    return int(value)


class SwarmServer:
    """The HTTP side of the store. One asyncio loop (in a thread) reads each request whole under a deadline,
    so a slow or idle connection costs a buffer, not a thread; worker threads answer whole requests. A
    request's way: _accept, _connection (_read_request, _answered, _send, _hang_up). credentials:
    credentials()'s. What requests hold is bounded apart for writers and readers: request bodies count in
    self.in_flight (one at a time per per-peer credential), replies made for a request in self.replying,
    and a page of groups is sent from the texts the store holds, 64 KB at a time (_chunks)."""

    def __init__(self, store, host, port, credentials=None, public_reads=False, verbose=False, score=None):
        self.store, self.credentials = store, credentials
        self.public_reads, self.verbose = public_reads, verbose
        self.score = score  # (group, completion) -> its reward, which the dashboard shows; None: none shown
        self.listener = socket.create_server((host, port), backlog=Limits.backlog,
                                             family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.listener.setblocking(False)
        self.server_address = self.listener.getsockname()
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if resource else -1  # -1: none; 64 for files
        self.max_connections = max(4, min(Limits.connections, soft - 64)) if soft > 0 else Limits.connections
        self.open, self.waiting = set(), {}  # every connection; those that may be closed for a new one ->
                                             # 0 if idle or sending a head, 1 if sending a body (in order)
        self.in_flight = 0                   # bytes of request bodies held right now (Limits.in_flight_bytes)
        self.replying = 0                    # bytes of replies made for a request, held (Limits.made_bytes)
        self.pools = {method: ThreadPoolExecutor(Limits.workers, thread_name_prefix=f"swarm-{method}")
                      for method in ("GET", "POST")}
        self.large = threading.Lock()        # held while a large body is answered: see Limits.body_bytes
        self.turns = weakref.WeakValueDictionary()  # writer -> the lock its POSTs take turns on, body and all
        self.posting = asyncio.Semaphore(Limits.workers)  # POSTs being answered; its waiters: one per writer
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_loop_error)
        self.accepting = self.loop.create_task(self._accept())
        self.thread = threading.Thread(target=self.loop.run_forever, name="swarm-server", daemon=True)
        self.thread.start()

    async def _accept(self):
        """One connection at a time, so the cap holds. At the cap, or out of descriptors, _evict closes one for
        it; with none to close, a new connection is refused, and accept() pauses, never spins."""
        while True:
            try:
                sock, _ = await self.loop.sock_accept(self.listener)
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE) or not self._evict():
                    _log(f"cannot accept connections for now ({e.strerror}); trying again in 1 s")
                    await asyncio.sleep(1)
                await asyncio.sleep(0)  # let an evicted connection close, giving its descriptor back
                continue
            if len(self.open) >= self.max_connections and not self._evict():
                sock.close()  # every connection is being answered: this one must go
                continue
            await asyncio.sleep(0)
            try:  # (a small send buffer: what a reader that never reads leaves in the kernel)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, Limits.send_buffer)
                reader, writer = await asyncio.open_connection(sock=sock, limit=Limits.line_bytes)
            except OSError:
                sock.close()
                continue
            self.open.add(writer)
            self.loop.create_task(self._connection(reader, writer))

    def _evict(self):
        """Close the oldest of those idle or sending a head (which proves nothing, not even the token), else
        of those sending a body -> False if there is none."""
        if not self.waiting:
            return False
        writer = min(self.waiting, key=self.waiting.get)  # the first of the lowest rank
        self.open.discard(writer)  # at once, so that a burst never picks it twice
        del self.waiting[writer]
        writer.transport.abort()
        return True

    async def _connection(self, reader, writer):
        """One request per connection (nothing rides behind a body), read whole under the deadline, answered,
        closed. The body counts in self.in_flight, and a POST holds its writer's turn, until it is answered."""
        writer.transport.set_write_buffer_limits(0)  # so that drain() returns once the reply has left
        self.waiting[writer], body, turn, reply = 0, bytearray(), [], []  # turn: the writer's lock, once held
        try:
            try:
                seconds = Limits.request_seconds
                request = await asyncio.wait_for(self._read_request(reader, writer, body, turn), seconds)
            except asyncio.TimeoutError:
                raise BadRequest(f"The request did not arrive whole within {seconds:g} s.", 408) from None
            reply += await self._answered(request)  # status, content type, body, headers
            self._give_back(body, turn)
            await self._send(writer, *reply, head_only=request.method == "HEAD")
            if self.verbose:
                who = writer.get_extra_info("peername")
                _log(f"{who} {request.method} {request.target[:200]} {reply[0]}")
        except BadRequest as e:  # the rest of the request is unread: answer, then close
            self.waiting[writer] = 0  # first to go while it lingers, holding no body
            self._give_back(body, turn)
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await self._send(writer, *e.reply)
                writer.write_eof()  # and read what the client still sends for a moment, so that
                await asyncio.wait_for(_drop_input(reader), 2.0)  # closing does not reset it before it reads
        except (OSError, EOFError, asyncio.TimeoutError):
            pass  # a client that hangs up, idles or stops reading its reply is not news
        finally:
            self._give_back(body, turn)
            reply.clear()  # (a page of groups holds texts that retention may prune meanwhile)
            if writer in self.open:
                self.waiting[writer] = 0  # while its reply drains: first to go at the cap
                await self._hang_up(writer)
            self.open.discard(writer)
            self.waiting.pop(writer, None)
            writer.transport.abort()

    async def _answered(self, request):
        """A request's answer from a worker thread: Limits.workers GETs and as many POSTs at a time."""
        if request.method != "POST":
            return await self.loop.run_in_executor(self.pools["GET"], self._answer, request)
        async with self.posting:
            return await self.loop.run_in_executor(self.pools["POST"], self._answer, request)

    async def _take_turn(self, peer, turn):
        """A POST of a per-peer credential waits for its writer's turn before its body is read: one POST of
        each at a time, so one writer's many or slow bodies cost that writer alone, never the bodies' shared
        budget nor another's turn. Without one, writers cannot be told apart (an address may be a proxy's):
        first come, first served."""
        lock = self.turns.setdefault(peer, asyncio.Lock())
        await lock.acquire()
        turn.append(lock)  # (no await between: a deadline that cancels the wait leaves nothing held)

    def _give_back(self, body, turn):  # what a request holds, once answered: its body's bytes, its turn
        self.in_flight -= len(body)
        body.clear()
        while turn:
            turn.pop().release()

    async def _hang_up(self, writer):
        """Close once the kernel has delivered the reply, or at the deadline with a reset (SO_LINGER 0), so no
        reply its reader never takes stays in the kernel for minutes, as an orphaned socket's would."""
        sock, deadline = writer.get_extra_info("socket"), time.monotonic() + Limits.request_seconds
        while _unsent(sock) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if _unsent(sock):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    async def _read_request(self, reader, writer, body, turn):
        """The request line, the headers and the body (into `body`) -> Request. Strict: no request reads
        differently in a proxy in front. The credential is checked, and a POST takes its writer's turn, before
        the body is read, which counts in self.in_flight as it arrives: a sender who only declares a length
        costs nothing, and a GET, which may need no credential (--public-reads), has none."""
        if (first := await reader.read(1)) in (b"", b"\x16"):  # gone, or TLS (this server speaks plain HTTP)
            raise EOFError("no request")
        line = first.decode("latin-1") + await _readline(reader, 414, "The request line")
        parts = re.fullmatch(r"([!-~]+) ([!-~]+) HTTP/1\.[01]\r?\n", line)
        _want(parts, "This server speaks plain HTTP/1.1 and did not understand the request line.")
        method, target = parts.groups()
        headers, lines = {}, 0
        while (line := await _readline(reader, 431, "A header line")) not in ("\r\n", "\n"):
            lines += 1
            most = Limits.header_lines
            _want(lines <= most, f"The request has more than {most} header lines.", 431)
            header = re.fullmatch(r"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*(.*?)[ \t]*\r?\n", line)
            _want(header, "Each header line must be 'Name: value'.")
            name = header[1].lower()  # a name given twice has both values, as RFC 9110 combines them
            headers[name] = f"{headers[name]}, {header[2]}" if name in headers else header[2]
        peer = None  # the name the credential writes as; None: any (the shared token, or no credentials)
        if self.credentials and (method != "GET" or not self.public_reads):  # public reads: GETs need none
            scheme, _, given = headers.get("authorization", "").partition(" ")  # (looked up by digest, so
            given = hashlib.sha256(given.strip().encode("latin-1")).digest()  # its timing tells nothing)
            peer = self.credentials.get(given, "") if scheme.lower() == "bearer" else ""
            _want(peer != "", "This server needs the header 'Authorization: Bearer <token>'; pass the swarm "
                  "token.", 401, {"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length", "0")
        _want("transfer-encoding" not in headers and (method != "POST" or "content-length" in headers),
              "A POST needs a Content-Length header (no chunked bodies).", 411)
        _want(re.fullmatch(r"[0-9]{1,12}", length), "Content-Length must be a whole number.")
        most = Limits.body_bytes
        _want(int(length) <= most, f"The body is {length} bytes; the limit is {most}.", 413)
        _want(method not in ("GET", "HEAD") or int(length) == 0, f"A {method} has no body here.")
        self.waiting[writer] = 1  # sending its body: evicted after those that sent no head yet
        if method == "POST" and peer:
            await self._take_turn(peer, turn)
        if int(length) and headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while len(body) < int(length):
            chunk = await reader.read(min(1 << 16, int(length) - len(body)))
            if not chunk:
                raise EOFError("the client hung up")
            if self.in_flight + len(chunk) > Limits.in_flight_bytes:
                raise BadRequest(BUSY, 503, {"Retry-After": "1"})
            self.in_flight += len(chunk)  # given back by _connection once it is answered
            body += chunk
        self.waiting.pop(writer, None)
        return Request(method, target, body, peer)

    async def _send(self, writer, status, content_type, body, headers=None, head_only=False):
        """A reply within the deadline (a reader too slow is cut off), 64 KB at a time. body: bytes made for
        it, which count in self.replying (a 503 past Limits.made_bytes), or a list of texts the store
        holds (a page of groups), sent as they are: a reader that does not read holds 64 KB here at most."""
        made = len(body) if isinstance(body, bytes) else 0
        if made > 65536 and self.replying + made > Limits.made_bytes:
            busy = BadRequest("The server is busy; ask again in a moment.", 503, {"Retry-After": "1"})
            (status, content_type, body, headers), made = busy.reply, 0
        pieces = [body] if isinstance(body, bytes) else body
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n" \
               f"Content-Length: {sum(map(len, pieces))}\r\n{extra}Connection: close\r\n\r\n"
        self.replying += made
        try:
            deadline = time.monotonic() + Limits.request_seconds
            for chunk in _chunks([head.encode()] + ([] if head_only else pieces)):
                writer.write(chunk)
                chunk = None  # (what the kernel did not take waits in the transport's buffer alone)
                await asyncio.wait_for(writer.drain(), deadline - time.monotonic())
        finally:
            self.replying -= made

    def _answer(self, request):  # (in a worker thread) a request -> (status, content type, body, headers)
        try:
            path, _, query = request.target.partition("?")
            _want(path.startswith("/"), "The request target must be a path such as /rollouts.")
            allowed = ROUTES.get(path)
            _want(allowed, f"There is no {path[:80]} here; the paths are {', '.join(ROUTES)}.", 404)
            _want(request.method in allowed.split(", "),
                  f"{path} accepts only {allowed}, not {request.method[:20]}.", 405, {"Allow": allowed})
            _want(query.count("&") < 16, "The query string has too many fields.")
            q = parse_qs(query, keep_blank_values=True)
            with self.large if len(request.body) > Limits.body_bytes // 8 else contextlib.nullcontext():
                reply = self._route(request.method, path, q, request.body, request.peer)
            return 200, "text/html; charset=utf-8" if path == "/" else JSON, reply, {}
        except BadRequest as e:
            return e.reply
        except Exception as e:
            if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):  # the sender keeps its data: later
                full = "The server's disk is full, so nothing was stored; send it again later."
                return BadRequest(full, 507).reply
            if getattr(e, "errno", None) in (errno.EMFILE, errno.ENFILE):
                return BadRequest(BUSY, 503, {"Retry-After": "1"}).reply
            _log(f"unexpected error in {request.method[:20]} {request.target[:200]}: {e!r:.300}")
            return BadRequest("The server hit an unexpected error; it was logged and the server keeps "
                              "serving.", 500).reply

    def _route(self, method, path, q, body, peer):
        """A request for one of ROUTES (a write: by `peer`'s credential) -> the reply's bytes, or for a page of
        groups or metrics rows, the list of its pieces (_listed): they are kept as JSON text, never copied."""
        if method == "POST":
            b = (PUBLISH if path == "/rollouts" else METRICS)(parse_json(body))
            _want(peer in (None, b["peer"]),
                  f"This credential is peer {peer}'s; it cannot write as {b['peer']}.", 403)
            if path == "/metrics":
                self.store.add_metrics(b["peer"], b["round"], b["metrics"])
                return b'{"ok":true}'
            return _dumps(self.store.publish(b["peer"], b["round"], b["batch_id"], b["groups"]))
        if path == "/metrics":
            texts, next_n, last_n = self.store.read_metrics(_int_param(q, "after", 0, 0, 10**15))
            return _listed(b'{"metrics":[', texts, b'],"next":%d,"last":%d}' % (next_n, last_n))
        if path == "/rollouts":
            exclude = q.get("exclude", [""])[-1].lower()
            _want(not exclude or NAME.fullmatch(exclude), f"exclude must be a peer name: {NAMES}.")
            if "sample" in q:  # a sampled read: K groups of the recent window
                k = _int_param(q, "sample", 1, 1, Limits.sample_groups)
                texts, last_seq = self.store.sample(k, exclude, _int_param(q, "seed", 0, 0, 2**63 - 1))
                return _listed(b'{"groups":[', texts, b'],"last":%d}' % last_seq)
            texts, next_seq, last_seq = self.store.read(_int_param(q, "after", 0, 0, 10**15), exclude,
                                                        _int_param(q, "limit", 256, 1, Limits.page_groups))
            return _listed(b'{"groups":[', texts, b'],"next":%d,"last":%d}' % (next_seq, last_seq))
        snap = self.store.snapshot(metrics=path == "/")
        if path == "/health":
            return _dumps({"ok": True, "groups": snap["groups"], "peers": len(snap["peers"]),
                           "last_seq": snap["last_seq"]})
        if path == "/peers":
            return _dumps({"peers": snap["peers"]})
        newest = self.store.read(max(0, snap["last_seq"] - 64), None, 64)[0]  # the dashboard: the newest
        return render_page(snap, [json.loads(t) for t in newest], self.score).encode()

    def shutdown(self):
        """Stop serving: close the listener and every connection, let running answers finish, close the store."""
        async def stop():
            self.accepting.cancel()
            self.listener.close()
            for writer in list(self.open):
                writer.transport.abort()
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            if tasks:  # each ends on its own once its connection is gone (or its answer is done)
                await asyncio.wait(tasks, timeout=Limits.request_seconds)

        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        for pool in self.pools.values():
            pool.shutdown(wait=True)
        self.loop.close()
        self.store.close()


def check_token(token, what="the swarm token"):  # -> None, or 1 to 256 visible ASCII characters (a header's)
    if token and not re.fullmatch(r"[!-~]{1,256}", token):
        raise ValueError(f"{what} must be 1 to 256 printable ASCII characters without spaces.")
    return token or None


def credentials(token=None, peers=None):
    """The shared token and per-peer tokens ({name: token}) -> {SHA-256 of a token: the name it writes as, or
    None (the shared token: any)}; or ValueError: each name once (in lower case, as stored), each token one's."""
    table, names = {hashlib.sha256(check_token(token).encode()).digest(): None} if token else {}, set()
    for name, secret in (peers or {}).items():
        if not isinstance(name, str) or not NAME.fullmatch(name) or name.lower() in names:
            raise ValueError(f"the peer name {str(name)[:80]!r} must be {NAMES}, and given once.")
        secret = check_token(secret if isinstance(secret, str) and secret else " ", f"peer {name}'s token")
        digest = hashlib.sha256(secret.encode()).digest()
        if digest in table:
            raise ValueError(f"peer {name}'s token is another's too; give each peer a token of its own.")
        table[digest] = name.lower()
        names.add(name.lower())
    return table


def read_peers(path):
    """A --peers-file -> {name: token}: one 'name token' a line (blank and '#' lines skipped), else ValueError."""
    try:
        with open(path, encoding="latin-1") as f:
            lines = f.read(Limits.body_bytes).splitlines()
        rows = [line.split() for line in lines if line.strip()[:1] not in "#"]
    except OSError as e:
        raise ValueError(f"cannot read --peers-file {path} ({e.strerror or e}).") from None
    if not rows or any(len(row) != 2 for row in rows) or len(dict(rows)) < len(rows):
        raise ValueError(f"--peers-file {path} must hold one 'name token' a line, each name once.")
    return dict(rows)


def start_server(dir, host="127.0.0.1", port=0, token=None, keep_bytes=Limits.keep_bytes,
                 public_reads=False, verbose=False, peers=None, score=None, redis=None):
    """Start a server in a daemon thread -> (server, "http://host:port"); server.shutdown() stops it. With a
    token or peers ({name: token}) every request needs one (GETs not, with public_reads), and a peer's token
    writes only as that peer (403). score(group, completion), which never raises: the rewards the dashboard
    shows (train.py's launcher passes reward.score). redis: a Redis URL, whose store replaces the folder dir
    (RedisStore). Bad settings: ValueError."""
    table = credentials(token, peers)
    if not isinstance(keep_bytes, int) or keep_bytes < 1:
        raise ValueError("--keep-bytes must be a size of at least 1 byte.")
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError("--port must be a whole number from 0 to 65535.")
    store = RedisStore(redis, keep_bytes) if redis else RolloutStore(dir, keep_bytes)
    try:
        server = SwarmServer(store, host, port, table, public_reads, verbose, score)
    except OSError as e:
        store.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}); "
                         "choose another --host or --port.") from None
    return server, f"http://{f'[{host}]' if ':' in host else host}:{server.server_address[1]}"


# -----------------------------------------------------------------------------
# The client's transports: a Store in this process, or a swarm.py server over HTTP.

def connect(url, peer, sample, token=None, **state):
    """A started Client of the swarm.py server at url (http:// or https://). sample: K; token: the server's
    credential (None: $SWARM_TOKEN); state: the read state (seed, round, seen). The client's bounds are Limits'."""
    if not isinstance(peer, str) or not NAME.fullmatch(peer):
        raise ValueError(f"peer must be a name of {NAMES}.")
    if type(sample) is not int or not 1 <= sample <= Limits.sample_groups:
        raise ValueError(f"sample must be a whole number from 1 to {Limits.sample_groups}.")
    if re.match(r"rediss?://", str(url), re.I):  # (the URL itself is not repeated: it may hold a password)
        raise ValueError(REDIS_PEER)
    transport = HttpTransport(str(url), peer, os.environ.get("SWARM_TOKEN") if token is None else token)
    return Client(peer, transport, sample, **state, seen_cap=Limits.seen_seqs, inbox_cap=Limits.inbox_bytes,
                  outbox_cap=Limits.outbox_bytes, body_cap=Limits.body_bytes)


REDIS_PEER = ("a peer joins a swarm over HTTP only: start a server with python swarm.py --redis "
              "redis://HOST:6379/0 and join it with its http://HOST:PORT")


class LocalTransport:
    """A Store in this process as a Client's transport. Every transport has these four calls; a call in
    trouble raises OSError (try later) or Refused (the store will never take this)."""

    def __init__(self, store, peer):
        self.store = store        # the Store the exchanges go to
        self.peer = peer.lower()  # the name the store keeps this peer's batches under (names ignore case)

    def publish(self, round_, texts, batch_id):
        return self.store.publish(self.peer, round_, batch_id, [json.loads(text) for text in texts])

    def post_metrics(self, round_, texts):  # a Store keeps no metrics: they are the server's dashboard's
        pass

    def sample(self, k, seed):
        return [(json.loads(text), len(text)) for text in self.store.sample(k, self.peer, seed)[0]]

    def close(self):
        pass


class _Transport:
    """A remote store's transport: the peer's name (lower-cased: `name`) and the checks of what the store
    says. Its calls are LocalTransport's, and they also raise BadRequest for "no usable answer now, try
    later"; sample() hands back only the groups it could check, with their bytes."""
    def __init__(self, peer):
        self.peer, self.name, self.said, self.closed = peer, peer.lower(), None, False

    def _received(self, groups):
        """Groups as a store sent them -> [(clean group, bytes)]; a bad one is dropped alone, said once."""
        good, bad = [], []
        for g in groups:
            try:
                g = STORED(g, "a received group")
                good.append((g, len(_dumps(g))))
            except (BadRequest, ValueError) as e:  # (ValueError: a lone surrogate, which UTF-8 cannot carry)
                bad.append(getattr(e, "message", str(e)))
        if bad and bad[0] != self.said:
            self.said = bad[0]
            _log(f"dropped {len(bad)} malformed groups from the server (the first: {bad[0][:200]})",
                 self.peer)
        return good

    def _acknowledged(self, reply, groups, where):  # a reply to a publish -> it, if it says all were stored
        _want(isinstance(reply, dict) and reply.get("accepted") == groups, f"{where} acknowledges nothing")
        return fields({"accepted": number(groups), "seq": SEQ})(reply, where)


class HttpTransport(_Transport):
    """A swarm.py server's side of the exchanges, through requests, under a deadline, every reply checked. It
    sends only where told: no redirect is followed, no credential but its token goes (no ~/.netrc), and of the
    environment only the proxies (HTTP_PROXY, HTTPS_PROXY, NO_PROXY) and a REQUESTS_CA_BUNDLE count."""

    def __init__(self, url, peer, token):
        super().__init__(peer)
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"the swarm URL must look like http://HOST:PORT, not {url[:80]!r}.")
        token, self.sockets = check_token(token), {}  # thread -> the sockets of its exchange (writer, reader)
        self.url, self.session = u.geturl().rstrip("/"), requests.Session()
        self.session.trust_env, self.session.proxies = False, requests.utils.get_environ_proxies(self.url)
        self.session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
        headers = {"Content-Type": JSON, "Connection": "close", "Accept-Encoding": "identity"}
        self.session.headers.update({**headers, **({"Authorization": f"Bearer {token}"} if token else {})})
        for scheme in ("http://", "https://"):
            self.session.mount(scheme, _Adapter(self))

    def publish(self, round_, texts, batch_id):
        reply = self._call("/rollouts", b'{"peer":%s,"round":%d,"batch_id":%s,"groups":[%s]}' % (
            _dumps(self.peer), round_, _dumps(batch_id), b",".join(texts)))
        return self._acknowledged(reply, len(texts), "a reply to /rollouts")

    def post_metrics(self, round_, texts):
        row = b'{"peer":%s,"round":%d,"metrics":%s}' % (_dumps(self.peer), round_, texts[0])
        reply = self._call("/metrics", row)
        _want(isinstance(reply, dict) and reply.get("ok") is True, "a reply to /metrics acknowledges nothing")

    def sample(self, k, seed):
        reply = self._call(f"/rollouts?sample={k}&exclude={self.peer}&seed={seed}")
        return self._received(SAMPLE(reply, "the reply to /rollouts")["groups"][:k])

    def close(self):
        self.closed = True
        for sockets in list(self.sockets.values()):
            _shut(sockets)
        self.session.close()

    def _call(self, path, body=None):
        """One HTTP exchange, a POST of body (else a GET) -> the JSON of a 200. A 400, 413 or 422 is Refused for
        a POST (the same bytes would be refused again), an OSError for a GET (a proxy's). Any other status (said
        with its likely cause), or no whole reply within Limits.request_seconds (a timer shuts the socket:
        requests bounds each read, not a reply), is an OSError. A 200 is BadRequest unless it is JSON within
        Limits.reply_bytes and json_values values: parsing holds the interpreter lock, and with it training."""
        if self.closed:
            raise ConnectionError("the client is closing")
        deadline, reply = time.monotonic() + Limits.request_seconds, bytearray()
        sockets = self.sockets[threading.get_ident()] = []  # (the client's two threads call at once)
        timer = threading.Timer(Limits.request_seconds, _shut, [sockets])
        timer.start()
        try:
            method = "GET" if body is None else "POST"
            with self.session.request(method, self.url + path, data=body, stream=True, allow_redirects=False,
                                      timeout=Limits.request_seconds) as r:
                for chunk in r.iter_content(1 << 16):
                    reply += chunk
                    if len(reply) > Limits.reply_bytes:
                        break
        except (OSError, ValueError) as e:  # (requests' errors are OSErrors too)
            reply = e
        finally:
            timer.cancel()
            for sock in sockets:  # the duplicates _Adapter made
                sock.close()
        late = time.monotonic() > deadline  # (cut short by the timer?)
        if late or self.closed or isinstance(reply, Exception):
            why = "no whole reply in time" if late else _reason(reply)
            raise ConnectionError(f"server unreachable ({why})")
        if (status := r.status_code) != 200 and not 400 <= status < 500 or status in (408, 429):
            where = r.headers.get("Location", "")[:100]
            moved = f", a redirect to {where!r}, which this client does not follow" * (300 <= status < 400)
            raise ConnectionError(f"server unreachable (HTTP {status}{moved})")
        try:
            _want(len(reply) <= Limits.reply_bytes, f"a reply of more than {Limits.reply_bytes} bytes")
            reply = parse_json(reply, surrogates=True)
        except BadRequest as e:
            if status == 200:
                raise BadRequest(f"a reply it cannot use ({e.message[:200]})") from None
            reply = None
        if status not in (200, 400, 413, 422):
            raise ConnectionError(f"HTTP {status} from {self.url}{path.partition('?')[0]}: "
                                  f"{_REFUSED.get(status) or _said(reply)}")
        if status != 200:
            raise (ConnectionError if body is None else Refused)(f"HTTP {status}: {_said(reply)}")
        return reply


class _Adapter(requests.adapters.HTTPAdapter):
    """requests' own, but each connection it opens joins its thread's transport.sockets, which the deadline and
    close() shut."""
    def __init__(self, transport):
        super().__init__()
        self.transport = transport

    def get_connection_with_tls_context(self, *args, **kwargs):
        pool, transport = super().get_connection_with_tls_context(*args, **kwargs), self.transport
        if "ConnectionCls" not in vars(pool):  # once per pool: its ConnectionCls makes every connection
            class Connection(pool.ConnectionCls):
                def _new_conn(self):  # the TCP socket before any TLS handshake (which takes the object over,
                    sock = super()._new_conn()  # so a duplicate descriptor): a stalled handshake is cut too
                    sockets = transport.sockets[threading.get_ident()]
                    sockets.append(sock.dup())
                    if transport.closed:
                        _shut(sockets)
                    return sock
            pool.ConnectionCls = Connection
        return pool


def _shut(sockets):  # end an exchange at once, from another thread
    for sock in list(sockets):
        with contextlib.suppress(OSError):  # (it had just ended)
            sock.shutdown(socket.SHUT_RDWR)


_REFUSED = dict.fromkeys((401, 403), "this peer's token is not the server's: pass it with --token or "
                         "$SWARM_TOKEN")
_REFUSED[404] = "is that the swarm server's URL, or does a proxy send it elsewhere?"  # (the likely causes)


def _reason(e):  # the words that matter in requests' long messages ("Connection refused")
    found = re.findall(r"\[Errno -?\d+\] ([^'\"()\[\]]+)|(Read timed out|Connection aborted)", str(e))
    return "".join(found[-1]).strip() if found else type(e).__name__


def _said(data):  # the one sentence of an error reply, cut short (_log escapes any lone surrogate)
    return str(data.get("error"))[:200] if isinstance(data, dict) else "(no message)"


# -----------------------------------------------------------------------------
# Dashboard: an SVG line chart, and one self-contained HTML page.

COLOURS = "#1f77b4 #ff7f0e #2ca02c #d62728 #9467bd #8c564b #e377c2 #7f7f7f #bcbd22 #17becf".split()


def _ticks(lo, hi, least=0):
    """Round numbers from lo to hi, three to eight: multiples of 1, 2 or 5 times a power of ten, and of least."""
    step = 10.0 ** math.floor(math.log10((hi - lo) / 8))
    step = max(least, next(step * m for m in (1, 2, 5, 10) if (hi - lo) / (step * m) < 8))
    return [round(k * step, 9) for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def render_svg(series, title="reward per round", ylabel="reward", xlabel="round", width=760, height=360,
               bands=None, hline=None, mean_over=5):
    """{name: [(round, value), ...]} -> a standalone SVG document (a string) with one line per name: each
    point a faint dot, and the line the running mean over `mean_over` points (0: the points themselves).
    bands: {name: [(round, low, high), ...]}, shaded in that line's colour; hline: a dashed level."""
    left, top, plot_w, plot_h = 60, 34, width - 230, height - 80  # margins for the axes and the legend
    lines = {name: sorted((x, y) for x, y in pts if _sane(x) and _sane(y))
             for name, pts in sorted(series.items())}
    lines = {name: pts for name, pts in lines.items() if pts}
    bands = {name: [b for b in band if all(map(_sane, b))]
             for name, band in (bands or {}).items() if name in lines}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} '
           f'{height}" font-family="sans-serif" font-size="12"><rect width="{width}" height="{height}" '
           'fill="white"/>',
           f'<text x="{left + plot_w / 2}" y="20" text-anchor="middle" font-size="14">{html.escape(title)}'
           '</text>']
    if not lines:
        return "\n".join(out + [f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" text-anchor="middle" '
                                'fill="#888">no data yet</text></svg>'])
    xs, ys = [x for pts in lines.values() for x, _ in pts], [y for pts in lines.values() for _, y in pts]
    ys += [y for band in bands.values() for _, low, high in band for y in (low, high)]
    ys += [hline] * _sane(hline)
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    pad = (max(ys) - min(ys)) * 0.05 or 0.5
    y0, y1 = min(ys) - pad, max(ys) + pad

    def px(x):  # data to pixels
        return left + (x - x0) / (x1 - x0) * plot_w

    def py(y):
        return top + (y1 - y) / (y1 - y0) * plot_h

    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>')
    whole = all(x == int(x) for x in xs)
    for xv in _ticks(x0, x1, least=1 if whole else 0):  # rounds along the bottom (whole ones, if all are)
        out.append(f'<text x="{px(xv):.1f}" y="{top + plot_h + 18}" text-anchor="middle">{xv:g}</text>')
    for yv in _ticks(y0, y1):  # values up the side, with grid lines
        y = py(yv)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{yv:g}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle">{html.escape(xlabel)}'
               f'</text><text x="16" y="{top + plot_h / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {top + plot_h / 2})">{html.escape(ylabel)}</text>')
    if _sane(hline):
        out.append(f'<line x1="{left}" y1="{py(hline):.1f}" x2="{left + plot_w}" y2="{py(hline):.1f}" '
                   'stroke="#888" stroke-dasharray="5,4"/>')
    for k, (name, pts) in enumerate(lines.items()):
        legend = (left + plot_w, top + 10 + 18 * k)
        out += _svg_line(name, pts, bands.get(name, []), COLOURS[k % len(COLOURS)], px, py, mean_over, legend)
    return "\n".join(out + ["</svg>"])


def _svg_line(name, pts, band, colour, px, py, mean_over, legend):
    """One line of render_svg's chart -> its SVG elements: the band, the dots and the running mean through
    them (or the points themselves), and its entry in the legend, whose row starts at legend (x, y)."""
    lx, ly = legend
    out, edge = [], [(x, high) for x, _, high in band] + [(x, low) for x, low, _ in band[::-1]]
    if edge:
        out.append(f'<polygon fill="{colour}" fill-opacity="0.15" stroke="none" points="'
                   + " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in edge) + '"/>')
    if mean_over and len(pts) > 1:  # each point a dot, and the running mean through them
        out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2" fill="{colour}" fill-opacity="0.5"/>'
                for x, y in pts[::max(1, len(pts) // 500)]]
        pts = [(x, sum(y for _, y in pts[max(0, i + 1 - mean_over):i + 1]) / min(i + 1, mean_over))
               for i, (x, _) in enumerate(pts)]
    pts = pts[::max(1, len(pts) // 2000)]  # a chart needs no more than ~2000 points a line
    if len(pts) == 1:
        out.append(f'<circle cx="{px(pts[0][0]):.1f}" cy="{py(pts[0][1]):.1f}" r="3" fill="{colour}"/>')
    else:
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>')
    out.append(f'<line x1="{lx + 12}" y1="{ly}" x2="{lx + 32}" y2="{ly}" stroke="{colour}" stroke-width="3"/>'
               f'<text x="{lx + 38}" y="{ly + 4}">{html.escape(name[:24])}</text>')
    return out


def render_page(snap, groups=(), score=None):
    """The dashboard: local_reward per round of the 10 peers seen most recently, each one's newest completions
    among `groups` (escaped; with score(group, completion), their rewards), and a table of rounds done, as bars
    count, and of the model each one's newest group names."""
    series, last, drawn = {}, {}, list(snap["peers"])[-len(COLOURS):]
    for row in snap["metrics"]:  # later rows for the same round (after a resume) replace earlier ones
        if row["peer"] in drawn and row["metrics"].get("local_reward") is not None:
            series.setdefault(row["peer"], {})[row["round"]] = row["metrics"]["local_reward"]
        last.setdefault(row["peer"], {}).update(row["metrics"], done=row["round"] + 1)  # (rounds done)
    chart = render_svg({p: sorted(s.items()) for p, s in series.items()},
                       title="local_reward per round (dots), mean of the last 5 rounds (lines)")
    newest = {g["peer"]: g for g in groups if g["peer"] in drawn}  # the last group of each peer wins
    said = ""
    for p, g in sorted(newest.items()):  # its question, and its first two completions
        said += f"<h3>{html.escape(p)}, round {g['round']}: {html.escape(g['question'][:300])}</h3>"
        for c in g["completions"][:2]:
            said += f"<pre>{f'reward {score(g, c):g}: ' if score else ''}{html.escape(c[:500])}</pre>"
    rows, models = [], {g["peer"]: g.get("model", "") for g in groups}
    for peer, info in sorted(snap["peers"].items()):
        m = last.get(peer, {})
        cells = "".join(f"<td>{'' if m.get(k) is None else f'{m[k]:.3f}'}</td>"
                        for k in ("local_reward", "batch_reward"))
        seen = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info["last_seen"]))
        rows.append(f"<tr><td>{html.escape(peer)}</td><td>{html.escape(models.get(peer, ''))}</td>"
                    f"<td>{m.get('done', '')}</td><td>{info['groups']}</td>{cells}<td>{seen}</td></tr>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>nanoSAPO swarm</title>
<script>setInterval(async () => {{  // every 5 s the page's body anew, where the reader has scrolled to
  const page = await fetch(location.href, {{cache: "no-store"}}).catch(() => null);
  if (page && page.ok) document.body.innerHTML = new DOMParser().parseFromString(
    await page.text(), "text/html").body.innerHTML;
}}, 5000);</script>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}} h3{{font-size:1em}}
td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}} td:first-child{{text-align:left}}
pre{{white-space:pre-wrap;background:#f4f4f4;padding:4px;margin:2px 0}}</style>
</head><body><h1>nanoSAPO swarm</h1>
<p>{snap['groups']} groups kept (seq {snap['first_seq']} to {snap['last_seq']}), {len(snap['peers'])} peers.</p>
<div style="display:flex;gap:2em;align-items:flex-start">{chart}<div>{said or "no completions yet"}</div></div>
<table><tr><th>peer</th><th>model</th><th>rounds done</th><th>groups published</th><th>last local_reward</th>
<th>last batch_reward (the paper's training-batch figure)</th><th>last seen</th></tr>
{"".join(rows)}
</table></body></html>"""


# -----------------------------------------------------------------------------
# Command line: python swarm.py --dir swarm_data --host 127.0.0.1 --port 8000 [--token-file FILE] [--redis URL]

def _size(text):
    """'256M' -> 268435456: a byte count with an optional K, M or G."""
    found = re.fullmatch(r"([0-9]{1,15})([KMG]?)B?", text.strip().upper())
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 256M")
    return int(found.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[found.group(2)]


def main(argv=None):
    parser = argparse.ArgumentParser(description="nanoSAPO swarm rollout server (see the docstring of "
                                     "swarm.py).", epilog=f"Peer names are {NAMES}.")
    parser.error = lambda message: parser.exit(2, f"swarm.py: {message}; see python swarm.py --help.\n")
    parser.add_argument("--dir", default="swarm_data",
                        help="batch folder, made if missing (default: %(default)s)")
    parser.add_argument("--redis", metavar="URL", help="keep the batches in Redis instead of --dir, so that "
                        "several servers serve one swarm: redis://HOST:6379/0 (rediss:// for TLS); the password "
                        "in the URL or $SWARM_REDIS_PASSWORD")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on, 0.0.0.0: any (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000,
                        help="port to listen on, 0: any (default: %(default)s)")
    parser.add_argument("--token", default=os.environ.get("SWARM_TOKEN"), help="require 'Authorization: "
                        "Bearer TOKEN' on every request (default: $SWARM_TOKEN, which, unlike this flag, "
                        "does not show in ps)")
    parser.add_argument("--token-file", type=argparse.FileType(encoding="latin-1"),
                        help="the token, from a file")
    parser.add_argument("--peers-file", help="per-peer credentials, one 'NAME TOKEN' a line, read again on "
                        "SIGHUP: a peer's token writes only as that peer; with it, --token writes as any")
    parser.add_argument("--public-reads", action="store_true", help="with credentials: let anyone GET "
                        "(dashboard, rollouts, metrics); writes still need one")
    parser.add_argument("--keep-bytes", type=_size, default=f"{Limits.keep_bytes >> 20}M", help="what kept "
                        "batches may cost, on disk and in memory (or in Redis); the writer holding most loses "
                        "its oldest (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="log every request on stderr")
    args = parser.parse_args(argv)
    if args.token_file:  # (a token that is not printable ASCII fails in start_server)
        args.token = args.token_file.read().strip()
    try:
        peers = read_peers(args.peers_file) if args.peers_file else None
        server, url = start_server(args.dir, args.host, args.port, args.token, args.keep_bytes,
                                   args.public_reads, args.verbose, peers, redis=args.redis)
    except (ValueError, OSError) as e:  # e.g. a folder or port it cannot use: one sentence, exit status 2
        parser.exit(2, f"swarm.py: {e}\n")
    print(f"swarm server: {url}", flush=True)  # a launcher reads this line

    def reload(signum, frame):  # SIGHUP: the peers file again; a bad one leaves the credentials as they were
        try:
            server.credentials = credentials(args.token, read_peers(args.peers_file))
            _log(f"read {args.peers_file} again: {len(server.credentials)} credentials")
        except ValueError as e:
            _log(f"kept the credentials as they were: {e}")
    if args.peers_file:
        signal.signal(signal.SIGHUP, reload)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it like Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
