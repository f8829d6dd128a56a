"""Node names (schemas.ids: Slurm's node-name grammar) at every entry point, and control characters
escaped wherever the CLI prints what the audit or the bus holds (schemas.printable). Issue 40 item 5."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import ValidationError
from rich.console import Console
from typer.testing import CliRunner

from producers.gpu_dcgm import DcgmScraper, parse_exposition
from producers.gpu_nvml import NvmlProducer
from producers.ingest import _BadRequest, parse_nvrx, parse_nvsentinel
from producers.joblogs import split_rank_prefix
from producers.kernel import KernelLogProducer, KernelStreamProducer, parse_kernel_line
from schemas.codec import DecodeError, decode, encode
from schemas.errors import ExitCode, UsageError
from schemas.events import Anomaly, Incident, KernelEvent, LogBatch, LogLine, SchedEvent
from schemas.ids import NODE_NAME_MAX, NodeNameError, check_node_name, is_node_name
from schemas.printable import printable
from sinks.backends.slurm_cli import validate_node_name
from slurmio.hostlist import HostlistError, expand_hostlist
from trainmedic.cli import audit as audit_cli
from trainmedic.cli.base import new_app, print_rows
from trainmedic.cli.main import app
from trainmedic.settings import Settings, SettingsError

VALID = ["gpu-001", "node01.cluster", "a_b", "gpu01", "GPU7", "10.0.0.5", "n", "x" * NODE_NAME_MAX]
FORGED = "gpu01\n\x1b[31mdec-forged  job 1  gpu_hardware\x1b[0m"
INVALID = [
    "gpu01\n",  # a trailing newline: Python's `$` would let it through
    "a\nb",
    FORGED,
    "\x1b[31mgpu01",
    "gpu01\x1b",
    "gpu 01",
    "gpu01\t",
    "gpu01,gpu02",  # a hostlist, not a name
    "gpu[01-04]",
    "gpu[01",
    "",
    "x" * (NODE_NAME_MAX + 1),
    "-gpu01",  # would read as an option to scontrol, ssh
    ".gpu01",
    "gpu01/x",
    "gpu\u00e901",  # not ASCII
    "gpu01\u202e",  # a bidi override
    "gpu01\x00",
]


# --- the grammar ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALID)
def test_valid_node_names(name: str) -> None:
    assert is_node_name(name) and check_node_name(name) == name


@pytest.mark.parametrize("name", INVALID)
def test_invalid_node_names_are_refused_naming_the_value_escaped(name: str) -> None:
    assert not is_node_name(name)
    with pytest.raises(NodeNameError) as err:
        check_node_name(name)
    message = str(err.value)
    assert message.startswith("invalid node name ") and "a Slurm node name is 1-64" in message
    assert printable(message) == message, "the refusal itself carries a control character"
    assert isinstance(err.value, UsageError) and isinstance(err.value, ValueError)


def test_non_text_is_no_node_name() -> None:
    assert not is_node_name(None) and not is_node_name(7)


def test_the_refusal_cuts_a_long_value() -> None:
    with pytest.raises(NodeNameError, match=r"'x{80}'\.\.\.: a Slurm"):
        check_node_name("x" * 5000)


def test_the_scheduler_backends_hold_the_same_grammar() -> None:
    assert validate_node_name("gpu01") == "gpu01"
    for name in ("gpu01\n", "a b", "-x"):
        with pytest.raises(ValueError, match="invalid node name"):
            validate_node_name(name)


# --- the events: every decoder refuses a forged name ----------------------------------------------


def _kernel_payload(node: str) -> dict[str, Any]:
    data = orjson.loads(encode(KernelEvent(event_id="k", event_time=1.0, node="gpu01", kind="xid", text="t")))
    return {**data, "node": node}


@pytest.mark.parametrize("name", INVALID)
def test_decode_refuses_a_forged_node_naming_the_field(name: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode(KernelEvent, orjson.dumps(_kernel_payload(name)))
    assert err.value.field == "node"


def test_decode_takes_a_valid_node() -> None:
    assert decode(KernelEvent, orjson.dumps(_kernel_payload("node01.cluster"))).node == "node01.cluster"


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (SchedEvent(event_id="s", event_time=1.0, kind="job", job_id="1", state="RUNNING", nodes=["gpu01"]), "nodes"),
        (
            LogBatch(
                event_id="l",
                event_time=1.0,
                job_id="1",
                source="f",
                lines=[LogLine(text="x", ts=1.0, node="gpu01", lineno=0)],
                job_nodes=["gpu01"],
            ),
            "lines",
        ),
        (
            Incident(
                event_id="i",
                event_time=1.0,
                incident_id="inc-1",
                category="gpu_hardware",
                severity="critical",
                culprit_node="gpu01",
                confidence=0.9,
                explanation="x",
                evidence=[],
                anomaly_ids=[],
                first_signal_time=1.0,
            ),
            "culprit_node",
        ),
    ],
)
def test_lists_and_nested_fields_are_checked_too(event: Any, field: str) -> None:
    data = orjson.loads(encode(event))
    if field == "nodes":
        data["nodes"] = ["gpu01", FORGED]
    elif field == "lines":
        data["lines"][0]["node"] = FORGED
    else:
        data[field] = FORGED
    with pytest.raises(DecodeError) as err:
        decode(type(event), orjson.dumps(data))
    assert err.value.field in {"nodes.1", "lines.0.node", "culprit_node"}


def test_an_event_cannot_be_made_with_a_forged_node() -> None:
    with pytest.raises(ValidationError):
        Anomaly(
            event_id="a",
            event_time=1.0,
            detector="d",
            signature="s",
            category="gpu_hardware",
            severity="critical",
            role="root",
            source="job_log",
            node=FORGED,
            line="",
        )


# --- hostlists: the expression is fine where hostlists are taken, each name is checked ----------


def test_hostlists_still_expand() -> None:
    assert expand_hostlist("gpu[01-03],login.cluster") == ["gpu01", "gpu02", "gpu03", "login.cluster"]


@pytest.mark.parametrize("text", ["gpu01,\x1b[31mx", "gpu01,a\nb", "gpu[01-02]\x1b", "gpu01,-x"])
def test_a_hostlist_naming_no_node_is_refused(text: str) -> None:
    with pytest.raises(HostlistError) as err:
        expand_hostlist(text)
    assert printable(str(err.value)) == str(err.value)


# --- producers: a bad name of their own is refused at start ---------------------------------------


class _Sent:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, topic: object, event: Any) -> None:
        self.events.append(event)


def test_the_settings_refuse_a_node_name_saying_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match=r"'gpu01\\n\\x1b\[31m'.*--node"):
        Settings.load().slurm_node("gpu01\n\x1b[31m")
    monkeypatch.setattr("socket.gethostname", lambda: "my host")
    with pytest.raises(SettingsError, match="this host's name"):
        Settings.load().slurm_node()
    s = Settings.load(node_map={"k8s-worker": "bad name"})
    with pytest.raises(SettingsError, match=r"node_map\['k8s-worker'\]"):
        s.slurm_node("k8s-worker")
    assert Settings.load(node_map={"k8s-worker": "gpu07"}).slurm_node("k8s-worker") == "gpu07"


def test_node_producers_refuse_a_bad_name_at_start(tmp_path: Path) -> None:
    with pytest.raises(NodeNameError, match="kernel producer"):
        KernelLogProducer(_Sent(), tmp_path / "kern.log", node="gpu01\n")  # type: ignore[arg-type]
    with pytest.raises(NodeNameError, match="kernel producer"):
        KernelStreamProducer(_Sent(), node="a b")  # type: ignore[arg-type]
    with pytest.raises(NodeNameError, match="GPU producer"):
        NvmlProducer(_Sent(), node="\x1b[31m")  # type: ignore[arg-type]  # refused before NVML is touched
    with pytest.raises(NodeNameError, match="dcgm producer"):
        DcgmScraper("http://127.0.0.1:9400/metrics", default_node="x,y")
    # An IPv6 exporter address is no node name: the error says so (--node names it).
    with pytest.raises(NodeNameError, match="'::1' |'fe80::1'"):
        DcgmScraper("http://[fe80::1]:9400/metrics")


def test_a_dcgm_hostname_label_naming_no_node_skips_that_series() -> None:
    text = (
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-0",Hostname="gpu01"} 40\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="GPU-1",Hostname="gpu01\\u001b[31m"} 41\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="2",UUID="GPU-2",Hostname="a b"} 42\n'
    )
    assert set(parse_exposition(text, "default")) == {"gpu01"}


def test_a_kernel_line_naming_no_node_is_the_producers_node() -> None:
    xid = "NVRM: Xid (PCI:0000:01:00): 79, pid=1, name=x, GPU has fallen off the bus."
    parsed = parse_kernel_line(f"2025-03-03T12:00:00+00:00 -gpu01 kernel: {xid}", "gpu07")
    assert parsed is not None and parsed.node == "gpu07"
    sent = _Sent()
    KernelStreamProducer(sent, node="gpu07").handle(xid, host="h" * 65)  # type: ignore[arg-type]
    KernelStreamProducer(sent, node="gpu07").handle(xid, host="gpu03")  # type: ignore[arg-type]
    assert [e.node for e in sent.events] == ["gpu07", "gpu03"]


def test_a_log_line_names_no_host_that_is_not_a_node_name() -> None:
    assert split_rank_prefix("Hostname=gpu03 up").host == "gpu03"
    assert split_rank_prefix(f"Hostname={'x' * 70} up").host is None  # not cut to a name it is not


# --- the ingest: a forged name is a 400 naming the field, the value escaped ---------------------


@pytest.mark.parametrize(
    ("parse", "body", "field"),
    [
        (parse_nvsentinel, {"nodeName": FORGED, "checkName": "XID_ERROR_48"}, "nodeName"),
        (
            parse_nvsentinel,
            {"events": [{"nodeName": "gpu01", "checkName": "X"}, {"nodeName": "gpu01,gpu02", "checkName": "X"}]},
            "events.1.nodeName",
        ),
        (parse_nvrx, {"kind": "fault", "node": FORGED, "timestamp": 1.0, "fault_type": "hang"}, "node"),
    ],
)
def test_ingest_refuses_a_forged_node_name(parse: Any, body: dict[str, Any], field: str) -> None:
    with pytest.raises(_BadRequest) as err:
        parse(orjson.dumps(body), 1.0)
    assert (err.value.reason, err.value.field) == ("invalid_field", field)
    assert err.value.problem.startswith("invalid node name '") and printable(err.value.problem) == err.value.problem


# --- the terminal: one helper escapes, every listing uses it --------------------------------------


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("gpu01", "gpu01"),
        ("gpu01\ndec-forged", "gpu01\\ndec-forged"),
        ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),
        ("a\rb\tc\x07d\x7fe", "a\\rb\\tc\\x07d\\x7fe"),
        ("csi\x9b2J", "csi\\x9b2J"),
        ("bidi\u202etxt\u2028", "bidi\\u202etxt\\u2028"),
        ("naïve – ok [bold]", "naïve – ok [bold]"),
    ],
)
def test_printable_escapes_control_characters_only(text: str, shown: str) -> None:
    assert printable(text) == shown
    assert printable(shown) == shown  # idempotent: escaping twice shows the same
    assert printable(3) == "3"


def test_api_listings_print_one_escaped_line_per_row(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"node": FORGED}, {"node": "gpu02"}]
    print_rows(rows, False, lambda r: f"culprit {r['node']}")
    out = capsys.readouterr().out
    assert out.splitlines() == [f"culprit {printable(FORGED)}", "culprit gpu02"]
    assert "\x1b" not in out


def test_audit_tables_escape_and_read_no_markup() -> None:
    buf = io.StringIO()
    rows = [{"incident_id": "inc-1", "culprit_node": FORGED + " [red]x[/red]"}, {"incident_id": "inc-2"}]
    table = audit_cli._table("t\x1b[2J", rows, (("incident_id", "incident"), ("culprit_node", "culprit")))
    Console(file=buf, width=400, force_terminal=False).print(table)
    out = buf.getvalue()
    assert "\x1b" not in out and "\\x1b[31m" in out and "[red]x[/red]" in out
    body = [line for line in out.splitlines() if line.startswith("│")]
    assert len(body) == 2, out  # one line per record: the newline forged no row


# --- the CLI: a node argument is checked before anything is asked ---------------------------------

runner = CliRunner()


@pytest.mark.parametrize(
    "args",
    [
        ["nodes", "resume", "gpu01\n\x1b[31mx", "--api", "http://127.0.0.1:9"],
        ["audit", "node", "gpu01 gpu02", "--data-dir", "/nonexistent"],
        ["produce", "kernel", "--node", "gpu01\n", "--file", "/nonexistent/kern.log"],
        ["produce", "dcgm", "--node", "-x", "--url", "http://127.0.0.1:9/metrics"],
        ["produce", "logs", "--job", "1", "--path", "/nonexistent", "--nodes", "gpu01,a\x1bb"],
    ],
)
def test_cli_refuses_a_bad_node_name(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINMEDIC_TOKEN", "t0ken-t0ken-t0ken")
    monkeypatch.setenv("TRAINMEDIC_BOOTSTRAP", "127.0.0.1:9")  # never reached: the name is refused first
    result = runner.invoke(app, args)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "node name" in result.stderr and "\x1b" not in result.stderr


def test_the_console_writes_server_values_as_text_never_as_html() -> None:
    """The console's scripts put every value from the server in with textContent (console.js says so):
    no HTML sink at all, so a name with markup or control characters is inert text in the page."""
    static = Path(audit_cli.__file__).parents[1] / "web" / "console" / "static"
    scripts = sorted(static.glob("*.js"))
    assert scripts
    for script in scripts:
        text = script.read_text()
        for sink in (
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "DOMParser",
            "createContextualFragment",
        ):
            assert sink not in text, f"{script.name} uses {sink}"


def test_an_error_line_stays_one_line_escaped() -> None:
    sub = new_app()

    @sub.command()
    def fails() -> None:
        raise UsageError(f"the API said: no node {FORGED}")

    @sub.command()
    def other() -> None:
        pass

    result = runner.invoke(sub, ["fails"])
    assert result.exit_code == ExitCode.USAGE
    assert result.stderr == f"error: the API said: no node {printable(FORGED)}\n"
