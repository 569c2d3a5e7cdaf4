"""What every base eviction method provides (one subclass per module of this package).

A base method decides two things for one attention layer: the scores its older tokens are ranked by
and how the layer's budget is shared among its KV heads. ``criticalkv.selection.select_layer`` (PyTorch)
and ``criticalkv.export.select_function`` (the ONNX function body) drive a method through this
interface; neither names a method. A refinement (``two_stage.TwoStage``, CriticalKV) then picks, inside
each head's share, which tokens are kept. A model-level method (``model_level``) also ranks each layer's tokens
(``priority``) and shares one budget over every layer (``model_allocate``): ``criticalkv.selection.select_model``
and ``criticalkv.export.model_select`` call those hooks.

The ONNX pieces are written into the graph builder they are given (``g``, a ``criticalkv.export.graph.GraphBuilder``:
``g.Add(...)`` appends a node, ``g.FLOAT`` is the float element type), with the function body's own helpers
(``body.topk_mask``, ``body.head_floor``, ``body.value_norms``, ...): the methods import nothing of the exporter.

Shapes: B batch, H_kv KV heads, G query heads per KV head, w window, m = n - w older tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from criticalkv.methods.knobs import Knobs, knob_names
from criticalkv.methods.lazy import torch

if TYPE_CHECKING:
    from criticalkv.methods.phases import PromptScoring, Stream

#: A ``criticalkv.policy.KVPolicy`` (the policy stands a floor above the methods: it imports their registry).
Policy = Any


@dataclass(frozen=True)
class Allocation:
    """How a layer's selectable budget is shared among its KV heads (one of the two is set).

    counts : [B, H_kv] int64, older tokens each head keeps (chosen by the base's score unless refined)
    mask : [B, H_kv, m] bool, the base's own choice of older tokens (its per-head sums are the counts)
    """

    counts: Any = None
    mask: Any = None


@dataclass(frozen=True)
class GroupScoreInputs:
    """Window scores of the G query heads of one KV group (PyTorch, fp32).

    probs : [B, G, w, m] window attention over the older tokens; raw : [B, G, m] its mean over the window;
    pooled : [B, G, m] ``raw`` max-pooled over positions; norms(kind) -> [B, G, m] projected-value norms;
    valid : [B, m] bool, older positions that are not left padding; values : [B, m, d_h] the group's older values;
    w_heads : [G, d_h, d] fp32, W_O^h of the group's query heads.
    """

    probs: "torch.Tensor"
    raw: "torch.Tensor"
    pooled: "torch.Tensor"
    norms: Callable[[str], "torch.Tensor"]
    valid: "torch.Tensor" = None
    values: "torch.Tensor" = None
    w_heads: "torch.Tensor" = None


#: Why the per-layer CriticalKVSelect plugin refuses a model-level method (its ``cpp_refusal``).
MODEL_LEVEL_REFUSAL = ("shares the budget across all layers, and the CriticalKVSelect plugin selects one layer per node: "
                       "its graph selects with a CriticalKVScore node per layer and one CriticalKVSelectModel node "
                       "(plugins/README.md)")


class BaseMethod:
    """A budget-allocation base method. Subclasses set the class attributes and override what differs.

    Attributes
    ----------
    name : the method's name (a policy of its own)
    cpp_enum : its ``criticalkv::BaseMethod`` enumerator in the generated C++ header
    description : one line for ``criticalkv policies`` and the README table
    Knobs : the dataclass of the knobs the method reads besides ``name``, ``budget`` and ``window``
        (``criticalkv.methods.knobs``; ``knobs``: their names)
    evicts : False for ``full`` (every entry kept)
    scored : whether it ranks older tokens by window attention (the window is then always kept)
    shared_allocation : whether the layer's H_kv * r slots are shared across heads (per-head floor)
    own_l2_norms : whether its own score needs the l2 projected-value norms
    score_name : the score its own choice ranks by (``scores[score_name]``)
    score_knobs : the knobs its scores depend on (scores are memoised per prompt by these, not by budget)
    row_scores : whether its score reads every window query's attention row, not only their mean (defensivekv)
    model_level : whether the budget is shared across all layers (``select_model`` selects after the last layer)
    native : whether the per-layer CriticalKVSelect plugin (TensorRT) selects it; otherwise the plugin refuses it
    cpp_refusal : why the plugin refuses a method that is not native (the generated validation's message)
    kernels : whether the CUDA kernels and the host version select it through the torch ops (``criticalkv.selection.op``:
        per layer, or over every layer for a ``model_level`` method, with the external scores as an input where it
        reads them); the plugin may still refuse it (``native``)
    kernels_refusal : why the kernels do not select a method whose ``kernels`` is False
    pools : whether its attention is max-pooled over positions (``pool_kernel``) before it ranks
    needs_rotation : whether it reads RoPE's rotation tables (``expected_attention.rotation_tables``): the drivers then
        take them (``select_layer(rotation=...)``, the selection node's input ``rotation``)
    external_scores : whether it ranks by a per-entry score computed outside the layer's selection (``kvzip``: the
        attention of a context reconstruction through the whole model): the drivers then take it
        (``select_layer(scores=...)``, the selection node's input ``scores``; none given: ``attention_rows``), and
        the method's phases compute it (``criticalkv.methods.phases``: ``streams``, ``rereads``, ``engine_data``,
        ``prompt_scoring``), which the engine, the exporter and the backends run without knowing the method; a graph
        that runs no phase (the TensorRT flavour) computes it only where one stream gives it (``graph_stream``; else
        ``graph_refusal``)
    data_key : the key of its data in an engine's manifest (``method_data``; ``engine_data``)
    """

    name: str = ""
    cpp_enum: str = ""
    description: str = ""
    Knobs: type[Knobs] = Knobs
    evicts: bool = True
    scored: bool = True
    shared_allocation: bool = False
    own_l2_norms: bool = False
    score_name: str = "attention"
    row_scores: bool = False
    model_level: bool = False
    native: bool = True
    cpp_refusal: str = ""
    kernels: bool = True
    kernels_refusal: str = ""
    score_knobs: tuple[str, ...] = ("pool_kernel",)
    pools: bool = True
    needs_rotation: bool = False
    external_scores: bool = False
    #: names of the per-token scores ``group_scores`` adds (besides "attention", which every scored method has)
    score_names: tuple[str, ...] = ()
    data_key: str = ""

    @property
    def knobs(self) -> tuple[str, ...]:
        """The names of the knobs the method reads (``Knobs``'s fields, in declaration order)."""
        return knob_names(self.Knobs)

    @property
    def equal_head_lengths(self) -> bool:
        """Whether every KV head of a layer keeps as many entries as the others (per sequence): true unless the layer's
        or the model's budget is shared across heads (``shared_allocation``, ``model_level``). Layers may still differ
        (pyramidkv). The fused decode graph of an engine whose heads hold equal lengths needs no per-head mask."""
        return not (self.shared_allocation or self.model_level)

    # ------------------------------------------------------------------ budget arithmetic (integers)
    def layer_budget(self, policy: Policy, r: int, layer_idx: int, num_layers: int) -> int:
        """r_l: older tokens per KV head (average over the layer's heads) that layer ``layer_idx`` may keep when
        the model-wide average is ``r`` (= budget - window)."""
        return r

    def max_older_per_head(self, policy: Policy, r: int, m: int, num_kv_heads: int) -> int:
        """Most older tokens one head of a layer with budget r can keep out of m."""
        return min(r, m)

    def sinks(self, policy: Policy) -> int:
        """How many of the first (valid) tokens are always kept, inside the budget (0: none)."""
        return 0

    def rotation_table(self, policy: Policy, inv_freq: "np.ndarray | None", head_dim: int) -> "np.ndarray":
        """The constant [2, >= window, d_h] float32 a method that reads RoPE's rotation (``needs_rotation``) takes as
        its input ``rotation``, from the model's RoPE angles ``inv_freq`` [d_h / 2] (None: RoPE's default, base
        10000). The exporter and the selection node's standalone model call it without knowing the method."""
        raise NotImplementedError(f"{self.name} reads no rotation tables (needs_rotation is False)")

    # ------------------------------------------------------------------ PyTorch
    def attention_rows(self, policy: Policy, queries, keys, valid_start, rotation, m: int):
        """The attention the method ranks by, for one KV group: (probs [B, G, rows, m], raw [B, G, m] = the rows'
        mean) over the older tokens, from ``queries`` [B, G, w, d_h] and ``keys`` [B, G, n, d_h] (post-RoPE).
        None (the default): the window's own attention (``criticalkv.selection.scores.window_attention``)."""
        return None

    def group_scores(self, policy: Policy, inputs: GroupScoreInputs) -> dict[str, "torch.Tensor"]:
        """Scores [B, m] of one KV group beyond "attention" (named as in ``score_names``)."""
        return {}

    def allocate(self, policy: Policy, scores: Any, eligible: "torch.Tensor", r: "torch.Tensor") -> Allocation:
        """Share the layer's budget: ``r`` [B] older tokens per head on average, ``eligible`` [B, H_kv, m]."""
        batch, heads, _ = eligible.shape
        return Allocation(counts=r[:, None].expand(batch, heads))

    def unscored_keep(self, policy: Policy, valid: "torch.Tensor", valid_start: "torch.Tensor", num_kv_heads: int) -> "torch.Tensor":
        """[B, H_kv, n] chosen entries of a method that does not score (``scored`` False)."""
        raise NotImplementedError(f"{self.name} is scored")

    # ------------------------------------------------------------------ model level (``model_level`` methods)
    def priority(self, policy: Policy, scores: Any, eligible: "torch.Tensor", r: "torch.Tensor") -> "torch.Tensor":
        """[B, H_kv, m] one layer's ranking of its older tokens in the model-wide allocation (``r`` [B])."""
        raise NotImplementedError(f"{self.name} is not a model-level method")

    def model_allocate(self, policy: Policy, ranking: "torch.Tensor", eligible: "torch.Tensor", r: "torch.Tensor") -> "torch.Tensor":
        """[B, L * H_kv, m] bool: the older tokens every head of every layer keeps, from the layers' ``priority``
        concatenated layer-major ([B, L * H_kv, m]), ``eligible`` (same shape) and r [B] per head on average."""
        raise NotImplementedError(f"{self.name} is not a model-level method")

    # ------------------------------------------------------------------ phases (``external_scores`` methods)
    def streams(self, policy: Policy, model: Any) -> tuple["Stream", ...]:
        """The streams an engine for ``policy`` computes as its prompts run (their weights found for ``model``, a
        transformers model); ValueError, with what to do, when the model has none."""
        return ()

    def rereads(self, policy: Policy) -> bool:
        """Whether an engine for ``policy`` re-reads prompts (its re-read graphs are written)."""
        return False

    def engine_data(self, policy: Policy, model: Any, tokenizer: Any = None) -> dict:
        """The method's data an engine for ``policy`` keeps (the manifest's ``method_data[data_key]``: JSON)."""
        return {}

    def prompt_scoring(self, policy: Policy, data: dict, streams: frozenset[str]) -> "PromptScoring | None":
        """How an engine scores a prompt for ``policy`` (None: its layers' selection needs nothing more), given the
        engine's ``data`` (``engine_data``'s) and the names of the streams its prompt graphs return; ValueError, with
        what to do, when the engine lacks what the policy needs."""
        return None

    def graph_stream(self, policy: Policy) -> str | None:
        """The stream (one of ``streams``) that alone gives ``policy``'s scores where no scoring phase runs: a graph
        that selects inside itself (the TensorRT flavour's prefill, whose plugin nodes take the scores as an input)
        computes it from each layer's attention input. None: the scores need more than a stream (a re-read pass), so
        the graphs cannot compute them (``graph_refusal`` says why)."""
        return None

    def graph_refusal(self, policy: Policy) -> str:
        """Why the graphs alone cannot compute ``policy``'s scores (``graph_stream`` None): the reason an
        ``external_scores`` policy has no TensorRT flavour."""
        return (f"{policy.name} ranks by scores its method's phases compute apart from the layers, which the TensorRT "
                "graphs do not run")

    # ------------------------------------------------------------------ ONNX function body
    def onnx_attention_rows(self, body: Any, g: Any, q: str, keys: str, ctx: dict[str, str], w: str, m: str):
        """The body's ``attention_rows``: q [B, H_kv, G, w, d_h], keys [B, H_kv, n, d_h] -> (probs
        [B, H_kv, G, rows, m], raw [B, H_kv, G, m]); None: the window's own attention (the body's default)."""
        return None

    def onnx_group_scores(self, body: Any, g: Any, probs: str, raw: str, pooled: str, values_m: str) -> dict[str, str]:
        """The body's version of ``group_scores`` over all groups at once ([B, H_kv, m] tensor names)."""
        return {}

    def onnx_allocate(self, body: Any, g: Any, scores: dict[str, str], eligible: str, r: str) -> Allocation:
        """The body's version of ``allocate``: ``r`` int64 [B]; returns tensor names."""
        return Allocation(counts=g.Expand(g.unsqueeze(r, 1), g.concat(body.batch, g.i64(body.kv_heads))))

    def onnx_unscored_keep(self, body: Any, g: Any, ctx: dict[str, str]) -> str:
        """The body's version of ``unscored_keep``: [B, H_kv or 1, n] bool."""
        raise NotImplementedError(f"{self.name} is scored")

    def onnx_priority(self, body: Any, g: Any, scores: dict[str, str], eligible: str, r: str) -> str:
        """The body's version of ``priority`` (the ``CriticalKVScore`` node's output): [B, H_kv, m] float."""
        raise NotImplementedError(f"{self.name} is not a model-level method")

    def onnx_model_allocate(self, body: Any, g: Any, ranking: str, eligible: str, r: str, budget: str) -> str:
        """The body's version of ``model_allocate`` (inside ``CriticalKVSelectModel``): ``ranking`` and ``eligible``
        [B, L * H_kv, m], ``r`` [B] int64, ``budget`` the request's budget (int64 scalar); ``body`` sees the model's
        L * H_kv heads as one layer's (``body.kv_heads``, ``body.topk_mask``, ``body.head_floor``)."""
        raise NotImplementedError(f"{self.name} is not a model-level method")
