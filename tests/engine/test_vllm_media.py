"""The engine refuses media URLs itself, behind validation: vLLM gets the operator's allow-list
(an empty one would let it fetch any host, so an engine given none fetches nothing) and
never follows a redirect. Checked with vLLM's own media connector, built from the settings
the engine starts with, against a server on loopback that counts what it is asked."""

from __future__ import annotations

import io
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import pytest

from engine.base import ModelSpec
from engine.vllm_engine import serve_args, set_env_defaults
from jobs.lib.model_registry import engine_media_domains
from tests.engine import needs_vllm

pytestmark = [needs_vllm, pytest.mark.engine]


def png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (2, 2), "red").save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def server() -> Iterator[tuple[str, list[str]]]:
    """http://127.0.0.1:<port>: /cat.png an image, /away a redirect to the same image on
    `localhost` (another host name). Yields its base URL and the paths it was asked for."""
    asked: list[str] = []
    image = png()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            asked.append(f"{self.headers['Host'].split(':')[0]}{self.path}")
            if self.path == "/away":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{port}/cat.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = httpd.server_address[1]
    thread = Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", asked
    httpd.shutdown()
    httpd.server_close()


def connector(options: dict):
    """vLLM's media connector as its chat renderer builds it for an engine started with
    `options`."""
    from vllm import envs
    from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY

    set_env_defaults()
    args = serve_args(ModelSpec(name="m", backend="vllm", path="/nowhere"), options)
    return MEDIA_CONNECTOR_REGISTRY.load(envs.VLLM_MEDIA_CONNECTOR,
                                         allowed_media_domains=args.allowed_media_domains)


def image_io():
    from vllm.multimodal.media.image import ImageMediaIO

    return ImageMediaIO()


def test_an_engine_without_an_allow_list_fetches_nothing(server):
    base, asked = server
    with pytest.raises(ValueError, match="allowed domains"):
        connector({}).load_from_url(f"{base}/cat.png", image_io())
    assert asked == []


def test_an_allowed_host_is_fetched_but_its_redirects_are_not(server):
    base, asked = server
    media = connector({"allowed_media_domains": ["127.0.0.1"]})
    assert media.load_from_url(f"{base}/cat.png", image_io()).size == (2, 2)
    assert asked == ["127.0.0.1/cat.png"]
    with pytest.raises(Exception):  # noqa: B017 (vLLM's own error for a 302 answer)
        media.load_from_url(f"{base}/away", image_io())
    assert asked == ["127.0.0.1/cat.png", "127.0.0.1/away"]  # localhost was never asked


def test_the_engine_gets_the_operators_allow_list(settings):
    settings.BATCHWEB = {**settings.BATCHWEB,
                         "MEDIA_ALLOWED_DOMAINS": ["Images.Example.com", ".cdn.example.org"]}
    assert engine_media_domains() == ["images.example.com", "cdn.example.org"]
    settings.BATCHWEB_MODELS = [{"name": "m", "backend": "vllm", "path": "/m"}]
    from jobs.lib.model_registry import model_spec

    spec = model_spec("m")
    assert spec is not None
    assert spec.options["allowed_media_domains"] == ["images.example.com", "cdn.example.org"]
    # A model's own setting wins.
    settings.BATCHWEB_MODELS = [{"name": "m", "backend": "vllm", "path": "/m",
                                 "options": {"allowed_media_domains": ["a.example"]}}]
    assert model_spec("m").options["allowed_media_domains"] == ["a.example"]
