"""
The command lines as a user types them: train.py's flags and their one-sentence errors, --help, the --peers
launcher (its children, their flags, models, credentials, memory check), Ctrl-C and a peer that dies,
what the end of a run prints and delivers; and sample.py's.
"""

import json
import os
import random
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest
import requests
import torch

import model as M
import reproduce
import reward
import sample
import swarm
import train
from conftest import ROOT, _SW_SCRIPT, _processes_mentioning
from test_all import (FakeClient, _fake_gpu, _free_port, _sw_group, _sw_post, _sw_read_all, quiet, save_tiny,
                      save_tiny_chars, spread_rewards, tiny_args)


@pytest.mark.slow
def test_sample_cli_prints_completions_and_rewards_of_a_task_item(tmp_path, capsys):
    """python sample.py MODEL "question": four completions of a model folder; of a task's item (made by
    --task, or a question that is one of its items), each with its reward."""
    save_tiny(tmp_path / "tiny", std=None)
    sample.main([str(tmp_path / "tiny"), "what is 2 + 2"])
    out = capsys.readouterr().out
    assert out.startswith("question: what is 2 + 2") and out.count("--- completion") == 4 and "reward" not in out
    item = reward.TASKS["repeat_number"].generate(random.Random(7))
    for argv in (["--task", "repeat_number", "--seed", "7"], [item["question"], "--task", "repeat_number"]):
        sample.main([str(tmp_path / "tiny"), *argv])
        out = capsys.readouterr().out
        assert f"question: {item['question']}\nanswer: {item['answer']}" in out
        assert len(re.findall(r"--- completion \d, reward [01]:", out)) == 4
    run = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), str(tmp_path / "missing"), "hi"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr and run.stderr.startswith("sample.py: ")


def test_train_help_never_prints_the_swarm_token(capsys, monkeypatch):
    monkeypatch.setenv("SWARM_TOKEN", "s3cret-token-value")
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--token" in out and "s3cret-token-value" not in out
    assert train.parse_args(["--out", "x"]).token == "s3cret-token-value"  # still the default
    assert train.parse_args(["--out", "x", "--token", "other"]).token == "other"


def test_train_the_swarm_token_is_never_written_to_disk(tiny, tmp_path, monkeypatch):
    secret = "s3cret-" + "token-value"
    monkeypatch.setenv("SWARM_TOKEN", secret)
    monkeypatch.setattr(swarm, "connect", FakeClient)
    spread_rewards(monkeypatch)
    args = tiny_args(tmp_path, "--swarm", "http://127.0.0.1:9", "--name", "t", "--rounds", "2", "--save-every", "1",
                     "--sample-every", "1")
    assert args.token == secret
    logs = []
    peer = train.Peer(args, log=logs.append)
    peer.run()
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert len(files) > 5 and not [p for p in files if secret.encode() in p.read_bytes()]
    assert secret not in json.dumps([logs, peer.client.metrics, peer.client.published])


def test_train_bad_flags_get_one_sentence(capsys):
    for bad, says in ((["--generations", "1"], "at least 2"), (["--tasks", "nope"], "Unknown task"),
                      (["--temperature", "0"], "positive"), (["--name", "a b"], "--name"),
                      (["--resume"], "--out"), (["--swarm", "localhost:1"], "URL"),
                      (["--external", "2"], "--swarm")):  # J external groups, but no swarm to take them from
        with pytest.raises(SystemExit) as e:
            train.parse_args(bad)
        assert e.value.code == 2
        assert says in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
