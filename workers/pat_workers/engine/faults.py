"""Named fault-injection points (as etcd's gofail), set by PAT_FAILPOINTS="name@rank,...".

`failpoint` makes that rank exit abruptly when it reaches the point (tests kill a rank in the middle of a
regroup with it); `active` lets a rank simulate a silent fault, such as a corrupted weight shard.
"""

import os

EXIT_CODE = 86


def active(name: str, rank: int) -> bool:
    return f"{name}@{rank}" in os.environ.get("PAT_FAILPOINTS", "").split(",")


def failpoint(name: str, rank: int) -> None:
    if active(name, rank):
        os._exit(EXIT_CODE)
