"""Control plane of PAT RLHF jobs. Pure contract modules (layout, metric names, fit) are imported by the workers;
nothing in this package imports torch."""

from importlib.metadata import version

__version__ = version("pat-rlhf")  # the installed distribution's: `pat --version`, `pat-operator --version`
