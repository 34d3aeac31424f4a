import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E401,E702
# The maintainers' tests of the silo baselines and the cost columns: 8/0+informative-norm (a loss over the
# informative groups alone), 8/0+resample (DAPO's dynamic sampling, within a cap), and what reproduce.py
# counts of what a peer sampled and trained on; the candidate rule kept for the swarm, 4/4+is-wide.
#
#     python -m pytest -q tests/test_baselines.py

import json
import math

import pytest
import torch

import grpo
import reproduce
import reward
import train
from test_all import FakeClient, quiet, spread_rewards, tiny, tiny_args  # noqa: F401 (a fixture)


def _silo(tmp_path, name, *flags, Peer=train.Peer):
    """A tiny silo peer (I = 2, G = 4, J = 0)."""
    return Peer(tiny_args(tmp_path, "--name", name, "--external", "0", *flags), log=quiet, client=FakeClient())


def _with_rewards(groups, rewards):
    """The groups with the rewards given, one list per group (a list of one value: all equal)."""
    return [train.Group(g.item, g.prompt, g.completions, g.texts, g.stopped, [r[k % len(r)] for k in
                                                                            range(len(g.completions))], g.logprobs)
            for g, r in zip(groups, rewards)]


def _steps(monkeypatch):
    """Every grpo.step call's groups, advantages and stats, as the step was given and returned them."""
    steps, real = [], grpo.step

    def step(model, opt, groups, advantages, **settings):
        steps.append((groups, advantages, real(model, opt, groups, advantages, **settings)))
        return steps[-1][2]
    monkeypatch.setattr(grpo, "step", step)
    return steps


def test_the_informative_norm_silo_is_the_plain_loss_over_its_informative_groups(tiny, tmp_path, monkeypatch):
    steps = _steps(monkeypatch)
    plain, norm = _silo(tmp_path, "plain"), _silo(tmp_path, "norm", "--rule", "informative-norm")
    assert norm.rule is train.RULES["informative-norm"] and norm.args.external == 0
    local, _ = plain.sample_local(0)
    local += plain.sample_local(0, "more", 1)[0]  # four groups: two informative, two whose rewards are all equal
    groups = _with_rewards(local, [[1.0, 0.0], [0.0], [0.0, 1.0], [1.0]])
    informative = [g for g in groups if train.informative(g)]
    assert len(informative) == 2
    norm.update(groups)
    plain.update(informative)  # the plain silo's loss, given the informative groups alone
    plain_all = _silo(tmp_path, "plain-all")
    plain_all.update(groups)
    (given, adv, stats), (given_plain, adv_plain, stats_plain), (_, _, stats_all) = steps
    assert given == given_plain and adv == adv_plain and stats == stats_plain
    # the plain silo's normaliser also counts the tokens of the groups whose rewards are all equal, which
    # scales its gradient (the norm before clipping) down by their share of the tokens
    tokens = [sum(len(c) for g in some for c in g.completions) for some in (informative, groups)]
    assert stats_all["grad_norm"] == pytest.approx(stats["grad_norm"] * tokens[0] / tokens[1], rel=1e-4)
    assert tokens[0] < tokens[1]
    assert all(p.equal(q) for p, q in zip(norm.model.parameters(), plain.model.parameters()))


def test_the_informative_norm_silo_takes_no_step_without_an_informative_group(tiny, tmp_path):
    norm = _silo(tmp_path, "norm", "--rule", "informative-norm")
    stats = norm.update(_with_rewards(norm.sample_local(0)[0], [[1.0], [0.0]]))
    assert stats["stepped"] is False


def _resampling(tmp_path, monkeypatch, target, cap, name="r"):
    """A tiny silo peer of a resampling rule with this target and cap (completions a round)."""
    rule = train.Rule("a test's resampling silo", informative_only=True, resample=(target, cap))
    monkeypatch.setitem(train.RULES, "resample-test", rule)
    return _silo(tmp_path, name, "--rule", "resample-test", Peer=reproduce.CountingPeer)


