"""``python -m criticalkv.bench.peers.cpu needle``: how answers are compared (the peers themselves are not run in CI)."""

from criticalkv.bench.peers.cpu import same_answer, until_stop

STOP = {2}


def test_tokens_are_cut_after_the_first_stop_token():
    assert until_stop([5, 6, 2, 7, 2], STOP) == [5, 6, 2]
    assert until_stop([5, 6], STOP) == [5, 6]


def test_an_engine_must_stop_where_the_reference_stops():
    reference = [5, 6, 2]
    assert same_answer(reference, [5, 6, 2], STOP, stops=True)
    assert not same_answer(reference, [5, 6, 9, 2], STOP, stops=True)  # ' 3042.' then more
    assert not same_answer(reference, [5, 7, 2], STOP, stops=True)


def test_a_peer_that_cannot_stop_is_compared_before_the_stop_token():
    reference = [5, 6, 2]
    assert same_answer(reference, [5, 6, 11, 11], STOP, stops=False)  # its runner suppresses the stop token
    assert not same_answer(reference, [5, 7, 11, 11], STOP, stops=False)
    assert same_answer([5, 6, 8], [5, 6, 8, 1], STOP, stops=False)  # a reference without a stop: its whole length
