"""Synthetic arithmetic problems with verifiable integer answers, built locally and deterministically.

Why this task: the project's demo must show SFT teaching a ~1M-parameter model *something* in a few CPU
minutes and GRPO then improving it measurably. Chains of small additions, subtractions and one
multiplication fit: every step is a short fact the model can learn, errors compound over steps (so
accuracy falls with difficulty instead of being all-or-nothing), and answers are exact integers that
math-verify checks.

A problem is a left-to-right chain ``a op b op c ...``. Multiplication only appears as the first
operation, so left-to-right evaluation and the usual operator precedence agree and the question is
unambiguous as written. Subtraction never goes below zero, so no answer needs a sign. The worked
solution writes one line per operation, e.g. for ``Compute 23+45-7.``::

    <think>23+45=68
    68-7=61</think> The answer is \\boxed{61}.

Every digit is its own token in our tokenizer, so a step (``23+45=68``) is about 8 tokens and a whole
answer with the default knobs is at most ~45 tokens including the eos: cheap to sample on a CPU.

Difficulty knob: ``max_steps`` (operations per problem) and ``max_digits`` (digits per operand); each
problem draws its own steps in ``1..max_steps`` and digits in ``1..max_digits`` uniformly, so one file
mixes easy and hard problems and a partly trained model gets some right and some wrong. Questions are
unique within and across splits up to their wording (keyed on the expression: "What is 1*7?" and "Compute
1*7." are one problem), so a small cell (1 step, 1 digit: a few hundred distinct expressions) is
represented by at most its distinct expressions.

Shortcut answers (what gives RL room to improve): a fraction ``shortcut_fraction`` of the SFT answers
skip the worked lines and write the whole chain in one line, ``<think>23+45-7=61</think> ...``. Both
styles are correct, but a small model gets the one-line shortcut of a multi-step chain mostly wrong
and the step-by-step trace mostly right. After SFT the model uses both styles (the shortcut more often
when the fraction is above 1/2, so greedy decoding picks it); GRPO rewards the worked style, so
accuracy rises along with response length as the policy learns to work problems out.

Measured (tiny preset, defaults below, plain PyTorch AdamW, batch 32, lr 3e-3 -> 3e-4 cosine, 5%
warmup; on-policy GRPO 32 prompts x 8 samples, T=1, lr 3e-5..1e-4; held-out greedy accuracy, 3 seeds):
after 1,000 SFT steps 34-51%; after 100 GRPO steps 55-74% (+9 to +37 points). Those runs had the leaky split
of before 2026-11-30 (test problems in the training sets in another wording), so they overstate held-out accuracy;
docs/performance.md has the demo on the clean split. Without shortcuts,
SFT on 1-digit chains reaches 80% after 600 steps and 99% after 900, leaving RL nothing to do.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

QUESTION_TEMPLATES = ("Compute {expr}.", "What is {expr}?", "Calculate {expr}.", "Evaluate {expr}.")
ANSWER_TEMPLATE = "<think>{work}</think> The answer is \\boxed{{{answer}}}."
# Consecutive duplicate draws after which the problem space counts as exhausted.
MAX_MISSES_IN_A_ROW = 2000


@dataclass(frozen=True)
class Problem:
    """One arithmetic chain: the question text, the worked lines and the integer answer."""

    question: str
    # The chain as written in the question, e.g. "23+45-7".
    expression: str
    # One line per operation, "lhs op rhs=result", in evaluation order.
    work_lines: tuple[str, ...]
    answer: int

    def solution(self, shortcut: bool = False) -> str:
        """The assistant's answer: worked lines (or the one-line shortcut) in <think>, then the boxed result."""
        work = f"{self.expression}={self.answer}" if shortcut else "\n".join(self.work_lines)
        return ANSWER_TEMPLATE.format(work=work, answer=self.answer)


@dataclass(frozen=True)
class DataPaths:
    """Files written by `make_data`."""

    sft_train: Path
    sft_test: Path
    rl_train: Path
    rl_test: Path


