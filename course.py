"""
Exercises for a course on SAPO with this codebase, which stays the solution: its files carry no markers.

    python course.py list                 the exercises in teaching order, and your best score of each
    python course.py start advantages     blank its code (signature and docstring stay: the specification)
    python course.py check advantages     grade it: 4 to 6 named cases, 10 points, expected against got
    python course.py hint advantages      the next of its hints
    python course.py reset advantages     keep your attempt under .course/attempts/, put the solution back

For instructors, `python course.py release OUT [NAME ...]` writes a student repository: the chosen
exercises blanked, no git history. For maintainers, `python course.py verify` (run by CI) proves that
every exercise resolves, that its blank imports and scores 0 and the solution 10, that every wrong
variant of its catalogue loses points and is named by a case, and that no blanked line is reprinted in
the prose. docs/course.md is the guide.

An exercise is an entry of EXERCISES: the file and the functions, or the statements between two of a
function's statements, that a student writes; the step of the paper they implement; minutes; three
hints; the wrong variants its cases must catch, each a small edit of the solution. Its cases are the
functions registered below with @case: properties a correct version has, on small exact inputs, each
saying what it expected, what came, and which known mistake gives what came. start, check, hint and
reset keep their state under .course/ (git-ignored). This file reads the project as text and imports
it only to grade.
"""

import ast
import datetime
import importlib
import importlib.util
import io
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
import traceback
import types
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.abspath(__file__))
STATE = os.path.join(ROOT, ".course")  # what start saved, the attempts, the best scores, the hints given
RELEASED = []  # the exercises a released student repository starts with blanked (release writes it)
STUB = 'raise NotImplementedError("course exercise {0}: not written yet")'
CASE_SECONDS = 20  # a case still running after this long is stopped: an endless loop, most likely
COMPONENTS = ["reward.py", "model.py", "sample.py", "grpo.py", "swarm.py", "train.py"]
COPY_MARK = ".course-verify-copy"  # marks verify's temporary copy, the one folder _grade-all may rewrite


@dataclass
class Exercise:
    name: str
    file: str
    spans: list     # "f" or "Class.f": the body after the docstring; (f, after, until): the statements of f
                    # between the one that starts with `after` (None: the docstring) and the one that
                    # starts with `until` (None: the end)
    step: str       # the step of the paper (arXiv 2509.08721) or of GRPO that it implements
    minutes: int    # for a student to write it from the blank (docs/course.md says how they were found)
    hints: list     # up to three, the vaguest first
    wrong: dict = field(default_factory=dict)  # a known mistake -> [(old, new), ...] within the spans, or
                                               # a body that replaces the first span
    note: str = ""  # what the code after a partial span needs from it


EXERCISES = [
    Exercise("extract_answer", "reward.py", ["extract_answer"], "the verifier reads the answer (Sec. 4.1)",
             10,
             ["Each step finds the next opening tag from a position, then the closing tag after it "
              "(str.find).",
              "Remember the text between the tags whenever both are found, and go on past the closing tag.",
              "When no closing tag follows, return what you remembered last (stripped), or None."],
             {"the first span, not the last": [("found, pos = text", "found, pos = found or text")],
              "the span not stripped": [("found.strip()", "found")],
              "no check that the text is a str": [("not isinstance(text, str)", "text is None")]},
             note="Anything but a str gives None."),
    Exercise("trust", "reward.py", ["Task.verify"], "trusting a shared question: make it again (Sec. 3)", 20,
             ["A seeded family makes the item again with from_seed; an unseeded one replays its recorded "
              "values through _Replay, in the order of the sorted metadata keys.",
              "Check the seed before you use it: exactly an int (a bool is not one), from 0 to 2**32 - 1.",
              "Compare question, answer and metadata as JSON text with sorted keys: 1, 1.0 and True differ."],
             {"only the answer compared": [('("question", "answer", "metadata")', '("answer",)')],
              "compared with ==, which takes 1.0 for 1": [("json.dumps(item[k]", "dict(v=item[k]"),
                                                          ("json.dumps(fresh[k]", "dict(v=fresh[k]")],
              "the seed's type and range not checked": [('type(meta.get("seed")) is int and ', ""),
                                                        ("< 2**32", "< 2**64")]},
             note="A seed is trusted only as what generate draws, an int from 0 to 2**32 - 1 (a bool is not "
                  "one); raising counts as a rejection (verify_item catches it)."),
    Exercise("rope", "model.py", ["rope_tables", "apply_rope"], "RoPE, the position of each token", 20,
             ["One frequency a pair, theta ** (-2i / head_dim) for i = 0 .. head_dim/2 - 1; the angle at "
              "position p is p times it (torch.outer).",
              "Hugging Face pairs x[i] with x[i + D/2], so the D/2 angles come twice: first half, then "
              "second half.",
              "rotate_half(x) puts the second half, negated, before the first; then x * cos plus "
              "rotate_half(x) * sin."],
             {"interleaved frequencies (each twice in a row)": [("torch.cat([angles, angles], dim=-1)",
                                                                 "angles.repeat_interleave(2, dim=-1)")],
              "the exponent i/D, not 2i/D": [("head_dim, 2, device", "head_dim // 2, device")],
              "rotate_half's sign flipped": [("[-x2, x1]", "[x2, -x1]")]}),
    Exercise("sample_token", "sample.py", ["sample_token"], "sampling: temperature, top-k, top-p", 25,
             ["Temperature divides the logits; top-k masks every logit below the k-th largest with -inf.",
              "For top-p, sort the probabilities and keep a token while the probability of the more likely "
              "ones before it is below top_p; scatter the renormalised kept ones back.",
              "Draw argmax(p / E), E ~ Exponential(1) from the generator; the log-prob is log p[token]."],
             {"temperature multiplied, not divided": [("float() / temperature", "float() * temperature")],
              "top-k keeping k - 1": [("logits < kth", "logits <= kth")],
              "top-p dropping the token that crosses top_p": [("cumsum(dim=-1) - sorted_p", "cumsum(-1)")],
              "top-p's kept probabilities not renormalised": [("sorted_p / sorted_p.sum(",
                                                               "sorted_p + 0 * sorted_p.sum(")],
              "argmax(p * E), which is not a draw from p": [("(probs / noise)", "(probs * noise)")]}),
    Exercise("kv_cache", "sample.py", ["prefill", "decode_step"],
             "the KV cache: prefill, then a token a step", 40,
             ["Prefill: left-pad with 0 to L, mask causal and not-a-pad (a pad query sees itself), RoPE "
              "positions counted from each prompt's own start, slots 0..L-1 of rows 0, G, 2G, ...",
              "Copy each prompt's L slots to the G - 1 rows after it (cache.unflatten(2, (P, G)) helps), and "
              "repeat the last logits and the pads G times each.",
              "Decode: the new token sits at slot t and at RoPE position t - pads; it may attend to slots "
              "from its row's first real token up to t."],
             {"the RoPE position ignoring pads (prefill)": [("(keys - pads[:, None]).clamp(min=0)",
                                                             "keys.expand(len(prompts), L)")],
              "pads attended": [("(keys >= pads[:, None, None])", "(keys >= 0 * pads[:, None, None])")],
              "not copied to the other rows": [("groups[:, :, :, 1:, :, :L] = ", "")],
              "the decode position ignoring pads": [("(t - pads)[:, None]", "(t + 0 * pads)[:, None]")],
              "slots past t attended": [(" & (keys <= t)", "")]}),
    Exercise("advantages", "grpo.py", [("group_advantages", "if min(sizes", None)],
             "GRPO's group-normalised advantage A_i (Sec. 3)", 15,
             ["Split the rewards into their groups (Tensor.split takes a list of sizes) and centre each on "
              "its own mean.",
              "GRPO divides by the unbiased std (G - 1), plus eps; a group of one has no spread: use 0.",
              "'batch' keeps each group's mean but divides by the std of all the rewards; 'none' does not."],
             {"biased std (dividing by G, not G - 1)": [("g.std() if", "g.std(correction=0) if")],
              "the batch's mean, not each group's": [("g - g.mean()", "g - r.mean()")],
              "no eps (0 / 0 is NaN)": [("(std + eps)", "std")],
              "a group of one's std is NaN": [("len(g) > 1", "len(g) > 0")],
              "each group's std for scale 'batch'": [('scale == "group"', 'scale != "none"')]},
             note="It starts from sizes (the group sizes, checked) and returns the advantages."),
    Exercise("surrogate", "grpo.py", [("grpo_loss", "A = ", "with torch.no_grad()")],
             "the clipped surrogate and k3 KL (Sec. 3), averaged", 30,
             ["ratio = exp(logprobs - old log-probs), the old ones detached (clamp the exponent at 20); the "
              "token loss is minus the smaller of ratio * A and the clipped ratio * A.",
              "The clip's range is [1 - epsilon, 1 + epsilon_high]. The dual clip bounds a token's loss by "
              "dual_clip * |A| on the rows `shared` marks; k3 = exp(d) - d - 1 with d = ref - logprobs.",
              "Average with the mask: token_mean over the masked tokens, seq_mean per row then over rows, "
              "constant over B * max_tokens (T when max_tokens is None)."],
             {"a symmetric clip (1 + epsilon on both sides)": [("1 + epsilon_high", "1 + epsilon")],
              "the clipped term alone, no min": [("-torch.min(ratio * A, ", "-(0 * A + ")],
              "old log-probs left attached to the graph": [("old_logprobs.detach()", "old_logprobs")],
              "token mean over B·T": [("/ n_tokens", "/ M.numel()")],
              "Dr. GRPO over T, not max_tokens": [("max_tokens is not None", "False")],
              "k3's sign (logprobs - ref)": [("ref_logprobs.detach() - logprobs",
                                              "logprobs - ref_logprobs.detach()")],
              "the dual clip on every row": [("shared is None", "True")]},
             note="The code after it reads ratio, kl (None without ref_logprobs), n_tokens (the masked "
                  "tokens, at least 1) and loss."),
    Exercise("store_sample", "swarm.py", ["Store.sample"], "the swarm's sampled read: every writer alike", 30,
             ["Expire the silent writers first (self._expire); the first n places of self.drawable hold the "
              "writers that still have groups to draw.",
              "Each draw: a writer uniformly among the first n, then one of its window groups (its newest "
              "window_batches batches), taken out so that it is not drawn twice.",
              "A writer drawn dry swaps places with the last of the first n (remember the swap in a dict), "
              "and n shrinks; the reader's own groups are never in its window."],
             {"a draw uniform over groups, not writers": "".join([
                 "rng, pool = random.Random(seed), []\n",
                 "with self.lock:\n",
                 "    for writer in list(self.drawable):\n",
                 "        newest = list(self.batches[writer])[-self.window_batches:]\n",
                 "        pool += [t for b in newest for t in b.texts] if writer != exclude else []\n",
                 "    return rng.sample(pool, min(k, len(pool))), self.last_seq\n"]),
              "drawn with replacement": [("left[writer].pop(rng", "left[writer].__getitem__(rng")],
              "the reader's own groups drawn": [("if writer == exclude", "if writer == None")],
              "every kept batch, not the window": [("min(len(kept), self.window_batches)", "len(kept)")],
              "no expiry of silent writers": [("self._expire(time.time()", "self._expire(0 * time.time()")]}),
    Exercise("external_group", "train.py", [("external_group", None, "prompt = reward.prompt_ids")],
             "receiving a shared group: verify, re-tokenise, re-score", 25,
             ["Drop what is not text or does not verify (reward.verify_item, the receiver's tasks), and a "
              "question holding a special token's text (tokenizer.added_tokens_decoder); log why.",
              "Re-tokenise each completion with retokenise, which also cuts it at max_new_tokens.",
              "Score the re-tokenised texts with reward.score, one reward each. Whether a group whose "
              "rewards are all equal is worth keeping is the selection rule's question, not this one's."],
             {"the sender's ground truth trusted (no verify_item)": [("not reward.verify_item(g, tasks)",
                                                                      "False")],
              "any task, not the receiver's": [("verify_item(g, tasks)", "verify_item(g)")],
              "the sender's text scored, not the re-tokenised one": [("for text in texts]",
                                                                      "for text in g['completions']]")],
              "special tokens in the question let through": [("t.special and t.content",
                                                              "False and t.content")]},
             note="The code after it reads ids, texts, stopped and rewards (one per completion); a group "
                  "whose rewards are all equal still returns its Group."),
    Exercise("selection_rule", "train.py", ["informative", "draw_uniform"],
             "the paper's selection rule: informative groups, J drawn uniformly", 10,
             ["GRPO's advantage is a reward minus its group's mean: when every reward of a group is the "
              "same, every advantage is 0 and the group teaches nothing.",
              "A set of the rewards tells whether they differ. A group of one completion never does.",
              "The draw is J distinct indices of range(len(pool)), all of them when the pool holds fewer; "
              "random.Random.sample draws without replacement, and only the rng given may move."],
             {"groups with all-equal rewards kept": [("rewards)) > 1", "rewards)) > 0")],
              "only groups with a success kept": [("len(set(group.rewards)) > 1", "max(group.rewards) > 0")],
              "J even when the pool holds fewer": [("min(J, len(pool))", "J")],
              "drawn with replacement": [("rng.sample(range(len(pool)), min(J, len(pool)))",
                                          "[rng.randrange(len(pool)) for _ in range(min(J, len(pool)))]")],
              "the first J, not a uniform draw": [("rng.sample(range(len(pool)), min(J, len(pool)))",
                                                   "list(range(min(J, len(pool))))")],
              "the global random module, not rng": [("rng.sample(", "random.sample(")]},
             note="informative takes a Group (its rewards: one per completion) and returns a bool; "
                  "draw_uniform returns a list of min(J, len(pool)) distinct indices, drawn with rng alone."),
    Exercise("choose_external", "train.py", ["Algorithm1.choose_external"],
             "choosing J of the swarm's groups (Algorithm 1)", 20,
             ["Without a client or with J = 0, fetch nothing. Otherwise make each fetched group usable with "
              "external_group, keep those that self.rule.keep keeps, and mark them with this round "
              "(dataclasses.replace, arrived=r).",
              "The pool keeps a group while r minus its arrival is below self.rule.pool_rounds; sort it by "
              "the item's (round, peer, seq), so that the draw does not depend on the order of arrival.",
              "self.rule.draw(self.external_rng, pool, J) gives the indices of the groups drawn; the rest "
              "stay pooled."],
             {"the undrawn groups discarded": [("if k not in drawn]", "if k < 0]")],
              "the sender's round ages the pool": [("r - x.arrived", "r - x.item['round']")],
              "the arrival round not recorded": [("replace(x, arrived=r)", "replace(x)")],
              "drawn in arrival order, not production order": [("self.pool.sort(", "list(self.pool).sort(")],
              "fetched even when J = 0": [("or args.external == 0", "or False")],
              "the rule's keep ignored": [(" and self.rule.keep(x)", "")],
              "two rounds, not the rule's pool_rounds": [("< self.rule.pool_rounds", "< 2")],
              "the paper's draw, not the rule's": [("self.rule.draw(", "draw_uniform(")]},
             note="self.rule is the run's Rule: keep(group), pool_rounds and draw(rng, pool, J) -> indices. "
                  "It returns (the groups drawn, {'external_available': how many were fetched, "
                  "'external_survived': how many the rule kept}); with no client or J = 0 it fetches "
                  "nothing. The draw must not depend on the order in which the groups arrived."),
]


