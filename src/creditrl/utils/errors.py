"""The error a user can act on: the command line prints its message as one line (CREDITRL_DEBUG=1
shows the traceback). Bad arguments are ``ValueError``/``TypeError``, files ``OSError``, missing
extras ``ImportError``; a run that cannot go on raises a ``CreditrlError``."""
from __future__ import annotations


class CreditrlError(RuntimeError):
    """A run or command that cannot go on; the message says why and what to do."""


USER_ERRORS = (ValueError, TypeError, OSError, ImportError, CreditrlError)
