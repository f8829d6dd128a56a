"""Offline diagnosis reads the catalogs' kernel and driver messages in a kernel log wherever the line's
prefix puts them (journald/syslog host, dmesg -T date, uptime stamp), and the emitters' vocabulary in
job logs whatever signatures.yaml holds. Lines are filled in from the kernel's and Slurm's format
strings (cited in streams/catalog/vocabulary.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest

from streams.catalog import default_signatures
from trainmedic.ops.diagnose import diagnose_paths

JOB = "step 10 | loss 2.31\nstep 20 | loss 2.29\n"


def _case(tmp_path: Path, kern: str, job: str = JOB) -> list[Path]:
    (tmp_path / "kern.log").write_text(kern)
    (tmp_path / "job.out").write_text(job)
    return [tmp_path / "kern.log", tmp_path / "job.out"]


@pytest.mark.parametrize(
    ("line", "category", "culprit", "action"),
    [
        (
            # journald: "<date> <host> kernel: <message>"
            "Dec 07 18:56:47 gpu02 kernel: pcieport 0000:00:03.1: PCIe Bus Error: severity=Uncorrectable (Fatal), "
            "type=Transaction Layer, (Receiver ID)",
            "node",
            "gpu02",
            "drain_and_requeue",
        ),
        (
            # syslog with an uptime stamp
            "Dec  7 18:56:47 gpu03 kernel: [680111.646286] Memory cgroup out of memory: Killed process 41234 (python3) "
            "total-vm:98765432kB, anon-rss:61234567kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:123456kB "
            "oom_score_adj:0",
            "oom",
            "gpu03",
            "stop",
        ),
        (
            # dmesg -T: no host, so no culprit node
            "[Mon Dec  7 18:56:47 2026] EXT4-fs error (device nvme0n1p2): ext4_find_entry:1658: inode #2: comm "
            "python3: reading directory lblock 0",
            "storage",
            None,
            "stop",
        ),
    ],
)
def test_kernel_messages_in_a_kernel_log(
    tmp_path: Path, line: str, category: str, culprit: str | None, action: str
) -> None:
    report = diagnose_paths(_case(tmp_path, line + "\n"))
    assert (report["category"], report["culprit"], report["action"]) == (category, culprit, action)
    assert report["evidence"][0]["source"] == "kernel"


def test_a_programs_line_in_syslog_is_not_the_kernels(tmp_path: Path) -> None:
    """syslog also holds programs' lines: a signature there is evidence, but the job's, not the kernel's."""
    line = "Dec  7 18:56:47 gpu02 slurmstepd[4242]: error: Detected 1 oom_kill event in StepId=77.0. Some of the step tasks have been OOM Killed."
    report = diagnose_paths(_case(tmp_path, line + "\n"))
    assert report["category"] == "oom"
    assert report["evidence"][0]["provenance"] == "job"


def test_healthy_kernel_log_stays_healthy(tmp_path: Path) -> None:
    kern = (
        "Dec 07 18:56:47 gpu02 kernel: pcieport 0000:00:1c.5: AER: Correctable error message received from 0000:00:1c.5\n"
        "Dec 07 18:57:01 gpu02 kernel: nfs: server 10.0.0.60 OK\n"
    )
    assert diagnose_paths(_case(tmp_path, kern))["category"] == "healthy"


def test_vocabulary_reads_a_job_log_without_signatures_yaml(tmp_path: Path) -> None:
    """With every report-written specific entry left out (as leave-one-source-out does for a case's
    own sources), the emitters' vocabulary still names the node Slurm lost."""
    job = "step 10 | loss 2.31\nsrun: error: Node failure on gpu04\nslurmstepd: error: *** STEP 77.0 ON gpu01 CANCELLED AT 2026-12-07T18:56:47 DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***\n"
    (tmp_path / "job.out").write_text(job)
    fallbacks = [s for s in default_signatures() if s.fallback]
    report = diagnose_paths([tmp_path / "job.out"], signatures=fallbacks)
    assert (report["category"], report["culprit"], report["action"]) == ("node", "gpu04", "drain_and_requeue")


@pytest.mark.parametrize(
    "wrapped",
    [
        # a monitoring alert quoting the node's syslog line
        "ALERT Xid errors on instance: gpu03, Error: Dec  7 18:56:47 gpu03 kernel: [680111.646286] {xid}",
        # kubectl logs of a node-problem pod: container runtime prefix, then journald's line
        "2026-12-07T18:56:47.123456789Z stdout F Dec 07 18:56:47 gpu03 kernel: {xid}",
        # a collector's "[time] source:" wrapper around an ISO-stamped syslog line
        "[2026-12-07 18:56:48] syslog: 2026-12-07T18:56:47+00:00 gpu03 kernel: {xid}",
    ],
)
def test_a_driver_message_is_read_wherever_it_sits_in_a_job_log_line(tmp_path: Path, wrapped: str) -> None:
    # NVRM's Xid format: "NVRM: Xid (PCI:%04x:%02x:%02x): %d, pid=%s, name=%s, %s" (kernel_rc.c, 570.211.01)
    xid = "NVRM: Xid (PCI:0000:10:00): 79, pid=0, name=python3, GPU has fallen off the bus."
    (tmp_path / "job.out").write_text(JOB + wrapped.format(xid=xid) + "\n")
    report = diagnose_paths([tmp_path / "job.out"])
    assert (report["category"], report["culprit"], report["action"]) == ("gpu_hardware", "gpu03", "drain_and_requeue")


def test_prose_naming_the_kernel_names_no_node(tmp_path: Path) -> None:
    xid = "NVRM: Xid (PCI:0000:10:00): 79, pid=0, name=python3, GPU has fallen off the bus."
    (tmp_path / "job.out").write_text(JOB + f"the node said through the kernel: {xid}\n")
    report = diagnose_paths([tmp_path / "job.out"])
    assert (report["category"], report["culprit"]) == ("gpu_hardware", None)


def test_a_pdsh_collected_multi_line_aer_report_is_one_fault_of_its_node(tmp_path: Path) -> None:
    """pdsh's "HOST: " before each syslog line (pdsh 2.34 dsh.c) and AER's indented lines under its
    severity line (drivers/pci/pcie/aer.c aer_print_error): one node fault of the named node, and
    the indented lines are not read as messages of their own."""
    kern = "".join(
        f"gpu05: Dec  7 18:56:47 gpu05 kernel: pcieport 0000:00:03.1: {m}\n"
        for m in (
            "PCIe Bus Error: severity=Uncorrectable (Fatal), type=Transaction Layer, (Receiver ID)",
            "  device [8086:2030] error status/mask=00040000/00000000",
            "   [18] MalfTLP                (First)",
        )
    )
    report = diagnose_paths(_case(tmp_path, kern))
    assert (report["category"], report["culprit"], report["action"]) == ("node", "gpu05", "drain_and_requeue")
    kernel = [e["line"] for e in report["evidence"] if e["source"] == "kernel"]
    assert kernel and all("error status/mask=00040000/00000000" in line for line in kernel)
