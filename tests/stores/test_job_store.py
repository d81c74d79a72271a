"""Detached jobs in the store (``stores.jobs``), in process: the directory store and
SQLite, one rule each (limits, claims under a lease, fencing of a runner that lost its
lease, checkpoints, cancellation, removal, expiry, pages), durable across reopening.
Real server processes racing on one store are in ``tests/cluster/test_jobs_cluster.py``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dxcontract.errors import StorageFullError, TooManyJobsError
from dxserve.server.jobs.store import DirectoryJobs, JobRecord, SqlJobs, open_jobs
from dxserve.server.stores import open_store
from dxserve.server.stores.directory import DirectoryStore

T0 = 1_000_000.0
LEASE = 10.0


def _open(kind: str, path: Path):
    return open_store(f"dir://{path}" if kind == "directory" else path)


@pytest.fixture(params=["directory", "sqlite"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def opened(kind: str, tmp_path: Path):
    """``(store, jobs)`` of a fresh store of ``kind``; closed after the test."""
    store = _open(kind, tmp_path / "s")
    yield store, open_jobs(store)
    store.close()


def _record(job_id: str, owner: str = "t:a", created: float = T0, **more) -> JobRecord:
    return JobRecord(id=job_id, owner=owner, operator="hessian", function="rosenbrock",
                     status="queued", created=created, **more)


def test_open_jobs_matches_the_store(opened, kind: str) -> None:
    store, jobs = opened
    assert isinstance(jobs, DirectoryJobs if kind == "directory" else SqlJobs)
    assert isinstance(store, DirectoryStore) == (kind == "directory")


def test_create_keeps_the_record_and_body_and_enforces_the_limits(opened) -> None:
    _, jobs = opened
    jobs.create(_record("job-00001"), b"body-1", max_active=2, max_bytes=100)
    jobs.create(_record("job-00002"), b"body-22", max_active=2, max_bytes=100)
    with pytest.raises(TooManyJobsError) as err:
        jobs.create(_record("job-00003"), b"x", max_active=2, max_bytes=100)
    assert err.value.extra["limit"] == "max_jobs_per_token"
    assert "DXSERVE_MAX_JOBS_PER_TOKEN" in str(err.value)
    jobs.create(_record("job-00004", owner="t:b"), b"x" * 80, max_active=2, max_bytes=100)
    with pytest.raises(StorageFullError) as full:  # 6 + 7 + 80 held; 8 more is past 100
        jobs.create(_record("job-00005", owner="t:c"), b"y" * 8, max_active=2, max_bytes=100)
    assert full.value.extra["limit"] == "job_store_bytes"
    assert "DXSERVE_JOB_STORE_BYTES" in str(full.value)
    rec = jobs.get("job-00001")
    assert (rec.status, rec.owner, rec.body_bytes, rec.stored_bytes) == ("queued", "t:a", 6, 6)
    assert jobs.body("job-00002") == b"body-22" and jobs.result("job-00002") is None
    assert jobs.get("job-00005") is None and jobs.stored_bytes() == 93
    assert jobs.counts() == {"queued": 3}


def test_a_claim_runs_a_job_once_until_its_lease_expires_then_fences_the_old_runner(
    opened,
) -> None:
    _, jobs = opened
    jobs.create(_record("job-00001"), b"b", max_active=None, max_bytes=None)
    assert jobs.has_work(T0, "A")
    a = jobs.claim("A", LEASE, T0)
    assert (a.status, a.runner, a.attempts, a.started) == ("running", "A", 1, T0)
    assert jobs.claim("B", LEASE, T0 + 5) is None  # A holds the lease
    assert jobs.renew("job-00001", "A", LEASE, T0 + 6).lease_until == T0 + 16
    assert jobs.claim("B", LEASE, T0 + 15) is None  # renewed
    b = jobs.claim("B", LEASE, T0 + 17)  # A stopped renewing: taken over
    assert (b.runner, b.attempts, b.started) == ("B", 2, T0)
    # every write of the old runner is refused now; the new one's are taken
    assert jobs.renew("job-00001", "A", LEASE, T0 + 18) is None
    assert jobs.checkpoint("job-00001", "A", "k.0", b"zz", 1, 4, "columns") is None
    assert jobs.progress("job-00001", "A", 2, 4, "columns") is None
    assert jobs.finish("job-00001", "A", "succeeded", T0 + 19, result=b"r") is None
    assert jobs.release("job-00001", "A") is None
    done = jobs.finish("job-00001", "B", "succeeded", T0 + 20, result=b"result",
                       result_header="8")
    assert (done.status, done.finished, done.runner, done.result_bytes) == (
        "succeeded", T0 + 20, None, 6)
    assert jobs.result("job-00001") == b"result" and not jobs.has_work(T0 + 100, "C")


def test_checkpoints_are_kept_counted_and_freed_when_the_job_ends(opened) -> None:
    _, jobs = opened
    jobs.create(_record("job-00001"), b"body", max_active=None, max_bytes=None)
    jobs.claim("A", LEASE, T0)
    jobs.progress("job-00001", "A", 0, 30, "columns")
    jobs.checkpoint("job-00001", "A", "hessian.columns.10.float64.0", b"a" * 80, 10, 30, "columns")
    rec = jobs.checkpoint("job-00001", "A", "hessian.columns.10.float64.10", b"b" * 80, 20, 30,
                          "columns")
    assert (rec.done, rec.total, rec.unit, rec.computed, rec.stored_bytes) == (
        20, 30, "columns", 2, 4 + 160)
    assert jobs.chunks("job-00001") == {
        "hessian.columns.10.float64.0": b"a" * 80, "hessian.columns.10.float64.10": b"b" * 80,
    }
    assert jobs.progress("job-00001", "A", 20, 30, "columns", restored=2).restored == 2
    # a stopping process hands the job back, its checkpoints kept for the next run
    assert jobs.release("job-00001", "A").status == "queued"
    again = jobs.claim("B", LEASE, T0 + 1)
    assert again.attempts == 2 and len(jobs.chunks("job-00001")) == 2
    rec = jobs.finish("job-00001", "B", "failed", T0 + 2, error={"type": "t", "detail": "d"})
    assert rec.error == {"type": "t", "detail": "d"} and rec.stored_bytes == 0
    assert jobs.chunks("job-00001") == {} and jobs.body("job-00001") is None


def test_cancel_a_queued_and_a_running_job_then_remove_them(opened) -> None:
    _, jobs = opened
    jobs.create(_record("job-00001", created=T0), b"1", max_active=None, max_bytes=None)
    jobs.create(_record("job-00002", created=T0 + 1), b"2", max_active=None, max_bytes=None)
    running = jobs.claim("A", LEASE, T0 + 2)
    assert running.id == "job-00001"  # oldest first
    assert jobs.request_cancel("job-00002", "t:other", T0 + 3) is None  # not theirs
    queued = jobs.request_cancel("job-00002", "t:a", T0 + 3)
    assert (queued.status, queued.finished) == ("cancelled", T0 + 3)
    asked = jobs.request_cancel("job-00001", "t:a", T0 + 3)
    assert (asked.status, asked.cancel_requested) == ("running", True)
    assert jobs.renew("job-00001", "A", LEASE, T0 + 4).cancel_requested  # A is told
    assert not jobs.delete("job-00001", "t:a")  # still running: cancel first
    # A died before it stopped: whoever claims it next ends it, unrun
    ended = jobs.claim("B", LEASE, T0 + 100)
    assert (ended.status, ended.runner) == ("cancelled", None)
    assert not jobs.delete("job-00002", "t:other")
    assert jobs.delete("job-00002", "t:a") and jobs.get("job-00002") is None
    assert jobs.counts() == {"cancelled": 1}


def test_pages_newest_first_and_expiry(opened) -> None:
    _, jobs = opened
    for i in range(5):
        jobs.create(_record(f"job-0000{i}", created=T0 + i), b"x", max_active=None,
                    max_bytes=None)
    jobs.create(_record("job-other", owner="t:b", created=T0 + 9), b"x", max_active=None,
                max_bytes=None)
    first = jobs.list("t:a", 2, None)
    assert [r.id for r in first] == ["job-00004", "job-00003"]
    rest = jobs.list("t:a", 10, (first[-1].created, first[-1].id))
    assert [r.id for r in rest] == ["job-00002", "job-00001", "job-00000"]
    claimed = []
    for i in range(2):  # the owners take turns: t:a's oldest, then t:b's
        rec = jobs.claim("A", LEASE, T0 + 10)
        claimed.append(rec.id)
        jobs.finish(rec.id, "A", "succeeded", T0 + 20 + i, result=b"r")
    assert claimed == ["job-00000", "job-other"]
    assert jobs.expire(T0 + 20.5) == 1  # ended before: removed; the rest stay
    assert jobs.get("job-00000") is None and jobs.get("job-other").status == "succeeded"
    assert jobs.expire(T0 + 1000) == 1 and len(jobs.list("t:a", 10, None)) == 4


def test_jobs_survive_reopening(kind: str, tmp_path: Path) -> None:
    store = _open(kind, tmp_path / "s")
    jobs = open_jobs(store)
    jobs.create(_record("job-00001"), b"body", max_active=None, max_bytes=None)
    jobs.claim("A", LEASE, T0)
    jobs.checkpoint("job-00001", "A", "k.0", b"c" * 16, 4, 8, "rows")
    store.close()
    store = _open(kind, tmp_path / "s")  # a new process: A is gone
    try:
        jobs = open_jobs(store)
        rec = jobs.get("job-00001")
        assert (rec.status, rec.done, rec.computed) == ("running", 4, 1)
        assert jobs.chunks("job-00001") == {"k.0": b"c" * 16} and jobs.body("job-00001") == b"body"
        # a directory store is one process's: a job an earlier process ran is claimable
        # at once; a shared store waits for the lease
        soon = jobs.claim("B", LEASE, T0 + 1)
        if kind == "directory":
            assert soon.runner == "B"
        else:
            assert soon is None and jobs.claim("B", LEASE, T0 + LEASE + 1).runner == "B"
    finally:
        store.close()


def test_concurrent_claims_on_one_sqlite_file_run_each_job_once(tmp_path: Path) -> None:
    stores = [open_store(tmp_path / "shared") for _ in range(4)]  # four connections
    try:
        jobs = [open_jobs(s) for s in stores]
        for i in range(6):
            jobs[0].create(_record(f"job-0000{i}", created=T0 + i), b"x", max_active=None,
                           max_bytes=None)
        won: list[tuple[str, str]] = []
        lock = threading.Lock()

        def race(n: int) -> None:
            while True:
                rec = jobs[n].claim(f"runner-{n}", LEASE, T0 + 10)
                if rec is None:
                    return
                with lock:
                    won.append((rec.id, rec.runner))

        threads = [threading.Thread(target=race, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(job_id for job_id, _ in won) == [f"job-0000{i}" for i in range(6)]
        assert all(jobs[0].get(job_id).runner == runner for job_id, runner in won)
        assert all(jobs[0].get(job_id).attempts == 1 for job_id, _ in won)
    finally:
        for s in stores:
            s.close()


# --- limits decided at submission ---------------------------------------------------------
def test_a_job_reserves_its_expected_result_and_gives_it_back_when_it_ends(opened) -> None:
    """The reservation counts from submission: a job whose result would pass the limit is
    refused before it runs, checkpoints fit in the reservation, and an ended job counts
    its result alone."""
    _, jobs = opened
    jobs.create(_record("job-00001", reserved_bytes=600), b"b" * 10, max_active=None,
                max_bytes=1000)
    assert jobs.get("job-00001").stored_bytes == jobs.stored_bytes() == 610
    with pytest.raises(StorageFullError) as full:  # 610 held and reserved; 400 more is past
        jobs.create(_record("job-00002", reserved_bytes=390), b"b" * 10, max_active=None,
                    max_bytes=1000)
    assert full.value.extra["limit"] == "job_store_bytes"
    assert "DXSERVE_JOB_STORE_BYTES" in str(full.value) and "expected result" in str(full.value)
    assert jobs.get("job-00002") is None
    jobs.claim("A", LEASE, T0)
    rec = jobs.checkpoint("job-00001", "A", "k.0", b"c" * 300, 1, 2, "columns")
    assert rec.stored_bytes == 610  # the checkpoint is a piece of the reserved result
    rec = jobs.checkpoint("job-00001", "A", "k.1", b"c" * 400, 2, 2, "columns")
    assert rec.stored_bytes == 710  # past its reservation: what is really kept counts
    rec = jobs.finish("job-00001", "A", "succeeded", T0 + 1, result=b"r" * 580)
    assert rec.stored_bytes == jobs.stored_bytes() == 580
    jobs.create(_record("job-00003", reserved_bytes=390), b"b" * 10, max_active=None,
                max_bytes=1000)  # room again
    assert jobs.stored_bytes() == 980


def test_a_result_past_the_stores_largest_value_is_refused_at_submission(opened, kind) -> None:
    _, jobs = opened
    if kind == "directory":
        assert jobs.max_blob_bytes is None  # files: no such limit
        return
    assert 0 < jobs.max_blob_bytes < 10**9  # SQLite's length limit, less a row's margin
    with pytest.raises(StorageFullError) as err:
        jobs.create(_record("job-00001", reserved_bytes=10**9), b"b", max_active=None,
                    max_bytes=None)
    assert err.value.extra["limit"] == "store_blob_bytes" and jobs.get("job-00001") is None


def test_owners_take_turns_so_one_owners_queue_does_not_hold_back_anothers(opened) -> None:
    _, jobs = opened
    for i in range(300):
        jobs.create(_record(f"job-a{i:05d}", owner="t:attacker", created=T0 + i), b"x",
                    max_active=None, max_bytes=None)
    jobs.create(_record("job-victim", owner="t:victim", created=T0 + 5000), b"x",
                max_active=None, max_bytes=None)
    first = jobs.claim("A", LEASE, T0 + 6000)
    jobs.finish(first.id, "A", "succeeded", T0 + 6001, result=b"r")
    second = jobs.claim("A", LEASE, T0 + 6002)
    assert (first.id, second.id) == ("job-a00000", "job-victim")
    jobs.finish(second.id, "A", "succeeded", T0 + 6003, result=b"r")
    # an owner with a job running waits behind one with none running
    jobs.create(_record("job-victim2", owner="t:victim", created=T0 + 7000), b"x", max_active=None,
                max_bytes=None)
    held = jobs.claim("A", LEASE, T0 + 7001)
    assert held.owner == "t:attacker"
    assert jobs.claim("B", LEASE, T0 + 7002).id == "job-victim2"


def test_a_job_keeps_a_copy_of_its_function_until_it_ends(opened) -> None:
    _, jobs = opened
    jobs.create(_record("job-00001", digest="sha256:ab"), b"body", max_active=None,
                max_bytes=1000, pin=b"the function")
    rec = jobs.get("job-00001")
    assert rec.digest == "sha256:ab" and rec.stored_bytes == 4 + 12
    assert jobs.pinned("job-00001") == b"the function" and jobs.chunks("job-00001") == {}
    jobs.claim("A", LEASE, T0)
    jobs.finish("job-00001", "A", "succeeded", T0 + 1, result=b"r")
    assert jobs.pinned("job-00001") is None


def test_half_written_files_are_removed_when_a_directory_store_opens(tmp_path: Path) -> None:
    """What a process killed mid-write leaves (a partial result's temporary file, a job
    directory without its record) is gone once the next process opens the store."""
    store = _open("directory", tmp_path / "s")
    jobs = open_jobs(store)
    jobs.create(_record("job-00001"), b"body", max_active=None, max_bytes=None)
    jobs.claim("A", LEASE, T0)
    jobs.checkpoint("job-00001", "A", "k.0", b"c" * 16, 4, 8, "rows")
    root = jobs.root
    store.close()
    partial = [root / "job-00001" / ".tmp-result.tmp", root / "job-00001" / "chunks" / ".tmp-k.tmp"]
    for path in partial:
        path.write_bytes(b"p" * 1000)
    (root / "job-00002").mkdir()
    (root / "job-00002" / "body").write_bytes(b"orphan")
    store = _open("directory", tmp_path / "s")
    try:
        jobs = open_jobs(store)
        assert not any(path.exists() for path in partial)
        assert not (root / "job-00002").exists()
        assert jobs.chunks("job-00001") == {"k.0": b"c" * 16} and jobs.body("job-00001") == b"body"
    finally:
        store.close()


def test_a_result_past_its_reservation_is_stored_only_where_there_is_room(opened) -> None:
    """The runner's last check before it writes a result (``Detached._past_limits``): a
    result larger than what its job reserved is refused when the store has no room left
    for it, so the store stays under its limit even when an estimate was short."""
    from types import SimpleNamespace

    from dxserve.server.jobs.detached import Detached
    from dxserve.settings import Settings

    _, jobs = opened
    service = SimpleNamespace(settings=Settings(job_store_bytes=1000), store=None)
    detached = Detached(service, store=jobs)
    jobs.create(_record("job-00001", reserved_bytes=300), b"b" * 10, max_active=None,
                max_bytes=1000)
    jobs.create(_record("job-00002", owner="t:b", reserved_bytes=500), b"b" * 10,
                max_active=None, max_bytes=1000)
    rec = jobs.claim("A", LEASE, T0)
    assert rec.id == "job-00001"
    assert detached._past_limits(rec, 300) is None  # within its reservation
    assert detached._past_limits(rec, 480) is None  # past it, but there is room
    full = detached._past_limits(rec, 600)  # 510 held by the other job: no room
    assert full is not None and full.extra["limit"] == "job_store_bytes"
    if jobs.max_blob_bytes is not None:
        big = detached._past_limits(rec, jobs.max_blob_bytes + 1)
        assert big is not None and big.extra["limit"] == "store_blob_bytes"
