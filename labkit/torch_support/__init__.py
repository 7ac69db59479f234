"""torch-side building blocks the strategies and the rank runtime share.

- ``torch_internals``: every use of torch's private distributed API, in one place;
- ``host_staging``: pinned host buffers that copy batches to a GPU without stalls;
- ``optimizers``: the optimizer a run builds over what a rank holds.

Rank side only (these import torch); they know nothing of labkit's other packages.
"""
