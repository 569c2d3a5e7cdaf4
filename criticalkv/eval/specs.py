"""Policy specifications of an evaluation: ``--policies a,b:knob=value,...`` x ``--budgets``.

A spec is a policy name from ``KVPolicy``'s registry, optionally followed by ``:knob=value`` overrides
(``criticalkv:stage2_scores=raw``, ``ada-criticalkv:alpha=0.5:value_norm=l2``); the knobs not given
come from the command's ``KVPolicy`` flags, the budget from ``--budgets``. ``full`` runs once,
whatever the budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

from criticalkv.methods import BASE_METHODS, METHODS
from criticalkv.policy import KVPolicy, parse_policy_spec  # noqa: F401 (the evaluations' spec parser)

@dataclass(frozen=True)
class PolicyRun:
    """One (policy spec, budget) cell of an evaluation; ``key`` names it in the results."""

    spec: str
    budget: int | None
    policy: KVPolicy

    @property
    def key(self) -> str:
        return self.spec if self.budget is None else f"{self.spec}@{self.budget}"


def default_policy_specs(pairs_only: bool = False) -> list[str]:
    """Every policy of the registry, each two-stage one also with ``stage2_scores=raw``, grouped by base method.

    ``pairs_only``: only the two-stage policies and the bases they refine (the perturbation analysis).
    """
    specs = []
    for base in BASE_METHODS.values():
        refined = [m.name for m in METHODS.values() if m.base is base and m.refine is not None]
        if pairs_only and not refined:
            continue
        specs.append(base.name)
        for name in refined:
            specs += [name, f"{name}:stage2_scores=raw"]
    return specs


def parse_list(text: str, flag: str, kind=int) -> list:
    """Comma-separated numbers; an empty list or a bad item is a clear error."""
    items = [t.strip() for t in (text or "").split(",") if t.strip()]
    if not items:
        raise ValueError(f"{flag}: give at least one value (comma-separated)")
    out = []
    for t in items:
        try:
            out.append(kind(t))
        except ValueError:
            raise ValueError(f"{flag}: {t!r} is not a valid {kind.__name__}") from None
    if len(set(out)) != len(out):
        raise ValueError(f"{flag}: {text!r} repeats a value")
    return out


def expand_runs(policies: str, budgets: list[int], base: KVPolicy) -> list[PolicyRun]:
    """Every (spec, budget) run; ``full`` once with budget None. Budgets are validated by KVPolicy."""
    specs = [s.strip() for s in (policies or "").split(",") if s.strip()]
    if not specs:
        raise ValueError("--policies: give at least one policy (comma-separated)")
    if len(set(specs)) != len(specs):
        raise ValueError(f"--policies: {policies!r} repeats a policy")
    if not budgets:
        raise ValueError("--budgets: give at least one budget")
    runs = []
    for spec in specs:
        policy = parse_policy_spec(spec, base)
        if policy.name == "full":
            runs.append(PolicyRun(spec, None, policy))
            continue
        for budget in budgets:
            try:
                runs.append(PolicyRun(spec, budget, policy.replace(budget=budget)))
            except ValueError as err:
                raise ValueError(f"--budgets: {budget} for {spec!r}: {err}") from None
    return runs


def check_lengths(lengths: list[int], runs: list[PolicyRun]) -> None:
    """Every prompt must fill the window and be longer than every budget (else nothing is evicted)."""
    for length in lengths:
        for run in runs:
            if length <= run.policy.window:
                raise ValueError(f"--lengths: {length} is not longer than the window ({run.policy.window} tokens)")
            if run.budget is not None and length <= run.budget:
                raise ValueError(
                    f"--lengths: {length} is not longer than the budget {run.budget} of {run.spec!r}: "
                    "nothing would be evicted (use longer prompts or smaller budgets)"
                )
