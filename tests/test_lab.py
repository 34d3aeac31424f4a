import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E401,E702
# The maintainers' tests of the lab and the selection rule: the receiver's rule in one registry (train.RULES),
# the rule chosen is the rule run, and a run says which one ran; reproduce.py for a class: the lab preset,
# --seeds as a count or a list, toys built once and reused from the cache, a second run into one --out.
#
#     python -m pytest -q tests/test_lab.py

import json
import random
import re

import pytest
import torch

import model as M
import reproduce
import reward
import swarm
import train
from test_all import FakeClient, quiet, spread_rewards, tiny, tiny_args, wire_group  # noqa: F401 (a fixture)


# ---------------------------------------------------------------------------------------------------
# the selection rule


def _score_shared_only(monkeypatch):
    """Rewards that say where a group came from: a local group (its item has no sender) scores 0 on every
    completion, so its rewards are all equal; a shared one scores 1 for a completion with answer tags."""
    monkeypatch.setattr(reward, "score", lambda item, text: float(item.get("peer") == "other" and "<answer>" in text))


def _received(item_seed=0):
    """Two groups as another peer shares them: one of mixed rewards, one whose rewards are all equal (0, 0)."""
    rng = random.Random(item_seed)
    mixed = wire_group(reward.TASKS["repeat_number"].generate(rng))
    flat = wire_group(reward.TASKS["repeat_number"].generate(rng), completions=["no", "nope"])
    return [mixed, flat]


def _learn(peer):
    """One round of the peer, returning its metrics and the groups its GRPO step was given."""
    given = []
    update = peer.update
    peer.update = lambda groups: given.extend(groups) or update(groups)
    return peer.learn(0, peer.collect(0)), given


def test_the_papers_rule_drops_all_equal_shared_groups_and_never_a_local_one(tiny, tmp_path, monkeypatch):
    _score_shared_only(monkeypatch)
    peer = train.Peer(tiny_args(tmp_path, "--name", "r"), log=quiet, client=FakeClient())
    assert peer.args.rule == "paper" and peer.rule is train.RULES["paper"]
    peer.client.queue = _received()
    m, given = _learn(peer)
    external = [g for g in given if g.external]
    assert len(external) == 1 and train.informative(external[0]) and m["external_survived"] == 1
    local = [g for g in given if not g.external]
    assert len(local) == 2 and not any(map(train.informative, local))  # all-equal local groups are trained on
    assert m["frac_zero_std_local"] == 1.0 and m["frac_zero_std_batch"] == pytest.approx(2 / 3)


def test_the_rule_chosen_is_the_rule_run(tiny, tmp_path, monkeypatch):
    """keep-all keeps the shared group whose rewards are all equal, and the GRPO step is given it."""
    _score_shared_only(monkeypatch)
    peer = train.Peer(tiny_args(tmp_path, "--name", "r", "--rule", "keep-all"), log=quiet, client=FakeClient())
    peer.client.queue = _received()
    m, given = _learn(peer)
    external = [g for g in given if g.external]
    assert len(external) == 2 and sorted(map(train.informative, external)) == [False, True]
    assert m["external_used"] == 2 and m["frac_zero_std_batch"] == pytest.approx(3 / 4)
    settings = json.loads((tmp_path / "run" / "r" / "settings.json").read_text())
    assert settings["rule"] == "keep-all"


def test_a_rule_is_one_line_of_the_registry(tiny, tmp_path, monkeypatch):
    """A student's variant: one entry of train.RULES, then --rule NAME and reproduce.py's I/J+NAME run it."""
    newest = train.Rule("draw the J newest groups of the pool", draw=lambda rng, pool, J: range(len(pool))[-J:])
    monkeypatch.setitem(train.RULES, "newest", newest)
    assert reproduce.parse_configs("8/0,4/4+newest") == [(8, 0), (4, 4, "newest")]
    peer = train.Peer(tiny_args(tmp_path, "--name", "r", "--rule", "newest", "--external", "1"), log=quiet,
                      client=FakeClient())
    rng = random.Random(1)
    peer.client.queue = [wire_group(reward.TASKS["repeat_number"].generate(rng), round_=r) for r in (3, 1, 2)]
    external, _ = peer.choose_external(0)
    assert [g.item["round"] for g in external] == [3]  # the pool is in production order: 1, 2, 3


