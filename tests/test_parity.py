"""
reward.py's scorers against reasoning_gym's (reasoning-gym==0.1.25): for each of the paper's nine families,
N of ReasoningGym's items with the paper's config and N of ours, each scored by both scorers on its
reference answer and on near misses a model might write (near_misses below). As a script it prints
docs/rewards.md's table:

    pip install reasoning-gym==0.1.25 && python tests/test_parity.py 200
"""

import argparse
import json
import math
import os
import random
import re
import sys
from decimal import Context, Decimal, localcontext

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (run as a script)
import reward  # noqa: E402

_OTHER_DIGITS = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")  # Arabic-Indic digits, which int() and Decimal() read


def near_misses(item):
    """Answers close to the item's answer, as a model might write them: other case, spacing and
    separators, equal numbers spelled otherwise, LaTeX, partial or padded answers, and nearly right
    ones (off by one, another weekday, an unreduced fraction, a premise instead of a conclusion)."""
    a, meta = item["answer"], item["metadata"]
    out = [a.upper(), a.lower(), a.title(), a.replace(" ", "  "), a.replace(" ", ", "), a.replace(" ", ""),
           a.replace("\n", " "), a.replace("\n", "\n\n"), f"The answer is {a}", f"{a}.", f"${a}$",
           f"\\boxed{{{a}}}", a[:len(a) // 2], a + a[-1:]]
    with localcontext(Context(prec=60)):
        try:
            x = Decimal(a)
            out += [str(x + 1), str(x - 1), str(-x), f"+{a}", f"0{a}", f"{a}0" if "." in a else f"{a}.0",
                    f"{x:,}", f"{x:e}", f"{x:.2f}", f"{x:.3f}", f"{x:.4f}", str(x + Decimal("0.0004")),
                    str(x - Decimal("0.0011")), str(float(x)), f"{a} days", a.translate(_OTHER_DIGITS)]
        except ArithmeticError:  # not a number
            pass
    if a in reward._DAYS:
        out += [reward._DAYS[(reward._DAYS.index(a) + 1) % 7], a[:3], f"It was a {a}."]
    if a in ("Yes", "No"):
        out += ["No" if a == "Yes" else "Yes", "True", "Y"]
    if "simplified_numerator" in meta:
        p, q, n, d = (meta[k] for k in ("simplified_numerator", "simplified_denominator", "numerator", "denominator"))
        latex = f"\\frac{{{p}}}{{{q}}}"
        out += [f"{p}/{q}", f"{p} / {q}", latex, f"${latex}$", f"\\dfrac{{ {p} }}{{ {q} }}", latex.upper(),
                f"{latex} is it", f"{n}/{d}", f"{2 * p}/{2 * q}", f"{q}/{p}", f"-{p}/{q}", f"{p}:{q}", f"{p / q:.3f}",
                f"{p}/{q} = {p / q:.2f}", f"{p}/{d}", f"{n}/{q}", f"{p}/{q}/1"]
    if re.fullmatch(r"[0-9]+( [0-9]+)*(\n[0-9]+( [0-9]+)*)*", a):  # a grid: arc_1d, binary_matrix
        rows = [[int(v) for v in line.split()] for line in a.split("\n")]
        lines = a.split("\n")
        out += [str(rows), str(tuple(map(tuple, rows))), json.dumps(rows), "[" + "]\n [".join(lines) + "]",
                str((int(a[0]) + 1) % 10) + a[1:], "\n".join(line + " " for line in lines), "; ".join(lines),
                reward._grid(zip(*rows)), str(rows[0]) if len(rows) == 1 else str(rows[:-1])]
    if "premises" in meta:
        premises = meta["premises"]
        ascii_ = a.replace("∧", "&").replace("∨", "|").replace("→", "->").replace("↔", "<->").replace("¬", "~")
        out += [ascii_, a.replace("∧", "and"), f"({a})", f"(({a}))", f"¬({a})", f"¬{a}", "¬¬" + a, *premises,
                f"({premises[0]} ∧ {premises[-1]})", "(P ∨ ¬P)", "P", "Q", "p", "Z", "P ∧ Q", "(P → P)"]
        m = re.fullmatch(r"\((¬?[A-Z]) (.) (¬?[A-Z])\)", a)
        if m:
            out.append(f"({m[3]} {m[2]} {m[1]})")
    seen = {a, ""}
    return [v for v in (v.strip() for v in out) if not (v in seen or seen.add(v)) and "answer>" not in v]


def parity(n, seed=0):
    """Agreement between our scorers and reasoning_gym's for each of the nine families: on n of rg's
    items (its reference answer, then near_misses of it) and on n of ours (rg's scorer must give our
    reference answer 1.0, and agree with ours on near misses). Returns a dict of counts per family
    and the disagreements as (family, whose item, answer, our score, rg's score)."""
    tag = "<answer>{}</answer>".format
    rows, diffs = [], []

    def agree(ours, theirs, answers, whose):
        """How many answers our scorer (on item ours) and rg's (on item theirs) give the same score."""
        scores = [(v, reward.score(ours, tag(v)), reward.score(theirs, tag(v))) for v in answers]
        diffs.extend((ours["task"], whose, v, a, b) for v, a, b in scores if not math.isclose(a, b, abs_tol=1e-9))
        return sum(math.isclose(a, b, abs_tol=1e-9) for _, a, b in scores)

    for name in reward.PAPER_TASKS:
        rg_task = reward.get_task("rg:" + name)
        rg_rng, our_rng = random.Random(f"parity {seed} {name} rg"), random.Random(f"parity {seed} {name} ours")
        row = dict(family=name, n=n, refs=0, variants=0, variants_n=0, accepts=0, ours=0, ours_n=0)
        for _ in range(n):
            theirs = rg_task.generate(rg_rng)
            mine, misses = {**theirs, "task": name}, near_misses(theirs)
            row["refs"] += agree(mine, theirs, [theirs["answer"]], "rg's")
            row["variants"] += agree(mine, theirs, misses, "rg's")
            row["variants_n"] += len(misses)
            ours = reward.TASKS[name].generate(our_rng)
            as_rg, misses = {**ours, "task": rg_task.name}, near_misses(ours)
            row["accepts"] += reward.score(as_rg, tag(ours["answer"])) == 1.0
            row["ours"] += agree(ours, as_rg, misses, "our")
            row["ours_n"] += len(misses)
        rows.append(row)
    return rows, diffs


def print_parity(n):
    """Print parity(n) as docs/rewards.md's Markdown table, then every disagreement."""
    from importlib.metadata import version
    rows, diffs = parity(n)
    rows.append({k: "all" if k == "family" else sum(r[k] for r in rows) for k in rows[0]})
    print(f"Agreement with reasoning_gym {version('reasoning-gym')} score_answer, {n} items per family\n")
    print("| family | rg's reference answers | rg's items, near misses | rg accepts our reference answers "
          "| our items, near misses |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k]}/{r[m]} ({100 * r[k] / max(r[m], 1):.1f}%)" for k, m in
                 (("refs", "n"), ("variants", "variants_n"), ("accepts", "n"), ("ours", "ours_n"))]
        print(f"| {r['family']} | " + " | ".join(cells) + " |")
    for name, whose, v, a, b in diffs:
        print(f"differs: {name}, {whose} item: answer {v!r}: ours {a:.4g}, rg {b:.4g}")


def main(argv=None):
    p = argparse.ArgumentParser(description="reward.py's scorers against reasoning_gym's, N items per family")
    p.add_argument("n", type=int, nargs="?", default=200, metavar="N", help="items per family (default: 200)")
    args = p.parse_args(argv)
    if reward.reasoning_gym is None:
        p.error("this needs reasoning_gym: pip install reasoning-gym==0.1.25")
    if args.n < 1:
        p.error("N must be a positive number of items")
    print_parity(args.n)


@pytest.mark.skipif(reward.reasoning_gym is None, reason="reasoning_gym is not installed: "
                    "pip install reasoning-gym==0.1.25 to compare reward.py with it")
def test_reward_parity_with_reasoning_gym(capsys):
    rows, diffs = parity(10)
    assert diffs == []
    for row in rows:  # every family gets at least 8 near misses per item
        assert row["refs"] == row["accepts"] == 10 and row["variants"] == row["variants_n"] >= 80
        assert row["ours"] == row["ours_n"] >= 80
    # the command line, in this process (a subprocess would import everything again): python tests/test_parity.py N
    main(["1"])
    assert "| all | 9/9 (100.0%) |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # a usage error, not a traceback
        main(["0"])
    assert e.value.code == 2 and "positive" in capsys.readouterr().err


if __name__ == "__main__":
    main()
