import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E401,E702
# docs/glossary.md is written from the code by docs/glossary.py: these tests fail when it is stale, or when a
# term names a function that is gone.

import importlib.util
import re

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _glossary():
    spec = importlib.util.spec_from_file_location("glossary", os.path.join(HERE, "docs", "glossary.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_glossary_is_current():
    with open(os.path.join(HERE, "docs", "glossary.md"), encoding="utf-8") as f:
        assert f.read() == _glossary().render(), "docs/glossary.md is stale: run python docs/glossary.py"


def test_every_term_points_at_the_lines_that_define_it():
    g = _glossary()
    for _, _, refs, _ in g.TERMS + g.ALGORITHM:
        for ref in refs:
            file, name, first, last = g.span(ref)
            lines = open(os.path.join(HERE, file), encoding="utf-8").read().splitlines()[first - 1:last]
            short = name.split(".")[-1]
            assert re.match(rf"\s*(@|def {short}\b|class {short}\b|{short}\s*=)", lines[0]), (ref, lines[0])
    terms = {t for t, *_ in g.TERMS}
    assert {"I", "J", "G", "selection rule", "advantage (A)", "GRPO objective", "epsilon (ε)", "beta (β)",
            "experience sharing", "cumulative reward", "verifier, reward model (ρ)"} <= terms


def test_a_term_that_names_nothing_says_so():
    g = _glossary()
    with pytest.raises(SystemExit, match="names nothing"):
        g.span("train.py:no_such_function")
