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
