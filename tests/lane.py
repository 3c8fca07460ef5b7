"""Which lane this pytest run is: the quick lane, ``python -m pytest -m "not slow"``, or the full
suite (CI). tests/conftest.py sets :data:`QUICK` when pytest is configured, before any test
module is imported, so a Hypothesis ``@settings`` can size itself with :func:`examples`.
"""

QUICK = False  # the mark expression deselects the tests marked slow


def examples(full: int, quick: int) -> int:
    """A property's Hypothesis example count: ``full`` in the full suite, ``quick`` in the quick
    lane (the same property on fewer examples, so that every area keeps a property test there)."""
    return quick if QUICK else full
