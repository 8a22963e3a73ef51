"""The load-time plan: strategy, residency, slots, KV, workspace and activations under one budget (DESIGN §4).

``make_plan`` is a pure function of sizes: no device, no allocation, no weight bytes. It either
returns a ``Plan`` whose parts add up to at most the budget, or raises ``CapacityError`` naming every
part of the floor — before ``load_model`` allocates anything (invariant I9).

Device sizes: weights live on the device as bf16 (the kernels' storage type; an f16/f32 checkpoint is
converted at load), so a tensor's payload is ``numel · 2`` bytes — or, with ``quantize``, the quantized
layout's bytes for the weights ``vmmstream.quantization`` quantizes; each tensor owns a VA range of whole
granules, so it costs its payload rounded up to the granularity.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Mapping

from ..budget import format_bytes as _fmt
from ..errors import CapacityError
from . import floor as fl
from .residency import split

SOURCES = ("explicit", "env", "inferred")
RESIDENT, STREAMED, LEGACY = "resident", "streamed", "legacy"
EXPERT = "expert"      # a routed expert's weight: placed with its unit (ExpertPlan), not in the schedule
DEFAULT_MAX_CONTEXT = 4096       # when none is given: min(this, max_position_embeddings, sliding_window)
HOST = "host"


@dataclass(frozen=True)
class Placement:
    name: str
    where: str              # "resident", "streamed" or "host" (gathered from pinned host memory)
    device_bytes: int       # the tensor's VA range: payload rounded up to granules (0 on the host)
    payload: int            # bytes of the tensor on the device (bf16)
    slot: int | None = None     # streamed: the slot whose pages back it
    order: int | None = None    # position in the decode schedule (None for host tensors)


@dataclass(frozen=True)
class ExpertPlan:
    """Routed experts of a mixture of experts, placed as units (one expert's gate, up and down weights).

    ``resident`` units live on the device for the whole session; the others stay in pinned host memory
    and are gathered into one of ``slots`` unit-sized slots when a token is routed to them (only routed
    experts move). All experts of all layers have one unit size. The initial resident set spreads over
    the layers (lowest expert ids first); ``Model.rebalance_experts`` re-chooses it by routing counts."""
    layers: int
    per_layer: int                 # experts per layer
    top_k: int
    unit_payload: int              # bytes of one expert's three weights (each part 256-byte aligned)
    unit_bytes: int                # its device bytes (granule-rounded)
    resident: tuple                # ((layer, expert), ...)
    slots: int                     # gather slots (0 when every expert is resident)

    @property
    def total(self) -> int:
        return self.layers * self.per_layer

    @property
    def resident_bytes(self) -> int:
        return len(self.resident) * self.unit_bytes

    @property
    def slot_bytes_total(self) -> int:
        return self.slots * self.unit_bytes

    @property
    def expected_bytes_per_token(self) -> float:
        """Expert bytes gathered per decode token if routing is uniform: k routed per layer, each missing
        the device with the non-resident fraction."""
        miss = 1.0 - len(self.resident) / self.total
        return self.layers * self.top_k * miss * self.unit_payload

    @property
    def worst_bytes_per_token(self) -> int:
        per_layer_missing = [self.per_layer - sum(1 for (layer, _) in self.resident if layer == i)
                             for i in range(self.layers)]
        return sum(min(self.top_k, m) for m in per_layer_missing) * self.unit_payload

    def to_dict(self) -> dict:
        return {"layers": self.layers, "per_layer": self.per_layer, "top_k": self.top_k,
                "unit_payload": self.unit_payload, "unit_bytes": self.unit_bytes,
                "resident": [list(u) for u in self.resident], "slots": self.slots,
                "expected_bytes_per_token": self.expected_bytes_per_token,
                "worst_bytes_per_token": self.worst_bytes_per_token}


@dataclass(frozen=True)
class Plan:
    strategy: str                   # "resident", "streamed" or "legacy"
    budget: int
    budget_source: str              # "explicit", "env" or "inferred"
    budget_detail: str
    granularity: int
    max_context: int
    batch: int
    architecture: str
    placements: tuple               # Placement per tensor: the decode schedule, then host tensors
    weight_bytes: int               # device bytes of every dense weight (granule-rounded)
    resident_bytes: int             # of which resident (the weights_resident lease)
    streamed_bytes_per_token: int   # payload bytes copied host -> device per decode token
    host_bytes: int                 # pinned host memory kept: host tensors + streamed copies
    slot_count: int
    slot_bytes: int
    kv_bytes: int
    workspace: dict = field(hash=False)      # {"step": bytes, "session": bytes}, granule-rounded
    activations: int = 0
    floor: int = 0                  # kv + workspace + activations + slots (what no weight may use)
    h2d_gbps: float | None = None
    tokens_per_s_bound: float | None = None  # h2d_gbps·1e9 / streamed_bytes_per_token
    sources: dict = field(default_factory=dict, hash=False)
    exact: bool = True              # the residency choice is proven optimal (False: greedy fallback)
    notes: tuple = ()
    quantization: str | None = None  # "int4" / "mxfp4": the layers' linear weights are stored quantized
    experts: "ExpertPlan | None" = field(default=None, hash=False)   # mixtures of experts: see ExpertPlan
    prefill_chunk: int = fl.PREFILL_CHUNK   # tokens a prefill walks through each layer (each weight read once)

    @property
    def device_bytes(self) -> int:
        """Everything the plan commits on the device; never more than the budget."""
        return self.resident_bytes + self.floor

    @property
    def expert_bytes_per_token(self) -> float:
        """Expected routed-expert bytes gathered per decode token (uniform routing); 0 without experts."""
        return self.experts.expected_bytes_per_token if self.experts else 0.0

    def leases(self) -> dict:
        """Bytes per authority role (``vmmstream.memory.authority.ROLES``): what ``load_model`` grants.
        Resident experts count as resident weights, gather slots as weight slots."""
        ex_res = self.experts.resident_bytes if self.experts else 0
        ex_slots = self.experts.slot_bytes_total if self.experts else 0
        return {"weights_resident": self.resident_bytes, "weight_slots": self.slot_count * self.slot_bytes + ex_slots,
                "kv_cache": self.kv_bytes, "workspace_step": self.workspace["step"],
                "workspace_session": self.workspace["session"], "activations": self.activations}

    def placement(self, name: str) -> Placement:
        for p in self.placements:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def resident(self) -> tuple:
        return tuple(p.name for p in self.placements if p.where == RESIDENT)

    @property
    def streamed(self) -> tuple:
        """Streamed tensors in schedule order (the order the copy stream fills slots)."""
        return tuple(p.name for p in self.placements if p.where == STREAMED)

    def slot_tenants(self, slot: int) -> tuple:
        return tuple(p.name for p in self.placements if p.where == STREAMED and p.slot == slot)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "strategy", "budget", "budget_source", "budget_detail", "granularity", "max_context", "batch",
            "architecture", "weight_bytes", "resident_bytes", "streamed_bytes_per_token", "host_bytes",
            "slot_count", "slot_bytes", "kv_bytes", "activations", "floor", "h2d_gbps", "tokens_per_s_bound",
            "exact", "quantization", "prefill_chunk")}
        d["experts"] = self.experts.to_dict() if self.experts else None
        d.update(workspace=dict(self.workspace), device_bytes=self.device_bytes, leases=self.leases(),
                 sources=dict(self.sources), notes=list(self.notes),
                 placements=[{"name": p.name, "where": p.where, "device_bytes": p.device_bytes,
                              "payload": p.payload, "slot": p.slot, "order": p.order} for p in self.placements])
        return d

    def table(self, tensors: bool = False) -> str:
        from .report import plan_table
        return plan_table(self, tensors=tensors)

    def __str__(self) -> str:
        return self.table()


def make_plan(config, tensors, budget_bytes: int, *, budget_source="explicit", max_context: int | None = None,
              batch: int | None = None, slots: int | None = None, granularity: int | None = None,
              workspace: Mapping | None = None, h2d_gbps: float | None = None, legacy: bool = False,
              prefill_chunk: int = fl.PREFILL_CHUNK, sources: Mapping | None = None,
              quantize: str | None = None) -> Plan:
    """Plan a model of ``config`` (a ``ModelConfig``) with ``tensors`` (name -> info with ``.shape``) in a budget.

    ``budget_source``: "explicit", "env" or "inferred", or a ``(kind, detail)`` pair. ``max_context``
    defaults to min(4096, max_position_embeddings, sliding_window); ``batch`` to 1; ``slots`` (K >= 2) to 2;
    ``granularity`` to 2 MiB; ``workspace`` ({"step", "session"} peak bytes from the kernels'
    ``workspace_requirement``) to ``floor.estimate_workspace``. ``sources`` overrides where a number
    came from (e.g. ``{"granularity": "explicit"}`` when it was queried from the driver). ``quantize``
    ("int4" | "mxfp4"): size the layers' linear weights as stored quantized (``vmmstream.quantization``).

    Strategy: every dense weight + the floor without slots fits -> ``resident``; else ``streamed``
    with the byte-optimal resident set (see ``residency``); ``legacy=True`` never streams.
    Raises ``CapacityError`` when no plan fits, ``ValueError`` for bad arguments.
    """
    kind, detail = _source(budget_source)
    src = {"budget": kind, "weights": "inferred"}
    src["max_context"] = "inferred" if max_context is None else "explicit"
    src["batch"] = "inferred" if batch is None else "explicit"
    src["slots"] = "inferred" if slots is None else "explicit"
    src["granularity"] = "inferred" if granularity is None else "explicit"
    src["workspace"] = "inferred" if workspace is None else "explicit"
    src["activations"] = src["kv_cache"] = "inferred"
    src["h2d_gbps"] = None if h2d_gbps is None else "explicit"
    if max_context is None:
        max_context = config.default_context(DEFAULT_MAX_CONTEXT)
    batch = 1 if batch is None else batch
    slots = 2 if slots is None else slots
    gran = fl.GRANULARITY if granularity is None else granularity
    _check_int("budget_bytes", budget_bytes, 1)
    _check_int("max_context", max_context, 1)
    _check_int("batch", batch, 1)
    _check_int("granularity", gran, 1)
    _check_int("prefill_chunk", prefill_chunk, 1)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 2:
        raise ValueError(f"slots={slots!r}: streaming needs K >= 2 slots (one is filled while another is read)")
    if h2d_gbps is not None and not h2d_gbps > 0:
        raise ValueError(f"h2d_gbps={h2d_gbps!r} must be positive")
    for k, v in (sources or {}).items():
        if v not in SOURCES:
            raise ValueError(f"source {v!r} for {k!r} is not one of {', '.join(SOURCES)}")
        src[k] = v
    from ..quantization import check_kind, is_linear, payload as q_payload, quantizable
    quantize = check_kind(quantize)
    budget_bytes, max_context, batch, gran = int(budget_bytes), int(max_context), int(batch), int(gran)
    config.check_context(max_context)

    # -- weights: the decode schedule on the device, the embedding (untied) on the host --
    infos = dict(tensors) if isinstance(tensors, Mapping) else {t.name: t for t in tensors}
    schedule, host = list(config.decode_schedule()), list(config.host_tensors())
    missing = [n for n in schedule + host if n not in infos]
    if missing:
        raise ValueError(f"tensors lack {len(missing)} the {config.architecture} decode step reads: "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    expert_names = []
    if getattr(config, "is_moe", False):
        expert_names = [n for i in range(config.num_hidden_layers) for e in range(config.num_experts)
                        for n in config.expert_names(i, e)]
        lack = [n for n in expert_names if n not in infos]
        if lack:
            raise ValueError(f"tensors lack {len(lack)} expert weights, e.g. {lack[0]}")
        gone = set(expert_names)
        schedule = [n for n in schedule if n not in gone]
    payload = [q_payload(n, infos[n].shape, quantize) for n in schedule]
    dev = [fl.round_up(p, gran) for p in payload]
    weight_bytes = sum(dev)
    unit_payload = unit_dev = n_units = 0
    if expert_names:
        unit_payload = sum(-(-q_payload(n, infos[n].shape, quantize) // 256) * 256
                           for n in config.expert_names(0, 0))
        unit_dev = fl.round_up(unit_payload, gran)
        n_units = config.num_hidden_layers * config.num_experts
        weight_bytes += n_units * unit_dev

    def expert_plan(n_resident: int, slots: int):
        if not expert_names:
            return None
        order = sorted(((i, e) for i in range(config.num_hidden_layers) for e in range(config.num_experts)),
                       key=lambda u: (u[1], u[0]))          # spread over the layers, lowest ids first
        return ExpertPlan(config.num_hidden_layers, config.num_experts, config.num_experts_per_tok, unit_payload,
                          unit_dev, tuple(sorted(order[:max(0, min(n_resident, n_units))])), slots)

    # -- the floor --
    ws_raw = fl.estimate_workspace(config, max_context, batch, prefill_chunk) if workspace is None else workspace
    ws = {k: fl.round_up(_ws(ws_raw, k), gran) for k in ("step", "session")}
    kv = fl.kv_cache_bytes(config, max_context, batch, gran)
    act = fl.activation_bytes(config, max_context, batch, gran, prefill_chunk)
    base = kv + ws["step"] + ws["session"] + act
    parts = dict(kv=kv, ws=ws, act=act, max_context=max_context, batch=batch, budget=budget_bytes,
                 kind=kind, detail=detail)

    notes = _notes(config, max_context)
    if batch > 1:
        notes += (f"KV cache: {batch} sequences of up to {max_context} positions, {_fmt(kv // batch)} each, a "
                  "sequence's pages committed when it joins and unmapped when it ends",)
    if quantize:
        nq = sum(1 for n in schedule if quantizable(n, infos[n].shape, quantize))
        kept = sum(1 for n in schedule if is_linear(n)) - nq
        notes += (f"{quantize}: {nq} linear weights of the layers stored quantized (sizes above are the "
                  "quantized ones); embeddings, the output head, norms and biases stay bf16",)
        if kept:
            notes += (f"{kept} linear weights stay bf16: their input dim is not a multiple of the "
                      f"{quantize} group",)
    common = dict(quantization=quantize, budget=budget_bytes, budget_source=kind, budget_detail=detail, granularity=gran,
                  max_context=max_context, batch=batch, architecture=config.architecture,
                  weight_bytes=weight_bytes, kv_bytes=kv, workspace=ws, activations=act, h2d_gbps=h2d_gbps,
                  sources=src, prefill_chunk=min(prefill_chunk, max_context))
    host_payload = sum(_payload(infos[n]) for n in host)
    host_places = tuple(Placement(n, HOST, 0, _payload(infos[n])) for n in host)
    expert_places = tuple(Placement(n, EXPERT, 0, q_payload(n, infos[n].shape, quantize)) for n in expert_names)
    host_places = expert_places + host_places
    dense_bytes = weight_bytes - n_units * unit_dev

    if legacy or weight_bytes + base <= budget_bytes:
        if weight_bytes + base > budget_bytes:
            raise CapacityError(
                f"with VMMSTREAM_LEGACY_ALLOCATOR=1 nothing streams, and the model needs "
                f"{_fmt(weight_bytes + base)} (weights {_fmt(weight_bytes)} + {_floor_text(parts, 0, 0)}) "
                f"but the budget is {_budget_text(parts)}. Unset VMMSTREAM_LEGACY_ALLOCATOR (or set it to 0) to "
                "stream weights, or raise the budget",
                requested=weight_bytes + base, budget=budget_bytes, role="weights_resident", holder="plan")
        places = tuple(Placement(n, RESIDENT, d, p, None, i)
                       for i, (n, d, p) in enumerate(zip(schedule, dev, payload))) + host_places
        notes += ("nothing streams: decode is bound by HBM bandwidth, not by host-to-device copies",)
        return Plan(strategy=LEGACY if legacy else RESIDENT, placements=places, resident_bytes=weight_bytes,
                    streamed_bytes_per_token=0, host_bytes=host_payload, slot_count=0,
                    slot_bytes=0, floor=base, tokens_per_s_bound=None, notes=notes,
                    experts=expert_plan(n_units, 0), **common)

    if expert_names:
        # Experts go on demand: k gather slots join the floor. Dense weights are read every token, a
        # non-resident expert only when routed (k of E per layer), so dense residency saves more bytes per
        # byte of budget: the dense part is planned first, the experts fill what is left.
        ex_floor = config.num_experts_per_tok * unit_dev
        base += ex_floor
        parts["experts"] = (config.num_experts_per_tok, unit_dev)
        if dense_bytes + base <= budget_bytes:
            n_res = (budget_bytes - base - dense_bytes) // unit_dev
            places = tuple(Placement(n, RESIDENT, d, p, None, i)
                           for i, (n, d, p) in enumerate(zip(schedule, dev, payload))) + host_places
            ep = expert_plan(n_res, config.num_experts_per_tok)
            exp_b = ep.expected_bytes_per_token
            notes += (f"{len(ep.resident)} of {n_units} experts resident; the rest are gathered into "
                      f"{ep.slots} slots when routed (uniform routing: {_fmt(int(exp_b))} per token)",)
            return Plan(strategy=STREAMED, placements=places, resident_bytes=dense_bytes + ep.resident_bytes,
                        streamed_bytes_per_token=0, host_bytes=host_payload + n_units * unit_payload, slot_count=0,
                        slot_bytes=0, floor=base, tokens_per_s_bound=(None if h2d_gbps is None or not exp_b
                                                                      else h2d_gbps * 1e9 / exp_b),
                        notes=notes, experts=ep, **common)

    sp = split(dev, payload, budget_bytes - base, slots, gran) if base <= budget_bytes else None
    if sp is None:
        # The smallest footprint any streaming plan has: slots of size s, every tensor larger than s resident.
        need, slot, forced = min((base + slots * s + sum(d for d in dev if d > s), s, sum(d for d in dev if d > s))
                                 for s in set(dev))
        text = _floor_text(parts, slots, slot)
        if forced:
            text += f", plus {_fmt(forced)} of tensors larger than a slot, kept resident"
        raise CapacityError(
            f"the non-weight floor needs {_fmt(need)} ({text}) but the budget is {_budget_text(parts)}, "
            f"so no plan fits. Raise the budget, or lower max_context (now {max_context}) or batch "
            f"(now {batch})",
            requested=need, budget=budget_bytes, role="floor", holder="plan")
    places, rr = [], 0
    for i, (n, d, p) in enumerate(zip(schedule, dev, payload)):
        if i in sp.resident:
            places.append(Placement(n, RESIDENT, d, p, None, i))
        else:       # round-robin in schedule order: consecutive streamed tensors use different slots
            places.append(Placement(n, STREAMED, d, p, rr % slots, i))
            rr += 1
    if not sp.exact:
        notes += ("the resident set was chosen greedily (largest first): the exact search was too large",)
    ep = expert_plan(0, config.num_experts_per_tok) if expert_names else None
    if ep is not None:
        notes += (f"no expert resident: the dense weights take the budget; {ep.slots} gather slots",)
    per_token = sp.streamed_payload + (ep.expected_bytes_per_token if ep else 0)
    bound = None if h2d_gbps is None else h2d_gbps * 1e9 / per_token
    return Plan(strategy=STREAMED, placements=tuple(places) + host_places,
                resident_bytes=sum(dev[i] for i in sp.resident), streamed_bytes_per_token=sp.streamed_payload,
                host_bytes=host_payload + sp.streamed_payload + n_units * unit_payload, slot_count=slots,
                slot_bytes=sp.slot_bytes, floor=base + slots * sp.slot_bytes, tokens_per_s_bound=bound, exact=sp.exact,
                notes=notes, experts=ep, **common)


def _floor_text(parts, slots: int, slot: int) -> str:
    ws = parts["ws"]
    text = (f"KV cache {_fmt(parts['kv'])} for max_context {parts['max_context']} x batch {parts['batch']}, "
            f"workspace step {_fmt(ws['step'])}, workspace session {_fmt(ws['session'])}, "
            f"activations {_fmt(parts['act'])}")
    if slots:
        text += f", weight slots {slots} x {_fmt(slot)} (the largest streamed tensor)"
    if "experts" in parts:
        k, unit = parts["experts"]
        text += f", expert gather slots {k} x {_fmt(unit)} (one routed expert each)"
    return text


def _budget_text(parts) -> str:
    detail = f": {parts['detail']}" if parts["detail"] else ""
    return f"{_fmt(parts['budget'])} ({parts['kind']}{detail})"


def _notes(config, max_context: int) -> tuple:
    notes = []
    if config.host_tensors():
        notes.append("the embedding table stays in pinned host memory; a step gathers only its rows")
    else:
        notes.append("embeddings are tied: the table is also the output head, so it is a device weight")
    if max_context > config.max_position_embeddings:
        notes.append(f"max_context {max_context} exceeds the model's max_position_embeddings "
                     f"{config.max_position_embeddings}; quality past it is not what the model was trained for")
    if config.sliding_window is not None:
        notes.append(f"sliding window {config.sliding_window} >= max_context: full attention is identical")
    factors = config.rope_factor_set(max_context)
    if factors is not None:
        orig = config.rope_scaling["original_max_position_embeddings"]
        if factors == "long":
            notes.append(f"longrope: long_factor at every position, since max_context {max_context} > "
                         f"original_max_position_embeddings {orig}; transformers uses short_factor for sequences "
                         f"of at most {orig} tokens, so those differ from it (load with max_context <= {orig} to "
                         "match it there)")
        else:
            notes.append(f"longrope: short_factor (max_context {max_context} <= original_max_position_embeddings "
                         f"{orig}), the set transformers uses for every length up to max_context")
    return tuple(notes)


def _source(s) -> tuple[str, str]:
    kind, detail = (s, "") if isinstance(s, str) else tuple(s)
    if kind not in SOURCES:
        raise ValueError(f"budget_source {kind!r} is not one of {', '.join(SOURCES)}")
    return kind, str(detail)


def _payload(info) -> int:
    n = 1
    for s in info.shape:
        n *= int(s)
    return fl.BF16 * n


def _ws(ws, key) -> int:
    v = ws.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ValueError(f"workspace[{key!r}]={v!r} must be a non-negative integer number of bytes")
    return int(v)


def _check_int(name, v, lo) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ValueError(f"{name}={v!r} must be an integer >= {lo}")
