"""
The reading path's budgets: each component file's one marker line, the lines a student reads above the
six of them, the six whole files, the longest function, the README; code lines over 110 characters, and
the jumps (a name used above a file's marker line but defined only below it, where a reader who stops at
the line cannot follow it). Also the one-way imports of the reading order. As a script it prints the table:

    python tests/test_budgets.py [DIR]        # DIR: another checkout (default: this one)
"""

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPONENTS = ["reward.py", "model.py", "sample.py", "grpo.py", "swarm.py", "train.py"]  # the README's order
MARKER = "# ----- Nothing below this line is needed to understand SAPO: plumbing follows. -----"
BUDGETS = dict(reading=1700, whole=5500, function=60, readme=250,  # lines: reading path, six files, a function, README
               long_lines=20, long_chars=110, jumps=10, swarm_jumps=5)  # per file, characters, six files, swarm.py


def marker_line(lines):
    """The 0-based index of the marker line (the whole file's length when it has none)."""
    return next((k for k, line in enumerate(lines) if line.strip() == MARKER), len(lines))


def line_counts(folder=ROOT):
    """Per component file: lines up to its marker (the reading path, docstrings included; the whole file
    when it has no marker), whole lines, markers, its longest function (name, lines), its code lines over
    110 characters, and its jumps."""
    rows = []
    for name in COMPONENTS:
        text = open(os.path.join(folder, name), encoding="utf-8").read()
        lines = text.splitlines()
        funcs = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        rows.append(dict(file=name, reading=marker_line(lines), whole=len(lines), markers=lines.count(MARKER),
                         longest=max(funcs, key=lambda f: f[1], default=("-", 0)), long_lines=len(long_lines(text)),
                         jumps=jumps(text)))
    return rows


def readme_lines(folder=ROOT):
    with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
        return len(f.read().splitlines())


def long_lines(text, limit=BUDGETS["long_chars"]):
    """The numbers of the code lines longer than `limit` characters: not blank, not a comment alone on its
    line, not in a docstring (of the module, a class or a function, found with ast)."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    return [k for k, line in enumerate(text.splitlines(), 1)
            if len(line) > limit and line.strip() and not line.lstrip().startswith("#") and k not in docstrings]


def _bound_in_scopes(tree):
    """{id(node): the names its function binds} for every node inside a function (its innermost one):
    a name a function binds itself (an argument, an assignment, a loop variable) is not the module's."""
    bound = {}

    def visit(node, names):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            names = names | {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]
                             if a is not None}
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        bound[id(node)] = names
        for child in ast.iter_child_nodes(node):
            visit(child, names)

    visit(tree, frozenset())
    return bound


def jumps(text):
    """The jumps of one file -> {name: line of its first use}. A jump is a name used above the marker line
    (a bare name, self.NAME or CLASS.NAME) that is defined only below it: a module-level function, class or
    constant, a method or class attribute, or an attribute a method sets on self."""
    tree, lines = ast.parse(text), text.splitlines()
    marker = marker_line(lines) + 1  # (1-based, as ast's line numbers)
    above = lambda node: node.lineno < marker  # noqa: E731
    below = lambda node: node.lineno > marker  # noqa: E731

    def targets(node):  # the names and attributes an assignment binds
        if isinstance(node, ast.Assign):
            for t in node.targets:
                yield from t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
        elif isinstance(node, ast.AnnAssign):
            yield node.target

    def names(node):  # what a module-level or class-level statement defines
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return {node.name}
        return {t.id for t in targets(node) if isinstance(t, ast.Name)}

    module_above = {n for node in tree.body if above(node) for n in names(node)}
    module_below = {n for node in tree.body if below(node) for n in names(node)} - module_above
    members = set()  # methods, class attributes and self attributes defined below the marker
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        members |= {n for item in cls.body if below(item) for n in names(item)}
    for node in ast.walk(tree):
        if hasattr(node, "lineno") and below(node):
            members |= {t.attr for t in targets(node) if isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name) and t.value.id == "self"}
    members -= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and above(n)}
    members -= {t.attr for n in ast.walk(tree) if hasattr(n, "lineno") and above(n) for t in targets(n)
                if isinstance(t, ast.Attribute)}
    bound, used = _bound_in_scopes(tree), {}
    for node in ast.walk(tree):
        if not hasattr(node, "lineno") or not above(node) or not isinstance(getattr(node, "ctx", None), ast.Load):
            continue
        if isinstance(node, ast.Name) and node.id in module_below and node.id not in bound[id(node)]:
            used.setdefault(node.id, node.lineno)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr in members \
                and (node.value.id == "self" or node.value.id in module_below):
            used.setdefault(f"{node.value.id}.{node.attr}", node.lineno)
    return dict(sorted(used.items(), key=lambda kv: kv[1]))


