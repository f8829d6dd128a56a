"""bench/accuracy.py on a small corpus built from real dev cases: both splits reported, the test
split's misses kept off the terminal, diagnose_args and culprit_rank handled, malformed labels -> 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from bench import accuracy, results
from tests.conftest import FIXTURES

DEV = FIXTURES / "corpus" / "dev"


def copy_case(src: str, dst: Path, **label_changes: object) -> Path:
    shutil.copytree(DEV / src, dst)
    if label_changes:
        label = yaml.safe_load((dst / "label.yaml").read_text())
        label.update(label_changes)
        (dst / "label.yaml").write_text(yaml.safe_dump(label))
    return dst


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    copy_case("gpu_xid79_nccl_timeouts", root / "dev" / "gpu_xid79_nccl_timeouts")
    copy_case("healthy_megatron_gpt2_345m", root / "dev" / "healthy_megatron_gpt2_345m")
    # A deliberately wrong label in the held-out split: it must be a miss in the files only.
    copy_case("user_valueerror_bad_config", root / "test" / "secret_case_xyz", category="storage")
    copy_case("healthy_nccl_socket_init", root / "test" / "healthy_nccl_socket_init")
    return root


def run(corpus: Path, out: Path, *extra: str) -> int:
    return accuracy.main(["--corpus", str(corpus), "--out", str(out), *extra])


def test_both_splits_reported_and_test_misses_only_in_files(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert run(corpus, out) == 0  # a miss does not fail the report
    terminal = capsys.readouterr().out
    assert "gpu_xid79_nccl_timeouts" in terminal  # dev case by case
    assert "secret_case_xyz" not in terminal and "test: 2 cases" in terminal
    result = json.loads((out / "accuracy.json").read_text())
    dev, test = result["splits"]["dev"]["summary"], result["splits"]["test"]["summary"]
    assert (dev["cases"], dev["category_accuracy"], dev["false_actions_on_healthy"]) == (2, 1.0, 0)
    assert dev["culprit_named_cases"] == 1 and dev["culprit_named_accuracy"] == 1.0
    assert (test["cases"], test["category_accuracy"]) == (2, 0.5)
    assert test["per_category"]["storage"]["diagnosed_as"] == {"user_code": 1}
    md = (out / "accuracy.md").read_text()
    assert "## Split `dev`" in md and "## Split `test`" in md
    miss = next(line for line in md.splitlines() if line.startswith("| secret_case_xyz"))
    assert "storage / null / stop" in miss and "user_code / null / stop" in miss


def test_single_split_writes_its_own_files(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run(corpus, out, "--split", "dev") == 0
    assert sorted(p.name for p in out.iterdir()) == ["accuracy", "accuracy-dev.json", "accuracy-dev.md"]
    assert "test" not in json.loads((out / "accuracy-dev.json").read_text())["splits"]
    # The same run in the common results format (bench/results.py), named after its split.
    (common,) = (out / "accuracy").iterdir()
    doc = json.loads(common.read_text())
    assert results.errors(doc) == [] and doc["variant"] == "dev" and common.name.endswith("-dev.json")
    assert {f["where"]["split"] for f in doc["figures"]} == {"dev"}


def test_culprit_rank_is_scored_and_unknown_category_accepted(corpus: Path, tmp_path: Path) -> None:
    # The real Xid 79 case names node gpu01; a label that also claims a rank the log never gives is a miss.
    label = corpus / "dev" / "gpu_xid79_nccl_timeouts" / "label.yaml"
    data = yaml.safe_load(label.read_text())
    label.write_text(yaml.safe_dump({**data, "culprit_rank": 7}))
    copy_case("unknown_segfault_barrier", corpus / "dev" / "unknown_crash")
    out = tmp_path / "out"
    assert run(corpus, out, "--split", "dev") == 0
    res = json.loads((out / "accuracy-dev.json").read_text())["splits"]["dev"]
    assert res["summary"]["culprit_named_correct"] == 0
    assert res["summary"]["unknown_cases"] == 1 and "unknown" in res["summary"]["per_category"]


def test_diagnose_args_passed_only_when_accepted(corpus: Path, tmp_path: Path) -> None:
    label = corpus / "dev" / "healthy_megatron_gpt2_345m" / "label.yaml"
    data = yaml.safe_load(label.read_text())
    args = {"nodelist": "gpu[01-02]", "ranks_per_node": 8, "no_such_argument_xyz": 1}
    label.write_text(yaml.safe_dump({**data, "diagnose_args": args}))
    out = tmp_path / "out"
    assert run(corpus, out, "--split", "dev") == 0
    res = json.loads((out / "accuracy-dev.json").read_text())["splits"]["dev"]
    accepted = accuracy.accepted_args()
    ignored = sorted(k for k in args if accepted is not None and k not in accepted)
    assert "no_such_argument_xyz" in ignored
    assert res["ignored_diagnose_args"] == {"healthy_megatron_gpt2_345m": ignored}
    # diagnose_paths was called with the arguments it takes and still diagnosed the case.
    case = next(c for c in res["cases"] if c["case"] == "healthy_megatron_gpt2_345m")
    assert case["got"]["category"] == "healthy"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"category": "cosmic_rays"}, "category 'cosmic_rays'"),
        ({"action": "reboot"}, "action 'reboot'"),
        ({"culprit_rank": "three"}, "culprit_rank"),
        ({"diagnose_args": ["gpu[01-04]"]}, "diagnose_args"),
        ({"source": []}, "source"),
        ({"typo_key": 1}, "unknown keys typo_key"),
    ],
)
def test_malformed_label_exits_2(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, object], message: str
) -> None:
    label = corpus / "dev" / "healthy_megatron_gpt2_345m" / "label.yaml"
    label.write_text(yaml.safe_dump({**yaml.safe_load(label.read_text()), **change}))
    assert run(corpus, tmp_path / "out", "--split", "dev") == 2
    err = capsys.readouterr().err
    assert "healthy_megatron_gpt2_345m" in err and message in err


def test_missing_split_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "corpus" / "dev").mkdir(parents=True)
    assert run(tmp_path / "corpus", tmp_path / "out") == 2
    assert "no cases" in capsys.readouterr().err


def test_source_units_group_a_thread_and_a_repositorys_files() -> None:
    unit = accuracy.source_unit
    assert unit("https://github.com/NVIDIA/nccl/issues/1405#issuecomment-1") == "github.com/nvidia/nccl/issues/1405"
    assert unit("https://github.com/NVIDIA/nccl/pull/1405") == unit("https://github.com/nvidia/nccl/issues/1405")
    assert unit("https://github.com/huggingface/m4-logs/blob/7a31/tr_141/README.md") == "github.com/huggingface/m4-logs"
    assert unit("https://forums.developer.nvidia.com/t/xid-79/12345/") == "forums.developer.nvidia.com/t/xid-79/12345"


def test_leave_one_source_out_drops_the_signatures_written_from_the_case(corpus: Path, tmp_path: Path) -> None:
    # gpu_cuda_ecc_uncorrectable is the source the catalog's cuda_uncorrectable_ecc entry was written from.
    copy_case("gpu_cuda_ecc_uncorrectable", corpus / "dev" / "gpu_cuda_ecc_uncorrectable")
    out = tmp_path / "out"
    assert run(corpus, out, "--split", "dev") == 0
    dev = json.loads((out / "accuracy-dev.json").read_text())["splits"]["dev"]
    left_out = dev["leave_one_source_out"]["signatures_left_out"]
    assert "cuda_uncorrectable_ecc" in left_out["gpu_cuda_ecc_uncorrectable"]
    assert "gpu_xid79_nccl_timeouts" not in left_out or "xid" not in " ".join(left_out["gpu_xid79_nccl_timeouts"])
    assert dev["summary"]["cases"] == dev["leave_one_source_out"]["summary"]["cases"] == 3


def test_batches_and_failures_called_healthy_are_reported(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    copy_case("gpu_xid79_nccl_timeouts", root / "dev" / "gpu_xid79_nccl_timeouts")
    copy_case("healthy_megatron_gpt2_345m", root / "test" / "ta_healthy_run")
    # A failure labelled as such in a healthy log: diagnosed healthy, so a failure called healthy.
    copy_case(
        "healthy_nccl_socket_init", root / "test" / "tb_failure_seen_as_healthy", category="storage", action="stop"
    )
    out = tmp_path / "out"
    assert run(root, out) == 0
    test = json.loads((out / "accuracy.json").read_text())["splits"]["test"]
    assert set(test["batches"]) == {"ta", "tb"}
    assert test["batches"]["tb"]["failures_called_healthy"] == 1 and test["batches"]["ta"]["failure_cases"] == 0
    assert test["summary"]["failures_called_healthy_rate"] == 1.0
    assert "| tb | 1 |" in (out / "accuracy.md").read_text()
