"""The planner: a virtual model routes easy and hard requests to different real models, with the reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenops.fusion import FusionPlanner, RouteConfig, ShareCalibrator
from tokenops.fusion.routers import RuleRouter


@dataclass
class Req:
    model: str
    body: dict[str, Any]
    kind: str = "chat"


@dataclass
class Principal:
    tenant: str


@dataclass
class Adm:
    principal: Principal = field(default_factory=lambda: Principal("acme"))


def chat(model: str, text: str, **extra: Any) -> Req:
    return Req(model, {"model": model, "messages": [{"role": "user", "content": text}], **extra})


def planner(strategy: str = "single") -> FusionPlanner:
    cal = ShareCalibrator(0.5)
    cal.seed([0.2] * 50 + [0.8] * 50)
    route = RouteConfig(
        "auto",
        cheap="small",
        strong="big",
        router=RuleRouter(),
        strategy=strategy,  # type: ignore[arg-type]
        calibrator=cal,
    )
    return FusionPlanner({"auto": route})


def test_auto_routes_easy_and_hard_differently() -> None:
    p = planner()
    easy = p.plan(chat("auto", "What is the capital of France?"), Adm())
    hard = p.plan(chat("auto", "Write a Python function that merges two sorted lists."), Adm())
    assert easy.models == ("small",) and hard.models == ("big",)
    assert easy.route == hard.route == "auto" and easy.router == "rules"
    assert "<=" in easy.reason and ">" in hard.reason
    assert hard.header().startswith("route=auto; model=big; reason=rules score 0.80")
    assert p.is_virtual("auto") and not p.is_virtual("small")
    assert p.reservation_model("auto") == "big" and p.reservation_model("small") == "small"


def test_direct_model_and_tools() -> None:
    p = planner()
    assert p.plan(chat("small", "hi"), None).reason == "direct"
    tools = p.plan(chat("auto", "hi", tools=[{"type": "function", "function": {"name": "f"}}]), Adm())
    assert tools.models == ("big",)


def test_cascade_and_ensemble_plans() -> None:
    p = planner("cascade")
    easy = p.plan(chat("auto", "hello"), Adm())
    assert easy.strategy == "cascade" and easy.models == ("small", "big")
    hard = p.plan(chat("auto", "write python code"), Adm())
    assert hard.models == ("big",)
    assert easy.header().startswith("route=auto; strategy=cascade; reason=rules score 0.20")
    ensemble = planner("ensemble").plan(chat("auto", "hello"), Adm())
    assert ensemble.models == ("small", "big") and ensemble.reason == "ensemble (vote)"


def test_plans_the_gateways_own_inbound_request() -> None:
    # the gateway hands its parsed InboundRequest as is
    import orjson

    from tokenops.gateway.request import parse_request

    p = planner()
    easy = parse_request(
        "chat", orjson.dumps({"model": "auto", "messages": [{"role": "user", "content": "hi"}]}), None
    )
    hard = parse_request(
        "completion", orjson.dumps({"model": "auto", "prompt": "def f(x):\n    # python function"}), None
    )
    assert p.plan(easy, Adm()).model == "small"
    assert p.plan(hard, Adm()).model == "big"
