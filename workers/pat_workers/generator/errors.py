"""What a generator pod refuses, as exceptions carrying their HTTP status: both engines' pods raise them and
server.py turns them into JSON errors. Each is raised before anything changed."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from pat_operator.podapi import RegroupAck, RegroupPlan, WeightUpdate

from ..weightsync import handover_address, parse_address


class PodError(Exception):
    """A request the pod refuses; `status` is its HTTP status code. Nothing changed."""

    status = 500


class Conflict(PodError):
    status = 409


class Forbidden(PodError):
    status = 403


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


@dataclass(frozen=True)
class WeightStore:
    """The job's weight-sync store (--weights-store), which its trainer's rank 0 hosts: a DNS name or an address, and
    the port when the trainer's is fixed (None: any, the trainer picks a free one)."""
    host: str
    port: int | None = None

    @classmethod
    def parse(cls, value: str) -> WeightStore:
        """HOST or HOST:PORT; an IPv6 address bare (then a host alone) or in brackets: [fd00::5]:29500."""
        bare_ipv6 = value.count(":") > 1 and not value.startswith("[")
        try:
            parts = urlsplit(f"//[{value}]" if bare_ipv6 else f"//{value}")
            port = parts.port
        except ValueError as e:
            raise ValueError(f"--weights-store {value!r}: {e}; use HOST, HOST:PORT or [IPV6]:PORT") from None
        if not parts.hostname or parts.path or parts.query or parts.fragment or parts.username:
            raise ValueError(f"--weights-store {value!r}: use HOST, HOST:PORT or [IPV6]:PORT")
        return cls(parts.hostname, port)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


async def check_weight_source(update: WeightUpdate, store: WeightStore | None, token: str) -> None:
    """What both engines' pods refuse of a POST /v1/weights before anything connects: a hand-over other than the
    job's own (its name comes from the job's token), or, given the job's store, another store. The store's name and
    the update's host are resolved now (the trainer pod's current address) and must share an address."""
    if update.transport == "device":
        if update.address != (own := handover_address(token)):
            raise Forbidden(f"address: {update.address!r} is not this job's in-pod hand-over {own!r}")
        return
    if store is None:  # started without --weights-store (a local run): any store
        return
    try:
        host, port = parse_address(update.address)
    except ValueError as e:
        raise Invalid(f"address: {e}") from None
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    refused = f"address: {update.address} is not this job's weight-sync store {store} (--weights-store)"
    if store.port is not None and port != store.port:
        raise Forbidden(f"{refused}: the port differs")
    try:
        expected = await _addresses(store.host)
    except OSError as e:
        raise Unavailable(f"--weights-store {store}: cannot resolve {store.host!r} now ({e}); retry") from None
    try:
        announced = await _addresses(host)
    except OSError as e:
        raise Invalid(f"address: cannot resolve {host!r} ({e}); give the trainer's address") from None
    if not expected & announced:
        raise Forbidden(f"{refused}: {host} is {_listed(announced)}, the store {store.host} is {_listed(expected)}")


async def _addresses(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses `host` resolves to, IPv4-mapped IPv6 ones as IPv4 (a dual-stack socket reports those)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    addresses = {ipaddress.ip_address(sockaddr[0].partition("%")[0]) for *_, sockaddr in infos}
    return {getattr(a, "ipv4_mapped", None) or a for a in addresses}


def _listed(addresses: set) -> str:
    return ", ".join(sorted(map(str, addresses)))


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
