"""``Model.generate`` given a list of prompts: the prompts decode together in the model's batch (``max_batch``),
joining as slots free, each with its own seed, stop ids and stop strings — what each gets alone with the same
arguments (``execution/batch.py`` says how)."""

from __future__ import annotations

import numpy as np

from .errors import CapacityError
from .text import TokenText


def is_prompt_list(prompt) -> bool:
    """A list of prompts (texts, or token-id lists / tuples / 1-D arrays), not one prompt of token ids."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(p, (str, list, tuple)) or (isinstance(p, np.ndarray) and p.ndim == 1)
                    for p in prompt))


def generate_many(model, prompts, max_new_tokens, *, eos_token_id, stop, return_logits, seed, sampling) -> list:
    """One result per prompt (text for a text prompt, else ids; with ``return_logits`` a (result, logits) pair)."""
    from .execution.batch import BatchDecoder
    m = model
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"seed: {len(seeds)} seeds for {len(prompts)} prompts")
    if m.placement.batch_kv is None:
        raise TypeError("prompt: expected token ids (ints) or text; a list of prompts needs a model loaded with "
                        "max_batch > 1 (load_model(..., max_batch=8)), this one decodes one sequence at a time")
    reqs = [m._request(p, max_new_tokens, eos_token_id=eos_token_id, stop=stop, return_logits=return_logits,
                       want_text=isinstance(p, str), seed=sd, **sampling) for p, sd in zip(prompts, seeds)]
    seqs: list = [None] * len(reqs)
    texts = [TokenText(m.tokenizer, r.stop) if r.want_text else None for r in reqs]
    fed = [0] * len(reqs)

    def feed(dec, i) -> None:           # new tokens through the text: a stop string ends the sequence
        q, t = seqs[i], texts[i]
        if t is None or q is None:
            return
        new = q.tokens[fed[i]:]
        t.feed(new, last=q.done and not t.stopped)
        fed[i] = len(q.tokens)
        if t.stopped and not q.done:
            dec.finish(q)

    with m._lock:
        m._take_engine()
        dec = BatchDecoder(m.engine, m.placement.batch_kv)
        try:
            waiting = list(range(len(reqs)))
            while waiting or dec.active():
                while waiting and dec.free_slots():            # joins between steps, prefilled together
                    take = waiting[:dec.free_slots()]
                    try:
                        joined = dec.add_many([(reqs[i].ids, reqs[i].max_new_tokens,
                                                dict(stop=reqs[i].eos, return_logits=reqs[i].return_logits,
                                                     sampling=reqs[i].sampling, seed=reqs[i].seed)) for i in take])
                    except CapacityError:
                        if not dec.active():                    # nothing will leave to make room
                            raise
                        break                                   # joins once a sequence leaves
                    if not joined:
                        break
                    for i, q in zip(take, joined):
                        seqs[i] = q
                        waiting.remove(i)
                        feed(dec, i)
                dec.step()
                for i in range(len(reqs)):
                    feed(dec, i)
        finally:
            dec.close()
    out = []
    for p, q, t in zip(prompts, seqs, texts):      # each text was fed its last token with last=True, or stopped
        keep = len(t.tokens) if t is not None else len(q.tokens)
        res = t.text if isinstance(p, str) else list(q.tokens[:keep])
        out.append((res, np.stack(q.logits[:keep])) if return_logits else res)
    return out

