"""The built-in texts: the fixed pydoc split, deterministic sizes, disjoint calibration/held-out/code texts."""
import pytest

from autotune.calibration import texts
from runtime.errors import NpumoeError


def test_pydoc_split_is_disjoint_complete_and_fixed():
    calib, heldout = texts.pydoc_split()
    assert not set(calib) & set(heldout)
    assert sorted(calib + heldout) == sorted(texts.pydoc_topics())
    assert 0.15 < len(heldout) / (len(calib) + len(heldout)) < 0.35
    # The split is a function of the topic name only, so it is the same on every Python version.
    assert texts.pydoc_split() == (calib, heldout)
    assert all(texts.is_heldout_topic(k) for k in heldout) and not any(texts.is_heldout_topic(k) for k in calib)


def test_builtin_texts_are_deterministic_sized_and_disjoint():
    got = {n: texts.read_text(n) for n in texts.BUILTIN_TEXTS}
    assert got == {n: texts.read_text(n) for n in texts.BUILTIN_TEXTS}
    calib, heldout, code = (got[texts.DEFAULT_CALIB_TEXT], got[texts.DEFAULT_EVAL_TEXT], got[texts.SHIFTED_TEXT])
    assert 100_000 < len(calib) < 1_000_000 and 30_000 < len(heldout) < 500_000
    assert 50_000 < len(code) <= texts.STDLIB_CODE_MAX_CHARS
    topics = texts.pydoc_topics()
    for key in texts.pydoc_split()[1]:
        assert topics[key].strip() in heldout
    # Topics quote each other; not one held-out paragraph may reach the calibration (= training) side.
    held_paragraphs = {p for p in heldout.split("\n\n") if p.strip()}
    calib_paragraphs = {p for p in calib.split("\n\n") if p.strip()}
    assert len(held_paragraphs) > 300 and len(calib_paragraphs) > 1000
    assert not held_paragraphs & calib_paragraphs
    assert "def " in code and "import " in code  # source code, a different domain from the prose topics


def test_stdlib_code_selection_is_fixed_and_left_out_of_training_files():
    selected = texts.stdlib_code_files()
    assert len(selected) >= 5
    assert all(texts.is_stdlib_code_file(f) for f in selected)
    training = [f for f in texts.stdlib_files() if not texts.is_stdlib_code_file(f)]
    assert not set(selected) & set(training) and len(training) > 10 * len(selected)
    assert not any("/test" in "/" + f for f in selected)


def test_read_text_errors_and_files(tmp_path):
    with pytest.raises(NpumoeError, match="unknown built-in text"):
        texts.read_text("builtin:nope")
    with pytest.raises(NpumoeError, match="cannot read"):
        texts.read_text(str(tmp_path / "missing.txt"))
    (tmp_path / "t.txt").write_text("hello")
    assert texts.read_text(str(tmp_path / "t.txt")) == "hello"


def test_large_text_is_read_only_as_far_as_needed(tmp_path, monkeypatch):
    """Tokenising as read: a text far larger than one piece costs one piece when few tokens are used."""
    from autotune.calibration import workload
    from runtime.loading.model_loader import ByteTokenizer

    big = tmp_path / "big.txt"
    line = "static capacity tiers and grouped experts\n"
    big.write_text(line * (3 * texts.PIECE_CHARS // len(line)))
    seen = []
    real = workload.encode
    monkeypatch.setattr(workload, "encode", lambda tok, piece: seen.append(len(piece)) or real(tok, piece))
    ids = workload.encode_text(ByteTokenizer(256), str(big), 256)
    assert len(ids) == 256 and len(seen) == 1 and seen[0] <= texts.PIECE_CHARS
    assert ids.tolist() == ByteTokenizer(256).encode(line * 7)[:256]
    pieces = list(texts.iter_text(str(big)))
    assert len(pieces) >= 3 and all(p.endswith("\n") for p in pieces) and "".join(pieces) == big.read_text()
