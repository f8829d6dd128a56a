"""slurmio's parsers on real output of every supported Slurm version.

22.05 and 24.11 were captured from this project's clusters; 23.02, 23.11 and
24.05 come from public repositories (tests/fixtures/slurm/SOURCES.md). The
expected values are read off the fixture files themselves.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from slurmio import (
    ExitStatus,
    HostlistError,
    LocalRunner,
    SlurmCommandError,
    SlurmFormatError,
    detect,
    expand_hostlist,
    known_versions,
    parse_jobs,
    parse_nodes,
    parse_sinfo,
    read_jobs,
    read_nodes,
    read_sinfo,
)
from slurmio.scontrol import job_from_text, node_from_text, parse_scontrol_line, show_job
from slurmio.versions import load_document

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"


def _doc(rel: str) -> dict[str, Any]:
    data = json.loads((FIX / rel).read_text())
    assert isinstance(data, dict)
    return data


# ----------------------------------------------------------------- versions
@pytest.mark.parametrize(
    ("rel", "version", "release"),
    [
        ("22.05/squeue.json", "v0.0.38", "22.05.8"),
        ("22.05/sinfo.json", "v0.0.38", "22.05.8"),
        ("23.02/squeue.json", "v0.0.39", "23.02.4"),
        ("23.02/sinfo.json", "v0.0.39", "23.02.5"),
        ("23.11/job-running.json", "v0.0.40", "23.11.10"),
        ("23.11/node-drain.json", "v0.0.40", "23.11.10"),
        ("24.05/job-running.json", "v0.0.41", "24.05.3"),
        ("24.05/node-drain.json", "v0.0.41", "24.05.3"),
        ("24.11/squeue.json", "v0.0.42", "24.11.5"),
        ("24.11/sinfo.json", "v0.0.42", "24.11.5"),
        ("24.11/scontrol_show_job.json", "v0.0.42", "24.11.5"),
    ],
)
def test_version_is_detected_from_meta(rel: str, version: str, release: str) -> None:
    parser = detect(_doc(rel), rel)
    assert (parser.version, parser.release) == (version, release)


def test_every_catalogued_version_has_a_fixture() -> None:
    assert set(known_versions()) == {"v0.0.38", "v0.0.39", "v0.0.40", "v0.0.41", "v0.0.42"}


def test_an_unsupported_version_is_refused_by_name() -> None:
    # A real 21.08 document (openapi v0.0.37): refused, never read with a guess.
    with pytest.raises(SlurmFormatError, match=r"v0\.0\.37.*21\.08\.5.*not supported"):
        read_sinfo((FIX / "21.08/sinfo.json").read_text())


def test_a_document_without_meta_is_refused() -> None:
    doc = _doc("22.05/squeue.json")
    del doc["meta"]
    with pytest.raises(SlurmFormatError, match="no 'meta'"):
        parse_jobs(doc)


def test_a_release_without_parser_name_maps_to_its_series() -> None:
    doc = _doc("24.11/squeue.json")
    del doc["meta"]["plugin"]["data_parser"]
    assert detect(doc, "squeue --json").version == "v0.0.42"


# ----------------------------------------------------------------- squeue
def test_squeue_2205() -> None:
    jobs = read_jobs((FIX / "22.05/squeue.json").read_text()).jobs
    running, held, failed = jobs["6"], jobs["7"], jobs["8"]
    assert (running.state, running.restart_cnt, running.nodes, running.partition) == ("RUNNING", 1, "gpu01", "gpu")
    assert running.start_time == 1796156887 and running.comment == "hello world" and running.user == "root"
    assert running.std_out == "/tmp/tmx2411/j22-%j.out"  # 22.05 squeue gives the pattern, scontrol the path
    assert running.tasks == 2 and not running.held
    assert held.state == "PENDING" and held.held and held.state_reason == "JobHeldUser" and held.nodes == ""
    assert failed.state == "FAILED" and failed.exit == ExitStatus(return_code=3)  # raw wait status 768
    assert failed.end_time == 1796156880 and failed.state_reason == "NonZeroExitCode"


def test_squeue_2302() -> None:
    jobs = read_jobs((FIX / "23.02/squeue.json").read_text()).jobs
    done = jobs["52173767"]
    assert (done.state, done.nodes, done.start_time, done.end_time) == ("COMPLETED", "cs66", 1694675238, 1694675491)
    assert done.exit == ExitStatus(return_code=0) and done.priority == 48 and done.user == "wshenyi"
    requeued_held = jobs["52175550"]
    assert requeued_held.state == "PENDING" and requeued_held.restart_cnt == 1 and requeued_held.held
    assert requeued_held.std_err == "/work/wshenyi/dtu_regr/rvsys/./logs/slurm-52175550.out"


@pytest.mark.parametrize("series", ["23.11", "24.05"])
def test_jobs_2311_and_2405(series: str) -> None:
    running = next(iter(read_jobs((FIX / series / "job-running.json").read_text()).jobs.values()))
    raw = _doc(f"{series}/job-running.json")["jobs"][0]
    assert raw["job_state"] == ["RUNNING"]
    assert running.state == "RUNNING" and running.base_state == "RUNNING"
    assert running.start_time == raw["start_time"]["number"] and running.start_time
    assert running.nodes == raw["nodes"] and running.std_out == raw["standard_output"]
    failed = next(iter(read_jobs((FIX / series / "job-failed.json").read_text()).jobs.values()))
    assert failed.state == "FAILED" and failed.exit == ExitStatus(return_code=1, signal=None)
    pending = next(iter(read_jobs((FIX / series / "job-pending.json").read_text()).jobs.values()))
    assert pending.state == "PENDING" and pending.nodes == ""


def test_squeue_2411() -> None:
    doc = read_jobs((FIX / "24.11/squeue_all.json").read_text())
    jobs = doc.jobs
    assert doc.parser.scontrol_json
    running = jobs["1"]
    assert running.state == "RUNNING" and running.restart_cnt == 1 and running.nodes == "gpu[01-02]"
    assert running.start_time == 1796156860 and running.tasks == 4 and running.comment == "hello world"
    assert running.std_out == "/tmp/tmx2411/j-1.out"  # expanded by 24.11 squeue already
    assert jobs["2"].held and jobs["2"].state_reason == "JobHeldUser" and jobs["2"].start_time == 0
    assert jobs["3"].state == "FAILED" and jobs["3"].exit == ExitStatus(return_code=3)
    # Without --states=all 24.11 leaves the finished job out (22.05 lists it anyway).
    assert set(read_jobs((FIX / "24.11/squeue.json").read_text()).jobs) == {"1", "2"}


def test_scontrol_json_2411_matches_squeue() -> None:
    from_scontrol = read_jobs((FIX / "24.11/scontrol_show_job.json").read_text(), "scontrol show job --json").jobs
    from_squeue = read_jobs((FIX / "24.11/squeue_all.json").read_text()).jobs
    assert from_scontrol == from_squeue


def test_list_state_with_a_flag_is_shown_as_2205_shows_it() -> None:
    doc = _doc("24.11/squeue.json")
    doc["jobs"][0]["job_state"] = ["RUNNING", "COMPLETING"]
    job = parse_jobs(doc).jobs["1"]
    assert (job.state, job.base_state, job.state_flags) == ("COMPLETING", "RUNNING", ("COMPLETING",))


# ----------------------------------------------------------------- wrong shapes fail loudly
def test_2411_document_labelled_2205_fails_naming_field_and_version() -> None:
    doc = _doc("24.11/squeue.json")
    doc["meta"] = _doc("22.05/squeue.json")["meta"]
    with pytest.raises(SlurmFormatError, match=r"v0\.0\.38.*jobs\[0\]\.job_state: expected a state string, got list"):
        parse_jobs(doc)


def test_2205_document_labelled_2411_fails_naming_field_and_version() -> None:
    doc = _doc("22.05/squeue.json")
    doc["meta"] = _doc("24.11/squeue.json")["meta"]
    with pytest.raises(SlurmFormatError, match=r"v0\.0\.42.*jobs\[0\]\.job_state"):
        parse_jobs(doc)


def test_integer_time_where_an_object_is_promised_fails() -> None:
    doc = _doc("24.11/squeue.json")
    doc["jobs"][1]["start_time"] = 5
    with pytest.raises(SlurmFormatError, match=r"jobs\[1\]\.start_time: expected a \{set, infinite, number\}"):
        parse_jobs(doc)


def test_unset_and_infinite_numbers_are_none() -> None:
    doc = _doc("24.11/squeue.json")
    doc["jobs"][0]["end_time"] = {"set": False, "infinite": False, "number": 0}
    doc["jobs"][0]["start_time"] = {"set": True, "infinite": True, "number": 0}
    job = parse_jobs(doc).jobs["1"]
    assert job.end_time is None and job.start_time is None


def test_unknown_base_state_fails() -> None:
    doc = _doc("24.11/squeue.json")
    doc["jobs"][0]["job_state"] = ["WIBBLE"]
    with pytest.raises(SlurmFormatError, match="exactly one base state"):
        parse_jobs(doc)


def test_sinfo_group_without_nodes_fails() -> None:
    doc = _doc("24.11/sinfo.json")
    del doc["sinfo"][0]["nodes"]
    with pytest.raises(SlurmFormatError, match=r"sinfo\[0\]\.nodes"):
        parse_sinfo(doc)


def test_slurm_errors_raise_command_error() -> None:
    doc = _doc("24.11/squeue.json")
    doc["errors"] = [{"description": "boom", "error_number": 1}]
    with pytest.raises(SlurmCommandError, match="boom"):
        load_document(json.dumps(doc), "squeue --json")


def test_not_json_fails() -> None:
    with pytest.raises(SlurmFormatError, match="not JSON"):
        read_jobs("squeue: error: ...")


# ----------------------------------------------------------------- sinfo / nodes
def test_sinfo_2205_drain_is_idle_plus_flag() -> None:
    nodes = read_sinfo((FIX / "22.05/sinfo.json").read_text()).nodes
    assert nodes["gpu04"].state == "IDLE" and nodes["gpu04"].flags == ("DRAIN",) and nodes["gpu04"].drained
    assert nodes["gpu04"].reason == "trainmedic fixture: xid 79" and nodes["gpu04"].reason_time == 1796156879
    assert nodes["gpu01"].state == "MIXED" and nodes["gpu01"].partitions == ("gpu",)


def test_sinfo_2302_groups() -> None:
    nodes = read_sinfo((FIX / "23.02/sinfo.json").read_text()).nodes
    assert nodes == {"localhost": nodes["localhost"]}
    assert nodes["localhost"].state == "ALLOCATED" and nodes["localhost"].partitions == ("debug",)


def test_sinfo_2411_groups_drain_and_down() -> None:
    nodes = read_sinfo((FIX / "24.11/sinfo.json").read_text()).nodes
    assert sorted(nodes) == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert nodes["gpu03"].state == "IDLE" and nodes["gpu03"].flags == ("DRAIN",)
    assert nodes["gpu03"].reason == "trainmedic fixture: xid 79" and nodes["gpu03"].reason_user == "root"
    assert nodes["gpu04"].state == "DOWN" and nodes["gpu04"].reason == "admin down test"
    assert nodes["gpu01"].state == nodes["gpu02"].state == "MIXED"


def test_sinfo_and_scontrol_nodes_agree_on_2411() -> None:
    from_sinfo = read_sinfo((FIX / "24.11/sinfo.json").read_text()).nodes
    from_scontrol = read_nodes((FIX / "24.11/scontrol_show_node.json").read_text()).nodes
    assert from_sinfo == from_scontrol


def test_a_node_in_two_partitions_is_merged() -> None:
    doc = _doc("24.11/sinfo.json")
    extra = copy.deepcopy(doc["sinfo"][0])
    extra["partition"]["name"] = "debug"
    doc["sinfo"].append(extra)
    node = parse_sinfo(doc).nodes["gpu03"]
    assert node.partitions == ("gpu", "debug") and node.flags == ("DRAIN",)


@pytest.mark.parametrize(
    ("rel", "state", "flags", "reason"),
    [
        ("23.11/node-drain.json", "MIXED", ("DRAIN",), "ECC memory error"),
        ("23.11/node-down.json", "DOWN", ("DRAIN",), "Network dead"),
        ("24.05/node-drain.json", "IDLE", ("DRAIN",), "ECC memory error"),
        ("24.05/node-down.json", "DOWN", (), "CPU dead"),
    ],
)
def test_node_documents_2311_2405(rel: str, state: str, flags: tuple[str, ...], reason: str) -> None:
    (node,) = parse_nodes(_doc(rel)).nodes.values()
    raw = _doc(rel)["nodes"][0]
    assert (node.state, node.flags, node.reason) == (state, flags, reason)
    assert node.reason_time == raw["reason_changed_at"]["number"]


# ----------------------------------------------------------------- scontrol text
def test_scontrol_text_2205() -> None:
    lines = (FIX / "22.05/scontrol_show_job.txt").read_text().splitlines()
    jobs = {j.job_id: j for j in map(job_from_text, filter(None, lines))}
    assert jobs["6"].std_out == "/tmp/tmx2411/j22-6.out" and jobs["6"].restart_cnt == 1
    assert jobs["6"].comment == "hello world" and jobs["6"].tasks == 2 and jobs["6"].user == "root"
    assert jobs["7"].held and jobs["8"].exit == ExitStatus(return_code=3)
    nodes = {
        n.name: n
        for n in map(node_from_text, filter(None, (FIX / "22.05/scontrol_show_node.txt").read_text().splitlines()))
    }
    assert nodes["gpu04"].flags == ("DRAIN",) and nodes["gpu04"].reason == "trainmedic fixture: xid 79"
    assert nodes["gpu04"].reason_user == "root"


def test_scontrol_text_and_json_agree_on_2411() -> None:
    lines = filter(None, (FIX / "24.11/scontrol_show_job.txt").read_text().splitlines())
    text = {j.job_id: j for j in map(job_from_text, lines)}
    json_jobs = read_jobs((FIX / "24.11/scontrol_show_job.json").read_text()).jobs
    for job_id, j in json_jobs.items():
        t = text[job_id]
        assert (t.state, t.restart_cnt, t.nodes, t.std_out, t.std_err, t.comment, t.tasks, t.held, t.exit) == (
            j.state,
            j.restart_cnt,
            j.nodes,
            j.std_out,
            j.std_err,
            j.comment,
            j.tasks,
            j.held,
            j.exit,
        )


def test_scontrol_line_values_with_spaces() -> None:
    fields = parse_scontrol_line("JobId=5 Comment=hello world  StdErr=/a b/c.err Reason=None")
    assert fields == {"JobId": "5", "Comment": "hello world", "StdErr": "/a b/c.err", "Reason": "None"}


def test_show_job_picks_text_or_json_by_version() -> None:
    calls: list[list[str]] = []
    text_out = (FIX / "22.05/scontrol_show_job.txt").read_text()
    json_out = (FIX / "24.11/scontrol_show_job.json").read_text()

    def runner(argv: Any, timeout: float) -> str:
        calls.append(list(argv))
        return json_out if "--json" in argv else text_out

    old = detect(_doc("22.05/squeue.json"), "squeue")
    new = detect(_doc("24.11/squeue.json"), "squeue")
    job = show_job(runner, "6", 5, old)
    assert job is not None and job.std_out == "/tmp/tmx2411/j22-6.out"
    job = show_job(runner, "1", 5, new)
    assert job is not None and job.std_out == "/tmp/tmx2411/j-1.out"
    assert calls == [["scontrol", "show", "job", "-o", "6"], ["scontrol", "show", "job", "--json", "1"]]
    assert show_job(runner, "999", 5, new) is None  # 24.11: unknown id -> empty list


# ----------------------------------------------------------------- hostlist and runner
def test_hostlist_expansion() -> None:
    assert expand_hostlist("gpu[01-03,05],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu05", "cpu1"]
    assert expand_hostlist("a,b,a") == ["a", "b", "a"]
    assert expand_hostlist("(null)") == []
    for bad in ("n[1-2],,m", "n[3-1]", "n[" + "9" * 30 + "]"):
        with pytest.raises(HostlistError):
            expand_hostlist(bad)


def test_local_runner_error_names_the_command_and_keeps_stderr() -> None:
    runner = LocalRunner()
    with pytest.raises(SlurmCommandError, match=r"sh -c 'echo nope >&2; exit 3' exited 3: nope") as info:
        runner(["sh", "-c", "echo nope >&2; exit 3"], 10)
    assert info.value.returncode == 3 and info.value.stderr.strip() == "nope"
    with pytest.raises(SlurmCommandError, match="timed out") as info:
        runner(["sleep", "5"], 0.2)
    assert info.value.returncode is None
    with pytest.raises(SlurmCommandError, match="could not be run"):
        runner(["/nonexistent/squeue"], 5)
    assert runner(["echo", "ok"], 5) == "ok\n"


def test_scontrol_text_with_a_planted_key_is_refused() -> None:
    # The text form has no quoting: a job name "x NodeList=gpu06" would plant a second NodeList
    # (the first occurrence of a key used to win, and JobName comes before NodeList).
    from slurmio.scontrol import parse_scontrol_line
    from slurmio.versions import SlurmFormatError

    ok = parse_scontrol_line("JobId=7 JobName=train UserId=alice(1000) NodeList=gpu[01-02] StdOut=/home/a/o")
    assert ok["NodeList"] == "gpu[01-02]" and ok["JobName"] == "train"
    with pytest.raises(SlurmFormatError, match="NodeList appears twice"):
        parse_scontrol_line("JobId=7 JobName=x NodeList=gpu06 UserId=alice(1000) NodeList=gpu[01-02]")
