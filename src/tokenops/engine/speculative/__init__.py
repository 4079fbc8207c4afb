"""Speculative decoding: cheap draft tokens proposed per sequence, verified by the target in one pass.

`config` holds the knob (`SpeculativeConfig`), `proposers` the drafters (prompt lookup, self-draft),
`rejection` the verification rule, `draft_length` the per-sequence adaptive draft length, and
`speculator` ties them to the engine step.
"""

from tokenops.engine.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
