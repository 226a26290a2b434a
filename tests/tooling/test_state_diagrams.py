"""docs/ARCHITECTURE.md's state diagrams are the protocol tables, as generated."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush.protocol import diagrams

DOC = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"


def test_the_documents_diagrams_are_the_tables() -> None:
    text = DOC.read_text()
    assert diagrams.replace(text) == text, (
        "docs/ARCHITECTURE.md's state diagrams differ from the tables: run "
        "python -m kvpush.protocol.diagrams --write docs/ARCHITECTURE.md")


def test_every_table_is_drawn() -> None:
    text = DOC.read_text()
    for module, attr, table in diagrams.machines():
        assert f"#### {table.name} (`{module}.{attr}`)" in text


def test_check_fails_on_a_stale_document(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "doc.md"
    stale.write_text(DOC.read_text().replace("--> held: prefill_done", "--> held: nothing"))
    assert diagrams.main(["--check", str(stale)]) == 1
    assert "differ from the tables" in capsys.readouterr().err
    assert diagrams.main(["--write", str(stale)]) == 0
    assert diagrams.main(["--check", str(stale)]) == 0
    assert stale.read_text() == DOC.read_text()


def test_a_document_without_markers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="markers"):
        diagrams.replace("# no diagrams here\n")
