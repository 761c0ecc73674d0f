"""The web UI and JSON API over real HTTP (``schedule-lineage serve`` in a subprocess)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest
from support.browse import Served
from support.fleet import SMALL_PHYSICS, Fleet, Worker, seed_file
from support.legacy_lineage import FIXTURE_BACKTRACE, FIXTURE_GENERATIONS, FIXTURE_OUT_OF_LOOP

from worker.instrument.records import DEATHS

# Full tier: it serves the UI with `schedule-lineage serve`.
pytestmark = pytest.mark.full

CRASH = '(message "about to die")\n(error "boom from the organism")\n'


@pytest.fixture(scope="module")
def served(served_sample: Served) -> Served:
    """The session's served sample, once its answer on live workers is in."""
    served_sample.wait_for_workers()
    return served_sample


def test_overview_lists_every_lineage_with_status_progress_and_spend(served: Served) -> None:
    data = served.get("/api/").json()
    by_name = {lineage["name"]: lineage for lineage in data["lineages"]}
    assert sorted(by_name) == ["sample", "sample-twin", "xss"]
    sample = by_name["sample"]
    assert (sample["kind"], sample["status"], sample["generations"]) == ("imported", "imported", 5)
    assert sample["outcomes"] == {"died": 1, "changed": 2, "no-change": 2}
    assert sample["run"] is None and sample["backlog"] is None
    xss = by_name["xss"]
    assert (xss["kind"], xss["status"], xss["observed"], xss["backlog"]) == (
        "fleet",
        "running",
        2,
        0,
    )
    assert Decimal(xss["spent_usd"]) == Decimal("0.0024")
    assert (xss["run"]["done"], xss["run"]["wanted"], xss["run"]["stopped"]) == (2, 5, None)
    # worker.celery exists but its broker (this home's embedded Redis) is not running.
    assert (data["broker"], data["workers"]) == ("inspected", [])
    page = served.get("/").text
    assert "no live workers answered" in page
    assert '<progress max="5" value="2">' in page
    assert 'href="/lineages/sample"' in page


def test_lineage_page_and_api_show_generations_and_unnumbered_commits(served: Served) -> None:
    data = served.get("/api/lineages/sample").json()
    rows = data["rows"]
    assert {r["commit"]["generation"]: r["outcome"] for r in rows if r["commit"]["generation"]} == (
        FIXTURE_GENERATIONS
    )
    assert [r["commit"]["subject"] for r in rows if r["commit"]["generation"] is None] == (
        FIXTURE_OUT_OF_LOOP
    )
    assert data["page"] == {"number": 1, "per_page": 50, "rows": 10, "pages": 1}
    page = served.get("/lineages/sample").text
    for generation in FIXTURE_GENERATIONS:
        assert f'href="/lineages/sample/generations/{generation}"' in page
    assert "external edit: silence probe" in page
    assert "Not pinned" in page
    small = served.get("/api/lineages/sample?per_page=4&page=3").json()
    assert [r["commit"]["subject"] for r in small["rows"]] == [
        "hand-commit: crasher for kill test",
        "seed",
    ]
    fleet_page = served.get("/lineages/xss").text
    # Organism size and lines, cumulative spend, files, duration, memory, cost, calls and
    # tokens, the death marked on each; and the strip of outcomes.
    assert fleet_page.count("<svg") == 10 and "<polyline" in fleet_page
    assert fleet_page.count('<a href="/lineages/xss/generations/2" class="death-mark">') == 9
    assert 'id="strip"' in fleet_page
    assert "wall_seconds" in fleet_page


def test_death_page_shows_lethal_body_beside_the_journal_lines(served: Served) -> None:
    data = served.get("/api/lineages/sample/generations/1").json()
    assert data["journal"]["stderr_lines"] == FIXTURE_BACKTRACE
    assert data["lethal_body"].rstrip().endswith('(error "boom")')
    assert [f["path"] for f in data["diff"]] == ["organism.el", "journal.md"]
    page = served.get("/lineages/sample/generations/1").text
    assert 'id="lethal-body"' in page and 'id="backtrace"' in page
    assert "(error &#34;boom&#34;)" in page
    assert "load-with-code-conversion(&#34;/work/organism.el&#34;" in page


def test_generation_page_shows_observation_model_calls_and_provenance(served: Served) -> None:
    data = served.get("/api/lineages/xss/generations/1").json()
    observation = data["observation"]
    assert observation["model_calls"][0]["input_tokens"] == 40
    assert observation["provenance"]["ceiling_driver"] == "cgroup1"
    page = served.get("/lineages/xss/generations/1").text
    for text in ("Model calls", "40 in / 12 out tokens", "Provenance", "cgroup1"):
        assert text in page
    # How the model stopped, and the attempt the vendor refused before it answered.
    assert "stopped max_tokens" in page and "2 attempts" in page
    assert "failed (HTTP 429), waited 0.25 s for the cap" in page


