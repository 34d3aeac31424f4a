"""
The swarm client against servers that misbehave: redirects, proxies and .netrc, replies it must not take
(bombs, lone surrogates, malformed groups), refusals, a server that starts over, a stalled handshake; and
what it logs, once. That publish() and fetch() never wait, and what the queues hold, are test_all.py's.
"""

import json
import os
import re
import threading
import time

import pytest
import requests

import swarm
from conftest import fake_server
from test_all import _free_port, _sw_group, _sw_post, _sw_read_all, _sw_stored


def test_swarm_client_close_ends_a_stalled_tls_handshake_at_once(_sw_clients):
    """https:// to a server that accepts and never answers the TLS hello: close() ends the exchange at
    once (the thread's socket is shut before its handshake), not after requests' 10 s read timeout."""
    import socket
    listener, accepted = socket.create_server(("127.0.0.1", 0)), []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    try:
        client = _sw_clients(f"https://127.0.0.1:{listener.getsockname()[1]}", "alice")
        client.publish(0, [_sw_group(1)])
        deadline = time.time() + 10
        while not accepted and time.time() < deadline:
            time.sleep(0.05)
        assert accepted and any(client.transport.sockets.values())  # in its handshake, its socket known
        client.close()  # joins the thread for up to 5 s
        assert not any(t.is_alive() for t in client.threads)
    finally:
        listener.close()


def test_swarm_client_drops_at_once_a_batch_no_server_would_take(monkeypatch, capsys, _sw_clients):
    """A batch over a request's byte limit is dropped when it is published, in one line: a server would
    refuse it (413), and kept while the server is down it would hold the outbox past its bound."""
    monkeypatch.setattr(swarm.Limits, "body_bytes", 5_000)
    alice = _sw_clients(f"http://127.0.0.1:{_free_port()}", "alice")  # nobody listens there
    alice.publish(0, [_sw_group(0, completions=["x" * 3000] * 2)])
    alice.publish(1, [_sw_group(1)])
    assert [what for what, *_ in alice.outbox] == ["round 1's batch"]
    assert "swarm client alice: round 0's batch is " in capsys.readouterr().err


@pytest.mark.slow
def test_swarm_client_back_online_says_whether_anything_waited(tmp_path, capsys, _sw_clients):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    reader, writer = _sw_clients(url, "reader"), _sw_clients(url, "writer")
    writer.publish(0, [_sw_group(0)])
    reader.fetch()  # (asks for a read)
    deadline = time.time() + 10
    while not (reader.down and writer.down) and time.time() < deadline:  # both found the server gone
        time.sleep(0.05)
    server, _ = swarm.start_server(str(tmp_path / "s"), port=port)
    try:
        assert reader.flush(20) and writer.flush(20)
        err, deadline = "", time.time() + 10
        while err.count("answers again") < 2 and time.time() < deadline:  # (said just after the exchange)
            err += capsys.readouterr().err
            time.sleep(0.05)
        assert "swarm client reader: the server answers again\n" in err, err
        assert "swarm client writer: the server answers again, sending what waited\n" in err, err
    finally:
        server.shutdown()


def test_swarm_client_checks_every_group_it_receives(capsys, _sw_clients):
    def stored(n, **change):
        g = dict(_sw_group(n), peer="mallory", round=1, seq=n, time=1.0e9)
        g.update(change)
        return {k: v for k, v in g.items() if v is not KeyError}

    groups = [stored(1), stored(2, completions=KeyError), stored(3, completions=5), stored(4, stopped=[True]),
              stored(5, peer="<b>"), stored(6, time=KeyError), stored(7, question=None), "not a group",
              stored(8), stored(8), stored(9, seq=99)]

    # every sampled read: the same groups (the client hands out none twice)
    httpd, url = fake_server(lambda method, path, body: (200, {"groups": groups, "last": 99}))
    try:
        client = _sw_clients(url, "alice")
        assert client.flush(10) and client.flush(10)
        got = client.fetch()
        assert [g["seq"] for g in got] == [1, 8, 99] and all(isinstance(g["completions"], list) for g in got)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "dropped 7 malformed groups" in err[0]
        client.close()  # before its server goes: a client left running would log that it is unreachable
    finally:
        httpd.shutdown()
        httpd.server_close()



