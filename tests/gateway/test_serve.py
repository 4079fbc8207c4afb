"""`tokenops serve` as a real process: first start prints the keys once, a restart keeps them, two
gateway processes sharing Redis hold one combined RPM limit, and (bundled) the embedded engine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from gateway_harness import ADMIN_KEY, MODEL

from tokenops.bench.ports import free_port

REDIS_URL = "redis://127.0.0.1:6379/0"


class ServeProcess:
    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENOPS_")}
        cmd = [
            sys.executable,
            "-c",
            "from tokenops.cli import app; app()",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
        ]
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"serve not ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def write_config(path: Path, data_dir: Path, stub_url: str, **extra: object) -> Path:
    cfg = {
        "data_dir": str(data_dir),
        "log_level": "warning",
        "models": {MODEL: {"backends": [stub_url + "/v1"], "pricing": {"input": 1, "output": 2}}},
        **extra,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def processes() -> Iterator[list[ServeProcess]]:
    procs: list[ServeProcess] = []
    yield procs
    for p in procs:
        p.stop()


def test_first_start_prints_keys_once(stub, tmp_path: Path, processes: list[ServeProcess]) -> None:
    config = write_config(tmp_path / "c.yaml", tmp_path / "data", stub[0])
    first = ServeProcess(config, free_port(), tmp_path / "first.log")
    processes.append(first)
    first.wait_ready()
    out = first.output()
    admin = re.search(r"admin key.*?:\s+(\S+)", out)
    api = re.search(r"API key for default/default:\s+(\S+)", out)
    assert admin and api, out
    client = openai.OpenAI(base_url=first.url + "/v1", api_key=api.group(1), max_retries=0)
    assert client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    ).choices
    keys = httpx.get(first.url + "/admin/keys", headers={"authorization": f"Bearer {admin.group(1)}"}).json()[
        "data"
    ]
    assert len(keys) == 1 and api.group(1) not in str(keys)
    first.stop()
    second = ServeProcess(config, free_port(), tmp_path / "second.log")
    processes.append(second)
    second.wait_ready()
    assert "first start" not in second.output()
    client = openai.OpenAI(base_url=second.url + "/v1", api_key=api.group(1), max_retries=0)
    assert client.models.list().data[0].id == MODEL
    # keys are not recoverable from the database: only hashes and a short prefix are stored
    db = (tmp_path / "data" / "tokenops.db").read_bytes()
    assert api.group(1).encode() not in db and admin.group(1).encode() not in db


@pytest.mark.redis
def test_two_gateways_share_one_rpm_limit(stub, tmp_path: Path, processes: list[ServeProcess]) -> None:
    prefix = f"tokenops:test-gateway:{uuid.uuid4().hex[:8]}:"  # Redis outlives this test's database
    config = write_config(
        tmp_path / "c.yaml",
        tmp_path / "data",
        stub[0],
        redis_url=REDIS_URL,
        redis_prefix=prefix,
        admin_key=ADMIN_KEY,
    )
    a = ServeProcess(config, free_port(), tmp_path / "a.log")
    processes.append(a)
    a.wait_ready()
    b = ServeProcess(config, free_port(), tmp_path / "b.log")
    processes.append(b)
    b.wait_ready()
    admin = httpx.Client(base_url=a.url, headers={"authorization": f"Bearer {ADMIN_KEY}"})
    org = "rpm-org"
    assert admin.post("/admin/tenants", json={"parent": None, "name": org}).status_code == 201
    r = admin.post("/admin/keys", json={"node": org, "name": "shared", "limits": {"rpm": 10}})
    assert r.status_code == 201, r.text
    key = r.json()["key"]
    ok = limited = 0
    for i in range(30):
        url = (a if i % 2 else b).url
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        try:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
            ok += 1
        except openai.RateLimitError as e:
            limited += 1
            assert e.response.headers.get("retry-after")
    assert ok == 10 and limited == 20


def _engine_registered() -> bool:
    from tokenops.cli import app

    names = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    return "engine" in names


@pytest.mark.bundled
def test_serve_with_the_embedded_engine(tmp_path: Path, processes: list[ServeProcess]) -> None:
    if not _engine_registered():
        pytest.skip("`tokenops engine` is not registered yet")
    engine_port = free_port()
    cfg = {
        "data_dir": str(tmp_path / "data"),
        "log_level": "warning",
        "models": {
            "smollm2-135m-instruct": {"engine": {"model": "smollm2-135m-instruct", "port": engine_port}}
        },
    }
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = ServeProcess(config, free_port(), tmp_path / "serve.log")
    processes.append(proc)
    proc.wait_ready(timeout=300)
    api = re.search(r"API key for default/default:\s+(\S+)", proc.output())
    assert api, proc.output()
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key=api.group(1), max_retries=0, timeout=120)
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage and chunks[-1].usage.completion_tokens >= 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()


@pytest.mark.bundled
def test_serve_starts_a_local_pd_pair(tmp_path: Path, processes: list[ServeProcess]) -> None:
    # `engine: {prefill: 1, decode: 1}` as real processes: one prefill and one decode engine, beside a
    # colocated engine of the same model; the PD model's greedy answer is the colocated one's
    if not _engine_registered():
        pytest.skip("`tokenops engine` is not registered yet")
    name = "smollm2-135m-instruct"
    pd_port, solo_port = free_port(), free_port()
    while abs(solo_port - pd_port) < 2:  # the pair takes two consecutive ports
        solo_port = free_port()
    cfg = {
        "data_dir": str(tmp_path / "data"),
        "log_level": "warning",
        "models": {
            "pd": {
                "engine": {"model": name, "port": pd_port, "prefill": 1, "decode": 1},
                "served_name": name,
            },
            "solo": {"engine": {"model": name, "port": solo_port}, "served_name": name},
        },
    }
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = ServeProcess(config, free_port(), tmp_path / "serve.log")
    processes.append(proc)
    proc.wait_ready(timeout=420)
    api = re.search(r"API key for default/default:\s+(\S+)", proc.output())
    assert api, proc.output()
    # three engines on a shared 2-core machine: a first answer can take minutes
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key=api.group(1), max_retries=0, timeout=600)
    ask = {
        "messages": [{"role": "user", "content": "Name three primary colours."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    solo = client.chat.completions.create(model="solo", **ask)
    chunks = list(
        client.chat.completions.create(model="pd", stream=True, stream_options={"include_usage": True}, **ask)
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == solo.choices[0].message.content
    )
    # the decode engine pulled the prompt's KV from the prefill engine instead of computing it
    assert chunks[-1].usage.model_extra["prompt_token_sources"]["transferred"] > 0
