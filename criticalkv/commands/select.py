"""``criticalkv select``: run the reference selection on one layer's tensors saved to a file.

The file (``.pt`` via ``torch.save`` or ``.npz``) holds ``queries`` [B, H, w, d_h], ``keys`` and
``values`` [B, H_kv, n, d_h], ``o_proj_weight`` [d, H*d_h] and optionally ``prompt_lengths`` [B].
Useful to reproduce a selection outside a model or to compare a backend with the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

from criticalkv.policy import KVPolicy

REQUIRED = ("queries", "keys", "values", "o_proj_weight")


def load_layer_tensors(path: Path) -> dict[str, "torch.Tensor"]:  # noqa: F821 (imported below: torch takes seconds)
    import numpy as np
    import torch

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        if path.suffix == ".npz":
            with np.load(path) as data:
                tensors = {k: torch.from_numpy(data[k]) for k in data.files}
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # whatever the loader trips on, the file is the culprit
        kind = ".npz file of arrays" if path.suffix == ".npz" else "tensor file saved with torch.save"
        reason = type(err).__name__ + (": " + str(err).strip().splitlines()[0] if str(err).strip() else "")
        raise ValueError(f"{path}: not a {kind} ({reason})") from None
    if path.suffix != ".npz":
        if not isinstance(tensors, dict):
            raise ValueError(f"{path}: expected a dict of tensors, got {type(tensors).__name__}")
    missing = [k for k in REQUIRED if k not in tensors]
    if missing:
        raise ValueError(f"{path}: missing tensor(s) {', '.join(missing)} (needs {', '.join(REQUIRED)})")
    return tensors


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "select",
        help="run the reference KV selection on one layer's saved tensors and print the kept indices",
        description=__doc__.replace("``", ""),  # the docstring's markup is not for a terminal
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", type=Path, help=".pt or .npz file with queries, keys, values, o_proj_weight")
    p.add_argument("--layer-idx", type=int, default=0, help="this layer's index (PyramidKV budgets)")
    p.add_argument("--num-layers", type=int, default=1, help="number of layers of the model")
    p.add_argument("--output", type=Path, help="write the JSON here instead of standard output")
    KVPolicy.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from criticalkv.selection import select_layer

    policy = KVPolicy.from_args(args)
    t = load_layer_tensors(args.inputs)
    sel = select_layer(
        policy, t["queries"], t["keys"], t["values"], t["o_proj_weight"],
        args.layer_idx, args.num_layers, t.get("prompt_lengths"),
    )
    result = {
        "policy": policy.to_dict(),
        "prompt_len": int(t["keys"].shape[2]),
        "lengths": sel.lengths.tolist(),
        "indices": [[[i for i in head if i >= 0] for head in seq] for seq in sel.indices.tolist()],
    }
    text = json.dumps(result)
    if args.output:
        args.output.write_text(text + "\n")
    else:
        print(text)
    return 0