def test_compare_and_family_views(served: Served) -> None:
    data = served.get("/api/lineages/sample/compare/2/5").json()
    assert (data["a"]["commit"]["generation"], data["b"]["commit"]["generation"]) == (2, 5)
    # The external edits restored gen 2's body, so only the other paths differ.
    assert "README.md" in [f["path"] for f in data["diff"]]
    assert "organism.el" not in [f["path"] for f in data["diff"]]
    assert "README.md" in served.get("/lineages/sample/compare/2/5").text
    redirect = served.get("/lineages/sample/compare?a=2&b=5")
    assert redirect.status_code == 303
    assert redirect.headers["location"] == "/lineages/sample/compare/2/5"
    seed = served.get("/api/lineages/sample").json()["summary"]["seed_sha256"]
    family = served.get(f"/api/families/{seed}").json()
    assert [lineage["name"] for lineage in family["lineages"]] == ["sample", "sample-twin"]
    assert "sample-twin" in served.get(f"/families/{seed}").text


def test_unknown_lineages_generations_and_pages_are_404(served: Served) -> None:
    for path in (
        "/lineages/nope",
        "/lineages/sample/generations/6",
        "/lineages/sample/generations/0",
        "/lineages/sample/compare/1/9",
        "/lineages/sample?page=2",
        "/families/" + "0" * 64,
        "/families/not-a-sha",
        "/no/such/page",
    ):
        assert served.get(path).status_code == 404, path
        api = served.get("/api" + path)
        assert api.status_code == 404, path
        assert "detail" in api.json()
    assert "no lineage named nope" in served.get("/lineages/nope").text


def test_openapi_schema_is_served_and_nothing_loads_from_a_cdn(served: Served) -> None:
    schema = served.get("/openapi.json").json()
    assert {
        "/api/",
        "/api/lineages/{name}",
        "/api/lineages/{name}/generations/{gen}",
        "/api/lineages/{name}/compare/{a}/{b}",
        "/api/families/{seed}",
    } <= set(schema["paths"])
    assert served.get("/docs").status_code == 404
    page = served.get("/lineages/xss").text
    assert "http://" not in page and "https://" not in page and "<script" not in page
    headers = served.get("/").headers
    assert "default-src 'none'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY"


def test_server_binds_loopback_by_default(served: Served) -> None:
    listening = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":  # LISTEN
            address, port = local.split(":")
            listening.add((address, int(port, 16)))
    assert ("0100007F", served.port) in listening  # 127.0.0.1, little-endian hex
    assert not [a for a, p in listening if p == served.port and a != "0100007F"]


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_views_of_a_lineage_made_by_the_pipeline(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, COLUMNS="200")
    fleet.ok("init", "demo", *SMALL_PHYSICS)
    fleet.ok("run", "demo", "--generations", "2", "--local")
    fleet.ok("init", "crashy", "--seed", str(seed_file(tmp_path, CRASH)), *SMALL_PHYSICS)
    fleet.ok("run", "crashy", "--generations", "1", "--local")
    served = Served(fleet, tmp_path / "serve.log")
    try:
        overview = {lineage["name"]: lineage for lineage in served.get("/api/").json()["lineages"]}
        demo = overview["demo"]
        assert (demo["kind"], demo["generations"], demo["observed"], demo["backlog"]) == (
            "fleet",
            2,
            2,
            0,
        )
        assert Decimal(demo["spent_usd"]) > 0
        rows = served.get("/api/lineages/demo").json()["rows"]
        assert [r["commit"]["generation"] for r in rows] == [2, 1, None]
        for row in rows[:2]:
            figures = row["figures"]
            assert figures["model_calls"] >= 1 and figures["duration_seconds"] > 0
            assert figures["lineage_commit"] == row["commit"]["sha"]
        generation = served.get("/api/lineages/demo/generations/2").json()
        assert generation["observation"]["model_calls"][0]["prompt"]
        assert generation["journal"]["generation"] == 2
        assert generation["diff"][0]["path"] == "organism.el"
        assert served.get("/lineages/demo/compare/1/2").status_code == 200

        death = served.get("/api/lineages/crashy/generations/1").json()
        assert death["row"]["outcome"] in DEATHS
        assert "boom from the organism" in death["observation"]["stderr"]
        assert "boom from the organism" in "\n".join(death["journal"]["stderr_lines"])
        assert "boom from the organism" in death["lethal_body"]
        page = served.get("/lineages/crashy/generations/1").text
        assert 'id="lethal-body"' in page and 'id="stderr"' in page
    finally:
        served.stop()
    journal = fleet.ok("journal", "crashy").stdout
    assert "boom from the organism" in journal
    assert "process_exit" in fleet.ok("observations", "crashy").stdout


@pytest.mark.bwrap
@pytest.mark.cgroups
@pytest.mark.root
def test_overview_lists_live_workers_and_the_instrument_queue_they_serve(
    tmp_path: Path, redis_url: str
) -> None:
    fleet = Fleet(tmp_path, OUROBOROS_BROKER_URL=redis_url)
    fleet.ok("init", "demo", *SMALL_PHYSICS)
    worker = Worker(fleet, "browse")
    served = None
    try:
        worker.wait_ready()
        served = Served(fleet, tmp_path / "serve.log")
        served.wait_for_workers()
        data = served.get("/api/").json()
        queue = "gen." + data["lineages"][0]["instrument_fingerprint"][:12]
        [live] = [w for w in data["workers"] if w["hostname"].startswith("browse@")]
        assert queue in live["queues"]
        page = served.get("/").text
        assert live["hostname"] in page and queue in page
    finally:
        if served is not None:
            served.stop()
        worker.stop()
