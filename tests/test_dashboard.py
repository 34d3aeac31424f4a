"""
The dashboard (python swarm.py serves it at /) and the reward charts it shares with train.py --plot: what
they show, escaped, and that every chart is well-formed SVG.
"""

import json
import os
import re
import xml.etree.ElementTree as ET

import pytest
import requests

import reward
import swarm
import train
from test_all import _sw_group


def test_swarm_dashboard_and_metrics(_sw_server, _sw_clients):
    server, url, folder = _sw_server
    alice, bob = _sw_clients(url, "alice"), _sw_clients(url, "bob.2")
    assert "no data yet" in requests.get(url + "/", timeout=5).text
    for r in range(4):
        alice.post_metrics(r, {"local_reward": 0.1 * r, "batch_reward": 0.2 * r, "loss": float("nan"),
                               "big": 10**400})
        bob.post_metrics(r, {"local_reward": 0.3 + 0.01 * r})
    alice.publish(3, [_sw_group()])
    assert alice.flush(10) and bob.flush(10)
    page = requests.get(url + "/", timeout=5)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "<svg" in page.text and "alice" in page.text and "bob.2" in page.text
    assert page.text.count("<polyline") == 2
    rows = requests.get(url + "/metrics", timeout=5).json()["metrics"]
    first = next(row["metrics"] for row in rows if row["peer"] == "alice")
    assert len(rows) == 8 and first["loss"] is None and first["big"] is None
    server.shutdown()
    with open(os.path.join(folder, "metrics.jsonl"), "a") as f:  # a row an older server let in
        f.write(json.dumps({"n": 9, "peer": "eve", "round": 1, "time": 1.0, "metrics": {"local_reward": 10**400}}) + "\n")
    server, url = swarm.start_server(folder)  # metrics survive a restart; the dashboard survives the bad row
    try:
        assert len(requests.get(url + "/metrics", timeout=5).json()["metrics"]) == 8
        assert requests.get(url + "/peers", timeout=5).json()["peers"]["bob.2"]["last_round"] == 3
        assert requests.get(url + "/", timeout=5).status_code == 200
    finally:
        server.shutdown()


def test_swarm_dashboard_shows_each_peers_newest_completions_escaped(_sw_server, _sw_clients):
    """Beside the chart: each peer's newest question and completions, escaped (they are text from
    outside); the table names each peer's model and counts rounds done as the progress bar does (a peer that
    finished round 0: 1)."""
    server, url, folder = _sw_server
    eve, ann = _sw_clients(url, "eve"), _sw_clients(url, "ann")
    eve.publish(0, [_sw_group(completions=["old"], stopped=[True])])
    eve.publish(1, [_sw_group(question="<script>alert(1)</script>?", completions=["<b>bold</b> & <img src=x>"],
                              stopped=[True])])
    ann.publish(1, [_sw_group(completions=["ann says 2"], stopped=[True], model="ann's <i>model</i>")])  # round 1,
    ann.post_metrics(0, {"local_reward": 0.5, "round": 0})                   # round 0 done
    assert eve.flush(10) and ann.flush(10)
    page = requests.get(url + "/", timeout=5).text
    assert "<script>alert" not in page and "<img" not in page and "<b>bold" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;?" in page and "&lt;b&gt;bold&lt;/b&gt; &amp; &lt;img src=x&gt;" in page
    assert "ann says 2" in page and ">old<" not in page  # the newest group of each peer
    assert re.search(r"<td>ann</td><td>ann&#x27;s &lt;i&gt;model&lt;/i&gt;</td><td>1</td>", page)  # its model, escaped
    assert re.search(r"<td>eve</td><td>tiny</td><td></td>", page) and "rounds done" in page
    assert "<pre>reward" not in page  # a server given no scorer (python swarm.py) judges no content


def test_swarm_dashboard_shows_each_completions_reward_by_the_scorer_it_was_given(tmp_path, _sw_clients):
    """The launcher's server, started with score=reward.score, shows the reward of each completion on
    its dashboard, a right one's 1 and a wrong one's 0."""
    server, url = swarm.start_server(str(tmp_path / "swarm"), score=reward.score)
    try:
        eve = _sw_clients(url, "eve")
        eve.publish(0, [_sw_group(3, completions=["<answer>4</answer>", "<answer>5</answer>"], stopped=[True, True])])
        assert eve.flush(10)
        page = requests.get(url + "/", timeout=5).text
        assert "<pre>reward 1: &lt;answer&gt;4" in page and "<pre>reward 0: &lt;answer&gt;5" in page, page
    finally:
        server.shutdown()


