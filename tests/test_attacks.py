"""
What the rollout server and the swarm client survive: each attack below is a test that asserts the bound
it proves (honest requests get through, no acknowledged batch is lost over kill -9, no 5xx, disk and
memory within their limits, a dishonest writer held to its own share), at sizes that take seconds. Run as
a script, each attack runs at the sizes docs/swarm.md measures (Reliability) and prints its figures:

    python tests/test_attacks.py                        # every attack: about 13 minutes on 2 cores
    python tests/test_attacks.py --only kill sybil      # the attacks whose names hold one of the words
    python tests/test_attacks.py --against DIR          # the server of DIR/swarm.py (another checkout)

The server runs as a process of its own (bench.py's _server: python swarm.py --port 0). Latencies are
printed, never asserted: they measure the machine's load as much as the server.
"""

import argparse
import collections
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (run as a script)
import bench  # noqa: E402
from bench import _cpu_seconds, _end, _groups, _pct, _read_all, _rss_mb, _server  # noqa: E402
from conftest import fake_server  # noqa: E402


def attack_flood(slow=500, seconds=20):
    """`slow` connections held open (a third idle, a third sending headers a byte every 2 s, a third
    declaring a body they never send; each reconnects when the server closes it) while an honest client
    alternates GET /health and POST /rollouts on fresh connections."""
    import socket
    proc, url, folder = _server()
    host, port = url[7:].rsplit(":", 1)
    stop, opened = threading.Event(), [0]

    def connect(k):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.setblocking(False)
        s.send([b"", b"GET /health HTTP/1.1\r\nHost: x\r\n", b"POST /rollouts HTTP/1.1\r\nContent-Length: 99\r\n\r\n{"][k % 3])
        opened[0] += 1
        return s

    def flood():
        conns = [connect(k) for k in range(slow)]
        while not stop.wait(2.0):
            for k, s in enumerate(conns):
                try:
                    if s.recv(65536) == b"":  # (a reply is read and dropped; a close makes a new one)
                        raise OSError("closed")
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    conns[k] = s = connect(k)
                if k % 3 == 1:
                    try:
                        s.send(b"X")
                    except OSError:
                        pass
        for s in conns:
            s.close()

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        time.sleep(3)  # let the flood build up
        cpu0, t0 = _cpu_seconds(proc.pid), time.time()
        honest = _honest(url, seconds)
        cpu = (_cpu_seconds(proc.pid) - cpu0) / (time.time() - t0)
        rss = _rss_mb(proc.pid, "VmHWM")
    finally:
        stop.set()
        flooder.join()
        _end(proc, folder)
    return {"slow_connections": slow, "slow_connects_made": opened[0], **honest, "server_cpu_cores": round(cpu, 3),
            "server_peak_rss_mb": round(rss, 1)}


def _honest(url, seconds, headers=None, page=False):
    """An honest client alternating GET /health and POST /rollouts on fresh connections for `seconds` (and
    with `page`, GET /rollouts?after=0&limit=1024: a page of up to 1 MB) -> its failures, in all and by
    request, and latency percentiles (ms)."""
    import requests
    lat = {"GET /health": [], "POST /rollouts": [], **({"GET /rollouts page": []} if page else {})}
    failed, t0, r = collections.Counter(), time.time(), 0
    while time.time() < t0 + seconds:
        for what in lat:
            t = time.perf_counter()
            try:
                if what == "GET /health":
                    ok = requests.get(url + "/health", headers=headers, timeout=10).status_code == 200
                elif what == "GET /rollouts page":
                    ok = requests.get(url + "/rollouts?after=0&limit=1024", headers=headers, timeout=10).ok
                else:
                    ok = requests.post(url + "/rollouts", headers=headers, timeout=10, json={
                        "peer": "honest", "round": r, "batch_id": f"h{r}", "groups": _groups(r, 1)}).status_code == 200
            except requests.RequestException:
                ok = False
            lat[what].append(1000 * (time.perf_counter() - t))
            failed[what] += not ok
        r += 1
        time.sleep(0.1)
    return {"honest_requests": sum(map(len, lat.values())), "honest_errors": sum(failed.values()),
            **{f"{w} failed": f"{failed[w]} of {len(v)}" for w, v in lat.items()},
            **{f"{w} p50_ms": _pct(v, 0.5) for w, v in lat.items()}, **{f"{w} p99_ms": _pct(v, 0.99) for w, v in lat.items()}}