@pytest.mark.parametrize("target, cap, informative, batches", [
    (3, 64, True, 2),    # two informative groups a batch: the second batch reaches 3, and it stops
    (3, 30, False, 3),   # none informative: batches of 2 x 4 = 8 completions while they fit in 30 (8, 16, 24)
    (3, 8, False, 1),    # a cap of one batch: it never samples more
    (2, 64, True, 1),    # the first I = 2 groups are informative: nothing more
    (0, 64, False, 1),   # no target: the plain silo's one batch
])
def test_the_resampling_silo_stops_at_its_target_or_its_cap(tiny, tmp_path, monkeypatch, target, cap, informative,
                                                            batches):
    if informative:
        spread_rewards(monkeypatch)  # rewards 1, 0, 1, 0, ...: every group of 4 is informative
    else:
        monkeypatch.setattr(reward, "score", lambda item, text: 0.0)
    steps = _steps(monkeypatch)
    peer = _resampling(tmp_path, monkeypatch, target, cap)
    plain = _silo(tmp_path, "plain")
    collected = peer.collect(0)
    sampled = sum(len(g.completions) for g in collected["groups"] + collected["extra"])
    assert sampled == batches * 2 * 4 <= max(cap, 8)  # the first batch is the plain silo's, whatever the cap
    assert sampled + 8 > cap or sum(map(train.informative, collected["groups"] + collected["extra"])) >= target
    m = peer.learn(0, collected)
    assert m["completions_sampled"] == sampled  # the cost column counts what was sampled
    trained = min(target, sum(map(train.informative, collected["groups"] + collected["extra"])))
    assert m["informative_trained"] == trained
    assert len(steps) == (trained > 0) and (not steps or len(steps[0][0]) == trained)
    # the local reward is that of the first I groups: the plain silo's questions and sampling seeds
    assert [g.item["question"] for g in collected["groups"]] == [g.item["question"] for g in
                                                                  plain.sample_local(0)[0]]
    assert m["local_reward"] == train.mean([x for g in collected["groups"] for x in g.rewards])


