"""``full``: no eviction (the reference every compressed policy is compared with)."""

from criticalkv.methods.base import BaseMethod


class Full(BaseMethod):
    name = "full"
    cpp_enum = "kFull"
    description = "no eviction (reference)"
    evicts = False
    scored = False
    score_knobs = ()


METHOD = Full()
