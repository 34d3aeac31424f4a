"""
Writes docs/glossary.md: every symbol and term of the SAPO paper's method (arXiv 2509.08721, Sec. 3 and
Algorithm 1, and the GRPO update of its experiments) beside the file, function and lines that implement
it, and where the code deviates. The lines are read from the code (ast) each time, so they follow it.

    python docs/glossary.py            # writes docs/glossary.md
    python docs/glossary.py --check    # exits 1, saying so, if docs/glossary.md is not what it would write

tests/test_glossary.py fails when docs/glossary.md is stale. A term is one entry of TERMS or ALGORITHM:
its name, what it means in the paper, where it lives ("file.py:name", a class's method as Class.method),
and what the code does otherwise ("" where it follows the paper).
"""

import ast
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "glossary.md")

TERMS = [
    ("SAPO", "Swarm sAmpling Policy Optimization: each node trains its own policy with RL on verifiable tasks "
     "and, every round, trains on its own rollouts plus some that other nodes shared",
     ["train.py:Algorithm1"], "The paper's nodes exchange rollouts over a peer-to-peer network; here one "
     "swarm.py server (or several over Redis) holds them (swarm.py's docstring)."),
    ("swarm", "the set of nodes that share rollouts, with no central trainer and no shared weights",
     ["swarm.py:Store", "swarm.py:Client", "train.py:launch"], "`train.py --peers N` starts a server and N "
     "peers on one machine; `reproduce.py` runs a swarm's peers in one process in synchronous rounds."),
    ("node, peer (n)", "one member of the swarm: its own policy, its own questions, its own reward model",
     ["train.py:Algorithm1.__init__", "train.py:Peer"], "Peer k of a launched swarm gets the seed "
     "peer_seed(seed, k); it names itself peer0, peer1, ... there."),
    ("policy", "the node's language model, which it samples from and trains",
     ["model.py:Transformer", "train.py:Algorithm1.__init__"], "Trained in float32; it samples from a "
     "bfloat16 copy on a GPU, refreshed after every step (Algorithm1.update)."),
    ("round (t)", "one pass of Algorithm 1: sample, share, choose, update",
     ["train.py:Algorithm1.round", "train.py:Algorithm1.collect", "train.py:Algorithm1.learn"],
     "reproduce.py runs the swarm's peers in synchronous rounds (every peer collects, then every peer "
     "learns), so a run is deterministic; launched peers never wait for each other."),
    ("question, task, dataset", "a verifiable problem with its ground truth and metadata, drawn from "
     "task families (nine ReasoningGym families in the paper)",
     ["reward.py:Task", "reward.py:PAPER_TASKS", "reward.py:get_task", "train.py:Algorithm1.questions"],
     "The nine families are written from scratch (docs/rewards.md); easy families give a 135M model some "
     "reward; the toy of reproduce.py asks alphabet_position."),
    ("I", "the local groups a node trains on in a round: questions it drew and sampled itself",
     ["train.py:Algorithm1.questions", "train.py:learning_flags"], "--local; in silo (J = 0) a peer takes "
     "I + J, as the paper's baseline 8/0 against 4/4. A CPU's default is 2, not 4."),
    ("J", "the external groups a node trains on in a round, sampled from what the others shared",
     ["train.py:Algorithm1.choose_external", "train.py:learning_flags"], "--external; fewer when fewer "
     "usable groups came (a peer never waits). A CPU's default is 2, not 4."),
    ("G", "the completions (rollouts) sampled for each question; 8 in the paper's runs",
     ["train.py:Algorithm1.sample_local", "sample.py:generate"], "--generations; a CPU's default is 4."),
    ("rollout, completion", "one answer the policy sampled for a question",
     ["sample.py:generate", "sample.py:prefill", "sample.py:decode_step", "sample.py:sample_token"],
     "Sampled by a hand-written KV-cache sampler, not transformers' generate()."),
    ("group", "a question with its G completions and their rewards: the unit GRPO normalises over",
     ["train.py:Group"], ""),
    ("verifier, reward model (ρ)", "the program that scores a completion against the ground truth; each "
     "node uses its own", ["reward.py:score", "reward.py:extract_answer", "reward.py:Task.score_answer"],
     "Scores as ReasoningGym's score_answer does (partial credit included); the toy's reward is 0 or 1."),
    ("experience sharing", "a node publishes its rollouts as decoded text with the question, ground truth "
     "and metadata; never weights, gradients or rewards",
     ["train.py:Algorithm1.publish", "swarm.py:wire_group", "swarm.py:Client.publish", "swarm.py:Store.publish"],
     "Beyond the paper, --shared-logprobs also shares each completion's token ids and sampling log-probs."),
    ("sampling the swarm", "a node takes external rollouts from what the others shared",
     ["swarm.py:Store.sample", "swarm.py:Client.fetch", "train.py:connect"], "A peer reads 4J groups a "
     "round, drawn from each writer's newest batches with every writer alike, not everything shared."),
    ("re-tokenisation", "a shared completion is text; the receiver turns it into its own token ids",
     ["train.py:retokenise"], "Special-token strings stay text; a completion longer than --max-new-tokens "
     "is cut there and scored as cut."),
    ("re-scoring", "the receiver computes a shared completion's reward with its own verifier",
     ["train.py:external_group"], "Groups whose answer does not follow from their question are dropped "
     "(reward.verify_item); the paper trusts the sender's ground truth."),
    ("selection rule", "which shared groups a receiver keeps and how it draws J of them; the paper drops "
     "groups whose rewards are all equal and draws J of the rest uniformly",
     ["train.py:RULES", "train.py:Rule", "train.py:informative", "train.py:draw_uniform",
      "train.py:Algorithm1.choose_external"], "Undrawn groups stay in the pool for 2 of the receiver's "
     "rounds. --rule NAME runs another rule of RULES; reproduce.py's I/J+NAME compares it with the paper's."),
    ("zero-advantage group", "a group whose rewards are all equal: its advantages are 0 and GRPO learns "
     "nothing from it", ["train.py:informative", "grpo.py:group_advantages"], "Local ones stay in the "
     "batch, as in the paper; metrics.jsonl counts them (frac_zero_std_local, frac_zero_std_batch)."),
    ("advantage (A)", "a completion's reward minus its group's mean, divided by the group's std",
     ["grpo.py:group_advantages", "train.py:Algorithm1.batch"], "The std is unbiased, plus 1e-4; "
     "--adv-scale batch or none divides otherwise."),
    ("GRPO objective", "the clipped surrogate of PPO with group-normalised advantages, no value model",
     ["grpo.py:grpo_loss", "grpo.py:step", "train.py:Algorithm1.update"], "Token losses are averaged over "
     "the batch's tokens (token_mean, as the paper's code); --loss-type offers GRPO's and Dr. GRPO's."),
    ("epsilon (ε)", "the clip range of the importance ratio", ["grpo.py:grpo_loss", "train.py:learning_flags"],
     "Clipped to [1 - 0.2, 1 + 0.28] (DAPO's clip-higher); with one optimizer step a round the ratio is 1 "
     "and the clip never acts, as in the paper's code."),
    ("beta (β)", "the weight of the KL penalty to a reference policy", ["grpo.py:grpo_loss", "train.py:load_models"],
     "0 by default, as in the paper's runs; with beta > 0 the k3 estimator against the initial model."),
    ("old policy, importance ratio", "the policy that sampled the rollouts, and the new policy's "
     "probability over it", ["grpo.py:step", "grpo.py:grpo_loss", "train.py:Algorithm1.behaviour"],
     "A shared completion's old log-probs are the receiver's own, as in the paper; the rule `is` (--rule is, "
     "or --shared-logprobs) takes the sender's, under a dual clip (docs/offpolicy.md)."),
    ("policy update", "one policy-gradient step on the round's I + J groups",
     ["train.py:Algorithm1.update", "grpo.py:step"], "AdamW at 1e-5 with gradient clipping at 1.0 "
     "(docs/learning-rate.md); --inner-steps takes more than one step a round."),
    ("silo", "a node that trains alone: the paper's baseline, 8/0 (I = 8, J = 0)",
     ["train.py:parse_args", "reproduce.py:parse_configs"], "A peer with J = 0 or no swarm takes I + J "
     "local groups, so the silo trains on as many groups as a swarm peer."),
    ("configuration I/J", "how many local and external groups a node trains on (8/0, 6/2, 4/4, 2/6)",
     ["reproduce.py:parse_configs", "reproduce.py:PAPER"], "I/J+NAME runs the selection rule NAME."),
    ("cumulative reward", "the paper's measure: reward summed over every node and every round",
     ["reproduce.py:cumulative", "reproduce.py:summarise"], "Compared as a ratio to 8/0 of the same seed "
     "(paired seeds), over the local reward (a peer's own completions) and the batch reward."),
    ("local reward, batch reward", "a node's reward on its own completions; on its whole training batch",
     ["train.py:Algorithm1.log_round"], "The paper's figure is the batch reward, which counts the shared "
     "groups (always of mixed reward); reproduce.py's ratios are of the local reward, the skill."),
    ("Table 1, Fig. 2", "the paper's cumulative reward per configuration, and reward per round",
     ["reproduce.py:table_md", "reproduce.py:reward_svg"], "At toy scale: a 106k-parameter model, 26 facts, "
     "150 rounds, not Qwen2.5-0.5B over 2,000 rounds (docs/reproduce.md)."),
    ("system prompt", "the instruction every question is asked under", ["reward.py:SYSTEM_PROMPTS",
     "reward.py:prompt_ids"], "Ours by default (--system-prompt rg: ReasoningGym's, the paper's), and a "
     "worked example of the family as an earlier turn (--one-shot)."),
    ("paired seeds", "(not in the paper) runs of different configurations that ask the same questions",
     ["train.py:stream", "train.py:peer_seed"], "Questions, sampling and external draws are separate "
     "random streams of a peer's seed, so 8/0 and 4/4 of one seed differ only in what is shared."),
]

