"""What a generator pod refuses, as exceptions carrying their HTTP status: both engines' pods raise them and
server.py turns them into JSON errors. Each is raised before anything changed."""

from __future__ import annotations

from pat_operator.podapi import WeightUpdate

from ..weightsync import parse_address


class PodError(Exception):
    """A request the pod refuses; `status` is its HTTP status code. Nothing changed."""

    status = 500


class Conflict(PodError):
    status = 409


class Invalid(PodError):
    status = 422


class NotFound(PodError):
    status = 404


class Unavailable(PodError):
    status = 503


def check_weight_update(update: WeightUpdate, policy_version: int, receivers: int) -> None:
    """What both engines' pods refuse of a POST /v1/weights: an old version, a bad store address, or ranks
    rank_offset .. rank_offset + receivers - 1 outside the weight-sync world."""
    if update.version <= policy_version:
        raise Conflict(f"version: {update.version} is not newer than the pod's policy_version {policy_version}")
    if update.transport == "device":
        return
    try:
        parse_address(update.address)
    except ValueError as e:
        raise Invalid(f"address: {e}") from None
    if update.rank_offset + receivers > update.world:
        raise Invalid(f"rank_offset: ranks {update.rank_offset}..{update.rank_offset + receivers - 1} of this pod's "
                      f"{receivers} do not fit in a weight-sync world of {update.world}")
