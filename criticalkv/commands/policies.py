"""``criticalkv policies``: the policies and every knob with its flag and default."""

from criticalkv.policy import policy_table_markdown


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "policies", help="list the KV policies and their knobs",
        description="Print the KV policies (base allocation, whether CriticalKV's stage 2 runs, what each keeps) and "
                    "every policy knob with its flag, default and meaning, as markdown tables.")
    p.set_defaults(func=run)


def run(args) -> int:
    print(policy_table_markdown())
    return 0
