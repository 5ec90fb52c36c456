"""The v1 REST API: views, serializers, the strict parser, auth, OpenAPI, and the domain-error mapping."""