@pytest.fixture
def _sw_fake():
    """Make servers with _sw_fake(answer): every request is answered by answer(method, path, body) ->
    (status, a JSON-able reply or bytes[, headers]) (conftest.fake_server). Every one is shut at the end."""
    made = []

    def make(answer):
        httpd, url = fake_server(answer)
        made.append(httpd)
        return url

    yield make
    for httpd in made:
        httpd.shutdown()
        httpd.server_close()


def _sw_honest(stored, method, path):
    """What a swarm server holding `stored` (groups with seq 1, 2, ...: one producer's window) answers a
    sampled read, GET /rollouts?sample=K: K of them (the newest, here)."""
    k = int(re.search(r"sample=(\d+)", path).group(1))
    return 200, {"groups": stored[-k:], "last": len(stored)}


def test_swarm_client_speaks_through_requests_and_follows_no_redirect(_sw_server, _sw_clients, _sw_fake, capsys):
    """A server answering 307 to another server (which would take the batch, and serve reads): the client
    sends nothing there. A redirect is the server's trouble: said once, and the batch waits."""
    server, url, folder = _sw_server
    moved = _sw_fake(lambda method, path, body: (307, b"", {"Location": url + path}))  # (307 keeps a POST a POST)
    alice = _sw_clients(moved, "alice")
    alice.publish(0, [_sw_group(0)])
    _sw_post(url, "bob", 0, [_sw_group(1)])
    assert not alice.flush(3)  # fails: the redirect was followed, the batch stored there
    assert [g["peer"] for g in _sw_read_all(url)] == ["bob"] and alice.fetch() == [] and len(alice.outbox) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HTTP 307, a redirect to " in err[0] and url in err[0], err
    assert isinstance(alice.transport.session, requests.Session)


def test_swarm_client_sends_its_token_not_a_netrc_password_and_keeps_proxies(tmp_path, monkeypatch, _sw_clients,
                                                                          _sw_fake):
    """A ~/.netrc entry for the server's host must not replace the client's bearer token (requests'
    environment trust would), while HTTP_PROXY, and NO_PROXY around it, still take effect."""
    server, url = swarm.start_server(str(tmp_path / "s"), token="s3cret")
    try:
        home, home_before = tmp_path / "home", os.environ.get("HOME", "/")
        home.mkdir()
        (home / ".netrc").write_text("machine 127.0.0.1 login someone password netrc-secret\n")
        (home / ".netrc").chmod(0o600)
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.delenv("NETRC", raising=False)
        for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy",
                     "NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        alice = _sw_clients(url, "alice", token="s3cret")
        alice.publish(0, [_sw_group(0)])
        assert alice.flush(10)  # fails: 401 for ever, the netrc password sent instead of the token
        asked = []
        proxy = _sw_fake(lambda method, path, body: asked.append((path, body)) or (200, {"accepted": 1, "seq": 1}))
        monkeypatch.setenv("HTTP_PROXY", proxy)
        bob = _sw_clients(url, "bob", token="s3cret")
        bob.publish(0, [_sw_group(1)])
        bob.flush(5)
        bob.close()
        assert asked and asked[0][0] == url + "/rollouts"  # through the proxy, by absolute URL
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        carol, proxied = _sw_clients(url, "carol", token="s3cret"), len(asked)
        carol.publish(0, [_sw_group(2)])
        assert carol.flush(10) and len(asked) == proxied
        monkeypatch.setenv("HOME", home_before)  # (plain requests, as the audit below, would use that .netrc)
        assert [g["peer"] for g in _sw_read_all(url, token="s3cret")] == ["alice", "carol"]
    finally:
        server.shutdown()


