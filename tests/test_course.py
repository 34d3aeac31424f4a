import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: E401,E702
"""
The course's exercise layer (course.py), for maintainers: verify passes, start and reset round-trip every
file byte for byte, a blank checks as "not started", a wrong attempt is graded with its mistake named
and only the student's frames, every bad input is one sentence, and release writes a repository
without history. Each test works on a copy of the files, never on this working tree.
"""

import shutil
import subprocess

import pytest

import course

ROOT = course.ROOT


def run(folder, *args):
    done = subprocess.run([sys.executable, "course.py", *args], cwd=folder, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def copy(tmp_path):
    """The six component files and course.py, copied: a working tree of their own."""
    for name in course.COMPONENTS + ["course.py"]:
        shutil.copy2(os.path.join(ROOT, name), tmp_path)
    return tmp_path


@pytest.mark.slow
def test_course_verify_passes():
    code, said = run(ROOT, "verify")
    assert code == 0 and "0 problems" in said, said


def test_course_every_exercise_resolves_and_lists_ten_or_more():
    assert len(course.EXERCISES) >= 10
    assert {ex.file for ex in course.EXERCISES} == set(course.COMPONENTS)  # each file has one at least
    for ex in course.EXERCISES:
        assert sum(points for _, points, _ in course.CASES[ex.name]) == 10 and 4 <= len(course.CASES[ex.name]) <= 6
        assert all(r.first <= r.last for r in course.regions(ex, course.read(ex.file)))
    code, said = run(ROOT, "list")
    assert code == 0 and [line.split()[0] for line in said.splitlines()] == [ex.name for ex in course.EXERCISES]


@pytest.mark.slow
def test_course_start_then_reset_gives_back_every_file_byte_for_byte(copy):
    before = {name: (copy / name).read_bytes() for name in course.COMPONENTS}
    for ex in course.EXERCISES:  # all at once: two exercises of one file are found in each other's blank
        assert run(copy, "start", ex.name)[0] == 0
    assert all((copy / name).read_bytes() != before[name] for name in course.COMPONENTS)
    imports = subprocess.run([sys.executable, "-c", "import reward, model, sample, grpo, swarm, train"], cwd=copy)
    assert imports.returncode == 0
    for ex in course.EXERCISES:
        code, said = run(copy, "check", ex.name)
        assert code == 1 and said.startswith(f"{ex.name}: not started") and "Traceback" not in said
    for ex in reversed(course.EXERCISES):
        code, said = run(copy, "reset", ex.name)
        assert code == 0 and "the solution is back" in said
    assert {name: (copy / name).read_bytes() for name in course.COMPONENTS} == before
    assert len(list((copy / ".course" / "attempts").iterdir())) == len(course.EXERCISES)


@pytest.mark.slow
def test_course_a_wrong_attempt_is_named_and_shows_only_the_students_frames(copy):
    run(copy, "start", "advantages")
    stub = course.stub_text(course.find("advantages"), "    ")
    text = (copy / "grpo.py").read_text()
    biased = ("    groups = rewards.float().split(sizes)\n"  # right, but for the std of 'group': biased
              "    if scale == 'none':\n"
              "        return torch.cat([g - g.mean() for g in groups])\n"
              "    spread = [g.std(correction=0) if scale == 'group' else rewards.float().std() for g in groups]\n"
              "    return torch.cat([(g - g.mean()) / (s + eps) for g, s in zip(groups, spread)])\n")
    (copy / "grpo.py").write_text(text.replace(stub, biased))
    code, said = run(copy, "check", "advantages")
    assert code == 1 and "this is what biased std (dividing by G, not G - 1) gives" in said
    assert "advantages: 4/10" in said
    (copy / "grpo.py").write_text(text.replace(stub, "    return helper(rewards)\n"))
    code, said = run(copy, "check", "advantages")
    assert code == 1 and "raised NameError: name 'helper' is not defined" in said and "grpo.py, line" in said
    assert "course.py" not in said and "Traceback" not in said
    assert run(copy, "hint", "advantages")[1].startswith("hint 1 of 3")


@pytest.mark.parametrize("args, says", [
    ([], "say what to do"),
    (["start", "nope"], "there is no exercise 'nope'"),
    (["check"], "check takes one exercise's name"),
    (["reset", "rope"], "rope is not started, so there is nothing to reset"),
    (["release"], "release needs a folder"),
    (["verify", "x"], "verify takes no arguments"),
])
def test_course_bad_input_is_one_sentence(copy, args, says):
    code, said = run(copy, *args)
    assert code != 0 and said.startswith("course.py: ") and says in said and len(said.strip().splitlines()) == 1


def test_course_start_twice_and_release_into_a_full_folder_are_one_sentence(copy, tmp_path):
    run(copy, "start", "rope")
    code, said = run(copy, "start", "rope")
    assert code != 0 and said.strip() == "course.py: rope is started already: check it, or reset it to begin again."
    code, said = run(ROOT, "release", str(copy))
    assert code != 0 and "exists and is not an empty folder" in said and len(said.strip().splitlines()) == 1


@pytest.mark.slow
def test_course_release_writes_a_repository_without_history_whose_blanks_are_not_started(tmp_path):
    out = tmp_path / "class"
    code, said = run(ROOT, "release", str(out), "advantages", "store_sample")
    assert code == 0, said
    log = subprocess.run(["git", "log", "--oneline"], cwd=out, capture_output=True, text=True).stdout
    assert len(log.splitlines()) == 1
    assert "RELEASED = ['advantages', 'store_sample']" in (out / "course.py").read_text()
    assert (out / "grpo.py").read_text() == course.blank(course.find("advantages"), course.read("grpo.py"))
    with open(os.path.join(ROOT, "model.py"), "rb") as f:
        assert (out / "model.py").read_bytes() == f.read()  # an exercise not chosen keeps its solution
    code, said = run(out, "check", "store_sample")
    assert code == 1 and said.startswith("store_sample: not started")
    code, said = run(out, "start", "advantages")
    assert code != 0 and "started already" in said
    code, said = run(out, "reset", "advantages")
    assert code == 0 and "the stub is back" in said  # a student copy holds no solution
