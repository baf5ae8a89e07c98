"""A generator pod: the coordinator (an HTTP server, `server`, over one thread that drives the ranks,
`coordinator`) and one engine rank per device. Start one with `python -m pat_workers.generator` or
`pat generator`."""
