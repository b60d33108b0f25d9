"""Every public op's contract spec (tests/contract.py), one module per family.

tests/specs/<family>.py holds the family's float64 oracle and low-precision reference,
its argument makers and the `SPECS` of its ops; tests/test_<family>.py imports them for its
numerics. A new family (jaxgpu._family.FAMILY_NAMES) adds its module here.
"""

from __future__ import annotations

import importlib

from jaxgpu import _family

# {public op name: OpSpec}, in family order.
SPECS = {spec.name: spec for name in _family.FAMILY_NAMES
         for spec in importlib.import_module(f"specs.{name}").SPECS}
