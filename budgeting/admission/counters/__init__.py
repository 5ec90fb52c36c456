"""The providers' own counting APIs (SPEC §4 "Counters"): the I/O behind ``ladder.walk.ProviderCount``.

``payloads`` turns the ladder's final payload into each API's request, ``apis`` makes the call (through the
official SDKs where they cover it), ``breaker`` keeps a dead API from adding its timeout to every request,
and ``service`` puts the count cache, the breaker and the metrics in front of them for one admission.
"""