ALGORITHM = [  # Algorithm 1 of the paper, line by line, as train.py's docstring numbers its steps
    ("1. draw a batch of questions", "a node draws I questions of its tasks", ["train.py:Algorithm1.questions"], ""),
    ("2. generate rollouts", "G completions of each, scored by its verifier",
     ["train.py:Algorithm1.sample_local"], ""),
    ("3. share", "publish the questions, ground truths, metadata and completions",
     ["train.py:Algorithm1.publish"], "A peer publishes all its groups, never their rewards."),
    ("4. sample the swarm", "take what the others shared", ["train.py:Algorithm1.choose_external"],
     "A sample of 4J groups a round (swarm.Store.sample)."),
    ("5. choose the training set", "I local and J external groups, filtered as the node likes",
     ["train.py:external_group", "train.py:Algorithm1.choose_external"],
     "Re-tokenised and re-scored locally; untrusted items dropped; the selection rule is train.RULES."),
    ("6. update the policy", "a policy-gradient step (GRPO) on the training set",
     ["train.py:Algorithm1.update", "grpo.py:step"], ""),
    ("7. the next round", "the loop over rounds", ["train.py:Algorithm1.log_round", "train.py:Peer.run"],
     "Each round is logged to metrics.jsonl, with a checkpoint every --save-every rounds."),
]


