import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E401, E702
# A newcomer's first run, held: what a fresh clone, the README top to bottom, `python train.py --peers 4
# --rounds 20`, Ctrl-C, --resume, a few mistakes and the tests meet. A stop keeps every completed round
# whatever the load, a resume keeps the metrics, a wrong flag answers before torch loads, the memory check
# counts what the device's defaults need, the launcher resolves each model once, a --swarm that does not
# answer says so, sample.py asks as the run asked, and the run's disk is said and kept tidy.

import json
import random
import re
import shutil
import signal
import subprocess
import textwrap
import threading
import time
import xml.etree.ElementTree as ET

import pytest
import torch

import grpo
import model as M
import reward
import sample
import swarm
import train
from conftest import _processes_mentioning
from test_all import (FakeClient, _fake_gpu, _free_port, quiet, save_tiny, spread_rewards, tiny,  # noqa: F401
                      tiny_args, wire_group)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(HERE, "train.py")


def _rounds(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line)["round"] for line in f]


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


# -- a stop keeps every completed round, whatever the load --------------------------------------------------

def _stop_in_round(monkeypatch, peer_box, stop_round, where):
    """Send the peer in peer_box[0] the launcher's stop (SIGTERM's handler) in round stop_round: 'forward',
    during its GRPO step's passes, before the optimizer step; 'step', as its optimizer step begins."""
    real_step, calls = grpo.step, []

    def step(model, opt, *args, **kwargs):
        calls.append(1)
        if len(calls) == stop_round + 1 and where == "forward":
            peer_box[0].interrupt(signal.SIGTERM, None)  # a long forward pass: the stop arrives here
        if len(calls) == stop_round + 1 and where == "step":
            opt.register_step_pre_hook(lambda *_: peer_box[0].interrupt(signal.SIGTERM, None))
        return real_step(model, opt, *args, **kwargs)
    monkeypatch.setattr(grpo, "step", step)


def test_a_stop_in_a_rounds_forward_pass_saves_the_last_completed_round_at_once(tiny, tmp_path, monkeypatch):
    """A stop that lands in round 2's forward and backward passes (which take minutes on a loaded CPU)
    abandons round 2, whose weights are still round 1's, and saves round 1 at once: the launcher's grace
    never has to cover a whole round. --resume goes on at round 2."""
    spread_rewards(monkeypatch)  # (every round steps)
    box = [None]
    _stop_in_round(monkeypatch, box, 2, "forward")
    after = {}
    log_round = train.Peer.log_round

    def logged(peer, r, *args):
        m = log_round(peer, r, *args)
        after[r] = _weights(peer.model)
        return m
    monkeypatch.setattr(train.Peer, "log_round", logged)
    box[0] = peer = train.Peer(tiny_args(tmp_path, "--name", "s", "--rounds", "9", "--external", "0"), log=quiet)
    assert peer.run() is True
    folder = tmp_path / "run" / "s"
    assert train.last_checkpoint(str(folder))["round"] == 1 and _rounds(folder) == [0, 1]
    saved, _ = M.load_model(str(folder / "checkpoint-1"))
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), after[1]))
    assert sorted(os.listdir(folder)) == ["checkpoint-1", "checkpoint.json", "metrics.jsonl", "samples.jsonl",
                                          "settings.json"]
    again = train.Peer(tiny_args(tmp_path, "--name", "s", "--rounds", "9", "--external", "0", "--resume"),
                       log=quiet)
    assert again.start_round == 2


def test_a_stop_during_the_optimizer_step_finishes_that_round_and_saves_it(tiny, tmp_path, monkeypatch):
    spread_rewards(monkeypatch)
    box = [None]
    _stop_in_round(monkeypatch, box, 2, "step")
    box[0] = peer = train.Peer(tiny_args(tmp_path, "--name", "s", "--rounds", "9", "--external", "0"), log=quiet)
    assert peer.run() is True
    folder = tmp_path / "run" / "s"
    assert train.last_checkpoint(str(folder))["round"] == 2 and _rounds(folder) == [0, 1, 2]


