"""The analysts' reports: the query, the reads behind each figure, pricing, the FOCUS export, charts, pages.

Every figure is a query over the manifests, reservations and ledger entries of a period and scope, so a report
and an export of the same query agree with each other and with the database. Requests are dated by when
they were admitted (``created_at``, UTC days).
"""
