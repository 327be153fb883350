"""``creditrl train | eval | diagnose | compare | estimators | config | experiment``.

Each command lives in its own module, imported only when it runs (``COMMANDS``: name -> the import
path of its ``main(argv) -> exit status``), so ``creditrl --help`` loads no torch and a command
loads only what it uses. ``experiment`` comes from the research distribution through the
``creditrl.commands`` entry point. Config values are set with ``--config FILE`` (YAML) and dotted
``key=value`` overrides, e.g. ``creditrl train algorithm.estimator=maxpo algorithm.options.k=4``.
Set CREDITRL_DEBUG=1 to see full tracebacks instead of one-line errors.
"""
from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points

from creditrl import __version__
from creditrl.utils import cli
from creditrl.utils.imports import load_object

COMMANDS = {
    "train": ("creditrl.trainer.command:main", "train a policy (defaults: builtin:tiny on addition)"),
    "eval": ("creditrl.tools.evaluate:main", "held-out greedy accuracy and pass@k / avg@k"),
    "diagnose": ("creditrl.tools.diagnose.command:main", "measure which estimator gives the best gradient on this "
                 "model/task"),
    "compare": ("creditrl.tools.compare:main", "run several configs x seeds and write one comparison report"),
    "estimators": ("creditrl.tools.estimators:main", "list the registered advantage estimators, their facts "
                   "and options"),
    "config": ("creditrl.recipe.reference:main", "print the configuration reference (Markdown; docs/config.md)"),
}
PLUGIN_GROUP = "creditrl.commands"
RESEARCH = {"experiment": ("the papers' claims in miniature (docs/results.md)",
                           "from a clone, `pip install -e research/` (`make setup` does it)")}


INTERRUPTED = {  # what to do after Ctrl-C, where the command's runs are not resumed by --resume
    "compare": " (to finish, run the same compare command again, not the trainer's --resume: it reuses the "
               "finished runs and trains the unfinished one again from the start)",
    "experiment": " (an experiment starts over when run again; the interrupted one's outputs are cleared first)",
}


def commands() -> dict[str, tuple[str, str]]:
    """The built-in commands and those installed packages add (the research distribution's ``experiment``)."""
    found = {ep.name: (ep.value, RESEARCH.get(ep.name, (f"from {ep.dist.name if ep.dist else 'a plug-in'}",))[0])
             for ep in entry_points(group=PLUGIN_GROUP) if ep.name not in COMMANDS}
    return {**COMMANDS, **found}


def usage(available: dict[str, tuple[str, str]]) -> str:
    width = max(map(len, available))
    lines = [f"  {name:<{width}}  {text}" for name, (_, text) in available.items()]
    lines += [f"  {name:<{width}}  {text} (not installed: {how})" for name, (text, how) in RESEARCH.items()
              if name not in available]
    return ("usage: creditrl COMMAND [options] [key=value ...]\n\nCritic-free RL post-training of LLMs (OTB, MaxPO, "
            "STAPO, GRPO-λ) that runs on a CPU.\n\ncommands:\n" + "\n".join(lines) +
            "\n\n`creditrl COMMAND --help` lists a command's options (and every config key).")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    available = commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(available))
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"creditrl {__version__}")
        return 0
    name = argv[0]
    if name not in available:
        why = f"`creditrl {name}` is in the research distribution: {RESEARCH[name][1]}" if name in RESEARCH else (
            f"unknown command {name!r}; expected one of {list(available)}")
        print(f"creditrl: error: {why}", file=sys.stderr)
        return 2
    loaded: list = []
    status = cli.run(name, lambda: loaded.append(load_object(available[name][0], what=f"creditrl {name}")))
    if not loaded:
        return status
    try:
        return int(loaded[0](argv[1:]) or 0)   # each command reports its own errors
    except KeyboardInterrupt:                  # Ctrl-C in a command that does not catch it: one line, 130
        if os.environ.get("CREDITRL_DEBUG"):
            raise
        print(f"creditrl {name}: interrupted" + INTERRUPTED.get(name, ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