def test_swarm_render_svg_parses():
    svg = swarm.render_svg({"<b>&'peer\"": [(0, 0.1), (1, 0.5), (2, 0.4)], "solo": [(3, 1.0)],
                            "empty": [], "nan": [(1, float("nan"))], "huge": [(1, 10**400)]},
                           title="a < b & c", ylabel="r")
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "<b>&'peer\"" in texts and "a < b & c" in texts and "round" in texts
    assert len(list(root.iter("{http://www.w3.org/2000/svg}polyline"))) == 1
    assert ET.fromstring(swarm.render_svg({})).tag.endswith("svg")
    # reproduce.py's figures: a shaded band per line (bad points left out) and a dashed reference level
    svg = swarm.render_svg({"4/4": [(0, 0.2), (1, 0.3)], "8/0": [(0, 0.1), (1, 0.2)]}, hline=1.0,
                           bands={"4/4": [(0, 0.1, 0.3), (1, float("nan"), 0.4), (1, 0.2, 0.4)], "gone": [(0, 0, 1)]})
    root = ET.fromstring(svg)
    polygons = list(root.iter("{http://www.w3.org/2000/svg}polygon"))
    assert len(polygons) == 1 and len(polygons[0].get("points").split()) == 4
    assert any(x.get("stroke-dasharray") for x in root.iter("{http://www.w3.org/2000/svg}line"))


def test_swarm_reward_chart_ticks_at_round_numbers_and_draws_points_and_their_running_mean(tmp_path):
    """The dashboard's and --plot's chart: a faint dot per round and a line through the mean of the last 5
    rounds (a reward that zigzags by 0.6 draws a line that moves far less), and ticks at round numbers."""
    svg_ns = "{http://www.w3.org/2000/svg}"
    zigzag = [(r, 0.1 if r % 2 else 0.9) for r in range(20)]

    def drawn(svg):
        root = ET.fromstring(svg)
        dots = [float(c.get("cy")) for c in root.iter(svg_ns + "circle")]
        line = [float(xy.split(",")[1]) for p in root.iter(svg_ns + "polyline") for xy in p.get("points").split()]
        return root, dots, line
    root, dots, line = drawn(swarm.render_svg({"peer0": zigzag}))
    ticks = [t.text for t in root.iter(svg_ns + "text")][1:9]  # after the title: rounds, then rewards
    assert ticks == ["0", "5", "10", "15", "0.2", "0.4", "0.6", "0.8"]
    assert len(dots) == 20 and len(line) == 20 and max(line[4:]) - min(line[4:]) < 0.25 * (max(dots) - min(dots))
    _, dots, line = drawn(swarm.render_svg({"peer0": zigzag}, mean_over=0))  # reproduce.py's own running means
    assert dots == [] and max(line) - min(line) == pytest.approx(0.8 / 0.88 * 280, abs=0.2)
    snap = dict(groups=0, first_seq=0, last_seq=0, peers={"peer0": dict(last_seen=0, groups=0)},
                metrics=[dict(peer="peer0", round=r, metrics=dict(local_reward=y)) for r, y in zigzag])
    _, dots, line = drawn(re.search(r"<svg.*?</svg>", swarm.render_page(snap), re.S).group(0))
    assert len(dots) == 20 and len(line) == 20
    (tmp_path / "peer0").mkdir()
    (tmp_path / "peer0" / "metrics.jsonl").write_text("".join(json.dumps(dict(round=r, local_reward=y, batch_reward=y))
                                                              + "\n" for r, y in zigzag))
    train.plot(str(tmp_path))
    _, dots, line = drawn((tmp_path / "reward.svg").read_text())
    assert len(dots) == 20 and len(line) == 20 and max(line[4:]) - min(line[4:]) < 0.25 * (max(dots) - min(dots))


def test_train_plot_shows_the_local_reward_first(tmp_path, monkeypatch):
    for name, local, batch in (("p0", 0.1, 0.6), ("p1", 0.2, 0.7)):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for r in range(3):
                f.write(json.dumps(dict(round=r, local_reward=local, batch_reward=batch)) + "\n")
    charts, real = [], swarm.render_svg
    monkeypatch.setattr(swarm, "render_svg", lambda series, title: charts.append((series, title)) or real(series, title))
    train.main(["--plot", str(tmp_path)])
    (local, local_title), (batch, batch_title) = charts
    assert "local reward" in local_title and "paper" in batch_title
    assert local["p0"] == [(r, pytest.approx(0.1)) for r in range(3)] and batch["p1"][-1] == (2, pytest.approx(0.7))
    ET.fromstring((tmp_path / "reward.svg").read_text())  # one well-formed SVG holding both
    (tmp_path / "silo" / "p0").mkdir(parents=True)  # in silo the batch is the local groups: one chart
    with open(tmp_path / "silo" / "p0" / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps(dict(round=r, local_reward=0.5, batch_reward=0.5)) + "\n" for r in range(3)))
    train.main(["--plot", str(tmp_path / "silo")])
    root = ET.fromstring((tmp_path / "silo" / "reward.svg").read_text())
    assert len(charts) == 3 and root.get("height") == "360" and len(root.findall("{http://www.w3.org/2000/svg}svg")) == 1