def test_a_receiver_never_trains_on_a_shared_group_its_own_model_rejects(tiny, tmp_path, monkeypatch):
    """plausible: the receiver's own surprisal per character decides; here it is forced, 2 nats for its own
    completions, 1 for the shared group of round 0 and 9 for that of round 1, so round 1's never reaches the
    GRPO step. The paper's rule, given the same groups, trains on both."""
    _score_shared_only(monkeypatch)
    forced = {None: 2.0, 0: 1.0, 1: 9.0}  # by the group's round; own groups have none
    monkeypatch.setattr(train, "surprisal", lambda peer, g: [forced[g.item.get("round")]] * len(g.texts))
    rng, trained = random.Random(0), {}
    shared = [wire_group(reward.TASKS["repeat_number"].generate(rng), round_=r) for r in (0, 1)]
    for rule in ("plausible", "paper"):
        peer = train.Peer(tiny_args(tmp_path, "--name", rule, "--rule", rule), log=quiet, client=FakeClient())
        peer.client.queue = [dict(g) for g in shared]
        m, given = _learn(peer)
        trained[rule] = sorted(g.item["round"] for g in given if g.external)
        assert m["external_survived"] == len(trained[rule]) and not peer.pool
    assert trained == {"plausible": [0], "paper": [0, 1]}


def test_a_receiver_never_trains_on_a_fragment_its_own_limit_cut(tiny, tmp_path, monkeypatch):
    """whole: of a shared group only the completions that fit the receiver's own length limit uncut reach the
    GRPO step, and a group they leave all equal is dropped whole. At a limit of 6 tokens the first group
    keeps all three (the third did not stop, but it is whole: 5 tokens), the second loses its only right
    answer (8 tokens with its stop, cut to 6) and goes; the paper's rule trains the fragment. At a limit of
    8 nothing is cut, and whole trains on exactly what the paper's rule trains on."""
    _score_shared_only(monkeypatch)
    rng, trained = random.Random(0), {}
    items = [reward.TASKS["repeat_number"].generate(rng) for _ in range(2)]
    right = [f"<answer> {x['answer']} </answer>" for x in items]
    sent = [(right[0], True), ("no", True), (right[0] + " 1 2", False)], [(right[1] + " 1 2 3 4", True), ("no", True)]
    shared = [dict(swarm.wire_group(x["task"], x["question"], x["answer"], [c for c, _ in cs], [s for _, s in cs],
                                    x["metadata"], "tiny"), peer="other", round=0, seq=k + 1)
              for k, (x, cs) in enumerate(zip(items, sent))]
    for rule, limit in (("whole", 6), ("paper", 6), ("whole", 8), ("paper", 8)):
        peer = train.Peer(tiny_args(tmp_path, "--name", f"{rule}-{limit}", "--rule", rule, "--max-new-tokens",
                                    str(limit)), log=quiet, client=FakeClient())
        peer.client.queue = [dict(g) for g in shared]
        m, given = _learn(peer)
        trained[rule, limit] = sorted((g.item["seq"], g.stopped) for g in given if g.external)
        assert m["external_survived"] == len(trained[rule, limit]) and not peer.pool
    assert trained["whole", 6] == [(1, [True, True, False])]
    assert trained["paper", 6] == [(1, [True, True, False]), (2, [False, True])]
    assert trained["whole", 8] == trained["paper", 8] == [(1, [True, True, False]), (2, [True, True])]


def test_a_receiver_never_trains_on_a_shared_failure(tiny, tmp_path, monkeypatch):
    """positive: a shared completion below its group's mean reaches the GRPO step with an advantage of 0, so
    what it says cannot move the receiver's weights: after a round whose only informative group is shared,
    the weights are the same to the bit whichever wrong answer (two known tokens) it holds. The paper's
    rule, given the same groups, trains on it: its weights differ."""
    _score_shared_only(monkeypatch)
    item = reward.TASKS["repeat_number"].generate(random.Random(0))
    right, weights = f"<answer> {item['answer']} </answer>", {}
    for rule in ("positive", "paper"):
        for wrong in ("12 13", "14 15"):
            peer = train.Peer(tiny_args(tmp_path, "--name", f"{rule}-{wrong[:2]}", "--rule", rule), log=quiet,
                              client=FakeClient())
            assert len(set(peer.tok(wrong, add_special_tokens=False)["input_ids"]) - {peer.tok.unk_token_id}) == 2
            peer.client.queue = [wire_group(item, completions=[right, wrong])]
            m, given = _learn(peer)
            assert m["stepped"] and [g.texts for g in given if g.external] == [[right, wrong]]
            weights[rule, wrong] = torch.cat([p.detach().flatten() for p in peer.model.parameters()])
    assert torch.equal(weights["positive", "12 13"], weights["positive", "14 15"])
    assert not torch.equal(weights["paper", "12 13"], weights["paper", "14 15"])


