"""Scale out on Ray Serve: N model replicas (model + engine thread + the FastAPI app) behind a front that holds no
model. The OpenAI routes are unchanged.

``specdecode serve --ray --replicas 2`` serves the front from its own process (uvicorn, as without Ray) and calls
the replicas through a Ray handle; Ray's HTTP proxies are not started. Without RAY_ADDRESS it starts a new Ray on
this machine, registered as 127.0.0.1 so that its traffic stays on loopback (``init_ray``). On several machines:
``ray start --head --port 6379`` on one, ``ray start --address HEAD_IP:6379`` on each of the others, then
``specdecode serve --ray --replicas N --host 0.0.0.0 --api-key KEY`` on the head (with RAY_ADDRESS=auto); Ray places
the replicas on the nodes' CPUs and clients call the head. Each replica loads the model on its own node (the bundled
model ships with the package; a path must exist on every node).

For Ray's own HTTP proxies (one on every node), deploy ``application``: the front is then a deployment (one per
model replica, no CPU reserved), which costs a hop more per streamed chunk (docs/BENCHMARKS.md, "Faults"):

    from ray import serve
    from specdecode.serving import ServerConfig
    from specdecode.serving.replicas.ray_app import application
    serve.run(application(ServerConfig(target="smollm2"), replicas=2))     # http://127.0.0.1:8000/v1/...

Either way the front checks the Host header, the API key and the body size, and relays each request to a model
replica (``asgi_bridge``). A model replica that dies (a crash, the kernel's OOM killer) is restarted by Ray;
meanwhile its streams end with an error event and ``[DONE]``, its requests that had not started answering are sent
to another replica, and new requests go to the live ones.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import uvicorn

from ...errors import optional_import
from ..app import create_app
from ..config import ServerConfig
from ..hosts import HostCheck
from ..middleware import Guard
from ..shutdown import GracefulServer
from .asgi_bridge import Forwarder, RawRequest, relay

LOOPBACK = "127.0.0.1"
# On Linux, Ray rewrites a loopback node address to the machine's interface address, unless this switch (read when
# ray is imported, here and by the processes Ray starts) puts it in the one-machine mode macOS and Windows default to.
ONE_MACHINE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
MODEL_DEPLOYMENT = "specdecode-model"


def model_replicas(config: ServerConfig, replicas: int = 1, threads: int | None = None) -> Any:
    """The model replicas as a Ray Serve application with no HTTP route: ``replicas`` copies of the app, each on
    ``threads`` CPUs (default: the config's ``threads``, else 1) with torch limited to them, taking up to 4 ×
    ``max_batch`` requests. A front (``front``) calls them."""
    from ray import serve

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    threads = threads or config.threads or 1
    replica_config = replace(config, threads=threads)

    @serve.deployment(
        name=MODEL_DEPLOYMENT,
        num_replicas=replicas,
        max_ongoing_requests=4 * config.max_batch,
        ray_actor_options={"num_cpus": threads, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}},
    )
    class ModelReplica:
        """One model replica: the OpenAI-compatible app, run on the requests a front relays."""

        async def __init__(self) -> None:  # type: ignore[misc]  # Ray awaits it: the model loads here
            self.app = create_app(replica_config)
            self.lifespan = contextlib.AsyncExitStack()  # the app's lifespan, run by hand: no server runs it here
            await self.lifespan.enter_async_context(self.app.router.lifespan_context(self.app))

        async def relay(self, request: RawRequest) -> AsyncIterator[list[dict]]:
            async for batch in relay(self.app, request):
                yield batch

        async def __del__(self) -> None:  # Ray's graceful shutdown: stop the engine, write the suffix history
            await self.lifespan.aclose()

    return ModelReplica.bind()


def front(model: Any, config: ServerConfig) -> Callable:
    """The front's ASGI app over ``model``, a handle to the model replicas: the checks that need no model, then each
    request relayed to a replica."""
    streaming = model.options(stream=True)

    async def open_stream(request: RawRequest) -> AsyncIterator[list[dict]]:
        stream = streaming.relay.remote(request)
        try:
            async for batch in stream:
                yield batch
        finally:
            stream.cancel()  # the client left (or the stream ended: then a no-op)

    forwarder = Forwarder(open_stream, replica_gone)
    guarded = Guard(forwarder, api_key=config.api_key, max_body_bytes=config.max_body_bytes)
    return HostCheck(guarded, bound=config.host, allowed=config.allowed_hosts)


def application(config: ServerConfig, replicas: int = 1, threads: int | None = None) -> Any:
    """A Ray Serve application behind Ray's HTTP proxies: the front as the ingress deployment (one per model
    replica, no CPU reserved) and ``model_replicas(config, replicas, threads)``."""
    from ray import serve

    @serve.deployment(
        name="specdecode",
        num_replicas=replicas,
        max_ongoing_requests=4 * config.max_batch * replicas,
        ray_actor_options={"num_cpus": 0},
    )
    @serve.ingress()
    class Front:
        """The ingress: ``front`` over the model replicas' handle."""

        def __init__(self, model: Any) -> None:
            self.model = model

        def __serve_build_asgi_app__(self) -> Callable:  # noqa: N807  # Ray's name for the late-bound ASGI app
            return front(self.model, config)

    return Front.bind(model_replicas(config, replicas, threads))


def replica_gone(error: BaseException) -> bool:
    """Whether ``error`` says the model replica is gone (dead, unreachable or stopping), rather than that the
    request failed in it: the request may then go to another replica."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(error, (ActorDiedError, ActorUnavailableError, RayActorError))


def init_ray(**options: Any) -> None:
    """Join the Ray cluster at RAY_ADDRESS, or start a new Ray on this machine that registers 127.0.0.1 (its
    traffic stays on loopback). Call it before anything in this process imports ray."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        os.environ.update(ONE_MACHINE)
    ray = optional_import("ray", "ray", "serve --ray")

    if address:
        ray.init(address=address, **options)
    else:
        ray.init(address="local", _node_ip_address=LOOPBACK, **options)


def run(config: ServerConfig, replicas: int, host: str, port: int, grace: float = 10.0) -> None:
    """Start (or join, with RAY_ADDRESS) a Ray cluster, deploy the model replicas and serve the front from this
    process until Ctrl+C or SIGTERM: then running requests get ``grace`` seconds, the replicas stop (each writes its
    suffix history) and one line is printed."""
    init_ray(include_dashboard=False)
    from ray import serve

    serve.start(proxy_location="Disabled")
    server: GracefulServer | None = None
    try:
        model = serve.run(model_replicas(config, replicas), name="specdecode", route_prefix=None)
        print(f"serving on http://{host}:{port} with {replicas} Ray Serve replica(s); Ctrl-C stops", flush=True)
        options = uvicorn.Config(front(model, config), host=host, port=port, timeout_graceful_shutdown=grace)
        server = GracefulServer(options, on_signal=lambda _: None)
        server.run()
    finally:
        serve.shutdown()
    print(f"specdecode: stopped on {server.signal_name or 'request'}; the replicas have shut down", flush=True)