@functools.lru_cache(maxsize=None)
def tree(file):
    """A file's top-level statements, parsed once."""
    with open(os.path.join(ROOT, file), encoding="utf-8") as f:
        return ast.parse(f.read()).body


def span(ref):
    """'train.py:Algorithm1.choose_external' -> (file, name, first line, last line), from the file's ast."""
    file, name = ref.split(":")
    body = tree(file)
    node = None
    for part in name.split("."):
        node = next((n for n in body if getattr(n, "name", None) == part or part in
                     [getattr(t, "id", None) for t in getattr(n, "targets", [])]), None)
        if node is None:
            raise SystemExit(f"docs/glossary.py: {ref} names nothing in {file}: fix TERMS or ALGORITHM")
        body = getattr(node, "body", [])
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return file, name, first, node.end_lineno


def where(refs):
    """The 'in the code' cell: a link to each place, with its lines."""
    cells = []
    for ref in refs:
        file, name, first, last = span(ref)
        cells.append(f"[{file} `{name}`, {first}–{last}](../{file}#L{first}-L{last})")
    return "<br>".join(cells)


def render():
    """docs/glossary.md's text."""
    lines = ["# Glossary: the paper, mapped to the code", "",
             "Each term of the SAPO paper's method (arXiv 2509.08721, Sec. 3, Algorithm 1 and the GRPO update "
             "of its experiments), where the code implements it (file, function, lines) and where it does "
             "otherwise. Written by `python docs/glossary.py` from the code; `tests/test_glossary.py` fails "
             "when this file is stale.", "",
             "| term | in the paper | in the code | where the code differs |", "|---|---|---|---|"]
    lines += [f"| {term} | {meaning} | {where(refs)} | {differs or 'as in the paper'} |"
              for term, meaning, refs, differs in TERMS]
    lines += ["", "## Algorithm 1, line by line", "",
              "| step | in the paper | in the code | where the code differs |", "|---|---|---|---|"]
    lines += [f"| {step} | {meaning} | {where(refs)} | {differs or 'as in the paper'} |"
              for step, meaning, refs, differs in ALGORITHM]
    return "\n".join(lines) + "\n"


def main(argv):
    text = render()
    if argv == ["--check"]:
        with open(OUT, encoding="utf-8") as f:
            stale = f.read() != text
        print("docs/glossary.md is stale: run python docs/glossary.py" if stale else "docs/glossary.md is current")
        return int(stale)
    if argv:
        raise SystemExit("usage: python docs/glossary.py [--check]")
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
