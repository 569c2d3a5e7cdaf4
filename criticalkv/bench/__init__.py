"""Benchmarks: a serving load generator for the Triton server (``serving``, ``client``, ``metrics``,
``prompts``), the single-request comparison with kvpress and transformers (``peers``), the AIPerf
cross-check (``aiperf``), and the shared header and reports (``machine``, ``report``)."""
