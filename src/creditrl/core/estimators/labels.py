"""Estimator labels: a registered name, or ``NAME+loo`` for its ``leave_one_out=True`` form
(``otb+loo``), as `creditrl diagnose` and the experiments name the rows they compare."""
from __future__ import annotations

from creditrl.core.estimators.registry import get_estimator, list_estimators

LOO = "+loo"


def name_of(label: str) -> str:
    return label.removesuffix(LOO)


def takes_k(label: str) -> bool:
    """Whether the label's estimator is a max@K one (declares a K range)."""
    return get_estimator(name_of(label)).k_range is not None


def label_options(label: str, k: int | None = None) -> tuple[str, dict]:
    """(registered name, options) of a label: ``+loo`` sets leave_one_out; an estimator with a
    declared K range gets ``k``. Unknown names and ``+loo`` on an estimator without that form raise."""
    name = name_of(label)
    spec = get_estimator(name)
    if label.endswith(LOO) and not spec.leave_one_out:
        raise ValueError(f"estimator label {label!r}: {name} has no leave_one_out form; labels are {all_labels(1)}")
    options = {"leave_one_out": True} if label.endswith(LOO) else {}
    if spec.k_range is not None:
        options["k"] = k
    return name, options


def all_labels(k: int | None) -> list[str]:
    """Every registered estimator (those with a K range only when ``k`` is given) and every
    ``leave_one_out`` form."""
    out = []
    for name in list_estimators():
        spec = get_estimator(name)
        if spec.k_range is not None and k is None:
            continue
        out += [name, name + LOO] if spec.leave_one_out else [name]
    return out
