"""What ranks display reaches a real notebook as ordinary outputs (nbclient, a real kernel, 2 ranks).

The notebook is executed as JupyterLab would run it and the outputs are read from the saved
notebook: what a reader, nbval and the documentation site see without a kernel.
"""

import base64

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.lab

# A cluster's environment often chooses Agg, which would make plt.show() on a rank silently do nothing.
START = ("import os\nos.environ['MPLBACKEND'] = 'Agg'\n"
         "%load_ext labkit\n%lab start 2 --backend gloo --threads 1 --timeout 60")

CELLS = {
    "plot": "%%lab\nimport matplotlib.pyplot as plt\nplt.plot([0, 1, rank])\nplt.title(f'rank {rank}')\nplt.show()",
    "html": "%%lab\nfrom IPython.display import HTML, display\ndisplay(HTML(f'<b>shown by {rank}</b>'))\n"
            "HTML(f'<i>value of {rank}</i>')",
    "alike": "%%lab\nprint('the same on every rank')\nprint('rank', rank)\nprint('done')",
    "tqdm": "%%lab\nfrom tqdm import tqdm\nimport time\nfor _ in tqdm(range(40), mininterval=0):\n    time.sleep(0.005)",
    "update": "%%lab\nfrom IPython.display import display, clear_output, HTML\nprint('gone')\nclear_output()\n"
              "handle = display(HTML('first'), display_id=True)\nprint('kept', rank)\nhandle.update(HTML(f'updated {rank}'))",
    "huge": "%%lab\nfrom IPython.display import display, Image\nimport os\n"
            "display(Image(data=b'\\x89PNG\\r\\n\\x1a\\n' + os.urandom(12_000_000), format='png'))\nprint('after')",
    "tabs": "%%lab --view tabs\nprint('page of', rank)\nfrom IPython.display import HTML\nHTML(f'<u>{rank}</u>')",
    "auto on": "%lab auto",
    "auto cell": "x_auto = 10 + rank\nprint('auto', x_auto)",
    "auto off": "%lab auto off",
    "here": "print('in the notebook')",
    "stop": "%lab stop",
}


@pytest.fixture(scope="module")
def outputs():
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(START)] + [nbformat.v4.new_code_cell(code) for code in CELLS.values()]
    NotebookClient(notebook, timeout=180, kernel_name="python3").execute()
    return {name: cell.outputs for name, cell in zip(CELLS, notebook.cells[1:])}


def _streams(outputs, name="stdout"):
    return "".join(out["text"] for out in outputs if out["output_type"] == "stream" and out["name"] == name)


def _data(outputs, kind):
    return [out["data"][kind] for out in outputs if out["output_type"] in ("display_data", "execute_result")
            and kind in out.get("data", {})]


def test_a_plot_shown_on_each_rank_is_one_png_per_rank_under_its_label(outputs):
    pngs = _data(outputs["plot"], "image/png")
    assert len(pngs) == 2 and pngs[0] != pngs[1]  # each rank's own figure
    assert all(base64.b64decode(png).startswith(b"\x89PNG") for png in pngs)
    assert _streams(outputs["plot"]).splitlines() == ["[rank 0]", "[rank 1]"]


def test_html_displays_and_an_html_value_are_stored_as_html_per_rank(outputs):
    html = _data(outputs["html"], "text/html")
    # Both differ from rank to rank: each rank's display, then its value, rank by rank.
    assert html == ["<b>shown by 0</b>", "<i>value of 0</i>", "<b>shown by 1</b>", "<i>value of 1</i>"]
    assert "[rank 0] Out: <IPython.core.display.HTML object>" in _streams(outputs["html"])


def test_what_ranks_print_alike_is_shown_once(outputs):
    assert _streams(outputs["alike"]) == ("[ranks 0-1] the same on every rank\n[rank 0] rank 0\n[rank 1] rank 1\n"
                                          "[ranks 0-1] done\n")


def test_a_progress_bar_ends_as_each_ranks_final_state_once(outputs):
    text = _streams(outputs["tqdm"], "stderr")
    finals = [line for line in text.splitlines() if "40/40" in line]
    assert len(finals) in (1, 2), text  # one line per rank, or one for both when they ended alike
    assert {"0", "1"} <= set(finals[0].split("]")[0]) or len(finals) == 2
    assert "\r" not in text and " 0/40" not in text


def test_clear_output_and_display_updates_leave_the_final_state(outputs):
    assert _data(outputs["update"], "text/html") == ["updated 0", "updated 1"]
    text = _streams(outputs["update"])
    assert "gone" not in text and "[rank 0] kept 0" in text and "[rank 1] kept 1" in text


def test_an_oversized_display_is_a_note_not_a_frozen_browser(outputs):
    assert _data(outputs["huge"], "image/png") == []
    text = _streams(outputs["huge"])
    assert "was not shown: over the 8.4 MB one output may take" in text
    assert "[ranks 0-1] after" in text


def test_the_tabs_view_is_one_html_page_per_rank_with_a_text_form(outputs):
    html = _data(outputs["tabs"], "text/html")
    assert len(html) == 1
    page = html[0]
    assert "rank 0</label>" in page and "rank 1</label>" in page and "<u>0</u>" in page and "<u>1</u>" in page
    assert page.index("page of 0") < page.index("page of 1")
    page_output = [out for out in outputs["tabs"] if "text/html" in out.get("data", {})][0]
    assert page_output["data"]["text/plain"].startswith("[rank 0] page of 0")  # what a terminal and nbval read


def test_auto_mode_runs_plain_cells_on_the_ranks_and_says_so(outputs):
    text = _streams(outputs["auto cell"])
    assert text.splitlines() == ["%lab auto: on ranks 0-1", "[rank 0] auto 10", "[rank 1] auto 11"]
    assert _streams(outputs["here"]) == "in the notebook\n"
