"""The compaction policy as a plain object over a session snapshot: when it cuts, where, and that a
tool call is never separated from its output."""

from __future__ import annotations

from tokenops.gateway.compaction import (
    SUMMARY_PREFIX,
    CompactionPolicy,
    SessionSnapshot,
    summary_message,
    transcript,
)


def turns(n: int, size: int = 200) -> tuple[dict, ...]:
    out: list[dict] = []
    for k in range(n):
        out.append({"role": "user", "content": f"question {k} " + "x" * size})
        out.append({"role": "assistant", "content": f"answer {k} " + "y" * size})
    return tuple(out)


def test_no_cut_while_the_next_prompt_fits() -> None:
    policy = CompactionPolicy(compact_at=0.75)
    history = turns(3)
    assert policy.decide(SessionSnapshot(history, 500, 50, window=1024, max_output=64)) is None
    assert policy.decide(SessionSnapshot((), 0, 5000, window=1024, max_output=64)) is None  # nothing to cut


def test_the_cut_keeps_a_recent_tail_starting_at_a_user_turn() -> None:
    policy = CompactionPolicy(compact_at=0.75, keep_recent=0.4)
    history = turns(10)
    cut = policy.decide(SessionSnapshot(history, 1200, 40, window=1024, max_output=64))
    assert cut is not None and 0 < cut.split < len(history)
    assert history[cut.split]["role"] == "user"
    budget = policy.prompt_budget(1024, 64)
    assert cut.prompt_budget == budget == 768
    per_message = 1200 / len(history)
    assert (len(history) - cut.split) * per_message <= 0.4 * budget  # the tail fits its share
    assert cut.tokens_per_byte > 0


def test_a_tool_output_stays_with_its_call() -> None:
    history = (
        *turns(4),
        {"role": "user", "content": "look it up"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "z" * 400},
        {"role": "assistant", "content": "done"},
    )
    cut = CompactionPolicy(keep_recent=0.2).decide(
        SessionSnapshot(history, 900, 10, window=1024, max_output=32)
    )
    assert cut is not None
    assert history[cut.split]["role"] == "user"  # never a tool output without its call


def test_a_gateway_budget_tighter_than_the_window() -> None:
    policy = CompactionPolicy(max_history_tokens=300)
    history = turns(4)
    assert policy.prompt_budget(8192, 256) == 300
    assert policy.decide(SessionSnapshot(history, 400, 10, window=8192, max_output=256)) is not None


def test_the_tightest_of_window_gateway_and_tenant_budgets_applies() -> None:
    history = turns(4)
    roomy = CompactionPolicy()
    assert roomy.decide(SessionSnapshot(history, 400, 10, window=8192, max_output=256)) is None
    cut = roomy.decide(SessionSnapshot(history, 400, 10, window=8192, max_output=256, tenant_budget=300))
    assert cut is not None and cut.prompt_budget == 300
    assert CompactionPolicy(max_history_tokens=200).prompt_budget(8192, 256, tenant_budget=300) == 200
    assert roomy.prompt_budget(1024, 64, tenant_budget=5000) == 768  # the window's share


def test_transcript_and_summary() -> None:
    text = transcript([{"role": "user", "content": "a" * 5000}, {"role": "tool", "content": "b"}], 600)
    assert len(text) <= 600 and text.endswith("tool: b")
    assert summary_message("  they asked  ")["content"] == SUMMARY_PREFIX + "they asked"
