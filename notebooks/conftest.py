"""nbval settings for the workshop notebooks.

Widget views, HTML and pictures are not compared: widgets carry random model ids,
every HTML output here (mesh pictures, status tables) has a text/plain twin that
is, and pictures of timings (dashboards, timelines, benchmarks) differ every run.
"""


def pytest_collectstart(collector):
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += (
            "application/vnd.jupyter.widget-view+json",
            "text/html",
            "image/png",
        )


def pytest_collection_modifyitems(items):
    # Every notebook starts real ranks: `-m "not lab"` (the fast path) leaves them out.
    import pytest

    for item in items:
        if item.fspath.ext == ".ipynb":
            item.add_marker(pytest.mark.lab)
