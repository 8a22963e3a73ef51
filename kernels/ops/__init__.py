"""The small ops around the matmuls: ``norm`` (RMSNorm), ``rope``, ``elementwise`` (SiLU·mul, residual add),
``embedding`` (row gather), ``sampling`` (argmax, top-k/top-p) and ``scalars`` (the decode graph's position and
length counters)."""
