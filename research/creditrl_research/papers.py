"""The papers' numbers that several experiments test against (``../shared/notes/paper-numbers.md``)."""
from __future__ import annotations

# MaxPO §5.2.3: 77.4% lower Adam-moment proxy than PKPO (Llama-3.2-3B), the paper's "EI-only variant":
# PKPO's sloo_minus_one is (K/N)·EI, so this raw proxy is at a different gradient scale from raw EI
PAPER_MAXPO_VARIANCE_RATIO = 1 - 0.774