def test_a_receivers_advantages_under_positive_need_nothing_a_sender_could_forge(tiny, tmp_path):
    """positive decides from the rewards the receiver's own verifier gives the text it trains on: a group
    that claims other log-probs, token ids, tokenizer, model or sender gets the same advantages."""
    peer = train.Peer(tiny_args(tmp_path, "--name", "r", "--rule", "positive"), log=quiet, client=FakeClient())
    honest = wire_group(reward.TASKS["repeat_number"].generate(random.Random(0)), completions=["<answer>", "no",
                                                                                              "a", "b"])
    ids = [peer.tok(c, add_special_tokens=False)["input_ids"] + [peer.stop_id] for c in honest["completions"]]
    claims = [dict(model="another-model"), dict(peer="someone", round=7),
              dict(token_ids=ids, logprobs=[[0.0] * len(x) for x in ids], tokenizer=train.tokenizer_fingerprint(peer.tok)),
              dict(token_ids=ids, logprobs=[[-1e4] * len(x) for x in ids], tokenizer="vocab-another")]

    def advantages(g):
        return peer.batch([train.external_group(peer.tok, g, peer.stop_id, 6, False, quiet)])[2].tolist()

    assert advantages(honest) == pytest.approx([0.0, 0.0, 0.0, 0.0])  # rewards all equal: nothing to learn
    honest["completions"][0] = f"<answer> {honest['answer']} </answer>"
    assert advantages(honest) == pytest.approx([1.5, 0.0, 0.0, 0.0], abs=1e-3)  # one right of four: 0.75 / 0.5
    for claim in claims:
        assert advantages({**honest, **claim}) == advantages(honest), claim


@pytest.mark.parametrize("rule", ["plausible", "whole"])
def test_a_receivers_judge_needs_nothing_a_sender_could_forge(tiny, tmp_path, monkeypatch, rule):
    """plausible and whole read what the receiver trains on (the text as its own tokens, cut at its own
    limit) and, plausible, its own model: a group that claims other log-probs, token ids, tokenizer, model or
    sender gets the same surprisal and the same verdict as the honest one."""
    monkeypatch.setattr(reward, "score", lambda item, text: float("peer" in item and "<answer>" in text))
    peer = train.Peer(tiny_args(tmp_path, "--name", "r", "--rule", rule, "--shared-logprobs"), log=quiet,
                      client=FakeClient())
    peer.own = peer.sample_local(0)[0]
    honest = wire_group(reward.TASKS["repeat_number"].generate(random.Random(0)))
    ids = [peer.tok(c, add_special_tokens=False)["input_ids"] + [peer.stop_id] for c in honest["completions"]]
    ours = train.tokenizer_fingerprint(peer.tok)
    claims = [dict(model="another-model"), dict(peer="someone", round=7),
              dict(token_ids=ids, logprobs=[[0.0] * len(x) for x in ids], tokenizer=ours),  # certainty
              dict(token_ids=ids, logprobs=[[-1e4] * len(x) for x in ids], tokenizer=ours)]  # near impossible

    def judged(g):
        x = train.external_group(peer.tok, g, peer.stop_id, 6, False, quiet)
        return train.surprisal(peer, x), [g.completions for g in peer.rule.judge(peer, [x])]

    assert peer.rule is train.RULES[rule] and peer.rule.judge is not None
    for claim in claims:
        assert judged({**honest, **claim}) == judged(honest), claim


