"""Method family 1: trust regions, clipping and regularisers.

Importing this package registers the policy losses ``output_reset``, ``gapo``, ``estr``,
``sao_clip``, ``eppo`` and the regulariser ``cokl``. Formulas: reference/trust_regions.py;
docs: docs/methods/{output-reset,cokl,gapo,estr,sao,eppo}.md.
"""

from megarl.methods.trust_regions import cokl, eppo, estr, gapo, output_reset, sao  # noqa: F401
