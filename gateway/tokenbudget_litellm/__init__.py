"""Admission for calls through a LiteLLM proxy: a proxy hook over the ``tokenbudget_gateway`` protocol.

``hook`` is what the proxy loads (it needs ``litellm``; install ``token-budget-gateway[litellm]``); the
other modules are standard library only: ``settings`` (the hook's configuration), ``mapping`` (a proxy
request to an admission and the admitted payload back) and ``calls`` (the protocol calls and how a failed
provider call is reported).
"""
