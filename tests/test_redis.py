"""
The Redis store (RedisStore, swarm.py --redis) against a real redis-server that each test starts itself
(marked redis, skipped with the reason where none can start), and the tests that run against both stores
behind a swarm.py server: its folder, then Redis. Peers speak HTTP only; the servers hold Redis's password.
"""

import collections
import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import requests

import bench
import swarm
import train
from conftest import ROOT, _sw_spawn, _sw_stop
from test_all import _sw_group, _sw_post, _sw_read_all, quiet, spread_rewards, tiny_args


def _sw_acl(password):
    """The servers' ACL user as docs/swarm.md gives it, with this password: the tests run the servers as it."""
    docs = open(os.path.join(ROOT, "docs", "swarm.md"), encoding="utf-8").read()
    line = re.search(r"^user swarm on >SERVER_PASSWORD .*$", docs, re.M).group(0)
    return line.replace("SERVER_PASSWORD", password)


class _SwRedis:
    """A real redis-server on a free loopback port, in its own folder, durable as docs/swarm.md says
    (appendonly yes, appendfsync always), with two ACL users: `swarm`, the servers' (docs/swarm.md's), and
    `admin`, which the tests use to see and to spoil what Redis holds. kill() is kill -9, start() restarts
    it on the same folder and port; freeze() and thaw() stop and continue it (SIGSTOP, SIGCONT)."""

    def __init__(self, folder):
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.folder, self.proc = folder, None
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "users.acl"), "w") as f:
            f.write(f"user default off nopass ~* &* +@all\n{_sw_acl('swarm-pw')}\n"
                    "user admin on >admin-pw ~* &* +@all\n")
        with open(os.path.join(folder, "redis.conf"), "w") as f:
            f.write(f"port {self.port}\nbind 127.0.0.1\ndir {folder}\nappendonly yes\nappendfsync always\n"
                    f"save \"\"\naclfile {folder}/users.acl\nlogfile {folder}/redis.log\n")
        self.start()

    def url(self, user="swarm"):
        return f"redis://{user}:{user}-pw@127.0.0.1:{self.port}/0"

    def admin(self):
        import redis
        return redis.Redis.from_url(self.url("admin"), socket_timeout=30)

    def start(self):
        import redis
        self.proc = subprocess.Popen(["redis-server", os.path.join(self.folder, "redis.conf")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while True:
            try:
                return redis.Redis.from_url(self.url(), socket_timeout=5).ping()
            except redis.RedisError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def freeze(self):
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self):
        self.proc.send_signal(signal.SIGCONT)


@pytest.fixture
def _sw_redis(tmp_path):
    """A real redis-server for the test (see _SwRedis); skipped only where none can be started."""
    pytest.importorskip("redis", reason="redis-py is not installed (.ci/run installs it)")
    try:
        server = _SwRedis(str(tmp_path / "redis"))
    except Exception as e:  # no binary, or it would not start: say why
        pytest.skip(f"redis-server cannot be started here ({e!r:.200}); .ci/run installs it")
    yield server
    server.thaw()
    server.kill()


@pytest.fixture
def _sw_redis_servers(_sw_redis):
    """Start swarm servers in this process over the test's Redis with _sw_redis_servers(**start_server's
    settings) -> (server, url); every one is shut down at the end of the test."""
    made = []

    def make(**settings):
        made.append(swarm.start_server(None, redis=_sw_redis.url(), **settings))
        return made[-1]

    yield make
    _sw_redis.thaw()
    for server, _ in made:
        server.shutdown()


class _SwProcess:
    """swarm.py as a process of its own, with _SwRedis's kill() (kill -9) and start() (again, on the same
    folder or Redis): its folder with redis=None, else the Redis URL."""

    def __init__(self, folder, redis=None):
        self.folder, self.flags = folder, ("--redis", redis) if redis else ()
        self.start()

    def url(self):
        return self._url

    def start(self):
        self.proc, self._url = _sw_spawn(self.folder, self.folder + ".log", *self.flags)

    def kill(self):
        _sw_stop(self.proc)


@pytest.fixture(params=["file", pytest.param("redis", marks=pytest.mark.redis)])
def _sw_store(request, tmp_path):
    """A swarm.py server as a process of its own over each store in turn: its folder, then a real Redis."""
    redis = request.getfixturevalue("_sw_redis").url() if request.param == "redis" else None
    server = _SwProcess(str(tmp_path / "swarm"), redis)
    yield server
    server.kill()


def _sw_publish(client, round_, groups, batch_id=None):
    """One exchange of the client's writer thread, as it does it -> the server's acknowledgement."""
    return client.transport.publish(round_, [swarm._dumps(g) for g in groups], batch_id or f"{client.peer}-{round_}")


def _sw_store_of(redis, keep_bytes=swarm.Limits.keep_bytes):  # a RedisStore on the test's Redis, used directly
    return swarm.RedisStore(redis.url(), keep_bytes)


def _sw_put(store, writer, round_, groups, batch_id=None):  # Store.publish with clean groups, as the server calls it
    return store.publish(writer, round_, batch_id or f"{writer}-{round_}", [swarm.WIRE(g) for g in groups])


def _sw_drawn(store, k, exclude="", seed=0):  # Store.sample -> the groups drawn, parsed
    return [json.loads(text) for text in store.sample(k, exclude, seed)[0]]


# -----------------------------------------------------------------------------
# Both stores behind a swarm.py server.

def test_swarm_stores_two_peers_share_and_a_retry_is_stored_once(_sw_store, _sw_clients):
    """Both stores: what one peer publishes the other fetches, numbered and checked, never its own."""
    alice, bob = _sw_clients(_sw_store.url(), "alice"), _sw_clients(_sw_store.url(), "bob")
    sent = [_sw_group(1), _sw_group(2, n=3)]
    alice.publish(0, sent)
    assert alice.flush(10)
    bob.publish(0, [_sw_group(3)])
    assert bob.flush(10) and alice.flush(10)
    got = sorted(bob.fetch(), key=lambda g: g["seq"])
    assert [(g["peer"], g["round"], g["seq"]) for g in got] == [("alice", 0, 1), ("alice", 0, 2)]
    assert [{k: g[k] for k in s} for g, s in zip(got, sent)] == sent
    assert [(g["peer"], g["seq"]) for g in alice.fetch()] == [("bob", 3)] and alice.fetch() == []
    assert _sw_publish(bob, 1, [_sw_group(4)], "once") == _sw_publish(bob, 1, [_sw_group(5)], "once") == \
        {"accepted": 1, "seq": 4}
    assert alice.flush(10) and [g["question"] for g in alice.fetch()] == [_sw_group(4)["question"]]


def _sw_kill_under_writers(target, url, cycles=1, batches=40):
    """Four writers post numbered batches through url() (each posts a batch again, with the same id, until
    it is acknowledged) while `target` is killed with kill -9 and started again, `cycles` times, each after
    `batches` more acknowledgements -> [(batch key, the seq it was acknowledged under)]."""
    acked, stop = [], threading.Event()

    def writer(name):
        for i in range(10**6):
            key = f"{name}-{i}"
            seq = bench.post_until_acknowledged(
                lambda: _sw_post(url(), name, i, [_sw_group(i, metadata={"key": key})], batch_id=key), stop)
            if seq is None:
                return
            acked.append((key, seq))

    threads = [threading.Thread(target=writer, args=(f"w{w}",)) for w in range(4)]
    for t in threads:
        t.start()
    try:
        for cycle in range(cycles):
            deadline = time.time() + 120
            while len(acked) < batches * (cycle + 1) and time.time() < deadline:
                time.sleep(0.01)
            target.kill()  # SIGKILL while the writers write
            target.start()
        deadline = time.time() + 120
        while len(acked) < batches * (cycles + 0.5) and time.time() < deadline:  # some after the last restart
            time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert len(acked) >= batches * (cycles + 0.5)
    return acked


def _sw_all_kept(url, acked):  # every acknowledged batch is kept under its seq, each once, seqs 1, 2, ...
    stored = _sw_read_all(url)
    seq_of = collections.Counter(g["metadata"]["key"] for g in stored)
    assert all(seq_of[key] == 1 for key, _ in acked), "an acknowledged batch lost or stored twice"
    where = {g["metadata"]["key"]: g["seq"] for g in stored}
    assert all(where[key] == seq for key, seq in acked)
    assert [g["seq"] for g in stored] == list(range(1, len(stored) + 1))


@pytest.mark.slow
def test_swarm_stores_kill9_of_the_server_loses_no_acknowledged_batch(_sw_store):
    """Both stores, kill -9 of the server in the middle of four writers' runs: after a restart every
    acknowledged batch is there under its seq, once."""
    acked = _sw_kill_under_writers(_sw_store, _sw_store.url)
    _sw_all_kept(_sw_store.url(), acked)


@pytest.mark.redis
@pytest.mark.slow
def test_swarm_redis_kill9_of_redis_loses_no_acknowledged_batch(_sw_redis, _sw_redis_servers):
    """kill -9 of Redis itself (appendonly yes, appendfsync always) under a server and four writers: the
    server answers 503 while Redis is down, and after Redis restarts every acknowledged batch is there under
    its seq, once (a batch whose reply was lost is sent again and recognised)."""
    url = _sw_redis_servers()[1]
    acked = _sw_kill_under_writers(_sw_redis, lambda: url, cycles=2)
    _sw_all_kept(url, acked)


def test_swarm_stores_late_joiner_draws_from_the_newest_batches(_sw_store, _sw_clients):
    """Both stores: a new peer, whatever the history, draws from each producer's newest two batches only."""
    old = _sw_clients(_sw_store.url(), "old")
    for r in range(30):
        _sw_publish(old, r, [_sw_group(10 * r + j) for j in range(10)])
    new = _sw_clients(_sw_store.url(), "new", sample=8, seed=1)
    assert new.flush(10)
    got = [g["seq"] for g in new.fetch()]
    assert len(got) == 8 == len(set(got)) and all(281 <= seq <= 300 for seq in got)


# -----------------------------------------------------------------------------
# Several servers over one Redis.

@pytest.mark.redis
def test_swarm_redis_two_servers_serve_one_swarm(_sw_redis_servers, _sw_clients):
    """Two servers over one Redis are one swarm: a group published through one is read through the other,
    seqs follow publication order across both (one counter), and a retry that reaches the other server is
    stored once. The dashboard, /health and /peers of either show the same swarm."""
    (_, one), (_, two) = _sw_redis_servers(), _sw_redis_servers()
    alice, bob = _sw_clients(one, "alice", sample=8), _sw_clients(two, "bob", sample=8)
    acks = [_sw_publish(alice, 0, [_sw_group(1), _sw_group(2)]), _sw_publish(bob, 0, [_sw_group(3)]),
            _sw_publish(alice, 1, [_sw_group(4)])]
    assert [a["seq"] for a in acks] == [2, 3, 4]
    again = _sw_clients(two, "alice")  # alice's retry of her round-1 batch, through the other server
    assert _sw_publish(again, 1, [_sw_group(4)]) == {"accepted": 1, "seq": 4}
    assert bob.flush(10) and sorted(g["seq"] for g in bob.fetch()) == [1, 2, 4]  # alice's, read through two
    assert alice.flush(10) and [g["seq"] for g in alice.fetch()] == [3]          # bob's, read through one
    assert [g["seq"] for g in _sw_read_all(one)] == [g["seq"] for g in _sw_read_all(two)] == [1, 2, 3, 4]
    health = [requests.get(url + "/health", timeout=5).json() for url in (one, two)]
    assert health[0] == health[1] == {"ok": True, "groups": 4, "peers": 2, "last_seq": 4}
    peers = requests.get(two + "/peers", timeout=5).json()["peers"]
    assert {p: (v["groups"], v["last_round"]) for p, v in peers.items()} == {"alice": (3, 1), "bob": (1, 0)}
    page = requests.get(one + "/", timeout=5).text
    assert "4 groups kept (seq 1 to 4), 2 peers" in page and _sw_group(3)["question"] in page


@pytest.mark.redis
def test_swarm_redis_per_peer_credentials_hold_whichever_store(_sw_redis_servers):
    """The server's checks come before the store, Redis or not: a peer's token writes only as that peer
    (403, nothing stored), a body over the server's limits is refused before Redis sees it (413), and a
    malformed group gets a 400."""
    _, url = _sw_redis_servers(peers={"alice": "alice-token", "bob": "bob-token"})
    as_alice = {"Authorization": "Bearer alice-token"}
    assert _sw_post(url, "alice", 0, [_sw_group(1)], headers=as_alice).json() == {"accepted": 1, "seq": 1}
    assert _sw_post(url, "bob", 0, [_sw_group(2)], headers=as_alice).status_code == 403
    assert _sw_post(url, "alice", 1, [{"task": "t"}], headers=as_alice).status_code == 400
    big = [_sw_group(3, n=64) | {"completions": ["x" * 32_000] * 64} for _ in range(5)]  # 10 MB of groups
    assert _sw_post(url, "alice", 2, big, headers=as_alice).status_code == 413
    stored = _sw_read_all(url, token="alice-token")
    assert [(g["peer"], g["seq"]) for g in stored] == [("alice", 1)]
    assert requests.get(url + "/health", timeout=5).status_code == 401


# -----------------------------------------------------------------------------
# The Store's rules over Redis (RedisStore called as the server calls it).

@pytest.mark.redis
@pytest.mark.slow
def test_swarm_redis_sampled_reads_are_bounded_by_k_and_fair_to_writers(_sw_redis):
    """A sampled read returns K groups however many writers there are (10 or 40: its bytes do not grow),
    from each writer's newest 2 batches, never the excluded writer's, none twice; the same seed and state
    give the same draw; and each writer has an equal chance whatever its I."""
    store, sizes = _sw_store_of(_sw_redis), []
    for writers in (10, 40):
        for k in range(writers):
            for r in range(3):  # 3 batches: only the newest 2 are in the window
                _sw_put(store, f"p{k}", r, [_sw_group(100 * r + j, metadata={"round": r}) for j in range(4)])
        _sw_put(store, "reader", 0, [_sw_group(7)])
        for seed in range(5):
            page = _sw_drawn(store, 8, "reader", seed)
            assert len(page) == 8 and len({g["seq"] for g in page}) == 8
            assert all(g["peer"] != "reader" and g["metadata"]["round"] >= 1 for g in page)
            sizes.append(len(swarm._dumps(page)))
        assert store.sample(8, "reader", 9) == store.sample(8, "reader", 9)
    assert max(sizes) < 1.2 * min(sizes)
    _sw_redis.admin().flushall()
    fair = _sw_store_of(_sw_redis)  # "big" publishes 16 groups a batch, "b" and "c" one: a third each
    for peer, n in (("big", 16), ("b", 1), ("c", 1)):
        for r in range(2):
            _sw_put(fair, peer, r, [_sw_group(j) for j in range(n)])
    reads = [_sw_drawn(fair, 2, "x", seed) for seed in range(90)]
    assert all(len({g["seq"] for g in groups}) == 2 for groups in reads)  # never one group twice in a read
    drawn = [g["peer"] for groups in reads for g in groups]
    assert len(drawn) == 180 and 0.2 < drawn.count("big") / 180 < 0.45, drawn.count("big")


@pytest.mark.redis
def test_swarm_redis_retention_cuts_the_writer_holding_most(_sw_redis):
    """--keep-bytes over Redis: past it the writer holding most loses its oldest batches, so a flooding
    writer prunes its own and an honest writer's recent batches stay; the bytes kept stay within the budget
    (and the batch stored last); a retry of a pruned batch is still recognised and stored once."""
    store = _sw_store_of(_sw_redis, keep_bytes=100_000)
    honest = [_sw_put(store, "honest", r, [_sw_group(r)]) for r in range(3)]
    for r in range(60):
        _sw_put(store, "flood", r, [_sw_group(1000 + r, n=8) for _ in range(4)])
    admin = _sw_redis.admin()
    kept = sorted(int(k) for k in admin.hkeys("sapo:w:honest:groups") if k.isdigit())
    assert kept == [a["seq"] for a in honest]  # the honest writer's batches all stay
    assert int(admin.hget("sapo:kept", "bytes")) <= 100_000
    assert admin.llen("sapo:w:flood:batches") < 30  # the flood lost its oldest
    assert _sw_put(store, "flood", 0, [_sw_group(5)]) == {"accepted": 4, "seq": 7}  # pruned, yet stored once
    held = {k: int(v) for k, v in admin.zrange("sapo:held", 1, -1, withscores=True)}
    assert held[b"flood"] == int(admin.hget("sapo:w:flood:groups", "held"))


@pytest.mark.redis
def test_swarm_redis_window_is_limits_window_batches(_sw_redis, monkeypatch):
    """Limits.window_batches reaches the Redis scripts: 3 batches of each writer drawn from."""
    monkeypatch.setattr(swarm.Limits, "window_batches", 3)
    store = _sw_store_of(_sw_redis)
    for r in range(5):
        _sw_put(store, "p", r, [_sw_group(10 * r + j) for j in range(2)])
    assert {g["round"] for seed in range(20) for g in _sw_drawn(store, 16, "", seed)} == {2, 3, 4}


@pytest.mark.redis
def test_swarm_redis_a_writer_silent_past_the_window_is_never_drawn(_sw_redis, monkeypatch):
    monkeypatch.setattr(swarm.Limits, "window_seconds", 1)  # (shortened for the test)
    store = _sw_store_of(_sw_redis)
    _sw_put(store, "quiet", 0, [_sw_group(1)])
    assert {g["peer"] for g in _sw_drawn(store, 16)} == {"quiet"}
    time.sleep(1.5)
    _sw_put(store, "busy", 0, [_sw_group(2)])
    assert all({g["peer"] for g in _sw_drawn(store, 16, "", seed)} == {"busy"} for seed in range(20))


@pytest.mark.redis
def test_swarm_redis_metrics_rows_are_bounded_and_the_dashboard_draws_them(_sw_redis, _sw_redis_servers, _sw_clients,
                                                                           monkeypatch):
    """Metrics over Redis: rows read in pages after n, the oldest dropped past Limits.metrics_bytes, and
    the dashboard of a server over Redis shows each peer's rounds, rewards and newest completions."""
    monkeypatch.setattr(swarm.Limits, "metrics_bytes", 4000)
    _, url = _sw_redis_servers()
    peer = _sw_clients(url, "alice")
    for r in range(60):
        peer.post_metrics(r, {"local_reward": r / 100, "batch_reward": 0.5})
    peer.publish(59, [_sw_group(1)])
    assert peer.flush(20)
    rows = requests.get(url + "/metrics?after=0", timeout=5).json()
    assert rows["last"] == 60 and rows["next"] == 60 and 10 < len(rows["metrics"]) < 60
    assert [m["n"] for m in rows["metrics"]] == list(range(61 - len(rows["metrics"]), 61))
    assert int(_sw_redis.admin().hget("sapo:mstat", "bytes")) <= 4000
    page = requests.get(url + "/", timeout=5).text
    assert "<td>alice</td><td>tiny</td><td>60</td><td>1</td><td>0.590</td><td>0.500</td>" in page
    assert "<polyline" in page and _sw_group(1)["question"] in page


# -----------------------------------------------------------------------------
# What Redis may hold that no server wrote, and a Redis that stops answering.

@pytest.mark.redis
def test_swarm_redis_a_counter_past_1e14_goes_on(_sw_redis, _sw_redis_servers, _sw_clients):
    """Guards against Lua writing numbers with `..`, which writes 1e14 as "1e+14": with sapo:seq at 10^14
    every ack was refused and every read returned 0 groups. Whatever the counter holds up to the largest
    seq (10^15), acks and reads go on; past it a publish gets a 503 and one log line, and stores nothing."""
    _, url = _sw_redis_servers()
    admin = _sw_redis.admin()
    admin.set("sapo:seq", 10**14)
    alice, bob = _sw_clients(url, "alice"), _sw_clients(url, "bob", sample=4)
    assert _sw_publish(alice, 0, [_sw_group(1), _sw_group(2)]) == {"accepted": 2, "seq": 10**14 + 2}
    admin.set("sapo:seq", 10**15 - 3)
    assert _sw_publish(alice, 1, [_sw_group(3), _sw_group(4), _sw_group(5)]) == {"accepted": 3, "seq": 10**15}
    assert bob.flush(10)  # the client's sampled read, through the server: K = 4 of alice's 5 groups
    got = [g["seq"] for g in bob.fetch()]
    assert len(got) == 4 and set(got) <= {10**14 + 1, 10**14 + 2, 10**15 - 2, 10**15 - 1, 10**15}
    got = requests.get(url + "/rollouts?sample=8&exclude=bob", timeout=5).json()
    assert sorted(g["seq"] for g in got["groups"]) == [10**14 + 1, 10**14 + 2, 10**15 - 2, 10**15 - 1, 10**15]
    assert got["last"] == 10**15
    page = requests.get(url + f"/rollouts?after={10**14}", timeout=5).json()
    assert [g["seq"] for g in page["groups"]] == [10**14 + 1, 10**14 + 2, 10**15 - 2, 10**15 - 1, 10**15]
    assert page["next"] == page["last"] == 10**15
    r = _sw_post(url, "alice", 2, [_sw_group(6)])  # past the largest seq: refused, nothing stored
    assert r.status_code == 503 and r.headers["Retry-After"] and admin.get("sapo:seq") == b"%d" % 10**15


@pytest.mark.redis
def test_swarm_redis_stale_or_cleared_index_still_draws_k(_sw_redis, _sw_redis_servers, _sw_clients, capsys):
    """Guards the draw's index (sapo:fresh) against what no publish put there: with 100,000 names that have
    no batches a read returned 1 group instead of about K, and with the index cleared one writer got every
    read. A read returns K groups whatever stale names the index holds (they are removed as they are found,
    at most Limits.scan_groups a script call), and a cleared index is rebuilt from the writers' own keys."""
    _, url = _sw_redis_servers()
    writers = [_sw_clients(url, f"w{k}") for k in range(4)]
    for k, w in enumerate(writers):
        _sw_publish(w, 0, [_sw_group(10 * k + j) for j in range(8)])
    admin, now = _sw_redis.admin(), time.time()
    for start in range(0, 100_000, 10_000):
        admin.zadd("sapo:fresh", {f"ghost{i}": now for i in range(start, start + 10_000)})
    first = admin.eval(swarm.SAMPLE_LUA, 0, 16, "", 1, *[swarm.Limits.page_bytes, swarm.Limits.body_bytes, 2, 600,
                                                         256, swarm.Limits.scan_groups])
    assert 0 < int(first[0]) <= swarm.Limits.scan_groups  # one script call's work is bounded
    got = requests.get(url + "/rollouts?sample=16&seed=3", timeout=30).json()["groups"]
    assert len(got) == 16 and {g["peer"] for g in got} <= {"w0", "w1", "w2", "w3"}
    assert admin.zcard("sapo:fresh") < 100_000
    for seed in range(10):  # the ghosts go as they are drawn: every read returns K
        assert len(requests.get(url + f"/rollouts?sample=16&seed={seed}", timeout=30).json()["groups"]) == 16
    admin.delete("sapo:fresh")  # cleared: the next publish or read rebuilds it first
    _sw_publish(writers[0], 1, [_sw_group(99)])
    drawn = collections.Counter(g["peer"] for seed in range(40) for g in requests.get(
        url + f"/rollouts?sample=1&seed={seed}", timeout=5).json()["groups"])
    assert sorted(drawn) == ["w0", "w1", "w2", "w3"] and max(drawn.values()) < 20, drawn
    assert "indexed 4 writers' batches in Redis" in capsys.readouterr().err


@pytest.mark.redis
def test_swarm_redis_an_oversized_group_is_skipped_not_the_read(_sw_redis, _sw_redis_servers, _sw_clients):
    """Guards each read against one group no server would store: a 3 MB group drawn into a read failed it
    (97 reads of 100). The server refuses such a group before the store; found in Redis all the same (over
    8 MB, not JSON, not UTF-8, a number JSON cannot serve, more values than a client parses), it is skipped
    and the read returns the rest. What no publish writes in a writer's keys (a batch naming groups that
    are not there, a range no batch has, junk, keys of the wrong type) costs only itself."""
    _, url = _sw_redis_servers()
    honest = _sw_clients(url, "honest")
    _sw_publish(honest, 0, [_sw_group(1)])
    admin, now = _sw_redis.admin(), time.time()
    bad = {2: b"x" * (9 << 20), 3: b"not json", 4: json.dumps(_sw_group(4)).replace("What", "\udcff").encode(
        "utf-8", "surrogateescape"), 5: b'{"a":1e999}', 6: b'{"a":[' + b"0," * 1_100_000 + b'0]}'}
    for seq, text in bad.items():
        admin.hset("sapo:w:junk:groups", seq, text)
    admin.rpush("sapo:w:junk:batches", "junk", f"99999999 1 {now} 1 d", f"9 7 {now} 100 c", f"6 2 {now} 100 b")
    admin.zadd("sapo:log", {"6 2 junk": 6, "99999999 1 junk": 7, "junk": 8})
    admin.set("sapo:w:wrongtype:batches", "a string")
    admin.rpush("sapo:w:wrongtype2:batches", f"10 10 {now} 1 e")
    admin.set("sapo:w:wrongtype2:groups", "a string")
    admin.zadd("sapo:fresh", {"junk": now, "wrongtype": now, "wrongtype2": now})
    reader = _sw_clients(url, "reader", sample=32)
    for seed in range(20):
        got = requests.get(url + f"/rollouts?sample=32&seed={seed}", timeout=10)
        assert got.status_code == 200 and [g["peer"] for g in got.json()["groups"]] == ["honest"]
    assert reader.flush(10) and [g["question"] for g in reader.fetch()] == [_sw_group(1)["question"]]
    page = requests.get(url + "/rollouts?after=0", timeout=10).json()
    assert [g["seq"] for g in page["groups"]] == [1]


@pytest.mark.redis
def test_swarm_redis_servers_hold_the_only_password(_sw_redis, _sw_redis_servers, capsys):
    """Guards against peers holding Redis access (with +eval a peer could freeze Redis): a peer joins a
    server over HTTP, and a Redis URL given to a peer (swarm.connect, train.py --swarm) is refused in one
    sentence that says how to start a server over Redis. The servers run as docs/swarm.md's ACL user (this
    test's Redis has no other for them), which cannot run Redis's dangerous commands."""
    import redis
    for url in (_sw_redis.url(), "REDISS://h:6379/0"):
        with pytest.raises(ValueError, match=r"over HTTP only: start a server with python swarm.py --redis"):
            swarm.connect(url, "p", 1)
    with pytest.raises(SystemExit):
        train.parse_args(["--swarm", _sw_redis.url(), "--name", "p"])
    err = capsys.readouterr().err
    assert "--swarm: a peer joins a swarm over HTTP only: start a server with python swarm.py --redis" in err
    assert "swarm-pw" not in err  # (the URL, which may hold a password, is not repeated)
    as_server = redis.Redis.from_url(_sw_redis.url())
    for command in (("FLUSHALL",), ("DEBUG", "SLEEP", "0"), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("GET", "other")):
        with pytest.raises(redis.exceptions.ResponseError, match="no permissions|not allowed"):
            as_server.execute_command(*command)
    _, url = _sw_redis_servers()
    assert _sw_post(url, "alice", 0, [_sw_group(1)]).json() == {"accepted": 1, "seq": 1}


@pytest.mark.redis
def test_swarm_redis_a_frozen_redis_gets_a_503_and_one_log_line(_sw_redis, _sw_redis_servers, monkeypatch, capsys):
    """Guards the server against a Redis that stops answering (a SIGSTOP here; DEBUG SLEEP alike), which
    made it log a ValueError traceback: it waits Limits.redis_seconds, then answers 503 with Retry-After,
    never a 500, and logs one sentence while the trouble lasts and one when Redis answers again. A batch
    sent again once Redis answers is stored once, even if Redis ran the first try late."""
    monkeypatch.setattr(swarm.Limits, "redis_seconds", 1.0)  # (shortened for the test)
    _, url = _sw_redis_servers()
    _sw_redis.freeze()
    replies = [_sw_post(url, "alice", 0, [_sw_group(1)], batch_id="b1"),
               requests.get(url + "/rollouts?sample=4", timeout=10), requests.get(url + "/health", timeout=10),
               _sw_post(url, "alice", 0, [_sw_group(1)], batch_id="b1")]
    assert [r.status_code for r in replies] == [503] * 4 and all(r.headers["Retry-After"] for r in replies)
    assert "send it again" in replies[0].json()["error"]
    _sw_redis.thaw()
    deadline = time.time() + 30
    while (r := _sw_post(url, "alice", 0, [_sw_group(1)], batch_id="b1")).status_code != 200 and time.time() < deadline:
        time.sleep(0.2)
    assert r.json() == {"accepted": 1, "seq": 1} and len(_sw_read_all(url)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Error" not in err.replace("TimeoutError", "")
    said = [line for line in err.splitlines() if "does not answer" in line]
    assert len(said) == 1 and said[0].startswith(f"swarm server: Redis at 127.0.0.1:{_sw_redis.port} does not "
                                                 "answer (TimeoutError: Timeout reading from") and said[0].endswith(
        "); requests get 503 until it answers")
    assert err.count("answers again") == 1


@pytest.mark.redis
def test_swarm_redis_bad_settings_get_one_sentence(_sw_redis, tmp_path, monkeypatch):
    """--redis takes redis:// or rediss:// with one option (?ssl_ca_certs=FILE, with rediss://), and the
    password in the URL or in $SWARM_REDIS_PASSWORD, not both; a Redis it cannot reach or log in to is said
    in one line, and swarm.py exits with status 2."""
    port = _sw_redis.port
    for url, says in (("http://h", "must look like redis://"), ("redis://", "must look like redis://"),
                      ("redis://h:x/0", "must look like"), (f"redis://h:{port}/0?socket_timeout=0", "one option"),
                      ("redis://h/0?ssl_ca_certs=x", "one option"),
                      (f"redis://swarm:wrong@127.0.0.1:{port}/0", "cannot use Redis at 127.0.0.1.*invalid username")):
        with pytest.raises(ValueError, match=says):
            swarm.start_server(None, redis=url)
    monkeypatch.setenv("SWARM_REDIS_PASSWORD", "swarm-pw")
    with pytest.raises(ValueError, match="in the --redis URL or in .SWARM_REDIS_PASSWORD, not both"):
        swarm.start_server(None, redis=_sw_redis.url())
    server, url = swarm.start_server(None, redis=f"REDIS://swarm@127.0.0.1:{port}/0")  # the password from the environment
    server.shutdown()
    tls = swarm.RedisStore.__new__(swarm.RedisStore)  # (a rediss:// URL's option reaches redis-py)
    with pytest.raises(ValueError, match="cannot use Redis"):
        tls.__init__(f"rediss://swarm@127.0.0.1:{port}/0?ssl_ca_certs={tmp_path}/ca.pem")
    r = subprocess.run(["python", os.path.join(ROOT, "swarm.py"), "--redis", "redis://127.0.0.1:1/0", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot use Redis at 127.0.0.1:1" in r.stderr


@pytest.mark.redis
@pytest.mark.slow
def test_train_joins_a_swarm_served_over_redis(tiny, tmp_path, monkeypatch, _sw_redis, _sw_redis_servers):
    """Two peers of train.py, each joining its own server over one Redis, share and train."""
    spread_rewards(monkeypatch)
    urls = [_sw_redis_servers()[1], _sw_redis_servers()[1]]
    peers = [train.Peer(tiny_args(tmp_path, "--swarm", urls[k], "--name", f"r{k}", "--seed", str(k)),
                        log=quiet) for k in range(2)]
    try:
        for r in range(3):
            collected = [p.collect(r) for p in peers]
            assert all(p.client.flush(30) for p in peers)  # every batch stored; then a read after them all:
            assert all(p.client.flush(30) for p in peers)  # (a peer's first may have been before the other's)
            rows = [p.learn(r, c) for p, c in zip(peers, collected)]
            assert all(m["round"] == r and m["stepped"] for m in rows)
        assert all(m["external_used"] > 0 for m in rows)
    finally:
        for p in peers:
            p.client.close()
