"""``ContextAffinityRouter``: a Ray Serve request router that sends a request to the replica holding its context.

Ray Serve's public-alpha router API (``ray.serve.request_router.RequestRouter``): ``choose_replicas`` returns ranks of
replicas, best first; Serve sends the request to the replica of the first rank with the shortest queue that accepts
it, then tries the next rank. Like Ray Serve LLM's ``PrefixCacheAffinityRouter`` and vllm-router's ``cache_aware``,
locality wins unless the load is too uneven:

* a request whose payload names a ``route`` (the digest of its context's token ids, set by the frontend) goes first to
  the replicas that hold that context compressed: those whose last report (``Replica.record_routing_stats``:
  the contexts cached or being compressed there) lists it, and the replica this router sent it to last (within
  ``record_ttl_s``: reports arrive about once a second, so the second question about a new document must not wait
  for one), unless that replica's queue is longer than the shortest by more than ``imbalance_threshold`` requests;
* a context nobody holds goes to the least loaded replica (ties at random), chosen here and remembered at once as
  where the context went: the questions that arrive together with the first one about a new document (before any of
  them is routed) follow it there and wait for its compression instead of compressing the document on another
  replica too, unless that replica becomes too busy;
* otherwise (no context, or the holders are too busy) every replica forms one rank: the least loaded one gets it (ties
  at random), and with the shared store it loads the context instead of compressing it.

There is no FIFO matching (``FIFOMixin``): a replica chosen for a request goes to that request, not to the oldest
one waiting, which would break the affinity. The router runs in the process of the handle that calls the replicas
(the launcher, whose OpenAI frontend calls them); its counts (``stats``) show in ``GET /replicas``.
"""

from __future__ import annotations

import random
import time
import weakref
from collections import OrderedDict
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

#: the routers of this process (``GET /replicas`` reads their counts)
ROUTERS: "weakref.WeakSet[ContextAffinityRouter]" = weakref.WeakSet()


class ContextAffinityRouter(RequestRouter):
    """Context affinity with a load-imbalance threshold (see the module's docstring)."""

    def initialize_state(self, imbalance_threshold: int = 4, record_ttl_s: float = 30.0, max_records: int = 100_000):
        if not isinstance(imbalance_threshold, int) or imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be an integer >= 0, got {imbalance_threshold!r}")
        self.imbalance_threshold = imbalance_threshold
        self.record_ttl_s = float(record_ttl_s)
        self.max_records = int(max_records)
        self._sent: OrderedDict[str, tuple] = OrderedDict()  # route -> (replica id, time sent)
        #: decisions: to a holder, to the least loaded because nobody holds it / the holders were too busy, no context
        self.stats = {"affinity": 0, "no_holder": 0, "imbalanced": 0, "no_context": 0}
        # Serve pickles a router class by value (its module's globals are copies): register in the imported module
        import criticalkv.replicas.router as module

        module.ROUTERS.add(self)

    @staticmethod
    def route_of(pending_request: Optional[PendingRequest]) -> str | None:
        """The ``route`` field of the request's payload (the first dict argument), if any."""
        if pending_request is None:
            return None
        for arg in pending_request.args:
            if isinstance(arg, dict):
                route = arg.get("route")
                return route if isinstance(route, str) else None
        return None

    def holders(self, route: str, candidates: List[RunningReplica]) -> List[RunningReplica]:
        """The candidates that hold ``route``'s context: by their last report, or because it was sent there lately."""
        out = [r for r in candidates if route in ((r.routing_stats or {}).get("contexts") or ())]
        sent = self._sent.get(route)
        if sent is not None and time.time() - sent[1] <= self.record_ttl_s:
            out += [r for r in candidates if r.replica_id == sent[0] and r not in out]
        return out

    async def queue_lengths(self, replicas: List[RunningReplica]) -> dict:
        """Replica id -> requests in flight there (Serve's cached count, probed when missing; None if unknown)."""
        lengths, missing = {}, []
        for r in replicas:
            n = self.replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            lengths[r.replica_id] = n
        if missing:
            for r, n in await self._probe_queue_lens(missing, 0):
                lengths[r.replica_id] = n
        return lengths

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        candidates = list(candidate_replicas)
        random.shuffle(candidates)  # Serve takes the shortest queue of a rank, the first one on a tie
        route = self.route_of(pending_request)
        if route is None:
            self.stats["no_context"] += 1
            return [candidates]
        holders = self.holders(route, candidates)
        lengths = await self.queue_lengths(candidates)
        known = [n for n in lengths.values() if n is not None]
        shortest = min(known) if known else 0
        if not holders:
            self.stats["no_holder"] += 1
            # the least loaded replica (the shuffle broke the ties), named now: the next requests on this context
            # follow it before this one is even routed
            first = min(candidates, key=lambda r: shortest if lengths.get(r.replica_id) is None
                        else lengths[r.replica_id])
            self._remember(route, first.replica_id)
            return [[first], [r for r in candidates if r is not first]]
        # a holder whose count is unknown (its probe timed out: a loaded machine) keeps the preference: Serve probes it
        # again before it sends anything there
        near = [r for r in holders if lengths.get(r.replica_id) is None
                or lengths[r.replica_id] - shortest <= self.imbalance_threshold]
        if not near:
            self.stats["imbalanced"] += 1
            return [candidates]
        self.stats["affinity"] += 1
        return [near, [r for r in candidates if r not in near]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """Remember where a context went: its next questions follow it before the replica's next report."""
        route = self.route_of(pending_request)
        if route is not None:
            self._remember(route, replica_id)

    def _remember(self, route: str, replica_id) -> None:
        self._sent[route] = (replica_id, time.time())
        self._sent.move_to_end(route)
        while len(self._sent) > self.max_records:
            self._sent.popitem(last=False)
