"""The gateway side of the admission protocol, installable alone (standard library only, no Django).

``client.GatewayClient`` runs one admitted call end to end; it uses ``transport`` (our REST API),
``provider`` (the streamed Chat Completions call), ``protocol`` (ids, grants, results) and ``errors``.
"""
