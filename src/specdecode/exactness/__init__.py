"""Exactness checks: the sampled chi-square test of ``specdecode check-exact`` (``check``) and the exact laws of
the first tokens by enumeration (``enumeration``)."""
