"""Ranks' output as HTML: the live view while work runs, and one page per rank (``--view tabs|grid``).

The live view of a cell is one display redrawn in place; when a rank has shown a plot or a
table, its HTML form shows them among the lines (an image inline, HTML as it is), so a loop that
redraws a figure is seen redrawn while it runs. The per-rank views put each rank's whole output
on a page of its own: ``tabs`` (one rank at a time, picked by its tab; pure HTML and CSS, so a
saved notebook and the documentation show it without a kernel, and where styles are stripped the
pages simply stand one under the other, each headed by its rank) or ``grid`` (the ranks side by
side, a column each).
"""

from __future__ import annotations

import hashlib
import html
import json

from labkit.views.rank_blocks import Block, rank_label
from labkit.views.rank_items import PLAIN, Item, Shown, Value, item_text

VIEWS = ("tabs", "grid")
_IMAGES = ("image/png", "image/jpeg", "image/gif")
_PRE = "margin:0;white-space:pre-wrap;font-family:var(--jp-code-font-family,monospace)"


def bundle_html(data: dict) -> str:
    """The richest form of a MIME bundle that a page can hold, as HTML."""
    if "text/html" in data:
        return str(data["text/html"])
    if "image/svg+xml" in data:
        return str(data["image/svg+xml"])
    for kind in _IMAGES:
        if kind in data:
            return f'<img src="data:{kind};base64,{data[kind]}" style="max-width:100%">'
    for kind in ("text/markdown", "text/latex"):
        if kind in data:
            return f'<pre style="{_PRE}">{html.escape(str(data[kind]))}</pre>'
    if "application/json" in data:
        return f'<pre style="{_PRE}">{html.escape(json.dumps(data["application/json"], indent=1))}</pre>'
    return f'<pre style="{_PRE}">{html.escape(str(data.get(PLAIN, "")))}</pre>'


def _items_html(items: list[Item], label: str = "") -> str:
    """Items as HTML: runs of text lines in one <pre>, displays in their richest form."""
    parts: list[str] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            parts.append(f'<pre style="{_PRE}">{html.escape(chr(10).join(text))}</pre>')
            text.clear()

    prefix = f"{label} " if label else ""
    for item in items:
        rich = item.rich if isinstance(item, Value) else item.data if isinstance(item, Shown) and item.rich else None
        if not rich:
            text.extend(prefix + line for line in item_text(item))
            continue
        if label:  # the rich form stands under its label (a rank's own page needs none)
            text.append(f"{label} Out:" if isinstance(item, Value) else label)
        flush()
        parts.append(f"<div>{bundle_html(rich)}</div>")
    flush()
    return "".join(parts)


def blocks_html(blocks: list[Block], errors: list[Block], note: str = "") -> str:
    """The live view: every block with its label, stderr after, the note last."""
    body = "".join(_items_html(run, rank_label(ranks)) for ranks, run in blocks)
    body += "".join(_items_html(run, rank_label(ranks, "stderr")) for ranks, run in errors)
    if note:
        body += f'<pre style="{_PRE}">labkit: {html.escape(note)}</pre>'
    return f"<div>{body}</div>"


def _page(items: list[Item], errors: list[str]) -> str:
    page = _items_html(items)
    if errors:
        page += f'<pre style="{_PRE};color:#b22">{html.escape(chr(10).join(errors))}</pre>'
    return page or f'<pre style="{_PRE};opacity:.6">(no output)</pre>'


def ranks_view_html(items: dict[int, list[Item]], errors: dict[int, list[str]], view: str) -> str:
    """Each rank's output on a page of its own: ``tabs`` or ``grid`` (see the module's docstring)."""
    ranks = sorted(items)
    pages = {rank: _page(items[rank], errors.get(rank, [])) for rank in ranks}
    if view == "grid":
        heads = "".join(f'<th style="text-align:left;padding:2px 8px">rank {rank}</th>' for rank in ranks)
        cells = "".join(f'<td style="vertical-align:top;padding:2px 8px;min-width:12em">{pages[rank]}</td>'
                        for rank in ranks)
        return f'<table style="border-collapse:collapse"><tr>{heads}</tr><tr>{cells}</tr></table>'
    # Tabs: radio inputs and CSS only (no script), named after the content so a saved notebook is stable.
    name = "labkit-" + hashlib.sha1("".join(pages.values()).encode()).hexdigest()[:10]
    style = [f"#{name} > .pages > div{{display:none}}", f"#{name} input{{display:none}}",
             f"#{name} label{{padding:2px 10px;border:1px solid #bbb;border-bottom:none;cursor:pointer;"
             "margin-right:2px;display:inline-block}"]
    tabs, panes = [], []
    for index, rank in enumerate(ranks):
        tab = f"{name}-{rank}"
        style += [f"#{tab}:checked ~ .pages > .p{rank}{{display:block}}",
                  f"#{name} #{tab}:checked + label{{background:#e8e8e8;font-weight:bold}}"]
        checked = " checked" if index == 0 else ""
        tabs.append(f'<input type="radio" name="{name}" id="{tab}"{checked}><label for="{tab}">rank {rank}</label>')
        panes.append(f'<div class="p{rank}"><b class="labkit-head">rank {rank}</b>{pages[rank]}</div>')
    style.append(f"#{name} .labkit-head{{display:none}}")
    return (f'<div id="{name}"><style>{"".join(style)}</style>{"".join(tabs)}'
            f'<div class="pages" style="border-top:1px solid #bbb;padding-top:4px">{"".join(panes)}</div></div>')