def _descriptors(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def attack_busy_cap(busy=1100, limit=1024, seconds=15):
    """`busy` connections that each send one byte of a request line and stop (made again when the server
    closes them), against a server whose descriptor limit is `limit` (so a cap of limit - 64), while an
    honest client alternates GET and POST; the server's peak count of descriptors shows any overshoot."""
    import resource
    import socket
    proc, url, folder = _server(preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    host, port = url[7:].rsplit(":", 1)
    stop, made, peak = threading.Event(), [0], [0]

    def connect():
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.send(b"G")
            s.setblocking(False)
            made[0] += 1
            return s
        except OSError:
            return None

    def hold():
        conns = [connect() for _ in range(busy)]
        while not stop.wait(0.5):
            peak[0] = max(peak[0], _descriptors(proc.pid))
            for k, s in enumerate(conns):
                try:
                    if s is None or s.recv(65536) == b"":
                        raise OSError("closed")
                except BlockingIOError:
                    pass
                except OSError:
                    s and s.close()
                    conns[k] = connect()
        for s in conns:
            s and s.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        time.sleep(3)
        honest = _honest(url, seconds)
        return {"busy_connections": busy, "descriptor_limit": limit, "busy_connects_made": made[0], **honest,
                "server_peak_descriptors": peak[0], "server_alive": proc.poll() is None}
    finally:
        stop.set()
        holder.join()
        _end(proc, folder)


def _stalled(url, head, senders, stop, made):
    """`senders` threads, each sending `head` and a body of 8 MB minus one byte (the head declares 8 MB),
    then stalling; again whenever the server closes the connection. made[0] counts their connects."""
    import socket
    import swarm
    host, port = url[7:].rsplit(":", 1)
    data = head % swarm.Limits.body_bytes + b"x" * (swarm.Limits.body_bytes - 1)

    def sender():
        while not stop.is_set():
            try:
                with socket.create_connection((host, int(port)), timeout=2) as s:
                    made[0] += 1
                    s.sendall(data)
                    while not stop.is_set():
                        try:
                            if s.recv(65536) == b"":
                                break
                        except socket.timeout:
                            pass
            except OSError:
                time.sleep(0.05)

    threads = [threading.Thread(target=sender) for _ in range(senders)]
    for t in threads:
        t.start()
    return threads


def _beside_stalled(proc, url, folder, head, senders, token, seconds):
    """`senders` stalled bodies sent with `head` (_stalled), then an honest client with `token` alternating
    GET and POST for `seconds`; the server is ended after. Returns their connects and the honest figures."""
    stop, made = threading.Event(), [0]
    threads = _stalled(url, head, senders, stop, made)
    try:
        time.sleep(3)
        honest = _honest(url, seconds, headers={"Authorization": f"Bearer {token}"})
        return {"their_connects": made[0], **honest}
    finally:
        _end(proc, folder, stop, threads)


def attack_stalled_bodies(senders=8, seconds=15):
    """With a token: `senders` connections without it, each sending a body of 8 MB minus one byte and then
    stalling (again whenever the server closes them), while an honest client with the token alternates
    GET and POST."""
    proc, url, folder = _server(None, "--token", "s3cret")
    head = b"POST /rollouts HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
    return {"stalled_senders": senders, **_beside_stalled(proc, url, folder, head, senders, "s3cret", seconds)}


def attack_stalled_reads(senders=9, seconds=15):
    """With a token and --public-reads (GETs need none, the launcher's default): `senders` anonymous GETs,
    each declaring a body of 8 MB, sending all of it but one byte and stalling (again whenever the server
    closes them), while an honest client with the token alternates GET and POST."""
    proc, url, folder = _server(None, "--token", "s3cret", "--public-reads")
    head = b"GET /rollouts HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
    return {"stalled_gets": senders, **_beside_stalled(proc, url, folder, head, senders, "s3cret", seconds)}


def attack_stalled_writer(bodies=9, seconds=15):
    """With per-peer credentials: one writer, mallory, posting `bodies` bodies of 8 MB at once with its own
    token, each stalling one byte short (again whenever the server closes it), while another writer
    alternates GET and POST."""
    with tempfile.NamedTemporaryFile("w", suffix=".peers") as f:  # (read once, at the server's start)
        f.write("mallory m-token\nhonest h-token\n")
        f.flush()
        proc, url, folder = _server(None, "--peers-file", f.name)
    head = b"POST /rollouts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer m-token\r\nContent-Length: %d\r\n\r\n"
    return {"stalled_bodies": bodies, **_beside_stalled(proc, url, folder, head, bodies, "h-token", seconds)}


def attack_parse_bombs(writers=4, seconds=15):
    """`writers` clients posting bodies of nested empty objects without end: 8 MB of {"x":[{},{},...]}
    (2.8 million objects) and the largest such body the server parses (half a million, 1.5 MB), while
    GET /health is timed; the server's peak resident memory."""
    import requests
    import swarm
    proc, url, folder = _server()
    stop, statuses = threading.Event(), {}
    bodies = [b'{"x":[' + b"{}," * (swarm.Limits.body_bytes // 3 - 4) + b"{}]}",
              b'{"x":[' + b"{}," * (swarm.Limits.json_values // 2 - 2) + b"{}]}"]

    def bomber(w):
        session, k = requests.Session(), w
        while not stop.is_set():
            try:
                status = session.post(url + "/rollouts", data=bodies[k % 2], timeout=30).status_code
            except requests.RequestException:
                status = "error"
            statuses[status] = statuses.get(status, 0) + 1
            k += 1

    threads = [threading.Thread(target=bomber, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    health, t0 = [], time.time()
    try:
        while time.time() < t0 + seconds:
            t = time.perf_counter()
            try:
                requests.get(url + "/health", timeout=30)
            except requests.RequestException:
                pass
            health.append(1000 * (time.perf_counter() - t))
            time.sleep(0.05)
        return {"writers": writers, "bomb_replies": {str(k): v for k, v in sorted(statuses.items(), key=str)},
                "health_p50_ms": _pct(health, 0.5), "health_p99_ms": _pct(health, 0.99),
                "health_max_ms": round(max(health), 1), "server_peak_rss_mb": round(_rss_mb(proc.pid, "VmHWM"), 1)}
    finally:
        _end(proc, folder, stop, threads)


def _hostile_requests():
    """(class, raw bytes) of crafted requests; every one must get a 4xx or a clean close, never a 5xx."""
    def post(path, body, extra=b""):
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (path.encode(), len(body), extra, body)

    g = {"task": "t", "question": "q", "answer": "a", "completions": ["c"], "stopped": [True]}
    ok = {"peer": "p", "round": 1, "batch_id": "b", "groups": [g]}
    bad_values = [None, True, -1, 1.5, 10 ** 400, "", "x" * 40_000, "caf\u00e9 <b>", [], [1], {}, {"a": [None]}]
    bad_groups = [dict(g, **{field: v}) for field in g for v in bad_values if not (field == "question" and
                  v in ("", "caf\u00e9 <b>")) and not (field == "answer" and v in ("", "caf\u00e9 <b>"))]
    bad_groups += [{k: v for k, v in g.items() if k != field} for field in g] + [
        "x", None, 5, dict(g, metadata={"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": {}}}}}}}}}}),
        dict(g, completions=["c"] * 65, stopped=[True] * 65), dict(g, metadata={"k": "v" * 17_000})]
    bad_tops = [dict(ok, **{field: v}) for field in ok for v in bad_values if not (field == "groups" and v == [])]
    bad_tops += [{k: v for k, v in ok.items() if k != field} for field in ok] + [
        dict(ok, peer="../x"), dict(ok, batch_id="a/b"), dict(ok, groups=[g] * 300), [ok], "ok"]
    bad_bodies = [b"{", b"[" * 100_000, b"\xff\xfe", b"NaN", b'{"peer": 1e999}', b"1" * 5000, b"null", b"[]",
                  b'{"peer": "p", "round": Infinity}', b"\x00" * 100, b'{"a": "\\ud800"}',
                  json.dumps(dict(ok, groups=[dict(g, question="\ud800")])).encode(), b'{"a": "\xed\xa0\x80"}']
    metrics = [{"peer": "p", "round": 1, "metrics": m} for m in (
        {"a": 10 ** 400}, {"a": 1e300}, {"a": -1e16}, {"a": "x"}, {"a": [1]}, {"a": True}, {"": 1}, {"x" * 65: 1},
        {str(k): 1 for k in range(65)}, [1], None, {"\ud800": 1})] + [{"peer": "<b>", "round": 1, "metrics": {}},
                                                       {"peer": "p", "round": -1, "metrics": {}}]
    get = [b"GET /rollouts?after=-1 HTTP/1.1\r\n\r\n", b"GET /rollouts?limit=0 HTTP/1.1\r\n\r\n",
           b"GET /rollouts?limit=99999 HTTP/1.1\r\n\r\n", b"GET /rollouts?exclude=%3Cb%3E HTTP/1.1\r\n\r\n",
           b"GET /rollouts?" + b"&".join(b"a=%d" % k for k in range(40)) + b" HTTP/1.1\r\n\r\n",
           b"GET /metrics?after=x HTTP/1.1\r\n\r\n", b"GET /nope HTTP/1.1\r\n\r\n", b"GET /../etc/passwd HTTP/1.1\r\n\r\n"]
    methods = [b"%s %s HTTP/1.1\r\nConnection: close\r\n\r\n" % (m, p) for m in (b"HEAD", b"OPTIONS", b"PUT", b"DELETE",
               b"PATCH", b"TRACE", b"CONNECT", b"BREW", b"get") for p in (b"/", b"/health", b"/rollouts", b"/metrics")]
    protocol = [b"OPTIONS * HTTP/1.1\r\n\r\n",
                b"GET http://[::1/x HTTP/1.1\r\n\r\n", b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n",
                b"GET /health HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n",
                b"GET /health HTTP/1.1\r\n" + b"X: a\r\n" * 100 + b"\r\n", b"GET /health HTTP/2.0\r\n\r\n",
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"\x16\x03\x01\x00\xc8\x01\x00\x00\xc4\x03\x03" + bytes(190),
                b"\x00\x01\x02\r\n\r\n", b"GET /health\r\n\r\n", b"GET /health HTTP/1.1\r\nno colon\r\n\r\n",
                b"POST /rollouts HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                b"POST /rollouts HTTP/1.1\r\n\r\n", b"POST /rollouts HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                b"POST /rollouts HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n",
                b"POST /rollouts HTTP/1.1\r\nContent-Length: 100\r\n\r\n{",  # a lying length: waits for the deadline
                b"POST /metrics HTTP/1.1\r\nContent-Length: 10\r\nContent-Length: 99\r\n\r\n0123456789",
                b"POST /metrics HTTP/1.1\r\nContent-Length : 24\r\n\r\nGET /health HTTP/1.1\r\n\r\n",
                b"GET\t/health\tHTTP/1.1\r\n\r\n", b"GET /health HTTP/1.1\r\nX: a\r\n b\r\n\r\n"]
    return ([("bad JSON body", post(p, b)) for b in bad_bodies for p in ("/rollouts", "/metrics")]
            + [("bad batch", post("/rollouts", x)) for x in bad_tops]
            + [("bad group", post("/rollouts", dict(ok, batch_id=f"g{i}", groups=[x]))) for i, x in enumerate(bad_groups)]
            + [("unknown method", r) for r in methods]
            + [("bad metrics", post("/metrics", m)) for m in metrics]
            + [("bad query or path", r) for r in get] + [("protocol abuse", r) for r in protocol]
            + [("fuzzed (fuzzed_requests)", r) for _, r in fuzzed_requests(500, seed=1)])


