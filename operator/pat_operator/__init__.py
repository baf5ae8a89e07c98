"""Control plane of PAT RLHF jobs. Pure contract modules (layout, metric names, fit) are imported by the workers;
nothing in this package imports torch."""


def version() -> str:
    """The installed distribution's version (`pat --version`, `pat-operator --version`). Read when asked, not at
    import: the metadata lookup takes ~25 ms, and every rank of every pod imports this package."""
    from importlib.metadata import version as installed

    return installed("pat-rlhf")