def _operand(rng: random.Random, num_digits: int) -> int:
    # Draw the digit count first so 1-digit operands are common even in a 2-digit problem.
    digits = rng.randint(1, num_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def make_problem(rng: random.Random, *, num_steps: int, num_digits: int) -> Problem:
    """Draw one chain with exactly `num_steps` operations on operands of at most `num_digits` digits."""
    if num_steps < 1 or num_digits < 1:
        raise ValueError(f"num_steps={num_steps}, num_digits={num_digits}: both must be >= 1")
    value = _operand(rng, num_digits)
    expr = str(value)
    lines = []
    for step in range(num_steps):
        op = rng.choice("+-*" if step == 0 else "+-")
        # Multiply by one digit only: a 2-digit x 2-digit product is far beyond a tiny model.
        rhs = rng.randint(2, 9) if op == "*" else _operand(rng, num_digits)
        if op == "-" and rhs > value:
            op = "+"
        result = {"+": value + rhs, "-": value - rhs, "*": value * rhs}[op]
        lines.append(f"{value}{op}{rhs}={result}")
        expr += f"{op}{rhs}"
        value = result
    question = rng.choice(QUESTION_TEMPLATES).format(expr=expr)
    return Problem(question=question, expression=expr, work_lines=tuple(lines), answer=value)


def sample_problem(rng: random.Random, *, max_steps: int, max_digits: int) -> Problem:
    """Draw the difficulty (steps, digits) uniformly, then a problem of that difficulty."""
    return make_problem(rng, num_steps=rng.randint(1, max_steps), num_digits=rng.randint(1, max_digits))


def _unique_problems(
    rng: random.Random, count: int, *, max_steps: int, max_digits: int, exclude: set[str]
) -> list[Problem]:
    # Duplicate problems would leak between train and test: keyed on the expression, since the same chain in
    # another wording template is the same problem (keyed on the question, about half of the 500 test
    # problems were in the training sets reworded). When the space of distinct expressions is used up (e.g.
    # max_steps=1, max_digits=1), draws keep colliding: stop with a clear message.
    problems: list[Problem] = []
    seen = set(exclude)
    misses_in_a_row = 0
    while len(problems) < count:
        problem = sample_problem(rng, max_steps=max_steps, max_digits=max_digits)
        if problem.expression in seen:
            misses_in_a_row += 1
            if misses_in_a_row > MAX_MISSES_IN_A_ROW:
                raise ValueError(
                    f"only {len(problems)} distinct problems found for count={count} with "
                    f"max_steps={max_steps}, max_digits={max_digits}: raise max_steps/max_digits or ask for fewer"
                )
            continue
        misses_in_a_row = 0
        seen.add(problem.expression)
        problems.append(problem)
    return problems


def sft_record(problem: Problem, shortcut: bool = False) -> dict[str, object]:
    """SFT row: a chat `messages` list (user question, assistant answer)."""
    return {
        "messages": [
            {"role": "user", "content": problem.question},
            {"role": "assistant", "content": problem.solution(shortcut)},
        ]
    }


def rl_record(problem: Problem) -> dict[str, object]:
    """RL row in the dapo-math-17k shape: `prompt` chat list and `label` answer string."""
    return {"prompt": [{"role": "user", "content": problem.question}], "label": str(problem.answer)}


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    # Fixed key order and separators so equal seeds give byte-identical files.
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    path.write_text(text, encoding="utf-8")


# The files make_data writes, in DataPaths' order.
DATA_FILES = ("sft_train.jsonl", "sft_test.jsonl", "rl_train.jsonl", "rl_test.jsonl")


def make_data(
    out_dir: str | Path,
    *,
    seed: int = 0,
    num_sft: int = 20000,
    num_rl: int = 4000,
    num_test: int = 500,
    max_steps: int = 4,
    max_digits: int = 1,
    shortcut_fraction: float = 0.6,
) -> DataPaths:
    """Write sft_train/sft_test/rl_train/rl_test jsonl files to `out_dir`; same seed, same bytes.

    The test problems are drawn first and excluded from both training sets, and `sft_test.jsonl` and
    `rl_test.jsonl` hold the same problems (in the two shapes), so SFT accuracy and RL accuracy are
    measured on one held-out set. RL training prompts may repeat SFT training problems, as in practice.
    """
    for name, value in (("num_sft", num_sft), ("num_rl", num_rl), ("num_test", num_test)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    if not 0.0 <= shortcut_fraction <= 1.0:
        raise ValueError(f"shortcut_fraction={shortcut_fraction}: must be in [0, 1]")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    knobs = {"max_steps": max_steps, "max_digits": max_digits}
    test = _unique_problems(rng, num_test, exclude=set(), **knobs)
    held_out = {p.expression for p in test}
    sft_train = _unique_problems(rng, num_sft, exclude=held_out, **knobs)
    # RL prompts only need to avoid the test set; repeats of SFT problems are fine.
    rl_train = _unique_problems(rng, num_rl, exclude=held_out, **knobs)
    paths = DataPaths(*(out / name for name in DATA_FILES))
    # A separate stream for the style draws, so the problems do not depend on shortcut_fraction.
    style_rng = random.Random(f"{seed}-style")
    _write_jsonl(paths.sft_train, [sft_record(p, style_rng.random() < shortcut_fraction) for p in sft_train])
    _write_jsonl(paths.sft_test, [sft_record(p, style_rng.random() < shortcut_fraction) for p in test])
    _write_jsonl(paths.rl_train, [rl_record(p) for p in rl_train])
    _write_jsonl(paths.rl_test, [rl_record(p) for p in test])
    return paths


def tokenizer_corpus(num_examples: int = 2000, seed: int = 1234) -> list[str]:
    """Texts the tokenizer's merges are learned from: the fixed phrases plus generated examples."""
    rng = random.Random(seed)
    texts = [t.format(expr="1+2") for t in QUESTION_TEMPLATES]
    for _ in range(num_examples):
        problem = sample_problem(rng, max_steps=3, max_digits=2)
        texts.extend((problem.question, problem.solution()))
    return texts
