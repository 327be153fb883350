"""Utilities every layer may use: argument checks (validate), atomic writes (io), peak-memory
counting (memory), scoped CPU threads (threads). No torch model code."""
