"""Snapshots of device memory: a dict for programs, a table for people."""

from __future__ import annotations

from ..budget import format_bytes
from ..driver import VMM_CALLS
from .authority import ROLES


def snapshot(mem) -> dict:
    a = mem.authority
    pool = mem.pool
    holders: dict[str, int] = {}
    for l in a.leases.values():
        holders[l.holder] = holders.get(l.holder, 0) + l.committed
    calls = mem.driver.calls
    return {
        "allocator": "legacy" if mem.legacy else "vmm",
        "backend": mem.driver.backend,
        "budget": a.budget,
        "budget_source": {"kind": a.budget_source.kind, "detail": a.budget_source.detail},
        "committed": a.committed,
        "peak_committed": a.peak_committed,
        "reserved": a.reserved,
        "retained": a.retained,
        "mapped": mem.mapped_bytes,
        "by_role": a.by_role(),
        "by_holder": holders,
        "leases": [{"holder": l.holder, "role": l.role, "committed": l.committed, "granted": l.granted,
                    "peak": l.peak} for l in a.leases.values()
                   if l.granted or l.committed or l.peak],   # an untouched lease is no lease
        "handles": {
            "created": pool.created if pool else 0,
            "released": pool.released if pool else 0,
            "reused": pool.reused if pool else 0,
            "live": len(pool.live) if pool else 0,
            "pooled": len(pool._idle) if pool else 0,
            "owned_bytes": pool.owned_bytes if pool else 0,
        },
        "vmm_calls": {k: calls.get(k, 0) for k in sorted(VMM_CALLS)},
        "vmm_calls_total": mem.driver.vmm_call_count(),
        "plain_allocs": calls.get("mem_alloc", 0),
        "arenas": {n: {"va_bytes": ar.size, "used_bytes": ar.used_bytes} for n, ar in mem.arenas.items()},
        "pending_releases": len(mem.fences),
        "refusals": a.refusals,
        "granularity": mem.granularity,
    }


def table(s: dict) -> str:
    src = s["budget_source"]
    lines = [
        f"allocator {s['allocator']}  backend {s['backend']}  granularity {format_bytes(s['granularity'])}",
        f"budget     {format_bytes(s['budget']):>12}  ({src['kind']}{': ' + src['detail'] if src['detail'] else ''})",
        f"committed  {format_bytes(s['committed']):>12}  peak {format_bytes(s['peak_committed'])}"
        f"  reserved {format_bytes(s['reserved'])}  retained {format_bytes(s['retained'])}",
        "",
        f"{'role':<20}{'committed':>14}",
    ]
    for role in ROLES:
        lines.append(f"{role:<20}{format_bytes(s['by_role'][role]):>14}")
    h = s["handles"]
    lines += [
        "",
        f"handles    created {h['created']}  released {h['released']}  reused {h['reused']}  "
        f"live {h['live']}  pooled {h['pooled']}",
        "vmm calls  " + "  ".join(f"{k.replace('mem_', '')} {v}" for k, v in s["vmm_calls"].items()),
        f"pending releases {s['pending_releases']}  refusals {s['refusals']}",
    ]
    return "\n".join(lines)