def fuzzed_requests(n, seed=0):
    """n requests made by mutating valid ones at random (seeded) -> [(mutation, raw bytes)]: a value of the
    JSON body replaced by a hostile one (wrong types, lone surrogates, huge numbers, control characters,
    deep nesting), a field dropped or added, a query parameter changed, or the head bent (a header twice,
    a space before the colon, tabs for spaces, stray bytes). Every length is true, so none waits."""
    rng = random.Random(seed)
    group = {"task": "t", "question": "q", "answer": "a", "metadata": {"k": [1, {"z": "v"}]}, "completions": ["c", "d"],
             "stopped": [True, False], "model": "m"}
    bodies = {"/rollouts": {"peer": "p", "round": 1, "batch_id": "b", "groups": [group]},
              "/metrics": {"peer": "p", "round": 1, "metrics": {"loss": 0.5, "local_reward": None}}}
    nasty = [None, True, False, -1, 0, 2**63, 1.5, -0.0, 1e308, "", "\ud800", "a\udfff", "\ud83d\ude00", "\x00",
             "x" * 70_000, "caf\u00e9", "<b>", "../x", [], [None], [[[[[[[[[[[]]]]]]]]]]], {}, {"\ud800": 1}, {"": 1}]
    raw_nasty = ["1e999", "-1e999", "1" * 5000, "NaN", "-Infinity", '"\\ud800"', '"\\udc00\\ud800"', "[" * 50 + "]" * 50]

    def paths(x, here=()):  # every place a value sits in x
        yield here
        for k, v in (x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()):
            yield from paths(v, here + (k,))

    def head(method, target, body, extra=()):
        lines = [f"{method} {target} HTTP/1.1", "Host: x", "Connection: close", *extra]
        return ("\r\n".join(lines + [f"Content-Length: {len(body)}", "", ""])).encode("latin-1") + body

    out = []
    for _ in range(n):
        path = rng.choice(["/rollouts", "/metrics", "/rollouts?", "/health"])
        body, target = json.loads(json.dumps(bodies.get(path, {}))), path
        kind = rng.choice(["value", "raw value", "drop", "add", "query", "head"] if path in bodies else ["query", "head"])
        text = None
        if kind in ("value", "raw value", "drop", "add"):
            spot = rng.choice([p for p in paths(body) if p])
            parent = body
            for k in spot[:-1]:
                parent = parent[k]
            if kind == "value":
                parent[spot[-1]] = rng.choice(nasty)
            elif kind == "drop":
                del parent[spot[-1]]
            elif kind == "add" and isinstance(parent, dict):
                parent[rng.choice(["\ud800", "x" * 100, "seq", "time", "peer"])] = rng.choice(nasty)
            else:
                marker = "\u0001MARK\u0001"
                parent[spot[-1]] = marker
                text = json.dumps(body).replace(json.dumps(marker), rng.choice(raw_nasty))
        data = (text or json.dumps(body)).encode() if path in bodies else b""
        method = "POST" if path in bodies else "GET"
        if kind == "query":
            method, target = "GET", rng.choice(["/rollouts", "/metrics"]) + "?" + "&".join(
                f"{rng.choice(['after', 'limit', 'exclude', 'x'])}={rng.choice(['0', '-1', '1e3', '%ff', '%00', '%ud800', '9' * 20, '', 'a b', '1&after=2'])}"
                for _ in range(rng.randint(1, 4)))
            data = b""
        raw = head(method, target, data)
        if kind == "head":
            raw = rng.choice([head(method, target, data, [f"Content-Length: {len(data)}"]),
                              head(method, target, data, ["Authorization: Bearer x", "Authorization: Bearer y"]),
                              raw.replace(b"Host: x", b"Host : x"), raw.replace(b" ", b"\t", 2),
                              raw.replace(b"Host: x", b"Host: x\r\n x"), raw.replace(b"HTTP/1.1", b"HTTP/1.1 x", 1),
                              raw.replace(b"Host", bytes([rng.randrange(256)]) + b"Host"), raw.replace(b"\r\n", b"\n"),
                              raw.replace(b"Host: x", b"Host: \xff\x00")])
        out.append((kind, raw))
    return out


def _raw(url, data):
    """Send raw bytes -> the reply's status (0: closed without a reply)."""
    import socket
    host, port = url[7:].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        try:
            s.sendall(data)
            reply = s.recv(65536)
        except OSError:
            reply = b""
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", reply)
    return int(m.group(1)) if m else 0


def attack_hostile():
    """Every crafted request once, 16 at a time -> replies counted by class and status."""
    from concurrent.futures import ThreadPoolExecutor
    import requests
    proc, url, folder = _server()
    try:
        cases = _hostile_requests()
        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(lambda case: _raw(url, case[1]), cases))
        counts = {}
        for (cls, _), status in zip(cases, statuses):
            c = counts.setdefault(cls, {"requests": 0, "2xx": 0, "4xx": 0, "5xx": 0, "closed": 0})
            c["requests"] += 1
            c[f"{status // 100}xx" if status else "closed"] += 1
        alive = requests.get(url + "/health", timeout=5).json()
        return {"classes": counts, "stored_groups_after": alive["groups"], "server_alive": alive["ok"]}
    finally:
        _end(proc, folder)


def attack_kill9(cycles=10, writers=16):
    """kill -9 in the middle of `writers` concurrent writers, `cycles` times: every acknowledged batch
    must be there after each restart, once, under the seq it was acknowledged with."""
    import random
    import requests
    folder, acked, lost, duplicated = tempfile.mkdtemp(prefix="swarm-attack-"), {}, 0, 0
    try:
        for cycle in range(cycles):
            proc, url, _ = _server(folder)
            stop = threading.Event()

            def writer(w):
                session, i = requests.Session(), 0
                while not stop.is_set():
                    key = f"{cycle}-{w}-{i}"
                    try:
                        r = session.post(url + "/rollouts", timeout=10, json={
                            "peer": f"w{w}", "round": i, "batch_id": key, "groups": _groups(key, 2, 2, 100)})
                        if r.status_code == 200:
                            acked[key] = r.json()["seq"]
                    except requests.RequestException:
                        return
                    i += 1

            threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
            for t in threads:
                t.start()
            time.sleep(random.uniform(0.3, 1.0))
            proc.kill()
            proc.wait()
            stop.set()
            for t in threads:
                t.join()
        proc, url, _ = _server(folder)
        seen = {}
        for g in _read_all(url):
            key = g["question"].rsplit(" question ", 1)[0]
            seen.setdefault(key, []).append(g["seq"])
        proc.kill()
        proc.wait()
        for key, seq in acked.items():
            lost += key not in seen or seen[key][-1] != seq
        duplicated = sum(len(s) != 2 for s in seen.values())
        return {"cycles": cycles, "writers": writers, "batches_acknowledged": len(acked),
                "acknowledged_lost": lost, "batches_stored_twice": duplicated}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def attack_client(calls=50):
    """A client against a black hole (accepts, never answers), a trickle (a byte every 2 s), a server
    answering 500s and garbage, and a port nobody listens on: the slowest publish()/fetch()/post_metrics()
    call; then a real server comes up on the same port and everything queued must arrive once."""
    import socket
    import swarm
    results, servers = {}, []

    def hostile(kind, sock):
        conns = []
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                break
            conns.append(conn)

            def answer(conn=conn):
                try:
                    conn.recv(65536)
                    if kind == "500 or garbage":
                        conn.sendall(b"HTTP/1.1 500 Oops\r\nContent-Length: 2\r\n\r\nno" if len(conns) % 2 else b"\x00{[")
                    else:
                        for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n":
                            conn.send(bytes([byte]))
                            time.sleep(2)
                except OSError:
                    pass
            threading.Thread(target=answer, daemon=True).start()
        for conn in conns:
            conn.close()

    kinds = ["black hole", "trickle", "500 or garbage", "down"]
    socks = {}
    for kind in kinds:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        if kind != "down":
            s.listen(64)
        if kind in ("trickle", "500 or garbage"):
            threading.Thread(target=hostile, args=(kind, s), daemon=True).start()
        socks[kind] = s
    clients = {kind: swarm.connect(f"http://127.0.0.1:{s.getsockname()[1]}", f"p{k}", 4) for k, (kind, s) in
               enumerate(socks.items())}
    try:
        slowest = {kind: 0.0 for kind in kinds}
        for r in range(calls):
            for kind, c in clients.items():
                for call in (lambda: c.publish(r, _groups(r, 1)), c.fetch, lambda: c.post_metrics(r, {"x": 1.0})):
                    t = time.perf_counter()
                    call()
                    slowest[kind] = max(slowest[kind], time.perf_counter() - t)
            time.sleep(0.1)
        for kind, s in socks.items():
            port = s.getsockname()[1]
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
            servers.append(swarm.start_server(tempfile.mkdtemp(prefix="swarm-attack-"), port=port))
        for (server, url), (kind, c) in zip(servers, clients.items()):
            flushed = c.flush(60)
            rounds = [int(g["question"].split()[0]) for g in _read_all(url)]
            results[kind] = {"slowest_call_ms": round(1000 * slowest[kind], 2), "delivered_after": flushed,
                             "batches_delivered_once": sorted(rounds) == list(range(calls))}
        return results
    finally:
        for c in clients.values():
            c.close()
        for server, _ in servers:
            shutil.rmtree(server.store.folder, ignore_errors=True)
            server.shutdown()