def test_the_resampling_silo_draws_new_questions_in_every_batch(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(reward, "score", lambda item, text: 0.0)
    peer = _resampling(tmp_path, monkeypatch, 1, 32)
    collected = peer.collect(3)
    questions = [g.item["question"] for g in collected["groups"] + collected["extra"]]
    assert len(questions) == 8 and len(set(questions)) > 4  # four batches of two, from streams of their own
    again = _resampling(tmp_path, monkeypatch, 1, 32, name="again").collect(3)
    assert [g.item["question"] for g in again["groups"] + again["extra"]] == questions  # and the same each time


def test_the_silo_baselines_are_rules_of_the_registry():
    assert train.RULES["resample"].resample == (5, 512) and train.RULES["resample"].informative_only
    assert "5 groups are informative" in train.RULES["resample"].what and "512 completions" in train.RULES[
        "resample"].what
    assert reproduce.parse_configs("8/0,8/0+informative-norm,8/0+resample,4/4,8/0+positive-silo,4/4+positive-all") == [
        (8, 0), (8, 0, "informative-norm"), (8, 0, "resample"), (4, 4), (8, 0, "positive-silo"), (4, 4, "positive-all")]
    assert [name for name, rule in train.RULES.items() if rule.silo] == ["informative-norm", "resample", "positive-silo"]
    for wrong in ("8/0,4/4+resample", "8/0,4/4+informative-norm", "8/0,8/0+is", "8/0,4/4+positive-silo",
                  "8/0,8/0+positive-all"):
        with pytest.raises(ValueError, match="run in silo"):
            reproduce.parse_configs(wrong)


def _history(sampled, informative, rewards):
    """One peer's round rows as CountingPeer returns them, with what summarise reads."""
    return [dict(local_reward=r, batch_reward=r, external_used=0, informative_trained=i, completions_sampled=n,
                 stepped=i > 0) for n, i, r in zip(sampled, informative, rewards)]


def test_the_cost_columns_count_what_was_sampled():
    rounds = 4
    run = lambda sampled, informative, rewards: dict(  # noqa: E731 (two peers alike)
        peers=[_history(sampled, informative, rewards)] * 2, seconds=60.0, cpu_seconds=60.0, round_seconds=[])
    runs = {((8, 0), 0): run([64] * rounds, [1, 1, 2, 2], [0.0, 0.1, 0.2, 0.3]),
            ((8, 0, "resample"), 0): run([64, 192, 128, 64], [5, 5, 5, 5], [0.0, 0.2, 0.3, 0.4]),
            ((4, 4), 0): run([32] * rounds, [5, 5, 5, 5], [0.0, 0.3, 0.4, 0.5])}
    summary = reproduce.summarise(runs, [(8, 0), (8, 0, "resample"), (4, 4)], [0], rounds)
    resample, swarm = summary["8/0+resample"], summary["4/4"]
    assert resample["cost"]["cumulative_completions"] == [64, 256, 384, 448]
    assert resample["cost"]["completions_per_round"] == 112 and resample["cost"]["completions_per_peer"] == 448
    assert swarm["cost"]["completions_per_peer"] == 128 and summary["8/0"]["cost"]["completions_per_round"] == 64
    assert swarm["informative_groups_per_round"] == 5 and summary["8/0"]["informative_groups_per_round"] == 1.5
    assert swarm["whole"]["ratio_to_silo"]["8/0+resample"]["per_seed"] == [pytest.approx(1.2 / 0.9)]
    # the cost curve: the reward (the figure's running mean, window 1 here) against completions sampled
    assert reproduce.reward_at(swarm, 64) == 0.3 and reproduce.reward_at(swarm, 200) is None
    assert reproduce.completions_to(swarm, 0.3) == 64 and reproduce.completions_to(resample, 0.3) == 384
    table = "\n".join(reproduce.cost_md(summary) + reproduce.silos_md(summary, [0]))
    assert "| 4/4 | 32.0 | 5.00 | 128 | 0.300 | 0.500 | – | – | 64 |" in table  # 8/0 samples 256 in all
    assert "| 8/0+resample | 112.0 | 5.00 | 448 | 0.000 | 0.200 | 0.200 | 0.200 | 384 |" in table
    assert "| 4/4 | 1.33 | – | 1/1 |" in table
    svg = reproduce.cost_svg(summary)
    assert svg.startswith("<svg") and "completions a peer sampled" in svg


def test_a_swarm_peer_samples_its_i_groups_and_counts_what_it_trained(tiny, tmp_path, monkeypatch):
    spread_rewards(monkeypatch)
    peer = reproduce.CountingPeer(tiny_args(tmp_path, "--name", "s"), log=quiet, client=FakeClient())
    m = peer.learn(0, peer.collect(0))
    assert m["completions_sampled"] == 2 * 4 and m["informative_trained"] == 2 and m["external_used"] == 0
    row = json.loads((tmp_path / "run" / "s" / "metrics.jsonl").read_text())
    assert row["round"] == 0 and not {"completions_sampled", "informative_trained"} & set(row)  # beside, not in it


# ---------------------------------------------------------------------------------------------------
# the candidate rule kept for the swarm (4/4+is-wide), for the property that defines it


def test_is_wide_keeps_the_gradient_of_a_shared_token_up_to_a_ratio_of_3(tmp_path):
    """is-wide trains against the senders' log-probs, as is does; a shared token the receiver finds 2.5
    times as likely as its sender did, with a positive advantage, keeps its gradient (is's clip at 1.28
    removes it); past 3 the clip removes it under is-wide too."""
    wide, narrow = (train.parse_args(["--out", str(tmp_path), "--rule", r]) for r in ("is-wide", "is"))
    assert wide.shared_logprobs and narrow.shared_logprobs and (wide.epsilon_high, narrow.epsilon_high) == (2.0, 0.28)
    for ratio, kept in ((2.5, (True, False)), (3.5, (False, False))):
        for args, keeps in zip((wide, narrow), kept):
            logprobs = torch.zeros(1, 1, requires_grad=True)
            loss, _ = grpo.grpo_loss(logprobs, torch.full((1, 1), -math.log(ratio)), torch.ones(1), torch.ones(1, 1),
                                     epsilon=args.epsilon, epsilon_high=args.epsilon_high)
            loss.backward()
            assert (logprobs.grad.abs().item() > 0) == keeps
