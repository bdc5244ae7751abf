"""hetfl: federated learning on heterogeneous, non-IID client data.

The Python API (:mod:`hetfl.api`), imported on first use so that ``import hetfl`` stays cheap (no torch)::

    import hetfl

    result = hetfl.run({"train": {"rounds": 3}}, out="runs/demo")    # a RunResult
    table = hetfl.compare(["fedavg", "fedprox"], overrides=["train.rounds=3"], out="runs/cmp")  # a CompareResult
    grid = hetfl.sweep({"train.lr": [0.01, 0.1]}, overrides=["train.rounds=3"], out="runs/sweep")  # one too
"""

__version__ = "0.1.0"

#: the public names served lazily, and the module each comes from
_LAZY = {
    "run": "hetfl.api",
    "compare": "hetfl.api",
    "sweep": "hetfl.api",
    "RunResult": "hetfl.api",
    "CompareResult": "hetfl.api",
    "ConfigError": "hetfl.params",
    "RunDirError": "hetfl.engine.rundir",
}

__all__ = ["CompareResult", "ConfigError", "RunDirError", "RunResult", "__version__", "compare", "run", "sweep"]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        module = __import__(_LAZY[name], fromlist=[name])
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hetfl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
