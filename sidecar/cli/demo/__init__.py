"""`refitd demo`: a synthetic model through trainer ranks, the daemon and the reference engine."""
