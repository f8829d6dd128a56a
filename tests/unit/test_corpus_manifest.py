"""The corpus's split is frozen: the committed manifest matches every case, and a case moved
between dev and test, a changed log or label, and a new unlisted case are each named."""

from __future__ import annotations

import shutil
from pathlib import Path

from bench import corpus_manifest
from tests.conftest import FIXTURES

CORPUS = FIXTURES / "corpus"


def test_the_committed_manifest_matches_the_corpus() -> None:
    assert corpus_manifest.differences(CORPUS) == []


def _small_corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    for name in ("gpu_xid79_nccl_timeouts", "healthy_megatron_gpt2_345m"):
        shutil.copytree(CORPUS / "dev" / name, root / "dev" / name)
    (root / "test").mkdir()
    corpus_manifest.write(root)
    return root


def test_a_case_moved_to_test_is_named(tmp_path: Path) -> None:
    root = _small_corpus(tmp_path)
    shutil.move(root / "dev" / "healthy_megatron_gpt2_345m", root / "test" / "healthy_megatron_gpt2_345m")
    assert corpus_manifest.differences(root) == ["healthy_megatron_gpt2_345m: frozen in dev/, now in test/"]
    assert corpus_manifest.main(["--corpus", str(root)]) == 1


def test_a_changed_label_and_an_unlisted_case_are_named(tmp_path: Path) -> None:
    root = _small_corpus(tmp_path)
    label = root / "dev" / "gpu_xid79_nccl_timeouts" / "label.yaml"
    label.write_text(label.read_text().replace("gpu_hardware", "interconnect", 1))
    shutil.copytree(CORPUS / "dev" / "user_valueerror_bad_config", root / "test" / "tz_new_case")
    assert corpus_manifest.differences(root) == [
        "gpu_xid79_nccl_timeouts: its files changed since the manifest was written",
        "tz_new_case: in test/ but not in the manifest",
    ]


def test_an_unchanged_copy_agrees(tmp_path: Path) -> None:
    root = _small_corpus(tmp_path)
    assert corpus_manifest.main(["--corpus", str(root)]) == 0
    frozen = (root / corpus_manifest.MANIFEST).read_text()
    assert '"batch": "-"' in frozen and '"split": "dev"' in frozen
