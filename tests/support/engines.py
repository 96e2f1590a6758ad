"""An engine or framework the tests import: a skip where it is not installed, a failure where CI
installed it (``REFITD_REQUIRE_ENGINES=1``: make test-engines, test-sglang, test-verl, test-live), so a
broken engine venv fails its target rather than skipping every test in it."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRE = "REFITD_REQUIRE_ENGINES"


def missing(what: str, hint: str, exc: BaseException) -> NoReturn:
    """An import failed (``what``: "vLLM does not import"): fail under REFITD_REQUIRE_ENGINES=1, else
    skip with ``hint`` (the make target that installs it)."""
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{REQUIRE}=1 but {what}: {exc}")
    pytest.skip(f"{hint} ({exc})")
