"""What a generator pod refuses, as exceptions carrying their HTTP status: both engines' pods raise them and
server.py turns them into JSON errors. Each is raised before anything changed."""

from __future__ import annotations

from pat_operator.podapi import RegroupAck, RegroupPlan, WeightUpdate

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


def check_plan(plan: RegroupPlan, epoch: int, layout: list[int], last: RegroupAck | None) -> RegroupAck | None:
    """What both engines' pods refuse of an operator's plan given the pod's applied epoch and layout: an epoch not
    newer, or one made for another epoch. Returns the last acknowledgement for a retry of the plan just applied."""
    if last is not None and plan.epoch == last.applied_epoch == epoch:
        return last
    if plan.epoch <= epoch:
        raise Conflict(f"epoch: plan epoch {plan.epoch} is not newer than the applied epoch {epoch}; plans must come "
                       f"with increasing epochs")
    if plan.from_epoch is not None and plan.from_epoch != epoch:
        raise Conflict(f"from_epoch: the plan was made for epoch {plan.from_epoch}, the pod is at epoch {epoch} "
                       f"(layout {layout}); plan again from the current state")
    return None
