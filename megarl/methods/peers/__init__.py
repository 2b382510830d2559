"""Method family: the peers' objective catalogue (verl's core_algos), as plugins.

Importing this package registers the policy losses ``gpg``, ``gmpo``, ``clip_cov``, ``kl_cov``,
``bypass_reinforce`` and the advantage estimator ``gpg``. Formulas: reference/peers.py; docs:
docs/methods/{gpg,gmpo,clip-cov,kl-cov,bypass}.md.
"""

from megarl.methods.peers import bypass, cov, gmpo, gpg  # noqa: F401
