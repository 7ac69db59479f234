"""One outbound HTTPS line between a machine behind NAT and the notebook's host.

A machine that joins with ``python -m labkit join <https token>`` opens one TLS
websocket out to the lab's hub (``hub_server``) and nothing else: every byte its
engines and ranks exchange with the notebook's host travels as frames of that one
connection (``frames``, ``session``), which survives short drops (replayed, not
lost) and is opened again after long ones (``agent_link``). ``token`` is what the
join line carries, ``tls`` the hub's certificate and how a joining machine checks
it; DiLoCo's outer sync frames its messages with ``wire.sync_messages``.

Nothing here imports torch or starts a rank: the cluster (``cluster.site_agent``,
``cluster.site_cluster``) and the runs (``runs.site_diloco``) build on it.
"""
