"""Reservation ids grow with time (``ledger.models.new_reservation_id``), so that an admission writes its
index entries beside the last admission's (bench/README.md: the pages an admission reads on a large ledger).
Random ids (version 4) fail the ordering test: twelve of them sort in the order they were made once in 12!."""

from __future__ import annotations

import time
import uuid

import pytest

from ledger.models import Reservation, new_reservation_id
from tests.ledger.helpers import admit, catalog, pool_account, spec, tenant_account


def test_an_id_is_a_version_7_uuid_carrying_the_millisecond_it_was_made():
    before = time.time_ns() // 1_000_000
    made = new_reservation_id()
    after = time.time_ns() // 1_000_000
    assert made.version == 7 and made.variant == uuid.RFC_4122
    assert before <= made.int >> 80 <= after
    assert Reservation().pk.version == 7


def test_ids_made_in_the_same_millisecond_differ():
    made = [new_reservation_id() for _ in range(2000)]
    assert len(set(made)) == len(made)


@pytest.mark.django_db(transaction=True)
def test_admissions_a_millisecond_apart_sort_in_postgresql_in_the_order_they_were_made():
    cat = catalog()
    tenant_account(cat)
    pool_account(cat)
    made = []
    for _ in range(12):
        made.append(admit(spec(cat)).reservation.pk)
        time.sleep(0.002)
    stored = Reservation.objects.filter(pk__in=made).order_by("pk").values_list("pk", flat=True)
    assert list(stored) == made
