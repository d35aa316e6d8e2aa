"""Scale out on Ray Serve: N replicas of the same app (model + engine thread + FastAPI routes) behind Ray's
HTTP proxy, which routes each request to a replica. The OpenAI routes are unchanged.

    from ray import serve
    from specdecode.serving import ServerConfig
    from specdecode.serving.ray_app import application
    serve.run(application(ServerConfig(target="smollm2"), replicas=2))     # http://127.0.0.1:8000/v1/...

or ``specdecode serve --ray --replicas 2``: without RAY_ADDRESS that starts a new Ray on this machine, registered
as 127.0.0.1 so that its traffic stays on loopback (``init_ray``). On several machines: ``ray start --head --port
6379`` on one, ``ray start --address HEAD_IP:6379`` on each of the others, then ``specdecode serve --ray --replicas N
--host 0.0.0.0 --api-key KEY`` on the head (with RAY_ADDRESS=auto); Ray places the replicas on the nodes'
CPUs and runs a proxy on every node, so clients may call any node's port. Each replica loads the model on
its own node (the bundled model ships with the package; a path must exist on every node).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

from .app import ServerConfig, create_app

LOOPBACK = "127.0.0.1"
# On Linux, Ray rewrites a loopback node address to the machine's interface address, unless this switch (read when
# ray is imported, here and by the processes Ray starts) puts it in the one-machine mode macOS and Windows default to.
ONE_MACHINE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def application(config: ServerConfig, replicas: int = 1, threads: int | None = None) -> Any:
    """A Ray Serve application: ``replicas`` copies of the app, each on ``threads`` CPUs (default: the config's
    ``threads``, else 1) with torch limited to them; each replica accepts up to 4 × ``max_batch`` requests."""
    from ray import serve

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    threads = threads or config.threads or 1
    replica_config = replace(config, threads=threads)

    def build_app():  # runs inside each replica: loads the model there
        return create_app(replica_config)

    @serve.deployment(
        name="specdecode",
        num_replicas=replicas,
        max_ongoing_requests=4 * config.max_batch,
        ray_actor_options={"num_cpus": threads, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}},
    )
    @serve.ingress(build_app)
    class SpecDecodeReplica:
        """One replica of the OpenAI-compatible server."""

    return SpecDecodeReplica.bind()


def init_ray(**options: Any) -> None:
    """Join the Ray cluster at RAY_ADDRESS, or start a new Ray on this machine that registers 127.0.0.1 (its
    traffic stays on loopback). Call it before anything in this process imports ray."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        os.environ.update(ONE_MACHINE)
    import ray

    if address:
        ray.init(address=address, **options)
    else:
        ray.init(address="local", _node_ip_address=LOOPBACK, **options)


def run(config: ServerConfig, replicas: int, host: str, port: int) -> None:
    """Start (or join, with RAY_ADDRESS) a Ray cluster, deploy the app and serve until interrupted."""
    init_ray(include_dashboard=False)
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    serve.run(application(config, replicas), name="specdecode", route_prefix="/")
    print(f"serving on http://{host}:{port} with {replicas} Ray Serve replica(s); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
