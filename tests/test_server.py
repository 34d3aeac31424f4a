"""
The rollout server's plumbing, beyond SAPO's rules (test_all.py holds those): HTTP parsing and hostile
input, tokens and per-peer credentials, the folder on disk (kill -9, damaged files, full disks, links and
FIFOs), retention by blocks, connection caps and slow connections, the command line.
"""

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import pytest
import requests

import swarm
from conftest import _SW_SCRIPT, _sw_spawn, _sw_stop
from test_all import _sw_disk, _sw_files, _sw_group, _sw_post, _sw_read_all, _sw_settled, _sw_tiny


def _sw_raw(url, method, path, body=None, headers=None, content_length=True):
    """A request exactly as written, for the bodies and headers `requests` would fix up."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if body is not None and content_length:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        if body:
            conn.send(body)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _sw_bytes(url, data, timeout=5.0):
    """Send raw bytes -> (status or None, JSON body or None, seconds until the reply was whole or the
    server closed). Reads one reply (by its Content-Length) or until the server closes."""
    import socket
    u, t0 = urlsplit(url), time.time()
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:
            pass
        reply = b""
        while True:
            head, _, body = reply.partition(b"\r\n\r\n")
            length = re.search(rb"Content-Length: (\d+)", head)
            if _ and length and len(body) >= int(length.group(1)):
                break
            try:
                chunk = s.recv(65536)
            except OSError:  # a reset after the reply is a close too
                break
            if not chunk:
                break
            reply += chunk
    status = re.match(rb"HTTP/1\.1 (\d{3}) ", reply)
    head, _, body = reply.partition(b"\r\n\r\n")
    return (int(status.group(1)) if status else None), (json.loads(body) if body else None), time.time() - t0


def test_swarm_offpolicy_fields_round_trip_and_count_in_the_byte_caps(_sw_server, _sw_clients, monkeypatch):
    """token_ids, logprobs and tokenizer travel with a group when it has them (all three) and never appear
    on one that has none; they are part of the group's bytes, so the body and page caps count them."""
    server, url, folder = _sw_server
    alice, bob = _sw_clients(url, "alice"), _sw_clients(url, "bob")
    with_fields, without = dict(_sw_group(1), **_sw_offpolicy()), _sw_group(2)
    alice.publish(0, [with_fields, without])
    assert alice.flush(10) and bob.flush(10)
    got = sorted(bob.fetch(), key=lambda g: g["seq"])
    assert {k: got[0][k] for k in with_fields} == with_fields
    assert not {"token_ids", "logprobs", "tokenizer"} & set(got[1])
    size = lambda g: len(swarm._dumps(g))  # noqa: E731
    assert size(with_fields) - size(_sw_group(1)) == len(swarm._dumps(_sw_offpolicy())) - 2 + 1  # one more comma
    monkeypatch.setattr(swarm.Limits, "body_bytes", 600)  # a body the log-probs push over the cap is refused
    body = {"peer": "carol", "round": 0, "batch_id": "c-0",
            "groups": [dict(_sw_group(3), **_sw_offpolicy(token_ids=[[1] * 40, [3]], logprobs=[[-1.5] * 40, [-1.0]]))]}
    assert len(json.dumps(_sw_group(3))) < 600 < len(json.dumps(body))
    assert _sw_post(url, "carol", 0, body["groups"]).status_code == 413


@pytest.mark.slow
def test_swarm_concurrent_clients_one_order(_sw_server, _sw_clients):
    server, url, _ = _sw_server
    n_peers, n_posts = 8, 50
    writers = [_sw_clients(url, f"peer{k}") for k in range(n_peers)]
    results = {}

    def write(k):
        for i in range(n_posts):
            writers[k].publish(i, [_sw_group(1000 * k + i)])
        assert writers[k].flush(60)

    def read(name):  # a reader of GET /rollouts?after=SEQ (a dashboard, an audit) while the writers write
        seen, deadline, after = [], time.time() + 60, 0
        while len(seen) < n_peers * n_posts and time.time() < deadline:
            page = requests.get(url + "/rollouts", params={"after": after}, timeout=5).json()
            seen += [(g["seq"], g["peer"], g["question"]) for g in page["groups"]]
            after = page["next"]
            time.sleep(0.05)
        results[name] = seen

    threads = [threading.Thread(target=write, args=(k,)) for k in range(n_peers)]
    threads += [threading.Thread(target=read, args=(name,)) for name in ("readerA", "readerB")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = _sw_read_all(url, limit=1024)
    assert [g["seq"] for g in everything] == list(range(1, n_peers * n_posts + 1))
    keys = [(g["peer"], g["question"]) for g in everything]
    expected = {(f"peer{k}", f"What is {1000 * k + i} + 1?") for k in range(n_peers) for i in range(n_posts)}
    assert len(set(keys)) == len(keys) and set(keys) == expected
    order = [(g["seq"], g["peer"], g["question"]) for g in everything]
    assert results["readerA"] == order and results["readerB"] == order
    for k in range(n_peers):  # one peer's posts keep their order
        rounds = [g["round"] for g in everything if g["peer"] == f"peer{k}"]
        assert rounds == sorted(rounds)


_SW_OK_BODY = {"peer": "alice", "round": 1, "batch_id": "b1", "groups": [_sw_group(1)]}


def _sw_bad_group(**change):
    g = _sw_group(1)
    g.update(change)
    for key in [k for k, v in change.items() if v is KeyError]:
        del g[key]
    return dict(_SW_OK_BODY, groups=[g])


def _sw_offpolicy(**change):
    """The off-policy fields of _sw_group(1) (two completions: 2 tokens, then 1), with `change` applied."""
    fields = dict(token_ids=[[5, 2], [7]], logprobs=[[-0.5, -0.0001], [-3.25]], tokenizer="vocab-0123abcd")
    return dict(fields, **change)


def _sw_deep(levels):
    x = {}
    for _ in range(levels):
        x = {"a": x}
    return x


_SW_BAD = [  # (id, method, path, body: bytes | JSON value | None, headers, expected status)
    ("malformed json", "POST", "/rollouts", b'{"peer": "alice", ', {}, 400),
    ("not utf-8", "POST", "/rollouts", b'{"peer": "\xff\xfe"}', {}, 400),
    ("body is a list", "POST", "/rollouts", [_SW_OK_BODY], {}, 400),
    ("round is a string", "POST", "/rollouts", dict(_SW_OK_BODY, round="1"), {}, 400),
    ("round is a bool", "POST", "/rollouts", dict(_SW_OK_BODY, round=True), {}, 400),
    ("round is negative", "POST", "/rollouts", dict(_SW_OK_BODY, round=-1), {}, 400),
    ("round is a float", "POST", "/rollouts", dict(_SW_OK_BODY, round=1.5), {}, 400),
    ("round is huge", "POST", "/rollouts", dict(_SW_OK_BODY, round=10**400), {}, 400),
    ("groups not a list", "POST", "/rollouts", dict(_SW_OK_BODY, groups={"a": 1}), {}, 400),
    ("group not an object", "POST", "/rollouts", dict(_SW_OK_BODY, groups=["x"]), {}, 400),
    ("missing peer", "POST", "/rollouts", {k: v for k, v in _SW_OK_BODY.items() if k != "peer"}, {}, 400),
    ("missing batch_id", "POST", "/rollouts", {k: v for k, v in _SW_OK_BODY.items() if k != "batch_id"}, {}, 400),
    ("bad batch_id", "POST", "/rollouts", dict(_SW_OK_BODY, batch_id="../../etc/passwd"), {}, 400),
    ("missing question", "POST", "/rollouts", _sw_bad_group(question=KeyError), {}, 400),
    ("missing completions", "POST", "/rollouts", _sw_bad_group(completions=KeyError), {}, 400),
    ("no completions", "POST", "/rollouts", _sw_bad_group(completions=[], stopped=[]), {}, 400),
    ("completion not str", "POST", "/rollouts", _sw_bad_group(completions=["a", 7]), {}, 400),
    ("stopped wrong length", "POST", "/rollouts", _sw_bad_group(stopped=[True]), {}, 400),
    ("stopped not bool", "POST", "/rollouts", _sw_bad_group(stopped=[1, 0]), {}, 400),
    ("too many completions", "POST", "/rollouts",
     _sw_bad_group(completions=["x"] * 65, stopped=[True] * 65), {}, 400),
    ("completion too long", "POST", "/rollouts",
     _sw_bad_group(completions=["x" * 32_001, "y"]), {}, 400),
    ("question too long", "POST", "/rollouts", _sw_bad_group(question="q" * 16_001), {}, 400),
    ("answer not str", "POST", "/rollouts", _sw_bad_group(answer=42), {}, 400),
    ("model not str", "POST", "/rollouts", _sw_bad_group(model=["m"]), {}, 400),
    ("too many groups", "POST", "/rollouts", dict(_SW_OK_BODY, groups=[_sw_group(1, n=1)] * 257), {}, 400),
    ("metadata not object", "POST", "/rollouts", _sw_bad_group(metadata=[1, 2]), {}, 400),
    # the optional off-policy fields: all or none, one list per completion, one log-prob per id
    ("logprobs without the rest", "POST", "/rollouts", _sw_bad_group(logprobs=[[-1.0], [-1.0]]), {}, 400),
    ("no tokenizer", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(tokenizer=KeyError)), {}, 400),
    ("no logprobs", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(logprobs=KeyError)), {}, 400),
    ("token_ids per completion", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(token_ids=[[1, 2]])), {}, 400),
    ("logprobs wrong length", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(logprobs=[[-1.0], [-1.0]])), {}, 400),
    ("logprob above 0", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(logprobs=[[-1.0, 0.5], [-1.0]])), {}, 400),
    ("logprob a string", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(logprobs=[[-1.0, "x"], [-1.0]])), {}, 400),
    ("logprob 1e400", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(logprobs=[[-1.0, -1e400], [-1.0]])), {}, 400),
    ("token id negative", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(token_ids=[[1, -2], [3]])), {}, 400),
    ("token id 2**31", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(token_ids=[[1, 2**31], [3]])), {}, 400),
    ("token id a float", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(token_ids=[[1, 2.0], [3]])), {}, 400),
    ("token id a bool", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(token_ids=[[1, True], [3]])), {}, 400),
    ("too many token ids", "POST", "/rollouts",
     _sw_bad_group(**_sw_offpolicy(token_ids=[[1] * 8193, [3]], logprobs=[[-1.0] * 8193, [-1.0]])), {}, 400),
    ("tokenizer too long", "POST", "/rollouts", _sw_bad_group(**_sw_offpolicy(tokenizer="v" * 65)), {}, 400),
    ("metadata too deep", "POST", "/rollouts", _sw_bad_group(metadata=_sw_deep(20)), {}, 400),
    ("metadata 500 deep", "POST", "/rollouts", _sw_bad_group(metadata=_sw_deep(500)), {}, 400),
    ("json absurdly deep", "POST", "/rollouts", b"[" * 100_000 + b"]" * 100_000, {}, 400),
    ("nan", "POST", "/rollouts", b'{"peer": "alice", "round": NaN}', {}, 400),
    ("peer with space", "POST", "/rollouts", dict(_SW_OK_BODY, peer="al ice"), {}, 400),
    ("peer empty", "POST", "/rollouts", dict(_SW_OK_BODY, peer=""), {}, 400),
    ("peer too long", "POST", "/rollouts", dict(_SW_OK_BODY, peer="a" * 65), {}, 400),
    ("peer is a path", "POST", "/rollouts", dict(_SW_OK_BODY, peer="../x"), {}, 400),
    ("peer not str", "POST", "/rollouts", dict(_SW_OK_BODY, peer=5), {}, 400),
    ("bad content-length", "POST", "/rollouts", None, {"Content-Length": "abc"}, 400),
    ("body over cap", "POST", "/rollouts", None, {"Content-Length": str(9 * 1024 * 1024)}, 413),
    ("no content-length", "POST", "/rollouts", b"CL", {}, 411),
    ("after negative", "GET", "/rollouts?after=-1", None, {}, 400),
    ("after not int", "GET", "/rollouts?after=abc", None, {}, 400),
    ("limit zero", "GET", "/rollouts?limit=0", None, {}, 400),
    ("limit too big", "GET", "/rollouts?limit=1025", None, {}, 400),
    ("bad exclude", "GET", "/rollouts?exclude=a%20b", None, {}, 400),
    ("unknown path get", "GET", "/nope", None, {}, 404),
    ("unknown path post", "POST", "/rollouts/../x", b"{}", {}, 404),
    ("delete rollouts", "DELETE", "/rollouts", None, {}, 405),
    ("put rollouts", "PUT", "/rollouts", b"{}", {}, 405),
    ("options", "OPTIONS", "/rollouts", None, {}, 405),
    ("made-up method", "BREW", "/health", None, {}, 405),
    ("post health", "POST", "/health", b"{}", {}, 405),
    ("metrics not object", "POST", "/metrics", {"peer": "alice", "round": 1, "metrics": [1]}, {}, 400),
    ("metric a string", "POST", "/metrics", {"peer": "alice", "round": 1, "metrics": {"a": "x"}}, {}, 400),
    ("metric 400 digits", "POST", "/metrics", {"peer": "alice", "round": 1, "metrics": {"a": 10**400}}, {}, 400),
    ("metric 1e300", "POST", "/metrics", {"peer": "alice", "round": 1, "metrics": {"a": 1e300}}, {}, 400),
    ("metrics bad peer", "POST", "/metrics", {"peer": "<b>", "round": 1, "metrics": {}}, {}, 400),
    ("lone surrogate in a question", "POST", "/rollouts", _sw_bad_group(question="q\ud800"), {}, 400),
    ("lone surrogate in metadata", "POST", "/rollouts", _sw_bad_group(metadata={"k": ["\udc00"]}), {}, 400),
    ("lone surrogate as a metrics key", "POST", "/metrics", {"peer": "a", "round": 1, "metrics": {"\ud800": 1}}, {}, 400),
    ("surrogate encoded as UTF-8", "POST", "/rollouts", json.dumps(_sw_bad_group(question="Q")).encode().replace(
        b'"Q"', b'"\xed\xa0\x80"'), {}, 400),
    ("parse bomb", "POST", "/rollouts", b'{"x":[' + b"{}," * (1 << 20) + b'{}]}', {}, 413),
]


