"""Prometheus auth (PrometheusAuth: a bearer token file, a CA file, extra headers) on each query, never on the session
the operator shares with the pods: against a local server that records the headers (the test's real Prometheus cannot
require a token) and serves HTTPS with a certificate of the test's own CA; and a query through the real Prometheus
without auth, as before."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import ssl
import subprocess

import aiohttp
import pytest

from pat_operator.prometheus import PrometheusAuth, PrometheusError, header_flag, query
from tests.stubserver import Answer, StubServer

VECTOR = Answer(200, {"status": "success", "data": {"resultType": "vector", "result": [
    {"metric": {"pod": "g-0"}, "value": [1.0, "3"]}]}})


def run_queries(url: str, *auths: PrometheusAuth | None, pod_call: bool = False, promql: str = "up") -> list:
    """query() with each auth in turn on one session; then, with pod_call, a plain GET on the same session (as the
    operator reads a pod's /metrics). Returns each query's result, or its PrometheusError."""
    async def go():
        out = []
        async with aiohttp.ClientSession() as session:
            for auth in auths:
                try:
                    out.append(await query(session, url, promql, 5, auth))
                except PrometheusError as e:
                    out.append(e)
            if pod_call:
                async with session.get(url + "/metrics") as resp:
                    await resp.read()
        return out

    return asyncio.run(go())


def test_token_and_headers_go_with_each_query_only(tmp_path):
    token = tmp_path / "token"
    token.write_text("first\n")
    auth = PrometheusAuth(bearer_token_file=str(token), headers={"X-Scope-OrgID": "tenant-1"})
    with StubServer(VECTOR) as s:
        [result] = run_queries(s.url, auth)
        token.write_text("rotated")  # a projected token, renewed by the kubelet
        run_queries(s.url, auth, None, pod_call=True)
    assert result == VECTOR.body["data"]["result"]
    sent = [(r.path.split("?")[0], r.headers.get("Authorization"), r.headers.get("X-Scope-OrgID")) for r in s.requests]
    assert sent == [("/api/v1/query", "Bearer first", "tenant-1"), ("/api/v1/query", "Bearer rotated", "tenant-1"),
                    ("/api/v1/query", None, None),  # auth=None: as before
                    ("/metrics", None, None)]  # the session the pods share saw no credentials


def test_an_unreadable_token_file_names_the_flag(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("")
    with StubServer(VECTOR) as s:
        missing, blank = run_queries(s.url, PrometheusAuth(bearer_token_file=str(tmp_path / "none")),
                                     PrometheusAuth(bearer_token_file=str(empty)))
    assert (missing.reason, str(missing)) == (
        "PrometheusAuthFailed", f"--prometheus-bearer-token-file {tmp_path / 'none'}: No such file or directory")
    assert str(blank) == f"--prometheus-bearer-token-file {empty} is empty"
    assert s.requests == []


def test_a_refused_token_is_an_auth_failure(tmp_path):
    token = tmp_path / "token"
    token.write_text("expired")
    with StubServer(Answer(401, b"Unauthorized\n", {"Content-Type": "text/plain"})) as s:
        [refused] = run_queries(s.url, PrometheusAuth(bearer_token_file=str(token)))
    assert (refused.reason, str(refused)) == (
        "PrometheusAuthFailed", f"{s.url}: HTTP 401: check --prometheus-bearer-token-file and --prometheus-header")


def test_bad_headers_are_refused_naming_the_flag():
    assert header_flag("X-Scope-OrgID=a=b") == ("X-Scope-OrgID", "a=b")
    with pytest.raises(argparse.ArgumentTypeError, match="give NAME=VALUE"):
        header_flag("X-Scope-OrgID")
    with pytest.raises(ValueError, match=r"--prometheus-header X Y=\.\.\.: give NAME=VALUE, NAME an HTTP header"):
        PrometheusAuth(headers={"X Y": "secret"})
    with pytest.raises(ValueError, match="both set the Authorization header"):
        PrometheusAuth(bearer_token_file="/t", headers={"authorization": "Basic eDp5"})


def certificates(tmp_path) -> tuple[str, str, str]:
    """A CA, and a server certificate for 127.0.0.1 that it signed (the openssl command): (CA file, certificate
    file, key file)."""
    if not shutil.which("openssl"):
        pytest.skip("no openssl command")
    ca, ca_key, cert, key, csr = (str(tmp_path / f) for f in ("ca.crt", "ca.key", "server.crt", "server.key",
                                                                "server.csr"))
    (tmp_path / "server.ext").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                                         "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for command in (["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=test CA",
                     "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"],
                    ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=prometheus"],
                    ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-set_serial", "2", "-days", "1",
                     "-extfile", str(tmp_path / "server.ext"), "-out", cert]):
        subprocess.run(["openssl", *command], check=True, capture_output=True)
    return ca, cert, key


def test_https_with_the_ca_file(tmp_path):
    ca_file, cert_file, key_file = certificates(tmp_path)
    served = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    served.load_cert_chain(cert_file, key_file)
    auth = PrometheusAuth(ca_file=ca_file)
    with StubServer(VECTOR, ssl_context=served) as s:
        trusted, unknown = run_queries(s.url, auth, None)
    assert trusted == VECTOR.body["data"]["result"]
    # The negative control: without the CA file the system's CAs do not know the server's.
    assert unknown.reason == "PrometheusUnreachable" and "CERTIFICATE_VERIFY_FAILED" in str(unknown), unknown
    assert len(s.requests) == 1
    assert auth.ssl_context() is auth.ssl_context()  # read once per CA file (and version)


def test_a_missing_ca_file_names_the_flag(tmp_path):
    with pytest.raises(PrometheusError, match=f"--prometheus-ca-file {tmp_path}/none: No such file or directory"):
        PrometheusAuth(ca_file=str(tmp_path / "none")).ssl_context()


@pytest.mark.cluster
def test_the_real_prometheus_without_auth(prometheus):
    [[sample]] = run_queries(prometheus.url, None, promql="vector(1)")
    assert sample["metric"] == {} and sample["value"][1] == "1"
