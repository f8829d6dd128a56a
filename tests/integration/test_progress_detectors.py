"""The streams worker runs the loss detector on job.progress: a real log whose loss turns NaN
and stays, read by the real job-log producer (with the generic progress pattern diagnose uses
offline, given as a custom pattern as an operator would), through the real broker."""

from __future__ import annotations

from pathlib import Path

from bus.publish import Publisher
from producers.joblogs import JobLayout, JobLogProducer
from producers.progress import ProgressParser
from sinks.backends.simulated import SimulatedScheduler
from tests.conftest import FIXTURES, wait_for
from tests.integration.scenario import NODES, running_stack, wait_incident
from trainmedic.ops.diagnose import OfflineSettings
from trainmedic.stack.broker import EmbeddedBroker


def test_nan_loss_that_stays_is_found_online(
    broker: EmbeddedBroker, chdb_url: str, database: str, tmp_path: Path
) -> None:
    job = "710"
    log = FIXTURES / "corpus" / "dev" / "num_loss_nan_epochs" / "job.out"  # gradnorm_tf#17
    with running_stack(broker.bootstrap, chdb_url, database, SimulatedScheduler(NODES), "monitor", tmp_path) as stack:
        assert stack.store is not None
        store = stack.store
        pub = Publisher(broker.bootstrap, "test-producer")
        parser = ProgressParser(OfflineSettings().fallback_progress)
        JobLogProducer(pub, job, [log], JobLayout(tuple(NODES[:1]), 1), partition="gpu", progress=parser).poll_once()
        assert pub.flush(10) == 0

        def divergence_rows() -> list[dict[str, object]]:
            return store.query(
                "SELECT signature, category, role FROM {db}.anomalies FINAL "
                "WHERE job_id = {j:String} AND detector = 'divergence'",
                {"j": job},
            )

        rows = wait_for("the loss detector's anomaly in the audit", divergence_rows, 60)
        assert rows == [{"signature": "loss_nonfinite", "category": "numerical", "role": "root"}]
        assert wait_incident(store, job)["category"] == "numerical"
