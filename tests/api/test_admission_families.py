"""The demo's GPT-4o, Llama 3.3 and Mistral Nemo through the API: counted as the vendors' own code counts."""

from __future__ import annotations

from dataclasses import replace

import pytest
from django.conf import settings
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from budgeting.catalog.models import ModelRevision
from ladder.components import Limits
from ladder.parser import parse_components
from ladder.templates import get_template
from ledger.models import Reservation
from tests.api.test_admissions import api, post, request_body  # noqa: F401 (api is a fixture)
from tests.ladder.test_families import meta_format, meta_messages, num_tokens_from_messages, openai_reference

pytestmark = pytest.mark.django_db

MODELS = {
    "gpt-4o@2024-08-06": ("us-small", "t-20"),
    "llama-3.3-70b-instruct@2024-12-06": ("eu-large", "t-19"),
    "mistral-nemo@2024-07-18": ("eu-large", "t-19"),
}


def vendor_count(model: str, body: dict) -> int:
    """What the vendor's own code counts for the components the answer admitted (e3 is not permitted)."""
    components = parse_components(body["components"], limits=Limits())
    permitted = replace(components, evidence=tuple(e for e in components.evidence if e.id != "e3"))
    if model.startswith("gpt"):
        entries = get_template("openai").payload(permitted)["messages"]
        assert isinstance(entries, list)
        return num_tokens_from_messages(entries, openai_reference("o200k_base"))
    if model.startswith("llama"):
        return len(meta_format().encode_dialog_prompt(meta_messages(permitted)).tokens)
    payload = get_template("mistral").payload(permitted)
    request = ChatCompletionRequest.from_openai(messages=payload["messages"])  # type: ignore[arg-type]
    vendor = MistralTokenizer.from_file(f"{settings.TOKENIZER_DIR}/tekken_240718.json")
    return len(vendor.encode_chat_completion(request).tokens)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_demo_family_counts_exactly_as_its_vendor(api, model):  # noqa: F811
    pool, tenant = MODELS[model]
    body = request_body(modelPool=pool, modelRevision=model, tenantId=tenant)
    body["components"].pop("tools")
    res = post(api, "/api/v1/admissions:count", body)
    assert res.status_code == 200, res.json()
    data = res.json()
    assert data["countMethod"] == "EXACT"
    assert data["tokenizerDigest"] == ModelRevision.objects.get(name=model).tokenizer.digest
    assert data["tokens"]["input"] == vendor_count(model, body)
    assert Reservation.objects.count() == 0


def test_gpt_4o_with_tools_is_admitted_on_an_upper_bound(api):  # noqa: F811
    body = request_body(modelPool="us-small", modelRevision="gpt-4o@2024-08-06", tenantId="t-20")
    res = post(api, "/api/v1/admissions", body, key="gpt-4o-tools-1")
    assert res.status_code == 200, res.json()
    data = res.json()
    assert data["decision"] == "ADMITTED" and data["countMethod"] == "UPPER_BOUND"
    without_tools = request_body(modelPool="us-small", modelRevision="gpt-4o@2024-08-06", tenantId="t-20")
    without_tools["components"].pop("tools")
    assert data["tokens"]["input"] > vendor_count("gpt-4o@2024-08-06", without_tools)
