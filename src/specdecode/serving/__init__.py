"""An OpenAI-compatible HTTP server over the speculative decoder: FastAPI routes (``app``) over the request handling
(``server``), its settings (``config``), the middleware, Host allow-list, stalled readers and clean shutdown
(``middleware``, ``hosts``, ``stalls``, ``shutdown``), Prometheus metrics (``metrics``), a loopback server for tests
and benchmarks (``local``); OpenAI's wire format (``openai/``), the engine thread that batches requests, its
speculate-or-not policy and prefix cache (``batching/``), and the Ray Serve replicas (``replicas/``). The engine
never knows about HTTP; the scheduler calls it.

    from specdecode.serving import ServerConfig, create_app
    app = create_app(ServerConfig(target="smollm2", proposer="lookup"))   # then: uvicorn.run(app)
"""

from .app import create_app
from .config import ServerConfig
from .server import Server

__all__ = ["Server", "ServerConfig", "create_app"]
