"""worker.outcome and worker.logs.parse_line: how an exit is classified, how lines are tagged."""

from __future__ import annotations

import json
from pathlib import Path

from worker.logs import parse_line
from worker.outcome import classify, rank_exit_code, read_exit_json

# What torchrun 2.x prints when local rank 1 fails (see worker.outcome).
SUMMARY = [
    "E1202 16:00:20.762000 10785 torch/distributed/elastic/multiprocessing/api.py:1002] "
    "failed (exitcode: 75) local_rank: 1 (pid: 10806) of binary: /py",
    "Root Cause (first observed failure):",
    "  rank      : 1 (local_rank: 1)",
    "  exitcode  : 75 (pid: 10806) ",
]


def _classify(code: int, **kw: object) -> tuple[int | None, str | None, str]:
    args: dict[str, object] = dict(
        stop_reason=None, stop_message="", exit_info=None, agent_lines=[], tail=[]
    )
    args.update(kw)
    o = classify(code, **args)  # type: ignore[arg-type]
    return o.exit_code, o.reason, o.message


def test_success_and_worker_stops() -> None:
    assert _classify(0)[:2] == (0, None)
    # A stop the worker asked for wins over the exit status (a SIGTERMed trainer exits 0).
    assert _classify(0, stop_reason="cancelled", stop_message="by request")[1:] == (
        "cancelled",
        "by request",
    )
    assert _classify(-9, stop_reason="timeout", stop_message="late")[:2] == (-9, "timeout")


def test_a_stop_the_worker_asked_for_records_the_signal_it_sent() -> None:
    """Not torchrun's 1 after a SIGTERM, which reads as a failure of the run."""
    for reason in ("cancelled", "preempted", "timeout"):
        stopped = _classify(1, stop_reason=reason, stop_message="m", stop_signal=15)
        assert stopped == (-15, reason, "m")
    # The grace ran out: SIGKILL followed.
    assert _classify(1, stop_reason="cancelled", stop_message="m", stop_signal=9)[0] == -9
    # SIGTERM from outside the worker: the trainer checkpoints, says so, and exits 0.
    info = {"reason": "preempted", "message": "stopped on SIGTERM; checkpoint saved at step 9"}
    assert _classify(0, exit_info=info)[1:] == ("preempted", info["message"])


def test_exit_json_comes_before_codes() -> None:
    info = {"reason": "oom", "message": "CUDA out of memory", "rank": 1, "step": 7}
    code, reason, message = _classify(1, exit_info=info, agent_lines=SUMMARY)
    assert (code, reason) == (1, "oom")
    assert "CUDA out of memory" in message and "rank 1" in message and "step 7" in message
    # An unknown reason in exit.json is not trusted.
    assert _classify(1, exit_info={"reason": "bogus"})[1] == "exit_code"


def test_rank_codes_from_torchrun_summary() -> None:
    assert rank_exit_code(SUMMARY) == (75, 1)
    assert _classify(1, agent_lines=SUMMARY)[1] == "nan_loss"
    assert _classify(1, agent_lines=[s.replace("75", "76") for s in SUMMARY])[1] == "oom"
    assert _classify(1, agent_lines=[s.replace("75", "64") for s in SUMMARY])[1] == "spec_error"


def test_other_failures_quote_the_last_lines() -> None:
    killed = [s.replace("75", "-9") for s in SUMMARY]
    code, reason, message = _classify(1, agent_lines=killed, tail=["boom", "Traceback"])
    assert (code, reason) == (1, "exit_code")
    assert "local rank 1 killed by signal 9 (SIGKILL)" in message
    assert message.endswith("boom\nTraceback")
    assert _classify(3)[1:] == ("exit_code", "torchrun exited with exit code 3")


def test_a_ranks_own_error_is_the_message() -> None:
    """The trainer's record of an uncaught exception, not torchrun's report and log tail."""
    crash = {"reason": "exit_code", "message": "IndexError: index out of range in self",
             "rank": 1, "step": 1, "exit_code": 1}  # fmt: skip
    exited = [s.replace("75", "1") for s in SUMMARY]
    assert _classify(1, exit_info=crash, agent_lines=exited, tail=["ChildFailedError"]) == (
        1,
        "exit_code",
        "IndexError: index out of range in self (rank 1, step 1)",
    )
    # A rank killed by a signal records nothing; the others fail after it, in a collective.
    gone = {**crash, "message": "RuntimeError: Connection closed by peer", "rank": 0}
    killed = [*[s.replace("75", "-9") for s in SUMMARY], SUMMARY[0].replace("75", "1")]
    _, reason, message = _classify(1, exit_info=gone, agent_lines=killed, tail=["last"])
    assert reason == "exit_code" and message == (
        "torchrun exited with code 1: local rank 1 killed by signal 9 (SIGKILL); then "
        "RuntimeError: Connection closed by peer (rank 0, step 1); last lines:\nlast"
    )


def test_a_signal_death_is_the_root_cause_whatever_torchrun_names_first() -> None:
    """torchrun's first failure is by whole-second timestamps: a rank that failed because
    its peer was killed may be named first (trainer.torchrun prints one line per rank)."""
    lines = [
        "failed (exitcode: 1) local_rank: 0 (pid: 10) of binary: /py",
        "trainer.torchrun: rank 0 (local_rank: 0) failed with exitcode: 1",
        "trainer.torchrun: rank 1 (local_rank: 1) failed with exitcode: -9 (SIGKILL)",
    ]
    assert rank_exit_code(lines) == (-9, 1)
    assert rank_exit_code(lines[:2]) == (1, 0)
    # SIGTERM is what torchrun sends the ranks left after a failure: never the cause.
    stopped = ["trainer.torchrun: rank 1 (local_rank: 1) failed with exitcode: -15 (SIGTERM)"]
    assert rank_exit_code([*stopped, lines[1]]) == (1, 0)
    assert rank_exit_code(stopped) == (-15, 1)
    crash = {"reason": "exit_code", "message": "IndexError: x", "rank": 1, "step": 1}
    assert _classify(1, exit_info=crash, agent_lines=stopped)[2] == "IndexError: x (rank 1, step 1)"


def test_read_exit_json(tmp_path: Path) -> None:
    assert read_exit_json(tmp_path) is None
    (tmp_path / "exit.json").write_text("{not json")
    assert read_exit_json(tmp_path) is None
    (tmp_path / "exit.json").write_text(json.dumps({"reason": "nan_loss"}))
    assert read_exit_json(tmp_path) == {"reason": "nan_loss"}


def test_parse_line_tags_rank_lines_only() -> None:
    assert parse_line(b"[rank1]:step 3 loss 2.1\n") == (1, "step 3 loss 2.1")
    assert parse_line(b"[rank12]:[rank0]:x\r\n") == (12, "[rank0]:x")
    assert parse_line(b"W1202 torchrun warning\n") == (None, "W1202 torchrun warning")
    assert parse_line(b"\xff\xfebad utf8\n") == (None, "\ufffd\ufffdbad utf8")
    rank, text = parse_line(b"[rank0]:" + b"x" * 100_000)
    assert rank == 0 and len(text) == 8192
