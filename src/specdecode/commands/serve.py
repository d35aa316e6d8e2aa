"""``specdecode serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn), or replicas on Ray Serve."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import typer

from specdecode import factory
from specdecode.commands import err, quiet_transformers
from specdecode.commands.generate import default_proposer
from specdecode.commands.options import (
    DraftOption,
    DtypeOption,
    GammaOption,
    GroupSizeOption,
    HeadsOption,
    ModeOption,
    ProposerChoice,
    ProposerOption,
    QuantizationOption,
    SuffixCacheOption,
    TargetOption,
    ThreadsOption,
    parse_gamma,
)

if TYPE_CHECKING:
    from specdecode.serving.config import ServerConfig

PolicyOption = Annotated[
    str,
    typer.Option(help="auto (speculate while the measured costs say it pays at this batch size), always or never."),
]
HostOption = Annotated[str, typer.Option(help="Address to bind (loopback by default; 0.0.0.0 for all).")]
MaxBatchOption = Annotated[int, typer.Option(help="Most requests decoded at once (each holds a KV cache); more wait.")]
RequestContextOption = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Most tokens a request may hold, prompt and output together (default: 4096, or the model's context "
        "window if shorter); a longer request is refused. The server starts only if the weights and --max-batch "
        "KV caches of this many tokens fit the memory available (checked before the weights are read).",
    ),
]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(envvar="SPECDECODE_API_KEY", help="Require 'Authorization: Bearer KEY' on every route but /health."),
]
MaxBodyOption = Annotated[int, typer.Option(help="Largest request body accepted (413 above).")]
ServedNameOption = Annotated[str | None, typer.Option(help="Model id clients use (default: the target's name).")]
RayOption = Annotated[bool, typer.Option("--ray", help="Run replicas on Ray Serve (pip install 'specdecode\\[ray]').")]
ReplicasOption = Annotated[
    int, typer.Option(help="With --ray: model replicas (each loads the model); this process serves HTTP in front.")
]
PortOption = Annotated[int, typer.Option(help="Port to listen on.")]
SuffixScopeOption = Annotated[
    str,
    typer.Option(
        help="--proposer suffix or eagle+suffix: global (drafts from every earlier request's prompt and answer) or "
        "request (from the request's own tokens and --suffix-cache only: no timing hints about other users' text).",
    ),
]
PrefixCacheOption = Annotated[
    float | None,
    typer.Option(
        help="GiB of KV rows kept from earlier requests, reused by prompts that share their prefix (0: off). "
        "Default: a quarter of the memory available after --max-batch full-context caches, at most 8.",
    ),
]
AllowedHostsOption = Annotated[
    list[str] | None,
    typer.Option(
        help="Repeatable (or comma-separated): a host name clients may reach the server by, besides localhost, "
        "127.0.0.1, [::1] and --host; a request naming another host in its Host header gets a 400 (a defence "
        "against DNS rebinding: a web page making your browser call this server). '*' allows any.",
    ),
]
ShutdownGraceOption = Annotated[
    float,
    typer.Option(
        min=0,
        help="On Ctrl+C or SIGTERM: seconds the requests already running get to finish; after that each ends with "
        "what it has (finish_reason length, its final chunk). No new request is accepted meanwhile.",
    ),
]


def serve(
    target: TargetOption = "smollm2",
    proposer: ProposerOption = None,
    draft: DraftOption = None,
    gamma: GammaOption = "auto",
    policy: PolicyOption = "auto",
    mode: ModeOption = "reproducible",
    host: HostOption = "127.0.0.1",
    port: PortOption = 8000,
    max_batch: MaxBatchOption = 16,
    max_context: RequestContextOption = None,
    api_key: ApiKeyOption = None,
    max_body_bytes: MaxBodyOption = 1_000_000,
    served_model_name: ServedNameOption = None,
    ray: RayOption = False,
    replicas: ReplicasOption = 1,
    threads: ThreadsOption = None,
    dtype: DtypeOption = "auto",
    quantization: QuantizationOption = "auto",
    group_size: GroupSizeOption = 32,
    suffix_cache: SuffixCacheOption = None,
    suffix_scope: SuffixScopeOption = "global",
    heads: HeadsOption = None,
    prefix_cache_gb: PrefixCacheOption = None,
    allowed_hosts: AllowedHostsOption = None,
    shutdown_grace: ShutdownGraceOption = 10.0,
) -> None:
    """Serve TARGET over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, /metrics."""
    options = ServeOptions(**locals())  # every parameter, as typer parsed it (nothing else is bound yet)
    config = _config(options)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        err.print(f"[yellow]warning:[/yellow] serving on {host} without --api-key: anyone who can reach it may use it")
    if ray:
        from specdecode.serving.replicas.ray_app import run

        run(config, replicas=replicas, host=host, port=port, grace=shutdown_grace)
        return
    if replicas != 1:
        raise ValueError("--replicas needs --ray (one process serves one replica)")
    _serve_here(config, host, port, shutdown_grace)


@dataclass(frozen=True)
class ServeOptions:
    """``serve``'s options as given (see its parameters' help)."""

    target: str
    proposer: ProposerChoice | None
    draft: str | None
    gamma: str
    policy: str
    mode: str
    host: str
    port: int
    max_batch: int
    max_context: int | None
    api_key: str | None
    max_body_bytes: int
    served_model_name: str | None
    ray: bool
    replicas: int
    threads: int | None
    dtype: str
    quantization: str
    group_size: int
    suffix_cache: str | None
    suffix_scope: str
    heads: str | None
    prefix_cache_gb: float | None
    allowed_hosts: list[str] | None
    shutdown_grace: float


def _config(options: ServeOptions) -> ServerConfig:
    """The server's settings from the options (the proposer defaulted, the gamma and quantization checked, the
    allowed hosts split at commas)."""
    from specdecode.serving.config import ServerConfig

    factory.parse_quantization(options.quantization)
    choice = options.proposer or default_proposer(options.draft, None, options.heads)
    names = options.allowed_hosts or ()
    return ServerConfig(
        target=options.target,
        proposer=choice.value,
        draft=options.draft,
        gamma=parse_gamma(options.gamma),
        policy=options.policy,
        mode=options.mode,
        max_batch=options.max_batch,
        max_context=options.max_context,
        api_key=options.api_key,
        max_body_bytes=options.max_body_bytes,
        served_model_name=options.served_model_name,
        dtype=options.dtype,
        quantization=options.quantization,
        group_size=options.group_size,
        threads=options.threads,
        suffix_cache=options.suffix_cache,
        suffix_scope=options.suffix_scope,
        heads=options.heads,
        prefix_cache_gb=options.prefix_cache_gb,
        host=options.host,
        allowed_hosts=tuple(name.strip() for entry in names for name in entry.split(",") if name.strip()),
    )


def _serve_here(config, host: str, port: int, grace: float) -> None:
    from specdecode.serving.server import Server
    from specdecode.serving.shutdown import serve_until_signalled

    quiet_transformers()
    with err.status(f"loading {config.target}…"):
        server = Server(config)  # load before binding: a bad model or option is one line, not a traceback
    err.print(
        f"[dim]serving {server.model_name} on http://{host}:{port} (proposer {config.proposer}, gamma "
        f"{config.gamma}, policy {config.policy}, max batch {config.max_batch} × {server.window} tokens, pid "
        f"{os.getpid()})[/dim]",
        highlight=False,
    )
    serve_until_signalled(server, host, port, grace)
