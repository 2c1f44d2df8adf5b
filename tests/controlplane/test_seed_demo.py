"""`seed_demo` as `make run` uses it: every demo deployment priced, a week of simulated history
marked as demo data, last month's invoice issued (its PDF matching its CSV); and nothing of it
twice."""

import csv
import io
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.db.models import F
from django.utils import timezone

from billing.models import Invoice
from capacity.models import (
    AllocationDecision,
    CapacitySample,
    CostModel,
    Deployment,
    ModelPrediction,
    ServedModel,
    UsageMinute,
)
from capacity.pricing.cost_models import active_cost_model
from capacity.selling.sellable import model_capacity
from controlplane.management.commands.seed_demo import DEMO_PORTAL_PASSWORD
from core.models import AuditEntry
from simulation.demo_history import SPAN, _demand, demo_history_marker
from tests.billing.test_pdf import pdf_text

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


def counts() -> dict[str, int]:
    return {
        "cost_models": CostModel.objects.count(),
        "usage_minutes": UsageMinute.objects.count(),
        "samples": CapacitySample.objects.count(),
        "decisions": AllocationDecision.objects.count(),
        "invoices": Invoice.objects.count(),
        "markers": AuditEntry.objects.filter(action="demo.history").count(),
    }


@pytest.fixture
def seeded(capsys):
    call_command("seed_demo")
    return capsys.readouterr().out


def test_every_deployment_is_priced_a_week_is_simulated_and_last_month_invoiced(
    seeded, planner_client
):
    for deployment in Deployment.objects.select_related("served_model", "gpu_pool__gpu_type"):
        assert active_cost_model(
            served_model=deployment.served_model,
            gpu_type=deployment.gpu_pool.gpu_type,
            gpus_per_replica=deployment.gpus_per_replica,
        ), deployment.name
    for model in ServedModel.objects.all():
        capacity = model_capacity(model)
        assert capacity.sellable_mu_per_minute > 0, model.name
        assert [d.note for d in capacity.deployments if d.note] == [], model.name
    # Plausible against the reference: an L40S replica mints a fraction of an H100's MU.
    llama = model_capacity(ServedModel.objects.get(name="llama-3.1-8b"))
    per_replica = {d.name: d.mu_per_minute_per_replica for d in llama.deployments}
    assert per_replica["llama-8b-h100"] == pytest.approx(100)
    assert 10 < per_replica["llama-8b-l40s"] < 50

    # A week of simulated history, marked as demo data (below), and last month's invoice.
    now = timezone.now()
    week_ago = now - timedelta(days=7)
    assert "History:" in seeded and "replayed through the fleet simulator" in seeded
    # The week's demand fitted at once (prediction's forecast, drawn by the planner).
    assert "Forecast: 1 model(s) fitted" in seeded
    fitted = ModelPrediction.objects.get(served_model__name="llama-3.1-8b")
    assert fitted.forecast["method"] == "holt-winters daily" and fitted.demand_since is not None
    usage = UsageMinute.objects.filter(served_model__name="llama-3.1-8b")
    # Up to now: the thinned replay's quiet hours may hold no request of one customer for
    # most of an hour (at night, UTC), so each customer's last minute is the one its last
    # request of the week's trace was served in, however long before the seed that was.
    marker = demo_history_marker().after
    start = datetime.fromisoformat(marker["from"])
    assert start < week_ago + timedelta(minutes=5)
    assert datetime.fromisoformat(marker["to"]) > now - timedelta(minutes=5)
    demand = _demand(start)
    for slug in ("acme", "globex"):
        mine = usage.filter(customer__slug=slug)
        first, last = mine.earliest("minute").minute, mine.latest("minute").minute
        arrivals_s = [r.arrival_s for r in demand if r.client == slug]
        # A request of the seed's last minutes may finish after it, outside the history.
        settled_s = [a for a in arrivals_s if a < SPAN.total_seconds() - 120]
        assert first < week_ago + timedelta(hours=1)
        assert start + timedelta(seconds=max(settled_s)) - timedelta(minutes=1) <= last
        assert last <= start + timedelta(seconds=max(arrivals_s)) + timedelta(minutes=5)
        # Most minutes of the week: some night minutes of the thinned replay hold no request.
        assert mine.count() > 7 * 24 * 60 / 2
    # acme runs within its reservation (guaranteed); globex is best-effort.
    acme = usage.filter(customer__slug="acme")
    assert sum(acme.values_list("best_effort_mu", flat=True)) == 0
    globex = usage.filter(customer__slug="globex")
    assert sum(globex.values_list("guaranteed_mu", flat=True)) == 0
    # A sample per model every five minutes of the week, the fleet page's charts.
    for model in ServedModel.objects.all():
        assert CapacitySample.objects.filter(served_model=model).count() == 7 * 24 * 60 / 5
    # Decisions of the simulated fleet, every one saying it was simulated; some scaled.
    decisions = AllocationDecision.objects.filter(deployment__name="llama-8b-h100")
    assert decisions.exists() and not decisions.exclude(actuator_kind="simulated").exists()
    assert all(d.reasons[0]["code"] == "simulated" for d in decisions)
    assert decisions.exclude(target_replicas=F("current_replicas")).exists()
    assert decisions.latest("created_at").created_at < now - timedelta(minutes=9)
    marker = AuditEntry.objects.get(action="demo.history")
    assert marker.actor == "system:seed_demo"
    assert marker.after["simulated_deployment"] == "llama-8b-h100"

    first_of_month = timezone.now().date().replace(day=1)
    last_month = (first_of_month - timedelta(days=1)).replace(day=1)
    invoice = Invoice.objects.get(customer__slug="acme", period_start=last_month)
    assert invoice.status == Invoice.Status.ISSUED
    assert {"commitment", "keep_warm"} <= set(invoice.lines.values_list("kind", flat=True))
    assert Invoice.objects.filter(status=Invoice.Status.ISSUED).count() == 1
    # Its PDF holds the CSV's lines and the totals they add up to.
    exported = planner_client.get(f"/api/v1/invoices/{invoice.pk}/csv/").content.decode()
    rows = list(csv.DictReader(io.StringIO(exported)))
    amounts = [Decimal(row["amount"]) for row in rows]
    subtotal = sum(a for a in amounts if a > 0)
    credits = -sum(a for a in amounts if a < 0)
    assert (invoice.subtotal, invoice.credits, invoice.total) == (
        subtotal, credits, max(Decimal(0), subtotal - credits)
    )  # fmt: skip
    text = pdf_text(planner_client.get(f"/api/v1/invoices/{invoice.pk}/pdf/").content)
    for name, value in (("Subtotal", subtotal), ("SLA credits", credits), ("Total", invoice.total)):
        assert f"{name} {value:.2f} {invoice.currency}" in text
    for row in rows:
        assert f" {row['amount']} " in text and f" {row['quantity']} " in text, row
    assert "Issued" in text


