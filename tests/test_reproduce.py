"""
reproduce.py: a small swarm-against-silo run and its outputs (the table, the figure, paired seeds), a
mixed swarm, the time estimate, the seeds' toys, bad flags, the statistics.
"""

import json
import math
import os
import re
import xml.etree.ElementTree as ET

import pytest
import torch

import model as M
import reproduce
from test_all import quiet


@pytest.fixture(autouse=True)
def _cpu_defaults(monkeypatch):
    """reproduce.py's CPU defaults (the toy preset) on any machine: with a CUDA GPU its default preset is
    another, and these tests check the toy's flags, messages and runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _questions(peer_dir):
    """(round, question) of every sample a peer wrote: its first two local groups of each round."""
    with open(os.path.join(peer_dir, "samples.jsonl")) as f:
        return sorted({(s["round"], s["question"]) for s in map(json.loads, f)})


@pytest.mark.slow
def test_reproduce_small_run_writes_the_table_and_figure_and_pairs_the_seeds(tmp_path, capsys):
    out = tmp_path / "run"
    sentence = reproduce.main(["--configs", "4/4,8/0,4/4+is", "--seeds", "1", "--peers", "2", "--rounds", "3",
                               "--pretrain-steps", "20", "--sample-every", "1", "--jobs", "1", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert list(results["configurations"]) == ["8/0", "4/4", "4/4+is"]  # the baseline first, whatever the order
    for entry in results["configurations"].values():
        for span in ("whole", "first_half"):
            for key in ("cumulative_local_reward", "cumulative_batch_reward", "ratio_local_reward"):
                assert len(entry[span][key]["per_seed"]) == 1
        assert 0 <= entry["rounds_without_step"] <= 1 and entry["minutes"] > 0
        assert len(entry["curve"]["mean"]) == 3
    base = results["configurations"]["8/0"]["whole"]
    assert base["ratio_local_reward"]["per_seed"] in ([1.0], [None])  # None only if 8/0 earned nothing
    assert results["configurations"]["8/0"]["external_groups_per_round"] == 0
    assert results["sentence"] == sentence and sentence in (out / "table.md").read_text()
    table = (out / "table.md").read_text()
    assert re.search(r"^\| 8/0 \|", table, re.M) and re.search(r"^\| 4/4 \|", table, re.M)
    # the table, per seed, against the paper's rule, and the cost (what its peers sampled, cost.svg beside)
    assert len(re.findall(r"^\| 4/4\+is \|", table, re.M)) == 4 and (out / "cost.svg").exists()
    corrected = results["configurations"]["4/4+is"]["whole"]
    assert corrected["ratio_to_paper_rule"]["per_seed"][0] == pytest.approx(
        corrected["cumulative_local_reward"]["per_seed"][0]
        / results["configurations"]["4/4"]["whole"]["cumulative_local_reward"]["per_seed"][0])
    assert json.loads((out / "seed0" / "4-4-is" / "peer0" / "settings.json").read_text())["shared_logprobs"]
    assert not json.loads((out / "seed0" / "4-4" / "peer0" / "settings.json").read_text())["shared_logprobs"]
    svg = ET.fromstring((out / "reward.svg").read_text())
    ns = "{http://www.w3.org/2000/svg}"
    assert len(list(svg.iter(ns + "polyline"))) == 3 and len(list(svg.iter(ns + "polygon"))) == 3
    # paired seeds: peer k of 8/0 and peer k of 4/4 were asked the same first questions every round
    for k in range(2):
        silo, shared, corrected = (_questions(out / "seed0" / c / f"peer{k}") for c in ("8-0", "4-4", "4-4-is"))
        assert len(silo) == 6 and silo == shared == corrected, k
    assert _questions(out / "seed0" / "8-0" / "peer0") != _questions(out / "seed0" / "8-0" / "peer1")
    # the asynchronous mode (--async: each peer does its whole round in turn) on the toy just built
    s = reproduce.parse_args(["--async", "--peers", "2", "--rounds", "2", "--out", str(tmp_path / "async")])
    run = reproduce.run(s, str(out / "toy-model"), (4, 4), 0, str(tmp_path / "async"))
    assert [[m["round"] for m in peer] for peer in run["peers"]] == [[0, 1], [0, 1]]
    assert _questions(tmp_path / "async" / "peer1")[:2] == _questions(out / "seed0" / "4-4" / "peer1")[:2]


def test_reproduce_each_seed_trains_on_a_toy_built_with_that_seed(tmp_path):
    """Seed s's toy is drawn and pre-trained with seed s, so the seed-to-seed spread includes the toy's own;
    seed 0's is exactly the toy a lone build with seed 0 gives."""
    s = reproduce.parse_args(["--seeds", "2", "--pretrain-steps", "5", "--jobs", "1", "--out", str(tmp_path)])
    models, before = reproduce.build_toys(s, [0, 1], str(tmp_path), s.guess, s.known, log=quiet)
    assert models == {0: [str(tmp_path / "toy-model")], 1: [str(tmp_path / "toy-model-seed1")]}
    assert all(len(b) == 1 and 0 <= b[0][0] <= 1 for b in before.values())
    alone = reproduce.build_toy(str(tmp_path / "alone"), s.guess, s.known, s.tasks, 5, log=quiet)
    weights = [M.load_model(f, log=quiet)[0].state_dict() for f in (models[0][0], alone, models[1][0])]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])