@pytest.mark.slow
def test_swarm_client_takes_no_reply_that_would_hold_the_training_loop(monkeypatch, capsys, _sw_clients, _sw_fake):
    costs = []  # the JSON values in every reply the client parsed

    def parse(raw, real=swarm.parse_json, **kwargs):
        value = real(raw, **kwargs)  # (its count refuses what holds too many values before parsing)
        costs.append(sum(map(bytes(raw).count, b"{[,")))
        return value

    monkeypatch.setattr(swarm, "parse_json", parse)
    stored, reads = [_sw_stored(seq) for seq in range(1, 6)], []
    bomb = b'{"groups":[' + b",".join([b"{}"] * (swarm.Limits.json_values + 1000)) + b'],"last":5}'
    fake = _sw_fake(lambda method, path, body: (200, bomb) if not reads.append(path) and len(reads) == 1 else
                    _sw_honest(stored, method, path))  # (the first read: the bomb)
    client = _sw_clients(fake, "victim")
    assert client.flush(20)
    stored.append(_sw_stored(6))
    assert client.flush(20) and sorted(g["seq"] for g in client.fetch()) == [1, 2, 3, 4, 5, 6]  # it read on
    assert costs and max(costs) <= swarm.Limits.json_values  # the bomb was never parsed
    assert swarm.Limits.reply_bytes <= swarm.Limits.body_bytes + (1 << 20)  # the largest page a server sends
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "cannot use" in err[0] and f"{swarm.Limits.json_values} values" in err[0], err
    assert "answers again" in err[1], err


@pytest.mark.slow
def test_swarm_client_reads_on_past_a_reply_it_cannot_use(capsys, _sw_clients, _sw_fake):
    """A server that serves, among the groups arriving, one whose question is a lone surrogate: every group
    after it is received, and the client says so once, never every read."""
    stored = []
    client, got = _sw_clients(_sw_fake(lambda method, path, body: _sw_honest(stored, method, path)), "victim"), []
    for seq in range(1, 11):
        stored.append(_sw_stored(seq, question="\ud800") if seq == 3 else _sw_stored(seq))
        assert client.flush(20)
        got += [g["seq"] for g in client.fetch()]
    assert set(range(4, 11)) <= set(got), got
    for _ in range(3):
        assert client.flush(20)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # said once, never every read


def test_swarm_client_drops_a_served_lone_surrogate_alone(capsys, _sw_clients, _sw_fake):
    """A page whose third group's question is a lone surrogate ("\\ud800", which UTF-8 cannot carry):
    that group is dropped, the four beside it in the same page are received."""
    stored = [_sw_stored(seq, question="\ud800") if seq == 3 else _sw_stored(seq) for seq in range(1, 6)]
    client = _sw_clients(_sw_fake(lambda method, path, body: _sw_honest(stored, method, path)), "victim")
    assert client.flush(20) and sorted(g["seq"] for g in client.fetch()) == [1, 2, 4, 5]
    assert "dropped 1 malformed groups" in capsys.readouterr().err



@pytest.mark.parametrize("status", [413, 422])
@pytest.mark.slow
def test_swarm_client_reads_again_after_a_get_refused_413_or_422(_sw_fake, _sw_clients, status):
    stored, pages = [_sw_stored(s) for s in range(1, 11)], []

    def answer(method, path, body):  # one GET answered 413 or 422 (a proxy's), then an honest server
        pages.append(path)
        return (status, {"error": "a proxy's refusal"}) if len(pages) == 1 else _sw_honest(stored, method, path)

    client = _sw_clients(_sw_fake(answer), "me")
    assert client.flush(20)
    assert sorted(g["seq"] for g in client.fetch()) == list(range(1, 11)) and len(pages) >= 2


def test_swarm_client_sampled_reads_go_on_after_the_store_starts_over(tmp_path, _sw_clients):
    server, url = swarm.start_server(str(tmp_path / "a"))
    port = server.server_address[1]
    _sw_post(url, "bob", 0, [_sw_group(i) for i in range(8)])
    client = _sw_clients(url, "me", sample=16)
    assert client.flush(20) and len(client.fetch()) == 8
    server.shutdown()  # the store starts over (a wiped folder; a Redis without persistence): seqs 1, 2, ... again
    server, _ = swarm.start_server(str(tmp_path / "b"), port=port)
    try:
        _sw_post(url, "carol", 0, [_sw_group(i) for i in range(8)])
        got = []
        for _ in range(3):
            client.flush(20)
            got += client.fetch()
        assert len(got) == 8  # fails: 0, the new groups' seqs are in `seen`
    finally:
        server.shutdown()


