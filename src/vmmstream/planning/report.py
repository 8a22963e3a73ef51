"""A plan as a table for a person: what goes where, how many bytes, and where each number came from."""

from __future__ import annotations

from ..budget import format_bytes


def plan_table(plan, tensors: bool = False) -> str:
    s = plan.sources
    n_res = sum(1 for p in plan.placements if p.where == "resident")
    n_str = sum(1 for p in plan.placements if p.where == "streamed")
    host = [p for p in plan.placements if p.where in ("host",)]
    budget_from = plan.budget_source + (f": {plan.budget_detail}" if plan.budget_detail else "")
    rows = [
        ("budget", format_bytes(plan.budget), budget_from),
        ("granularity", format_bytes(plan.granularity), s.get("granularity", "")),
        ("max_context x batch", f"{plan.max_context} x {plan.batch}",
         f"{s.get('max_context', '')} / {s.get('batch', '')}"),
        ("weights on device", format_bytes(plan.weight_bytes), f"{n_res + n_str} tensors, whole granules each"
         + (f"; layers' linear weights {plan.quantization}" if plan.quantization else "")),
        ("  resident", format_bytes(plan.resident_bytes), f"{n_res} tensors"),
    ]
    if plan.slot_count:
        rows += [("  streamed / token", format_bytes(plan.streamed_bytes_per_token),
                  f"{n_str} tensors, in schedule order, round-robin over the slots"),
                 ("  slots", f"{plan.slot_count} x {format_bytes(plan.slot_bytes)}",
                  f"{s.get('slots', '')}; each fits the largest streamed tensor")]
    ep = getattr(plan, "experts", None)
    if ep is not None:
        rows.append(("  experts", f"{len(ep.resident)} of {ep.total} resident",
                     f"{format_bytes(ep.unit_bytes)} each (gate + up + down), {ep.per_layer} per layer, top-{ep.top_k}"))
        if ep.slots:
            rows.append(("  expert slots", f"{ep.slots} x {format_bytes(ep.unit_bytes)}",
                         "routed non-resident experts are gathered here"))
            rows.append(("  experts / token", format_bytes(int(ep.expected_bytes_per_token)),
                         f"expected with uniform routing (worst {format_bytes(ep.worst_bytes_per_token)})"))
    host = [p for p in host if p.where == "host"]
    if host:
        rows.append(("embedding (host)", format_bytes(sum(p.payload for p in host)), "rows gathered per step"))
    rows += [
        ("kv cache", format_bytes(plan.kv_bytes), s.get("kv_cache", "")),
        ("workspace step", format_bytes(plan.workspace["step"]), s.get("workspace", "")),
        ("workspace session", format_bytes(plan.workspace["session"]), s.get("workspace", "")),
        ("activations", format_bytes(plan.activations), s.get("activations", "") + " (estimate)"),
        ("floor", format_bytes(plan.floor), "kv + workspace + activations" + (" + slots" if plan.slot_count else "")
         + (" + expert slots" if ep is not None and ep.slots else "")),
        ("device total", format_bytes(plan.device_bytes), f"{100 * plan.device_bytes / plan.budget:.1f}% of budget"),
        ("pinned host", format_bytes(plan.host_bytes), "embedding + streamed weights"
         + (" + every expert" if ep is not None and ep.slots else "")),
    ]
    if plan.tokens_per_s_bound is not None:
        rows.append(("bound", f"<= {plan.tokens_per_s_bound:,.1f} tok/s",
                     f"{plan.h2d_gbps:g} GB/s host-to-device / streamed bytes per token"
                     + (" (dense + expected experts)" if ep is not None and ep.slots else "")))
    elif plan.slot_count:
        rows.append(("bound", "unknown", "pass the host-to-device bandwidth (--h2d-gbps) to see it"))
    w = max(len(r[0]) for r in rows)
    v = max(len(r[1]) for r in rows)
    lines = [f"plan: {plan.strategy}  ({plan.architecture})"]
    lines += [f"  {a:<{w}}  {b:>{v}}  {c}".rstrip() for a, b, c in rows]
    lines += [f"  note: {n}" for n in plan.notes]
    if tensors:
        lines.append("")
        lines.append(f"  {'#':>4}  {'tensor':<48} {'where':<9} {'slot':>4} {'device':>11} {'payload':>11}")
        for p in plan.placements:
            order = "" if p.order is None else str(p.order)
            slot = "" if p.slot is None else str(p.slot)
            lines.append(f"  {order:>4}  {p.name:<48} {p.where:<9} {slot:>4} "
                         f"{format_bytes(p.device_bytes):>11} {format_bytes(p.payload):>11}")
    return "\n".join(lines)