@pytest.mark.slow
def test_reproduce_mixed_swarm_measures_each_kind_against_its_own_silo(tmp_path):
    """--mixed: peers take the word-level toy and the character toy in turn; each kind's ratio is its own
    peers' cumulative local reward over the same peers' in 8/0; the external groups each kind trained on
    are counted by the sender's model and by whether the sender's log-probs were used (only +is, and only
    from a sender with the same tokenizer)."""
    out = tmp_path / "mixed"
    sentence = reproduce.main(["--mixed", "--seeds", "2", "--peers", "4", "--rounds", "3", "--pretrain-steps", "20",
                               "--jobs", "1", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    kinds = results["by_kind"]
    assert list(kinds) == ["toy", "chars"] and set(results["kinds"]) == {"toy", "chars"}
    assert results["settings"]["max_new_tokens"] == 8 and results["settings"]["configs"] == "8/0,4/4,4/4+is"
    for k, folder in enumerate(["toy-model", "toy-chars", "toy-model", "toy-chars"]):
        for seed in (0, 1):
            model = json.loads((out / f"seed{seed}" / "4-4" / f"peer{k}" / "settings.json").read_text())["model"]
            assert model == str(out / reproduce.toy_folder("", folder, seed))
    for i, kind in enumerate(kinds):
        for c in ("8/0", "4/4", "4/4+is"):
            e = kinds[kind][c]
            per_seed = [sum(json.loads(line)["local_reward"] for k in (i, i + 2)
                            for line in open(out / f"seed{seed}" / c.replace("/", "-").replace("+", "-")
                                             / f"peer{k}" / "metrics.jsonl")) for seed in (0, 1)]
            assert e["whole"]["cumulative_local_reward"]["per_seed"] == pytest.approx(per_seed)
            base = kinds[kind]["8/0"]["whole"]["cumulative_local_reward"]["per_seed"]
            assert e["whole"]["ratio_local_reward"]["per_seed"] == [v / b if b > 0 else None
                                                                    for v, b in zip(per_seed, base)]
            assert 0 <= e["external_other_model_per_round"] <= e["external_groups_per_round"]
            sender = e["external_sender_logprobs_per_round"]
            assert sender == 0 if c != "4/4+is" else sender <= e["external_groups_per_round"] - e[
                "external_other_model_per_round"] + 1e-9
            assert 0 <= e["start_reward"] <= 1 and 0 <= e["end_reward"] <= 1
    table = (out / "table.md").read_text()
    assert len(re.findall(r"^\| (toy|chars) \| (8/0|4/4|4/4\+is) \|", table, re.M)) == 6
    assert "Kind by kind, against its own silo" in sentence and "; chars peers earned" in sentence and sentence in table
    svg = ET.fromstring((out / "reward.svg").read_text())
    assert len(list(svg.iter("{http://www.w3.org/2000/svg}polyline"))) == 6  # a line per kind and configuration


def test_reproduce_time_estimate_runs_a_probe_as_the_runs_go(tmp_path):
    """The estimate runs every configuration for PROBE_ROUNDS rounds in as many workers as the runs get,
    and lays the scaled runs out on the workers in turn (no timing is asserted: only what it measures)."""
    assert reproduce.layout([3, 1, 2], 2) == 3 and reproduce.layout([3, 1, 2], 1) == 6
    assert reproduce.layout([1, 1, 1, 1, 1], 2) == 3
    s = reproduce.parse_args(["--configs", "8/0,4/4", "--peers", "2", "--rounds", "10", "--jobs", "1",
                              "--pretrain-steps", "5", "--out", str(tmp_path)])
    models, _ = reproduce.build_toys(s, [0, 1], str(tmp_path), s.guess, s.known, log=quiet)
    minutes = reproduce.estimate_minutes(s, models, s.config_list, [0, 1])
    assert math.isfinite(minutes) and minutes > 0
    for c in ("8-0", "4-4"):
        rounds = [json.loads(line)["round"] for line in open(tmp_path / "probe" / "seed0" / c / "peer1" / "metrics.jsonl")]
        assert rounds == list(range(reproduce.PROBE_ROUNDS))


@pytest.mark.parametrize("flags, says", [
    (["--configs", "4/4"], "must include 8/0"), (["--configs", "4-4,8/0"], "is not I/J"),
    (["--configs", "0/8,8/0"], "I >= 1"), (["--configs", "8/0,500/500"], "I + J <= 64"),
    (["--configs", "8/0,4/4+tis"], "a rule is one of"), (["--configs", "8/0,8/0+is"], "J > 0"),
    (["--peers", "1"], "--peers >= 2"), (["--peers", "100000"], "at most 64"), (["--guess", "0"], "--guess"),
    (["--sweep", "--preset", "gpu"], "--sweep"), (["--rounds", "x"], "invalid int"), (["--jobs", "-1"], "--jobs"),
    (["--lr", "-1"], "--lr"), (["--known", "2"], "--known"), (["--sweep", "--sweep-toys", "0.3"], "guess:known"),
    (["--sweep", "--sweep-toys", "0:0"], "0 < guess"), (["--sweep", "--sweep-peers", "2,x"], "--sweep-peers"),
    (["--mixed", "--preset", "gpu"], "--mixed builds two toys"), (["--model", "toy,nope"], "comma list of toy, chars"),
    (["--sweep", "--mixed"], "--sweep varies one toy")])
def test_reproduce_bad_flags_get_one_sentence(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        reproduce.parse_args(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert says in err and "Traceback" not in err


def test_reproduce_a_run_folder_in_use_gets_a_sub_folder(tmp_path, capsys):
    (tmp_path / "x").write_text("an earlier run")
    assert reproduce.run_folder(str(tmp_path)) == str(tmp_path / "run-2")
    assert "holds an earlier run: this one goes to" in capsys.readouterr().out
    assert (tmp_path / "x").read_text() == "an earlier run"
    with pytest.raises(SystemExit, match="cannot make the run folder"):  # a file where a folder must go
        reproduce.main(["--out", str(tmp_path / "x" / "run")])
    assert reproduce.parse_configs("8/0,4/4,4/4,8/0") == [(8, 0), (4, 4)]
    assert reproduce.parse_configs("4/4+is, 8/0,4/4,4/4+is") == [(8, 0), (4, 4, "is"), (4, 4)]
    assert [reproduce.name(c) for c in reproduce.parse_configs("8/0,2/6+is")] == ["8/0", "2/6+is"]


def test_reproduce_statistics():
    s = reproduce.mean_se([1.4, 1.5, 1.6])
    assert s["mean"] == pytest.approx(1.5) and s["se"] == pytest.approx(0.0577, abs=1e-4)
    assert s["sd"] == pytest.approx(0.1)  # the seed-to-seed spread: se * sqrt(3)
    assert s["ci95"] == pytest.approx([1.5 - 4.30 * 0.057735, 1.5 + 4.30 * 0.057735], abs=1e-3)
    assert reproduce.mean_se([2.0]) == dict(mean=2.0, se=None, ci95=None, sd=None)
    assert reproduce.mean_se([None, float("nan")])["mean"] is None
