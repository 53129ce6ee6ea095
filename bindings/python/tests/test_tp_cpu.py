"""Tensor parallelism over gloo on CPU tensors (the float64 backend): world sizes 2 and 3, vocab
split unevenly, labels global, every rank's outputs against the unsharded float64 reference;
``d hidden`` all-reduced (default) or left partial; a given or all-reduced vocabulary size; fp32
operands (whose one-hot rule adds to the partial ``d hidden`` before the all-reduce); a bad
label raising ValueError on every rank. Cases of one world size share one spawned group."""

from tp_workers import run_tp_cases


def test_tp_world2():
    run_tp_cases(
        2,
        [
            ("core_tp", dict(sizes=None, temperature=0.8)),
            ("core_tp", dict(sizes=[37, 263], temperature=0.8)),
            ("core_tp", dict(sizes=[120, 180], give_vocab=True, ignore=False, temperature=1.3)),
            ("core_tp", dict(sizes=[100, 200], dtype="fp32", reduce=True, precision="split")),
            ("core_tp", dict(sizes=[100, 200], dtype="fp32", reduce=False, precision="split")),
            ("label_error_tp", {}),
        ],
    )


def test_tp_world3():
    run_tp_cases(
        3,
        [
            ("core_tp", dict(sizes=[101, 100, 99], temperature=0.8)),
            ("core_tp", dict(sizes=[10, 250, 40])),
            ("core_tp", dict(sizes=[50, 150, 100], reduce=False)),
        ],
    )
