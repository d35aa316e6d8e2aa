"""Kill one of two Ray Serve model replicas mid-stream (SIGKILL, as a crash or the OOM killer would) and measure
what clients see: how each running stream ends, whether requests sent meanwhile are answered, and the time until
Ray has two replicas running again.

    python benchmarks/ray_replica_kill.py --target smollm2 --front process|proxy --streams 8 --out ray_kill.json

``--front process``: the front served from this process, as `specdecode serve --ray` does; ``proxy``: the front as a
deployment behind Ray's HTTP proxy (``ray_app.application``). Needs `pip install 'specdecode[ray]'`; starts its own
local Ray (num_cpus 2: one per replica). tests/serving/test_serving_slow.py runs it on the bundled model and checks what
it reports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

MODEL_DEPLOYMENT = "specdecode-model"


@dataclass
class StreamEnd:
    """How one stream ended, as its client read it."""

    chunks: int = 0
    ending: str = "running"  # done | error_event | broken (the connection cut) | http_NNN
    ended_at: float | None = None


@dataclass
class KillResult:
    streams: list[StreamEnd] = field(default_factory=list)
    during: list[tuple[float, int]] = field(default_factory=list)  # (seconds after the kill, HTTP status)
    killed_pid: int = 0
    error_events_s: float | None = None  # after the kill, the last error event of the killed replica's streams
    noticed_s: float | None = None  # after the kill, Serve's status first shows fewer than two replicas running
    recovered_s: float | None = None  # after the kill, two replicas RUNNING again, one of them new

    def summary(self) -> dict[str, Any]:
        endings: dict[str, int] = {}
        for stream in self.streams:
            endings[stream.ending] = endings.get(stream.ending, 0) + 1
        statuses: dict[str, int] = {}
        for _, status in self.during:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        return {
            "stream_endings": endings,
            "requests_meanwhile": statuses,
            "error_events_s": self.error_events_s,
            "noticed_s": self.noticed_s,
            "recovered_s": self.recovered_s,
        }


def read_stream(url: str, body: dict, end: StreamEnd) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            if response.status_code != 200:
                end.ending = f"http_{response.status_code}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    end.ending = "done" if end.ending == "running" else end.ending
                elif '"error"' in line:
                    end.ending = "error_event"
                else:
                    end.chunks += 1
    except httpx.HTTPError:
        end.ending = "broken"
    finally:
        end.ended_at = time.monotonic()


def replica_actors(app_name: str) -> dict[str, Any]:
    """{actor name: handle} of the application's model replicas."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{MODEL_DEPLOYMENT}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return {name: ray.get_actor(name, namespace="serve") for name in names}


def kill_one_replica_mid_stream(
    url: str, app_name: str, streams: int = 8, max_tokens: int = 300, kill_after_s: float = 2.0, timeout_s: float = 120
) -> KillResult:
    """``streams`` streamed completions; ``kill_after_s`` later one model replica is killed by SIGKILL; requests
    sent every 0.2 s until Serve has seen the replica gone and runs two again (one of them new)."""
    import ray
    from ray import serve

    result = KillResult(streams=[StreamEnd() for _ in range(streams)])
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    readers = [threading.Thread(target=read_stream, args=(url, body, end), daemon=True) for end in result.streams]
    for reader in readers:
        reader.start()
    time.sleep(kill_after_s)
    before = replica_actors(app_name)
    victim = next(iter(before.values()))
    result.killed_pid = ray.get(victim.__ray_call__.remote(lambda _: os.getpid()))
    killed = time.monotonic()
    os.kill(result.killed_pid, signal.SIGKILL)
    short = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    while time.monotonic() - killed < timeout_s:
        sent = time.monotonic()
        try:
            status = httpx.post(f"{url}/v1/completions", json=short, timeout=60).status_code
        except httpx.HTTPError:
            status = 0
        result.during.append((round(sent - killed, 2), status))
        states = serve.status().applications[app_name].deployments[MODEL_DEPLOYMENT].replica_states
        if states != {"RUNNING": 2} and result.noticed_s is None:
            result.noticed_s = time.monotonic() - killed
        names = set(replica_actors(app_name))
        if result.noticed_s is not None and states == {"RUNNING": 2} and len(names - set(before)) == 1:
            result.recovered_s = time.monotonic() - killed
            break
        time.sleep(0.2)
    for reader in readers:
        reader.join(timeout_s)
    cut = [end.ended_at - killed for end in result.streams if end.ending == "error_event" and end.ended_at]
    result.error_events_s = max(cut) if cut else None
    return result


@contextlib.contextmanager
def deployed(target: str, front: str, app_name: str = "kill") -> Iterator[str]:
    """Two model replicas of ``target`` on the running Ray (one CPU each), and the URL of their front: served from
    this process (``process``, as ``specdecode serve --ray`` does) or as a deployment behind Ray's HTTP proxy
    (``proxy``, ``ray_app.application``)."""
    from ray import serve

    from specdecode.bench.serve_load import free_port
    from specdecode.serving import ServerConfig
    from specdecode.serving.local import LocalServer
    from specdecode.serving.replicas.ray_app import application, model_replicas
    from specdecode.serving.replicas.ray_app import front as front_app

    config = ServerConfig(target=target)
    try:
        if front == "proxy":
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(application(config, replicas=2, threads=1), name=app_name, route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        else:
            serve.start(proxy_location="Disabled")
            model = serve.run(model_replicas(config, replicas=2, threads=1), name=app_name, route_prefix=None)
            with LocalServer(front_app(model, config)) as local:
                yield local.url
    finally:
        serve.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--front", choices=("process", "proxy"), default="process")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--kill-after", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path("ray_kill.json"))
    args = parser.parse_args()

    from specdecode.serving.replicas.ray_app import init_ray

    init_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with deployed(args.target, args.front) as url:
        result = kill_one_replica_mid_stream(url, "kill", args.streams, args.max_tokens, args.kill_after)
    summary = result.summary()
    record = {"args": {**vars(args), "out": str(args.out)}, **summary, "during": result.during,
              "streams": [vars(s) for s in result.streams]}  # fmt: skip
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
