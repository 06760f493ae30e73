"""A live `cortexstream serve` app on 127.0.0.1 (ephemeral port) in a background thread, for server tests."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from cortexstream.server import ServerConfig, create_app


class LiveServer:
    def __init__(self, model: Any, tokenizer: Any, **config: Any) -> None:
        config.setdefault("model_name", "tiny")
        config.setdefault("kv_tokens", 4096)
        self.config = ServerConfig(**config)
        self.app = create_app(model, tokenizer, self.config)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def state(self) -> Any:
        return self.app.state.server

    @property
    def engine(self) -> Any:
        return self.state.bridge.engine

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, api_key: str = "none", **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def async_client(self, api_key: str = "none", **kwargs: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """/v1/kv once no sequence is live (aborts land within an engine step or two)."""
        import httpx

        deadline = time.time() + timeout
        while True:
            kv = httpx.get(f"{self.url}/v1/kv", headers=self._auth_header()).json()
            if not kv["sequences"] or time.time() > deadline:
                return kv
            time.sleep(0.05)

    def _auth_header(self) -> dict[str, str]:
        keys = self.config.api_keys
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


def assert_server_takes_policy(model: Any, tokenizer: Any, prompt: list[int], spec: str, bad_spec: str,
                               bad_match: str) -> None:
    """A live server decodes 4 greedy tokens of `prompt` with `spec` as the request's `kv_policy` (greedy: a sampled
    reply could end early on end-of-text), and refuses `bad_spec` with an error matching `bad_match`."""
    import pytest

    with LiveServer(model, tokenizer, kv_tokens=2048) as live:
        out = live.client().completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                               extra_body={"kv_policy": spec})
        assert out.usage.completion_tokens == 4
        bad = live.client().with_options(max_retries=0)
        with pytest.raises(Exception, match=bad_match):
            bad.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"kv_policy": bad_spec})
