"""Named fault-injection points (as etcd's gofail), set by PAT_FAILPOINTS="name@rank[~seconds],...".

`failpoint` makes that rank exit abruptly when it reaches the point (tests kill a rank in the middle of a
regroup with it), or, with ~seconds, stall there that long (a peer that is alive but late); `active` lets a
rank simulate a silent fault, such as a corrupted weight shard.
"""

import os
import time

EXIT_CODE = 86


def _spec(name: str, rank: int) -> str | None:
    for entry in os.environ.get("PAT_FAILPOINTS", "").split(","):
        point, _, stall = entry.partition("~")
        if point == f"{name}@{rank}":
            return stall
    return None


def active(name: str, rank: int) -> bool:
    return _spec(name, rank) is not None


def failpoint(name: str, rank: int) -> None:
    stall = _spec(name, rank)
    if stall:
        time.sleep(float(stall))
    elif stall is not None:
        os._exit(EXIT_CODE)
