"""Addresses of pods and stores: URLs with IPv6 in brackets, the generator's --weights-store, and the check that a
weight update names the job's own store (names resolved with the system's resolver, as in a pod)."""

from __future__ import annotations

import asyncio

import pytest

from pat_operator.podapi import WeightUpdate
from pat_operator.podclient import http_url
from pat_workers.generator.errors import Forbidden, Invalid, Unavailable, WeightStore, check_weight_source
from pat_workers.weightsync import handover_address


@pytest.mark.parametrize("host, url", [
    ("10.0.0.5", "http://10.0.0.5:8000"), ("fd00::5", "http://[fd00::5]:8000"), ("::", "http://[::]:8000"),
    ("[fd00::5]", "http://[fd00::5]:8000"), ("g-0.job.ns.svc", "http://g-0.job.ns.svc:8000"),
    ("$(POD_IP)", "http://$(POD_IP):8000"),
])
def test_http_url_brackets_ipv6_only(host, url):
    assert http_url(host, 8000) == url


@pytest.mark.parametrize("value, store", [
    ("t-0.job.ns.svc", WeightStore("t-0.job.ns.svc")), ("10.0.0.5:29501", WeightStore("10.0.0.5", 29501)),
    ("fd00::5", WeightStore("fd00::5")), ("[fd00::5]", WeightStore("fd00::5")),
    ("[fd00::5]:29501", WeightStore("fd00::5", 29501)),
])
def test_weights_store_flag_parses(value, store):
    assert WeightStore.parse(value) == store
    assert WeightStore.parse(str(store)) == store


@pytest.mark.parametrize("value, error", [
    ("host:port", "Port could not be cast to integer value as 'port'"), ("[fd00::5", "Invalid IPv6 URL"),
    ("host/path", "use HOST, HOST:PORT or [IPV6]:PORT"), ("", "use HOST, HOST:PORT or [IPV6]:PORT"),
])
def test_a_bad_weights_store_flag_is_named(value, error):
    with pytest.raises(ValueError, match=r"--weights-store .*" + error.replace("[", r"\[")):
        WeightStore.parse(value)


def _check(address: str, store: WeightStore | None, transport: str = "group", token: str = "t") -> None:
    update = WeightUpdate(version=1, address=address, transport=transport, world=2, rank_offset=1)
    asyncio.run(check_weight_source(update, store, token))


@pytest.mark.parametrize("address, store", [
    ("127.0.0.1:29500", WeightStore("localhost")),  # a name resolved (/etc/hosts), the trainer's IP announced
    ("127.0.0.1:29500", WeightStore("localhost", 29500)),
    ("::ffff:127.0.0.1:29500", WeightStore("127.0.0.1")),  # IPv4-mapped: as a dual-stack socket reports it
    ("::1:29500", WeightStore("::1")),  # the trainer announces host:port unbracketed
    ("[::1]:29500", WeightStore("0:0::1", 29500)),  # bracketed, and another spelling of the same address
    ("10.9.9.9:1", None),  # no --weights-store: any store
])
def test_the_jobs_own_store_is_taken(address, store):
    _check(address, store)


@pytest.mark.parametrize("address, store, error", [
    ("127.0.0.2:29500", WeightStore("localhost"), Forbidden("address: 127.0.0.2:29500 is not this job's weight-sync "
     "store localhost (--weights-store): 127.0.0.2 is 127.0.0.2, the store localhost is 127.0.0.1")),
    ("127.0.0.1:29501", WeightStore("localhost", 29500), Forbidden("address: 127.0.0.1:29501 is not this job's "
     "weight-sync store localhost:29500 (--weights-store): the port differs")),
    ("[::2]:29500", WeightStore("::1"), Forbidden("address: [::2]:29500 is not this job's weight-sync store [::1] "
     "(--weights-store): ::2 is ::2, the store ::1 is ::1")),
    ("no-such-host.invalid:29500", WeightStore("localhost"), Invalid("address: cannot resolve 'no-such-host.invalid'")),
    ("127.0.0.1:29500", WeightStore("no-such-host.invalid"), Unavailable("--weights-store no-such-host.invalid: "
     "cannot resolve 'no-such-host.invalid' now")),
    ("127.0.0.1", WeightStore("localhost"), Invalid("address: weight-sync address '127.0.0.1': use host:port")),
])
def test_another_store_is_refused_naming_the_field_and_the_expected_store(address, store, error):
    with pytest.raises(type(error)) as refused:
        _check(address, store)
    assert str(refused.value).startswith(str(error)), refused.value


def test_the_in_pod_hand_over_must_be_the_jobs_own():
    own = handover_address("control")
    _check(own, WeightStore("no-such-host.invalid"), "device", "control")  # no store lookup for the hand-over
    with pytest.raises(Forbidden, match=f"address: '{handover_address('other')}' is not this job's in-pod hand-over "
                                        f"'{own}'"):
        _check(handover_address("other"), None, "device", "control")


@pytest.mark.parametrize("args, env, error", [
    (["--weights-store", "host:port"], {}, "--weights-store 'host:port': Port could not be cast"),
    ([], {"PAT_INFERENCE_TOKEN": "same"}, "the inference token equals the control token"),
], ids=["bad-store", "same-tokens"])
def test_the_generator_refuses_a_bad_store_or_an_inference_token_equal_to_the_control_token(monkeypatch, capsys, args,
                                                                                           env, error):
    from pat_workers.generator.__main__ import main as generator

    for name, value in {"PAT_JOB_TOKEN": "same", **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        generator(["--model", "/no/model", "--ranks", "1", *args])
    assert exited.value.code == 2 and error in capsys.readouterr().err
