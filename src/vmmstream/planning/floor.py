"""The non-weight floor: device bytes a model needs before a single weight is placed (DESIGN §4, §5).

All pure functions of sizes. Each component is rounded up to whole granules because each lives in
its own arena of whole physical handles (DESIGN §3). ``config`` is anything with the ``ModelConfig``
size attributes; this layer never imports the model layer.
"""

from __future__ import annotations

import math

MiB = 2**20
GRANULARITY = 2 * MiB          # H200's VMM granularity (GPU.md); the driver's figure overrides it
PREFILL_CHUNK = 512            # tokens a prefill walks through each layer at once (default; streamed plans choose)
PREFILL_SUB = 512              # of a longer walk, the tokens whose MLP product / materialized scores exist at once
BF16 = 2
FUSED_HEAD_DIMS = tuple(range(16, 129, 16))   # head dims with a fused prefill route (no workspace): MMA_HEAD_DIMS
                                              # of kernels/attention/prefill.py
_BUFFERS, _ALIGN = 40, 256        # activation buffers at most (execution/step.py), each aligned to 256 bytes
_ARGMAX_SPLIT_CHUNK, _ARGMAX_MAX_SPLIT = 4096, 256    # kernels/sampling: greedy partials per row


def round_up(n: int, granularity: int) -> int:
    return -(-int(n) // granularity) * granularity


def kv_row_bytes(config) -> int:
    """One position of the KV cache: K and V of every layer (bf16), the layers of a position side by side."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * BF16


def kv_cache_bytes(config, max_context: int, batch: int, granularity: int) -> int:
    """K and V for every layer at ``max_context`` positions of ``batch`` sequences, bf16, one arena:

    one sequence: ``2 · layers · kv_heads · head_dim · 2 bytes · max_context``, rounded up to a granule; a batch:
    ``batch`` ranges of ``slot_stride`` positions each (whole granules per sequence, so each maps and unmaps its
    own pages: ``execution/kv_batch.py``).
    """
    row = kv_row_bytes(config)
    if batch == 1:
        return round_up(row * max_context, granularity)
    return batch * slot_stride(max_context, row, granularity) * row


def slot_stride(max_context: int, row_bytes: int, granularity: int) -> int:
    """Positions per sequence range of a batch's KV cache: the least count >= ``max_context`` whose bytes
    (``row_bytes`` a position) are whole granules."""
    q = granularity // math.gcd(granularity, row_bytes)
    return -(-max_context // q) * q


def estimate_workspace(config, max_context: int, batch: int, prefill_chunk: int = PREFILL_CHUNK) -> dict:
    """A built-in *estimate* of the kernel workspace peaks, ``{"step": bytes, "session": bytes}`` (unrounded).

    ``load_model`` should pass the real peaks, found by asking each kernel's ``workspace_requirement``
    at the planned shapes; this estimate mirrors those formulas for the kernels that declare any:

    - step: prefill attention without a fused route (head_dim not 64/128) materialises fp32 scores
      ``[Hq, T, max_context]`` for a prefill chunk of ``T = min(prefill_chunk, max_context)`` tokens;
      the fused routes need none.
    - session: greedy argmax partials, 8 bytes × batch × ``min(256, ceil(vocab / 4096))`` (captured
      decode needs them at a stable address).
    """
    t = min(prefill_chunk, max_context, PREFILL_SUB)
    step = 0 if config.head_dim in FUSED_HEAD_DIMS else 4 * config.num_attention_heads * t * max_context
    splits = max(1, min(_ARGMAX_MAX_SPLIT, math.ceil(config.vocab_size / _ARGMAX_SPLIT_CHUNK)))
    return {"step": step, "session": 8 * batch * splits}


def activation_bytes(config, max_context: int, batch: int, granularity: int,
                     prefill_chunk: int = PREFILL_CHUNK) -> int:
    """An *estimate* of the activation buffers, rounded up to a granule.

    For ``T = min(prefill_chunk, max_context)`` tokens of each of ``batch`` sequences, bf16:
    3 hidden-sized buffers (residual stream, normed input, projection output); in one region shared by the two
    halves of a layer, the larger of q and the attention output (``Hq · head_dim`` each) with k and v
    (``Hkv · head_dim`` each), and of an MLP-sized gate with two more MLP-sized buffers (up and a margin) for
    ``min(T, PREFILL_SUB)`` tokens (a dense walk computes up and silu(gate)·up in parts; a mixture of experts for
    all T); plus fp32 logits for one position per sequence
    (``vocab · 4 · batch``), int32 token ids, positions and cache rows (``12 · T · batch``), the int32 output tokens
    (``4 · max_context``), the RoPE table and the alignment of every buffer. Decode uses a prefix of the same
    buffers (T = 1). The MLP width is the widest of the dense, routed-expert and shared-expert intermediate
    sizes; a mixture of experts adds fp32 router logits (``4 · experts``), an fp32 accumulator of the routed experts' outputs (``4 · hidden``), the
    top-k ids, weights and slot mapping (``12 · k``), the shared-expert gate logit, and the experts' fp32
    outputs (``4 · k · hidden``) per token, plus the expert location table and counters.
    """
    t = min(prefill_chunk, max_context)
    width = max(config.intermediate_size, getattr(config, "moe_intermediate_size", 0),
                getattr(config, "shared_expert_intermediate_size", 0))
    q_dim = config.num_attention_heads * config.head_dim
    per_token = BF16 * 3 * config.hidden_size
    experts = getattr(config, "num_experts", 0)
    sub = t if experts else min(t, PREFILL_SUB)       # a dense walk longer than PREFILL_SUB: up in parts
    if experts:
        k = config.num_experts_per_tok
        per_token += 4 * experts + 4 * config.hidden_size + 12 * k + 4 + 4 * k * config.hidden_size
    rows = max(t, batch)           # a batch's decode step uses a prefix of the walk's buffers, one row a sequence
    # q, k, v and the attention output share one region with gate and up (never live at once): the larger of them
    attention = rows * BF16 * (2 * q_dim + 2 * config.num_key_value_heads * config.head_dim)
    mlp = rows * BF16 * width + max(sub, min(batch, t)) * BF16 * 2 * width
    raw = rows * (per_token + 12) + max(attention, mlp) + batch * config.vocab_size * 4
    raw += 4 * max_context + 64 * batch + 2 * config.head_dim + _BUFFERS * _ALIGN   # output tokens, decode state
    # per sequence, RoPE table, alignment
    if experts:     # expert location table, routing counts, decode counters
        raw += 12 * config.num_hidden_layers * experts + 24 + 4 * 256
    return round_up(raw, granularity)


WALK_SHARE = 8                 # a streamed plan's prefill walk may take up to 1/WALK_SHARE of the budget more


def streaming_walk(config, max_context: int, batch: int, granularity: int, budget: int) -> int:
    """The prefill walk of a plan whose weights stream: the longest (a power of two, or ``max_context``) whose
    activations cost at most ``budget // WALK_SHARE`` more than a ``PREFILL_CHUNK`` walk's.

    Each walk streams every streamed weight once, so a prompt of P tokens costs ``ceil(P / walk)`` passes over
    the streamed bytes; the bytes a longer walk takes from the resident weights are streamed by every decode
    step instead. An eighth of the budget bounds that decode cost while a prompt of a few thousand tokens
    streams once.
    """
    base = activation_bytes(config, max_context, batch, granularity, PREFILL_CHUNK)
    best, w = min(PREFILL_CHUNK, max_context), PREFILL_CHUNK
    while w < max_context:
        w = min(2 * w, max_context)
        if activation_bytes(config, max_context, batch, granularity, w) - base > budget // WALK_SHARE:
            break
        best = w
    return best
