"""Control plane of PAT RLHF jobs. Pure contract modules (layout, metric names, fit) are imported by the workers;
nothing in this package imports torch."""
