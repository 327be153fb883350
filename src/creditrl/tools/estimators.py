"""``creditrl estimators``: the registered estimators, their declared facts and options."""
from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from creditrl.core.estimators import get_estimator, list_estimators

HELP = "list the registered advantage estimators, their facts and options"


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="creditrl estimators", description=HELP).parse_args(argv)
    table = Table("estimator", "facts", "options (default)", "description")
    for name in list_estimators():
        spec = get_estimator(name)
        options = ", ".join(f"{s.name}={'required' if s.required else s.default}" for s in spec.option_specs or [])
        table.add_row(name, "; ".join(spec.facts()), options, spec.doc)
    Console(width=200).print(table)
    return 0
