"""The JSON API against its own OpenAPI schema: every status documented, 405s with Allow.

Schemathesis (its ``st`` command, as a user would run it) generates requests from
``/openapi.json`` and runs every one of its checks against ``schedule-lineage
serve`` over real HTTP, over the imported legacy sample and a lineage full of
hostile text.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.browse import Served

from scheduler.web.api import ErrorBody

# Full tier: it serves the API with `schedule-lineage serve`.
pytestmark = pytest.mark.full

ST_SECONDS = 400


@pytest.fixture
def served(served_sample: Served) -> Served:
    """The session's one served sample (conftest)."""
    return served_sample


def test_every_operation_documents_its_errors_with_their_body(served: Served) -> None:
    spec = served.get("/openapi.json").json()
    body = "#/components/schemas/ErrorBody"
    for path, methods in spec["paths"].items():
        responses = methods["get"]["responses"]
        assert responses["503"]["content"]["application/json"]["schema"]["$ref"] == body, path
        if "{" in path:
            assert responses["404"]["content"]["application/json"]["schema"]["$ref"] == body
    for path in (
        "/api/lineages/absent",
        "/api/lineages/sample/generations/999",
        "/api/lineages/sample/compare/1/999",
        "/api/families/" + "0" * 64,
    ):
        reply = served.get(path)
        assert reply.status_code == 404, path
        ErrorBody.model_validate(reply.json())


def test_a_method_the_path_does_not_take_is_405_with_allow(served: Served) -> None:
    for path in ("/api/", "/api/lineages/sample", "/", "/lineages/sample"):
        reply = served.client.post(path)
        assert reply.status_code == 405, path
        assert set(reply.headers["allow"].replace(" ", "").split(",")) == {"GET"}, path


def test_schemathesis_passes_every_check(served: Served, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "st"),
            "run",
            f"{served.url}/openapi.json",
            "--checks",
            "all",
            "--max-examples",
            "40",
            "--workers",
            "1",
            "--no-color",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=ST_SECONDS,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failed" in result.stdout or " passed" in result.stdout
