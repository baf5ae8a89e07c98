"""What a generator pod refuses, as exceptions carrying their HTTP status: both engines' pods raise them and
server.py turns them into JSON errors. Each is raised before anything changed."""

from __future__ import annotations


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
