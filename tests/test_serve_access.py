"""Who may call ``kvr-serve``: ``--api-key`` over HTTPS (``--ssl-keyfile``/``--ssl-certfile``, a self-signed
certificate made here) as a user starts it. The ``openai`` client with the key completes and streams; with a wrong
key or none it raises ``AuthenticationError`` (a 401 in OpenAI's error shape); /health, /metrics and /version stay
open; the key is also read from KVR_API_KEY; bad TLS flags are one line and exit 2 before any rank starts."""

from __future__ import annotations

import ssl
import subprocess
import sys

import httpx
import openai
import pytest

from tests.test_serve_cli import ENV, MODEL, PROMPT, ROOT, serving

pytestmark = pytest.mark.timeout(300)

KEY = "sk-test-5b1f0c"


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    key, cert = d / "key.pem", d / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


def _trust(cert) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


def _api(url: str, cert, key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60,
                         http_client=httpx.Client(verify=_trust(cert)))


def test_the_api_key_over_https_admits_the_key_and_refuses_a_wrong_or_missing_one(tls):
    key_file, cert = tls
    with serving("--ssl-keyfile", str(key_file), "--ssl-certfile", str(cert), nproc=1,
                 env={"KVR_API_KEY": KEY}) as server:
        url = server.url()
        assert url.startswith("https://127.0.0.1:")
        good = _api(url, cert, KEY)
        c = good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        assert c.usage.completion_tokens == 4
        streamed = "".join(chunk.choices[0].text for chunk in good.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True) if chunk.choices)
        assert streamed == c.choices[0].text
        assert [m.id for m in good.models.list()] == [MODEL]
        with pytest.raises(openai.AuthenticationError) as wrong:
            _api(url, cert, KEY + "x").completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert wrong.value.status_code == 401 and wrong.value.body["code"] == "invalid_api_key"
        assert "not this server's" in wrong.value.body["message"]
        with httpx.Client(verify=_trust(cert), timeout=30) as http:
            bare = http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
            assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
            err = bare.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and "no API key" in err["message"]
            assert http.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401
            assert http.get(f"{url}/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
            for open_path in ("/health", "/version", "/metrics"):
                assert http.get(f"{url}{open_path}").status_code == 200, open_path
            refused = [line for line in http.get(f"{url}/metrics").text.splitlines()
                       if line.startswith('kvr_requests_total{outcome="unauthorized"}')]
            assert refused and float(refused[0].split()[-1]) >= 4
        with pytest.raises(httpx.TransportError):  # plain HTTP to the HTTPS port is dropped, never answered
            httpx.get(url.replace("https://", "http://") + "/v1/models", timeout=10,
                      headers={"Authorization": f"Bearer {KEY}"}).raise_for_status()


@pytest.mark.parametrize("args,says", [
    (["--ssl-certfile", "CERT"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-certfile", "CERT", "--ssl-keyfile", "CERT"], "do not load as a PEM certificate and its key"),
    (["--api-key", " "], "--api-key is empty"),
])
def test_bad_access_flags_are_one_line_and_exit_2(tls, args, says):
    key_file, cert = tls
    args = [str(cert) if a == "CERT" else a for a in args]
    r = subprocess.run([sys.executable, "-m", "kvrunahead.cli.serve", "--model", MODEL, "--nproc", "2", *args],
                       capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr


def test_every_socket_the_ranks_listen_on_is_on_loopback():
    """The rendezvous store, gloo's pairs and the HTTP port of a two-rank server listen on 127.0.0.1 only (torch's
    own store would listen on every interface)."""
    import psutil

    with serving() as server:
        server.url()
        pids = set(server.ranks().values()) | {server.proc.pid}
        assert len(pids) == 3
        listening = [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in pids]
        assert len(listening) >= 3 and {ip for _, ip, _ in listening} == {"127.0.0.1"}, listening
