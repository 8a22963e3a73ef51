"""The execution layer: weight residency and streaming, the KV cache, the step's op sequence, the decode graph.

``weights`` (a VA per tensor, resident pages, slots aliased at streamed VAs, pinned host copies, the copy
schedule), ``kv`` (one growing VA range), ``ops`` (the launch adapter: Numba kernels on ``cuda``, NumPy
references recorded in stream order on ``host``), ``step`` (prefill and decode of the dense decoders),
``graph`` (capture once, replay per token), ``engine`` (streams, warm-up, the decode graph, prefill and the
replays of one sequence; driven by one owner thread). ``vmmstream.loading`` places a model with them and
``vmmstream.api`` is the public face.
"""
