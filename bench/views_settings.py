"""The platform's settings without the hot path (budgeting/api/hotpath.py): every request goes through the
whole middleware stack and DRF's views, as before the hot path. gateway_bench.py serves its ``views`` arm's
API with these, to measure the hot path through the real gateway in the same run."""

from budgeting.settings import *  # noqa: F403

MIDDLEWARE = [name for name in MIDDLEWARE if name != "budgeting.api.hotpath.HotPathMiddleware"]  # noqa: F405
