"""The demo's task data (jaxgpu/_demo.py): packed rows whose targets, mask, positions and
segment ids say what the docstring says. The training run itself is the demo's to show."""

import numpy as np

from jaxgpu import _demo


def test_examples_are_sorted_digits():
  rng = np.random.default_rng(0)
  for _ in range(50):
    prompt, answer = _demo.example(rng)
    assert prompt[-1] == _demo.SEP and answer[-1] == _demo.END
    digits = [t - _demo.DIGIT0 for t in prompt[:-1]]
    assert _demo.MIN_DIGITS <= len(digits) <= _demo.MAX_DIGITS
    assert [t - _demo.DIGIT0 for t in answer[:-1]] == sorted(digits)


def test_packed_rows():
  b = {k: np.asarray(v) for k, v in _demo.batch(np.random.default_rng(1), 4, 64).items()}
  for r in range(4):
    seg, pos, tok, tgt, mask = (b[k][r] for k in ("segment_ids", "positions", "tokens",
                                                   "targets", "mask"))
    n = int(np.count_nonzero(seg))
    assert n > 0 and np.all(seg[:n] > 0) and np.all(seg[n:] == 0)  # padding only at the end
    assert np.all(tok[n:] == _demo.PAD) and not mask[n:].any()
    for s in np.unique(seg[:n]):
      idx = np.flatnonzero(seg == s)
      assert np.array_equal(pos[idx], np.arange(len(idx)))  # positions restart per example
      ex = tok[idx]
      sep = int(np.flatnonzero(ex == _demo.SEP)[0])
      # the loss covers exactly the answer: predicted from SEP up to the token before END
      assert np.array_equal(np.flatnonzero(mask[idx]), np.arange(sep, len(idx) - 1))
      assert np.array_equal(tgt[idx][:-1], ex[1:])
      assert ex[-1] == _demo.END
      assert sorted(ex[:sep]) == list(ex[sep + 1:-1])


def test_text():
  assert _demo.text([_demo.DIGIT0 + 3, _demo.DIGIT0 + 1, _demo.SEP, _demo.DIGIT0 + 1,
                     _demo.DIGIT0 + 3, _demo.END, _demo.PAD]) == "3 1 > 1 3 |"