def test_a_rule_sets_its_flags_and_a_flag_given_against_it_is_one_sentence(tmp_path, capsys):
    args = train.parse_args(["--out", str(tmp_path), "--rule", "is"])
    assert args.shared_logprobs is True
    assert train.parse_args(["--out", str(tmp_path), "--rule", "is", "--shared-logprobs"]).shared_logprobs
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--out", str(tmp_path), "--rule", "is", "--no-shared-logprobs"])
    assert e.value.code == 2
    assert "--rule is sets --shared-logprobs to True" in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(SystemExit):
        train.parse_args(["--out", str(tmp_path), "--rule", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# reproduce.py for a class


def test_the_lab_preset_fits_a_class():
    s = reproduce.parse_args(["--preset", "lab"])
    assert (s.peers, s.seeds, s.rounds, s.config_list) == (4, [0, 1, 2, 3], 100, [(8, 0), (4, 4)])
    assert s.model == "toy" and s.guess == 0.3 and s.device == "cpu" and len(s.seeds) >= 3


@pytest.mark.parametrize("given, seeds", [("3", [0, 1, 2]), ("3,7,11", [3, 7, 11]), ("7,", [7]), (" 2, 5 ", [2, 5])])
def test_seeds_are_a_count_or_a_list(given, seeds):
    assert reproduce.parse_args(["--seeds", given]).seeds == seeds


@pytest.mark.parametrize("given", ["x", "0", "1,1", "-1,2", "101", ","])
def test_bad_seeds_get_one_sentence(given, capsys):
    with pytest.raises(SystemExit) as e:
        reproduce.parse_args(["--seeds", given])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--seeds" in err and "Traceback" not in err


def _count_builds(monkeypatch):
    built = []
    pretrain = reproduce.pretrain_toy
    monkeypatch.setattr(reproduce, "pretrain_toy", lambda *a, **k: built.append(k.get("seed")) or pretrain(*a, **k))
    return built


@pytest.mark.slow
def test_toys_are_built_once_and_reused_from_the_cache(tmp_path, monkeypatch):
    built = _count_builds(monkeypatch)
    flags = ["--pretrain-steps", "5", "--jobs", "1", "--toy-cache", str(tmp_path / "cache")]
    s = reproduce.parse_args(flags + ["--seeds", "3,7"])
    first, before = reproduce.build_toys(s, s.seeds, str(tmp_path / "a"), s.guess, s.known, log=quiet)
    assert sorted(built) == [3, 7] and first == {3: [str(tmp_path / "a" / "toy-model-seed3")],
                                                7: [str(tmp_path / "a" / "toy-model-seed7")]}
    again, before_again = reproduce.build_toys(s, s.seeds, str(tmp_path / "b"), s.guess, s.known, log=quiet)
    assert sorted(built) == [3, 7] and before_again == before  # nothing built the second time
    weights = [M.load_model(f[0], log=quiet)[0].state_dict() for f in (first[3], again[3])]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    reproduce.build_toys(s, s.seeds, str(tmp_path / "c"), 0.5, s.known, log=quiet)  # another --guess: other toys
    assert len(built) == 4
    monkeypatch.setattr(reproduce, "toy_code", lambda: "another-version")  # the code that builds a toy changed
    reproduce.build_toys(s, [3], str(tmp_path / "d"), s.guess, s.known, log=quiet)
    assert len(built) == 5
    names = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(names) == 5 and all(re.fullmatch(r"toy-alphabet_position-guess[\d.]+-known0.0-steps5-seed\d+-\S+", n)
                                   for n in names)


@pytest.mark.slow
def test_a_seed_list_runs_through_the_time_estimate(tmp_path):
    s = reproduce.parse_args(["--configs", "8/0,4/4", "--peers", "2", "--rounds", "10", "--jobs", "1", "--seeds",
                              "4,9", "--pretrain-steps", "5", "--toy-cache", str(tmp_path / "cache"),
                              "--out", str(tmp_path / "run")])
    models, _ = reproduce.build_toys(s, s.seeds, str(tmp_path / "run"), s.guess, s.known, log=quiet)
    assert reproduce.estimate_minutes(s, models, s.config_list, s.seeds) > 0


@pytest.mark.slow
def test_a_run_says_which_rule_ran_and_a_second_run_into_its_folder_reuses_its_toys(tmp_path, monkeypatch, capsys):
    built = _count_builds(monkeypatch)
    spread_rewards(monkeypatch)  # every peer earns some reward, whatever a toy of 5 steps says
    out = tmp_path / "lab"
    flags = ["--preset", "lab", "--configs", "8/0,4/4,4/4+keep-all", "--seeds", "2,5", "--peers", "2", "--rounds",
             "3", "--pretrain-steps", "5", "--jobs", "1", "--toy-cache", str(tmp_path / "cache"), "--out", str(out)]
    sentence = reproduce.main(flags)
    results = json.loads((out / "results.json").read_text())
    assert results["seeds"] == [2, 5] and list(results["configurations"]) == ["8/0", "4/4", "4/4+keep-all"]
    table = (out / "table.md").read_text()
    header = table.split("| I/J |")[0]
    assert "4/4, paper: " + train.RULES["paper"].what in header
    assert "4/4+keep-all, keep-all: " + train.RULES["keep-all"].what in header
    assert "seeds 2, 5" in header and "guess 0.3" in header and "5 pre-training steps" in header
    for c, rule in (("4-4", "paper"), ("4-4-keep-all", "keep-all"), ("8-0", "paper")):
        assert json.loads((out / "seed5" / c / "peer1" / "settings.json").read_text())["rule"] == rule
    for e in results["configurations"].values():
        assert 0 <= e["informative_groups_per_round"] <= 8
    assert sentence.startswith(("Sharing helped here: 4/4 ", "Sharing hurt here: 4/4 ", "No clear effect"))
    assert re.search(r"95% interval [\d.–-]+; \d of 2 seeds above 1\), training on [\d.]+ informative groups a "
                     r"round \(rewards not all equal\) to 8/0's [\d.]+\.", sentence)
    assert capsys.readouterr().out.rstrip().endswith(sentence)  # the run ends in its verdict
    assert len(built) == 2
    reproduce.main(flags)  # again, into the same --out
    assert len(built) == 2 and (out / "run-2" / "results.json").exists() and (out / "results.json").exists()
    assert (out / "table.md").read_text() == table
