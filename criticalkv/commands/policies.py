"""``criticalkv policies``: the policies and every knob with its flag and default."""

from criticalkv.policy import policy_table_markdown


def register(subparsers) -> None:
    p = subparsers.add_parser("policies", help="list the KV policies and their knobs")
    p.set_defaults(func=run)


def run(args) -> int:
    print(policy_table_markdown())
    return 0
