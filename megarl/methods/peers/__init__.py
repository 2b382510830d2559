"""Method family: the peers' objective catalogue (verl's core_algos), as plugins.

Importing this package registers the policy losses ``gpg`` and ``gmpo`` and the advantage
estimator ``gpg``. Formulas: reference/peers.py; docs: docs/methods/{gpg,gmpo}.md.
"""

from megarl.methods.peers import gmpo, gpg  # noqa: F401