def test_train_launcher_runs_a_swarm_and_ctrl_c_stops_it(tiny, tmp_path, capsys):
    import signal
    import time
    out = tmp_path / "swarm-run"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--peers", "2", "--model", str(tiny), "--tasks",
           "repeat_number", "--generations", "4", "--max-new-tokens", "6", "--out", str(out)]
    r = subprocess.run(cmd + ["--rounds", "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("peer0", "peer1"):
        assert [json.loads(l)["round"] for l in open(out / name / "metrics.jsonl")] == [0, 1, 2]
    assert "2 of 2 peers finished" in r.stdout
    train.main(["--plot", str(out)])  # the chart of this very folder (its swarm/metrics.jsonl: the server's rows)
    chart = ET.fromstring((out / "reward.svg").read_text())
    names = {t.text for t in chart.iter("{http://www.w3.org/2000/svg}text")}
    assert {"peer0", "peer1"} <= names and "swarm" not in names
    # what the end of the run prints: that chart, the dashboard again, and a command that trains on
    assert f"chart it: python train.py --plot {out}\nits dashboard again: python swarm.py --dir {out / 'swarm'}\n" in r.stdout
    assert r.stdout.splitlines()[-1].endswith(f"--out {out} --rounds 6 --resume")
    with pytest.raises(SystemExit):  # the same --rounds again: nothing left to do, said before any model loads
        train.parse_args(cmd[2:] + ["--rounds", "3", "--resume"])
    assert "--resume has nothing left to do" in capsys.readouterr().err
    seeds = [json.load(open(out / name / "settings.json"))["seed"] for name in ("peer0", "peer1")]
    assert seeds == [train.peer_seed(0, 0), train.peer_seed(0, 1)]
    # a long run, interrupted: every child goes
    # Ctrl-C as a terminal sends it; SIG_DFL first, since a test run started in the background (nohup,
    # cmd &) ignores SIGINT, and an ignored SIGINT is inherited, so the launcher would never see it
    proc = subprocess.Popen(cmd[:-2] + ["--out", str(out) + "-long", "--rounds", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, SWARM_TOKEN="tok-0123456789"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while time.time() < deadline and not all(os.path.exists(out.parent / "swarm-run-long" / n / "metrics.jsonl")
                                             for n in ("peer0", "peer1")):
        time.sleep(0.2)
    assert len(_processes_mentioning(str(out) + "-long")) >= 3  # launcher + at least the server and a peer
    assert _processes_mentioning("tok-0123456789") == []  # the token reaches the children, never a command line
    proc.send_signal(signal.SIGINT)
    said = proc.communicate(timeout=150)[0]  # each child saves its last round; stop_all kills after STOP_SECONDS
    time.sleep(0.5)
    assert _processes_mentioning(str(out) + "-long") == []
    go_on = said.splitlines()[-1]  # how to go on with it
    assert proc.returncode == 130 and "train.py --peers 2 " in go_on and go_on.endswith(" --resume")
    assert all(train.last_checkpoint(f"{out}-long/{name}") for name in ("peer0", "peer1"))  # the training kept


@pytest.mark.slow
def test_train_launcher_exits_non_zero_when_a_peer_dies(tiny, tmp_path):
    """A peer killed by signal 9 (as the kernel's OOM killer does) and one that stops: the launcher says
    why, in one sentence each, and exits non-zero."""
    import signal
    import time
    out = tmp_path / "swarm-run"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--peers", "2", "--model", str(tiny),
                             "--tasks", "repeat_number", "--generations", "4", "--max-new-tokens", "6",
                             "--out", str(out), "--rounds", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not all(os.path.exists(out / n / "metrics.jsonl") for n in ("peer0", "peer1")) and time.time() < deadline:
        time.sleep(0.2)
    for name, sig in (("peer1", signal.SIGKILL), ("peer0", signal.SIGTERM)):
        for pid in _processes_mentioning(str(out), f"\0--name\0{name}\0"):
            os.kill(pid, sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr[-2000:]
    assert "peer1 was killed by signal 9 (SIGKILL), probably out of memory; try fewer --peers" in stderr
    assert "peer0 stopped with exit code 130" in stderr and "0 of 2 peers finished" in stdout
    time.sleep(0.5)
    assert _processes_mentioning(str(out)) == []


@pytest.mark.slow
def test_train_launcher_runs_a_swarm_of_two_models_and_says_which_peer_runs_which(tmp_path, monkeypatch):
    """python train.py --peers 2 --model A,B: peer0 runs A, peer1 B, to the end; the memory check counts
    each peer's own model; the plot names each line's model; a comma list without --peers is refused."""
    save_tiny(tmp_path / "words", std=None)
    save_tiny_chars(tmp_path / "chars")
    out, models = tmp_path / "mixed-run", f"{tmp_path / 'words'},{tmp_path / 'chars'}"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--peers", "2", "--model", models, "--tasks",
                        "repeat_number", "--generations", "4", "--max-new-tokens", "6", "--out", str(out),
                        "--rounds", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "2 of 2 peers finished" in r.stdout, r.stderr[-2000:]
    for name, model in (("peer0", "words"), ("peer1", "chars")):
        assert json.load(open(out / name / "settings.json"))["model"] == str(tmp_path / model)
        assert [json.loads(line)["round"] for line in open(out / name / "metrics.jsonl")] == [0, 1, 2]
    import shutil
    for name in ("peer0", "peer1"):  # the peers' folders alone (the server's swarm/ beside them is no peer's)
        shutil.copytree(out / name, tmp_path / "plot" / name)
    train.main(["--plot", str(tmp_path / "plot")])
    legend = [t.text for t in ET.parse(tmp_path / "plot" / "reward.svg").iter() if t.tag.endswith("text") and t.text]
    assert {"peer0 words", "peer1 chars"} <= set(legend)
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--model", models])
    assert e.value.code == 2
    argv = ["--peers", "4", "--model", models, "--out", str(tmp_path / "too-many")]
    args = train.parse_args(argv)
    sizes = {m: train.model_size(str(tmp_path / m)) for m in ("words", "chars")}
    need = {m: train.peer_memory(*size, args) for m, size in sizes.items()}
    assert len(set(need.values())) == 2
    free = 2 * need["words"] + need["chars"]
    monkeypatch.setattr(train, "free_memory", lambda device: free)  # room for words, chars, words: not a 2nd chars
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert "4 peers need about" in str(e.value) and "try --peers 3." in str(e.value) and "up to " in str(e.value)
    train.check_memory(args, [sizes[m] for m in ("words", "chars", "words")])


def test_train_launcher_gives_each_peer_its_model_in_turn_and_one_task_mix(monkeypatch):
    """--model A,B with --peers 3: peer0 A, peer1 B, peer2 A, each as its own --model; --tasks auto is
    resolved once by the launcher (the easy mix when the default model is among them), so peers of
    different models draw the same task families and can use each other's groups."""
    started = []
    monkeypatch.setattr(train.subprocess, "Popen", lambda cmd, **kw: started.append(cmd))
    for models, mix in ((f"{M.DEFAULT_MODEL},some/model", "easy"), ("some/model,other/model", "paper")):
        argv = ["--model", models, "--peers", "3", "--device", "cpu"]
        args = train.parse_args(argv + ["--out", "/tmp/launched"])
        children = []
        for k in range(3):
            train.start_peer(args, argv, k, "http://127.0.0.1:9", [])
            children.append(train.parse_args(started.pop()[3:]))
        assert [c.model for c in children] == [models.split(",")[k % 2] for k in range(3)]
        assert all(c.task_list == reward.task_names(mix) for c in children), models
    one = train.parse_args(["--model", "some/model", "--peers", "2", "--device", "cpu", "--out", "/tmp/launched"])
    train.start_peer(one, ["--model", "some/model", "--peers", "2"], 1, "http://127.0.0.1:9", [])
    assert train.parse_args(started.pop()[3:]).tasks == "auto"  # one model: the peer resolves it itself


def test_train_device_is_resolved_once_and_anything_but_cuda_gets_the_small_defaults(monkeypatch, capsys):
    """--device, declared once, becomes a torch.device; a CPU and any device but a CUDA GPU (mps) get the
    smaller defaults; --dtype defaults to what this machine would pick, and --help says which."""
    assert re.findall(r'"--device"', open(os.path.join(ROOT, "train.py")).read()) == ['"--device"']
    small = lambda a: (a.local, a.external, a.generations, a.max_new_tokens, a.micro_tokens, a.grad_checkpoint)  # noqa
    cpu = train.parse_args(["--model", "some/model", "--device", "cpu", "--swarm", "http://h:1"])
    mps = train.parse_args(["--model", "some/model", "--device", "mps", "--swarm", "http://h:1"])
    assert mps.device == torch.device("mps") and small(mps) == small(cpu) == (2, 2, 4, 64, 1024, True)
    assert (cpu.dtype, mps.dtype) == ("float32", "float32")
    assert train.parse_args(["--device", "cpu", "--dtype", "bfloat16"]).dtype == "bfloat16"  # still overrides
    for native_bf16, dtype in ((True, "bfloat16"), (False, "float16")):
        _fake_gpu(monkeypatch, native_bf16)
        gpu = train.parse_args(["--model", "some/model", "--device", "cuda", "--swarm", "http://h:1"])
        assert gpu.device == torch.device("cuda") and small(gpu) == (4, 4, 8, 256, 8192, False) and gpu.dtype == dtype
        with pytest.raises(SystemExit):
            train.parse_args(["--help", "--device", "cuda"])
        assert re.search(r"--dtype \{[a-z0-9,]+\}.*\(default: " + dtype + r"\)", " ".join(capsys.readouterr().out.split()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, says in [(["--device", "bogus"], "must be a device such as cuda, cuda:1, cpu or mps, not 'bogus'"),
                       (["--device", "cuda:1"], "--device cuda:1 was asked for, but torch sees no CUDA GPU")]:
        with pytest.raises(SystemExit) as e:
            train.parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and says in err[-1] and "Traceback" not in "".join(err), argv


def test_train_default_names_are_unique_and_logged(tiny, tmp_path, capsys):
    import socket
    logs, nobody = [], ["--swarm", f"http://127.0.0.1:{_free_port()}"]  # (its name matters in a swarm only)
    a = train.Peer(tiny_args(tmp_path, *nobody), log=logs.append)
    b = train.Peer(tiny_args(tmp_path, *nobody), log=logs.append)
    a.client.close()
    b.client.close()
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:57]
    assert a.name != b.name and a.name.startswith(host + "-") and b.name.startswith(host + "-")
    assert any(a.name in line for line in logs) and any(b.name in line for line in logs)
    with pytest.raises(SystemExit):  # two peers in --out: which one?
        train.Peer(tiny_args(tmp_path, "--resume"), log=quiet)
    assert "pass --name to say which one to resume" in capsys.readouterr().err


def test_train_cpu_defaults_save_memory_and_the_launcher_refuses_what_does_not_fit(tiny, tmp_path, monkeypatch, capsys):
    args = train.parse_args(["--model", str(tiny), "--device", "cpu"])
    assert args.grad_checkpoint is True and args.micro_tokens == 1024
    ours, _ = M.load_model(str(tiny))
    params = sum(p.numel() for p in ours.parameters())
    assert train.count_params(str(tiny)) == params
    argv = ["--peers", "4", "--model", str(tiny), "--out", str(tmp_path / "run")]
    need = train.peer_memory(*train.model_size(str(tiny)), train.parse_args(argv))
    monkeypatch.setattr(train, "free_memory", lambda device: 2.5 * need)
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert "try --peers 2." in str(e.value) and len(str(e.value).splitlines()) == 1
    assert not (tmp_path / "run").exists()  # refused before anything started
    assert "out of memory" in train.why_stopped(-9) and "fewer --peers" in train.why_stopped(-9)


def test_train_launcher_passes_its_flags_through_to_its_peers(monkeypatch):
    """A launched peer gets the launcher's own flags, then its name, seed, the server and the run folder:
    read on the same machine they give the same settings, and the token travels in its environment."""
    started = []
    monkeypatch.setattr(train.subprocess, "Popen", lambda cmd, **kw: started.append((cmd, kw["env"])))
    for extra in (["--no-one-shot", "--token", "tok", "--lr", "3e-6"], ["--external", "0", "--token=tok"]):
        argv = ["--model", "some/model", "--tasks", "repeat_number", "--peers", "2", "--device", "cpu", *extra]
        args = train.parse_args(argv + ["--out", "/tmp/launched"])
        train.start_peer(args, argv, 1, "http://127.0.0.1:9", [])
        cmd, env = started.pop()
        child = train.parse_args(cmd[3:])
        assert "tok" not in " ".join(cmd) and env["SWARM_TOKEN"] == "tok"
        assert (child.peers, child.swarm, child.name, child.seed) == (0, "http://127.0.0.1:9", "peer1", train.peer_seed(0, 1))
        same = lambda a: {k: v for k, v in vars(a).items() if k not in ("peers", "swarm", "name", "seed", "quiet", "token")}
        assert same(child) == same(args) and child.quiet


def test_train_launcher_gives_each_peer_a_credential_of_its_own(tmp_path, monkeypatch):
    """train.py --peers N starts its server with one credential per peer, each in that peer's SWARM_TOKEN:
    peer k's token writes as peer k only (403 as another), and reads need none (the dashboard)."""
    monkeypatch.setattr(train, "check_memory", lambda *args: None)
    monkeypatch.setattr(train, "model_size", lambda folder: (None, 0))
    monkeypatch.setattr(train.M, "resolve", lambda name: name)
    seen, real_start_peer = {}, train.start_peer

    class Finished:
        returncode = 0

        def poll(self):
            return 0

    def start_peer(args, argv, k, url, children, token):
        headers = {"Authorization": f"Bearer {token}"}
        seen[k] = (token, _sw_post(url, f"peer{k}", 0, [_sw_group(k)], headers=headers).status_code,
                   _sw_post(url, f"peer{1 - k}", 1, [_sw_group(k)], headers=headers).status_code,
                   requests.get(url + "/health", timeout=5).status_code)
        return Finished()

    monkeypatch.setattr(train, "start_peer", start_peer)
    argv = ["--peers", "2", "--model", "some/model", "--device", "cpu", "--out", str(tmp_path / "run")]
    args = train.parse_args(argv)
    train.launch(args, argv)
    assert seen[0][1:] == seen[1][1:] == (200, 403, 200) and seen[0][0] != seen[1][0]
    started = []
    monkeypatch.setattr(train.subprocess, "Popen", lambda cmd, **kw: started.append(kw["env"]))
    real_start_peer(args, argv, 1, "http://127.0.0.1:9", [], "peer1-token")
    assert started[0]["SWARM_TOKEN"] == "peer1-token"


def test_train_help_shows_each_default_once_and_every_flag_has_help(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "(default: None)" not in out and "(default: False)" not in out
    flat = " ".join(out.split())
    assert all(flat.count(f"--{k} ") >= 1 for k in ("name", "dtype", "out", "loss-type"))
    assert re.search(r"--generations GENERATIONS G: completions per question, compared by GRPO \(default: 4\)", flat)
    for action in train.parser(torch.device("cpu"), 2, 2)._actions:
        assert action.help, action.dest
        text = " ".join(train.Help("x")._get_help_string(action).split())
        assert text.count("default:") <= 1, text
    run = subprocess.run([sys.executable, _SW_SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    flat = " ".join(run.stdout.split())
    assert "(default: swarm_data)" in flat and "(default: 127.0.0.1)" in flat and "(default: 8000)" in flat


@pytest.mark.slow
def test_train_bad_flags_are_one_sentence_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """Flags a newcomer gets wrong: one sentence from parse_args (so before any model is read), exit 2."""
    (tmp_path / "file").write_text("x")
    monkeypatch.delenv("SWARM_TOKEN", raising=False)
    cases = [(["--out", str(tmp_path / "file")], "is a file, not a folder"),
             (["--out", str(tmp_path / "file" / "run")], "is a file, not a folder"),
             (["--token", "my token"], "printable ASCII characters without spaces"),
             (["--resume", "--out", str(tmp_path / "empty")], "nothing to resume")]
    for argv, says in cases:
        with pytest.raises(SystemExit) as e:
            train.parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and says in err[-1] and "Traceback" not in "".join(err), argv
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as a folder of another user's would be
    with pytest.raises(SystemExit):
        train.parse_args(["--out", str(tmp_path / "theirs" / "run")])
    assert f"cannot write in {tmp_path}" in capsys.readouterr().err
    monkeypatch.undo()
    run = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model", str(tmp_path / "no-model"),
                          "--token", "my token"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr and run.stdout == ""
    assert run.stderr.strip().splitlines()[-1].startswith("train.py: the swarm token must be")


def test_train_resume_says_which_command_resumes_a_folder(tmp_path, capsys):
    """--resume on a swarm launched with --peers 2, without --peers, names the command that resumes it;
    a folder with one peer is resumed under that peer's name."""
    for name in ("peer0", "peer1"):
        (tmp_path / "swarm-run" / name).mkdir(parents=True)
        (tmp_path / "swarm-run" / name / "settings.json").write_text("{}")
    (tmp_path / "swarm-run" / "swarm").mkdir()
    for argv in (["--resume"], ["--resume", "--peers", "3"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv + ["--out", str(tmp_path / "swarm-run")])
        assert f"python train.py --peers 2 --resume --out {tmp_path / 'swarm-run'}" in capsys.readouterr().err
    assert train.parse_args(["--resume", "--peers", "2", "--out", str(tmp_path / "swarm-run")]).name is None
    (tmp_path / "alone" / "alice").mkdir(parents=True)
    (tmp_path / "alone" / "alice" / "settings.json").write_text("{}")
    assert train.parse_args(["--resume", "--out", str(tmp_path / "alone")]).name == "alice"
    with pytest.raises(SystemExit):
        train.parse_args(["--resume", "--peers", "2", "--out", str(tmp_path / "alone")])
    assert "resume it without --peers" in capsys.readouterr().err


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_train_ctrl_c_keeps_the_training_and_resume_goes_on_at_the_next_round(tiny, tmp_path, sig):
    """Ctrl-C (or the launcher's SIGTERM) to a peer: it ends its round or abandons it, saves the last
    completed round, says how to chart and resume the run; --resume starts at the round after it."""
    import signal
    out = tmp_path / "run"
    argv = ["--model", str(tiny), "--tasks", "repeat_number", "--generations", "4", "--max-new-tokens", "6",
            "--name", "p", "--quiet", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *argv, "--rounds", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(out / "p" / "metrics.jsonl")
                                          and len(open(out / "p" / "metrics.jsonl").readlines()) >= 2):
        time.sleep(0.2)
    proc.send_signal(getattr(signal, sig))
    said = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130 and "Traceback" not in said, said[-2000:]
    rounds = [json.loads(line)["round"] for line in open(out / "p" / "metrics.jsonl")]
    saved = train.last_checkpoint(str(out / "p"))["round"]
    assert len(rounds) >= 2 and rounds == list(range(saved + 1))  # the last completed round is saved
    assert json.loads(open(out / "p" / "samples.jsonl").readline())["round"] == 0  # what it said, from round 0
    assert f"python train.py --plot {out}" in said and "--resume" in said.splitlines()[-1]
    again = train.Peer(train.parse_args(argv + ["--rounds", str(saved + 2), "--resume"]), log=quiet)
    assert again.start_round == saved + 1
    assert again.run() is False
    assert [json.loads(line)["round"] for line in open(out / "p" / "metrics.jsonl")] == list(range(saved + 2))



# -- the newcomer's run: the end of a run, what it prints, what it keeps; a resume that equals no stop --
def test_train_a_finished_run_says_how_to_go_on_and_resume_says_when_nothing_is_left(tmp_path, capsys):
    """After a finished run the printed command trains on (twice its --rounds; a stopped run's keeps them);
    --resume of a run whose peers all saved their last round says so in one sentence, before any model
    loads, for one peer and for a launched swarm; with one peer behind, or a larger --rounds, it goes on."""
    def saved(folder, round_):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "settings.json").write_text("{}")
        (folder / "checkpoint.json").write_text(json.dumps(dict(round=round_, checkpoint=f"checkpoint-{round_}",
                                                                metrics_bytes=0)))
    saved(tmp_path / "alone" / "alice", 2)
    for k in range(2):
        saved(tmp_path / "swarm-run" / f"peer{k}", 2)
    (tmp_path / "swarm-run" / "swarm").mkdir()
    for argv in (["--out", str(tmp_path / "alone")], ["--peers", "2", "--out", str(tmp_path / "swarm-run")]):
        with pytest.raises(SystemExit) as e:
            train.parse_args(argv + ["--rounds", "3", "--resume"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert "has done its --rounds 3: --resume has nothing left to do; pass a larger --rounds" in err
        assert train.parse_args(argv + ["--rounds", "4", "--resume"]).rounds == 4
    saved(tmp_path / "swarm-run" / "peer1", 1)  # one peer stopped a round early: it has a round to go
    assert train.parse_args(["--peers", "2", "--out", str(tmp_path / "swarm-run"), "--rounds", "3", "--resume"])
    argv = ["--rounds", "3", "--out", str(tmp_path / "new")]
    args = train.parse_args(argv)
    go_on = f"go on with it: python train.py --out {tmp_path / 'new'} --rounds 6 --resume"
    assert train.next_steps(args, argv, stopped=False).splitlines()[-1] == go_on
    assert train.next_steps(args, argv, stopped=True).splitlines()[-1].endswith("--rounds 3 --out "
                                                                                f"{tmp_path / 'new'} --resume")
    assert "swarm.py" not in train.next_steps(args, argv, stopped=False)  # a launched swarm's only


@pytest.mark.slow
def test_train_the_end_of_a_run_delivers_what_is_queued_or_says_in_one_line_what_was_not(tiny, tmp_path,
                                                                                       monkeypatch, capsys):
    """Against a server taking 0.6 s a POST, the end of a run waits (bounded) for its last rounds' batches
    and metrics, and all arrive; with no server listening, one line says how many were not delivered, and why."""
    real = swarm.SwarmServer._route

    def slow(self, method, *args):
        if method == "POST":
            time.sleep(0.6)
        return real(self, method, *args)
    monkeypatch.setattr(swarm.SwarmServer, "_route", slow)
    monkeypatch.setattr(train, "FLUSH_SECONDS", 120, raising=False)  # (a loaded machine: the bound is not tested)
    server, url = swarm.start_server(str(tmp_path / "swarm"))
    try:
        train.Peer(tiny_args(tmp_path, "--swarm", url, "--name", "s", "--rounds", "6", "--external", "0"), log=quiet).run()
        assert sorted(g["round"] for g in _sw_read_all(url)) == [r for r in range(6) for _ in range(2)]
        assert sorted(row["round"] for row in server.store.snapshot(metrics=True)["metrics"]) == list(range(6))
    finally:
        server.shutdown()
    assert "not delivered" not in capsys.readouterr().err
    monkeypatch.setattr(train, "FLUSH_SECONDS", 0.5, raising=False)
    nobody = f"http://127.0.0.1:{_free_port()}"
    train.Peer(tiny_args(tmp_path, "--swarm", nobody, "--name", "a", "--rounds", "2", "--external", "0"), log=quiet).run()
    said = [line for line in capsys.readouterr().err.splitlines() if "not delivered" in line]
    assert len(said) == 1 and re.fullmatch(r"swarm client a: 2 batches and 2 metrics rows were not delivered: "
                                           r"server unreachable \(.*refused.*\)", said[0]), said


def test_train_a_model_folder_that_does_not_exist_is_one_sentence_and_leaves_nothing(tmp_path, monkeypatch,
                                                                                     capsys):
    """--model ./my-model, a folder that is not there: the sentence says so (a name like a path is never
    taken for a Hub id), a run that cannot start makes no folder, and a peer in silo prints no swarm name."""
    monkeypatch.chdir(tmp_path)
    for name in ("./my-model", "../my-model", "/no/such/model", "~/no-such-model", "my/model/", "runs/a/p/checkpoint-9"):
        with pytest.raises(FileNotFoundError, match=f"^the model folder {re.escape(name)} does not exist"):
            M.resolve(name)
    with pytest.raises(SystemExit) as e:
        train.main(["--model", "./my-model", "--tasks", "repeat_number"])
    assert str(e.value).startswith("train.py: the model folder ./my-model does not exist, nor is it a Hub id")
    assert os.listdir(tmp_path) == [] and "name in the swarm" not in capsys.readouterr().out


def test_train_and_reproduce_bad_flags_are_one_line_that_says_where_to_look(capsys):
    for parse, prog in ((train.parse_args, "train.py"), (reproduce.parse_args, "reproduce.py")):
        for bad in [["--rounds", "0"], ["--rounds", "x"], ["--bogus"]] + [["--device", "nope"]] * (prog == "train.py"):
            with pytest.raises(SystemExit) as e:
                parse(bad)
            err = capsys.readouterr().err
            assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"{prog}: "), (bad, err)
            assert err.endswith(f"; see python {prog} --help\n") and "usage" not in err


def test_train_progress_bar_pace_is_the_runs_mean_and_help_explains_the_bar(tiny, tmp_path, monkeypatch):
    """A short round (one without a step, say) does not make the pace: the bar shows the run's mean rounds
    a minute; --help says what reward, batch, ext, pace and left mean."""
    shown = []

    class Bar:
        def __init__(self, *args, **kwargs):
            pass

        def set_postfix(self, numbers):
            shown.append(numbers)
        update = close = lambda *args: None
    monkeypatch.setattr(train, "tqdm", Bar)
    seconds, log_round = iter([6.0, 6.0, 0.1]), train.Algorithm1.log_round
    monkeypatch.setattr(train.Algorithm1, "log_round", lambda self, *args: log_round(self, *args[:-1], next(seconds)))
    train.Peer(tiny_args(tmp_path, "--name", "bar", "--rounds", "3"), log=quiet).run()
    assert [numbers["pace"] for numbers in shown] == ["10 rounds/min", "10 rounds/min", "15 rounds/min"]
    epilog = " ".join(train.parser(torch.device("cpu"), 2, 2).epilog.split())
    assert "ext, the external groups of its last round" in epilog and "pace, its mean rounds a minute" in epilog


def test_train_launcher_passes_the_reward_to_its_dashboard(tiny, tmp_path, monkeypatch):
    got = {}

    def start_server(folder, **kwargs):
        got.update(kwargs)
        raise OSError("no server in this test")
    monkeypatch.setattr(swarm, "start_server", start_server)
    with pytest.raises(SystemExit, match="no server in this test"):
        train.main(["--peers", "2", "--model", str(tiny), "--out", str(tmp_path / "run")])
    assert got["score"] is reward.score  # (python swarm.py alone judges no content: it shows no rewards)


def test_bench_peer_memory_measures_a_whole_peer_against_the_count_train_py_checks(tmp_path):
    """python bench.py --peer-memory: each --local is a peer in a process of its own that trains 3 rounds, every one
    a step (coin-flip rewards), and its row holds the bytes measured beside train.peer_memory's count for the
    same settings. A model that is neither a shape nor a folder, or flags that do not split, is one sentence."""
    save_tiny(tmp_path / "tiny", std=None)
    flags = "--tasks repeat_number --max-new-tokens 16"
    cmd = [sys.executable, os.path.join(ROOT, "bench.py"), "--peer-memory", "--model", str(tmp_path / "tiny"),
           "--device", "cpu", "--local", "3", "--peer-flags", flags, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["what"], r["local"], r["steps"]) for r in rows] == [("peer memory", 3, 3)]
    for r in rows:
        args = train.parse_args(["--model", str(tmp_path / "tiny"), "--device", "cpu", "--local", str(r["local"]),
                                 "--external", "0", "--out", str(tmp_path / "x")] + flags.split())
        assert r["counted_gb"] == pytest.approx(train.peer_memory(*train.model_size(str(tmp_path / "tiny")), args) / 1e9)
        assert r["measured_gb"] > 0.1  # a process that imported torch, at the least
    for wrong, says in ((["--model", str(tmp_path / "none")], "takes a shape"),
                        (["--model", str(tmp_path / "tiny"), "--peer-flags", '--tasks "x'], "not one line of flags")):
        bad = subprocess.run(cmd[:3] + wrong, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and says in bad.stderr.strip().splitlines()[-1]