def _longest_stall(seconds, client=None):
    """The training thread: short steps of work, asking the client for a read (fetch(), which never
    waits) every 0.1 s, as a round would -> the longest it stood still, in seconds."""
    stall, asked = 0.0, 0.0
    last = t0 = time.perf_counter()
    while (now := time.perf_counter()) < t0 + seconds:
        stall, last = max(stall, now - last), now
        if client is not None and now > asked + 0.1:
            client.fetch()
            asked = now
        sum(range(2000))
    return stall


def attack_large_reply(mb=32, seconds=10, closes=5):
    """A server answering every read with `mb` MB of tiny JSON objects, {"groups":[{},{},...]}: the
    longest the training thread stood still while the client's thread took the reply (parsing holds the
    interpreter lock), and the slowest of `closes` close() calls made at moments after a reply went out."""
    import contextlib
    import io
    import swarm
    body = b'{"groups":[' + b",".join([b"{}"] * ((mb << 20) // 3)) + b'],"last":1}'
    sent = threading.Event()

    def answer(method, path, request_body):
        sent.set()
        return 200, body

    httpd, url = fake_server(answer)
    log = io.StringIO()
    try:
        with contextlib.redirect_stderr(log):
            alone = _longest_stall(seconds / 2)  # what the machine's load alone costs
            client = swarm.connect(url, "victim", 16)
            stall = _longest_stall(seconds, client)
            client.close()
            slowest_close, closed = 0.0, not any(t.is_alive() for t in client.threads)
            for k in range(closes):  # at 0.05, 0.3, 0.55, ... s after a reply went out
                sent.clear()
                client = swarm.connect(url, "victim", 16)
                client.fetch()  # (asks for a read)
                sent.wait(30)
                time.sleep(0.05 + 0.25 * k)  # the reply is on its way: close() while the client's thread takes it
                t = time.perf_counter()
                client.close()
                slowest_close = max(slowest_close, time.perf_counter() - t)
                closed = closed and not any(t.is_alive() for t in client.threads)
        return {"reply_mb": mb, "training_thread_longest_stall_ms": round(1000 * stall, 1),
                "same_without_a_client_ms": round(1000 * alone, 1), "slowest_close_ms": round(1000 * slowest_close, 1),
                "log_lines": log.getvalue().count("swarm client"), "refused": "a reply of more than" in log.getvalue(),
                "closed": closed}
    finally:
        httpd.shutdown()


def attack_poisoned_reads(groups=40, seconds=8):
    """A server that serves, among the groups arriving at 5 a second, one whose question is a lone
    surrogate ("\\ud800", which UTF-8 cannot carry): how many of those published after it the client
    received, and the lines it logged."""
    import contextlib
    import io
    import swarm
    stored = []

    def answer(method, path, body):  # every sampled read: all the groups so far (the client hands out none twice)
        return 200, {"groups": stored, "last": len(stored)}

    httpd, url = fake_server(answer)
    log, got = io.StringIO(), []
    try:
        with contextlib.redirect_stderr(log):
            client = swarm.connect(url, "victim", swarm.Limits.sample_groups)
            for seq in range(1, groups + 1):
                stored.append({**_groups(seq, 1, 2, 80)[0], "peer": "other", "round": seq, "seq": seq, "time": 1.7e9})
                stored[-1]["question"] = "\ud800" if seq == 3 else stored[-1]["question"]
                time.sleep(seconds / groups)
                got += [g["seq"] for g in client.fetch()]
            client.flush(10)
            got += [g["seq"] for g in client.fetch()]
            client.close()
        return {"surrogate": {"published_after_the_poison": groups - 3, "received_of_those": len(set(got) - {1, 2}),
                              "log_lines": log.getvalue().count("swarm client")}}
    finally:
        httpd.shutdown()


def attack_memory(keep_mb=64, post_mb=256, writers=4, largest=False):
    """Fill a server with --keep-bytes keep_mb far past it: its disk use and resident memory. Posts of
    32 groups of 8 completions of 1,000 characters (~260 KB), or with `largest` the largest valid bodies
    (4 groups of 64 completions of 31,000 characters: 7.6 MB)."""
    import requests
    proc, url, folder = _server(None, "--keep-bytes", f"{keep_mb}M")
    try:
        empty_rss, peak_disk = _rss_mb(proc.pid), 0
        shape, kb = ((4, 64, 31_000), 7_800) if largest else ((32, 8, 1000), 260)
        body = lambda w, i: {"peer": f"w{w}", "round": i, "batch_id": f"{w}-{i}", "groups": _groups(f"{w}-{i}", *shape)}
        posts = max(1, post_mb * 1024 // kb // writers)

        def writer(w):
            session = requests.Session()
            for i in range(posts):
                while session.post(url + "/rollouts", json=body(w, i), timeout=60).status_code == 503:
                    time.sleep(0.2)  # busy: in flight are 64 MB of bodies already; send it again

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak_disk = max(peak_disk, sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
                                           if os.path.exists(os.path.join(folder, n))))
            time.sleep(0.2)
        disk = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
        return {"keep_mb": keep_mb, "posted_mb": round(posts * writers * kb / 1024), "disk_mb": round(disk / 2**20, 1),
                "peak_disk_mb": round(peak_disk / 2**20, 1), "empty_rss_mb": round(empty_rss, 1),
                "final_rss_mb": round(_rss_mb(proc.pid), 1), "peak_rss_mb": round(_rss_mb(proc.pid, "VmHWM"), 1)}
    finally:
        _end(proc, folder)


# --attack, the store's own bounds and its writers: each case against a shared token and against one
# credential per peer (run both with --against DIR, where DIR/swarm.py predates --peers-file, and that
# column says so). "Honest" writers and readers act beside one attacker, "mallory".

def _guarded(names, *flags):
    """{"shared token": start, "per-peer credentials": start}: start() -> (server process, url, folder, token
    of a writer by name), the server run with `flags` and guarded the one way or the other."""
    tokens = {name: f"token-{name}" for name in names}

    def shared():
        return (*_server(None, "--token", "shared-token", *flags), lambda name: "shared-token")

    def per_peer():
        with tempfile.NamedTemporaryFile("w", suffix=".peers") as f:  # (read once, at the server's start)
            f.write("".join(f"{name} {token}\n" for name, token in tokens.items()))
            f.flush()
            return (*_server(None, "--peers-file", f.name, *flags), tokens.get)

    return {"shared token": shared, "per-peer credentials": per_peer}


def _each_guard(attack, names, *flags):
    """attack(url, token) in a fresh server for each guard -> {guard: its figures}; a server that cannot start
    (an older swarm.py without --peers-file) is said, not raised."""
    results = {}
    for guard, start in _guarded(names, *flags).items():
        try:
            proc, url, folder, token = start()
        except RuntimeError:
            results[guard] = "the server does not start with it"
            continue
        try:
            results[guard] = attack(url, token, proc)
        finally:
            _end(proc, folder)
    return results


def _post(session, url, token, name, round_, groups, batch_id=None):
    """A POST /rollouts as `name` with `token` -> (status, milliseconds)."""
    t = time.perf_counter()
    try:
        status = session.post(url + "/rollouts", headers={"Authorization": f"Bearer {token}"}, timeout=30, json={
            "peer": name, "round": round_, "batch_id": batch_id or f"{name}-{round_}", "groups": groups}).status_code
    except OSError:
        status = "error"
    return status, 1000 * (time.perf_counter() - t)


def _sampled_peers(url, token, reads, k=16, reader="reader"):
    import requests
    peers = []
    for seed in range(reads):
        page = requests.get(f"{url}/rollouts?sample={k}&exclude={reader}&seed={seed}", timeout=30,
                            headers={"Authorization": f"Bearer {token(reader)}"}).json()
        peers += [(g["peer"], g["question"]) for g in page["groups"]]
    return peers


def attack_sybil(names=100, honest=4, reads=100):
    """Four honest writers post two batches each; mallory posts two under each of `names` names (with
    per-peer credentials its own token, whatever it claims), then two as itself. Mallory's share of the
    groups in `reads` sampled reads of 16."""
    import requests
    writers = [f"h{k}" for k in range(honest)]

    def attack(url, token, proc):
        session, refused = requests.Session(), 0
        for r in range(2):
            for w in writers:
                _post(session, url, token(w), w, r, _groups(w, 4, 2, 100))
            for n in range(names):
                refused += _post(session, url, token("mallory"), f"m{n}", r, _groups("mallory", 4, 2, 100))[0] == 403
            _post(session, url, token("mallory"), "mallory", r, _groups("mallory", 4, 2, 100))
        drawn = _sampled_peers(url, token, reads)
        share = sum(q.startswith("mallory") for _, q in drawn) / max(1, len(drawn))
        return {"mallory_share": round(share, 3), "fair_share": round(1 / (honest + 1), 3),
                "writes_refused": refused, "groups_drawn": len(drawn)}

    return {"names": names, **_each_guard(attack, [*writers, "mallory", "reader"])}


def attack_impersonation(rounds=10, reads=100):
    """Alice posts a batch a round; after each, mallory posts two as alice (a window is a writer's newest
    two batches). Of the groups sampled reads draw "from alice", the share that are alice's own."""
    import requests

    def attack(url, token, proc):
        session, refused = requests.Session(), 0
        for r in range(rounds):
            _post(session, url, token("alice"), "alice", r, _groups("genuine", 4, 2, 100))
            _post(session, url, token("bob"), "bob", r, _groups("bob", 4, 2, 100))
            for j in range(2):
                status = _post(session, url, token("mallory"), "alice", 1000 + 2 * r + j, _groups("forged", 4, 2, 100))[0]
                refused += status == 403
        alice = [q for peer, q in _sampled_peers(url, token, reads) if peer == "alice"]
        return {"alice_groups_genuine": round(sum(q.startswith("genuine") for q in alice) / max(1, len(alice)), 3),
                "forged_writes_refused": refused}

    return _each_guard(attack, ["alice", "bob", "mallory", "reader"])


def _honest_posts(url, token, writers, seconds, pace=1.5):
    """Honest writers posting a batch of 4 groups each every `pace` s for `seconds` -> (POST ms, acknowledged
    batch ids)."""
    import requests
    times, acked, stop = [], [], time.time() + seconds

    def writer(w):
        session, r = requests.Session(), 0
        while time.time() < stop:
            status, ms = _post(session, url, token(w), w, r, _groups(f"{w}-{r}", 4, 8, 600))
            times.append(ms)
            if status == 200:
                acked.append(f"{w}-{r}")
            r += 1
            time.sleep(pace)

    threads = [threading.Thread(target=writer, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times, acked


def attack_flood_writer(seconds=20, flooders=4, keep="4M"):
    """Under --keep-bytes 4M: four honest writers post a batch of ~20 KB every 1.5 s (together less than the
    budget), alone for a while, then while mallory posts valid batches of ~40 KB from `flooders` connections
    at full rate. The honest groups still kept at the end, and the honest POST p50 alone and under the flood."""
    import requests
    writers = ["h0", "h1", "h2", "h3"]

    def attack(url, token, proc):
        alone, _ = _honest_posts(url, token, writers, seconds / 4)
        stop, flooded = threading.Event(), [0]

        def flood(f):
            session, r = requests.Session(), 0
            while not stop.is_set():
                flooded[0] += _post(session, url, token("mallory"), "mallory", r, _groups(f"m{f}-{r}", 8, 8, 600),
                                    f"m{f}-{r}")[0] == 200
                r += 1

        threads = [threading.Thread(target=flood, args=(f,)) for f in range(flooders)]
        for t in threads:
            t.start()
        t0 = time.time()
        under, acked = _honest_posts(url, token, writers, seconds)
        stop.set()
        for t in threads:
            t.join()
        mallory_mb = flooded[0] * len(json.dumps(_groups("m0-0", 8, 8, 600))) / 2**20 / (time.time() - t0)
        kept = {g["question"].rsplit(" question ", 1)[0] for g in _read_all(url, token("h0"))}
        return {"honest_batches": len(acked), "honest_kept": round(sum(a in kept for a in acked) / max(1, len(acked)), 3),
                "honest_post_p50_ms_alone": _pct(alone, 0.5), "honest_post_p50_ms_flood": _pct(under, 0.5),
                "mallory_acked_mb_per_s": round(mallory_mb, 1)}

    return {"keep_bytes": keep, **_each_guard(attack, [*writers, "mallory"], "--keep-bytes", keep)}


def attack_write_queue(connections=500, seconds=15):
    """Mallory holds `connections` connections, each posting tiny batches back to back; an honest writer
    posts one tiny batch at a time. Its POST p50 alone, then under the queue."""
    import requests

    def attack(url, token, proc):
        rounds, stop, sent, answered = iter(range(10**9)), threading.Event(), collections.Counter(), collections.Counter()

        def honest(n):
            session, times = requests.Session(), []
            for r in itertools.islice(rounds, n):
                status, ms = _post(session, url, token("honest"), "honest", r, _groups(f"h{r}", 1, 1, 50))
                answered[status] += 1
                times.append(ms)
            return times

        def queue(c):
            session, r = requests.Session(), 0
            while not stop.is_set():
                sent[_post(session, url, token("mallory"), "mallory", r, _groups("m", 1, 1, 50), f"m{c}-{r}")[0]] += 1
                r += 1

        alone = honest(50)

        threads = [threading.Thread(target=queue, args=(c,), daemon=True) for c in range(connections)]
        for t in threads:
            t.start()
        time.sleep(3)
        t0, under = time.time(), []
        while time.time() < t0 + seconds:
            under += honest(1)
        stop.set()
        for t in threads:
            t.join(60)
        return {"honest_post_p50_ms_alone": _pct(alone, 0.5), "honest_post_p50_ms_queue": _pct(under, 0.5),
                "honest_posts_under_queue": len(under), "honest_replies": dict(answered), "mallory_replies": dict(sent)}

    return {"connections": connections, **_each_guard(attack, ["honest", "mallory"])}


def _disk_mb(folder):  # what a folder's files take on disk (their blocks)
    paths = [os.path.join(folder, name) for name in os.listdir(folder)]
    return sum(os.stat(p).st_blocks * 512 for p in paths if os.path.isfile(p)) / 2**20


def _tiny_posts(url, n, threads=4, name=lambda r: f"w{r % 4}"):
    """n tiny batches (one group of one short completion; batch r by name(r)), from `threads` threads -> POST ms."""
    import requests
    times = []

    def writer(w):
        session = requests.Session()
        for r in range(w, n, threads):
            times.append(_post(session, url, "", name(r), r, _groups(f"t{r}", 1, 1, 100), f"t{r}")[1])

    workers = [threading.Thread(target=writer, args=(w,)) for w in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return times


def attack_tiny_batches(n=100_000, keep="256M"):
    """n tiny batches under --keep-bytes `keep`: the files and disk they take, the server's memory, its
    start after kill -9 on that folder, and the slowest POST (the one that crosses --keep-bytes prunes)."""
    proc, url, folder = _server(None, "--keep-bytes", keep)
    try:
        t0 = time.time()
        times = _tiny_posts(url, n)
        seconds, rss = time.time() - t0, _rss_mb(proc.pid)
        time.sleep(2)  # (for the files retention is deleting)
        files, disk = len(os.listdir(folder)), _disk_mb(folder)
        proc.kill()
        proc.wait()
        t0 = time.time()
        proc, url, _ = _server(folder, "--keep-bytes", keep)
        start = time.time() - t0
        return {"batches": n, "keep_bytes": keep, "posts_per_s": round(n / seconds), "post_p99_ms": _pct(times, 0.99),
                "post_max_ms": round(max(times), 1), "files": files, "disk_mb": round(disk, 1),
                "server_rss_mb": round(rss, 1), "start_after_kill9_s": round(start, 2),
                "load_average": open("/proc/loadavg").read().split()[0]}
    finally:
        _end(proc, folder)


def attack_many_writers(writers=30_000, reads=200):
    """One tiny batch from each of `writers` writers, then `reads` sampled reads of 16 while another client
    asks GET /health: their latencies (a read that passes over every writer grows with their number)."""
    import requests
    proc, url, folder = _server()
    stop, health, reads_ms, full = threading.Event(), [], [], 0

    def ask():
        while not stop.is_set():
            t = time.perf_counter()
            requests.get(url + "/health", timeout=30)
            health.append(1000 * (time.perf_counter() - t))
            time.sleep(0.01)

    asker = threading.Thread(target=ask)
    try:
        _tiny_posts(url, writers, 8, name=lambda r: f"w{r}")
        asker.start()
        for seed in range(reads):
            t = time.perf_counter()
            page = requests.get(f"{url}/rollouts?sample=16&seed={seed}", timeout=30).json()
            reads_ms.append(1000 * (time.perf_counter() - t))
            full += len({g["peer"] for g in page["groups"]}) == 16  # K groups, of K writers
        return {"writers": writers, "reads_of_16_writers": full, "reads": reads, "sample16_p50_ms": _pct(reads_ms, 0.5), "sample16_p99_ms": _pct(reads_ms, 0.99),
                "health_p50_ms": _pct(health, 0.5), "health_p99_ms": _pct(health, 0.99)}
    finally:
        _end(proc, folder, stop, [asker] if asker.ident else [])


def attack_unread_replies(readers=200, seconds=30, honest=8):
    """`readers` connections each ask for a 1 MB page and never read it (a small receive buffer, so that
    the reply waits on the server's side), while for their first `honest` seconds an honest client reads
    that page, GET /health and posts: its failures, the server's resident memory before and at its peak,
    the kernel's TCP memory (all sockets, /proc/net/sockstat) and its orphaned sockets, 2 s in and
    `seconds` in."""
    import requests
    import socket
    proc, url, folder = _server()
    host, port = url[7:].rsplit(":", 1)
    try:
        for r in range(6):  # about 1.2 MB of groups: a page of 1 MB
            requests.post(url + "/rollouts", timeout=30, json={"peer": "a", "round": r, "batch_id": f"a{r}",
                                                               "groups": _groups(r, 7, 7, 30_000)})

        def sockstat():
            line = next(l for l in open("/proc/net/sockstat") if l.startswith("TCP:")).split()
            return dict(zip(line[1::2], map(int, line[2::2])))

        base, conns, seen, held = sockstat(), [], {}, _descriptors(proc.pid)
        rss_before, figures = _rss_mb(proc.pid), {}
        for _ in range(readers):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(b"GET /rollouts?after=0&limit=1024 HTTP/1.1\r\nHost: x\r\n\r\n")
            conns.append(s)
        t0 = time.time()
        client = threading.Thread(target=lambda: figures.update(_honest(url, honest, page=True)))
        client.start()
        for at in (2, seconds):
            time.sleep(max(0, t0 + at - time.time()))
            now = sockstat()
            seen[f"at_{at}s"] = {"tcp_mem_mb": round((now["mem"] - base["mem"]) * 4096 / 2**20, 1),
                                 "orphans": now["orphan"] - base["orphan"], "server_descriptors": _descriptors(proc.pid)}
        client.join()
        seen["server_descriptors_before"] = held
        for s in conns:
            s.close()
        return {"readers": readers, "server_rss_mb_before": round(rss_before, 1),
                "server_peak_rss_mb": round(_rss_mb(proc.pid, "VmHWM"), 1), **figures, **seen}
    finally:
        _end(proc, folder)


def attack_client_reads(rounds=60, link_seconds=6, seconds=10):
    """Two peers on a real server, each round publishing a batch and a metrics row and asking for a read,
    rounds 0.01 to 0.1 s apart: the groups each received. Then a peer whose server takes `link_seconds` to take each
    batch (a 6 MB batch on a 1 MB/s link), asking for a read every 0.1 s for `seconds`: the reads done."""
    import swarm
    proc, url, folder = _server()
    received, rng = {}, random.Random(0)

    def peer(name):  # a round: its batch (8 groups of 8 completions) and its metrics row, then a read
        client, got = swarm.connect(url, name, 16), 0
        for r in range(rounds):
            client.publish(r, _groups(f"{name}-{r}", 8))
            client.post_metrics(r, {"local_reward": 0.5})
            got += len(client.fetch())
            time.sleep(rng.uniform(0.01, 0.1))
        received[name] = got
        client.close()

    try:
        threads = [threading.Thread(target=peer, args=(name,)) for name in ("p0", "p1")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        _end(proc, folder)
    reads, stored = [0], {"groups": [dict(g, peer="other", round=0, seq=1, time=1.7e9) for g in _groups("other", 1)],
                          "last": 1}

    def slow_link(method, path, body):
        if method == "POST":
            time.sleep(link_seconds)  # what the batch takes to cross the link
            return 200, {"accepted": 4, "seq": 4}
        reads[0] += 1
        return 200, stored

    httpd, url = fake_server(slow_link)
    client = swarm.connect(url, "slow", 4)
    try:
        t0 = time.time()
        for r in range(4):
            client.publish(r, _groups(f"slow-{r}", 4))
        while time.time() < t0 + seconds:
            client.fetch()
            time.sleep(0.1)
        return {"rounds": rounds, "groups_received": received, "slow_link_s": link_seconds, "read_for_s": seconds,
                "reads_done": reads[0]}
    finally:
        client.close()
        httpd.shutdown()


def attack_late_retries(n=100, keep="64K"):
    """Under --keep-bytes `keep`: n tiny batches from 4 writers, then each of them posted again (a late
    retry, with its batch_id): the re-posts stored again, each under a new seq."""
    import requests
    proc, url, folder = _server(None, "--keep-bytes", keep)
    try:
        session = requests.Session()
        post = lambda r: session.post(url + "/rollouts", timeout=30, json={  # noqa: E731
            "peer": f"w{r % 4}", "round": r, "batch_id": f"t{r}", "groups": _groups(f"t{r}", 1, 1, 100)}).json()
        first = [post(r) for r in range(n)]
        again = [post(r) for r in range(n)]
        return {"keep_bytes": keep, "batches": n, "stored_again": sum(a != b for a, b in zip(first, again))}
    finally:
        _end(proc, folder)


def _full_batch(tag):
    """A batch of 4 groups holding 2^20 values less a few (Limits.json_values): 16 completions of 8,192
    token ids and log-probs each, less some ids of the last."""
    import swarm
    ids = [[0] * 8192 for _ in range(16)]
    groups = [{"task": "t", "question": f"{tag} question {k}", "answer": "a", "completions": ["c"] * 16,
               "stopped": [True] * 16, "token_ids": [list(c) for c in ids], "logprobs": [list(c) for c in ids],
               "tokenizer": "v"} for k in range(4)]
    body = {"peer": "alice", "round": 0, "batch_id": tag, "groups": groups}
    cut = (swarm._values(json.dumps(body)) - swarm.Limits.json_values + 5) // 2  # (an id and its log-prob)
    del groups[-1]["token_ids"][-1][-cut:], groups[-1]["logprobs"][-1][-cut:]
    return json.dumps(body).encode()


def attack_parse_limit(batches=3):
    """`batches` batches of nearly 2^20 JSON values each (the most a POST may hold), acknowledged, then kill -9
    and a start on the folder: the acknowledged batches it reads back."""
    import requests
    proc, url, folder = _server()
    try:
        acked = [requests.post(url + "/rollouts", data=_full_batch(f"full{k}"), timeout=60,
                               headers={"Content-Type": "application/json"}).status_code == 200 for k in range(batches)]
        proc.kill()
        proc.wait()
        proc, url, _ = _server(folder)
        back = {g["question"].split()[0] for g in _read_all(url)}
        return {"batches": batches, "acknowledged": sum(acked), "read_back_after_kill9": len(back)}
    finally:
        _end(proc, folder)




# -----------------------------------------------------------------------------
# the table: every attack at the sizes docs/swarm.md measures, and at the sizes its test runs

ATTACKS = [  # (what, attack, docs/swarm.md's sizes, a test's sizes)
    ("slow-connection flood", attack_flood, dict(slow=500, seconds=20), dict(slow=100, seconds=3)),
    ("hostile requests", attack_hostile, {}, {}),
    ("busy connections at the cap", attack_busy_cap, {}, dict(busy=300, limit=256, seconds=3)),
    ("stalled bodies without the token", attack_stalled_bodies, {}, dict(senders=4, seconds=3)),
    ("parse bombs", attack_parse_bombs, {}, dict(writers=2, seconds=3)),
    ("kill -9 cycles", attack_kill9, dict(cycles=10), dict(cycles=3, writers=8)),
    ("client vs bad servers", attack_client, {}, dict(calls=10)),
    ("client vs a large reply", attack_large_reply, {}, dict(seconds=2, closes=2)),
    ("client vs poisoned reads", attack_poisoned_reads, {}, dict(groups=10, seconds=2)),
    ("memory and disk", attack_memory, {}, dict(keep_mb=16, post_mb=48)),
    ("memory and disk, largest bodies", attack_memory, dict(keep_mb=256, post_mb=512, writers=16, largest=True),
     dict(keep_mb=32, post_mb=64, largest=True)),
    ("sybil: one writer under many names", attack_sybil, {}, dict(names=20, reads=20)),
    ("impersonation: posting as alice", attack_impersonation, {}, dict(rounds=3, reads=20)),
    ("flood: one writer at full rate under --keep-bytes 4M", attack_flood_writer, {}, dict(seconds=4)),
    ("write queue: many writer connections", attack_write_queue, {}, dict(connections=50, seconds=4)),
    ("tiny batches: files, disk, memory, start", attack_tiny_batches, {}, dict(n=3000, keep="1M")),
    ("pruning: the post that crosses --keep-bytes", attack_tiny_batches, dict(n=100_000, keep="24M"),
     dict(n=3000, keep="300K")),
    ("many writers: sampled reads", attack_many_writers, {}, dict(writers=1000, reads=20)),
    ("unread replies: kernel memory", attack_unread_replies, {}, dict(readers=20, seconds=25, honest=4)),
    ("stalled bodies of anonymous reads", attack_stalled_reads, {}, dict(senders=4, seconds=3)),
    ("stalled bodies of one writer", attack_stalled_writer, {}, dict(bodies=4, seconds=3)),
    ("client: reads beside writes", attack_client_reads, {}, dict(rounds=20, link_seconds=3, seconds=2)),
    ("late retries under a small --keep-bytes", attack_late_retries, {}, dict(n=100)),
    ("batches at the parse limit over kill -9", attack_parse_limit, {}, dict(batches=1)),
]


ATTACK_SIZES = {what: test for what, _, _, test in ATTACKS}


def run(what, small=True):
    """One attack of the table by its name, at a test's sizes (or docs/swarm.md's) -> its figures."""
    _, attack, full, test = next(row for row in ATTACKS if row[0] == what)
    return attack(**(test if small else full))


def main(argv=None):
    p = argparse.ArgumentParser(description="What the rollout server and the client survive (docs/swarm.md).")
    p.add_argument("--only", nargs="+", help="only the attacks whose names hold one of these words")
    p.add_argument("--against", metavar="DIR", help="run the server from DIR/swarm.py (e.g. another checkout)")
    p.add_argument("--slow", type=int, help="slow connections held open (default: 500)")
    p.add_argument("--cycles", type=int, help="kill -9 cycles (default: 10)")
    p.add_argument("--quick", action="store_true", help="a test's sizes, to check that the attacks run (no figures)")
    p.add_argument("--json", action="store_true", help="one JSON object per attack")
    args = p.parse_args(argv)
    bench.SWARM_PY = os.path.join(os.path.abspath(args.against or bench.HERE), "swarm.py")
    if not os.path.isfile(bench.SWARM_PY):
        p.error(f"--against: there is no {bench.SWARM_PY}")
    print(f"server: {bench.SWARM_PY}; load average {' '.join(open('/proc/loadavg').read().split()[:3])}", flush=True)
    for what, attack, full, test in ATTACKS:
        if args.only and not any(word in what for word in args.only):
            continue
        sizes = dict(test if args.quick else full)
        if attack is attack_flood and args.slow:
            sizes["slow"] = args.slow
        if attack is attack_kill9 and args.cycles:
            sizes["cycles"] = args.cycles
        t0 = time.time()
        r = attack(**sizes)
        print(json.dumps({"what": what, **r, "seconds": round(time.time() - t0, 1)}) if args.json else
              f"{what} ({time.time() - t0:.0f} s): {json.dumps(r)}", flush=True)


# -----------------------------------------------------------------------------
# each attack, the bound it proves

def test_the_attack_table_runs_every_attack_this_file_defines():
    """Every attack_* case is in the table (a case left out measures nothing, and docs/swarm.md quotes them
    all), and a test below runs each row of it by its name."""
    import inspect
    assert {name for name in globals() if name.startswith("attack_")} == {row[1].__name__ for row in ATTACKS}
    tests = "".join(inspect.getsource(test) for name, test in globals().items() if name.startswith("test_"))
    assert [row[0] for row in ATTACKS if f'"{row[0]}"' not in tests] == []


@pytest.mark.slow
def test_a_flood_of_slow_connections_lets_every_honest_request_through():
    """Slow connections held open (idle, a header byte every 2 s, a body never sent), made again once closed:
    every honest GET and POST is answered, and the server's memory stays small."""
    r = run("slow-connection flood")
    assert r["honest_errors"] == 0 and r["honest_requests"] > 0, r
    assert r["server_peak_rss_mb"] < 200, r


@pytest.mark.slow
def test_no_crafted_or_fuzzed_request_gets_a_5xx():
    """Every crafted request (bad JSON, batches, groups, methods, metrics, queries, protocol abuse) and 500
    fuzzed ones, 16 at a time: a 4xx, a 2xx where the mutation left it valid, or a clean close; never a 5xx,
    and the server still serves."""
    r = run("hostile requests")
    assert sum(c["5xx"] for c in r["classes"].values()) == 0 and r["server_alive"], r
    assert sum(c["requests"] for c in r["classes"].values()) == len(_hostile_requests())


@pytest.mark.slow
def test_busy_connections_at_the_cap_never_lock_honest_ones_out():
    """More busy connections than the descriptor limit allows, each one byte into its request line: honest
    requests are answered, and the server never holds more descriptors than its limit."""
    r = run("busy connections at the cap")
    assert r["honest_errors"] == 0 and r["server_alive"], r
    assert r["server_peak_descriptors"] <= r["descriptor_limit"], r


@pytest.mark.slow
def test_stalled_bodies_without_the_token_never_lock_honest_ones_out():
    """Senders without the token, each declaring a body of 8 MB and stalling one byte short, again and
    again: every honest request with the token is answered."""
    r = run("stalled bodies without the token")
    assert r["honest_errors"] == 0 and r["honest_requests"] > 0 and r["their_connects"] > 0, r


@pytest.mark.slow
def test_parse_bombs_are_refused_and_the_servers_memory_stays_bounded():
    """Bodies of nested empty objects: the 8 MB ones are refused (413) before parsing, the largest the server
    parses get a 400; no 5xx, and the server's memory stays within a few hundred MB."""
    r = run("parse bombs")
    assert set(r["bomb_replies"]) <= {"400", "413"} and "413" in r["bomb_replies"], r
    assert r["server_peak_rss_mb"] < 400, r


@pytest.mark.slow
def test_kill9_under_concurrent_writers_loses_no_acknowledged_batch():
    """kill -9 at a random moment under concurrent writers, cycle after cycle: every acknowledged batch is
    there after the restart, once, under the seq it was acknowledged with."""
    r = run("kill -9 cycles")
    assert r["batches_acknowledged"] > 0 and r["acknowledged_lost"] == 0 and r["batches_stored_twice"] == 0, r


@pytest.mark.slow
def test_a_client_facing_bad_servers_delivers_every_batch_once_a_real_one_is_back():
    """A client facing a black hole, a trickle, 500s and garbage, and a closed port keeps its batches; once a
    real server comes up on the port, every batch arrives exactly once."""
    r = run("client vs bad servers")
    for kind, figures in r.items():
        assert figures["delivered_after"] and figures["batches_delivered_once"], (kind, figures)


@pytest.mark.slow
def test_a_client_takes_no_large_reply_and_closes():
    """A server answering every read with 32 MB of tiny JSON objects: the client refuses the reply past its
    bounds (a log line says so) instead of parsing it, and each close() ends its thread."""
    r = run("client vs a large reply")
    assert r["refused"] and r["closed"], r


@pytest.mark.slow
def test_a_client_reads_on_past_a_poisoned_group():
    """A server that serves, among new groups, one whose question is a lone surrogate: every group published
    after it is received, and the client says so in one line."""
    r = run("client vs poisoned reads")["surrogate"]
    assert r["received_of_those"] == r["published_after_the_poison"] and r["log_lines"] == 1, r


@pytest.mark.slow
@pytest.mark.parametrize("what", ["memory and disk", "memory and disk, largest bodies"])
def test_retention_keeps_the_disk_within_keep_bytes_and_the_memory_bounded(what):
    """A server filled far past --keep-bytes by four writers (posts of 260 KB, or the largest valid bodies of
    7.6 MB): its disk stays within --keep-bytes and the newest batch (and the batches being written), its memory
    within docs/swarm.md's bound: 30 MB, 1.2 x --keep-bytes, and 8 + 64 + 100 + 75 MB of metrics, bodies in
    flight and parsing."""
    r = run(what)
    newest = 7.8 if "largest" in what else 0.3  # MB: one batch
    assert r["disk_mb"] <= r["keep_mb"] + newest and r["peak_disk_mb"] <= r["keep_mb"] + 4 * newest, r
    assert r["peak_rss_mb"] <= 30 + 1.2 * r["keep_mb"] + 8 + 64 + 100 + 75, r


@pytest.mark.slow
def test_a_sybil_gets_a_fair_share_with_per_peer_credentials():
    """One token holder posting under many names beside four honest writers: with per-peer credentials its
    writes under other names are refused and its share of sampled reads is about one writer's."""
    r = run("sybil: one writer under many names")
    peer = r["per-peer credentials"]
    assert peer["writes_refused"] == 2 * r["names"] and peer["groups_drawn"] > 0, r
    assert peer["mallory_share"] < 2 * peer["fair_share"], r


@pytest.mark.slow
def test_no_one_writes_as_alice_with_per_peer_credentials():
    """A token holder posting as alice: with per-peer credentials each forged write is refused, and every
    group a read draws from alice is hers."""
    r = run("impersonation: posting as alice")["per-peer credentials"]
    assert r["alice_groups_genuine"] == 1.0 and r["forged_writes_refused"] == 2 * 3, r


@pytest.mark.slow
def test_a_writer_flooding_past_keep_bytes_costs_the_honest_writers_no_batch():
    """Under --keep-bytes 4M, one writer posting valid batches at full rate from four connections beside four
    honest writers: retention takes the flood's own batches, and every honest batch is kept, whatever the guard."""
    r = run("flood: one writer at full rate under --keep-bytes 4M")
    for guard in ("shared token", "per-peer credentials"):
        assert r[guard]["honest_batches"] > 0 and r[guard]["honest_kept"] == 1.0, (guard, r)


@pytest.mark.slow
def test_a_writer_queueing_posts_on_many_connections_lets_an_honest_writer_through():
    """One writer holding many connections, each posting tiny batches back to back: every post of the honest
    writer beside it is acknowledged, alone and under the queue."""
    r = run("write queue: many writer connections")
    for guard in ("shared token", "per-peer credentials"):
        assert set(r[guard]["honest_replies"]) == {200} and r[guard]["honest_posts_under_queue"] > 0, (guard, r)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["tiny batches: files, disk, memory, start", "pruning: the post that crosses --keep-bytes"])
def test_tiny_batches_keep_the_disk_within_keep_bytes(what):
    """Thousands of tiny batches (one group of one short completion): retention counts their blocks, so the
    folder takes at most --keep-bytes on disk, and the server starts again after kill -9 on it."""
    r = run(what)
    keep_mb = int(r["keep_bytes"][:-1]) / (1024 if r["keep_bytes"].endswith("K") else 1)
    assert r["disk_mb"] <= keep_mb and r["files"] > 0 and r["start_after_kill9_s"] >= 0, r


@pytest.mark.slow
def test_sampled_reads_among_a_thousand_writers_draw_k_writers():
    """A thousand writers of one tiny batch each: every sampled read of K = 16 holds 16 groups of 16 writers."""
    r = run("many writers: sampled reads")
    assert r["reads_of_16_writers"] == r["reads"], r


@pytest.mark.slow
def test_replies_left_unread_are_cut_off_at_the_deadline():
    """Readers that ask for a 1 MB page and never read it: past the deadline the server has closed every one
    of their connections (it holds the descriptors it held before them), leaving no orphaned socket."""
    r = run("unread replies: kernel memory")
    held, end = r["at_2s"]["server_descriptors"], r[f"at_{ATTACK_SIZES['unread replies: kernel memory']['seconds']}s"]
    assert held > r["server_descriptors_before"] >= end["server_descriptors"], r
    assert r["honest_errors"] == 0 and r["honest_requests"] > 0, r  # (the readers hold no budget of theirs)


@pytest.mark.slow
def test_anonymous_reads_stalling_bodies_cost_the_writers_nothing():
    """With --public-reads, anonymous GETs declaring 8 MB bodies and stalling: each is refused at its
    headers, and every honest request is answered."""
    r = run("stalled bodies of anonymous reads")
    assert r["honest_errors"] == 0 and r["honest_requests"] > 0 and r["their_connects"] > 0, r


@pytest.mark.slow
def test_one_writers_stalled_bodies_cost_another_writer_nothing():
    """With per-peer credentials, one writer's many stalled 8 MB bodies wait for its own turn: every
    request of another writer is answered."""
    r = run("stalled bodies of one writer")
    assert r["honest_errors"] == 0 and r["honest_requests"] > 0, r


@pytest.mark.slow
def test_a_peers_reads_go_on_beside_its_writes():
    """Two peers with rounds 0.01 to 0.1 s apart both receive groups; a peer whose server takes seconds
    to take each batch still reads."""
    r = run("client: reads beside writes")
    assert all(n > 0 for n in r["groups_received"].values()) and r["reads_done"] > 0, r


@pytest.mark.slow
def test_late_retries_under_a_small_keep_bytes_are_stored_once():
    """Under --keep-bytes 64K, where most batches are pruned at once, each late retry gets its first reply."""
    r = run("late retries under a small --keep-bytes")
    assert r["stored_again"] == 0, r


@pytest.mark.slow
def test_a_batch_at_the_parse_limit_is_read_back_after_kill9():
    """A batch of nearly 2^20 values, acknowledged, is read back after kill -9 and a start on the folder."""
    r = run("batches at the parse limit over kill -9")
    assert r["acknowledged"] == r["read_back_after_kill9"] == r["batches"], r


if __name__ == "__main__":
    main()
