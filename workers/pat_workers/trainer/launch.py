"""`pat trainer LAUNCH_OPTIONS -- RANK_OPTIONS`: one trainer pod.

torch.distributed.run (torchrun) with LAUNCH_OPTIONS starts the pod's ranks, each `python -m pat_workers.trainer
RANK_OPTIONS` (loop.main) with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. The command ends
when its ranks do, and fails (exit 1, naming the rank) when one fails. commands.trainer_args builds the line.
"""

from __future__ import annotations

import sys

from torch.distributed import run
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

RANK_MODULE = "pat_workers.trainer"


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: pat trainer [torch.distributed.run options] -- [trainer rank options]", file=sys.stderr)
        return 2
    cut = argv.index("--")
    try:
        run.main([*argv[:cut], "--module", RANK_MODULE, *argv[cut + 1:]])
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)
        return 1
    return 0
