"""train/corpus.py: a held-out file must be evidence of code the model has not seen."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "train"))
import corpus  # noqa: E402


def named(split: str, count: int, pattern: str = "crate-1.0.0/src/f{i}.rs") -> list[str]:
    """File names of `pattern` that the path hash sends to `split`."""
    names = (pattern.format(i=i) for i in range(100_000))
    found = [n for n in names if corpus.split_of(n) == split][:count]
    assert len(found) == count
    return found


def test_a_held_out_copy_of_a_training_file_is_in_neither_split() -> None:
    train_a, train_b = named("train", 2)
    held_copy, held_own = named("heldout", 2)
    files = [(held_copy, "sha-of-a"), (train_a, "sha-of-a"), (train_b, "sha-of-b"), (held_own, "sha-of-c")]
    # The copy comes before its training twin: the rule looks at the whole corpus, not the files so far.
    assert corpus.splits(files) == ["duplicate", "train", "train", "heldout"]


def test_copies_among_training_files_stay_in_training() -> None:
    train_a, train_b = named("train", 2)
    assert corpus.splits([(train_a, "same"), (train_b, "same")]) == ["train", "train"]


def test_a_held_out_file_trained_at_another_version_of_its_crate_is_in_neither_split() -> None:
    [held] = named("heldout", 1, "darling-0.21.{i}/src/lib.rs")
    [trained] = named("train", 1, "darling-0.20.{i}/src/lib.rs")
    [other] = named("train", 1, "darling-0.20.{i}/src/util.rs")
    assert corpus.splits([(held, "new"), (trained, "old")]) == ["duplicate", "train"]
    assert corpus.splits([(held, "new"), (other, "old")]) == ["heldout", "train"], "another file of the crate"
    assert corpus.same_file_any_version("darling_core-0.20.11/src/a.rs") == ("darling_core", "src/a.rs")
    assert corpus.same_file_any_version("cpython-3.11/ast.py") == ("cpython", "ast.py")