def test_swarm_client_survives_a_lone_surrogate_in_an_error_reply(capsys, _sw_fake, _sw_clients):
    """capsys's stderr is strict UTF-8, as is any stream a host program wraps: the client's log line about
    an error reply holding a lone surrogate must not raise there, and its thread must go on asking."""
    asked = []

    def answer(method, path, body):
        asked.append(path)
        return 409, b'{"error":"bad \\ud800 thing"}'
    client = _sw_clients(_sw_fake(answer), "me", sample=4)
    deadline = time.time() + 20
    while len(asked) < 2 and time.time() < deadline:
        client.flush(0.5)
    assert len(asked) >= 2 and all(t.is_alive() for t in client.threads)


def test_swarm_client_reads_on_after_a_400_quoting_a_lone_surrogate(capsys, _sw_fake, _sw_clients):
    """A 400 to a read whose message holds a lone surrogate is still a 400 to the client: it says so in a
    line it can print, and the next read is served."""
    stored, reads = [_sw_stored(seq) for seq in range(1, 6)], []

    def answer(method, path, body):
        reads.append(path)
        return (400, b'{"error":"no seq 0 \\ud800 here"}') if len(reads) == 1 else _sw_honest(stored, method, path)
    client = _sw_clients(_sw_fake(answer), "me")
    assert client.flush(20) and sorted(g["seq"] for g in client.fetch()) == [1, 2, 3, 4, 5]
    assert "HTTP 400: no seq 0 \\ud800 here" in capsys.readouterr().err


def test_swarm_client_logs_a_served_bad_group_once_in_sampled_mode(capsys, _sw_fake, _sw_clients):
    bad = _sw_stored(99, completions=[])
    url = _sw_fake(lambda method, path, body: (200, {"groups": [bad, _sw_stored(1)], "last": 99}))
    client = _sw_clients(url, "me", sample=4)
    for _ in range(4):
        assert client.flush(20)
        client.fetch()
    assert capsys.readouterr().err.count("malformed") == 1  # fails: once per read


def test_swarm_client_a_redirect_to_a_malformed_url_is_the_servers_trouble(capsys, _sw_clients, _sw_fake):
    """A 307 to a URL that cannot be parsed: "server unreachable", said once, and the batch waits."""
    client = _sw_clients(_sw_fake(lambda method, path, body: (307, b"", {"Location": "http://[::1"})), "me")
    client.publish(0, [_sw_group(0)])
    deadline = time.time() + 20
    while "unreachable" not in (err := capsys.readouterr().err) and time.time() < deadline:
        client.flush(0.2)
    assert "server unreachable (" in err and "unexpected" not in err and len(client.outbox) == 1


@pytest.mark.parametrize("status, says", [(401, "token"), (403, "token"), (404, "proxy"), (200, "acknowledge")])
@pytest.mark.slow
def test_swarm_client_keeps_a_batch_the_server_did_not_acknowledge(status, says, capsys, _sw_clients, _sw_fake):
    posts, honest = [], threading.Event()

    def answer(method, path, body):
        if method == "GET":
            return _sw_honest([], method, path)
        posts.append(json.loads(body))
        if honest.is_set():
            return 200, {"accepted": len(posts[-1]["groups"]), "seq": len(posts[-1]["groups"])}
        return status, {} if status == 200 else {"error": "No."}

    client, t0 = _sw_clients(_sw_fake(answer), "alice"), time.time()
    client.publish(0, [_sw_group(0)])
    while len(posts) < 3 and time.time() < t0 + 60:
        time.sleep(0.05)
    assert len(posts) >= 3 and len(client.outbox) == 1  # tried again and again, and kept it
    honest.set()
    assert client.flush(20) and not client.outbox and {p["batch_id"] for p in posts} == {posts[0]["batch_id"]}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and says in err[0] and "answers again" in err[1], err


@pytest.mark.parametrize("status", [400, 413, 422])
@pytest.mark.slow
def test_swarm_client_drops_a_batch_the_server_refuses_as_malformed(status, capsys, _sw_clients, _sw_fake):
    posts = []

    def answer(method, path, body):
        if method == "GET":
            return _sw_honest([], method, path)
        posts.append(path)
        return status, {"error": "That batch is wrong."}

    client = _sw_clients(_sw_fake(answer), "alice")
    client.publish(0, [_sw_group(0)])
    assert client.flush(20) and not client.outbox and posts == ["/rollouts"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"dropped: HTTP {status}: That batch is wrong." in err[0], err
