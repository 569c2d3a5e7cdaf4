"""The policy spec: the rules every ``KVPolicy`` knob obeys, and the generator of every derived file.

``criticalkv.policy.KVPolicy`` declares each knob once (type, default, help, choices, rules);
``criticalkv.methods`` says which methods read it. ``python -m criticalkv.spec.generate`` writes the C++
field header and validation, the plugin YAML and the README tables from them (``--check`` fails when a
committed file is stale; ``tests/test_spec_generated.py`` runs it).
"""