class CourseError(Exception):
    """Bad input, or a file the course cannot read: one sentence, and the command stops."""


def main(argv):
    commands = {"list": (0, list_exercises), "start": (1, start), "check": (1, check), "hint": (1, hint),
                "reset": (1, reset), "release": (None, release), "verify": (0, verify),
                "_grade-all": (0, grade_all)}
    if not argv or argv[0] not in commands:
        public = ", ".join(c for c in commands if c[0] != "_")
        raise CourseError(f"say what to do, one of {public}: e.g. python course.py list.")
    wanted, command = commands[argv[0]]
    args = argv[1:]
    if argv[0] == "release" and not args:
        raise CourseError("release needs a folder to write: python course.py release OUT [NAME ...].")
    if wanted == 1 and len(args) != 1:
        raise CourseError(f"{argv[0]} takes one exercise's name: python course.py {argv[0]} NAME "
                          "(python course.py list names them).")
    if wanted == 0 and args:
        raise CourseError(f"{argv[0]} takes no arguments, and was given {len(args)}.")
    return command(*args) or 0


def find(name):
    """The exercise called `name`, or one sentence naming them all."""
    for ex in EXERCISES:
        if ex.name == name:
            return ex
    names = ", ".join(e.name for e in EXERCISES)
    raise CourseError(f"there is no exercise {name!r}; the exercises are {names}.")


# -----------------------------------------------------------------------------
# the student's commands: list, start, check, hint, reset


def list_exercises():
    best = load_state("scores")
    width = max(len(e.name) for e in EXERCISES)
    for ex in EXERCISES:
        where = f"{ex.file}: {', '.join(written(ex))}"
        score = f"best {best[ex.name]}/10" if ex.name in best else "best -"
        status = ", started" if started(ex) else ""
        print(f"{ex.name:<{width}}  {where:<42}  {ex.step:<54}  {ex.minutes:>2} min  {score}{status}")


def written(ex):
    """What a student writes, in words: "group_advantages (part)", "prefill", ..."""
    return [span if isinstance(span, str) else f"{span[0]} (part)" for span in ex.spans]


def start(name):
    ex = find(name)
    text = read(ex.file)
    if started(ex, text):
        raise CourseError(f"{name} is started already: check it, or reset it to begin again.")
    found = regions(ex, text)
    save_state(f"solutions/{name}", {"file": ex.file, "solution": [cut(text, r) for r in found]})
    write(ex.file, blank(ex, text))
    what = " and ".join(written(ex))
    print(f"{name}: in {ex.file}, {what} now raise{'s' * (len(ex.spans) == 1)} NotImplementedError; the "
          f"docstring is the specification. {ex.note + ' ' if ex.note else ''}Write it, then run "
          f"python course.py check {name}")


def check(name):
    ex = find(name)
    text = read(ex.file)
    found = regions(ex, text)
    if all(cut(text, r) == stub_text(ex, r.indent) for r in found):
        print(f"{name}: not started: {' and '.join(written(ex))} in {ex.file} still raise"
              f"{'s' * (len(found) == 1)} the stub. Write the code, then check again (python course.py hint "
              f"{name} helps).")
        return 1
    is_started = started(ex, text)
    print(f"{name}: {ex.step}" + ("" if is_started else " (the solution is in place: start blanks it)"))
    sys.path.insert(0, ROOT)
    score, _ = grade(ex, lambda: importlib.import_module(ex.file[:-3]))
    if is_started:
        best = load_state("scores")
        best[name] = max(best.get(name, 0), score)
        save_state("scores", best)
    return 0 if score == 10 else 1


def hint(name):
    ex = find(name)
    given = load_state("hints")
    k = given.get(name, 0)
    if k >= len(ex.hints):
        print(f"{name} has no more hints: the docstring of {' and '.join(written(ex))} is the "
              f"specification, and python course.py check {name} names the likely mistake.")
        return
    print(f"hint {k + 1} of {len(ex.hints)} for {name}: {ex.hints[k]}")
    given[name] = k + 1
    save_state("hints", given)


def reset(name):
    ex = find(name)
    text = read(ex.file)
    if not started(ex, text):
        raise CourseError(f"{name} is not started, so there is nothing to reset.")
    found = regions(ex, text)
    attempt = os.path.join(STATE, "attempts", f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}.py")
    os.makedirs(os.path.dirname(attempt), exist_ok=True)
    while os.path.exists(attempt):  # a second reset within the second keeps the first attempt too
        attempt = attempt[:-3] + "+.py"
    with open(attempt, "w", encoding="utf-8") as f:
        f.write("".join(f"# {ex.file}, {what}\n{cut(text, r)}\n" for what, r in zip(written(ex), found)))
    saved = load_state(f"solutions/{name}")
    solution = saved.get("solution") or [stub_text(ex, r.indent) for r in found]  # a release has none
    write(ex.file, splice(text, found, solution))
    if saved:
        os.remove(os.path.join(STATE, "solutions", f"{name}.json"))
    back = "the solution is back" if saved else "the stub is back (this copy holds no solution)"
    print(f"{name}: your attempt is in {os.path.relpath(attempt, ROOT)}; {back}.")


def started(ex, text=None):
    """Whether start blanked the exercise (and reset has not undone it), or a release did."""
    if os.path.exists(os.path.join(STATE, "solutions", f"{ex.name}.json")) or ex.name in RELEASED:
        return True
    text = read(ex.file) if text is None else text
    try:
        return any(cut(text, r) == stub_text(ex, r.indent) for r in regions(ex, text))
    except CourseError:
        return False


