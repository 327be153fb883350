"""creditrl's research: each paper's claim tested in miniature (``creditrl experiment``), with the
machinery only the experiments need (synthetic and fixed policies, trainer studies, verdict rules).

A second distribution beside the library (``pip install -e research/``); the installed ``creditrl``
package never imports it. It adds the ``experiment`` command to ``creditrl`` through the
``creditrl.commands`` entry point.
"""
