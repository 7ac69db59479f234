"""Models: the ``Model`` protocol every strategy asks of one, the model catalog, and the lab's own two.

A model is one declaration (``catalog.ModelDeclaration``) found by an entry
point of the ``labkit.models`` group (``plugins``): the zoo's ``mlp`` and
``gpt`` (``mlp.py``, ``gpt.py``; their networks in ``mlp_network.py`` and
``gpt_network.py``), or an installed package's. Declarations and settings load
without torch; networks, data and losses are made on the ranks.
"""
