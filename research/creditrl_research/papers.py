"""The papers' numbers that several experiments test against (``../shared/notes/paper-numbers.md``)."""
from __future__ import annotations

PAPER_MAXPO_VARIANCE_RATIO = 1 - 0.774    # MaxPO §5.2.3: 77.4% lower than EI-only (Adam proxy, Llama-3.2-3B)
