"""Mistral models, counted by Mistral's own code (``mistral_common``) from ``templates.MistralTemplate``.

How Mistral frames a request depends on the tokenizer's instruct version (v3, v7, …: where the system prompt
goes, tool definitions before the last user message, consecutive messages merged), so this family does not
re-implement it: the template lays the request out as the OpenAI-style JSON a Mistral endpoint takes, as one
text piece, and the counter hands that JSON to ``MistralTokenizer.encode_chat_completion``. The count is
exact by construction; its per-bucket breakdown is not (the whole request is one piece of the ``template``
bucket). The JSON text is the cache key, so a repeated request is not encoded again.

Mistral's API accepts only tool-call ids of nine letters and digits; the payload carries each other id as
such an id derived from it (the same id for a call and its result), and that payload is what is counted.
Images are not pixels here: each counts by the model revision's image formula, outside the request JSON.
What the output schema costs is not published by Mistral: it is a ``Bound`` piece, so a request with one
counts ``UPPER_BOUND``.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ladder.counting import CountingUnavailable, CountMethod


@dataclass(frozen=True, eq=False)
class MistralCounter:
    """Exact counts of request JSON texts (``MistralTemplate``) with Mistral's own tokenizer and framing."""

    tokenizer: Any
    digest: str

    @property
    def method(self) -> CountMethod:
        """Always ``EXACT``."""
        return "EXACT"

    def encode(self, request_json: str) -> list[int]:
        """Return the token ids Mistral's code renders for a request JSON text.

        Raises CountingUnavailable when Mistral's code refuses the request (it would refuse to serve it too).
        """
        from mistral_common.exceptions import MistralCommonException
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        request = json.loads(request_json)
        try:
            completion = ChatCompletionRequest.from_openai(
                messages=request["messages"], tools=request.get("tools")
            )
            tokens: list[int] = self.tokenizer.encode_chat_completion(completion).tokens
        # sentencepiece raises a plain RuntimeError for a text it cannot encode (a lone surrogate, escaped in
        # a call's arguments).
        except (MistralCommonException, ValueError, AssertionError, RuntimeError) as exc:
            raise CountingUnavailable(f"Mistral's tokenizer refuses the request: {exc}") from exc
        return tokens

    def special_id(self, token: str) -> int | None:
        """Mistral's specials are inside its own rendering: none stands alone in the stream."""
        return None

    def count_many(self, texts: Sequence[str]) -> list[int]:
        """Return the token count of each request JSON text. Raises CountingUnavailable."""
        return [len(self.encode(text)) for text in texts]


def load_mistral(data: bytes, digest: str, name: str) -> MistralCounter:
    """Build the counter of a Mistral tokenizer file (tekken JSON, or sentencepiece ``.model.vN``).

    mistral_common reads the instruct version from the file name's suffix and only from a path, so the very
    bytes that were digested are written to a private temporary file of the same name and read from there.
    Raises whatever mistral_common raises for a file that is not a Mistral tokenizer.
    """
    # Imported here: mistral_common brings numpy and pydantic, which processes serving no Mistral model
    # should not pay for at start-up.
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / Path(name).name
        path.write_bytes(data)
        return MistralCounter(MistralTokenizer.from_file(path), digest)
