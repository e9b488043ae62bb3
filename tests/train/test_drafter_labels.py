"""train/drafter.py: a drafted position trains only on labels of the target's own chain, and
blocks of the target's own rows are anchored where inference drafts."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "train"))
from drafter import blocks, chain_kept, cycle_lengths  # noqa: E402


def test_labels_past_a_token_the_target_would_not_choose_are_dropped() -> None:
    # greedy[p] is the target's choice after the text up to p, i.e. for the token at p + 1.
    ids = np.array([[10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])
    greedy = np.array([[11, 12, 99, 14, 15, 16, 17, 18, 19, 20]])
    b = 4  # an anchor and 3 drafted positions
    kept = chain_kept(ids, greedy, np.array([[0, 1, 4]]), b)
    assert kept.shape == (1, 3, 3)
    # Anchor 0: the text took the target's choices at 1 and 2 (11, 12): all three labels hold.
    assert kept[0, 0].tolist() == [True, True, True]
    # Anchor 1: the text took 12 at 2, but 13 at 3 where the target chose 99: the third
    # label (the target's choice after 13) answers text the drafter never sees.
    assert kept[0, 1].tolist() == [True, True, False]
    # Anchor 4: the target's own text from there on: every label holds.
    assert kept[0, 2].tolist() == [True, True, True]


def test_the_first_drafted_position_always_holds() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 5, size=(3, 40))
    greedy = rng.integers(0, 5, size=(3, 40))
    anchors = np.sort(rng.choice(np.arange(1, 32), size=(3, 6)), axis=1)
    kept = chain_kept(ids, greedy, anchors, 8)
    assert kept[:, :, 0].all()
    # Once a label is dropped, every later one in its block is too.
    assert (np.diff(kept.astype(int), axis=2) <= 0).all()


def test_anchors_of_a_row_start_where_it_says() -> None:
    # Two corpus rows (anchors from 1) and two of the target's own text after a prompt of 96
    # tokens (anchors from its last token, 95): distinct, sorted, and each block ends in its row.
    rng = np.random.default_rng(0)
    t, k, b = 160, 24, 8
    first = np.array([1, 1, 95, 95])
    for _ in range(50):
        anchors = blocks(rng, 4, t, k, b, first)
        assert anchors.shape == (4, k)
        assert (anchors >= first[:, None]).all() and (anchors <= t - b).all()
        assert (np.diff(anchors, axis=1) > 0).all()
    # Every place can be drawn: the 58 places after the prompt, all of them over many draws.
    seen = set(np.concatenate([blocks(rng, 1, t, k, b, np.array([95]))[0] for _ in range(200)]).tolist())
    assert seen == set(range(95, t - b + 1))


def test_decoding_follows_its_own_cycles_not_every_place() -> None:
    # Drafts a block at each place would accept: the first cycle (at place 0) accepts 2 and
    # commits 3 tokens, so the next is anchored at place 3 (not 1, whose 7 decoding never
    # sees), accepts 0 and commits 1; place 4 accepts 1; place 6 is the row's last.
    accepted = np.array([2, 7, 7, 0, 1, 7, 3])
    assert cycle_lengths(accepted) == [3, 1, 2, 4]
    # Every place accepting nothing: one token a cycle, a cycle at every place.
    assert cycle_lengths(np.zeros(5, dtype=int)) == [1] * 5
