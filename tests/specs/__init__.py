"""Every public op's contract spec (tests/contract.py), one module per family.

tests/specs/<family>.py holds the family's float64 oracle and low-precision reference,
its argument makers and `SPECS`, one OpSpec per op; tests/test_<family>.py imports them for
its numerics. An op may have several specs (variants: the decode ops' 8-bit cache). A new
family (a name in jaxgpu._family.FAMILY_NAMES) adds its module, a new
op its OpSpec: test_contract.py then runs every contract case on it, and
test_every_op_has_a_spec fails until every declared op has one.
"""

from __future__ import annotations

import importlib

from jaxgpu import _family

# {spec id: OpSpec}, in family order: the public op's name, with [variant] for an op's
# variants that have specs of their own (OpSpec.variant).
SPECS = {spec.id: spec for name in _family.FAMILY_NAMES
         for spec in importlib.import_module(f"specs.{name}").SPECS}
