"""On a rank: the trainable of a run, and the user's own model, data and loss built from what the notebook sent.

A run of a catalog model needs nothing sent: its declaration is installed
(``torch_support.trainable.declared_trainable``). A user's own (``spec.own_model``)
arrives packed as ``lab.push`` packs values (``runs.own_model``): the names their
code reads from the notebook (modules, helper functions and classes, constants)
go into the rank's namespace, as a push would put them, so their methods find
them when they run; the model factory, the data, the loss and the split options
are built beside it, not into it.

The last one built is kept (``RankContext.own_built``), keyed by what was sent:
a continuation, a checkpoint's load or the next run of the same model does not
unpickle the data again.
"""

from __future__ import annotations

import linecache

from labkit.rank.context import RankContext
from labkit.rank.push import build_all
from labkit.spec.train_config import TrainConfig
from labkit.torch_support.trainable import OwnTrainable, Trainable, declared_trainable

# The names the notebook packs the parts under (runs.own_model): built, never put into the namespace.
MODEL, DATA, LOSS, OPTIONS = "labkit_model", "labkit_data", "labkit_loss", "labkit_options"
PARTS = (MODEL, DATA, LOSS, OPTIONS)


def trainable_for(config: TrainConfig, context: RankContext) -> Trainable:
    """What ``config``'s run trains on this rank."""
    own = config.own
    if own is None:
        return declared_trainable(config)
    show_cells(own.sources)
    built = context.own_built
    if built is None or built[0] != own.fingerprint:
        context.own_built = None  # the old model's data goes before the new one is unpickled
        built = (own.fingerprint, _build(own.items, getattr(context, "namespace", None)))
        context.own_built = built
    parts = built[1]
    return OwnTrainable(own.name, parts[MODEL], parts[DATA], parts[LOSS], config.seed, parts[OPTIONS],
                        tokens=own.tokens_per_sample, meta=own.meta_build, loss_name=own.loss_name)


def show_cells(sources: dict) -> None:
    """Keep the lines of the notebook cells the user's code was written in ({cell name: lines}) where tracebacks
    read lines, so an error in their ``forward`` or loss shows its line, as a ``%%lab`` cell's does. Kept with no
    modification time: ``linecache.checkcache`` leaves such entries be."""
    for filename, lines in sources.items():
        linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)


def _build(items: tuple[dict, ...], namespace: dict | None) -> dict:
    """Build every item (in the order packed); the user's names go into ``namespace``, the parts are returned."""
    namespace = {} if namespace is None else namespace  # a torchrun process has no namespace of cells
    staged = build_all(items, namespace)
    namespace.update({name: value for name, value in staged.items() if name not in PARTS})
    return {name: staged.get(name) for name in PARTS}
