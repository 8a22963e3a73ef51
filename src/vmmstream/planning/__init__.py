"""The planning layer: pure functions of sizes that decide where every device byte goes (DESIGN §2, §4, §5)."""

from .floor import (  # noqa: F401
    GRANULARITY,
    PREFILL_CHUNK,
    activation_bytes,
    estimate_workspace,
    kv_cache_bytes,
    round_up,
)
from .plan import LEGACY, RESIDENT, STREAMED, Placement, Plan, make_plan  # noqa: F401
from .residency import knapsack, split  # noqa: F401