def test_seeding_again_adds_nothing_and_the_planner_and_portal_say_what_is_simulated(
    seeded, capsys, planner_client, client
):
    before = counts()
    call_command("seed_demo")
    out = capsys.readouterr().out
    assert counts() == before
    assert "History: already seeded" in out
    for path in ("/planner/", "/planner/customers/acme/", "/planner/allocation/"):
        page = planner_client.get(path).content.decode()
        assert 'data-testid="demo-history"' in page, path
        assert "Demo data." in page and "seed_demo" in page
        assert 'class="problem"' not in page, path

    # acme's owner logs in to the portal with the password run.sh prints, and finds its
    # week of use charted and last month's invoice, both marked as demo data.
    assert "Portal: acme-owner (owner of acme) logs in at /portal/" in out
    assert DEMO_PORTAL_PASSWORD not in out  # the output is logged; run.sh shows it
    login = {"username": "acme-owner", "password": DEMO_PORTAL_PASSWORD}
    assert client.post("/login/", login, follow=True).redirect_chain[-1][0] == "/portal/acme/"
    overview = client.get("/portal/acme/?range=7d").content.decode()
    assert 'data-testid="demo-history"' in overview
    assert '<script id="utilisation" type="application/json">' in overview
    assert "globex" not in overview.lower()
    invoices = client.get("/portal/acme/invoices/").content.decode()
    assert "Issued" in invoices and "/download/csv" in invoices
    # Its member reads and creates no key.
    client.logout()
    client.post("/login/", {"username": "acme-member", "password": DEMO_PORTAL_PASSWORD})
    assert client.get("/portal/acme/keys/").status_code == 200
    assert client.post("/portal/acme/keys/new", {"name": "x"}).status_code == 403