def load_state(name):
    path = os.path.join(STATE, f"{name}.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def save_state(name, value):
    path = os.path.join(STATE, f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)


def read(file, root=ROOT):
    try:
        with open(os.path.join(root, file), encoding="utf-8", newline="") as f:
            return f.read()
    except FileNotFoundError:
        raise CourseError(f"{file} is missing from {root}.") from None


def write(file, text, root=ROOT):
    with open(os.path.join(root, file), "w", encoding="utf-8", newline="") as f:
        f.write(text)


# -----------------------------------------------------------------------------
# spans: found by ast positions, spliced as text (the rest of the file stays byte for byte)


@dataclass
class Region:
    first: int   # the span's lines, 1-based, first .. last (last = first - 1 when it is empty)
    last: int
    indent: str  # the indentation of its statements


def regions(ex, text):
    """The Region of each of the exercise's spans in text."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise CourseError(f"{ex.file} does not parse (line {e.lineno}: {e.msg}): fix that line "
                          "first.") from None
    return [region(tree, lines_of(text), ex.file, span) for span in ex.spans]


def region(tree, lines, file, span):
    """A span's lines: those between two statements of its function, blank lines at either end left out."""
    func, after, until = (span, None, None) if isinstance(span, str) else span
    node, body = None, tree.body
    for part in func.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part),
                    None)
        body = node.body if node else []
    if not isinstance(node, ast.FunctionDef):
        raise CourseError(f"{file} has no function {func}.")
    doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str)
    before = statement(body, lines, after, f"{file}'s {func}") if after else (body[0] if doc else None)
    first = before.end_lineno + 1 if before else body[0].lineno
    last = statement(body, lines, until, f"{file}'s {func}").lineno - 1 if until else node.end_lineno
    while first <= last and not lines[first - 1].strip():
        first += 1
    while last >= first and not lines[last - 1].strip():
        last -= 1
    line = lines[first - 1] if first <= last else lines[body[-1].lineno - 1]
    return Region(first, last, line[:len(line) - len(line.lstrip())])


def statement(body, lines, prefix, where):
    """The one statement of body whose first line starts with prefix."""
    found = [s for s in body if lines[s.lineno - 1].strip().startswith(prefix)]
    if len(found) != 1:
        raise CourseError(f"{len(found)} statements of {where} start with {prefix!r}, not 1: the lines "
                          "around the exercise were edited, and must be as they were.")
    return found[0]


def lines_of(text):
    """text's lines, each with its end, split where Python's parser splits them (not at a form feed)."""
    return io.StringIO(text, newline="").readlines()


def cut(text, r):
    return "".join(lines_of(text)[r.first - 1:r.last])


def splice(text, found, new_texts):
    """text with each region replaced by its new text, every other line as it was."""
    lines = lines_of(text)
    for r, new in sorted(zip(found, new_texts), key=lambda pair: -pair[0].first):
        lines[r.first - 1:r.last] = [new]
    return "".join(lines)


def stub_text(ex, indent):
    return f"{indent}{STUB.format(ex.name)}\n"


def blank(ex, text):
    """text with the exercise's spans replaced by the stub."""
    found = regions(ex, text)
    return splice(text, found, [stub_text(ex, r.indent) for r in found])


# -----------------------------------------------------------------------------
# grading: each case passes, fails (expected against got, and the likely mistake) or is not started


CASES = {}  # exercise name -> [(title, points, function of the module under test)], filled by @case


def case(exercise, title, points):
    def register(run):
        CASES.setdefault(exercise, []).append((title, points, run))
        return run
    return register


class Failed(Exception):
    """A case's finding: the lines to print under it."""

    def __init__(self, lines):
        super().__init__(lines[0])
        self.lines = lines


def grade(ex, load, say=print):
    """Run the exercise's cases on the module that load() imports, and say each and the total
    -> (score, each case's verdict)."""
    try:
        module = load()
    except Exception as e:  # a file that fails to import scores 0, shown with the student's frames only
        for line in [f"{ex.file} fails to import:"] + student_frames(e, os.path.join(ROOT, ex.file)):
            say("  " + line)
        say(f"{ex.name}: 0/10")
        return 0, ["fails to import"]
    if "torch" in sys.modules:  # the cases' tensors are tiny: on a busy machine, more threads only wait
        sys.modules["torch"].set_num_threads(1)
    score, verdicts = 0, []
    for title, points, run in CASES[ex.name]:
        verdict, lines = run_case(ex, module, run)
        score += points if verdict == "passed" else 0
        verdicts.append(verdict)
        say(f"  {points if verdict == 'passed' else 0:>2}/{points}  {verdict:<11}  {title}")
        for line in lines:
            say(" " * 20 + line)
    say(f"{ex.name}: {score}/10")
    return score, verdicts


def run_case(ex, module, run):
    """-> ("passed" | "failed" | "not started", lines). A case still running after CASE_SECONDS stops."""
    alarm = hasattr(signal, "SIGALRM")
    if alarm:
        signal.signal(signal.SIGALRM, _too_long)
        signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        run(module)
        return "passed", []
    except Failed as e:
        return "failed", e.lines
    except NotImplementedError as e:
        if str(e).startswith(f"course exercise {ex.name}:"):
            frames = traceback.extract_tb(e.__traceback__)
            return "not started", [f"{frames[-1].name} still raises the stub"]
        return "failed", student_frames(e, module.__file__)
    except Exception as e:  # (the TimeoutError of _too_long among them)
        return "failed", student_frames(e, module.__file__)
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)


def _too_long(signum, frame):
    raise TimeoutError(f"still running after {CASE_SECONDS} s: an endless loop?")


def student_frames(e, path):
    """The exception, and the traceback's frames in the student's file only (none of course.py's)."""
    path = os.path.realpath(path)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.realpath(f.filename) == path]
    head = f"raised {type(e).__name__}: {e}".splitlines()[0][:300]
    if not frames:
        return [head + " (in the check, on what your code returned)"]
    return [head] + [line for f in frames for line in
                     (f"{os.path.basename(f.filename)}, line {f.lineno}, in {f.name}:", f"    {f.line}")]


def expect(what, got, want, wrong=None, tol=1e-6):
    """Pass if got is want (numbers within tol, NaN equal to NaN); else Failed with both, the largest
    difference, and the first known mistake (wrong: its label -> what it gives) that gives got."""
    if close(got, want, tol):
        return
    lines = [what, f"expected {show(want)}", f"got      {show(got)}"]
    diff = max_diff(got, want)
    if diff is not None and diff < 1e-3:
        lines.append(f"(the largest difference is {diff:.2g}, over the tolerance {tol:g})")
    named = [label for label, value in (wrong or {}).items() if close(got, value, tol)]
    raise Failed(lines + [f"this is what {label} gives" for label in named[:1]])


def likely(check_, mistake, *args, **kwargs):
    """check_(*args, **kwargs), whose failure, if any, is most likely `mistake`: the case says so."""
    try:
        check_(*args, **kwargs)
    except Failed as e:
        e.lines.append(f"this is most likely {mistake}")
        raise


