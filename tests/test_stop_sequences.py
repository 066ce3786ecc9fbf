"""Stop sequences over streamed pieces: the text before the first stop, nothing held back longer than needed."""
import pytest

from runtime.serving.stop_sequences import StopText


def _run(stops, pieces):
    st, out = StopText(stops), []
    for p in pieces:
        text, hit = st.feed(p)
        out.append(text)
        if hit:
            return out, True
    out.append(st.flush())
    return out, False


@pytest.mark.parametrize("stops,pieces,text,hit", [
    (["END"], ["ab", "cE", "N", "Dxyz"], "abc", True),
    (["END"], ["ab", "cE", "N", "x"], "abcENx", False),
    (["\n\n", "##"], ["a\n", "b#", "#c"], "a\nb", True),
    ([], ["a", "b"], "ab", False),
    (["xy", "y"], ["ay"], "a", True),
])
def test_text_ends_before_the_first_stop(stops, pieces, text, hit):
    out, stopped = _run(stops, pieces)
    assert "".join(out) == text and stopped == hit


def test_only_a_possible_stop_start_is_held_back():
    st = StopText(["END"])
    assert st.feed("abcE") == ("abc", False)
    assert st.feed("x") == ("Ex", False)