class RoundClient(FakeClient):
    """A swarm client that hands out, at each round's fetch, that round's groups: a read depends on its
    round only, as the real client's sampled reads do, so a resumed peer is handed what an unstopped one was."""

    def __init__(self, batches, round=0):
        super().__init__()
        self.batches, self.round = batches, round

    def fetch(self):
        self.round += 1
        return self.batches.get(self.round - 1, [])


def test_a_peer_stopped_after_drawing_its_external_groups_resumes_as_if_never_stopped(tiny, tmp_path, monkeypatch):
    """Stopped in round 2 after it drew external groups from its pool (the pool and the draw's random state
    moved on) but before its step: the checkpoint holds round 1's state, and --resume to round 5 ends with the
    weights of a peer that never stopped, having trained on the same groups round by round."""
    items = [reward.TASKS["repeat_number"].generate(random.Random(k)) for k in range(40)]  # (rewards: real ones)
    batches = {r: [dict(wire_group(items[4 * r + i], round_=r), seq=4 * r + i) for i in range(4)] for r in range(8)}
    drawn, choose, stopped_once = {}, train.Algorithm1.choose_external, []

    def recorded(peer, r):
        external, counts = choose(peer, r)
        drawn.setdefault(os.path.basename(peer.dir), []).append((r, [x.item["seq"] for x in external]))
        if os.path.basename(peer.dir) == "stopped" and r == 2 and not stopped_once:
            stopped_once.append(r)
            peer.interrupt(signal.SIGTERM, None)  # not yet stepped: round 2 is abandoned here
        return external, counts
    monkeypatch.setattr(train.Algorithm1, "choose_external", recorded)
    weights = {}
    for name, stops in (("whole", [5]), ("stopped", [9, 5])):
        for k, rounds in enumerate(stops):
            args = tiny_args(tmp_path, "--name", name, "--rounds", str(rounds), *["--resume"] * k)
            peer = train.Peer(args, log=quiet)
            peer.client = RoundClient(batches, peer.start_round)
            peer.run()
        weights[name] = _weights(peer.model)
    assert train.last_checkpoint(str(tmp_path / "run" / "stopped"))["round"] == 4
    stopped = drawn["stopped"]
    assert [r for r, _ in stopped] == [0, 1, 2, 2, 3, 4] and stopped[2] == stopped[3]  # round 2 drawn again
    assert stopped[:2] + stopped[3:] == drawn["whole"] and all(seqs for _, seqs in drawn["whole"]), drawn
    assert all(torch.equal(a, b) for a, b in zip(weights["whole"], weights["stopped"]))


def test_the_launcher_waits_for_a_peer_that_says_it_is_saving(tmp_path, monkeypatch):
    """stop_all: a child that ignores SIGTERM is killed after STOP_SECONDS (0 here), unless its folder holds
    SAVING, as a stopped peer's does while it writes its last checkpoint: that one is waited for, and given
    time to exit once it has saved."""
    monkeypatch.setattr(train, "STOP_SECONDS", 0)
    monkeypatch.setattr(train, "FLUSH_SECONDS", 60)  # (after its save, a peer's last sends: time to exit)
    (tmp_path / "saver").mkdir()
    (tmp_path / "other").mkdir()
    script = textwrap.dedent("""
        import os, signal, sys, time
        folder = sys.argv[1]
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if folder.endswith("saver"):
            open(os.path.join(folder, ".saving"), "w").close()  # saving, however long it takes
        open(os.path.join(folder, "ready"), "w").close()
        while not os.path.exists(os.path.join(folder, "release")):
            time.sleep(0.05)
        if folder.endswith("saver"):
            os.remove(os.path.join(folder, ".saving"))
    """)
    children = [(subprocess.Popen([sys.executable, "-c", script, str(tmp_path / name)]), str(tmp_path / name))
                for name in ("other", "saver")]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    (other, _), (saver, _) = children
    seen, deadline = {}, time.time() + 60

    def release():  # once the one not saving is gone: is the saving one still there? then let it finish
        while other.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        seen.update(other=other.returncode, saver=saver.poll())
        (tmp_path / "saver" / "release").touch()
    try:
        while not all((tmp_path / n / "ready").exists() for n in ("saver", "other")) and time.time() < deadline:
            time.sleep(0.05)
        assert train.SAVING == ".saving"
        threading.Thread(target=release, daemon=True).start()
        train.stop_all(children)
        assert seen == dict(other=-signal.SIGKILL, saver=None) and saver.returncode == 0  # never killed
    finally:
        (tmp_path / "saver" / "release").touch()
        for proc, _ in children:
            if proc.poll() is None:
                proc.kill()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


