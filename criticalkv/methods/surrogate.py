"""``kvzip_score=surrogate``: KVzip's score predicted from the prefill's own hidden states, with no re-read.

KVzip (``criticalkv.methods.kvzip``) scores a context by re-reading it: one more pass over the context's full cache,
which costs more than the prefill itself (measured on the bundled model, 2,048 tokens: 2.2x; the re-read's attention
runs over twice the keys of the prefill's). KVzap (Jegou and Jeblick, 2026, arXiv 2601.07891; kvpress's
``KVzapPress``) and Fast KVzip (Kim et al., 2026, arXiv 2601.17668; kvpress's ``FastKVzipPress``) learn the score
instead: a small model per layer maps each entry's hidden state to its KVzip score, trained once per model on KVzip's
own scores. This module is KVzap's linear form. Per layer l, KV head g and context entry i, with h_i the layer's
attention input (after ``input_layernorm``, the vector the entry's key and value are projected from):

    log S[g, i] ~= h_i . W_l[:, g] + b_l[g]            S_hat[g, i] = exp(h_i . W_l[:, g] + b_l[g])

fitted by ridge regression on the log KVzip scores of training contexts (``criticalkv.hf.surrogate``, the
``criticalkv train-surrogate`` command). S_hat replaces S everywhere KVzip's score is read (the same selections:
``kvzip``'s head-adaptive shares, ``layer-kvzip``'s model-wide ones, CriticalKV's stage 2 with S_hat + epsilon), and,
as KVzip's, entries of the chat template's opening beyond the sinks score 0 (``mask_opening``). Its cost is one
[d, H_kv] product per layer and token during the prefill (0.1 % of a layer's projections on the bundled model).

A surrogate belongs to one model: ``fingerprint`` hashes its shapes and a few of its weights, and ``find_surrogate``
looks for one whose fingerprint matches (the model's folder's ``criticalkv_surrogate.npz``, then the ones shipped in
``criticalkv/surrogates/``, the bundled model's among them).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from criticalkv.methods.lazy import torch
from criticalkv.methods.phases import layer_linear_maps

#: The surrogate a model's folder may hold (``criticalkv train-surrogate`` writes it there by default).
FOLDER_FILE = "criticalkv_surrogate.npz"
#: Surrogates shipped with the package (found by fingerprint).
PACKAGED_DIR = Path(__file__).resolve().parent.parent / "surrogates"
FORMAT = 1


def fingerprint(model) -> str:
    """A hash of ``model``'s shapes and of a few of its weights (the embedding's and the first layer's projections'
    first rows): the same for every copy of the same weights (a GGUF converted again), different for another model."""
    config = model.config
    m = model.model
    digest = hashlib.sha256()
    dims = [config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size]
    digest.update(json.dumps(dims).encode())
    attention = m.layers[0].self_attn
    for weight in (m.embed_tokens.weight, attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight):
        digest.update(np.ascontiguousarray(weight[:4].detach().float().cpu().numpy()).tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class KVzipSurrogate:
    """Per layer the linear map from an entry's hidden state to its log KVzip score (module docstring).

    weight : [L, d, H_kv] float32; bias : [L, H_kv] float32
    model : the fingerprint of the model it was trained on; info : how it was trained (corpus, contexts, the ridge
    penalty, the held-out rank correlation per layer), kept with it."""

    weight: np.ndarray
    bias: np.ndarray
    model: str
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        weight, bias = layer_linear_maps(self.weight, self.bias, "a KVzip surrogate")
        object.__setattr__(self, "weight", weight)
        object.__setattr__(self, "bias", bias)

    @property
    def num_layers(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.weight.shape[2]

    def scores(self, layer: int, hidden) -> "torch.Tensor":
        """S_hat of one layer: ``hidden`` [1, n, d] (or [n, d]) the layer's attention input -> [1, H_kv, n] float32."""
        h = hidden.reshape(-1, hidden.shape[-1]).float()
        w = torch.from_numpy(self.weight[layer]).to(h.device)
        b = torch.from_numpy(self.bias[layer]).to(h.device)
        return torch.exp(h @ w + b).T[None].contiguous()

    def check_model(self, model) -> None:
        """ValueError unless the surrogate was trained on ``model``."""
        config = model.config
        shape = (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads)
        if shape != (self.num_layers, self.hidden_size, self.num_kv_heads):
            raise ValueError(f"the KVzip surrogate is for a model of (layers, hidden size, KV heads) = "
                             f"{(self.num_layers, self.hidden_size, self.num_kv_heads)}, not {shape}")
        if fingerprint(model) != self.model:
            raise ValueError("the KVzip surrogate was trained on another model (its fingerprint differs): train one "
                             "for this model with `criticalkv train-surrogate`")

    def save(self, path: str | os.PathLike) -> Path:
        """Write the surrogate to ``path`` (an .npz) atomically: a failed write leaves any earlier file as it was."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npz", dir=path.parent)
        try:
            with os.fdopen(handle, "wb") as f:
                np.savez(f, weight=self.weight, bias=self.bias,
                         meta=np.array(json.dumps({"format": FORMAT, "model": self.model, "info": self.info})))
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # a plain file's mode (mkstemp's is 0600)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "KVzipSurrogate":
        try:
            with np.load(Path(path), allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                weight, bias = data["weight"], data["bias"]
        except (OSError, KeyError, ValueError) as err:
            raise ValueError(f"{path}: not a KVzip surrogate ({type(err).__name__}: {err})") from None
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: KVzip surrogate format {meta.get('format')!r}, this criticalkv reads {FORMAT}")
        return cls(weight, bias, str(meta["model"]), dict(meta.get("info") or {}))


def _structure_only(model) -> bool:
    """Whether ``model`` is a structure without weights (the meta device: a build that does not load them)."""
    return any(p.is_meta for p in model.parameters())


def _shape(model) -> tuple[int, int, int]:
    config = model.config
    return config.num_hidden_layers, config.hidden_size, config.num_key_value_heads


def find_surrogate(model, folder: str | os.PathLike | None = None) -> KVzipSurrogate:
    """The KVzip surrogate of ``model``: ``folder``'s ``criticalkv_surrogate.npz`` (the model's folder), else the
    packaged one with ``model``'s fingerprint. ValueError (with the command that trains one) when there is none. A
    model without weights (the meta device: a torch build reads no weights) gets the first of its shape; its
    fingerprint is checked when the weights load."""
    structure = _structure_only(model)
    if folder is not None and (Path(folder) / FOLDER_FILE).is_file():
        found = KVzipSurrogate.load(Path(folder) / FOLDER_FILE)
        if structure:
            if (found.num_layers, found.hidden_size, found.num_kv_heads) == _shape(model):
                return found
        else:
            found.check_model(model)
            return found
    mine = None if structure else fingerprint(model)
    for path in sorted(PACKAGED_DIR.glob("*.npz")):
        found = KVzipSurrogate.load(path)
        if found.model == mine or (structure and (found.num_layers, found.hidden_size, found.num_kv_heads) == _shape(model)):
            return found
    where = f"{Path(folder) / FOLDER_FILE} nor " if folder is not None else ""
    raise ValueError(f"kvzip_score=surrogate: no KVzip surrogate for this model (neither {where}one shipped in "
                     f"criticalkv/surrogates/ matches it): train one with `criticalkv train-surrogate --model MODEL`")


_FOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def surrogate_of(model) -> KVzipSurrogate:
    """``find_surrogate`` for a transformers model (its folder: ``config._name_or_path``), found once per model."""
    if model not in _FOUND:
        folder = str(getattr(model.config, "_name_or_path", "") or "") or None
        _FOUND[model] = find_surrogate(model, folder)
    return _FOUND[model]


def uses_surrogate(policy) -> bool:
    """Whether ``policy`` ranks by KVzip's score predicted by the model's surrogate (``kvzip_score=surrogate``)."""
    base = None if policy is None else policy.method.base
    return base is not None and base.external_scores and base.evicts and policy.kvzip_score == "surrogate"


def mask_opening(scores: list, prompt, context_ids, sink_tokens: int) -> list:
    """``scores`` (per layer [1, H_kv, n], torch or numpy) with the chat template's opening beyond the sinks set to 0
    in place (entries [min(sink_tokens, skip), skip), skip = ``prompt.skipped(context_ids)``): KVzip never re-reads
    them, so the surrogate scores them as KVzip does."""
    skip = prompt.skipped(context_ids)
    sinks = min(sink_tokens, skip)
    if skip > sinks:
        for layer in scores:
            layer[:, :, sinks:skip] = 0
    return scores
