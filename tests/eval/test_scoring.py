"""Scoring rules (they must be able to fail) and the paired statistics."""

import pytest

from criticalkv.eval.scoring import digits_match, paired_comparison, score, sign_test, string_match_all, string_match_part


def test_needle_digits_must_appear_as_a_whole_number():
    assert score("digits", " 7481.", ["7481"]) == 1.0
    assert score("digits", "The passcode is 7481", ["7481"]) == 1.0
    assert score("digits", " 74810.", ["7481"]) == 0.0
    assert score("digits", " 17481", ["7481"]) == 0.0
    assert score("digits", " 7 4 8 1", ["7481"]) == 0.0
    assert score("digits", "", ["7481"]) == 0.0
    assert digits_match("a1234b", "1234") == 1.0


def test_ruler_string_match_all_and_part():
    refs = ["Marian Holt", "ABCDE", "12345"]
    assert string_match_all("marian holt, abcde", refs) == pytest.approx(2 / 3)
    assert string_match_all("nothing here", refs) == 0.0
    assert string_match_all("ABCDE 12345 Marian Holt", refs) == 1.0
    assert string_match_part("it was marian holt", ["Marian Holt", "Holt"]) == 1.0
    assert string_match_part("it was Tobias", ["Marian Holt"]) == 0.0
    assert score("all", "\x00 ABCDE\n", ["abcde"]) == 1.0  # RULER's control-character clean-up


def test_score_rejects_unknown_metrics_and_empty_references():
    with pytest.raises(ValueError, match="unknown metric"):
        score("bleu", "x", ["x"])
    with pytest.raises(ValueError, match="no reference"):
        score("all", "x", [])


def test_sign_test_and_paired_comparison():
    assert sign_test(0, 5) == pytest.approx(2 / 32)
    assert sign_test(3, 3) == 1.0
    assert sign_test(0, 0) == 1.0
    same = paired_comparison([1, 0, 1, 1], [1, 0, 1, 1])
    assert same["mean_diff"] == 0 and same["ties"] == 4 and same["within_noise"]
    better = paired_comparison([1.0] * 30, [0.0] * 30)
    assert better["mean_diff"] == 1 and better["wins"] == 30 and not better["within_noise"] and better["sign_test_p"] < 1e-6
    noisy = paired_comparison([1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 1, 0])
    assert noisy["wins"] == 2 and noisy["losses"] == 2 and noisy["within_noise"]
    with pytest.raises(ValueError, match="not paired"):
        paired_comparison([1, 0], [1])
