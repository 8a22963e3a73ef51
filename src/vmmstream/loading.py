"""Loading: a checkpoint becomes a plan, the plan becomes leases, the leases become placed bytes.

The order is what makes a load safe to fail anywhere: everything that can be refused without touching the device
comes first (a bad quantization kind or budget, a bad checkpoint, shapes the CUDA kernels cannot run), then the
plan, asking the kernels for their workspace at the planned shapes, then admission, which grants every planned
lease or none (a ``CapacityError`` before any allocation, I9), and only then the allocations. ``Placement``
holds what the allocations made, so its owner can release exactly what a failed load had taken so far.

``vmmstream.api.Model`` drives these steps together with the ``Engine`` that runs on the placement.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .budget import format_bytes, parse_budget, parse_budget_spec
from .errors import Attempts, BudgetError, CapacityError
from .execution.kv import KVCache
from .execution.kv_batch import BatchKV
from .execution.step import Activations
from .execution.weights import Weights
from .interrupts import uninterruptible
from .memory.transaction import Transaction
from .planning import floor
from .planning.floor import PREFILL_SUB, streaming_walk

# Every role a plan leases: a model's teardown gives back each one of them.
ROLES_PLANNED = ("weights_resident", "weight_slots", "kv_cache", "workspace_step", "workspace_session",
                 "activations")


def prepare(path, budget=None, *, memory=None, backend: str | None = None, quantize: str | None = None):
    """The checks of a load request, the checkpoint's headers and the device memory to load into:
    ``(checkpoint, memory)``, with the coming model already counted among the memory's users (``memory.models``)
    so that no other model's ``close()`` closes it in between. The process's shared memory, when this load made
    it, closes with the last model on it; a ``memory`` passed in stays the caller's to close.

    Raises ``ValueError`` (bad ``quantize``), ``BudgetError``, ``CheckpointError`` / ``UnsupportedModelError``
    before any device work, and ``BudgetError`` when ``budget`` and a given ``memory`` disagree.
    """
    from . import memory as memmod
    from .model import open_checkpoint
    from .quantization import check_kind
    check_kind(quantize)                            # a bad choice is a ValueError before any work
    if budget is not None:
        parse_budget_spec(budget)                   # a bad budget is a BudgetError before any device work
    ck = open_checkpoint(path)                      # headers only: CheckpointError / UnsupportedModelError
    if memory is not None:
        if budget is not None:
            free, total = memory.driver.mem_get_info()
            want = parse_budget(budget, total, device_free=free)
            if want != memory.authority.budget:
                raise BudgetError(f"budget {budget!r} ({want} bytes) differs from the given memory's budget "
                                  f"({memory.authority.budget} bytes)")
        with memory.lock:
            memory.models += 1
        return ck, memory
    while True:                                     # the shared memory may close under us: then take a new one
        memory = memmod.device_memory(budget, device=0, backend=backend, for_model=True)
        with memory.lock:
            if memory.closed:
                continue
            memory.models += 1
            return ck, memory


def plan_model(checkpoint, memory, *, max_context=None, slots=None, h2d_gbps=None, prefill_chunk=None,
               quantize=None, batch=None):
    """The plan for ``checkpoint`` within ``memory``'s budget, and the prefill chunk ``tmax`` (the activation
    buffers' tokens): ``(plan, tmax)``. Raises ``UnsupportedModelError`` (shapes the CUDA kernels cannot run) or
    ``CapacityError`` (no plan fits)."""
    c = checkpoint.config
    if memory.driver.backend == "cuda":
        _check_cuda_shapes(c)
    a = memory.authority
    # Other models' grants are theirs: plan against what is left (idle retained handles count as free, a grant
    # takes them back). The source says so when it is less than the whole budget.
    held = sum(l.granted for l in a.leases.values())
    left = a.budget - held
    if left <= 0:
        raise CapacityError(f"the other models on this device hold the whole budget ({format_bytes(a.budget)}); "
                            "close one or raise the budget", requested=0, budget=a.budget, in_use=held,
                            role="floor", holder="plan")
    detail = a.budget_source.detail
    if left < a.budget:
        detail = (f"{detail + '; ' if detail else ''}{format_bytes(left)} of {format_bytes(a.budget)} left by "
                  "the other models on this device")

    p = plan_walked(c, checkpoint.tensors, left, backend=memory.driver.backend, prefill_chunk=prefill_chunk,
                    budget_source=(a.budget_source.kind, detail), max_context=max_context, slots=slots, batch=batch,
                    granularity=memory.granularity, h2d_gbps=h2d_gbps, legacy=memory.legacy,
                    sources={"granularity": "explicit", "workspace": "inferred"}, quantize=quantize)
    return p, p.prefill_chunk


RESIDENT_WALK = 4096      # the longest prefill walk a resident plan takes by itself


def plan_walked(config, tensors, budget: int, *, backend: str, prefill_chunk=None, **kw):
    """``make_plan`` with the kernels' workspace peaks for ``backend`` and, where ``prefill_chunk`` is not given:
    for a plan whose weights stream, the longest prefill walk within ``floor.WALK_SHARE`` of the budget that still
    fits (a plan note says what it costs); for a resident plan, the longest up to ``RESIDENT_WALK`` tokens within
    the same share of the budget that leaves it resident (the legacy allocator's plans keep ``PREFILL_CHUNK``).
    What ``load_model`` and ``vmmstream plan`` both use."""
    from .planning import PREFILL_CHUNK, make_plan
    from .planning.plan import DEFAULT_MAX_CONTEXT
    c = config
    mc = kw.get("max_context") or c.default_context(DEFAULT_MAX_CONTEXT)
    gran = kw.get("granularity") or floor.GRANULARITY

    def plan(walk: int):
        return make_plan(c, tensors, budget, prefill_chunk=walk, **kw,
                         workspace=workspace_peaks(c, mc, min(walk, mc), backend, kw.get("batch") or 1, gran))
    p = plan(int(prefill_chunk or PREFILL_CHUNK))

    def floor_of(q):              # what a walk changes: activations and the workspaces
        return q.activations + sum(q.workspace.values())
    if prefill_chunk is None and p.strategy == "streamed":
        # Streamed weights are read once per walk: a longer walk streams a long prompt's weights fewer times
        walk, longer = streaming_walk(c, mc, p.batch, gran, budget), None
        while walk > p.prefill_chunk and longer is None:      # the longest walk under its share that still fits
            try:
                longer = plan(walk)
            except CapacityError:
                pass
            if longer is not None and floor_of(longer) - floor_of(p) > budget // floor.WALK_SHARE:
                longer = None             # a mixture of experts' step workspace grows with the walk too
            if longer is None:
                walk = max(p.prefill_chunk, 1 << (walk - 1).bit_length() - 1)
        if longer is not None and longer.strategy == "streamed":
            extra = floor_of(longer) - floor_of(p)
            note = (f"prefill walks {walk} tokens through each layer, so a prompt of up to {walk} tokens "
                    f"streams each weight once; its activations and workspace take {format_bytes(extra)} more "
                    f"than a {p.prefill_chunk}-token walk's, streamed by each decode step instead "
                    "(prefill_chunk= sets the walk)")
            p = dataclasses.replace(longer, notes=longer.notes + (note,))
    elif prefill_chunk is None and p.strategy == "resident" and mc > p.prefill_chunk:
        # Nothing streams: a longer walk only saves launches and gives the GEMMs more rows. Take the longest up to
        # RESIDENT_WALK whose activations stay within the streamed walk's share of the budget (what other models
        # under the same budget can count on) and that keeps every weight resident.
        walk = min(mc, RESIDENT_WALK, streaming_walk(c, mc, p.batch, gran, budget))
        while walk > p.prefill_chunk:
            try:
                longer = plan(walk)
            except CapacityError:
                longer = None
            if (longer is not None and longer.strategy == "resident"
                    and floor_of(longer) - floor_of(p) <= budget // floor.WALK_SHARE):
                return longer
            walk = max(p.prefill_chunk, 1 << (walk - 1).bit_length() - 1)
    return p


def admit(authority, holder: str, plan) -> None:
    """Grant ``holder`` every role's planned bytes, or none: a refusal undoes the grants made so far (I9)."""
    with Transaction() as tx:
        for role, n in plan.leases().items():
            if n:
                lease = authority.lease(holder, role)
                before = lease.granted
                authority.grant(lease, n)
                tx.on_undo(authority.restore_grant, lease, before)
                lease.keeps_grant = True       # the plan's bytes stay the model's until it closes


def release_leases(authority, holder: str) -> None:
    """Give back what ``admit`` granted. A lease still committed (a release failed) is shrunk to what it holds
    rather than dropped, so the authority's books stay true."""
    for role in ROLES_PLANNED:
        lease = authority.leases.get((holder, role))
        if lease is not None:
            lease.keeps_grant = False          # what is still freed later gives its grant back with it
        if lease is not None and lease.committed == 0:
            del authority.leases[(holder, role)]
        elif lease is not None:
            authority.shrink(lease)


class Placement:
    """Where one model's bytes live on the device: its weights (resident pages, slots aliased at streamed VAs,
    pinned host copies), KV cache, activations and session workspace.

    Built in two steps so that its owner holds it before anything is allocated: ``Placement(memory, holder)``
    holds nothing, ``place(...)`` allocates, and after a failure part-way ``close()`` frees what was taken.
    """

    def __init__(self, memory, holder: str):
        self.memory, self.holder = memory, holder
        self.weights = self.kv = self.acts = self.batch_kv = None
        self.ws_block = self.ws_session = None
        self.blocks = []                # the blocks allocated here (the weights and the KV cache free their own)
        self.closed = False

    def place(self, checkpoint, plan, tmax: int, ops, copy_stream, *, progress=None) -> None:
        """Allocate and fill: weights (uploaded on ``copy_stream``), KV cache, activations for ``tmax`` tokens,
        the session workspace. The plan's leases must have been granted (``admit``)."""
        mem, c = self.memory, checkpoint.config
        if ops.backend == "cuda":       # where long prompts' attention may take cuDNN (its workspace is planned),
            from vmmstream.kernels.attention import cudnn_sdpa, prefill       # start it while the weights upload
            if prefill.session_requirement(plan.max_context, c.num_attention_heads, c.num_key_value_heads,
                                           c.head_dim).bytes:
                # one sequence's cache: a layer's rows are a whole position's row apart (KVCache's layout)
                row = floor.kv_row_bytes(c) // 2 if plan.batch == 1 else 0     # elements (bf16)
                cudnn_sdpa.prewarm(c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                   getattr(ops.driver, "make_current", None), cache_row=row, max_tokens=tmax,
                                   min_tokens=prefill.cudnn_min_prompt(), scale=prefill.default_scale(c.head_dim))
        self.weights = Weights(mem, ops, plan, checkpoint, self.holder, copy_stream, progress=progress)
        if ops.backend == "cuda":     # the cuDNN start (if any) is over before anything is captured or closed
            from vmmstream.kernels.attention import cudnn_sdpa
            cudnn_sdpa.join_prewarm()
        if plan.batch > 1:          # one VA range per sequence; the one-sequence path runs in the first
            self.batch_kv = BatchKV(mem, ops, c, plan.max_context, plan.batch, self.holder)
            self.kv = self.batch_kv.slot(0)
            self.kv.ensure(1)         # as a one-sequence cache does: the warm-up step writes position 0
        else:
            self.kv = KVCache(mem, ops, c, plan, self.holder)
        self.acts = Activations(mem, ops, c, plan, self.holder, tmax, sub=PREFILL_SUB)
        self.blocks.append(self.acts.block)
        if self.weights.experts is not None:
            v = self.acts.views(1)
            self.weights.experts.bind((v.expert_loc, v.expert_counts, v.expert_stats))
        ws = plan.workspace["session"]
        self.ws_block = mem.allocate(ws, role="workspace_session", holder=self.holder, arena="workspace") \
            if ws else None
        if self.ws_block is not None:
            self.blocks.append(self.ws_block)
        self.ws_session = ops.view(self.ws_block.va, (ws,), np.uint8) if ws else None

    @uninterruptible()
    def close(self) -> None:
        """Free what was placed (fenced: after the work queued on the memory's tracked streams). Idempotent;
        every step is attempted, the first failure raised at the end."""
        if self.closed:
            return
        self.closed = True
        mem = self.memory
        attempt = Attempts()

        if self.weights is not None:
            attempt(self.weights.close)
        if self.batch_kv is not None:
            attempt(self.batch_kv.close)
        elif self.kv is not None:
            attempt(self.kv.close)
        if not mem.closed:
            for b in self.blocks:
                attempt(mem.free, b)
            # Anything else still charged to this model: an allocation completed while a Ctrl-C waited
            # (``vmmstream.interrupts``) whose caller never kept it. Aliases go first, as in DeviceMemory.close.
            left = sorted((b for b in mem.blocks if b.lease.holder == self.holder), key=lambda b: b.state != "alias")
            for b in left:
                attempt(mem.free, b)
            attempt(mem.synchronize)
            for name in [n for n in mem.arenas if n.endswith(":" + self.holder)]:
                if not mem.arenas[name]._used:
                    attempt(mem.arenas[name].close)
                    if not mem.arenas[name].closed:
                        continue
                    del mem.arenas[name]
        attempt.raise_first()


def workspace_peaks(config, max_context: int, tmax: int, backend: str = "host", batch: int = 1,
                    granularity: int = floor.GRANULARITY) -> dict:
    """Workspace peaks per lifetime class, from each kernel's ``workspace_requirement`` at the planned shapes.

    The kernels of one stream run in order, so one buffer of the largest need serves each class (max, not sum).
    """
    from vmmstream.kernels.attention import decode as attention_decode
    from vmmstream.kernels.attention import prefill as attention_prefill
    from vmmstream.kernels.ops import sampling
    c = config
    session = max(attention_decode.workspace_requirement(b, c.num_attention_heads, c.num_key_value_heads,
                                                         c.head_dim, s).bytes
                  for b, s in {(1, max_context), (1, kv_stride(c, max_context, batch, granularity)),
                               (batch, kv_stride(c, max_context, batch, granularity))})
    session = max(session, sampling.workspace_requirement(batch, c.vocab_size, "greedy").bytes,
                  sampling.workspace_requirement(1, c.vocab_size, "sample").bytes)
    if backend == "cuda":               # the dense prefill GEMMs' cuBLASLt route, where it loads
        from vmmstream.kernels.matmul.dense import gemm
        session = max(session, gemm.workspace_requirement(tmax, c.hidden_size, c.hidden_size).bytes,
                      attention_prefill.session_requirement(      # long prompts' cuDNN attention, where it loads
                          max_context, c.num_attention_heads, c.num_key_value_heads, c.head_dim).bytes)
    at = tmax if c.is_moe else min(tmax, PREFILL_SUB)     # a dense walk's attention runs in parts of PREFILL_SUB
    step = attention_prefill.workspace_requirement(at, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                                   start_pos=max_context - at).bytes
    if getattr(c, "is_moe", False):
        # expert routing + h: decode (inside the graph: session lifetime) over the k slots or a layer's experts,
        # for each of a batch's sequences; prefill rounds over the k slots
        from vmmstream.kernels import moe
        k, n = c.num_experts_per_tok, max(c.num_experts_per_tok, c.num_experts)
        session = max(session, moe.workspace_requirement(batch, k, n, c.moe_intermediate_size).bytes)
        step = max(step, moe.workspace_requirement(tmax, k, n, c.moe_intermediate_size).bytes)
    return {"step": int(step), "session": int(session)}


def kv_stride(config, max_context: int, batch: int, granularity: int = floor.GRANULARITY) -> int:
    """Positions per sequence range of the KV cache (a batch's ranges are whole granules)."""
    if batch == 1:
        return max_context
    return floor.slot_stride(max_context, floor.kv_row_bytes(config), granularity)


def _check_cuda_shapes(c) -> None:
    from vmmstream.kernels.attention import decode as attention_decode

    from .model import UnsupportedModelError
    if c.is_moe and (c.num_experts > 128 or c.num_experts_per_tok > 8 or c.hidden_size % 8
                     or c.moe_intermediate_size % 8):
        raise UnsupportedModelError(
            f"{c.architecture}: the CUDA MoE kernels take at most 128 experts, top-k <= 8, and hidden and expert "
            "sizes that are multiples of 8")
    if c.head_dim not in attention_decode.HEAD_DIMS:
        raise UnsupportedModelError(
            f"head_dim {c.head_dim}: the CUDA decode attention takes a head_dim that is a multiple of 16 up to 256")


def stored_quantization(checkpoint, quantize):
    """The quantization the plan sizes: a GPTQ / AWQ checkpoint's own (its weights are int4 already), else
    ``quantize``. Asking a quantized checkpoint for another kind is a ``ValueError``."""
    if checkpoint.quantization is None:
        return quantize
    from .errors import PrequantizedFormatError
    from .quantization import is_linear
    plain = [n for n, t in checkpoint.tensors.items() if is_linear(n) and t.source is None]
    if plain:
        raise PrequantizedFormatError(
            f"{checkpoint.path}: a {checkpoint.format} checkpoint with {len(plain)} layer linear weight(s) stored "
            f"unquantized (e.g. {plain[0]}); checkpoints that mix quantized and unquantized layer weights are not "
            "supported")
    if quantize not in (None, checkpoint.quantization):
        raise ValueError(f"quantize={quantize!r}: {checkpoint.path} is a {checkpoint.format} checkpoint whose "
                         f"layer weights are {checkpoint.quantization} already; load it without quantize (they "
                         "are repacked as stored, never re-quantized)")
    return checkpoint.quantization
