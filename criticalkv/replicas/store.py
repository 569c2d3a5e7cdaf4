"""The shared compressed-context store: a detached Ray actor that owns compressed contexts in Ray's object store.

A replica that compresses a context (``Scheduler.on_context_compressed``) sends a host copy of its kept entries here
(``put``); the store puts it in Ray's object store itself, so the object's owner is the store and the context
outlives the replica that made it (a replica killed mid-request, scaled down, or on another node). A replica that is
asked about a context it does not hold asks the store first (``get``: a reference to the object, fetched by Ray's
object manager, zero-copy on the same node) and offers the copy to its scheduler (``Scheduler.offer_context``), which
then serves the request as a cache hit instead of compressing the document again.

Keys (``store_key``) name the model, the engine (a digest of its ``manifest.json``: graphs, weights and policy), the
backend, the context policy, the budget and the context's token ids (their SHA-256, as the context cache's own key),
so a context is only ever restored into an engine that made the same selection. Entries are evicted least recently
used first beyond ``capacity_bytes`` (0: nothing is stored; the actor still keeps the replicas' reports).

The actor also keeps what each replica reports every second (``report``: its process, requests, context cache and
the contexts it holds), which ``GET /replicas`` shows and the benchmark reads.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from criticalkv.runtime.backend import RowSnapshot
from criticalkv.runtime.engine import SlotSnapshot

#: the Ray namespace of criticalkv's actors and the name prefix of a deployment's store (one per Serve application)
NAMESPACE = "criticalkv"
STORE_PREFIX = "criticalkv-context-store-"
#: how long a replica's report stays current (it reports every ``REPORT_PERIOD_S``)
REPORT_PERIOD_S = 1.0
REPORT_STALE_S = 5.0


def store_name(app_name: str) -> str:
    return f"{STORE_PREFIX}{app_name}"


def engine_fingerprint(engine_dir: str | Path) -> str:
    """A digest of the engine's ``manifest.json`` (its files' SHA-256 sums, its policy and shapes): two copies of one
    engine directory on two nodes share it, two builds do not."""
    return hashlib.sha256((Path(engine_dir) / "manifest.json").read_bytes()).hexdigest()[:16]


def model_name(engine_dir: str | Path) -> str:
    return str(json.loads((Path(engine_dir) / "manifest.json").read_text()).get("model", {}).get("name", "model"))


def store_key(model: str, engine: str, backend: str, cache_key: tuple) -> str:
    """The store's key of a context: the model, the engine's fingerprint, the backend, and the scheduler's cache key
    (token digest, token count, the context policy's JSON, the budget)."""
    digest, count, policy_json, budget = cache_key
    policy = hashlib.sha256(policy_json.encode()).hexdigest()[:16]
    return f"{model}/{engine}/{backend}/{policy}/{budget}/{digest}/{count}"


def route_digest(digest: str) -> str:
    """What the router names a context by: the head of its token digest (the first element of the cache key)."""
    return digest[:16]


# ----------------------------------------------------------------------------------------------- host copies
@dataclass
class HostSnapshot:
    """A ``SlotSnapshot`` as NumPy arrays (a device snapshot copied to the host; an ONNX Runtime one as it is), which
    pickles into Ray's object store and restores into any backend of the same engine. ``torch_dtype``: the tensors'
    dtype when they were torch tensors (bfloat16 travels as its 16 bits), else None."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    lengths: list[np.ndarray]
    position: int
    kept_entries: int
    torch_dtype: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(k.nbytes) + int(v.nbytes) for k, v in zip(self.keys, self.values))


def to_host(snapshot: SlotSnapshot) -> HostSnapshot:
    row = snapshot.row
    first = row.keys[0] if row.keys else None
    if first is None or isinstance(first, np.ndarray):
        return HostSnapshot(list(row.keys), list(row.values), [np.asarray(x) for x in row.lengths], snapshot.position,
                            snapshot.kept_entries)
    torch = sys.modules["torch"]  # a torch tensor: torch is loaded

    def host(t):
        t = t.detach().to("cpu")
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()

    return HostSnapshot([host(k) for k in row.keys], [host(v) for v in row.values],
                        [t.detach().to("cpu").numpy() for t in row.lengths], snapshot.position, snapshot.kept_entries,
                        str(first.dtype).removeprefix("torch."))


def from_host(snapshot: HostSnapshot, engine) -> SlotSnapshot:
    """``snapshot`` as the ``SlotSnapshot`` ``engine.restore`` takes: NumPy arrays for ONNX Runtime, tensors on the
    device of the engine's own buffers for the torch and TensorRT backends."""
    buffers = getattr(engine.backend, "keys", None)
    reference = buffers[0] if buffers else None
    if reference is None or isinstance(reference, np.ndarray):
        row = RowSnapshot(list(snapshot.keys), list(snapshot.values), list(snapshot.lengths))
    else:
        torch = sys.modules["torch"]
        device = reference.device

        def tensor(a, dtype=None):
            t = torch.from_numpy(np.array(a))
            if dtype == "bfloat16":
                t = t.view(torch.bfloat16)
            return t.to(device)

        row = RowSnapshot([tensor(k, snapshot.torch_dtype) for k in snapshot.keys],
                          [tensor(v, snapshot.torch_dtype) for v in snapshot.values],
                          [tensor(x) for x in snapshot.lengths])
    return SlotSnapshot(row=row, position=snapshot.position, kept_entries=snapshot.kept_entries)


# ----------------------------------------------------------------------------------------------- the actor
class ContextStore:
    """The store's state (run as a detached Ray actor: ``ray.remote(ContextStore)``). ``capacity_bytes``: most bytes of
    compressed contexts kept in the object store (0: none; the replicas' reports are still kept)."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = int(capacity_bytes)
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key -> (ObjectRef, bytes)
        self._bytes = 0
        self.stats = {"puts": 0, "hits": 0, "misses": 0, "evictions": 0, "refused": 0}
        self._reports: dict[str, dict] = {}

    def put(self, key: str, snapshot: HostSnapshot) -> bool:
        """Keep ``snapshot`` under ``key`` (copied into an object this actor owns); False when it alone is larger than
        the capacity."""
        import ray

        size = int(snapshot.nbytes)
        if size > self.capacity_bytes:
            self.stats["refused"] += 1
            return False
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        while self._entries and self._bytes + size > self.capacity_bytes:
            _, (_, freed) = self._entries.popitem(last=False)
            self._bytes -= freed
            self.stats["evictions"] += 1
        self._entries[key] = (ray.put(snapshot), size)
        self._bytes += size
        self.stats["puts"] += 1
        return True

    def get(self, key: str) -> list | None:
        """``[ObjectRef]`` of the context under ``key`` (a list, so that Ray hands the reference over instead of the
        object), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.stats["misses"] += 1
            return None
        self._entries.move_to_end(key)
        self.stats["hits"] += 1
        return [entry[0]]

    def report(self, replica: str, info: dict) -> None:
        """A replica's report (every ``REPORT_PERIOD_S``): its process, requests, context cache, contexts held."""
        self._reports[replica] = {**info, "reported": time.time()}

    def forget(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def summary(self) -> dict:
        """The store's counts and the replicas' last reports (those older than ``REPORT_STALE_S`` flagged stale)."""
        now = time.time()
        replicas = [{**info, "replica": name, "age_s": round(now - info["reported"], 3),
                     "stale": now - info["reported"] > REPORT_STALE_S} for name, info in sorted(self._reports.items())]
        return {"capacity_bytes": self.capacity_bytes, "entries": len(self._entries), "bytes_held": self._bytes,
                **self.stats, "replicas": replicas}
