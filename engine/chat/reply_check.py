"""Telling a reply that carries no text from a real one: the sign of damaged weights in a user's folder.

A model whose weights were overwritten still runs; it typically emits one special token over and over
(`<|endoftext|>` twenty times was the probe's output) or NaN logits that argmax to token 0. Nothing
raises, so without this check the user sees garbage and the CLI exits 0. The default model is covered
by its checksums (engine.models.default_model); this is the check for folders Velox did not convert.
"""

from __future__ import annotations

import re
from typing import Any

# A whole reply that is one short piece (up to 16 characters) repeated at least 16 times is a stuck model,
# not an answer. Judged on the text, not token ids: BPE merges runs ('!!!!') into tokens of varying length.
MIN_REPEATS_FOR_STUCK = 16
_STUCK_REPLY = re.compile(rf"(.{{1,16}}?)\1{{{MIN_REPEATS_FOR_STUCK - 1},}}.{{0,16}}\Z", re.DOTALL)


def _special_token_strings(tokenizer: Any) -> list[str]:
    strings = getattr(tokenizer, "all_special_tokens", None) or []
    return sorted((s for s in strings if isinstance(s, str) and s), key=len, reverse=True)


def degenerate_reply(text: str, generated_tokens: int, tokenizer: Any) -> str | None:
    """Why the reply is degenerate (one sentence for the user), or None for a normal reply.

    Degenerate: tokens were generated but nothing but special tokens and whitespace came out, or the
    whole reply is one short piece repeated at least MIN_REPEATS_FOR_STUCK times."""
    if generated_tokens <= 0:
        return None
    visible = text
    for special in _special_token_strings(tokenizer):
        visible = visible.replace(special, "")
    advice = "the model's weights may be damaged; reinstall or re-download the model."
    if not visible.strip():
        return f"The reply was {generated_tokens} token(s) of only special or end-of-text tokens: {advice}"
    stuck = _STUCK_REPLY.match(visible.strip())
    if stuck:
        unit = stuck.group(1)
        return f"The reply was {unit!r} repeated {len(visible.strip()) // len(unit)} times: {advice}"
    return None