def print_lines(folder=ROOT):
    rows = line_counts(folder)
    print(f"| file | reading path | whole file | longest function | code lines over {BUDGETS['long_chars']} "
          "characters | jumps |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['file']} | {r['reading']} | {r['whole']} | {r['longest'][0]} ({r['longest'][1]}) | "
              f"{r['long_lines']} | {len(r['jumps'])} |")
    reading, whole = sum(r["reading"] for r in rows), sum(r["whole"] for r in rows)
    longest, most = max(r["longest"][1] for r in rows), max(r["long_lines"] for r in rows)
    print(f"| all six | {reading} (budget {BUDGETS['reading']}) | {whole} (budget {BUDGETS['whole']}) | "
          f"{longest} (budget {BUDGETS['function']}) | at most {most} a file (budget {BUDGETS['long_lines']}) | "
          f"{sum(len(r['jumps']) for r in rows)} (budget {BUDGETS['jumps']}; swarm.py {BUDGETS['swarm_jumps']}) |")
    print(f"| README.md | | {readme_lines(folder)} (budget {BUDGETS['readme']}) | | | |")
    missing = [r["file"] for r in rows if r["markers"] != 1]
    if missing:
        print(f"no single marker line in: {', '.join(missing)}")
    for r in rows:
        for name, line in r["jumps"].items():
            print(f"{r['file']}:{line}: {name} is used above the marker and defined only below it")


def test_the_reading_path_fits_its_budget():
    """Every component file has the one marker line; the six reading paths (each file up to its marker)
    add up to at most 1,700 lines, the six whole files to at most 4,550, no function is longer than 60
    lines, and the README has at most 250 (python tests/test_budgets.py)."""
    rows = line_counts()
    assert [r["file"] for r in rows if r["markers"] != 1] == []
    assert sum(r["reading"] for r in rows) <= BUDGETS["reading"]
    assert sum(r["whole"] for r in rows) <= BUDGETS["whole"]
    assert max(r["longest"][1] for r in rows) <= BUDGETS["function"], [r["longest"] for r in rows]
    assert readme_lines() <= BUDGETS["readme"]


def test_each_component_file_has_few_code_lines_over_110_characters():
    """At most 20 code lines over 110 characters in each of the six files (comments and docstrings are
    prose, not counted): a line a reader must scroll or wrap to read is rare."""
    counts = {r["file"]: r["long_lines"] for r in line_counts()}
    assert max(counts.values()) <= BUDGETS["long_lines"], "code lines over 110 characters: " + ", ".join(
        f"{name} {n}" for name, n in counts.items())


def test_few_names_are_used_above_a_marker_and_defined_only_below_it():
    """At most 10 jumps over the six files, and at most 5 in swarm.py: a reader who stops at the marker
    line meets few names defined only below it."""
    found = {r["file"]: r["jumps"] for r in line_counts()}
    counts = {name: len(j) for name, j in found.items()}
    assert sum(counts.values()) <= BUDGETS["jumps"] and counts["swarm.py"] <= BUDGETS["swarm_jumps"], (
        f"{sum(counts.values())} jumps: " + ", ".join(f"{name} {n} ({', '.join(found[name])})" for name, n in counts.items()))


def test_each_component_file_imports_only_files_before_it_in_the_reading_order():
    """No import circle: reward, model, sample, grpo, swarm, train, each importing only earlier files (sample
    model, and reward for its command line; model, grpo and swarm none of the project), inside functions too."""
    allowed = {"reward": set(), "model": set(), "sample": {"model", "reward"}, "grpo": set(), "swarm": set(),
               "train": {"reward", "model", "sample", "grpo", "swarm"}}
    for name, ok in allowed.items():
        tree = ast.parse(open(os.path.join(ROOT, name + ".py"), encoding="utf-8").read())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        assert imported & set(allowed) <= ok, (name, sorted(imported & set(allowed) - ok))


def test_swarm_store_sample_states_the_window_limits_hold():
    """Store.sample's rule, above the marker, gives the values of the Limits below it that it reads."""
    import swarm
    doc, L = " ".join(swarm.Store.sample.__doc__.split()), swarm.Limits
    assert f"window_batches ({L.window_batches})" in doc and f"window_seconds ({L.window_seconds})" in doc
    assert f"page_bytes, {L.page_bytes >> 20} MB" in doc


if __name__ == "__main__":
    print_lines(os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