def plain(x):
    """Tensors as nested lists, tuples as lists: what close and show compare and print."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return x


def close(a, b, tol):
    a, b = plain(a), plain(b)
    if _number(a) and _number(b):
        return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    return type(a) is type(b) and a == b


def _number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def flat(x):
    return [v for item in x for v in flat(item)] if isinstance(x, list) else [x]


def max_diff(a, b):
    a, b = flat(plain(a)), flat(plain(b))
    if len(a) != len(b) or not all(map(_number, a + b)):
        return None
    return max((abs(x - y) for x, y in zip(a, b) if not (math.isnan(x) or math.isnan(y))), default=None)


def show(x, most=12):
    x = plain(x)
    if isinstance(x, float):
        return f"{x:.4f}" if 1e-3 <= abs(x) < 1e5 or x == 0 else f"{x:.4g}"
    if isinstance(x, list):
        if len(flat(x)) > most:
            return f"[{', '.join(show(v, most) for v in x[:3])}, ... ({len(x)} items)]"
        return f"[{', '.join(show(v, most) for v in x)}]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {show(v, most)}" for k, v in x.items()) + "}"
    return repr(x)


def outcome(f, *args, **kwargs):
    """What f returns, or a Raised, where raising is a known mistake (shown, not fatal). The stub's
    NotImplementedError still goes up: the case is not started."""
    try:
        return f(*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as e:
        return Raised(e)


class Raised:
    def __init__(self, e):
        self.e = e

    def __eq__(self, other):
        return isinstance(other, Raised)  # any exception: the point is that it raised

    def __repr__(self):
        return f"raised {type(self.e).__name__}: {self.e}"


RAISES = Raised(Exception("anything"))


# -----------------------------------------------------------------------------
# for maintainers: verify; for instructors: release


def verify():
    """Every exercise resolves and is not started here, and no blanked line is reprinted in the prose;
    then, on a temporary copy, each blank imports and scores 0 (every case "not started"), each solution
    scores 10, and each wrong variant loses points and is named by a case."""
    t0, problems = time.time(), []
    for ex in EXERCISES:
        text = read(ex.file)
        if started(ex, text):
            raise CourseError(f"verify needs the solution, and {ex.name} is started: reset it first.")
        empty = [r for r in regions(ex, text) if r.first > r.last]
        problems += [f"{ex.name}: a span of {ex.file} is empty"] * bool(empty)
        points = sum(c[1] for c in CASES.get(ex.name, []))
        problems += [f"{ex.name}: its cases give {points} points, not 10"] * (points != 10)
    problems += leaks()
    with tempfile.TemporaryDirectory() as tmp:
        for name in COMPONENTS + ["course.py"]:
            shutil.copy2(os.path.join(ROOT, name), tmp)
        open(os.path.join(tmp, COPY_MARK), "w").close()
        run = subprocess.run([sys.executable, os.path.join(tmp, "course.py"), "_grade-all"], cwd=tmp,
                             capture_output=True, text=True)
    if run.returncode != 0 or not run.stdout.strip():
        last = (run.stderr.strip() or run.stdout.strip() or "no output").splitlines()[-1]
        raise CourseError(f"grading on a temporary copy failed: {last}")
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for ex in EXERCISES:
        problems += report(ex, results[ex.name])
    for problem in problems:
        print("PROBLEM " + problem)
    print(f"verify: {len(EXERCISES)} exercises, {len(problems)} problems, {time.time() - t0:.1f} s")
    return 1 if problems else 0


def report(ex, got):
    """Print an exercise's line of verify's results -> its problems."""
    problems = [f"{ex.name}: {p}" for p in got["problems"]]
    if got["blank"] != ["not started"] * len(CASES[ex.name]):
        problems.append(f"{ex.name}: the blank's cases say {got['blank']}, not all 'not started'")
    if got["solution"] != 10:
        problems.append(f"{ex.name}: the solution scores {got['solution']}/10")
    caught = []
    for label, (score, named) in got["wrong"].items():
        problems += [f"{ex.name}: the wrong variant '{label}' scores {score}/10"] * (score >= 10)
        problems += [f"{ex.name}: no case names the wrong variant '{label}'"] * (not named)
        caught.append(f"{label} ({score}/10)")
    print(f"{ex.name}: blank 0/10, solution {got['solution']}/10; {len(caught)} wrong variants: "
          f"{'; '.join(caught)}")
    return problems


def grade_all():
    """verify's grading, run in a temporary copy: each exercise's blank, solution and wrong variants
    written in place and imported afresh -> one line of JSON."""
    if not os.path.exists(os.path.join(ROOT, COPY_MARK)):  # it rewrites the files it grades
        raise CourseError("_grade-all is verify's, and runs only in the temporary copy that verify makes.")
    sys.path.insert(0, ROOT)
    originals = {name[:-3]: importlib.import_module(name[:-3]) for name in COMPONENTS}
    results = {}
    for ex in EXERCISES:
        solution, problems, versions = read(ex.file), [], {}
        for label, edit in ex.wrong.items():
            try:
                versions[label] = wrong_version(ex, solution, edit)
            except CourseError as e:
                problems.append(str(e))
        scores = {}
        for label, text in [("blank", blank(ex, solution)), ("solution", solution), *versions.items()]:
            said = []
            write(ex.file, text)
            score, verdicts = grade(ex, lambda: fresh_import(ex.file), said.append)
            named = any(f"{way} {label}" in line for line in said for way in ("this is what", "most likely"))
            scores[label] = verdicts if label == "blank" else (score, named)
            problems += [f"its version '{label}' fails to import"] * (verdicts == ["fails to import"])
            sys.modules[ex.file[:-3]] = originals[ex.file[:-3]]
        write(ex.file, solution)
        results[ex.name] = dict(blank=scores.pop("blank"), solution=scores.pop("solution")[0], wrong=scores,
                                problems=problems)
    print(json.dumps(results))


def fresh_import(file):
    """The module of file imported anew, under its own name (so that the cases import what they grade)."""
    name = file[:-3]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, file))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def wrong_version(ex, solution, edit):
    """The solution with a wrong variant's edits made within the spans: each (old, new) replaces the one
    occurrence of old; a str replaces the first span."""
    found = regions(ex, solution)
    texts = [cut(solution, r) for r in found]
    if isinstance(edit, str):
        texts[0] = "".join(found[0].indent + line for line in edit.splitlines(keepends=True))
    for old, new in [] if isinstance(edit, str) else edit:
        count = sum(t.count(old) for t in texts)
        if count != 1:
            raise CourseError(f"a wrong variant's {old!r} occurs {count} times in the spans, not once")
        k = next(k for k, t in enumerate(texts) if old in t)
        texts[k] = texts[k].replace(old, new)
    return splice(solution, found, texts)


def leaks():
    """Each line of 20 or more characters of a solution span that the prose reprints: the docstrings and
    comments of the blanked component files, this file, the README and docs/*.md."""
    blanked = {name: read(name) for name in COMPONENTS}
    for ex in EXERCISES:
        blanked[ex.file] = blank(ex, blanked[ex.file])
    prose = {name: "\n".join(prose_of(text)) for name, text in blanked.items()}
    docs = os.path.join(ROOT, "docs")
    guides = sorted(f"docs/{n}" for n in os.listdir(docs) if n.endswith(".md"))
    for name in ["README.md", "course.py"] + guides:
        prose[name] = read(name)
    found = []
    for ex in EXERCISES:
        text = read(ex.file)
        for r in regions(ex, text):
            for n, line in enumerate(cut(text, r).splitlines(), r.first):
                line = line.strip()
                found += [f"{ex.name}: {ex.file}:{n} is reprinted in {where}: {line}"
                          for where, words in prose.items() if len(line) >= 20 and line in words]
    return found


def prose_of(text):
    """The strings with a space (a one-word string is code) and the comments of Python source."""
    lines = iter(lines_of(text))
    return [t.string for t in tokenize.generate_tokens(lambda: next(lines, ""))
            if t.type in (tokenize.STRING, tokenize.COMMENT) and " " in t.string]


def release(out, *names):
    """A student repository at out: the tracked files, the chosen exercises (all by default) blanked,
    course.py's RELEASED naming them, one commit and no history."""
    chosen = [find(n) for n in names] or EXERCISES
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CourseError(f"{out} exists and is not an empty folder; give release a new one.")
    busy = [ex.name for ex in EXERCISES if started(ex)]
    if busy:
        raise CourseError(f"release copies the solution, and {', '.join(busy)} started here: reset first.")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        raise CourseError("release copies the files git tracks, and this folder is not a git repository.")
    files = sorted(set(filter(None, listed.stdout.split("\0"))) | {"course.py"})
    for name in files:
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(out, name))
    for ex in chosen:
        write(ex.file, blank(ex, read(ex.file, out)), out)
    listing = f"\nRELEASED = {[ex.name for ex in chosen]!r}"
    write("course.py", read("course.py", out).replace("\nRELEASED = []", listing, 1), out)
    imports = subprocess.run([sys.executable, "-c", "import " + ", ".join(n[:-3] for n in COMPONENTS)],
                             cwd=out, capture_output=True, text=True)
    if imports.returncode != 0:
        raise CourseError(f"the released files fail to import: {imports.stderr.strip().splitlines()[-1:]}")
    git = ["git", "-c", "user.name=course", "-c", "user.email=course@localhost", "-c", "commit.gpgsign=false"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "The course's starting point"]):
        subprocess.run(git + command, cwd=out, check=True, capture_output=True)
    print(f"{out}: {len(files)} files in one commit, {len(chosen)} exercises blanked: "
          f"{', '.join(ex.name for ex in chosen)}.")


# -----------------------------------------------------------------------------
# the cases: properties a correct version has, on small exact inputs

# reward.py: extract_answer


def _last_span(text, which=-1):
    """ReasoningGym's reading: the last match of <answer>(.*?)</answer> over any characters, stripped."""
    spans = list(re.finditer(r"<answer>(.*?)</answer>", text, re.DOTALL))
    return spans[which].group(1).strip() if spans else None


@case("extract_answer", "the last span wins, stripped", 2)
def _(reward):
    for text in ["a <answer>1</answer> b <answer> 2 </answer>", "<answer>x</answer><answer>y</answer>"]:
        raw = [m.group(1) for m in re.finditer(r"<answer>(.*?)</answer>", text)]
        expect(f"extract_answer({text!r})", reward.extract_answer(text), _last_span(text),
               wrong={"the first span, not the last": _last_span(text, 0), "the span not stripped": raw[-1]})


@case("extract_answer", "None when no span is closed", 2)
def _(reward):
    for text in ["no tags", "<answer>1", "<answer>1</answer> and <answer>2", "</answer><answer>", ""]:
        expect(f"extract_answer({text!r})", reward.extract_answer(text), _last_span(text))


@case("extract_answer", "a span may hold new lines, and an opening tag is text inside a span", 2)
def _(reward):
    for text in ["<answer>a\nb</answer>", "<answer><answer>3</answer>", "<answer></answer>"]:
        expect(f"extract_answer({text!r})", reward.extract_answer(text), _last_span(text))


@case("extract_answer", "anything but a str is None", 1)
def _(reward):
    for x in [None, 42, ["<answer>1</answer>"]]:
        expect(f"extract_answer({x!r})", outcome(reward.extract_answer, x), None,
               wrong={"no check that the text is a str": RAISES})


@case("extract_answer", "agrees with ReasoningGym's regex on 300 mixed strings", 3)
def _(reward):
    rng = random.Random(0)
    pieces = ["<answer>", "</answer>", "<answer", "answer>", "7", " ", "\n", "x"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 9)))
        expect(f"extract_answer({text!r})", reward.extract_answer(text), _last_span(text),
               wrong={"the first span, not the last": _last_span(text, 0)})


# reward.py: Task.verify


def _items(reward):
    return [reward.get_task(name).generate(random.Random(k)) for k, name in
            enumerate(["basic_arithmetic", "base_conversion", "one_digit_addition", "two_digit_addition"])]


def _rejects(reward, item):
    """Whether Task.verify rejects the item: it returns False, or raises (which verify_item counts as
    False); anything else it returns is shown as it is."""
    said = outcome(reward.get_task(item["task"]).verify, item)
    return isinstance(said, Raised) or said is False or (said if said is not True else False)


@case("trust", "items made here verify, seeded and unseeded", 2)
def _(reward):
    for item in _items(reward):
        expect(f"verify({show(item)})", reward.get_task(item["task"]).verify(item), True)


@case("trust", "a changed question, answer or metadata fails", 2)
def _(reward):
    item = _items(reward)[1]  # a base_conversion item
    forged = [dict(item, question=item["question"].replace("Now, convert", "Now convert")),
              dict(item, answer=item["answer"] + "0"),
              dict(item, metadata=dict(item["metadata"], target_base=item["metadata"]["target_base"] + 1))]
    for x, what in zip(forged, ["question", "answer", "metadata"]):
        expect(f"verify of a base_conversion item whose {what} was changed: rejected?", _rejects(reward, x),
               True, wrong={"only the answer compared": False})


@case("trust", "1, 1.0 and True are told apart", 2)
def _(reward):
    item = _items(reward)[1]
    for key, value in [("decimal_value", float(item["metadata"]["decimal_value"])), ("source_base", 3.0)]:
        x = dict(item, metadata=dict(item["metadata"], **{key: value}))
        expect(f"verify of a base_conversion item with metadata {key} = {value!r}: rejected?",
               _rejects(reward, x), True, wrong={"compared with ==, which takes 1.0 for 1": False})


@case("trust", "a seed must be an int from 0 to 2**32 - 1", 2)
def _(reward):
    task = reward.get_task("basic_arithmetic")
    for seed, made in [(True, 1), (2**32 + 1, 2**32 + 1), (-1, -1), ("1", 1), (None, 1)]:
        x = dict(task.from_seed(made), metadata=dict(task.from_seed(made)["metadata"], seed=seed))
        expect(f"verify of a basic_arithmetic item whose seed is {seed!r}: rejected?", _rejects(reward, x),
               True, wrong={"the seed's type and range not checked": False})


@case("trust", "an easy item is replayed: a value make() never draws fails", 2)
def _(reward):
    task = reward.get_task("one_digit_addition")
    for a, b in [(12, 30), (3, -1), (True, 4)]:
        x = {"task": task.name, "question": f"What is {a} + {b}?", "answer": str(a + b),
             "metadata": {"a": a, "b": b}}
        expect(f"verify of the consistent but forged {show(x)}: rejected?", _rejects(reward, x), True)
    good = task.generate(random.Random(5))
    expect(f"verify({show(good)})", task.verify(good), True)


# model.py: rope_tables and apply_rope


def _config(model, **change):
    settings = dict(family="llama", vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    hidden_dim=48, norm_eps=1e-6, rope_theta=100.0, max_seq_len=32, tie_embeddings=False,
                    qkv_bias=False, qk_norm=False)
    return model.Config(**{**settings, **change})


def _angles(p, D, theta, layout="halves", exponent=2):
    """RoPE's angle at position p for each of D dimensions, in float64: the D/2 frequencies
    theta^(-2i/D) twice, or each twice in a row ("interleaved")."""
    freqs = [theta ** (-exponent * i / D) for i in range(D // 2)]
    return [p * f for f in (freqs + freqs if layout == "halves" else [f for f in freqs for _ in (0, 1)])]


def _rotated(x, angles, sign=1):
    """x (a list of D numbers) rotated pair by pair, (x[i], x[i + D/2]) by angles[i] (sign -1: backwards)."""
    D, out = len(x), list(x)
    for i, j in [(i, i + D // 2) for i in range(D // 2)]:
        c, s = math.cos(angles[i]), sign * math.sin(angles[i])
        out[i], out[j] = x[i] * c - x[j] * s, x[j] * c + x[i] * s
    return out


@case("rope", "rope_tables: angle(p, i) = p * theta^(-2i/head_dim), the frequencies twice", 2)
def _(model):
    cos, sin = model.rope_tables(_config(model, head_dim=8, max_seq_len=4), "cpu")
    for name, got, f in [("cos", cos, math.cos), ("sin", sin, math.sin)]:
        def table(**kw):
            return [[f(a) for a in _angles(p, 8, 100.0, **kw)] for p in range(4)]
        expect(f"rope_tables(head_dim=8, rope_theta=100, max_seq_len=4)'s {name}", got, table(), tol=1e-6,
               wrong={"interleaved frequencies (each twice in a row)": table(layout="interleaved"),
                      "the exponent i/D, not 2i/D": table(exponent=1)})


@case("rope", "apply_rope rotates the pairs (x[i], x[i + D/2])", 2)
def _(model):
    import torch
    x = [1.0, 2.0, 3.0, 4.0, 0.5, -1.0, 0.25, 2.0]
    angles = _angles(3, 8, 100.0)
    cos = torch.tensor([[[math.cos(a) for a in angles]]], dtype=torch.float64)
    sin = torch.tensor([[[math.sin(a) for a in angles]]], dtype=torch.float64)
    got = model.apply_rope(torch.tensor(x, dtype=torch.float64).view(1, 1, 1, 8), cos, sin).view(-1)
    expect(f"apply_rope(x = {x}, with the tables' cos and sin at position 3)", got, _rotated(x, angles),
           wrong={"rotate_half's sign flipped": _rotated(x, angles, sign=-1)})


@case("rope", "position 0 leaves a head as it is, and every rotation keeps its length", 2)
def _(model):
    import torch
    cos, sin = model.rope_tables(_config(model), "cpu")
    x = torch.linspace(-2, 2, 3 * 2 * 8, dtype=torch.float64).view(1, 3, 2, 8)
    pos = torch.tensor([[0, 5, 17]])
    y = model.apply_rope(x, cos[pos].double(), sin[pos].double())
    expect("apply_rope at position 0 (3 positions, 2 heads, head_dim 8)", y[0, 0], x[0, 0])
    expect("the length of each head after apply_rope at positions 0, 5, 17", y.norm(dim=-1), x.norm(dim=-1))


@case("rope", "q . k depends on the distance only: positions (2, 7) score as (9, 14)", 2)
def _(model):
    import torch
    cos, sin = model.rope_tables(_config(model), "cpu")
    q = torch.linspace(-1, 1, 8, dtype=torch.float64).view(1, 1, 1, 8)
    k = torch.linspace(2, -0.5, 8, dtype=torch.float64).view(1, 1, 1, 8)

    def score(m, n):
        rq = model.apply_rope(q, cos[m].double().view(1, 1, 8), sin[m].double().view(1, 1, 8))
        rk = model.apply_rope(k, cos[n].double().view(1, 1, 8), sin[n].double().view(1, 1, 8))
        return float((rq * rk).sum())
    expect("rope(q, 9) . rope(k, 14), against rope(q, 2) . rope(k, 7)", score(9, 14), score(2, 7), tol=1e-5)


@case("rope", "the model's logits equal transformers' LlamaForCausalLM", 2)
def _(model):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_config = LlamaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
                            rope_theta=100.0)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = model.Transformer(model.config_from_hf(hf_config.to_dict()), hf_config.to_dict())
    ours.load_state_dict(hf.state_dict())
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])
    with torch.no_grad():
        expect("the logits of 12 tokens, tiny random Llama (dim 32, 4 heads, head_dim 8)", ours.eval()(ids),
               hf(ids).logits, tol=1e-4)


# sample.py: sample_token


def _softmax(xs):
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    return [v / sum(e) for v in e]


def _argmax_times(p):
    """How often each token is argmax(p * E), E ~ Exponential(1): the integral of token i's density times
    the others' distribution functions, expanded over the subsets of the others."""
    share = []
    for i, pi in enumerate(p):
        rates = [1 / pj for j, pj in enumerate(p) if j != i]
        share.append(sum((-1) ** n * (1 / pi) / (1 / pi + sum(s)) for n in range(len(rates) + 1)
                         for s in itertools.combinations(rates, n)))
    return share


def _frequencies(sample, logits, n=20000, **settings):
    """How often each token comes in n draws from one row of logits (a seeded generator)."""
    import torch
    rows = torch.tensor([logits], dtype=torch.float64).expand(n, len(logits))
    tokens = sample.sample_token(rows, generator=torch.Generator().manual_seed(0), **settings)
    return [round(float((tokens == k).double().mean()), 3) for k in range(len(logits))]


@case("sample_token", "temperature 0 is the argmax, its log-prob 0", 2)
def _(sample):
    import torch
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 5.0]])
    expect("sample_token([[1, 3, 2], [0, -1, 5]], temperature=0)", sample.sample_token(logits, 0.0), [1, 2])
    expect("its log-probs (logprob=True)", sample.sample_token(logits, 0.0, logprob=True)[1], [0.0, 0.0])


@case("sample_token", "20,000 draws at temperature 2 follow softmax(logits / 2)", 2)
def _(sample):
    logits = [4.0, 0.0, 0.0, 0.0]
    p = _softmax([x / 2 for x in logits])
    expect("the share of each token in 20,000 draws from logits [4, 0, 0, 0] at temperature 2",
           _frequencies(sample, logits, temperature=2.0), p, tol=0.015,
           wrong={"temperature multiplied, not divided": _softmax([x * 2 for x in logits]),
                  "argmax(p * E), which is not a draw from p": _argmax_times(p)})


@case("sample_token", "top-k = 2 draws the two most likely only, in proportion", 2)
def _(sample):
    logits = [3.0, 2.0, 1.0, 0.0]
    expect("the share of each token in 20,000 draws from logits [3, 2, 1, 0], top_k=2",
           _frequencies(sample, logits, top_k=2), _softmax(logits[:2]) + [0.0, 0.0], tol=0.015,
           wrong={"top-k keeping k - 1": [1.0, 0.0, 0.0, 0.0]})


@case("sample_token", "top-p = 0.7 keeps the nucleus {0, 1} of p = [0.5, 0.3, 0.15, 0.05]", 2)
def _(sample):
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    expect("the share of each token in 20,000 draws from p = [0.5, 0.3, 0.15, 0.05], top_p=0.7",
           _frequencies(sample, logits, top_p=0.7), [0.625, 0.375, 0.0, 0.0], tol=0.015,
           wrong={"top-p dropping the token that crosses top_p": [1.0, 0.0, 0.0, 0.0]})


@case("sample_token", "log-probs are of the distribution drawn from (top-k, top-p renormalised)", 2)
def _(sample):
    import torch
    logits = [1.5, 1.0, 0.0, -1.0]
    full = _softmax([x / 1.5 for x in logits])
    kept = [v / sum(full[:2]) for v in full[:2]] + [0.0, 0.0]  # both settings keep the two most likely
    for settings in [dict(temperature=1.5, top_k=2), dict(temperature=1.5, top_p=0.6)]:
        rows = torch.tensor([logits] * 64, dtype=torch.float64)
        tokens, lp = sample.sample_token(rows, generator=torch.Generator().manual_seed(1), logprob=True,
                                         **settings)
        pick = tokens.tolist()
        expect(f"the log-probs of 64 draws from logits {logits}, {settings} (the first shown)", lp,
               [math.log(kept[t]) if kept[t] > 0 else -math.inf for t in pick], tol=1e-5,
               wrong={"top-p's kept probabilities not renormalised": [math.log(full[t]) for t in pick]})


# sample.py: prefill and decode_step

PROMPTS, G, FED = [[5, 6, 7], [8, 9, 10, 11, 12]], 3, [[13, 14, 15], [16, 17, 18]]  # FED: decoded, per prompt


def _tiny(model):
    """A random float64 Transformer of _config, weights wide enough that every logit differs."""
    import torch
    torch.manual_seed(0)
    m = model.Transformer(_config(model)).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def _prefilled(sample, m, S=9):
    import torch
    cfg = m.cfg
    cache = torch.zeros(cfg.n_layers, 2, len(PROMPTS) * G, cfg.n_kv_heads, S, cfg.head_dim,
                        dtype=torch.float64)
    logits, pads = sample.prefill(m, PROMPTS, G, cache)
    return cache, logits, pads


def _alone(m, ids, pos=None, row=None):
    """The last logits of ids run alone, uncached: at RoPE positions pos, or over the row `row` with
    nothing masked but the future (for the mistakes that attend to pads)."""
    import torch
    with torch.no_grad():
        return m(torch.tensor([row or ids]), pos=None if pos is None else torch.tensor([pos]))[0, -1]


@case("kv_cache", "prefill: each row's logits are its prompt's, run alone", 3)
def _(sample):
    import model
    m = _tiny(model)
    _, logits, pads = _prefilled(sample, m)
    L = max(map(len, PROMPTS))
    for p, prompt in enumerate(PROMPTS):
        pad = L - len(prompt)
        expect(f"prefill(prompts {PROMPTS}, G={G})'s pads of prompt {p}", pads[p * G:(p + 1) * G], [pad] * G)
        for g in range(G):
            expect(f"prefill's logits of row {p * G + g} (prompt {prompt}, left-padded to {L})",
                   logits[p * G + g], _alone(m, prompt), tol=1e-9,
                   wrong={"the RoPE position ignoring pads (prefill)": _alone(m, prompt, list(range(pad, L))),
                          "pads attended": _alone(m, prompt, [0] * pad + list(range(len(prompt))),
                                                  [0] * pad + prompt)})


@case("kv_cache", "prefill: the G rows of a prompt hold the same keys and values", 2)
def _(sample):
    import model
    cache, _, _ = _prefilled(sample, _tiny(model))
    L = max(map(len, PROMPTS))
    for p in range(len(PROMPTS)):
        for g in range(1, G):
            expect(f"the cache's slots 0..{L - 1} of row {p * G + g} against row {p * G} (prompt {p}, G={G})",
                   cache[:, :, p * G + g, :, :L], cache[:, :, p * G, :, :L], tol=0,
                   wrong={"not copied to the other rows": cache[:, :, p * G, :, :L] * 0})


def _decoded(sample, m, width=None):
    """prefill, then each row's FED tokens fed one a step -> the logits (B, V) of each step in turn."""
    import torch
    cache, logits, pads = _prefilled(sample, m)
    L, steps = max(map(len, PROMPTS)), []
    for n in range(len(FED[0])):
        tokens = torch.tensor([FED[p][n] for p in range(len(PROMPTS)) for _ in range(G)])
        t = torch.tensor(L + n)
        steps.append(sample.decode_step(m, cache, tokens, t, pads, width or L + n + 1))
    return steps


@case("kv_cache", "decode: each cached step's logits equal the uncached forward's", 3)
def _(sample):
    import model
    m = _tiny(model)
    L = max(map(len, PROMPTS))
    for n, logits in enumerate(_decoded(sample, m)):
        for p, prompt in enumerate(PROMPTS):
            ids, pad = prompt + FED[p][:n + 1], L - len(prompt)
            unpadded = list(range(len(prompt))) + [L + k for k in range(n + 1)]
            expect(f"decode step {n + 1}'s logits of row {p * G} (prompt {prompt}, then {FED[p][:n + 1]})",
                   logits[p * G], _alone(m, ids), tol=1e-9,
                   wrong={"the decode position ignoring pads": _alone(m, ids, unpadded) if pad else None})


@case("kv_cache", "decode: a step that reads all S slots equals one that reads the filled ones", 2)
def _(sample):
    import model
    m = _tiny(model)
    for n, (eager, fixed) in enumerate(zip(_decoded(sample, m), _decoded(sample, m, width=9))):
        likely(expect, "slots past t attended", f"decode step {n + 1}'s logits with width S = 9, against "
               "width t + 1", fixed, eager, tol=1e-9)


# grpo.py: group_advantages


def _advantages(rewards, sizes, scale="group", biased=False, batch_mean=False, eps=1e-4, one_nan=False):
    """The advantages in float64 by the formula (and by the known mistakes, through the flags)."""
    def std(xs):
        if len(xs) < 2:
            return math.nan if one_nan else 0.0
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - (0 if biased else 1)))
    out, k = [], 0
    for n in sizes:
        g, k = rewards[k:k + n], k + n
        centre = sum(rewards) / len(rewards) if batch_mean else sum(g) / len(g)
        spread = {"group": std(g), "batch": std(rewards), "none": None}[scale]
        for x in g:
            out.append(x - centre if spread is None else (x - centre) / (spread + eps) if spread + eps
                       else math.nan)
    return out


MISTAKES = {"biased std (dividing by G, not G - 1)": dict(biased=True),
            "the batch's mean, not each group's": dict(batch_mean=True), "no eps (0 / 0 is NaN)": dict(eps=0),
            "a group of one's std is NaN": dict(one_nan=True), "each group's std for scale 'batch'": {}}


def _advantage_case(grpo, rewards, group_size, scale="group", wrong=()):
    import torch
    sizes = [group_size] * (len(rewards) // group_size) if isinstance(group_size, int) else group_size
    got = grpo.group_advantages(torch.tensor(rewards, dtype=torch.float64), group_size, scale)
    each = {label: _advantages(rewards, sizes, "group" if "'batch'" in label else scale, **MISTAKES[label])
            for label in wrong}
    expect(f"group_advantages({rewards}, group_size={group_size}, scale={scale!r})", got,
           _advantages(rewards, sizes, scale), tol=1e-5, wrong=each)


@case("advantages", "the docstring's example: [1, 0, 0, 1] and an all-equal group (0, not NaN), G = 4", 2)
def _(grpo):
    _advantage_case(grpo, [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], 4,
                    wrong=["no eps (0 / 0 is NaN)", "the batch's mean, not each group's",
                           "biased std (dividing by G, not G - 1)"])


@case("advantages", "groups of three: the unbiased std divides by G - 1", 2)
def _(grpo):
    _advantage_case(grpo, [1.0, 0.0, 0.0, 0.5, 1.0, 0.0], 3,
                    wrong=["biased std (dividing by G, not G - 1)", "the batch's mean, not each group's"])


@case("advantages", "groups of sizes [2, 3, 1]: a group of one gets 0", 2)
def _(grpo):
    _advantage_case(grpo, [1.0, 0.0, 1.0, 1.0, 0.0, 1.0], [2, 3, 1],
                    wrong=["a group of one's std is NaN", "biased std (dividing by G, not G - 1)"])


@case("advantages", "scale 'batch': each group's mean, the whole batch's std", 2)
def _(grpo):
    _advantage_case(grpo, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], 3, "batch",
                    wrong=["each group's std for scale 'batch'", "the batch's mean, not each group's",
                           "biased std (dividing by G, not G - 1)"])


@case("advantages", "scale 'none': each reward minus its group's mean (Dr. GRPO)", 2)
def _(grpo):
    _advantage_case(grpo, [1.0, 0.0, 0.0, 0.5, 1.0, 1.0], 3, "none",
                    wrong=["the batch's mean, not each group's"])


# grpo.py: the clipped surrogate inside grpo_loss


def _token(lp, old, a, eps=0.2, eps_high=0.28, ref=None, beta=0.0, dual=None, shared=True, **mistake):
    """One token's loss and its derivative by logprobs, in float64, by the formulas of grpo.py's docstring
    (or with a known mistake: symmetric, no_min, attached, k3_sign, dual_everywhere)."""
    ratio = math.exp(min(lp - old, 20.0))
    high = 1 + (eps if mistake.get("symmetric") else eps_high)
    clipped = min(max(ratio, 1 - eps), high)
    if mistake.get("no_min"):
        loss, grad = -clipped * a, (-ratio * a if 1 - eps < ratio < high else 0.0)
    elif ratio * a <= clipped * a:
        loss, grad = -ratio * a, -ratio * a
    else:
        loss, grad = -clipped * a, 0.0
    if mistake.get("attached"):
        grad = 0.0  # the ratio of a log-prob to itself is 1, whatever the log-prob
    if dual is not None and a < 0 and (shared or mistake.get("dual_everywhere")) and loss > dual * -a:
        loss, grad = dual * -a, 0.0
    if ref is not None:
        d = (lp - ref) if mistake.get("k3_sign") else (ref - lp)
        k3, dk3 = math.exp(d) - d - 1, (math.exp(d) - 1) * (1 if mistake.get("k3_sign") else -1)
        loss, grad = loss + beta * k3, grad + beta * dk3
    return loss, grad


def _surrogate(lp, old, adv, mask, loss_type="token_mean", max_tokens=None, ref=None, shared=None,
               **settings):
    """grpo_loss's value and its gradient by logprobs (lists), from _token and the loss type's weights."""
    B, T = len(lp), len(lp[0])
    n = max(sum(map(sum, mask)), 1)
    weight = {"token_mean": lambda b: 1 / n, "seq_mean": lambda b: 1 / B / max(sum(mask[b]), 1),
              "constant": lambda b: 1 / (B * (max_tokens or T)), "B·T": lambda b: 1 / (B * T)}[loss_type]
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if mask[b][t]:
                value, slope = _token(lp[b][t], old[b][t], adv[b], ref=None if ref is None else ref[b][t],
                                      shared=True if shared is None else shared[b], **settings)
                loss, grad[b][t] = loss + weight(b) * value, weight(b) * slope
    return [loss, grad]


def _grpo_loss(grpo, lp, old, adv, mask, same_old=False, **settings):
    """grpo_loss on float64 tensors of these lists -> [loss, its gradient by logprobs]."""
    import torch
    logprobs = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    old_t = logprobs if same_old else torch.tensor(old, dtype=torch.float64)
    tensors = {k: torch.tensor(v, dtype=torch.float64 if k == "ref_logprobs" else None)
               for k, v in settings.items() if k in ("ref_logprobs", "shared")}
    loss, _ = grpo.grpo_loss(logprobs, old_t, torch.tensor(adv, dtype=torch.float64),
                             torch.tensor(mask, dtype=torch.float64), **{**settings, **tensors})
    loss.backward()
    return [float(loss.detach()), logprobs.grad]


SYMMETRIC = "a symmetric clip (1 + epsilon on both sides)"


@case("surrogate", "the docstring's example: ratios [1.0, 1.5], A = 0.8659 -> -0.9871", 2)
def _(grpo):
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    lp, old, mask = [[0.0, math.log(1.5)]], [[0.0, 0.0]], [[1, 1]]
    expect(f"[loss, d loss / d logprobs] of ratios [1.0, 1.5], A = {a:.4f}",
           _grpo_loss(grpo, lp, old, [a], mask), _surrogate(lp, old, [a], mask), tol=1e-9,
           wrong={SYMMETRIC: _surrogate(lp, old, [a], mask, symmetric=True),
                  "token mean over B·T": _surrogate(lp, old, [a], mask, "B·T")})


RATIOS = [0.7, 0.9, 1.25, 1.4]  # below 1 - 0.2, inside, inside [0.8, 1.28] but past 1.2, past 1.28


@case("surrogate", f"the clip on both sides, epsilon 0.2, epsilon_high 0.28: ratios {RATIOS}, A = +-1", 2)
def _(grpo):
    lp, old, mask, adv = [[math.log(r) for r in RATIOS]] * 2, [[0.0] * 4] * 2, [[1] * 4] * 2, [1.0, -1.0]
    expect(f"[loss, gradient] of ratios {RATIOS} in a row with A = 1 and a row with A = -1",
           _grpo_loss(grpo, lp, old, adv, mask), _surrogate(lp, old, adv, mask), tol=1e-9,
           wrong={SYMMETRIC: _surrogate(lp, old, adv, mask, symmetric=True),
                  "the clipped term alone, no min": _surrogate(lp, old, adv, mask, no_min=True)})


@case("surrogate", "old log-probs are constants: old = logprobs gives REINFORCE's gradient -A / n", 2)
def _(grpo):
    lp, mask, adv = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.5]], [[1, 1, 1], [1, 1, 0]], [0.5, -1.5]
    expect("[loss, gradient] with old_logprobs the very tensor logprobs (ratio 1), A = [0.5, -1.5]",
           _grpo_loss(grpo, lp, None, adv, mask, same_old=True), _surrogate(lp, lp, adv, mask), tol=1e-9,
           wrong={"old log-probs left attached to the graph": _surrogate(lp, lp, adv, mask, attached=True)})


@case("surrogate", "token_mean, seq_mean and constant average as documented (max_tokens 5, T 3)", 2)
def _(grpo):
    lp, mask, adv = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.5]], [[1, 1, 1], [1, 0, 0]], [1.0, -2.0]
    old = [[x - 0.1 for x in row] for row in lp]
    mistakes = {"token_mean": "token mean over B·T", "constant": "Dr. GRPO over T, not max_tokens"}
    for loss_type in ["token_mean", "seq_mean", "constant"]:
        expect(f"[loss, gradient] of rows of 3 and 1 tokens, A = {adv}, loss_type={loss_type!r}, "
               "max_tokens=5",
               _grpo_loss(grpo, lp, old, adv, mask, loss_type=loss_type, max_tokens=5),
               _surrogate(lp, old, adv, mask, loss_type, max_tokens=5), tol=1e-9,
               wrong={mistakes.get(loss_type): _surrogate(lp, old, adv, mask, "B·T")})


@case("surrogate", "the k3 KL term: beta * (exp(ref - logp) - (ref - logp) - 1), and its gradient", 1)
def _(grpo):
    lp, mask, adv, ref = [[-1.0, -2.0, -0.5]], [[1, 1, 1]], [0.7], [[-1.5, -1.7, -0.5]]
    expect(f"[loss, gradient] with beta=0.1, ref_logprobs {ref}, logprobs {lp}, ratio 1",
           _grpo_loss(grpo, lp, lp, adv, mask, beta=0.1, ref_logprobs=ref),
           _surrogate(lp, lp, adv, mask, ref=ref, beta=0.1), tol=1e-9,
           wrong={"k3's sign (logprobs - ref)": _surrogate(lp, lp, adv, mask, ref=ref, beta=0.1,
                                                           k3_sign=True)})


@case("surrogate", "the dual clip bounds a token's loss by 3 |A| on the shared rows only", 1)
def _(grpo):
    lp, old, mask, adv = [[0.0], [0.0]], [[-math.log(5)], [-math.log(5)]], [[1], [1]], [-1.0, -1.0]
    settings = dict(dual=3.0, shared=[True, False])
    expect("[loss, gradient] of ratio 5, A = -1, rows shared [True, False], dual_clip=3",
           _grpo_loss(grpo, lp, old, adv, mask, dual_clip=3.0, shared=[True, False]),
           _surrogate(lp, old, adv, mask, **settings), tol=1e-9,
           wrong={"the dual clip on every row": _surrogate(lp, old, adv, mask, **settings,
                                                           dual_everywhere=True)})


# swarm.py: Store.sample


def _store(swarm, batches, clock=None):
    """A Store holding batches [(writer, number of groups), ...] published in turn (at clock's times)."""
    store = swarm.Store()
    for k, (writer, n) in enumerate(batches):
        if clock:
            clock[0] = clock[1 + k]
        store.publish(writer, k, f"batch-{k}", [{"question": f"{writer} {i}"} for i in range(n)])
    return store


def _drawn(store, k, exclude="", seed=0):
    texts, _ = store.sample(k, exclude, seed)
    return [(g["peer"], g["seq"]) for g in map(json.loads, texts)]


@case("store_sample", "a fast writer gets no more than its share: 2 writers, 1/2 each", 3)
def _(swarm):
    store = _store(swarm, [("fast", 100), ("fast", 100), ("slow", 3)])
    draws = [w for seed in range(300) for w, _ in _drawn(store, 2, seed=seed)]
    share = draws.count("slow") / max(len(draws), 1)
    if len(draws) != 600 or abs(share - 0.5) > 0.08:
        raise Failed(["300 reads of K=2 from 'fast' (2 batches of 100 groups) and 'slow' (3 groups)",
                      "expected 600 groups, slow's share 0.50 +- 0.08",
                      f"got      {len(draws)} groups, slow's share {share:.2f}"]
                     + ["this is what a draw uniform over groups, not writers gives"] * (share < 0.1))


@case("store_sample", "never the reader's own, never a group twice, at most K", 2)
def _(swarm):
    store = _store(swarm, [("a", 4), ("b", 3), ("c", 2)])
    everything = sorted(_drawn(store, 100, exclude="a", seed=1))
    others = [["b", 5], ["b", 6], ["b", 7], ["c", 8], ["c", 9]]
    expect("how many groups sample(K=100, exclude='a') draws of a: 4 groups, b: 3, c: 2", len(everything), 5,
           wrong={"drawn with replacement": 100, "the reader's own groups drawn": 9})
    expect("the groups sample(K=100, exclude='a') draws (peer, seq), sorted", everything, others,
           wrong={"the reader's own groups drawn": [["a", n] for n in range(1, 5)] + others})
    three = _drawn(store, 3, exclude="a", seed=2)
    expect("sample(K=3, exclude='a'): how many groups, and whether they are distinct",
           [len(three), len(set(three)) == len(three)], [3, True],
           wrong={"drawn with replacement": [3, False]})


@case("store_sample", "only each writer's newest window_batches (2) batches", 2)
def _(swarm):
    store = _store(swarm, [("w", 2), ("w", 2), ("w", 2)])
    expect("sample(K=100) of w's 3 batches of 2 groups (seq 1-2, 3-4, 5-6): the seqs drawn, sorted",
           sorted(s for _, s in _drawn(store, 100)), [3, 4, 5, 6],
           wrong={"every kept batch, not the window": [1, 2, 3, 4, 5, 6]})


@case("store_sample", "a writer whose newest batch is older than window_seconds (600) is left out", 2)
def _(swarm):
    clock, real = [0.0, 1000.0, 2000.0], swarm.time
    swarm.time = types.SimpleNamespace(time=lambda: clock[0])  # the store's clock, as these cases set it
    try:
        store = _store(swarm, [("old", 2), ("new", 2)], clock)
        clock[0] = 2599.0
        got = sorted(w for w, _ in _drawn(store, 100))
    finally:
        swarm.time = real
    expect("the writers sample(K=100) draws at time 2599 of 'old' (its batch at time 1000) and 'new' (2000)",
           got, ["new", "new"], wrong={"no expiry of silent writers": ["new", "new", "old", "old"]})


@case("store_sample", "the same state and seed give the same draw", 1)
def _(swarm):
    store = _store(swarm, [("a", 5), ("b", 5), ("c", 5)])
    expect("two reads sample(K=5, seed=7) of the same store", _drawn(store, 5, seed=7),
           _drawn(store, 5, seed=7))


# train.py: external_group


def _tokenizer(words=("What", "is", "+", "?", "no", "nope", "the", "answer", "system", "user", "assistant")):
    """A word-level tokenizer: these words, the numbers 0-99, <answer> and </answer> as single tokens, and
    a chat template whose turns the special tokens <|im_start|> and <|im_end|> mark."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "[UNK]", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + ["<answer>", "</answer>", *words, *map(str, range(100))])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tk.add_tokens([AddedToken("<answer>", special=False), AddedToken("</answer>", special=False)])
    template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>",
                                   unk_token="[UNK]", chat_template=template)


_TOKENIZER = []  # made once a process: building it imports transformers


def _received(train, completions, max_new_tokens=16, tasks=None, **change):
    """external_group of a one_digit_addition group (3 + 9) with these completions, all stopped."""
    import reward
    import swarm
    if not _TOKENIZER:
        _TOKENIZER.append(_tokenizer())
    tok, item = _TOKENIZER[0], reward.get_task("one_digit_addition").generate(random.Random(3))
    g = swarm.wire_group(item["task"], item["question"], item["answer"], completions,
                         [True] * len(completions), item["metadata"], "tiny")
    g = dict(g, peer="sender", round=0, seq=1, **change)
    got = train.external_group(tok, g, tok.eos_token_id, max_new_tokens, False, lambda *a: None, tasks=tasks)
    return _summary(got), tok


def _summary(group):
    return None if group is None else {"rewards": group.rewards, "stopped": group.stopped,
                                       "completions": group.completions, "texts": group.texts}


def _kept(train, tok, completions, rewards, max_new_tokens=16):
    """The summary of a Group that keeps these completions, re-tokenised, with these rewards."""
    kept = [train.retokenise(tok, c, True, tok.eos_token_id, max_new_tokens) for c in completions]
    return {"rewards": rewards, "stopped": [x[2] for x in kept], "completions": [x[0] for x in kept],
            "texts": [x[1] for x in kept]}


@case("external_group", "a group made here is re-tokenised and re-scored by the receiver", 3)
def _(train):
    completions = ["<answer> 12 </answer>", "no", "1 2 3 4 5 6 7 8 <answer> 12 </answer>"]
    got, tok = _received(train, completions, max_new_tokens=6)
    expect(f"external_group of 'What is 3 + 9?' completed {completions}, max_new_tokens=6", got,
           _kept(train, tok, completions, [1.0, 0.0, 0.0], 6),
           wrong={"the sender's text scored, not the re-tokenised one": _kept(train, tok, completions,
                                                                              [1.0, 0.0, 1.0], 6)})


@case("external_group", "a group whose answer does not follow from its question is dropped", 2)
def _(train):
    completions = ["<answer> 13 </answer>", "no"]
    got, tok = _received(train, completions, answer="13")
    expect(f"external_group of 'What is 3 + 9?' whose sender says the answer is 13, completed {completions}",
           got, None,
           wrong={"the sender's ground truth trusted (no verify_item)": _kept(train, tok, completions,
                                                                              [1, 0])})


@case("external_group", "rewards are of what is trained on: an answer cut off scores 0", 2)
def _(train):
    completions = ["1 2 3 4 5 6 7 8 <answer> 12 </answer>", "no"]
    got, tok = _received(train, completions, max_new_tokens=6)
    expect(f"external_group of 'What is 3 + 9?' completed {completions}, max_new_tokens=6 (both 0 as cut)",
           got, _kept(train, tok, completions, [0.0, 0.0], 6),
           wrong={"the sender's text scored, not the re-tokenised one": _kept(train, tok, completions,
                                                                              [1.0, 0.0], 6)})


@case("external_group", "a group of a task the receiver did not choose is dropped", 2)
def _(train):
    completions = ["<answer> 12 </answer>", "no"]
    got, tok = _received(train, completions, tasks=["two_digit_addition"])
    expect("external_group of a one_digit_addition group, tasks=['two_digit_addition']", got, None,
           wrong={"any task, not the receiver's": _kept(train, tok, completions, [1.0, 0.0])})


@case("external_group", "a question holding a special token's text is dropped (even if it verified)", 1)
def _(train):
    completions, real = ["<answer> 12 </answer>", "no"], train.reward.verify_item
    train.reward.verify_item = lambda g, tasks=None: True  # a family's check that let it through
    try:
        got, tok = _received(train, completions, question="What is 3 + 9?<|im_end|>")
    finally:
        train.reward.verify_item = real
    expect("external_group of 'What is 3 + 9?<|im_end|>', every group verifying", got, None,
           wrong={"special tokens in the question let through": _kept(train, tok, completions, [1.0, 0.0])})


# train.py: informative, draw_uniform


def _group(rewards):
    return types.SimpleNamespace(rewards=list(rewards))  # what informative reads of a Group


@case("selection_rule", "a group whose rewards are all equal is dropped; one with any spread is kept", 3)
def _(train):
    groups = [[0.0, 0.0, 0.0], [1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.5], [0.25], [1.0, 1.0, 0.0]]
    expect(f"informative of groups with rewards {groups}", [train.informative(_group(g)) for g in groups],
           [False, False, True, True, False, True],
           wrong={"groups with all-equal rewards kept": [True] * 6,
                  "only groups with a success kept": [False, True, True, True, True, True]})


@case("selection_rule", "kept exactly when GRPO's advantages are not all zero", 2)
def _(train):
    rng, disagree = random.Random(0), []
    for _ in range(200):
        rewards = [rng.choice([0.0, 0.5, 1.0]) for _ in range(rng.randint(1, 4))]
        advantages = train.grpo.group_advantages(train.torch.tensor(rewards), [len(rewards)]).tolist()
        if train.informative(_group(rewards)) != any(a != 0 for a in advantages):
            disagree.append(rewards)
    mistake = ("groups with all-equal rewards kept" if any(max(g) == 0 for g in disagree)
               else "only groups with a success kept")
    likely(expect, mistake, "the groups of 200 random ones (1 to 4 rewards of 0, 0.5 or 1) on which "
           "informative and 'some advantage is not 0' disagree", disagree[:4], [])


@case("selection_rule", "min(J, pool) distinct indices of the pool", 2)
def _(train):
    draws = [outcome(train.draw_uniform, random.Random(seed), list("abcde"), 3) for seed in range(50)]
    bad = [d for d in draws if isinstance(d, Raised) or len(d) != 3 or not set(d) <= {0, 1, 2, 3, 4}
           or len(set(d)) != 3]
    if bad:
        raise Failed(["draw_uniform(random.Random(seed), a pool of 5, J=3) for seeds 0..49",
                      "expected 3 distinct indices of 0..4 each time", f"got      {show(bad[0])} (and "
                      f"{len(bad) - 1} more draws not so)"]
                     + ["this is what drawn with replacement gives"] * any(len(set(d)) < len(d) for d in bad
                                                                          if isinstance(d, list)))
    few = outcome(train.draw_uniform, random.Random(1), list("ab"), 4)
    none = list(train.draw_uniform(random.Random(1), list("abcde"), 0))
    expect("draw_uniform of a pool of 2 with J=4 (sorted); of a pool of 5 with J=0",
           [sorted(few) if isinstance(few, list) else few, none], [[0, 1], []],
           wrong={"J even when the pool holds fewer": [RAISES, []]})


@case("selection_rule", "each group of the pool equally likely", 2)
def _(train):
    counts = [0] * 4
    for seed in range(2000):
        for k in train.draw_uniform(random.Random(seed), list("abcd"), 2):
            counts[k] += 1
    shares = [c / 2000 for c in counts]
    if any(abs(x - 0.5) > 0.05 for x in shares):
        raise Failed(["2000 draws of J=2 of a pool of 4 (seeds 0..1999): how often each index is drawn",
                      "expected 0.50 +- 0.05 each",
                      f"got      {', '.join(f'{x:.2f}' for x in shares)}"]
                     + ["this is what the first J, not a uniform draw gives"] * (shares[:2] == [1.0, 1.0]))


@case("selection_rule", "the draw is rng's: the same rng state, the same indices", 1)
def _(train):
    draws = []
    for other in range(5):
        random.seed(other)  # the global generator, which the draw must not read
        draws.append(list(train.draw_uniform(random.Random(7), list(range(10)), 3)))
    random.seed()
    likely(expect, "the global random module, not rng", "draw_uniform(random.Random(7), a pool of 10, J=3) "
           "five times, the global random module seeded 0..4 before each", draws, draws[:1] * 5)


# train.py: Algorithm1.choose_external


class _Client:
    """A swarm client whose k-th fetch() returns fetches[k] (then nothing); it counts the fetches."""

    def __init__(self, fetches):
        self.fetches, self.calls = list(fetches), 0

    def fetch(self):
        self.calls += 1
        return self.fetches.pop(0) if self.fetches else []


def _rule(train, **change):
    """The paper's rule as the cases write it: keep a group whose rewards differ, draw J uniformly."""
    paper = dict(keep=lambda g: len(set(g.rewards)) > 1,
                 draw=lambda rng, pool, J: rng.sample(range(len(pool)), min(J, len(pool))))
    return train.Rule("the paper's, or this change of it", **dict(paper, **change))


def _choosing(train, J, fetches, seed=0, client=True, rule=None):
    """An Algorithm1 with only what choose_external reads -> (it, the list of the lines it logs)."""
    peer, said = object.__new__(train.Algorithm1), []
    peer.args = types.SimpleNamespace(external=J, max_new_tokens=16, one_shot=False, system_prompt="default",
                                      task_list=["one_digit_addition"], seed=seed)
    peer.client = _Client(fetches) if client else None
    peer.tok, peer.stop_id, peer.pool, peer.log = None, 0, [], said.append
    peer.rule = rule or _rule(train)
    peer.external_rng = train.stream(seed, "external")
    return peer, said


def _choose(train, peer, rounds):
    """The groups [peer, seq] choose_external draws in each of these rounds, and its last counts, with an
    external_group that keeps every group but those marked bad, and scores those marked flat all 0."""
    real = train.external_group
    train.external_group = lambda tok, g, *a, **k: None if g.get("bad") else train.Group(
        g, [1], [[2]], ["x"], [True], [0.0, 0.0] if g.get("flat") else [1.0, 0.0], external=True)
    try:
        drawn, counts = [], None
        for r in rounds:
            external, counts = peer.choose_external(r)
            drawn.append([[x.item["peer"], x.item["seq"]] for x in external])
        return drawn, counts
    finally:
        train.external_group = real


def _wire(n, claimed_round=0, bad=(), flat=()):
    return [dict(peer=f"p{k % 3}", round=claimed_round, seq=k, bad=k in bad, flat=k in flat)
            for k in range(1, n + 1)]


@case("choose_external", "J distinct groups are drawn, or all when fewer; the undrawn stay pooled", 3)
def _(train):
    peer, _ = _choosing(train, 2, [_wire(5)])
    drawn, _ = _choose(train, peer, [0, 1, 2])
    seen = [tuple(x) for r in drawn for x in r]
    expect("how many groups J=2 draws in rounds 0, 1, 2 of 5 fetched in round 0, and how many distinct",
           [[len(r) for r in drawn], len(set(seen))], [[2, 2, 0], 4],
           wrong={"the undrawn groups discarded": [[2, 0, 0], 2]})
    peer, _ = _choosing(train, 3, [_wire(2)])
    expect("how many groups J=3 draws in rounds 0 and 1 of 2 fetched in round 0",
           [len(r) for r in _choose(train, peer, [0, 1])[0]], [2, 0])


@case("choose_external", "the counts say how many came and how many the rule kept", 1)
def _(train):
    peer, _ = _choosing(train, 2, [_wire(6, bad=(2,), flat=(5,))])
    expect("choose_external's counts for 6 groups fetched, 1 unusable, 1 whose rewards are all equal",
           _choose(train, peer, [0])[1], {"external_available": 6, "external_survived": 4},
           wrong={"the rule's keep ignored": {"external_available": 6, "external_survived": 5}})


@case("choose_external", "a group stays pool_rounds (2) of the receiver's rounds, whatever it says", 2)
def _(train):
    peer, _ = _choosing(train, 1, [_wire(3, claimed_round=6)])
    drawn, _ = _choose(train, peer, [5, 6, 7])
    expect("how many groups J=1 draws in rounds 5, 6, 7 of 3 that came in round 5 (their sender says 6)",
           [len(r) for r in drawn], [1, 1, 0],
           wrong={"the sender's round ages the pool": [1, 1, 1], "the arrival round not recorded": [0, 0, 0]})


@case("choose_external", "the draw depends on the groups, not on the order they arrived in", 2)
def _(train):
    groups = _wire(6)
    for seed in range(4):
        draws = []
        for order in (groups, groups[::-1], groups[2:] + groups[:2]):
            peer, _ = _choosing(train, 3, [list(order)], seed=seed)
            draws.append(sorted(_choose(train, peer, [0])[0][0]))
        likely(expect, "drawn in arrival order, not production order", f"the groups J=3 draws of 6, seed "
               f"{seed}, as they arrived in order, reversed and rotated", draws[1:], draws[:1] * 2)


@case("choose_external", "no swarm, or J = 0: nothing fetched, nothing drawn", 1)
def _(train):
    nothing = {"external_available": 0, "external_survived": 0}
    peer, _ = _choosing(train, 2, [_wire(3)], client=False)
    expect("choose_external without a client: [drawn, counts]", list(_choose(train, peer, [0])),
           [[[]], nothing])
    peer, _ = _choosing(train, 0, [_wire(3)])
    drawn, counts = _choose(train, peer, [0])
    expect("choose_external with J=0: [drawn, counts, fetches]", [drawn, counts, peer.client.calls],
           [[[]], nothing, 0],
           wrong={"fetched even when J = 0": [[[]], {"external_available": 3, "external_survived": 3}, 1]})


@case("choose_external", "another rule: its own keep, pool_rounds and draw", 1)
def _(train):
    odd = _rule(train, keep=lambda g: g.item["seq"] % 2 == 1, pool_rounds=3,
                draw=lambda rng, pool, J: list(range(min(J, len(pool)))))  # the first J in production order
    peer, _ = _choosing(train, 1, [_wire(6)], rule=odd)
    drawn, _ = _choose(train, peer, [0, 1, 2, 3])
    counts = [[len(r) for r in drawn], sorted(x[1] for r in drawn for x in r)]
    expect("of 6 groups fetched in round 0 (seq 1-6), a rule that keeps odd seqs for 3 rounds and draws "
           "J=1: how many it draws in rounds 0-3, and their seqs", counts, [[1, 1, 1, 0], [1, 3, 5]],
           wrong={"the rule's keep ignored": [[1, 1, 1, 0], [1, 3, 6]],
                  "two rounds, not the rule's pool_rounds": [[1, 1, 0, 0], [1, 3]]})
    likely(expect, "the paper's draw, not the rule's", "the groups [peer, seq] that rule, drawing the first "
           "of the pool in production order, draws in rounds 0-3", drawn,
           [[["p0", 3]], [["p1", 1]], [["p2", 5]], []])


if __name__ == "__main__":
    if hasattr(signal, "SIGPIPE"):  # python course.py list | head: the reader has read enough
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        sys.exit(main(sys.argv[1:]))
    except CourseError as e:
        sys.exit(f"course.py: {e}")
