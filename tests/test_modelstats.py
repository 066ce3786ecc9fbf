"""Routing statistics on a known routing: shares, skew, total-variation distance, unigram perplexity."""
import numpy as np
import pytest

from autotune.calibration import modelstats
from runtime.drift import tv_distance


def test_modelstats_on_a_known_routing():
    counts = np.array([[6, 1, 1, 0], [2, 2, 2, 2]])
    share = modelstats.shares(counts)
    assert np.allclose(modelstats.skew(share), [3.0, 1.0])
    assert np.allclose(tv_distance(share, share[::-1]), [0.5, 0.5])
    assert modelstats.unigram_perplexity([0, 0, 1], [0, 1], 2) == pytest.approx((3 / 5 * 2 / 5) ** -0.5)
