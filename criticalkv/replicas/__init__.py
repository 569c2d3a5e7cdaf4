"""criticalkv past one machine: a Ray Serve deployment of engine replicas (``criticalkv serve --replicas N``).

* ``deployment``: one replica = one ``Engine`` and its serving ``Scheduler`` (continuous batching, chunked prefill,
  context cache, one KV memory budget); ``ReplicaModel``, what the OpenAI-compatible frontend of
  ``criticalkv.serving.openai_api`` serves requests with in the launcher
  (the same app, routes, errors and streaming; its requests go to the replicas through a Ray Serve handle);
* ``router``: ``ContextAffinityRouter``, a Ray Serve ``RequestRouter`` that sends a request with a ``context`` to the
  replica holding it compressed (what the replicas report, and where it sent the context last), else to the least
  loaded replica, unless the holder's queue is longer than the shortest by more than a threshold;
* ``store``: ``ContextStore``, a detached Ray actor that owns compressed contexts in Ray's object store, keyed by the
  engine, the context policy and the context's tokens, so that a replica (another one, or one restarted after a
  crash) loads a context instead of compressing it again; it also keeps what each replica last reported;
* ``launch``: start a local Ray on ``--host`` (or join ``--ray-address``), deploy, serve the OpenAI API in this
  process, print ``ready:``, stop what it started (a watchdog kills a local Ray's processes if the launcher dies).

Ray (``pip install criticalkv[ray]``) is imported by those modules only, never by this package's face.
"""
