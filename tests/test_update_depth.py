"""How deep one traced call of accumulate's update goes into the library.

A contributor changing one behaviour holds in mind the functions a call passes
through. Counted as the distinct library functions entered (``sys.setprofile``)
while ``jax.jit(...).trace`` traces one ``update`` (``init`` outside the count),
the way ``optax.MultiSteps(...).update`` enters 7. The bounds are the ones a plain
call must stay within: options a call does not use add nothing to it.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import accum_jax

ROOT = os.path.dirname(accum_jax.__file__)


def _entered(fun, *args) -> set[tuple[str, str]]:
  seen: set[tuple[str, str]] = set()

  def profile(frame, event, arg):
    del arg
    if event == "call" and frame.f_code.co_filename.startswith(ROOT):
      seen.add((os.path.relpath(frame.f_code.co_filename, ROOT), frame.f_code.co_name))

  sys.setprofile(profile)
  try:
    jax.jit(fun).trace(*args)
  finally:
    sys.setprofile(None)
  return seen


@pytest.mark.parametrize("layout", ["packed", "tree"])
@pytest.mark.parametrize("apply, bound", [(False, 20), (True, 30)])
def test_a_plain_update_passes_through_a_handful_of_functions(apply, bound, layout):
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
  opt = accum_jax.accumulate(optax.adamw(1e-3), every_k=4, layout=layout)
  state = opt.init(params)
  entered = _entered(lambda g, s, p: opt.update(g, s, p, apply=apply), params, state, params)
  assert len(entered) <= bound, sorted(entered)
  # Options the call does not use are not entered: noise, weights, skip functions.
  assert not any("noise" in f or "_left_out" == name for f, name in entered), sorted(entered)
