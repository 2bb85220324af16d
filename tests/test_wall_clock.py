"""Wall-clock time in a run's records: every log.txt line, every metrics.jsonl record and the folder lock carry
a UTC ISO-8601 time, so a run lines up with a cluster's events (they carried none, the lock a local time)."""

import json
import re
from datetime import datetime, timedelta, timezone

from test_train import Pixels, tiny_config

from dit.io.atomic import FolderLock
from dit.train import train

STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")  # 2026-12-02T01:23:45.678Z


def parse(stamp: str) -> datetime:
    assert STAMP.fullmatch(stamp), stamp
    return datetime.fromisoformat(stamp)  # the Z reads as UTC


def within(stamp: str, start: datetime, end: datetime) -> datetime:
    at = parse(stamp)
    assert at.utcoffset() == timedelta(0)
    assert start - timedelta(milliseconds=1) <= at <= end, (stamp, start, end)  # the stamp is cut to the ms
    return at


def test_log_lines_metrics_records_and_the_lock_carry_utc_times(tmp_path):
    start = datetime.now(timezone.utc)
    train(tiny_config(tmp_path, max_steps=4, log_every=2, mfu_warmup_steps=0), Pixels())
    end = datetime.now(timezone.utc)
    run = tmp_path / "run"
    lines = (run / "log.txt").read_text().splitlines()
    assert len(lines) > 4
    times = [within(line.split(" ", 1)[0], start, end) for line in lines]
    assert times == sorted(times)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    times = [within(r["time"], start, end) for r in records]
    assert times == sorted(times)
    # the record's console line in log.txt carries the record's own time
    assert all(any(line.startswith(f"{r['time']} step={r['step']} ") for line in lines) for r in records)

    before = datetime.now(timezone.utc)
    with FolderLock(run, "training run", "wait"):
        holder = json.loads((run / ".lock").read_text())
        within(holder["since"], before, datetime.now(timezone.utc))
