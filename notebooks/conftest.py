"""nbval settings for the workshop notebooks.

Widget views and HTML are not compared: widgets carry random model ids, and every
HTML output here (mesh pictures, status tables) has a text/plain twin that is.
"""


def pytest_collectstart(collector):
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += (
            "application/vnd.jupyter.widget-view+json",
            "text/html",
        )
