"""An OpenAI-compatible HTTP server over the speculative decoder: FastAPI routes (``app``), the batching engine
thread (``scheduler``), the speculate-or-not policy (``policy``), Prometheus metrics (``metrics``), request and
response shapes (``protocol``), a loopback server for tests and benchmarks (``local``) and the Ray Serve
deployment (``ray_app``). The engine never knows about HTTP; the scheduler calls it.

    from specdecode.serving import ServerConfig, create_app
    app = create_app(ServerConfig(target="smollm2", proposer="lookup"))   # then: uvicorn.run(app)
"""

from .app import Server, ServerConfig, create_app

__all__ = ["Server", "ServerConfig", "create_app"]
