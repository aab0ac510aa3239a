"""A property-based fuzz of the whole OpenAPI surface (schemathesis on hypothesis).

Valid and invalid requests for every operation, with a real token, against the app on the
real PostgreSQL and Redis: no 5xx, every status code documented, every body matching the
schema of its status and media type. Bounded (a fixed seed, a few hundred examples).
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api.support import Api

CHECKS: list[Any] = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def test_openapi_surface_has_no_5xx_and_keeps_its_schema(api: Api) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", api.app)
    cases = st.one_of(
        schema.as_strategy(generation_mode=GenerationMode.POSITIVE),
        schema.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )
    headers = api.headers()
    seen: set[tuple[str, int]] = set()

    @given(case=cases)
    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        response = case.call(headers={**headers, **(case.headers or {})})
        case.validate_response(response, checks=CHECKS)
        seen.add((case.operation.label, response.status_code))

    run()
    # The fuzz reached the operations, and not only their error paths.
    labels = {label for label, _ in seen}
    assert len(labels) >= 8, labels
    assert any(code == 201 for _, code in seen), seen
