"""Router labels read from the database they are stored in: the profiles of a route's two models
(`labels_from_profiles` over their latest runs) and the route's own cascade outcomes.

This module owns only that read, so the gateway's routers train on what is stored rather than on
files exported from it. It does not train (routers.py) or store (profiles.py, outcomes.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenops.fusion.outcomes import OutcomeStore, examples
from tokenops.fusion.profiles import ProfileStore
from tokenops.fusion.routers import LabelledExample, labels_from_profiles
from tokenops.ops.db import engine_url


def stored_examples(
    db_url: str, route: str, cheap: str, strong: str, sources: Iterable[str]
) -> list[LabelledExample]:
    """Labels from `sources` ("profiles", "outcomes"); an empty source adds nothing."""
    out: list[LabelledExample] = []
    sources = set(sources)
    if "profiles" in sources:
        store = ProfileStore(engine_url(db_url).render_as_string(hide_password=False))
        try:
            out += labels_from_profiles(store.results(cheap), store.results(strong))
        finally:
            store.close()
    if "outcomes" in sources:
        outcomes = OutcomeStore(db_url)
        try:
            out += examples(outcomes.outcomes(route))
        finally:
            outcomes.close()
    return out
