"""Content negotiation that honours a refusal: DRF's, less the media ranges an ``Accept`` header gives
``q=0`` (RFC 9110 §12.5.1: "not acceptable"), which DRF reads as accepted.

The API answers JSON only. When the most specific range of the header that matches ``application/json``
has ``q=0`` (``*/*;q=0``; ``application/json;q=0, */*`` too), or every range it lists has, the answer is
``406 NOT_ACCEPTABLE``, not JSON the client said it does not take.
"""

from __future__ import annotations

from rest_framework.exceptions import NotAcceptable
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.request import Request

# The ranges that match JSON, by specificity.
_JSON_RANGES = {"application/json": 3, "application/*": 2, "*/*": 1}


def _parsed(media_range: str) -> tuple[str, bool]:
    """The range's type (lower case) and whether it is refused (``q=0``)."""
    kind, *params = (part.strip() for part in media_range.split(";"))
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "q":
            try:
                return kind.lower(), float(value) == 0
            except ValueError:
                return kind.lower(), False
    return kind.lower(), False


class RefusalAwareNegotiation(DefaultContentNegotiation):
    def get_accept_list(self, request: Request) -> list[str]:
        listed = [value for value in super().get_accept_list(request) if value]
        parsed = [_parsed(value) for value in listed]
        kept = [value for value, (_, refused) in zip(listed, parsed, strict=True) if not refused]
        deciding = max(
            (item for item in parsed if item[0] in _JSON_RANGES),
            key=lambda item: _JSON_RANGES[item[0]],
            default=None,
        )
        if (listed and not kept) or (deciding is not None and deciding[1]):
            raise NotAcceptable("the answer is JSON, and the Accept header refuses it (q=0)")
        return kept
