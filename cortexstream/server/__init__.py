"""`cortexstream serve`: an OpenAI-compatible HTTP server on the engine (FastAPI app, uvicorn, ThreadedEngine).

One concept per module: `config` (settings), `errors` (OpenAI error bodies), `protocol` (request schemas),
`auth` (API keys as prefix-cache tenants), `limits` (request size caps), `jobs` (what crosses the thread
boundary), `bridge` (engine thread <-> event loop), `prepare` (API request -> engine job), `responses` (chunks
and bodies), `metrics` (Prometheus), `kv_view` (/v1/kv), `routes` (endpoints), `app` (the ASGI app and its
lifespan), `uvicorn_server` (uvicorn, SIGTERM).
"""

from cortexstream.server.app import create_app
from cortexstream.server.config import ServerConfig

__all__ = ["create_app", "ServerConfig"]
