"""A stand-in for ray on the GPU bench machine, where ray (a 70 MB wheel) cannot travel.

verl/protocol.py and verl/utils/distributed.py import ray at module level; the functions
bench_gpu.py times (torch_functional, core_algos) never call it. Anything used raises.
"""


class ObjectRef:
    pass


class _Unavailable:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"ray.{self._name} called, but this is the bench machine's stub of ray")

    def __getattr__(self, item):
        return _Unavailable(f"{self._name}.{item}")


def remote(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(name)
