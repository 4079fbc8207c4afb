"""`tokenops serve`: the whole platform in one process tree on a laptop.

This module owns the start-up sequence: read the config, start each model's local engine replicas
(`tokenops engine --model ... --port ...`, `replicas` of them on consecutive ports) under the
cluster's `Supervisor` (restart with backoff; a restart tells the cluster to forget the replica's
cached prefixes) and wait for their `/health`,
open the ops façade (which creates the database and runs the migrations), on first start create an
admin key and a default organisation/project/key and print their plaintext once, then run the
gateway with uvicorn (uvloop, httptools) until interrupted, and stop the engines on the way out.
It does not serve requests itself (app.py) nor run models (the engine does).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import secrets
import sys
from typing import Any

from sqlalchemy.exc import IntegrityError

from tokenops.cluster.supervisor import ProcessSpec, Supervisor
from tokenops.config import EngineSpec, Settings
from tokenops.gateway.admin import hash_admin_key
from tokenops.protocol import APIError

log = logging.getLogger("tokenops.serve")

ADMIN_HASH_FILE = "admin_key.sha256"
# young-generation collections every 10,000 net allocations instead of 700: a request allocates a
# few hundred container objects, nearly all freed by reference counting before any collection
GC_THRESHOLDS = (10_000, 10, 10)
DEFAULT_PATH = ("default", "default")  # organisation / project created on first start


def engine_command(spec: EngineSpec, port: int | None = None) -> list[str]:
    """The engine's command line (on `port`, default the spec's first); knobs become `--knob value`."""
    cmd = [sys.executable, "-c", "from tokenops.cli import app; app()", "engine", "--model", spec.model]
    cmd += ["--host", spec.host, "--port", str(spec.port if port is None else port)]
    for key, value in spec.args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, dict):  # e.g. speculative: {method: ngram, num_tokens: 4}
            cmd += [flag, json.dumps(value)]
        else:
            cmd += [flag, str(value)]
    return cmd


def engine_processes(settings: Settings) -> list[ProcessSpec]:
    """One supervised process per local engine: `replicas` of them, or a PD pair's prefill then decode
    engines with their `--role`, on consecutive ports."""
    specs = []
    for name, m in settings.models.items():
        if m.engine is None:
            continue
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        for i, (port, role) in enumerate(m.engine.roles):
            argv = engine_command(m.engine, port) + ([] if role == "both" else ["--role", role])
            name = f"{safe}-{i}" if role == "both" else f"{safe}-{role}-{i}"
            specs.append(ProcessSpec(name, tuple(argv), url=f"http://{m.engine.host}:{port}"))
    return specs


def ensure_admin_key(settings: Settings) -> tuple[tuple[str, ...], str | None]:
    """The admin key hashes to accept, and a new plaintext admin key when this is the first start."""
    if settings.admin_key:
        return (), None  # the config names one; nothing to create
    path = settings.data_dir / ADMIN_HASH_FILE
    if path.is_file():
        return (path.read_text().strip(),), None
    key = "tok-admin-" + secrets.token_urlsafe(32)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(hash_admin_key(key) + "\n")
    path.chmod(0o600)
    return (path.read_text().strip(),), key


async def bootstrap_tenant(ops: Any) -> str | None:
    """On an empty database: create the default organisation, project and key; return its plaintext."""
    if await ops.list_nodes():
        return None
    try:
        await ops.create_node((), DEFAULT_PATH[0], {})
    except IntegrityError:  # another gateway's first start on this database won the race
        return None
    except APIError as exc:  # ... and had committed before this one looked
        if exc.code == "node_exists":
            return None
        raise
    await ops.create_node(DEFAULT_PATH[:1], DEFAULT_PATH[1], {})
    plaintext, _ = await ops.create_key(DEFAULT_PATH, "default", {})
    return plaintext


def print_first_start(url: str, model: str, admin_key: str | None, api_key: str | None) -> None:
    if not admin_key and not api_key:
        return
    lines = ["", "tokenops: first start. These keys are shown once; they are stored only as hashes.", ""]
    if admin_key:
        lines.append(f"  admin key (for /admin/ and the admin API):  {admin_key}")
    if api_key:
        lines.append(f"  API key for {'/'.join(DEFAULT_PATH)}:                 {api_key}")
        lines += [
            "",
            "  from openai import OpenAI",
            f'  client = OpenAI(base_url="{url}/v1", api_key="{api_key}")',
            f'  client.chat.completions.create(model="{model}", '
            'messages=[{"role": "user", "content": "Hi"}])',
        ]
    lines.append("")
    print("\n".join(lines), flush=True)


async def run(settings: Settings, probes: bool = False) -> None:
    """Start engines, open ops, bootstrap, serve until interrupted (`probes`: app.py, probes.py)."""
    import uvicorn

    from tokenops.gateway.app import Gateway, create_app, open_operations
    from tokenops.gateway.connections import uvicorn_options

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    hashes, new_admin_key = ensure_admin_key(settings)
    specs = engine_processes(settings)
    urls = {s.name: s.url for s in specs}
    app: Gateway | None = None

    def restarted(name: str) -> None:
        # the replica's KV cache died with it: the cluster forgets its prefixes and event cursor
        if app is not None:
            app.cluster.replica_restarted(urls[name])

    log_dir = settings.data_dir / "engines"
    supervisor = Supervisor(specs, on_restart=restarted, log_dir=log_dir)
    ops = None
    try:
        if specs:
            log.info("starting %d engine(s); their output goes to %s", len(specs), log_dir)
            await supervisor.start()
            timeout = max(
                m.engine.startup_timeout_s for m in settings.models.values() if m.engine is not None
            )
            await supervisor.wait_ready(timeout=timeout)
        ops = await open_operations(settings)
        api_key = await bootstrap_tenant(ops)
        app = create_app(settings, ops=ops, admin_key_hashes=hashes, probes=probes)
        url = f"http://{settings.host}:{settings.port}"
        print_first_start(url, next(iter(settings.models)), new_admin_key, api_key)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            loop="uvloop",
            log_level=settings.log_level,
            access_log=False,
            proxy_headers=False,  # no X-Forwarded-* rewriting per request: nothing reads the client address
            server_header=False,
            timeout_graceful_shutdown=5,
            **uvicorn_options(settings.connections),  # header and idle timeouts, the connection cap
        )
        # everything loaded so far (modules, config, the ops schema) lives as long as the process:
        # frozen, the collector's full passes no longer walk it (they showed as pauses of the loop)
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        log.info("gateway listening on %s", url)
        await uvicorn.Server(config).serve()
    finally:
        await supervisor.stop()
        if ops is not None:
            await ops.close()


def serve(settings: Settings, probes: bool = False) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO: the health checks and load polls would flood the log each second
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = asyncio.new_event_loop
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run(settings, probes))
