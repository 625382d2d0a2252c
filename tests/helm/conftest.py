"""Chart fixtures: the chart loaded once per session through the Helm v4 SDK."""

from __future__ import annotations

from collections.abc import Iterator

import helm_python as helm
import pytest

from tests.helm.support import render_tool


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(render_tool.CHART_DIR) as loaded:
        yield loaded