@pytest.mark.parametrize("case", _SW_BAD, ids=[c[0] for c in _SW_BAD])
def test_swarm_bad_input(_sw_server, case):
    server, url, folder = _sw_server
    name, method, path, body, headers, expected = case
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
    status, reply = _sw_raw(url, method, path, body, headers, content_length=(expected != 411))
    assert status == expected
    assert set(reply) == {"error"} and isinstance(reply["error"], str)
    assert reply["error"].endswith(".") and len(reply["error"]) < 300
    assert requests.get(url + "/health", timeout=5).json()["groups"] == 0  # stored nothing, still serving
    assert _sw_files(folder) == [] and not os.path.exists(os.path.join(folder, "metrics.jsonl"))
    assert _sw_post(url, "alice", 1, [_sw_group(1)]).json() == {"accepted": 1, "seq": 1}


_SW_PROTOCOL = [  # (id, raw bytes, expected status; None: the server just closes)
    ("head", b"HEAD /rollouts HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
    ("options star", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("bad target", b"GET http://[::1/x HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("long target", b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    ("long header", b"GET /health HTTP/1.1\r\nX-A: " + b"a" * 20_000 + b"\r\n\r\n", 431),
    ("many headers", b"GET /health HTTP/1.1\r\n" + b"X-A: a\r\n" * 200 + b"\r\n", 431),
    ("header without colon", b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    ("http/2.0 line", b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 400),
    ("http/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    ("garbage line", b"\x00\x01\x02 hello\r\n\r\n", 400),
    ("chunked body", b"POST /rollouts HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
    ("negative length", b"POST /rollouts HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400),
    ("two lengths", b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 99\r\n\r\n{}", 400),
    ("space before the colon", b"POST /metrics HTTP/1.1\r\nContent-Length : 24\r\n\r\nGET /health HTTP/1.1\r\n\r\n", 400),
    ("tabs in the request line", b"GET\t/health\tHTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("tab in the target", b"GET /health\tHTTP/1.1 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("folded header", b"GET /health HTTP/1.1\r\nHost: x\r\n y\r\n\r\n", 400),
    ("tls hello", bytes.fromhex("16030100c8010000c40303") + bytes(190), None),
]


def test_swarm_protocol_abuse_gets_a_prompt_json_4xx(_sw_server):
    server, url, folder = _sw_server
    for name, data, expected in _SW_PROTOCOL:
        status, reply, seconds = _sw_bytes(url, data)
        # answered at once, not after the request deadline (10 s) has run out
        assert status == expected and seconds < swarm.Limits.request_seconds - 1, name
        if expected is None:
            assert reply is None, name  # no HTML page, no status line: a clean close
        elif not data.startswith(b"HEAD"):
            assert set(reply) == {"error"} and reply["error"].endswith("."), name
    assert requests.get(url + "/health", timeout=5).json() == {"ok": True, "groups": 0, "peers": 0, "last_seq": 0}


def test_swarm_fuzzed_requests_never_get_a_5xx(_sw_server):
    """500 requests mutated from valid ones (fuzzed_requests, in test_attacks.py: hostile values, lone
    surrogates, bent heads, odd queries): every one gets a 2xx or a one-sentence 4xx, and the server keeps serving."""
    from test_attacks import fuzzed_requests
    server, url, folder = _sw_server
    for kind, data in fuzzed_requests(500, seed=1):
        status, reply, _ = _sw_bytes(url, data)
        assert status is not None and status < 500, (kind, data[:400])
        if status >= 400:
            assert set(reply) == {"error"} and reply["error"].endswith(".") and len(reply["error"]) < 300, data[:400]
    assert requests.get(url + "/health", timeout=5).json()["ok"] is True


def test_swarm_unexpected_error_is_500(_sw_server, monkeypatch):
    server, url, _ = _sw_server

    def broken(*args):
        raise KeyError("a bug")

    monkeypatch.setattr(server.store, "read", broken)
    r = requests.get(url + "/rollouts", timeout=5)
    assert r.status_code == 500 and "error" in r.json()
    assert requests.get(url + "/health", timeout=5).json()["ok"] is True


@pytest.mark.slow
def test_swarm_token_guards_reads_and_writes(tmp_path, monkeypatch, _sw_clients):
    server, url = swarm.start_server(str(tmp_path / "s"), token="s3cret")
    try:
        assert _sw_post(url, "alice", 0, [_sw_group()]).status_code == 401
        r = _sw_post(url, "alice", 0, [_sw_group()], headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "token" in r.json()["error"]
        assert _sw_post(url, "alice", 0, [_sw_group()], headers={"Authorization": "s3cret"}).status_code == 401
        assert requests.post(url + "/metrics", json={"peer": "a", "round": 0, "metrics": {}},
                             timeout=5).status_code == 401
        for path in ("/", "/health", "/rollouts", "/metrics", "/peers"):  # reads need it too
            assert requests.get(url + path, timeout=5).status_code == 401, path
        for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme is case-insensitive
            assert requests.get(url + "/health", headers={"Authorization": f"{scheme} s3cret"},
                                timeout=5).status_code == 200
        mallory = _sw_clients(url, "mallory")
        mallory.publish(0, [_sw_group()])
        assert not mallory.flush(1)
        good = _sw_post(url, "alice", 0, [_sw_group()], headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200
        bob = _sw_clients(url, "bob", token="s3cret")
        bob.publish(0, [_sw_group()])
        assert bob.flush(10)
        monkeypatch.setenv("SWARM_TOKEN", "s3cret")  # the client's token can stay off the command line
        carol = _sw_clients(url, "carol")
        assert carol.flush(10) and len(carol.fetch()) == 2
    finally:
        server.shutdown()
    server, url = swarm.start_server(str(tmp_path / "s"), token="s3cret", public_reads=True)
    try:
        assert requests.get(url + "/rollouts", timeout=5).status_code == 200
        assert requests.get(url + "/", timeout=5).status_code == 200
        assert _sw_post(url, "alice", 1, [_sw_group()]).status_code == 401
    finally:
        server.shutdown()
    for bad in ("two words", "caf\u00e9", "tab\there", "x" * 257):
        with pytest.raises(ValueError, match="printable ASCII"):
            swarm.start_server(str(tmp_path / "t"), token=bad)
        with pytest.raises(ValueError, match="printable ASCII"):
            swarm.connect("http://127.0.0.1:9", "a", 1, token=bad)


def test_swarm_token_is_checked_before_any_body_is_read(tmp_path, monkeypatch):
    """Senders without the token who declare large bodies and stall cost nothing: each gets its 401 from
    its headers alone, and honest writes are never refused as busy. A wrong token with a large body still
    reads its 401: the server drops the rest for a moment before closing, so the close resets nothing."""
    import socket
    monkeypatch.setattr(swarm.Limits, "in_flight_bytes", 1_000_000)
    server, url = swarm.start_server(str(tmp_path / "s"), token="s3cret")
    u, stalled = urlsplit(url), []
    try:
        for _ in range(8):
            stalled.append(socket.create_connection((u.hostname, u.port), timeout=5))
            stalled[-1].sendall(b"POST /rollouts HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (swarm.Limits.body_bytes - 1)
                                + b"x" * 200_000)
        time.sleep(0.5)  # (time for the server to read what they sent)
        auth = {"Authorization": "Bearer s3cret"}
        assert [_sw_post(url, "alice", k, [_sw_group(k)], headers=auth).status_code for k in range(5)] == [200] * 5
        for s in stalled:
            assert s.recv(65536).startswith(b"HTTP/1.1 401 ")
        r = requests.post(url + "/rollouts", data=b"x" * (4 << 20), headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401 and "token" in r.json()["error"]
    finally:
        for s in stalled:
            s.close()
        server.shutdown()


def test_swarm_token_from_a_file_or_the_environment(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    proc, url = _sw_spawn(str(tmp_path / "a"), str(tmp_path / "log"), "--token-file", str(token_file))
    try:
        assert requests.get(url + "/health", timeout=5).status_code == 401
        assert requests.get(url + "/health", headers={"Authorization": "Bearer s3cret"}, timeout=5).status_code == 200
        assert b"s3cret" not in open(f"/proc/{proc.pid}/cmdline", "rb").read()
    finally:
        _sw_stop(proc)
    env = dict(os.environ, SWARM_TOKEN="caf\u00e9")
    run = subprocess.run([sys.executable, _SW_SCRIPT, "--dir", str(tmp_path / "b"), "--port", "0"],
                         capture_output=True, text=True, timeout=20, env=env)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "printable ASCII" in run.stderr


@pytest.mark.slow
def test_swarm_kill9_cycles_keep_every_ack(tmp_path):
    """Three kill -9s in the middle of four writers' runs: every acknowledged batch is there after each
    restart, under the seq it was acknowledged with, and the numbering never repeats."""
    folder, log = str(tmp_path / "s"), str(tmp_path / "server.log")
    acked = []
    for cycle in range(3):
        proc, url = _sw_spawn(folder, log)
        stop = threading.Event()

        def writer(w):
            session, i = requests.Session(), 0
            while not stop.is_set():
                body = {"peer": f"w{w}", "round": i, "batch_id": f"w{w}-{cycle}-{i}",
                        "groups": [_sw_group(i, metadata={"key": f"{w}-{cycle}-{i}"}), _sw_group(i)]}
                try:
                    r = session.post(url + "/rollouts", json=body, timeout=5)
                except requests.RequestException:
                    return
                if r.status_code == 200:
                    acked.append((f"{w}-{cycle}-{i}", r.json()["seq"]))
                i += 1

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
        try:
            before = len(acked)
            for t in threads:
                t.start()
            deadline = time.time() + 15
            while len(acked) < before + 20 and time.time() < deadline:
                time.sleep(0.01)
            proc.kill()  # SIGKILL in the middle of the writers' runs
            proc.wait()
            stop.set()
            for t in threads:
                t.join(10)
            assert len(acked) >= before + 20
        finally:
            stop.set()
            _sw_stop(proc)
    with open(os.path.join(folder, ".tmp-batch-999999999999.json"), "w") as f:
        f.write('{"batch_id": "x", "groups": [{"seq"')  # a write cut short
    proc, url = _sw_spawn(folder, log)
    try:
        stored = _sw_read_all(url)
        seq_of = {g["metadata"]["key"]: g["seq"] for g in stored if "key" in g["metadata"]}
        for key, seq in acked:  # each acknowledged batch is there, under the seq it was acknowledged with
            assert seq_of[key] == seq - 1
        seqs = [g["seq"] for g in stored]
        assert seqs == sorted(set(seqs)) and len(seq_of) == len(stored) // 2
        assert _sw_post(url, "after", 0, [_sw_group(7)]).json()["seq"] > max(seqs)
        assert not os.path.exists(os.path.join(folder, ".tmp-batch-999999999999.json"))
    finally:
        _sw_stop(proc)


@pytest.mark.parametrize("damage", ["brackets", "truncated", "wrong types"])
def test_swarm_corrupt_newest_batch_file_never_reuses_a_seq(tmp_path, damage):
    folder = str(tmp_path / "s")
    server, url = swarm.start_server(folder)
    for r in range(3):
        _sw_post(url, "alice", r, [_sw_group(r), _sw_group(r + 10)])
    server.shutdown()
    newest = os.path.join(folder, _sw_files(folder)[-1])
    data = open(newest, "rb").read()
    with open(newest, "wb") as f:
        f.write({"brackets": b"[" * 100_000, "truncated": data[:len(data) // 2],
                 "wrong types": b'{"peer": "alice", "groups": 5}'}[damage])
    log = str(tmp_path / "log")
    proc, url = _sw_spawn(folder, log)
    try:
        assert [g["seq"] for g in _sw_read_all(url)] == [1, 2, 3, 4]  # the damaged batch is skipped
        assert _sw_post(url, "bob", 0, [_sw_group(1)]).json() == {"accepted": 1, "seq": 7}  # 5, 6 stay used
        assert os.path.basename(newest) in open(log).read()
    finally:
        _sw_stop(proc)


def test_swarm_folder_lock_survives_a_stray_rm(tmp_path):
    folder = str(tmp_path / "s")
    server, _ = swarm.start_server(folder)
    try:
        for name in os.listdir(folder):
            if name.endswith(".lock"):
                os.remove(os.path.join(folder, name))
        with pytest.raises(ValueError, match="another swarm server"):
            swarm.start_server(folder)
    finally:
        server.shutdown()
    swarm.start_server(folder)[0].shutdown()  # and once it is stopped, the folder is free


def test_swarm_moved_folder_stores_nothing_more(tmp_path):
    """`mv D D.old; mkdir D` while a server runs lets a second server lock the new D. The first one keeps
    every file it wrote (it works relative to the folder it locked) and refuses new writes with a 503,
    which clients retry later, so no acknowledged batch goes missing and no seq is written twice."""
    folder = tmp_path / "d"
    first, url1 = swarm.start_server(str(folder))
    try:
        assert _sw_post(url1, "alice", 0, [_sw_group(0)]).json() == {"accepted": 1, "seq": 1}
        os.rename(folder, tmp_path / "d.old")
        os.mkdir(folder)
        second, url2 = swarm.start_server(str(folder))
        try:
            r = _sw_post(url1, "alice", 1, [_sw_group(1)])
            assert r.status_code == 503 and "moved or replaced" in r.json()["error"]
            assert requests.post(url1 + "/metrics", json={"peer": "a", "round": 0, "metrics": {}}, timeout=5).status_code == 503
            assert _sw_post(url2, "bob", 0, [_sw_group(2)]).json() == {"accepted": 1, "seq": 1}
        finally:
            second.shutdown()
    finally:
        first.shutdown()
    for name, peers in (("d.old", ["alice"]), ("d", ["bob"])):
        server, url = swarm.start_server(str(tmp_path / name))
        try:
            assert [g["peer"] for g in _sw_read_all(url)] == peers
        finally:
            server.shutdown()


def test_swarm_folder_files_are_regular_files_never_links_or_fifos(tmp_path):
    """A FIFO named like a batch file or metrics.jsonl does not hang the start; links are never followed,
    neither to read a batch from outside the folder nor to truncate or append to a file outside it."""
    outside = tmp_path / "outside"
    server, url = swarm.start_server(str(outside))
    _sw_post(url, "mallory", 0, [_sw_group(0)])
    server.shutdown()
    folder = tmp_path / "s"
    folder.mkdir()
    (tmp_path / "victim").write_text("keep me\n")
    os.symlink(outside / _sw_files(str(outside))[0], folder / "batch-000000000001.json")
    os.symlink(tmp_path / "victim", folder / ".tmp-probe")
    os.symlink(tmp_path / "victim", folder / "metrics.jsonl")
    os.mkfifo(folder / "batch-000000000005.json")
    started = []
    thread = threading.Thread(target=lambda: started.append(swarm.start_server(str(folder))), daemon=True)
    thread.start()
    thread.join(30)
    assert started, "the server hung at start-up"
    server, url = started[0]
    try:
        assert _sw_read_all(url) == []  # the linked batch is not read; the names still reserve seqs 1 to 5
        assert _sw_post(url, "alice", 0, [_sw_group(1)]).json() == {"accepted": 1, "seq": 6}
        assert requests.post(url + "/metrics", json={"peer": "a", "round": 0, "metrics": {"x": 1}}, timeout=5).status_code == 200
        assert (tmp_path / "victim").read_text() == "keep me\n"
        assert not os.path.islink(folder / "metrics.jsonl")
    finally:
        server.shutdown()


def test_swarm_no_clock_and_no_cut_line_loses_an_acknowledged_row(tmp_path, monkeypatch):
    """A clock below 0 or past 1e11 still stores batches and rows a restart can read; a metrics line cut
    by kill -9 costs that line only, never the row appended after it."""
    folder = str(tmp_path / "s")
    for k, clock in enumerate((-5.0, 2e11)):
        server, url = swarm.start_server(folder)
        monkeypatch.setattr(time, "time", lambda: clock)
        try:
            assert server.store.publish("alice", k, f"b{k}", [_sw_group(k)])["accepted"] == 1
            server.store.add_metrics("alice", k, {"local_reward": 0.5})
        finally:
            monkeypatch.undo()
            server.shutdown()
    with open(os.path.join(folder, "metrics.jsonl"), "ab") as f:
        f.write(b'{"n":3,"peer":"alice","rou')  # a row cut by kill -9
    for k in (2, 3):
        server, url = swarm.start_server(folder)
        try:
            assert [g["round"] for g in _sw_read_all(url)] == [0, 1]
            assert [row["round"] for row in requests.get(url + "/metrics", timeout=5).json()["metrics"]] == list(range(k))
            server.store.add_metrics("alice", k, {"local_reward": 0.5})
        finally:
            server.shutdown()


def test_swarm_a_full_disk_at_start_is_one_sentence_and_frees_the_folder(tmp_path, monkeypatch):
    """Starting on a folder whose repair needs a write (here a metrics line cut by kill -9) on a full disk
    is a ValueError in one sentence, which train.py's launcher catches (never an OSError traceback), and
    the folder is not left locked."""
    import errno
    folder = str(tmp_path / "s")
    server, url = swarm.start_server(folder)
    server.store.add_metrics("alice", 0, {"local_reward": 0.5})
    server.shutdown()
    with open(os.path.join(folder, "metrics.jsonl"), "ab") as f:
        f.write(b'{"n":2,"peer":"alice","rou')

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(swarm.os, "fsync", full)
    with pytest.raises(ValueError, match=r"^cannot use --dir .*No space left on device.*\.$"):
        swarm.start_server(folder)
    monkeypatch.undo()
    server, url = swarm.start_server(folder)  # the lock was released; the cut line is dropped now
    try:
        assert [row["round"] for row in requests.get(url + "/metrics", timeout=5).json()["metrics"]] == [0]
    finally:
        server.shutdown()


def test_swarm_utf8_on_disk_and_pages_bounded_in_bytes(_sw_server, monkeypatch):
    server, url, folder = _sw_server
    text = "\u00e9t\u00e9 \u2603 \U0001F600 " * 400
    assert _sw_post(url, "alice", 0, [_sw_group(0, completions=[text], stopped=[True])]).status_code == 200
    data = open(os.path.join(folder, _sw_files(folder)[0]), "rb").read()
    assert text.encode() in data and len(data) < len(text.encode()) + 1000  # UTF-8, not \uXXXX escapes
    monkeypatch.setattr(server.store, "page_bytes", 20_000)  # (the store took Limits.page_bytes when it started)
    for r in range(1, 6):
        _sw_post(url, "alice", r, [_sw_group(10 * r + j, completions=["x" * 4000], stopped=[True]) for j in range(4)])
    seen, after, pages = [], 0, 0
    while True:
        r = requests.get(url + "/rollouts", params={"after": after, "limit": 1024}, timeout=5)
        data = r.json()
        assert len(r.content) <= 20_000 + 200 or len(data["groups"]) == 1  # one big group is still served
        seen += [g["seq"] for g in data["groups"]]
        if data["next"] == after:
            break
        after, pages = data["next"], pages + 1
    assert seen == list(range(1, 22)) and pages >= 5
    for r in range(300):  # /metrics is paged the same way
        server.store.add_metrics("alice", r, {"local_reward": 0.5, "loss": 1.0})
    rows, after = [], 0
    while True:
        r = requests.get(url + "/metrics", params={"after": after}, timeout=5)
        assert len(r.content) <= 20_000 + 200
        rows += r.json()["metrics"]
        if r.json()["next"] == after:
            break
        after = r.json()["next"]
    assert [row["round"] for row in rows] == list(range(300)) and r.json()["last"] == 300


def test_swarm_everything_a_request_can_make_the_server_hold_is_bounded(_sw_server, monkeypatch):
    server, url, folder = _sw_server
    monkeypatch.setattr(server.store, "keep_peers", 20)  # (Limits.peers, which the store took when it started)
    monkeypatch.setattr(swarm.Limits, "metrics_bytes", 5_000)
    monkeypatch.setattr(server.store, "keep_replies", 10)  # (Limits.replies, taken likewise)
    for k in range(50):  # empty posts store nothing and name nobody
        assert _sw_post(url, f"nobody{k}", 0, []).json() == {"accepted": 0, "seq": 0}
    assert requests.get(url + "/health", timeout=5).json()["peers"] == 0
    for k in range(50):
        r = requests.post(url + "/metrics", json={"peer": f"p{k}", "round": 0, "metrics": {"local_reward": 0.5}},
                          timeout=5)
        assert r.status_code == 200
        assert _sw_post(url, f"p{k}", 0, [_sw_group(k)], batch_id=f"b{k}").status_code == 200
    assert len(requests.get(url + "/peers", timeout=5).json()["peers"]) == 20
    kept = sum(len(batches) for batches in server.store.batches.values())  # every kept batch's reply, and at most
    assert server.store.metrics_bytes <= 5_000 and len(server.store.replies) == kept + len(server.store.gone)
    assert len(server.store.gone) <= 10  # Limits.replies of pruned ones (test_swarm_a_late_retry_...)
    assert os.path.getsize(os.path.join(folder, "metrics.jsonl")) <= 2 * 5_000 + 200
    assert "p49" in requests.get(url + "/", timeout=5).text  # the dashboard lists the newest


@pytest.mark.slow
def test_swarm_full_disk_is_507_and_loses_nothing(_sw_server, monkeypatch, _sw_clients):
    import builtins
    import errno
    server, url, folder = _sw_server

    def full(path, mode="r", *args, **kwargs):
        if "w" in mode or "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(swarm, "open", full, raising=False)
    for path, body in (("/rollouts", _SW_OK_BODY), ("/metrics", {"peer": "a", "round": 0, "metrics": {}})):
        r = requests.post(url + path, json=body, timeout=5)
        assert r.status_code == 507 and r.json()["error"].endswith(".") and "disk is full" in r.json()["error"]
    alice = _sw_clients(url, "alice")
    alice.publish(0, [_sw_group(0)])
    assert not alice.flush(1)
    assert _sw_files(folder) == [] and [n for n in os.listdir(folder) if n.startswith(".tmp")] == []
    monkeypatch.undo()
    assert alice.flush(10)
    assert [g["round"] for g in _sw_read_all(url)] == [0]


def test_swarm_hangups_are_not_logged(_sw_server, capsys):
    import socket
    import struct
    server, url, folder = _sw_server
    for r in range(60):  # 7 MB: more than a socket buffer holds
        _sw_post(url, "alice", r, [_sw_group(r, completions=["x" * 30_000] * 4, stopped=[True] * 4)])
    u = urlsplit(url)
    for request, answered in ((b"GET /rollouts?limit=1024 HTTP/1.1\r\nHost: x\r\n\r\n", True),  # mid-reply
                              (b"POST /rollouts HTTP/1.1\r\nContent-Le", False),  # mid-request
                              (b"GET /health HTTP/1.1\r\n" + b"X: y\r\n" * 100 + b"\r\n", True)):  # a 431
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((u.hostname, u.port))
        s.sendall(request)
        s.settimeout(30)
        if answered:
            assert s.recv(1024).startswith(b"HTTP/1.1 ")  # the server is writing its reply
        else:  # the server has read past our bytes once it answers a request sent after them
            assert requests.get(url + "/health", timeout=30).status_code == 200
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # hang up with a reset
        s.close()
    deadline = time.time() + 30
    while len(server.open) > 0 and time.time() < deadline:  # until the server has noticed every hang-up
        time.sleep(0.05)
    assert len(server.open) == 0
    assert requests.get(url + "/health", timeout=5).status_code == 200
    assert capsys.readouterr().err == ""


def test_swarm_shutdown_race_is_not_logged_but_other_loop_errors_are(_sw_server, capsys):
    """Python 3.11's sock_accept sets the result of an accept that shutdown() has just cancelled when a
    connection arrives at that moment: an InvalidStateError in a loop callback, harmless, not logged.
    Any other error in a loop callback still is."""
    server, url, _ = _sw_server

    def race(error):
        future = server.loop.create_future()
        future.cancel()
        if error:
            raise ValueError("a real bug")
        future.set_result(None)  # raises InvalidStateError, as the race does
    for error in (False, True):
        server.loop.call_soon_threadsafe(race, error)
    assert requests.get(url + "/health", timeout=5).status_code == 200  # (after both callbacks ran)
    err = capsys.readouterr().err
    assert "InvalidStateError" not in err and "a real bug" in err, err


def test_swarm_health_walks_no_metrics_rows(_sw_server):
    """/health, which cursor readers ask on every poll that finds groups, costs the same with 8 MB of
    dashboard metrics kept as with none: it never walks their rows (the dashboard does)."""
    server, url, _ = _sw_server
    for r in range(3):
        assert _sw_raw(url, "POST", "/metrics", json.dumps({"peer": "a", "round": r, "metrics": {"x": 1}}).encode(),
                       {"Content-Type": "application/json"})[0] == 200

    class Unwalkable(list):
        def __iter__(self):
            raise RuntimeError("walked the metrics rows")
    server.store.metrics = Unwalkable(server.store.metrics)
    health = requests.get(url + "/health", timeout=5)
    assert health.status_code == 200 and health.json()["last_seq"] == 0
    assert requests.get(url + "/", timeout=5).status_code == 500  # the dashboard does walk them (logged)


@pytest.mark.slow
def test_swarm_slow_connections_get_a_deadline_and_honest_ones_get_through(_sw_server, monkeypatch):
    import socket
    monkeypatch.setattr(swarm.Limits, "request_seconds", 1.0)
    server, url, folder = _sw_server
    u = urlsplit(url)
    slow = []
    for k in range(60):  # headers that never end, a byte at a time
        s = socket.create_connection((u.hostname, u.port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        slow.append(s)
    liar = socket.create_connection((u.hostname, u.port), timeout=5)  # says 100 bytes, sends 1
    liar.sendall(b"POST /rollouts HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
    monkeypatch.setattr(swarm.Limits, "in_flight_bytes", 100_000)  # a declared length alone holds nothing
    slow.append(socket.create_connection((u.hostname, u.port), timeout=5))
    slow[-1].sendall(b"POST /rollouts HTTP/1.1\r\nContent-Length: 99850\r\n\r\n{")
    time.sleep(0.2)
    assert _sw_post(url, "honest", 99, [_sw_group(99)]).status_code == 200
    t0 = time.time()
    for k in range(5):
        for s in slow:
            try:
                s.send(b"X")
            except OSError:
                pass
        assert requests.get(url + "/health", timeout=5).status_code == 200
        assert _sw_post(url, "honest", k, [_sw_group(k)]).status_code == 200
        time.sleep(0.3)
    closed = 0
    for s in slow + [liar]:  # each must get its 408 one deadline (1 s) after its last byte: wait generously
        s.settimeout(max(1.0, t0 + 60 - time.time()))
        try:
            reply = s.recv(65536)
            closed += reply.startswith(b"HTTP/1.1 408 ") and b'"error"' in reply
        except OSError:
            pass
        s.close()
    assert closed == 62  # each got a JSON 408 once its deadline passed, not a 60 s wait per read


def _sw_spawn_with_128_descriptors(tmp_path):
    """python swarm.py under a descriptor limit of 128 -> (process, url)."""
    import resource
    return _sw_spawn(str(tmp_path / "s"), str(tmp_path / "log"),
                     preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)))


def _sw_honest_requests(url, proc, most_descriptors=None):
    """Six GET /health and six POST /rollouts, one after another -> how many got a 200. With
    most_descriptors, the server must hold no more than that after each pair."""
    ok = 0
    for k in range(6):
        try:
            ok += requests.get(url + "/health", timeout=5).status_code == 200
            ok += _sw_post(url, "honest", k, [_sw_group(k)]).status_code == 200
        except requests.RequestException:
            pass
        if most_descriptors is not None:
            assert len(os.listdir(f"/proc/{proc.pid}/fd")) <= most_descriptors
    return ok


@pytest.mark.slow
def test_swarm_connection_cap_under_a_low_descriptor_limit(tmp_path):
    """With 128 descriptors, 150 idle connections must not lock honest clients out (no busy accept
    loop either: the longest-waiting connection is closed to make room)."""
    import socket
    proc, url = _sw_spawn_with_128_descriptors(tmp_path)
    u, idle = urlsplit(url), []
    try:
        for _ in range(150):
            idle.append(socket.create_connection((u.hostname, u.port), timeout=5))
        assert _sw_honest_requests(url, proc) == 12 and proc.poll() is None
    finally:
        for s in idle:
            s.close()
        _sw_stop(proc)


@pytest.mark.slow
def test_swarm_busy_connections_at_the_cap_never_lock_honest_ones_out(tmp_path):
    """With 128 descriptors (a cap of 64 connections), 200 connections opened in a burst that each send
    one byte of a request line and stop must not lock honest clients out (they prove nothing, so they
    go first), and the server never overshoots its cap: an honest POST can still open its batch file."""
    import socket
    proc, url = _sw_spawn_with_128_descriptors(tmp_path)
    u, busy = urlsplit(url), []
    try:
        for _ in range(200):
            busy.append(socket.create_connection((u.hostname, u.port), timeout=5))
            busy[-1].sendall(b"G")
        assert _sw_honest_requests(url, proc, most_descriptors=128 - 32) == 12 and proc.poll() is None
    finally:
        for s in busy:
            s.close()
        _sw_stop(proc)


def test_swarm_server_a_directory_at_a_batch_name_is_no_500(_sw_server):
    server, url, folder = _sw_server
    assert _sw_post(url, "a", 0, [_sw_group(0)]).status_code == 200
    os.mkdir(os.path.join(folder, "batch-000000000003.json"))  # the next batch of 2 groups is named so
    statuses = {_sw_post(url, "a", r, [_sw_group(0), _sw_group(1)]).status_code for r in range(1, 4)}
    assert 500 not in statuses  # fails: a 500 for every batch of 2 groups, for ever


def test_swarm_one_stored_group_full_of_commas_does_not_blind_the_readers(_sw_server, _sw_clients):
    server, url, folder = _sw_server  # (commas inside strings: degenerate output, or a hostile peer's)
    _sw_post(url, "bob", 0, [_sw_group(i) for i in range(4)])
    assert _sw_post(url, "carol", 0, [_sw_group(9, n=20, completions=["," * 32_000] * 20)]).status_code == 200
    _sw_post(url, "bob", 1, [_sw_group(i) for i in range(4)])
    client, got = _sw_clients(url, "me"), []
    for _ in range(3):
        client.flush(10)
        got += client.fetch()
    assert sorted(g["seq"] for g in got) == list(range(1, 10))  # fails: [] (every reply holding seq 5 is refused)


def test_swarm_no_stored_group_holds_more_values_than_a_client_reads(_sw_server, _sw_clients):
    server, url, folder = _sw_server
    n = 40  # 40 completions of 8192 token ids and as many log-probs: 655,360 values, well-formed
    heavy = _sw_group(9, n=n, token_ids=[[0] * 8192] * n, logprobs=[[0] * 8192] * n, tokenizer="tok")
    bob = [_sw_post(url, "bob", 0, [_sw_group(i) for i in range(4)]).json()["seq"]]
    _sw_post(url, "mallory", 0, [heavy])  # refused (413), or stored and then readable: either will do
    bob.append(_sw_post(url, "bob", 1, [_sw_group(i) for i in range(4)]).json()["seq"])
    client, got = _sw_clients(url, "me"), []
    for _ in range(3):
        client.flush(10)
        got += client.fetch()
    # fails: the server stores it (200) and no client can read a reply holding it: sampled readers receive
    # nothing while mallory's batch is in the window (600 s)
    assert sorted(g["seq"] for g in got if g["peer"] == "bob") == [*range(bob[0] - 3, bob[0] + 1),
                                                                   *range(bob[1] - 3, bob[1] + 1)]


@pytest.mark.parametrize("in_the_way", ["folder", "link", "fifo"])
def test_swarm_something_in_the_way_of_metrics_jsonl_is_replaced(in_the_way, _sw_server, tmp_path):
    """A folder, a link or a FIFO where metrics.jsonl goes: the row is kept and the file written anew
    (never through the link), not a 500 on every POST /metrics."""
    server, url, folder = _sw_server
    path, target = os.path.join(folder, "metrics.jsonl"), tmp_path / "elsewhere"
    target.write_text("untouched")
    if os.path.exists(path):
        os.remove(path)
    {"folder": os.mkdir, "link": lambda p: os.symlink(target, p), "fifo": os.mkfifo}[in_the_way](path)
    for r in range(2):
        reply = requests.post(url + "/metrics", json={"peer": "a", "round": r, "metrics": {"x": r}}, timeout=10)
        assert reply.status_code == 200, reply.text
    assert [m["round"] for m in requests.get(url + "/metrics", timeout=10).json()["metrics"]] == [0, 1]
    with open(path) as f:  # a regular file now, holding both rows
        assert [json.loads(line)["round"] for line in f] == [0, 1]
    assert target.read_text() == "untouched"


def test_swarm_retention_that_fails_on_a_full_disk_deletes_its_files_later(tmp_path):
    import errno
    server, url = swarm.start_server(str(tmp_path / "s"), keep_bytes=60_000)
    real, failed = server.store._write_atomic, []

    def full_once(name, data):  # the disk is full just when retention writes pruned.json, once
        if name.startswith("pruned") and not failed:
            failed.append(name)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(name, data)

    server.store._write_atomic = full_once
    try:
        statuses = [_sw_post(url, "a", r, [_sw_group(r, question="q" * 2000)] * 3).status_code for r in range(40)]
        assert failed and statuses == [200] * 40  # each batch was stored: no 507 because pruned.json failed after
        files = {f for f in os.listdir(_sw_settled(server.store).folder) if f.startswith("batch")}
        assert files == {swarm._batch_file(b.seq) for batches in server.store.batches.values() for b in batches}
    finally:
        server.shutdown()


def test_swarm_retention_counts_blocks_so_tiny_batches_keep_the_disk_within_keep_bytes(tmp_path, monkeypatch):
    """A tiny batch takes a whole block on disk and memory beyond its bytes: retention counts both, so 400
    batches of ~300 bytes under --keep-bytes 200K leave at most 200K on disk (counting their JSON bytes,
    1.6 MB stayed), and what is kept is bounded in number too."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # (the test is about sizes, not durability)
    folder, keep = str(tmp_path / "s"), 200_000
    store = swarm.RolloutStore(folder, keep)
    try:
        for k in range(400):
            assert _sw_tiny(store, f"w{k % 4}", k)["accepted"] == 1
        assert _sw_disk(_sw_settled(store).folder) <= keep
        kept = sum(len(batches) for batches in store.batches.values())
        assert 0 < kept <= keep // (swarm.Limits.batch_overhead + 512) and len(store.index) == kept
    finally:
        store.close()


def test_swarm_a_small_disk_never_fills_with_tiny_batches(tmp_path, monkeypatch):
    """A filesystem of 800 KB under --keep-bytes 600K (every write there fails with ENOSPC once the folder's
    blocks would pass 800 KB): tiny batches are stored for ever, none refused. Counting JSON bytes, the disk
    filled after about 190 batches holding 60 KB, and from then on every batch was refused."""
    import errno
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    folder = str(tmp_path / "s")
    store = swarm.RolloutStore(folder, 600_000)
    real = store._write_atomic

    def small_disk(name, data):
        if _sw_disk(folder) + 4096 * (len(data) // 4096 + 1) > 800_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(name, data)

    store._write_atomic = small_disk
    try:
        for k in range(500):
            assert _sw_tiny(store, "w", k)["accepted"] == 1
            _sw_settled(store)
        assert _sw_disk(folder) <= 600_000
    finally:
        store.close()


def test_swarm_a_write_that_prunes_returns_while_its_files_are_deleted(tmp_path, monkeypatch):
    """The write that crosses --keep-bytes deletes no file while it holds the write lock (with 100,000
    tiny batches kept, deleting 10,000 of them took 24 s under the lock): it returns, and the next write
    too, while the deletion is held up."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    store = swarm.RolloutStore(str(tmp_path / "s"), 100_000)
    real, release, removing = store._remove, threading.Event(), []

    def slow_remove(name):
        if name.startswith("batch-"):
            removing.append(name)
            release.wait(30)
        return real(name)

    store._remove = slow_remove
    try:
        for k in range(12):  # under the budget
            _sw_tiny(store, "w", k, question="q" * 3000)
        writes = threading.Thread(target=lambda: [_sw_tiny(store, "w", k, question="q" * 3000) for k in range(12, 52)])
        writes.start()
        writes.join(10)
        assert not writes.is_alive() and removing  # every write returned, though a deletion hangs
    finally:
        release.set()
        store.close()


def test_swarm_seqs_past_twelve_digits_read_back_after_a_restart(tmp_path):
    """Batch files are named after their last seq, 12 digits or more: from 10^12 on the names grow, and a
    restart reads them back in order (they were skipped, and the next batch reused their seqs)."""
    folder = str(tmp_path / "s")
    store = swarm.RolloutStore(folder)
    try:
        store.last_seq = 10**12 - 3  # (as after 10^12 groups)
        _sw_tiny(store, "a", 0)
        store.publish("a", 1, "a-1", [_sw_group(1), _sw_group(2), _sw_group(3)])
        _sw_tiny(store, "a", 2)
    finally:
        store.close()
    assert sorted(_sw_files(folder), key=len)[-1] == "batch-1000000000002.json"
    store = swarm.RolloutStore(folder)
    try:
        assert [seq for seq, *_ in store.index] == [10**12 - 2, 10**12 - 1, 10**12, 10**12 + 1, 10**12 + 2]
        assert _sw_tiny(store, "a", 3) == {"accepted": 1, "seq": 10**12 + 3}
    finally:
        store.close()


def test_swarm_a_sampled_read_costs_the_same_whatever_the_number_of_writers(tmp_path, monkeypatch):
    """A K = 16 read takes as many steps with 5,000 writers as with 200 (the Python lines run in swarm.py,
    counted): no pass over the writers, no sort of their names (with 30,000 writers a read took 32 ms)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)

    def steps(writers):
        store = swarm.RolloutStore(str(tmp_path / f"s{writers}"))
        try:
            for k in range(writers):
                _sw_tiny(store, f"w{k}", k)
            count = [0]

            def tracer(frame, event, arg):
                if frame.f_code.co_filename == swarm.__file__:
                    count[0] += event == "line"
                    return tracer
            sys.settrace(tracer)
            try:
                texts = store.sample(16, "w0", 7)[0]
            finally:
                sys.settrace(None)
            assert len(texts) == 16
            return count[0]
        finally:
            store.close()

    small, large = steps(200), steps(5000)
    assert large < 1.5 * small + 50, (small, large)


def test_swarm_a_reply_left_unread_is_reset_at_the_deadline(tmp_path, monkeypatch):
    """A reader that never reads its reply is cut off with a reset once the deadline passes: its reply does
    not stay in the kernel (an unread 1 MB page held 2.45 MB of kernel memory for minutes, delivered in
    full whenever the reader came back). A reader that reads gets every byte."""
    import socket
    monkeypatch.setattr(swarm.Limits, "request_seconds", 1.0)
    server, url = swarm.start_server(str(tmp_path / "s"))
    u = urlsplit(url)
    try:
        for r in range(6):  # about 1.2 MB of groups: a page of 1 MB
            assert _sw_post(url, "a", r, [_sw_group(r, completions=["x" * 30_000] * 7, stopped=[True] * 7)]).ok
        full = requests.get(url + "/rollouts?after=0&limit=1024", timeout=10).content
        assert len(full) > 800_000
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((u.hostname, u.port))
        s.sendall(b"GET /rollouts?after=0&limit=1024 HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(4)  # past the reply's deadline (1 s) and its delivery's (1 s)
        received, reset = 0, False
        s.settimeout(5)
        try:
            while chunk := s.recv(1 << 16):
                received += len(chunk)
        except ConnectionResetError:
            reset = True
        s.close()
        assert reset and received < len(full)
    finally:
        server.shutdown()


def test_swarm_a_reply_comes_only_after_its_batch_and_folder_are_fsynced(tmp_path, monkeypatch):
    """publish() returns (and so the POST's reply goes) only after the batch file was fsynced, renamed into
    place and the folder fsynced; retention's pruned.json copies the same, before any pruned file goes.
    (kill -9 cannot show a missing fsync: the page cache outlives the process.)"""
    folder = str(tmp_path / "s")
    store = swarm.RolloutStore(folder, 60_000)
    events, real_fsync, real_replace, real_remove = [], os.fsync, os.replace, os.remove
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.fstat(fd).st_ino)) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b, **kw: events.append(("replace", b)) or real_replace(a, b, **kw))
    monkeypatch.setattr(os, "remove", lambda a, **kw: events.append(("remove", a)) or real_remove(a, **kw))
    folder_ino = os.stat(folder).st_ino

    def durable(name):  # the file's fsync, then its rename, then the folder's fsync, in that order
        ino = os.stat(os.path.join(folder, name)).st_ino
        renamed = max(i for i, e in enumerate(events) if e == ("replace", name))
        assert ("fsync", ino) in events[:renamed] and ("fsync", folder_ino) in events[renamed:], (name, events)
        return renamed

    try:
        for k in range(30):
            reply = store.publish("w", k, f"w-{k}", [_sw_group(k, question="q" * 3000)])
            durable(swarm._batch_file(reply["seq"]))
            if store.gone:  # retention ran: both copies durable before any batch file was deleted
                store.deleter.submit(int).result()
                removed = [i for i, e in enumerate(events) if e[0] == "remove" and e[1].startswith("batch-")]
                assert removed and all(durable(copy) < removed[0] for copy in store.copies)
                break
        assert store.gone
    finally:
        store.close()


def test_swarm_per_peer_credentials_bind_a_write_to_its_name(tmp_path):
    """With peers={name: token}, a write is stored under the name its token belongs to: a body naming
    another peer is refused (403), in any case of the name; any credential reads (or anyone, with
    public_reads). The shared token, beside them, writes as anyone. Bad tables are one sentence."""
    peers = {"alice": "a-token", "Bob": "b-token"}
    server, url = swarm.start_server(str(tmp_path / "s"), token="shared", peers=peers)
    auth = lambda token: {"Authorization": f"Bearer {token}"}  # noqa: E731
    try:
        assert _sw_post(url, "alice", 0, [_sw_group(1)], headers=auth("a-token")).json() == {"accepted": 1, "seq": 1}
        assert _sw_post(url, "ALICE", 1, [_sw_group(2)], headers=auth("a-token")).status_code == 200
        r = _sw_post(url, "bob", 0, [_sw_group(3)], headers=auth("a-token"))  # impersonation
        assert r.status_code == 403 and "alice" in r.json()["error"]
        r = requests.post(url + "/metrics", json={"peer": "bob", "round": 0, "metrics": {}}, headers=auth("a-token"),
                          timeout=5)
        assert r.status_code == 403
        assert _sw_post(url, "bob", 0, [_sw_group(4)], headers=auth("b-token")).status_code == 200
        assert _sw_post(url, "carol", 0, [_sw_group(5)], headers=auth("shared")).status_code == 200
        for headers in ({}, auth("wrong"), auth("a-token ") | {"Authorization": "a-token"}):
            assert _sw_post(url, "alice", 5, [_sw_group(6)], headers=headers).status_code == 401
        assert requests.get(url + "/health", timeout=5).status_code == 401
        got = requests.get(url + "/rollouts?after=0", headers=auth("b-token"), timeout=5).json()["groups"]
        assert [(g["peer"], g["seq"]) for g in got] == [("alice", 1), ("alice", 2), ("bob", 3), ("carol", 4)]
    finally:
        server.shutdown()
    server, url = swarm.start_server(str(tmp_path / "s"), peers=peers, public_reads=True)
    try:
        assert requests.get(url + "/health", timeout=5).status_code == 200
        assert _sw_post(url, "alice", 7, [_sw_group(7)]).status_code == 401
    finally:
        server.shutdown()
    for bad, says in (({"alice": "t1", "ALICE": "t2"}, "given once"), ({"alice": "t", "bob": "t"}, "another's"),
                      ({".x": "t"}, "starting with a letter or digit"), ({"a": "two words"}, "peer a's token"),
                      ({"a": ""}, "peer a's token")):
        with pytest.raises(ValueError, match=says):
            swarm.start_server(str(tmp_path / "t"), peers=bad)
    with pytest.raises(ValueError, match="another's"):
        swarm.start_server(str(tmp_path / "t"), token="t", peers={"a": "t"})


def test_swarm_peers_file_is_read_at_start_and_again_on_sighup(tmp_path):
    """--peers-file: one 'name token' a line, read at start (a bad file: one sentence, exit 2) and on SIGHUP
    (a bad file then leaves the credentials as they were, logged)."""
    import signal
    peers, log = tmp_path / "peers", tmp_path / "log"
    peers.write_text("# name token\nalice a-token\n\nbob b-token\n")
    proc, url = _sw_spawn(str(tmp_path / "s"), str(log), "--peers-file", str(peers))
    writes = lambda name, token: _sw_post(url, name, 0, [_sw_group()], headers={  # noqa: E731
        "Authorization": f"Bearer {token}"}).status_code
    try:
        assert writes("alice", "a-token") == writes("bob", "b-token") == 200 and writes("bob", "a-token") == 403
        peers.write_text("carol c-token\nbob b-token\n")
        proc.send_signal(signal.SIGHUP)
        deadline = time.time() + 10
        while writes("carol", "c-token") != 200 and time.time() < deadline:
            time.sleep(0.1)
        assert writes("carol", "c-token") == 200 and writes("alice", "a-token") == 401
        peers.write_text("carol c-token extra\n")
        proc.send_signal(signal.SIGHUP)
        while "kept the credentials" not in log.read_text() and time.time() < deadline:
            time.sleep(0.1)
        assert "kept the credentials as they were" in log.read_text() and writes("carol", "c-token") == 200
    finally:
        _sw_stop(proc)
    for text in ("alice\n", "", "alice a\nalice b\n", "a b c\n"):
        peers.write_text(text)
        run = subprocess.run([sys.executable, _SW_SCRIPT, "--dir", str(tmp_path / "t"), "--port", "0", "--peers-file",
                              str(peers)], capture_output=True, text=True, timeout=20)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--peers-file" in run.stderr, text
    run = subprocess.run([sys.executable, _SW_SCRIPT, "--peers-file", str(tmp_path / "missing")], capture_output=True,
                         text=True, timeout=20)
    assert run.returncode == 2 and "cannot read --peers-file" in run.stderr


def test_swarm_peer_names_are_case_insensitive_and_start_with_a_letter_or_digit(_sw_server):
    """`Alice` and `alice` are one peer (stored in lower case); `.`, `..` and names starting with '_' or '-'
    are refused; exclude= compares the same way, for cursor reads and sampled reads alike."""
    server, url, _ = _sw_server
    for name, r in (("Alice", 0), ("alice", 1), ("ALICE", 2), ("bob", 0)):
        assert _sw_post(url, name, r, [_sw_group(r)]).status_code == 200
    assert _sw_post(url, "Alice", 0, [_sw_group(0)]).json() == {"accepted": 1, "seq": 1}  # her retry
    assert set(requests.get(url + "/peers", timeout=5).json()["peers"]) == {"alice", "bob"}
    for bad in (".", "..", "-x", "_x", ".alice"):
        r = _sw_post(url, bad, 0, [_sw_group()])
        assert r.status_code == 400 and "starting with a letter or digit" in r.json()["error"], bad
    for query in ("after=0&exclude=ALICE", "sample=16&exclude=aLiCe"):
        assert {g["peer"] for g in requests.get(f"{url}/rollouts?{query}", timeout=5).json()["groups"]} == {"bob"}
    assert requests.get(f"{url}/rollouts?after=0&exclude=..", timeout=5).status_code == 400


def test_swarm_posts_are_answered_in_turn_per_writer(tmp_path):
    """Writers take turns: with a writer's ten POSTs waiting behind a slow one of its own, another writer's
    POST is answered next, not after those ten (first come, first served, it waited for all of them)."""
    server, url = swarm.start_server(str(tmp_path / "s"), peers={"flood": "f-token", "honest": "h-token"})
    real, order, release = server.store.publish, [], threading.Event()

    def publish(peer, round_, batch_id, groups):
        order.append(peer)
        if len(order) == 1:
            release.wait(10)
        return real(peer, round_, batch_id, groups)

    server.store.publish = publish
    post = lambda name, r: _sw_post(url, name, r, [_sw_group(r)], headers={  # noqa: E731
        "Authorization": f"Bearer {name[0]}-token"}).status_code
    try:
        posts = [threading.Thread(target=post, args=("flood", r)) for r in range(11)]
        for t in posts:
            t.start()
            time.sleep(0.05)
        honest = threading.Thread(target=post, args=("honest", 0))
        honest.start()
        time.sleep(0.3)
        release.set()
        for t in posts + [honest]:
            t.join(20)
        assert len(order) == 12 and order.index("honest") <= 2, order
    finally:
        release.set()
        server.shutdown()


@pytest.mark.slow
def test_swarm_cli_bad_flags(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for flags in (["--port", "notanint"], ["--bogus"], ["--dir", str(a_file)], ["--keep-bytes", "0"],
                  ["--keep-bytes", "lots"], ["--port", "70000"], ["--dir", str(a_file / "sub")],
                  ["--token", "has space"], ["--token-file", str(tmp_path / "missing")]):
        run = subprocess.run([sys.executable, _SW_SCRIPT, *flags], capture_output=True, text=True, timeout=20)
        assert run.returncode == 2, flags
        assert run.stdout == "" and "Traceback" not in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("swarm.py: ")
    # two servers never share one folder
    server, _ = swarm.start_server(str(tmp_path / "s"))
    try:
        run = subprocess.run([sys.executable, _SW_SCRIPT, "--dir", str(tmp_path / "s"), "--port", "0"],
                             capture_output=True, text=True, timeout=20)
        assert run.returncode == 2 and "another swarm server" in run.stderr
    finally:
        server.shutdown()


def test_swarm_an_anonymous_get_has_no_body_and_spends_nothing_writers_need(tmp_path, monkeypatch):
    """With --public-reads a GET needs no credential, so it has no body: one that declares a body gets its
    400 from its headers alone, and anonymous readers sending bodies leave the bodies' budget (in flight)
    to the writers. (A GET's body was read into the shared budget: with --public-reads, 9 anonymous GETs
    stalling 8 MB bodies made 62 of 95 honest POSTs fail with 503.)"""
    import socket
    monkeypatch.setattr(swarm.Limits, "in_flight_bytes", 1_000_000)
    monkeypatch.setattr(swarm.Limits, "request_seconds", 3.0)
    server, url = swarm.start_server(str(tmp_path / "s"), token="s3cret", public_reads=True)
    u, stalled = urlsplit(url), []
    try:
        status, reply, _ = _sw_bytes(url, b"GET /health HTTP/1.1\r\nContent-Length: 1000000\r\n\r\n", timeout=30)
        assert status == 400 and "has no body" in reply["error"]  # (it waited for no body: no 408)
        for _ in range(4):
            stalled.append(socket.create_connection((u.hostname, u.port), timeout=5))
            stalled[-1].sendall(b"GET /rollouts HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (swarm.Limits.body_bytes - 1)
                                + b"x" * 300_000)
        time.sleep(0.5)  # (time for the server to read what they sent)
        auth = {"Authorization": "Bearer s3cret"}
        assert [_sw_post(url, "alice", k, [_sw_group(k)], headers=auth).status_code for k in range(5)] == [200] * 5
        assert requests.get(url + "/health", timeout=5).json()["groups"] == 5  # (reads need no token)
    finally:
        for s in stalled:
            s.close()
        server.shutdown()


@pytest.mark.slow
def test_swarm_a_writers_slow_bodies_cost_that_writer_alone(tmp_path, monkeypatch):
    """A POST of a per-peer credential takes its writer's turn before its body is read: one writer's many
    stalled bodies hold one body's bytes at most, and another writer's POSTs go through. (The turn was
    taken once the body was read into the shared budget: one writer's 9 stalled 8 MB bodies made 155 of
    165 of another writer's POSTs fail with 503.)"""
    import socket
    monkeypatch.setattr(swarm.Limits, "in_flight_bytes", 900_000)
    server, url = swarm.start_server(str(tmp_path / "s"), peers={"mallory": "m-token", "honest": "h-token"})
    u, stalled = urlsplit(url), []
    head = b"POST /rollouts HTTP/1.1\r\nAuthorization: Bearer m-token\r\nContent-Length: 200000\r\n\r\n"
    try:
        for _ in range(9):  # each sends half of its body, then stalls (sent from a thread: a body the server
            stalled.append(socket.create_connection((u.hostname, u.port), timeout=30))  # leaves unread may
            threading.Thread(target=stalled[-1].sendall, args=(head + b"x" * 100_000,), daemon=True).start()  # block
        deadline = time.time() + 10
        while server.in_flight < 100_000 and time.time() < deadline:  # the first one's half is in
            time.sleep(0.01)
        deadline = time.time() + 2  # and the others' halves, as far as the server reads them (all 9 would fill
        while server.in_flight < 900_000 and time.time() < deadline:  # the budget)
            time.sleep(0.01)
        assert server.in_flight == 100_000  # one body of mallory's at a time
        auth = {"Authorization": "Bearer h-token"}
        assert [_sw_post(url, "honest", k, [_sw_group(k)], headers=auth).status_code for k in range(5)] == [200] * 5
    finally:
        for s in stalled:
            s.close()
        server.shutdown()


def test_swarm_unread_replies_hold_little_and_let_honest_readers_and_writers_through(tmp_path, monkeypatch):
    """Readers that never read their replies: a page of groups is sent from the texts the store holds, 64 KB
    at a time, so an unread one holds at most 64 KB in the server's buffers and counts in no budget, and
    honest reads and writes go on. (Each unread reply was held whole, counted in the 64 MB in flight: 200
    such readers made 16 of 33 honest reads fail with 503 and grew the server's memory from 58 to 274 MB.)"""
    import socket
    monkeypatch.setattr(swarm.Limits, "in_flight_bytes", 1_000_000)
    server, url = swarm.start_server(str(tmp_path / "s"))
    monkeypatch.setattr(server.store, "page_bytes", 300_000)  # (the store took Limits.page_bytes when it started)
    u, readers = urlsplit(url), []
    try:
        for r in range(2):  # about 420 KB of groups: a page of 300 KB
            assert _sw_post(url, "a", r, [_sw_group(r, completions=["x" * 30_000] * 7, stopped=[True] * 7)]).ok
        for _ in range(20):
            readers.append(socket.socket())
            readers[-1].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            readers[-1].connect((u.hostname, u.port))
            readers[-1].sendall(b"GET /rollouts?after=0&limit=1024 HTTP/1.1\r\nHost: x\r\n\r\n")
        for s in readers:  # every reply has begun: its first bytes have arrived, unread
            s.settimeout(30)
            assert s.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200"
        assert all(w.transport.get_write_buffer_size() <= 65536 for w in list(server.open))
        r = requests.get(url + "/rollouts?after=0&limit=1024", timeout=10)
        assert r.status_code == 200 and len(r.content) > 200_000
        assert _sw_post(url, "b", 0, [_sw_group(0)]).status_code == 200
    finally:
        for s in readers:
            s.close()
        server.shutdown()


@pytest.mark.slow
def test_swarm_the_bodies_budget_is_given_back_when_a_request_ends(tmp_path, monkeypatch):
    """Guards the mutation that drops `self.in_flight -= len(body)` in SwarmServer._give_back: a body counts
    in the bodies' budget (in flight) while it is read and answered, and is given back once it is, whether
    stored, refused or cut short, so a server takes POSTs for ever (with the mutation, every POST got a 503
    once 64 MB had arrived in all)."""
    monkeypatch.setattr(swarm.Limits, "in_flight_bytes", 200_000)
    server, url = swarm.start_server(str(tmp_path / "s"))
    try:
        big = lambda r: [_sw_group(r, completions=["x" * 20_000], stopped=[True])]  # noqa: E731 (20 KB)
        assert [_sw_post(url, "a", r, big(r)).status_code for r in range(30)] == [200] * 30  # 600 KB in all
        assert _sw_raw(url, "POST", "/rollouts", b"[" * 50_000)[0] == 400  # refused
        _sw_bytes(url, b"POST /rollouts HTTP/1.1\r\nContent-Length: 99999\r\n\r\n" + b"x" * 50_000, timeout=0.5)  # cut
        deadline = time.time() + 30
        while server.in_flight and time.time() < deadline:  # (each connection ends on its own)
            time.sleep(0.05)
        assert server.in_flight == 0
        assert [_sw_post(url, "a", r, big(r)).status_code for r in range(30, 40)] == [200] * 10
    finally:
        server.shutdown()


@pytest.mark.slow
def test_swarm_an_acknowledged_batch_at_the_parse_limit_reads_back_after_a_restart(tmp_path):
    """A batch of nearly Limits.json_values values is acknowledged, and stored with what the server adds to
    each group (its writer, round, seq and time, and the metadata and model it left out): the server reads
    its own files allowing for that, so the batch is there after a restart. (The files were read under a
    POST's limit: such a batch was acknowledged, then skipped at the next start as too large: lost.)"""
    ids = [[0] * 8192 for _ in range(16)]  # 2^17 token ids a group, Limits.group_tokens
    groups = [{"task": "t", "question": f"q{k}", "answer": "a", "completions": ["c"] * 16, "stopped": [True] * 16,
               "token_ids": [list(c) for c in ids], "logprobs": [list(c) for c in ids], "tokenizer": "v"}
              for k in range(4)]
    body = {"peer": "alice", "round": 0, "batch_id": "full", "groups": groups}
    over = swarm._values(json.dumps(body)) - (swarm.Limits.json_values - 4)
    cut = (over + 1) // 2  # each token id dropped takes a value from token_ids and one from logprobs
    del groups[-1]["token_ids"][-1][-cut:], groups[-1]["logprobs"][-1][-cut:]
    data = json.dumps(body).encode()
    assert swarm.Limits.json_values - 6 < swarm._values(data.decode()) <= swarm.Limits.json_values
    folder = str(tmp_path / "s")
    server, url = swarm.start_server(folder)
    try:
        r = requests.post(url + "/rollouts", data=data, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.json() == {"accepted": 4, "seq": 4}
    finally:
        server.shutdown()
    stored = open(os.path.join(folder, _sw_files(folder)[0]), encoding="utf-8").read()
    assert swarm._values(stored) > swarm.Limits.json_values  # what the server adds passes the POST's limit
    server, url = swarm.start_server(folder)
    try:
        assert [seq for seq, *_ in server.store.index] == [1, 2, 3, 4]
        assert _sw_post(url, "alice", 0, groups, batch_id="full").json() == {"accepted": 4, "seq": 4}  # stored once
    finally:
        server.shutdown()
