"""Every public op's contract spec (tests/contract.py), one module per family.

tests/specs/<family>.py holds the family's float64 oracle and low-precision reference,
its argument makers and `SPECS`, one OpSpec per op; tests/test_<family>.py imports them for
its numerics. A new family (a name in jaxgpu._family.FAMILY_NAMES) adds its module, a new
op its OpSpec: test_contract.py then runs every contract case on it, and
test_every_op_has_a_spec fails until every declared op has one.
"""

from __future__ import annotations

import importlib

from jaxgpu import _family

# {public op name: OpSpec}, in family order.
SPECS = {spec.name: spec for name in _family.FAMILY_NAMES
         for spec in importlib.import_module(f"specs.{name}").SPECS}