SLOW_ROUNDS = """
import itertools, time
import grpo, reward
_count, _calls, _step = itertools.count(), itertools.count(), grpo.step
reward.score = lambda item, text: float(next(_count) % 2)  # every round steps
def _slow(*args, **kwargs):  # round 0 at once; every later round's passes take an hour
    if next(_calls) > 0:
        time.sleep(3600)
    return _step(*args, **kwargs)
grpo.step = _slow
"""


@pytest.mark.slow
def test_ctrl_c_during_rounds_longer_than_the_grace_keeps_each_peers_last_round(tiny, tmp_path):
    """python train.py --peers 2, where every round after the first takes an hour (forced, in each process, by
    a sitecustomize the test writes): Ctrl-C stops it at once, with exit status 130, each peer's round 0
    saved and nothing half written; --resume of a peer goes on at round 1."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_ROUNDS)
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hooks), HERE]))
    cmd = [sys.executable, TRAIN, "--peers", "2", "--model", str(tiny), "--tasks", "repeat_number",
           "--generations", "4", "--max-new-tokens", "6", "--out", str(out), "--rounds", "50"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not all((out / n / "metrics.jsonl").exists() for n in ("peer0", "peer1")):
            time.sleep(0.2)
        time.sleep(1.0)  # (both are in round 1's hour now)
        proc.send_signal(signal.SIGINT)
        said = proc.communicate(timeout=train.STOP_SECONDS - 20)[0]  # before the launcher would kill
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _processes_mentioning(str(out)):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130, said[-3000:]
    for name in ("peer0", "peer1"):
        folder = out / name
        assert train.last_checkpoint(str(folder))["round"] == 0 and _rounds(folder) == [0], name
        assert not [f for f in os.listdir(folder) if f.startswith(".tmp-") or f == train.SAVING]
        assert "stopped after round 0, the last completed one, which is saved" in (folder / "log.txt").read_text()
    assert said.splitlines()[-1].endswith(" --resume")


def test_a_resume_without_a_checkpoint_keeps_the_metrics_and_a_start_removes_what_a_save_left(tiny, tmp_path,
                                                                                          monkeypatch):
    """A peer killed (kill -9, out of memory) before its first checkpoint: --resume starts again at round 0
    and keeps every row metrics.jsonl had; --plot draws each round from its newest row. A .tmp- folder (a save
    cut short), a checkpoint.json.tmp and a stale SAVING are gone at once, at a start as at a resume."""
    spread_rewards(monkeypatch)
    train.Peer(tiny_args(tmp_path, "--name", "k", "--rounds", "2", "--external", "0", "--save-every", "0"),
               log=quiet).run()
    folder = tmp_path / "run" / "k"
    shutil.rmtree(folder / "checkpoint-1")  # as if killed before its first checkpoint
    os.remove(folder / "checkpoint.json")
    before = (folder / "metrics.jsonl").read_text()
    (folder / ".tmp-a1b2").mkdir()
    (folder / ".tmp-a1b2" / "model.safetensors").write_bytes(b"0" * 4096)
    (folder / "checkpoint.json.tmp").write_text("{")
    (folder / train.SAVING).write_text("123")
    logs = []
    again = train.Peer(tiny_args(tmp_path, "--name", "k", "--rounds", "1", "--external", "0", "--resume"),
                       log=logs.append)
    assert again.start_round == 0 and (folder / "metrics.jsonl").read_text() == before
    assert sorted(os.listdir(folder)) == ["metrics.jsonl", "samples.jsonl", "settings.json"]
    assert any("no checkpoint yet" in line and "keeps" in line for line in logs)
    again.run()
    assert _rounds(folder) == [0, 1, 0]
    train.main(["--plot", str(tmp_path / "run")])
    chart = ET.fromstring((tmp_path / "run" / "reward.svg").read_text())
    dots = [c for c in chart.iter("{http://www.w3.org/2000/svg}circle") if c.get("r") == "2"]
    assert len(dots) == 2  # rounds 0 and 1, once each


# -- the flags: wire caps, answered before torch loads ---------------------------------------------------------

def test_more_completions_than_a_swarm_group_holds_is_refused_up_front(capsys):
    """--generations 100 --peers 2: the server takes at most Limits.group_completions (64) completions a group,
    so every batch would be refused and the peer would train alone without a word: refused in one sentence,
    before anything loads. In silo it is fine. The schema holds the same named caps."""
    assert swarm.Limits.group_completions == 64
    for argv in (["--generations", "100", "--peers", "2"], ["--generations", "65", "--swarm", "http://h:1"],
                 ["--local", "300", "--peers", "2"]):
        with pytest.raises(SystemExit) as e:
            train.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "a swarm may hold" in err, err
    assert train.parse_args(["--generations", "100", "--device", "cpu"]).generations == 100
    group = swarm.wire_group("repeat_number", "q", "1", ["a"] * 64, [True] * 64)
    assert swarm.WIRE(group, "g")["completions"] == ["a"] * 64
    with pytest.raises(swarm.BadRequest):
        swarm.WIRE(dict(group, completions=["a"] * 65, stopped=[True] * 65), "g")
    with pytest.raises(swarm.BadRequest):
        swarm.WIRE(dict(group, completions=["a" * (swarm.Limits.completion_chars + 1)], stopped=[True]), "g")


def test_a_wrong_flag_is_answered_before_torch_loads(tmp_path):
    """python train.py with a wrong flag: one line and exit status 2, and torch never imported (checked in the
    process that ran it, and by python -X importtime); --help, which shows this machine's defaults, may load it."""
    (tmp_path / "file").write_text("x")
    cases = [["--rounds", "0"], ["--bogus"], ["--tasks", "nope"],
             ["--generations", "100", "--peers", "2", "--device", "nope"],  # (the first wrong flag is said)
             ["--external", "2"], ["--token", "my token"], ["--resume", "--out", str(tmp_path / "empty")],
             ["--out", str(tmp_path / "file")], ["--model", "a,b"], ["--swarm", "localhost:1"]]
    script = textwrap.dedent(f"""
        import json, runpy, sys
        sys.path.insert(0, {HERE!r})  # (as python train.py puts its folder first)
        said = []
        for argv in {cases!r}:
            sys.argv = [{TRAIN!r}, *argv]
            try:
                runpy.run_path({TRAIN!r}, run_name="__main__")
            except SystemExit as e:
                said.append(e.code)
        print(json.dumps([said, "torch" in sys.modules]))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    codes, torch_loaded = json.loads(run.stdout.strip().splitlines()[-1])
    assert codes == [2] * len(cases) and not torch_loaded, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == len(cases) and all(line.startswith("train.py: ") for line in lines), lines
    timed = subprocess.run([sys.executable, "-X", "importtime", TRAIN, "--rounds", "0"], capture_output=True,
                           text=True, timeout=120, cwd=tmp_path)
    assert timed.returncode == 2 and not re.search(r"\|\s+torch$", timed.stderr, re.M)


# -- memory: what the device's defaults need --------------------------------------------------------------------

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0)


def _smollm2_size(tmp_path):
    (tmp_path / "smollm2").mkdir(exist_ok=True)
    (tmp_path / "smollm2" / "config.json").write_text(json.dumps(SMOLLM2))
    return train.model_size(str(tmp_path / "smollm2"))


def test_the_memory_check_counts_what_the_devices_defaults_need(tmp_path, monkeypatch, capsys):
    """peer_memory, from the model's config and the run's flags: a SmolLM2-135M peer with the CPU's defaults
    comes to its measured 3.2-3.3 GB peak; with a CUDA GPU's (G 8, 256 tokens, micro-batches of 8,192 tokens,
    no recomputed activations) several times that, so a 16 GB GPU holds at most one, not four; smaller
    micro-batches or --grad-checkpoint bring it down."""
    cfg, params = _smollm2_size(tmp_path)
    assert 134e6 < params < 135e6
    base = ["--model", "some/model", "--tasks", "easy", "--peers", "4"]
    cpu = train.peer_memory(cfg, params, train.parse_args(base + ["--device", "cpu"]))
    assert 3.0e9 < cpu < 3.6e9, cpu
    _fake_gpu(monkeypatch, native_bf16=False)  # a T4: float16 sampling, float32 training
    t4 = train.parse_args(base + ["--device", "cuda"])
    gpu = train.peer_memory(cfg, params, t4)
    assert gpu > 3 * cpu, (gpu, cpu)
    monkeypatch.setattr(train, "free_memory", lambda device: 16e9)
    with pytest.raises(SystemExit) as e:
        train.check_memory(t4, [(cfg, params)] * 4)
    assert "GPU memory" in str(e.value) and len(str(e.value).splitlines()) == 1
    for less in (["--micro-tokens", "2048"], ["--grad-checkpoint"]):
        assert train.peer_memory(cfg, params, train.parse_args(base + ["--device", "cuda", *less])) < gpu / 2


def test_a_peer_out_of_gpu_memory_says_so_and_what_to_change(tiny, tmp_path, monkeypatch, capsys):
    """torch.cuda.OutOfMemoryError in a peer: one sentence that names fewer --peers, --micro-tokens and
    --grad-checkpoint, and an exit status the launcher names (not 'stopped with exit code 1')."""
    def out_of_memory(self):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(train.Peer, "run", out_of_memory)
    with pytest.raises(SystemExit) as e:
        train.main(["--model", str(tiny), "--tasks", "repeat_number", "--out", str(tmp_path / "run")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.py")]
    assert e.value.code == train.OUT_OF_MEMORY != 1 and len(err) == 1
    assert "out of GPU memory" in err[0] and "--micro-tokens" in err[0] and "--grad-checkpoint" in err[0]
    said = train.why_stopped(train.OUT_OF_MEMORY)
    assert "out of GPU memory" in said and "fewer --peers" in said


# -- the launcher: each model once, the bars, its peers' logs ----------------------------------------------------

def test_the_launcher_resolves_each_model_once_however_many_peers(tiny, tmp_path, monkeypatch):
    """--peers 100 of one model: the model is found (and any notice printed) once, not a hundred times, and
    the refusal of what does not fit comes before any run folder is made."""
    calls, real = [], M.resolve
    monkeypatch.setattr(M, "resolve", lambda name, log=print: calls.append(name) or real(name, log))
    monkeypatch.setattr(train, "free_memory", lambda device: 1e6)
    monkeypatch.setattr(train, "start_peer", None)  # (nothing may start)
    with pytest.raises(SystemExit, match="try --peers|not even one peer fits"):
        train.main(["--peers", "100", "--model", str(tiny), "--out", str(tmp_path / "run")])
    assert calls == [str(tiny)] and not (tmp_path / "run").exists()


def test_ctrl_c_closes_every_bar_before_the_launcher_says_anything(tmp_path, monkeypatch, capsys):
    """Ctrl-C during a launched run: each bar is closed (redrawn whole, over the ^C the terminal echoed into
    it) before the stop is announced, so none is drawn again after the run's last line."""
    events = []

    class Bar:
        def __init__(self, *args, **kwargs):
            self.n = 0

        def set_postfix(self, numbers):
            pass

        def close(self):
            events.append("closed")

    class Interrupted:
        returncode = None

        def poll(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(train, "tqdm", Bar)
    monkeypatch.setattr(train, "check_memory", lambda *args: None)
    monkeypatch.setattr(train, "start_peer", lambda *args: Interrupted())
    monkeypatch.setattr(train, "stop_all", lambda children: events.append("stop_all"))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    argv = ["--peers", "2", "--model", str(tiny_folder(tmp_path)), "--out", str(tmp_path / "run")]
    try:
        with pytest.raises(SystemExit) as e:
            train.launch(train.parse_args(argv), argv)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert e.value.code == 130 and events == ["closed", "closed", "stop_all"]
    out = capsys.readouterr().out
    assert out.index("stopping every peer") < out.index("go on with it")


def tiny_folder(tmp_path):
    if not (tmp_path / "tiny").exists():
        save_tiny(tmp_path / "tiny", std=None)
    return tmp_path / "tiny"


def test_a_launched_peers_log_ends_with_no_command_to_copy(tiny, tmp_path, monkeypatch, capsys):
    """A launched peer's log.txt does not end with its own internal command line (its --peers 0, its server's
    port): the launcher's last lines say how to go on. A peer started by hand still says it."""
    monkeypatch.setattr(train.Peer, "run", lambda self: False)
    argv = ["--model", str(tiny), "--tasks", "repeat_number", "--name", "p", "--out", str(tmp_path / "run")]
    monkeypatch.setenv("SAPO_LAUNCHED", "1")
    train.main(argv)
    assert "go on with it" not in capsys.readouterr().out
    monkeypatch.delenv("SAPO_LAUNCHED")
    train.main(argv[:-1] + [str(tmp_path / "run3")])
    assert "go on with it" in capsys.readouterr().out
    started = []
    monkeypatch.setattr(train.subprocess, "Popen", lambda cmd, **kw: started.append(kw["env"]))
    args = train.parse_args(["--peers", "2", "--model", str(tiny), "--out", str(tmp_path / "run2")])
    train.start_peer(args, ["--peers", "2"], 0, "http://127.0.0.1:9", [], "t")
    assert started[0]["SAPO_LAUNCHED"] == "1"


def test_a_model_that_is_not_there_announces_no_run_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in (["--model", "./nope"], ["--model", "./nope", "--peers", "2"]):
        with pytest.raises(SystemExit, match="the model folder ./nope does not exist"):
            train.main(argv + ["--tasks", "repeat_number"])
        assert "run folder" not in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


# -- a --swarm that does not answer, and the dashboard ------------------------------------------------------------

def test_a_swarm_that_does_not_answer_is_said_at_start_with_no_dashboard(tiny, tmp_path):
    """--swarm on a dead port: one line at start says the swarm does not answer and that the peer trains alone
    meanwhile, and no dashboard is claimed; a live server's line names its dashboard."""
    logs = []
    dead = f"http://127.0.0.1:{_free_port()}"
    peer = train.Peer(tiny_args(tmp_path, "--swarm", dead, "--name", "d", "--rounds", "1"), log=logs.append)
    peer.client.close()
    said = [line for line in logs if line.startswith("swarm:")]
    assert len(said) == 1 and "does not answer" in said[0] and "alone" in said[0] and "dashboard" not in said[0]
    server, url = swarm.start_server(str(tmp_path / "swarm"))
    try:
        assert train.health(url) == f"swarm: {url} answers; its dashboard: {url}/"
    finally:
        server.shutdown()


def test_the_dashboard_updates_itself_without_resetting_the_readers_scroll():
    """No <meta refresh> (a reload scrolls to the top every 5 s): a script fetches the page and swaps its body."""
    page = swarm.render_page(dict(peers={}, metrics=[], groups=0, first_seq=0, last_seq=0))
    assert 'http-equiv="refresh"' not in page and "setInterval" in page and "fetch(location.href" in page


# -- sample.py asks as training asked -------------------------------------------------------------------------------

def test_sample_asks_a_peers_model_what_its_training_asked(tmp_path, monkeypatch, capsys):
    """python sample.py RUN/peer0 "a question": the prompt is the one the peer trained with (its settings.json:
    the system prompt and a one-shot example of a task of the run), and completions are as long as its
    --max-new-tokens; a question that is one of its tasks' items is scored."""
    peer = tmp_path / "run" / "peer0"
    save_tiny(peer / "checkpoint-3", std=None)
    (peer / "checkpoint.json").write_text(json.dumps(dict(round=3, checkpoint="checkpoint-3", metrics_bytes=0)))
    (peer / "metrics.jsonl").write_text("")
    settings = dict(system_prompt="rg", one_shot=True, max_new_tokens=5, task_list=["repeat_number"])
    (peer / "settings.json").write_text(json.dumps(settings))
    asked = []
    real = sample.generate
    monkeypatch.setattr(sample, "generate", lambda model, prompts, **kw: asked.append((prompts, kw))
                        or real(model, prompts, **kw))
    item = reward.TASKS["repeat_number"].generate(random.Random(3))
    _, tok = M.load_model(str(peer))
    for target in (peer, peer / "checkpoint-3"):
        sample.main([str(target), item["question"]])
        prompts, kw = asked.pop()
        assert prompts == [reward.prompt_ids(tok, item, True, "rg")] and kw["max_new_tokens"] == 5
        out = capsys.readouterr().out
        assert len(re.findall(r"--- completion \d, reward [01]:", out)) == 4 and "system prompt (rg)" in out
    sample.main([str(peer), "a question of no task"])
    prompts, kw = asked.pop()
    expected = reward.prompt_ids(tok, {"task": "repeat_number", "question": "a question of no task"}, True, "rg")
    assert prompts == [expected] and "reward" not in capsys.readouterr().out


# -- disk ---------------------------------------------------------------------------------------------------------------

def test_the_run_says_what_its_checkpoints_take_on_disk(tmp_path):
    """One line at the start: a SmolLM2-135M checkpoint takes about 1.6 GB (float32 weights and AdamW's two
    moments), a run of 4 peers keeps one each, about 6.5 GB."""
    _, params = _smollm2_size(tmp_path)
    args = train.parse_args(["--peers", "4", "--device", "cpu", "--model", "some/model"])
    line = train.run_line(args, [params] * 4).splitlines()[-1]
    assert "a checkpoint takes about 1.6 GB" in line and "about 6.5 GB in all" in line


# -- the chart ----------------------------------------------------------------------------------------------------------

def test_the_plots_titles_fit_their_charts(tmp_path):
    """--plot's two charts: each title, centred over its plot, fits the chart's width (at 0.6 em a character,
    more than sans-serif's average), so the lower one is not cut off at the left."""
    for name, batch in (("peer0", 0.9), ("peer1", 0.8)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps(dict(round=r, local_reward=0.5, batch_reward=batch)) + "\n" for r in range(3)))
    train.plot(str(tmp_path))
    svg = "{http://www.w3.org/2000/svg}"
    chart = ET.fromstring((tmp_path / "reward.svg").read_text())
    titles = [t for t in chart.iter(svg + "text") if t.get("font-size") == "14"]
    assert len(titles) == 2
    for t in titles:
        half = 0.6 * 14 * len(t.text) / 2
        assert half <= float(t.get("x")) and float(t.get("x")) + half <= 760, t.text


# -- the README's quick loop --------------------------------------------------------------------------------------------

def test_the_readme_test_command_works_after_the_readme_install():
    """The README installs requirements.txt; its test command runs pytest: so requirements.txt names it. The
    README states no test counts, which drift."""
    with open(os.path.join(HERE, "requirements.txt")) as f:
        assert re.search(r"^pytest\b", f.read(), re.M)
    with open(os.path.join(HERE, "README.md")) as f:
        readme = f.read()
    assert "python -m pytest" in readme and not re.search(r"\b\d+ tests\b|\ball \d+\b", readme)
