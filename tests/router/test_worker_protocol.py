"""The router against workers that stretch HTTP/1.1: interim answers, oversized heads,
header values that would split the request, and TLS workers."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from switchyard.net.errors import ConnectError
from switchyard.net.httpclient import ConnectionPool
from switchyard.router.settings import TLS
from tests.router.inprocess import running_router
from tests.router.stub_backend import StubBackend, StubReply, StubRequest
from tests.router.test_router_errors import assert_openai_error

BODY = {"model": "stub-model", "prompt": "hi", "max_tokens": 4}
ANSWER = orjson.dumps({"id": "cmpl-1", "object": "text_completion", "choices": []})


def raw_answers(raw: bytes) -> StubBackend:
    """A worker whose completions are ``raw``, written byte for byte."""

    async def route(request: StubRequest) -> StubReply | None:
        if request.path == "/v1/completions" and request.json().get("prompt") == "raw":
            return StubReply.verbatim(raw)
        return None

    return StubBackend(route)


async def test_a_worker_that_answers_100_continue_first_is_relayed_its_final_answer() -> None:
    final = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    async with raw_answers(b"HTTP/1.1 100 Continue\r\n\r\n" + final % len(ANSWER) + ANSWER) as w:
        async with running_router(w.url) as router:
            resp = await router.post("/v1/completions", json={**BODY, "prompt": "raw"})
    assert resp.status_code == 200
    assert resp.content == ANSWER


async def test_an_oversized_worker_head_is_a_502_and_the_router_goes_on() -> None:
    huge = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 300_000 + b"\r\nContent-Length: 2\r\n\r\n{}"
    async with raw_answers(huge) as worker:
        async with running_router(worker.url) as router:
            resp = await router.post("/v1/completions", json={**BODY, "prompt": "raw"})
            error = assert_openai_error(resp, 502)
            assert "ResponseHeadTooLarge" in error["message"]
            after = await router.post("/v1/completions", json=BODY)
            assert after.status_code == 200
            assert (await router.get("/health")).status_code == 200


async def test_a_header_value_that_would_split_the_request_is_a_400(engine: StubBackend) -> None:
    async with running_router(engine.url) as router:
        resp = await router.post("/v1/completions", json=BODY, headers={"baggage": "a\x00b"})
        error = assert_openai_error(resp, 400)
        assert error["code"] == "invalid_header"
        assert engine.state.requests == 0  # nothing reached the worker
        assert (await router.post("/v1/completions", json=BODY)).status_code == 200


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key: (cert, key) PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "switchyard test worker")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "worker.pem", directory / "worker.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


@pytest.fixture
async def tls_worker(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """A worker answering over TLS on 127.0.0.1 with a self-signed certificate."""
    cert_file, key_file = self_signed(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert_file, key_file)
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next(
                    (
                        int(line[15:])
                        for line in head.lower().split(b"\r\n")
                        if line.startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context)
    port = server.sockets[0].getsockname()[1]
    yield f"https://127.0.0.1:{port}/v1/completions", cert_file
    server.close()


async def test_a_tls_worker_is_reached_with_the_ca_file_of_its_settings(tls_worker) -> None:
    url, cert_file = tls_worker
    pool = ConnectionPool(connect_timeout_s=2.0, ssl_context=TLS(ca_file=str(cert_file)).context())
    try:
        for _ in range(2):
            resp = await pool.post(url, b"{}", {})
            assert (resp.status, await resp.read()) == (200, b"ok")
    finally:
        await pool.close()


async def test_a_tls_worker_whose_certificate_is_not_trusted_is_refused(tls_worker) -> None:
    url, _ = tls_worker
    pool = ConnectionPool(connect_timeout_s=2.0, ssl_context=TLS().context())
    try:
        with pytest.raises(ConnectError) as raised:
            await pool.post(url, b"{}", {})
        assert isinstance(raised.value.__cause__, ssl.SSLCertVerificationError)
        assert not raised.value.maybe_started
    finally:
        await pool.close()


async def test_a_tls_worker_is_reached_unverified_where_verify_is_off(tls_worker) -> None:
    url, _ = tls_worker
    pool = ConnectionPool(connect_timeout_s=2.0, ssl_context=TLS(verify=False).context())
    try:
        resp = await pool.post(url, b"{}", {})
        assert (resp.status, await resp.read()) == (200, b"ok")
    finally:
        await pool.close()


async def test_a_worker_that_requires_a_client_certificate_gets_the_settings_one(
    tmp_path: Path,
) -> None:
    cert_file, key_file = self_signed(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert_file, key_file)
    server_context.verify_mode = ssl.CERT_REQUIRED
    server_context.load_verify_locations(cert_file)  # the one client it knows
    peers: list[object] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peercert"))
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/health"
    tls = TLS(ca_file=str(cert_file), cert_file=str(cert_file), key_file=str(key_file))
    pool = ConnectionPool(connect_timeout_s=2.0, ssl_context=tls.context())
    try:
        resp = await pool.get(url)
        assert (resp.status, await resp.read()) == (200, b"ok")
        assert peers and peers[0]  # the worker saw our certificate
    finally:
        await pool.close()
        server.close()


def test_a_key_file_without_its_certificate_is_refused() -> None:
    with pytest.raises(ValueError, match="--tls-key-file needs --tls-cert-file"):
        TLS(key_file="worker.key")


async def test_a_router_reaches_and_probes_an_https_worker_with_its_tls_ca_file(
    tmp_path: Path,
) -> None:
    cert_file, key_file = self_signed(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert_file, key_file)
    async with StubBackend(tls=server_context) as engine:
        assert engine.url.startswith("https://")
        async with running_router(
            engine.url, config={"router": {"tls": {"ca_file": str(cert_file)}}}
        ) as router:
            r = await router.client.post(
                "/v1/completions", json={"model": "stub-model", "prompt": "hi", "max_tokens": 4}
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-switchyard-worker"] == engine.url
            health = await router.client.get("/health")
            assert health.status_code == 200  # the balancer's probe trusted the worker too
